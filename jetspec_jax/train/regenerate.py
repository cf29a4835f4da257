"""Regenerate chat responses with the target itself: the draft head learns the target's own outputs.

Each conversation's assistant turns (the first ``max_turns``) are replaced, in order, by the
target's response to the chat-templated conversation so far (thinking off by default); a
conversation that ends with a user message gets a response appended. The output directory holds
``chunk-{start:09d}-{end:09d}.jsonl`` files of ``{"index", "messages"}`` rows (``index``: position
in the source), each the regenerated source conversations ``[start, end)``, written to a temporary
name and renamed when complete, plus ``regenerate.json`` (the settings). A regenerated assistant
message keeps the ids the target generated (``token_ids``, EOS excluded) beside their text, and the
data module trains on those ids. A rerun with the same settings skips complete chunks, so an
interrupted run continues without losing or repeating rows; ``train.sources.read_jsonl(out_dir)``
reads the result.

In a multi-process job (``jetspec_jax.distributed.initialize``) every process runs the same
generation over the ``mesh`` (which spans every process's devices: the batch is split over them),
process 0 alone checks the settings, lists the complete chunks and writes files, and every process
sees its decisions and returns the same summary once the files are written.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import time
from typing import Sequence

import jax
from tqdm.auto import tqdm

from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.distributed import from_first_process
from jetspec_jax.errors import JetSpecError
from jetspec_jax.files import write_json, write_jsonl
from jetspec_jax.tokenizer import IM_END, PAD, load_tokenizer
from jetspec_jax.train.chat import ChatEncoder
from jetspec_jax.train.sources import Conversation, iter_conversations

MANIFEST = "regenerate.json"
CHUNK_RE = re.compile(r"^chunk-(\d{9})-(\d{9})\.jsonl$")


def chunk_name(start: int, end: int) -> str:
  return f"chunk-{start:09d}-{end:09d}.jsonl"


def turn_positions(messages: Conversation) -> list[int]:
  """Where responses go: each assistant message right after a user message, and the end when the
  conversation ends with a user message."""
  pos = [i for i in range(1, len(messages))
         if messages[i]["role"] == "assistant" and messages[i - 1]["role"] == "user"]
  return pos + ([len(messages)] if messages and messages[-1]["role"] == "user" else [])


def generate_batches(params, cfg, prompts: Sequence[Sequence[int]], *, batch_size: int, max_new_tokens: int,
                     eos_ids: tuple[int, ...], temperature: float, key: jax.Array, mesh=None, attn_impl="xla",
                     prefill_chunk: int | None = None, kv_memory: float | None = None, page_rows: int = 16,
                     on_batch=lambda tokens: None) -> list[list[int]]:
  """Generated ids (EOS included when hit) for each prompt: each its own AR generation.

  The prompts run through the continuous-batching engine (``decode.engine``) with ``batch_size`` slots (a
  multiple of the mesh's data axis): a finished response frees its slot for the next prompt at once.
  Prompt i of the length-sorted order samples with fold_in(fold_in(key, i // batch_size), i % batch_size),
  the key its row had in the static batches this replaced. Prompts are prefilled ``prefill_chunk`` rows per
  lane and round (default 64; 0: a whole prompt). ``kv_memory``: GiB of KV pages of ``page_rows`` rows the slots
  share (None: every slot's full context; a pool smaller than the load makes requests wait or be preempted, never
  changing a response). ``on_batch(generated_tokens)`` is called as responses finish.
  """
  from jetspec_jax.attention import cache_rows
  from jetspec_jax.decode.engine import Engine, Request, page_bytes
  data = 1 if mesh is None else mesh.shape["data"]
  pages = None
  if kv_memory is not None:
    size = page_bytes(cfg, None, page_rows, params["embed"].dtype)
    pages = int(kv_memory * (1 << 30) // size) // data * data
    if pages < data:
      raise JetSpecError(f"a KV memory of {kv_memory:g} GiB holds {pages} pages of {page_rows} rows ({size} bytes "
                         f"each); give at least {data * size / (1 << 30):.3g} GiB")
  slots = -(-batch_size // data) * data
  order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
  requests = [Request(list(prompts[i]), max_new_tokens,
                      key=jax.random.fold_in(jax.random.fold_in(key, n // batch_size), n % batch_size))
              for n, i in enumerate(order)]
  rows = cache_rows(max(len(p) for p in prompts)) if prefill_chunk == 0 else (prefill_chunk or 64)
  engine = Engine.for_requests(cfg, params, requests, slots=slots, groups=data, lanes=data,
                               prefill_rows=rows, eos_ids=eos_ids, mesh=mesh, attn_impl=attn_impl,
                               sampling_cfg=SamplingConfig(temperature=temperature), pages=pages,
                               page_rows=page_rows)
  engine.start()
  engine.submit(requests)
  out: list[list[int]] = [[] for _ in prompts]
  finished = 0
  while finished < len(requests):
    results = engine.step(SEGMENT_ROUNDS)
    for r in results:
      out[order[r.id]] = r.tokens
    finished += len(results)
    on_batch(sum(len(r.tokens) for r in results))
  return out


SEGMENT_ROUNDS = 64     # engine rounds between progress updates


@dataclasses.dataclass
class _Example:
  index: int
  source: Conversation
  turns: list[int]
  messages: Conversation = dataclasses.field(default_factory=list)   # regenerated so far
  done_upto: int = 0    # source messages consumed
  open: bool = True     # may take another turn


def _resolve_target(target, mesh, dtype=None):
  """(cfg, params, tokenizer) from a path (weights cast to ``dtype``; None: as stored) or a loaded
  ``(cfg, params, tokenizer or tokenizer dir)``."""
  if isinstance(target, (str, os.PathLike)):
    from jetspec_jax.convert import load_target
    cfg, params, side = load_target(os.fspath(target), dtype, mesh=mesh)
    return cfg, params, load_tokenizer(side)
  cfg, params, tokenizer = target
  return cfg, params, load_tokenizer(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer


def _open_output(out_dir: str, settings: dict) -> dict:
  """Check (or write) the manifest of ``out_dir`` and list its complete chunks: {"problem": None or what
  is wrong, "chunks": [[start, end, name], ...]}. Runs on process 0 only (see ``regenerate``)."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, MANIFEST)
  if os.path.isfile(path):
    with open(path) as f:
      stored = json.load(f)
    for key, value in settings.items():
      if stored.get(key) != value:
        return {"problem": f"{out_dir} was regenerated with {key}={stored.get(key)!r}, not {value!r}: "
                           f"rerun with the same settings or use a new output directory", "chunks": []}
  else:
    write_json(path, settings)
  return {"problem": None,
          "chunks": [[int(m[1]), int(m[2]), name] for name in os.listdir(out_dir) if (m := CHUNK_RE.match(name))]}


def regenerate(target, source: str, out_dir: str, *, max_new_tokens: int = 1024, batch_size: int = 32,
               temperature: float = 0.0, seed: int = 0, limit: int | None = None, chunk_size: int = 1024,
               max_turns: int = 1, enable_thinking: bool = False, max_prompt_tokens: int | None = None,
               mesh=None, dtype=None, attn_impl="xla", prefill_chunk: int | None = None,
               kv_memory: float | None = None, page_rows: int = 16, progress: bool = True) -> dict:
  """Replace the responses of ``source`` (see ``sources.iter_conversations``) by the target's own.

  ``target``: a target path (HF directory or converted checkpoint, tokenizer beside it) or a loaded
  ``(cfg, params, tokenizer)``. Up to ``limit`` source conversations are processed, ``chunk_size``
  per output file; prompts longer than ``max_prompt_tokens`` end a conversation (before its first
  turn: it is skipped), and so does a response cut at ``max_new_tokens``. Returns a summary of this
  run: examples written, skipped, truncated responses, chunks written / reused, tokens generated,
  seconds. ``dtype``, ``attn_impl``, ``prefill_chunk``: the target's weights and generation (``decode.engine``);
  prompts are prefilled ``prefill_chunk`` rows per round (default 64), memory-bounded at any length; the KV cache
  is ``kv_memory`` GiB of pages of ``page_rows`` rows (``generate_batches``).
  """
  if min(max_new_tokens, batch_size, chunk_size, max_turns) <= 0 or (limit is not None and limit <= 0):
    raise JetSpecError("max_new_tokens, batch_size, chunk_size, max_turns and limit must be positive")
  t0 = time.perf_counter()
  cfg, params, tokenizer = _resolve_target(target, mesh, dtype)
  if len(tokenizer) > cfg.vocab_size:
    raise JetSpecError(f"the tokenizer has {len(tokenizer)} tokens, more than the target's vocab_size {cfg.vocab_size}")
  encoder = ChatEncoder(tokenizer, enable_thinking)
  vocab = tokenizer.get_vocab()
  eos_ids = tuple(sorted(set(cfg.eos_token_ids) | {vocab[t] for t in (IM_END, PAD) if t in vocab}))
  settings = {"source": source if source == "sharegpt" else os.path.abspath(source), "chunk_size": chunk_size,
              "max_new_tokens": max_new_tokens, "temperature": float(temperature), "seed": seed,
              "max_turns": max_turns, "enable_thinking": enable_thinking, "max_prompt_tokens": max_prompt_tokens}
  conversations = itertools.islice(iter_conversations(source), limit)
  first = next(conversations, None)
  if first is None:
    raise JetSpecError(f"source {source} holds no conversations")
  conversations = itertools.chain([first], conversations)
  writer = jax.process_index() == 0
  output = from_first_process(_open_output(out_dir, settings) if writer else None)
  if output["problem"]:
    raise JetSpecError(output["problem"])
  existing = {start: (end, name) for start, end, name in output["chunks"]}

  summary = dict.fromkeys(("examples", "skipped", "truncated", "chunks_written", "chunks_reused", "tokens"), 0)
  bar = tqdm(total=limit, unit="conv", desc="regenerate", disable=not (progress and writer))

  def count(tokens: int) -> None:
    summary["tokens"] += tokens
    bar.set_postfix(tokens=summary["tokens"], refresh=False)

  for k, chunk in enumerate(iter(lambda: list(itertools.islice(conversations, chunk_size)), [])):
    start, end = k * chunk_size, k * chunk_size + len(chunk)
    old_end, old_name = existing.get(start, (None, None))
    if old_end is not None and old_end >= end:
      summary["chunks_reused"] += 1
      bar.update(len(chunk))
      continue
    if old_name and writer:   # a shorter chunk from a run with a smaller limit: redo it
      os.remove(os.path.join(out_dir, old_name))
    rows = _regenerate_chunk(params, cfg, encoder, chunk, start, summary, count, batch_size=batch_size,
                             max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=float(temperature),
                             key=jax.random.fold_in(jax.random.key(seed), k), max_turns=max_turns,
                             max_prompt_tokens=max_prompt_tokens, mesh=mesh, attn_impl=attn_impl,
                             prefill_chunk=prefill_chunk, kv_memory=kv_memory, page_rows=page_rows)
    if writer:
      write_jsonl(os.path.join(out_dir, chunk_name(start, end)), rows)
    summary["examples"] += len(rows)
    summary["chunks_written"] += 1
    bar.update(len(chunk))
  bar.close()
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("jetspec_regenerated")   # no process returns before the files exist
  return {**summary, "out_dir": os.path.abspath(out_dir), "seconds": time.perf_counter() - t0}


def _regenerate_chunk(params, cfg, encoder: ChatEncoder, chunk: list[Conversation], start: int, summary: dict,
                      count, *, batch_size, max_new_tokens, eos_ids, temperature, key, max_turns,
                      max_prompt_tokens, mesh, attn_impl, prefill_chunk, kv_memory, page_rows) -> list[dict]:
  """Rows ``{"index", "messages"}`` for ``chunk`` (source positions ``start, start + 1, ...``); turn t
  samples with ``fold_in(key, t)``."""
  examples = [_Example(start + j, c, turn_positions(c)[:max_turns]) for j, c in enumerate(chunk)]
  for t in range(max_turns):
    jobs = []
    for ex in examples:
      if not ex.open or len(ex.turns) <= t:
        continue
      context = ex.messages + ex.source[ex.done_upto:ex.turns[t]]
      ids = encoder.prompt_ids(context)
      if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        ex.open = False
        continue
      jobs.append((ex, context, ids))
    if not jobs:
      break
    outputs = generate_batches(params, cfg, [ids for _, _, ids in jobs], batch_size=batch_size,
                               max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=temperature,
                               key=jax.random.fold_in(key, t), mesh=mesh, attn_impl=attn_impl,
                               prefill_chunk=prefill_chunk, kv_memory=kv_memory, page_rows=page_rows,
                               on_batch=count)
    for (ex, context, _), ids in zip(jobs, outputs):
      finished = bool(ids) and ids[-1] in eos_ids
      response = ids[:-1] if finished else ids
      text = encoder.tokenizer.decode(response, skip_special_tokens=False)
      ex.messages = context + [{"role": "assistant", "content": text, "token_ids": response}]
      ex.done_upto = ex.turns[t] + 1
      ex.open = finished
      summary["truncated"] += int(not finished)
  rows = [{"index": ex.index, "messages": ex.messages} for ex in examples if ex.messages]
  summary["skipped"] += len(examples) - len(rows)
  return rows

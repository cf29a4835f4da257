"""Regenerating responses with a tiny random target: exactly-once chunks across interruptions, and
responses equal to the target's own greedy generation."""
import glob
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax import tokenizer as tok_lib
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.reference import greedy
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import qwen3
from jetspec_jax.train import regenerate as regen
from jetspec_jax.train.chat import ChatEncoder
from jetspec_jax.train.records import prepare_dataset

MAX_NEW = 6
WORDS = "the cat dog sat on a mat and ran to why how is you we answer 1 2 3 , . ?".split()


def sentence(rng) -> str:
  return " ".join(rng.choice(WORDS, size=rng.integers(2, 9)))


def source_conversations() -> list[list[dict]]:
  """10 conversations: single turns, two-turn ones (0, 4, 8), a prompt-only one (5), one with no
  user message before its assistant message (7: skipped), one with a system message (2)."""
  rng = np.random.default_rng(0)
  out = []
  for i in range(10):
    msgs = [{"role": "user", "content": f"{i} {sentence(rng)}"}, {"role": "assistant", "content": sentence(rng)}]
    if i % 4 == 0:
      msgs += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
    out.append(msgs)
  out[2].insert(0, {"role": "system", "content": "be brief"})
  out[5] = out[5][:1]
  out[7] = [{"role": "assistant", "content": "hello"}]
  return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  rng = np.random.default_rng(1)
  d = tok_lib.train_chat_tokenizer([sentence(rng) for _ in range(300)], 400, str(tmp_path_factory.mktemp("tok")))
  return tok_lib.load_tokenizer(d)


@pytest.fixture(scope="module")
def target(tok):
  """(cfg, params): a random target whose extra EOS id is a token its greedy first response to
  conversation 0 emits third, so that turn ends early and conversation 0 gets a second turn."""
  cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0)
  rng = np.random.default_rng(1)   # std 0.3 (not init_target's 0.02) so greedy text is not one repeated token
  params = {name: jnp.asarray(1.0 + 0.2 * rng.standard_normal(spec.shape) if spec.axes == ("norm",)
                              else 0.3 * rng.standard_normal(spec.shape), jnp.float32)
            for name, spec in qwen3.param_specs(cfg).items()}
  prompt = ChatEncoder(tok).prompt_ids(source_conversations()[0][:1])
  first = greedy(cfg, params, prompt, MAX_NEW)
  return Qwen3Config(**{**cfg.__dict__, "eos_token_ids": (first[2],)}), params


def _runs(mask):
  """(starts, ends) of the runs of ones in a 0/1 mask."""
  edges = np.diff(np.concatenate([[0], mask, [0]]))
  return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def read_rows(out_dir) -> list[dict]:
  return [json.loads(line) for f in sorted(glob.glob(os.path.join(out_dir, "*.jsonl"))) for line in open(f)]


def test_regenerate_resumes_exactly_once_and_matches_greedy(tmp_path, tok, target, monkeypatch):
  cfg, params = target
  source = str(tmp_path / "src.jsonl")
  convs = source_conversations()
  with open(source, "w") as f:
    f.writelines(json.dumps({"messages": c}) + "\n" for c in convs)
  out = str(tmp_path / "regen")
  kw = dict(max_new_tokens=MAX_NEW, batch_size=3, chunk_size=4, max_turns=2, progress=False)

  first = regen.regenerate((cfg, params, tok), source, out, limit=5, **kw)
  assert sorted(os.listdir(out)) == ["chunk-000000000-000000004.jsonl", "chunk-000000004-000000005.jsonl",
                                     "regenerate.json"]
  assert first["examples"] == 5 and first["chunks_written"] == 2

  # Second run: crash after its first new chunk ([4, 8), which replaces the short [4, 5)).
  real_write = regen.write_jsonl

  def write_once(path, rows):
    real_write(path, rows)
    monkeypatch.setattr(regen, "write_jsonl", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))

  monkeypatch.setattr(regen, "write_jsonl", write_once)
  with pytest.raises(KeyboardInterrupt):
    regen.regenerate((cfg, params, tok), source, out, **kw)
  assert sorted(f for f in os.listdir(out) if f.endswith(".jsonl")) == [
      "chunk-000000000-000000004.jsonl", "chunk-000000004-000000008.jsonl"]
  monkeypatch.setattr(regen, "write_jsonl", real_write)

  last = regen.regenerate((cfg, params, tok), source, out, **kw)
  assert last["chunks_reused"] == 2 and last["chunks_written"] == 1 and last["examples"] == 2
  assert not [f for f in os.listdir(out) if f.startswith(".")]

  rows = read_rows(out)
  assert [r["index"] for r in rows] == [0, 1, 2, 3, 4, 5, 6, 8, 9]   # each once; 7 has no user prompt
  enc = ChatEncoder(tok)
  eos = tuple(sorted({*cfg.eos_token_ids, tok.eos_token_id, tok.pad_token_id}))
  prompts, contents = [], []
  for r in rows:
    src, msgs = convs[r["index"]], r["messages"]
    assert [m["role"] for m in msgs[:-1]] == [m["role"] for m in src[:len(msgs) - 1]]
    assert [m["content"] for m in msgs if m["role"] != "assistant"] == [
        m["content"] for m in src[:len(msgs)] if m["role"] != "assistant"]
    for i, m in enumerate(msgs):
      if m["role"] == "assistant":
        prompts.append(enc.prompt_ids(msgs[:i]))
        contents.append(m["content"])
  reference = [greedy(cfg, params, p, MAX_NEW, eos) for p in prompts]
  generated = [m["token_ids"] for r in rows for m in r["messages"] if m["role"] == "assistant"]
  for ids, content, kept in zip(reference, contents, generated):
    assert kept == (ids[:-1] if ids[-1] in eos else ids) and content == tok.decode(kept)
  # Training rows hold exactly the generated ids (a random target's ids are often not the
  # tokenizer's own segmentation of their text), each response closed by <|im_end|>. (Precondition of
  # this random target: no response holds a think tag, which the chat template would rewrite.)
  think = {tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")}
  assert not any(think & set(kept) for kept in generated)
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  responses = []
  for r in rows:
    ids, mask = enc.encode(r["messages"])
    responses += [ids[a:b].tolist() for a, b in zip(*_runs(mask))]
  assert responses == [kept + [im_end] for kept in generated]
  assert any(tok(tok.decode(kept), add_special_tokens=False)["input_ids"] != kept for kept in generated)
  # A second turn follows only a response that ended with EOS; conversation 0 has one.
  assert len(read_rows(out)[0]["messages"]) == 4
  assert any(len(ids) == MAX_NEW and ids[-1] not in eos for ids in reference)

  # The output is a dataset the data module reads.
  prepared = prepare_dataset(out, tok, str(tmp_path / "tfds"), seq_len=128)
  assert len(prepared) == len(rows)


def test_regenerate_checks_its_inputs(tmp_path, tok, target):
  cfg, params = target
  source = tmp_path / "src.jsonl"
  source.write_text(json.dumps({"messages": [{"role": "user", "content": "the cat"}]}) + "\n")
  out = str(tmp_path / "regen")
  kw = dict(max_new_tokens=MAX_NEW, batch_size=3, progress=False)   # the shapes the test above compiled
  summary = regen.regenerate((cfg, params, tok), str(source), out, **kw)
  assert summary["examples"] == 1 and 1 <= summary["tokens"] <= MAX_NEW
  with pytest.raises(JetSpecError, match="max_turns=1, not 2"):
    regen.regenerate((cfg, params, tok), str(source), out, **kw, max_turns=2)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(JetSpecError, match="no conversations"):
    regen.regenerate((cfg, params, tok), str(empty), str(tmp_path / "e"), progress=False)
  small = Qwen3Config(**{**cfg.__dict__, "vocab_size": len(tok) - 1})
  with pytest.raises(JetSpecError, match="vocab_size"):
    regen.regenerate((small, params, tok), str(source), str(tmp_path / "s"), progress=False)


def test_regenerate_from_a_target_directory(tmp_path, tok):
  """A Hugging Face directory with the tokenizer saved beside the weights (the real-use layout)."""
  import hf_fixtures
  model_dir = str(tmp_path / "target")
  hf_fixtures.save_model(hf_fixtures.build_model(hf_fixtures.hf_config("dense_tied", vocab_size=len(tok))), model_dir)
  tok.save_pretrained(model_dir)
  source = tmp_path / "src.jsonl"
  source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in source_conversations()[:2]))
  summary = regen.regenerate(model_dir, str(source), str(tmp_path / "regen"), max_new_tokens=MAX_NEW, batch_size=3,
                             progress=False)
  rows = read_rows(tmp_path / "regen")
  assert summary["examples"] == 2 and [r["index"] for r in rows] == [0, 1]
  assert all(r["messages"][-1]["role"] == "assistant" for r in rows)


def test_two_processes_regenerate_what_one_does(tmp_path, tok):
  """`jetspec-jax regenerate` under launch/local.sh, 2 processes x 8 CPU devices (two 8-GPU hosts): the batch
  is split over all 16 devices, process 0 alone writes, and the rows equal one process's with 16 devices. A
  rerun reuses the chunks; changed settings are refused by every process."""
  import subprocess
  import sys

  import hf_fixtures
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  model_dir = str(tmp_path / "target")
  hf_fixtures.save_model(hf_fixtures.build_model(hf_fixtures.hf_config("dense_tied", vocab_size=len(tok))), model_dir)
  tok.save_pretrained(model_dir)
  source = tmp_path / "src.jsonl"
  source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in source_conversations()))
  env = dict(os.environ, PYTHONPATH=repo, JETSPEC_KILL_GRACE="5")
  # launch/local.sh replaces XLA_FLAGS' device count per process and keeps the rest (scripts/test.sh's -O0)

  def launch(processes, devices, out, *extra):
    cmd = ["bash", os.path.join(repo, "launch", "local.sh"), "-n", str(processes), "--cpu-devices", str(devices), "--",
           sys.executable, "-m", "jetspec_jax.cli", "regenerate", "--target", model_dir, "--source", str(source),
           "--out-dir", str(tmp_path / out), "--max-new-tokens", str(MAX_NEW), "--batch-size", "16", "--json", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

  def summaries(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines() if "{" in line]

  single, = summaries(launch(1, 16, "one", "--mesh", "16x1"))
  first = summaries(launch(2, 8, "two"))
  assert len(first) == 2 and first[0]["processes"] == 2 and first[0]["settings"]["mesh"] == single["settings"]["mesh"] == {"data": 16, "model": 1}
  for s in first:
    assert {k: s[k] for k in ("examples", "skipped", "truncated", "tokens", "chunks_written")} == \
        {k: single[k] for k in ("examples", "skipped", "truncated", "tokens", "chunks_written")}
  assert read_rows(tmp_path / "two") == read_rows(tmp_path / "one")
  assert sorted(os.listdir(tmp_path / "two")) == sorted(os.listdir(tmp_path / "one"))   # no temporary files left
  again = summaries(launch(2, 8, "two"))
  assert [(s["chunks_reused"], s["chunks_written"]) for s in again] == [(1, 0), (1, 0)]
  refused = launch(2, 8, "two", "--temperature", "0.5")
  assert refused.returncode == 2 and refused.stderr.count("temperature=0.0, not 0.5") == 2, refused.stderr[-2000:]


def test_regenerate_cli_takes_the_generation_settings(tmp_path, tok, capsys):
  """`jetspec-jax regenerate` exposes what it generates with (dtype, attention, prompt limit, prefill chunk)
  and reports it; a chunked prefill writes the same rows as one forward."""
  import hf_fixtures
  from jetspec_jax import cli
  model_dir = str(tmp_path / "target")
  hf_fixtures.save_model(hf_fixtures.build_model(hf_fixtures.hf_config("dense_tied", vocab_size=len(tok))), model_dir)
  tok.save_pretrained(model_dir)
  source = tmp_path / "src.jsonl"
  source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in source_conversations()))
  base = ["regenerate", "--target", model_dir, "--source", str(source), "--max-new-tokens", str(MAX_NEW),
          "--batch-size", "4", "--dtype", "float32", "--attention", "xla", "--json"]
  for name, chunk in (("whole", "0"), ("chunked", "4")):
    assert cli.main(base + ["--out-dir", str(tmp_path / name), "--prefill-chunk", chunk]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["settings"]["attention"] == "xla" and res["settings"]["prefill_chunk"] == int(chunk)
  assert read_rows(tmp_path / "chunked") == read_rows(tmp_path / "whole") != []
  # A KV pool of 12 pages of 16 rows for 4 slots: requests wait for pages (or are preempted), the rows are the same.
  from jetspec_jax.convert import read_target_config
  from jetspec_jax.decode.engine import page_bytes
  gib = 12 * page_bytes(read_target_config(model_dir)[0], None, 16, jnp.float32) / (1 << 30)
  assert cli.main(base + ["--out-dir", str(tmp_path / "paged"), "--kv-memory", f"{gib * 1.001:.9f}"]) == 0
  assert json.loads(capsys.readouterr().out)["settings"]["kv_memory_gib"] > 0
  assert read_rows(tmp_path / "paged") == read_rows(tmp_path / "whole")
  assert cli.main(base + ["--out-dir", str(tmp_path / "bad"), "--max-prompt-tokens", "0"]) == 2
  assert "--max-prompt-tokens must be at least 1" in capsys.readouterr().err

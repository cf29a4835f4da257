"""Small-LM pretraining: the loss falls, the exported directory is a Hugging Face Qwen3 that matches
our forward, packed rows equal separate rows, a fixed seed fixes the weights, sharding changes nothing."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures
from jetspec_jax import convert
from jetspec_jax.config import Qwen3Config
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import qwen3
from jetspec_jax.sharding import make_mesh
from jetspec_jax.tokenizer import load_tokenizer, train_chat_tokenizer
from jetspec_jax.train import pretrain
from jetspec_jax.train.batching import pad_rows
from jetspec_jax.train.chat import ChatEncoder
from jetspec_jax.train.records import prepare_dataset

WORDS = ("the cat sat on a mat while the dog ran to the park and a bird sang in the tree "
         "one two three four five six seven eight nine ten red green blue yellow").split()
SEQ_LEN = 128
TRAIN = dict(steps=40, batch_size=8, learning_rate=1e-2, seed=0)
token_losses = jax.jit(pretrain.token_losses, static_argnums=1)
mean_loss = jax.jit(pretrain.mean_loss, static_argnums=1)
forward = jax.jit(hf_fixtures.target_forward, static_argnums=1)


def conversations(n: int, seed: int = 0):
  """User: some words; assistant: the same words twice (partly learnable in a few dozen steps)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    words = " ".join(rng.choice(WORDS, size=rng.integers(2, 6)))
    out.append([{"role": "user", "content": f"repeat {words}"},
                {"role": "assistant", "content": f"{words} {words}"}])
  return out


def tiny_config(tok, **overrides) -> Qwen3Config:
  kw = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rope_theta=10_000.0, tie_word_embeddings=True)
  return Qwen3Config(**{**kw, **overrides})


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("pretrain")
  convs = conversations(48)
  texts = [m["content"] for c in convs for m in c] + ["user assistant"] * 8
  tok_dir = train_chat_tokenizer(texts, 300, str(root / "tok"))
  jsonl = root / "chat.jsonl"
  with open(jsonl, "w") as f:
    for c in convs:
      f.write(json.dumps({"messages": c}) + "\n")
  tok = load_tokenizer(tok_dir)
  rows = prepare_dataset(str(jsonl), tok, str(root / "data"), seq_len=SEQ_LEN, pack=True)
  return {"root": root, "tok_dir": tok_dir, "tok": tok, "rows": rows, "convs": convs}


@pytest.fixture(scope="module")
def trained(world):
  out = world["root"] / "target_hf"
  return pretrain.pretrain_target(tiny_config(world["tok"]), world["rows"], str(out), **TRAIN,
                                  tokenizer_dir=world["tok_dir"], progress=False, log_dir=str(world["root"] / "logs"),
                                  log_every=10)


def test_training_lowers_the_loss(world, trained):
  assert len(world["rows"]) >= 8
  assert any(len(r["segment_lengths"]) > 1 for r in world["rows"].read(range(len(world["rows"])))), "rows are packed"
  assert trained["steps"] == 40 and len(trained["losses"]) == 40
  assert trained["initial_loss"] == pytest.approx(np.log(len(world["tok"])), abs=0.3)
  assert trained["final_loss_avg"] < 0.8 * trained["initial_loss"], trained["losses"]
  assert trained["tokens_per_s"] > 0 and trained["num_params"] > 0
  logged = [json.loads(l) for l in open(world["root"] / "logs" / "metrics.jsonl")]
  assert [r["step"] for r in logged] == [10, 20, 30, 40]
  assert all({"loss", "grad_norm", "learning_rate", "tokens_per_s"} <= set(r) for r in logged)
  assert logged[-1]["loss"] == pytest.approx(trained["final_loss"], rel=1e-6)


def test_export_is_a_hugging_face_qwen3_matching_our_forward(world, trained):
  import torch
  import transformers
  out = trained["out_dir"]
  tok = world["tok"]
  assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
  assert not [n for n in os.listdir(os.path.dirname(out)) if ".tmp-" in n]
  hf_cfg = json.load(open(os.path.join(out, "config.json")))
  assert hf_cfg["eos_token_id"] == tok.eos_token_id and hf_cfg["pad_token_id"] == tok.pad_token_id
  assert transformers.AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template

  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  cfg, params, side = convert.load_target(out, jnp.float32)
  assert side == out and cfg.eos_token_ids == (tok.eos_token_id,)
  ids = np.asarray(ChatEncoder(tok).encode(world["convs"][0])[0])[None, :40]
  with torch.no_grad():
    ref = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  n = ids.shape[1]
  logits, _, _ = forward(params, cfg, jnp.asarray(ids), jnp.arange(n, dtype=jnp.int32)[None],
                          qwen3.init_cache(cfg, 1, n, jnp.float32), jnp.zeros((1,), jnp.int32), qwen3.causal_mask(1, n))
  np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=0)
  assert np.abs(ref).max() > 1.0   # trained, not near-zero random logits


def test_packed_row_equals_separate_rows(world, trained):
  cfg, params, _ = convert.load_target(trained["out_dir"], jnp.float32)
  encoded = [ChatEncoder(world["tok"]).encode(c) for c in world["convs"][:3]]
  rows = [{"input_ids": ids, "loss_mask": m, "segment_lengths": np.array([len(ids)], np.int32)} for ids, m in encoded]
  packed_row = {"input_ids": np.concatenate([r["input_ids"] for r in rows]),
                "loss_mask": np.concatenate([r["loss_mask"] for r in rows]),
                "segment_lengths": np.array([len(r["input_ids"]) for r in rows], np.int32)}
  length = int(sum(packed_row["segment_lengths"])) + 5            # some padding too
  packed = pad_rows([packed_row], length, world["tok"].pad_token_id)
  separate = pad_rows(rows, length, world["tok"].pad_token_id)
  ce_p, valid_p = jax.device_get(token_losses(params, cfg, packed))
  ce_s, valid_s = jax.device_get(token_losses(params, cfg, separate))
  assert valid_p.sum() == valid_s.sum() == sum(len(r["input_ids"]) - 1 for r in rows)
  assert not valid_p[0, -5:].any()                                  # padding predicts nothing
  np.testing.assert_allclose(ce_p[valid_p], ce_s[valid_s], rtol=1e-5, atol=1e-5)
  # The check has teeth: one plain causal sequence (positions running on, attention across
  # conversations) changes the later conversations' losses.
  plain = dict(packed, segment_ids=np.where(packed["segment_ids"] > 0, 1, 0),
               positions=np.where(packed["segment_ids"] > 0, np.arange(length), 0))
  ce_c, valid_c = jax.device_get(token_losses(params, cfg, plain))
  first = len(rows[0]["input_ids"]) - 1
  assert np.abs(ce_c[0, first + 1:][valid_p[0, first + 1:]] - ce_p[0, first + 1:][valid_p[0, first + 1:]]).max() > 1e-3
  # ... and the packed batch's mean loss is the per-token mean over the valid targets.
  loss, count = mean_loss(params, cfg, packed)
  assert int(count) == valid_p.sum() and float(loss) == pytest.approx(ce_p[valid_p].mean(), rel=1e-5)


def _weights(out_dir):
  reader = convert.SafetensorsReader(out_dir)
  return {k: reader.get(k) for k in sorted(reader.keys())}


@pytest.fixture(scope="module")
def reruns(world):
  """The ``trained`` run again (same seed: the compiled program is reused), and on a 2x2 mesh."""
  run = lambda name, mesh=None: pretrain.pretrain_target(tiny_config(world["tok"]), world["rows"],
                                                         str(world["root"] / name), **TRAIN, mesh=mesh, progress=False)
  runs = {"again": run("again")}
  if jax.device_count() >= 4:
    runs["mesh"] = run("mesh", make_mesh(2, 2, jax.devices()[:4]))
  return runs


def test_same_seed_same_weights(trained, reruns):
  again = reruns["again"]
  assert again["losses"] == trained["losses"]
  wa, wb = _weights(trained["out_dir"]), _weights(again["out_dir"])
  assert set(wa) == set(wb)
  for k in wa:
    np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


def test_sharded_run_equals_single_device(trained, reruns):
  if "mesh" not in reruns:
    pytest.skip("needs 4 devices (scripts/test.sh gives 8 fake CPU devices)")
  np.testing.assert_allclose(reruns["mesh"]["losses"], trained["losses"], rtol=2e-5)   # measured: 6e-7
  wa, wb = _weights(trained["out_dir"]), _weights(reruns["mesh"]["out_dir"])
  for k in wa:
    np.testing.assert_allclose(wb[k], wa[k], rtol=1e-4, atol=2e-5, err_msg=k)       # measured: 1e-6 abs


def test_refuses_a_non_empty_output_directory_before_training(world, tmp_path):
  out = tmp_path / "taken"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  with pytest.raises(JetSpecError, match="not empty"):
    pretrain.pretrain_target(tiny_config(world["tok"]), world["rows"], str(out), steps=1, batch_size=2,
                             progress=False)
  with pytest.raises(JetSpecError, match="vocab_size"):
    pretrain.pretrain_target(tiny_config(world["tok"], vocab_size=100), world["rows"], str(tmp_path / "x"), steps=1,
                             batch_size=2, tokenizer_dir=world["tok_dir"], progress=False)
  assert (out / "keep.txt").exists() and not (tmp_path / "x").exists()


def test_default_demo_config():
  cfg = pretrain.default_demo_config(4096, eos_id=7, pad_id=5)
  cfg.validate()
  assert cfg.tie_word_embeddings and cfg.eos_token_ids == (7,) and cfg.pad_token_id == 5
  assert 1e6 <= pretrain.num_params(cfg) <= 2e7 and cfg.hidden_size == 128
  assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (2, 1, 384)
  wide = pretrain.default_demo_config(4096, eos_id=7, pad_id=5, hidden_size=256, num_layers=3)
  assert (wide.num_attention_heads, wide.num_key_value_heads, wide.intermediate_size, wide.num_hidden_layers) == (
      4, 2, 768, 3)

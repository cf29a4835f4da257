"""Hugging Face files this project writes mean the same model to transformers 4.x as to 5.x.

Each check loads the files in a subprocess with the transformers 4.57 that scripts/setup.sh installs
into .venv/transformers4 (first on PYTHONPATH; torch, numpy and safetensors come from the venv).
The targets use RoPE theta 5e6: a 4.x that missed it would build theta 10000, a different model.
"""
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf4_probe
import hf_fixtures
from jetspec_jax import convert
from jetspec_jax.models import draft_head
from jetspec_jax.tokenizer import train_chat_tokenizer
from jetspec_jax.train import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF4_DIR = os.path.join(ROOT, ".venv", "transformers4")
PYTHON = os.path.join(ROOT, ".venv", "bin", "python")
THETA = 5_000_000.0

pytestmark = pytest.mark.skipif(not os.path.isdir(HF4_DIR),
                                reason=f"transformers 4.x is not installed in {HF4_DIR} (scripts/setup.sh installs it)")


def run_hf4(kind: str, **job):
  """hf4_probe's ``kind`` under transformers 4.x, in a subprocess; returns its result."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [HF4_DIR, os.environ.get("PYTHONPATH")])),
         "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
  proc = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "hf4_probe.py"), json.dumps({"kind": kind, **job})],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout)
  assert out["transformers"].startswith("4."), out["transformers"]
  return out["result"]


def project_target(name: str, root):
  """The named fixture with theta 5e6, written as the demo target (``pretrain.write_hf_directory``,
  config from ``to_hf_dict``) and exported from its converted checkpoint (``convert.export_hf``).
  Returns (cfg, params, [target dir, exported dir])."""
  src = hf_fixtures.save_model(hf_fixtures.build_model(hf_fixtures.hf_config(name, rope_theta=THETA)),
                               str(root / "src"))
  cfg, params, _ = convert.load_target(src, jnp.float32)
  assert cfg.rope_theta == THETA
  target, ckpt, exported = str(root / "target"), str(root / "ckpt"), str(root / "exported")
  pretrain.write_hf_directory(target, cfg, params)
  convert.convert_hf(target, ckpt)
  convert.export_hf(ckpt, exported)
  return cfg, params, [target, exported]


@pytest.mark.parametrize("name,expected_class", [("dense", "Qwen3ForCausalLM"), ("moe_norm", "Qwen3MoeForCausalLM")])
def test_hf4_target_logits_match_jax(name, expected_class, tmp_path):
  cfg, params, dirs = project_target(name, tmp_path)
  ids = (np.arange(1, 25, dtype=np.int32)[None] * 7) % cfg.vocab_size
  want, _ = hf_fixtures.jax_forward(params, cfg, ids)
  for d, got in run_hf4("model", dirs=dirs, ids=ids.tolist()).items():
    assert got["class"] == expected_class, d
    assert got["loading_problems"] == {}, d
    c = got["config"]
    assert c["rope_theta"] == THETA, d
    if cfg.num_experts:
      assert (c["num_experts"], c["num_experts_per_tok"], c["norm_topk_prob"], c["mlp_only_layers"],
              c["decoder_sparse_step"]) == (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                                            list(cfg.mlp_only_layers), cfg.decoder_sparse_step), d
    err = float(np.abs(np.asarray(got["logits"], np.float32) - want).max())
    assert err <= 1e-4, f"{d}: transformers 4.x logits differ from JAX by {err}"


@pytest.mark.parametrize("name,expected_class", [("dense", "Qwen3ForCausalLM"), ("moe_norm", "Qwen3MoeForCausalLM")])
def test_hf4_loads_the_export_of_a_hf5_saved_model(name, expected_class, tmp_path):
  """transformers 5 ``save_pretrained`` writes theta only in rope_parameters (and MoE experts as
  num_local_experts), which 4.x misses; converted and exported by the project, it is the same model there."""
  src = hf_fixtures.save_model(hf_fixtures.build_model(hf_fixtures.hf_config(name, rope_theta=THETA)),
                               str(tmp_path / "src"))
  with open(os.path.join(src, "config.json")) as f:
    saved = json.load(f)
  assert saved["transformers_version"].startswith("5.") and "rope_theta" not in saved and "num_experts" not in saved
  cfg, params, _ = convert.load_target(src, jnp.float32)
  ckpt, exported = str(tmp_path / "ckpt"), str(tmp_path / "exported")
  convert.convert_hf(src, ckpt)
  convert.export_hf(ckpt, exported)
  ids = (np.arange(1, 25, dtype=np.int32)[None] * 5) % cfg.vocab_size
  want, _ = hf_fixtures.jax_forward(params, cfg, ids)
  got = run_hf4("model", dirs=[exported], ids=ids.tolist())[exported]
  assert got["class"] == expected_class and got["loading_problems"] == {}
  assert got["config"]["rope_theta"] == THETA
  if cfg.num_experts:
    assert got["config"]["num_experts"] == cfg.num_experts == saved["num_local_experts"]
  err = float(np.abs(np.asarray(got["logits"], np.float32) - want).max())
  assert err <= 1e-4, f"transformers 4.x logits of the export differ from JAX by {err}"


def test_hf4_reads_head_config(jax_target, tmp_path):
  target_cfg, _ = jax_target("dense")
  head_cfg = draft_head.DraftConfig.for_target(target_cfg, num_layers=2, block_size=4, rope_theta=THETA)
  out = str(tmp_path / "head")
  convert.save_head(out, head_cfg, draft_head.init_head(head_cfg, jax.random.key(0)))
  got = run_hf4("config", path=out)
  assert got["class"] == "Qwen3Config"
  c, want = got["config"], head_cfg.to_hf_dict("float32")
  assert c["rope_theta"] == THETA and (c.get("rope_scaling") or {}).get("rope_type", "default") == "default"
  for key in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "tie_word_embeddings", "block_size",
              "num_target_layers", "dflash_config"):
    assert c[key] == want[key], key
  assert c.get("torch_dtype", c.get("dtype")) == "float32"
  assert draft_head.DraftConfig.from_hf_dict(c) == head_cfg       # and it reads back as the same head


def chat_tokenizer(out_dir: str) -> str:
  rng = np.random.default_rng(0)
  words = ["the", "cat", "sat", "on", "mat", "think", "answer", "2+2", "is", "4", "héllo", "数字", "\n"]
  texts = [" ".join(rng.choice(words, 12)) for _ in range(200)]
  return train_chat_tokenizer(texts, 320, out_dir)


def assert_hf4_tokenizer_matches_hf5(hf5_dir: str, hf4_dir: str) -> None:
  want = json.loads(json.dumps(hf4_probe.tokenizer(hf5_dir)))      # transformers 5, as JSON
  got = run_hf4("tokenizer", path=hf4_dir)
  assert want["specials"]["eos"] == ["<|im_end|>", want["len"] - 4]
  assert want["specials"]["mask"][0] == "<|MASK|>" and want["specials"]["pad"][0] == "<|endoftext|>"
  for key in want:
    assert got[key] == want[key], key


def test_hf4_tokenizer_matches_hf5(tmp_path):
  tok_dir = chat_tokenizer(str(tmp_path / "tok"))
  assert_hf4_tokenizer_matches_hf5(tok_dir, tok_dir)


def test_hf4_loads_project_copies_of_a_hf5_saved_tokenizer(jax_target, tmp_path):
  """A tokenizer re-saved by transformers 5 (``TokenizersBackend``, list-valued ``extra_special_tokens``)
  does not load in 4.x; the copy the demo target gets (``pretrain.write_hf_directory``) does, as the same
  tokenizer. (The export's copy goes through the same ``convert.copy_side_files``.)"""
  import transformers
  resaved = str(tmp_path / "resaved")
  transformers.AutoTokenizer.from_pretrained(chat_tokenizer(str(tmp_path / "tok"))).save_pretrained(resaved)
  with open(os.path.join(resaved, "tokenizer_config.json")) as f:
    assert json.load(f)["tokenizer_class"] == "TokenizersBackend"
  cfg, params = jax_target("dense")
  target = str(tmp_path / "target")
  pretrain.write_hf_directory(target, cfg, params, tokenizer_dir=resaved)
  assert_hf4_tokenizer_matches_hf5(resaved, target)

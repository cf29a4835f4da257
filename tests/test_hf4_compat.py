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


def test_hf4_tokenizer_matches_hf5(tmp_path):
  rng = np.random.default_rng(0)
  words = ["the", "cat", "sat", "on", "mat", "think", "answer", "2+2", "is", "4", "héllo", "数字", "\n"]
  texts = [" ".join(rng.choice(words, 12)) for _ in range(200)]
  tok_dir = train_chat_tokenizer(texts, 320, str(tmp_path / "tok"))
  want = json.loads(json.dumps(hf4_probe.tokenizer(tok_dir)))      # transformers 5, as JSON
  got = run_hf4("tokenizer", path=tok_dir)
  assert want["specials"]["eos"] == ["<|im_end|>", want["len"] - 4]
  assert want["specials"]["mask"][0] == "<|MASK|>" and want["specials"]["pad"][0] == "<|endoftext|>"
  for key in want:
    assert got[key] == want[key], key

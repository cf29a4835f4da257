"""The embedded default pipeline (``jetspec-jax demo``).

Builds a small random Qwen3 checkpoint in Hugging Face format, converts it to an orbax
checkpoint, generates with the jitted AR loop and speculatively with a JetSpec head, exports
back to Hugging Face format and checks the round trip is bit-exact and the speculative output
equals AR output.
"""
from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import convert
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.loop import generate_ar
from jetspec_jax.decode.speculative import TreeConfig, generate_speculative
from jetspec_jax.models import draft_head, qwen3

DEMO_TARGET = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                          tie_word_embeddings=True, eos_token_ids=(1,))


def default_workdir() -> str:
  return os.environ.get("JETSPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jetspec-jax")


def write_random_hf_target(out_dir: str, cfg: Qwen3Config, seed: int = 0, dtype=jnp.bfloat16) -> None:
  """A random Qwen3 checkpoint in HF format (config.json + safetensors), written atomically."""
  params = qwen3.init_target(cfg, jax.random.key(seed), dtype)
  params = {k: (v * 8).astype(dtype) if v.ndim > 1 else v for k, v in params.items()}
  with convert.atomic_directory(out_dir, overwrite=True) as tmp:
    convert.write_safetensors(tmp, convert.target_mappings(cfg), params)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(cfg.to_hf_dict(str(jnp.dtype(dtype))), f, indent=2)


def _same_safetensors(a_dir: str, b_dir: str) -> tuple[bool, int]:
  a, b = convert.SafetensorsReader(a_dir), convert.SafetensorsReader(b_dir)
  if a.keys() != b.keys():
    return False, 0
  same = all(np.array_equal(a.get(k).view(np.uint8), b.get(k).view(np.uint8)) for k in a.keys())
  return same, len(a.keys())


def run(workdir: str | None = None, quiet: bool = False) -> dict:
  workdir = os.path.abspath(workdir or default_workdir())
  say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
  hf_dir, ckpt_dir, export_dir = (os.path.join(workdir, n) for n in ("target_hf", "target_ckpt", "target_export"))
  res: dict = {"workdir": workdir, "backend": jax.default_backend()}
  say(f"[1/4] writing a random Qwen3 target ({DEMO_TARGET.num_hidden_layers} layers, hidden "
      f"{DEMO_TARGET.hidden_size}) in Hugging Face format -> {hf_dir}")
  write_random_hf_target(hf_dir, DEMO_TARGET)
  say(f"[2/4] converting to an orbax checkpoint -> {ckpt_dir}")
  t0 = time.perf_counter()
  res["convert"] = convert.convert_hf(hf_dir, ckpt_dir, overwrite=True)
  res["convert"]["seconds"] = time.perf_counter() - t0
  say("[3/4] generating: jitted AR loop vs JetSpec speculative loop (random head)")
  cfg, params, _ = convert.load_target(ckpt_dir, jnp.float32)
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=8)
  head = draft_head.init_head(head_cfg, jax.random.key(1))
  prompts = [[5, 17, 42, 7, 99, 3], [11, 12, 13]]
  ar = generate_ar(params, cfg, prompts, max_new_tokens=32, eos_ids=())
  tree = TreeConfig("accum_logp", budget=16, width=4, depth=7)
  spec = generate_speculative(params, cfg, head, head_cfg, prompts, max_new_tokens=32, tree_cfg=tree, eos_ids=())
  res["generate"] = {"ar_tokens": ar["token_ids"], "spec_equals_ar": spec["token_ids"] == ar["token_ids"],
                     "tau": spec["tau"], "rounds": spec["rounds"]}
  say(f"[4/4] exporting back to Hugging Face format -> {export_dir}")
  res["export"] = convert.export_hf(ckpt_dir, export_dir, overwrite=True)
  exact, n = _same_safetensors(hf_dir, export_dir)
  res["round_trip"] = {"bit_exact": exact, "tensors": n}
  res["ok"] = exact and res["generate"]["spec_equals_ar"]
  return res


def summary(res: dict) -> str:
  g, rt = res["generate"], res["round_trip"]
  return "\n".join([
      f"{'stage':<28} result",
      f"{'HF -> orbax convert':<28} {res['convert']['num_tensors']} tensors, {res['convert']['seconds']:.1f}s",
      f"{'speculative == AR':<28} {g['spec_equals_ar']} (tau {g['tau']:.2f} with an untrained head)",
      f"{'orbax -> HF round trip':<28} {'bit-exact' if rt['bit_exact'] else 'MISMATCH'} over {rt['tensors']} tensors",
      f"artifacts under {res['workdir']}",
      "OK" if res["ok"] else "FAILED"])

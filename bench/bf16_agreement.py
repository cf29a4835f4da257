"""How often greedy speculative decoding in bfloat16 differs from greedy AR decoding in bfloat16, and why.

In float32 speculative output equals AR output up to float32 near-ties (``decode.agreement``'s rule, tested). In bfloat16 a verify forward of N tree nodes and a
one-token AR step round differently (other matmul shapes, other reduction orders), so where the target's
top two logits are nearly tied the argmax can flip and the two outputs part. For each mode this prints
the share of sequences whose tokens equal AR's, the mean position where the others first differ, and the
float32 top-2 logit gap of the AR step at that position (small gaps: near-ties, the cause).

Models: the demo's target and head (``--workdir`` of a finished `jetspec-jax demo`), and a random target of
Qwen3-8B layer width (hidden 4096, 32 / 8 heads, MLP 12288; ``--wide-layers`` layers, small vocabulary)
with a random head (tau about 1: every round's correction token comes from the verify forward's root
row, so it compares that row against the AR step). Attention: XLA, and with ``--interpret`` the Pallas
kernel in interpret mode too (slow; a few prompts).

  python bench/bf16_agreement.py --workdir ~/.cache/jetspec-jax [--prompts 32] [--interpret 4] [--modes chain tree_b64]
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import bench, convert, demo
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import agreement
from jetspec_jax.decode import engine
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.tokenizer import load_tokenizer

NAME = "bf16_agreement"
DEMO_TREES = {"chain": lambda depth: TreeConfig("chain", 1, 1, depth),          # mode -> its tree at a head depth
              "best_b16": lambda depth: TreeConfig("best_nodes", 16, 4, depth),
              "tree_b64": lambda depth: TreeConfig("accum_logp", 64, 4, depth)}
WIDE_MODES = ("chain", "tree_b64")    # the random 8B-width target's (its random head: tau about 1)


def top2_gap(cfg, params32, prompt: list[int], generated: list[int], position: int) -> float:
  """float32 logit gap between the target's top two tokens for generated token ``position``."""
  top = np.sort(agreement.last_logits(cfg, params32, list(prompt) + list(generated[:position])))[-2:]
  return float(top[1] - top[0])


def compare(name: str, cfg, params, head_cfg, head_params, prompts, max_new: int, trees, attn_impl: str) -> list[dict]:
  """One row per tree: sequences equal to AR (bfloat16 weights and caches), first differences, their gaps."""
  cast = lambda tree: jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tree)
  p16, h16 = cast(params), cast(head_params)
  ar = engine.generate(cfg, p16, prompts, max_new, eos_ids=(), attn_impl=attn_impl).tokens
  rows = []
  for label, tree in trees:
    spec = engine.generate(cfg, p16, prompts, max_new, head_cfg=head_cfg, head_params=h16, tree=tree, eos_ids=(),
                           attn_impl=attn_impl).tokens
    diffs = [(i, agreement.first_difference(a, s)) for i, (a, s) in enumerate(zip(ar, spec))]
    parted = [(i, d) for i, d in diffs if d is not None]
    gaps = [top2_gap(cfg, params, prompts[i], ar[i], d) for i, d in parted]
    rows.append({"model": name, "attention": attn_impl, "mode": label, "sequences": len(prompts),
                 "equal_to_ar": len(prompts) - len(parted), "share_equal": 1 - len(parted) / len(prompts),
                 "mean_first_difference": float(np.mean([d for _, d in parted])) if parted else None,
                 "median_top2_gap_f32": float(np.median(gaps)) if gaps else None})
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a finished `jetspec-jax demo` work directory")
  p.add_argument("--prompts", type=int, default=32, help="HumanEval prompts of the demo's bank")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--wide-layers", type=int, default=2, help="layers of the random 8B-width target")
  p.add_argument("--interpret", type=int, default=0, help="prompts also run with the Pallas kernel (interpret)")
  p.add_argument("--quick", action="store_true", help="the work directory is a `jetspec-jax demo --quick` one")
  p.add_argument("--modes", nargs="+", choices=list(DEMO_TREES), default=list(DEMO_TREES),
                  help="speculative modes to compare (default all)")
  p.add_argument("--out", help="JSON path (default bench/results/bf16_agreement.json)")
  a = p.parse_args(argv)
  s = demo.QUICK if a.quick else demo.DemoSettings()
  tokenizer = load_tokenizer(os.path.join(a.workdir, "tokenizer"))
  cfg, params, _ = convert.load_target(os.path.join(a.workdir, "target_ckpt"), jnp.float32)
  head_cfg, head = convert.load_head(os.path.join(a.workdir, "head_run", "head_hf"), jnp.float32, target_cfg=cfg)
  prompts = demo.bench_prompts(s, "humaneval", tokenizer)[:a.prompts]
  trees = [(m, DEMO_TREES[m](head_cfg.depth)) for m in a.modes]
  rows = compare("demo", cfg, params, head_cfg, head, prompts, a.max_new_tokens, trees, "xla")
  if a.interpret:
    rows += compare("demo", cfg, params, head_cfg, head, prompts[:a.interpret], a.max_new_tokens, trees,
                    "pallas_interpret")
  wide = Qwen3Config(vocab_size=1024, hidden_size=4096, intermediate_size=12288, num_hidden_layers=a.wide_layers,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6)
  wparams = qwen3.init_target(wide, jax.random.key(0))
  wparams = {k: v * 5 if v.ndim > 1 else v for k, v in wparams.items()}       # logits spread like a real model's
  whead_cfg = draft_head.DraftConfig.for_target(wide, num_layers=1, block_size=8)
  whead = draft_head.init_head(whead_cfg, jax.random.key(1))
  wprompts = [list(map(int, r)) for r in np.random.default_rng(0).integers(1, 1024, (8, 32))]
  rows += compare("random 8B width", wide, wparams, whead_cfg, whead, wprompts, a.max_new_tokens,
                  [(m, DEMO_TREES[m](7)) for m in a.modes if m in WIDE_MODES], "xla")
  print(bench.format_table(rows))
  for path in bench.save_results({"machine": bench.machine_info(), "args": vars(a), "rows": rows}, a.out, NAME):
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

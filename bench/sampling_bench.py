"""Sampling benchmark: tau and tokens/s of the two lossless acceptance rules at temperature > 0.

For each temperature (default 0.6 and 1.0) and tree budget (default 16 and 64) it runs
a one-slot-per-prompt speculative engine with ``accept="match"`` (one target draw per node, deterministic top-W
tree) and ``accept="rejection"`` (Gumbel-top-k tree + recursive rejection sampling), plus the AR
engine at the same temperature as the tokens/s baseline, and prints one table.

By default the target is a small RANDOM Qwen3 (vocab 512, hidden 128, 4 layers) and the head is a RANDOM,
untrained JetSpec head: its tau says little about a trained head (expect tau near 1 and match
close to rejection); the table and JSON say so. Pass ``--target`` (HF directory or converted
checkpoint) and ``--head`` (HF head directory) to measure a real pair.

  python bench/sampling_bench.py                       # random model; JSON to bench/results/
  python bench/sampling_bench.py --target T --head H --prompt-ids "1,2,3;4,5"

Timing: the first call of every configuration compiles and is not timed; then ``--repeats``
timed calls, median reported. tokens/s counts generated tokens (prefill's first token included)
over the engine run's wall time (prefill included).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.bench import format_table, machine_info, median, save_results
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.engine import Engine, Request, acceptance
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.decode.tree import TREE_METHODS
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3

NAME = "sampling_bench"


RANDOM_TARGET = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                            tie_word_embeddings=True, eos_token_ids=(1,))


def random_models(dtype, block_size: int):
  """A small random Qwen3 target (weights scaled x8 so it is not near-uniform) and a random causal head."""
  cfg = RANDOM_TARGET
  params = qwen3.init_target(cfg, jax.random.key(0), dtype)
  params = {k: (v * 8).astype(dtype) if v.ndim > 1 else v for k, v in params.items()}
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=block_size)
  return cfg, params, head_cfg, draft_head.init_head(head_cfg, jax.random.key(1), dtype)


def load_models(args, dtype):
  if args.head and not args.target:
    raise JetSpecError("--head needs --target")
  if not args.target:
    return random_models(dtype, args.block_size) + ("random small target, random untrained head",)
  from jetspec_jax.convert import load_head, load_target
  cfg, params, _ = load_target(args.target, dtype)
  if args.head:
    head_cfg, head_params = load_head(args.head, dtype, target_cfg=cfg)
    label = f"target {args.target}, head {args.head}"
  else:
    head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=args.block_size)
    head_params = draft_head.init_head(head_cfg, jax.random.key(1), dtype)
    label = f"target {args.target}, random untrained head"
  return cfg, params, head_cfg, head_params, label


def parse_prompts(args, vocab: int) -> list[list[int]]:
  if args.prompt_ids:
    prompts = [[int(t) for t in p.split(",") if t.strip()] for p in args.prompt_ids.split(";") if p.strip()]
    if not prompts or any(not p or min(p) < 0 or max(p) >= vocab for p in prompts):
      raise JetSpecError(f"--prompt-ids: ';'-separated lists of ids in [0, {vocab})")
    return prompts
  rng = np.random.default_rng(0)
  return [rng.integers(2, vocab, size=args.prompt_len).tolist() for _ in range(args.batch)]


def measure(prompts, max_new_tokens: int, repeats: int, *, cfg, params, **kw) -> dict:
  """Median seconds and tokens/s over ``repeats`` runs, after a compiling one, of an engine of one slot per
  prompt (``kw``: the engine's head, tree and sampling), plus the acceptance of the first timed run when it is
  speculative."""
  from jetspec_jax.attention import cache_rows
  requests = [Request(list(p), max_new_tokens) for p in prompts]
  eng = Engine.for_requests(cfg, params, requests, slots=len(requests),
                            prefill_rows=cache_rows(max(len(p) for p in prompts)), eos_ids=(), **kw)
  eng.run(requests)                                                # compile
  runs = [eng.run(requests) for _ in range(repeats)]
  secs = [r.wall_s for r in runs]
  n = sum(len(t) for t in runs[0].tokens)
  out = dict(seconds=median(secs), generated=n, tokens_per_s=n / max(median(secs), 1e-9))
  return out | (acceptance(runs[0].results) if eng.speculative else {})


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--target", help="HF directory or converted checkpoint (default: random demo-shaped target)")
  p.add_argument("--head", help="JetSpec head directory, HF format (default: random head)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--temperatures", default="0.6,1.0")
  p.add_argument("--budgets", default="16,64")
  p.add_argument("--width", type=int, default=7)
  p.add_argument("--depth", type=int, default=None, help="tree depth (default: the head's block_size - 1)")
  p.add_argument("--tree", default="accum_logp", choices=list(TREE_METHODS))
  p.add_argument("--block-size", type=int, default=16, help="block size of a random head")
  p.add_argument("--top-k", type=int, default=0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--batch", type=int, default=1, help="number of random prompts (ignored with --prompt-ids)")
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--prompt-ids", help="';'-separated comma lists of prompt ids, e.g. '1,2,3;4,5'")
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", help="JSON path (default bench/results/sampling_bench.json)")
  args = p.parse_args(argv)

  dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
  cfg, params, head_cfg, head_params, label = load_models(args, dtype)
  prompts = parse_prompts(args, cfg.vocab_size)
  temps = [float(t) for t in args.temperatures.split(",")]
  budgets = [int(b) for b in args.budgets.split(",")]
  depth = args.depth or head_cfg.depth
  m = args.max_new_tokens
  print(f"models: {label}; backend {jax.default_backend()}; {len(prompts)} prompt(s), "
        f"{args.max_new_tokens} new tokens, top_k {args.top_k}, top_p {args.top_p}", flush=True)

  rows = []
  for temp in temps:
    sampled = lambda accept: SamplingConfig(temp, args.top_k, args.top_p, accept, args.seed)
    ar = measure(prompts, m, args.repeats, cfg=cfg, params=params, sampling_cfg=sampled("rejection"))
    rows.append({"temperature": temp, "budget": None, "accept": "AR", "tau": 1.0, "acc_d1": None,
                 "tokens_per_s": ar["tokens_per_s"], "speedup": 1.0, "seconds": ar["seconds"]})
    print(format_table(rows[-1:]), flush=True)
    for budget in budgets:
      tree = TreeConfig(args.tree, budget, args.width, depth)
      for accept in ("match", "rejection"):
        res = measure(prompts, m, args.repeats, cfg=cfg, params=params, head_cfg=head_cfg, head_params=head_params,
                      tree=tree, sampling_cfg=sampled(accept))
        acc = res["acceptance_by_depth"]
        rows.append({"temperature": temp, "budget": budget, "accept": accept, "tau": res["tau"],
                     "acc_d1": acc[0] if acc else None, "tokens_per_s": res["tokens_per_s"],
                     "speedup": res["tokens_per_s"] / ar["tokens_per_s"], "seconds": res["seconds"],
                     "acceptance_by_depth": acc, "rounds": res["rounds"],
                     "tree": dataclasses.asdict(tree) | {"num_nodes": tree.num_nodes()}})
        print(format_table(rows[-1:], columns=list(rows[0].keys())), flush=True)

  columns = ["temperature", "budget", "accept", "tau", "acc_d1", "tokens_per_s", "speedup", "seconds"]
  print()
  print(f"JetSpec sampling: match vs rejection ({label})")
  print(format_table(rows, columns))
  result = {"benchmark": NAME, "models": label, "random_models": not args.head,
            "note": ("random untrained head: tau is not representative of a trained head" if not args.head
                     else ""),
            "args": vars(args), "machine": machine_info(), "rows": rows}
  for path in save_results(result, args.out, NAME):
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

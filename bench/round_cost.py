"""What an engine round costs and how long prompts wait, on CPU with the demo's target and trained head
(``jetspec-jax demo`` first).

Part ``round``: 16 slots, every slot decoding (prompts in, no prompt waiting), AR and best_nodes budget 16: the
engine's milliseconds per round (segments of --rounds rounds, the fastest of --repeats). Part ``batch1``: one
prompt at a time (as ``generate``), AR, chain and best_nodes 16: tokens/s of a one-slot engine that prefills the
whole prompt in its first round. Part ``ttft``: --long prompts of --long-tokens tokens among --short ShareGPT
requests, arriving at --rate per second, through the AR engine at each prefill setting of --prefill
(LANESxROWS: lanes per round x prompt rows per lane): TTFT and TPOT percentiles. docs/benchmarks.md sets these
beside the static loops the engine replaced (measured by this script at the last commit that had them).

    python bench/round_cost.py --workdir ~/.cache/jetspec-jax --out docs/benchmark_runs/round_cost.json
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import bench, convert, load
from jetspec_jax.decode.engine import Engine, EnginePlan, Request
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.tokenizer import load_tokenizer


def engine_ms_per_round(cfg, params, head, requests, tree, rounds: int, repeats: int) -> dict:
  """Milliseconds per engine round once every slot decodes (segments of ``rounds``, the fastest kept)."""
  nodes = 1 if tree is None else tree.num_nodes()
  plan = EnginePlan(slots=len(requests), rows=len(requests) * nodes, lanes=1, prefill_rows=32,
                    max_prompt=max(len(r.prompt) for r in requests),
                    max_new_tokens=max(r.max_new_tokens for r in requests), queue=len(requests), tree=tree)
  kw = {} if tree is None else dict(head_cfg=head[0], head_params=head[1])
  engine = Engine(cfg, params, plan, eos_ids=(), **kw)
  best = None
  for _ in range(repeats + 1):                       # the first pass compiles
    engine.start()
    engine.submit(requests)
    while len([t for t in engine.progress().values() if t]) < len(requests):
      engine.step(1)
    start = int(engine.state.round)
    t0 = time.perf_counter()
    engine.step(rounds)
    wall = time.perf_counter() - t0
    ran = int(engine.state.round) - start
    ms = wall / ran * 1e3
    best = ms if best is None else min(best, ms)
  return {"ms_per_round": best, "rounds": rounds, "cache_rows": plan.cache_lengths(None if tree is None else head[0])[0]}


def part_round(cfg, params, head, tokenizer, args, say) -> dict:
  base = load.sharegpt_requests(tokenizer, args.slots, max_output=args.max_new, max_prompt=args.max_prompt)
  requests = [Request(r.prompt, args.max_new) for r in base]
  out = {}
  for name, tree in (("ar", None), ("best_b16", TreeConfig("best_nodes", 16, 4, head[0].depth))):
    out[name] = {"engine": engine_ms_per_round(cfg, params, head, requests, tree, args.rounds, args.repeats)}
    say(f"round {name}: engine {out[name]['engine']['ms_per_round']:.2f} ms/round")
  return out


def part_batch1(cfg, params, head, tokenizer, args, say) -> dict:
  """One prompt at a time, as ``generate`` runs: the engine (one slot; the whole prompt in its first round),
  tokens/s over the prompts (prefill included), the fastest of --repeats."""
  base = load.sharegpt_requests(tokenizer, args.batch1_prompts, max_output=args.batch1_new, max_prompt=args.max_prompt)
  requests = [Request(r.prompt, args.batch1_new) for r in base]
  longest = max(len(r.prompt) for r in requests)
  out = {"prompts": len(requests), "max_new_tokens": args.batch1_new, "modes": {}}
  modes = (("ar", None), ("chain", TreeConfig("chain", 1, 1, head[0].depth)),
           ("best_b16", TreeConfig("best_nodes", 16, 4, head[0].depth)))
  for name, tree in modes:
    kw = {} if tree is None else dict(head_cfg=head[0], head_params=head[1])
    engine = Engine.for_requests(cfg, params, requests, slots=1, prefill_rows=-(-longest // 8) * 8, tree=tree,
                                 eos_ids=(), **kw)
    for _ in range(2):                                                     # compile (the first run and reset)
      engine.run(requests[:1])
    best = 0.0
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      tokens = sum(len(engine.run([r]).results[0].tokens) for r in requests)
      best = max(best, tokens / (time.perf_counter() - t0))
    out["modes"][name] = {"engine": best}
    say(f"batch 1 {name}: engine {best:.0f} tok/s")
  return out


def part_ttft(cfg, params, tokenizer, args, say) -> dict:
  short = load.sharegpt_requests(tokenizer, args.short, max_output=args.ttft_new, max_prompt=args.max_prompt)
  pool = [t for r in load.sharegpt_requests(tokenizer, 64, max_prompt=1024) for t in r.prompt]
  rng = np.random.default_rng(0)
  longs = []
  for _ in range(args.long):
    at = int(rng.integers(0, len(pool) - args.long_tokens))
    longs.append(Request(pool[at:at + args.long_tokens], args.ttft_new))
  requests = list(short)
  for i, r in enumerate(longs):                     # spread among the short ones
    requests.insert((i + 1) * len(requests) // (len(longs) + 1), r)
  out = {"requests": len(requests), "long_prompts": args.long, "long_tokens": args.long_tokens, "rate": args.rate,
         "runs": {}}
  for setting in args.prefill:
    lanes, rows = (int(x) for x in setting.split("x"))
    plan = EnginePlan(slots=args.slots, rows=args.slots, lanes=lanes, prefill_rows=rows,
                      max_prompt=max(len(r.prompt) for r in requests),
                      max_new_tokens=max(r.max_new_tokens for r in requests), queue=len(requests),
                      key_buckets=args.key_buckets)
    engine = Engine(cfg, params, plan, eos_ids=())
    load.run_engine(engine, requests[:args.slots])                         # compile
    res = load.run_engine(engine, requests, rate=args.rate)
    long_rows = [r for r in res["requests"] if r["prompt_tokens"] == args.long_tokens]
    short_rows = [r for r in res["requests"] if r["prompt_tokens"] != args.long_tokens]
    run = {"tokens_per_s": res["tokens_per_s"], "wall_s": res["wall_s"], "rounds": res["rounds"],
           "ttft_s": res["ttft_s"], "tpot_s": res["tpot_s"],
           "ttft_short_s": load.percentiles(r["ttft_s"] for r in short_rows),
           "ttft_long_s": load.percentiles(r["ttft_s"] for r in long_rows)}
    out["runs"][setting] = run
    say(f"ttft {setting}: TTFT p50 {run['ttft_s']['p50']:.2f} s p99 {run['ttft_s']['p99']:.2f} s (long prompts p50 "
        f"{run['ttft_long_s']['p50']:.2f} s), TPOT p50 {run['tpot_s']['p50'] * 1e3:.1f} ms, "
        f"{run['tokens_per_s']:.0f} tok/s")
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--workdir", default=os.path.expanduser("~/.cache/jetspec-jax"))
  p.add_argument("--parts", default="round,batch1,ttft")
  p.add_argument("--batch1-prompts", type=int, default=8, help="part batch1: prompts, one at a time")
  p.add_argument("--batch1-new", type=int, default=128, help="part batch1: tokens per prompt")
  p.add_argument("--slots", type=int, default=16)
  p.add_argument("--max-prompt", type=int, default=128, help="prompt cap of the ShareGPT requests")
  p.add_argument("--max-new", type=int, default=320, help="part round: tokens per request")
  p.add_argument("--rounds", type=int, default=100, help="part round: rounds per timed segment")
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--short", type=int, default=60, help="part ttft: short ShareGPT requests")
  p.add_argument("--long", type=int, default=4, help="part ttft: long prompts among them")
  p.add_argument("--long-tokens", type=int, default=4096)
  p.add_argument("--ttft-new", type=int, default=64, help="part ttft: output cap")
  p.add_argument("--rate", type=float, default=4.0, help="part ttft: requests per second (Poisson)")
  p.add_argument("--key-buckets", type=int, default=4)
  p.add_argument("--prefill", nargs="*", default=["1x32"], help="part ttft: LANESxROWS settings")
  p.add_argument("--label", default="", help="a name for the code measured (e.g. its commit)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  say = lambda s: print(s, flush=True)
  cfg, params, _ = convert.load_target(os.path.join(args.workdir, "target_ckpt"), jnp.float32)
  head = convert.load_head(os.path.join(args.workdir, "head_run", "head_hf"), jnp.float32, target_cfg=cfg)
  tokenizer = load_tokenizer(os.path.join(args.workdir, "tokenizer"))
  here = os.path.dirname(os.path.abspath(bench.__file__))
  commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
  result = {"machine": bench.machine_info(), "label": args.label, "code": here, "commit": commit.strip(),
            "jax": jax.__version__, "args": vars(args)}
  parts = args.parts.split(",")
  if "round" in parts:
    result["round"] = part_round(cfg, params, head, tokenizer, args, say)
  if "batch1" in parts:
    result["batch1"] = part_batch1(cfg, params, head, tokenizer, args, say)
  if "ttft" in parts:
    result["ttft"] = part_ttft(cfg, params, tokenizer, args, say)
  if args.out:
    bench.write_json(args.out, result)
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)

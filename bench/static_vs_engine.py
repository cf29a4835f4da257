"""The engine at this checkout against the static decode loops it replaced, measured alternately on one machine.

The static loops (``decode.generation.Generator``) were removed after commit b1b23b2; this script compares them
with the engine by running two worker processes, one importing this checkout and one a checkout of the older
commit (``--static-tree``, e.g. ``git worktree add /tmp/static b1b23b2``), and asking them for one timed unit at a
time, alternately, so that the machine's noise (frequency, neighbours) falls on both alike. Units:

- ``batch1``: 8 ShareGPT prompts one at a time, 128 new tokens each, tokens/s over the pass (prefill included),
  for AR, chain and best_nodes 16. The engine as ``jetspec-jax generate`` runs a prompt (one slot, its prefill
  lane sized to the prompt: an engine per prompt length, compiled before timing, as the static loop compiles a
  prefill per prompt length) and as one engine shared by all prompts (lane sized to the longest).
- ``round``: 16 slots, every one decoding: milliseconds per engine round against a static batch's decode step.

    git worktree add /tmp/static b1b23b2
    python bench/static_vs_engine.py --static-tree /tmp/static --out docs/benchmark_runs/static_vs_engine.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("ar", "chain", "best")


def worker(workdir: str, parts: list[str]) -> None:
  """Build every unit this checkout has, print their names (one JSON line), then run units named on stdin."""
  import jax.numpy as jnp
  import numpy as np

  from jetspec_jax import convert, load
  from jetspec_jax.attention import cache_rows
  from jetspec_jax.decode.engine import Engine, Request
  from jetspec_jax.decode.speculative import TreeConfig
  from jetspec_jax.tokenizer import load_tokenizer
  try:
    from jetspec_jax.decode.generation import Generator
  except ImportError:
    Generator = None
  cfg, params, _ = convert.load_target(os.path.join(workdir, "target_ckpt"), jnp.float32)
  head_cfg, head_params = convert.load_head(os.path.join(workdir, "head_run", "head_hf"), jnp.float32, target_cfg=cfg)
  tokenizer = load_tokenizer(os.path.join(workdir, "tokenizer"))
  trees = {"ar": None, "chain": TreeConfig("chain", 1, 1, head_cfg.depth),
           "best": TreeConfig("best_nodes", 16, 4, head_cfg.depth)}
  units = {}
  head_kw = lambda tree: {} if tree is None else dict(head_cfg=head_cfg, head_params=head_params)
  if "batch1" in parts:
    prompts = [Request(r.prompt, 128) for r in load.sharegpt_requests(tokenizer, 8, max_output=128, max_prompt=128)]
    longest = max(len(r.prompt) for r in prompts)
    for name, tree in trees.items():
      if Generator is None:
        shared = Engine.for_requests(cfg, params, prompts, slots=1, prefill_rows=cache_rows(longest), tree=tree,
                                     eos_ids=(), **head_kw(tree))
        own = {len(r.prompt): Engine.for_requests(cfg, params, [r], slots=1, prefill_rows=cache_rows(len(r.prompt)),
                                                  tree=tree, eos_ids=(), **head_kw(tree)) for r in prompts}
        for _ in range(2):                     # the second run of an engine compiles its reset
          for r in prompts:
            for eng in (shared, own[len(r.prompt)]):
              eng.run([r])
        units[f"batch1_{name}_shared"] = lambda e=shared: sum(len(e.run([r]).results[0].tokens) for r in prompts)
        units[f"batch1_{name}_generate"] = lambda own=own: sum(len(own[len(r.prompt)].run([r]).results[0].tokens)
                                                               for r in prompts)
      else:
        gen = Generator(cfg, params, eos_ids=(), **({} if tree is None else dict(head_kw(tree), tree=tree)))
        for r in prompts:
          gen.generate([r.prompt], r.max_new_tokens)
        units[f"batch1_{name}_static"] = lambda gen=gen: sum(len(gen.generate([r.prompt], r.max_new_tokens).tokens[0])
                                                             for r in prompts)
  if "round" in parts:
    requests = [Request(r.prompt, 320) for r in load.sharegpt_requests(tokenizer, 16, max_output=320, max_prompt=128)]
    for name in ("ar", "best"):
      tree = trees[name]
      if Generator is None:
        from round_cost import engine_ms_per_round          # this checkout's bench/ (the script's directory)
        unit = functools.partial(engine_ms_per_round, cfg, params, (head_cfg, head_params), requests, tree, 100, 0)
        unit()
        units[f"round_{name}_engine"] = lambda unit=unit: unit()["ms_per_round"]
      else:
        gen = Generator(cfg, params, eos_ids=(), **({} if tree is None else dict(head_kw(tree), tree=tree)))

        def sunit(gen=gen):
          out = gen.generate([r.prompt for r in requests], 320)
          return out.decode_s / int(np.max(out.rounds)) * 1e3
        sunit()
        units[f"round_{name}_static"] = sunit
  print(json.dumps(sorted(units)), flush=True)
  for line in sys.stdin:
    name = line.strip()
    t0 = time.perf_counter()
    out = units[name]()
    wall = time.perf_counter() - t0
    value = out / wall if name.startswith("batch1") else out                       # tokens/s | ms per round
    print(json.dumps({"unit": name, "value": value}), flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--static-tree", required=True, help="a checkout of the commit with the static loops (b1b23b2)")
  p.add_argument("--workdir", default=os.path.expanduser("~/.cache/jetspec-jax"))
  p.add_argument("--parts", default="batch1,round")
  p.add_argument("--repeats", type=int, default=7, help="alternations (each runs every unit of both sides once)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  parts = args.parts.split(",")
  if args.worker:
    return worker(args.workdir, parts)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  trees = {"engine": here, "static": os.path.abspath(args.static_tree)}
  if not os.path.isfile(os.path.join(trees["static"], "jetspec_jax", "decode", "generation.py")):
    raise SystemExit(f"{args.static_tree} has no jetspec_jax/decode/generation.py: check out b1b23b2 there")
  procs = {}
  for side, tree in trees.items():
    env = dict(os.environ, PYTHONPATH=tree)
    procs[side] = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "--static-tree", tree,
                                    "--workdir", args.workdir, "--parts", args.parts], cwd=tree, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
  names = {side: json.loads(proc.stdout.readline()) for side, proc in procs.items()}
  values: dict[str, list[float]] = {}
  for rep in range(args.repeats):
    for side, proc in procs.items():
      for name in names[side]:
        proc.stdin.write(name + "\n")
        proc.stdin.flush()
        values.setdefault(name, []).append(json.loads(proc.stdout.readline())["value"])
    print(f"alternation {rep + 1}/{args.repeats} done", flush=True)
  for proc in procs.values():
    proc.stdin.close()
    proc.wait()
  summary = {name: {"median": statistics.median(v), "best": max(v) if name.startswith("batch1") else min(v),
                    "values": v} for name, v in values.items()}
  ratios = {}
  for mode in MODES:
    for engine in ("generate", "shared"):
      a, b = summary.get(f"batch1_{mode}_{engine}"), summary.get(f"batch1_{mode}_static")
      if a and b:
        ratios[f"batch1_{mode}_{engine}_over_static"] = {k: a[k] / b[k] for k in ("median", "best")}
  for mode in ("ar", "best"):
    a, b = summary.get(f"round_{mode}_engine"), summary.get(f"round_{mode}_static")
    if a and b:
      ratios[f"round_{mode}_engine_over_static_step"] = {k: a[k] / b[k] for k in ("median", "best")}
  for name, r in ratios.items():
    print(f"{name}: median {r['median']:.3f}, best {r['best']:.3f}")
  from jetspec_jax import bench
  commit = lambda tree: subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip()
  result = {"machine": bench.machine_info(), "engine_commit": commit(here), "static_commit": commit(trees["static"]),
            "repeats": args.repeats, "units": summary, "ratios": ratios,
            "note": "batch1: tokens/s (higher is better); round: ms per round or step (lower is better)"}
  if args.out:
    bench.write_json(args.out, result)
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)

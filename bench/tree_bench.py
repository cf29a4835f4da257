"""Tree-method benchmark: every tree method at every budget on the demo's model, in one run.

For each bank (HumanEval, ShareGPT) it takes an acceptance profile (``jetspec-jax profile``'s
measurement) on prompts disjoint from the bench prompts, then runs greedy speculative decoding of the
bench prompts with the chain and with each method at each budget:

  accum_logp, top2gap, best_nodes          the draft's own log-probs (today's methods)
  rank_caps                                accum_logp with fan-outs capped by the profile
  calibrated                               best_nodes on the draft's probabilities recalibrated per
                                           (depth, rank) by the profile (offline)
  cal_online, cal_online+profile           the same from counts kept on device and updated every round
                                           (from none / from the profile's)
  static                                   the profile's optimal fixed tree (its expected tau beside)

It prints tau, tokens/s, ms per round (median over ``--repeats`` passes, after a warm-up call) and the
equality with AR per mode, then a round-time table (best_nodes, calibrated offline and online, static:
all bench prompts in their own slots, the modes interleaved over ``--overhead-repeats``), and writes one JSON. The bench
prompts, the model and the tree width are the demo's (``jetspec-jax demo`` must have run in
``--workdir``). Timing is on whatever machine runs it; speed on a CPU is not speed on a GPU (see
docs/benchmarks.md), so the round time is reported as a ratio to best_nodes' at the same budget.

  python bench/tree_bench.py --workdir ~/.cache/jetspec-jax
"""
from __future__ import annotations

import argparse
import os

import jax.numpy as jnp

from jetspec_jax import banks, bench, convert
from jetspec_jax.decode.agreement import compare
from jetspec_jax.decode.engine import acceptance
from jetspec_jax.decode.profile import expected_tau, optimal_static_tree
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.demo import DemoSettings
from jetspec_jax.tokenizer import load_tokenizer

NAME = "tree_bench"


def variants(budget: int, width: int, depth: int, prof, prior_strength: float):
  """(mode name, TreeConfig) of every method at one budget."""
  t = lambda method, **kw: TreeConfig(method, budget, width, depth, **kw)
  return [
      ("accum_logp", t("accum_logp")), ("top2gap", t("top2gap")), ("best_nodes", t("best_nodes")),
      ("rank_caps", t("rank_caps", profile=prof)),
      ("calibrated", t("calibrated", profile=prof, prior_strength=prior_strength)),
      ("cal_online", t("calibrated", online="batch", prior_strength=prior_strength)),
      ("cal_online+profile", t("calibrated", profile=prof, online="batch", prior_strength=prior_strength)),
      ("static", t("static", profile=prof)),
  ]


def round_times(cfg, params, head_cfg, head_params, prompts, trees, new: int, repeats: int) -> dict:
  """Median ms per engine round of each (name, TreeConfig) with every prompt in its own slot (one run of all
  ``prompts``; each prompt prefills in its first round), the modes interleaved in every repeat (so slow spells of a
  shared machine hit them all)."""
  engines = {name: bench.engine(params, cfg, prompts, new, slots=len(prompts), head_params=head_params,
                                head_cfg=head_cfg, tree=tc, eos_ids=()) for name, tc in trees}
  requests = bench.requests_of(prompts, new)
  times = {name: [] for name in engines}
  for name, eng in engines.items():
    eng.run(requests)                                                                # compile + warm
  for _ in range(repeats):
    for name, eng in engines.items():
      run = eng.run(requests)
      times[name].append(1e3 * run.wall_s / run.rounds)
  return {name: bench.median(t) for name, t in times.items()}


def bank_prompts(bank: str, tokenizer, s: DemoSettings, args):
  """(bench prompts, profile prompts): the demo's bench prompts, and prompts after them that neither the
  bench nor the head's training data uses (HumanEval problems below ``regen_humaneval_from``; ShareGPT
  conversations after the bench's)."""
  offset = 0 if bank == "humaneval" else s.pretrain_conversations + s.regen_conversations
  bench_p = banks.prompt_bank(bank, tokenizer, num_prompts=s.bench_prompts, prompt_len=s.bench_prompt_len,
                              offset=offset)
  prof_p = banks.prompt_bank(bank, tokenizer, num_prompts=args.profile_prompts, prompt_len=s.bench_prompt_len,
                             offset=offset + args.profile_offset,
                             stop=s.regen_humaneval_from if bank == "humaneval" else None)
  return bench_p, prof_p


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", default=None, help="the demo's work directory (default: its default)")
  p.add_argument("--budgets", default="16,32,64")
  p.add_argument("--profile-prompts", type=int, default=32, help="profiling prompts per bank")
  p.add_argument("--profile-offset", type=int, default=16, help="bank offset of the profiling prompts")
  p.add_argument("--profile-budget", type=int, default=64, help="best_nodes budget of the profiling run")
  p.add_argument("--prior-strength", type=float, default=16.0)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--overhead-repeats", type=int, default=15, help="interleaved repeats of the round-time table")
  p.add_argument("--bank", action="append", default=None)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  from jetspec_jax import cache
  s = DemoSettings()
  root = os.path.abspath(args.workdir or cache.default_root())
  cfg, params, _ = convert.load_target(os.path.join(root, "target_ckpt"), jnp.float32)
  head_cfg, head_params = convert.load_head(os.path.join(root, "head_run", "head_hf"), jnp.float32, target_cfg=cfg)
  tokenizer = load_tokenizer(os.path.join(root, "tokenizer"))
  budgets = [int(b) for b in args.budgets.split(",")]
  width, depth, new = s.bench_width, head_cfg.depth, s.bench_new_tokens
  result = {"machine": bench.machine_info(), "workdir": root, "width": width, "depth": depth, "budgets": budgets,
            "max_new_tokens": new, "banks": {}}
  for bank in args.bank or list(banks.BANKS):
    bench_p, prof_p = bank_prompts(bank, tokenizer, s, args)
    profile_tree = TreeConfig("best_nodes", args.profile_budget, width, depth)
    prof, prof_tau = bench.collect_profile(params, cfg, head_params, head_cfg, prof_p, profile_tree,
                                           max_new_tokens=new, eos_ids=())
    print(f"[{bank}] profile: {len(prof_p)} prompts, {prof.visits[0]} rounds, tau {prof_tau:.2f}", flush=True)
    ar = bench.time_mode(bench.engine(params, cfg, bench_p, new, slots=1, eos_ids=()), bench_p, new, args.repeats)
    ar_tokens = [r.tokens for r in ar.pop("results")]
    modes = [("chain", 1, TreeConfig("chain", 1, 1, depth))] + [
        (name, b, tc) for b in budgets
        for name, tc in variants(b, width, depth, prof, args.prior_strength)]
    rows = []
    for name, b, tc in modes:
      eng = bench.engine(params, cfg, bench_p, new, slots=1, head_params=head_params, head_cfg=head_cfg, tree=tc,
                         eos_ids=())
      eng.run(bench.requests_of(bench_p[:1], new))                                  # compile + warm
      passes = [eng.run(bench.requests_of(bench_p, new)) for _ in range(args.repeats)]
      results = passes[-1].results
      acc = acceptance(results)
      row = {"method": name, "budget": tc.num_nodes(), "tau": acc["tau"],
             "ms/round": bench.median([1e3 * ps.wall_s / ps.rounds for ps in passes]),
             "tok/s": bench.median([sum(len(r.tokens) for r in ps.results) / ps.wall_s for ps in passes]),
             "== AR": compare(cfg, params, bench_p, ar_tokens, [r.tokens for r in results]).label()}
      if tc.method == "static":
        shape = optimal_static_tree(prof.fitted(depth, width), b)
        row["expected tau"] = expected_tau(prof.acceptance()[:depth, :width], shape.parents, shape.depths,
                                           shape.ranks)
      rows.append(row)
      print(f"  {name} b{b}: tau {acc['tau']:.2f}", flush=True)
    for row in rows:                                            # round time relative to best_nodes'
      ref = next((r for r in rows if r["method"] == "best_nodes" and r["budget"] == row["budget"]), None)
      row["round vs best"] = row["ms/round"] / ref["ms/round"] if ref else None
    result["banks"][bank] = {"profile": prof.to_json({"prompts": len(prof_p), "tau": prof_tau}),
                             "bench_prompts": len(bench_p), "ar_tokens_per_s": ar["tokens_per_s"], "modes": rows}
    print(f"[{bank}] {len(bench_p)} prompts x {s.bench_prompt_len} tokens, {new} new tokens, width {width}; "
          f"AR {ar['tokens_per_s']:.0f} tok/s")
    print(bench.format_table(rows))
    overhead = []
    for b in budgets:
      trees = [(n, tc) for n, tc in variants(b, width, depth, prof, args.prior_strength)
               if n in ("best_nodes", "calibrated", "cal_online+profile", "static")]
      ms = round_times(cfg, params, head_cfg, head_params, bench_p, trees, new, args.overhead_repeats)
      overhead.append({"budget": b, **{f"{n} ms": v for n, v in ms.items()},
                       "online / offline": ms["cal_online+profile"] / ms["calibrated"],
                       "calibrated / best_nodes": ms["calibrated"] / ms["best_nodes"],
                       "static / best_nodes": ms["static"] / ms["best_nodes"]})
    result["banks"][bank]["round_time"] = overhead
    print(f"[{bank}] ms per loop iteration, batch {len(bench_p)}, median of {args.overhead_repeats} interleaved "
          f"repeats")
    print(bench.format_table(overhead))
  paths = bench.save_results(result, args.out, NAME)
  print("JSON:", ", ".join(map(str, paths)))
  return result


if __name__ == "__main__":
  main()

"""What an engine round moves, computes and launches on one H200 (deviceless), against the AR step's: per-kernel
HBM bytes and dot FLOPs read from the compiled programs, with a roofline time model for the H200 and the H100.

For each ``--config`` (Qwen3-8B, 30B-A3B shapes; bf16 weights and caches, one device, greedy, ``--attention``) and
batch (``--batches``): the AR engine round (one token per slot) and the speculative round (best_nodes trees of
each ``--budgets`` nodes per slot, width 7, the head's depth, every slot's whole tree verified) over slots of
``--context`` committed positions, compiled ahead of time for an H200 with jax's CUDA plugin
(``jetspec_jax.deviceless``). The round is the engine's decode body (``engine.ROUND_BODIES`` variant 0: no
prefill lane). ``jetspec_jax.hlo_cost`` reads each kernel's bytes read and written and its dot FLOPs; per program:
kernels, GB read / written, GFLOPs, the model's time on each device (``hlo_cost.roofline``: per kernel
max(bytes / bandwidth, FLOPs / peak) plus a launch cost each; a model, not a measurement), the round's bytes
against the AR step's at the same batch, and for budget-128 rounds tokens/s projected at the published taus
(MATH-500 9.56, MT-Bench 4.88: tau x batch / the round's modelled time).

Layers: compiling a 36- or 48-layer program per row takes minutes on a CPU, so by default each program is
compiled with ``--layers A B`` target layers (default: as many as the head reads and one more; the head whole,
its taps moved to the last layers, so its input projection keeps its width) and the totals
are extrapolated linearly to the config's layer count (the layers are identical, so each adds the same
kernels; ``--full-layers`` compiles the real count instead, and the JSON says which). Also per program, the ten
kernels (grouped by their jax source op) moving the most bytes that the AR step at that batch does not have.

``--target v5e | v6e | v5p``: each program is instead ONE decode round compiled alone (``aot_memory.round_program``)
for one TPU chip with libtpu (no TPU attached), costed two ways: its ``cost_analysis()`` (bytes accessed and FLOPs:
every op's operands and outputs wherever they live, VMEM included) and its device-memory (HBM) bytes from the
optimised HLO (``hlo_cost``: arrays XLA:TPU placed in VMEM or SMEM move nothing, its async copies into and out of
VMEM move what they copy), grouped as for the H200 (the largest consumers beyond the AR step); a whole-program
roofline on the HBM bytes (max(HBM bytes / bandwidth, FLOPs / peak): a lower bound); ``xla`` attention (it gathers
each slot's pages per layer) or ``--attention tpu`` (the Mosaic TPU kernel: opaque, its operands counted whole in
the HBM bytes; its share of ``cost_analysis()`` is its declared estimate, every cache position of the table read
once per row block); a program too large for the chip is listed as not compiled.

  python bench/round_bytes.py --configs qwen3_8b --out docs/benchmark_runs/round_bytes_<date>_<commit>.json
  python bench/round_bytes.py --configs qwen3_8b --batches 1 --budgets 128 --full-layers     # check the model
  python bench/round_bytes.py --configs qwen3_8b --batches 1 64 --budgets 128 --target v6e  # in a jax[tpu] venv
  python bench/round_bytes.py --configs qwen3_8b --batches 1 64 --budgets 128 --target v6e --attention tpu

Needs ``pip install "jax[cuda12]==<jax's version>" absl-py`` (jax >= 0.12; docs/gpu.md), or for a TPU target
``pip install "jax[tpu]==<jax's version>"`` in its own venv (one process at a time: libtpu holds a lock file).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aot_memory  # noqa: E402  (sets JAX_PLATFORMS=cpu before jax starts)
import jax  # noqa: E402
from jetspec_jax import deviceless, hlo_cost  # noqa: E402
from jetspec_jax.bench import commit_of, format_table, machine_info, save_results  # noqa: E402
from jetspec_jax.decode import speculative  # noqa: E402
from jetspec_jax.errors import JetSpecError  # noqa: E402
from jetspec_jax.sharding import make_mesh  # noqa: E402
from jetspec_jax.train import trainer  # noqa: E402
from jetspec_jax.train.config_file import load_config  # noqa: E402

NAME = "round_bytes"
TAUS = {"math500_b128": 9.56, "mtbench_b128": 4.88}     # published taus at budget 128 (shared/BRIEF.md)
CONFIGS = ("qwen3_8b", "qwen3_30b_a3b", "tiny")            # tiny: a compile-in-seconds one (tests)
TOTAL_KEYS = ("kernels", "bytes_read", "bytes_written", "flops", "opaque_kernels")


def models(name: str, layers: int, moe_dispatch: str = "auto"):
  """(target config cut to ``layers`` layers, head config: its layers whole, its taps the last target layers)."""
  c = load_config(name)
  target = dataclasses.replace(aot_memory.TARGETS[name], moe_dispatch=moe_dispatch, num_hidden_layers=layers)
  taps = tap_count(name)
  if layers < taps:
    raise JetSpecError(f"{name}'s head reads {taps} target layers: compile at least {taps} layers")
  c.head.target_layer_ids = tuple(range(layers - taps, layers))
  return target, trainer.build_head_config(c, target, None)


def tap_count(name: str) -> int:
  """Target layers the config's head reads (its input projection's width depends on it; 1 for the rule's)."""
  return len(load_config(name).head.target_layer_ids) or 1


def program_kernels(name: str, layers: int, batch: int, budget: int | None, context: int, attention: str,
                    moe_dispatch: str = "auto"):
  """(kernels of one decode round, loops without a trip count, compile seconds) of the AR round (``budget`` None)
  or the speculative round."""
  from jetspec_jax.decode import engine
  target, head_cfg = models(name, layers, moe_dispatch)
  mesh = make_mesh(1, 1, deviceless.h200_devices(1))
  tree = None if budget is None else speculative.TreeConfig("best_nodes", budget, 7, head_cfg.depth)
  plan = aot_memory.round_plan(context, batch, tree)
  t0 = time.perf_counter()
  compiled = aot_memory.engine_program(target, None if tree is None else head_cfg, plan, mesh, "greedy", attention)
  text = compiled.as_text()
  comps, body = hlo_cost.round_body(text, engine.ROUND_BODIES, 0)
  return hlo_cost.kernels_of(comps, body), hlo_cost.unknown_trip_loops(comps, body), time.perf_counter() - t0


def tpu_program_totals(name: str, layers: int, batch: int, budget: int | None, context: int, chip: str,
                       moe_dispatch: str = "auto", attention: str = "xla"):
  """(bytes accessed and FLOPs of ONE decode round compiled for one TPU ``chip``, from its ``cost_analysis()``;
  the program's ops from its optimised HLO (``hlo_cost``: device-memory bytes, arrays in VMEM or SMEM not
  counted); compile seconds): the round alone (``aot_memory.round_program``), since a TPU's cost covers a whole
  program."""
  target, head_cfg = models(name, layers, moe_dispatch)
  mesh = make_mesh(1, 1, deviceless.tpu_devices(chip))
  tree = None if budget is None else speculative.TreeConfig("best_nodes", budget, 7, head_cfg.depth)
  plan = aot_memory.round_plan(context, batch, tree)
  t0 = time.perf_counter()
  compiled = aot_memory.round_program(target, None if tree is None else head_cfg, plan, mesh, "greedy", attention)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  comps, entry = hlo_cost.parse(compiled.as_text())
  return ({"bytes": float(cost["bytes accessed"]), "flops": float(cost["flops"])}, hlo_cost.kernels_of(comps, entry),
          time.perf_counter() - t0)


def tpu_case(args, name: str, batch: int, budget: int | None, say) -> dict:
  """``case`` for a TPU ``--target``: the program's bytes accessed and FLOPs (``cost_analysis()``, which counts
  every op's operands and outputs wherever they live, VMEM included), its device-memory (HBM) bytes read and
  written from the optimised HLO (``hlo_cost``) with the groups behind them, and a whole-program roofline on the
  HBM bytes (a lower bound: max(HBM bytes / bandwidth, FLOPs / peak), no per-op bound, no launch cost)."""
  a, b = args.layers or (tap_count(name), tap_count(name) + 1)
  full = aot_memory.TARGETS[name].num_hidden_layers
  label = "AR" if budget is None else f"best_nodes b{budget}"
  counts = (full,) if args.full_layers else (a, b)
  say(f"{name} x{batch} {label} on {args.target}: compiling {' and '.join(map(str, counts))} layers")
  got = [tpu_program_totals(name, n, batch, budget, args.context, args.target, args.moe_dispatch,
                            args.attention)
         for n in counts]
  hbm = [{k: t[k] for k in ("kernels", "bytes_read", "bytes_written")} for t in (hlo_cost.totals(ks) for _, ks, _ in got)]
  if args.full_layers:
    totals, hbm, by_source = got[0][0], hbm[0], groups(got[0][1])
  else:
    totals, hbm = extrapolate(got[0][0], got[1][0], a, b, full), extrapolate(hbm[0], hbm[1], a, b, full)
    by_source = scale_kernels(got[0][1], got[1][1], a, b, full)
  dev = hlo_cost.TPU_DEVICES[args.target]
  hbm_bytes = hbm["bytes_read"] + hbm["bytes_written"]
  floors = {"bytes_floor_ms": 1e3 * hbm_bytes / dev.bandwidth, "flops_floor_ms": 1e3 * totals["flops"] / dev.peak}
  return {"config": name, "batch": batch, "program": label, "budget": budget, "target": args.target,
          "layers": f"compiled at {full} layers" if args.full_layers else f"extrapolated from {a} and {b} layers",
          "compile_s": sum(t for *_, t in got), **totals, "hbm_bytes": hbm_bytes, "hlo_ops": hbm["kernels"],
          "hbm_bytes_read": hbm["bytes_read"], "hbm_bytes_written": hbm["bytes_written"],
          "time_model": {args.target: {"time_ms": max(floors.values()), **floors}},
          "by_source": by_source, "sources": group_sources(got[-1][1])}


def extrapolate(small: dict, large: dict, a: int, b: int, layers: int) -> dict:
  """Totals at ``layers`` from those at ``a`` and ``b`` layers: linear in the layer count."""
  return {k: small[k] + (large[k] - small[k]) * (layers - a) / (b - a) for k in small}


def scale_kernels(small: list, large: list, a: int, b: int, layers: int) -> list:
  """Per-source groups at ``layers``: a group's bytes linear in the layer count (``extrapolate`` per group)."""
  g_small, g_large = groups(small), groups(large)
  out = {}
  for src in set(g_small) | set(g_large):
    s, l = g_small.get(src, 0.0), g_large.get(src, 0.0)
    out[src] = max(s + (l - s) * (layers - a) / (b - a), 0.0)
  return out


def group_key(k: hlo_cost.Kernel) -> str:
  """What a kernel's bytes are about, alike across programs: a kernel reading an operand of 8 MB or more (a weight
  matrix, a cache) by that operand's size (XLA drops the source of some fusions, e.g. its split-K matrix-vector
  products); any other by its jax source op, layer numbers dropped."""
  if k.largest_operand >= 8e6:
    return f"reads a {k.largest_operand / 1e6:.1f} MB operand"
  src = re.sub(r"layer_\d+", "layer_*", k.source).split("jetspec_round_bodies/while/body/")[-1]
  return src if src != "?" else f"? {k.op} {k.name.split('.')[0]}"


def groups(kernels: list) -> dict[str, float]:
  """Bytes per round per ``group_key``."""
  out: dict[str, float] = {}
  for k in kernels:
    out[group_key(k)] = out.get(group_key(k), 0.0) + k.bytes * k.count
  return out


def group_sources(kernels: list) -> dict[str, list[str]]:
  """The jax sources (layer numbers dropped) behind each ``group_key``, the most bytes first: what a size key
  stands for."""
  out: dict[str, dict[str, float]] = {}
  for k in kernels:
    src = re.sub(r"layer_\d+", "layer_*", k.source).split("jetspec_round_bodies/while/body/")[-1]
    per = out.setdefault(group_key(k), {})
    per[src] = per.get(src, 0.0) + k.bytes * k.count
  return {key: sorted(per, key=lambda src: (-per[src], src)) for key, per in out.items()}


def case(args, name: str, batch: int, budget: int | None, say) -> dict:
  a, b = args.layers or (tap_count(name), tap_count(name) + 1)
  full = aot_memory.TARGETS[name].num_hidden_layers
  label = "AR" if budget is None else f"best_nodes b{budget}"
  if args.full_layers:
    say(f"{name} x{batch} {label}: compiling {full} layers")
    ks, unknown, secs = program_kernels(name, full, batch, budget, args.context, args.attention, args.moe_dispatch)
    totals, by_source, how = hlo_cost.totals(ks), groups(ks), f"compiled at {full} layers"
  else:
    say(f"{name} x{batch} {label}: compiling {a} and {b} layers")
    ks_a, unknown, s_a = program_kernels(name, a, batch, budget, args.context, args.attention, args.moe_dispatch)
    ks_b, _, s_b = program_kernels(name, b, batch, budget, args.context, args.attention, args.moe_dispatch)
    totals = extrapolate(hlo_cost.totals(ks_a), hlo_cost.totals(ks_b), a, b, full)
    by_source, secs, how = scale_kernels(ks_a, ks_b, a, b, full), s_a + s_b, f"extrapolated from {a} and {b} layers"
    ks = ks_b
  time_model = {}
  for dev_name, dev in hlo_cost.DEVICES.items():
    launches = totals["kernels"] * dev.launch_s
    # The per-kernel bound summed at the compiled layer count, scaled like the bytes (each layer's kernels alike).
    per_kernel = hlo_cost.roofline(ks, dev)["kernel_time_s"]
    floor = (hlo_cost.totals(ks)["bytes_read"] + hlo_cost.totals(ks)["bytes_written"]) / dev.bandwidth
    bound = per_kernel * ((totals["bytes_read"] + totals["bytes_written"]) / dev.bandwidth) / floor if floor else 0.0
    time_model[dev_name] = {"time_ms": 1e3 * (bound + launches), "bytes_floor_ms": 1e3 * (totals["bytes_read"] +
                            totals["bytes_written"]) / dev.bandwidth, "flops_floor_ms": 1e3 * totals["flops"] / dev.peak,
                            "launch_ms": 1e3 * launches}
  return {"config": name, "batch": batch, "program": label, "budget": budget, "target": "h200", "layers": how,
          "compile_s": secs, "loops_without_trip_count": unknown, **{k: totals[k] for k in TOTAL_KEYS},
          "bytes": totals["bytes_read"] + totals["bytes_written"], "time_model": time_model,
          "by_source": by_source, "sources": group_sources(ks)}


def rows_for(results: list[dict], taus: dict[str, float]) -> list[dict]:
  """Table rows: one per program, the round against the AR step at its batch, tokens/s at each tau."""
  ar = {(r["config"], r["batch"]): r for r in results if r["budget"] is None}
  rows = []
  for r in results:
    base = ar.get((r["config"], r["batch"]))
    row = {"config": r["config"], "batch": r["batch"], "program": r["program"]}
    model = r["time_model"][r["target"]]["time_ms"]           # the target's (TPU chip, or H200) modelled time
    first = r["target"] if r["target"] in hlo_cost.TPU_DEVICES else "H200"
    if r["target"] in hlo_cost.TPU_DEVICES:
      row.update({"GB accessed": r["bytes"] / 1e9, "HBM GB": r["hbm_bytes"] / 1e9, "GFLOP": r["flops"] / 1e9,
                  f"{first} ms": model})
    else:
      row.update({"kernels": round(r["kernels"]), "GB read": r["bytes_read"] / 1e9,
                  "GB written": r["bytes_written"] / 1e9, "GFLOP": r["flops"] / 1e9,
                  "H200 ms": r["time_model"]["h200"]["time_ms"], "H100 ms": r["time_model"]["h100"]["time_ms"]})
    if base:
      row["bytes vs AR"] = r["bytes"] / base["bytes"]
      if "hbm_bytes" in r:
        row["HBM bytes vs AR"] = r["hbm_bytes"] / base["hbm_bytes"]
    # The published taus are budget 128's: other budgets get no projection (their tau is another).
    per_round = {"AR": 1.0} if r["budget"] is None else taus if r["budget"] == 128 else {}
    for k, tau in per_round.items():
      row[f"{first} tok/s ({k})"] = tau * r["batch"] / (model / 1e3)
    rows.append(row)
  return rows


def beyond_ar(results: list[dict], top: int = 10) -> dict[str, list[dict]]:
  """Per speculative program: the ``top`` groups (``group_key``) whose bytes per round exceed the AR step's at its
  batch the most, with the sources behind each."""
  ar = {(r["config"], r["batch"]): r for r in results if r["budget"] is None}
  out = {}
  for r in results:
    base = ar.get((r["config"], r["batch"]))
    if r["budget"] is None or base is None or "by_source" not in r:
      continue
    extra = {k: v - base["by_source"].get(k, 0.0) for k, v in r["by_source"].items()}
    best = sorted(((k, v) for k, v in extra.items() if v > 0), key=lambda kv: -kv[1])[:top]
    out[f"{r['config']} x{r['batch']} {r['program']}"] = [
        {"group": k, "gb_beyond_ar": v / 1e9, "sources": r["sources"].get(k, [])[:4]} for k, v in best]
  return out


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--configs", default="qwen3_8b", help=f"comma-separated: {', '.join(CONFIGS)}")
  p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
  p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 128, 256], help="tree nodes per slot")
  p.add_argument("--wide", nargs="*", default=["64:4"], help="BATCH:NODES extra rounds (e.g. 64 slots of 4 nodes)")
  p.add_argument("--context", type=int, default=4096, help="committed positions per slot")
  p.add_argument("--attention", default="xla", help="attention inside the round: xla | mosaic | pallas (GPU) | "
                                                    "tpu (the Mosaic TPU kernel, TPU targets)")
  p.add_argument("--target", default="h200", choices=["h200", *hlo_cost.TPU_DEVICES],
                 help="h200: compiled for one H200 (per kernel, with the H100 model beside it); v5e / v6e / v5p: "
                      "one round compiled for one TPU chip: its cost_analysis() and its HLO's HBM bytes (xla or "
                      "tpu attention)")
  p.add_argument("--moe-dispatch", choices=("auto", "gather", "kernel"), default="auto",
                 help="the sparse layers' expert dispatch (models/moe.py; auto: kernel on the H200, gather on a TPU)")
  p.add_argument("--layers", type=int, nargs=2, default=None, metavar=("A", "B"),
                 help="compile at A and B target layers and extrapolate (default: the head's taps and one more; "
                      "fewer layers than taps would change the head)")
  p.add_argument("--full-layers", action="store_true", help="compile every layer instead")
  p.add_argument("--max-budget-batch", type=int, default=16,
                 help="the --budgets rounds run at batches up to this (larger batches: --wide only)")
  p.add_argument("--out", default=None, help="JSON path (default bench/results/round_bytes.json)")
  args = p.parse_args(argv)
  tpu = args.target in hlo_cost.TPU_DEVICES
  if (args.attention not in ("xla", "tpu")) if tpu else (args.attention == "tpu"):
    p.error(f"--attention {args.attention} does not run on {args.target}: a TPU round takes xla or tpu, an H200 "
            "round xla, pallas or mosaic")
  try:
    deviceless.tpu_devices(args.target) if tpu else deviceless.require()
  except JetSpecError as e:
    p.exit(2, f"round_bytes: {e}\n")
  say = lambda s: print(s, file=sys.stderr, flush=True)
  cases = []
  for name in args.configs.split(","):
    if name not in CONFIGS:
      p.error(f"unknown config {name!r}; choose from {', '.join(CONFIGS)}")
    for batch in args.batches:
      cases.append((name, batch, None))
      if batch <= args.max_budget_batch:
        cases += [(name, batch, b) for b in args.budgets]
    for spec in args.wide:
      batch, nodes = (int(x) for x in spec.split(":"))
      cases.append((name, batch, nodes))
      if batch not in args.batches:
        cases.append((name, batch, None))
  results, skipped = [], []
  commit = commit_of(__file__)                 # the code that runs, even if a commit lands during the run
  for name, batch, budget in dict.fromkeys(cases):          # the JSON rewritten after each program
    try:
      results.append((tpu_case if tpu else case)(args, name, batch, budget, say))
    except jax.errors.JaxRuntimeError as e:                  # e.g. a v5e chip's 16 GB: the program does not fit
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      reason = str(e).split("\n")[0]
      say(f"{name} x{batch} {'AR' if budget is None else f'best_nodes b{budget}'}: not compiled, it does not fit "
          f"one {args.target}: {reason}")
      skipped.append({"config": name, "batch": batch, "budget": budget, "reason": reason})
    devices = {args.target: hlo_cost.TPU_DEVICES[args.target]} if tpu else hlo_cost.DEVICES
    out = {"machine": machine_info(), "commit": commit, "settings": vars(args),
           "devices": {k: dataclasses.asdict(v) for k, v in devices.items()},
           "rows": rows_for(results, TAUS), "beyond_ar": beyond_ar(results), "programs": results,
           "not_compiled": skipped}
    paths = save_results(out, args.out, NAME)
  print(format_table(out["rows"]))
  for prog, items in out["beyond_ar"].items():
    print(f"\n{prog}: largest byte consumers beyond the AR step (GB per round)")
    print(format_table([{"group": i["group"][-60:], "GB": i["gb_beyond_ar"],
                         "sources": "; ".join(s[-50:] for s in i["sources"][:2])} for i in items]))
  for path in paths:
    say(f"JSON: {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

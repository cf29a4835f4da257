"""How far the demo's numbers move with the CPU's float32 numerics.

XLA:CPU's float32 results depend on the CPU (vector width, the matmul blocking and thread partitioning it
picks), and training from scratch amplifies last-bit differences, so another CPU kind trains another
target and another head. This script stands in for other CPUs on one machine: it runs the demo (full or
``--quick``) once per numerics variant, each in its own work directory (stages are cached there: a rerun
only benchmarks), each in its own process with its own ``XLA_FLAGS`` and CPU affinity, and prints every
variant's head loss and tau per bank and mode beside the spread (max - min) across variants.

  python bench/numerics_spread.py --workdir /tmp/spread [--quick] [--variants default,threads1,sse4_2]

Variants (``VARIANTS``): ``default``; ``threads1`` (one CPU: XLA's thread pool of 1, other matmul
partitions); ``sse4_2`` / ``avx2`` (``--xla_cpu_max_isa``: narrower vectors); ``fast_math``
(``--xla_cpu_enable_fast_math``: other exp/log/division code). ``--set KEY=VALUE`` changes a demo setting
for every variant (for example ``--set head_lr=0.0015`` to see a worse head). The JSON goes to
bench/results/numerics_spread.json (or ``--out``); docs/demo.md has the measured table.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "default": ("", None),
    "threads1": ("", 1),
    "sse4_2": ("--xla_cpu_max_isa=SSE4_2", None),
    "avx2": ("--xla_cpu_max_isa=AVX2", None),
    "fast_math": ("--xla_cpu_enable_fast_math=true", None),
}
NAME = "numerics_spread"


def child(workdir: str, quick: bool, overrides: dict) -> None:
  """Run the demo in this process (its numerics set by the parent) and print its result's key numbers."""
  from jetspec_jax import demo
  s = dataclasses.replace(demo.QUICK if quick else demo.DemoSettings(), **overrides)
  res = demo.run(workdir, s, quiet=True)
  out = {"head_loss": res["head_loss_tail"], "seconds": res["seconds"], "ok": res["ok"],
         "tau": {bank: {name: m["tau"] for name, m in r["modes"].items() if name != "ar"}
                 for bank, r in res["bench"].items()},
         "speedup": {bank: {name: m["speedup_vs_ar"] for name, m in r["modes"].items() if name != "ar"}
                     for bank, r in res["bench"].items()},
         "ar_ties": {bank: {name: m["ar_ties"] for name, m in r["modes"].items() if m.get("ar_ties")}
                     for bank, r in res["bench"].items()},
         "parted_elsewhere": {bank: {name: m["parted_elsewhere"] for name, m in r["modes"].items()
                                     if m.get("parted_elsewhere")} for bank, r in res["bench"].items()},
         "ar_batch_invariance": {bank: r["ar_batch_invariance"] for bank, r in res["bench"].items()}}
  print("RESULT " + json.dumps(out))


def run_variant(name: str, workdir: str, quick: bool, sets: list[str]) -> dict:
  flags, cpus = VARIANTS[name]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # the test suite's environment for the reduced demo: 8 fake devices (they do not change the bits)
  env["XLA_FLAGS"] = " ".join(f for f in (flags, "--xla_force_host_platform_device_count=8" if quick else "") if f)
  cmd = [sys.executable, os.path.abspath(__file__), "--child", os.path.join(workdir, name)]
  cmd += (["--quick"] if quick else []) + [a for s in sets for a in ("--set", s)]
  first_cpus = sorted(os.sched_getaffinity(0))[:cpus] if cpus else None
  t = time.perf_counter()
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                        preexec_fn=(lambda: os.sched_setaffinity(0, first_cpus)) if first_cpus else None)
  line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
  if proc.returncode or line is None:
    raise SystemExit(f"error: variant {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  return {**json.loads(line[len("RESULT "):]), "xla_flags": env["XLA_FLAGS"], "cpus": cpus or os.cpu_count(),
          "wall_s": time.perf_counter() - t}


def spread_table(results: dict) -> list[dict]:
  """One row per (bank, mode): each variant's tau, and max - min across them."""
  names = list(results)
  first = results[names[0]]
  rows = []
  for bank, modes in first["tau"].items():
    for mode in modes:
      taus = {v: results[v]["tau"][bank][mode] for v in names}
      rows.append({"bank": bank, "mode": mode, **taus, "spread": max(taus.values()) - min(taus.values())})
  rows.append({"bank": "head loss", "mode": "", **{v: results[v]["head_loss"] for v in names},
               "spread": max(r["head_loss"] for r in results.values()) - min(r["head_loss"] for r in results.values())})
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", default="/tmp/jetspec_numerics_spread", help="one subdirectory per variant")
  p.add_argument("--variants", default="default,threads1,sse4_2,fast_math",
                 help=f"comma-separated, from {', '.join(VARIANTS)}")
  p.add_argument("--quick", action="store_true", help="the reduced demo (the test suite's)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a demo setting, every variant")
  p.add_argument("--out", default=None, help="JSON path (default bench/results/numerics_spread.json)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  overrides = {}
  for item in a.set:
    key, _, value = item.partition("=")
    try:
      overrides[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      p.error(f"--set {item!r}: the value must be a Python literal (a number, a string in quotes, a tuple)")
  if a.child:
    return child(a.child, a.quick, overrides)
  names = [v.strip() for v in a.variants.split(",") if v.strip()]
  if unknown := [v for v in names if v not in VARIANTS]:
    p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
  from jetspec_jax import bench
  results = {}
  for name in names:
    print(f"[{name}] XLA_FLAGS={VARIANTS[name][0] or '(none)'} cpus={VARIANTS[name][1] or 'all'}", flush=True)
    results[name] = run_variant(name, a.workdir, a.quick, a.set)
    r = results[name]
    ties = [f"{bank} {mode} prompt {t['prompt']} token {t['token']} ({t['ulps']:.0f} ulps)"
            for bank, modes in r["ar_ties"].items() for mode, ts in modes.items() for t in ts]
    print(f"  head loss {r['head_loss']:.3f}, {r['wall_s']:.0f}s, {'OK' if r['ok'] else 'FAILED'}; ties: "
          f"{'; '.join(ties) or 'none'}", flush=True)
  rows = spread_table(results)
  print(bench.format_table(rows))
  report = {"machine": bench.machine_info(), "quick": a.quick, "overrides": overrides, "variants": results,
            "table": rows}
  print("\n".join(bench.save_results(report, a.out, NAME)))


if __name__ == "__main__":
  main()

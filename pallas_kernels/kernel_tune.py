"""Tile-size sweep of the Pallas tree-attention kernel (beside the kernel and its tuning tables), run by
``bench/gpu_check.py``'s tune section.

For a few problem shapes (N tree nodes x prefix length, Qwen3-8B attention), time the kernel under
each candidate launch configuration (block_r, block_k, num_warps, num_stages, and the rule that picks
the prefix splits: target_programs, min_split_keys) and report every
time, the fastest configuration per shape against the default one, and a tuning table
(``pallas_kernels.tuning.KernelTuning``) that gives each row count (GQA group x N) of the sweep the
configuration that does best over its shapes. A configuration that is illegal for a shape
(``launch_shapes`` refuses it) or fails to compile is recorded with its error; the sweep goes on.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from pallas_kernels.tree_attention import tree_attention
from pallas_kernels.tuning import FIELDS, KernelTuning, LaunchConfig

DEFAULT = LaunchConfig()
# Hopper candidates: the default, deeper pipelines, wider key blocks, more warps, other row tiles; then
# more prefix splits (shorter ones, more programs) for the bandwidth-bound small trees.
CONFIGS = tuple(LaunchConfig(*values) for values in (
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3),
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (32, 64, 4, 2), (32, 128, 4, 3), (16, 64, 4, 2))) + (
    LaunchConfig(min_split_keys=256), LaunchConfig(target_programs=528, min_split_keys=256),
    LaunchConfig(block_k=128, num_stages=3, target_programs=528, min_split_keys=256))
# (N, prefix): decode and the budgets 16 and 128 at the decode benchmarks' 1k prefix and at 4k+.
SHAPES = ((1, 1024), (1, 16384), (16, 1024), (16, 4096), (128, 1024), (128, 4096))


def tune_section(make_inputs: Callable, timer: Callable, *, group: int, shapes=SHAPES, configs=CONFIGS,
                 interpret: bool = False, device_kind: str = "", expired: Callable[[], bool] = lambda: False) -> dict:
  """Times every config on every shape.

  make_inputs(n, prefix) -> kernel args; timer(fn, args) -> seconds per call; group: query heads per kv
  head of those inputs; expired() -> True once the caller's time budget is spent (the remaining rows are
  recorded as skipped). Returns {"rows": [{n, prefix, **config, us | error}], "best": [{n, prefix, **best
  config, us, default_us, speedup_vs_default}], "table": KernelTuning.to_json() of ``tuning_table``} (a shape
  whose every config failed has no "best" row)."""
  rows, best = [], []
  for n, prefix in shapes:
    args = None
    timed = []
    for config in configs:
      row = dict(n=n, prefix=prefix, **dataclasses.asdict(config))
      if expired():
        rows.append({**row, "skipped": "time budget spent"})
        continue
      args = make_inputs(n, prefix) if args is None else args     # once per problem, shared by its configs
      try:
        only = KernelTuning(rules=((1, config),))        # this config, whatever table is active
        fn = jax.jit(lambda *a, only=only: tree_attention(*a, interpret=interpret, tuning=only))
        row["us"] = timer(fn, args) * 1e6
        timed.append(row)
      except Exception as e:  # noqa: BLE001  (an illegal config, JetSpecError, or a compile failure is a result)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
      rows.append(row)
    if timed:
      fastest = min(timed, key=lambda r: r["us"])
      default = next((r for r in timed if _config(r) == DEFAULT), None)
      best.append({**fastest, "default_us": None if default is None else default["us"],
                   "speedup_vs_default": None if default is None else default["us"] / fastest["us"]})
  table = tuning_table(rows, group=group, device_kind=device_kind)
  return dict(rows=rows, best=best, table=None if table is None else table.to_json())


def _config(row: dict) -> LaunchConfig:
  return LaunchConfig(**{k: row[k] for k in FIELDS})


def tuning_table(rows: list[dict], *, group: int, device_kind: str = "") -> KernelTuning | None:
  """A table with one rule per row count (group x N) of the swept shapes: the configuration, among those
  that ran on every shape of that row count, with the least sum over those shapes of its time relative to
  the shape's fastest (ties: the earlier configuration of the sweep). None when nothing ran."""
  by_rows: dict[int, dict[tuple, list[dict]]] = {}
  for row in rows:
    if "us" in row:
      by_rows.setdefault(group * row["n"], {}).setdefault((row["n"], row["prefix"]), []).append(row)
  rules = []
  for tile_rows, problems in sorted(by_rows.items()):
    score: dict[LaunchConfig, float] = {}
    counted: dict[LaunchConfig, int] = {}
    for timed in problems.values():
      fastest = min(r["us"] for r in timed)
      for r in timed:
        config = _config(r)
        score[config] = score.get(config, 0.0) + r["us"] / fastest
        counted[config] = counted.get(config, 0) + 1
    everywhere = [c for c in score if counted[c] == len(problems)]     # insertion order: the sweep's
    if everywhere:
      rules.append((tile_rows, min(everywhere, key=score.get)))
  return KernelTuning(rules=tuple(rules), device_kind=device_kind) if rules else None

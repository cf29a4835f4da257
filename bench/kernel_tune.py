"""Tile-size sweep of the Pallas tree-attention kernel, run by ``bench/gpu_check.py --tune``.

For a few problem shapes (N tree nodes x prefix length, Qwen3-8B attention), time the kernel under
each candidate launch configuration (block_r, block_k, num_warps, num_stages) and report every
time plus, per shape, the fastest configuration against the default one. A configuration that is
illegal for a shape (``launch_shapes`` refuses it) or fails to compile is recorded with its error;
the sweep goes on.
"""
from __future__ import annotations

from typing import Callable

import jax

from pallas_kernels.tree_attention import tree_attention

DEFAULT = dict(block_r=64, block_k=64, num_warps=4, num_stages=2)
# Hopper candidates: the default, deeper pipelines, wider key blocks, more warps, other row tiles.
CONFIGS = tuple(dict(zip(DEFAULT, values)) for values in (
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3),
    (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (32, 64, 4, 2), (32, 128, 4, 3), (16, 64, 4, 2)))
SHAPES = ((1, 16384), (16, 4096), (128, 1024), (128, 4096))


def tune_section(make_inputs: Callable, timer: Callable, *, shapes=SHAPES, configs=CONFIGS,
                 interpret: bool = False) -> dict:
  """Times every config on every shape.

  make_inputs(n, prefix) -> kernel args; timer(fn, args) -> seconds per call. Returns
  {"rows": [{n, prefix, **config, us | error}], "best": [{n, prefix, **best config, us, default_us,
  speedup_vs_default}]} (a shape whose every config failed has no "best" row)."""
  rows, best = [], []
  for n, prefix in shapes:
    args = make_inputs(n, prefix)                      # once per problem, shared by its configs
    timed = []
    for config in configs:
      row = dict(n=n, prefix=prefix, **config)
      try:
        fn = jax.jit(lambda *a, config=config: tree_attention(*a, interpret=interpret, **config))
        row["us"] = timer(fn, args) * 1e6
        timed.append(row)
      except Exception as e:  # noqa: BLE001  (an illegal config, JetSpecError, or a compile failure is a result)
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
      rows.append(row)
    if timed:
      fastest = min(timed, key=lambda r: r["us"])
      default = next((r for r in timed if all(r[k] == v for k, v in DEFAULT.items())), None)
      best.append({**fastest, "default_us": None if default is None else default["us"],
                   "speedup_vs_default": None if default is None else default["us"] / fastest["us"]})
  return dict(rows=rows, best=best)

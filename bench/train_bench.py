"""Draft-head training throughput: sequences/s, tokens/s, peak host memory, the step's scratch
memory (XLA's memory analysis of the compiled step) and its FLOP count (XLA's cost analysis), so
the same script reports MFU on a GPU (pass --peak-tflops, or it is looked up for H100/H200).

  python bench/train_bench.py                 # the tiny config on a synthetic world (CPU, ~2 min)
  python bench/train_bench.py --config configs/qwen3_8b.py --config.target=CKPT --config.data.path=DATA

Timing: the first step (compile) is excluded and reported; the median of --repeats windows of
--steps steps each is reported. Prints a table and writes JSON (--out, and $OUT/train_bench.json).
The synthetic world is the test suite's (tests/trainer_world.py of this checkout).
"""
from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}   # dense bf16


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="tiny")
  p.add_argument("--steps", type=int, default=10, help="steps per timed window")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--peak-tflops", type=float, default=None)
  p.add_argument("--out", default=None, help="JSON path (default bench/results/train_bench.json)")
  args, overrides = p.parse_known_args(argv)
  import jax
  import numpy as np
  from jetspec_jax import bench
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jetspec_jax import convert
  from jetspec_jax.config import parse_dtype
  from jetspec_jax.tokenizer import load_tokenizer
  from jetspec_jax.train import records, runtime, trainer
  from jetspec_jax.train.batching import BatchIterator
  from jetspec_jax.train.config_file import apply_override, load_config

  c = load_config(args.config, [o for o in overrides if o.startswith("--config.")])
  if not c.target:                                   # synthetic world: tokenizer, random target, chat data
    world_py = Path(__file__).parents[1] / "tests" / "trainer_world.py"
    spec = importlib.util.spec_from_file_location("trainer_world", world_py)
    trainer_world = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer_world)
    world = trainer_world.build(tempfile.mkdtemp(prefix="train_bench_"), hidden=64)
    c.target, c.data.path = world["target"], world["data"]
    if not any(o.startswith("--config.data.seq_len") for o in overrides):
      apply_override(c, "data.seq_len=128")
  tc = c.train
  mesh = trainer.build_mesh(c.mesh)
  target_cfg, target_params, side = convert.load_target(c.target, parse_dtype(tc.target_dtype), mesh)
  tok = load_tokenizer(side)
  head_cfg = trainer.build_head_config(c, target_cfg, tok.mask_token_id)
  rows = records.prepare_dataset(c.data.path, tok, tempfile.mkdtemp(prefix="train_bench_data_"),
                                 seq_len=c.data.seq_len, pack=c.data.pack)
  tx = trainer.optimizer_config(tc).build()
  state = trainer.init_state(head_cfg, tx, c.seed, mesh)
  sharding = NamedSharding(mesh, P("data", None))
  step = trainer.compile_step(state, target_params, target_cfg=target_cfg, head_cfg=head_cfg, tc=tc,
                              tx=tx, mesh=mesh)
  batches = BatchIterator(rows, tc.batch_size // jax.process_count(), seed=0)

  def batch():
    return runtime.global_batch(next(batches), sharding, trainer.BATCH_FIELDS)

  b0 = batch()
  flops = None
  t0 = time.perf_counter()
  compiled = step.lower(state, b0, target_params).compile()
  compile_s = time.perf_counter() - t0
  try:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0)) or None
  except Exception as e:                            # cost analysis is best effort on some backends
    print(f"(no cost analysis: {type(e).__name__})", file=sys.stderr)
  try:
    temp_gb = compiled.memory_analysis().temp_size_in_bytes / 1e9   # XLA's scratch for one step
  except Exception as e:                            # memory analysis is best effort on some backends
    temp_gb = None
    print(f"(no memory analysis: {type(e).__name__})", file=sys.stderr)
  state, m = step(state, b0, target_params)
  jax.block_until_ready(m)
  windows = []
  for _ in range(args.repeats):
    feeds = [batch() for _ in range(args.steps)]
    t0 = time.perf_counter()
    for f in feeds:
      state, m = step(state, f, target_params)
    jax.block_until_ready(m)
    windows.append((time.perf_counter() - t0) / args.steps)
  step_s = statistics.median(windows)
  kind = jax.devices()[0].device_kind
  peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)
  res = {"config": args.config, "device": kind, "devices": jax.device_count(), "batch_size": tc.batch_size,
         "seq_len": c.data.seq_len, "num_anchors": tc.num_anchors, "block_size": head_cfg.block_size,
         "step_s": step_s, "compile_s": compile_s, "sequences_per_s": tc.batch_size / step_s,
         "tokens_per_s": tc.batch_size * c.data.seq_len / step_s, "step_flops": flops,
         "achieved_tflops": flops / step_s / 1e12 if flops else None,
         "mfu": flops / step_s / 1e12 / (peak * jax.device_count()) if flops and peak else None,
         "step_temp_gb": temp_gb, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2,
         "final_loss": float(np.asarray(m["loss"]))}
  print(bench.format_table([{"metric": k, "value": v} for k, v in res.items()]))
  res["machine"] = bench.machine_info()
  for path in bench.save_results(res, args.out, "train_bench"):
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""GPU check of JetSpec-JAX: correctness and speed on the device, printed and saved as JSON.

Kernel section: the Pallas tree-attention kernel against the XLA reference for Qwen3-8B attention
(B=1, 32 query heads, 8 kv heads, head_dim 128, bf16), N tree nodes x prefix length. Per row:
error vs XLA, the prefix splits the kernel chose, kernel time with those splits and with one split
(no flash-decoding), XLA time (each the device time per call: ``--reps`` calls inside one jitted
loop, median over ``--iters`` samples), and the kernel's achieved bandwidth counting the K/V of
prefix + N keys read once, as a fraction of the device's HBM bandwidth. Because a tree of N nodes
does 4 * N * group FLOPs per K/V byte read (Qwen3-8B: group 4, so N = 128 is 512 FLOP/B, past an
H200's ridge of ~206 FLOP/B), large trees are compute-bound: each row also gives the roofline floor
max(bytes / HBM bandwidth, FLOPs / peak bf16 tensor FLOP/s), which bound sets it, and the kernel's
fraction of that floor.

  python bench/gpu_check.py                 # on the GPU; JSON to $OUT/gpu_check.json when $OUT is set
  python bench/gpu_check.py --smoke         # on CPU: tiny shapes, kernel in interpret mode

Exits non-zero when a kernel row's relative error exceeds its dtype's tolerance.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script from anywhere

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.attention import xla_attention
from pallas_kernels.tree_attention import launch_shapes, tree_attention

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}   # matched against jax device_kind
DENSE_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}   # SXM tensor-core peak, no sparsity
REL_TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-5}


@dataclasses.dataclass(frozen=True)
class AttentionShape:
  """One model's attention: batch, query heads, kv heads, head_dim, dtype name."""
  batch: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  dtype: str


QWEN3_8B = AttentionShape(batch=1, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
SMOKE = AttentionShape(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
SWEEP = {"full": ((1, 16, 64, 128, 256), (1024, 4096, 16384)), "smoke": ((1, 5), (3, 600))}


def device_peak(table: dict[str, float], device_kind: str, flag: float | None, unit: float) -> float | None:
  """A device peak: the flag (in ``unit``s) if given, else by device kind from ``table``, else unknown."""
  if flag is not None:
    return flag * unit
  return next((peak for name, peak in table.items() if name in device_kind), None)


def random_tree_mask(rng: np.random.Generator, batch: int, num_nodes: int) -> np.ndarray:
  """[batch, N, N] ancestor masks of random trees (node 0 the root, parents before children)."""
  masks = np.zeros((batch, num_nodes, num_nodes), bool)
  for b in range(batch):
    masks[b] = np.eye(num_nodes, dtype=bool)
    for i in range(1, num_nodes):
      masks[b, i] |= masks[b, rng.integers(0, i)]
  return masks


def make_inputs(shape: AttentionShape, num_nodes: int, prefix: int, seed: int):
  """(q, k_cache, v_cache, prefix_len, block_mask) with the cache exactly prefix + N long."""
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(shape.dtype)
  cache = (shape.batch, shape.num_kv_heads, prefix + num_nodes, shape.head_dim)
  normal = lambda dims: jnp.asarray(rng.standard_normal(dims, np.float32), dtype)
  return (normal((shape.batch, num_nodes, shape.num_q_heads, shape.head_dim)), normal(cache),
          normal(cache), jnp.full((shape.batch,), prefix, jnp.int32),
          jnp.asarray(random_tree_mask(rng, shape.batch, num_nodes)))


def median_seconds(fn, args, *, iters: int, reps: int) -> float:
  """Median over ``iters`` samples of one call's time; a sample is ``reps`` back-to-back calls
  then block_until_ready, so host dispatch overlaps device work. Warm-up (compile) excluded."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    start = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / reps)
  return statistics.median(samples)


def loop_seconds(fn, args, *, iters: int, reps: int) -> float:
  """Device time of one call: the median over ``iters`` samples of one jitted ``fori_loop`` running
  ``fn`` ``reps`` times, divided by ``reps``, so the host's per-call dispatch (tens of us in a
  sandbox) is paid once per sample. Each iteration adds i * 1e-30 (no change in value, but not
  known to the compiler) to one element of the first input, so XLA cannot hoist the call out of the
  loop as loop-invariant."""
  def many(*inputs):
    def body(i, acc):
      first = inputs[0]
      nudged = first.at[(0,) * first.ndim].add((i * 1e-30).astype(first.dtype))
      return acc + fn(nudged, *inputs[1:]).reshape(-1)[0].astype(jnp.float32)
    return jax.lax.fori_loop(0, reps, body, jnp.zeros((), jnp.float32))
  return median_seconds(jax.jit(many), args, iters=iters, reps=1) / reps


def kernel_section(*, smoke: bool, iters: int, reps: int, hbm: float | None, flops_peak: float | None,
                   tuning: dict) -> list[dict]:
  """Kernel vs XLA over the N x prefix sweep; one row (a dict) per problem."""
  shape = SMOKE if smoke else QWEN3_8B
  node_counts, prefixes = SWEEP["smoke" if smoke else "full"]
  kernel = jax.jit(lambda *a: tree_attention(*a, interpret=smoke, **tuning))
  one_split = jax.jit(lambda *a: tree_attention(*a, interpret=smoke, **{**tuning, "num_splits": 1}))
  reference = jax.jit(xla_attention)
  rows = []
  for num_nodes in node_counts:
    for prefix in prefixes:
      rows.append(guarded(dict(n=num_nodes, prefix=prefix), lambda: kernel_row(
          shape, num_nodes, prefix, kernel, one_split, reference, iters=iters, reps=reps, hbm=hbm,
          flops_peak=flops_peak, tuning=tuning)))
      print(f"  kernel N={num_nodes} prefix={prefix}: " + (rows[-1].get("error") or
            f"{rows[-1]['kernel_us']:.1f} us (XLA {rows[-1]['xla_us']:.1f} us)"), file=sys.stderr, flush=True)
  return rows


def guarded(key: dict, measure) -> dict:
  """``key`` plus the measured columns, or plus ``error`` when the measurement raised: one failing
  shape (a Triton compile error, out of memory) must not cost the rest of a one-shot GPU run."""
  try:
    return {**key, **measure()}
  except Exception as e:  # noqa: BLE001  (recorded in the row and counted as a failure)
    return {**key, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def kernel_row(shape, num_nodes, prefix, kernel, one_split, reference, *, iters, reps, hbm, flops_peak,
               tuning) -> dict:
  """One problem of the kernel sweep: errors, times, bandwidth and roofline columns."""
  itemsize = jnp.dtype(shape.dtype).itemsize
  args = make_inputs(shape, num_nodes, prefix, seed=1000 * num_nodes + prefix)
  out = np.asarray(kernel(*args), np.float32)
  ref = np.asarray(reference(*args), np.float32)
  max_err = float(np.max(np.abs(out - ref)))
  kernel_s = loop_seconds(kernel, args, iters=iters, reps=reps)
  one_split_s = loop_seconds(one_split, args, iters=iters, reps=reps)
  splits = launch_shapes(shape.batch, num_nodes, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                         cache_len=prefix, **tuning).num_splits
  xla_s = loop_seconds(reference, args, iters=iters, reps=reps)
  kv_bytes = 2 * shape.batch * shape.num_kv_heads * (prefix + num_nodes) * shape.head_dim * itemsize
  flops = 4 * shape.batch * num_nodes * shape.num_q_heads * (prefix + num_nodes) * shape.head_dim
  floors = {"memory": None if hbm is None else kv_bytes / hbm,
            "compute": None if flops_peak is None else flops / flops_peak}
  bound = max((k for k in floors if floors[k] is not None), key=floors.get, default=None)
  return dict(
      max_abs_err=max_err,
      rel_err=max_err / float(np.max(np.abs(ref))), splits=splits, kernel_us=kernel_s * 1e6,
      one_split_us=one_split_s * 1e6, xla_us=xla_s * 1e6,
      speedup=xla_s / kernel_s, kv_bytes=kv_bytes, kernel_gbps=kv_bytes / kernel_s / 1e9,
      hbm_fraction=None if hbm is None else kv_bytes / kernel_s / hbm,
      bound=bound or "-", floor_us=None if bound is None else floors[bound] * 1e6,
      roofline_fraction=None if bound is None else floors[bound] / kernel_s)


def format_table(rows: list[dict]) -> str:
  """Rows as an aligned text table (floats to 4 significant digits)."""
  columns = list(dict.fromkeys(c for row in rows for c in row))    # rows with an error have fewer
  cell = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
  cells = [columns] + [[cell(row.get(c)) for c in columns] for row in rows]
  widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
  return "\n".join("  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in cells)


def decode_section(*, smoke: bool, layers: int, budgets: tuple[int, ...], max_new: int, attn_impl: str) -> list[dict]:
  """Jitted decode rounds on a Qwen3-8B-shaped random-weight model (``layers`` of its 36 layers; per-layer
  shapes are Qwen3-8B's, so the verify/AR ratio does not depend on the layer count): ms per AR step and
  per speculative round (draft + tree + verify + accept + commit) for each budget, batch 1, bf16."""
  from jetspec_jax.config import Qwen3Config
  from jetspec_jax.decode.loop import generate_ar
  from jetspec_jax.decode.speculative import TreeConfig, generate_speculative
  from jetspec_jax.models import draft_head, qwen3
  if smoke:
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    dtype, prompt_len, head_layers = jnp.float32, 16, 1
  else:
    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6)
    dtype, prompt_len, head_layers = jnp.bfloat16, 1024, 5
  params = qwen3.init_target(cfg, jax.random.key(0), dtype)
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=head_layers, block_size=16)
  head = draft_head.init_head(head_cfg, jax.random.key(1), dtype)
  prompt = [np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len).tolist()]
  rows = []

  def timed(fn):
    fn()                                  # compile + warm-up
    return fn()

  def ar_row():
    ar = timed(lambda: generate_ar(params, cfg, prompt, max_new_tokens=max_new, eos_ids=(), attn_impl=attn_impl))
    return dict(ms_per_round=1e3 * ar["decode_s"] / max(ar["target_forwards"] - 1, 1), ratio_to_ar_step=1.0, tau=1.0)

  def tree_row(budget):
    tree = TreeConfig("accum_logp", budget, 7, head_cfg.depth)
    out = timed(lambda: generate_speculative(params, cfg, head, head_cfg, prompt, max_new_tokens=max_new,
                                             tree_cfg=tree, eos_ids=(), attn_impl=attn_impl))
    ms = 1e3 * out["decode_s"] / max(out["rounds"], 1)
    ar_ms = rows[0].get("ms_per_round")
    return dict(ms_per_round=ms, ratio_to_ar_step=None if ar_ms is None else ms / ar_ms, tau=out["tau"])

  rows.append(guarded(dict(mode="ar", nodes=1), ar_row))
  for budget in budgets:
    rows.append(guarded(dict(mode=f"tree_b{budget}", nodes=budget), lambda: tree_row(budget)))
  return rows


def write_report(report: dict) -> None:
  """The report as JSON in $OUT/gpu_check.json (when OUT is set), replaced whole each time."""
  if out_dir := os.environ.get("OUT"):
    path = Path(out_dir) / "gpu_check.json"
    path.with_suffix(".tmp").write_text(json.dumps(report, indent=2))
    path.with_suffix(".tmp").replace(path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
  """Runs every section, prints the tables, writes $OUT/gpu_check.json; 1 if a check failed."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernel in interpret mode (CPU)")
  parser.add_argument("--hbm-gbps", type=float, help="peak HBM bandwidth in GB/s for unknown devices")
  parser.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s for unknown devices")
  parser.add_argument("--iters", type=int, default=20, help="timing samples per measurement")
  parser.add_argument("--reps", type=int, default=50, help="calls inside one jitted loop per timing sample")
  parser.add_argument("--block-r", type=int, default=64)
  parser.add_argument("--block-k", type=int, default=64)
  parser.add_argument("--num-warps", type=int, default=4)
  parser.add_argument("--num-stages", type=int, default=2)
  parser.add_argument("--num-splits", type=int, default=None, help="prefix splits (default: chosen per problem)")
  parser.add_argument("--decode-layers", type=int, default=12, help="layers of the Qwen3-8B-shaped model")
  parser.add_argument("--decode-budgets", default="16,64,128")
  parser.add_argument("--decode-new-tokens", type=int, default=33)
  parser.add_argument("--skip-decode", action="store_true")
  args = parser.parse_args(argv)
  if args.smoke:
    args.iters, args.reps = min(args.iters, 3), 1

  device = jax.devices()[0]
  hbm = device_peak(HBM_BYTES_PER_S, device.device_kind, args.hbm_gbps, 1e9)
  flops_peak = device_peak(DENSE_BF16_FLOPS, device.device_kind, args.peak_tflops, 1e12)
  tuning = dict(block_r=args.block_r, block_k=args.block_k, num_warps=args.num_warps,
                num_stages=args.num_stages, num_splits=args.num_splits)
  rows = kernel_section(smoke=args.smoke, iters=args.iters, reps=args.reps, hbm=hbm, flops_peak=flops_peak,
                        tuning=tuning)
  shape = SMOKE if args.smoke else QWEN3_8B
  failed = [r for r in rows if "error" in r or not r["rel_err"] <= REL_TOLERANCE[shape.dtype]]

  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"HBM {'unknown' if hbm is None else f'{hbm / 1e12:.2f} TB/s'}, "
        f"bf16 peak {'unknown' if flops_peak is None else f'{flops_peak / 1e12:.0f} TFLOP/s'}")
  print(f"\nkernel vs XLA, {shape}, tuning {tuning}:")
  print(format_table(rows))
  print(f"\nkernel rows measured with errors within {REL_TOLERANCE[shape.dtype]:g}: "
        f"{len(rows) - len(failed)}/{len(rows)}")

  report = dict(device_kind=device.device_kind, platform=device.platform, jax_version=jax.__version__,
                hbm_bytes_per_s=hbm, dense_bf16_flops=flops_peak, smoke=args.smoke, iters=args.iters, reps=args.reps,
                kernel=dict(shape=dataclasses.asdict(shape), tuning=tuning, rows=rows))
  write_report(report)                      # the kernel rows survive a failure or time-out below
  if not args.skip_decode:
    impl = "pallas_interpret" if args.smoke else ("pallas" if device.platform == "gpu" else "xla")
    drows = decode_section(smoke=args.smoke, layers=args.decode_layers, max_new=args.decode_new_tokens,
                           budgets=tuple(int(b) for b in args.decode_budgets.split(",")), attn_impl=impl)
    print(f"\njitted decode round, Qwen3-8B-shaped ({args.decode_layers} layers), batch 1, attention {impl}:")
    print(format_table(drows))
    report["decode"] = dict(layers=args.decode_layers, attention=impl, rows=drows)
    failed += [r for r in drows if "error" in r]
    write_report(report)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())

"""GPU check of JetSpec-JAX: speed (and the kernel's error against XLA) on the device, printed and saved as
JSON.

Kernel section: the Pallas tree-attention kernels (Triton, and Mosaic GPU: ``mosaic_*`` columns) against the XLA
reference for Qwen3-8B attention
(B=1, 32 query heads, 8 kv heads, head_dim 128, bf16), N tree nodes x prefix length. Per row:
error vs XLA, the prefix splits the kernel chose, kernel time with those splits and with one split
(no flash-decoding), XLA time (each the device time per call: ``--reps`` calls inside one jitted
loop, ``--unroll`` per iteration, median over ``--iters`` samples), and the kernel's achieved
bandwidth counting the K/V of prefix + N keys read once, as a fraction of the device's HBM
bandwidth. Because a tree of N nodes does 4 * N * group FLOPs per K/V byte read (Qwen3-8B: group 4,
so N = 128 is 512 FLOP/B, past an H200's ridge of ~206 FLOP/B), large trees are compute-bound: each
row also gives the roofline floor max(bytes / HBM bandwidth, FLOPs / peak bf16 tensor FLOP/s), which
bound sets it, and the kernel's fraction of that floor.

Tune section (second): ``pallas_kernels/kernel_tune.py``'s sweep of launch configurations; the tuning
table it gives is saved as $OUT/kernel_tuning.json and passed (in the ``AttentionImpl``) to the model
sections that follow (``--keep-tuning``: not). Phases section: each phase of a round timed alone, through the functions
the decode loops run (``verify.verify_tree``, the head's ``draft_logits``, ``tree.build_tree``). Decode
section: ms per AR step and per speculative round on a Qwen3-8B-shaped random-weight model.
Profile section: the same model's decode loops under ``jax.profiler``, summarized per round by
``jetspec_jax/trace_summary.py`` (device busy time vs span, kernels, time per named-scope phase, top
kernels); the raw traces go to $OUT/traces/<mode>.json.gz.

  python bench/gpu_check.py                 # on the GPU; JSON to $OUT/gpu_check.json when $OUT is set
  python bench/gpu_check.py --smoke         # on CPU: tiny shapes, kernel in interpret mode

It measures and reports; it exits 0 unless it crashes. A row whose measurement raised records the error;
rows that would start after the ``--minutes`` budget (default 7) are recorded as skipped. The kernel's
tolerance checks against XLA on the device are pytest tests (``tests/test_gpu.py``, marked ``gpu``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import bench, trace_summary
from jetspec_jax.attention import AttentionImpl
from pallas_kernels import kernel_tune
from pallas_kernels.reference import xla_attention
from pallas_kernels import tuning as kernel_tuning
from pallas_kernels.tree_attention import launch_shapes, resolve_config, tree_attention
from pallas_kernels import tree_attention_mgpu

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}   # matched against jax device_kind
DENSE_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}   # SXM tensor-core peak, no sparsity


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


def random_tree(rng: np.random.Generator, batch: int, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
  """(parents [batch, N], ancestor masks [batch, N, N]) of random trees (node 0 the root, parents before children)."""
  parents = np.zeros((batch, num_nodes), np.int32)
  masks = np.zeros((batch, num_nodes, num_nodes), bool)
  for b in range(batch):
    masks[b] = np.eye(num_nodes, dtype=bool)
    for i in range(1, num_nodes):
      parents[b, i] = rng.integers(0, i)
      masks[b, i] |= masks[b, parents[b, i]]
  return parents, masks


def make_inputs(shape: AttentionShape, num_nodes: int, prefix: int, seed: int):
  """(q, k_cache, v_cache, prefix_len, block_mask) with the cache exactly prefix + N long."""
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(shape.dtype)
  cache = (shape.batch, shape.num_kv_heads, prefix + num_nodes, shape.head_dim)
  normal = lambda dims: jnp.asarray(rng.standard_normal(dims, np.float32), dtype)
  return (normal((shape.batch, num_nodes, shape.num_q_heads, shape.head_dim)), normal(cache),
          normal(cache), jnp.full((shape.batch,), prefix, jnp.int32),
          jnp.asarray(random_tree(rng, shape.batch, num_nodes)[1]))


def carried_seconds(step, consts, carry, *, iters: int, reps: int, unroll: int) -> float:
  """Device time of one ``step(consts, carry) -> (carry, out)`` call: the median over ``iters`` samples of one
  jitted ``fori_loop`` making ``reps`` chained calls (rounded down to a multiple of ``unroll``), divided by the
  calls made, so the host's per-call dispatch is paid once per sample. Each loop iteration makes ``unroll``
  calls: on a GPU every iteration costs a host sync (~10 us), which ``unroll`` calls then share. The carry
  threads through every call (a KV cache is updated in place, never copied), so XLA can neither hoist a
  call out of the loop nor merge two calls; ``out``'s first element is summed so no call is dead code."""
  unroll = max(1, min(unroll, reps))
  loops = reps // unroll

  def many(consts, carry):
    def body(i, state):
      carry, acc = state
      for _ in range(unroll):
        carry, out = step(consts, carry)
        acc = acc + out.reshape(-1)[0].astype(jnp.float32)
      return carry, acc
    return jax.lax.fori_loop(0, loops, body, (carry, jnp.zeros((), jnp.float32)))

  run = jax.jit(many, donate_argnums=1)
  carry, _ = jax.block_until_ready(run(consts, carry))            # compile + warm-up
  samples = []
  for _ in range(iters):
    start = time.perf_counter()
    carry, _ = jax.block_until_ready(run(consts, carry))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples) / (loops * unroll)


def loop_seconds(fn, args, *, iters: int, reps: int, unroll: int) -> float:
  """Device time of one ``fn(*args)`` call (``carried_seconds``; ``args`` are not consumed). Before each call,
  1e-30 x the previous call's first output element (below the element's precision, but not known to the
  compiler) is added to one element of the first input, which the loop carries."""
  def step(rest, carry):
    x, prev = carry
    x = x.at[(0,) * x.ndim].add((prev * 1e-30).astype(x.dtype))
    out = fn(x, *rest).reshape(-1)[0].astype(jnp.float32)
    return (x, out), out
  first = jnp.copy(args[0])                                      # the loop donates its carry
  return carried_seconds(step, tuple(args[1:]), (first, jnp.zeros((), jnp.float32)), iters=iters, reps=reps,
                         unroll=unroll)


def kernel_section(*, smoke: bool, iters: int, reps: int, unroll: int, hbm: float | None, flops_peak: float | None,
                   overrides: dict) -> list[dict]:
  """Kernel vs XLA over the N x prefix sweep; one row (a dict) per problem. The kernel launches with the
  active tuning table's configuration, with ``overrides`` (launch parameters that are not None) applied."""
  shape = SMOKE if smoke else QWEN3_8B
  node_counts, prefixes = SWEEP["smoke" if smoke else "full"]
  kernel = jax.jit(lambda *a: tree_attention(*a, interpret=smoke, **overrides))
  one_split = jax.jit(lambda *a: tree_attention(*a, interpret=smoke, **{**overrides, "num_splits": 1}))
  mosaic = jax.jit(lambda *a: tree_attention_mgpu.tree_attention(*a, interpret=smoke))
  reference = jax.jit(xla_attention)
  rows = []
  for num_nodes in node_counts:
    for prefix in prefixes:
      rows.append(guarded(dict(n=num_nodes, prefix=prefix), lambda: kernel_row(
          shape, num_nodes, prefix, kernel, one_split, mosaic, reference, iters=iters, reps=reps, unroll=unroll,
          hbm=hbm, flops_peak=flops_peak, overrides=overrides)))
      row = rows[-1]
      print(f"  kernel N={num_nodes} prefix={prefix}: " + (row.get("error") or row.get("skipped") or
            f"{row['kernel_us']:.1f} us (XLA {row['xla_us']:.1f} us)"), file=sys.stderr, flush=True)
  return rows


class Deadline:
  """The run's wall-clock budget (``--minutes``): a row that would start after it is recorded as skipped."""

  def __init__(self, seconds: float = math.inf):
    self.end = time.monotonic() + seconds

  def passed(self) -> bool:
    return time.monotonic() >= self.end


DEADLINE = Deadline()           # main() starts it; rows check it through ``guarded``
SKIPPED = "time budget spent (--minutes)"


def guarded(key: dict, measure) -> dict:
  """``key`` plus the measured columns, or plus ``error`` when the measurement raised: one failing
  shape (a Triton compile error, out of memory) must not cost the rest of a one-shot GPU run. After
  the deadline, ``key`` plus ``skipped`` (not a failure)."""
  if DEADLINE.passed():
    return {**key, "skipped": SKIPPED}
  try:
    return {**key, **measure()}
  except Exception as e:  # noqa: BLE001  (recorded in the row and counted as a failure)
    return {**key, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def kernel_row(shape, num_nodes, prefix, kernel, one_split, mosaic, reference, *, iters, reps, unroll, hbm, flops_peak,
               overrides) -> dict:
  """One problem of the kernel sweep: errors, times, bandwidth and roofline columns of the Triton kernel,
  and the Mosaic GPU kernel's error, time, HBM fraction and speed relative to the Triton kernel
  (``mosaic_vs_triton`` > 1: Mosaic faster; ``mosaic_error`` when it cannot run here)."""
  itemsize = jnp.dtype(shape.dtype).itemsize
  args = make_inputs(shape, num_nodes, prefix, seed=1000 * num_nodes + prefix)
  out = np.asarray(kernel(*args), np.float32)
  ref = np.asarray(reference(*args), np.float32)
  max_err = float(np.max(np.abs(out - ref)))
  kernel_s = loop_seconds(kernel, args, iters=iters, reps=reps, unroll=unroll)
  one_split_s = loop_seconds(one_split, args, iters=iters, reps=reps, unroll=unroll)
  config = resolve_config(shape.num_q_heads // shape.num_kv_heads * num_nodes, **overrides)
  splits = launch_shapes(shape.batch, num_nodes, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                         cache_len=prefix, **dataclasses.asdict(config)).num_splits
  xla_s = loop_seconds(reference, args, iters=iters, reps=reps, unroll=unroll)
  kv_bytes = 2 * shape.batch * shape.num_kv_heads * (prefix + num_nodes) * shape.head_dim * itemsize
  flops = 4 * shape.batch * num_nodes * shape.num_q_heads * (prefix + num_nodes) * shape.head_dim
  floors = {"memory": None if hbm is None else kv_bytes / hbm,
            "compute": None if flops_peak is None else flops / flops_peak}
  bound = max((k for k in floors if floors[k] is not None), key=floors.get, default=None)
  try:
    mosaic_out = np.asarray(mosaic(*args), np.float32)
    mosaic_s = loop_seconds(mosaic, args, iters=iters, reps=reps, unroll=unroll)
    second = dict(mosaic_rel_err=float(np.max(np.abs(mosaic_out - ref))) / float(np.max(np.abs(ref))),
                  mosaic_us=mosaic_s * 1e6, mosaic_vs_triton=kernel_s / mosaic_s,
                  mosaic_hbm_fraction=None if hbm is None else kv_bytes / mosaic_s / hbm)
  except Exception as e:  # noqa: BLE001  (the Triton columns stand; the reason is recorded)
    second = dict(mosaic_error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
  return dict(
      max_abs_err=max_err,
      rel_err=max_err / float(np.max(np.abs(ref))), splits=splits, kernel_us=kernel_s * 1e6,
      one_split_us=one_split_s * 1e6, xla_us=xla_s * 1e6,
      speedup=xla_s / kernel_s, kv_bytes=kv_bytes, kernel_gbps=kv_bytes / kernel_s / 1e9,
      hbm_fraction=None if hbm is None else kv_bytes / kernel_s / hbm,
      bound=bound or "-", floor_us=None if bound is None else floors[bound] * 1e6,
      roofline_fraction=None if bound is None else floors[bound] / kernel_s, **second)


@dataclasses.dataclass(frozen=True)
class DecodeModel:
  """A random-weight target (config, params), its draft head (config, params) and a batch-1 prompt: built
  once, shared by the decode and profile sections."""
  cfg: object
  params: dict
  head_cfg: object
  head: dict
  prompt: list


def decode_model(*, smoke: bool, layers: int) -> DecodeModel:
  """A Qwen3-8B-shaped model with ``layers`` of its 36 layers, bf16, a 5-layer head and a 1024-token prompt;
  tiny and float32 when ``smoke``. Per-layer shapes are Qwen3-8B's, so the verify/AR ratio moves little with
  the layer count (docs/gpu.md gives the estimate)."""
  from jetspec_jax.config import Qwen3Config
  from jetspec_jax.models import draft_head, qwen3
  if smoke:
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    dtype, prompt_len, head_layers = jnp.float32, 16, 1
  else:
    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6)
    dtype, prompt_len, head_layers = jnp.bfloat16, 1024, 5
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=head_layers, block_size=16)
  return DecodeModel(cfg=cfg, params=qwen3.init_target(cfg, jax.random.key(0), dtype), head_cfg=head_cfg,
                     head=draft_head.init_head(head_cfg, jax.random.key(1), dtype),
                     prompt=[np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len).tolist()])


def mode_name(budget: int | None, method: str = "accum_logp") -> str:
  """"ar" for autoregressive decoding (budget None), else the bench's name: tree_b<N> (accum_logp), best_b<N>..."""
  return "ar" if budget is None else f"{bench.MODE_PREFIX[method]}_b{budget}"


def prefilled(model: DecodeModel, budget: int | None, *, max_new: int, attn_impl: str, method: str = "accum_logp"):
  """A one-slot engine (AR with budget None, else speculative with a ``method`` tree of ``budget`` nodes, width 7)
  holding the model's prompt for ``max_new`` greedy tokens, after its first round (the prompt's prefill)."""
  from jetspec_jax.attention import cache_rows
  from jetspec_jax.decode.engine import Engine, Request
  from jetspec_jax.decode.speculative import TreeConfig
  tree = None if budget is None else TreeConfig(method, budget, 7, model.head_cfg.depth)
  head = {} if tree is None else dict(head_cfg=model.head_cfg, head_params=model.head)
  requests = [Request(model.prompt[0], max_new)]
  eng = Engine.for_requests(model.cfg, model.params, requests, slots=1, prefill_rows=cache_rows(len(model.prompt[0])),
                            tree=tree, eos_ids=(), attn_impl=attn_impl, **head)
  eng.start()
  eng.submit(requests)
  eng.step(1)
  jax.block_until_ready(eng.state)
  return eng


def decode_rest(eng) -> dict:
  """The rest of a ``prefilled`` engine's generation, timed: decode_s, rounds (after the prefill's), tau."""
  from jetspec_jax.decode.engine import acceptance
  t0 = time.perf_counter()
  results = eng.step()
  decode_s = time.perf_counter() - t0
  acc = acceptance(results)
  return dict(decode_s=decode_s, rounds=acc["rounds"], tau=acc["tau"])


def generate(model: DecodeModel, budget: int | None, *, max_new: int, attn_impl: str,
             method: str = "accum_logp") -> dict:
  """One greedy generation of ``max_new`` tokens (``prefilled``): decode_s (seconds after the prefill round),
  rounds (AR: target forwards after the prefill), tau."""
  return decode_rest(prefilled(model, budget, max_new=max_new, attn_impl=attn_impl, method=method))


def decode_section(model: DecodeModel, *, budgets: tuple[int, ...], max_new: int, attn_impl: str,
                   methods: tuple[str, ...] = ("accum_logp",)) -> list[dict]:
  """Jitted decode rounds, batch 1: ms per AR step and per speculative round (draft + tree + verify + accept
  + commit) for each tree method and budget, timed on a second generation (the first compiles)."""
  rows = []

  def row(budget, method):
    generate(model, budget, max_new=max_new, attn_impl=attn_impl, method=method)      # compile + warm-up
    out = generate(model, budget, max_new=max_new, attn_impl=attn_impl, method=method)
    ms = 1e3 * out["decode_s"] / max(out["rounds"], 1)
    ar_ms = rows[0].get("ms_per_round") if rows else ms         # the AR row (first) is its own reference
    return dict(ms_per_round=ms, ratio_to_ar_step=None if ar_ms is None else ms / ar_ms, tau=out["tau"])

  for budget, method in [(None, "ar"), *((b, m) for m in methods for b in budgets)]:
    rows.append(guarded(dict(mode=mode_name(budget, method), nodes=budget or 1), lambda: row(budget, method)))
  return rows


def phase_section(model: DecodeModel, *, budgets: tuple[int, ...], attn_impl: str, iters: int, reps: int,
                  unroll: int) -> list[dict]:
  """Each phase of a round timed alone (``carried_seconds``), batch 1, after the model's prompt (prefix P):

  ar_forward: ``verify.verify_tree`` on a one-node tree, the same target forward as an AR step's;
  verify_b<N>: ``verify.verify_tree`` on an N-node random tree plus the argmax of its logits (the issue's
  "verify round", goal <= 1.2x ar_forward at N = 128); draft: the head's block forward and per-depth
  logits; tree_heap_b<N> / tree_best_b<N>: the accum_logp search (a loop) / the best_nodes selection (no
  loop) from random per-depth logits, width 7.
  ``ratio_to_ar_forward`` compares each with ar_forward."""
  from jetspec_jax.decode.tree import Tree, build_tree
  from jetspec_jax.decode.verify import verify_tree
  from jetspec_jax.models import draft_head, qwen3
  cfg, head_cfg = model.cfg, model.head_cfg
  prefix = len(model.prompt[0])
  prefix_len = jnp.full((1,), prefix, jnp.int32)
  rng = np.random.default_rng(7)
  dtype = model.params["embed"].dtype
  # A model forward takes milliseconds, so the loop's host sync per iteration (~10 us) is below 1% of it
  # and each iteration makes one call: unrolling would multiply the compiled program (and its compile time).
  timed = dict(iters=iters, reps=reps, unroll=1)

  def forward_row(nodes):
    parents, mask = random_tree(rng, 1, nodes)
    tree = Tree(tokens=jnp.asarray(rng.integers(0, cfg.vocab_size, (1, nodes)), jnp.int32),
                parents=jnp.asarray(parents), depths=jnp.asarray(mask.sum(-1, dtype=np.int32) - 1),
                valid=jnp.ones((1, nodes), bool), ancestors=jnp.asarray(mask),
                candidates=jnp.zeros((1, 1, 0), jnp.int32),        # verification reads no candidate lists
                candidate_logp=jnp.zeros((1, 1, 0), jnp.float32))

    def step(params, cache):           # the round's verification; its taps feed the commit phase, not timed here
      logits, cache, _ = verify_tree(params, cfg, tree, cache, prefix_len, tap_layers=(), attn_impl=attn_impl)
      return cache, jnp.argmax(logits, axis=-1)
    cache = qwen3.init_cache(cfg, 1, prefix + nodes, dtype)
    return dict(ms=1e3 * carried_seconds(step, model.params, cache, **timed))

  def draft_row():
    anchor = jnp.zeros((1,), jnp.int32)

    def step(params, cache):
      head = draft_head.bind(head_cfg, params[1])
      logits, cache = head.draft_logits(qwen3.bind(cfg, params[0]), cache, prefix_len, anchor, attn_impl=attn_impl)
      return cache, logits
    cache = draft_head.init_context_cache(head_cfg, 1, prefix + head_cfg.block_size, dtype)
    return dict(ms=1e3 * carried_seconds(step, (model.params, model.head), cache, **timed))

  def tree_row(method, budget):
    logits = jnp.asarray(3 * rng.standard_normal((1, head_cfg.depth, cfg.vocab_size)), jnp.float32)
    build = lambda lg: build_tree(jnp.zeros((1,), jnp.int32), lg, method=method, budget=budget, width=7).tokens
    return dict(ms=1e3 * loop_seconds(build, (logits,), **{**timed, "unroll": unroll}))

  rows = [guarded(dict(phase="ar_forward", nodes=1), lambda: forward_row(1))]
  rows += [guarded(dict(phase=f"verify_b{n}", nodes=n), lambda n=n: forward_row(n)) for n in budgets]
  rows.append(guarded(dict(phase="draft", nodes=head_cfg.block_size), draft_row))
  rows += [guarded(dict(phase=f"tree_{short}_b{n}", nodes=n), lambda m=method, n=n: tree_row(m, n))
           for short, method in (("heap", "accum_logp"), ("best", "best_nodes")) for n in budgets]
  ar_ms = rows[0].get("ms")
  for row in rows:
    row["ratio_to_ar_forward"] = None if ar_ms is None or "ms" not in row else row["ms"] / ar_ms
  return rows


PHASES = ("jetspec_draft", "jetspec_tree", "jetspec_verify", "jetspec_accept", "jetspec_commit")


def profile_section(model: DecodeModel, *, budgets: tuple[int, ...], max_new: int, attn_impl: str) -> list[dict]:
  """A profiler trace of one generation per mode (AR, then each budget; compiled by a first generation),
  summarized per round by ``trace_summary`` over the decode loop's device events (the prefill excluded): busy
  and span ms, kernels, per-phase time (the named scopes ``PHASES``) and the top kernels. The traces are
  copied to $OUT/traces/<mode>.json.gz when OUT is set."""
  rows = []
  for budget in (None, *budgets):
    rows.append(guarded(dict(mode=mode_name(budget), nodes=budget or 1),
                        lambda: profile_row(model, budget, max_new=max_new, attn_impl=attn_impl)))
    row = rows[-1]
    print(f"\n{row['mode']}: " + (row.get("error") or row.get("skipped") or trace_summary.format_summary(row, top=12)))
  return rows


def profile_row(model: DecodeModel, budget: int | None, *, max_new: int, attn_impl: str) -> dict:
  """One mode of the profile section: rounds and the trace summary's columns (times and counts per round)."""
  generate(model, budget, max_new=max_new, attn_impl=attn_impl)                # compile + warm-up
  eng = prefilled(model, budget, max_new=max_new, attn_impl=attn_impl)
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      rounds = decode_rest(eng)["rounds"]
    if out_dir := os.environ.get("OUT"):
      (Path(out_dir) / "traces").mkdir(exist_ok=True)
      shutil.copyfile(trace_summary.trace_file(tmp), Path(out_dir) / "traces" / f"{mode_name(budget)}.json.gz")
    return trace_summary.summarize(tmp, phases=PHASES, rounds=max(rounds, 1), top=30, after="PjitFunction(run_rounds)")


def relate_to_unprofiled(profile_rows: list[dict], decode_rows: list[dict]) -> list[str]:
  """While a profiler is attached, XLA runs its command buffers (CUDA graphs) one op at a time (unless
  --xla_enable_command_buffers_during_profiling=true) and the tracer slows every launch, so a profiled
  round's span overstates the gaps of a normal round; the kernels' own times hardly change. Adds to each
  profiled mode the decode section's unprofiled time per round (same tokens, so the same rounds) and the
  device's busy fraction of it. Returns a printable line per mode."""
  unprofiled = {r["mode"]: r["ms_per_round"] for r in decode_rows if r.get("ms_per_round")}
  lines = []
  for row in profile_rows:
    if "busy_us" in row and row["mode"] in unprofiled:
      row["unprofiled_us"] = unprofiled[row["mode"]] * 1e3
      row["busy_fraction_unprofiled"] = row["busy_us"] / row["unprofiled_us"]
      lines.append(f"{row['mode']}: busy {row['busy_us'] / 1e3:.3f} ms of an unprofiled {row['unprofiled_us'] / 1e3:.3f} "
                   f"ms round (busy fraction {row['busy_fraction_unprofiled']:.3f}; profiled span "
                   f"{row['span_us'] / 1e3:.3f} ms)")
  return lines


def tune_section(*, smoke: bool, iters: int, reps: int, unroll: int, device_kind: str, minutes: float = math.inf) -> dict:
  """``kernel_tune``'s sweep of launch configurations on Qwen3-8B attention shapes (2 configurations of one
  problem on the smoke shape); prints the fastest configuration per shape against the default and the tuning
  table the sweep gives. Configurations that are illegal for a shape are recorded, not failures of the run.
  The sweep stops starting timings after ``minutes`` (or the run's budget), so the model sections keep theirs."""
  shape = SMOKE if smoke else QWEN3_8B
  own = Deadline(60 * minutes)
  sweep = dict(shapes=((5, 3),), configs=kernel_tune.CONFIGS[:1] + kernel_tune.CONFIGS[-1:]) if smoke else {}
  result = kernel_tune.tune_section(
      lambda n, prefix: make_inputs(shape, n, prefix, seed=n + prefix),
      lambda fn, args: loop_seconds(fn, args, iters=max(iters // 4, 1), reps=reps, unroll=unroll),
      group=shape.num_q_heads // shape.num_kv_heads, interpret=smoke, device_kind=device_kind,
      expired=lambda: DEADLINE.passed() or own.passed(), **sweep)
  print(f"\nkernel launch configurations, {shape}, fastest per shape (us; default {kernel_tune.DEFAULT}):")
  print(bench.format_table(result["best"]))
  print(f"tuning table from the sweep (max_rows = group x N): {json.dumps(result['table'])}")
  return result


def save_tuning(table: dict) -> str:
  """Saves a tuning table (JSON form) as $OUT/kernel_tuning.json (or in a temporary directory), the file
  ``--kernel-tuning`` takes. Returns the path."""
  out_dir = os.environ.get("OUT") or tempfile.mkdtemp(prefix="jetspec_tuning_")
  path = Path(out_dir) / "kernel_tuning.json"
  kernel_tuning.KernelTuning.from_json(table).save(path)
  return str(path)


def write_report(report: dict) -> None:
  """The report as JSON in $OUT/gpu_check.json (when OUT is set), replaced whole each time."""
  if out_dir := os.environ.get("OUT"):
    print(f"wrote {bench.write_json(Path(out_dir) / 'gpu_check.json', report)}")


def main(argv: list[str] | None = None) -> int:
  """Runs every section, prints the tables, writes $OUT/gpu_check.json; 0 (rows record their errors)."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, kernel in interpret mode (CPU)")
  parser.add_argument("--minutes", type=float, default=7.0,
                      help="wall-clock budget: rows that would start later are skipped and reported (default 7, "
                           "so a run ends within 8 minutes)")
  parser.add_argument("--hbm-gbps", type=float, help="peak HBM bandwidth in GB/s for unknown devices")
  parser.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s for unknown devices")
  parser.add_argument("--iters", type=int, default=20, help="timing samples per measurement")
  parser.add_argument("--reps", type=int, default=50, help="calls inside one jitted loop per timing sample")
  parser.add_argument("--unroll", type=int, default=10, help="chained calls per iteration of that loop")
  for flag in ("--block-r", "--block-k", "--num-warps", "--num-stages"):
    parser.add_argument(flag, type=int, default=None, help="kernel sweep launch parameter (default: the tuning table's)")
  parser.add_argument("--num-splits", type=int, default=None, help="prefix splits (default: chosen per problem)")
  parser.add_argument("--decode-layers", type=int, default=12, help="layers of the Qwen3-8B-shaped model")
  parser.add_argument("--decode-budgets", default="16,64,128")
  parser.add_argument("--decode-new-tokens", type=int, default=33)
  parser.add_argument("--decode-trees", default="accum_logp,best_nodes", help="tree methods of the decode rounds")
  parser.add_argument("--skip-decode", action="store_true")
  parser.add_argument("--decode-attention", default="",
                      help="comma-separated attention implementations the decode section also runs (e.g. mosaic), "
                           "after the model sections' own (pallas on a GPU)")
  parser.add_argument("--skip-phases", action="store_true")
  parser.add_argument("--skip-tune", action="store_true", help="skip the kernel's tile-size sweep")
  parser.add_argument("--tune-minutes", type=float, default=2.5,
                      help="the sweep's own budget within --minutes: timings that would start later are skipped, "
                           "so the model sections keep their time (default 2.5)")
  parser.add_argument("--keep-tuning", action="store_true",
                      help="the model sections keep the active tuning table instead of the sweep's")
  parser.add_argument("--profile-budgets", default="16,128")
  parser.add_argument("--profile-new-tokens", type=int, default=None,
                      help="tokens per profiled generation (default: --decode-new-tokens, so its compiles are reused)")
  parser.add_argument("--skip-profile", action="store_true")
  args = parser.parse_args(argv)
  args.profile_new_tokens = args.profile_new_tokens or args.decode_new_tokens
  if args.smoke:
    args.iters, args.reps = min(args.iters, 3), 1

  global DEADLINE
  DEADLINE = Deadline(60 * args.minutes)
  device = jax.devices()[0]
  hbm = device_peak(HBM_BYTES_PER_S, device.device_kind, args.hbm_gbps, 1e9)
  flops_peak = device_peak(DENSE_BF16_FLOPS, device.device_kind, args.peak_tflops, 1e12)
  overrides = {k: v for k, v in dict(block_r=args.block_r, block_k=args.block_k, num_warps=args.num_warps,
                                      num_stages=args.num_stages, num_splits=args.num_splits).items() if v is not None}
  table = kernel_tuning.DEFAULT_TUNING.to_json()
  rows = kernel_section(smoke=args.smoke, iters=args.iters, reps=args.reps, unroll=args.unroll, hbm=hbm,
                        flops_peak=flops_peak, overrides=overrides)
  shape = SMOKE if args.smoke else QWEN3_8B

  print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}, "
        f"HBM {'unknown' if hbm is None else f'{hbm / 1e12:.2f} TB/s'}, "
        f"bf16 peak {'unknown' if flops_peak is None else f'{flops_peak / 1e12:.0f} TFLOP/s'}")
  print(f"\nkernel vs XLA, {shape}, tuning table {json.dumps(table)}, overrides {overrides}:")
  print(bench.format_table(rows))
  worst = max((r["rel_err"] for r in rows if "rel_err" in r), default=None)
  print(f"\nkernel rows measured: {sum('rel_err' in r for r in rows)}/{len(rows)}, worst relative error vs XLA: "
        f"{bench.fmt(worst)}")

  report = dict(device_kind=device.device_kind, platform=device.platform, jax_version=jax.__version__,
                hbm_bytes_per_s=hbm, dense_bf16_flops=flops_peak, smoke=args.smoke, iters=args.iters, reps=args.reps,
                unroll=args.unroll, kernel=dict(shape=dataclasses.asdict(shape), tuning=table, overrides=overrides,
                                                        rows=rows))
  write_report(report)                      # the kernel rows survive a failure or time-out below
  tuned = None
  if not args.skip_tune:
    report["tune"] = tune_section(smoke=args.smoke, iters=args.iters, reps=args.reps, unroll=args.unroll,
                                  device_kind=device.device_kind, minutes=args.tune_minutes)
    if report["tune"]["table"] and not args.keep_tuning:
      report["tune"]["applied"] = save_tuning(report["tune"]["table"])
      tuned = kernel_tuning.KernelTuning.from_json(report["tune"]["table"])
      print(f"the model sections below use this table ({report['tune']['applied']})")
    write_report(report)
  impl = AttentionImpl("pallas_interpret" if args.smoke else ("pallas" if device.platform == "gpu" else "xla"), tuned)
  model_sections = [name for name, skip in (("phases", args.skip_phases), ("decode", args.skip_decode),
                                             ("profile", args.skip_profile)) if not skip]
  if DEADLINE.passed():                     # not even the model is built
    report.update({name: dict(skipped=SKIPPED) for name in model_sections})
    model_sections = []
    write_report(report)
  model = decode_model(smoke=args.smoke, layers=args.decode_layers) if model_sections else None
  budgets = tuple(int(b) for b in args.decode_budgets.split(","))
  model_label = "the tiny smoke model" if args.smoke else f"Qwen3-8B-shaped ({args.decode_layers} layers)"
  if "phases" in model_sections:
    phrows = phase_section(model, budgets=budgets, attn_impl=impl, iters=args.iters, reps=args.reps,
                           unroll=args.unroll)
    print(f"\nround phases timed alone, {model_label}, batch 1, prefix "
          f"{len(model.prompt[0])}, attention {impl.name}:")
    print(bench.format_table(phrows))
    report["phases"] = dict(layers=args.decode_layers, attention=impl.name, rows=phrows,
                            kernel_tuning=impl.tuning and impl.tuning.to_json())
    write_report(report)
  if "decode" in model_sections:
    drows = []
    for attn in [impl, *(AttentionImpl(n, tuned) for n in args.decode_attention.split(",") if n)]:
      drows += [{"attention": attn.name, **r} for r in decode_section(
          model, max_new=args.decode_new_tokens, attn_impl=attn, budgets=budgets,
          methods=tuple(args.decode_trees.split(",")))]
      print(f"\njitted decode round, {model_label}, batch 1, attention {attn.name}:")
      print(bench.format_table([r for r in drows if r["attention"] == attn.name]))
      report["decode"] = dict(layers=args.decode_layers, attention=impl.name, rows=drows)
      write_report(report)
  if "profile" in model_sections:
    print(f"\nprofiled decode rounds ({args.profile_new_tokens} new tokens), per round, attention {impl.name}:")
    prows = profile_section(model, max_new=args.profile_new_tokens, attn_impl=impl,
                            budgets=tuple(int(b) for b in args.profile_budgets.split(",")))
    if "decode" in report and args.profile_new_tokens == args.decode_new_tokens:
      lines = relate_to_unprofiled(prows, [r for r in report["decode"]["rows"] if r["attention"] == impl.name])
      print("\nthe same rounds without the profiler (decode section):\n" + "\n".join(lines))
    report["profile"] = dict(layers=args.decode_layers, attention=impl.name, new_tokens=args.profile_new_tokens,
                             phases=PHASES, rows=prows)
    write_report(report)
  sections = [report["kernel"], *(report[name] for name in ("tune", "phases", "decode", "profile") if name in report)]
  skipped = [r for section in sections for r in [section, *section.get("rows", [])] if "skipped" in r]
  if skipped:
    print(f"\n{len(skipped)} rows or sections skipped: the {args.minutes:g}-minute budget was spent (rerun with a larger "
          f"--minutes, or --skip-* for the sections already measured)")
  errors = [r for section in sections for r in section.get("rows", []) if "error" in r]
  if errors:
    print(f"\n{len(errors)} rows recorded an error (see their 'error' column)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""jetspec_jax/trace_summary.py: per-kernel, per-phase and busy/span summaries of a jax.profiler trace, on a
synthetic GPU-like trace with known numbers and on a real CPU trace."""
import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from jetspec_jax import trace_summary

PHASES = ("jetspec_draft", "jetspec_verify", "jetspec_accept")


def write_trace(trace_dir, events) -> None:
  run = trace_dir / "plugins" / "profile" / "run_1"
  run.mkdir(parents=True)
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)


def op(label, ts, dur, tid=10, pid=2, **args):
  """A complete event named ``label`` (its ``args`` may hold another "name": a named-scope path)."""
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": label, "args": args}


@pytest.fixture
def gpu_trace(tmp_path):
  """Two streams of /device:GPU:0 after a host dispatch at 100 us: gemm [100, 140] and [150, 170] on one
  stream inside a while event [100, 180], softmax [130, 160] on the other, memcpy [200, 210]; a prefill
  kernel at 50 us before the dispatch."""
  write_trace(tmp_path, [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "pid": 2, "tid": 10, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
      {"ph": "M", "pid": 2, "tid": 11, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
      op("PjitFunction(run_rounds)", 100, 500, pid=1, tid=1),
      op("prefill_fusion", 50, 20),
      op("while.5", 100, 80),
      op("gemm", 100, 40, name="jit(run_rounds)/while/body/jetspec_verify/dot_general", hlo_op="gemm.1"),
      op("gemm", 150, 20, name="jit(run_rounds)/while/body/jetspec_draft/dot_general", hlo_op="gemm.2"),
      op("softmax", 130, 30, tid=11, long_name="jetspec_accept/jetspec_verify/exp", correlation_id=7),
      op("memcpy", 200, 10),
  ])
  return tmp_path


def test_synthetic_gpu_trace_exact_numbers(gpu_trace):
  s = trace_summary.summarize(gpu_trace, phases=PHASES, rounds=2, top=2, after="PjitFunction(run_rounds)")
  assert s["source"] == "device"
  # ops: gemm 40 + gemm 20 + softmax 30 + memcpy 10 (the while contains gemms: dropped; prefill: before `after`)
  assert s["events"] == 2 and s["total_us"] == 50
  assert s["span_us"] == 55                       # (210 - 100) / 2
  assert s["busy_us"] == 40                       # union [100, 170] + [200, 210] = 80, / 2
  assert s["busy_fraction"] == pytest.approx(80 / 110)
  assert s["kernels"] == [
      dict(name="gemm", total_us=30, count=1, mean_us=30, share=0.6),
      dict(name="softmax", total_us=15, count=0.5, mean_us=30, share=0.3)]
  # softmax names both accept and verify: the first of PHASES that appears (verify) takes it
  assert [(r["name"], r["total_us"], r["count"]) for r in s["phases"]] == [
      ("jetspec_draft", 10, 0.5), ("jetspec_verify", 35, 1), ("jetspec_accept", 0, 0), ("other", 5, 0.5)]
  text = trace_summary.format_summary(s, top=2)
  assert "0.040 ms/round busy of 0.055 ms/round span" in text and "jetspec_verify 0.035" in text
  lines = text.splitlines()                       # totals, phases, then the table: header, rule, a row per kernel
  assert len(lines) == 6 and [c.strip() for c in lines[4].strip("|").split("|")] == ["gemm", "30.0", "1.00", "30.00",
                                                                                     "0.600"]


def test_without_after_the_whole_trace_counts_and_a_missing_event_raises(gpu_trace):
  s = trace_summary.summarize(gpu_trace)
  assert s["events"] == 5 and s["span_us"] == 160 and s["busy_us"] == 100
  with pytest.raises(ValueError, match="PjitFunction"):
    trace_summary.summarize(gpu_trace, after="PjitFunction(generate)")


def test_real_cpu_trace(tmp_path):
  @jax.jit
  def f(x, w):
    return jax.lax.fori_loop(0, 3, lambda i, x: jnp.tanh(x @ w) + 1.0, x)

  x, w = jnp.ones((128, 128)), jnp.full((128, 128), 1e-3)
  f(x, w).block_until_ready()
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    f(x, w).block_until_ready()
  s = trace_summary.summarize(tmp_path, phases=PHASES, rounds=3, after="PjitFunction(f)")
  assert s["source"] == "host" and s["events"] > 0 and s["kernels"]
  assert 0 < s["busy_us"] <= s["span_us"] and 0 < s["busy_fraction"] <= 1
  assert sum(r["share"] for r in s["phases"]) == pytest.approx(1)
  assert "kernels/round" in trace_summary.format_summary(s)

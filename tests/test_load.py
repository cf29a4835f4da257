"""Load benchmark plumbing: segmented runs under Poisson arrivals return every request once, with its AR
tokens, ordered timings, and the static baseline's (batches through the same engine) tokens and occupancy."""
import numpy as np
import pytest

from jetspec_jax import load
from jetspec_jax.decode.engine import Engine, EnginePlan
from jetspec_jax.errors import JetSpecError
from test_engine import ar_reference, random_requests
from test_speculative import CFG, target


def test_poisson_arrivals_through_segments_equal_the_static_baseline():
  requests = random_requests(21, 10, max_new=12)
  plan = EnginePlan(slots=3, rows=3, lanes=1, prefill_rows=8, max_prompt=40, max_new_tokens=12, queue=4)
  engine = Engine(CFG, target(), plan, eos_ids=())
  res = load.run_engine(engine, requests, rate=200.0, segment_rounds=4, seed=1)
  static = load.run_static(engine, requests)                # batches of 3, each run to its longest max_new_tokens
  assert [r["tokens"] for r in res["requests"]] == static["tokens"]
  assert static["tokens"] == [ar_reference(tuple(r.prompt), r.max_new_tokens, ()) for r in requests]
  rows = res["requests"]
  assert all(0 < r["ttft_s"] <= r["latency_s"] and r["tpot_s"] >= 0 for r in rows)
  assert np.all(np.diff([r["arrival_s"] for r in rows]) > 0)
  assert res["output_tokens"] == static["output_tokens"] == sum(r.max_new_tokens for r in requests)
  assert 0 < res["occupancy"] <= 1 and 0 < static["occupancy"] <= 1 and res["tau"] == 1.0
  assert res["ttft_s"]["p50"] <= res["ttft_s"]["p99"]


def test_arrivals():
  assert np.all(load.arrivals(5, None) == 0)
  times = load.arrivals(2000, 50.0, seed=0)
  assert np.all(np.diff(times) > 0) and abs(len(times) / times[-1] - 50.0) < 5.0
  with pytest.raises(JetSpecError, match="request rate must be > 0"):
    load.arrivals(3, 0.0)

"""Load benchmarks on the engine, measured as serving benchmarks measure them (vLLM's
``benchmark_serving``): a request mix, all at once or arriving as a Poisson process, and per request the
time to first token (TTFT), time per output token after it (TPOT) and end-to-end latency, with the
run's output tokens per second, tau and slot occupancy.

Requests come from ShareGPT's own conversations: the first user turn (chat template) is the prompt,
the length of the assistant's reply its ``max_new_tokens`` (capped), filtered as vLLM filters them
(prompt and reply of at least 4 tokens, prompt at most ``max_prompt``, the two within ``context``).

The engine runs in segments of ``segment_rounds`` rounds, one in flight, as the server's driver runs it:
the host submits the requests that have arrived, dispatches the next segment, then collects the previous
one's finished requests. A request's first token is visible when the segment that drew it is collected
(TTFT counts from its arrival to then), its last when the segment that finished it is; TPOT is the time between the two over (tokens - 1)
(wall times at segment resolution). The static baseline runs the same requests in arrival-order batches
of the slot count, each batch admitted at once and run to its longest ``max_new_tokens`` before the next
starts (an engine run per batch): what static batching does.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import numpy as np

from jetspec_jax.decode.engine import Engine, Request
from jetspec_jax.errors import JetSpecError


def sharegpt_requests(tokenizer, num: int, *, max_output: int = 1024, max_prompt: int = 1024,
                      context: int = 2048, offset: int = 0) -> list[Request]:
  """``num`` requests from ShareGPT conversations ``offset`` on (see the module docstring)."""
  from jetspec_jax.banks import chat_prompt_ids
  from jetspec_jax.train.sources import iter_conversations
  out, seen = [], 0
  for conv in iter_conversations("sharegpt"):
    if len(conv) < 2 or conv[0]["role"] != "user" or conv[1]["role"] != "assistant":
      continue
    seen += 1
    if seen <= offset:
      continue
    prompt = chat_prompt_ids(tokenizer, conv[0]["content"])
    reply = len(tokenizer(conv[1]["content"])["input_ids"])
    if len(prompt) < 4 or reply < 4 or len(prompt) > max_prompt or len(prompt) + reply > context:
      continue
    out.append(Request(prompt, min(reply, max_output)))
    if len(out) == num:
      return out
  raise JetSpecError(f"ShareGPT has only {len(out)} conversations that pass the length filter; ask for fewer")


def arrivals(num: int, rate: float | None, seed: int = 0) -> np.ndarray:
  """Arrival times [num] in seconds: all 0 (rate None: all at once) or a Poisson process of ``rate``/s."""
  if rate is None:
    return np.zeros(num)
  if not rate > 0:
    raise JetSpecError(f"request rate must be > 0 requests/s, got {rate}")
  return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, num))


def percentiles(xs: Sequence[float]) -> dict:
  xs = np.asarray(list(xs), np.float64)
  if xs.size == 0:
    return {"mean": None, "p50": None, "p99": None}
  return {"mean": float(xs.mean()), "p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}


def run_engine(engine: Engine, requests: Sequence[Request], *, rate: float | None = None,
               segment_rounds: int = 32, seed: int = 0, progress: Callable[[str], None] = lambda s: None) -> dict:
  """The requests through ``engine`` in segments (module docstring); returns per-request metrics and the
  summary. The engine's program should be compiled already (a warm-up run), or its compile counts."""
  engine.start()
  arrive = arrivals(len(requests), rate, seed)
  order = list(range(len(requests)))
  pending_ids: dict[int, int] = {}                                   # engine id -> request index
  done: dict[int, dict] = {}
  submitted, t0 = 0, time.perf_counter()
  segment_end: list[tuple[int, float]] = []                          # (rounds so far, wall time collected)
  in_flight, busy, rounds, peak_pages = None, 0, 0, 0

  def collect(segment):
    nonlocal busy, rounds, peak_pages
    update = engine.collect(segment)
    busy, rounds, peak_pages = busy + update.busy, update.round, max(peak_pages, update.pages_used)
    segment_end.append((rounds, time.perf_counter() - t0))
    for r in update.finished:
      done[pending_ids.pop(r.id)] = {"result": r}
    progress(f"{len(done)}/{len(requests)} requests done")

  while len(done) < len(requests):
    now = time.perf_counter() - t0
    free = engine.plan.queue * engine.plan.groups - len(pending_ids)
    ready = [i for i in order[submitted:] if arrive[i] <= now][:free]
    if ready:
      for eid, i in zip(engine.submit([requests[i] for i in ready]), ready):
        pending_ids[eid] = i
      submitted += len(ready)
    if not pending_ids and in_flight is None:                        # idle until the next arrival
      time.sleep(max(0.0, arrive[order[submitted]] - now))
      continue
    dispatched = engine.dispatch(segment_rounds) if pending_ids else None
    if in_flight is not None:
      collect(in_flight)
    in_flight = dispatched
  if in_flight is not None:
    collect(in_flight)
  wall = time.perf_counter() - t0
  ends = np.asarray(segment_end)

  def seen_at(round_index: int) -> float:
    """Wall time at the end of the segment that ran ``round_index``."""
    return float(ends[np.searchsorted(ends[:, 0], round_index + 1), 1])

  rows = []
  for i, req in enumerate(requests):
    r = done[i]["result"]
    first, last = seen_at(r.first), seen_at(r.finished)
    n = len(r.tokens)
    rows.append({"prompt_tokens": len(req.prompt), "output_tokens": n, "arrival_s": float(arrive[i]),
                 "ttft_s": first - float(arrive[i]), "latency_s": last - float(arrive[i]),
                 "tpot_s": (last - first) / max(n - 1, 1), "steps": r.steps, "preempted": r.preempted,
                 "cached_tokens": r.cached_tokens, "tokens": r.tokens})
  output = sum(r["output_tokens"] for r in rows)
  decoded = output - len(rows)
  steps = sum(r["steps"] for r in rows)
  return {"requests": rows, "wall_s": wall, "rounds": rounds, "output_tokens": output,
          "tokens_per_s": output / wall, "requests_per_s": len(rows) / wall,
          "tau": decoded / max(steps, 1), "occupancy": busy / max(rounds * engine.plan.slots, 1),
          "ttft_s": percentiles(r["ttft_s"] for r in rows), "tpot_s": percentiles(r["tpot_s"] for r in rows),
          "latency_s": percentiles(r["latency_s"] for r in rows), "rate": rate, "segment_rounds": segment_rounds,
          "kv_pages": engine.plan.pool_pages(engine.head_cfg), "kv_pages_peak": peak_pages,
          "preemptions": sum(r["preempted"] for r in rows),
          "prefix_cached_tokens": sum(r["cached_tokens"] for r in rows),
          "prompt_tokens_computed": sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows)}


def run_static(engine: Engine, requests: Sequence[Request]) -> dict:
  """The static-batch baseline (module docstring) in batches of ``engine.plan.slots``: useful tokens (each
  request's own max_new_tokens, cut at EOS) per second, and its occupancy (useful slot-rounds over slots x
  rounds)."""
  batch = engine.plan.slots
  t0 = time.perf_counter()
  useful, slot_rounds, outputs = 0, 0, []
  for i in range(0, len(requests), batch):
    chunk = requests[i:i + batch]
    longest = max(r.max_new_tokens for r in chunk)
    run = engine.run([Request(r.prompt, longest) for r in chunk])
    for r, toks in zip(chunk, run.tokens):
      outputs.append(toks[:r.max_new_tokens])
    useful += sum(len(t) for t in outputs[-len(chunk):])
    slot_rounds += batch * run.rounds
  wall = time.perf_counter() - t0
  return {"wall_s": wall, "output_tokens": useful, "tokens_per_s": useful / wall,
          "occupancy": useful / max(slot_rounds, 1), "tokens": outputs}


def table(result: dict) -> str:
  """One row per mode and rate: throughput, TTFT and TPOT percentiles, tau, occupancy."""
  from jetspec_jax.bench import format_table
  rows = []
  for mode, by_rate in result["modes"].items():
    for rate, r in by_rate.items():
      rows.append({"mode": mode, "rate": rate, "tokens/s": r["tokens_per_s"], "req/s": r["requests_per_s"],
                   "TTFT p50 s": r["ttft_s"]["p50"], "TTFT p99 s": r["ttft_s"]["p99"],
                   "TPOT p50 ms": r["tpot_s"]["p50"] * 1e3, "TPOT p99 ms": r["tpot_s"]["p99"] * 1e3,
                   "tau": r["tau"], "occupancy": r["occupancy"]})
  return format_table(rows)


def plot(result: dict, path: str) -> str | None:
  """Throughput and TPOT p50 against the request rate, one line per mode (PNG); None without matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
  for mode, by_rate in result["modes"].items():
    rates = list(by_rate)
    a.plot(rates, [by_rate[r]["tokens_per_s"] for r in rates], marker="o", label=mode)
    b.plot(rates, [by_rate[r]["tpot_s"]["p50"] * 1e3 for r in rates], marker="o", label=mode)
  a.set(xlabel="request rate (1/s)", ylabel="output tokens/s")
  b.set(xlabel="request rate (1/s)", ylabel="TPOT p50 (ms)")
  a.legend()
  fig.tight_layout()
  from jetspec_jax.files import atomic_open
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with atomic_open(path, "wb", encoding=None) as f:
    fig.savefig(f, format="png")
  plt.close(fig)
  return path

"""Where the device time of a ``jax.profiler`` trace goes: per kernel, per named-scope phase, and idle.

  with jax.profiler.trace(tmp, create_perfetto_trace=True):
    run()
  print(format_summary(summarize(tmp, phases=("jetspec_verify",), rounds=8)))

The events summarized are the complete ("X") events of the processes named "/device:..." (on a GPU,
one thread per CUDA stream and one event per kernel or memcpy). A CPU-only trace has no such process:
there the XLA ops run on the host's "tf_XLA..." threads, as events carrying an "hlo_op" argument. An
event that contains another event of its thread (on CPU, a while or call thunk around its body's ops)
is dropped, so each op's time counts once. Times are in microseconds.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from jetspec_jax.bench import format_table


def trace_file(trace_dir) -> Path:
  """The perfetto trace of the newest run in ``trace_dir``: ``<dir>/plugins/profile/<run>/perfetto_trace.json.gz``."""
  runs = (Path(trace_dir) / "plugins" / "profile").glob("*/perfetto_trace.json.gz")
  newest = max(runs, key=lambda p: p.stat().st_mtime, default=None)
  if newest is None:
    raise FileNotFoundError(f"no plugins/profile/*/perfetto_trace.json.gz in {trace_dir}")
  return newest


def op_events(trace: dict, after: str | None = None) -> tuple[str, list[dict]]:
  """(source, events) of a loaded trace: its device events ("device"), or when it has none the XLA ops of
  the host's tf_XLA threads ("host"), innermost events only. ``after``: the name of an event (e.g. the
  host's "PjitFunction(run_rounds)"); only events starting at or after its first start are kept."""
  events = trace["traceEvents"]
  processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] == "thread_name"}
  complete = [e for e in events if e.get("ph") == "X"]
  source, ops = "device", [e for e in complete if processes.get(e["pid"], "").startswith("/device:")]
  if not ops:
    source, ops = "host", [e for e in complete if threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")
                           and "hlo_op" in e.get("args", {})]
  if after is not None:
    start = min((e["ts"] for e in complete if e["name"] == after), default=None)
    if start is None:
      raise ValueError(f"no event named {after!r} in the trace")
    ops = [e for e in ops if e["ts"] >= start]
  return source, innermost(ops)


def innermost(events: list[dict]) -> list[dict]:
  """The events that contain no other event of their thread (events of a thread nest or follow each other)."""
  tracks: dict[tuple, list[dict]] = {}
  for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
    tracks.setdefault((e["pid"], e.get("tid")), []).append(e)
  end = lambda e: e["ts"] + e["dur"]
  return [e for track in tracks.values() for e, nxt in zip(track, track[1:] + [None])
          if nxt is None or nxt["ts"] >= end(e) or end(nxt) > end(e)]


def union_us(events: list[dict]) -> float:
  """Length of the union of the events' [ts, ts + dur) intervals: time with at least one event running."""
  busy, reached = 0.0, float("-inf")
  for e in sorted(events, key=lambda e: e["ts"]):
    busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], reached))
    reached = max(reached, e["ts"] + e["dur"])
  return busy


def phase_of(event: dict, phases) -> str:
  """The first of ``phases`` found in the event's name or in any string argument (a named-scope path), else "other"."""
  texts = [event["name"], *(v for v in event.get("args", {}).values() if isinstance(v, str))]
  return next((p for p in phases if any(p in t for t in texts)), "other")


def grouped(events: list[dict], key, total_us: float, rounds: float, names=()) -> list[dict]:
  """One row per key value (``names`` first, in order, even when absent), heaviest first after them:
  total_us and count per round, mean_us per event, share of ``total_us``."""
  groups: dict[str, list[float]] = {name: [] for name in names}
  for e in events:
    groups.setdefault(key(e), []).append(e["dur"])
  rest = sorted(set(groups) - set(names), key=lambda k: -sum(groups[k]))
  return [dict(name=k, total_us=sum(groups[k]) / rounds, count=len(groups[k]) / rounds,
               mean_us=sum(groups[k]) / max(len(groups[k]), 1), share=sum(groups[k]) / total_us)
          for k in (*names, *rest)]


def summarize(trace_dir, *, phases=(), rounds: float = 1, top: int = 20, after: str | None = None) -> dict:
  """Summary of the trace in ``trace_dir`` (see ``op_events`` for ``after``), every time and count divided by
  ``rounds``: span_us (first start to last end), busy_us (union of the events, so overlapping streams count
  once), busy_fraction (busy / span; the rest is launch gaps and host syncs), events per round, total_us
  (sum of durations), ``phases`` (rows for each of ``phases`` then "other") and the ``top`` kernels by time."""
  with gzip.open(trace_file(trace_dir)) as f:
    source, events = op_events(json.load(f), after)
  if not events:
    raise ValueError(f"no {source} op events in the trace")
  span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
  busy = union_us(events)
  total = sum(e["dur"] for e in events)
  return dict(source=source, rounds=rounds, span_us=span / rounds, busy_us=busy / rounds, busy_fraction=busy / span,
              events=len(events) / rounds, total_us=total / rounds,
              phases=grouped(events, lambda e: phase_of(e, phases), total, rounds, names=(*phases, "other")),
              kernels=grouped(events, lambda e: e["name"], total, rounds)[:top])


def format_summary(summary: dict, top: int = 12) -> str:
  """A summary as text: a line of per-round totals, a line of per-phase ms per round, and a table of the
  ``top`` kernels (names cut to 60 characters)."""
  head = (f"{summary['busy_us'] / 1e3:.3f} ms/round busy of {summary['span_us'] / 1e3:.3f} ms/round span "
          f"(busy fraction {summary['busy_fraction']:.3f}), {summary['events']:.1f} kernels/round, "
          f"{summary['rounds']:g} rounds, {summary['source']} events")
  phases = "phases, ms/round: " + ", ".join(f"{r['name']} {r['total_us'] / 1e3:.3f}" for r in summary["phases"])
  kernels = [{"kernel": r["name"][:60], "us/round": f"{r['total_us']:.1f}", "count/round": f"{r['count']:.2f}",
              "mean_us": f"{r['mean_us']:.2f}", "share": f"{r['share']:.3f}"} for r in summary["kernels"][:top]]
  return "\n".join([head, phases, format_table(kernels)])

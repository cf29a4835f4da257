"""Shared helpers of the benchmark scripts: machine description, timing, tables, JSON output and
FLOP / array counts read from compiled HLO text.

Every benchmark prints a plain-text table and writes one JSON document: to ``--out`` and, when
the ``OUT`` environment variable names a directory (the device runner sets it), also to
``$OUT/<name>.json``.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
if str(REPO_ROOT) not in sys.path:             # run as a script from anywhere
  sys.path.insert(0, str(REPO_ROOT))


def machine_info() -> dict[str, Any]:
  """Where the numbers come from: host, CPU count, memory and library versions."""
  info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                          "cpu_count": os.cpu_count(), "date": datetime.date.today().isoformat()}
  try:
    info["load_average_1_5_15min"] = [round(x, 2) for x in os.getloadavg()]   # other jobs share the CPUs
  except OSError:
    pass
  try:
    with open("/proc/meminfo") as f:
      mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    info["mem_total_gib"] = round(mem_kb / 1024 ** 2, 1)
  except (OSError, StopIteration, ValueError):
    pass
  try:
    with open("/proc/cpuinfo") as f:
      info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  for mod in ("jax", "jaxlib", "numpy", "orbax.checkpoint", "safetensors", "torch", "transformers"):
    m = sys.modules.get(mod)
    if m is not None and hasattr(m, "__version__"):
      info[mod] = m.__version__
  if "jax" in sys.modules:
    import jax
    info["jax_backend"] = jax.default_backend()
    info["jax_devices"] = [str(d) for d in jax.devices()]
  return info


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """(fn(), wall seconds)."""
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if xs else float("nan")


def fmt(x: Any, digits: int = 3) -> str:
  """Compact cell text: floats to ``digits`` significant-ish places, None as '-'."""
  if x is None:
    return "-"
  if isinstance(x, bool):
    return "yes" if x else "no"
  if isinstance(x, float):
    if x != x:
      return "nan"
    if x == 0:
      return "0"
    if abs(x) >= 100:
      return f"{x:,.0f}"
    if abs(x) >= 10:
      return f"{x:.1f}"
    return f"{x:.{digits}g}" if abs(x) < 0.01 else f"{x:.2f}"
  return str(x)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
          headers: dict[str, str] | None = None) -> str:
  """A left/right aligned plain-text (and Markdown-compatible) table of ``rows``."""
  if not rows:
    return "(no rows)"
  columns = list(columns or rows[0].keys())
  headers = headers or {}
  cells = [[headers.get(c, c) for c in columns]] + [[fmt(r.get(c)) for c in columns] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
  numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) or r.get(c) is None
                 for r in rows) for c in columns]

  def line(row):
    parts = [(v.rjust(w) if num else v.ljust(w)) for v, w, num in zip(row, widths, numeric)]
    return "| " + " | ".join(parts) + " |"

  sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
  return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def write_json(result: dict[str, Any], out: str | os.PathLike | None, name: str) -> list[str]:
  """Write ``result`` to ``out`` (default bench/results/<name>.json) and to $OUT/<name>.json when
  $OUT is set. Returns the paths written."""
  paths = [Path(out) if out else RESULTS_DIR / f"{name}.json"]
  if os.environ.get("OUT"):
    paths.append(Path(os.environ["OUT"]) / f"{name}.json")
  written = []
  for p in paths:
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
      json.dump(result, f, indent=2, default=_json_default)
      f.write("\n")
    written.append(str(p))
  return written


def _json_default(x):
  try:
    import numpy as np
    if isinstance(x, np.generic):
      return x.item()
    if isinstance(x, np.ndarray):
      return x.tolist()
  except ImportError:
    pass
  if isinstance(x, Path):
    return str(x)
  raise TypeError(f"not JSON serialisable: {type(x).__name__}")


_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")


def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str]:
  """{computation: [(name, shape, opcode, rest of line)]} of a compiled HLO module, and the entry's name."""
  comps, entry, current = {}, None, None
  for line in hlo.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)
    head = _COMP.match(line)
    if head:
      current = comps.setdefault(head.group(1), [])
      entry = head.group(1) if line.startswith("ENTRY") else entry
      continue
    ins = _INSTR.match(line)
    if ins and current is not None:
      current.append(ins.groups())
  return comps, entry


def hlo_dot_flops(hlo: str, unknown_trips: int | None = None) -> float:
  """FLOPs of every dot in a compiled HLO module (2 * output elements * contracted size), a while
  body counted ``known_trip_count`` times, a conditional as its costliest branch. XLA's
  ``cost_analysis`` counts every loop body once. A loop without a known trip count (a data-dependent
  ``lax.while_loop``) is an error, or counts ``unknown_trips`` times when given (1: FLOPs per iteration)."""
  comps, entry = _computations(hlo)
  memo: dict[str, float] = {}

  def cost(name: str) -> float:
    if name in memo:
      return memo[name]
    shapes = {n: s for n, s, _, _ in comps[name]}
    total = 0.0
    for _, shape, op, rest in comps[name]:
      if op == "dot":
        lhs = _dims(shapes[re.match(r"%([\w.\-]+)", rest).group(1)])
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
        total += 2 * math.prod(_dims(shape)) * math.prod(lhs[int(d)] for d in contracted.split(",") if d)
      elif op == "while":
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        if known is None and unknown_trips is None:
          raise ValueError("a while loop without a known trip count: its FLOPs are not static")
        trips = int(known.group(1)) if known else unknown_trips
        body, cond = re.search(r"body=%([\w.\-]+)", rest).group(1), re.search(r"condition=%([\w.\-]+)", rest).group(1)
        total += trips * cost(body) + (trips + 1) * cost(cond)
      elif op == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else _CALLEE.findall(rest)
        total += max(cost(b) for b in names)
      else:
        total += sum(cost(c) for c in _CALLEE.findall(rest))
    memo[name] = total
    return total

  return cost(entry)


def largest_array(hlo: str) -> tuple[int, str]:
  """(elements, shape) of the largest array any instruction of a compiled HLO module produces, other
  than the entry's parameters and values of the same shape (the inputs, e.g. the expert weights)."""
  comps, entry = _computations(hlo)
  inputs = {tuple(_dims(s)) for _, s, op, _ in comps[entry] if op == "parameter"}
  best = (0, "")
  for instrs in comps.values():
    for _, shape, op, _ in instrs:
      for dims in _ARRAY.findall(shape):
        d = tuple(int(x) for x in dims.split(",") if x)
        if op != "parameter" and d not in inputs and math.prod(d) > best[0]:
          best = (math.prod(d), shape)
  return best

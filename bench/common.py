"""Shared helpers of the benchmark scripts: machine description, timing, tables and JSON output.

Every benchmark prints a plain-text table and writes one JSON document: to ``--out`` and, when
the ``OUT`` environment variable names a directory (the device runner sets it), also to
``$OUT/<name>.json``.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
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

"""A process's memory maps: the count, the kernel's limit and a peak sampler.

Every XLA:CPU executable keeps its machine code in memory maps (about three per kernel: code, constants, data), and
Linux lets a process hold at most vm.max_map_count of them (65,530 by default); past it XLA's JIT aborts the process
("LLVM ERROR: Unable to allocate section memory"). The project's long-lived processes (the demo, ``jetspec-jax
bench``, a server, a Python loop calling ``generate``) keep their peak under ``BUDGET``, leaving the rest of the
default limit to a user's own programs beside them (``decode.engine.programs`` bounds the engine's).
"""
from __future__ import annotations

import threading

BUDGET = 20_000                 # the most maps this project's own processes may hold at once


def count(pid: int | str = "self") -> int | None:
  """The memory maps process ``pid`` holds now (None without procfs)."""
  try:
    with open(f"/proc/{pid}/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def limit() -> int | None:
  """This machine's vm.max_map_count (None without procfs)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


class Peak:
  """The most maps this process held while the ``with`` block ran, sampled every ``interval`` seconds by a thread
  (and at both ends): ``peak`` (None without procfs)."""

  def __init__(self, interval: float = 0.2):
    self.interval, self.peak = interval, count()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="memory-maps", daemon=True)

  def _sample(self) -> None:
    now = count()
    if now is not None:
      self.peak = max(self.peak or 0, now)

  def _watch(self) -> None:
    while not self._stop.wait(self.interval):
      self._sample()

  def __enter__(self) -> "Peak":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
    self._sample()

  def as_dict(self) -> dict:
    """{"peak", "budget", "limit"}: for reports."""
    return {"peak": self.peak, "budget": BUDGET, "limit": limit()}

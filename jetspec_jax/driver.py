"""One thread that owns an ``Engine`` and serves requests arriving from other threads.

The thread loops over segments: cancel what was asked to stop, submit waiting requests (as many as the
engine's queue has free entries; the rest wait their turn, in arrival order), ``step(segment_rounds)``,
then publish to every live request its tokens so far (``Engine.progress``, one fetch per segment) and,
for those that finished, their final tokens. Callers never touch the engine: ``submit`` and ``cancel``
only append to locked lists and wake the thread, and a ``Ticket``'s ``publish`` callback must return at
once (a server hands the update to its event loop), so neither side waits on the other.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from jetspec_jax.decode.engine import Engine, Request

# publish(tokens so far, done, error): done with error None is a normal finish (tokens final); an error
# (one sentence) ends the request without its tokens.
Publish = Callable[[list[int], bool, "str | None"], None]


@dataclasses.dataclass(eq=False)
class Ticket:
  """A request handed to the driver and where its updates go; ``published``: tokens already sent."""
  request: Request
  publish: Publish
  published: int = 0
  done: bool = False


class Driver:
  """Runs ``engine`` in its own thread (``start``), ``segment_rounds`` rounds per segment."""

  def __init__(self, engine: Engine, segment_rounds: int = 8):
    self.engine, self.segment_rounds = engine, segment_rounds
    self._wake = threading.Condition()
    self._arrived: list[Ticket] = []
    self._cancelled: list[Ticket] = []
    self._waiting: list[Ticket] = []
    self._live: dict[int, Ticket] = {}                 # engine id -> ticket
    self._stop = False
    self.error: str | None = None                      # set when the device loop failed; nothing more runs
    self.segments = 0                                  # steps run
    self.cancelled = 0                                 # requests stopped before they finished
    self._thread = threading.Thread(target=self._run, name="jetspec-engine", daemon=True)

  def start(self) -> None:
    self.engine.start()
    self._thread.start()

  def submit(self, ticket: Ticket) -> Ticket:
    """Queue ``ticket`` (thread-safe; returns at once)."""
    with self._wake:
      if self.error is not None:
        ticket.publish([], True, self.error)
        return ticket
      self._arrived.append(ticket)
      self._wake.notify()
    return ticket

  def cancel(self, ticket: Ticket) -> None:
    """Stop ``ticket``'s request at the next segment boundary; it publishes nothing more."""
    with self._wake:
      ticket.done = True
      self._cancelled.append(ticket)
      self._wake.notify()

  def outstanding(self) -> int:
    """Requests submitted and not yet finished or cancelled."""
    with self._wake:
      return len(self._arrived) + len(self._waiting) + len(self._live)

  def drain(self, timeout: float) -> int:
    """Wait up to ``timeout`` seconds for every outstanding request to finish, then end the rest with an
    error and stop the thread. Returns how many were ended that way."""
    deadline = time.monotonic() + timeout
    while self.outstanding() and time.monotonic() < deadline and self._thread.is_alive():
      time.sleep(0.05)
    with self._wake:
      self._stop = True
      self._wake.notify()
    self._thread.join()
    rest = self._arrived + self._waiting + list(self._live.values())
    for t in rest:
      if not t.done:
        t.done = True
        t.publish([], True, f"the server shut down before this request finished (drain timeout {timeout:g}s)")
    self._arrived, self._waiting, self._live = [], [], {}
    return len(rest)

  def _take(self) -> tuple[list[Ticket], list[Ticket]] | None:
    """(arrived, cancelled) since the last call, after waiting for work while nothing runs; None: stop."""
    with self._wake:
      while not (self._stop or self._arrived or self._cancelled or self._waiting or self._live):
        self._wake.wait()
      if self._stop:
        return None
      arrived, cancelled = self._arrived, self._cancelled
      self._arrived, self._cancelled = [], []
      return arrived, cancelled

  def _run(self) -> None:
    try:
      while (taken := self._take()) is not None:
        arrived, cancelled = taken
        self._segment(arrived, set(cancelled))
    except Exception as e:  # noqa: BLE001  (the device loop failed: every request is told, none hangs)
      with self._wake:
        self.error = f"the engine failed ({type(e).__name__}: {e}); restart the server"
        rest = self._arrived + self._waiting + list(self._live.values())
        self._arrived, self._waiting, self._live = [], [], {}
      for t in rest:
        t.publish([], True, self.error)
      raise

  def _segment(self, arrived: list[Ticket], cancelled: set[Ticket]) -> None:
    """Cancel, submit, one ``step``, publish (module docstring)."""
    engine = self.engine
    gone = [rid for rid, t in self._live.items() if t in cancelled]
    engine.cancel(gone)
    for rid in gone:
      del self._live[rid]
    waiting = self._waiting + arrived
    self._waiting = [t for t in waiting if t not in cancelled]
    self.cancelled += len(gone) + len(waiting) - len(self._waiting)
    free = engine.plan.queue * engine.plan.groups - len(self._live)
    if free > 0 and self._waiting:
      batch, self._waiting = self._waiting[:free], self._waiting[free:]
      self._live.update(zip(engine.submit([t.request for t in batch]), batch))
    if not self._live:
      return
    finished = engine.step(self.segment_rounds)
    self.segments += 1
    for r in finished:
      t = self._live.pop(r.id)
      if not t.done:
        t.done = True
        t.publish(r.tokens, True, None)
    for rid, tokens in engine.progress().items():
      t = self._live[rid]
      if len(tokens) > t.published and not t.done:
        t.published = len(tokens)
        t.publish(tokens, False, None)

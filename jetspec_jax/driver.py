"""One thread that owns an ``Engine`` and serves requests arriving from other threads.

The thread keeps one segment in flight: it cancels what was asked to stop, submits waiting requests (as many
as the engine's queue has free entries; the rest wait their turn, in arrival order), dispatches the next
segment (``segment_rounds`` rounds), and only then collects the previous one and publishes it: to every live
request its new tokens (a delta: host work in the new tokens), to those that finished their last ones. The
device runs a segment while the host handles the one before, so host work is hidden unless it takes longer
than a segment; a request submitted or cancelled while a segment runs takes effect in the next. Callers never
touch the engine: ``submit`` and ``cancel`` only append to locked lists and wake the thread, and a ``Ticket``'s
``publish`` callback must return at once (a server hands the update to its event loop), so neither side waits
on the other.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from jetspec_jax.decode.engine import Engine, Request
from jetspec_jax.errors import JetSpecError

# publish(new tokens, done, error): the tokens since the last publish (a delta); done with error None is a normal
# finish (the delta completes the tokens); an error (one sentence) ends the request without more tokens.
Publish = Callable[[list[int], bool, "str | None"], None]


class Overloaded(JetSpecError):
  """The driver's waiting list is at its bound (``max_waiting``): the request was not taken."""


@dataclasses.dataclass(eq=False)
class Ticket:
  """A request handed to the driver and where its updates go."""
  request: Request
  publish: Publish
  done: bool = False
  cached_tokens: int = 0          # prompt rows the prefix cache supplied (set when it finishes)


class Driver:
  """Runs ``engine`` in its own thread (``start``), ``segment_rounds`` rounds per segment. ``max_waiting``: the
  most requests that may wait for a queue entry (None: unbounded); ``submit`` refuses more (``Overloaded``)."""

  def __init__(self, engine: Engine, segment_rounds: int = 8, max_waiting: int | None = None):
    self.engine, self.segment_rounds, self.max_waiting = engine, segment_rounds, max_waiting
    self._wake = threading.Condition()
    self._arrived: list[Ticket] = []
    self._cancelled: list[Ticket] = []
    self._waiting: list[Ticket] = []
    self._live: dict[int, Ticket] = {}                 # engine id -> ticket
    self._stop = False
    self.error: str | None = None                      # set when the device loop failed; nothing more runs
    self.segments = 0                                  # segments collected
    self.cancelled = 0                                 # requests stopped before they finished
    self.refused = 0                                   # requests refused at the bound (``Overloaded``)
    self.rejected = 0                                  # requests the engine could not run (told, one sentence)
    self.decode_rounds = 0                             # finished requests' decode rounds and tokens after the first
    self.decoded_tokens = 0
    self.prompt_tokens = 0                             # finished requests' prompt tokens, of them prefix-cached,
    self.cached_tokens = 0                             # and their preemptions
    self.preemptions = 0
    self.pages_used = self.pages_cached = 0            # KV pages held, and free ones holding cached rows (last segment)
    self._thread = threading.Thread(target=self._run, name="jetspec-engine", daemon=True)

  def start(self) -> None:
    self.engine.start()
    self._thread.start()

  def submit(self, ticket: Ticket) -> Ticket:
    """Queue ``ticket`` (thread-safe; returns at once). Raises ``Overloaded`` when ``max_waiting`` requests
    already wait."""
    with self._wake:
      if self.error is not None:
        ticket.publish([], True, self.error)
        return ticket
      waiting = self.waiting()
      if self.max_waiting is not None and waiting >= self.max_waiting:
        self.refused += 1
        raise Overloaded(f"{waiting} requests are waiting for this server, its limit (serve --max-waiting); "
                         f"retry shortly")
      self._arrived.append(ticket)
      self._wake.notify()
    return ticket

  def cancel(self, ticket: Ticket) -> None:
    """Stop ``ticket``'s request at the next segment boundary; it publishes nothing more."""
    with self._wake:
      ticket.done = True
      self._cancelled.append(ticket)
      self._wake.notify()

  def waiting(self) -> int:
    """Requests submitted and not yet in the engine."""
    return len(self._arrived) + len(self._waiting)

  def running(self) -> int:
    """Requests in the engine (queued on device or holding a slot)."""
    return len(self._live)

  def tau(self) -> float:
    """Committed tokens per decode round over the finished requests (``engine.acceptance``'s tau)."""
    return self.decoded_tokens / max(self.decode_rounds, 1)

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

  def _take(self, wait: bool) -> tuple[list[Ticket], list[Ticket]] | None:
    """(arrived, cancelled) since the last call, after waiting for work while nothing runs (``wait``: no
    segment in flight); None: stop."""
    with self._wake:
      while wait and not (self._stop or self._arrived or self._cancelled or self._waiting or self._live):
        self._wake.wait()
      if self._stop:
        return None
      arrived, cancelled = self._arrived, self._cancelled
      self._arrived, self._cancelled = [], []
      return arrived, cancelled

  def _run(self) -> None:
    try:
      in_flight = None
      while (taken := self._take(wait=in_flight is None)) is not None:
        arrived, cancelled = taken
        self._admit(arrived, set(cancelled))
        dispatched = self.engine.dispatch(self.segment_rounds) if self._live else None
        if in_flight is not None:
          self._publish(self.engine.collect(in_flight))
        in_flight = dispatched
    except Exception as e:  # noqa: BLE001  (the device loop failed: every request is told, none hangs)
      with self._wake:
        self.error = f"the engine failed ({type(e).__name__}: {e}); restart the server"
        rest = self._arrived + self._waiting + list(self._live.values())
        self._arrived, self._waiting, self._live = [], [], {}
      for t in rest:
        t.publish([], True, self.error)
      raise

  def _admit(self, arrived: list[Ticket], cancelled: set[Ticket]) -> None:
    """Cancel, then submit what the engine's queue has room for (module docstring)."""
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
      good = []
      for t in batch:                          # one request the engine cannot run is told; the others go on
        try:
          engine.check([t.request])
        except JetSpecError as e:
          self.rejected += 1
          t.done = True
          t.publish([], True, str(e).removeprefix("request 0: "))
          continue
        good.append(t)
      if good:
        self._live.update(zip(engine.submit([t.request for t in good]), good))

  def _publish(self, update) -> None:
    """A collected segment's new tokens and finished requests to their tickets."""
    self.segments += 1
    self.pages_used, self.pages_cached = update.pages_used, update.pages_cached
    for r in update.finished:
      self.decode_rounds += r.steps
      self.decoded_tokens += max(len(r.tokens) - 1, 0)
      self.preemptions += r.preempted
      self.cached_tokens += r.cached_tokens
      t = self._live.pop(r.id)
      self.prompt_tokens += len(t.request.prompt)
      t.cached_tokens = r.cached_tokens
      if not t.done:
        t.done = True
        t.publish(update.new.get(r.id, []), True, None)
    for rid, new in update.new.items():
      t = self._live.get(rid)
      if t is not None and not t.done:
        t.publish(new, False, None)

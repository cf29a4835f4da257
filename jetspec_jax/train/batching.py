"""Batches of prepared rows: ``pad_rows`` (rows -> [B, L] arrays) and ``BatchIterator`` (seeded
per-epoch shuffles, disjoint per-process slices, an integer state to resume from).
"""
from __future__ import annotations

import numpy as np

from jetspec_jax.errors import JetSpecError


def pad_rows(rows: list[dict[str, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """Rows -> a batch: input_ids / loss_mask / segment_ids / positions [B, seq_len] int32, length [B] int32.

  segment_ids numbers a row's conversations 1..k and is 0 on padding; positions restart at 0 in
  each conversation (0 on padding); length counts a row's real tokens.
  """
  batch = len(rows)
  out = {"input_ids": np.full((batch, seq_len), pad_id, np.int32),
         "loss_mask": np.zeros((batch, seq_len), np.int32),
         "segment_ids": np.zeros((batch, seq_len), np.int32),
         "positions": np.zeros((batch, seq_len), np.int32),
         "length": np.zeros((batch,), np.int32)}
  for b, row in enumerate(rows):
    n, segs = len(row["input_ids"]), np.asarray(row["segment_lengths"])
    out["input_ids"][b, :n] = row["input_ids"]
    out["loss_mask"][b, :n] = row["loss_mask"]
    out["segment_ids"][b, :n] = np.repeat(np.arange(1, len(segs) + 1, dtype=np.int32), segs)
    out["positions"][b, :n] = np.arange(n) - np.repeat(np.cumsum(segs) - segs, segs)
    out["length"][b] = n
  return out


class BatchIterator:
  """Endless numpy batches (see ``pad_rows``) of ``batch_size`` rows per process.

  Epoch e visits all rows in the order ``permutation(seed, e)`` (identity without ``shuffle``); the
  concatenated epochs are cut into global batches of ``batch_size * process_count`` rows, and process
  p reads only rows ``[p * batch_size, (p + 1) * batch_size)`` of each, so processes' slices are
  disjoint and together cover every row once per epoch. ``state`` is the number of batches taken;
  ``BatchIterator(..., state=s)`` yields exactly the batches that followed state ``s``. ``rows``: a
  ``records.ChatRows`` (``len``, ``read(indices)``, ``seq_len``, ``pad_id``, ``path``); only rows
  ``start..len(rows)-1`` are visited (the first ``start`` are held out).
  """

  def __init__(self, rows, batch_size: int, *, seed: int = 0, shuffle: bool = True, process_index: int | None = None,
               process_count: int | None = None, state: int = 0, start: int = 0):
    if process_index is None or process_count is None:
      import jax
      process_index, process_count = jax.process_index(), jax.process_count()
    if batch_size <= 0 or not 0 <= process_index < process_count:
      raise JetSpecError(f"need batch_size > 0 and 0 <= process_index < process_count (got {batch_size}, "
                         f"{process_index}, {process_count})")
    if len(rows) <= start:
      raise JetSpecError(f"dataset {rows.path} has no rows after the first {start}" if start else
                         f"dataset {rows.path} is empty")
    self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
    self.start, self.size = start, len(rows) - start
    self.process_index, self.process_count = process_index, process_count
    self.state = int(state)
    self._perm_epoch, self._perm = -1, None

  @property
  def steps_per_epoch(self) -> int:
    """Global batches needed to visit every row at least once."""
    return -(-self.size // (self.batch_size * self.process_count))

  def _order(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      n = self.size
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
      self._perm_epoch = epoch
    return self._perm

  def indices(self, step: int) -> np.ndarray:
    """Row indices [batch_size] (of ``rows``) this process reads at batch ``step``."""
    n = self.size
    first = (step * self.process_count + self.process_index) * self.batch_size
    return self.start + np.array([self._order(q // n)[q % n] for q in range(first, first + self.batch_size)], np.int64)

  def batch(self, step: int) -> dict[str, np.ndarray]:
    return pad_rows(self.rows.read(self.indices(step)), self.rows.seq_len, self.rows.pad_id)

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    out = self.batch(self.state)
    self.state += 1
    return out

"""Training metrics: one JSON line per step, plus TensorBoard event files, with no extra dependency.

``MetricsWriter(log_dir).write(step, {"loss": 1.2, "lr": 3e-4})`` appends
``{"step": 10, "wall_time": 1.7e9, "loss": 1.2, "lr": 0.0003}`` to ``log_dir/metrics.jsonl`` and one
scalar ``Event`` to ``log_dir/events.out.tfevents.<int time>.<hostname>``, flushing both. Only
process 0 writes (``process_index`` defaults to ``jax.process_index()``); every other process, and a
writer made with ``enabled=False``, accepts the same calls and writes nothing.

The event file is written without tensorflow, tensorboard or protobuf:

* TFRecord framing: ``uint64 length | masked crc32c(length) | data | masked crc32c(data)``, all
  little-endian, with CRC32C (Castagnoli) computed from a 256-entry table;
* the ``tensorflow.Event`` message encoded by hand: ``wall_time`` (double, field 1), ``step`` (int64,
  field 2), ``file_version`` (string, field 3; ``"brain.Event:2"`` in the first record only) and
  ``summary`` (field 5) holding repeated ``Summary.Value{tag (string, 1), simple_value (float, 2)}``.

Non-finite values are written as JSON ``null`` in ``metrics.jsonl`` (strict JSON) and as the IEEE
value in the event file.
"""
from __future__ import annotations

import json
import math
import numbers
import os
import socket
import struct
import time
from typing import Mapping

from jetspec_jax import files
from jetspec_jax.errors import JetSpecError

FILE_VERSION = "brain.Event:2"
JSONL_NAME = "metrics.jsonl"
_RESERVED = ("step", "wall_time")

# ----------------------------------------------------------------------------------------- CRC32C


def _make_crc32c_table() -> tuple[int, ...]:
  poly = 0x82F63B78  # Castagnoli polynomial, bit-reversed
  table = []
  for i in range(256):
    c = i
    for _ in range(8):
      c = (c >> 1) ^ poly if c & 1 else c >> 1
    table.append(c)
  return tuple(table)


_CRC32C_TABLE = _make_crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC32C (Castagnoli) of ``data``; ``crc32c(b"123456789") == 0xE3069283``."""
  crc = 0xFFFFFFFF
  table = _CRC32C_TABLE
  for b in data:
    crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """The TFRecord CRC: rotate right by 15 bits and add a constant (mod 2**32)."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
  """One TFRecord frame around ``data``."""
  header = struct.pack("<Q", len(data))
  return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


# ------------------------------------------------------------------------------ protobuf encoding


def _varint(value: int) -> bytes:
  if value < 0:  # int64: two's complement, always 10 bytes
    value += 1 << 64
  out = bytearray()
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
  return _varint((field << 3) | wire_type)


_F32_MAX = 3.4028234663852886e38


def _f32(value: float) -> bytes:
  """Little-endian float32; magnitudes past the float32 range become +-inf (struct would raise)."""
  value = float(value)
  if math.isfinite(value) and abs(value) > _F32_MAX:
    value = math.copysign(math.inf, value)
  try:
    return struct.pack("<f", value)
  except OverflowError:  # rounding just above _F32_MAX
    return struct.pack("<f", math.copysign(math.inf, value))


def _len_field(field: int, payload: bytes) -> bytes:
  return _key(field, 2) + _varint(len(payload)) + payload


RESTART_STATUS = 1   # Event field 6 with status START: TensorBoard drops earlier events at steps >= this one's


def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 scalars: Mapping[str, float] | None = None, restart: bool = False) -> bytes:
  """The serialized ``tensorflow.Event`` with the given fields (scalars as ``simple_value``;
  ``restart``: the START marker with which a restarted run tells TensorBoard to purge the steps it
  repeats)."""
  out = _key(1, 1) + struct.pack("<d", float(wall_time)) + _key(2, 0) + _varint(int(step))
  if file_version is not None:
    out += _len_field(3, file_version.encode("utf-8"))
  if restart:
    out += _len_field(6, _key(1, 0) + _varint(RESTART_STATUS))
  if scalars:
    summary = b"".join(
        _len_field(1, _len_field(1, tag.encode("utf-8")) + _key(2, 5) + _f32(value))
        for tag, value in scalars.items())
    out += _len_field(5, summary)
  return out


# ----------------------------------------------------------------------------------------- writer


def _as_step(step) -> int:
  if isinstance(step, bool) or not isinstance(step, numbers.Integral):
    try:
      import numpy as np
      arr = np.asarray(step)
      if arr.shape == () and np.issubdtype(arr.dtype, np.integer):
        return int(arr)
    except Exception:  # noqa: BLE001 - anything that is not an integer is the user's mistake
      pass
    raise JetSpecError(f"metrics step must be an integer, got {step!r}")
  return int(step)


def _as_scalar(tag, value) -> int | float:
  if not isinstance(tag, str) or not tag:
    raise JetSpecError(f"metric names must be non-empty strings, got {tag!r}")
  if tag in _RESERVED:
    raise JetSpecError(f"metric name {tag!r} is reserved for the record itself; rename it")
  if isinstance(value, bool):
    return int(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  try:  # numpy / jax scalars and one-element arrays
    import numpy as np
    arr = np.asarray(value)
    if arr.size == 1 and (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
      item = arr.reshape(()).item()
      return int(item) if isinstance(item, (bool, int)) else float(item)
  except Exception:  # noqa: BLE001
    pass
  raise JetSpecError(f"metric {tag!r} must be a real scalar, got {type(value).__name__} {value!r}"[:200])


def _json_value(value: int | float):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _default_process_index() -> int:
  import jax
  return jax.process_index()


class MetricsWriter:
  """Appends scalar metrics to ``log_dir/metrics.jsonl`` and a TensorBoard event file (process 0 only).

  Args:
    log_dir: directory for both files (created if missing).
    enabled: ``False`` makes every call a no-op (nothing is created).
    process_index: this process's index; defaults to ``jax.process_index()``. Only 0 writes.
    start_step: the step the run starts after (0: a fresh run; k: resumed from a checkpoint of step k).
      Records of later steps that an earlier run wrote to metrics.jsonl are dropped (that run's work past
      its last checkpoint is redone and logged again), and the new event file opens with a TensorBoard
      restart marker at step k + 1, so TensorBoard drops them too. None keeps every earlier record.
  """

  def __init__(self, log_dir: str | os.PathLike | None, enabled: bool = True, process_index: int | None = None,
               start_step: int | None = None):
    if process_index is None and enabled:
      process_index = _default_process_index()
    self.process_index = 0 if process_index is None else int(process_index)
    self.active = bool(enabled) and self.process_index == 0
    self.log_dir = None if log_dir is None else os.fspath(log_dir)
    self.jsonl_path: str | None = None
    self.event_path: str | None = None
    self._jsonl = None
    self._events = None
    self._closed = False
    if not self.active:
      return
    if self.log_dir is None:
      raise JetSpecError("MetricsWriter needs a log_dir when it is enabled")
    if os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
      raise JetSpecError(f"metrics log_dir {self.log_dir} exists and is not a directory")
    os.makedirs(self.log_dir, exist_ok=True)
    self.jsonl_path = os.path.join(self.log_dir, JSONL_NAME)
    base = os.path.join(self.log_dir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
    path, n = base, 0
    while os.path.exists(path):  # two writers in the same second: never append to another run's file
      n += 1
      path = f"{base}.{n}"
    self.event_path = path
    if start_step is not None and os.path.exists(self.jsonl_path):
      with open(self.jsonl_path, encoding="utf-8") as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= start_step]
      files.write_text(self.jsonl_path, "".join(kept))
    self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
    self._events = open(self.event_path, "xb")
    self._events.write(tfrecord(encode_event(time.time(), 0, file_version=FILE_VERSION)))
    if start_step:
      self._events.write(tfrecord(encode_event(time.time(), start_step + 1, restart=True)))
    self._events.flush()

  def write(self, step, scalars: Mapping[str, object]) -> None:
    """Record ``scalars`` (name -> real number, numpy/jax scalars included) at ``step``; flushes."""
    if self._closed:
      raise JetSpecError("MetricsWriter.write was called after close()")
    step = _as_step(step)
    if not isinstance(scalars, Mapping):
      raise JetSpecError(f"metrics must be a mapping of name -> scalar, got {type(scalars).__name__}")
    values = {tag: _as_scalar(tag, v) for tag, v in scalars.items()}
    if not self.active:
      return
    wall = time.time()
    record = {"step": step, "wall_time": wall, **{k: _json_value(v) for k, v in values.items()}}
    self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
    self._jsonl.flush()
    if values:
      self._events.write(tfrecord(encode_event(wall, step, scalars={k: float(v) for k, v in values.items()})))
      self._events.flush()

  def flush(self) -> None:
    for f in (self._jsonl, self._events):
      if f is not None and not f.closed:
        f.flush()

  def close(self) -> None:
    """Flush and close both files; safe to call more than once."""
    self._closed = True
    for f in (self._jsonl, self._events):
      if f is not None and not f.closed:
        f.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):  # best effort; close() is the API
    try:
      self.close()
    except Exception:  # noqa: BLE001
      pass

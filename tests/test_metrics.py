"""MetricsWriter: metrics.jsonl plus TensorBoard event files, decoded here by an independent reader."""
import glob
import json
import math
import os
import socket
import struct

import numpy as np
import pytest

from jetspec_jax.errors import JetSpecError
from jetspec_jax.train import metrics
from jetspec_jax.train.metrics import MetricsWriter

# ------------------------------------------------- an independent minimal TFRecord / Event reader


def _crc32c_bitwise(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for b in data:
    crc ^= b
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
  return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
  c = _crc32c_bitwise(data)
  return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def read_records(path):
  with open(path, "rb") as f:
    buf = f.read()
  pos, out = 0, []
  while pos < len(buf):
    header = buf[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (hcrc,) = struct.unpack("<I", buf[pos + 8:pos + 12])
    assert hcrc == _masked(header), "length CRC mismatch"
    data = buf[pos + 12:pos + 12 + length]
    (dcrc,) = struct.unpack("<I", buf[pos + 12 + length:pos + 16 + length])
    assert dcrc == _masked(data), "data CRC mismatch"
    out.append(data)
    pos += 16 + length
  assert pos == len(buf)
  return out


def _read_varint(buf, pos):
  shift = result = 0
  while True:
    b = buf[pos]
    pos += 1
    result |= (b & 0x7F) << shift
    shift += 7
    if not b & 0x80:
      return result, pos


def parse_fields(buf):
  """[(field_number, wire_type, value)] with value int (varint), bytes (len/fixed)."""
  pos, out = 0, []
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    field, wt = key >> 3, key & 7
    if wt == 0:
      val, pos = _read_varint(buf, pos)
    elif wt == 1:
      val, pos = buf[pos:pos + 8], pos + 8
    elif wt == 2:
      n, pos = _read_varint(buf, pos)
      val, pos = buf[pos:pos + n], pos + n
    elif wt == 5:
      val, pos = buf[pos:pos + 4], pos + 4
    else:
      raise AssertionError(f"unexpected wire type {wt}")
    out.append((field, wt, val))
  assert pos == len(buf)
  return out


def decode_event(data):
  ev = {"values": {}}
  for field, wt, val in parse_fields(data):
    if field == 1:
      assert wt == 1
      ev["wall_time"] = struct.unpack("<d", val)[0]
    elif field == 2:
      assert wt == 0
      ev["step"] = val - (1 << 64) if val >= 1 << 63 else val
    elif field == 3:
      assert wt == 2
      ev["file_version"] = val.decode()
    elif field == 5:
      assert wt == 2
      for f2, wt2, value_msg in parse_fields(val):
        assert (f2, wt2) == (1, 2)
        tag = simple = None
        for f3, wt3, v3 in parse_fields(value_msg):
          if f3 == 1:
            assert wt3 == 2
            tag = v3.decode()
          elif f3 == 2:
            assert wt3 == 5
            simple = struct.unpack("<f", v3)[0]
        ev["values"][tag] = simple
    else:
      raise AssertionError(f"unexpected Event field {field}")
  return ev


def read_events(log_dir):
  files = glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
  assert len(files) == 1, files
  return files[0], [decode_event(r) for r in read_records(files[0])]


# -------------------------------------------------------------------------------------------- tests


def test_crc32c_known_vectors():
  assert metrics.crc32c(b"123456789") == 0xE3069283
  assert metrics.crc32c(b"") == 0
  assert metrics.crc32c(bytes(32)) == 0x8A9136AA
  data = bytes(range(256)) * 3
  assert metrics.crc32c(data) == _crc32c_bitwise(data)


def test_event_file_round_trip(tmp_path):
  log_dir = tmp_path / "run"
  with MetricsWriter(log_dir, process_index=0) as w:
    w.write(0, {"loss": 2.5, "lr": 1e-3})
    w.write(10, {"loss": np.float32(1.25), "accept/tau": 3, "grad_norm": np.array(0.5)})
    w.write(2 ** 40, {"loss": float("nan"), "huge": 1e300})
    w.write(-3, {"neg_step": -7.5})
    event_path = w.event_path

  path, events = read_events(str(log_dir))
  assert path == event_path
  name = os.path.basename(path)
  prefix, stamp, host = name[:len("events.out.tfevents.")], name.split(".")[3], name.split(".", 4)[4]
  assert prefix == "events.out.tfevents." and stamp.isdigit() and host == socket.gethostname()

  assert events[0]["file_version"] == "brain.Event:2" and events[0]["values"] == {}
  assert all("file_version" not in e for e in events[1:])
  assert [e["step"] for e in events[1:]] == [0, 10, 2 ** 40, -3]
  assert events[1]["values"] == {"loss": 2.5, "lr": pytest.approx(1e-3, rel=1e-6)}
  assert events[2]["values"] == {"loss": 1.25, "accept/tau": 3.0, "grad_norm": 0.5}
  assert math.isnan(events[3]["values"]["loss"]) and events[3]["values"]["huge"] == math.inf
  assert events[4]["values"] == {"neg_step": -7.5}
  assert all(abs(e["wall_time"] - events[0]["wall_time"]) < 600 for e in events)

  lines = (log_dir / "metrics.jsonl").read_text().splitlines()
  recs = [json.loads(line) for line in lines]
  assert [r["step"] for r in recs] == [0, 10, 2 ** 40, -3]
  assert recs[0]["loss"] == 2.5 and recs[0]["lr"] == 1e-3
  assert recs[1]["accept/tau"] == 3 and isinstance(recs[1]["accept/tau"], int) and recs[1]["loss"] == 1.25
  assert recs[2]["loss"] is None and recs[2]["huge"] == 1e300  # strict JSON: NaN -> null
  assert all(isinstance(r["wall_time"], float) for r in recs)


def test_flushes_after_each_write_and_appends_jsonl(tmp_path):
  w = MetricsWriter(tmp_path, process_index=0)
  w.write(1, {"a": 1.0})
  _, events = read_events(str(tmp_path))  # readable while still open
  assert [e["step"] for e in events] == [0, 1]
  assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
  w.close()
  w.close()  # idempotent
  with pytest.raises(JetSpecError, match="after close"):
    w.write(2, {"a": 1.0})
  with MetricsWriter(tmp_path, process_index=0) as w2:  # a second run appends to the same jsonl
    w2.write(2, {"a": 2.0})
  assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
  assert len(glob.glob(str(tmp_path / "events.out.tfevents.*"))) == 2  # never two writers in one file


@pytest.mark.parametrize("kwargs", [{"process_index": 1}, {"process_index": 3}, {"enabled": False}])
def test_only_process_zero_writes(tmp_path, kwargs):
  log_dir = tmp_path / "run"
  with MetricsWriter(log_dir, **kwargs) as w:
    assert not w.active
    w.write(1, {"loss": 1.0})
    with pytest.raises(JetSpecError):  # inputs are still checked everywhere
      w.write(1, {"loss": "high"})
  assert not log_dir.exists()


def test_default_process_index_is_jax(tmp_path):
  import jax
  w = MetricsWriter(tmp_path)
  assert w.process_index == jax.process_index() == 0 and w.active
  w.close()


@pytest.mark.parametrize("step,scalars,match", [
    (1.5, {"a": 1.0}, "step must be an integer"),
    ("3", {"a": 1.0}, "step must be an integer"),
    (1, {"a": "x"}, "must be a real scalar"),
    (1, {"a": np.ones(3)}, "must be a real scalar"),
    (1, {"a": 1 + 2j}, "must be a real scalar"),
    (1, {"": 1.0}, "non-empty strings"),
    (1, {3: 1.0}, "non-empty strings"),
    (1, {"step": 1.0}, "reserved"),
    (1, [("a", 1.0)], "mapping"),
])
def test_bad_input_is_a_clear_error(tmp_path, step, scalars, match):
  with MetricsWriter(tmp_path, process_index=0) as w:
    with pytest.raises(JetSpecError, match=match):
      w.write(step, scalars)


def test_log_dir_that_is_a_file(tmp_path):
  f = tmp_path / "file"
  f.write_text("x")
  with pytest.raises(JetSpecError, match="not a directory"):
    MetricsWriter(f, process_index=0)


def test_jax_scalars(tmp_path):
  import jax.numpy as jnp
  with MetricsWriter(tmp_path, process_index=0) as w:
    w.write(np.int64(5), {"loss": jnp.float32(0.75), "ok": jnp.array(True)})
  _, events = read_events(str(tmp_path))
  assert events[1]["step"] == 5 and events[1]["values"] == {"loss": 0.75, "ok": 1.0}

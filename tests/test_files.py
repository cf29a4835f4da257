"""Atomic writes (``jetspec_jax.files``): a file appears whole or not at all."""
import json
import os
import stat

import pytest

from jetspec_jax import files


def _leftovers(folder):
  return [n for n in os.listdir(folder) if n.endswith(".tmp")]


def test_write_json_and_jsonl_round_trip(tmp_path):
  path = tmp_path / "sub" / "a.json"             # the parent is created
  assert files.write_json(path, {"b": [1, "é"]}, ensure_ascii=False) == str(path)
  assert path.read_text(encoding="utf-8") == json.dumps({"b": [1, "é"]}, indent=2, ensure_ascii=False) + "\n"
  rows = tmp_path / "rows.jsonl"
  files.write_jsonl(rows, ({"i": i} for i in range(3)))
  assert [json.loads(l) for l in rows.read_text().splitlines()] == [{"i": 0}, {"i": 1}, {"i": 2}]
  assert not _leftovers(tmp_path) and not _leftovers(tmp_path / "sub")


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
  path = tmp_path / "a.json"
  files.write_json(path, {"old": True})
  with pytest.raises(TypeError):
    files.write_json(path, {"bad": object()})    # not serializable: fails before anything is renamed
  with pytest.raises(RuntimeError):
    with files.atomic_open(path) as f:
      f.write("half of a docu")
      raise RuntimeError("interrupted")
  assert json.loads(path.read_text()) == {"old": True}
  assert not _leftovers(tmp_path)


def test_mode_follows_the_umask_and_copy_is_byte_exact(tmp_path):
  old = os.umask(0o022)
  try:
    path = files.write_text(tmp_path / "t.txt", "x")
  finally:
    os.umask(old)
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o644       # as open() would make it, not mkstemp's 0600
  src = tmp_path / "blob.bin"
  src.write_bytes(bytes(range(256)) * 9)
  os.utime(src, (1_000_000, 1_000_000))
  files.copy_file(src, tmp_path / "copy.bin")
  assert (tmp_path / "copy.bin").read_bytes() == src.read_bytes()
  assert os.stat(tmp_path / "copy.bin").st_mtime == 1_000_000

"""Files written whole or not at all: every file the project writes goes through a temporary file in
the same directory, renamed over the target when complete, so a reader (or a resumed run) never sees
half of one. On an error the temporary file is removed and the old file, if any, is left as it was."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from typing import IO, Any, Callable, Iterator


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
  """``open(path, mode)`` for writing (``mode`` "w" or "wb") whose file appears at ``path`` only when the
  block ends normally. The parent directory is created; the data is flushed to disk before the rename."""
  path = os.fspath(path)
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
  try:
    with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else encoding) as f:   # the umask's mode
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_text(path: str | os.PathLike, text: str) -> str:
  """``text`` to ``path``, atomically; returns the path."""
  with atomic_open(path) as f:
    f.write(text)
  return os.fspath(path)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, default: Callable | None = None,
               sort_keys: bool = False, ensure_ascii: bool = True) -> str:
  """``obj`` as JSON (newline-terminated) to ``path``, atomically; returns the path."""
  return write_text(path, json.dumps(obj, indent=indent, default=default, sort_keys=sort_keys,
                                     ensure_ascii=ensure_ascii) + "\n")


def write_jsonl(path: str | os.PathLike, rows) -> str:
  """One JSON document per line to ``path``, atomically; returns the path."""
  with atomic_open(path) as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  return os.fspath(path)


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> str:
  """``src``'s bytes to ``dst``, atomically, then its timestamps and mode; returns ``dst``."""
  with open(src, "rb") as source, atomic_open(dst, "wb") as f:
    shutil.copyfileobj(source, f)
  shutil.copystat(src, dst)
  return os.fspath(dst)

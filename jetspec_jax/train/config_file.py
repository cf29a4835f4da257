"""Load an ml_collections training config from a Python file and apply ``--config.a.b=value`` overrides."""
from __future__ import annotations

import importlib.util
import os
import sys

import ml_collections

from jetspec_jax.errors import JetSpecError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_config(path: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
  """Run ``get_config()`` of the file at ``path`` (e.g. configs/tiny.py), then apply overrides."""
  if not os.path.isfile(path):
    alt = os.path.join(REPO_ROOT, "configs", f"{path}.py")
    if not os.path.isfile(alt):
      raise JetSpecError(f"config file not found: {path}")
    path = alt
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  for p in (root, REPO_ROOT):
    if p not in sys.path:
      sys.path.insert(0, p)
  spec = importlib.util.spec_from_file_location(f"_jetspec_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise JetSpecError(f"config file {path} has no get_config() function")
  config = module.get_config()
  for item in overrides:
    apply_override(config, item)
  return config


def _parse(value: str, current):
  if isinstance(current, bool):
    if value.lower() not in ("true", "false", "1", "0"):
      raise ValueError(value)
    return value.lower() in ("true", "1")
  if isinstance(current, int):
    return int(value)
  if isinstance(current, float):
    return float(value)
  if isinstance(current, (tuple, list)):
    return tuple(int(v) for v in value.split(",") if v.strip())
  return value


def apply_override(config: ml_collections.ConfigDict, item: str) -> None:
  """Apply one ``[--config.]section.key=value``; unknown keys and unparsable values are errors."""
  text = item[len("--config."):] if item.startswith("--config.") else item
  if "=" not in text:
    raise JetSpecError(f"config override {item!r} is not of the form --config.section.key=value")
  key, value = text.split("=", 1)
  node, parts = config, key.split(".")
  for part in parts[:-1]:
    if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
      raise JetSpecError(f"unknown config key {key!r}")
    node = node[part]
  if parts[-1] not in node:
    raise JetSpecError(f"unknown config key {key!r}")
  current = node[parts[-1]]
  try:
    node[parts[-1]] = _parse(value, current)
  except ValueError:
    raise JetSpecError(f"config key {key!r} expects a {type(current).__name__}, got {value!r}") from None

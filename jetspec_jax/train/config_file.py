"""Load an ml_collections training config (a file, or a shipped one by name) and apply
``--config.a.b=value`` overrides.

The shipped configs live in the checkout's ``configs/`` and are installed as ``jetspec_jax.configs``
(``setup.py``'s package_dir); a config file starts from ``jetspec_jax.configs.base.base_config()``.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import os

import ml_collections

from jetspec_jax.errors import JetSpecError


def shipped_configs() -> dict[str, str]:
  """{name: file} of the shipped configs (``tiny``, ``qwen3_8b``, ...)."""
  root = importlib.resources.files("jetspec_jax.configs")
  return {p.name[:-3]: str(p) for p in root.iterdir()
          if p.name.endswith(".py") and p.name not in ("__init__.py", "base.py")}


def load_config(path: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
  """Run ``get_config()`` of the file at ``path`` (e.g. configs/tiny.py) or of the shipped config of that
  name (e.g. tiny), then apply overrides."""
  if not os.path.isfile(path):
    shipped = shipped_configs()
    if path not in shipped:
      raise JetSpecError(f"config file not found: {path} (shipped configs: {', '.join(sorted(shipped))})")
    path = shipped[path]
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

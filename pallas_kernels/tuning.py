"""Launch configurations of the tree-attention kernel, chosen per problem from a tuning table.

A ``KernelTuning`` maps the kernel's tile rows (GQA group x tree nodes, the dimension a small tree
fills) to a ``LaunchConfig``: rule i = (max_rows, config) applies to problems with
rows <= max_rows that no earlier rule takes; problems above every rule use the last rule's config.
``bench/gpu_check.py`` measures one (its tune section) and writes it as JSON:

  {"device_kind": "NVIDIA H200", "rules": [{"max_rows": 4, "block_r": 16, "block_k": 64,
   "num_warps": 4, "num_stages": 2, "num_splits": null, "target_programs": 528}, ...]}

(a field left out of a rule takes ``LaunchConfig``'s default).

A table travels to the kernel as a static value (``tree_attention(..., tuning=)``, through
``jetspec_jax.attention.AttentionImpl`` from the CLI's ``--kernel-tuning``); a call without one
uses ``DEFAULT_TUNING``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pallas_kernels.errors import KernelError



@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  """One launch: row and prefix-key tile sizes (powers of two >= 16), Triton warps and pipeline
  stages, and the prefix splits: a fixed count, or (None) chosen per problem by ``launch_shapes``
  for about ``target_programs`` programs with splits of at least ``min_split_keys`` keys (None:
  max(8 * block_r, 256))."""
  block_r: int = 64
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  num_splits: int | None = None
  target_programs: int = 264
  min_split_keys: int | None = None


FIELDS = tuple(f.name for f in dataclasses.fields(LaunchConfig))
OPTIONAL = ("num_splits", "min_split_keys")          # fields that may be null (chosen per problem)


@dataclasses.dataclass(frozen=True)
class KernelTuning:
  """rules: ((max_rows, LaunchConfig), ...) with max_rows strictly increasing; device_kind: the device
  it was measured on ("" for the built-in default)."""
  rules: tuple[tuple[int, LaunchConfig], ...]
  device_kind: str = ""

  def __post_init__(self):
    bounds = [max_rows for max_rows, _ in self.rules]
    if not bounds or any(b < 1 for b in bounds) or bounds != sorted(set(bounds)):
      raise KernelError(f"a kernel tuning needs at least one rule, with max_rows >= 1 strictly increasing; "
                         f"got max_rows {bounds}.")

  def config_for(self, rows: int) -> LaunchConfig:
    """The configuration of a problem whose tile rows (group x tree nodes) are ``rows``."""
    return next((config for max_rows, config in self.rules if rows <= max_rows), self.rules[-1][1])

  def to_json(self) -> dict:
    return dict(device_kind=self.device_kind,
                rules=[dict(max_rows=max_rows, **dataclasses.asdict(config)) for max_rows, config in self.rules])

  @classmethod
  def from_json(cls, data, *, source: str = "kernel tuning") -> KernelTuning:
    """Parses ``to_json``'s form; every problem is a KernelError that names ``source`` and the key."""
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
      raise KernelError(f"{source}: expected an object with a list 'rules', got {type(data).__name__}.")
    rules = []
    for i, rule in enumerate(data["rules"]):
      if not isinstance(rule, dict):
        raise KernelError(f"{source}: rules[{i}] is not an object.")
      unknown = sorted(set(rule) - {"max_rows", *FIELDS})
      if unknown:
        raise KernelError(f"{source}: rules[{i}] has unknown key(s) {unknown}; allowed: max_rows, {', '.join(FIELDS)}.")
      if not isinstance(rule.get("max_rows"), int):
        raise KernelError(f"{source}: rules[{i}] needs an integer 'max_rows'.")
      fields = {k: v for k, v in rule.items() if k != "max_rows"}
      for key, value in fields.items():
        if not (isinstance(value, int) or (key in OPTIONAL and value is None)):
          raise KernelError(f"{source}: rules[{i}].{key} must be an integer, got {value!r}.")
      rules.append((rule["max_rows"], LaunchConfig(**fields)))
    return cls(rules=tuple(rules), device_kind=str(data.get("device_kind", "")))

  def save(self, path: str | os.PathLike) -> None:
    """Writes the JSON form through a temporary file and a rename (never half-written)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
    tmp.replace(path)


DEFAULT_TUNING = KernelTuning(rules=((4096, LaunchConfig()),))   # one configuration for every problem


def load_tuning(path: str | os.PathLike) -> KernelTuning:
  """The table in a JSON file (see the module docstring); a clear error for a missing or bad file."""
  path = Path(path)
  if path.is_dir():
    raise KernelError(f"kernel tuning file {path} is a directory; pass the JSON file in it "
                       f"(e.g. {path / 'kernel_tuning.json'}).")
  if not path.is_file():
    raise KernelError(f"kernel tuning file {path} does not exist.")
  try:
    data = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise KernelError(f"kernel tuning {path} is not valid JSON: {e}.") from None
  return KernelTuning.from_json(data, source=f"kernel tuning {path}")


"""Atomic directories, orbax save/restore of weight dicts into their target shardings, and the
training runs' orbax CheckpointManager (``CheckpointStore``)."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jetspec_jax.errors import JetSpecError
from jetspec_jax.models.params import ParamSpec
from jetspec_jax.sharding import named_sharding

log = logging.getLogger(__name__)


def check_output_dir(out_dir: str, overwrite: bool = False) -> None:
  """Refuse an existing non-empty output directory unless ``overwrite`` (checked before any work)."""
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not overwrite:
    raise JetSpecError(f"output directory already exists and is not empty: {out_dir} (use --overwrite)")


@contextlib.contextmanager
def atomic_directory(out_dir: str, overwrite: bool = False):
  """Yield a temporary sibling directory; rename it to ``out_dir`` only if the block succeeds.

  A failure (or interruption) leaves no ``out_dir`` and removes the temporary directory.
  """
  out_dir = os.path.abspath(out_dir)
  check_output_dir(out_dir, overwrite)
  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{uuid.uuid4().hex[:8]}")
  os.makedirs(tmp)
  try:
    yield tmp
    if os.path.isdir(out_dir) and not os.path.islink(out_dir):
      shutil.rmtree(out_dir)
    elif os.path.lexists(out_dir):     # overwrite=True over a file or link
      os.remove(out_dir)
    os.rename(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


# Names that only the flat layout before the NNX model used (now ``final_norm.weight`` and ``layers.0.attn.q_proj``).
LEGACY_NAMES = ("final_norm", "layers.0.q_proj")
# Weights an earlier layout stored in parts: {name suffix: (the parts' suffixes, the axis they are stacked on)}.
# A dense MLP's gate and up [H, I] are now one ``mlp.gate_up`` [H, 2, I]; ``restore_params`` stacks the parts.
STACKED_PARTS = {"mlp.gate_up": (("mlp.gate", "mlp.up"), 1)}


def _parts_of(specs: dict[str, ParamSpec], stored) -> dict[str, tuple[tuple[str, ...], int]]:
  """{declared name: (its stored parts' names, stacking axis)} for the weights ``stored`` holds in parts."""
  out = {}
  for name in specs:
    for suffix, (parts, axis) in STACKED_PARTS.items():
      if name.endswith(suffix) and name not in stored:
        names = tuple(name[:-len(suffix)] + p for p in parts)
        if all(n in stored for n in names):
          out[name] = (names, axis)
  return out


def save_params(path: str, params: dict[str, jax.Array]) -> None:
  """Save a flat weight dict with orbax at ``path`` (which must not exist); blocks until done."""
  # Bounded write concurrency and no OCDBT: orbax's defaults buffer up to ~0.7x the model in host
  # memory while writing (measured in bench/convert_bench.py).
  checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler(save_concurrent_gb=1, use_ocdbt=False))
  checkpointer.save(os.path.abspath(path), ocp.args.StandardSave(params))


def restore_params(path: str, specs: dict[str, ParamSpec], dtype, mesh=None) -> dict[str, jax.Array]:
  """Restore the weights declared by ``specs`` from an orbax checkpoint, each in its sharding.

  Names or shapes that differ from the declaration raise a JetSpecError naming the first one.
  """
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise JetSpecError(f"checkpoint weights not found: {path}")
  checkpointer = ocp.StandardCheckpointer()
  try:
    stored = checkpointer.metadata(path).item_metadata.tree
  except Exception:   # orbax reports an empty or damaged directory in several ways (or returns None)
    stored = None
  if stored is None:
    raise JetSpecError(f"checkpoint weights at {path} are not a readable orbax checkpoint")
  if any(name in stored for name in LEGACY_NAMES) and not any(name in specs for name in LEGACY_NAMES):
    raise JetSpecError(f"checkpoint {path} was written by an older JetSpec-JAX (weights named before the Flax NNX "
                       f"model); re-run `jetspec-jax convert` on its Hugging Face directory")
  parts = _parts_of(specs, stored)
  held = (set(stored) - {n for names, _ in parts.values() for n in names}) | set(parts)
  missing = sorted(set(specs) - held)
  extra = sorted(held - set(specs))
  if missing or extra:
    what = f"is missing {missing[0]}" if missing else f"has an unexpected weight {extra[0]}"
    raise JetSpecError(f"checkpoint {path} does not match its config: it {what} "
                       f"({len(missing)} missing, {len(extra)} unexpected)")
  # What to read: every declared weight, or for one stored in parts its parts (the stacking axis dropped).
  wanted = {}
  for name, spec in specs.items():
    if name in parts:
      names, axis = parts[name]
      drop = lambda t: t[:axis] + t[axis + 1:]
      wanted.update({n: ParamSpec(drop(spec.shape), drop(spec.axes)) for n in names})
    else:
      wanted[name] = spec
  for name, spec in wanted.items():
    if tuple(stored[name].shape) != spec.shape:
      raise JetSpecError(f"checkpoint {path} does not match its config: {name} has shape "
                         f"{tuple(stored[name].shape)}, the config implies {spec.shape}")
  sharding = lambda spec: (named_sharding(spec.axes, spec.shape, mesh)
                           or jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  target = {name: jax.ShapeDtypeStruct(spec.shape, dtype or stored[name].dtype, sharding=sharding(spec))
            for name, spec in wanted.items()}
  out = checkpointer.restore(path, target)
  for name, (names, axis) in parts.items():
    stack = jax.jit(lambda *xs, axis=axis: jnp.stack(xs, axis=axis), out_shardings=sharding(specs[name]))
    out[name] = stack(*(out.pop(n) for n in names))
  return out


class CheckpointStore:
  """Orbax CheckpointManager of {state, meta}: periodic saves, keep-last-k, resume from the latest
  COMPLETE step. Orbax writes each step into a temporary directory and renames it when finished;
  leftovers of an interrupted write are never listed as steps, and are reported with a warning."""

  def __init__(self, directory: str, keep: int):
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    for name in sorted(os.listdir(self.directory)):
      if not name.isdigit() and os.path.isdir(os.path.join(self.directory, name)):
        log.warning("skipping incomplete checkpoint directory %s (an interrupted save)",
                    os.path.join(self.directory, name))
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                             enable_async_checkpointing=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_state):
    """(state like ``abstract_state``, whose leaves are ShapeDtypeStructs with shardings; meta)."""
    stored = self.manager.item_metadata(step)["state"].tree.get("params", {})
    declared = abstract_state["params"] if isinstance(abstract_state, dict) else getattr(abstract_state, "params", {})
    if any(name in stored for name in LEGACY_NAMES) or _parts_of(declared, stored):
      raise JetSpecError(f"the training checkpoints in {self.directory} were written by an older JetSpec-JAX "
                         f"(an earlier weight layout) and cannot be resumed; train into a new output directory")
    out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                             meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def close(self) -> None:
    self.manager.close()

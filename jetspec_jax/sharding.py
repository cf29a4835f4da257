"""Device meshes and the logical-axis rules that map every declared weight onto them.

Mesh axes: ``data`` (batch) and ``model`` (tensor parallel: heads, MLP, vocabulary; whole MoE experts
under expert parallelism).
Each weight declares logical axis names (its ``nnx.Param``'s ``logical_axes``, see ``models.params``);
``RULES`` maps a logical name to a mesh axis. A dimension the mesh axis does not divide is replicated
when the logical axis is in ``REPLICATE_IF_INDIVISIBLE`` (KV heads, vocabulary, batch) and is an error
otherwise (query heads, MLP width).
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jetspec_jax.errors import JetSpecError

MESH_AXES = ("data", "model")
RULES: dict[str, str | None] = {
    "batch": "data",
    "vocab": "model",
    "embed": None,
    "q_heads": "model",
    "kv_heads": "model",
    "head_dim": None,
    "mlp": "model",
    "experts": None,
    "expert_shards": "model",   # the experts' axis under expert parallelism (Qwen3Config.expert_parallel)
    "norm": None,
    "seq": None,
    "features": None,
}
REPLICATE_IF_INDIVISIBLE = frozenset({"kv_heads", "vocab", "batch"})
_NAMES = {"q_heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "mlp": "the MLP width",
          "vocab": "vocab_size", "batch": "the batch size", "expert_shards": "num_experts"}


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh over ``devices`` (default: all); the product must equal the device count."""
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or model < 1:
    raise JetSpecError(f"mesh {data}x{model} is invalid: both axes must be >= 1")
  if data * model != len(devices):
    raise JetSpecError(f"mesh {data}x{model} needs {data * model} devices but {len(devices)} are available")
  return Mesh(np.asarray(devices).reshape(data, model), MESH_AXES)


def host_mesh(data: int = -1, model: int = 1) -> Mesh:
  """A (data, model) mesh laid on the job's hosts: each row of ``model`` devices inside one process (tensor
  and expert parallelism stay on a host's fast links), the ``data`` axis across processes, the same
  number of rows from every process. ``data`` -1: every device of every process. So one config runs on
  1, 2 or N hosts unchanged."""
  by_process: dict[int, list] = {}
  for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
    by_process.setdefault(d.process_index, []).append(d)
  nproc, local = len(by_process), min(len(v) for v in by_process.values())
  count = sum(len(v) for v in by_process.values())
  where = f"{nproc} process(es) x {local} device(s)" if nproc > 1 else f"{count} device(s)"
  if model < 1 or local % model:
    raise JetSpecError(f"mesh model axis {model} does not divide the {local} devices of a process: the model axis "
                       f"must fit inside one host ({where})")
  data = count // model if data in (-1, 0) else data
  if data < 1 or data * model > count:
    raise JetSpecError(f"mesh {data}x{model} needs {data * model} devices but the job has {count} ({where})")
  if data % nproc:
    raise JetSpecError(f"mesh {data}x{model} cannot be laid on {where}: its data axis must divide by the process "
                       f"count so every host holds the same rows; use data -1 for all {count} devices")
  rows = data // nproc
  grid = [np.asarray(devs[:rows * model], dtype=object).reshape(rows, model) for devs in by_process.values()]
  return Mesh(np.concatenate(grid), MESH_AXES)


def parse_mesh(text: str | None) -> tuple[int, int]:
  """'DATAxMODEL' (e.g. '2x4') -> (2, 4); None -> all devices on ``data``."""
  if not text:
    return jax.device_count(), 1
  try:
    data, model = (int(p) for p in text.lower().split("x"))
  except ValueError:
    raise JetSpecError(f"mesh {text!r} is not of the form DATAxMODEL, e.g. 2x4") from None
  return data, model


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh | None) -> P:
  """PartitionSpec for a tensor of ``shape`` with logical ``axes`` on ``mesh`` (None: replicated)."""
  if mesh is None:
    return P()
  if len(axes) != len(shape):
    raise ValueError(f"{len(axes)} logical axes for a rank-{len(shape)} tensor")
  spec, used = [], set()
  for name, dim in zip(axes, shape):
    mesh_axis = RULES.get(name) if name else None
    size = mesh.shape[mesh_axis] if mesh_axis else 1
    if mesh_axis is None or size == 1 or mesh_axis in used:
      spec.append(None)
    elif dim % size:
      if name not in REPLICATE_IF_INDIVISIBLE:
        raise JetSpecError(f"the mesh's {mesh_axis} axis ({size}) does not divide "
                           f"{_NAMES.get(name, name)} ({dim}); choose a {mesh_axis} size that divides it")
      spec.append(None)
    else:
      spec.append(mesh_axis)
      used.add(mesh_axis)
  return P(*spec)


def named_sharding(axes, shape, mesh: Mesh | None):
  """NamedSharding for logical ``axes`` (None when there is no mesh)."""
  return None if mesh is None else NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def shard(x: jax.Array, axes, mesh: Mesh | None) -> jax.Array:
  """Place (or constrain, under jit) ``x`` according to its logical axes."""
  if mesh is None:
    return x
  s = named_sharding(axes, x.shape, mesh)
  if isinstance(x, jax.core.Tracer):
    return jax.lax.with_sharding_constraint(x, s)
  return jax.device_put(x, s)


def whole_vocab(x: jax.Array, mesh: Mesh | None) -> jax.Array:
  """``x`` [R, ..., V] (under jit; V split over ``model``, the LM head's layout) gathered for per-row work
  along the vocabulary (sampling's sorts and cumulative sums): rows split over ``data`` where they divide
  evenly, V whole on every device. With V split XLA's SPMD partitioner runs a cumulative sum over it as a
  sequential loop over V / model elements (compiled for H200: docs/gpu.md). The first constraint pins the
  producer's layout, so the gather happens here and does not propagate back into the LM head's matmul."""
  if mesh is None:
    return x
  rows = "data" if x.shape[0] % mesh.shape["data"] == 0 else None
  vocab = "model" if x.shape[-1] % mesh.shape["model"] == 0 else None
  x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(rows, *([None] * (x.ndim - 2)), vocab)))
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(rows)))


def per_data_shard(fn, mesh: Mesh | None):
  """``fn`` run on each data shard's rows separately: every argument and result is split along its leading
  (batch) axis over ``data`` and replicated over ``model``. For per-row work that XLA would otherwise
  gather across shards (its top-k sorts the whole batch); the caller keeps the batch divisible."""
  if mesh is None or mesh.shape["data"] == 1:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)

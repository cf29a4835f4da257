"""Masked attention over a KV cache: the one interface verification, prefill and decode use.

Layout (shared by every implementation):
  q          [B, T, Hq, Dh]   queries of T new rows (a prompt chunk, one decode token, or N tree nodes)
  k_cache    [B, Hkv, S, Dh]  keys; the T new rows' own keys are already written at
  v_cache    [B, Hkv, S, Dh]  cache positions prefix_len[b] + t, t < T
  prefix_len [B] int32        committed keys 0..prefix_len[b]-1 are visible to every query
  block_mask [B, T, T] bool   block_mask[b, i, t]: query i may see new key t (position prefix_len[b]+t);
                              the diagonal must be True (every row sees itself; padding rows too)
  returns    [B, T, Hq, Dh]   in q.dtype; scores and softmax in float32; Hq = Hkv * group.

Implementations: ``xla`` (reference, any backend), ``xla_chunked`` (the same numerics one block
of ``QUERY_CHUNK`` queries at a time: its float32 scores are [B, Hkv, G, QUERY_CHUNK, S], never
[B, Hkv, G, T, S]; for long prompts and training's frozen target), ``pallas`` (the Pallas Triton
kernel of ``pallas_kernels.tree_attention``; ``pallas_interpret`` runs it on CPU) and ``mosaic`` (the
Pallas Mosaic GPU kernel for Hopper, ``pallas_kernels.tree_attention_mgpu``, 16-bit inputs only;
``mosaic_interpret`` runs it in jax >= 0.12's Mosaic GPU interpreter). The choice travels as a
static value: a name, or an ``AttentionImpl`` that also carries the Triton kernel's launch tuning table.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jetspec_jax.errors import JetSpecError
from pallas_kernels.errors import KernelError
from pallas_kernels.reference import masked_attention, visible_keys, xla_attention
from pallas_kernels.tuning import KernelTuning, load_tuning

IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret")
CACHE_ROWS_MULTIPLE = 8   # KV cache lengths: the Mosaic GPU kernel's TMA boxes start at multiples of 8 rows


def cache_rows(rows: int) -> int:
  """A KV cache length holding ``rows`` rows: rounded up to ``CACHE_ROWS_MULTIPLE``."""
  return -(-rows // CACHE_ROWS_MULTIPLE) * CACHE_ROWS_MULTIPLE
QUERY_CHUNK = 256   # queries per block of ``xla_chunked``


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
  """A static attention choice: ``name`` (one of ``IMPLEMENTATIONS``) and the kernel's launch ``tuning``
  (None: the kernel's default table; ignored by the XLA implementations). Hashable (a jit static)."""
  name: str = "xla"
  tuning: KernelTuning | None = None


def resolve_implementation(name: str | None, kernel_tuning: str | os.PathLike | None = None) -> AttentionImpl:
  """'auto' / None -> ``pallas`` on GPU, ``xla`` elsewhere; other names are checked. ``kernel_tuning``:
  a tuning table file (JSON, see ``pallas_kernels.tuning``) for the kernel, read and checked here."""
  if name in (None, "auto"):
    name = "pallas" if jax.default_backend() == "gpu" else "xla"
  if name not in IMPLEMENTATIONS:
    raise JetSpecError(f"unknown attention implementation {name!r}; choose auto or one of {', '.join(IMPLEMENTATIONS)}")
  check_available(name)
  try:
    tuning = None if kernel_tuning is None else load_tuning(kernel_tuning)
  except KernelError as e:
    raise JetSpecError(str(e)) from None
  return AttentionImpl(name, tuning)


def check_available(impl: str) -> None:
  """The compiled kernel (``pallas``) runs only on a GPU; say so instead of failing inside Pallas.
  Checked where an implementation is resolved, not in ``attention``, which must still trace the
  kernel on a CPU for a CUDA lowering (``lowering_platforms=("cuda",)``)."""
  backend = jax.default_backend()
  if impl in ("pallas", "mosaic") and backend != "gpu":
    raise JetSpecError(f"the {impl} attention kernel needs a GPU but jax's backend is {backend}; use "
                       f"{impl}_interpret (the same kernel in interpret mode on {backend}, slow) or xla")


def chunked_attention(q, k_cache, v_cache, prefix_len, block_mask, *, sm_scale: float | None = None,
                      chunk: int = QUERY_CHUNK):
  """``xla_attention`` over blocks of ``chunk`` queries in a ``lax.map`` (each block's softmax spans
  all S keys, so the result is the reference's up to float32 rounding). T is padded to a multiple of
  ``chunk`` with rows that see no new key, dropped from the output. Shapes: the module docstring."""
  num_q = q.shape[1]
  if num_q <= chunk:
    return xla_attention(q, k_cache, v_cache, prefix_len, block_mask, sm_scale=sm_scale)
  num_chunks = -(-num_q // chunk)
  pad = num_chunks * chunk - num_q
  q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  block_mask = jnp.pad(block_mask, ((0, 0), (0, pad), (0, 0)))             # [B, T', T]: padding rows see no key

  def one(start):
    qc = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1)
    rows = jax.lax.dynamic_slice_in_dim(block_mask, start, chunk, axis=1)     # [B, C, T]
    return masked_attention(qc, k_cache, v_cache, visible_keys(prefix_len, rows, k_cache.shape[2]), sm_scale)

  out = jax.lax.map(one, jnp.arange(num_chunks, dtype=jnp.int32) * chunk)   # [n, B, C, Hq, Dh]
  out = jnp.moveaxis(out, 0, 1).reshape(q.shape)
  return out[:, :num_q]


def _kernel_specs(mesh, batch: int, num_heads: int, num_kv: int):
  """shard_map specs for the kernel: batch over ``data`` and heads over ``model`` where they divide."""
  data = "data" if batch % mesh.shape["data"] == 0 else None
  model = "model" if num_heads % mesh.shape["model"] == 0 and num_kv % mesh.shape["model"] == 0 else None
  return (P(data, None, model, None), P(data, model, None, None), P(data, model, None, None), P(data),
          P(data, None, None)), P(data, None, model, None)


def attention(q, k_cache, v_cache, prefix_len, block_mask, *, impl: str | AttentionImpl = "xla",
              sm_scale: float | None = None, mesh=None):
  """Dispatch to an implementation (a static choice: a name or an ``AttentionImpl``). Under a ``mesh``
  the kernel runs per shard (shard_map over batch and heads); XLA's attention is partitioned by the
  compiler. The kernel's input errors come out as ``JetSpecError``."""
  impl, tuning = (impl.name, impl.tuning) if isinstance(impl, AttentionImpl) else (impl, None)
  if impl == "xla":
    return xla_attention(q, k_cache, v_cache, prefix_len, block_mask, sm_scale=sm_scale)
  if impl == "xla_chunked":
    return chunked_attention(q, k_cache, v_cache, prefix_len, block_mask, sm_scale=sm_scale)
  if impl in ("mosaic", "mosaic_interpret"):
    from pallas_kernels import tree_attention_mgpu as mosaic
    fn = functools.partial(mosaic.tree_attention, sm_scale=sm_scale, interpret=impl == "mosaic_interpret")
  elif impl in ("pallas", "pallas_interpret"):
    from pallas_kernels import tree_attention as kernel
    fn = functools.partial(kernel.tree_attention, sm_scale=sm_scale, interpret=impl == "pallas_interpret",
                           tuning=tuning)
  else:
    raise JetSpecError(f"unknown attention implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
  if mesh is not None and mesh.size > 1:
    in_specs, out_specs = _kernel_specs(mesh, q.shape[0], q.shape[2], k_cache.shape[1])
    fn = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  try:
    return fn(q, k_cache, v_cache, prefix_len, block_mask)
  except KernelError as e:
    raise JetSpecError(str(e)) from None

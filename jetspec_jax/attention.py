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
[B, Hkv, G, T, S]; for long prompts and training's frozen target) and ``pallas`` (the GPU kernel of
``pallas_kernels.tree_attention``; ``pallas_interpret`` runs it on CPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jetspec_jax.errors import JetSpecError

IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas", "pallas_interpret")
QUERY_CHUNK = 256   # queries per block of ``xla_chunked``


def resolve_implementation(name: str | None) -> str:
  """'auto' / None -> ``pallas`` on GPU, ``xla`` elsewhere; other names are checked."""
  if name in (None, "auto"):
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  if name not in IMPLEMENTATIONS:
    raise JetSpecError(f"unknown attention implementation {name!r}; choose auto or one of {', '.join(IMPLEMENTATIONS)}")
  check_available(name)
  return name


def check_available(impl: str) -> None:
  """The compiled kernel (``pallas``) runs only on a GPU; say so instead of failing inside Pallas.
  Checked where an implementation is resolved, not in ``attention``, which must still trace the
  kernel on a CPU for a CUDA lowering (``lowering_platforms=("cuda",)``)."""
  backend = jax.default_backend()
  if impl == "pallas" and backend != "gpu":
    raise JetSpecError(f"the pallas attention kernel needs a GPU but jax's backend is {backend}; use "
                       f"pallas_interpret (the same kernel in interpret mode on {backend}, slow) or xla")


def visible_keys(prefix_len: jax.Array, block_mask: jax.Array, cache_len: int) -> jax.Array:
  """Dense visibility [B, T, S] of cache positions for each query (XLA path and tests)."""
  pos = jnp.arange(cache_len)[None, None, :]                       # [1, 1, S]
  start = prefix_len[:, None, None]                                # [B, 1, 1]
  in_prefix = pos < start
  t_idx = pos - start                                               # index into the new block
  num_new = block_mask.shape[-1]
  in_block = (t_idx >= 0) & (t_idx < num_new)
  gathered = jnp.take_along_axis(
      block_mask, jnp.clip(t_idx, 0, num_new - 1).astype(jnp.int32).repeat(block_mask.shape[1], 1), axis=2)
  return in_prefix | (in_block & gathered)


def _cpu_upcast(*xs):
  """XLA:CPU has no BF16 x BF16 -> F32 dot with two batch dimensions (B and KV heads, both > 1):
  there the operands go to float32 first, which gives exactly the same products."""
  if jax.default_backend() != "cpu" or all(x.dtype == jnp.float32 for x in xs):
    return xs
  return tuple(x.astype(jnp.float32) for x in xs)


def xla_attention(q, k_cache, v_cache, prefix_len, block_mask, *, sm_scale: float | None = None):
  """Reference masked attention (see module docstring for shapes)."""
  return _masked_attention(q, k_cache, v_cache, visible_keys(prefix_len, block_mask, k_cache.shape[2]), sm_scale)


def _masked_attention(q, k_cache, v_cache, mask, sm_scale):
  """q [B, T, Hq, Dh] over the cache where mask [B, T, S] allows; a row seeing no key gives zeros."""
  batch, num_q, num_heads, head_dim = q.shape
  num_kv = k_cache.shape[1]
  group = num_heads // num_kv
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  qg = q.reshape(batch, num_q, num_kv, group, head_dim)
  scores = jnp.einsum("btkgd,bksd->bkgts", *_cpu_upcast(qg, k_cache), preferred_element_type=jnp.float32) * scale
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(mask[:, None, None], probs, 0.0)
  out = jnp.einsum("bkgts,bksd->btkgd", *_cpu_upcast(probs.astype(v_cache.dtype), v_cache),
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, num_q, num_heads, head_dim).astype(q.dtype)


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
    return _masked_attention(qc, k_cache, v_cache, visible_keys(prefix_len, rows, k_cache.shape[2]), sm_scale)

  out = jax.lax.map(one, jnp.arange(num_chunks, dtype=jnp.int32) * chunk)   # [n, B, C, Hq, Dh]
  out = jnp.moveaxis(out, 0, 1).reshape(q.shape)
  return out[:, :num_q]


def _kernel_specs(mesh, batch: int, num_heads: int, num_kv: int):
  """shard_map specs for the kernel: batch over ``data`` and heads over ``model`` where they divide."""
  data = "data" if batch % mesh.shape["data"] == 0 else None
  model = "model" if num_heads % mesh.shape["model"] == 0 and num_kv % mesh.shape["model"] == 0 else None
  return (P(data, None, model, None), P(data, model, None, None), P(data, model, None, None), P(data),
          P(data, None, None)), P(data, None, model, None)


def attention(q, k_cache, v_cache, prefix_len, block_mask, *, impl: str = "xla",
              sm_scale: float | None = None, mesh=None):
  """Dispatch to an implementation by name (a static choice). Under a ``mesh`` the kernel runs
  per shard (shard_map over batch and heads); XLA's attention is partitioned by the compiler."""
  if impl == "xla":
    return xla_attention(q, k_cache, v_cache, prefix_len, block_mask, sm_scale=sm_scale)
  if impl == "xla_chunked":
    return chunked_attention(q, k_cache, v_cache, prefix_len, block_mask, sm_scale=sm_scale)
  if impl not in ("pallas", "pallas_interpret"):
    raise JetSpecError(f"unknown attention implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
  from pallas_kernels import tree_attention as kernel
  fn = functools.partial(kernel.tree_attention, sm_scale=sm_scale, interpret=impl == "pallas_interpret")
  if mesh is not None and mesh.size > 1:
    in_specs, out_specs = _kernel_specs(mesh, q.shape[0], q.shape[2], k_cache.shape[1])
    fn = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
  return fn(q, k_cache, v_cache, prefix_len, block_mask)

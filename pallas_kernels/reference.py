"""The XLA reference of the tree-attention kernel: dense masked attention over a KV cache.

Shapes (the kernel's contract, ``tree_attention``'s module docstring):
  q [B, T, Hq, Dh], k_cache / v_cache [B, Hkv, S, Dh], prefix_len [B] int32, block_mask [B, T, T] bool
  -> [B, T, Hq, Dh] in q.dtype; scores and softmax in float32; Hq = Hkv * group.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


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


def cpu_upcast(*xs):
  """XLA:CPU has no BF16 x BF16 -> F32 dot with two batch dimensions (B and KV heads, both > 1):
  there the operands go to float32 first, which gives exactly the same products."""
  if jax.default_backend() != "cpu" or all(x.dtype == jnp.float32 for x in xs):
    return xs
  return tuple(x.astype(jnp.float32) for x in xs)


def xla_attention(q, k_cache, v_cache, prefix_len, block_mask, *, sm_scale: float | None = None):
  """Reference masked attention (see module docstring for shapes)."""
  return masked_attention(q, k_cache, v_cache, visible_keys(prefix_len, block_mask, k_cache.shape[2]), sm_scale)


def masked_attention(q, k_cache, v_cache, mask, sm_scale):
  """q [B, T, Hq, Dh] over the cache where mask [B, T, S] allows; a row seeing no key gives zeros."""
  batch, num_q, num_heads, head_dim = q.shape
  num_kv = k_cache.shape[1]
  group = num_heads // num_kv
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  qg = q.reshape(batch, num_q, num_kv, group, head_dim)
  scores = jnp.einsum("btkgd,bksd->bkgts", *cpu_upcast(qg, k_cache), preferred_element_type=jnp.float32) * scale
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(mask[:, None, None], probs, 0.0)
  out = jnp.einsum("bkgts,bksd->btkgd", *cpu_upcast(probs.astype(v_cache.dtype), v_cache),
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, num_q, num_heads, head_dim).astype(q.dtype)

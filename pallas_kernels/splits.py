"""Merging the float32 partials of a kernel's key splits (flash-decoding), shared by the GPU kernels.

Each split s of a row leaves an unnormalised acc_s [..., Dh], its running maximum m_s and running sum l_s (log2
domain; a split that saw no key has m_s = -inf and l_s = 0): out = sum_s w_s acc_s / sum_s w_s l_s with
w_s = 2^(m_s - max_s m_s). The splits are few (a kernel launches at most one wave of programs) and their axis is
unrolled into elementwise operations, so XLA computes the maximum, the weights and both sums in ONE loop fusion
(a reduction over the split axis would take a kernel for the maximum and another for the sums).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array, axis: int, dtype) -> jax.Array:
  """acc [..., P, ..., Dh] and m, l (acc's shape without Dh) with the P splits on ``axis`` -> acc's shape without
  ``axis``, in ``dtype``; a row no split saw (every m_s = -inf) is zero."""
  take = lambda x, s: jax.lax.index_in_dim(x, s, axis, keepdims=False)
  # m and l broadcast over Dh first: every operation is then on acc's shape, so XLA fuses the whole merge (with m
  # and l per row, it computed their maximum in a kernel of its own past 8 splits rather than once per element).
  m, l = (jnp.broadcast_to(x[..., None], acc.shape) for x in (m, l))
  splits = range(m.shape[axis])
  m_max = take(m, 0)
  for s in splits[1:]:
    m_max = jnp.maximum(m_max, take(m, s))
  m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
  num = den = 0.0
  for s in splits:
    m_s = take(m, s)
    w = jnp.where(m_s == -jnp.inf, 0.0, jnp.exp2(m_s - m_max))
    num, den = num + w * take(acc, s), den + w * take(l, s)
  return (num / jnp.where(den == 0.0, 1.0, den)).astype(dtype)

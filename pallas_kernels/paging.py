"""Paged KV caches as both tree-attention kernels read them: a pool of pages per group and a page table per row.

  k_pool, v_pool [G, Pg, Hkv, R, Dh]  G groups of Pg pages of R rows each (R a multiple of 8)
  table          [B, T'] int32        page ids within the row's group (batch row b is in group b // (B / G));
                                      -1: no page
Key position p of batch row b is pool[b // (B / G), table[b, p // R], :, p % R], so a row holds S = T' x R
positions; the T new rows' keys are already written at positions prefix_len[b] + t, as in a contiguous cache.
The kernels take the pool flattened to [G x Pg, Hkv, R, Dh] and the table's ids made global (``flat_pages``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.errors import KernelError, check_problem

PAGE_ROWS_MULTIPLE = 8      # a page's rows start a TMA box in the Mosaic GPU kernel: multiples of 8 rows


def check_paged(q, k_pool, v_pool, table, prefix_len, block_mask) -> tuple[int, int, int, int, int, int]:
  """The paged problem's shape contract (module docstring): returns (B, T, Hq, Dh, Hkv, S = T' x R) as
  ``check_problem`` does for a contiguous cache, or raises ``KernelError``."""
  if k_pool.ndim != 5 or k_pool.shape != v_pool.shape or table.ndim != 2 or table.shape[0] != q.shape[0]:
    raise KernelError(f"expected k_pool and v_pool [G, Pg, Hkv, R, Dh] and table [B, T'] for q {q.shape}, got "
                      f"{k_pool.shape}, {v_pool.shape} and {table.shape}.")
  groups, _, num_kv_heads, page_rows, head_dim = k_pool.shape
  if q.shape[0] % groups:
    raise KernelError(f"{q.shape[0]} batch rows do not split into the pool's {groups} groups.")
  if page_rows < PAGE_ROWS_MULTIPLE or page_rows % PAGE_ROWS_MULTIPLE:
    raise KernelError(f"pages of {page_rows} rows: the kernels need a positive multiple of {PAGE_ROWS_MULTIPLE}.")
  view = jax.ShapeDtypeStruct((q.shape[0], num_kv_heads, table.shape[1] * page_rows, head_dim), k_pool.dtype)
  return check_problem(q, view, view, prefix_len, block_mask)


def flat_pages(k_pool: jax.Array, v_pool: jax.Array, table: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(k, v [G x Pg, Hkv, R, Dh], table [B, T'] of ids into them): a missing page (-1) becomes its group's page 0,
  so every id the kernels load is in bounds (its rows are never read unmasked)."""
  groups, pages_per_group = k_pool.shape[:2]
  flat = lambda pool: pool.reshape((groups * pages_per_group,) + pool.shape[2:])
  first = jnp.arange(table.shape[0], dtype=jnp.int32) // (table.shape[0] // groups) * pages_per_group
  return flat(k_pool), flat(v_pool), jnp.maximum(table.astype(jnp.int32), 0) + first[:, None]

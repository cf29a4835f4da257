"""Paged cache storage: a pool of pages per data shard and a page table per slot, all on device.

A cache of B slots x S rows becomes a pool of P = G x Pg pages of R rows (R a multiple of 8: the Mosaic GPU
kernel's TMA boxes start at multiples of 8 rows), each page [Hkv, R, Dh] as a slot's rows are, and a table:
slot b's row s lives at row s % R of page ``table[b, s // R]``. Group g (data shard g) owns pages
g * Pg .. (g + 1) * Pg - 1 and its slots b in g * B/G .. (g + 1) * B/G - 1 take pages only from them, so a pool
sharded over the data axis on its page dimension never moves rows between shards.

``Pages`` is the allocator's state: per group a stack of free page ids; per slot its table row and the pages it
holds (a prefix of its table row). ``grow`` gives slots the pages their next rows need, oldest request first and
in order (a slot that does not fit stops the grant: later, smaller ones wait too, so the oldest is never starved);
``release`` returns a slot's pages. Invariant, per group: the held pages and the free stack are its Pg pages,
each exactly once. ``write`` scatters new rows into pages; ``gather`` is the XLA attention path's contiguous view
of the slots' first rows.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Pages:
  """The page allocator (module docstring). G groups of Pg pages, B slots of at most T pages."""
  free: jax.Array          # [G, Pg] int32 page ids; the first free_count[g] are free
  free_count: jax.Array    # [G] int32
  table: jax.Array         # [B, T] int32 page ids (-1: none)
  held: jax.Array          # [B] int32 pages held: table[b, :held[b]]

  @property
  def groups(self) -> int:
    return self.free.shape[0]

  @property
  def pages_per_group(self) -> int:
    return self.free.shape[1]


def init_pages(groups: int, pages_per_group: int, slots: int, max_pages: int) -> Pages:
  """Every page free, no slot holding any; slots / groups slots per group."""
  if slots % groups:
    raise ValueError(f"{slots} slots do not split into {groups} groups")
  ids = jnp.arange(groups * pages_per_group, dtype=jnp.int32).reshape(groups, pages_per_group)
  return Pages(free=ids, free_count=jnp.full((groups,), pages_per_group, jnp.int32),
               table=jnp.full((slots, max_pages), -1, jnp.int32), held=jnp.zeros((slots,), jnp.int32))


def pages_for(rows: jax.Array, page_rows: int) -> jax.Array:
  """Pages that hold ``rows`` rows."""
  return -(-rows // page_rows)


def grow(p: Pages, rows: jax.Array, order: jax.Array, page_rows: int) -> tuple[Pages, jax.Array]:
  """Give each slot the pages ``rows`` [B] rows need (beyond those it holds), per group in increasing ``order``
  [B] (e.g. admission sequence numbers) while the group's free pages last; the first slot that does not fit
  and every later one get none. Returns the allocator and ok [B]: the slot holds pages for its rows."""
  g, per = p.groups, p.table.shape[0] // p.groups
  t = p.table.shape[1]
  need = jnp.maximum(jnp.minimum(pages_for(rows, page_rows), t) - p.held, 0)

  def group(free, count, table, held, need, order):
    rank = jnp.argsort(order)                                   # slots oldest first
    fits = jnp.cumsum(need[rank]) <= count
    granted = jnp.zeros((per,), bool).at[rank].set(jnp.cumprod(fits.astype(jnp.int32)).astype(bool))
    take = jnp.where(granted, need, 0)
    taken = jnp.zeros((per,), jnp.int32).at[rank].set(jnp.cumsum(take[rank]))      # inclusive, in rank order
    first = count - taken                                        # slot takes free[first : first + take]
    j = jnp.arange(t)[None, :]
    new = (j >= held[:, None]) & (j < (held + take)[:, None])
    idx = jnp.clip(first[:, None] + j - held[:, None], 0, free.shape[0] - 1)
    table = jnp.where(new, free[idx], table)
    return count - jnp.sum(take), table, held + take, granted | (need == 0)

  by = lambda x: x.reshape((g, per) + x.shape[1:])
  count, table, held, ok = jax.vmap(group)(p.free, p.free_count, by(p.table), by(p.held), by(need), by(order))
  return p.replace(free_count=count, table=table.reshape(p.table.shape), held=held.reshape(-1)), ok.reshape(-1)


def release(p: Pages, slots: jax.Array) -> Pages:
  """Return the pages of the slots where ``slots`` [B] bool to their groups' free stacks."""
  g, per = p.groups, p.table.shape[0] // p.groups
  t, pg = p.table.shape[1], p.pages_per_group

  def group(free, count, table, held, mask):
    back = jnp.where(mask, held, 0)
    at = count + jnp.cumsum(back) - back                         # each slot's first free-stack position
    j = jnp.arange(t)[None, :]
    pos = jnp.where(j < back[:, None], at[:, None] + j, pg)      # pg: not written
    free = free.at[pos].set(table, mode="drop")
    return free, count + jnp.sum(back), jnp.where(mask[:, None], -1, table), jnp.where(mask, 0, held)

  by = lambda x: x.reshape((g, per) + x.shape[1:])
  free, count, table, held = jax.vmap(group)(p.free, p.free_count, by(p.table), by(p.held), by(slots))
  return p.replace(free=free, free_count=count, table=table.reshape(p.table.shape), held=held.reshape(-1))


def locate(table: jax.Array, rows: jax.Array, page_rows: int) -> tuple[jax.Array, jax.Array]:
  """(page id, row in the page) of slot b's rows ``rows`` [B, N] (``table`` [B, T])."""
  page = jnp.take_along_axis(table, jnp.clip(rows // page_rows, 0, table.shape[1] - 1), axis=1)
  return page, rows % page_rows


def write(pool: jax.Array, new: jax.Array, table: jax.Array, start: jax.Array) -> jax.Array:
  """``new`` [B, Hkv, N, Dh] written into ``pool`` [P, Hkv, R, Dh] as slot b's rows start[b] .. start[b] + N - 1
  (pages the table gives; a row whose page is -1 is dropped)."""
  rows = start[:, None] + jnp.arange(new.shape[2])[None, :]
  page, at = locate(table, rows, pool.shape[2])
  page = jnp.where(page < 0, pool.shape[0], page)                # out of range: dropped
  return pool.at[page, :, at].set(new.transpose(0, 2, 1, 3).astype(pool.dtype), mode="drop")


def gather(pool: jax.Array, table: jax.Array, length: int) -> jax.Array:
  """Slots' first ``length`` rows as a contiguous [B, Hkv, length, Dh] (the XLA attention path; rows of pages
  a slot does not hold are page 0's, never read unmasked)."""
  r = pool.shape[2]
  pages = pool[jnp.maximum(table[:, :pages_for(length, r)], 0)]   # [B, T', Hkv, R, Dh]
  b, n, h, _, d = pages.shape
  return pages.transpose(0, 2, 1, 3, 4).reshape(b, h, n * r, d)[:, :, :length]

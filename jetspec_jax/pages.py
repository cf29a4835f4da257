"""Paged cache storage: a pool of pages per data shard and a page table per slot, all on device.

A cache of B slots x S rows becomes a pool [G, Pg, Hkv, R, Dh]: per group Pg pages of R rows (R a multiple of 8:
the Mosaic GPU kernel's TMA boxes start at multiples of 8 rows), each page [Hkv, R, Dh] as a slot's rows are, and
a table: slot b's row s lives at row s % R of its group's page ``table[b, s // R]`` (ids 0 .. Pg - 1 within the
group). Group g (on data shard g) holds slots g * B/G .. (g + 1) * B/G - 1, which take pages only from it, and
every read and write is per group: a pool sharded over the data axis on its group dimension never moves rows
between shards.

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
  free: jax.Array          # [G, Pg] int32 page ids (within the group); the first free_count[g] are free
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
  ids = jnp.broadcast_to(jnp.arange(pages_per_group, dtype=jnp.int32), (groups, pages_per_group))
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


def _page(table: jax.Array, slot: jax.Array, row: jax.Array, page_rows: int) -> tuple[jax.Array, jax.Array]:
  """(page id, row in the page) of row ``row`` of slot ``slot`` of one group (``table`` [S, T]); page -1: the slot
  holds no page there (a row past its pages or past T pages, or a slot out of range: padding)."""
  s, t = table.shape
  index = row // page_rows
  inside = (slot >= 0) & (slot < s) & (index >= 0) & (index < t)
  page = table[jnp.clip(slot, 0, s - 1), jnp.clip(index, 0, t - 1)]
  return jnp.where(inside, page, -1), row % page_rows


def _by_group(pool: jax.Array, table: jax.Array) -> jax.Array:
  return table.reshape((pool.shape[0], -1) + table.shape[1:])


def scatter(pool: jax.Array, values: jax.Array, table: jax.Array, slot: jax.Array, row: jax.Array) -> jax.Array:
  """``values`` [G, K, Hkv, Dh] written into ``pool`` [G, Pg, Hkv, R, Dh] as row row[g, k] of the group's slot
  slot[g, k] (``table`` [B, T], B = G x slots per group); a row without a page is dropped (so is a slot out of
  range: padding). Per group (vmapped): a pool sharded over groups moves nothing between shards."""
  def one(pool_g, values_g, table_g, slot_g, row_g):
    page, at = _page(table_g, slot_g, row_g, pool_g.shape[2])
    page = jnp.where(page < 0, pool_g.shape[0], page)                  # out of range: dropped
    return pool_g.at[page, :, at].set(values_g.astype(pool_g.dtype), mode="drop")
  return jax.vmap(one)(pool, values, _by_group(pool, table), slot, row)


def take(pool: jax.Array, table: jax.Array, rows: jax.Array) -> jax.Array:
  """Slot b's rows rows[b, n] -> [B, Hkv, N, Dh] (a row without a page reads page 0's: ignore it)."""
  g, (b, n) = pool.shape[0], rows.shape
  per = b // g
  slot = jnp.broadcast_to(jnp.arange(per)[:, None], (per, n)).reshape(per * n)

  def one(pool_g, table_g, row_g):
    page, at = _page(table_g, slot, row_g, pool_g.shape[2])
    return pool_g[jnp.maximum(page, 0), :, at]                          # [S * N, Hkv, Dh]
  got = jax.vmap(one)(pool, _by_group(pool, table), rows.reshape(g, per * n))
  return got.reshape((b, n) + got.shape[2:]).transpose(0, 2, 1, 3)


def write(pool: jax.Array, new: jax.Array, table: jax.Array, start: jax.Array) -> jax.Array:
  """``new`` [B, Hkv, N, Dh] written into ``pool`` [G, Pg, Hkv, R, Dh] as slot b's rows start[b] .. start[b] + N - 1
  (pages the table [B, T] gives; a row without a page is dropped)."""
  g, (b, _, n, _) = pool.shape[0], new.shape
  per = b // g
  rows = (start[:, None] + jnp.arange(n)[None, :]).reshape(g, per * n)
  slot = jnp.broadcast_to(jnp.arange(per)[:, None], (per, n)).reshape(1, per * n)
  values = new.transpose(0, 2, 1, 3).reshape((g, per * n) + new.shape[1:2] + new.shape[3:])
  return scatter(pool, values, table, jnp.broadcast_to(slot, rows.shape), rows)


def gather(pool: jax.Array, table: jax.Array, length: int) -> jax.Array:
  """Slots' first ``length`` rows as a contiguous [B, Hkv, length, Dh] (the XLA attention path; rows of pages
  a slot does not hold are page 0's, never read unmasked)."""
  r = pool.shape[3]
  used = _by_group(pool, table)[:, :, :pages_for(length, r)]
  got = jax.vmap(lambda pool_g, t: pool_g[jnp.maximum(t, 0)])(pool, used)   # [G, S, T', Hkv, R, Dh]
  g, per, n, h, _, d = got.shape
  return got.transpose(0, 1, 3, 2, 4, 5).reshape(g * per, h, n * r, d)[:, :, :length]

"""Paged cache storage: a pool of pages per data shard and a page table per slot, all on device.

A cache of B slots x S rows becomes a pool [G, Pg, Hkv, R, Dh]: per group Pg pages of R rows (R a multiple of 8:
the Mosaic GPU kernel's TMA boxes start at multiples of 8 rows), each page [Hkv, R, Dh] as a slot's rows are, and
a table: slot b's row s lives at row s % R of its group's page ``table[b, s // R]`` (ids 0 .. Pg - 1 within the
group). Group g (on data shard g) holds slots g * B/G .. (g + 1) * B/G - 1, which take pages only from it, and
every read and write is per group: a pool sharded over the data axis on its group dimension never moves rows
between shards.

``Pages`` is the allocator's state: per page the slots holding it (``refs``), the prefix key of its rows when it is
cached (``key``) and when it was last released (``used``); per slot its table row and the pages it holds (a prefix
of its table row). A page is free when no slot holds it; a free page with a key is cached: its rows stay valid
until ``grow`` takes it, after every uncached free page, least recently released first. ``grow`` gives slots the
pages their next rows need, oldest request first and in order (a slot that does not fit stops the grant: later,
smaller ones wait too, so the oldest is never starved); ``release`` returns a slot's pages; ``register`` keys the
full prompt pages a slot has computed and ``share`` hands a newly admitted slot the cached pages of its prompt's
longest keyed prefix (prefix caching: a page with a key is never written, only read). Invariant, per group:
refs[page] is the number of slot table entries holding it. ``write`` puts new rows into pages and ``read`` reads
a slot's rows back, both whole pages at a time; ``gather`` is
the XLA attention path's contiguous view of the slots' first rows.

Keys are the host's (``prefix_keys``): page i of a prompt is keyed by a 64-bit hash of the prompt's first (i + 1) * R
token ids, as two int32 words, so a key names a page's tokens and positions. Two different prefixes sharing a
key (probability about n^2 / 2^65 over n keyed pages) would share rows: the one failure mode, stated here.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

FREE, CACHED, HELD = 0, 1, 2        # the order ``grow`` takes pages in: uncached free ones, then cached, never held


@flax.struct.dataclass
class Pages:
  """The page allocator (module docstring). G groups of Pg pages, B slots of at most T pages."""
  refs: jax.Array          # [G, Pg] int32 slots holding the page (0: free)
  key: jax.Array           # [G, Pg, 2] int32 prefix key of its rows ((0, 0): none)
  used: jax.Array          # [G, Pg] int32 when it was last released (``grow``'s order among free pages)
  table: jax.Array         # [B, T] int32 page ids (-1: none)
  held: jax.Array          # [B] int32 pages held: table[b, :held[b]]

  @property
  def groups(self) -> int:
    return self.refs.shape[0]

  @property
  def pages_per_group(self) -> int:
    return self.refs.shape[1]

  def free_count(self) -> jax.Array:
    """[G] pages no slot holds (cached ones included: ``grow`` may take them)."""
    return jnp.sum(self.refs == 0, axis=1).astype(jnp.int32)

  def cached_count(self) -> jax.Array:
    """[G] free pages holding keyed rows."""
    return jnp.sum((self.refs == 0) & _keyed(self.key), axis=1).astype(jnp.int32)


def _keyed(key: jax.Array) -> jax.Array:
  return jnp.any(key != 0, axis=-1)


def init_pages(groups: int, pages_per_group: int, slots: int, max_pages: int) -> Pages:
  """Every page free, none cached, no slot holding any; slots / groups slots per group."""
  if slots % groups:
    raise ValueError(f"{slots} slots do not split into {groups} groups")
  shape = (groups, pages_per_group)
  return Pages(refs=jnp.zeros(shape, jnp.int32), key=jnp.zeros(shape + (2,), jnp.int32),
               used=jnp.broadcast_to(jnp.arange(pages_per_group, dtype=jnp.int32), shape),
               table=jnp.full((slots, max_pages), -1, jnp.int32), held=jnp.zeros((slots,), jnp.int32))


def pages_for(rows: jax.Array, page_rows: int) -> jax.Array:
  """Pages that hold ``rows`` rows."""
  return -(-rows // page_rows)


def prefix_keys(prompt: Sequence[int], page_rows: int, pages: int) -> np.ndarray:
  """[pages, 2] int32 keys of a prompt's first ``pages`` full pages (module docstring): page i's is a hash of the
  prompt's first (i + 1) * page_rows ids, chained page by page; never (0, 0) (no key); (0, 0) past its full pages."""
  keys = np.zeros((pages, 2), np.int32)
  digest = b""
  ids = np.asarray(prompt, np.int32)
  for i in range(min(pages, len(ids) // page_rows)):
    digest = hashlib.blake2b(digest + ids[i * page_rows:(i + 1) * page_rows].tobytes(), digest_size=8).digest()
    keys[i] = np.frombuffer(digest, np.int32)
    if keys[i, 0] == 0:
      keys[i, 0] = 1
  return keys


def _by(p: Pages, x: jax.Array) -> jax.Array:
  return x.reshape((p.groups, -1) + x.shape[1:])


def grow(p: Pages, rows: jax.Array, order: jax.Array, page_rows: int) -> tuple[Pages, jax.Array]:
  """Give each slot the pages ``rows`` [B] rows need (beyond those it holds), per group in increasing ``order``
  [B] (e.g. admission sequence numbers) while the group's free pages last; the first slot that does not fit
  and every later one get none. Pages are taken uncached first, then cached ones least recently released first
  (their keys dropped). Returns the allocator and ok [B]: the slot holds pages for its rows."""
  per, t, pg = p.table.shape[0] // p.groups, p.table.shape[1], p.pages_per_group
  need = jnp.maximum(jnp.minimum(pages_for(rows, page_rows), t) - p.held, 0)

  def group(refs, key, used, table, held, need, order):
    rank = jnp.argsort(order)                                   # slots oldest first
    fits = jnp.cumsum(need[rank]) <= jnp.sum(refs == 0)
    granted = jnp.zeros((per,), bool).at[rank].set(jnp.cumprod(fits.astype(jnp.int32)).astype(bool))
    take = jnp.where(granted, need, 0)
    before = jnp.zeros((per,), jnp.int32).at[rank].set(jnp.cumsum(take[rank]) - take[rank])   # exclusive
    kind = jnp.where(refs > 0, HELD, jnp.where(_keyed(key), CACHED, FREE))
    _, _, candidates = jax.lax.sort((kind, used, jnp.arange(pg, dtype=jnp.int32)), num_keys=2)
    j = jnp.arange(t)[None, :]
    new = (j >= held[:, None]) & (j < (held + take)[:, None])
    table = jnp.where(new, candidates[jnp.clip(before[:, None] + j - held[:, None], 0, pg - 1)], table)
    taken = jnp.where(new, table, pg)                             # pg: not written
    return (refs.at[taken].add(1, mode="drop"), key.at[taken].set(0, mode="drop"), table, held + take,
            granted | (need == 0))

  refs, key, table, held, ok = jax.vmap(group)(p.refs, p.key, p.used, _by(p, p.table), _by(p, p.held), _by(p, need),
                                               _by(p, order))
  return p.replace(refs=refs, key=key, table=table.reshape(p.table.shape), held=held.reshape(-1)), ok.reshape(-1)


def release(p: Pages, slots: jax.Array, now: jax.Array | int = 0) -> Pages:
  """The slots where ``slots`` [B] bool let go of their pages (released at time ``now``: a cached page's LRU
  stamp)."""
  t, pg = p.table.shape[1], p.pages_per_group

  def group(refs, used, table, held, mask):
    j = jnp.arange(t)[None, :]
    back = jnp.where(mask[:, None] & (j < held[:, None]), table, pg)       # pg: not written
    return (refs.at[back].add(-1, mode="drop"), used.at[back].set(jnp.asarray(now, jnp.int32), mode="drop"),
            jnp.where(mask[:, None], -1, table), jnp.where(mask, 0, held))

  refs, used, table, held = jax.vmap(group)(p.refs, p.used, _by(p, p.table), _by(p, p.held), _by(p, slots))
  return p.replace(refs=refs, used=used, table=table.reshape(p.table.shape), held=held.reshape(-1))


def register(p: Pages, keys: jax.Array, count: jax.Array) -> Pages:
  """Key each slot's first count[b] pages with keys [B, K, 2] (its prompt's: pages whose rows it has computed, none
  written again). A page already keyed holds the same prefix; two slots may key copies of one prefix."""
  k, pg = keys.shape[1], p.pages_per_group

  def group(key, table, keys, count):
    pages = jnp.where(jnp.arange(k)[None, :] < count[:, None], table[:, :k], pg)   # pg: not written
    return key.at[pages].set(keys, mode="drop")

  key = jax.vmap(group)(p.key, _by(p, p.table), _by(p, keys), _by(p, jnp.minimum(count, p.held)))
  return p.replace(key=key)


def find(key: jax.Array, queries: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One group's pages keyed as ``queries`` [..., 2] among its keys [Pg, 2]: (page [...], found [...]); a sorted
  search on the first word, then the second compared (a first word shared by two prefixes: not found)."""
  order = jnp.argsort(key[:, 0])
  at = order[jnp.clip(jnp.searchsorted(key[order, 0], queries[..., 0], method="sort"), 0, key.shape[0] - 1)]
  return at, jnp.all(key[at] == queries, axis=-1) & jnp.any(queries != 0, axis=-1)


def share(p: Pages, slots: jax.Array, keys: jax.Array, count: jax.Array) -> tuple[Pages, jax.Array]:
  """Each slot where ``slots`` [B] bool (holding no page) takes the cached or held pages keyed as its first count[b]
  keys [B, K, 2], up to the first it does not find. Returns the allocator and the pages each took [B]."""
  k, pg = keys.shape[1], p.pages_per_group

  def group(refs, key, table, held, keys, count, mask):
    at, found = find(key, keys)                                                        # [S, K]
    found = found & (jnp.arange(k)[None, :] < count[:, None]) & mask[:, None]
    hits = jnp.sum(jnp.cumprod(found.astype(jnp.int32), axis=1), axis=1)
    new = jnp.arange(k)[None, :] < hits[:, None]
    table = table.at[:, :k].set(jnp.where(new, at, table[:, :k]))
    return refs.at[jnp.where(new, at, pg)].add(1, mode="drop"), table, held + hits, hits

  refs, table, held, hits = jax.vmap(group)(p.refs, p.key, _by(p, p.table), _by(p, p.held), _by(p, keys),
                                            _by(p, count), _by(p, slots))
  return p.replace(refs=refs, table=table.reshape(p.table.shape), held=held.reshape(-1)), hits.reshape(-1)


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


def read(pool: jax.Array, table: jax.Array, start: jax.Array, n: int) -> jax.Array:
  """Slot b's rows start[b] .. start[b] + n - 1 of ``pool`` [G, Pg, Hkv, R, Dh] -> [B, Hkv, n, Dh], read as the
  whole pages holding them (those ``write`` would write; a row without a page reads page 0's: ignore it). Picking
  single rows out of tiled pages makes XLA:TPU copy the whole pool into another layout first."""
  g, b, r = pool.shape[0], table.shape[0], pool.shape[3]
  span = -(-(n + r - 1) // r)                                          # pages n rows from any offset can touch
  index = start[:, None] // r + jnp.arange(span)[None, :]             # [B, span]: the slots' page indices

  def one(pool_g, table_g, index_g):
    s, t = table_g.shape
    page = table_g[jnp.arange(s)[:, None], jnp.clip(index_g, 0, t - 1)]
    return pool_g[jnp.where((index_g < t) & (page >= 0), page, 0)]   # [S, span, Hkv, R, Dh]
  got = jax.vmap(one)(pool, _by_group(pool, table), index.reshape((g, -1, span)))
  got = got.reshape((b, span) + got.shape[3:]).transpose(0, 2, 1, 3, 4)
  got = got.reshape(got.shape[:2] + (span * r, got.shape[-1]))        # [B, Hkv, span * R, Dh]
  return jax.vmap(lambda x, o: jax.lax.dynamic_slice_in_dim(x, o, n, axis=1))(got, start % r)


def write(pool: jax.Array, new: jax.Array, table: jax.Array, start: jax.Array) -> jax.Array:
  """``new`` [B, Hkv, N, Dh] written into ``pool`` [G, Pg, Hkv, R, Dh] as slot b's rows start[b] .. start[b] + N - 1
  (pages the table [B, T] gives; a row without a page is dropped). Whole pages are written: each page holding one
  of the new rows is read, its new rows set and the page written back (pages with none are not written). A
  scatter of single rows into tiled pages makes XLA:TPU copy the whole pool into another layout and back."""
  g, (b, _, n, _) = pool.shape[0], new.shape
  per, r = b // g, pool.shape[3]
  span = -(-(n + r - 1) // r)                                          # pages N rows from any offset can touch
  index = start[:, None] // r + jnp.arange(span)[None, :]             # [B, span]: the slots' page indices
  offset = index[..., None] * r + jnp.arange(r) - start[:, None, None]  # [B, span, R]: row of ``new`` (or outside)
  fresh = (offset >= 0) & (offset < n)

  def one(pool_g, table_g, new_g, index_g, offset_g, fresh_g):
    s, t = table_g.shape
    slot = jnp.arange(s)[:, None]
    page = table_g[slot, jnp.clip(index_g, 0, t - 1)]
    page = jnp.where((index_g < t) & (page >= 0) & jnp.any(fresh_g, axis=-1), page, pool_g.shape[0])   # [S, span]
    rows = new_g[slot[..., None], :, jnp.clip(offset_g, 0, n - 1)].transpose(0, 1, 3, 2, 4)  # [S, span, Hkv, R, Dh]
    old = pool_g[jnp.where(page < pool_g.shape[0], page, 0)]
    whole = jnp.where(fresh_g[:, :, None, :, None], rows.astype(pool_g.dtype), old)
    return pool_g.at[page.reshape(-1)].set(whole.reshape((-1,) + whole.shape[2:]), mode="drop")
  by = lambda x: x.reshape((g, per) + x.shape[1:])
  return jax.vmap(one)(pool, _by_group(pool, table), by(new), by(index), by(offset), by(fresh))


def gather(pool: jax.Array, table: jax.Array, length: int) -> jax.Array:
  """Slots' first ``length`` rows as a contiguous [B, Hkv, length, Dh] (the XLA attention path; rows of pages
  a slot does not hold are page 0's, never read unmasked)."""
  r = pool.shape[3]
  used = _by_group(pool, table)[:, :, :pages_for(length, r)]
  got = jax.vmap(lambda pool_g, t: pool_g[jnp.maximum(t, 0)])(pool, used)   # [G, S, T', Hkv, R, Dh]
  g, per, n, h, _, d = got.shape
  return got.transpose(0, 1, 3, 2, 4, 5).reshape(g * per, h, n * r, d)[:, :, :length]

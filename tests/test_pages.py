"""Paged cache storage (``jetspec_jax.pages``): the allocator counts every page's holders exactly, grants oldest first
and in order, returns what it took, shares keyed prompt pages and takes cached ones last, least recently released
first; rows written through a page table read back as the contiguous cache holds them, whatever order the pages
were handed out in; whole-page writes and reads equal row-by-row ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax import pages
from jetspec_jax.models.layers import write_rows


def check_invariant(p: pages.Pages):
  """Per group: each page's reference count is the number of its slots' table entries holding it, a slot holds a
  page at most once, and only a keyed page is held twice; the table past what a slot holds is -1."""
  g, pg = p.groups, p.pages_per_group
  per = p.table.shape[0] // g
  refs, key, table, held = (np.asarray(x) for x in (p.refs, p.key, p.table, p.held))
  for gi in range(g):
    rows = table[gi * per:(gi + 1) * per]
    h = held[gi * per:(gi + 1) * per]
    owned = [int(x) for b in range(per) for x in rows[b, :h[b]]]
    assert all((rows[b, h[b]:] == -1).all() for b in range(per))
    assert all(len(set(rows[b, :h[b]].tolist())) == h[b] for b in range(per))
    counts = np.bincount(owned, minlength=pg)
    assert counts.tolist() == refs[gi].tolist()
    assert (key[gi][counts > 1] != 0).any(axis=-1).all()


def test_grow_and_release_keep_every_page_once():
  rng = np.random.default_rng(0)
  p = pages.init_pages(groups=2, pages_per_group=9, slots=6, max_pages=5)
  grow = jax.jit(pages.grow, static_argnums=3)
  release = jax.jit(pages.release)
  seq = np.arange(6)
  for step in range(60):
    if rng.random() < 0.6:
      rows = jnp.asarray(rng.integers(0, 5 * 8 + 1, 6), jnp.int32)
      before = np.asarray(p.held)
      p, ok = grow(p, rows, jnp.asarray(seq), 8)
      ok, held = np.asarray(ok), np.asarray(p.held)
      need = np.minimum(-(-np.asarray(rows) // 8), 5)
      assert ((held >= need) == ok).all()                        # ok: the slot holds pages for its rows
      assert (held[~ok] == before[~ok]).all()                    # refused: nothing taken
      for gi in range(2):                                        # in order: no refused slot before a granted one
        grp = slice(gi * 3, gi * 3 + 3)
        order = np.argsort(seq[grp])
        wanted = (need[grp] > before[grp])[order]
        got = ok[grp][order]
        refused = np.flatnonzero(wanted & ~got)
        assert not refused.size or not (got & wanted)[refused[0]:].any()
    else:
      p = release(p, jnp.asarray(rng.random(6) < 0.5))
      seq = seq + 6 * (rng.random(6) < 0.5)                      # new requests, newer sequence numbers
    check_invariant(p)


def test_a_group_takes_only_its_own_pages():
  p = pages.init_pages(groups=2, pages_per_group=4, slots=4, max_pages=4)
  p, ok = pages.grow(p, jnp.asarray([32, 0, 0, 0], jnp.int32), jnp.arange(4), 8)      # group 0 wants all 4
  assert np.asarray(ok).tolist() == [True, True, True, True]
  p, ok = pages.grow(p, jnp.asarray([32, 8, 8, 0], jnp.int32), jnp.arange(4), 8)
  assert np.asarray(ok).tolist() == [True, False, True, True]                      # group 0 is out, group 1 is not
  assert np.asarray(p.free_count()).tolist() == [0, 3] and np.asarray(p.held).tolist() == [4, 0, 1, 0]
  check_invariant(p)


@pytest.mark.parametrize("page_rows", [8, 16])
def test_rows_written_through_pages_read_back_as_the_contiguous_cache(page_rows):
  """Several writes per slot at growing offsets (as prefill chunks and decode rounds write), pages handed out in a
  shuffled order: the gathered view equals a contiguous cache written the same way, on every written row."""
  rng = np.random.default_rng(page_rows)
  b, h, d, s = 4, 2, 4, 48
  p = pages.init_pages(groups=2, pages_per_group=20, slots=b, max_pages=s // page_rows)
  p = p.replace(used=jnp.asarray(np.stack([rng.permutation(20) for _ in range(2)]).astype(np.int32)))   # out of order
  pool = jnp.zeros((2, 20, h, page_rows, d), jnp.float32)
  cache = jnp.zeros((b, h, s, d), jnp.float32)
  length = np.zeros(b, np.int32)
  for n in (5, 1, 7, 3, 9):
    new = jnp.asarray(rng.normal(size=(b, h, n, d)), jnp.float32)
    start = jnp.asarray(length)
    p, ok = pages.grow(p, jnp.asarray(length + n), jnp.arange(b), page_rows)
    assert np.asarray(ok).all()
    pool = jax.jit(pages.write)(pool, new, p.table, start)
    cache = write_rows(cache, new, start)
    length += n
  view = pages.gather(pool, p.table, s)
  for i in range(b):
    np.testing.assert_array_equal(np.asarray(view)[i, :, :length[i]], np.asarray(cache)[i, :, :length[i]])
  check_invariant(p)


@pytest.mark.parametrize("n", [1, 5, 11, 19])
def test_whole_page_writes_equal_row_writes_and_touch_no_other_page(n):
  """``write`` (read each page holding a new row, set its rows, write the page back) against ``scatter`` row by
  row: equal bit for bit over a pool of garbage, starts mid-page and on a boundary, slots holding fewer pages than
  the rows need (-1 entries) and rows past the table (dropped); every other page and row unchanged."""
  rng = np.random.default_rng(n)
  g, pg, h, r, d, per, t = 2, 12, 2, 8, 4, 2, 4
  pool = jnp.asarray(rng.normal(size=(g, pg, h, r, d)), jnp.float32)
  table = np.stack([rng.permutation(pg)[:per * t].reshape(per, t) for _ in range(g)]).reshape(g * per, t)
  table[1, 2:] = -1                                                      # slot 1 holds two pages
  table = jnp.asarray(table.astype(np.int32))
  start = jnp.asarray([0, 13, 8, 30], jnp.int32)                        # boundary, mid-page, page 1, near the end
  new = jnp.asarray(rng.normal(size=(g * per, h, n, d)), jnp.float32)
  rows = (start[:, None] + jnp.arange(n)[None, :]).reshape(g, per * n)
  slot = jnp.broadcast_to(jnp.repeat(jnp.arange(per), n)[None, :], rows.shape)
  values = new.transpose(0, 2, 1, 3).reshape(g, per * n, h, d)
  want = pages.scatter(pool, values, table, slot, rows)
  np.testing.assert_array_equal(np.asarray(jax.jit(pages.write)(pool, new, table, start)), np.asarray(want))


@pytest.mark.parametrize("n", [1, 4, 16, 19])
def test_whole_page_reads_return_each_slots_rows(n):
  """``read`` (the whole pages holding a slot's rows start .. start + n - 1, then the rows) against those rows
  picked one by one from the pages the table names: equal bit for bit, starts mid-page, on a boundary and near the
  end of a slot's pages."""
  rng = np.random.default_rng(n)
  g, pg, h, r, d, per, t = 2, 12, 2, 8, 4, 2, 5
  pool = jnp.asarray(rng.normal(size=(g, pg, h, r, d)), jnp.float32)
  table = jnp.asarray(np.stack([rng.permutation(pg)[:per * t].reshape(per, t) for _ in range(g)]).reshape(g * per, t)
                      .astype(np.int32))
  start = jnp.asarray([0, 13, 8, t * r - n], jnp.int32)
  got = np.asarray(jax.jit(pages.read, static_argnums=3)(pool, table, start, n))
  pool_np, table_np = np.asarray(pool), np.asarray(table)
  for b in range(g * per):
    for j in range(n):
      row = int(start[b]) + j
      want = pool_np[b // per, table_np[b, row // r], :, row % r]
      np.testing.assert_array_equal(got[b, :, j], want)


def test_prefix_keys_name_the_tokens_before_each_page_end():
  a = pages.prefix_keys(list(range(40)), 8, 4)
  b = pages.prefix_keys(list(range(16)) + [99] + list(range(17, 40)), 8, 4)
  assert (a[:2] == b[:2]).all() and (a[2:] != b[2:]).any(axis=1).all()     # they part in page 2: so do later keys
  assert (a != 0).any(axis=1).all()
  assert (pages.prefix_keys(list(range(20)), 8, 4)[2:] == 0).all()         # no key past the full pages


def test_shared_pages_are_held_twice_never_taken_and_cached_ones_go_last_least_recent_first():
  """Slot 0 computes a 3-page prompt and keys its first 2 pages; slot 1 shares them and grows its own. Released, the
  keyed pages stay cached: a third slot shares them again; a grow that needs every free page takes the uncached
  ones first, then the cached ones, least recently released first, their keys dropped."""
  r = 8
  keys = jnp.asarray(np.stack([pages.prefix_keys(list(range(1, 33)), r, 3)] * 3))          # [3, 3, 2]
  p = pages.init_pages(groups=1, pages_per_group=8, slots=3, max_pages=8)
  p, ok = pages.grow(p, jnp.asarray([24, 0, 0]), jnp.arange(3), r)
  p = pages.register(p, keys, jnp.asarray([2, 0, 0]))
  p, hits = pages.share(p, jnp.asarray([False, True, False]), keys, jnp.asarray([3, 3, 0]))
  assert np.asarray(hits).tolist() == [0, 2, 0]
  assert np.asarray(p.table)[1, :2].tolist() == np.asarray(p.table)[0, :2].tolist()
  p, ok = pages.grow(p, jnp.asarray([0, 32, 0]), jnp.arange(3), r)
  assert bool(ok[1]) and int(p.held[1]) == 4
  check_invariant(p)
  shared = np.asarray(p.table)[0, :2].tolist()
  p = pages.release(p, jnp.asarray([True, False, False]), 5)
  p = pages.release(p, jnp.asarray([False, True, False]), 7)
  check_invariant(p)
  assert np.asarray(p.cached_count()).tolist() == [2] and np.asarray(p.free_count()).tolist() == [8]
  p, hits = pages.share(p, jnp.asarray([False, False, True]), keys, jnp.asarray([0, 0, 3]))
  assert int(hits[2]) == 2 and np.asarray(p.table)[2, :2].tolist() == shared
  p = pages.release(p, jnp.asarray([False, False, True]), 9)
  p = p.replace(used=p.used.at[0, shared[1]].set(3))                     # page 1 of the prefix: least recent
  p, ok = pages.grow(p, jnp.asarray([56, 0, 0]), jnp.arange(3), r)     # 7 pages: the 6 uncached, then 1 cached
  taken = np.asarray(p.table)[0, :7].tolist()
  assert bool(ok[0]) and taken[-1] == shared[1] and shared[0] not in taken
  assert np.asarray(p.cached_count()).tolist() == [1] and not np.asarray(p.key)[0, shared[1]].any()
  check_invariant(p)


def test_share_stops_at_the_first_page_it_does_not_find():
  r = 8
  keys = jnp.asarray(np.stack([pages.prefix_keys(list(range(1, 41)), r, 4)] * 2))
  p = pages.init_pages(groups=1, pages_per_group=10, slots=2, max_pages=5)
  p, _ = pages.grow(p, jnp.asarray([40, 0]), jnp.arange(2), r)
  p = pages.register(p, keys.at[0, 1].set(7), jnp.asarray([4, 0]))       # page 1 keyed otherwise
  p, hits = pages.share(p, jnp.asarray([False, True]), keys, jnp.asarray([0, 4]))
  assert int(hits[1]) == 1
  check_invariant(p)

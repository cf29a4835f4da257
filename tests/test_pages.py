"""Paged cache storage (``jetspec_jax.pages``): the allocator keeps every page exactly once (held or free), grants
oldest first and in order, returns what it took; rows written through a page table read back as the contiguous
cache holds them, whatever order the pages were handed out in."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax import pages
from jetspec_jax.models.layers import write_rows


def check_invariant(p: pages.Pages):
  """Per group: held pages and the free stack are the group's pages, each exactly once; the table past what a
  slot holds is -1."""
  g, pg = p.groups, p.pages_per_group
  per = p.table.shape[0] // g
  free, count, table, held = (np.asarray(x) for x in (p.free, p.free_count, p.table, p.held))
  for gi in range(g):
    rows = table[gi * per:(gi + 1) * per]
    h = held[gi * per:(gi + 1) * per]
    owned = [int(x) for b in range(per) for x in rows[b, :h[b]]]
    assert all((rows[b, h[b]:] == -1).all() for b in range(per))
    assert sorted(owned + free[gi, :count[gi]].tolist()) == list(range(pg))


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
  assert np.asarray(p.free_count).tolist() == [0, 3] and np.asarray(p.held).tolist() == [4, 0, 1, 0]
  check_invariant(p)


@pytest.mark.parametrize("page_rows", [8, 16])
def test_rows_written_through_pages_read_back_as_the_contiguous_cache(page_rows):
  """Several writes per slot at growing offsets (as prefill chunks and decode rounds write), pages handed out in a
  shuffled order: the gathered view equals a contiguous cache written the same way, on every written row."""
  rng = np.random.default_rng(page_rows)
  b, h, d, s = 4, 2, 4, 48
  p = pages.init_pages(groups=2, pages_per_group=20, slots=b, max_pages=s // page_rows)
  p = p.replace(free=jnp.asarray(np.stack([rng.permutation(20) for _ in range(2)]).astype(np.int32)))   # out of order
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

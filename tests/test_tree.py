"""Tree construction: the jitted device search against a plain-Python heapq reference."""
import functools
import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.decode.tree import TREE_METHODS, Tree, build_tree, top_w, tree_size
from jetspec_jax.errors import JetSpecError


@functools.lru_cache(maxsize=None)
def _jitted(method, budget, width, beta=2.0, g0=1.0):
  return jax.jit(functools.partial(build_tree, method=method, budget=budget, width=width,
                                   top2gap_beta=beta, top2gap_g0=g0))


def _build(anchor, logits, method, budget, width, beta=2.0, g0=1.0) -> Tree:
  tree = _jitted(method, budget, width, beta, g0)(jnp.asarray(anchor), jnp.asarray(logits))
  return jax.tree.map(np.asarray, tree)


def _reference_row(anchor, log_probs, method, budget, width, beta, g0):
  """heapq best-first search for one row; log_probs [D, V] float32. Returns a dict of [N] arrays."""
  depth = log_probs.shape[0]
  rank = np.argsort(-log_probs, axis=-1, kind="stable")[:, :width]     # ties: lower token id first
  top_lp = np.take_along_axis(log_probs, rank, axis=-1)
  if method == "accum_logp":
    caps = [width] * depth
  elif width < 2:
    caps = [1] * depth
  else:
    caps = [max(1, round(width / (1.0 + math.exp(beta * (float(top_lp[d, 0] - top_lp[d, 1]) - g0)))))
            for d in range(depth)]
  tokens, parents, depths, scores = [int(anchor)], [0], [0], [np.float32(0.0)]
  heap = [(-0.0, 0)]
  while heap and len(tokens) < budget:
    _, p = heapq.heappop(heap)
    d = depths[p]
    if d >= depth:
      continue
    for j in range(min(caps[d], budget - len(tokens))):
      score = np.float32(scores[p] + top_lp[d, j])                     # float32 like the device
      heapq.heappush(heap, (-float(score), len(tokens)))
      tokens.append(int(rank[d, j]))
      parents.append(p)
      depths.append(d + 1)
      scores.append(score)
  return _padded(tokens, parents, depths, budget)


def _best_nodes_reference_row(anchor, log_probs, budget, width):
  """Every node of the full W-ary tree (W^D of them), ordered by (-score, depth, position) where a depth's
  positions order its nodes by (-score, parent's position, rank); the first N - 1 of finite score, numbered by
  (depth, position). Asserts that every chosen node's parent was chosen."""
  depth = log_probs.shape[0]
  rank = np.argsort(-log_probs, axis=-1, kind="stable")[:, :width]
  top_lp = np.take_along_axis(log_probs, rank, axis=-1)
  levels = [[(np.float32(0.0), ())]]                                   # per depth: (score, rank path), by position
  for d in range(depth):
    children = [(np.float32(score + top_lp[d, r]), pos, r, path + (r,))
                for pos, (score, path) in enumerate(levels[-1]) for r in range(width)]
    children.sort(key=lambda c: (-float(c[0]), c[1], c[2]))
    levels.append([(c[0], c[3]) for c in children])
  ranked = sorted((-float(score), d, pos, path) for d in range(1, depth + 1)
                  for pos, (score, path) in enumerate(levels[d]) if np.isfinite(score))
  chosen = sorted(ranked[:budget - 1], key=lambda x: (x[1], x[2]))
  ids, tokens, parents, depths = {(): 0}, [int(anchor)], [0], [0]
  for _, d, _, path in chosen:
    assert path[:-1] in ids, "the chosen set is not closed under taking parents"
    ids[path] = len(tokens)
    tokens.append(int(rank[d - 1, path[-1]]))
    parents.append(ids[path[:-1]])
    depths.append(d)
  return _padded(tokens, parents, depths, budget)


def _padded(tokens, parents, depths, budget):
  """Reference lists of n nodes -> a dict of [N] arrays (padding as the device pads) and ancestors [N, N]."""
  n = len(tokens)
  ancestors = np.eye(budget, dtype=bool)
  for i in range(1, n):
    ancestors[i] |= ancestors[parents[i]]
  pad = [0] * (budget - n)
  return dict(tokens=np.array(tokens + pad), parents=np.array(parents + pad),
              depths=np.array(depths + pad), valid=np.arange(budget) < n, ancestors=ancestors)


def _assert_matches_reference(anchor, logits, method, budget, width, beta=2.0, g0=1.0):
  tree = _build(anchor, logits, method, budget, width, beta, g0)
  # XLA's own log-probs, so ulp-level differences from a NumPy softmax cannot reorder near-ties.
  log_probs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1))
  for b in range(logits.shape[0]):
    ref = (_best_nodes_reference_row(anchor[b], log_probs[b], budget, width) if method == "best_nodes" else
           _reference_row(anchor[b], log_probs[b], method, budget, width, beta, g0))
    for field, want in ref.items():
      np.testing.assert_array_equal(getattr(tree, field)[b], want, err_msg=f"{field}, row {b}")
  return tree


def _random_case(seed, depth, vocab, batch=3, scale=3.0):
  rng = np.random.default_rng(seed)
  anchor = rng.integers(0, vocab, size=batch).astype(np.int32)
  logits = (scale * rng.normal(size=(batch, depth, vocab))).astype(np.float32)
  return anchor, logits


CASES = [  # (budget, width, depth, vocab)
    (1, 3, 4, 50),
    (2, 7, 15, 200),
    (16, 1, 4, 50),
    (16, 3, 1, 97),
    (16, 7, 4, 128),
    (64, 3, 15, 500),
    (64, 7, 15, 256),
]


@pytest.mark.parametrize("method", ["accum_logp", "top2gap"])
@pytest.mark.parametrize("budget,width,depth,vocab", CASES)
def test_matches_heapq_reference(method, budget, width, depth, vocab):
  for seed in range(3):
    anchor, logits = _random_case(seed, depth, vocab)
    _assert_matches_reference(anchor, logits, method, budget, width)


BEST_NODES_CASES = [  # (budget, width, depth, vocab): the reference enumerates all W^D nodes
    (1, 3, 3, 40),
    (2, 1, 5, 40),
    (5, 7, 1, 40),
    (16, 3, 4, 60),
    (40, 4, 4, 60),
    (64, 2, 7, 30),
]


@pytest.mark.parametrize("budget,width,depth,vocab", BEST_NODES_CASES)
def test_best_nodes_matches_exhaustive_reference(budget, width, depth, vocab):
  for seed in range(3):
    anchor, logits = _random_case(seed, depth, vocab)
    _assert_matches_reference(anchor, logits, "best_nodes", budget, width)


def test_best_nodes_holds_at_least_the_probability_mass_of_accum_logp():
  """The sum over nodes of the path probability (the draft's expected accepted length) is the most any
  N-node tree holds, so it is at least accum_logp's, and strictly more when accum_logp adds unlikely siblings."""
  anchor, logits = _random_case(5, 8, 100, batch=4, scale=2.0)
  log_probs = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)

  def mass(tree):
    lp = np.take_along_axis(np.asarray(log_probs), tree.tokens[:, None, 1:].repeat(8, 1), axis=2)   # [B, D, N-1]
    node_lp = np.take_along_axis(lp, (tree.depths[:, None, 1:] - 1).clip(0), axis=1)[:, 0]        # [B, N-1]
    path = (tree.ancestors[:, 1:, 1:] * node_lp[:, None, :]).sum(-1)                              # [B, N-1]
    return (np.exp(path) * tree.valid[:, 1:]).sum(-1)

  for budget in (8, 32):
    best, heap = (mass(_build(anchor, logits, m, budget, 7)) for m in ("best_nodes", "accum_logp"))
    assert np.all(best >= heap - 1e-5) and np.any(best > heap + 1e-3), (best, heap)


@pytest.mark.parametrize("beta,g0", [(1.0, 1.0), (0.5, 4.0)])
def test_top2gap_knobs_match_reference(beta, g0):
  for seed in range(3):
    anchor, logits = _random_case(seed, 6, 150, scale=1.5)
    _assert_matches_reference(anchor, logits, "top2gap", 64, 7, beta, g0)


@pytest.mark.parametrize("method", ["accum_logp", "top2gap", "best_nodes"])
@pytest.mark.parametrize("same_rows", [False, True])
def test_exact_ties_match_reference(method, same_rows):
  """Repeated logit values tie log-probs within a depth; identical depths tie whole paths."""
  for seed in range(3):
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 3, size=(3, 5, 40)).astype(np.float32)
    if same_rows:
      logits[:] = logits[:, :1]
    anchor = np.arange(3, dtype=np.int32)
    tree = _assert_matches_reference(anchor, logits, method, 48, 5)
    assert tree.tokens[0, 1] == np.flatnonzero(logits[0, 0] == logits[0, 0].max())[0]


@pytest.mark.parametrize("method", ["accum_logp", "top2gap", "best_nodes"])
def test_masked_vocabulary_matches_reference(method):
  """-inf logits (fewer finite tokens than W) give -inf scores that still order like heapq."""
  anchor, logits = _random_case(3, 5, 40)
  logits[:, :, 3:] = -np.inf
  _assert_matches_reference(anchor, logits, method, 48, 5)


def test_top2gap_rounds_half_to_even():
  """A tied top-2 (gap 0) with g0 = 0 gives the cap round(W / 2): 7 -> 4, 5 -> 2, 3 -> 2."""
  logits = np.full((1, 1, 20), -20.0, np.float32)
  logits[0, 0, [4, 9]] = 0.0
  for width, children in [(7, 4), (5, 2), (3, 2)]:
    tree = _build(np.zeros(1, np.int32), logits, "top2gap", 16, width, beta=2.0, g0=0.0)
    assert tree.valid[0].sum() == 1 + children


def test_top2gap_cap_uses_the_childrens_depth():
  """Depth 1 is decisive (cap 1) and depth 2 is flat (cap round(7 * sigmoid(2)) = 6)."""
  logits = np.zeros((1, 2, 30), np.float32)
  logits[0, 0, 3] = 10.0
  tree = _build(np.array([5], np.int32), logits, "top2gap", 16, 7)
  assert tree.valid[0].sum() == 8
  np.testing.assert_array_equal(tree.depths[0, :8], [0, 1, 2, 2, 2, 2, 2, 2])
  np.testing.assert_array_equal(tree.tokens[0, :8], [5, 3, 0, 1, 2, 3, 4, 5])


def test_chain_is_per_depth_argmax():
  anchor, logits = _random_case(0, 6, 100)
  tree = _build(anchor, logits, "chain", 999, 999)
  n = tree_size("chain", 999, 6)
  assert tree.tokens.shape == (3, n) == (3, 7)
  np.testing.assert_array_equal(tree.tokens[:, 0], anchor)
  np.testing.assert_array_equal(tree.tokens[:, 1:], logits.argmax(-1))
  np.testing.assert_array_equal(tree.parents[0], [0, 0, 1, 2, 3, 4, 5])
  np.testing.assert_array_equal(tree.depths[0], np.arange(7))
  assert tree.valid.all()
  np.testing.assert_array_equal(tree.ancestors[1], np.tril(np.ones((7, 7), bool)))
  ties = np.random.default_rng(0).integers(0, 3, size=(3, 6, 100)).astype(np.float32)
  np.testing.assert_array_equal(_build(anchor, ties, "chain", 1, 1).tokens[:, 1:], ties.argmax(-1))


def test_tree_smaller_than_budget_is_padded():
  anchor, logits = _random_case(1, 4, 60)
  tree = _build(anchor, logits, "accum_logp", 16, 1)
  assert tree.tokens.shape == (3, 16)
  np.testing.assert_array_equal(tree.valid.sum(1), [5, 5, 5])
  np.testing.assert_array_equal(tree.tokens[:, 1:5], logits.argmax(-1))
  np.testing.assert_array_equal(tree.depths[:, :5], np.broadcast_to(np.arange(5), (3, 5)))
  for field in (tree.tokens, tree.parents, tree.depths):
    assert (field[:, 5:] == 0).all()
  np.testing.assert_array_equal(tree.ancestors[:, 5:], np.broadcast_to(np.eye(16, dtype=bool)[5:], (3, 11, 16)))


@pytest.mark.parametrize("method", ["accum_logp", "top2gap", "best_nodes"])
def test_tree_invariants(method):
  anchor, logits = _random_case(7, 15, 256, scale=1.0)
  tree = _build(anchor, logits, method, 64, 7)
  for b in range(3):
    n = int(tree.valid[b].sum())
    assert tree.valid[b, :n].all() and not tree.valid[b, n:].any()
    kids = np.arange(1, n)
    par = tree.parents[b, kids]
    assert (par < kids).all()
    np.testing.assert_array_equal(tree.depths[b, kids], tree.depths[b, par] + 1)
    for p in np.unique(par):
      sib = tree.tokens[b, kids[par == p]]
      assert len(set(sib.tolist())) == len(sib)
    for i in range(n):                                   # ancestors = the path to the root
      path, j = {i}, i
      while j:
        j = tree.parents[b, j]
        path.add(j)
      np.testing.assert_array_equal(np.flatnonzero(tree.ancestors[b, i]), sorted(path))


def test_tree_size():
  assert tree_size("accum_logp", 256, 15) == 256
  assert tree_size("top2gap", 1, 15) == 1
  assert tree_size("chain", 256, 15) == 16
  assert tree_size("best_nodes", 64, 15) == 64
  assert set(TREE_METHODS) == {"accum_logp", "top2gap", "best_nodes", "chain", "rank_caps", "calibrated", "static"}


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="beam", budget=16, width=3), "unknown tree method"),
    (dict(method="accum_logp", budget=0, width=3), "budget"),
    (dict(method="top2gap", budget=16, width=0), "width"),
    (dict(method="accum_logp", budget=16, width=11), "width"),
])
def test_bad_arguments(kwargs, match):
  anchor, logits = _random_case(0, 2, 10)
  with pytest.raises(JetSpecError, match=match):
    build_tree(jnp.asarray(anchor), jnp.asarray(logits), **kwargs)


def test_bad_shapes():
  anchor, logits = _random_case(0, 2, 10)
  with pytest.raises(JetSpecError, match="depth_logits"):
    build_tree(jnp.asarray(anchor), jnp.asarray(logits[0]), method="chain", budget=1, width=1)


@pytest.mark.parametrize("method", ["accum_logp", "top2gap", "best_nodes"])
def test_no_vocabulary_sort_in_the_compiled_tree(method):
  """The top-W of each depth stays a TopK: XLA turns a top_k whose outputs are sliced into a sort of the
  whole vocabulary (best_nodes once took 4.9 ms instead of 0.17 ms per tree that way at V = 4096 on CPU)."""
  fn = jax.jit(functools.partial(build_tree, method=method, budget=16, width=4))
  hlo = fn.lower(jnp.zeros((1,), jnp.int32), jnp.zeros((1, 7, 4096), jnp.float32)).compile().as_text()
  assert not [line for line in hlo.splitlines() if " sort(" in line and "4096" in line]


@pytest.mark.parametrize("vocab", [151936, 8192])
@pytest.mark.parametrize("width", [1, 7, 40])
def test_top_w_over_vocabulary_blocks_equals_top_k(vocab, width):
  """``top_w`` (the best blocks' maxima, then their tokens) against ``lax.top_k`` over whole rows: equal values and
  ids, with ties inside a block, across blocks, a row of one value, a row of -inf but a few, and bfloat16."""
  rng = np.random.default_rng(vocab + width)
  x = rng.normal(size=(3, 4, vocab)).astype(np.float32)
  x[0, 0, 1000:1010] = 9.0
  x[0, 0, vocab - 5] = 9.0
  x[0, 1, ::997] = 5.0
  x[1, 2] = 1.0
  x[2, 3] = -np.inf
  x[2, 3, [3, 700, vocab - 1]] = [0.5, 0.5, 2.0]
  for xs in (jnp.asarray(x), jnp.asarray(x, jnp.bfloat16)):
    want_v, want_i = jax.lax.top_k(xs, width)
    fn = jax.jit(top_w, static_argnums=1)
    assert "reduce-window" in fn.lower(xs, width).compile().as_text()         # the blocks' path, not lax.top_k's
    got_v, got_i = fn(xs, width)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))

"""Token-tree construction from per-depth draft logits, on device with static shapes.

A tree of N nodes per batch row (node 0 = the root = the anchor token) is built from
``depth_logits`` [B, D, V], where ``depth_logits[:, k]`` is the draft distribution for
depth k+1. Methods:

  accum_logp  best-first search on cumulative log-prob: a max-heap starts with the root
              (score 0); each pop of a node at depth d < D adds up to min(W, budget - n)
              children, the top-W tokens of depth d+1 in rank order (the same list for every
              parent at that depth), numbered n, n+1, ... in insertion order; the search
              stops when n == budget or the heap is empty. Heap ties go to the lower node
              index, top-k ties to the lower token id. N = budget.
  top2gap     the same search, but children at depth d+1 are capped at
              max(1, round(W * sigmoid(-beta * (g - g0)))), g = lp_rank1 - lp_rank2 of the
              depth-(d+1) distribution (round half to even). N = budget.
  best_nodes  the N - 1 nodes of highest cumulative log-prob among all nodes of depth 1..D
              whose parent is in the tree (every depth's candidates: the same top-W tokens),
              plus the root: the best tree of N nodes for a given budget, where accum_logp
              always adds a popped node's W children even when a deeper node is likelier.
              Order: score, then depth, then position at that depth (parent's position,
              then token rank), so a parent always precedes a child of equal score and the
              set is closed under taking parents. Found without a search loop: D top-k
              steps over the (N - 1) x W children of the previous depth's N - 1 best nodes,
              then one top-k over all depths. Nodes are numbered by depth, then position;
              nodes of score -inf are never chosen (a smaller tree is padded). N = budget.
  chain       node d (depth d) is the argmax of depth d's logits, parent d-1. N = D + 1.

Methods ranked by a measured acceptance (``decode.profile``: p(d, r), the chance that the rank-r
child at depth d is accepted given its parent was; ``acceptance`` [D, W] below is the profile fitted
to the tree, non-increasing in rank):
  rank_caps   accum_logp with depth d's fan-out capped at the number of ranks whose acceptance is at
              least ``cap_threshold`` (at least 1); without a profile exactly accum_logp. N = budget.
  calibrated  best_nodes on calibrated probabilities instead of the draft's: the rank-r token of
              depth d gets min(1, q * c[d, r]), q its draft probability this round and
              c = (hits + s) / (mass + s) the measured over the predicted acceptance of (d, r) (the
              profile's counts plus, online, those of this generation's rounds so far; s =
              ``prior_strength`` pseudo-rounds pull c towards 1), made non-increasing in rank.
              Without a profile or counts c = 1: exactly best_nodes. N = budget.
  static      the fixed tree of highest expected accepted length for the profile
              (``profile.optimal_static_tree``); each round only fills in the tokens. N = budget.

Sampled trees (``depth_tokens``): the SHAPE (parents, depths, child ranks) is built exactly as
above from the sorted top-W log-probs of ``depth_logits``, but the child of rank r at depth d
gets ``depth_tokens[:, d-1, r]`` instead of the r-th most likely token (the rejection rule
passes the r-th Gumbel-top-k sample of depth d; see ``decode.verify``). The shape therefore
never depends on which tokens were sampled.

Every tree also carries the candidate lists its nodes came from (``candidates`` [B, D, W]: the
rank-r token of depth d at [:, d-1, r]) and their log-probs, from which the loop counts which rank
the target took (``decode.profile``).

Invariants of every tree: parents[i] < i for i > 0 (parents precede children),
depths[i] = depths[parents[i]] + 1, sibling tokens are distinct, and padding nodes
(valid False, only when the search ran out of nodes) come after all valid ones.
Scores are float32: a node's log-prob is its logit minus its row's log-sum-exp over the full vocabulary, in float32.
"""
from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

import numpy as np

from jetspec_jax.decode.profile import ACCEPTANCE_FLOOR, optimal_static_tree
from jetspec_jax.errors import JetSpecError

TREE_METHODS = ("accum_logp", "top2gap", "best_nodes", "chain", "rank_caps", "calibrated", "static")
PROFILE_METHODS = ("rank_caps", "calibrated", "static")     # methods that read an acceptance profile

MAX_POPS_PER_STEP = 8     # pops unrolled in one step of the search loop (bounds the unrolled code)


@flax.struct.dataclass
class Tree:
  """A batch of token trees with N nodes each (N static; see ``tree_size``).

  tokens    [B, N] int32  node 0 is the root = the anchor token; padding nodes: 0
  parents   [B, N] int32  parent node index; root and padding nodes: 0
  depths    [B, N] int32  root 0; padding nodes: 0
  valid     [B, N] bool   False for padding nodes (tree smaller than N)
  ancestors [B, N, N] bool  ancestors[b, i, j] iff j is i or an ancestor of i;
                          padding rows hold only the diagonal
  candidates [B, D, W] int32  depth d's candidate tokens in rank order at [:, d-1] (W = 1 for a chain)
  candidate_logp [B, D, W] float32  their log-probs under the distribution the tree was built from
  """
  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  valid: jax.Array
  ancestors: jax.Array
  candidates: jax.Array
  candidate_logp: jax.Array


def _check_method(method: str) -> None:
  if method not in TREE_METHODS:
    raise JetSpecError(f"unknown tree method {method!r}; expected one of {', '.join(TREE_METHODS)}")


def tree_size(method: str, budget: int, depth: int) -> int:
  """Static node count N: ``depth + 1`` for chain, else ``budget``."""
  _check_method(method)
  if method == "chain":
    return depth + 1
  if budget < 1:
    raise JetSpecError(f"tree budget must be at least 1 (it counts the root); got {budget}")
  return budget


VOCAB_BLOCK = 128       # the top-W of a large vocabulary goes through the maxima of blocks of this many tokens


def top_w(logits: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """``jax.lax.top_k(logits, width)`` over the last axis ([..., V] -> values, int32 ids [..., W]), ties to the lower
  id, without sorting whole rows when V is a multiple of ``VOCAB_BLOCK`` over 32 blocks: the W blocks with the
  largest maxima (ties to the lower block) hold the W best tokens (each token outside them is outranked by those
  W maxima), so a top-W of those blocks' tokens is exact. XLA:TPU lowers a top_k to a sort of every row: over
  [64, 15, 151936] draft logits that is a sort of 146 M floats and two copies of the sorted arrays per round."""
  vocab, lead = logits.shape[-1], logits.shape[:-1]
  if vocab % VOCAB_BLOCK or vocab <= 32 * VOCAB_BLOCK or width > vocab // VOCAB_BLOCK:
    values, ids = jax.lax.top_k(logits, width)
    return values, ids.astype(jnp.int32)
  window = (1,) * len(lead) + (VOCAB_BLOCK,)
  lowest = jnp.array(-jnp.inf, logits.dtype)
  maxima = jax.lax.reduce_window(logits, lowest, jax.lax.max, window, window, "VALID")           # [..., V / 128]
  blocks = jnp.sort(jax.lax.top_k(maxima, width)[1], axis=-1)         # token order, so ties still go to lower ids
  ids = (blocks[..., None] * VOCAB_BLOCK + jnp.arange(VOCAB_BLOCK, dtype=jnp.int32)).reshape(lead + (-1,))
  values, at = jax.lax.top_k(jnp.take_along_axis(logits, ids, axis=-1), width)
  return values, jnp.take_along_axis(ids, at, axis=-1).astype(jnp.int32)


def _chain(anchor: jax.Array, depth_logits: jax.Array, depth_tokens: jax.Array | None = None) -> Tree:
  """Chain of the per-depth argmax tokens (or depth_tokens[:, :, 0]): N = D + 1 nodes, node d at depth d."""
  batch, depth, _ = depth_logits.shape
  n = depth + 1
  if depth_tokens is not None:
    best = depth_tokens[:, :, 0].astype(jnp.int32)
  else:
    # argmax with ties to the lower token id; top_k(., 1) is about 3x faster than argmax on CPU at V = 32k.
    best = top_w(depth_logits, 1)[1][..., 0]                                  # [B, D]
  logits = depth_logits.astype(jnp.float32)
  best_logp = (jnp.take_along_axis(logits, best[..., None], axis=-1)
               - jax.nn.logsumexp(logits, axis=-1, keepdims=True))           # [B, D, 1]
  tokens = jnp.concatenate([anchor[:, None].astype(jnp.int32), best], axis=1)
  idx = jnp.arange(n, dtype=jnp.int32)
  rows = jnp.broadcast_to(idx, (batch, n))
  return Tree(
      tokens=tokens,
      parents=jnp.maximum(rows - 1, 0),
      depths=rows,
      valid=jnp.ones((batch, n), bool),
      ancestors=jnp.broadcast_to(idx[None, :] <= idx[:, None], (batch, n, n)),
      candidates=best[:, :, None],
      candidate_logp=best_logp)


def _fanout_caps(log_probs: jax.Array, method: str, width: int, beta: float, g0: float) -> jax.Array:
  """Child cap [..., D] int32 per parent depth from the per-depth log-probs [..., D, V] (or logits: the top-2 gap is
  the same).

  The top-2 gap is taken with two max reductions, not by slicing top_k's output: XLA rewrites
  top_k plus such slices into a full-vocabulary sort (~70x slower on CPU at V = 32k), and an
  optimization barrier against that crashes XLA's TopK decomposer under SPMD partitioning."""
  if method == "accum_logp":
    return jnp.full(log_probs.shape[:-1], width, jnp.int32)
  if width < 2:                                   # max(1, round(1 * s)) == 1 for any s in [0, 1]
    return jnp.ones(log_probs.shape[:-1], jnp.int32)
  first = jnp.max(log_probs, axis=-1)
  best = jnp.argmax(log_probs, axis=-1)
  rest = jnp.where(jnp.arange(log_probs.shape[-1]) == best[..., None], -jnp.inf, log_probs)
  gap = first - jnp.max(rest, axis=-1)
  frac = jax.nn.sigmoid(-jnp.float32(beta) * (gap - jnp.float32(g0)))
  return jnp.maximum(1, jnp.round(width * frac)).astype(jnp.int32)


def _heap_tree(anchor: jax.Array, top_tok: jax.Array, top_lp: jax.Array, caps: jax.Array,
               budget: int) -> tuple[jax.Array, ...]:
  """Best-first search for one batch row (vmapped over the batch).

  anchor [] int32; top_tok / top_lp [D, W] per-depth top-W tokens and log-probs in rank
  order; caps [D] int32 child cap per parent depth. Returns tokens, parents, depths,
  valid [N] and ancestors [N, N] with N = budget.

  A pop takes the in-heap node with the highest score (lowest index among ties) and writes
  its children as one W-wide masked block at [n, n + W); internal arrays have N + W rows so the
  block always fits, and rows >= N are sliced off at the end. Nodes at depth D join the tree but
  not the heap (popping one would add nothing), so every pop adds at least one node until the
  tree is full or the heap is empty; a pop after that changes nothing. The loop stops there,
  and each of its steps makes min(ceil((N - 1) / W), MAX_POPS_PER_STEP) pops (ceil((N - 1) / W)
  is the fewest that can fill the tree): on a GPU each loop step costs a host round-trip for
  the predicate, so a full accum_logp tree of 128 nodes, W = 7, takes 3 steps instead of 128.
  top2gap with smaller caps takes more. Under vmap the loop runs until the slowest row is
  done; finished rows are unchanged.
  """
  depth, width = top_tok.shape
  n_nodes, rows = budget, budget + width
  slot = jnp.arange(width, dtype=jnp.int32)
  col = jnp.arange(n_nodes, dtype=jnp.int32)

  init = dict(
      n=jnp.int32(1),
      tokens=jnp.zeros(rows, jnp.int32).at[0].set(anchor),
      parents=jnp.zeros(rows, jnp.int32),
      depths=jnp.zeros(rows, jnp.int32),
      score=jnp.full(rows, -jnp.inf, jnp.float32).at[0].set(0.0),
      in_heap=jnp.zeros(rows, bool).at[0].set(True),
      anc=jnp.eye(rows, n_nodes, dtype=bool))

  def growing(s):
    return (s["n"] < n_nodes) & jnp.any(s["in_heap"])

  def pop_and_expand(s):
    n, in_heap, score = s["n"], s["in_heap"], s["score"]
    best = jnp.max(jnp.where(in_heap, score, -jnp.inf))
    parent = jnp.argmax(in_heap & (score == best)).astype(jnp.int32)   # first best heap node
    d = s["depths"][parent]                                           # < D: deeper nodes never enter
    k = jnp.where(jnp.any(in_heap), jnp.minimum(caps[d], n_nodes - n), 0)
    live = slot < k
    child = n + slot

    def put(arr, block):
      return jax.lax.dynamic_update_slice(arr, block, (n,) + (0,) * (arr.ndim - 1))

    anc_rows = (s["anc"][parent][None, :] & live[:, None]) | (col[None, :] == child[:, None])
    return dict(
        n=n + k,
        tokens=put(s["tokens"], jnp.where(live, top_tok[d], 0)),
        parents=put(s["parents"], jnp.where(live, parent, 0)),
        depths=put(s["depths"], jnp.where(live, d + 1, 0)),
        score=put(score, jnp.where(live, score[parent] + top_lp[d], -jnp.inf)),
        in_heap=put(in_heap.at[parent].set(False), live & (d + 1 < depth)),
        anc=put(s["anc"], anc_rows))

  def pops(s):
    for _ in range(min(MAX_POPS_PER_STEP, max(1, -(-(n_nodes - 1) // width)))):
      s = pop_and_expand(s)
    return s

  s = jax.lax.while_loop(growing, pops, init)
  valid = jnp.arange(n_nodes) < s["n"]
  return (s["tokens"][:n_nodes], s["parents"][:n_nodes], s["depths"][:n_nodes], valid,
          s["anc"][:n_nodes])


def _best_nodes_tree(anchor: jax.Array, top_tok: jax.Array, top_lp: jax.Array,
                     budget: int) -> tuple[jax.Array, ...]:
  """The ``best_nodes`` tree of one batch row (vmapped over the batch); arguments and results as
  ``_heap_tree``.

  Depth d keeps its M = N - 1 best nodes (a candidate is a kept node of depth d - 1 plus one of
  the W tokens; top_k over the candidates laid out as [parent position, rank] breaks score ties
  by parent position, then rank); every node of the final M best has its parent among the M best
  of the previous depth, so no candidate is lost. The final top_k runs over the kept nodes laid
  out depth-major (ties: lower depth first).
  """
  depth, width = top_tok.shape
  m = budget - 1
  n_nodes = budget
  if m == 0:
    eye = jnp.eye(1, dtype=bool)
    zero = jnp.zeros(1, jnp.int32)
    return anchor[None].astype(jnp.int32), zero, zero, jnp.ones(1, bool), eye
  # Row d of top_lp as a masked sum, not a slice: XLA turns a top_k whose output is sliced into a
  # full sort of the vocabulary (see ``_fanout_caps``).
  row = lambda d: jnp.sum(jnp.where(jnp.arange(depth)[:, None] == d, top_lp, 0.0), axis=0)   # [W]
  scores, parent_pos, ranks = [], [], []
  level = jnp.pad(row(0), (0, max(m - width, 0)), constant_values=-jnp.inf)[:m]      # depth 1: the ranks
  scores.append(level)
  parent_pos.append(jnp.zeros(m, jnp.int32))
  ranks.append(jnp.minimum(jnp.arange(m, dtype=jnp.int32), width - 1))
  for d in range(1, depth):
    children = (scores[-1][:, None] + row(d)[None, :]).reshape(-1)                    # [M * W]
    best, idx = jax.lax.top_k(children, m)
    scores.append(best)
    parent_pos.append((idx // width).astype(jnp.int32))
    ranks.append((idx % width).astype(jnp.int32))
  flat_scores = jnp.concatenate(scores)                                                 # [D * M] depth-major
  _, chosen = jax.lax.top_k(flat_scores, m)
  selected = jnp.zeros(depth * m, bool).at[chosen].set(True) & (flat_scores > -jnp.inf)
  node_id = jnp.where(selected, jnp.cumsum(selected), n_nodes)                          # n_nodes: dropped
  level_of = jnp.repeat(jnp.arange(depth, dtype=jnp.int32), m)
  rank = jnp.concatenate(ranks)
  parent_flat = (level_of - 1) * m + jnp.concatenate(parent_pos)
  parent_id = jnp.where(level_of == 0, 0, node_id[jnp.maximum(parent_flat, 0)])
  place = lambda values, fill: jnp.full(n_nodes, fill, values.dtype).at[node_id].set(values, mode="drop")
  tokens = place(top_tok[level_of, rank], 0).at[0].set(anchor)
  parents = place(parent_id.astype(jnp.int32), 0)
  depths = place(level_of + 1, 0)
  valid = place(selected, False).at[0].set(True)
  eye = jnp.eye(n_nodes, dtype=bool)
  anc = eye
  for _ in range(depth):
    anc = eye | (anc[parents] & valid[:, None])
  return tokens, parents, depths, valid, anc


def calibrated_scores(top_lp: jax.Array, counts, prior_strength: float) -> jax.Array:
  """The ``calibrated`` method's log-scores [B, D, W] (see the module docstring).

  top_lp [B, D, W] the draft's sorted top-W log-probs; counts None (scores = top_lp) or (hits, mass),
  each broadcastable to [B, D, W] (profile plus online counts)."""
  if counts is None:
    return top_lp
  hits, mass = counts
  s = jnp.float32(prior_strength)
  ratio = (jnp.asarray(hits, jnp.float32) + s) / (jnp.asarray(mass, jnp.float32) + s)
  a = jnp.minimum(jnp.exp(top_lp) * ratio, 1.0)
  return jnp.log(jnp.maximum(jax.lax.cummin(a, axis=a.ndim - 1), jnp.float32(ACCEPTANCE_FLOOR)))


def _static_tree(anchor: jax.Array, top_tok: jax.Array, acceptance: np.ndarray, budget: int) -> tuple[jax.Array, ...]:
  """The ``static`` tree: the shape is a constant; tokens gathered from top_tok [B, D, W]."""
  shape = optimal_static_tree(acceptance, budget)
  batch, n = anchor.shape[0], budget
  pad = n - len(shape.parents)                     # the full W-ary tree of depth D has fewer nodes
  parents = np.pad(np.asarray(shape.parents, np.int32), (0, pad))
  depths = np.pad(np.asarray(shape.depths, np.int32), (0, pad))
  ranks = np.pad(np.asarray(shape.ranks, np.int32), (0, pad))
  valid = np.arange(n) < len(shape.parents)
  anc = np.eye(n, dtype=bool)
  anc[:len(shape.parents), :len(shape.parents)] = shape.ancestors()
  node_tok = top_tok[:, np.maximum(depths - 1, 0), ranks]                               # [B, N]
  tokens = jnp.where(jnp.asarray((depths > 0) & valid), node_tok, 0).at[:, 0].set(anchor)
  bcast = lambda x: jnp.broadcast_to(jnp.asarray(x), (batch,) + x.shape)
  return tokens, bcast(parents), bcast(depths), bcast(valid), bcast(anc)


def build_tree(anchor: jax.Array, depth_logits: jax.Array, *, method: str, budget: int,
               width: int, top2gap_beta: float = 2.0, top2gap_g0: float = 1.0,
               depth_tokens: jax.Array | None = None, acceptance: np.ndarray | None = None,
               cap_threshold: float = 0.02, counts=None, prior_strength: float = 16.0) -> Tree:
  """Builds a token tree per batch row (see the module docstring for the methods).

  anchor [B] int32 (the root token); depth_logits [B, D, V] float, where
  depth_logits[:, k] is the draft distribution for depth k+1. method, budget, width,
  top2gap_beta and top2gap_g0 are static; budget and width are ignored by ``chain``.
  depth_tokens [B, D, W'] int32 (optional, W' >= width, W' >= 1 for chain): tokens to put at
  child rank r of depth k+1 (``depth_tokens[:, k, r]``) in place of the rank-r token of
  depth_logits; the shape still comes from depth_logits.
  acceptance [D, W] (numpy, static; ``AcceptanceProfile.fitted``): the profile of rank_caps and
  static (which needs it); cap_threshold (rank_caps); counts (hits, mass) and prior_strength
  (calibrated): see the module docstring.
  Returns a Tree with N = tree_size(method, budget, D) nodes.
  """
  _check_method(method)
  if depth_logits.ndim != 3 or anchor.shape != depth_logits.shape[:1] or depth_logits.shape[1] < 1:
    raise JetSpecError(f"expected anchor [B] and depth_logits [B, D, V] with D >= 1; got "
                       f"{anchor.shape} and {depth_logits.shape}")
  if depth_tokens is not None and (depth_tokens.shape[:2] != depth_logits.shape[:2] or
                                   depth_tokens.shape[2] < (1 if method == "chain" else width)):
    raise JetSpecError(f"depth_tokens {depth_tokens.shape} does not fit depth_logits {depth_logits.shape} "
                       f"and width {width}")
  if method == "chain":
    return _chain(anchor, depth_logits, depth_tokens)
  tree_size(method, budget, depth_logits.shape[1])
  vocab = depth_logits.shape[2]
  if not 1 <= width <= vocab:
    raise JetSpecError(f"tree width must be between 1 and the vocabulary size {vocab}; got {width}")
  if acceptance is not None and np.shape(acceptance) != (depth_logits.shape[1], width):
    raise JetSpecError(f"acceptance {np.shape(acceptance)} does not match the tree's depth and width "
                       f"({depth_logits.shape[1]}, {width})")
  if method == "static" and acceptance is None:
    raise JetSpecError("tree method 'static' needs an acceptance profile (`jetspec-jax profile`, then --tree-profile)")
  # The top-W of the logits and one log-sum-exp per row, never the [B, D, V] log-probs: ranks and gaps are
  # those of the logits, and a log-prob is its logit minus the row's log-sum-exp, which is shifted by the
  # top-1 logit (the row's max: no max pass over the vocabulary, so two reads of the logits in all).
  logits = depth_logits.astype(jnp.float32)
  top_logit, top_tok = top_w(logits, width)                              # [B, D, W]
  peak = jnp.max(top_logit, axis=-1, keepdims=True)      # top-1 (a max over W, not a slice: see _fanout_caps)
  lse = peak + jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1, keepdims=True))   # [B, D, 1]
  top_lp = top_logit - lse
  cand_lp = top_lp
  if depth_tokens is not None:
    top_tok = depth_tokens[:, :, :width]
    cand_lp = jnp.take_along_axis(logits, top_tok.astype(jnp.int32), axis=-1) - lse
  anchor, top_tok = anchor.astype(jnp.int32), top_tok.astype(jnp.int32)
  if method == "static":
    tokens, parents, depths, valid, ancestors = _static_tree(anchor, top_tok, acceptance, budget)
  elif method in ("best_nodes", "calibrated"):
    scores = top_lp if method == "best_nodes" else calibrated_scores(top_lp, counts, prior_strength)
    tokens, parents, depths, valid, ancestors = jax.vmap(
        lambda a, t, lp: _best_nodes_tree(a, t, lp, budget))(anchor, top_tok, scores)
  else:
    if method == "rank_caps":
      per_depth = width if acceptance is None else np.maximum(1, np.sum(acceptance >= cap_threshold, axis=1))
      caps = jnp.broadcast_to(jnp.asarray(per_depth, jnp.int32), logits.shape[:2])
    else:
      caps = _fanout_caps(logits, method, width, top2gap_beta, top2gap_g0)  # [B, D]
    tokens, parents, depths, valid, ancestors = jax.vmap(
        lambda a, t, lp, c: _heap_tree(a, t, lp, c, budget))(anchor, top_tok, top_lp, caps)
  return Tree(tokens=tokens, parents=parents, depths=depths, valid=valid, ancestors=ancestors, candidates=top_tok,
              candidate_logp=cand_lp)

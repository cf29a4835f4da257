"""The batch-wide node budget: which of the decode rows the slots offer one round verifies (prompt
rows go through the engine's prefill lanes, outside the budget).

Priorities (higher first; ``pack`` keeps each group's K best): a decoding slot's root (``ROOT``, so
every decoding slot commits at least one token per round), then tree nodes by cumulative log-score
along their root path (<= 0). A node's log-score is the draft's log-probability of its rank at its depth, calibrated by
the acceptance profile where there is one (``tree.calibrated_scores``: the measured over the
predicted acceptance of (depth, rank)), made non-increasing in rank. Path scores then never exceed a
parent's or a lower-ranked sibling's, and ties go to the lower index (parents and lower ranks come
first), so the kept nodes of every slot form a tree closed under parents and lower-ranked siblings:
the shape the acceptance rules need (``decode.verify``), hence lossless.

How many rows a round packs (K) is the engine plan's; ``decode.planner`` chooses it per device from
a measured cost curve.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.decode.tree import Tree, calibrated_scores

ROOT = 2.0e7       # priority of a decoding slot's root


def rank_scores(shape_logp: jax.Array, tree_cfg, counts) -> jax.Array:
  """Log-score [B, D, W] of the rank-r child at depth d from the draft's sorted top-W log-probs
  ``shape_logp`` [B, D, W] (what the tree's shape was built from, never the sampled tokens' own),
  calibrated by the profile (and, for the calibrated method online, this generation's counts ``counts``),
  cummin over ranks."""
  from jetspec_jax.decode.speculative import calibration_counts
  if tree_cfg.method == "calibrated":
    table = calibration_counts(tree_cfg, counts)
  elif tree_cfg.profile is not None:
    table = tree_cfg.profile.counts(tree_cfg.depth, tree_cfg.num_candidates)
  else:
    table = None
  scores = calibrated_scores(shape_logp, table, tree_cfg.prior_strength)
  return jax.lax.cummin(scores, axis=scores.ndim - 1)


def node_scores(tree: Tree, table: jax.Array) -> jax.Array:
  """Cumulative log-score [B, N] of each node (root 0): the sum of table[depth - 1, sibling rank] over
  its path. A node's sibling rank is the number of valid siblings before it (siblings are in rank order)."""
  n = tree.tokens.shape[1]
  idx = jnp.arange(n)
  earlier = (idx[None, :] < idx[:, None]) & (idx[None, :] > 0)                         # [N, N]: j < i, j not root
  sibling = (tree.parents[:, :, None] == tree.parents[:, None, :]) & earlier[None] & tree.valid[:, None, :]
  rank = jnp.minimum(jnp.sum(sibling, axis=-1), table.shape[2] - 1)                   # [B, N]
  depth = jnp.maximum(tree.depths - 1, 0)
  own = jax.vmap(lambda t, dd, r: t[dd, r])(table, depth, rank)                        # [B, N]
  own = jnp.where((tree.depths > 0) & tree.valid, own, 0.0)
  return jnp.sum(jnp.where(tree.ancestors, own[:, None, :], 0.0), axis=-1)


def pack(priority: jax.Array, rows: int, slots_per_group: int, nodes: int):
  """Each group's ``rows`` best offered rows. priority [G, S * W] (slot-major; -inf: not offered).
  Returns [G, K] arrays: slot (``slots_per_group`` for padding), node, live, and the flat slot-major index."""
  best, index = jax.lax.top_k(priority, rows)
  live = best > -jnp.inf
  return (jnp.where(live, index // nodes, slots_per_group).astype(jnp.int32), (index % nodes).astype(jnp.int32), live,
          index)

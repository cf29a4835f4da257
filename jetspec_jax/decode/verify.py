"""Tree verification: one target forward over all tree nodes, greedy acceptance, KV compaction.

Node i sits at RoPE position prefix_len + depth[i], its K/V at cache row prefix_len + i (scratch),
and attends to the committed prefix plus its ancestors (itself included).
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.decode.tree import Tree
from jetspec_jax.models import qwen3
from jetspec_jax.models.layers import write_rows


def verify_tree(params, cfg, tree: Tree, cache: qwen3.KVCache, prefix_len: jax.Array, *,
                tap_layers: tuple[int, ...], attn_impl: str = "xla", mesh=None):
  """Target logits [B, N, V] float32, cache with node K/V at prefix_len + i, taps [B, N, F]."""
  positions = prefix_len[:, None] + tree.depths
  return qwen3.forward(params, cfg, tree.tokens, positions, cache, prefix_len, tree.ancestors,
                       tap_layers=tap_layers, attn_impl=attn_impl, mesh=mesh)


@flax.struct.dataclass
class Acceptance:
  """Outcome of one round per sequence.

  path [B, D+1]: node index at each depth of the accepted path (entries past ``depth`` repeat the
  deepest node); depth [B]: matched draft tokens; correction [B]: the target's token after the path.
  """
  path: jax.Array
  depth: jax.Array
  correction: jax.Array


def greedy_accept(tree: Tree, target_next: jax.Array, max_depth: int) -> Acceptance:
  """Deepest node whose whole root path equals the target's own choices.

  target_next [B, N]: the target's token after each node (argmax of its logits). Node i matches
  when token[i] == target_next[parent[i]]; the root always matches."""
  parent_next = jnp.take_along_axis(target_next, tree.parents, axis=1)
  match = tree.valid & (tree.tokens == parent_next)
  match = match.at[:, 0].set(True)
  path_ok = ~jnp.any(tree.ancestors & ~match[:, None, :], axis=-1) & tree.valid     # [B, N]
  best = jnp.argmax(jnp.where(path_ok, tree.depths, -1), axis=1)                      # lowest index on ties
  best_anc = jnp.take_along_axis(tree.ancestors, best[:, None, None], axis=1)[:, 0]   # [B, N]
  depth = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0]
  d = jnp.arange(max_depth + 1)[None, :, None]
  on_path = best_anc[:, None, :] & (tree.depths[:, None, :] == d)                     # [B, D+1, N]
  path = jnp.where(jnp.any(on_path, axis=-1), jnp.argmax(on_path, axis=-1), best[:, None])
  correction = jnp.take_along_axis(target_next, best[:, None], axis=1)[:, 0]
  return Acceptance(path=path.astype(jnp.int32), depth=depth, correction=correction)


def accepted_tokens(tree: Tree, acc: Acceptance) -> tuple[jax.Array, jax.Array]:
  """Tokens committed this round [B, D+1] (path depths 1..depth, then the correction) and their count."""
  path_tokens = jnp.take_along_axis(tree.tokens, acc.path, axis=1)                   # [B, D+1]
  shifted = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
  j = jnp.arange(shifted.shape[1])[None, :]
  new = jnp.where(j < acc.depth[:, None], shifted, acc.correction[:, None])
  return new.astype(jnp.int32), acc.depth + 1


def gather_rows(cache_layer: jax.Array, rows: jax.Array) -> jax.Array:
  """cache [B, Hkv, S, Dh], rows [B, R] -> [B, Hkv, R, Dh]."""
  return jnp.take_along_axis(cache_layer, rows[:, None, :, None], axis=2)


def compact_cache(cache: qwen3.KVCache, prefix_len: jax.Array, path: jax.Array) -> qwen3.KVCache:
  """Move the accepted nodes' K/V (rows prefix_len + path[d]) to contiguous rows prefix_len + d."""
  rows = prefix_len[:, None] + path
  move = lambda c: write_rows(c, gather_rows(c, rows), prefix_len)
  return qwen3.KVCache(k=tuple(move(c) for c in cache.k), v=tuple(move(c) for c in cache.v))

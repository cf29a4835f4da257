"""Tree verification: one target forward over all tree nodes, acceptance, KV compaction.

Node i sits at RoPE position prefix_len + depth[i], its K/V at cache row prefix_len + i (scratch),
and attends to the committed prefix plus its ancestors (itself included).

Acceptance: greedy (``greedy_accept``: the deepest path matching the target's argmax, plus the argmax
at its end) and, at temperature > 0, ``sample_accept`` with the ``match`` or ``rejection`` rule (a
while_loop that walks down one depth per step, vmapped over the batch, float32). The rules and the
proof that both are lossless are in docs/verification.md.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax import pages
from jetspec_jax.decode import sampling
from jetspec_jax.decode.tree import Tree
from jetspec_jax.models import qwen3


def verify_tree(params, cfg, tree: Tree, cache: qwen3.KVCache, prefix_len: jax.Array, *,
                tap_layers: tuple[int, ...], attn_impl: str = "xla", mesh=None):
  """Target logits [B, N, V] float32, cache with node K/V at prefix_len + i, taps [B, N, F]."""
  positions = prefix_len[:, None] + tree.depths
  target = qwen3.bind(cfg, params)
  h, cache, taps = target.hidden(tree.tokens, positions, tree.ancestors, cache=cache, prefix_len=prefix_len,
                                 tap_layers=tap_layers, attn_impl=attn_impl, mesh=mesh)
  return target.logits(h), cache, taps


@flax.struct.dataclass
class Acceptance:
  """Outcome of one round per sequence.

  path [B, D+1]: node index at each depth of the accepted path (entries past ``accepted`` repeat the
  deepest node); accepted [B]: matched draft tokens; correction [B]: the target's token after the path.
  """
  path: jax.Array
  accepted: jax.Array
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
  return Acceptance(path=path.astype(jnp.int32), accepted=depth, correction=correction)


def _walk_one(tokens, parents, valid, logits, draft_logp, key, temperature, top_k, top_p, *, rule, max_depth, width):
  """The acceptance walk of one sequence (see the module docstring); vmapped over the batch.

  tokens / parents / valid [N]; logits [N, V] raw target logits; draft_logp [D, V] processed draft
  log-probs (rejection only); key: the round key; the sequence's sampling parameters (fixed numbers
  or traced scalars). Returns (path [D+1], depth [], correction []).

  Both loops are while_loops that stop at the first rejection (depth) or acceptance (siblings), so
  at batch 1 a round costs about tau steps instead of D + 1. Randomness: the step at depth d uses
  dkey = fold_in(fold_in(key, ACCEPT_TAG), d): the target draw (match) or the correction (rejection,
  drawn once after the walk from the final residual) with fold_in(dkey, 0), the uniform of sibling
  j with fold_in(dkey, 1 + j)."""
  n = tokens.shape[0]
  vocab = logits.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  num_draft_depths = draft_logp.shape[0]
  key = jax.random.fold_in(key, sampling.ACCEPT_TAG)

  def step(carry):
    d, node, _, path, _, corr = carry
    dkey = jax.random.fold_in(key, d)
    p = jnp.exp(sampling.process_logits(logits[node], temperature, top_k, top_p))     # [V]
    kids_mask = valid & (parents == node) & (idx > 0)
    if rule == "match":
      t = jax.random.categorical(jax.random.fold_in(dkey, 0), jnp.log(p)).astype(jnp.int32)
      hit = kids_mask & (tokens == t)
      accepted, child, corr = jnp.any(hit), jnp.argmax(hit).astype(jnp.int32), t
    else:
      kids = jnp.nonzero(kids_mask, size=width, fill_value=0)[0].astype(jnp.int32)  # rank (= index) order
      k = jnp.sum(kids_mask.astype(jnp.int32))
      q = jnp.exp(draft_logp[jnp.minimum(d, num_draft_depths - 1)])

      def sibling(c):
        j, p, q, _, _ = c
        cj = kids[j]
        tok = tokens[cj]
        q_tok, p_tok = q[tok], p[tok]
        live = q_tok > 0                                        # past q's support: not a candidate
        u = jax.random.uniform(jax.random.fold_in(dkey, 1 + j), (), jnp.float32)
        ok = live & (u * q_tok < p_tok)                         # probability min(1, p / q)
        reject = live & ~ok
        res = jnp.maximum(p - q, 0.0)
        res_sum = jnp.sum(res)
        res = jnp.where(res_sum > 0, res / jnp.where(res_sum > 0, res_sum, 1.0), p)
        q_next = q.at[tok].set(0.0)
        q_sum = jnp.sum(q_next)
        q_next = q_next / jnp.where(q_sum > 0, q_sum, 1.0)
        return j + 1, jnp.where(reject, res, p), jnp.where(reject, q_next, q), ok, cj

      _, p, _, accepted, child = jax.lax.while_loop(
          lambda c: (c[0] < k) & ~c[3], sibling, (jnp.int32(0), p, q, jnp.bool_(False), jnp.int32(0)))
    node = jnp.where(accepted, child, node)
    path = path.at[d + 1].set(node, mode="drop")
    return d + 1, node, ~accepted, path, p, corr

  init = (jnp.int32(0), jnp.int32(0), jnp.bool_(False), jnp.zeros((max_depth + 1,), jnp.int32),
          jnp.zeros((vocab,), jnp.float32), jnp.int32(0))
  d, node, _, path, p, corr = jax.lax.while_loop(lambda c: (c[0] <= max_depth) & ~c[2], step, init)
  depth = d - 1                                   # the walk stops at the step after the last acceptance
  if rule == "rejection":
    corr = jax.random.categorical(jax.random.fold_in(jax.random.fold_in(key, depth), 0), jnp.log(p))
  path = jnp.where(jnp.arange(max_depth + 1) <= depth, path, node)
  return path, depth, corr.astype(jnp.int32)


def sample_accept(tree: Tree, target_logits: jax.Array, draft_logp: jax.Array | None, round_keys: jax.Array, *,
                  rule: str, max_depth: int, width: int, temperature, top_k=0, top_p=1.0) -> Acceptance:
  """Acceptance at temperature > 0 by ``rule`` ("match" | "rejection"; see the module docstring).

  target_logits [B, N, V] raw target logits at every node; draft_logp [B, D, V] the processed
  draft log-probs (``sampling.process_logits`` of the draft logits; unused by "match");
  round_keys [B] per-sequence keys of this round; max_depth D = the tree depth; width: the most
  children a node can have (the tree width W; 1 for a chain). Sampling parameters: fixed numbers (> 0
  temperature) or per-sequence arrays [B] (a temperature-0 sequence's target distribution is all on
  its argmax; ``decode.engine`` takes ``greedy_accept`` for those)."""
  if rule not in sampling.ACCEPT_RULES:
    raise ValueError(f"unknown acceptance rule {rule!r}")
  if draft_logp is None:
    draft_logp = jnp.zeros(target_logits.shape[:1] + (1, target_logits.shape[2]), jnp.float32)
  walk = functools.partial(_walk_one, rule=rule, max_depth=max_depth, width=width)
  params = (temperature, top_k, top_p)
  fixed = sampling.is_fixed(*params)
  path, depth, corr = jax.vmap(walk, in_axes=(0,) * 6 + ((None,) * 3 if fixed else (0,) * 3))(
      tree.tokens, tree.parents, tree.valid, target_logits, draft_logp, round_keys, *params)
  return Acceptance(path=path, accepted=depth, correction=corr)


def accepted_tokens(tree: Tree, acc: Acceptance) -> tuple[jax.Array, jax.Array]:
  """Tokens committed this round [B, D+1] (path depths 1..depth, then the correction) and their count."""
  path_tokens = jnp.take_along_axis(tree.tokens, acc.path, axis=1)                   # [B, D+1]
  shifted = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, :1]], axis=1)
  j = jnp.arange(shifted.shape[1])[None, :]
  new = jnp.where(j < acc.accepted[:, None], shifted, acc.correction[:, None])
  return new.astype(jnp.int32), acc.accepted + 1


def compact_cache(cache: qwen3.KVCache, prefix_len: jax.Array, path: jax.Array, table: jax.Array,
                  window: int) -> qwen3.KVCache:
  """Move the accepted nodes' K/V (rows prefix_len + path[d], path [B, D+1] < ``window``, static) to contiguous rows
  prefix_len + d of the caches' page pools (page ``table`` [B, T], ``jetspec_jax.pages``). The window's pages are
  read whole and only the pages of the path's new rows are written."""
  def move(c):
    near = pages.read(c, table, prefix_len, window)                            # [B, Hkv, window, Dh]
    return pages.write(c, jax.vmap(lambda x, p: x[:, p])(near, path), table, prefix_len)
  return qwen3.KVCache(k=tuple(move(c) for c in cache.k), v=tuple(move(c) for c in cache.v))


def commit_tokens(tokens, num_tokens, done, new, count, eos_ids: tuple[int, ...], max_new=None):
  """Append new[b, :count[b]] to each unfinished sequence, cut after the first EOS and at max_new.

  tokens [B, M], num_tokens [B], done [B], new [B, K], count [B]; max_new [B] (<= M) or None (M).
  Returns (tokens, num_tokens, done, appended [B]); never writes past max_new or an EOS.
  """
  max_new = tokens.shape[1] if max_new is None else max_new
  j = jnp.arange(new.shape[1])[None, :]
  limit = jnp.minimum(count, max_new - num_tokens)
  limit = jnp.where(done, 0, limit)
  is_eos = jnp.isin(new, jnp.asarray(eos_ids, jnp.int32)) if eos_ids else jnp.zeros(new.shape, bool)
  eos_hit = is_eos & (j < limit[:, None])
  first_eos = jnp.argmax(eos_hit, axis=1)
  any_eos = jnp.any(eos_hit, axis=1)
  limit = jnp.where(any_eos, first_eos + 1, limit)
  pos = jnp.where(j < limit[:, None], num_tokens[:, None] + j, tokens.shape[1])
  tokens = jax.vmap(lambda t, p, v: t.at[p].set(v, mode="drop"))(tokens, pos, new)
  num_tokens = num_tokens + limit
  done = done | any_eos | (num_tokens >= max_new)
  return tokens, num_tokens, done, limit

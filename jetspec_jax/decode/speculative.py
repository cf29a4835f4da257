"""The JetSpec speculative generation programs: the head's context prefill, then one ``lax.while_loop``
whose body is draft -> build tree -> verify -> accept -> commit, with no host round-trip per round
(``decode.generation.Generator`` runs them after ``decode.loop.prefill``).

Invariants at the top of every round (per sequence b):
  target cache rows 0..prefix_len[b]-1 hold the committed tokens except ``last_token``;
  draft context cache rows 0..prefix_len[b]-1 hold those same positions' fused target features;
  ``last_token`` (the newest committed token) is the anchor of the next block.
Greedy output is identical to plain autoregressive decoding (tested in float32).

At temperature > 0 the round samples instead (``decode.sampling`` processing applied identically
to the target and the draft): ``accept="match"`` verifies the deterministic top-W tree by one
target draw per node, ``accept="rejection"`` fills the same-shaped tree with Gumbel-top-k draws
of the draft and verifies it by recursive rejection sampling; both are lossless (the argument is
in ``decode.verify``). Round r of sequence b draws from ``round_keys(state)`` =
fold_in(key[b], steps + 1), so a drafter can reproduce the tree's Gumbel noise with
``sampling.draft_gumbel(round_keys(state), D, V)``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import sampling, verify
from jetspec_jax.decode.loop import DecodeState, commit_tokens
from jetspec_jax.decode.tree import TREE_METHODS, build_tree, tree_size
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.draft_head import DraftConfig


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Static tree shape: method (one of ``tree.TREE_METHODS``: accum_logp | top2gap | best_nodes | chain),
  node budget (counts the root; a chain has depth + 1 nodes whatever the budget), width W (top-W tokens per
  depth) and depth D (<= block_size - 1)."""
  method: str = "accum_logp"
  budget: int = 16
  width: int = 7
  depth: int = 15

  def num_nodes(self) -> int:
    return tree_size(self.method, self.budget, self.depth)

  def validate(self, head: DraftConfig) -> None:
    if self.method not in TREE_METHODS:
      raise JetSpecError(f"unknown tree method {self.method!r}; choose one of {', '.join(TREE_METHODS)}")
    if not 1 <= self.depth <= head.depth:
      raise JetSpecError(f"tree depth {self.depth} must be between 1 and the head's block_size - 1 = {head.depth}")
    if self.budget < 1 or self.width < 1:
      raise JetSpecError(f"tree budget ({self.budget}) and width ({self.width}) must be at least 1")
    if self.width > head.vocab_size:
      raise JetSpecError(f"tree width {self.width} exceeds the vocabulary size {head.vocab_size}")


@flax.struct.dataclass
class SpecState:
  """DecodeState plus the draft head's context cache and acceptance metrics."""
  base: DecodeState
  draft_cache: qwen3.KVCache
  rounds: jax.Array         # [B] int32 rounds each sequence took part in
  depth_hist: jax.Array     # [B, D+1] int32 rounds that accepted exactly d draft tokens


# A drafter maps (target params, head params, state) -> (per-depth logits [B, D, V], draft cache).
Drafter = Callable[..., tuple[jax.Array, qwen3.KVCache]]


def round_keys(state: SpecState) -> jax.Array:
  """Per-sequence keys [B] of the round about to run on ``state`` (the tree's Gumbel noise is
  ``sampling.draft_gumbel(round_keys(state), D, V)``)."""
  return sampling.step_keys(state.base.key, state.base.steps + 1)


def head_drafter(target_params, head_params, state: SpecState, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
  """The JetSpec head: per-depth logits of the block [last_token, mask...] after the context."""
  head = draft_head.bind(head_cfg, head_params)
  return head.draft_logits(qwen3.bind(cfg, target_params), state.draft_cache, state.base.prefix_len,
                           state.base.last_token, tree_cfg.depth, attn_impl, mesh)


@functools.partial(jax.jit, static_argnames=("head_cfg",), donate_argnames=("draft_cache",))
def prefill_context(head_params, draft_cache, taps, *, head_cfg):
  """Fuse the prompt's tapped features into the head's context cache (rows 0..T-1)."""
  start = jnp.zeros((taps.shape[0],), jnp.int32)
  return draft_head.bind(head_cfg, head_params).append_context(draft_cache, taps, start)


def build_round_tree(anchor, depth_logits, keys, tree_cfg: TreeConfig, *, temperature: float, top_k: int,
                     top_p: float, accept: str):
  """The round's tree and the processed draft log-probs (None when greedy).

  Greedy: today's tree from the raw draft logits. match: the deterministic tree (top-W tokens) of
  the processed draft distribution. rejection: the same shape, child rank r at depth d holding the
  r-th Gumbel-top-k draw of the processed depth-d distribution (noise from ``keys``)."""
  kw = dict(method=tree_cfg.method, budget=tree_cfg.budget, width=tree_cfg.width)
  if temperature == 0.0:
    return build_tree(anchor, depth_logits, **kw), None
  logp = sampling.process_logits(depth_logits, temperature, top_k, top_p)          # [B, D, V]
  if accept == "match":
    return build_tree(anchor, logp, **kw), logp
  k = 1 if tree_cfg.method == "chain" else tree_cfg.width
  noise = sampling.draft_gumbel(keys, logp.shape[1], logp.shape[2])
  return build_tree(anchor, logp, depth_tokens=sampling.gumbel_top_k(logp, noise, k), **kw), logp


@functools.partial(jax.jit, static_argnames=("cfg", "head_cfg", "tree_cfg", "eos_ids", "attn_impl", "mesh",
                                             "drafter", "temperature", "top_k", "top_p", "accept"),
                   donate_argnames=("state",))
def spec_decode(target_params, head_params, state: SpecState, *, cfg: Qwen3Config, head_cfg: DraftConfig,
                tree_cfg: TreeConfig, eos_ids: tuple[int, ...], attn_impl: str = "xla", mesh=None,
                drafter: Drafter = head_drafter, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                accept: str = "rejection") -> SpecState:
  """Speculative rounds until every sequence is done (greedy at temperature 0, else sampled with
  the ``accept`` rule: "match" | "rejection")."""
  depth = tree_cfg.depth
  width = 1 if tree_cfg.method == "chain" else tree_cfg.width
  head = draft_head.bind(head_cfg, head_params)

  def body(s: SpecState) -> SpecState:
    b = s.base
    active = ~b.done
    # Named scopes (jetspec_<phase>) label each phase's kernels in a profile (bench/gpu_check.py).
    with jax.named_scope("jetspec_draft"):
      depth_logits, draft_cache = drafter(target_params, head_params, s, cfg=cfg, head_cfg=head_cfg,
                                          tree_cfg=tree_cfg, attn_impl=attn_impl, mesh=mesh)
    keys = round_keys(s)
    with jax.named_scope("jetspec_tree"):
      tree, draft_logp = build_round_tree(b.last_token, depth_logits, keys, tree_cfg, temperature=temperature,
                                          top_k=top_k, top_p=top_p, accept=accept)
    with jax.named_scope("jetspec_verify"):
      logits, cache, taps = verify.verify_tree(target_params, cfg, tree, b.cache, b.prefix_len,
                                               tap_layers=head_cfg.target_layer_ids, attn_impl=attn_impl, mesh=mesh)
    with jax.named_scope("jetspec_accept"):
      if temperature == 0.0:
        target_next = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        acc = verify.greedy_accept(tree, target_next, depth)
      else:
        acc = verify.sample_accept(tree, logits, draft_logp if accept == "rejection" else None, keys, rule=accept,
                                   max_depth=depth, width=width, temperature=temperature, top_k=top_k, top_p=top_p)
    with jax.named_scope("jetspec_commit"):
      cache = verify.compact_cache(cache, b.prefix_len, acc.path)
      path_taps = jnp.take_along_axis(taps, acc.path[:, :, None], axis=1)              # [B, D+1, F]
      draft_cache = head.append_context(draft_cache, path_taps, b.prefix_len)
      new, count = verify.accepted_tokens(tree, acc)
      tokens, num, done, _ = commit_tokens(b.tokens, b.num_tokens, b.done, new, count, eos_ids)
    base = DecodeState(cache=cache, tokens=tokens, num_tokens=num,
                       last_token=jnp.where(active, acc.correction, b.last_token),
                       prefix_len=b.prefix_len + jnp.where(active, count, 0), done=done, key=b.key,
                       steps=b.steps + 1)
    hist = s.depth_hist + (jax.nn.one_hot(acc.depth, depth + 1, dtype=jnp.int32) * active[:, None])
    return SpecState(base=base, draft_cache=draft_cache, rounds=s.rounds + active.astype(jnp.int32),
                     depth_hist=hist)

  return jax.lax.while_loop(lambda s: ~jnp.all(s.base.done), body, state)


def cache_lengths(prompt_len: int, max_new_tokens: int, head_cfg: DraftConfig, tree_cfg: TreeConfig):
  """(target, draft) cache sizes: committed rows plus the round's scratch rows."""
  committed = prompt_len + max_new_tokens
  return committed + tree_cfg.num_nodes() + 1, committed + max(head_cfg.block_size, tree_cfg.depth + 1) + 1

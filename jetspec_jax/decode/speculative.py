"""The JetSpec speculative generation programs: the head's context prefill, then one ``lax.while_loop``
whose body is draft -> build tree -> verify -> accept -> commit, with no host round-trip per round
(``decode.generation.Generator`` runs them after ``decode.loop.prefill``).

Invariants at the top of every round (per sequence b):
  target cache rows 0..prefix_len[b]-1 hold the committed tokens except ``last_token``, so
  prefix_len[b] = prompt length + num_tokens[b] - 1 <= prompt length + max_new_tokens - 1;
  draft context cache rows 0..prefix_len[b]-1 hold those same positions' fused target features;
  ``last_token`` (the newest committed token) is the anchor of the next block;
  a finished row (EOS or max_new_tokens) still runs each round (static shapes) but commits nothing: its
  prefix_len and committed rows stay as they are, and its round writes only rows prefix_len[b] onwards,
  which ``cache_lengths`` keeps inside the caches.
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

from jetspec_jax.attention import cache_rows
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import sampling, verify
from jetspec_jax.decode.loop import DecodeState
from jetspec_jax.decode.verify import commit_tokens
from jetspec_jax.decode.profile import AcceptanceProfile
from jetspec_jax.decode.tree import TREE_METHODS, build_tree, tree_size
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.draft_head import DraftConfig
from jetspec_jax.sharding import whole_vocab


ONLINE_MODES = ("off", "batch", "sequence")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Static tree shape: method (one of ``tree.TREE_METHODS``), node budget (counts the root; a chain has
  depth + 1 nodes whatever the budget), width W (top-W tokens per depth) and depth D (<= block_size - 1).

  For the methods of ``tree.PROFILE_METHODS``: ``profile`` (an ``AcceptanceProfile``; ``static`` needs
  one), ``cap_threshold`` (rank_caps), and for ``calibrated`` ``prior_strength`` (pseudo-rounds that
  pull the calibration towards the draft) and ``online``: "off" (the profile's counts alone), "batch"
  (plus the counts of every request decoding now: the batch of a static loop, the requests holding the engine's
  slots) or "sequence" (plus each request's own): counts of their rounds so far, kept on device in the loop
  state."""
  method: str = "accum_logp"
  budget: int = 16
  width: int = 7
  depth: int = 15
  profile: AcceptanceProfile | None = None
  cap_threshold: float = 0.02
  prior_strength: float = 16.0
  online: str = "off"

  def num_nodes(self) -> int:
    return tree_size(self.method, self.budget, self.depth)

  @property
  def num_candidates(self) -> int:
    """Candidates per depth W of the round's tree (1 for a chain)."""
    return 1 if self.method == "chain" else self.width

  def acceptance(self):
    """The profile fitted to this tree ([D, W] numpy, non-increasing in rank), or None."""
    return None if self.profile is None else self.profile.fitted(self.depth, self.width)

  def describe(self) -> dict:
    """JSON-ready fields (the profile as its depth and width)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "profile"}
    if self.profile is not None:
      out["profile"] = {"depth": self.profile.depth, "width": self.profile.width,
                        "rounds": self.profile.visits[0] if self.profile.visits else 0}
    return out | {"num_nodes": self.num_nodes()}

  def validate(self, head: DraftConfig) -> None:
    if self.method not in TREE_METHODS:
      raise JetSpecError(f"unknown tree method {self.method!r}; choose one of {', '.join(TREE_METHODS)}")
    if not 1 <= self.depth <= head.depth:
      raise JetSpecError(f"tree depth {self.depth} must be between 1 and the head's block_size - 1 = {head.depth}")
    if self.budget < 1 or self.width < 1:
      raise JetSpecError(f"tree budget ({self.budget}) and width ({self.width}) must be at least 1")
    if self.width > head.vocab_size:
      raise JetSpecError(f"tree width {self.width} exceeds the vocabulary size {head.vocab_size}")
    if self.online not in ONLINE_MODES:
      raise JetSpecError(f"online calibration {self.online!r} is not one of {', '.join(ONLINE_MODES)}")
    if self.online != "off" and self.method != "calibrated":
      raise JetSpecError(f"online calibration needs tree method 'calibrated', not {self.method!r}")
    if self.method == "static" and self.profile is None:
      raise JetSpecError("tree method 'static' needs an acceptance profile (make one with `jetspec-jax profile`, "
                         "then pass --tree-profile)")
    if not self.prior_strength > 0:
      raise JetSpecError(f"prior strength must be > 0; got {self.prior_strength}")
    if self.profile is not None and self.method != "chain":
      self.acceptance()                                  # raises when the profile is too shallow or narrow


@flax.struct.dataclass
class SpecState:
  """DecodeState plus the draft head's context cache and acceptance metrics (per sequence b; W =
  ``TreeConfig.num_candidates``; the counts are those of ``decode.profile``)."""
  base: DecodeState
  draft_cache: qwen3.KVCache
  rounds: jax.Array         # [B] int32 rounds each sequence took part in
  depth_hist: jax.Array     # [B, D+1] int32 rounds that accepted exactly d draft tokens
  depth_visits: jax.Array   # [B, D] int32 rounds whose accepted path reached depth d-1 (depth d observed)
  rank_hits: jax.Array      # [B, D, W] int32 of those, rounds whose target token at depth d was rank r
  rank_mass: jax.Array      # [B, D, W] float32 of those, the sum of the draft's probability of rank r


def init_state(base: DecodeState, draft_cache: qwen3.KVCache, tree_cfg: TreeConfig) -> SpecState:
  """The loop state after the prefill: zero rounds and counts."""
  batch, d = base.last_token.shape[0], tree_cfg.depth
  return SpecState(base=base, draft_cache=draft_cache, rounds=jnp.zeros((batch,), jnp.int32),
                   depth_hist=jnp.zeros((batch, d + 1), jnp.int32), depth_visits=jnp.zeros((batch, d), jnp.int32),
                   rank_hits=jnp.zeros((batch, d, tree_cfg.num_candidates), jnp.int32),
                   rank_mass=jnp.zeros((batch, d, tree_cfg.num_candidates), jnp.float32))


def observe_ranks(tree, acc, new: jax.Array, active: jax.Array):
  """This round's profile counts (visits [B, D], hits [B, D, W] int32, mass [B, D, W] float32) from the
  tree's candidates, the acceptance and the committed tokens new [B, D+1] (new[:, d-1] is the target's
  token at depth d for d <= depth + 1: a path token, then the correction)."""
  depth = tree.candidates.shape[1]
  observed = active[:, None] & (jnp.arange(1, depth + 1)[None, :] <= acc.depth[:, None] + 1)        # [B, D]
  hits = observed[..., None] & (tree.candidates == new[:, :depth, None])
  mass = jnp.where(observed[..., None], jnp.exp(tree.candidate_logp), 0.0)
  return observed.astype(jnp.int32), hits.astype(jnp.int32), mass


@flax.struct.dataclass
class DraftView:
  """What a drafter sees of a round, per sequence b: the target's cache (rows < prefix_len[b] committed), the
  head's context cache, the anchor ``last_token`` [B] (committed, not yet cached) and the round's keys [B] (the
  tree's Gumbel noise is ``sampling.draft_gumbel(keys, D, V)``)."""
  cache: qwen3.KVCache
  draft_cache: qwen3.KVCache
  last_token: jax.Array
  prefix_len: jax.Array
  keys: jax.Array


# A drafter maps (target params, head params, DraftView) -> (per-depth logits [B, D, V], draft cache); keyword
# arguments cfg, head_cfg, tree_cfg, attn_impl, mesh. Hashable: it is a static argument of the compiled loops.
Drafter = Callable[..., tuple[jax.Array, qwen3.KVCache]]


def round_keys(state: SpecState) -> jax.Array:
  """Per-sequence keys [B] of the round about to run on ``state``."""
  return sampling.step_keys(state.base.key, state.base.steps + 1)


def draft_view(state: SpecState) -> DraftView:
  return DraftView(cache=state.base.cache, draft_cache=state.draft_cache, last_token=state.base.last_token,
                   prefix_len=state.base.prefix_len, keys=round_keys(state))


def head_drafter(target_params, head_params, view: DraftView, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
  """The JetSpec head: per-depth logits of the block [last_token, mask...] after the context."""
  head = draft_head.bind(head_cfg, head_params)
  return head.draft_logits(qwen3.bind(cfg, target_params), view.draft_cache, view.prefix_len, view.last_token,
                           tree_cfg.depth, attn_impl, mesh)


@functools.partial(jax.jit, static_argnames=("head_cfg",), donate_argnames=("draft_cache",))
def prefill_context(head_params, draft_cache, taps, *, head_cfg):
  """Fuse the prompt's tapped features into the head's context cache (rows 0..T-1)."""
  start = jnp.zeros((taps.shape[0],), jnp.int32)
  return draft_head.bind(head_cfg, head_params).append_context(draft_cache, taps, start)


def calibration_counts(tree_cfg: TreeConfig, counts):
  """(hits, mass) the calibrated tree ranks by: the profile's plus, online, the loop's ``counts`` (rank_hits,
  rank_mass [B, D, W]: summed over the batch, or per sequence); None when there are neither."""
  prior = None if tree_cfg.profile is None else tree_cfg.profile.counts(tree_cfg.depth, tree_cfg.width)
  if tree_cfg.online == "off":
    return prior
  hits, mass = counts
  if tree_cfg.online == "batch":
    hits, mass = jnp.sum(hits, axis=0, keepdims=True), jnp.sum(mass, axis=0, keepdims=True)
  if prior is not None:
    hits, mass = hits + prior[0], mass + prior[1]
  return hits, mass


def build_round_tree(anchor, depth_logits, keys, tree_cfg: TreeConfig, *, temperature, top_k, top_p, accept: str,
                     counts=None):
  """The round's tree and the processed draft log-probs (None when greedy).

  Greedy: today's tree from the raw draft logits. match: the deterministic tree (top-W tokens) of
  the processed draft distribution. rejection: the same shape, child rank r at depth d holding the
  r-th Gumbel-top-k draw of the processed depth-d distribution (noise from ``keys``). counts: the
  loop's (rank_hits, rank_mass) so far, read by online calibration. Sampling parameters fixed, or per
  sequence [B] (``decode.sampling``): then each temperature-0 sequence gets the greedy tree and the
  others theirs."""
  kw = dict(method=tree_cfg.method, budget=tree_cfg.budget, width=tree_cfg.width)
  if tree_cfg.method != "chain":
    kw.update(acceptance=tree_cfg.acceptance(), cap_threshold=tree_cfg.cap_threshold,
              prior_strength=tree_cfg.prior_strength)
  if tree_cfg.method == "calibrated":
    kw["counts"] = calibration_counts(tree_cfg, counts)
  fixed = sampling.is_fixed(temperature, top_k, top_p)
  if fixed and temperature == 0.0:
    return build_tree(anchor, depth_logits, **kw), None
  logp = sampling.process_logits(depth_logits, temperature, top_k, top_p)          # [B, D, V]
  shaped = logp
  if not fixed:
    greedy = (jnp.asarray(temperature) <= 0)[:, None, None]
    shaped = jnp.where(greedy, depth_logits.astype(jnp.float32), logp)
  if accept == "match":
    return build_tree(anchor, shaped, **kw), logp
  k = tree_cfg.num_candidates
  noise = sampling.draft_gumbel(keys, logp.shape[1], logp.shape[2])
  tokens = sampling.gumbel_top_k(logp, noise, k)
  if not fixed:          # greedy sequences: build_tree's own top-W tokens, no noise
    tokens = jnp.where(greedy, jax.lax.top_k(jax.nn.log_softmax(shaped, axis=-1), k)[1], tokens)
  return build_tree(anchor, shaped, depth_tokens=tokens, **kw), logp


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
  width = tree_cfg.num_candidates
  head = draft_head.bind(head_cfg, head_params)

  def body(s: SpecState) -> SpecState:
    b = s.base
    active = ~b.done
    # Named scopes (jetspec_<phase>) label each phase's kernels in a profile (bench/gpu_check.py).
    with jax.named_scope("jetspec_draft"):
      depth_logits, draft_cache = drafter(target_params, head_params, draft_view(s), cfg=cfg, head_cfg=head_cfg,
                                          tree_cfg=tree_cfg, attn_impl=attn_impl, mesh=mesh)
    keys = round_keys(s)
    if temperature:                          # sampling's per-row sorts want whole rows (sharding.whole_vocab)
      depth_logits = whole_vocab(depth_logits, mesh)
    with jax.named_scope("jetspec_tree"):
      tree, draft_logp = build_round_tree(b.last_token, depth_logits, keys, tree_cfg, temperature=temperature,
                                          top_k=top_k, top_p=top_p, accept=accept,
                                          counts=(s.rank_hits, s.rank_mass))
    with jax.named_scope("jetspec_verify"):
      logits, cache, taps = verify.verify_tree(target_params, cfg, tree, b.cache, b.prefix_len,
                                               tap_layers=head_cfg.target_layer_ids, attn_impl=attn_impl, mesh=mesh)
    with jax.named_scope("jetspec_accept"):
      if temperature == 0.0:
        target_next = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        acc = verify.greedy_accept(tree, target_next, depth)
      else:
        acc = verify.sample_accept(tree, whole_vocab(logits, mesh), draft_logp if accept == "rejection" else None,
                                   keys, rule=accept,
                                   max_depth=depth, width=width, temperature=temperature, top_k=top_k, top_p=top_p)
    with jax.named_scope("jetspec_commit"):
      cache = verify.compact_cache(cache, b.prefix_len, acc.path)
      path_taps = jnp.take_along_axis(taps, acc.path[:, :, None], axis=1)              # [B, D+1, F]
      draft_cache = head.append_context(draft_cache, path_taps, b.prefix_len)
      new, count = verify.accepted_tokens(tree, acc)
      tokens, num, done, appended = commit_tokens(b.tokens, b.num_tokens, b.done, new, count, eos_ids)
    # prefix_len grows by the committed tokens only (0 once a row is done; cut at EOS and max_new_tokens), so a
    # finished row's later rounds write only scratch rows past its prefix, inside the cache (cache_lengths).
    base = DecodeState(cache=cache, tokens=tokens, num_tokens=num,
                       last_token=jnp.where(active, acc.correction, b.last_token),
                       prefix_len=b.prefix_len + appended, done=done, key=b.key,
                       steps=b.steps + 1)
    hist = s.depth_hist + (jax.nn.one_hot(acc.depth, depth + 1, dtype=jnp.int32) * active[:, None])
    visits, hits, mass = observe_ranks(tree, acc, new, active)
    return SpecState(base=base, draft_cache=draft_cache, rounds=s.rounds + active.astype(jnp.int32),
                     depth_hist=hist, depth_visits=s.depth_visits + visits, rank_hits=s.rank_hits + hits,
                     rank_mass=s.rank_mass + mass)

  return jax.lax.while_loop(lambda s: ~jnp.all(s.base.done), body, state)


def cache_lengths(prompt_len: int, max_new_tokens: int, head_cfg: DraftConfig, tree_cfg: TreeConfig):
  """(target, draft) cache sizes: committed rows plus the round's scratch rows (``attention.cache_rows``)."""
  committed = prompt_len + max_new_tokens
  return (cache_rows(committed + tree_cfg.num_nodes() + 1),
          cache_rows(committed + max(head_cfg.block_size, tree_cfg.depth + 1) + 1))

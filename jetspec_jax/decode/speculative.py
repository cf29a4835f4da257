"""The parts of a JetSpec speculative round the engine (``decode.engine``) runs for every decoding slot: the tree
configuration, the drafter interface (``DraftView``, the head's ``head_drafter``), the round's tree
(``build_round_tree``) and the acceptance-profile counts (``observe_ranks``).

Invariants at the top of every round (per decoding slot b):
  target cache rows 0..prefix_len[b]-1 hold the committed tokens except ``last_token``;
  draft context cache rows 0..prefix_len[b]-1 hold those same positions' fused target features;
  ``last_token`` (the newest committed token) is the anchor of the next block.
Greedy output is identical to plain autoregressive decoding (tested in float32 against ``decode.reference``).

At temperature > 0 the round samples instead (``decode.sampling`` processing applied identically
to the target and the draft): ``accept="match"`` verifies the deterministic top-W tree by one
target draw per node, ``accept="rejection"`` fills the same-shaped tree with Gumbel-top-k draws
of the draft and verifies it by recursive rejection sampling; both are lossless (the argument is
in ``decode.verify``). A round of slot b draws from its round keys ``DraftView.keys`` =
fold_in(key[b], steps + 1), so a drafter can reproduce the tree's Gumbel noise with
``sampling.draft_gumbel(view.keys, D, V)``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.decode import sampling
from jetspec_jax.decode.profile import AcceptanceProfile
from jetspec_jax.decode.tree import TREE_METHODS, build_tree, tree_size
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.draft_head import DraftConfig


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

  def fitted_profile(self):
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
      self.fitted_profile()                                # raises when the profile is too shallow or narrow


def observe_ranks(tree, acc, new: jax.Array, active: jax.Array):
  """This round's profile counts (visits [B, D], hits [B, D, W] int32, mass [B, D, W] float32) from the
  tree's candidates, the acceptance and the committed tokens new [B, D+1] (new[:, d-1] is the target's
  token at depth d for d <= depth + 1: a path token, then the correction)."""
  depth = tree.candidates.shape[1]
  observed = active[:, None] & (jnp.arange(1, depth + 1)[None, :] <= acc.accepted[:, None] + 1)        # [B, D]
  hits = observed[..., None] & (tree.candidates == new[:, :depth, None])
  mass = jnp.where(observed[..., None], jnp.exp(tree.candidate_logp), 0.0)
  return observed.astype(jnp.int32), hits.astype(jnp.int32), mass


@flax.struct.dataclass
class DraftView:
  """What a drafter sees of a round, per sequence b: the target's cache (rows < prefix_len[b] committed), the
  head's context cache, the anchor ``last_token`` [B] (committed, not yet cached), the round's keys [B] (the
  tree's Gumbel noise is ``sampling.draft_gumbel(keys, D, V)``) and the caches' page ``table`` [B, T] (both
  caches are page pools read through it, ``jetspec_jax.pages``)."""
  cache: qwen3.KVCache
  draft_cache: qwen3.KVCache
  last_token: jax.Array
  prefix_len: jax.Array
  keys: jax.Array
  table: jax.Array


# A drafter maps (target params, head params, DraftView) -> (per-depth logits [B, D, V], draft cache); keyword
# arguments cfg, head_cfg, tree_cfg, attn_impl, mesh. Hashable: it is a static argument of the compiled loops.
Drafter = Callable[..., tuple[jax.Array, qwen3.KVCache]]


def head_drafter(target_params, head_params, view: DraftView, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
  """The JetSpec head: per-depth logits of the block [last_token, mask...] after the context."""
  head = draft_head.bind(head_cfg, head_params)
  return head.draft_logits(qwen3.bind(cfg, target_params), view.draft_cache, view.prefix_len, view.last_token,
                           tree_cfg.depth, attn_impl, mesh, view.table)


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
    kw.update(acceptance=tree_cfg.fitted_profile(), cap_threshold=tree_cfg.cap_threshold,
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

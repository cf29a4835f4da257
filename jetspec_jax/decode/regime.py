"""How a compiled round chooses tokens: one of three sampling regimes, chosen once per engine (``regime_for``).

``Greedy``: every request greedy, compiled in: argmax trees, first tokens and acceptance; no draws.
``FixedSampling``: one setting (temperature > 0, top_k, top_p, acceptance rule) compiled in for every request.
``PerRequestSampling``: each request's own temperature / top_k / top_p, read from the engine state (traced); a
data shard whose decoding slots are all greedy this round takes the greedy tree and acceptance (a ``lax.cond``),
and a greedy request keeps the target's argmax path exactly.

Each regime answers the four places a round chooses: the round's tree (``tree``), a prompt's first token
(``first_tokens``), an AR step's token (``ar_tokens``) and the tree's acceptance (``accept_tree``). ``settings`` are the
per-request parameters (temperature, top_k, top_p) of the slots or lanes concerned, empty for the compiled regimes. Token
selection itself is ``decode.sampling``'s; acceptance ``decode.verify``'s.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp

from jetspec_jax.decode import sampling, verify
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.sharding import per_data_shard, whole_vocab

GREEDY_SETTING = (0.0, 0, 1.0)      # (temperature, top_k, top_p) of a greedy request


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Every request greedy (temperature 0 compiled in)."""
  accept: str = "rejection"            # unused: greedy acceptance has one rule
  greedy: ClassVar[bool] = True        # no row ever samples (draft logits need not be whole-vocabulary)
  argmax: ClassVar[bool] = True        # acceptance reads the target's argmax per row

  def slot_settings(self, state, decoding) -> tuple:
    return ()

  def lane_settings(self, state, lane_sequences) -> tuple:
    return ()

  def tree(self, build: Callable, *settings):
    return build(*GREEDY_SETTING)

  def first_tokens(self, logits, keys, mesh, *settings):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def ar_tokens(self, root_logits: Callable, keys, argmax_next, mesh, *settings):
    return argmax_next

  def accept_tree(self, tree, node_logits: Callable, draft_logp, keys, argmax_next, mesh, *settings, depth: int,
                  width: int) -> verify.Acceptance:
    return verify.greedy_accept(tree, argmax_next, depth)


@dataclasses.dataclass(frozen=True)
class FixedSampling:
  """One sampling setting for every request (temperature > 0), compiled in."""
  temperature: float
  top_k: int
  top_p: float
  accept: str = "rejection"
  greedy: ClassVar[bool] = False
  argmax: ClassVar[bool] = False

  @property
  def setting(self) -> tuple[float, int, float]:
    return self.temperature, self.top_k, self.top_p

  def slot_settings(self, state, decoding) -> tuple:
    return ()

  def lane_settings(self, state, lane_sequences) -> tuple:
    return ()

  def tree(self, build: Callable, *settings):
    return build(*self.setting)

  def first_tokens(self, logits, keys, mesh, *settings):
    draw = lambda lg, k: sampling.sample_tokens(lg, k, *self.setting)
    return per_data_shard(draw, mesh)(whole_vocab(logits, mesh), keys)

  def ar_tokens(self, root_logits: Callable, keys, argmax_next, mesh, *settings):
    draw = lambda lg, k: sampling.sample_tokens(lg, k, *self.setting)
    return per_data_shard(draw, mesh)(root_logits(), keys[:, None])

  def accept_tree(self, tree, node_logits: Callable, draft_logp, keys, argmax_next, mesh, *settings, depth: int,
                  width: int) -> verify.Acceptance:
    walk = functools.partial(verify.sample_accept, rule=self.accept, max_depth=depth, width=width,
                             temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
    return per_data_shard(walk, mesh)(tree, node_logits(), draft_logp if self.accept == "rejection" else None, keys)


@dataclasses.dataclass(frozen=True)
class PerRequestSampling:
  """Each request's own setting (temperature 0: greedy), read from the state; one program for any mix."""
  accept: str = "rejection"
  greedy: ClassVar[bool] = False
  argmax: ClassVar[bool] = True

  def slot_settings(self, state, decoding) -> tuple:
    """The decoding slots' settings [B] (a slot not decoding counts as greedy: it never makes a shard sample)."""
    return jnp.where(decoding, state.temperature, 0.0), state.top_k, state.top_p

  def lane_settings(self, state, lane_sequences) -> tuple:
    return tuple(lane_sequences(x) for x in (state.temperature, state.top_k, state.top_p))

  def tree(self, build: Callable, *settings):
    """``build(t, k, p)`` -> (tree, draft_logp, scores); the greedy branch's draft_logp (None) is zeros."""
    sampled_shape = jax.eval_shape(lambda: build(*settings))[1]

    def greedy():
      tree, _, scores = build(*GREEDY_SETTING)
      return tree, jnp.zeros(sampled_shape.shape, sampled_shape.dtype), scores
    return jax.lax.cond(jnp.any(settings[0] > 0), lambda: build(*settings), greedy)

  def first_tokens(self, logits, keys, mesh, *settings):
    return per_data_shard(sampling.sample_tokens, mesh)(whole_vocab(logits, mesh), keys, *settings)

  def ar_tokens(self, root_logits: Callable, keys, argmax_next, mesh, *settings):
    def choose(lg, k, greedy_next, t, top_k, top_p):
      sampled = lambda: sampling.sample_tokens(lg, k, t[:, None], top_k[:, None], top_p[:, None])
      return jax.lax.cond(jnp.any(t > 0), sampled, lambda: greedy_next)
    return per_data_shard(choose, mesh)(root_logits(), keys[:, None], argmax_next, *settings)

  def accept_tree(self, tree, node_logits: Callable, draft_logp, keys, argmax_next, mesh, *settings, depth: int,
                  width: int) -> verify.Acceptance:
    def accept_rows(tree, lg, draft_lp, k, greedy_next, t, top_k, top_p):
      greedy_acc = verify.greedy_accept(tree, greedy_next, depth)

      def sampled():                       # greedy requests keep the target's argmax path, exactly
        acc = verify.sample_accept(tree, lg, draft_lp if self.accept == "rejection" else None, k, rule=self.accept,
                                   max_depth=depth, width=width, temperature=t, top_k=top_k, top_p=top_p)
        return jax.tree.map(lambda g_, s_: jnp.where((t <= 0).reshape((-1,) + (1,) * (g_.ndim - 1)), g_, s_),
                            greedy_acc, acc)
      return jax.lax.cond(jnp.any(t > 0), sampled, lambda: greedy_acc)
    return per_data_shard(accept_rows, mesh)(tree, node_logits(), draft_logp, keys, argmax_next, *settings)


Regime = Greedy | FixedSampling | PerRequestSampling


def regime_for(cfg: SamplingConfig, per_request: bool) -> Regime:
  """The regime of an engine with sampling ``cfg`` (resolved) and, with ``per_request``, requests' own settings."""
  if per_request:
    return PerRequestSampling(cfg.accept)
  if cfg.greedy:
    return Greedy()
  return FixedSampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.accept)

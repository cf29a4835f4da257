"""The one generation API: a ``Generator`` (a target, optionally a draft head and its tree, and a
``SamplingConfig``) whose ``prefill`` / ``decode`` run the jitted programs of ``decode.loop`` (AR) or
``decode.speculative``, and whose ``generate`` returns a typed ``GenerationResult``.

The weights stay split (flat ``nnx.Param`` state, see ``models.params``) for the whole generation: each
jitted program binds them into the model inside its trace, and the loop state is donated. Timing and
tau are summarised in the benchmark layer (``jetspec_jax.bench.acceptance``), not here.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.attention import cache_rows
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import engine, loop, speculative
from jetspec_jax.decode.profile import AcceptanceProfile
from jetspec_jax.decode.prompts import batch_prompts
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.distributed import host_values
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.draft_head import DraftConfig


@dataclasses.dataclass(frozen=True)
class GenerationResult:
  """What one ``Generator.generate`` call produced, per sequence b of the batch.

  tokens[b]: the generated ids (prompt excluded; EOS included when hit); num_tokens [B];
  rounds [B]: decode steps sequence b took part in (speculative rounds; AR: one per token after the
  prefill's); depth_histogram [B, D+1]: rounds that accepted exactly d draft tokens; depth_visits [B, D],
  rank_hits and rank_mass [B, D, W]: the acceptance-profile counts of ``decode.profile`` (speculative only);
  target_forwards: target forwards of the batch, prefill included; prefill_s / decode_s: wall time of
  the two phases (the first call of a shape includes compilation)."""
  tokens: list[list[int]]
  num_tokens: np.ndarray
  rounds: np.ndarray
  depth_histogram: np.ndarray | None
  depth_visits: np.ndarray | None
  rank_hits: np.ndarray | None
  rank_mass: np.ndarray | None
  target_forwards: int
  prefill_s: float
  decode_s: float


def acceptance(results) -> dict:
  """tau and per-depth acceptance of speculative ``GenerationResult``s (summed over all of them): the one
  place they are computed. tau = committed tokens per round, each sequence's prefill token excluded;
  acceptance_by_depth[d-1] = share of rounds that accepted at least d draft tokens."""
  rounds = int(sum(int(np.sum(r.rounds)) for r in results))
  decoded = sum(int(np.sum(r.num_tokens)) - len(r.num_tokens) for r in results)
  hist = np.sum([np.sum(r.depth_histogram, axis=0) for r in results], axis=0)
  at_least = hist[::-1].cumsum()[::-1]
  return {"tau": decoded / max(rounds, 1), "rounds": rounds, "depth_histogram": hist.tolist(),
          "acceptance_by_depth": [float(at_least[d] / max(rounds, 1)) for d in range(1, len(hist))]}


def acceptance_profile(results) -> AcceptanceProfile:
  """The per-(depth, rank) acceptance counts of speculative ``GenerationResult``s, summed over all of them."""
  total = lambda field: np.sum([np.sum(getattr(r, field), axis=0) for r in results], axis=0)
  return AcceptanceProfile.from_counts(total("depth_visits"), total("rank_hits"), total("rank_mass"))


class Generator:
  """Generation with one target, and speculative when it has a draft head (``head_cfg``, ``head_params``,
  ``tree``). ``eos_ids`` None: the target config's; ``cache_dtype`` None: the target weights' dtype.

  Instrumentation (for benchmarks and debugging): ``transfer_guard`` (one of ``engine.TRANSFER_GUARDS``) runs every
  ``decode`` call, and waits for it, under ``jax.transfer_guard_device_to_host(transfer_guard)``;
  ``on_fetch(arrays)`` is called with the device arrays ``generate`` fetches to the host, just before."""

  def __init__(self, target_cfg: Qwen3Config, target_params: dict, *, head_cfg: DraftConfig | None = None,
               head_params: dict | None = None, tree: TreeConfig | None = None,
               sampling_cfg: SamplingConfig = SamplingConfig(), eos_ids: Sequence[int] | None = None,
               attn_impl: str = "xla", mesh=None, cache_dtype=None,
               drafter: speculative.Drafter = speculative.head_drafter, transfer_guard: str | None = None,
               on_fetch: Callable[[tuple[jax.Array, ...]], None] | None = None, prefill_chunk: int | None = None):
    if transfer_guard is not None and transfer_guard not in engine.TRANSFER_GUARDS:
      raise JetSpecError(f"transfer_guard {transfer_guard!r} is not one of {', '.join(engine.TRANSFER_GUARDS)}")
    self.transfer_guard, self.on_fetch = transfer_guard, on_fetch
    self.cfg, self.params = target_cfg, target_params
    self.head_cfg, self.head_params = head_cfg, head_params
    self.sampling = sampling_cfg.resolved()
    self.eos = engine.resolve_eos(target_cfg, eos_ids)
    self.attn_impl, self.mesh, self.drafter = attn_impl, mesh, drafter
    if prefill_chunk is not None and prefill_chunk < 0:
      raise JetSpecError(f"prefill_chunk must be >= 0 (0: the whole prompt in one forward), got {prefill_chunk}")
    self.prefill_chunk = prefill_chunk
    self.cache_dtype = cache_dtype or target_params["embed"].dtype
    self.tree = None
    if head_cfg is not None:
      self.tree = tree or TreeConfig()
      self.tree.validate(head_cfg)
      head_cfg.validate(target_cfg)

  @property
  def speculative(self) -> bool:
    return self.head_cfg is not None

  def _sampling_args(self) -> dict:
    s = self.sampling
    return dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)

  def prefill(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, width: int | None = None,
              key: jax.Array | None = None):
    """Run the prompts (token-id lists, right-padded to the longest or to ``width``) through the target
    (and the head's context); returns the loop state. ``key``: the PRNG key sequence b derives its keys
    from (fold_in(key, b)); default ``jax.random.key(sampling.seed)``."""
    tokens, lengths = batch_prompts(prompts, self.cfg.vocab_size, width=width)
    batch = len(prompts)
    chunk = self._prefill_chunk(batch, tokens.shape[1], max_new_tokens)
    if chunk and tokens.shape[1] % chunk:                 # whole chunks: pad the prompts' width to a multiple
      tokens, lengths = batch_prompts(prompts, self.cfg.vocab_size, width=-(-tokens.shape[1] // chunk) * chunk)
    if self.speculative:
      target_len, draft_len = speculative.cache_lengths(tokens.shape[1], max_new_tokens, self.head_cfg, self.tree)
    else:
      target_len = cache_rows(tokens.shape[1] + max_new_tokens)
    cache = qwen3.init_cache(self.cfg, batch, target_len, self.cache_dtype, self.mesh)
    taps_at = self.head_cfg.target_layer_ids if self.speculative else ()
    key = jax.random.key(self.sampling.seed) if key is None else key
    base, taps = loop.prefill(self.params, cache, jnp.asarray(tokens), jnp.asarray(lengths), key, cfg=self.cfg,
                              max_new_tokens=max_new_tokens, eos_ids=self.eos, attn_impl=self.attn_impl,
                              tap_layers=taps_at, mesh=self.mesh, chunk=chunk, **self._sampling_args())
    if not self.speculative:
      return base
    draft_cache = draft_head.init_context_cache(self.head_cfg, batch, draft_len, self.head_params["fc"].dtype,
                                                self.mesh)
    draft_cache = speculative.prefill_context(self.head_params, draft_cache, taps, head_cfg=self.head_cfg)
    return speculative.init_state(base, draft_cache, self.tree)

  def _prefill_chunk(self, batch: int, width: int, max_new_tokens: int) -> int:
    """``prefill_chunk`` if given, else ``loop.prefill_chunk``'s memory-bounded choice for this batch."""
    if self.prefill_chunk is not None:
      return self.prefill_chunk if self.prefill_chunk < width else 0
    scratch = self.tree.num_nodes() + 1 if self.speculative else 0
    return engine.prefill_chunk(batch, self.cfg.num_attention_heads, width, width + max_new_tokens + scratch, self.mesh)

  def _decode_call(self, state):
    """(jitted decode program, its positional and keyword arguments) for ``state``."""
    kw = dict(cfg=self.cfg, eos_ids=self.eos, attn_impl=self.attn_impl, mesh=self.mesh, **self._sampling_args())
    if not self.speculative:
      return loop.ar_decode, (self.params, state), kw
    return speculative.spec_decode, (self.params, self.head_params, state), dict(
        kw, head_cfg=self.head_cfg, tree_cfg=self.tree, drafter=self.drafter, accept=self.sampling.accept)

  def decode(self, state):
    """Run the jitted loop on ``state`` (donated) until every sequence is done (see ``transfer_guard``)."""
    fn, args, kwargs = self._decode_call(state)
    if self.transfer_guard is None:
      return fn(*args, **kwargs)
    with jax.transfer_guard_device_to_host(self.transfer_guard):
      return jax.block_until_ready(fn(*args, **kwargs))

  def lower_decode(self, state) -> jax.stages.Lowered:
    """The program ``decode(state)`` runs, lowered (neither run nor donated): e.g. ``.compile().as_text()``."""
    fn, args, kwargs = self._decode_call(state)
    return fn.lower(*args, **kwargs)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, width: int | None = None,
               key: jax.Array | None = None) -> GenerationResult:
    """prefill + decode + one fetch of the results, timed per phase (``width``, ``key``: see ``prefill``)."""
    t0 = time.perf_counter()
    state = self.prefill(prompts, max_new_tokens, width=width, key=key)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    state = self.decode(state)
    base = state.base if self.speculative else state
    arrays = (base.tokens, base.num_tokens, base.steps)
    if self.speculative:
      arrays += (state.rounds, state.depth_hist, state.depth_visits, state.rank_hits, state.rank_mass)
    if self.on_fetch is not None:
      self.on_fetch(arrays)
    fetched = host_values(arrays)
    t2 = time.perf_counter()
    out, num, steps = fetched[:3]
    num = np.asarray(num)
    rounds, hist, visits, hits, mass = ([np.asarray(a) for a in fetched[3:]] if self.speculative
                                        else (num - 1, None, None, None, None))
    return GenerationResult(tokens=[out[b, :num[b]].tolist() for b in range(len(prompts))], num_tokens=num,
                            rounds=rounds, depth_histogram=hist, depth_visits=visits, rank_hits=hits, rank_mass=mass,
                            target_forwards=int(steps) + 1,
                            prefill_s=t1 - t0, decode_s=t2 - t1)

"""Token selection from logits: greedy (temperature 0) or sampling with temperature, top-k, top-p.

One processing rule is shared by every sampler in the project (AR, the prefill's first token,
the speculative target distribution p at every tree node and the draft distributions q):

  1. divide the float32 logits by ``temperature``;
  2. ``top_k`` > 0: keep the k most likely tokens (ties to the lower token id, like lax.top_k);
  3. ``top_p`` < 1: among the kept tokens, renormalised, keep the smallest prefix (most likely
     first) whose cumulative probability is >= top_p; the most likely token is always kept;
  4. renormalise: log-probabilities with -inf outside the kept set.

Randomness is per sequence and reproducible: ``sequence_keys(seed_key, B)`` gives sequence b the
key fold_in(seed_key, b), and every draw of one step / round uses ``step_keys(keys, step)`` =
fold_in(keys[b], step) (step 0: the prefill's first token; step s >= 1: the s-th target forward
after the prefill). Inside a speculative round the draws are further folded with fixed tags
(``DRAFT_TAG``, ``ACCEPT_TAG``) and the depth, so a drafter can reproduce the tree's Gumbel noise
(``draft_gumbel``) from the state it is given.

Parameters are either fixed (Python numbers: static, compiled into the program; temperature 0 is argmax)
or per row (arrays, traced: one program serves any mix of requests). Per row, temperature 0 means the
distribution with all its mass on the argmax (top_k 1 after no scaling), so sampling it is greedy; the
rule above is the same, applied after a full-vocabulary sort (ties to the lower token id, as top_k).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.errors import JetSpecError

DRAFT_TAG = 1      # round key -> Gumbel noise of the draft candidates (per depth)
ACCEPT_TAG = 2     # round key -> uniforms / target samples of the acceptance walk (per depth)
ACCEPT_RULES = ("match", "rejection")


def validate_sampling(temperature: float, top_k: int, top_p: float, accept: str | None = None) -> None:
  if not temperature >= 0:
    raise JetSpecError(f"temperature must be >= 0, got {temperature}")
  if int(top_k) != top_k or top_k < 0:
    raise JetSpecError(f"top_k must be a non-negative integer (0 = off), got {top_k}")
  if not 0.0 < top_p <= 1.0:
    raise JetSpecError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
  if accept is not None and accept not in ACCEPT_RULES:
    raise JetSpecError(f"unknown acceptance rule {accept!r}; choose one of {', '.join(ACCEPT_RULES)}")


def is_fixed(*params) -> bool:
  """True when every sampling parameter is a Python / NumPy number (static), False for per-row arrays."""
  return all(isinstance(v, (int, float, np.integer, np.floating)) for v in params)


def _process_row(x: jax.Array, width: int, top_k, top_p) -> jax.Array:
  """One row [V] of temperature-scaled float32 logits -> masked logits (-inf outside the kept set): the
  ``width`` (static) most likely tokens sorted, then top_k (<= 0: off) and top_p (>= 1: off), fixed or traced."""
  vocab = x.shape[-1]
  vals, idx = jax.lax.top_k(x, width)                              # sorted, ties to the lower id
  rank = jnp.arange(width)
  keep = (top_k <= 0) | (rank < top_k)
  if not (is_fixed(top_p) and top_p >= 1.0):
    probs = jax.nn.softmax(jnp.where(keep, vals, -jnp.inf))
    before = jnp.cumsum(probs) - probs                             # mass strictly before each rank
    keep &= (top_p >= 1.0) | (before < top_p) | (rank == 0)       # the most likely token is always kept
  return jnp.full((vocab,), -jnp.inf, jnp.float32).at[idx].set(jnp.where(keep, vals, -jnp.inf))


def _per_row(x: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """Per-row parameters [P...] (a prefix of x's leading dims, broadcast over the rest) -> masked logits."""
  lead, vocab = x.shape[:-1], x.shape[-1]
  expand = lambda a, dtype: jnp.broadcast_to(
      jnp.reshape(a, jnp.shape(a) + (1,) * (len(lead) - jnp.ndim(a))), lead).astype(dtype).reshape(-1)
  t, k, p = expand(temperature, jnp.float32), expand(top_k, jnp.int32), expand(top_p, jnp.float32)
  greedy = t <= 0
  k = jnp.where(greedy, 1, k)
  flat = x.reshape(-1, vocab) / jnp.where(greedy, 1.0, t)[:, None]
  return jax.vmap(lambda r, kr, pr: _process_row(r, vocab, kr, pr))(flat, k, p).reshape(x.shape)


def process_logits(logits: jax.Array, temperature, top_k=0, top_p=1.0) -> jax.Array:
  """logits [..., V] -> float32 log-probabilities [..., V] of the processed distribution.

  Fixed parameters: ``temperature`` (> 0), ``top_k`` (0 = off) and ``top_p`` (1.0 = off) are static
  numbers. Per row: arrays of shape [P...], a prefix of logits' leading dims (temperature 0 rows: all
  mass on the argmax). See the module docstring for the rule. Tokens outside the kept set get -inf."""
  if not is_fixed(temperature, top_k, top_p):
    return jax.nn.log_softmax(_per_row(logits.astype(jnp.float32), temperature, top_k, top_p), axis=-1)
  if temperature <= 0:
    raise JetSpecError("process_logits needs temperature > 0 (temperature 0 is greedy argmax)")
  x = logits.astype(jnp.float32) / jnp.float32(temperature)
  vocab = x.shape[-1]
  if (0 < top_k < vocab) or top_p < 1.0:
    flat = x.reshape(-1, vocab)
    width = top_k if 0 < top_k < vocab else vocab
    x = jax.vmap(lambda r: _process_row(r, width, 0, top_p))(flat).reshape(x.shape)
  return jax.nn.log_softmax(x, axis=-1)


def sample_tokens(logits: jax.Array, key: jax.Array, temperature, top_k=0, top_p=1.0) -> jax.Array:
  """logits [..., V] -> token ids [...] int32. Temperature 0: argmax (top_k / top_p ignored: the
  most likely token is always kept). ``key`` is one key, or keys of shape [...] (one per row);
  parameters fixed or per row as ``process_logits``."""
  if is_fixed(temperature, top_k, top_p) and temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logp = process_logits(logits, temperature, top_k, top_p)
  if key.shape == ():
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
  return jax.vmap(lambda k, lp: jax.random.categorical(k, lp, axis=-1))(
      key.reshape(-1), logp.reshape((-1,) + logp.shape[key.ndim:])).reshape(key.shape + logp.shape[key.ndim:-1]
                                                                          ).astype(jnp.int32)


def sequence_keys(key: jax.Array, batch: int) -> jax.Array:
  """One key per sequence: fold_in(key, b) for b < batch -> [B] keys."""
  return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch, dtype=jnp.uint32))


def step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
  """Per-sequence keys [B] of one step (0 = prefill, s = the s-th target forward after it); ``step`` is
  one step for all, or [B] (each sequence's own)."""
  step = jnp.asarray(step)
  return jax.vmap(jax.random.fold_in, in_axes=(0, 0 if step.ndim else None))(keys, step)


def draft_gumbel(round_keys: jax.Array, depth: int, vocab: int) -> jax.Array:
  """Gumbel noise [B, depth, V] float32 of a speculative round's draft candidates.

  Depth index k (depth k+1) of sequence b uses fold_in(fold_in(round_keys[b], DRAFT_TAG), k), so
  the noise of one depth is a deterministic function of (sequence key, round, depth) that a
  drafter can reproduce (``speculative.round_keys(state)`` gives the round keys)."""
  def one(key):
    key = jax.random.fold_in(key, DRAFT_TAG)
    return jax.vmap(lambda d: jax.random.gumbel(jax.random.fold_in(key, d), (vocab,), jnp.float32))(
        jnp.arange(depth, dtype=jnp.uint32))
  return jax.vmap(one)(round_keys)


def gumbel_top_k(log_probs: jax.Array, gumbel: jax.Array, k: int) -> jax.Array:
  """k distinct tokens [..., k] drawn WITHOUT replacement from softmax(log_probs), in sampled
  order (Gumbel-top-k: the top-k of log_probs + Gumbel noise). Tokens with log-prob -inf only
  appear once the support is exhausted (they are never valid candidates)."""
  return jax.lax.top_k(log_probs + gumbel, k)[1].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are chosen. temperature 0: greedy (top_k, top_p and accept do not apply). Otherwise
  the target's distribution after temperature, top_k (0 = off) and top_p (1 = off), see
  ``decode.sampling``; speculative rounds accept by ``accept`` ("rejection" | "match"). Sequence b
  draws from keys derived from ``seed`` and b, so results are reproducible."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  accept: str = "rejection"
  seed: int = 0

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0

  def resolved(self) -> "SamplingConfig":
    """Validated, with the fields greedy decoding ignores set to their neutral values."""
    validate_sampling(self.temperature, self.top_k, self.top_p, self.accept)
    if self.greedy:
      return SamplingConfig(0.0, 0, 1.0, "rejection", int(self.seed))
    return SamplingConfig(float(self.temperature), int(self.top_k), float(self.top_p), self.accept, int(self.seed))

  def describe(self) -> dict:
    return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "accept": "greedy" if self.greedy else self.accept, "seed": self.seed}

"""The AR generation programs: one jitted prefill, then one jitted ``lax.while_loop`` over a donated
state; only the final result comes back to the host (``decode.generation.Generator`` runs them).

The AR loop is the baseline; the speculative loop (``decode.speculative``) shares the prefill,
``DecodeState`` and ``commit_tokens``.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.sampling import sample_tokens, sequence_keys, step_keys
from jetspec_jax.models import qwen3
from jetspec_jax.decode.verify import commit_tokens
from jetspec_jax.sharding import whole_vocab


@flax.struct.dataclass
class DecodeState:
  """Target-side generation state. Invariant: the target cache holds prefix_len[b] committed
  positions; ``last_token`` (the newest committed token) is not yet in the cache."""
  cache: qwen3.KVCache
  tokens: jax.Array       # [B, M] int32 generated tokens (M = max_new_tokens), -1 past num_tokens
  num_tokens: jax.Array   # [B] int32
  last_token: jax.Array   # [B] int32
  prefix_len: jax.Array   # [B] int32
  done: jax.Array         # [B] bool: hit EOS or max_new_tokens
  key: jax.Array          # [B] per-sequence PRNG keys (fixed; step s draws from fold_in(key[b], s))
  steps: jax.Array        # [] int32: target forwards after prefill


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_ids", "temperature", "attn_impl",
                                             "tap_layers", "mesh", "top_k", "top_p", "chunk"),
                   donate_argnames=("cache",))
def prefill(params, cache, prompt, prompt_len, key, *, cfg: Qwen3Config, max_new_tokens: int,
            eos_ids: tuple[int, ...], temperature: float, attn_impl: str = "xla",
            tap_layers: tuple[int, ...] = (), mesh=None, top_k: int = 0, top_p: float = 1.0, chunk: int = 0):
  """Run right-padded prompts [B, T] (lengths [B]) through the target; select the first token.

  ``chunk`` > 0 (T a multiple of it): the prompt goes through in forwards of ``chunk`` rows (one
  ``lax.scan``), each attending to the cache rows before it, so attention scores take [B, H, chunk, S]
  instead of [B, H, T, S] (``prefill_chunk`` picks it). ``key``: one PRNG key (sequence b then uses
  fold_in(key, b)) or [B] per-sequence keys. Returns (DecodeState, taps [B, T, F] or None)."""
  batch, length = prompt.shape
  target = qwen3.bind(cfg, params)
  last_row = prompt_len - 1
  if not chunk or chunk >= length:
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    h, cache, taps = target.hidden(prompt, positions, qwen3.causal_mask(batch, length), cache=cache,
                                   prefix_len=jnp.zeros((batch,), jnp.int32), tap_layers=tap_layers,
                                   rows=last_row[:, None], attn_impl=attn_impl, mesh=mesh)
  else:
    if length % chunk:
      raise ValueError(f"prefill chunk {chunk} does not divide the prompt width {length}")

    def forward(cache, start):
      rows = jax.lax.dynamic_slice_in_dim(prompt, start, chunk, axis=1)
      positions = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
      return target.hidden(rows, positions, qwen3.causal_mask(batch, chunk), cache=cache,
                           prefix_len=jnp.full((batch,), start, jnp.int32), tap_layers=tap_layers,
                           rows=jnp.clip(last_row - start, 0, chunk - 1)[:, None], attn_impl=attn_impl, mesh=mesh)

    def step(carry, start):
      cache, h_last = carry
      h, cache, taps = forward(cache, start)
      mine = (last_row >= start) & (last_row < start + chunk)          # the row's last prompt token is here
      return (cache, jnp.where(mine[:, None, None], h, h_last)), taps

    h_shape = jax.eval_shape(forward, cache, jnp.int32(0))[0]
    (cache, h), taps = jax.lax.scan(step, (cache, jnp.zeros(h_shape.shape, h_shape.dtype)),
                                    jnp.arange(0, length, chunk, dtype=jnp.int32))
    if taps is not None:                                                  # [T / chunk, B, chunk, F] -> [B, T, F]
      taps = jnp.moveaxis(taps, 0, 1).reshape(batch, length, taps.shape[-1])
  logits = target.logits(h)
  keys = sequence_keys(key, batch) if key.ndim == 0 else key
  first = sample_tokens(whole_vocab(logits[:, 0], mesh) if temperature else logits[:, 0], step_keys(keys, 0),
                        temperature, top_k, top_p)
  out = jnp.full((batch, max_new_tokens), -1, jnp.int32)
  zeros = jnp.zeros((batch,), jnp.int32)
  out, num, done, _ = commit_tokens(out, zeros, jnp.zeros((batch,), bool), first[:, None],
                                    jnp.ones((batch,), jnp.int32), eos_ids)
  state = DecodeState(cache=cache, tokens=out, num_tokens=num, last_token=first, prefix_len=prompt_len,
                      done=done, key=keys, steps=jnp.zeros((), jnp.int32))
  return state, taps


@functools.partial(jax.jit, static_argnames=("cfg", "eos_ids", "temperature", "attn_impl", "mesh", "top_k", "top_p"),
                   donate_argnames=("state",))
def ar_decode(params, state: DecodeState, *, cfg: Qwen3Config, eos_ids: tuple[int, ...],
              temperature: float, attn_impl: str = "xla", mesh=None, top_k: int = 0,
              top_p: float = 1.0) -> DecodeState:
  """Plain autoregressive decoding until every sequence is done (one token per target forward)."""
  batch = state.last_token.shape[0]
  one_mask = jnp.ones((batch, 1, 1), bool)
  target = qwen3.bind(cfg, params)

  def body(s: DecodeState) -> DecodeState:
    h, cache, _ = target.hidden(s.last_token[:, None], s.prefix_len[:, None], one_mask, cache=s.cache,
                                prefix_len=s.prefix_len, attn_impl=attn_impl, mesh=mesh)
    logits = target.logits(h)
    nxt = sample_tokens(whole_vocab(logits[:, 0], mesh) if temperature else logits[:, 0],
                        step_keys(s.key, s.steps + 1), temperature, top_k, top_p)
    active = ~s.done
    tokens, num, done, _ = commit_tokens(s.tokens, s.num_tokens, s.done, nxt[:, None],
                                         jnp.ones((batch,), jnp.int32), eos_ids)
    return DecodeState(cache=cache, tokens=tokens, num_tokens=num, last_token=jnp.where(active, nxt, s.last_token),
                       prefix_len=s.prefix_len + active.astype(jnp.int32), done=done, key=s.key, steps=s.steps + 1)

  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)

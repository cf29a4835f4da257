"""The reference greedy decoder the equality tests compare against, written apart from the engine: no KV
cache, no packed rows, no trees, no commit logic. Each new token is the argmax of the target's logits at the
last position of ONE causal forward over the whole sequence so far (prompt and the tokens before it), so
decoding a sequence of T tokens costs T full forwards: a test oracle, not a decoder to serve with.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import qwen3

WIDTH_MULTIPLE = 32          # sequences are padded to a multiple of this: one compiled program per width


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_ids"))
def _decode(params, tokens, prompt_len, *, cfg: Qwen3Config, max_new_tokens: int, eos_ids: tuple[int, ...]):
  """tokens [W] (the prompt, then padding), prompt_len [] -> (tokens [W] with the new ones written, count [])."""
  model = qwen3.bind(cfg, params)
  width = tokens.shape[0]
  positions = jnp.arange(width, dtype=jnp.int32)[None]
  mask = qwen3.causal_mask(1, width)
  eos = jnp.asarray(eos_ids or (-1,), jnp.int32)

  def step(carry):
    tokens, count, _ = carry
    last = prompt_len + count - 1
    h, _, _ = model.hidden(tokens[None], positions, mask, rows=last[None, None])
    new = jnp.argmax(model.logits(h)[0, 0]).astype(jnp.int32)
    return tokens.at[last + 1].set(new), count + 1, jnp.any(new == eos)

  going = lambda carry: (carry[1] < max_new_tokens) & ~carry[2]
  tokens, count, _ = jax.lax.while_loop(going, step, (tokens, jnp.int32(0), jnp.bool_(False)))
  return tokens, count


def greedy(cfg: Qwen3Config, params: dict, prompt: Sequence[int], max_new_tokens: int,
           eos_ids: Sequence[int] = ()) -> list[int]:
  """The greedy continuation of ``prompt``: at most ``max_new_tokens`` ids, ending at the first of ``eos_ids``
  (included)."""
  width = -(-(len(prompt) + max_new_tokens) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
  tokens = np.zeros((width,), np.int32)
  tokens[:len(prompt)] = prompt
  out, count = _decode(params, jnp.asarray(tokens), jnp.int32(len(prompt)), cfg=cfg,
                       max_new_tokens=int(max_new_tokens), eos_ids=tuple(int(e) for e in eos_ids))
  out, count = jax.device_get((out, count))
  return out[len(prompt):len(prompt) + int(count)].tolist()

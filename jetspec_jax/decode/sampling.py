"""Token selection from logits: greedy (temperature 0) or temperature sampling."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def select_tokens(logits: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
  """logits [..., V] float32 -> token ids [...] int32; ``temperature`` is static (0 = greedy)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)

"""Qwen3 / Qwen3-MoE target in JAX: declared weights, KV cache, a forward over new rows with taps.

Weights are a flat dict ``{name: array}``; ``param_specs(cfg)`` declares each one once (shape,
logical axes, init) and sharding, initialisation, conversion and restore all derive from it.
Layouts: projections are [in, heads, head_dim] / [heads, head_dim, out] so heads shard cleanly;
MoE experts are stacked [E, ...].

One forward serves prefill, AR decode and tree verification: T new rows are written into the
cache at positions prefix_len[b] + t and attend to the committed prefix plus the rows allowed
by ``block_mask`` (see ``jetspec_jax.attention``). RoPE positions are passed separately, so tree
nodes sit at prefix_len + depth.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.attention import attention
from jetspec_jax.config import Qwen3Config
from jetspec_jax.models.layers import (ParamSpec, attention_specs, decoder_layer, dense_mlp, dense_mlp_specs, init_params,
                                       rms_norm, write_rows)
from jetspec_jax.models.moe import moe_mlp, moe_specs
from jetspec_jax.sharding import shard


def param_specs(cfg: Qwen3Config) -> dict[str, ParamSpec]:
  """Every weight of the target, declared once."""
  h, nq, nkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  specs = {"embed": ParamSpec((cfg.vocab_size, h), ("vocab", "embed")),
           "final_norm": ParamSpec((h,), ("norm",), "ones")}
  if not cfg.tie_word_embeddings:
    specs["lm_head"] = ParamSpec((h, cfg.vocab_size), ("embed", "vocab"))
  for i in range(cfg.num_hidden_layers):
    pre = f"layers.{i}."
    specs.update(attention_specs(pre, h, nq, nkv, dh))
    if cfg.is_moe_layer(i):
      specs.update(moe_specs(pre, cfg))
    else:
      specs.update(dense_mlp_specs(pre, h, cfg.intermediate_size))
  return specs


def init_target(cfg: Qwen3Config, key: jax.Array, dtype=jnp.float32, mesh=None) -> dict[str, jax.Array]:
  """Random target weights (tests, benchmarks), each created in its sharding."""
  return init_params(param_specs(cfg), key, dtype, mesh)


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values, each [B, Hkv, S, Dh]; sequence b's committed length lives outside."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]


CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")


def zero_cache(num_layers: int, shape: tuple[int, ...], dtype, mesh=None) -> KVCache:
  """``num_layers`` zeroed [B, Hkv, S, Dh] keys and values, sharded over (data, model)."""
  zeros = lambda: shard(jnp.zeros(shape, dtype), CACHE_AXES, mesh)
  return KVCache(k=tuple(zeros() for _ in range(num_layers)), v=tuple(zeros() for _ in range(num_layers)))


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype, mesh=None) -> KVCache:
  """A zeroed cache of ``max_len`` positions per sequence."""
  return zero_cache(cfg.num_hidden_layers, (batch, cfg.num_key_value_heads, max_len, cfg.head_dim), dtype, mesh)


def forward(params: dict, cfg: Qwen3Config, tokens: jax.Array, positions: jax.Array, cache: KVCache,
            prefix_len: jax.Array, block_mask: jax.Array, *, tap_layers: tuple[int, ...] = (),
            attn_impl: str = "xla", mesh=None, logits_rows: jax.Array | None = None,
            return_hidden: bool = False):
  """Run T new rows through the target.

  tokens, positions [B, T] int32 (positions: RoPE positions); cache: KV cache whose rows
  prefix_len[b] + t (t < T) receive the new keys/values; prefix_len [B]; block_mask [B, T, T]
  (see ``jetspec_jax.attention``). ``logits_rows`` [B, R] selects which rows get logits (default
  all). Returns (logits [B, R, V] float32, new cache, taps [B, T, len(tap_layers) * H]) where
  taps are the residual outputs (before the final norm) of the chosen layers, in that order.
  With ``return_hidden`` the first output is the final-normed hidden states [B, R, H] instead
  (training computes vocabulary logits in chunks from them).
  """
  p = params
  x = shard(p["embed"][tokens], ("batch", "seq", "embed"), mesh)
  taps = {}
  new_k, new_v = [], []
  for i in range(cfg.num_hidden_layers):
    pre = f"layers.{i}."
    weight = lambda n, pre=pre: p[pre + n]

    def attend(q, k, v, i=i):
      k_cache, v_cache = write_rows(cache.k[i], k, prefix_len), write_rows(cache.v[i], v, prefix_len)
      new_k.append(k_cache)
      new_v.append(v_cache)
      return attention(q, k_cache, v_cache, prefix_len, block_mask, impl=attn_impl, mesh=mesh)

    mlp = (lambda h, pre=pre: moe_mlp(h, p, pre, cfg, mesh)) if cfg.is_moe_layer(i) else dense_mlp(weight)
    x = decoder_layer(x, weight, attend, mlp, num_heads=cfg.num_attention_heads,
                      num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps,
                      theta=cfg.rope_theta, positions=positions)
    if i in tap_layers:
      taps[i] = x
  tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1) if tap_layers else None
  if logits_rows is not None:
    x = jnp.take_along_axis(x, logits_rows[..., None], axis=1)
  hidden = rms_norm(x, p["final_norm"], cfg.rms_norm_eps)
  return hidden if return_hidden else lm_logits(p, cfg, hidden), KVCache(k=tuple(new_k), v=tuple(new_v)), tapped


def lm_logits(params: dict, cfg: Qwen3Config, h: jax.Array) -> jax.Array:
  """Final-normed hidden states [..., H] -> float32 logits [..., V] (tied or untied head)."""
  w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return jnp.einsum("...h,hv->...v", h, w, preferred_element_type=jnp.float32)


def causal_mask(batch: int, length: int) -> jax.Array:
  """[B, T, T] lower-triangular block mask (prefill)."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, L] segment ids (packed rows) -> [B, L, L] block mask: causal and within the same segment.

  Padding (segment 0) rows see earlier padding rows only, so the diagonal is always True."""
  length = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))
  return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])

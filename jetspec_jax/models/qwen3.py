"""Qwen3 / Qwen3-MoE target as a Flax NNX model: declared weights, an explicit KV cache, hidden
states over new rows (with taps) and logits as separate calls.

Module tree: ``embed`` [V, H]; ``layers`` (``DecoderLayer``: ``input_norm``, ``attn``,
``post_attn_norm``, ``mlp`` = ``MLP`` or ``moe.MoE``); ``final_norm``; ``lm_head`` [H, V] when the
embeddings are untied. ``param_specs(cfg)`` reads the declaration from an abstract model;
pipelines carry the weights as the flat dict of ``models.params`` and ``bind`` them into a model
inside their jitted functions.

One ``hidden`` call serves prefill, AR decode and tree verification: T new rows are written into
the cache at positions prefix_len[b] + t and attend to the committed prefix plus the rows allowed
by ``block_mask`` (see ``jetspec_jax.attention``). RoPE positions are passed separately, so tree
nodes sit at prefix_len + depth. Without a cache (training) the rows attend to each other only.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import params as P
from jetspec_jax.models.layers import MLP, Attention, DecoderLayer, PackedRows, RMSNorm, cached_attention
from jetspec_jax.models.moe import MoE
from jetspec_jax.sharding import named_sharding, shard


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values, each [B, Hkv, S, Dh], or each a page pool [G, Pg, Hkv, R, Dh] whose page table lives
  outside (``jetspec_jax.pages``); sequence b's committed length lives outside."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]


CACHE_AXES = ("batch", "kv_heads", "seq", "head_dim")
POOL_AXES = ("batch", None, "kv_heads", "seq", "head_dim")      # [G, Pg, Hkv, R, Dh]: groups over data


def zero_cache(num_layers: int, shape: tuple[int, ...], dtype, mesh=None) -> KVCache:
  """``num_layers`` zeroed [B, Hkv, S, Dh] keys and values (or page pools [G, Pg, Hkv, R, Dh]), sharded over
  (data, model). Each buffer is born in its sharding (``zero_cache_program``): no device ever holds more than its
  shard."""
  if mesh is None:
    zeros = lambda: jnp.zeros(shape, dtype)
  else:
    axes = CACHE_AXES if len(shape) == 4 else POOL_AXES
    zeros = zero_cache_program(shape, jnp.dtype(dtype), named_sharding(axes, shape, mesh))
  return KVCache(k=tuple(zeros() for _ in range(num_layers)), v=tuple(zeros() for _ in range(num_layers)))


@functools.lru_cache(maxsize=64)
def zero_cache_program(shape: tuple[int, ...], dtype, sharding):
  """The jitted program that creates one zeroed cache buffer directly in ``sharding`` (each device writes
  only its shard; under an outer jit it is inlined as a sharded broadcast)."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def init_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype, mesh=None) -> KVCache:
  """A zeroed cache of ``max_len`` positions per sequence."""
  return zero_cache(cfg.num_hidden_layers, (batch, cfg.num_key_value_heads, max_len, cfg.head_dim), dtype, mesh)


def init_pool(cfg: Qwen3Config, groups: int, pages: int, page_rows: int, dtype, mesh=None) -> KVCache:
  """A zeroed paged cache: per layer a pool of ``pages`` pages of ``page_rows`` rows per group (``jetspec_jax.pages``)."""
  shape = (groups, pages, cfg.num_key_value_heads, page_rows, cfg.head_dim)
  return zero_cache(cfg.num_hidden_layers, shape, dtype, mesh)


class Qwen3(nnx.Module):
  """The Qwen3 / Qwen3-MoE decoder (see the module docstring for the module tree)."""

  def __init__(self, cfg: Qwen3Config, *, dtype=jnp.float32, rngs: nnx.Rngs):
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.embed = P.param(rngs, (cfg.vocab_size, h), ("vocab", "embed"), dtype)

    def layer(i):
      attn = Attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps=eps,
                       theta=cfg.rope_theta, dtype=dtype, rngs=rngs)
      mlp = MoE(cfg, dtype=dtype, rngs=rngs) if cfg.is_moe_layer(i) else MLP(h, cfg.intermediate_size, dtype=dtype,
                                                                                 rngs=rngs)
      return DecoderLayer(attn, mlp, h, eps, dtype=dtype)

    self.layers = nnx.List([layer(i) for i in range(cfg.num_hidden_layers)])
    self.final_norm = RMSNorm(h, eps, dtype=dtype)
    self.lm_head = None if cfg.tie_word_embeddings else P.param(rngs, (h, cfg.vocab_size), ("embed", "vocab"), dtype)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """tokens [...] int -> embeddings [..., H]."""
    return self.embed[...][tokens]

  def hidden(self, tokens: jax.Array, positions: jax.Array, block_mask: jax.Array, *, cache: KVCache | None = None,
             prefix_len: jax.Array | None = None, tap_layers: tuple[int, ...] = (), rows: jax.Array | None = None,
             attn_impl: str = "xla", mesh=None, packed: PackedRows | None = None, table: jax.Array | None = None):
    """Run T new rows through the decoder layers.

    tokens, positions [B, T] int32 (positions: RoPE positions); block_mask [B, T, T]; cache: KV cache
    whose rows prefix_len[b] + t (t < T) receive the new keys/values (None: no cache, rows see each
    other only; prefix_len unused). ``rows`` [B, R] selects which rows come out (default all).
    Returns (final-normed hidden states [B, R, H], new cache or None, taps [B, T, len(tap_layers) * H]
    or None), taps being the residual outputs (before the final norm) of the chosen layers, in order.
    ``packed`` (``layers.PackedRows``): tokens and positions are packed rows [G, K + L * C], decode rows
    attending in the cache's [B, W] layout (block_mask [B, W, W], prefix_len [B]) and prefill lanes
    causally; everything returned stays packed. ``table`` [B, T']: the cache's buffers are page pools
    [G, Pg, Hkv, R, Dh] read and written through this page table (``jetspec_jax.pages``).
    """
    with jax.named_scope("embedding"):
      x = shard(self.embed_tokens(tokens), ("batch", "seq", "embed"), mesh)
    taps, new_k, new_v = {}, [], []
    for i, layer in enumerate(self.layers):
      kv = None if cache is None else (cache.k[i], cache.v[i])
      with jax.named_scope(f"layer_{i}"):
        attend = cached_attention(kv, prefix_len, block_mask, impl=attn_impl, mesh=mesh, packed=packed, table=table)
        x, kept = layer(x, positions, attend, mesh)
      if kept is not None:
        new_k.append(kept[0])
        new_v.append(kept[1])
      if i in tap_layers:
        taps[i] = x
    tapped = jnp.concatenate([taps[i] for i in tap_layers], axis=-1) if tap_layers else None
    if rows is not None:
      x = jnp.take_along_axis(x, rows[..., None], axis=1)
    new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v))
    return self.final_norm(x), new_cache, tapped

  def logits(self, h: jax.Array) -> jax.Array:
    """Final-normed hidden states [..., H] -> float32 logits [..., V] (tied or untied head)."""
    with jax.named_scope("lm_head"):
      if self.lm_head is None:                # tied: contract with the table's rows (no transposed copy of it)
        return jnp.einsum("...h,vh->...v", h, self.embed[...], preferred_element_type=jnp.float32)
      return jnp.einsum("...h,hv->...v", h, self.lm_head[...], preferred_element_type=jnp.float32)


TARGET = P.Declared(Qwen3)
abstract_model = TARGET.abstract
param_specs = TARGET.specs        # {name: ParamSpec} of every weight of ``Qwen3(cfg)``
init_target = TARGET.init         # (cfg, key, dtype, mesh): random weights, each created in its sharding
bind = TARGET.bind                # (cfg, params): the Qwen3 holding ``params``


def causal_mask(batch: int, length: int) -> jax.Array:
  """[B, T, T] lower-triangular block mask (prefill)."""
  return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, L] segment ids (packed rows) -> [B, L, L] block mask: causal and within the same segment.

  Padding (segment 0) rows see earlier padding rows only, so the diagonal is always True."""
  length = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((length, length), bool))
  return causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])

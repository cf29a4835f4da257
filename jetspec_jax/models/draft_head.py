"""The JetSpec causal parallel draft head (DFlash architecture with a causal block), a Flax NNX model.

A small Qwen3-style decoder stack with no embedding and no LM head of its own (it uses the
target's). Module tree: ``fc`` [n_taps*Ht, H], ``hidden_norm``, ``layers`` (``DecoderLayer`` with a
dense ``MLP``), ``final_norm``. Target features (residual outputs of ``target_layer_ids``, concatenated) are fused
as ``ctx = RMSNorm(concat @ fc)`` and serve as extra keys/values in EVERY layer:
k = k_norm(concat[k_proj(ctx), k_proj(h)]), v = concat[v_proj(ctx), v_proj(h)], q from h.
Since ctx does not depend on the layer input, each layer's context K/V is computed once per
context row and cached across rounds (``append_context``).

Block input: [anchor, mask x (bs-1)] at positions prefix_len .. prefix_len+bs-1. Causal head: slot j
sees all context rows and slots 0..j; bidirectional (DFlash) head: all slots. Slots 1..bs-1 go
through the target's final norm-free LM head after the head's own final norm: slot d is the
distribution for depth d.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jetspec_jax.config import Qwen3Config, versioned_keys
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import params as P
from jetspec_jax.models import qwen3
from jetspec_jax.models.layers import MLP, Attention, DecoderLayer, NormedRows, RMSNorm, cached_attention, write_rows


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """The published rule: evenly spaced from layer 1 to L-3 ([1,9,17,25,33] for L=36, n=5)."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  span = num_target_layers - 4
  return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
  """Draft-head hyper-parameters (HF format: Qwen3 config + block_size, num_target_layers, dflash_config)."""
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  block_size: int
  target_layer_ids: tuple[int, ...]
  target_hidden_size: int
  num_target_layers: int
  vocab_size: int
  mask_token_id: int
  causal: bool = True
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0

  @property
  def depth(self) -> int:
    """Draft depths per block (block slots 1..bs-1)."""
    return self.block_size - 1

  @classmethod
  def for_target(cls, target: Qwen3Config, num_layers: int = 1, block_size: int = 16, causal: bool = True,
                 mask_token_id: int | None = None, target_layer_ids=None, **overrides) -> "DraftConfig":
    """A head shaped like the target's layers (the published recipe), with the default taps."""
    layer_ids = tuple(target_layer_ids or default_target_layer_ids(target.num_hidden_layers, num_layers))
    fields = dict(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size or
                  target.moe_intermediate_size * 8, num_hidden_layers=num_layers,
                  num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                  head_dim=target.head_dim, block_size=block_size, target_layer_ids=layer_ids,
                  target_hidden_size=target.hidden_size, num_target_layers=target.num_hidden_layers,
                  vocab_size=target.vocab_size,
                  mask_token_id=target.vocab_size - 1 if mask_token_id is None else mask_token_id,
                  causal=causal, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta)
    fields.update(overrides)
    cfg = cls(**fields)
    cfg.validate(target)
    return cfg

  def validate(self, target: Qwen3Config | None = None) -> None:
    if self.block_size < 2:
      raise JetSpecError(f"block_size={self.block_size} must be at least 2 (one anchor and one draft slot)")
    if self.num_attention_heads % self.num_key_value_heads:
      raise JetSpecError("draft head: num_attention_heads is not a multiple of num_key_value_heads")
    if target is not None:
      bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
      if bad:
        raise JetSpecError(f"draft head taps target layer {bad[0]}, but the target has "
                           f"{target.num_hidden_layers} layers")
      if self.target_hidden_size != target.hidden_size or self.vocab_size != target.vocab_size:
        raise JetSpecError(f"draft head was built for a target with hidden size {self.target_hidden_size} and "
                           f"vocabulary {self.vocab_size}, not {target.hidden_size} and {target.vocab_size}")
      if not 0 <= self.mask_token_id < target.vocab_size:
        raise JetSpecError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary")

  def to_hf_dict(self, dtype: str = "bfloat16") -> dict[str, Any]:
    """The config.json of a published JetSpec / DFlash head (a Qwen3 config to transformers 4.x and 5.x)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
        **versioned_keys(self.rope_theta, dtype), "attention_bias": False, "tie_word_embeddings": False,
        "block_size": self.block_size, "num_target_layers": self.num_target_layers,
        "dflash_config": {"causal_head": self.causal, "target_layer_ids": list(self.target_layer_ids),
                          "mask_token_id": self.mask_token_id, "target_hidden_size": self.target_hidden_size},
    }

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> "DraftConfig":
    dflash = d.get("dflash_config")
    if not isinstance(dflash, dict) or "block_size" not in d:
      raise JetSpecError("config.json is not a JetSpec/DFlash draft head (no block_size / dflash_config)")
    missing = [k for k in ("target_layer_ids", "mask_token_id") if k not in dflash]
    missing += [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "vocab_size", "num_target_layers") if k not in d]
    if missing:
      raise JetSpecError(f"draft head config.json is missing key(s): {', '.join(missing)}")
    rope = d.get("rope_parameters") or {}
    heads = d["num_attention_heads"]
    return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
               num_hidden_layers=d["num_hidden_layers"], num_attention_heads=heads,
               num_key_value_heads=d.get("num_key_value_heads", heads),
               head_dim=d.get("head_dim") or d["hidden_size"] // heads, block_size=d["block_size"],
               target_layer_ids=tuple(dflash["target_layer_ids"]),
               target_hidden_size=dflash.get("target_hidden_size", d["hidden_size"]),
               num_target_layers=d["num_target_layers"], vocab_size=d["vocab_size"],
               mask_token_id=dflash["mask_token_id"], causal=bool(dflash.get("causal_head", True)),
               rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
               rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))))


def block_mask(cfg: DraftConfig, batch: int) -> jax.Array:
  """[B, bs, bs]: causal for the JetSpec head, all-ones for the bidirectional (DFlash) head."""
  bs = cfg.block_size
  m = jnp.tril(jnp.ones((bs, bs), bool)) if cfg.causal else jnp.ones((bs, bs), bool)
  return jnp.broadcast_to(m, (batch, bs, bs))


class DraftHead(nnx.Module):
  """The draft head (see the module docstring); ``cfg`` is kept as a static attribute."""

  def __init__(self, cfg: DraftConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    self.cfg = cfg
    self.fc = P.param(rngs, (len(cfg.target_layer_ids) * cfg.target_hidden_size, h), ("features", "embed"), dtype)
    self.hidden_norm = RMSNorm(h, eps, dtype=dtype)
    self.layers = nnx.List([
        DecoderLayer(Attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps=eps,
                               theta=cfg.rope_theta, dtype=dtype, rngs=rngs),
                     MLP(h, cfg.intermediate_size, dtype=dtype, rngs=rngs), h, eps, dtype=dtype)
        for _ in range(cfg.num_hidden_layers)])
    self.final_norm = RMSNorm(h, eps, dtype=dtype)

  def fuse(self, features: jax.Array) -> NormedRows:
    """Concatenated target taps [B, R, n_taps*Ht] -> ctx [B, R, H] = RMSNorm(features @ fc), as normed rows."""
    return self.hidden_norm.rows(features.astype(self.fc[...].dtype) @ self.fc[...])

  def context_kv(self, features: jax.Array, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Every layer's keys/values [B, Hkv, R, Dh] of context rows (taps [B, R, F]) at ``positions`` [B, R]."""
    ctx = self.fuse(features)
    # One operand per layer: XLA would merge the layers' projections of one shared ctx into a single dot over
    # their concatenated weights, copying every layer's K/V weights each round to do it.
    ctxs = jax.lax.optimization_barrier((ctx,) * len(self.layers))
    return [layer.attn.keys_values(c, positions) for layer, c in zip(self.layers, ctxs)]

  def append_context(self, cache: qwen3.KVCache, features: jax.Array, start: jax.Array,
                     table: jax.Array | None = None) -> qwen3.KVCache:
    """Add R context rows (target taps [B, R, F]) at positions start[b] + r of every layer's cache (page pools
    with a page ``table``)."""
    positions = start[:, None] + jnp.arange(features.shape[1], dtype=jnp.int32)[None, :]
    kv = self.context_kv(features, positions)
    return qwen3.KVCache(k=tuple(write_rows(c, k, start, table) for c, (k, _) in zip(cache.k, kv)),
                         v=tuple(write_rows(c, v, start, table) for c, (_, v) in zip(cache.v, kv)))

  def blocks(self, x: jax.Array, positions: jax.Array, attends) -> tuple[jax.Array, list]:
    """Block states x [B, T, H] through every layer (layer i attends with ``attends[i]``), final-normed;
    also returns what each layer's ``attend`` kept."""
    kept = []
    for i, layer in enumerate(self.layers):
      with jax.named_scope(f"draft_layer_{i}"):
        x, k = layer(x, positions, attends[i])
      kept.append(k)
    return self.final_norm(x), kept

  def draft_hidden(self, target: qwen3.Qwen3, cache: qwen3.KVCache, prefix_len: jax.Array, anchor: jax.Array,
                   attn_impl: str = "xla", mesh=None, table: jax.Array | None = None) -> tuple[jax.Array, qwen3.KVCache]:
    """Final-normed block states [B, bs, H] for block [anchor, mask...] after prefix_len context rows.

    Also returns the cache with the block's K/V written as scratch at prefix_len.. (masked out of
    later rounds and overwritten by the next ``append_context``); carrying it avoids a copy. ``table``: the
    cache holds page pools (``jetspec_jax.pages``)."""
    cfg = self.cfg
    batch, bs = anchor.shape[0], cfg.block_size
    tokens = jnp.concatenate([anchor[:, None], jnp.full((batch, bs - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    x = target.embed_tokens(tokens).astype(self.fc[...].dtype)
    positions = prefix_len[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]
    mask = block_mask(cfg, batch)
    attends = [cached_attention((k, v), prefix_len, mask, impl=attn_impl, mesh=mesh, table=table)
               for k, v in zip(cache.k, cache.v)]
    h, kept = self.blocks(x, positions, attends)
    return h, qwen3.KVCache(k=tuple(k for k, _ in kept), v=tuple(v for _, v in kept))

  def draft_logits(self, target: qwen3.Qwen3, cache: qwen3.KVCache, prefix_len: jax.Array, anchor: jax.Array,
                   depth: int | None = None, attn_impl: str = "xla", mesh=None,
                   table: jax.Array | None = None) -> tuple[jax.Array, qwen3.KVCache]:
    """Per-depth draft logits [B, depth, V] float32 (depth <= bs-1; slot d -> depth d), and the cache."""
    depth = self.cfg.depth if depth is None else depth
    h, cache = self.draft_hidden(target, cache, prefix_len, anchor, attn_impl, mesh, table)
    return target.logits(h[:, 1:depth + 1]), cache


HEAD = P.Declared(DraftHead)
abstract_model = HEAD.abstract
param_specs = HEAD.specs          # {name: ParamSpec} of every weight of ``DraftHead(cfg)``
init_head = HEAD.init             # (cfg, key, dtype, mesh): random weights, each created in its sharding
bind = HEAD.bind                  # (cfg, params): the DraftHead holding ``params``


def init_context_cache(cfg: DraftConfig, batch: int, max_len: int, dtype, mesh=None) -> qwen3.KVCache:
  """Per-layer context (and block scratch) K/V of the head, [B, Hkv, S, Dh] each."""
  return qwen3.zero_cache(cfg.num_hidden_layers, (batch, cfg.num_key_value_heads, max_len, cfg.head_dim), dtype,
                          mesh)


def init_context_pool(cfg: DraftConfig, groups: int, pages: int, page_rows: int, dtype, mesh=None) -> qwen3.KVCache:
  """The head's context cache paged: per layer a pool [groups, pages, Hkv, page_rows, Dh] (``jetspec_jax.pages``)."""
  return qwen3.zero_cache(cfg.num_hidden_layers, (groups, pages, cfg.num_key_value_heads, page_rows, cfg.head_dim),
                          dtype, mesh)

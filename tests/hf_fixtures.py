"""Tiny random Hugging Face Qwen3 / Qwen3-MoE models for tests, and small JAX-side helpers.

Models are built from small named configs (hidden 32-64, 2-3 layers, vocab <= 200) with a large
``initializer_range`` so greedy continuations are not degenerate repeats; the RMSNorm weights
(which transformers initialises to ones) are perturbed so the norm mappings are exercised too.
"""
from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jetspec_jax.models import qwen3

INIT_RANGE = 0.3

# name -> (kind, kwargs). Every entry is small enough to build in milliseconds.
CONFIGS: dict[str, tuple[str, dict]] = {
    # Untied, GQA 2, rope_theta = the library default.
    "dense": ("dense", dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            tie_word_embeddings=False, rope_theta=1_000_000.0)),
    # Tied embeddings, GQA 1 (MHA).
    "dense_tied": ("dense", dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                 tie_word_embeddings=True, rope_theta=10_000.0)),
    # head_dim (24) != hidden / heads (12), GQA 4, a small non-default RoPE theta.
    "dense_gqa4": ("dense", dict(vocab_size=160, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                 tie_word_embeddings=False, rope_theta=500.0)),
    # MoE, norm_topk_prob, layer 1 dense via mlp_only_layers (layers 0 and 2 sparse).
    "moe_norm": ("moe", dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                             decoder_sparse_step=1, tie_word_embeddings=False, rope_theta=10_000.0)),
    # MoE without renormalisation, decoder_sparse_step 2 (only layer 1 sparse), tied, theta 2e5.
    "moe_step2": ("moe", dict(vocab_size=112, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[],
                              decoder_sparse_step=2, tie_word_embeddings=True, rope_theta=200_000.0)),
    # Sharding: 8 query heads, 2 KV heads (replicated when the model axis is 4 or 8), vocab 100
    # (replicated when the model axis is 8). A smaller init range keeps logits ~O(3), so the 1e-5
# float32 bound has margin against reduction-order differences between layouts.
    "shard_dense": ("dense", dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                                  tie_word_embeddings=False, rope_theta=10_000.0, initializer_range=0.15)),
    "shard_moe": ("moe", dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=8,
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                              tie_word_embeddings=False, rope_theta=10_000.0, initializer_range=0.15)),
}


def hf_config(name: str, **overrides):
  """A transformers config object for a named test config."""
  kind, kw = CONFIGS[name]
  kw = {**kw, **overrides}
  theta = kw.pop("rope_theta")
  common = dict(initializer_range=kw.pop("initializer_range", INIT_RANGE), rms_norm_eps=1e-6, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": theta},
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
  cls = transformers.Qwen3Config if kind == "dense" else transformers.Qwen3MoeConfig
  return cls(**common, **kw)


def build_model(config, seed: int = 0):
  """A random float32 CausalLM (eval mode) for a transformers config, with perturbed norm weights."""
  torch.manual_seed(seed)
  cls = (transformers.Qwen3ForCausalLM if isinstance(config, transformers.Qwen3Config)
         else transformers.Qwen3MoeForCausalLM)
  model = cls(config).to(torch.float32).eval()
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = None
  return model


@functools.lru_cache(maxsize=None)
def named_model(name: str):
  """The (cached) random float32 model of a named config. Do not mutate it."""
  return build_model(hf_config(name), seed=sum(map(ord, name)))


def save_model(model, out_dir: str, dtype: str = "float32", max_shard_size=None) -> str:
  """``save_pretrained`` in ``dtype`` ('float32' | 'bfloat16'); a small ``max_shard_size`` (bytes or
  e.g. '20KB') gives sharded safetensors + model.safetensors.index.json."""
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
  m = model if torch_dtype == torch.float32 else copy.deepcopy(model).to(torch_dtype)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  m.save_pretrained(out_dir, **kwargs)
  return out_dir


def hf_logits(model, tokens: np.ndarray, output_hidden_states: bool = False):
  """transformers logits (float32 numpy) for a [B, T] batch without padding."""
  with torch.no_grad():
    out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long), output_hidden_states=output_hidden_states)
  logits = out.logits.float().numpy()
  if output_hidden_states:
    return logits, [h.float().numpy() for h in out.hidden_states]
  return logits


def hf_greedy(model, prompt, max_new_tokens: int, eos_id=None) -> list[int]:
  """transformers greedy ``generate`` for one prompt; returns only the new tokens (EOS included)."""
  ids = torch.as_tensor([list(prompt)], dtype=torch.long)
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=0, do_sample=False, eos_token_id=eos_id, pad_token_id=0)
  return out[0, ids.shape[1]:].tolist()


def target_forward(params, cfg, tokens, positions, cache, prefix_len, block_mask, **kw):
  """(logits, new cache, taps) of T new rows: the tests' shorthand for ``Qwen3.hidden`` then ``Qwen3.logits``."""
  target = qwen3.bind(cfg, params)
  h, cache, taps = target.hidden(tokens, positions, block_mask, cache=cache, prefix_len=prefix_len, **kw)
  return target.logits(h), cache, taps


@functools.lru_cache(maxsize=None)
def _jit_forward(cfg, tap_layers, mesh):
  return jax.jit(functools.partial(target_forward, cfg=cfg, tap_layers=tap_layers, mesh=mesh))


def jax_forward(params, cfg, tokens, tap_layers=(), mesh=None):
  """Prefill a [B, T] batch from an empty cache: returns (logits [B, T, V], taps) as numpy."""
  tokens = jnp.asarray(tokens, jnp.int32)
  batch, length = tokens.shape
  cache = qwen3.init_cache(cfg, batch, length, jnp.float32, mesh)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  fwd = _jit_forward(cfg, tuple(tap_layers), mesh)
  logits, _, taps = fwd(params, tokens=tokens, positions=positions, cache=cache,
                        prefix_len=jnp.zeros((batch,), jnp.int32), block_mask=qwen3.causal_mask(batch, length))
  return np.asarray(logits), None if taps is None else np.asarray(taps)


def random_tokens(vocab_size: int, shape, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab_size, size=shape).astype(np.int32)

"""Logits and tapped residuals of the JAX Qwen3 / Qwen3-MoE forward against transformers (float32)."""
import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures
from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import qwen3

PARITY_CONFIGS = ["dense", "dense_tied", "dense_gqa4", "moe_norm", "moe_step2"]
ATOL = 1e-4


def test_configs_cover_the_required_variants(jax_target):
  """The parity set spans tied/untied, GQA 1/2/4, head_dim != hidden/heads, both MoE routings,
  mlp_only_layers, decoder_sparse_step 2 and several RoPE thetas."""
  cfgs = {n: jax_target(n)[0] for n in PARITY_CONFIGS}
  assert {c.tie_word_embeddings for c in cfgs.values()} == {True, False}
  assert {c.num_attention_heads // c.num_key_value_heads for c in cfgs.values()} >= {1, 2, 4}
  assert any(c.head_dim * c.num_attention_heads != c.hidden_size for c in cfgs.values())
  moe = [c for c in cfgs.values() if c.num_experts]
  assert {c.norm_topk_prob for c in moe} == {True, False}
  assert cfgs["moe_norm"].mlp_only_layers == (1,)
  assert [cfgs["moe_norm"].is_moe_layer(i) for i in range(3)] == [True, False, True]
  assert cfgs["moe_step2"].decoder_sparse_step == 2
  assert [cfgs["moe_step2"].is_moe_layer(i) for i in range(3)] == [False, True, False]
  assert len({c.rope_theta for c in cfgs.values()}) >= 3
  assert cfgs["dense"].rope_theta == Qwen3Config.__dataclass_fields__["rope_theta"].default
  assert cfgs["dense_gqa4"].rope_theta == 500.0


@pytest.mark.parametrize("name", PARITY_CONFIGS)
def test_logits_and_taps_match_transformers(name, jax_target):
  cfg, params = jax_target(name)
  model = hf_fixtures.named_model(name)
  tokens = hf_fixtures.random_tokens(cfg.vocab_size, (2, 11), seed=1)
  ref_logits, ref_hidden = hf_fixtures.hf_logits(model, tokens, output_hidden_states=True)
  taps_at = tuple(range(cfg.num_hidden_layers - 1))
  logits, taps = hf_fixtures.jax_forward(params, cfg, tokens, tap_layers=taps_at)
  assert logits.shape == ref_logits.shape and logits.dtype == np.float32
  np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=ATOL)
  # Not degenerate: rows actually differ and the logits are not tiny.
  assert np.abs(ref_logits).max() > 1.0
  assert taps.shape == (2, 11, len(taps_at) * cfg.hidden_size)
  for j, layer in enumerate(taps_at):
    got = taps[..., j * cfg.hidden_size:(j + 1) * cfg.hidden_size]
    np.testing.assert_allclose(got, ref_hidden[layer + 1], rtol=0, atol=ATOL, err_msg=f"tap of layer {layer}")


def test_taps_follow_requested_order(jax_target):
  cfg, params = jax_target("dense")
  tokens = hf_fixtures.random_tokens(cfg.vocab_size, (1, 5), seed=2)
  _, taps_fwd = hf_fixtures.jax_forward(params, cfg, tokens, tap_layers=(0, 1))
  _, taps_rev = hf_fixtures.jax_forward(params, cfg, tokens, tap_layers=(1, 0))
  h = cfg.hidden_size
  np.testing.assert_array_equal(taps_fwd[..., :h], taps_rev[..., h:])
  np.testing.assert_array_equal(taps_fwd[..., h:], taps_rev[..., :h])


@pytest.mark.parametrize("name", ["dense_gqa4", "moe_norm"])
def test_chunked_prefill_through_cache_matches_transformers(name, jax_target):
  """Prefill a first chunk, then feed the rest at per-row offsets through the KV cache."""
  import jax
  cfg, params = jax_target(name)
  model = hf_fixtures.named_model(name)
  tokens = hf_fixtures.random_tokens(cfg.vocab_size, (2, 12), seed=3)
  ref = hf_fixtures.hf_logits(model, tokens)
  first = np.array([5, 8], np.int32)        # per-row committed lengths after the first chunk
  cache = qwen3.init_cache(cfg, 2, 12, jnp.float32)
  fwd = jax.jit(hf_fixtures.target_forward, static_argnames=("cfg",))
  # First chunk: 8 rows each; row 0 only really commits 5 (its rows 5..7 are overwritten next).
  chunk = jnp.asarray(tokens[:, :8])
  pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
  logits1, cache, _ = fwd(params, cfg=cfg, tokens=chunk, positions=pos, cache=cache,
                          prefix_len=jnp.zeros(2, jnp.int32), block_mask=qwen3.causal_mask(2, 8))
  np.testing.assert_allclose(np.asarray(logits1), ref[:, :8], rtol=0, atol=ATOL)
  # Second chunk: 4 rows at offsets 5 and 8.
  rest = np.stack([tokens[0, 5:9], tokens[1, 8:12]])
  pos2 = jnp.asarray(first[:, None] + np.arange(4, dtype=np.int32)[None])
  logits2, _, _ = fwd(params, cfg=cfg, tokens=jnp.asarray(rest), positions=pos2, cache=cache,
                      prefix_len=jnp.asarray(first), block_mask=qwen3.causal_mask(2, 4))
  logits2 = np.asarray(logits2)
  np.testing.assert_allclose(logits2[0], ref[0, 5:9], rtol=0, atol=ATOL)
  np.testing.assert_allclose(logits2[1], ref[1, 8:12], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["dense", "moe_norm"])
def test_bfloat16_forward_is_as_accurate_as_transformers_bfloat16(name, hf_dir):
  """bf16 weights on CPU (batch 2, 2 KV heads: a dot XLA:CPU cannot do in bf16 -> f32 directly).
  Against the float32 reference, JAX bf16 errs about as much as transformers bf16 does."""
  import copy

  import jax
  import torch
  from jetspec_jax import convert
  cfg, params, _ = convert.load_target(hf_dir(name, "bfloat16"))
  assert params["embed"].dtype == jnp.bfloat16
  model = hf_fixtures.named_model(name)
  tokens = hf_fixtures.random_tokens(cfg.vocab_size, (2, 11), seed=1)
  ref32 = hf_fixtures.hf_logits(model, tokens)
  ref16 = hf_fixtures.hf_logits(copy.deepcopy(model).to(torch.bfloat16), tokens)
  cache = qwen3.init_cache(cfg, 2, 11, jnp.bfloat16)
  logits, cache, _ = jax.jit(hf_fixtures.target_forward, static_argnames=("cfg",))(
      params, cfg=cfg, tokens=jnp.asarray(tokens), positions=jnp.broadcast_to(jnp.arange(11), (2, 11)),
      cache=cache, prefix_len=jnp.zeros(2, jnp.int32), block_mask=qwen3.causal_mask(2, 11))
  logits = np.asarray(logits)
  assert logits.dtype == np.float32 and cache.k[0].dtype == jnp.bfloat16 and np.isfinite(logits).all()
  ours, theirs = np.abs(logits - ref32).mean(), np.abs(ref16 - ref32).mean()
  assert ours <= 2 * theirs + 1e-3, (ours, theirs)

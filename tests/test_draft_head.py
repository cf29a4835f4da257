"""Draft head: equations vs an independent float64 NumPy implementation, HF format round trip."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from jetspec_jax import convert
from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import draft_head, qwen3

TARGET = Qwen3Config(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=10, rope_theta=5e5)


def make_head(causal=True, layers=2, block=5):
  cfg = draft_head.DraftConfig.for_target(TARGET, num_layers=layers, block_size=block, causal=causal,
                                          intermediate_size=36)
  params = draft_head.init_head(cfg, jax.random.key(3))
  params = {k: v * 10 if v.ndim > 1 else v + 0.1 * jax.random.normal(jax.random.key(len(k)), v.shape)
            for k, v in params.items()}
  return cfg, params


def target_params():
  p = qwen3.init_target(TARGET, jax.random.key(4))
  return {k: v * 10 if v.ndim > 1 else v for k, v in p.items()}


# ---- independent float64 reference -------------------------------------------------------------
def _rms(x, w, eps):
  return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def _rope(x, pos, theta):
  d = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
  ang = pos[:, None] * inv[None]
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
  rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
  return x * cos[:, None] + rot * sin[:, None]


def reference_logits(hp, cfg, tp, feats, anchor):
  """One sequence: feats [C, F] (context rows 0..C-1), anchor int -> logits [bs-1, V] in float64."""
  f64 = lambda a: np.asarray(a, np.float64)
  hp, tp = {k: f64(v) for k, v in hp.items()}, {k: f64(v) for k, v in tp.items()}
  eps, bs, c = cfg.rms_norm_eps, cfg.block_size, feats.shape[0]
  ctx = _rms(f64(feats) @ hp["fc"], hp["hidden_norm.weight"], eps)
  x = tp["embed"][[anchor] + [cfg.mask_token_id] * (bs - 1)]
  ctx_pos, blk_pos = np.arange(c), c + np.arange(bs)
  group = cfg.num_attention_heads // cfg.num_key_value_heads
  for i in range(cfg.num_hidden_layers):
    p = lambda n: hp[f"layers.{i}.{n}"]
    h = _rms(x, p("input_norm.weight"), eps)
    q = _rope(_rms(np.einsum("th,hnd->tnd", h, p("attn.q_proj")), p("attn.q_norm.weight"), eps), blk_pos, cfg.rope_theta)
    k = np.concatenate([np.einsum("th,hnd->tnd", ctx, p("attn.k_proj")), np.einsum("th,hnd->tnd", h, p("attn.k_proj"))])
    v = np.concatenate([np.einsum("th,hnd->tnd", ctx, p("attn.v_proj")), np.einsum("th,hnd->tnd", h, p("attn.v_proj"))])
    k = _rope(_rms(k, p("attn.k_norm.weight"), eps), np.concatenate([ctx_pos, blk_pos]), cfg.rope_theta)
    out = np.zeros_like(q)
    for head in range(cfg.num_attention_heads):
      kv = head // group
      s = q[:, head] @ k[:, kv].T / np.sqrt(cfg.head_dim)                      # [bs, C+bs]
      allowed = np.ones((bs, c + bs), bool)
      if cfg.causal:
        allowed[:, c:] = np.tril(np.ones((bs, bs), bool))
      s = np.where(allowed, s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + np.einsum("tnd,ndh->th", out, p("attn.o_proj"))
    h = _rms(x, p("post_attn_norm.weight"), eps)
    g = h @ p("mlp.gate_up")[:, 0]
    x = x + ((g / (1 + np.exp(-g))) * (h @ p("mlp.gate_up")[:, 1])) @ p("mlp.down")
  x = _rms(x, hp["final_norm.weight"], eps)
  return x[1:] @ tp["lm_head"]


@pytest.mark.parametrize("causal", [True, False])
def test_logits_match_float64_numpy(causal):
  cfg, hp = make_head(causal)
  tp = target_params()
  rng = np.random.default_rng(0)
  ctx_lens = [7, 3]
  feats = rng.normal(size=(2, 7, len(cfg.target_layer_ids) * TARGET.hidden_size)).astype(np.float32)
  anchor = np.array([5, 17], np.int32)
  cache = draft_head.init_context_cache(cfg, 2, 16, jnp.float32)
  cache = draft_head.bind(cfg, hp).append_context(cache, jnp.asarray(feats), jnp.zeros(2, jnp.int32))
  logits, _ = draft_head.bind(cfg, hp).draft_logits(qwen3.bind(TARGET, tp), cache, jnp.asarray(ctx_lens),
                                                    jnp.asarray(anchor))
  assert logits.shape == (2, cfg.block_size - 1, TARGET.vocab_size)
  for b in range(2):
    ref = reference_logits(hp, cfg, tp, feats[b, :ctx_lens[b]], int(anchor[b]))
    np.testing.assert_allclose(np.asarray(logits[b]), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_context_cache_appended_in_chunks_equals_one_shot():
  cfg, hp = make_head()
  tp = target_params()
  feats = jnp.asarray(np.random.default_rng(1).normal(size=(1, 9, 2 * TARGET.hidden_size)), jnp.float32)
  one = draft_head.bind(cfg, hp).append_context(draft_head.init_context_cache(cfg, 1, 20, jnp.float32), feats,
                                  jnp.zeros(1, jnp.int32))
  chunks = draft_head.init_context_cache(cfg, 1, 20, jnp.float32)
  for start, stop in [(0, 4), (4, 5), (5, 9)]:
    chunks = draft_head.bind(cfg, hp).append_context(chunks, feats[:, start:stop], jnp.array([start]))
  anchor, ctx_len = jnp.array([3]), jnp.array([9])
  a, _ = draft_head.bind(cfg, hp).draft_logits(qwen3.bind(TARGET, tp), one, ctx_len, anchor)
  b, _ = draft_head.bind(cfg, hp).draft_logits(qwen3.bind(TARGET, tp), chunks, ctx_len, anchor)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_default_target_layers_follow_the_published_rule():
  assert draft_head.default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
  assert draft_head.default_target_layer_ids(48, 1) == (24,)
  assert draft_head.default_target_layer_ids(TARGET.num_hidden_layers, 2) == (1, 3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_hf_format_round_trip(tmp_path, dtype):
  cfg, hp = make_head()
  hp = {k: v.astype(dtype) for k, v in hp.items()}
  out = tmp_path / "head"
  convert.save_head(str(out), cfg, hp)
  config = json.loads((out / "config.json").read_text())
  assert config["block_size"] == cfg.block_size
  assert config["num_target_layers"] == TARGET.num_hidden_layers
  assert config["dflash_config"] == {"causal_head": True, "target_layer_ids": [1, 3],
                                     "mask_token_id": cfg.mask_token_id,
                                     "target_hidden_size": TARGET.hidden_size}
  with safe_open(str(out / "model.safetensors"), "numpy") as f:
    keys = set(f.keys())
  expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
  for i in range(cfg.num_hidden_layers):
    expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
    expected |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
    expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    expected |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
  assert keys == expected
  cfg2, hp2 = convert.load_head(str(out), target_cfg=TARGET)
  assert cfg2 == cfg
  for k in hp:
    assert hp2[k].dtype == hp[k].dtype
    np.testing.assert_array_equal(np.asarray(hp2[k]), np.asarray(hp[k]))
  tp = target_params()
  cache = draft_head.init_context_cache(cfg, 1, 12, dtype)
  feats = jnp.ones((1, 4, 2 * TARGET.hidden_size), dtype)
  outs = []
  for p in (hp, hp2):
    c = draft_head.bind(cfg, p).append_context(cache, feats, jnp.zeros(1, jnp.int32))
    logits, _ = draft_head.bind(cfg, p).draft_logits(qwen3.bind(TARGET, tp), c, jnp.array([4]), jnp.array([2]))
    outs.append(np.asarray(logits))
  np.testing.assert_array_equal(outs[0], outs[1])


def test_head_for_another_target_is_rejected(tmp_path):
  cfg, hp = make_head()
  convert.save_head(str(tmp_path / "h"), cfg, hp)
  other = Qwen3Config(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=10)
  with pytest.raises(Exception, match="taps target layer 3"):
    convert.load_head(str(tmp_path / "h"), target_cfg=other)
  with pytest.raises(Exception, match="not found"):
    convert.load_head(str(tmp_path / "missing"))

"""The attention implementations inside the jitted loops: Pallas (interpret mode) == XLA, on a mesh too."""
import functools

import jax
import numpy as np
import pytest

from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.generation import Generator
from jetspec_jax.decode.prompts import batch_prompts
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.sharding import make_mesh
from cuda_lowering import cuda_target
from greedy import assert_agree

CFG = Qwen3Config(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, rope_theta=10000.0)
PROMPTS = [[3, 1, 4, 1, 5, 9], [2, 7]]
TREE = TreeConfig("accum_logp", 16, 3, 3)


@functools.lru_cache(maxsize=None)
def models():
  tp = {k: v * 20 if v.ndim > 1 else v for k, v in qwen3.init_target(CFG, jax.random.key(0)).items()}
  hcfg = draft_head.DraftConfig.for_target(CFG, num_layers=1, block_size=4)
  return tp, hcfg, draft_head.init_head(hcfg, jax.random.key(1))


def place(params, specs, mesh):
  from jetspec_jax.sharding import named_sharding
  return {k: jax.device_put(v, named_sharding(specs[k].axes, v.shape, mesh)) for k, v in params.items()}


@functools.lru_cache(maxsize=None)
def reference():
  tp, hcfg, hp = models()
  return Generator(CFG, tp, head_cfg=hcfg, head_params=hp, tree=TREE).generate(PROMPTS, 10).tokens


def test_pallas_interpret_matches_xla_in_the_speculative_loop():
  tp, hcfg, hp = models()
  out = Generator(CFG, tp, head_cfg=hcfg, head_params=hp, tree=TREE, attn_impl="pallas_interpret").generate(PROMPTS, 10)
  assert_agree(CFG, tp, PROMPTS, reference(), out.tokens)
  ar = Generator(CFG, tp, attn_impl="pallas_interpret").generate(PROMPTS, 10)
  assert_agree(CFG, tp, PROMPTS, reference(), ar.tokens)


def test_the_loops_use_the_kernel_tuning_table_they_are_given(monkeypatch):
  """With a tuning table in the attention choice, every kernel launch the loops trace takes the table's
  configuration (here: small tiles and two prefix splits for every problem), and the tokens stay those of XLA."""
  from jetspec_jax.attention import AttentionImpl
  from pallas_kernels import tree_attention as ta
  from pallas_kernels import tuning
  config = tuning.LaunchConfig(block_r=16, block_k=16, num_warps=2, num_stages=3, num_splits=2)
  impl = AttentionImpl("pallas_interpret", tuning.KernelTuning(rules=((1, config),)))
  launched = []
  launch = ta._launch
  monkeypatch.setattr(ta, "_launch", lambda *a, shapes, **kw: (launched.append(shapes), launch(*a, shapes=shapes, **kw))[1])
  tp, hcfg, hp = models()
  new = 7                                  # shapes no other test traces: nothing compiled earlier is reused
  ref = Generator(CFG, tp, head_cfg=hcfg, head_params=hp, tree=TREE).generate(PROMPTS, new).tokens
  kernel = Generator(CFG, tp, head_cfg=hcfg, head_params=hp, tree=TREE, attn_impl=impl)
  out = kernel.generate(PROMPTS, new)
  assert_agree(CFG, tp, PROMPTS, ref, out.tokens)
  assert_agree(CFG, tp, PROMPTS, ref, Generator(CFG, tp, attn_impl=impl).generate(PROMPTS, new).tokens)
  assert launched and all((s.block_r, s.block_k, s.num_warps, s.num_stages, s.num_splits) == (16, 16, 2, 3, 2)
                          for s in launched)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_speculative_loop_on_a_2x2_mesh(impl):
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  tp, hcfg, hp = models()
  mesh = make_mesh(2, 2, jax.devices()[:4])
  tp = place(tp, qwen3.param_specs(CFG), mesh)
  hp = place(hp, draft_head.param_specs(hcfg), mesh)
  assert "model" in str(tp["layers.0.attn.q_proj"].sharding.spec)
  out = Generator(CFG, tp, head_cfg=hcfg, head_params=hp, tree=TREE, attn_impl=impl, mesh=mesh).generate(PROMPTS, 10)
  assert_agree(CFG, tp, PROMPTS, reference(), out.tokens)


def _long_prompts():
  rng = np.random.default_rng(7)
  return [rng.integers(1, CFG.vocab_size, size=560).tolist(), rng.integers(1, CFG.vocab_size, size=300).tolist()]


def test_prefix_splits_in_the_loops_match_xla():
  """Long prompts make the kernel split the prefix (flash-decoding) in verify and AR steps alike."""
  from pallas_kernels.tree_attention import launch_shapes
  from jetspec_jax.decode.speculative import cache_lengths
  tp, hcfg, hp = models()
  prompts, new = _long_prompts(), 8
  target_len, _ = cache_lengths(560, new, hcfg, TREE)
  for num_q in (TREE.num_nodes(), 1):
    shapes = launch_shapes(2, num_q, CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim,
                           cache_len=target_len - num_q)
    assert shapes.num_splits >= 2
  ref = Generator(CFG, tp, head_cfg=hcfg, head_params=hp, tree=TREE).generate(prompts, new).tokens
  kernel = Generator(CFG, tp, head_cfg=hcfg, head_params=hp, tree=TREE, attn_impl="pallas_interpret")
  out = kernel.generate(prompts, new)
  assert_agree(CFG, tp, prompts, ref, out.tokens)
  assert_agree(CFG, tp, prompts, ref, Generator(CFG, tp, attn_impl="pallas_interpret").generate(prompts, new).tokens)


def test_decode_loops_lower_for_cuda_with_the_kernel(triton_modules):
  """The whole jitted speculative loop and AR loop, attention "pallas", lower for a GPU on this CPU
  machine, and every Triton module they contain verifies."""
  from jetspec_jax.decode import loop, speculative
  tp, hcfg, hp = models()
  tokens, lengths = batch_prompts(PROMPTS, CFG.vocab_size)
  target_len, draft_len = speculative.cache_lengths(tokens.shape[1], 10, hcfg, TREE)
  base, taps = loop.prefill(tp, qwen3.init_cache(CFG, 2, target_len, tp["embed"].dtype), tokens, lengths,
                            jax.random.key(0), cfg=CFG, max_new_tokens=10, eos_ids=(), temperature=0.0,
                            attn_impl="xla", tap_layers=hcfg.target_layer_ids)
  draft_cache = speculative.prefill_context(hp, draft_head.init_context_cache(hcfg, 2, draft_len, hp["fc"].dtype),
                                            taps, head_cfg=hcfg)
  state = speculative.init_state(base, draft_cache, TREE)
  with cuda_target():
    lowered = {
        "speculative": speculative.spec_decode.trace(tp, hp, state, cfg=CFG, head_cfg=hcfg, tree_cfg=TREE,
                                                     eos_ids=(), attn_impl="pallas"),
        "ar": loop.ar_decode.trace(tp, base, cfg=CFG, eos_ids=(), temperature=0.0, attn_impl="pallas"),
    }
    texts = {name: traced.lower(lowering_platforms=("cuda",)).as_text() for name, traced in lowered.items()}
  for name, text in texts.items():
    assert "__gpu$xla.gpu.triton" in text, name    # (one kernel function, called by every layer)
  assert triton_modules and all(error is None for _, error in triton_modules), triton_modules


@pytest.mark.parametrize("prefix", [0, 5])
def test_chunked_attention_equals_xla(prefix):
  """``xla_chunked`` (query blocks of 16; T = 40 is padded to 48) == ``xla`` on packed rows' segment-causal
  masks, with and without a committed prefix, float32 to 1e-5."""
  from jetspec_jax import attention
  batch, t, nkv, group, dh = 2, 40, 2, 3, 16
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (batch, t, nkv * group, dh))
  k = jax.random.normal(keys[1], (batch, nkv, prefix + t + 3, dh))
  v = jax.random.normal(keys[2], (batch, nkv, prefix + t + 3, dh))
  segments = np.repeat(np.array([[1, 2, 3, 0], [1, 1, 2, 2]]), t // 4, axis=1)
  mask = qwen3.segment_causal_mask(jax.numpy.asarray(segments))
  prefix_len = jax.numpy.full((batch,), prefix, jax.numpy.int32)
  ref = attention.xla_attention(q, k, v, prefix_len, mask)
  out = attention.chunked_attention(q, k, v, prefix_len, mask, chunk=16)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(attention.attention(q, k, v, prefix_len, mask, impl="xla_chunked")),
                                np.asarray(attention.xla_attention(q, k, v, prefix_len, mask)))   # T <= 256: dense

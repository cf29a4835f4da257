"""The attention implementations inside the engine's jitted loop (decode rows and prefill lanes): Pallas
(interpret mode) == XLA, on a mesh too, and the loop lowers for a GPU with the Triton kernel."""
import functools

import jax
import numpy as np
import pytest

from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.engine import Engine, Request, generate
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


def speculative(tp, hcfg, hp, prompts, new, **kw) -> list[list[int]]:
  """The speculative engine's tokens (one slot per prompt, no EOS)."""
  return generate(CFG, tp, prompts, new, head_cfg=hcfg, head_params=hp, tree=TREE, eos_ids=(), **kw).tokens


def autoregressive(tp, prompts, new, **kw) -> list[list[int]]:
  return generate(CFG, tp, prompts, new, eos_ids=(), **kw).tokens


@functools.lru_cache(maxsize=None)
def reference():
  tp, hcfg, hp = models()
  return speculative(tp, hcfg, hp, PROMPTS, 10)


def record_launches(monkeypatch) -> list:
  """Every kernel launch traced from here on: (query shape [B, num_q, H, Dh], LaunchShapes)."""
  from pallas_kernels import tree_attention as ta
  launched, launch = [], ta._launch
  monkeypatch.setattr(ta, "_launch", lambda *a, shapes, **kw: (launched.append((a[0].shape, shapes)),
                                                               launch(*a, shapes=shapes, **kw))[1])
  return launched


def test_pallas_interpret_matches_xla_in_the_engine():
  tp, hcfg, hp = models()
  assert_agree(CFG, tp, PROMPTS, reference(), speculative(tp, hcfg, hp, PROMPTS, 10, attn_impl="pallas_interpret"))
  assert_agree(CFG, tp, PROMPTS, reference(), autoregressive(tp, PROMPTS, 10, attn_impl="pallas_interpret"))


def test_the_engine_uses_the_kernel_tuning_table_it_is_given(monkeypatch):
  """With a tuning table in the attention choice, every kernel launch the engine traces (decode rows and prefill
  lanes) takes the table's configuration (here: small tiles and two prefix splits for every problem), and the
  tokens stay those of XLA."""
  from jetspec_jax.attention import AttentionImpl
  from pallas_kernels import tuning
  config = tuning.LaunchConfig(block_r=16, block_k=16, num_warps=2, num_stages=3, num_splits=2)
  impl = AttentionImpl("pallas_interpret", tuning.KernelTuning(rules=((1, config),)))
  launched = record_launches(monkeypatch)
  tp, hcfg, hp = models()
  new = 7                                  # shapes no other test traces: nothing compiled earlier is reused
  ref = speculative(tp, hcfg, hp, PROMPTS, new)
  assert_agree(CFG, tp, PROMPTS, ref, speculative(tp, hcfg, hp, PROMPTS, new, attn_impl=impl))
  assert_agree(CFG, tp, PROMPTS, ref, autoregressive(tp, PROMPTS, new, attn_impl=impl))
  assert {q[1] for q, _ in launched} >= {TREE.num_nodes(), 1, 16}     # tree rows, AR rows, the lanes (cache_rows: 16)
  assert all((s.block_r, s.block_k, s.num_warps, s.num_stages, s.num_splits) == (16, 16, 2, 3, 2)
             for _, s in launched)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_speculative_engine_on_a_2x2_mesh(impl):
  """Two groups of slots over the data axis, heads over the model axis (the kernel per shard)."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  tp, hcfg, hp = models()
  mesh = make_mesh(2, 2, jax.devices()[:4])
  tp = place(tp, qwen3.param_specs(CFG), mesh)
  hp = place(hp, draft_head.param_specs(hcfg), mesh)
  assert "model" in str(tp["layers.0.attn.q_proj"].sharding.spec)
  out = speculative(tp, hcfg, hp, PROMPTS, 10, attn_impl=impl, mesh=mesh, groups=2)
  assert_agree(CFG, tp, PROMPTS, reference(), out)


def _long_prompts():
  rng = np.random.default_rng(7)
  return [rng.integers(1, CFG.vocab_size, size=560).tolist(), rng.integers(1, CFG.vocab_size, size=300).tolist()]


def test_prefix_splits_in_the_engine_match_xla(monkeypatch):
  """Long prompts make the kernel split the prefix (flash-decoding) for tree rows and AR rows alike."""
  tp, hcfg, hp = models()
  prompts, new = _long_prompts(), 8
  launched = record_launches(monkeypatch)
  ref = speculative(tp, hcfg, hp, prompts, new)
  assert_agree(CFG, tp, prompts, ref, speculative(tp, hcfg, hp, prompts, new, attn_impl="pallas_interpret"))
  assert_agree(CFG, tp, prompts, ref, autoregressive(tp, prompts, new, attn_impl="pallas_interpret"))
  assert {q[1] for q, s in launched if s.num_splits >= 2} >= {TREE.num_nodes(), 1}


def test_the_engine_loop_lowers_for_cuda_with_the_kernel(triton_modules):
  """The whole jitted engine loop (``Engine.step``'s program: prefill lanes, tree verification; and AR), attention
  "pallas", lowers for a GPU on this CPU machine, and every Triton module it contains verifies."""
  tp, hcfg, hp = models()
  requests = [Request(p, 10) for p in PROMPTS]
  texts = {}
  for name, kw in (("speculative", dict(head_cfg=hcfg, head_params=hp, tree=TREE)), ("ar", {})):
    engine = Engine.for_requests(CFG, tp, requests, slots=2, prefill_rows=8, eos_ids=(), attn_impl="pallas", **kw)
    engine.start()                                   # the state on this machine's devices, then trace for CUDA
    with cuda_target():
      texts[name] = engine.trace(rounds=1).lower(lowering_platforms=("cuda",)).as_text()
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

"""The attention implementations inside the jitted loops: Pallas (interpret mode) == XLA, on a mesh too."""
import functools

import jax
import numpy as np
import pytest

from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.loop import generate_ar
from jetspec_jax.decode.speculative import TreeConfig, generate_speculative
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.sharding import make_mesh

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
  return generate_speculative(tp, CFG, hp, hcfg, PROMPTS, max_new_tokens=10, tree_cfg=TREE)["token_ids"]


def test_pallas_interpret_matches_xla_in_the_speculative_loop():
  tp, hcfg, hp = models()
  out = generate_speculative(tp, CFG, hp, hcfg, PROMPTS, max_new_tokens=10, tree_cfg=TREE,
                             attn_impl="pallas_interpret")
  assert out["token_ids"] == reference()
  ar = generate_ar(tp, CFG, PROMPTS, max_new_tokens=10, attn_impl="pallas_interpret")
  assert ar["token_ids"] == reference()


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_speculative_loop_on_a_2x2_mesh(impl):
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  tp, hcfg, hp = models()
  mesh = make_mesh(2, 2, jax.devices()[:4])
  tp = place(tp, qwen3.param_specs(CFG), mesh)
  hp = place(hp, draft_head.param_specs(hcfg), mesh)
  assert "model" in str(tp["layers.0.q_proj"].sharding.spec)
  out = generate_speculative(tp, CFG, hp, hcfg, PROMPTS, max_new_tokens=10, tree_cfg=TREE, attn_impl=impl,
                             mesh=mesh)
  assert out["token_ids"] == reference()

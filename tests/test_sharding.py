"""Sharded forward on 8 fake CPU devices equals the unsharded one; logical-axis rules and meshes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hf_fixtures
from greedy import assert_agree
from jetspec_jax import convert, sharding
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import reference
from jetspec_jax.decode.engine import generate
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import qwen3

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("eight_devices")


def _spec_axes(arr):
  return tuple(arr.sharding.spec)


@pytest.mark.parametrize("data,model", MESHES, ids=[f"{d}x{m}" for d, m in MESHES])
@pytest.mark.parametrize("name", ["shard_dense", "shard_moe"])
def test_sharded_forward_equals_unsharded(name, data, model, hf_dir, jax_target):
  cfg, ref_params = jax_target(name)
  tokens = hf_fixtures.random_tokens(cfg.vocab_size, (8, 7), seed=5)
  taps_at = (0,)
  ref_logits, ref_taps = hf_fixtures.jax_forward(ref_params, cfg, tokens, tap_layers=taps_at)
  mesh = sharding.make_mesh(data, model)
  cfg2, params, _ = convert.load_target(hf_dir(name), jnp.float32, mesh)
  assert cfg2 == cfg
  # The weights really are laid out on the mesh.
  q = params["layers.0.attn.q_proj"]
  assert q.sharding.mesh.shape == {"data": data, "model": model}
  if model > 1:
    assert _spec_axes(q) == (None, "model", None)
    assert len({s.data.shape for s in q.addressable_shards}) == 1
    assert q.addressable_shards[0].data.shape == (cfg.hidden_size, cfg.num_attention_heads // model, cfg.head_dim)
    assert "model" in _spec_axes(params.get("layers.0.mlp.gate", params.get("layers.0.mlp.gate_up")))  # experts, dense
  else:
    assert all(a is None for a in _spec_axes(q))
  kv_spec = _spec_axes(params["layers.0.attn.k_proj"])
  if model > 1 and cfg.num_key_value_heads % model:
    assert kv_spec == (None, None, None)          # replicated KV heads
  elif model > 1:
    assert kv_spec == (None, "model", None)
  logits, taps = hf_fixtures.jax_forward(params, cfg, tokens, tap_layers=taps_at, mesh=mesh)
  np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=ATOL)
  # Residuals are larger than logits: allow a relative float32 reduction-order difference too.
  np.testing.assert_allclose(taps, ref_taps, rtol=ATOL, atol=ATOL)


def test_replicated_kv_configs_are_covered(jax_target):
  """shard_dense has 2 KV heads: sharded on a model axis of 2, replicated on 4 and 8."""
  cfg, _ = jax_target("shard_dense")
  assert cfg.num_key_value_heads == 2 and cfg.num_attention_heads == 8
  assert cfg.vocab_size % 8 and cfg.vocab_size % 4 == 0


def test_cache_is_sharded(jax_target):
  cfg, _ = jax_target("shard_dense")
  cache = qwen3.init_cache(cfg, 8, 16, jnp.float32, sharding.make_mesh(4, 2))
  assert _spec_axes(cache.k[0]) == ("data", "model", None, None)
  cache = qwen3.init_cache(cfg, 8, 16, jnp.float32, sharding.make_mesh(2, 4))
  assert _spec_axes(cache.k[0]) == ("data", None, None, None)      # 2 KV heads on 4: replicated


def test_8b_cache_is_born_in_its_shards():
  """An 8B-width KV buffer (batch 64, 4k positions, 8 KV heads, bf16: 512 MiB) on a 1x8 mesh is created by a
  program whose every array is one shard (64 MiB): no device ever holds the whole buffer."""
  mesh = sharding.make_mesh(1, 8)
  shape, dtype = (64, 8, 4096, 128), jnp.dtype(jnp.bfloat16)
  spec = sharding.named_sharding(qwen3.CACHE_AXES, shape, mesh)
  compiled = qwen3.zero_cache_program(shape, dtype, spec).lower().compile()
  shard_bytes = 64 * 1 * 4096 * 128 * 2
  mem = compiled.memory_analysis()
  assert mem.output_size_in_bytes == shard_bytes and mem.temp_size_in_bytes <= shard_bytes
  assert "[64,8,4096,128]" not in compiled.as_text() and "[64,1,4096,128]" in compiled.as_text()
  programs = qwen3.zero_cache_program.cache_info()
  small = qwen3.zero_cache(2, (8, 8, 16, 4), jnp.float32, mesh)
  assert qwen3.zero_cache_program.cache_info().misses == programs.misses + 1     # zero_cache goes through it
  assert all(x.sharding.spec == spec.spec for x in small.k + small.v)
  assert all(s.data.shape == (8, 1, 16, 4) for x in small.k for s in x.addressable_shards)


def test_host_mesh_lays_the_model_axis_inside_a_host():
  mesh = sharding.host_mesh(-1, 2)
  assert dict(mesh.shape) == {"data": 4, "model": 2}
  assert dict(sharding.host_mesh(2, 2).shape) == {"data": 2, "model": 2}       # a subset: 4 of the 8 devices
  with pytest.raises(JetSpecError, match="must fit inside one host"):
    sharding.host_mesh(-1, 3)
  with pytest.raises(JetSpecError, match="needs 16 devices"):
    sharding.host_mesh(8, 2)


@pytest.mark.parametrize("data,model,batch", [(2, 4, 4), (4, 2, 3)])
def test_sharded_generation_equals_unsharded(data, model, batch, hf_dir, jax_target):
  """The engine with one group of slots per data shard == the unsharded greedy tokens (``decode.reference``, which
  agree with transformers). 2x4: 2 slots per shard, KV heads replicated; 4x2: one slot per shard (one shard idle:
  3 prompts), KV heads sharded."""
  cfg, ref_params = jax_target("shard_dense")
  prompts = [[1, 2, 3, 4, 5], [9, 8], [40, 41, 42], [77]][:batch]
  ref = [reference.greedy(cfg, ref_params, p, 6, cfg.eos_token_ids) for p in prompts]
  hf = [hf_fixtures.hf_greedy(hf_fixtures.named_model("shard_dense"), p, 6) for p in prompts]
  assert_agree(cfg, ref_params, prompts, hf, ref)
  mesh = sharding.make_mesh(data, model)
  _, params, _ = convert.load_target(hf_dir("shard_dense"), jnp.float32, mesh)
  out = generate(cfg, params, prompts, 6, slots=-(-batch // data) * data, groups=data, mesh=mesh)
  assert all(r.admitted == 0 for r in out.results)                         # every prompt in a slot at once
  assert_agree(cfg, ref_params, prompts, ref, out.tokens)


def test_converted_checkpoint_restores_into_another_mesh(hf_dir, jax_target, tmp_path):
  cfg, ref_params = jax_target("shard_moe")
  mesh_a, mesh_b = sharding.make_mesh(4, 2), sharding.make_mesh(1, 8)
  ckpt = str(tmp_path / "ckpt")
  convert.convert_hf(hf_dir("shard_moe"), ckpt, dtype=jnp.float32, mesh=mesh_a)
  _, params, _ = convert.load_target(ckpt, jnp.float32, mesh_b)
  assert _spec_axes(params["layers.0.attn.q_proj"]) == (None, "model", None)
  assert params["layers.0.attn.q_proj"].sharding.mesh.shape == {"data": 1, "model": 8}
  for k in ref_params:
    np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(ref_params[k]), err_msg=k)


def test_init_target_is_sharded():
  cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
  params = qwen3.init_target(cfg, jax.random.key(0), jnp.float32, sharding.make_mesh(2, 4))
  assert _spec_axes(params["layers.0.attn.q_proj"]) == (None, "model", None)
  assert _spec_axes(params["layers.0.attn.k_proj"]) == (None, None, None)
  assert _spec_axes(params["embed"]) == ("model", None)
  assert _spec_axes(params["layers.0.mlp.down"]) == ("model", None)


# ---------------------------------------------------------------- rules and meshes


def test_logical_to_spec_rules():
  mesh = sharding.make_mesh(2, 4)
  # KV heads indivisible by the model axis: replicated; divisible: sharded.
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 2, 8), mesh) == P(None, None, None)
  assert sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (32, 4, 8), mesh) == P(None, "model", None)
  # Vocabulary and batch likewise replicate when indivisible.
  assert sharding.logical_to_spec(("vocab", "embed"), (100, 32), sharding.make_mesh(1, 8)) == P(None, None)
  assert sharding.logical_to_spec(("batch", "seq"), (3, 5), mesh) == P(None, None)
  assert sharding.logical_to_spec(("batch", "seq"), (4, 5), mesh) == P("data", None)
  # A mesh axis is used at most once per tensor.
  assert sharding.logical_to_spec(("q_heads", "mlp"), (8, 8), mesh) == P("model", None)
  # No mesh: replicated.
  assert sharding.logical_to_spec(("q_heads",), (3,), None) == P()


def test_indivisible_query_heads_raise():
  mesh = sharding.make_mesh(1, 8)
  with pytest.raises(JetSpecError, match="num_attention_heads") as e:
    sharding.logical_to_spec(("embed", "q_heads", "head_dim"), (32, 6, 8), mesh)
  assert "(8)" in str(e.value) and "(6)" in str(e.value)
  with pytest.raises(JetSpecError, match="MLP width"):
    sharding.logical_to_spec(("embed", "mlp"), (32, 12), mesh)


def test_loading_onto_a_mesh_that_does_not_divide_the_heads(hf_dir):
  """dense_gqa4 has 4 query heads: a model axis of 8 cannot hold them."""
  with pytest.raises(JetSpecError, match="num_attention_heads"):
    convert.load_target(hf_dir("dense_gqa4"), jnp.float32, sharding.make_mesh(1, 8))


@pytest.mark.parametrize("data,model", [(3, 2), (4, 4), (1, 1), (0, 8)])
def test_make_mesh_wrong_device_count(data, model):
  with pytest.raises(JetSpecError, match="mesh"):
    sharding.make_mesh(data, model)


def test_make_mesh_message_names_the_counts():
  with pytest.raises(JetSpecError, match="needs 6 devices but 8 are available"):
    sharding.make_mesh(3, 2)
  mesh = sharding.make_mesh(2, 4)
  assert mesh.shape == {"data": 2, "model": 4} and mesh.axis_names == ("data", "model")


def test_parse_mesh():
  assert sharding.parse_mesh("2x4") == (2, 4)
  assert sharding.parse_mesh(None) == (jax.device_count(), 1)
  with pytest.raises(JetSpecError, match="DATAxMODEL"):
    sharding.parse_mesh("2by4")

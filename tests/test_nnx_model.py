"""The target and the draft head as Flax NNX models: the declaration every other layer reads, sharded and
abstract creation, use through Flax's own transforms, the explicit cache, profile scopes, and the error
for a checkpoint of the flat layout that came before."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jetspec_jax import checkpoint, convert, sharding
from jetspec_jax.bench import largest_array
from jetspec_jax.config import Qwen3Config
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, moe, qwen3
from jetspec_jax.models import params as P


DENSE = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8)
MOE = dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,))
TIED = dataclasses.replace(DENSE, tie_word_embeddings=True)
QWEN3_8B = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def prefill_inputs(batch=2, length=6, vocab=96):
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, length)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  return tokens, positions, qwen3.causal_mask(batch, length)


@pytest.mark.parametrize("cfg", [DENSE, MOE, TIED], ids=["dense", "moe", "tied"])
def test_module_state_is_the_declared_table(cfg):
  """nnx.state paths, shapes and logical axes are param_specs, and the HF table maps exactly those names."""
  model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
  state = {P.param_name(path): v for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  specs = qwen3.param_specs(cfg)
  assert set(state) == set(specs)
  for name, v in state.items():
    assert (v.get_value().shape, v.get_metadata()["logical_axes"]) == (specs[name].shape, specs[name].axes), name
  assert sorted(m.param for m in convert.target_mappings(cfg)) == sorted(specs)
  assert isinstance(model.layers[0].mlp, moe.MoE) == cfg.is_moe_layer(0)
  assert isinstance(model.layers[1].mlp, moe.MoE) == cfg.is_moe_layer(1)
  assert (model.lm_head is None) == cfg.tie_word_embeddings
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=2, block_size=4, target_layer_ids=(0, 1))
  head_specs = draft_head.param_specs(head_cfg)
  assert sorted(m.param for m in convert.head_mappings(head_cfg)) == sorted(head_specs)
  assert head_specs["layers.1.attn.q_proj"].axes == ("embed", "q_heads", "head_dim")


def test_abstract_8b_model_allocates_nothing():
  live = lambda: sum(a.nbytes for a in jax.live_arrays())
  before = live()
  model = qwen3.abstract_model(QWEN3_8B)
  leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert sum(int(np.prod(x.shape)) for x in leaves) == 8_190_735_360      # Qwen3-8B's parameter count
  assert live() - before < 2 ** 20


@pytest.mark.usefixtures("eight_devices")
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_weights_are_created_in_their_shardings(cfg):
  mesh = sharding.make_mesh(2, 4)
  params = qwen3.init_target(cfg, jax.random.key(0), mesh=mesh)
  for name, spec in qwen3.param_specs(cfg).items():
    assert params[name].sharding.spec == sharding.logical_to_spec(spec.axes, spec.shape, mesh), name
  single = qwen3.init_target(cfg, jax.random.key(0))
  # The same draws; the sharded program may round the init's scaling differently (jax 0.12 on an AVX-512
  # CPU: 1 ulp in 4% of one MoE weight's elements), so equal to float32 rounding, not bit for bit.
  for name in params:
    np.testing.assert_allclose(np.asarray(params[name]), np.asarray(single[name]), rtol=1e-6, atol=0)


@pytest.mark.usefixtures("eight_devices")
def test_sharded_creation_at_8b_width_never_holds_a_whole_weight():
  """Compiled (not run) for two 8B-shaped layers over a model axis of 8: no array of the program is larger
  than the largest weight shard (the random bits and values of each weight are made per shard), and each
  device's outputs are its shards only."""
  cfg = dataclasses.replace(QWEN3_8B, num_hidden_layers=2)
  mesh = sharding.make_mesh(1, 8)
  init = P.sharded_initializer(lambda rngs: qwen3.Qwen3(cfg, rngs=rngs), mesh)
  compiled = init.lower(jax.random.key(0)).compile()
  specs = qwen3.param_specs(cfg)
  shard_elements = [int(np.prod(sharding.named_sharding(s.axes, s.shape, mesh).shard_shape(s.shape)))
                    for s in specs.values()]
  assert largest_array(compiled.as_text())[0] <= max(shard_elements)
  assert 0 <= compiled.memory_analysis().output_size_in_bytes - 4 * sum(shard_elements) < 1024   # + the output tuple


def test_flax_transforms_run_the_model_itself():
  """nnx.jit over the module object gives the same logits as the bound flat weights the loops use."""
  model = qwen3.Qwen3(MOE, rngs=nnx.Rngs(3))
  tokens, positions, mask = prefill_inputs()

  @nnx.jit
  def logits_of(m, tokens):
    h, _, _ = m.hidden(tokens, positions, mask)
    return m.logits(h)

  @jax.jit
  def from_flat(params, tokens):
    target = qwen3.bind(MOE, params)
    h, _, _ = target.hidden(tokens, positions, mask)
    return target.logits(h)

  np.testing.assert_array_equal(np.asarray(logits_of(model, tokens)),
                                np.asarray(from_flat(P.flat_params(model), tokens)))


def test_cache_is_explicit_and_optional():
  """Without a cache nothing is allocated or returned; with one, the same rows give the same states and
  the returned cache holds their keys at prefix_len + t."""
  params = qwen3.init_target(DENSE, jax.random.key(1))
  target = qwen3.bind(DENSE, params)
  tokens, positions, mask = prefill_inputs()
  h0, none, taps0 = target.hidden(tokens, positions, mask, tap_layers=(0, 1))
  assert none is None and taps0.shape == (2, 6, 2 * DENSE.hidden_size)
  cache = qwen3.init_cache(DENSE, 2, 9, jnp.float32)
  h1, cache, taps1 = target.hidden(tokens, positions, mask, cache=cache, prefix_len=jnp.zeros(2, jnp.int32),
                                   tap_layers=(0, 1))
  np.testing.assert_allclose(np.asarray(h0), np.asarray(h1), rtol=0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(taps0), np.asarray(taps1), rtol=0, atol=1e-6)
  assert cache.max_len == 9 and not np.asarray(cache.k[1][:, :, 6:]).any() and np.asarray(cache.k[1][:, :, :6]).any()


def test_profile_scopes_name_the_blocks():
  params = qwen3.init_target(MOE, jax.random.key(2))
  tokens, positions, mask = prefill_inputs()

  def logits(params, tokens):
    target = qwen3.bind(MOE, params)
    return target.logits(target.hidden(tokens, positions, mask)[0])

  hlo = jax.jit(logits).lower(params, tokens).compile().as_text()
  for scope in ("embedding", "layer_0/attention", "layer_0/mlp", "layer_1/mlp", "lm_head"):
    assert f"/{scope}/" in hlo, scope


def test_checkpoint_of_the_previous_layout_says_to_convert_again(tmp_path):
  old = {"embed": np.zeros((96, 32), np.float32), "final_norm": np.ones(32, np.float32),
         "layers.0.q_proj": np.zeros((32, 4, 8), np.float32), "layers.0.input_norm": np.ones(32, np.float32)}
  checkpoint.save_params(str(tmp_path / "params"), old)
  with pytest.raises(JetSpecError, match=r"older JetSpec-JAX .* re-run `jetspec-jax convert`"):
    checkpoint.restore_params(str(tmp_path / "params"), qwen3.param_specs(DENSE), jnp.float32)


def _gate_and_up_apart(params: dict) -> dict:
  """``params`` as the earlier layout stored them: each dense MLP's gate and up [H, I] apart."""
  old = {}
  for k, v in params.items():
    if k.endswith(".mlp.gate_up"):
      old[k.removesuffix("gate_up") + "gate"], old[k.removesuffix("gate_up") + "up"] = v[:, 0], v[:, 1]
    else:
      old[k] = v
  return old


def test_checkpoint_with_gate_and_up_apart_restores_them_stacked(tmp_path):
  """A converted checkpoint of the earlier layout (a dense MLP's gate and up stored apart; the MoE layer's stacked
  experts keep their names) restores with ``mlp.gate_up`` stacked from them, in its sharding."""
  params = qwen3.init_target(MOE, jax.random.key(3))
  checkpoint.save_params(str(tmp_path / "params"), _gate_and_up_apart(params))
  mesh = sharding.make_mesh(4, 2)
  got = checkpoint.restore_params(str(tmp_path / "params"), qwen3.param_specs(MOE), jnp.float32, mesh)
  assert set(got) == set(params) and "layers.0.mlp.gate_up" in got and "layers.1.mlp.gate" in got
  for k in params:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(params[k]), err_msg=k)
  assert got["layers.0.mlp.gate_up"].sharding.spec == sharding.named_sharding(("embed", None, "mlp"), (32, 2, 64), mesh).spec


def test_training_checkpoint_with_gate_and_up_apart_is_not_resumed(tmp_path):
  from jetspec_jax.checkpoint import CheckpointStore
  store = CheckpointStore(str(tmp_path), keep=2)
  new = {"step": jnp.zeros((), jnp.int32), "params": {"layers.0.mlp.gate_up": jnp.ones((4, 2, 3))}}
  store.save(3, {"step": new["step"], "params": _gate_and_up_apart(new["params"])}, {"step": 3})
  store.close()
  store = CheckpointStore(str(tmp_path), keep=2)
  with pytest.raises(JetSpecError, match="older JetSpec-JAX .* train into a new output directory"):
    store.restore(3, new)
  store.close()


def test_training_checkpoint_of_the_previous_layout_is_not_resumed(tmp_path):
  from jetspec_jax.checkpoint import CheckpointStore
  store = CheckpointStore(str(tmp_path), keep=2)
  state = {"step": jnp.zeros((), jnp.int32), "params": {"fc": jnp.ones((4, 2)), "final_norm": jnp.ones(2)}}
  store.save(3, state, {"step": 3})
  store.close()
  store = CheckpointStore(str(tmp_path), keep=2)
  with pytest.raises(JetSpecError, match="older JetSpec-JAX .* train into a new output directory"):
    store.restore(3, state)
  store.close()

"""MoE expert dispatch (``models.moe``): equal to a per-expert loop and to transformers, within its
compiled FLOPs / memory bound, sharded without routing across the data axis, lossless speculation."""
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import NamedSharding

import hf_fixtures
from greedy import assert_agree
from jetspec_jax import sharding
from jetspec_jax.bench import hlo_dot_flops, largest_array, loop_report
from jetspec_jax.config import Qwen3Config
from jetspec_jax.errors import JetSpecError
from jetspec_jax.decode import reference
from jetspec_jax.decode.engine import generate
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.models import draft_head, moe, qwen3
from jetspec_jax.models.params import declared_specs


MOE = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=8, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=16, norm_topk_prob=True)


def per_expert_reference(tokens, top_w, top_i, gate, up, down):
  """float64 sum over each token's (weight, expert) pairs of the expert's SwiGLU: the definition."""
  x = np.asarray(tokens, np.float64)
  out = np.zeros_like(x)
  for m in range(x.shape[0]):
    for j in range(top_i.shape[1]):
      e = int(top_i[m, j])
      a = x[m] @ gate[e]
      out[m] += top_w[m, j] * ((a / (1 + np.exp(-a)) * (x[m] @ up[e])) @ down[e])
  return out


def random_experts(num_experts, hidden, inter, seed=0):
  rng = np.random.default_rng(seed)
  return tuple((0.3 * rng.normal(size=s)).astype(np.float32)
               for s in [(num_experts, hidden, inter), (num_experts, hidden, inter), (num_experts, inter, hidden)])


def random_routing(m, num_experts, k, seed=0):
  rng = np.random.default_rng(seed)
  top_i = np.stack([rng.permutation(num_experts)[:k] for _ in range(m)]).astype(np.int32)
  return rng.random((m, k)).astype(np.float32), top_i


def skewed_routing(m, num_experts, k, seed=0):
  """Every token's first choice is expert 3, the rest among experts 0-2: most experts get no token."""
  rng = np.random.default_rng(seed)
  others = np.stack([rng.permutation(3)[:k - 1] for _ in range(m)])
  return rng.random((m, k)).astype(np.float32), np.concatenate([np.full((m, 1), 3), others], 1).astype(np.int32)


@pytest.mark.parametrize("dispatch", moe.DISPATCHES)
@pytest.mark.parametrize("m,routing", [(1, random_routing), (3, random_routing), (40, random_routing),
                                       (300, random_routing), (200, skewed_routing)])
def test_dispatch_equals_per_expert_loop(m, routing, dispatch):
  e, h, i, k = 16, 32, 16, 3
  gate, up, down = random_experts(e, h, i)
  x = np.random.default_rng(m).normal(size=(m, h)).astype(np.float32)
  top_w, top_i = routing(m, e, k)
  out = jax.jit(moe.grouped_swiglu, static_argnames=("dispatch", "interpret"))(
      x, top_w, top_i, gate, up, down, dispatch=dispatch, interpret=True)
  np.testing.assert_allclose(out, per_expert_reference(x, top_w, top_i, gate, up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatch", moe.DISPATCHES)
@pytest.mark.parametrize("shards", [2, 4])
def test_expert_shards_sum_to_the_whole(shards, dispatch):
  """Expert parallelism's local step: each shard's local experts' share, summed, is the whole layer."""
  e, h, i, k, m = 16, 32, 16, 4, 50
  gate, up, down = random_experts(e, h, i, seed=1)
  x = np.random.default_rng(1).normal(size=(m, h)).astype(np.float32)
  top_w, top_i = random_routing(m, e, k, seed=1)
  el = e // shards
  fn = jax.jit(moe.grouped_swiglu, static_argnames=("num_experts", "dispatch", "interpret"))
  parts = [fn(x, top_w, top_i, gate[s * el:(s + 1) * el], up[s * el:(s + 1) * el], down[s * el:(s + 1) * el],
              first_expert=s * el, num_experts=e, dispatch=dispatch, interpret=True) for s in range(shards)]
  np.testing.assert_allclose(sum(parts), per_expert_reference(x, top_w, top_i, gate, up, down), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dispatch,tokens", [("loop", 100), ("gather", 100), ("gather", 3), ("kernel", 100),
                                             ("kernel", 3)])
@pytest.mark.parametrize("norm", [True, False])
def test_block_matches_transformers(norm, dispatch, tokens):
  """One sparse block with 32 experts and 2 x 100 tokens (tiles of several rows, skipped tiles), or 2 x 3
  (one row per tile: the tiled dispatches' pair tiles), against transformers' Qwen3MoeSparseMoeBlock,
  float32 (``kernel``: its Pallas kernels in interpret mode)."""
  hf_cfg = hf_fixtures.hf_config("moe_norm", num_experts=32, num_experts_per_tok=4, norm_topk_prob=norm)
  block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(hf_cfg).eval()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for p in block.parameters():
      p.copy_(0.3 * torch.randn(p.shape, generator=gen))
  x = torch.randn((2, tokens, hf_cfg.hidden_size), generator=gen)
  with torch.no_grad():
    ref = block(x).numpy()
  inter = hf_cfg.moe_intermediate_size
  gate_up = block.experts.gate_up_proj.detach().numpy()
  params = {"router": block.gate.weight.detach().numpy().T,
            "gate": gate_up[:, :inter].transpose(0, 2, 1), "up": gate_up[:, inter:].transpose(0, 2, 1),
            "down": block.experts.down_proj.detach().numpy().transpose(0, 2, 1)}
  cfg = Qwen3Config(vocab_size=8, hidden_size=hf_cfg.hidden_size, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=8, num_experts=32, num_experts_per_tok=4,
                    moe_intermediate_size=inter, norm_topk_prob=norm, moe_dispatch=dispatch)
  assert (moe.tile_rows(2 * tokens * 4, 32) > 1) == (tokens == 100)
  out = jax.jit(layer_fn(cfg))(x.numpy(), params)
  np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)


def test_gradient_flows_through_the_dispatch():
  """Not needed by the frozen target, but jax.grad works: it equals a dense one-hot formulation's."""
  e, h, i, k, m = 8, 16, 8, 2, 24
  gate, up, down = map(jnp.asarray, random_experts(e, h, i, seed=2))
  x = np.random.default_rng(2).normal(size=(m, h)).astype(np.float32)
  top_w, top_i = random_routing(m, e, k, seed=2)

  def dense(x, gate):
    y = jnp.einsum("mei,eih->meh", jax.nn.silu(jnp.einsum("mh,ehi->mei", x, gate)) * jnp.einsum("mh,ehi->mei", x, up),
                   down)
    w = jnp.zeros((m, e)).at[jnp.arange(m)[:, None], top_i].set(top_w)
    return jnp.einsum("me,meh->mh", w, y)

  loss = lambda f: lambda x, g: jnp.sum(jnp.sin(f(x, g)))
  ours = jax.grad(loss(lambda x, g: moe.grouped_swiglu(x, top_w, top_i, g, up, down)), (0, 1))(x, gate)
  ref = jax.grad(loss(dense), (0, 1))(x, gate)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def layer_fn(cfg, mesh=None):
  """One ``moe.MoE`` block's forward over its weights {router, gate, up, down}."""
  return lambda x, p: moe.moe_mlp(x, p["router"], p["gate"], p["up"], p["down"], cfg, mesh)


def layer_specs(cfg):
  return declared_specs(nnx.eval_shape(lambda: moe.MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))))


def layer_config(hidden, inter, experts, k):
  return Qwen3Config(vocab_size=8, hidden_size=hidden, intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=8, num_experts=experts,
                     num_experts_per_tok=k, moe_intermediate_size=inter, norm_topk_prob=True)


def compiled_layer(cfg, m, fn=None):
  fn = fn or layer_fn(cfg)
  specs = layer_specs(cfg)
  params = {n: jax.ShapeDtypeStruct(s.shape, jnp.float32) for n, s in specs.items()}
  return jax.jit(fn).lower(jax.ShapeDtypeStruct((1, m, cfg.hidden_size), jnp.float32), params).compile()


@pytest.mark.parametrize("m", [1, 16, 128, 1024, 8192])
def test_compiled_cost_is_the_routed_work_plus_a_tile_per_expert(m):
  """128 experts, hidden 64, intermediate 32, top-8. FLOPs: every dot of the compiled HLO, a loop body
  times its trip count; bound 1.25 x routed (2 * M*k * 3HI) + one tile per expert + the router
  (2 * M * H * E). Memory: no array larger than both E x routed rows and one expert's [H, I] weight;
  XLA's temporaries under the [C] slot arrays, [M, E] router, [M, H] accumulators and one tile's
  weights and activations."""
  e, h, i, k = 128, 64, 32, 8
  cfg = layer_config(h, i, e, k)
  compiled = compiled_layer(cfg, m)
  n, t = m * k, moe.tile_rows(m * k, e)
  c = moe.capacity(n, e, t)
  routed = 2 * n * 3 * h * i
  flops = hlo_dot_flops(compiled.as_text())
  assert routed <= flops <= 1.25 * routed + e * t * 6 * h * i + 2 * m * h * e
  biggest, shape = largest_array(compiled.as_text())
  assert biggest <= max(e * n, h * i), shape
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= 4 * (8 * c + 4 * m * e + 4 * m * h + 3 * h * i + 4 * t * (h + i)), temp


@pytest.mark.parametrize("m", [1, 16, 128, 1024])
def test_gather_dispatch_has_no_control_flow_and_the_same_cost_bound(m):
  """The ``gather`` dispatch (accelerators): no while loop or conditional anywhere in the compiled layer,
  FLOPs within the bound above, and temporaries bounded by the gathered copies of C/T tiles' expert
  weights plus the [C, H] rows (the copies are its price, module docstring)."""
  e, h, i, k = 128, 64, 32, 8
  cfg = dataclasses.replace(layer_config(h, i, e, k), moe_dispatch="gather")
  compiled = compiled_layer(cfg, m)
  text = compiled.as_text()
  report = loop_report(text)
  assert not report["loop"] and report["while_loops"] == 0 and report["conditionals"] == 0, report
  n, t = m * k, moe.tile_rows(m * k, e)
  c = moe.capacity(n, e, t)
  routed = 2 * n * 3 * h * i
  assert routed <= hlo_dot_flops(text) <= 1.25 * routed + e * t * 6 * h * i + 2 * m * h * e
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= 4 * (3 * (c // t) * h * i + 3 * c * (h + i) + 8 * c + 4 * m * e + 4 * m * h * k), temp


def test_auto_dispatch_follows_the_platform():
  cfg = layer_config(32, 16, 8, 2)
  assert moe.dispatch_for(cfg) == "loop" and moe.dispatch_for(cfg, sharding.make_mesh(1, 1, jax.devices()[:1])) == "loop"
  assert moe.dispatch_for(dataclasses.replace(cfg, moe_dispatch="gather")) == "gather"
  assert moe.dispatch_for(dataclasses.replace(cfg, moe_dispatch="kernel")) == "kernel"


def test_kernel_dispatch_refuses_untileable_sizes_in_one_sentence():
  """The expert-tile kernels need a power-of-two divisor >= 16 of the intermediate size: 8 is refused, naming
  the size and the dispatch that has no such need."""
  cfg = dataclasses.replace(layer_config(32, 8, 8, 2), moe_dispatch="kernel")
  specs = layer_specs(cfg)
  params = {n: jnp.ones(s.shape, jnp.float32) for n, s in specs.items()}
  with pytest.raises(JetSpecError, match=r"^moe_dispatch='kernel': the expert intermediate size \(8\) .*gather") as e:
    layer_fn(cfg)(jnp.ones((1, 3, 32)), params)
  assert "\n" not in str(e.value)


def test_cost_check_catches_the_dense_expansion():
  """Control: ``jax.lax.ragged_dot`` lowers on CPU to a dot against every expert, which the
  checks above reject (E x the routed FLOPs, an E x rows array)."""
  e, h, i, k, m = 128, 64, 32, 8, 128
  cfg = layer_config(h, i, e, k)

  def ragged(x, p):
    tokens = x.reshape(m, h)
    _, top_i = moe.route(tokens, p["router"], k, True)
    order = jnp.argsort(top_i.reshape(-1))
    sizes = jnp.bincount(top_i.reshape(-1), length=e).astype(jnp.int32)
    return jax.lax.ragged_dot(tokens[order // k], p["gate"], sizes)

  text = compiled_layer(cfg, m, ragged).as_text()
  assert hlo_dot_flops(text) > 100 * 2 * m * k * h * i
  assert largest_array(text)[0] >= e * m * k


# --- sharding -------------------------------------------------------------------------------------

def _groups(attrs: str):
  """Device groups of a collective: ``replica_groups`` in explicit, iota or mesh form, or permute pairs."""
  explicit = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
  if explicit:
    return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]

  def iota(shape, perm):
    ids = np.arange(np.prod(shape)).reshape(shape)
    return ids.transpose(perm) if perm else ids

  def ints(text):
    return [int(d) for d in text.split(",")] if text else None

  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    return iota(ints(m.group(3)), ints(m.group(4))).reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? "
                r"\{([^}]*)\}", attrs)
  if m:
    axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
    names, dims = [a for a, _ in axes], [int(d) for _, d in axes]
    ids = iota(ints(m.group(2)), ints(m.group(3))) if m.group(2) else np.arange(np.prod(dims))
    over = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(4))]
    ids = np.moveaxis(ids.reshape(dims), over, list(range(len(dims) - len(over), len(dims))))
    return ids.reshape(-1, int(np.prod([dims[a] for a in over]))).tolist()
  return None


def cross_data_collectives(hlo: str, mesh) -> list[str]:
  """Collectives of a compiled SPMD module that exchange data between devices of different data
  shards (device i of the module is mesh.devices.flat[i], data index i // model); a collective
  without groups spans every device. Every all-gather and all-to-all is reported too."""
  model = mesh.shape["model"]
  bad = []
  for line in hlo.splitlines():
    op = re.search(r"\s(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(?:-start)?\(", line)
    if not op:
      continue
    groups = _groups(line)
    crosses = groups is None or any(len({d // model for d in g}) > 1 for g in groups)
    if crosses or op.group(1) in ("all-gather", "all-to-all"):
      bad.append(line.strip()[:200])
  return bad


def sharded_params(specs, params, mesh):
  """``params`` placed as their ParamSpecs say."""
  return {n: jax.device_put(v, sharding.named_sharding(specs[n].axes, specs[n].shape, mesh)) for n, v in params.items()}


LAYOUTS = [(2, 4, False, "loop"), (4, 2, False, "loop"), (2, 4, True, "loop"), (4, 2, True, "loop"),
           (2, 4, True, "gather"), (4, 2, True, "kernel")]


@pytest.mark.usefixtures("eight_devices")
@pytest.mark.parametrize("data,model,ep,dispatch", LAYOUTS,
                         ids=[f"{d}x{m}{'-ep' if ep else ''}-{x}" for d, m, ep, x in LAYOUTS])
def test_sharded_layer_equals_unsharded_and_routes_locally(data, model, ep, dispatch):
  cfg = dataclasses.replace(layer_config(32, 16, 8, 2), expert_parallel=ep, moe_dispatch=dispatch)
  specs = layer_specs(cfg)
  keys = jax.random.split(jax.random.key(0), len(specs))
  params = {n: 0.3 * jax.random.normal(kk, specs[n].shape) for kk, n in zip(keys, sorted(specs))}
  x = jax.random.normal(jax.random.key(1), (8, 6, cfg.hidden_size))
  ref = jax.jit(layer_fn(cfg))(x, params)
  mesh = sharding.make_mesh(data, model)
  sp = sharded_params(specs, params, mesh)
  assert ("model" in tuple(sp["gate"].sharding.spec)[:1]) == ep
  xs = jax.device_put(x, NamedSharding(mesh, sharding.logical_to_spec(("batch", "seq", "embed"), x.shape, mesh)))
  fn = jax.jit(layer_fn(cfg, mesh))
  np.testing.assert_allclose(fn(xs, sp), ref, rtol=0, atol=1e-5)
  assert cross_data_collectives(fn.lower(xs, sp).compile().as_text(), mesh) == []


@pytest.mark.usefixtures("eight_devices")
def test_global_dispatch_would_cross_the_data_axis():
  """Control for the check above: the same layer left to the SPMD partitioner (no shard_map) sorts
  the global batch: the [B*T*k] = [96] expert ids are all-gathered over the data axis."""
  cfg = layer_config(32, 16, 8, 2)
  specs = layer_specs(cfg)
  params = {n: jnp.ones(s.shape) for n, s in specs.items()}
  mesh = sharding.make_mesh(2, 4)
  sp = sharded_params(specs, params, mesh)
  xs = jax.device_put(jnp.ones((8, 6, 32)), NamedSharding(mesh, sharding.logical_to_spec(("batch", "seq", "embed"),
                                                                                          (8, 6, 32), mesh)))
  text = jax.jit(layer_fn(cfg)).lower(xs, sp).compile().as_text()
  assert any(re.search(r"= s32\[96\]\S* all-gather", line) for line in cross_data_collectives(text, mesh))


@pytest.mark.usefixtures("eight_devices")
def test_expert_parallel_forward_equals_unsharded(hf_dir, jax_target):
  """The whole shard_moe target (4 experts) with experts split over a model axis of 4."""
  cfg, ref_params = jax_target("shard_moe")
  tokens = hf_fixtures.random_tokens(cfg.vocab_size, (8, 7), seed=5)
  ref, _ = hf_fixtures.jax_forward(ref_params, cfg, tokens)
  ep = dataclasses.replace(cfg, expert_parallel=True)
  assert "expert_parallel" not in ep.to_hf_dict()
  mesh = sharding.make_mesh(2, 4)
  params = sharded_params(qwen3.param_specs(ep), ref_params, mesh)
  assert params["layers.0.mlp.down"].addressable_shards[0].data.shape[0] == 1
  logits, _ = hf_fixtures.jax_forward(params, ep, tokens, mesh=mesh)
  np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-5)


# --- speculative decoding on an MoE target --------------------------------------------------------

@functools.lru_cache(maxsize=None)
def moe_target():
  params = qwen3.init_target(MOE, jax.random.key(0))
  return {n: v * 20 if v.ndim > 1 else v for n, v in params.items()}


def test_speculative_is_lossless_on_moe_target():
  """Greedy JetSpec on an MoE target (tree verification, prefill lanes and AR decode rows through the dispatch)
  == the engine's AR == the target's own greedy tokens (``decode.reference``)."""
  prompts = [[1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14, 15, 16]]
  hcfg = draft_head.DraftConfig.for_target(MOE, num_layers=1, block_size=5)
  hparams = draft_head.init_head(hcfg, jax.random.key(1))
  ref = [reference.greedy(MOE, moe_target(), p, 14) for p in prompts]
  assert len({tuple(t) for t in ref}) == 2 and all(len(set(t)) > 3 for t in ref)
  ar = generate(MOE, moe_target(), prompts, 14, eos_ids=()).tokens
  assert_agree(MOE, moe_target(), prompts, ref, ar)
  spec = generate(MOE, moe_target(), prompts, 14, head_cfg=hcfg, head_params=hparams,
                  tree=TreeConfig("accum_logp", 16, 3, 4), eos_ids=()).tokens
  assert_agree(MOE, moe_target(), prompts, ref, spec)

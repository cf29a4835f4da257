"""What XLA makes of the decode programs, read from compiled HLO: ``bench.loop_report`` on CPU, and
(where jax's CUDA plugin is installed: ``jetspec_jax.deviceless``) the programs compiled for H200s
with no GPU attached: no while loop or conditional left in a round's body but the tree search's."""
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from jetspec_jax import deviceless
from jetspec_jax.bench import loop_report
from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import qwen3
from jetspec_jax.train.config_file import load_config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import aot_memory  # noqa: E402

needs_plugin = pytest.mark.skipif(not deviceless.available(), reason="jax's CUDA plugin (jax[cuda12]) is not installed")
needs_libtpu = pytest.mark.skipif(not deviceless.tpu_available(), reason="libtpu (jax[tpu]) is not installed")

# Qwen3-30B-A3B's structure at a compile-in-seconds size: 2 sparse layers, 16 experts, top-4.
SMALL_MOE = Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                        num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True)


def test_loop_report_counts_what_one_iteration_runs():
  def f(x):
    def body(c):
      i, x = c
      x = jax.lax.cond(x.sum() > 0, lambda x: x * 2.0, lambda x: x - 1.0, x)
      x = jax.lax.fori_loop(0, i, lambda j, x: jnp.sin(x) + j, x)
      return i + 1, x
    return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

  report = loop_report(jax.jit(f).lower(jnp.ones(4)).compile().as_text())
  assert report["loop"] and report["while_loops"] == 1 and report["conditionals"] == 1, report
  assert report["kernels"] >= 1 and all(op.startswith("jit(f)/while/body") for op in report["while_ops"]), report
  flat = loop_report(jax.jit(jnp.sin).lower(jnp.ones(4)).compile().as_text())
  assert not flat["loop"] and flat["while_loops"] == flat["conditionals"] == 0


def small_case(dispatch: str = "auto"):
  c = load_config("qwen3_30b_a3b")
  target = dataclasses.replace(SMALL_MOE, moe_dispatch=dispatch)
  c.head.target_layer_ids = (0, 1)
  c.head.num_layers = 1
  return c, target


@needs_plugin
def test_moe_rounds_for_h200_keep_no_control_flow_but_the_tree_search():
  """AR step and budget-16 rounds (accum_logp: its search loop; best_nodes: loop-free) on 2 H200s."""
  c, target = small_case()
  devices = deviceless.h200_devices(2)
  ar, _ = aot_memory.ar_case("small_moe", target, 512, 1, devices)
  assert ar["while_loops"] == 0 and ar["conditionals"] == 0 and ar["kernels"] > 0, ar
  for batch in (1, 8):
    spec, _ = aot_memory.decode_case("small_moe", c, target, 512, 16, devices, batch)
    assert spec["while_loops"] == 1 and spec["conditionals"] == 0, spec
    assert all("jetspec_tree" in op for op in spec["control_flow"]), spec["control_flow"]
  flat, _ = aot_memory.decode_case("small_moe", c, target, 512, 16, devices, 1, "best_nodes")
  assert flat["while_loops"] == 0 and flat["conditionals"] == 0, flat
  assert all(r["temp_gb"] > 0 and r["args_gb"] > 0 for r in (ar, spec, flat))


@needs_plugin
def test_the_check_sees_the_tile_loop_dispatch():
  """Control: with the CPU's tile loop forced, every sparse layer leaves a loop in the AR step."""
  _, target = small_case("loop")
  ar, _ = aot_memory.ar_case("small_moe", target, 512, 1, deviceless.h200_devices(2))
  assert ar["while_loops"] >= target.num_hidden_layers, ar


@needs_plugin
def test_the_h200_expert_dispatch_reads_each_expert_in_place():
  """On an H200 ``auto`` is the expert-tile kernel: the small MoE's AR engine round (8 slots) launches its two
  Pallas kernels per sparse layer, costed by their tiles (not opaque), and leaves no loop; it moves fewer bytes
  than the ``gather`` dispatch, whose [tiles, H, I] weight copies are written and read back."""
  from jetspec_jax import hlo_cost
  from jetspec_jax.decode import engine
  mesh = aot_memory.make_mesh(1, 1, deviceless.h200_devices(1))

  def ar_round(dispatch):
    _, target = small_case(dispatch)
    text = aot_memory.engine_program(target, None, aot_memory.round_plan(512, 8, None), mesh).as_text()
    comps, body = hlo_cost.round_body(text, engine.ROUND_BODIES, 0)
    return hlo_cost.kernels_of(comps, body), hlo_cost.unknown_trip_loops(comps, body)

  (tiled, loops), (gathered, _) = ar_round("auto"), ar_round("gather")
  layers = SMALL_MOE.num_hidden_layers
  for name in hlo_cost.EXPERT_TILE_KERNELS:
    calls = [k for k in tiled if f"/{name}/" in k.source]
    assert len(calls) == layers and not any(k.opaque for k in calls), (name, calls)
  assert not any(f"/{n}/" in k.source for k in gathered for n in hlo_cost.EXPERT_TILE_KERNELS)
  assert loops == 0, loops
  ours, theirs = hlo_cost.totals(tiled), hlo_cost.totals(gathered)
  assert ours["bytes_read"] + ours["bytes_written"] < theirs["bytes_read"] + theirs["bytes_written"], (ours, theirs)


@needs_plugin
def test_sampling_over_a_split_vocabulary_for_h200_leaves_no_loop():
  """Logits [R, V] with V split over 8 H200s (the LM head's layout): the per-row sampling rule's cumulative sum
  compiles to a sequential loop over V / 8 elements unless the rows are gathered whole first
  (``sharding.whole_vocab``); with them whole, no loop and no conditional."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jetspec_jax.decode import sampling
  from jetspec_jax.sharding import whole_vocab
  mesh = deviceless.h200_mesh(1, 8)
  rows, vocab = 16, 8192
  sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, spec))
  args = (sds((rows, vocab), jnp.float32, P(None, "model")), sds((rows, 2), jnp.uint32, P()),
          sds((rows,), jnp.float32, P()), sds((rows,), jnp.int32, P()), sds((rows,), jnp.float32, P()))

  def draw(gather):
    def f(x, key, t, k, p):
      return sampling.sample_tokens(whole_vocab(x, mesh) if gather else x, jax.random.wrap_key_data(key), t, k, p)
    return loop_report(jax.jit(f).lower(*args).compile().as_text(), per_iteration=False)

  split, whole = draw(False), draw(True)
  assert split["while_loops"] >= 1, split                                  # control: the check sees the scan
  assert whole["while_loops"] == 0 and whole["conditionals"] == 0, whole


@needs_plugin
def test_the_engine_round_with_per_request_sampling_for_h200():
  """One engine round on 2 H200s (mesh 1 x 2): greedy compiled in holds no loop or conditional; per-request
  sampling holds the sampled acceptance walk's two loops and the two greedy-round conditionals, nothing else."""
  c, target = small_case()
  devices = deviceless.h200_devices(2)
  greedy, _ = aot_memory.decode_case("small_moe", c, target, 512, 16, devices, 8, "best_nodes", sampling="greedy")
  assert greedy["while_loops"] == 0 and greedy["conditionals"] == 0, greedy
  mixed, _ = aot_memory.decode_case("small_moe", c, target, 512, 16, devices, 8, "best_nodes",
                                    sampling="per_request")
  assert mixed["while_loops"] == 2 and mixed["conditionals"] == 2, mixed
  assert all("jetspec_accept" in op or "jetspec_tree/cond" in op for op in mixed["control_flow"]), mixed["control_flow"]


@needs_plugin
def test_the_engine_round_reads_paged_pools_with_the_kernels_for_h200():
  """The speculative engine round (best_nodes, 8 slots, one prefill lane) on 2 H200s over paged pools with
  ``--attention mosaic`` and ``pallas``: it compiles, the kernel reads the pages itself (its custom calls in place
  of XLA's attention, and no gathered copy of a pool: less temporary memory than ``xla``), and the round holds no
  loop or conditional."""
  from jetspec_jax.decode.speculative import TreeConfig
  from jetspec_jax.train.trainer import build_head_config
  c, target = small_case()
  mesh = deviceless.h200_mesh(1, 2)
  head_cfg = build_head_config(c, target, None)
  plan = aot_memory.round_plan(512, 8, TreeConfig("best_nodes", 16, 7, head_cfg.depth))
  rounds = {}
  for attention in ("xla", "mosaic", "pallas"):
    compiled = aot_memory.engine_program(target, head_cfg, plan, mesh, attention=attention)
    text = compiled.as_text()
    rounds[attention] = dict(loop_report(text), temp=compiled.memory_analysis().temp_size_in_bytes,
                             mosaic=text.count('custom_call_target="mosaic_gpu_v2"'),
                             triton=text.count('custom_call_target="__gpu$xla.gpu.triton"'))
  for attention, call in (("mosaic", "mosaic"), ("pallas", "triton")):
    r = rounds[attention]
    assert r[call] > 0 and r["while_loops"] == 0 and r["conditionals"] == 0, (attention, r)
    assert r["temp"] < rounds["xla"]["temp"], (attention, r["temp"], rounds["xla"]["temp"])


@needs_plugin
@pytest.mark.parametrize("splits", [8, 16, 32])
def test_the_split_merge_is_one_kernel_for_h200(splits):
  """``splits.merge_splits`` of a batch-1 AR step's partials (32 query heads) compiles for one H200 to ONE loop
  fusion at any split count (the Triton kernel splits 16 ways at batch 1; with the maxima per row, XLA gave them
  a kernel of their own past 8 splits)."""
  from jax.sharding import SingleDeviceSharding
  from jetspec_jax import hlo_cost
  from pallas_kernels.splits import merge_splits
  one = SingleDeviceSharding(deviceless.h200_devices(1)[0])
  shapes = [(1, splits, 1, 32, 128), (1, splits, 1, 32), (1, splits, 1, 32)]
  args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=one) for s in shapes]
  text = jax.jit(lambda *a: merge_splits(*a, axis=1, dtype=jnp.bfloat16)).lower(*args).compile().as_text()
  comps, entry = hlo_cost.parse(text)
  assert [k.op for k in hlo_cost.kernels_of(comps, entry)] == ["fusion"], text


@needs_plugin
def test_qwen3_8b_ar_step_for_h200_is_16_kernels_per_layer():
  """The batch-1 AR step of Qwen3-8B for one H200 with the default GPU kernel (``pallas``): one more layer adds at
  most 16 kernels (docs/gpu.md: norm, q projection, q norm and RoPE, k and v projections, k norm and RoPE, K and
  V rows written, the kernel, its split merge, o projection, residual add, norm, gate and up, SiLU x up, down and
  residual add)."""
  from bench import round_bytes
  count = lambda layers: len(round_bytes.program_kernels("qwen3_8b", layers, 1, None, 4096, "pallas")[0])
  assert count(6) - count(5) <= 16


@needs_plugin
def test_round_bytes_for_h200_grow_linearly_with_the_layers():
  """bench/round_bytes.py's extrapolation: a round's kernels, bytes and FLOPs at 3 layers are those at 1 and 2
  extended linearly; the round moves more than the AR step, which reads at least its weights."""
  from bench import round_bytes
  from jetspec_jax import hlo_cost
  run = lambda layers, budget: hlo_cost.totals(round_bytes.program_kernels("tiny", layers, 2, budget, 256, "xla")[0])
  at = {layers: run(layers, 4) for layers in (1, 2, 3)}                    # tiny's head reads one layer
  line = round_bytes.extrapolate(at[1], at[2], 1, 2, 3)
  for key in ("kernels", "bytes_read", "bytes_written", "flops"):
    assert line[key] == pytest.approx(at[3][key], rel=0.02), (key, line, at[3])
  ar = run(2, None)
  target, _ = round_bytes.models("tiny", 2)
  mesh = aot_memory.make_mesh(1, 1, deviceless.h200_devices(1))
  params = aot_memory.abstract_params(qwen3.param_specs(target), jnp.bfloat16, mesh)
  weights = sum(2 * x.size for x in jax.tree.leaves(params))             # bf16
  assert at[2]["bytes_read"] > ar["bytes_read"] >= 0.5 * weights and at[2]["flops"] > ar["flops"] > 0, (at[2], ar)


@needs_plugin
def test_the_planner_costs_rounds_for_h200_by_the_model():
  """Planning for an H200 from this machine (``planner.modeled``): each candidate's round compiled for one H200
  and costed by the roofline model, its tokens per round kept. A speculative round reads the head's weights and
  launches its kernels besides the target's, so it models slower than the AR round; the choice follows the
  modelled tokens per second."""
  from bench import round_bytes
  from jetspec_jax import hlo_cost
  from jetspec_jax.decode import planner
  from jetspec_jax.decode.speculative import TreeConfig
  target, head_cfg = round_bytes.models("tiny", 2)
  mesh = deviceless.h200_mesh(1, 1)
  spec = planner.candidate_plans(4, TreeConfig("best_nodes", 8, 3, head_cfg.depth), row_factors=(2,))
  spec = [s for s in spec if s[0] in ("ar", "best_nodes_rows8")]

  def round_hlo(tree, rows):
    plan = dataclasses.replace(aot_memory.round_plan(256, 4, tree), rows=rows)
    return aot_memory.engine_program(target, None if tree is None else head_cfg, plan, mesh,
                                     attention="xla").as_text()

  calibrated = [planner.Candidate("ar", 4, 1e-3, 4.0), planner.Candidate("best_nodes_rows8", 8, 1e-3, 9.0)]
  points = planner.modeled(calibrated, spec, round_hlo, hlo_cost.DEVICES["h200"])
  assert [p.cost for p in points] == ["model H200 SXM"] * 2 and [p.tokens_per_round for p in points] == [4.0, 9.0]
  ar, tree = (p.seconds_per_round for p in points)
  assert 0 < ar < tree, (ar, tree)
  assert planner.choose(points).name == ("ar" if 4.0 / ar > 9.0 / tree else "best_nodes_rows8")


@needs_libtpu
def test_round_bytes_for_a_tpu_chip_from_its_cost_analysis():
  """bench/round_bytes.py --target v6e: one decode round compiled alone for one v6e chip; its cost_analysis() bytes
  and its device-memory bytes from the HLO grow linearly with the layers (the extrapolation), and the speculative
  round moves and computes more than the AR step, which reads every weight but the embedding from device memory,
  less than cost_analysis() counts (which includes VMEM)."""
  from bench import round_bytes
  from jetspec_jax import hlo_cost
  def run(layers, budget):
    cost, kernels, _ = round_bytes.tpu_program_totals("tiny", layers, 2, budget, 256, "v6e")
    t = hlo_cost.totals(kernels)
    return {**cost, "hbm": t["bytes_read"] + t["bytes_written"], "hbm_read": t["bytes_read"]}
  at = {layers: run(layers, 4) for layers in (1, 2, 3)}
  line = round_bytes.extrapolate(at[1], at[2], 1, 2, 3)
  for key in ("bytes", "flops", "hbm"):
    assert line[key] == pytest.approx(at[3][key], rel=0.05), (key, line, at)
  ar = run(2, None)
  target, _ = round_bytes.models("tiny", 2)
  mesh = aot_memory.make_mesh(1, 1, deviceless.tpu_devices("v6e"))
  params = aot_memory.abstract_params(qwen3.param_specs(target), jnp.bfloat16, mesh)
  weights = sum(2 * x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                if "embed" not in jax.tree_util.keystr(path))                 # bf16; the embedding: rows gathered
  assert at[2]["bytes"] > ar["bytes"] and at[2]["flops"] > ar["flops"] > 0, (at[2], ar)
  assert weights <= ar["hbm_read"] and ar["hbm"] < ar["bytes"] and at[2]["hbm"] > ar["hbm"], (ar, at[2], weights)


@needs_libtpu
def test_the_engine_round_for_a_tpu_chip_runs_the_tpu_kernel():
  """The small MoE's budget-16 engine round (best_nodes, 2 slots of 512 positions) compiled for one v6e chip with
  ``--attention tpu``: the target's and the head's layers call the Mosaic TPU kernel, the round keeps no while
  loop or conditional, and it accesses fewer bytes than with ``xla`` attention (which gathers each slot's pages)."""
  from jetspec_jax.decode import speculative
  from jetspec_jax.train import trainer
  c, target = small_case()
  mesh = aot_memory.make_mesh(1, 1, deviceless.tpu_devices("v6e"))
  head_cfg = trainer.build_head_config(c, target, None)
  plan = aot_memory.round_plan(512, 2, speculative.TreeConfig("best_nodes", 16, 7, head_cfg.depth))

  def compiled(attention):
    program = aot_memory.round_program(target, head_cfg, plan, mesh, "greedy", attention)
    cost = program.cost_analysis()
    return program.as_text(), (cost[0] if isinstance(cost, (list, tuple)) else cost)["bytes accessed"]

  (text, kernel_bytes), (_, xla_bytes) = compiled("tpu"), compiled("xla")
  calls = text.count('custom_call_target="tpu_custom_call"')
  assert calls >= target.num_hidden_layers + head_cfg.num_hidden_layers, calls
  report = loop_report(text)
  assert report["while_loops"] == 0 and report["conditionals"] == 0, report
  assert kernel_bytes < xla_bytes, (kernel_bytes, xla_bytes)


@needs_libtpu
@pytest.mark.parametrize("sampling", ["greedy", "per_request"])
def test_moe_engine_rounds_for_a_v5p_tpu_slice_keep_no_control_flow(sampling):
  """The small MoE's greedy and per-request budget-16 rounds (best_nodes) on a v5p-8 slice (4 chips, mesh 1 x 4)
  with ``--attention tpu``: the TPU kernel in every layer, the ``gather`` expert dispatch (what ``auto`` picks on a
  TPU), no while loop or conditional but the sampled acceptance walk's and the greedy-round switch (none when
  greedy is compiled in), and bytes accessed per chip from XLA:TPU's cost_analysis."""
  from jetspec_jax.decode import speculative
  from jetspec_jax.models import moe
  from jetspec_jax.train import trainer
  c, target = small_case()
  devices = deviceless.tpu_devices("v5p-8")
  mesh = aot_memory.make_mesh(1, len(devices), devices)
  assert len(devices) == 4 and moe.dispatch_for(target, mesh) == "gather"
  head_cfg = trainer.build_head_config(c, target, None)
  plan = aot_memory.round_plan(512, 2, speculative.TreeConfig("best_nodes", 16, 7, head_cfg.depth), sampling)
  compiled, trips = aot_memory.compile_engine(target, head_cfg, plan, mesh, sampling, "tpu")
  text = compiled.as_text()
  assert trips is None and text.count('custom_call_target="tpu_custom_call"') >= target.num_hidden_layers
  report = loop_report(text)
  control = report["while_ops"] + report["conditional_ops"]
  assert all("jetspec_accept" in op or "jetspec_tree/cond" in op for op in control), control
  assert not control if sampling == "greedy" else report["while_loops"] >= 1, report
  row = aot_memory.flops_row(compiled, 1.0, mesh.size)
  assert row["gb_accessed"] > 0 and row["chip_tflop"] > 0, row


@needs_libtpu
def test_aot_memory_for_a_tpu_slice_reports_memory_and_cost_per_chip(tmp_path):
  """``bench/aot_memory.py --target v6e-8``: the tiny config's train step on its mesh over 8 v6e chips, per-chip
  memory against the chip's HBM, bytes and FLOPs from cost_analysis, its HBM bytes from the HLO (fewer: VMEM's not
  counted), a roofline time."""
  import json
  out = tmp_path / "aot.json"
  assert aot_memory.main(["--target", "v6e-8", "--configs", "tiny", "--no-decode", "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  (row,) = result["rows"]
  assert result["args"]["budget_gb"] == 32 and row["mesh"] == "8x1" and row["fits"], row
  assert row["gb_accessed"] > row["args_gb"] > 0 and row["chip_tflop"] > 0 and row["model_ms"] > 0, row
  assert 0 < row["hbm_gb"] < row["gb_accessed"], row

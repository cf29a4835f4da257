"""Ahead-of-time memory and FLOPs of the shipped configs, compiled with abstract weights on 8 devices.

For every shipped training config (configs/*.py) the head's train step (``trainer.compile_step``, the
config's mesh, optimizer, batch and sequence length, the target's real shapes; weights are
``jax.ShapeDtypeStruct`` carrying the NamedShardings their ParamSpecs give them) is lowered and
compiled without any weight being allocated; for the 8B and 30B-A3B targets a greedy speculative
engine round (``engine.run_rounds``, one slot, tree budget 128, bf16, requests of ``--decode-len``
committed positions, mesh 1 x 8) as well, and for the 8B target regeneration on its config's mesh
(``--regen``: 8 slots, 8192-token prompts, 1024 new tokens; the AR engine with 64-row prefill lanes); with
``--paged-slots`` the speculative engine round on ONE device with a KV pool of ``--kv-pages`` / ``--kv-memory`` and
its contiguous equivalent (``pages=None``), and how many requests of the ShareGPT mix (``--mix-tokenizer``) the
device's ``--usable-gib`` holds paged and contiguous. Reported per device, from ``compiled.memory_analysis()``:

* ``args_gb`` / ``out_gb`` / ``alias_gb`` / ``temp_gb``: arguments, outputs, outputs aliasing donated
  arguments, XLA's temporaries; ``peak_gb`` = args + out - alias + temp (an upper bound: XLA may free
  arguments early) against ``--budget-gb`` (80) with ``--headroom-gb`` (10) to spare;
* ``hlo_tflop``: the dots of the compiled HLO with every loop body times its trip count (XLA's
  ``cost_analysis``, ``xla_tflop``, counts a ``while`` body once: models/moe.py's tile loop, the
  attention's query blocks, the loss's anchor chunks); the decode loop's trip count is data-dependent,
  so its rows are per round; ``analytic_tflop``: matmul FLOPs counted from the shapes (below).

* ``kernels`` / ``while_loops`` / ``conditionals``: per engine round (the round body with prefill lanes, the
  largest; the whole program for the train step), ``bench.loop_report``.

``--target cpu`` (default) compiles for 8 fake CPU devices: XLA:CPU fuses and schedules differently
from XLA:GPU (and upcasts some bf16 dots to float32), so the temporaries are an estimate.
``--target h200`` compiles the same programs for eight H200s with no GPU attached (jax's CUDA plugin,
``jetspec_jax.deviceless``): XLA:GPU's own memory, kernels and control flow; ``--round-programs`` (alias
``--gpu-programs``) adds the AR round and the budget-16 / budget-128 rounds at batch 1 and 64 (the round table of
docs/gpu.md). Needs ``pip install "jax[cuda12]==<jax's version>" absl-py`` (about 5.5 GB).
``--target v5e-8 | v6e-8 | v5p-8`` compiles them for a TPU slice (8, 8 and 4 chips) with libtpu, no TPU attached
(``scripts/setup_tpu.sh``'s venv): per-chip memory against the chip's HBM (16, 32, 95 GB; headroom 1/8 of it), and
from XLA:TPU's ``cost_analysis()`` per chip ``gb_accessed`` (every op's operands and outputs, VMEM included) and
``chip_tflop``; ``hbm_gb`` per chip, the device-memory bytes read and written by the program's ops from its optimised
HLO (``hlo_cost``: arrays in VMEM or SMEM move nothing; each while body counted once); ``model_ms`` = max(HBM bytes /
HBM bandwidth, FLOPs / bf16 peak) (a model, ``hlo_cost.TPU_DEVICES``); ``vs_ar``: a round's HBM bytes against the AR
round's at its batch. Each engine row is then ONE round compiled alone (``round_program``: decode rows without
prefill lanes, the regen row with them), the attention ``tpu`` (the Mosaic TPU kernel) unless ``--attention``
says otherwise, and the MoE dispatch ``gather`` (``auto`` on a TPU).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/aot_memory.py          # every config
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/aot_memory.py --configs tiny --no-decode
  python bench/aot_memory.py --target h200 --configs qwen3_8b,qwen3_30b_a3b --gpu-programs --no-regen
  python bench/aot_memory.py --target h200 --configs qwen3_8b --no-train --no-decode --no-regen --paged-slots 64 \
      --kv-memory 108
  .venv-tpu/bin/python bench/aot_memory.py --target v5p-8 --configs qwen3_8b,qwen3_30b_a3b --no-decode   # train
  .venv-tpu/bin/python bench/aot_memory.py --target v6e-8 --configs qwen3_8b --no-train --round-programs
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jetspec_jax import deviceless, hlo_cost  # noqa: E402
from jetspec_jax.cli import _kv_flags, _kv_pages  # noqa: E402
from jetspec_jax.bench import format_table, hlo_dot_flops, loop_report, machine_info, save_results  # noqa: E402
from jetspec_jax.config import Qwen3Config, parse_dtype  # noqa: E402
from jetspec_jax.decode import speculative  # noqa: E402
from jetspec_jax.models import draft_head, qwen3  # noqa: E402
from jetspec_jax.sharding import make_mesh, named_sharding  # noqa: E402
from jetspec_jax.errors import JetSpecError  # noqa: E402
from jetspec_jax.train import runtime, trainer  # noqa: E402
from jetspec_jax.train.config_file import load_config  # noqa: E402

NAME = "aot_memory"
CONFIGS = ("tiny", "qwen3_0p6b", "qwen3_8b", "qwen3_30b_a3b")
DECODE_CONFIGS = ("qwen3_8b", "qwen3_30b_a3b")
TPU_SLICES = tuple(n for n in deviceless.TPU_TOPOLOGIES if "-" in n)
REGEN_CONFIGS = ("qwen3_8b",)
# The targets' shapes (Hugging Face config.json of Qwen/Qwen3-0.6B, -8B, -30B-A3B); tiny: a CPU-sized one.
TARGETS = {
    "tiny": Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen3_0p6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen3_30b_a3b": Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                 num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                 num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                                 decoder_sparse_step=1),
}
GB = 1e9
COLUMNS = ("config", "program", "mesh", "args_gb", "out_gb", "alias_gb", "temp_gb", "peak_gb", "hlo_tflop",
           "hlo_vs_analytic", "kernels", "while_loops", "conditionals", "compile_s", "fits")
# A TPU target's columns: its compiler's cost_analysis() per chip (bytes accessed, FLOPs), the roofline time those
# give on the chip, and a round's bytes against the AR step's at the same batch.
TPU_COLUMNS = ("config", "program", "mesh", "args_gb", "temp_gb", "peak_gb", "gb_accessed", "hbm_gb", "chip_tflop",
               "model_ms", "vs_ar", "while_loops", "conditionals", "compile_s", "fits")
CONCURRENCY = ("usable_gb", "kv_gb", "kv_pages", "prompt_mean", "reply_mean", "contiguous_requests", "paged_requests",
               "paged_vs_contiguous")


def abstract_params(specs, dtype, mesh) -> dict:
  """{name: ShapeDtypeStruct} with each weight's NamedSharding (nothing allocated)."""
  return {n: jax.ShapeDtypeStruct(s.shape, dtype, sharding=named_sharding(s.axes, s.shape, mesh))
          for n, s in specs.items()}


def abstract_state(head_cfg, tx, mesh) -> runtime.TrainState:
  """``trainer.init_state``'s TrainState, abstract: float32 head weights in their shardings, the rest
  in the shardings ``runtime.state_shardings`` gives them."""
  params = abstract_params(draft_head.param_specs(head_cfg), jnp.float32, mesh)
  shapes = jax.eval_shape(lambda p: runtime.TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p),
                                                       rng=jax.random.key_data(jax.random.key(0))), params)
  return jax.tree_util.tree_map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                                runtime.state_shardings(tx, params, mesh))


def memory_row(compiled) -> dict:
  m = compiled.memory_analysis()
  row = {"args_gb": m.argument_size_in_bytes / GB, "out_gb": m.output_size_in_bytes / GB,
         "alias_gb": m.alias_size_in_bytes / GB, "temp_gb": m.temp_size_in_bytes / GB}
  row["peak_gb"] = row["args_gb"] + row["out_gb"] - row["alias_gb"] + row["temp_gb"]
  return row


def flops_row(compiled, analytic: float, devices: int, unknown_trips: int | None = None) -> dict:
  """FLOPs of the whole SPMD program (``devices`` copies of the per-device one); XLA:GPU's
  ``cost_analysis`` is None on a deviceless compile (``xla_tflop`` then None). Kernels and control flow:
  per iteration of the decode loop (``unknown_trips`` given: a data-dependent loop), else the whole program."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = compiled.as_text()
  from jetspec_jax.decode.engine import ROUND_BODIES
  # XLA:TPU writes matmuls as convolutions and leaves its loops' trip counts unannotated: its cost_analysis stands.
  tpu = next(iter(jax.tree.leaves(compiled.input_shardings)[0].device_set)).platform == "tpu"
  hlo = None if tpu else hlo_dot_flops(text, unknown_trips, alternatives=ROUND_BODIES) * devices
  report = loop_report(text, per_iteration=unknown_trips is not None)
  hbm = None
  if tpu:
    comps, entry = hlo_cost.parse(text)
    t = hlo_cost.totals(hlo_cost.kernels_of(comps, entry))
    hbm = (t["bytes_read"] + t["bytes_written"]) / GB
  return {"xla_tflop": float(cost.get("flops", 0.0)) * devices / 1e12 if cost else None,
          "gb_accessed": float(cost["bytes accessed"]) / GB if cost and "bytes accessed" in cost else None,
          "chip_tflop": float(cost.get("flops", 0.0)) / 1e12 if cost else None, "hbm_gb": hbm,
          "hlo_tflop": None if hlo is None else hlo / 1e12, "analytic_tflop": analytic / 1e12,
          "hlo_vs_analytic": None if hlo is None else hlo / analytic,
          "kernels": report["kernels"], "while_loops": report["while_loops"], "conditionals": report["conditionals"],
          "control_flow": sorted(set(report["while_ops"] + report["conditional_ops"]))}


def layer_matmul_params(cfg: Qwen3Config, layer: int) -> int:
  """Weights a token multiplies with in one target layer (attention projections, active MLP, router)."""
  h, nq, nkv, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  attn = h * (2 * nq + 2 * nkv) * dh
  if cfg.is_moe_layer(layer):
    return attn + h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
  return attn + 3 * h * cfg.intermediate_size


def target_flops(cfg: Qwen3Config, rows: int, keys: int) -> float:
  """Forward FLOPs of ``rows`` new rows each scoring ``keys`` keys (dense scores: masked ones too)."""
  per_row = sum(layer_matmul_params(cfg, i) for i in range(cfg.num_hidden_layers))
  attn = 4 * keys * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
  return rows * (2 * per_row + attn)


def head_layer_params(hc) -> int:
  h, nq, nkv, dh = hc.hidden_size, hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim
  return h * (2 * nq + 2 * nkv) * dh + 3 * h * hc.intermediate_size


def train_flops(cfg: Qwen3Config, hc, tc, seq: int) -> float:
  """One micro-step: the target forward; the head's context keys (forward + backward: x3); per anchor
  block the head layers, its attention over the context and its block, and the student logits
  (forward, recomputed forward under ``jax.checkpoint``, backward: x4); the teacher logits (x1: no
  gradient flows into them, so the backward does not recompute them)."""
  b, a, bs = tc.batch_size, tc.num_anchors, hc.block_size
  h, v, nl = hc.hidden_size, cfg.vocab_size, hc.num_hidden_layers
  target = target_flops(cfg, b * seq, seq)
  ctx = 3 * 2 * b * seq * (len(hc.target_layer_ids) * hc.target_hidden_size * h
                           + nl * h * 2 * hc.num_key_value_heads * hc.head_dim)
  rows = b * a * bs
  blocks = rows * nl * (2 * head_layer_params(hc) + 4 * (seq + bs) * hc.num_attention_heads * hc.head_dim)
  logits = 2 * b * a * (bs - 1) * h * v
  return target + ctx + 4 * blocks + 5 * logits


def decode_flops(cfg: Qwen3Config, hc, nodes: int, target_len: int, draft_len: int, depth: int) -> float:
  """One round: verification of ``nodes`` tree nodes over the whole target cache and their logits; the
  head's block over its context cache, the context append of depth + 1 rows and depth logits."""
  verify = target_flops(cfg, nodes, target_len) + 2 * nodes * cfg.hidden_size * cfg.vocab_size
  nl, h = hc.num_hidden_layers, hc.hidden_size
  block = hc.block_size * nl * (2 * head_layer_params(hc) + 4 * draft_len * hc.num_attention_heads * hc.head_dim)
  append = 2 * (depth + 1) * (len(hc.target_layer_ids) * hc.target_hidden_size * h
                              + nl * h * 2 * hc.num_key_value_heads * hc.head_dim)
  return verify + block + append + 2 * depth * h * cfg.vocab_size


def config_mesh(mc: ml_collections.ConfigDict, devices: tuple):
  """The config's (data, model) mesh over ``devices`` (data = -1: all of them)."""
  model = int(mc.model)
  data = len(devices) // model if int(mc.data) == -1 else int(mc.data)
  return make_mesh(data, model, devices[:data * model])


def train_case(name: str, c: ml_collections.ConfigDict, target: Qwen3Config, devices: tuple) -> tuple[dict, dict]:
  """(table row, details) of the config's train step."""
  tc = c.train
  mesh = config_mesh(c.mesh, devices)
  target = trainer.target_layout(target, c.mesh)
  head_cfg = trainer.build_head_config(c, target, None)
  tx = trainer.optimizer_config(tc).build()
  state = abstract_state(head_cfg, tx, mesh)
  target_params = abstract_params(qwen3.param_specs(target), parse_dtype(tc.target_dtype), mesh)
  batch_sharding = NamedSharding(mesh, P("data", None))
  batch = {k: jax.ShapeDtypeStruct((tc.batch_size, c.data.seq_len), jnp.int32, sharding=batch_sharding)
           for k in trainer.BATCH_FIELDS}
  step = trainer.compile_step(state, target_params, target_cfg=target, head_cfg=head_cfg, tc=tc,
                              tx=tx, mesh=mesh)
  t0 = time.perf_counter()
  compiled = step.lower(state, batch, target_params).compile()
  row = {"config": name, "program": "train step", "mesh": f"{mesh.shape['data']}x{mesh.shape['model']}",
         **memory_row(compiled), **flops_row(compiled, train_flops(target, head_cfg, tc, c.data.seq_len), mesh.size),
         "compile_s": time.perf_counter() - t0}
  details = {"batch_size": tc.batch_size, "grad_accum": tc.grad_accum, "seq_len": c.data.seq_len,
             "num_anchors": tc.num_anchors, "chunk_anchors": tc.chunk_anchors,
             "expert_parallel": target.expert_parallel, "target_layers": target.num_hidden_layers}
  return row, details


ENGINE_SAMPLING = {"greedy": (False, 0.0), "sampled": (False, 0.6), "per_request": (True, 0.0)}


def engine_program(target: Qwen3Config, head_cfg, plan, mesh, sampling: str = "greedy", attention: str = "xla"):
  """The engine's device loop (``engine.run_rounds``) for ``plan`` compiled with abstract bf16 weights, caches and
  state: caches sharded as ``qwen3.CACHE_AXES``, per-slot state replicated (``sampling``: ``ENGINE_SAMPLING``)."""
  from jetspec_jax.decode import engine
  program, target_params, head_params, state, small = engine_inputs(target, head_cfg, plan, mesh, sampling, attention)
  return engine.programs(program).run_rounds.lower(
      target_params, head_params, state, small(jax.ShapeDtypeStruct((), jnp.int32)), program=program,
      window=engine.token_window(plan, 1 << 30)).compile()


def round_program(target: Qwen3Config, head_cfg, plan, mesh, sampling: str = "greedy", attention: str = "xla",
                  prefill: bool = False):
  """ONE engine round (``engine.engine_round``; ``prefill``: the body with prefill lanes) alone, compiled as
  ``engine_program``: a program whose whole cost is the round's (a TPU's ``cost_analysis`` covers a whole program)."""
  from jetspec_jax.decode import engine
  program, target_params, head_params, state, _ = engine_inputs(target, head_cfg, plan, mesh, sampling, attention)
  one = functools.partial(engine.engine_round, program=program, prefill=prefill)
  return jax.jit(one, donate_argnums=2).lower(target_params, head_params, state).compile()


def compile_engine(target: Qwen3Config, head_cfg, plan, mesh, sampling: str = "greedy", attention: str = "xla",
                   prefill: bool = False):
  """(compiled program, loop trips unknown): for a TPU mesh ONE round alone (``round_program``; ``prefill``: the body
  with lanes), whose ``cost_analysis`` is the round's; elsewhere the engine's device loop (``engine_program``), whose
  rows are per trip of its data-dependent loop."""
  if mesh.devices.flat[0].platform == "tpu":
    return round_program(target, head_cfg, plan, mesh, sampling, attention, prefill), None
  return engine_program(target, head_cfg, plan, mesh, sampling, attention), 1


def engine_inputs(target: Qwen3Config, head_cfg, plan, mesh, sampling: str = "greedy", attention: str = "xla"):
  """(RoundProgram, abstract target params, head params, engine state, a replicated-struct maker) for ``plan``."""
  from jetspec_jax.decode import engine
  from jetspec_jax.decode.regime import regime_for
  from jetspec_jax.decode.sampling import SamplingConfig
  dtype = jnp.bfloat16
  shapes = jax.eval_shape(lambda: engine.init_state(plan, target, head_cfg, dtype, dtype))
  replicated = NamedSharding(mesh, P())
  cache = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=named_sharding(qwen3.POOL_AXES, x.shape, mesh))
  small = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
  state = jax.tree.map(small, shapes).replace(cache=jax.tree.map(cache, shapes.cache),
                                              draft_cache=jax.tree.map(cache, shapes.draft_cache))
  target_params = abstract_params(qwen3.param_specs(target), dtype, mesh)
  head_params = None if head_cfg is None else abstract_params(draft_head.param_specs(head_cfg), dtype, mesh)
  temperature = ENGINE_SAMPLING[sampling][1]
  s = (SamplingConfig(temperature, 20, 0.95, "rejection") if temperature else SamplingConfig()).resolved()
  program = engine.RoundProgram(plan=plan, cfg=target, head_cfg=head_cfg, eos_ids=(),
                                regime=regime_for(s, plan.per_request_sampling), attn_impl=attention, mesh=mesh)
  return program, target_params, head_params, state, small


def round_plan(committed: int, slots: int, tree, sampling: str = "greedy", lanes: int = 1, prefill_rows: int = 64):
  """A plan of ``slots`` slots whose requests hold ``committed`` positions (3/4 prompt, 1/4 new), every slot's
  whole tree verified."""
  from jetspec_jax.decode import engine
  nodes = 1 if tree is None else tree.num_nodes()
  return engine.EnginePlan(slots=slots, rows=slots * nodes, lanes=lanes, prefill_rows=prefill_rows,
                           max_prompt=committed - committed // 4, max_new_tokens=committed // 4, queue=2 * slots,
                           tree=tree, per_request_sampling=ENGINE_SAMPLING[sampling][0])


def decode_case(name: str, c: ml_collections.ConfigDict, target: Qwen3Config, committed: int, budget: int,
                devices: tuple, batch: int = 1, method: str = "accum_logp", attention: str = "xla",
                sampling: str = "greedy") -> tuple[dict, dict]:
  """(table row, details) of one speculative engine round (``engine.run_rounds``; the kernel counts are the round
  body with prefill lanes, the largest) at ``batch`` slots: tree ``method`` of ``budget`` nodes, width 7, the
  head's depth, every slot's whole tree verified, one prefill lane of 64 rows; bf16; mesh 1 x devices.
  ``sampling``: greedy, or as ``ENGINE_SAMPLING``."""
  mesh = make_mesh(1, len(devices), devices)
  head_cfg = trainer.build_head_config(c, target, None)
  tree = speculative.TreeConfig(method, budget, 7, head_cfg.depth)
  plan = round_plan(committed, batch, tree, sampling)
  t0 = time.perf_counter()
  compiled, trips = compile_engine(target, head_cfg, plan, mesh, sampling, attention)
  target_len, draft_len = plan.cache_lengths(head_cfg)
  analytic = batch * decode_flops(target, head_cfg, tree.num_nodes(), target_len, draft_len, tree.depth)
  label = ("" if method == "accum_logp" else f" {method}") + ("" if sampling == "greedy" else f" {sampling}")
  row = {"config": name, "program": f"decode b{budget}{label} x{batch} (per round)", "mesh": f"1x{mesh.size}",
         "batch": batch,
         **memory_row(compiled), **flops_row(compiled, analytic, mesh.size, unknown_trips=trips),
         "compile_s": time.perf_counter() - t0}
  return row, {"target_cache": target_len, "draft_cache": draft_len, "nodes": tree.num_nodes(), "rows": plan.rows,
               "sampling": sampling}


def ar_case(name: str, target: Qwen3Config, committed: int, batch: int, devices: tuple,
            attention: str = "xla") -> tuple[dict, dict]:
  """(table row, details) of one AR engine round (one token per slot) at ``batch`` slots over a cache of
  ``committed`` positions, greedy, bf16, mesh 1 x devices."""
  mesh = make_mesh(1, len(devices), devices)
  plan = round_plan(committed, batch, None)
  t0 = time.perf_counter()
  compiled, trips = compile_engine(target, None, plan, mesh, "greedy", attention)
  target_len, _ = plan.cache_lengths(None)
  row = {"config": name, "program": f"AR round x{batch}", "mesh": f"1x{mesh.size}", "batch": batch, "ar": True,
         **memory_row(compiled),
         **flops_row(compiled, target_flops(target, batch, target_len), mesh.size, unknown_trips=trips),
         "compile_s": time.perf_counter() - t0}
  return row, {"cache_positions": target_len, "batch": batch}


def paged_case(name: str, c: ml_collections.ConfigDict, target: Qwen3Config, slots: int, context: int,
               page_rows: int, pages: int | None, devices: tuple, attention: str = "xla",
               prefix_caching: bool = True) -> tuple[dict, dict]:
  """(table row, details) of the greedy speculative engine round (best_nodes, budget 16 per slot, width 7) at
  ``slots`` slots of ``context`` committed positions (3/4 prompt, 1/4 new), bf16, on ``devices`` (mesh 1 x n), its
  KV caches a pool of ``pages`` pages of ``page_rows`` rows (None: every slot's capacity, the contiguous
  equivalent), ``attention`` the implementation inside the round (the paged kernels read the pool in place; the XLA
  paths gather each slot's pages). Details: the weights' and the pool's bytes (args = weights + pool + the small
  state)."""
  from jetspec_jax.decode.engine import page_bytes
  mesh = make_mesh(1, len(devices), devices)
  head_cfg = trainer.build_head_config(c, target, None)
  tree = speculative.TreeConfig("best_nodes", 16, 7, head_cfg.depth)
  plan = dataclasses.replace(round_plan(context, slots, tree), page_rows=page_rows, pages=pages,
                             prefix_caching=prefix_caching)
  pool = plan.pool_pages(head_cfg)
  pool_gb = pool * page_bytes(target, head_cfg, page_rows, jnp.bfloat16) / GB
  specs = {**qwen3.param_specs(target), **{f"head/{k}": v for k, v in draft_head.param_specs(head_cfg).items()}}
  weights_gb = sum(int(np.prod(s.shape)) for s in specs.values()) * 2 / GB
  t0 = time.perf_counter()
  compiled = engine_program(target, head_cfg, plan, mesh, attention=attention)
  label = "contiguous-equivalent" if pages is None else "paged"
  row = {"config": name, "program": f"{label} engine x{slots}, context {context}, {pool} pages, {attention} (per round)",
         "mesh": f"1x{mesh.size}", **memory_row(compiled), "compile_s": time.perf_counter() - t0}
  return row, {"slots": slots, "context": context, "page_rows": page_rows, "pool_pages": pool,
               "max_pages_per_slot": plan.max_pages(head_cfg), "scratch_rows": plan.scratch_rows(head_cfg),
               "page_bytes": page_bytes(target, head_cfg, page_rows, jnp.bfloat16), "pool_gb": pool_gb,
               "weights_gb": weights_gb, "state_and_other_args_gb": row["args_gb"] - weights_gb - pool_gb}


def sharegpt_lengths(tokenizer_dir: str, num: int, context: int) -> list[tuple[int, int]] | None:
  """(prompt, reply) token counts of ``num`` ShareGPT requests (``load.sharegpt_requests``: prompts up to 3/4 of
  ``context``, prompt + reply within it, replies uncapped) with the tokenizer at ``tokenizer_dir``; None without
  it."""
  if not os.path.isdir(tokenizer_dir):
    return None
  from jetspec_jax import load
  from jetspec_jax.tokenizer import load_tokenizer
  requests = load.sharegpt_requests(load_tokenizer(tokenizer_dir), num, max_output=context,
                                    max_prompt=context - context // 4, context=context)
  return [(len(r.prompt), r.max_new_tokens) for r in requests]


def concurrency(paged: dict, info: dict, usable_gb: float, lengths: list[tuple[int, int]]) -> dict:
  """Requests of the ShareGPT mix one device of ``usable_gb`` holds at once: its memory less what the paged round
  needs besides its pool (weights, state, temporaries: the same for both engines) is KV memory; contiguous, every
  request takes a slot's whole capacity; paged, the pages of its prompt, reply and one round's scratch rows."""
  kv_gb = usable_gb - (paged["peak_gb"] - info["pool_gb"])
  pages = int(kv_gb * GB // info["page_bytes"])
  need = -(-(np.asarray([p + r for p, r in lengths]) + info["scratch_rows"]) // info["page_rows"])
  contiguous = pages // info["max_pages_per_slot"]
  paged_requests = int(pages / need.mean())
  return {"usable_gb": usable_gb, "kv_gb": kv_gb, "kv_pages": pages, "requests_in_mix": len(lengths),
          "prompt_mean": float(np.mean([p for p, _ in lengths])), "reply_mean": float(np.mean([r for _, r in lengths])),
          "pages_per_request": {"mean": float(need.mean()), "p50": float(np.percentile(need, 50)),
                                "p99": float(np.percentile(need, 99)), "max": int(need.max())},
          "contiguous_requests": contiguous, "paged_requests": paged_requests,
          "paged_vs_contiguous": paged_requests / max(contiguous, 1)}


def regen_case(name: str, c: ml_collections.ConfigDict, target: Qwen3Config, batch: int, prompt: int,
               max_new: int, devices: tuple, attention: str = "xla") -> tuple[list[dict], dict]:
  """(table rows, details) of regeneration on the config's mesh: the AR engine ``regenerate`` runs (``batch``
  slots, one data group per data shard, one lane of 64 prompt rows per group and round) for prompts of
  ``prompt`` tokens and ``max_new`` new ones, bf16; per round of the body with lanes."""
  from jetspec_jax.decode import engine
  mesh = config_mesh(c.mesh, devices)
  groups = mesh.shape["data"]
  plan = engine.EnginePlan(slots=batch, rows=batch, lanes=groups, prefill_rows=64, max_prompt=prompt,
                           max_new_tokens=max_new, queue=2 * batch // groups, groups=groups)
  t0 = time.perf_counter()
  compiled, trips = compile_engine(target, None, plan, mesh, attention=attention, prefill=True)
  target_len, _ = plan.cache_lengths(None)
  rows = [{"config": name, "program": f"regen x{batch}, prompts {prompt} + {max_new} (per round)",
           "mesh": f"{mesh.shape['data']}x{mesh.shape['model']}", **memory_row(compiled),
           **flops_row(compiled, target_flops(target, batch + groups * 64, target_len), mesh.size,
                       unknown_trips=trips),
           "compile_s": time.perf_counter() - t0}]
  return rows, {"cache_positions": target_len, "batch": batch, "lanes": groups, "prefill_rows": 64}


def too_large(name: str, kind: str, message: str) -> dict:
  """The row of a program the compiler refused for want of memory: its temporaries where the message says them."""
  line = next((m for m in message.splitlines() if "memory" in m.lower()), message.splitlines()[0])
  temp = re.search(r"temporaries \(([\d.]+)G\)", message)
  return {"config": name, "program": f"{kind} (not compiled)", "temp_gb": float(temp.group(1)) * (1 << 30) / GB
          if temp else None, "fits": False, "error": line.strip()}


def tpu_costs(rows: list[dict], chip: hlo_cost.Device) -> None:
  """Add to each row of a TPU target its roofline time on ``chip`` (``model_ms``, from its per-chip HBM bytes and
  FLOPs) and, for an engine round, its HBM bytes against the AR round's of the same config and batch (``vs_ar``)."""
  ar = {(r["config"], r["batch"]): r["hbm_gb"] for r in rows if r.get("ar")}
  for r in rows:
    if r.get("hbm_gb") is None:
      continue
    r["model_ms"] = 1e3 * max(r["hbm_gb"] * GB / chip.bandwidth, r["chip_tflop"] * 1e12 / chip.peak)
    base = ar.get((r["config"], r.get("batch")))
    r["vs_ar"] = r["hbm_gb"] / base if base else None


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
  p.add_argument("--target", choices=("cpu", "h200", *TPU_SLICES), default="cpu",
                 help="compile for 8 fake CPU devices, for 8 H200s (no GPU needed: jax's CUDA plugin) or for a TPU "
                      "slice (no TPU needed: libtpu)")
  p.add_argument("--layers", type=int, default=0, help="> 0: cut every target and head to this many layers (CI)")
  p.add_argument("--no-decode", action="store_true", help="skip the speculative decode loop")
  p.add_argument("--no-regen", action="store_true", help="skip regeneration (chunked prefill and an AR step)")
  p.add_argument("--regen", default="8,8192,1024", help="regeneration's batch,prompt tokens,new tokens")
  p.add_argument("--no-train", action="store_true", help="skip the train step")
  p.add_argument("--decode-len", type=int, default=4096, help="committed positions (prompt + max_new_tokens)")
  p.add_argument("--budget", type=int, default=128, help="tree node budget of the decode loop")
  p.add_argument("--round-programs", "--gpu-programs", dest="round_programs", action="store_true",
                 help="for the decode configs: the AR step and the budget-16 / budget-128 rounds at batch 1 and 64, "
                      "and the budget-128 round with the loop-free best_nodes tree (instead of the one decode row)")
  p.add_argument("--attention", help="attention implementation inside the decode programs (default: tpu, the Mosaic "
                                     "TPU kernel, on a TPU target, else xla)")
  p.add_argument("--engine-slots", type=int, default=0,
                 help="> 0: the engine's round at this many slots, greedy, sampled and per-request sampling")
  p.add_argument("--paged-slots", type=int, default=0,
                 help="> 0: the greedy speculative engine round at this many slots on ONE "
                      "device with its KV pool (--kv-pages / --kv-memory, --page-rows) and its contiguous equivalent")
  p.add_argument("--paged-context", type=int, default=32768, help="the paged rows' max context (prompt + new tokens)")
  _kv_flags(p, "the paged rows: ")
  p.add_argument("--no-contiguous", action="store_true", help="the paged rows: skip compiling the contiguous equivalent")
  p.add_argument("--usable-gib", type=float, default=139.0,
                 help="the paged rows: device memory for the concurrent-requests figure (H200: 141 GB, 139 GiB usable)")
  p.add_argument("--mix-tokenizer", default=os.path.expanduser("~/.cache/jetspec-jax/tokenizer"),
                 help="the paged rows: the tokenizer of the ShareGPT mix (default: the demo's)")
  p.add_argument("--mix-requests", type=int, default=1000, help="the paged rows: ShareGPT requests in the mix")
  p.add_argument("--moe-dispatch", choices=("auto", "loop", "gather", "kernel"), default="auto",
                 help="MoE expert dispatch (models/moe.py; auto: loop on CPU, kernel on GPU, gather on TPU)")
  p.add_argument("--budget-gb", type=float, help="memory per device (default 80; a TPU target: its chip's HBM)")
  p.add_argument("--headroom-gb", type=float, help="memory to spare (default 10; a TPU target: 1/8 of its HBM)")
  p.add_argument("--out", help="JSON path (default bench/results/aot_memory.json)")
  args = p.parse_args(argv)
  names = [n for n in args.configs.split(",") if n]
  unknown = set(names) - set(CONFIGS)
  if unknown:
    p.error(f"unknown config(s) {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
  tpu = args.target in TPU_SLICES
  chip = hlo_cost.TPU_DEVICES[args.target.split("-")[0]] if tpu else None
  if args.budget_gb is None:
    args.budget_gb = chip.memory / GB if tpu else 80.0
  if args.headroom_gb is None:
    args.headroom_gb = args.budget_gb / 8 if tpu else 10.0
  if args.attention is None:
    args.attention = "tpu" if tpu else "xla"
  if tpu:
    try:
      devices = deviceless.tpu_devices(args.target)
    except JetSpecError as e:
      p.error(str(e))
    one_device = devices[:1]
    print(f"AOT compile for {args.target} ({len(devices)} x {chip.name}; deviceless: libtpu, no TPU), abstract "
          f"weights; per-chip GB against {args.budget_gb:g} GB with {args.headroom_gb:g} GB headroom; engine rows "
          "are ONE round compiled alone, costed by XLA:TPU's cost_analysis().", flush=True)
  elif args.target == "h200":
    try:
      devices = deviceless.h200_devices(8)
      one_device = deviceless.h200_devices(1)
    except JetSpecError as e:
      p.error(str(e))
    print("AOT compile for 8 H200s (deviceless: jax's CUDA plugin, no GPU), abstract weights; per-device GB "
          f"against {args.budget_gb:g} GB with {args.headroom_gb:g} GB headroom.", flush=True)
  else:
    devices = tuple(jax.devices())
    one_device = devices[:1]
    if len(devices) != 8:
      print(f"warning: {len(devices)} devices (set XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    print(f"AOT compile on {len(devices)} {jax.default_backend()} devices, abstract weights; per-device GB "
          f"against {args.budget_gb:g} GB with {args.headroom_gb:g} GB headroom. XLA:CPU fuses differently from "
          f"XLA:GPU: an estimate. FLOPs: XLA's cost_analysis counts each while body once; hlo_tflop multiplies "
          f"loop bodies by their trip counts.", flush=True)
  mix = sharegpt_lengths(args.mix_tokenizer, args.mix_requests, args.paged_context) if args.paged_slots else None
  rows, details = [], {}
  for name in names:
    c = load_config(name)
    target = dataclasses.replace(TARGETS[name], moe_dispatch=args.moe_dispatch)
    if args.layers:
      target = dataclasses.replace(target, num_hidden_layers=min(args.layers, target.num_hidden_layers))
      layers = target.num_hidden_layers
      c.head.target_layer_ids = tuple(sorted({min(t, layers - 1) for t in c.head.target_layer_ids}))
      c.head.num_layers = min(c.head.num_layers, args.layers)
    programs = [] if args.no_train else [("train", lambda: train_case(name, c, target, devices))]
    if name in DECODE_CONFIGS and not args.no_decode and args.round_programs:
      for batch in (1, 64):
        programs.append((f"ar/x{batch}", lambda batch=batch: ar_case(name, target, args.decode_len, batch, devices,
                                                                     args.attention)))
        for budget in (16, 128):
          programs.append((f"decode/b{budget}/x{batch}", lambda batch=batch, budget=budget: decode_case(
              name, c, target, args.decode_len, budget, devices, batch, attention=args.attention)))
      programs.append(("decode/b128/best_nodes", lambda: decode_case(name, c, target, args.decode_len, 128, devices,
                                                                      1, "best_nodes", args.attention)))
    elif name in DECODE_CONFIGS and not args.no_decode:
      programs.append(("decode", lambda: decode_case(name, c, target, args.decode_len, args.budget, devices,
                                                     attention=args.attention)))
    if name in DECODE_CONFIGS and args.engine_slots:
      for sampling in ENGINE_SAMPLING:
        programs.append((f"engine/x{args.engine_slots}/{sampling}", lambda sampling=sampling: decode_case(
            name, c, target, args.decode_len, 16, devices, args.engine_slots, "best_nodes", args.attention,
            sampling)))
    if args.paged_slots:
      try:
        pages = _kv_pages(args, target, trainer.build_head_config(c, target, None), jnp.bfloat16, 1)
      except JetSpecError as e:
        p.error(str(e))
      if pages is None:
        p.error("--paged-slots needs the pool's size: --kv-pages or --kv-memory")
      for pool in (pages,) if args.no_contiguous else (pages, None):
        programs.append((f"paged/x{args.paged_slots}/{pool or 'contiguous'}", lambda pool=pool: paged_case(
            name, c, target, args.paged_slots, args.paged_context, args.page_rows, pool, one_device, args.attention,
            args.prefix_caching)))
    if name in REGEN_CONFIGS and not args.no_regen:
      programs.append(("regen", lambda: regen_case(name, c, target, *map(int, args.regen.split(",")), devices,
                                                   args.attention)))
    for kind, run in programs:
      try:
        new_rows, info = run()
      except jax.errors.JaxRuntimeError as e:       # XLA:TPU refuses a program larger than the chip's HBM
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        rows.append(too_large(name, kind, str(e)))
        details[f"{name}/{kind}"] = {"error": rows[-1]["error"]}
        print(f"{name} {kind}: not compiled: {rows[-1]['error']}", flush=True)
        continue
      for row in new_rows if isinstance(new_rows, list) else [new_rows]:
        limit = args.usable_gib * (1 << 30) / GB if kind.startswith("paged") else args.budget_gb - args.headroom_gb
        row["fits"] = row["peak_gb"] <= limit
        rows.append(row)
        print(format_table(rows[-1:], COLUMNS), flush=True)
      details[f"{name}/{kind}"] = info
  for key, info in details.items():
    if "/paged/" in key and "contiguous" not in key and mix is not None:
      row = next(r for r in rows if r["program"].startswith("paged") and r["config"] == key.split("/")[0])
      info["concurrency"] = concurrency(row, info, args.usable_gib * (1 << 30) / GB, mix)
      print(f"{key}: {format_table([info['concurrency']], CONCURRENCY)}")
  if args.paged_slots and mix is None:
    print(f"no tokenizer at {args.mix_tokenizer} (--mix-tokenizer): concurrent requests not computed")
  if tpu:
    tpu_costs(rows, chip)
  print()
  print(format_table(rows, TPU_COLUMNS if tpu else COLUMNS))
  for row in rows:
    if row.get("control_flow"):
      print(f"{row['config']} {row['program']}: control flow per iteration from {', '.join(row['control_flow'])}")
  compiler = {"h200": "XLA:GPU for H200 (deviceless)", "cpu": "XLA:CPU fusion and scheduling differ from XLA:GPU: "
              "temporaries are an estimate"}.get(args.target, f"XLA:TPU for {args.target} (deviceless libtpu); "
                                                  "gb_accessed / chip_tflop: cost_analysis() per chip; hbm_gb: device-"
                                                  "memory bytes per chip from the HLO; model_ms: max(HBM bytes / HBM "
                                                  "bandwidth, FLOPs / bf16 peak), a model")
  result = {"benchmark": NAME, "args": vars(args), "machine": machine_info(), "jax": jax.__version__, "rows": rows,
            "details": details,
            "notes": ["per-device numbers of the SPMD program; peak_gb = args + out - alias + temp", compiler,
                      "xla_tflop counts every while body once (None for XLA:GPU deviceless); hlo_tflop counts loop "
                      "bodies x trip count",
                      "decode rows are one round of the data-dependent while loop; kernels / while_loops / "
                      "conditionals per round (the whole program for train and prefill)"]}
  for path in save_results(result, args.out, NAME if args.target == "cpu" else f"{NAME}_{args.target}"):
    print(f"wrote {path}")
  return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())

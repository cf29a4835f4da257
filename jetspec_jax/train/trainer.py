"""Draft-head training on the shared runtime (``train.runtime``): a frozen sharded target runs online
inside the same jitted step to give the tapped features and teacher states; the head is trained
over a (data, model) mesh, resumably (orbax CheckpointManager).

Loss (one micro-step):
  target forward (causal within each packed conversation, no grad) -> features [B, L, F], states [B, L, H]
  sample anchors among response positions -> head context keys once -> per chunk of anchors (remat):
  head blocks + loss
Master weights and optimizer state are float32 (``runtime.OptimizerConfig``, no weight-decay mask);
compute runs in ``train.compute_dtype``.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jetspec_jax import convert, files
from jetspec_jax.checkpoint import CheckpointStore
from jetspec_jax.config import Qwen3Config, parse_dtype
from jetspec_jax.distributed import host_values
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.draft_head import DraftConfig
from jetspec_jax.sharding import host_mesh, named_sharding
from jetspec_jax.train import objective, runtime

BATCH_FIELDS = ("input_ids", "loss_mask", "segment_ids", "positions")   # each [B, L] int32 (batching.pad_rows)


def optimizer_config(tc: ml_collections.ConfigDict) -> runtime.OptimizerConfig:
  return runtime.OptimizerConfig(steps=tc.steps, learning_rate=tc.learning_rate, warmup_frac=tc.warmup_frac,
                                 final_lr_frac=tc.final_lr_frac, clip_norm=tc.clip_norm,
                                 weight_decay=tc.weight_decay, grad_accum=tc.grad_accum)


def target_states(target_params, target_cfg: Qwen3Config, tokens: jax.Array, segment_ids: jax.Array,
                  positions: jax.Array, tap_layers, mesh=None):
  """Frozen target over whole rows, each conversation of a packed row on its own (segment mask,
  positions restarting per conversation): (final-normed states [B, L, H], taps [B, L, F]), no grad.
  Attention runs in query blocks (``xla_chunked``): no [B, H, L, L] float32 scores."""
  hidden, _, taps = qwen3.bind(target_cfg, target_params).hidden(
      tokens, positions, qwen3.segment_causal_mask(segment_ids), tap_layers=tap_layers, attn_impl="xla_chunked",
      mesh=mesh)
  return jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(taps)


def loss_and_metrics(head_params, batch, key, target_params, *, target_cfg, head_cfg, tc, mesh=None):
  """The training objective on one batch of ``BATCH_FIELDS`` [B, L] (head params float32)."""
  compute = parse_dtype(tc.compute_dtype)
  segment_ids, positions = batch["segment_ids"], batch["positions"]
  hidden, feats = target_states(target_params, target_cfg, batch["input_ids"], segment_ids, positions,
                                head_cfg.target_layer_ids, mesh)
  anchors, valid = objective.sample_anchors(key, batch["loss_mask"], tc.num_anchors, segment_ids)
  params_c = jax.tree_util.tree_map(lambda x: x.astype(compute), head_params)
  return objective.draft_loss(params_c, head_cfg, target_params, target_cfg, feats, hidden, batch["input_ids"],
                              batch["loss_mask"], anchors, valid, segment_ids=segment_ids, positions=positions,
                              loss=tc.loss, temperature=tc.temperature, gamma=tc.gamma or None,
                              chunk_size=tc.chunk_anchors)


def init_state(head_cfg: DraftConfig, tx, seed: int, mesh) -> runtime.TrainState:
  """Fresh float32 head weights from key ``seed`` (each in its sharding); PRNG key ``seed + 1``."""
  params = draft_head.init_head(head_cfg, jax.random.key(seed), jnp.float32, mesh)
  return runtime.init_state(tx, params, jax.random.key(seed + 1), mesh)


def compile_step(state, target_params, *, target_cfg, head_cfg, tc, tx, mesh):
  """``step(state, batch, target_params)`` (see ``runtime.compile_step``); state and target params:
  arrays or ShapeDtypeStructs, with their shardings."""
  sharding_of = lambda tree: jax.tree_util.tree_map(lambda x: x.sharding, tree)
  loss = functools.partial(loss_and_metrics, target_cfg=target_cfg, head_cfg=head_cfg, tc=tc, mesh=mesh)
  return runtime.compile_step(loss, tx, sharding_of(state), NamedSharding(mesh, P("data", None)), BATCH_FIELDS,
                              (sharding_of(target_params),))


def build_mesh(mc: ml_collections.ConfigDict):
  """The config's (data, model) mesh on this job's hosts (``sharding.host_mesh``: the model axis inside a
  host, data across hosts; data=-1 takes every device)."""
  return host_mesh(int(mc.data), int(mc.model))


def target_layout(target_cfg: Qwen3Config, mc: ml_collections.ConfigDict) -> Qwen3Config:
  """The target config in the training mesh's layout (``mesh.expert_parallel``: a runtime field)."""
  return dataclasses.replace(target_cfg, expert_parallel=bool(mc.expert_parallel))


def place_target(target_params: dict, target_cfg: Qwen3Config, mesh) -> dict:
  """The target's weights moved into the shardings ``target_cfg``'s specs give them on ``mesh``."""
  specs = qwen3.param_specs(target_cfg)
  return {n: jax.device_put(w, named_sharding(specs[n].axes, specs[n].shape, mesh)) for n, w in target_params.items()}


def prepare_rows(c: ml_collections.ConfigDict, tokenizer, out_dir: str):
  """Tokenise the dataset once (process 0 first, the others then reuse the prepared files)."""
  from jax.experimental import multihost_utils
  from jetspec_jax.train import records
  prepare = lambda: records.prepare_dataset(
      c.data.path if c.data.source == "jsonl" else "sharegpt", tokenizer, os.path.join(out_dir, "data"),
      seq_len=c.data.seq_len, pack=c.data.pack, enable_thinking=c.data.enable_thinking, limit=c.data.limit or None)
  if jax.process_count() == 1:
    return prepare()
  rows = prepare() if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices("jetspec_data_prepared")
  return rows if rows is not None else prepare()


def build_head_config(c: ml_collections.ConfigDict, target_cfg: Qwen3Config, mask_token_id: int | None) -> DraftConfig:
  hc = c.head
  overrides = {"intermediate_size": hc.intermediate_size} if hc.intermediate_size else {}
  mask = hc.mask_token_id if hc.mask_token_id >= 0 else mask_token_id
  return DraftConfig.for_target(target_cfg, num_layers=hc.num_layers, block_size=hc.block_size, causal=hc.causal,
                                mask_token_id=mask, target_layer_ids=tuple(hc.target_layer_ids) or None,
                                **overrides)


def eval_prompts(rows, count: int) -> list[list[int]]:
  """Prompt ids of the first ``count`` held-out rows (tokens before the first response token)."""
  prompts = []
  for i in range(min(count, len(rows))):
    row = rows.read([i])[0]
    mask = np.asarray(row["loss_mask"])
    first = int(np.argmax(mask)) if mask.any() else len(mask)
    if first > 0:
      prompts.append([int(t) for t in np.asarray(row["input_ids"])[:first]])
  return prompts


def eval_tree(ec: ml_collections.ConfigDict, head_cfg):
  """The evaluation's TreeConfig (``eval.tree`` / budget / width, ``eval.tree_profile`` a profile path or "",
  ``eval.online``), validated before training starts."""
  from jetspec_jax.decode import profile
  from jetspec_jax.decode.speculative import TreeConfig
  tree = TreeConfig(ec.tree, ec.budget, ec.width, head_cfg.depth,
                    profile=profile.load(ec.tree_profile) if ec.tree_profile else None, online=ec.online)
  tree.validate(head_cfg)
  return tree


def evaluate_tau(target_params, target_cfg, head_params, head_cfg, prompts, tree, max_new_tokens, compute_dtype,
                 mesh=None) -> dict:
  """tau and tokens/s of the current head on held-out prompts with ``tree`` (greedy speculative decoding on the
  engine, a slot per prompt, over the training mesh; in a multi-process run every process runs it on the same
  prompts). tokens/s counts the prefill."""
  from jetspec_jax.attention import cache_rows
  from jetspec_jax.decode.engine import Engine, Request, acceptance
  params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), head_params)
  groups = 1 if mesh is None else mesh.shape["data"]
  requests = [Request(list(p), max_new_tokens) for p in prompts]
  engine = Engine.for_requests(target_cfg, target_params, requests, slots=-(-len(prompts) // groups) * groups,
                               groups=groups, prefill_rows=cache_rows(max(len(p) for p in prompts)), tree=tree,
                               head_cfg=head_cfg, head_params=params, mesh=mesh)
  run = engine.run(requests)
  acc = acceptance(run.results)
  return {"eval_tau": acc["tau"], "eval_tokens_per_s": sum(len(r.tokens) for r in run.results) / max(run.wall_s, 1e-9),
          "eval_acceptance_d1": acc["acceptance_by_depth"][0] if acc["acceptance_by_depth"] else 0.0}


def run(c: ml_collections.ConfigDict, *, progress: bool = True, stop_after: int | None = None) -> dict:
  """Train a head per config ``c``; resumes from the latest complete checkpoint in output_dir.

  ``stop_after`` ends the run after that many steps of this invocation (simulates an interruption).
  Returns a summary dict (final metrics, paths)."""
  from jetspec_jax.tokenizer import load_tokenizer
  from jetspec_jax.train.batching import BatchIterator
  tc = c.train
  mesh = build_mesh(c.mesh)
  local_batch = runtime.local_batch_size(tc.batch_size, mesh, "train.batch_size")
  target_cfg, target_params, side = convert.load_target(c.target, parse_dtype(tc.target_dtype), mesh)
  if target_layout(target_cfg, c.mesh) != target_cfg:
    target_cfg = target_layout(target_cfg, c.mesh)
    target_params = place_target(target_params, target_cfg, mesh)
  tokenizer = load_tokenizer(side)
  head_cfg = build_head_config(c, target_cfg, tokenizer.mask_token_id)
  tree = eval_tree(c.eval, head_cfg)
  out_dir = os.path.abspath(c.output_dir)
  os.makedirs(out_dir, exist_ok=True)

  rows = prepare_rows(c, tokenizer, out_dir)
  held_out = min(c.data.eval_examples, max(len(rows) - tc.batch_size, 0))
  prompts = eval_prompts(rows, held_out)
  opt = optimizer_config(tc)
  tx = opt.build()
  state = init_state(head_cfg, tx, c.seed, mesh)
  step_fn = compile_step(state, target_params, target_cfg=target_cfg, head_cfg=head_cfg, tc=tc, tx=tx, mesh=mesh)
  total = opt.steps * opt.grad_accum

  def record(m, window):
    seqs = window["steps"] * tc.batch_size
    return {**{f"slot_acc_{k + 1}": float(a) for k, a in enumerate(np.ravel(m.get("top1_acc", [])))},
            "seqs_per_s": seqs / window["seconds"], "tokens_per_s": seqs * c.data.seq_len / window["seconds"]}

  def evaluate(step, state):
    if prompts and (c.eval.every and step % c.eval.every == 0 or step == total):
      return evaluate_tau(target_params, target_cfg, state.params, head_cfg, prompts, tree, c.eval.max_new_tokens,
                          parse_dtype(tc.compute_dtype), mesh)

  store = CheckpointStore(os.path.join(out_dir, "checkpoints"), c.checkpoint.keep)
  batches = BatchIterator(rows, local_batch, seed=c.seed, start=held_out)
  done = runtime.fit(step_fn, state, batches, opt, sharding=NamedSharding(mesh, P("data", None)), fields=BATCH_FIELDS,
                     frozen=(target_params,), log_every=c.log_every, record=record, hooks=(evaluate,), store=store,
                     checkpoint_every=c.checkpoint.every, log_dir=out_dir, progress=progress, stop_after=stop_after)
  summary = {"output_dir": out_dir, "step": done.step, "metrics": done.last, "head": head_cfg.to_hf_dict()}
  if done.step >= total:
    head_dir = os.path.join(out_dir, "head_hf")
    export = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(parse_dtype(c.export_dtype)),
                                    host_values(done.state.params))
    if jax.process_index() == 0:
      convert.save_head(head_dir, head_cfg, export, overwrite=True)
    summary["head_dir"] = head_dir
  store.close()
  if jax.process_index() == 0:
    files.write_json(os.path.join(out_dir, "summary.json"), summary, default=str)
  return summary

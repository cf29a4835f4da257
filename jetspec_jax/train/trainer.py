"""Draft-head training: a frozen sharded target runs online inside the same jitted step to give
the tapped features and teacher states; the head is trained with Optax under ``jax.jit`` with
explicit in/out shardings over a (data, model) mesh; orbax CheckpointManager for resume.

Step (one jit, params and optimizer state donated):
  target forward (causal within each packed conversation, no grad) -> features [B, L, F], states [B, L, H]
  sample anchors among response positions -> head context keys once -> per chunk of anchors (remat):
  head blocks + loss
  AdamW (warmup + cosine), global-norm clipping, optional gradient accumulation (optax.MultiSteps)
Master weights and optimizer state are float32; compute runs in ``train.compute_dtype``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jetspec_jax import convert
from jetspec_jax.checkpoint import LEGACY_NAMES
from jetspec_jax.config import Qwen3Config, parse_dtype
from jetspec_jax.distributed import host_values
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.draft_head import DraftConfig
from jetspec_jax.sharding import make_mesh, named_sharding
from jetspec_jax.train import objective

log = logging.getLogger("jetspec_jax.train")
BATCH_FIELDS = ("input_ids", "loss_mask", "segment_ids", "positions")   # each [B, L] int32 (data.pad_rows)


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs besides the data position: step, float32 head weights,
  optimizer state and the raw PRNG key data (uint32, checkpoint-friendly)."""
  step: jax.Array
  params: dict
  opt_state: Any
  rng: jax.Array


def lr_schedule(tc: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup (train.warmup_frac of the steps) then cosine decay, per optimizer update."""
  warmup = max(1, int(round(tc.warmup_frac * tc.steps)))
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.learning_rate, warmup_steps=warmup, decay_steps=max(tc.steps, warmup + 1),
      end_value=tc.learning_rate * tc.final_lr_frac)


def make_optimizer(tc: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW on ``lr_schedule``, global-norm clipping, optional accumulation."""
  tx = optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                   optax.adamw(lr_schedule(tc), b1=0.9, b2=0.95, weight_decay=tc.weight_decay))
  if tc.grad_accum > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=tc.grad_accum)
  return tx


def learning_rate(tc: ml_collections.ConfigDict, step: int) -> float:
  """The learning rate in effect at micro-step ``step``."""
  return float(lr_schedule(tc)(step // tc.grad_accum))


def target_states(target_params, target_cfg: Qwen3Config, tokens: jax.Array, segment_ids: jax.Array,
                  positions: jax.Array, tap_layers, mesh=None):
  """Frozen target over whole rows, each conversation of a packed row on its own (segment mask,
  positions restarting per conversation): (final-normed states [B, L, H], taps [B, L, F]), no grad.
  Attention runs in query blocks (``xla_chunked``): no [B, H, L, L] float32 scores."""
  hidden, _, taps = qwen3.bind(target_cfg, target_params).hidden(
      tokens, positions, qwen3.segment_causal_mask(segment_ids), tap_layers=tap_layers, attn_impl="xla_chunked",
      mesh=mesh)
  return jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(taps)


def loss_and_metrics(head_params, target_params, batch, key, *, target_cfg, head_cfg, tc, mesh=None):
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


def train_step(state: TrainState, target_params, batch, *, target_cfg, head_cfg, tc, tx, mesh=None):
  """One optimizer micro-step. Returns (new state, scalar metrics)."""
  rng = jax.random.wrap_key_data(state.rng)
  rng, key = jax.random.split(rng)
  (loss, metrics), grads = jax.value_and_grad(loss_and_metrics, has_aux=True)(
      state.params, target_params, batch, key, target_cfg=target_cfg, head_cfg=head_cfg, tc=tc, mesh=mesh)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, loss=loss, grad_norm=optax.global_norm(grads))
  new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng))
  return new, metrics


class CheckpointStore:
  """Orbax CheckpointManager of {state, meta}: periodic saves, keep-last-k, resume from the latest
  COMPLETE step. Orbax writes each step into a temporary directory and renames it when finished;
  leftovers of an interrupted write are never listed as steps, and are reported with a warning."""

  def __init__(self, directory: str, keep: int):
    self.directory = os.path.abspath(directory)
    os.makedirs(self.directory, exist_ok=True)
    for name in sorted(os.listdir(self.directory)):
      if not name.isdigit() and os.path.isdir(os.path.join(self.directory, name)):
        log.warning("skipping incomplete checkpoint directory %s (an interrupted save)",
                    os.path.join(self.directory, name))
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                             enable_async_checkpointing=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: TrainState, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict]:
    stored = self.manager.item_metadata(step)["state"].tree.get("params", {})
    if any(name in stored for name in LEGACY_NAMES):
      raise JetSpecError(f"the training checkpoints in {self.directory} were written by an older JetSpec-JAX "
                         f"(weights named before the Flax NNX model) and cannot be resumed; train into a new "
                         f"output directory")
    out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                             meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def close(self) -> None:
    self.manager.close()


def build_mesh(mc: ml_collections.ConfigDict):
  """(data, model) mesh: data=-1 takes every device the model axis leaves; an explicit size uses the
  first data*model devices (which must then include every process's devices)."""
  model, count = int(mc.model), jax.device_count()
  if model < 1 or count % model:
    raise JetSpecError(f"mesh.model={model} does not divide the {count} devices")
  data = count // model if mc.data in (-1, 0) else int(mc.data)
  if data * model > count:
    raise JetSpecError(f"mesh {data}x{model} needs {data * model} devices but {count} are available")
  return make_mesh(data, model, jax.devices()[:data * model])


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
  from jetspec_jax.train import data as data_lib
  prepare = lambda: data_lib.prepare_dataset(
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


def init_state(head_cfg: DraftConfig, tx, seed: int, mesh) -> TrainState:
  """Fresh float32 head weights (each in its sharding), optimizer state and PRNG key."""
  params = draft_head.init_head(head_cfg, jax.random.key(seed), jnp.float32, mesh)
  replicated = NamedSharding(mesh, P())
  # Optimizer moments take their weight's sharding; counters and the like are replicated.
  opt_sharding = optax.tree_map_params(tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params), params,
                                       transform_non_params=lambda _: replicated)
  opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)
  rng = jax.random.key_data(jax.random.key(seed + 1))
  return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=params,
                    opt_state=opt_state, rng=jax.device_put(rng, replicated))


def abstract_like(tree):
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def compile_step(state: TrainState, target_params, batch_sharding, *, target_cfg, head_cfg, tc, tx, mesh):
  """The jitted train step with explicit in/out shardings; the state is donated."""
  state_sh = jax.tree_util.tree_map(lambda x: x.sharding, state)
  target_sh = jax.tree_util.tree_map(lambda x: x.sharding, target_params)
  step = functools.partial(train_step, target_cfg=target_cfg, head_cfg=head_cfg, tc=tc, tx=tx, mesh=mesh)
  return jax.jit(step, in_shardings=(state_sh, target_sh, {k: batch_sharding for k in BATCH_FIELDS}),
                 out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=(0,))


def global_batch(local: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  """Process-local rows -> one global array per field, sharded over ``data``."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v, np.int32)) for k, v in local.items()}


@dataclasses.dataclass
class HeldOut:
  """The rows after the first ``skip`` (those are held out for evaluation); same interface as ChatRows."""
  rows: Any
  skip: int

  @property
  def seq_len(self) -> int:
    return self.rows.seq_len

  @property
  def pad_id(self) -> int:
    return self.rows.pad_id

  @property
  def path(self) -> str:
    return self.rows.path

  def __len__(self) -> int:
    return len(self.rows) - self.skip

  def read(self, indices):
    return self.rows.read([int(i) + self.skip for i in indices])


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


def evaluate_tau(target_params, target_cfg, head_params, head_cfg, prompts, ec, compute_dtype, mesh=None) -> dict:
  """tau and tokens/s of the current head on held-out prompts (greedy speculative decoding over the
  training mesh; in a multi-process run every process runs it on the same prompts)."""
  from jetspec_jax.decode.generation import acceptance
  from jetspec_jax.decode.generation import Generator
  from jetspec_jax.decode.speculative import TreeConfig
  params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), head_params)
  tree = TreeConfig(ec.tree, ec.budget, ec.width, head_cfg.depth)
  out = Generator(target_cfg, target_params, head_cfg=head_cfg, head_params=params, tree=tree,
                  mesh=mesh).generate(prompts, ec.max_new_tokens)
  acc = acceptance([out])
  return {"eval_tau": acc["tau"], "eval_tokens_per_s": int(out.num_tokens.sum()) / max(out.decode_s, 1e-9),
          "eval_acceptance_d1": acc["acceptance_by_depth"][0] if acc["acceptance_by_depth"] else 0.0}


def run(c: ml_collections.ConfigDict, *, progress: bool = True, stop_after: int | None = None) -> dict:
  """Train a head per config ``c``; resumes from the latest complete checkpoint in output_dir.

  ``stop_after`` ends the run after that many steps of this invocation (simulates an interruption).
  Returns a summary dict (final metrics, paths)."""
  from jetspec_jax.tokenizer import load_tokenizer
  from jetspec_jax.train import data as data_lib
  from jetspec_jax.train.metrics import MetricsWriter
  tc = c.train
  if tc.batch_size % jax.process_count():
    raise JetSpecError(f"train.batch_size={tc.batch_size} is not divisible by the {jax.process_count()} processes")
  mesh = build_mesh(c.mesh)
  if tc.batch_size % mesh.shape["data"]:
    raise JetSpecError(f"train.batch_size={tc.batch_size} is not divisible by the mesh's data axis "
                       f"({mesh.shape['data']})")
  target_cfg, target_params, side = convert.load_target(c.target, parse_dtype(tc.target_dtype), mesh)
  if target_layout(target_cfg, c.mesh) != target_cfg:
    target_cfg = target_layout(target_cfg, c.mesh)
    target_params = place_target(target_params, target_cfg, mesh)
  tokenizer = load_tokenizer(side)
  head_cfg = build_head_config(c, target_cfg, tokenizer.mask_token_id)
  out_dir = os.path.abspath(c.output_dir)
  os.makedirs(out_dir, exist_ok=True)

  rows = prepare_rows(c, tokenizer, out_dir)
  held_out = min(c.data.eval_examples, max(len(rows) - tc.batch_size, 0))
  prompts = eval_prompts(rows, held_out)
  train_rows = HeldOut(rows, held_out)
  tx = make_optimizer(tc)
  state = init_state(head_cfg, tx, c.seed, mesh)
  store = CheckpointStore(os.path.join(out_dir, "checkpoints"), c.checkpoint.keep)
  data_state = 0
  if store.latest_step() is not None:
    state, meta = store.restore(store.latest_step(), abstract_like(state))
    data_state = int(meta["data_state"])
    log.info("resumed from step %d", int(state.step))
  local_batch = tc.batch_size // jax.process_count()
  batches = data_lib.BatchIterator(train_rows, local_batch, seed=c.seed, state=data_state)
  batch_sharding = NamedSharding(mesh, P("data", None))
  step_fn = compile_step(state, target_params, batch_sharding, target_cfg=target_cfg, head_cfg=head_cfg, tc=tc,
                         tx=tx, mesh=mesh)
  writer = MetricsWriter(out_dir)
  start = int(state.step)
  total = tc.steps * tc.grad_accum
  bar = None
  if progress and jax.process_index() == 0:
    from tqdm import tqdm
    bar = tqdm(total=total, initial=start, desc="train", unit="step")
  last: dict = {}
  t_last, seqs = time.perf_counter(), 0
  step = start
  while step < total and (stop_after is None or step - start < stop_after):
    local = next(batches)
    batch = global_batch({k: local[k] for k in BATCH_FIELDS}, batch_sharding)
    state, metrics = step_fn(state, target_params, batch)
    step += 1
    seqs += tc.batch_size
    if step % c.log_every == 0 or step == total:
      m = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
      dt = time.perf_counter() - t_last
      last = {k: float(v) for k, v in m.items() if v.ndim == 0}
      last.update({f"slot_acc_{k + 1}": float(a) for k, a in enumerate(np.ravel(m.get("top1_acc", [])))})
      last.update(learning_rate=learning_rate(tc, step - 1), seqs_per_s=seqs / dt,
                  tokens_per_s=seqs * c.data.seq_len / dt)
      t_last, seqs = time.perf_counter(), 0
      writer.write(step, last)
      if bar is not None:
        bar.set_postfix(loss=f"{last['loss']:.3f}", refresh=False)
    if (c.eval.every and step % c.eval.every == 0 or step == total) and prompts:
      ev = evaluate_tau(target_params, target_cfg, state.params, head_cfg, prompts, c.eval,
                        parse_dtype(tc.compute_dtype), mesh)
      writer.write(step, ev)
      last.update(ev)
    if step % c.checkpoint.every == 0 or step == total:
      store.save(step, state, {"data_state": batches.state, "step": step})
    if bar is not None:
      bar.update(1)
  if bar is not None:
    bar.close()
  writer.close()
  summary = {"output_dir": out_dir, "step": step, "metrics": last, "head": head_cfg.to_hf_dict()}
  if step >= total:
    head_dir = os.path.join(out_dir, "head_hf")
    export = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(parse_dtype(c.export_dtype)),
                                    host_values(state.params))
    if jax.process_index() == 0:
      convert.save_head(head_dir, head_cfg, export, overwrite=True)
    summary["head_dir"] = head_dir
  store.close()
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2, default=str)
  return summary

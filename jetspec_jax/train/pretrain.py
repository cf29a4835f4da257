"""Pretraining a small Qwen3 target from scratch on chat rows (the demo's "target that has learned
something", since no real weights are downloadable in every setting).

Objective: next-token cross-entropy over EVERY real token of each row (prompt and response alike;
``loss_mask`` is ignored), averaged over the batch's predicted tokens. Padding (segment id 0) is
never a target. Packed rows (several conversations per row, see ``data.prepare_dataset(pack=True)``)
are exact: a token attends only to earlier tokens of its own conversation (``causal & seg_i == seg_j``),
RoPE uses the per-conversation positions of the batch, and the last token of one conversation is not
trained to predict the first token of the next.

Step (one ``jax.jit``, state donated, sharded over the mesh's ``data`` axis and the weights' logical
axes): the target's hidden states over the whole row (no KV cache), float32 logits, AdamW (float32
master weights; no decay on norms) with linear warmup + cosine decay and global-norm clipping at 1.0.

The result is written atomically as a normal Hugging Face directory (``config.json``,
``model.safetensors``, the tokenizer files), loadable by ``convert.load_target`` and by
``transformers.AutoModelForCausalLM``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jetspec_jax import convert
from jetspec_jax.checkpoint import atomic_directory, check_output_dir
from jetspec_jax.config import Qwen3Config
from jetspec_jax.distributed import host_values
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import qwen3
from jetspec_jax.sharding import make_mesh, named_sharding


BATCH_FIELDS = ("input_ids", "segment_ids", "positions")
FINAL_LR_FRAC = 0.1
WEIGHT_DECAY = 0.1
CLIP_NORM = 1.0


def default_demo_config(vocab_size: int, eos_id: int | None, pad_id: int | None, *, hidden_size: int = 128,
                        num_layers: int = 4) -> Qwen3Config:
  """The demo target: query heads of 64 (hidden_size / 64 of them, half as many KV heads, at least
  one), SwiGLU 3 x hidden, tied embeddings, rope_theta 1e6. The demo's default (hidden 128, 4 layers,
  4096-token vocabulary) has 1.3M parameters and pretrains at ~7k tokens/s on 2 CPU cores, about 3x
  the rate of hidden 256 for a lower loss per CPU-second.
  """
  heads = max(hidden_size // 64, 1)
  return Qwen3Config(vocab_size=int(vocab_size), hidden_size=hidden_size, intermediate_size=3 * hidden_size,
                     num_hidden_layers=num_layers, num_attention_heads=heads,
                     num_key_value_heads=max(heads // 2, 1), head_dim=64, rms_norm_eps=1e-6,
                     rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=40960,
                     eos_token_ids=() if eos_id is None else (int(eos_id),),
                     pad_token_id=None if pad_id is None else int(pad_id))


# ----------------------------------------------------------------------------------------------
# Objective.

def token_losses(params: dict, cfg: Qwen3Config, batch: dict, *, mesh=None, attn_impl: str = "xla"):
  """Per-token next-token cross-entropy of a batch {input_ids, segment_ids, positions} [B, L].

  Returns (ce [B, L-1] float32, valid [B, L-1] bool): ce[b, t] is -log p(input_ids[b, t+1] | row up
  to t); valid where t and t+1 are real tokens of the same conversation."""
  tokens, seg, pos = (jnp.asarray(batch[k], jnp.int32) for k in BATCH_FIELDS)
  model = qwen3.bind(cfg, params)
  hidden, _, _ = model.hidden(tokens, pos, qwen3.segment_causal_mask(seg), attn_impl=attn_impl, mesh=mesh)
  logits = model.logits(hidden[:, :-1])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  return ce, valid


def mean_loss(params: dict, cfg: Qwen3Config, batch: dict, *, mesh=None):
  """(mean cross-entropy over the valid tokens, their count)."""
  ce, valid = token_losses(params, cfg, batch, mesh=mesh)
  count = jnp.sum(valid)
  return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(count, 1), count


# ----------------------------------------------------------------------------------------------
# Optimizer and step.

@flax.struct.dataclass
class PretrainState:
  step: jax.Array
  params: dict
  opt_state: Any


def lr_schedule(steps: int, learning_rate: float, warmup_frac: float) -> optax.Schedule:
  """Linear warmup over ``warmup_frac`` of the steps, then cosine decay to 10% of the peak."""
  warmup = max(1, int(round(warmup_frac * steps)))
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1),
                                            learning_rate * FINAL_LR_FRAC)


def make_optimizer(steps: int, learning_rate: float, warmup_frac: float) -> optax.GradientTransformation:
  """Global-norm clipping (1.0), then AdamW (b2 0.95, decay 0.1 on matrices only), warmup + cosine."""
  schedule = lr_schedule(steps, learning_rate, warmup_frac)
  decay_mask = lambda params: {k: v.ndim > 1 for k, v in params.items()}
  return optax.chain(optax.clip_by_global_norm(CLIP_NORM),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=WEIGHT_DECAY, mask=decay_mask))


def train_step(state: PretrainState, batch: dict, *, cfg: Qwen3Config, tx, mesh):
  (loss, count), grads = jax.value_and_grad(mean_loss, has_aux=True)(state.params, cfg, batch, mesh=mesh)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": count}
  return PretrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


@functools.lru_cache(maxsize=8)
def build_program(cfg: Qwen3Config, steps: int, learning_rate: float, warmup_frac: float, mesh):
  """(optimizer, init_fn(key) -> state, step_fn(state, batch) -> (state, metrics)), both jitted with
  explicit shardings (weights by their logical axes, optimizer moments like their weight, the batch
  over ``data``); the step donates the state. Cached, so repeated runs of one setting compile once."""
  tx = make_optimizer(steps, learning_rate, warmup_frac)
  replicated = NamedSharding(mesh, P())
  specs = qwen3.param_specs(cfg)
  param_sh = {n: named_sharding(s.axes, s.shape, mesh) for n, s in specs.items()}
  abstract = {n: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=param_sh[n]) for n, s in specs.items()}
  opt_sh = optax.tree_map_params(tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, abstract), abstract,
                                 transform_non_params=lambda _: replicated)
  state_sh = PretrainState(step=replicated, params=param_sh, opt_state=opt_sh)

  def init(key):
    params = qwen3.init_target(cfg, key, jnp.float32, mesh)
    return PretrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  batch_sh = {k: NamedSharding(mesh, P("data", None)) for k in BATCH_FIELDS}
  step = functools.partial(train_step, cfg=cfg, tx=tx, mesh=mesh)
  return (tx, jax.jit(init, out_shardings=state_sh),
          jax.jit(step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, replicated), donate_argnums=(0,)))


def num_params(cfg: Qwen3Config) -> int:
  return int(sum(np.prod(s.shape) for s in qwen3.param_specs(cfg).values()))


# ----------------------------------------------------------------------------------------------
# Export.

def export_config(cfg: Qwen3Config, tokenizer) -> Qwen3Config:
  """cfg with eos / pad / bos ids taken from the tokenizer (when one is given)."""
  if tokenizer is None:
    return cfg
  eos = tokenizer.eos_token_id
  return dataclasses.replace(cfg, eos_token_ids=() if eos is None else (int(eos),),
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)


def write_hf_directory(out_dir: str, cfg: Qwen3Config, params: dict, tokenizer_dir: str | None = None,
                       overwrite: bool = False) -> list[str]:
  """config.json (float32) + model.safetensors + the tokenizer files, atomically. Returns the file names."""
  with atomic_directory(out_dir, overwrite) as tmp:
    convert.write_safetensors(tmp, convert.target_mappings(cfg), params)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(cfg.to_hf_dict("float32"), f, indent=2)
    if tokenizer_dir is not None:
      convert.copy_side_files(tokenizer_dir, tmp, convert.TOKENIZER_FILES)
    names = sorted(os.listdir(tmp))
  return names


# ----------------------------------------------------------------------------------------------
# Driver.

def pretrain_target(cfg: Qwen3Config, rows, out_dir: str, *, steps: int, batch_size: int,
                    learning_rate: float = 3e-3, warmup_frac: float = 0.05, seed: int = 0, mesh=None,
                    tokenizer_dir: str | None = None, progress: bool = True, log_dir: str | None = None,
                    log_every: int = 10, overwrite: bool = False) -> dict:
  """Train ``cfg`` from scratch on ``rows`` (``data.ChatRows``, packed or not) for ``steps`` steps of
  ``batch_size`` rows and write the Hugging Face directory ``out_dir``.

  Deterministic from ``seed`` (weights and the per-epoch row order). ``mesh``: a (data, model) mesh
  (default: one device); ``batch_size`` is global and must divide by its data axis and by the process
  count. ``tokenizer_dir``: its files are copied into ``out_dir`` and its eos / pad / bos ids go into
  config.json. Every ``log_every`` steps the loss goes to the tqdm bar and, with ``log_dir``, to
  ``MetricsWriter`` (loss, grad_norm, learning_rate, tokens_per_s). ``out_dir`` must be absent or empty
  unless ``overwrite``; it is checked before training and written atomically after.

  Returns {out_dir, files, steps, initial_loss (step 1, before any update), final_loss (last step),
  final_loss_avg (mean of the last 10% of steps), losses (every step), tokens (predicted tokens),
  seconds (training loop, compilation included), first_step_seconds (mostly compilation),
  tokens_per_s / padded_tokens_per_s (after step 1), num_params, num_params_non_embedding, config}.
  """
  from jetspec_jax.train.data import BatchIterator
  from jetspec_jax.train.metrics import MetricsWriter
  if steps < 1 or batch_size < 1 or log_every < 1:
    raise JetSpecError(f"need steps, batch_size and log_every >= 1 (got {steps}, {batch_size}, {log_every})")
  cfg.validate()
  if cfg.num_experts:
    raise JetSpecError("pretraining supports dense Qwen3 configs only")
  check_output_dir(out_dir, overwrite)
  tokenizer = None
  if tokenizer_dir is not None:
    from jetspec_jax.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) > cfg.vocab_size:
      raise JetSpecError(f"the tokenizer has {len(tokenizer)} ids but vocab_size={cfg.vocab_size}")
  if mesh is None:   # one device; with several processes, every device on the data axis
    mesh = make_mesh(1, 1, jax.devices()[:1]) if jax.process_count() == 1 else make_mesh(jax.device_count(), 1)
  nproc = jax.process_count()
  if batch_size % nproc or batch_size % mesh.shape["data"]:
    raise JetSpecError(f"batch_size={batch_size} must divide by the {nproc} processes and the mesh's data axis "
                       f"({mesh.shape['data']})")

  schedule = lr_schedule(steps, learning_rate, warmup_frac)
  _, init_fn, step_fn = build_program(cfg, int(steps), float(learning_rate), float(warmup_frac), mesh)
  state = init_fn(jax.random.key(seed))
  batches = BatchIterator(rows, batch_size // nproc, seed=seed)
  batch_sharding = NamedSharding(mesh, P("data", None))
  writer = MetricsWriter(log_dir) if log_dir is not None else None
  bar = None
  if progress and jax.process_index() == 0:
    from tqdm import tqdm
    bar = tqdm(total=steps, desc="pretrain", unit="step")

  losses, token_counts = [], []
  t_start = time.perf_counter()
  t_first = t_start       # when step 1 finished (its time includes compilation)
  t_log, log_from = t_start, 0   # throughput window: steps log_from+1.. since time t_log
  for step in range(1, steps + 1):
    local = batches.batch(step - 1)
    batch = {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(local[k], np.int32))
             for k in BATCH_FIELDS}
    state, metrics = step_fn(state, batch)
    losses.append(metrics["loss"])
    token_counts.append(metrics["tokens"])
    if step == 1:
      jax.block_until_ready(metrics)
      t_first = t_log = time.perf_counter()
      log_from = 1
    if step % log_every == 0 or step == steps:
      m = jax.device_get(metrics)
      now = time.perf_counter()
      window = [int(c) for c in jax.device_get(token_counts[log_from:])]
      rate = sum(window) / max(now - t_log, 1e-9) if window else 0.0
      t_log, log_from = now, step
      record = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                "learning_rate": float(schedule(step - 1)), "tokens_per_s": rate}
      if writer is not None:
        writer.write(step, record)
      if bar is not None:
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:.0f}", refresh=False)
    if bar is not None:
      bar.update(1)
  jax.block_until_ready(state.params)
  t_end = time.perf_counter()
  if bar is not None:
    bar.close()
  if writer is not None:
    writer.close()

  losses = [float(x) for x in jax.device_get(losses)]
  token_counts = [int(x) for x in jax.device_get(token_counts)]
  tail = max(1, steps // 10)
  steady_tokens = sum(token_counts[1:])
  out_cfg = export_config(cfg, tokenizer)
  host = host_values(state.params)
  files = []
  if jax.process_index() == 0:
    files = write_hf_directory(out_dir, out_cfg, host, tokenizer_dir, overwrite)
  return {
      "out_dir": os.path.abspath(out_dir),
      "files": files,
      "steps": steps,
      "initial_loss": losses[0],
      "final_loss": losses[-1],
      "final_loss_avg": float(np.mean(losses[-tail:])),
      "losses": losses,
      "tokens": int(sum(token_counts)),
      "seconds": t_end - t_start,
      "first_step_seconds": t_first - t_start,
      "tokens_per_s": steady_tokens / max(t_end - t_first, 1e-9) if steps > 1 else 0.0,
      "padded_tokens_per_s": ((steps - 1) * batch_size * rows.seq_len / max(t_end - t_first, 1e-9)
                              if steps > 1 else 0.0),
      "num_params": num_params(cfg),
      "num_params_non_embedding": num_params(cfg) - cfg.vocab_size * cfg.hidden_size * (
          1 if cfg.tie_word_embeddings else 2),
      "config": out_cfg.to_hf_dict("float32"),
  }

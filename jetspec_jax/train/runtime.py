"""The training runtime shared by draft-head training (``trainer``) and target pretraining (``pretrain``).

A run is a loss ``loss(params, batch, key, *frozen) -> (scalar, metrics)`` plus an ``OptimizerConfig``:
``init_state`` places a ``TrainState``, ``compile_step`` jits one micro-step of the loss (explicit
shardings, state donated) and ``fit`` drives it over a ``batching.BatchIterator``: global batches,
log records (``MetricsWriter``, tqdm on process 0), hooks, checkpoints and resume (``CheckpointStore``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jetspec_jax.errors import JetSpecError

log = logging.getLogger("jetspec_jax.train")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Global-norm clipping, then AdamW (b1 0.9, b2 0.95) on linear warmup + cosine decay; ``steps``
  counts optimizer updates, each of ``grad_accum`` accumulated micro-steps (optax.MultiSteps)."""
  steps: int
  learning_rate: float
  warmup_frac: float
  final_lr_frac: float
  clip_norm: float
  weight_decay: float
  decay_matrices_only: bool = False   # no weight decay on entries of ndim < 2 (params: a flat {name: array})
  grad_accum: int = 1

  def schedule(self) -> optax.Schedule:
    """0 -> peak over ``warmup_frac`` of the steps (at least one), then cosine to ``final_lr_frac`` of it."""
    warmup = max(1, int(round(self.warmup_frac * self.steps)))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=self.learning_rate, warmup_steps=warmup,
        decay_steps=max(self.steps, warmup + 1), end_value=self.learning_rate * self.final_lr_frac)

  def build(self) -> optax.GradientTransformation:
    mask = (lambda params: {k: v.ndim > 1 for k, v in params.items()}) if self.decay_matrices_only else None
    tx = optax.chain(optax.clip_by_global_norm(self.clip_norm),
                     optax.adamw(self.schedule(), b1=0.9, b2=0.95, weight_decay=self.weight_decay, mask=mask))
    return optax.MultiSteps(tx, every_k_schedule=self.grad_accum) if self.grad_accum > 1 else tx

  def lr_at(self, micro_step: int) -> float:
    """The learning rate in effect at (0-based) micro-step ``micro_step``."""
    return float(self.schedule()(micro_step // self.grad_accum))


@flax.struct.dataclass
class TrainState:
  """What a resumed run needs besides the data position: micro-step count, float32 params,
  optimizer state and the raw PRNG key data (uint32, checkpoint-friendly)."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def state_shardings(tx: optax.GradientTransformation, params, mesh) -> TrainState:
  """The shardings of ``params``' TrainState (params: arrays or ShapeDtypeStructs, each with its
  sharding): optimizer moments take their weight's; counters, the step and the key are replicated."""
  replicated = NamedSharding(mesh, P())
  opt = optax.tree_map_params(tx, lambda _, p: p.sharding, jax.eval_shape(tx.init, params), params,
                              transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=jax.tree.map(lambda p: p.sharding, params), opt_state=opt,
                    rng=replicated)


def init_state(tx: optax.GradientTransformation, params, rng: jax.Array, mesh) -> TrainState:
  """Step 0 of ``params`` (float32, already in their shardings) with PRNG key ``rng``."""
  sh = state_shardings(tx, params, mesh)
  return TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), sh.step), params=params,
                    opt_state=jax.jit(tx.init, out_shardings=sh.opt_state)(params),
                    rng=jax.device_put(jax.random.key_data(rng), sh.rng))


def abstract(tree):
  """ShapeDtypeStructs (with shardings) of a tree of arrays."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def compile_step(loss: Callable, tx: optax.GradientTransformation, shardings: TrainState, batch_sharding,
                 fields, frozen=()):
  """``step(state, batch, *frozen) -> (state, metrics)``, jitted with the state donated: one micro-step
  of ``loss(params, batch, key, *frozen)`` on a key split off ``state.rng``; metrics gain ``loss`` and
  ``grad_norm`` (replicated). Shardings: the state's ``shardings`` (see ``state_shardings``),
  ``batch_sharding`` for each of ``fields`` [B, L], and ``frozen`` (one sharding tree per frozen arg)."""
  def step(state: TrainState, batch, *args):
    rng, key = jax.random.split(jax.random.wrap_key_data(state.rng))
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state.params, batch, key, *args)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                     rng=jax.random.key_data(rng))
    return new, dict(metrics, loss=value, grad_norm=optax.global_norm(grads))

  return jax.jit(step, in_shardings=(shardings, {k: batch_sharding for k in fields}, *frozen),
                 out_shardings=(shardings, NamedSharding(batch_sharding.mesh, P())), donate_argnums=(0,))


def local_batch_size(batch_size: int, mesh, name: str = "batch_size") -> int:
  """This process's rows of a global batch of ``batch_size`` (which must divide by the process count
  and the mesh's ``data`` axis)."""
  nproc, data = jax.process_count(), mesh.shape["data"]
  if batch_size % nproc or batch_size % data:
    raise JetSpecError(f"{name}={batch_size} must divide by the {nproc} processes and the mesh's data axis ({data})")
  return batch_size // nproc


def global_batch(local: dict[str, np.ndarray], sharding, fields) -> dict[str, jax.Array]:
  """Process-local rows of ``fields`` -> one global int32 array each, sharded by ``sharding`` (over ``data``)."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(local[k], np.int32)) for k in fields}


@dataclasses.dataclass
class Fit:
  state: TrainState
  step: int                   # micro-steps done, earlier invocations' included
  last: dict                  # the last log record, with later hook records merged into it
  kept: dict[str, list]       # the ``keep`` metrics of every step of this invocation (host scalars)
  seconds: float              # the loop, compilation included
  first_step_seconds: float   # its first step (mostly compilation)


def fit(step_fn, state: TrainState, batches, opt: OptimizerConfig, *, sharding, fields, frozen=(), log_every: int,
        record: Callable | None = None, hooks=(), keep=(), store=None, checkpoint_every: int = 0,
        log_dir: str | None = None, progress: bool = True, desc: str = "train", stop_after: int | None = None) -> Fit:
  """Micro-steps ``state.step + 1 .. opt.steps * opt.grad_accum`` (at most ``stop_after`` of them) of
  ``step_fn(state, global_batch(next(batches)), *frozen)``.

  With a ``store`` holding a checkpoint, the state and ``batches.state`` first resume from its latest
  step. Every ``log_every`` steps and at the last, the step's scalar metrics, ``learning_rate`` and
  ``record(metrics, window)`` go to ``log_dir``'s MetricsWriter and the progress bar (``window``:
  ``steps``, ``seconds`` and the ``keep`` values since the previous record; the first step, mostly
  compilation, is in none); then each ``hook(step, state)`` may return a record to write. Every
  ``checkpoint_every`` steps (0: none before the last) and at the last, ``store`` saves the state with
  ``{data_state, step}``. Metrics of steps past the resumed checkpoint that an interrupted run logged are
  replaced, not repeated (``MetricsWriter``'s ``start_step``).
  """
  from tqdm import tqdm
  from jetspec_jax.train.metrics import MetricsWriter
  if checkpoint_every < 0:
    raise JetSpecError(f"checkpoint.every must be >= 0 (0: a checkpoint at the end only), got {checkpoint_every}")
  if store is not None and store.latest_step() is not None:
    state, meta = store.restore(store.latest_step(), abstract(state))
    batches.state = int(meta["data_state"])
    log.info("resumed from step %d", int(state.step))
  total, start = opt.steps * opt.grad_accum, int(state.step)
  writer = MetricsWriter(log_dir, enabled=log_dir is not None, start_step=start)
  bar = tqdm(total=total, initial=start, desc=desc, unit="step", disable=not progress or jax.process_index() != 0)
  kept, last, done = {k: [] for k in keep}, {}, 0
  t_start = t_first = t_log = time.perf_counter()
  while start + done < total and (stop_after is None or done < stop_after):
    state, metrics = step_fn(state, global_batch(next(batches), sharding, fields), *frozen)
    done += 1
    step = start + done
    for k in keep:
      kept[k].append(metrics[k])
    if done == 1:
      jax.block_until_ready(metrics)
      t_first = t_log = time.perf_counter()
      logged = 1            # steps of this invocation before the current window
    if step % log_every == 0 or step == total:
      m, now = jax.device_get(metrics), time.perf_counter()
      window = {"steps": done - logged, "seconds": max(now - t_log, 1e-9),
                **{k: jax.device_get(v[logged:]) for k, v in kept.items()}}
      t_log, logged = now, done
      last = {k: float(v) for k, v in m.items() if np.ndim(v) == 0}
      last.update(learning_rate=opt.lr_at(step - 1), **(record(m, window) if record else {}))
      writer.write(step, last)
      bar.set_postfix(loss=f"{last['loss']:.3f}", refresh=False)
    for hook in hooks:
      if extra := hook(step, state):
        writer.write(step, extra)
        last.update(extra)
    if store is not None and (checkpoint_every and step % checkpoint_every == 0 or step == total):
      store.save(step, state, {"data_state": batches.state, "step": step})
    bar.update(1)
  jax.block_until_ready(state)
  seconds = time.perf_counter() - t_start
  bar.close()
  writer.close()
  return Fit(state, start + done, last, {k: jax.device_get(v) for k, v in kept.items()}, seconds, t_first - t_start)

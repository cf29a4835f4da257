"""Pretraining a small Qwen3 target from scratch on chat rows (the demo's "target that has learned
something", since no real weights are downloadable in every setting).

Objective: next-token cross-entropy over EVERY real token of each row (prompt and response alike;
``loss_mask`` is ignored), averaged over the batch's predicted tokens. Padding (segment id 0) is
never a target. Packed rows (several conversations per row, see ``records.prepare_dataset(pack=True)``)
are exact: a token attends only to earlier tokens of its own conversation (``causal & seg_i == seg_j``),
RoPE uses the per-conversation positions of the batch, and the last token of one conversation is not
trained to predict the first token of the next.

Step (``runtime.compile_step``: sharded over the mesh's ``data`` axis and the weights' logical axes):
the target's hidden states over the whole row (no KV cache), float32 logits, AdamW (float32 master
weights; no decay on norms) with linear warmup + cosine decay and global-norm clipping at 1.0.

The result is written atomically as a normal Hugging Face directory (``config.json``,
``model.safetensors``, the tokenizer files), loadable by ``convert.load_target`` and by
``transformers.AutoModelForCausalLM``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

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
from jetspec_jax.train import runtime


BATCH_FIELDS = ("input_ids", "segment_ids", "positions")


def default_demo_config(vocab_size: int, eos_id: int | None, pad_id: int | None, *, hidden_size: int = 128,
                        num_layers: int = 4) -> Qwen3Config:
  """The demo target: query heads of 64 (hidden_size / 64 of them, half as many KV heads, at least
  one), SwiGLU 3 x hidden, tied embeddings, rope_theta 1e6 (why this size: docs/demo.md)."""
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


def _loss(params: dict, batch: dict, key, *, cfg: Qwen3Config, mesh):
  loss, count = mean_loss(params, cfg, batch, mesh=mesh)
  return loss, {"tokens": count}


@functools.lru_cache(maxsize=8)
def build_program(cfg: Qwen3Config, opt: runtime.OptimizerConfig, mesh):
  """(optimizer, compiled step) of one setting (weights in their logical axes' shardings); cached, so
  repeated runs of one setting compile once."""
  tx = opt.build()
  params = {n: jax.ShapeDtypeStruct(s.shape, jnp.float32, sharding=named_sharding(s.axes, s.shape, mesh))
            for n, s in qwen3.param_specs(cfg).items()}
  loss = functools.partial(_loss, cfg=cfg, mesh=mesh)
  return tx, runtime.compile_step(loss, tx, runtime.state_shardings(tx, params, mesh),
                                  NamedSharding(mesh, P("data", None)), BATCH_FIELDS)


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
  """Train ``cfg`` from scratch on ``rows`` (``records.ChatRows``, packed or not) for ``steps`` steps of
  ``batch_size`` rows and write the Hugging Face directory ``out_dir``.

  Deterministic from ``seed`` (weights and the per-epoch row order). ``mesh``: a (data, model) mesh
  (default: one device); ``batch_size`` is global and must divide by its data axis and by the process
  count. ``tokenizer_dir``: its files are copied into ``out_dir`` and its eos / pad / bos ids go into
  config.json. Every ``log_every`` steps the loss goes to the tqdm bar and, with ``log_dir``, to
  ``MetricsWriter`` (loss, grad_norm, tokens, learning_rate, tokens_per_s). ``out_dir`` must be absent
  or empty unless ``overwrite``; it is checked before training and written atomically after.

  Returns {out_dir, files, steps, initial_loss (step 1, before any update), final_loss (last step),
  final_loss_avg (mean of the last 10% of steps), losses (every step), tokens (predicted tokens),
  seconds (training loop, compilation included), first_step_seconds (mostly compilation),
  tokens_per_s / padded_tokens_per_s (after step 1), num_params, num_params_non_embedding, config}.
  """
  from jetspec_jax.train.batching import BatchIterator
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
  local_batch = runtime.local_batch_size(batch_size, mesh)
  opt = runtime.OptimizerConfig(steps=int(steps), learning_rate=float(learning_rate), warmup_frac=float(warmup_frac),
                                final_lr_frac=0.1, clip_norm=1.0, weight_decay=0.1, decay_matrices_only=True)
  tx, step_fn = build_program(cfg, opt, mesh)
  state = runtime.init_state(tx, qwen3.init_target(cfg, jax.random.key(seed), jnp.float32, mesh),
                             jax.random.key(seed + 1), mesh)
  record = lambda m, window: {"tokens_per_s": sum(int(t) for t in window["tokens"]) / window["seconds"]}
  done = runtime.fit(step_fn, state, BatchIterator(rows, local_batch, seed=seed), opt,
                     sharding=NamedSharding(mesh, P("data", None)), fields=BATCH_FIELDS, log_every=log_every,
                     record=record, keep=("loss", "tokens"), log_dir=log_dir, progress=progress, desc="pretrain")
  losses = [float(x) for x in done.kept["loss"]]
  token_counts = [int(x) for x in done.kept["tokens"]]
  steady_seconds = max(done.seconds - done.first_step_seconds, 1e-9)
  tail = max(1, steps // 10)
  steady_tokens = sum(token_counts[1:])
  out_cfg = export_config(cfg, tokenizer)
  host = host_values(done.state.params)
  files = []
  if jax.process_index() == 0:
    files = write_hf_directory(out_dir, out_cfg, host, tokenizer_dir, overwrite)
  return {
      "out_dir": os.path.abspath(out_dir), "files": files, "steps": steps,
      "initial_loss": losses[0], "final_loss": losses[-1], "final_loss_avg": float(np.mean(losses[-tail:])),
      "losses": losses, "tokens": int(sum(token_counts)),
      "seconds": done.seconds, "first_step_seconds": done.first_step_seconds,
      "tokens_per_s": steady_tokens / steady_seconds if steps > 1 else 0.0,
      "padded_tokens_per_s": (steps - 1) * batch_size * rows.seq_len / steady_seconds if steps > 1 else 0.0,
      "num_params": num_params(cfg),
      "num_params_non_embedding": num_params(cfg) - cfg.vocab_size * cfg.hidden_size * (
          1 if cfg.tie_word_embeddings else 2),
      "config": out_cfg.to_hf_dict("float32"),
  }

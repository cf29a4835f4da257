"""Trainer: resume exactness, half-written checkpoints, sharded == unsharded, multi-host == single host."""
import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jetspec_jax import convert
from jetspec_jax.errors import JetSpecError
from jetspec_jax.train import trainer

import trainer_world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  return trainer_world.build(str(tmp_path_factory.mktemp("world")))


def losses(out_dir):
  rows = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
  return [r["loss"] for r in rows if "loss" in r]


def head_weights(out_dir):
  return convert.load_head(os.path.join(out_dir, "head_hf"))[1]


def test_interrupted_then_resumed_equals_uninterrupted(world, tmp_path, caplog):
  full = trainer.run(trainer_world.tiny_config(world, str(tmp_path / "full"), **{"train.steps": 4,
                     "checkpoint.every": 2}), progress=False)
  assert full["step"] == 4
  cfg = trainer_world.tiny_config(world, str(tmp_path / "split"), **{"train.steps": 4, "checkpoint.every": 2})
  part = trainer.run(cfg, progress=False, stop_after=3)      # step 3 is logged, then lost with the run
  assert part["step"] == 3 and "head_dir" not in part
  # An interrupted save of step 4 leaves a temporary directory: it must be skipped with a warning.
  junk = tmp_path / "split" / "checkpoints" / "4.orbax-checkpoint-tmp-1234"
  junk.mkdir()
  (junk / "partial").write_text("x")
  with caplog.at_level(logging.WARNING, logger="jetspec_jax.train"):
    rest = trainer.run(cfg, progress=False)
  assert "incomplete checkpoint" in caplog.text
  assert rest["step"] == 4
  a, b = head_weights(str(tmp_path / "full")), head_weights(str(tmp_path / "split"))
  for k in a:
    np.testing.assert_allclose(np.asarray(a[k]), np.asarray(b[k]), rtol=1e-6, atol=1e-7)
  assert losses(str(tmp_path / "split"))[-2:] == pytest.approx(losses(str(tmp_path / "full"))[-2:], rel=1e-6)
  # the resumed run redid step 3: metrics.jsonl holds each step once, as the uninterrupted run's does
  steps = lambda d: [json.loads(l)["step"] for l in open(os.path.join(d, "metrics.jsonl")) if "loss" in l]
  assert steps(str(tmp_path / "split")) == steps(str(tmp_path / "full")) == [1, 2, 3, 4]


def test_checkpoint_every_zero_saves_at_the_end_only(world, tmp_path):
  out = tmp_path / "end"
  res = trainer.run(trainer_world.tiny_config(world, str(out), **{"train.steps": 3, "checkpoint.every": 0}),
                    progress=False)
  assert res["step"] == 3 and sorted(os.listdir(out / "checkpoints")) == ["3"]
  bad = trainer_world.tiny_config(world, str(tmp_path / "bad"), **{"train.steps": 3, "checkpoint.every": -1})
  with pytest.raises(JetSpecError, match="checkpoint.every must be >= 0"):
    trainer.run(bad, progress=False)


@pytest.mark.parametrize("mesh", [(2, 2), (4, 2)])
def test_sharded_step_equals_unsharded(world, tmp_path, mesh):
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  ref = trainer_world.tiny_config(world, str(tmp_path / "one"), **{"train.steps": 2, "mesh.data": 1, "mesh.model": 1})
  trainer.run(ref, progress=False)
  sharded = trainer_world.tiny_config(world, str(tmp_path / "mesh"), **{"train.steps": 2, "mesh.data": mesh[0],
                                                                        "mesh.model": mesh[1]})
  trainer.run(sharded, progress=False)
  np.testing.assert_allclose(losses(str(tmp_path / "mesh")), losses(str(tmp_path / "one")), rtol=2e-5)


def evals(out_dir):
  rows = [json.loads(l) for l in open(os.path.join(out_dir, "metrics.jsonl"))]
  return [r["eval_tau"] for r in rows if "eval_tau" in r]


def test_two_hosts_run_the_8b_mesh_and_follow_one_host(world, tmp_path):
  """Two processes x 8 CPU devices (standing for two 8-GPU hosts) train with the 8B config's mesh section as
  shipped (model axis inside a host, data over every device) and give the losses and eval tau of one
  process with 16 devices; a mesh that cannot be laid on the hosts is refused in one sentence."""
  from jetspec_jax.train.config_file import load_config
  mesh = load_config("qwen3_8b").mesh
  overrides = [f"--config.target={world['target']}", f"--config.data.path={world['data']}",
               "--config.data.seq_len=64", "--config.train.batch_size=16", "--config.train.num_anchors=8",
               "--config.train.chunk_anchors=4", "--config.head.block_size=4", "--config.data.eval_examples=4",
               "--config.eval.every=3", "--config.log_every=1", "--config.train.steps=3",
               f"--config.mesh.data={mesh.data}", f"--config.mesh.model={mesh.model}"]
  env = dict(os.environ, PYTHONPATH=REPO, JETSPEC_KILL_GRACE="5")
  # launch/local.sh replaces XLA_FLAGS' device count per process and keeps the rest (scripts/test.sh's -O0)

  def launch(processes, devices, out, *extra):
    cmd = ["bash", os.path.join(REPO, "launch", "local.sh"), "-n", str(processes), "--cpu-devices", str(devices),
           "--", sys.executable, "-m", "jetspec_jax.cli", "train", "--config", "tiny", "--json",
           f"--config.output_dir={tmp_path / out}", *overrides, *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

  for proc in (launch(1, 16, "one"), launch(2, 8, "two")):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = lambda out: [json.loads(l) for l in open(tmp_path / out / "metrics.jsonl")]
  assert [r["step"] for r in rows("two") if "loss" in r] == [1, 2, 3]
  np.testing.assert_allclose(losses(str(tmp_path / "two")), losses(str(tmp_path / "one")), rtol=1e-5)
  assert len(evals(str(tmp_path / "one"))) == 1
  assert evals(str(tmp_path / "two")) == evals(str(tmp_path / "one"))
  refused = launch(2, 8, "odd", "--config.mesh.data=3", "--config.mesh.model=2")
  assert refused.returncode == 2 and "must divide by the process count" in refused.stderr, \
      refused.stderr[-2000:]


def test_packed_rows_train(world, tmp_path):
  """data.pack=True: rows hold several conversations, and training on them runs and learns; the final
  evaluation runs with an online-calibrated tree."""
  from jetspec_jax.tokenizer import load_tokenizer
  from jetspec_jax.train import records
  out = tmp_path / "packed"
  summary = trainer.run(trainer_world.tiny_config(world, str(out), **{
      "train.steps": 6, "data.pack": True, "data.seq_len": 128, "train.learning_rate": 0.01,
      "data.eval_examples": 2, "eval.max_new_tokens": 4, "eval.tree": "calibrated", "eval.online": "batch"}),
                        progress=False)
  assert summary["step"] == 6 and os.path.isdir(summary["head_dir"])
  assert summary["metrics"]["eval_tau"] >= 1.0
  rows = records.prepare_dataset(world["data"], load_tokenizer(world["tokenizer"]), str(out / "data"), seq_len=128,
                                 pack=True)
  assert max(len(rows.read([i])[0]["segment_lengths"]) for i in range(len(rows))) >= 2
  curve = losses(str(out))
  assert all(np.isfinite(curve)) and curve[-1] < curve[0]


def test_an_evaluation_tree_is_checked_before_training(world, tmp_path):
  from jetspec_jax.errors import JetSpecError
  with pytest.raises(JetSpecError, match="'static' needs an acceptance profile"):
    trainer.run(trainer_world.tiny_config(world, str(tmp_path / "run"), **{"eval.tree": "static"}), progress=False)
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_target_states_equal_the_dense_forward_without_its_score_buffers():
  """The train step's frozen target (query-blocked attention) equals the dense-attention forward on packed
  rows (float32, 1e-5), and its compiled program has no [B, H, L, L]-sized temporary (the dense one does)."""
  from jetspec_jax.config import Qwen3Config
  from jetspec_jax.models import qwen3
  from jetspec_jax.bench import largest_array
  cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, rope_theta=10000.0)
  batch, length, taps = 2, 1024, (0, 1)
  params = qwen3.init_target(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  segments, positions = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
  for b in range(batch):                           # 3-4 conversations per row, then padding (segment 0)
    bounds = [0, *sorted(rng.choice(np.arange(8, length - 64), 3, replace=False)), length - 40]
    for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
      segments[b, lo:hi], positions[b, lo:hi] = s + 1, np.arange(hi - lo)
  tokens = rng.integers(0, cfg.vocab_size, (batch, length)).astype(np.int32)

  def dense(p, t, s, q):
    hidden, _, tapped = qwen3.bind(cfg, p).hidden(t, q, qwen3.segment_causal_mask(s), tap_layers=taps)
    return hidden, tapped

  chunked = lambda p, t, s, q: trainer.target_states(p, cfg, t, s, q, taps)
  args = (params, tokens, segments, positions)
  compiled = [jax.jit(f).lower(*args).compile() for f in (dense, chunked)]
  for want, got in zip(compiled[0](*args), compiled[1](*args)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
  scores = batch * cfg.num_attention_heads * length * length
  old, new = (largest_array(c.as_text())[0] for c in compiled)
  assert old >= scores > new
  temp_old, temp_new = (c.memory_analysis().temp_size_in_bytes for c in compiled)
  assert temp_new < temp_old / 2, (temp_old, temp_new)


def test_mesh_expert_parallel_splits_the_targets_experts_over_model():
  """``mesh.expert_parallel``: the loaded target's config gets ``expert_parallel`` and its expert weights move
  to whole experts per ``model`` shard; off (the default), the config and weights stay as loaded."""
  import ml_collections
  from jax.sharding import PartitionSpec as P
  from jetspec_jax.config import Qwen3Config
  from jetspec_jax.models import qwen3
  from jetspec_jax.sharding import make_mesh
  cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
  mesh = make_mesh(2, 4)
  params = qwen3.init_target(cfg, jax.random.key(0), mesh=mesh)
  assert trainer.target_layout(cfg, ml_collections.ConfigDict({"expert_parallel": False})) == cfg
  ep = trainer.target_layout(cfg, ml_collections.ConfigDict({"expert_parallel": True}))
  placed = trainer.place_target(params, ep, mesh)
  assert ep.expert_parallel and placed["layers.0.mlp.gate"].sharding.spec == P("model", None, None)
  assert params["layers.0.mlp.gate"].sharding.spec == P(None, None, "model")
  np.testing.assert_array_equal(np.asarray(placed["layers.0.mlp.up"]), np.asarray(params["layers.0.mlp.up"]))

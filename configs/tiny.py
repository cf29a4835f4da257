"""CPU-sized training run (minutes): a small target and a 1-layer head, short sequences."""
from jetspec_jax.configs.base import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/tiny"
  c.head.num_layers = 1
  c.head.block_size = 8
  c.data.seq_len = 128
  c.train.steps = 200
  c.train.batch_size = 8
  c.train.num_anchors = 16
  c.train.chunk_anchors = 8
  c.train.learning_rate = 1e-3
  c.train.compute_dtype = "float32"
  c.train.target_dtype = "float32"
  c.checkpoint.every = 100
  c.eval.every = 100
  c.eval.max_new_tokens = 32
  c.eval.budget = 16
  c.log_every = 10
  return c

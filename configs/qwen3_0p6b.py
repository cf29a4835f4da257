"""Qwen3-0.6B target (28 layers, hidden 1024): a 1-layer head, block 16; one 8-GPU host."""
from jetspec_jax.configs.base import base_config


def get_config():
  c = base_config()
  c.output_dir = "runs/qwen3_0p6b"
  c.head.num_layers = 1
  c.head.block_size = 16
  c.data.source = "jsonl"
  c.data.seq_len = 2048
  c.train.steps = 20000
  c.train.batch_size = 32
  c.train.num_anchors = 512
  c.mesh.data = -1                    # every device of every host (data parallel across hosts)
  c.mesh.model = 1                    # inside each host
  return c

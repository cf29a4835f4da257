"""Qwen3-8B target (36 layers): the published 5-layer head, block 16, taps [1, 9, 17, 25, 33].
Sequence 3072, 512 anchors; sharded over 8 x H100/H200 (data 4 x model 2) per host."""
from jetspec_jax.configs.base import base_config, scale_schedule


def get_config():
  c = scale_schedule(base_config())
  c.output_dir = "runs/qwen3_8b"
  c.head.num_layers = 5
  c.head.block_size = 16
  c.head.target_layer_ids = (1, 9, 17, 25, 33)
  c.mesh.data = -1                    # every device of every host (data parallel across hosts)
  c.mesh.model = 2                    # inside each host
  return c

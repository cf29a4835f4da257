"""Qwen3-30B-A3B MoE target (48 layers, hidden 2048): the published 8-layer head (MLP 6144, 32/4
heads), block 16, taps [1, 12, 23, 34, 45]; 8 GPUs per host with the model axis over 4."""
from jetspec_jax.configs.base import base_config, scale_schedule


def get_config():
  c = scale_schedule(base_config())
  c.output_dir = "runs/qwen3_30b_a3b"
  c.head.num_layers = 8
  c.head.block_size = 16
  c.head.intermediate_size = 6144
  c.head.target_layer_ids = (1, 12, 23, 34, 45)
  c.mesh.data = -1                    # every device of every host (data parallel across hosts)
  c.mesh.model = 4                    # inside each host
  return c

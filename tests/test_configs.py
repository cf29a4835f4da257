"""The shipped training configs (configs/*.py): each loads by name, sets only keys the base config
declares (a misspelt key would otherwise become a new, silently ignored field), keeps their types, and
is consistent in itself: taps inside the target, anchors chunked, batches split evenly over the mesh."""
import glob
import os

import ml_collections
import pytest

from jetspec_jax.configs.base import base_config
from jetspec_jax.errors import JetSpecError
from jetspec_jax.train.config_file import load_config, shipped_configs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO_ROOT, "configs", "*.py"))
                 if os.path.basename(p) not in ("__init__.py", "base.py"))
TARGET_LAYERS = {"qwen3_0p6b": 28, "qwen3_8b": 36, "qwen3_30b_a3b": 48}     # of the target each is written for


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> dict:
  """{dotted key: value} of every leaf."""
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(leaves(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def test_every_target_config_is_covered():
  assert set(TARGET_LAYERS) | {"tiny"} == set(SHIPPED) == set(shipped_configs())


def test_a_config_loads_by_path_and_by_name_and_an_unknown_name_lists_the_shipped_ones():
  assert leaves(load_config(os.path.join(REPO_ROOT, "configs", "tiny.py"))) == leaves(load_config("tiny"))
  with pytest.raises(JetSpecError, match="shipped configs: qwen3_0p6b, qwen3_30b_a3b, qwen3_8b, tiny"):
    load_config("tinyy")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_is_consistent(name):
  config, base = leaves(load_config(name)), leaves(base_config())
  assert sorted(config) == sorted(base), set(config) ^ set(base)
  for key, value in config.items():
    assert type(value) is type(base[key]), (key, value, base[key])
  taps = config["head.target_layer_ids"]
  assert list(taps) == sorted(set(taps)) and all(0 <= t < TARGET_LAYERS.get(name, 1 << 30) for t in taps)
  assert config["head.block_size"] >= 2 and config["head.num_layers"] >= 1
  assert 1 <= config["train.chunk_anchors"] <= config["train.num_anchors"]
  assert config["data.seq_len"] > config["head.block_size"]
  if config["mesh.data"] > 0:
    assert config["train.batch_size"] % config["mesh.data"] == 0
  elif name != "tiny":    # data = every device: the same global batch on 1, 2 or 4 hosts of 8 devices
    for hosts in (1, 2, 4):
      assert config["train.batch_size"] % (hosts * 8 // config["mesh.model"]) == 0, hosts

"""Kernel tuning tables: rule selection, the JSON file and its errors, and that the kernel launches with
the table's configuration (CUDA lowering) unless the call overrides it. (test_tree_attention checks tuned configurations against the XLA reference.)"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from jetspec_jax.attention import AttentionImpl, attention
from jetspec_jax.errors import JetSpecError
from pallas_kernels.errors import KernelError
from cuda_lowering import lower_text
from pallas_kernels import tree_attention as ta
from pallas_kernels import tuning as kt

SMALL = kt.LaunchConfig(block_r=16, block_k=128, num_warps=4, num_stages=3)
MEDIUM = kt.LaunchConfig(block_r=64, block_k=64, num_warps=4, num_stages=2, num_splits=2)
LARGE = kt.LaunchConfig(block_r=128, block_k=64, num_warps=8, num_stages=3, target_programs=528, min_split_keys=256)
TABLE = kt.KernelTuning(rules=((4, SMALL), (64, MEDIUM), (512, LARGE)), device_kind="test device")


@pytest.mark.parametrize("rows,expected", [(1, SMALL), (4, SMALL), (5, MEDIUM), (64, MEDIUM), (65, LARGE),
                                           (512, LARGE), (4096, LARGE)])
def test_rules_pick_the_first_bound_at_or_above_the_rows(rows, expected):
  assert TABLE.config_for(rows) == expected


def test_json_round_trip_writes_through_a_temporary_file(tmp_path):
  path = tmp_path / "tuning.json"
  TABLE.save(path)
  assert kt.load_tuning(path) == TABLE
  assert [p.name for p in tmp_path.iterdir()] == ["tuning.json"]
  assert json.loads(path.read_text())["rules"][1] == dict(max_rows=64, **MEDIUM.__dict__)


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    ('{"rules": {}}', "list 'rules'"),
    ('{"rules": []}', "at least one rule"),
    ('{"rules": [{"max_rows": 8}, {"max_rows": 8}]}', "strictly increasing"),
    ('{"rules": [{"block_r": 16}]}', "integer 'max_rows'"),
    ('{"rules": [{"max_rows": 8, "block_m": 16}]}', r"unknown key\(s\) \['block_m'\]"),
    ('{"rules": [{"max_rows": 8, "num_warps": "four"}]}', r"rules\[0\].num_warps must be an integer"),
])
def test_bad_tuning_files_get_errors_that_name_the_problem(tmp_path, content, message):
  path = tmp_path / "bad.json"
  path.write_text(content)
  with pytest.raises(KernelError, match=message):
    kt.load_tuning(path)


def test_missing_tuning_file(tmp_path):
  with pytest.raises(KernelError, match="does not exist"):
    kt.load_tuning(tmp_path / "absent.json")


def test_a_call_without_a_table_uses_the_default():
  assert "num_warps = 4" in _lowered_text(128) and "num_stages = 2" in _lowered_text(128)


def _lowered_text(num_q: int, call=ta.tree_attention, **kwargs) -> str:
  spec = jax.ShapeDtypeStruct
  args = (spec((1, num_q, 32, 128), jnp.bfloat16), spec((1, 8, 4096, 128), jnp.bfloat16),
          spec((1, 8, 4096, 128), jnp.bfloat16), spec((1,), jnp.int32), spec((1, num_q, num_q), jnp.bool_))
  return lower_text(lambda *a: call(*a, **kwargs), *args)


def test_kernel_launches_with_the_tables_configuration():
  """The table a call passes reaches the Triton call (warps, stages), per problem size, directly and through
  ``attention``'s AttentionImpl; a call's own parameters override it."""
  assert "num_warps = 8" in _lowered_text(128, tuning=TABLE) and "num_stages = 3" in _lowered_text(128, tuning=TABLE)
  small = _lowered_text(1, tuning=TABLE)                                                     # rows 4: SMALL
  assert "num_warps = 4" in small and "num_stages = 3" in small
  assert "num_warps = 2" in _lowered_text(128, tuning=TABLE, num_warps=2)
  assert "num_warps = 8" in _lowered_text(128, call=attention, impl=AttentionImpl("pallas", TABLE))   # rows 512: LARGE


def test_an_illegal_table_entry_is_refused_at_the_call():
  """The kernel's own error; through ``attention`` it is the project's one-sentence JetSpecError."""
  bad = kt.KernelTuning(rules=((8, kt.LaunchConfig(block_r=48)),))
  with pytest.raises(KernelError, match="block_r=48"):
    _lowered_text(1, tuning=bad)
  with pytest.raises(JetSpecError, match="block_r=48"):
    _lowered_text(1, call=attention, impl=AttentionImpl("pallas", bad))


def test_every_tune_candidate_lowers_to_a_verified_triton_module(triton_modules):
  """The GPU run's sweep (pallas_kernels/kernel_tune.py) should spend its time measuring, not failing: every
  candidate configuration is legal and gives a Triton module that verifies, for one problem of each row
  count it is swept on (Qwen3-8B attention, bf16)."""
  from pallas_kernels import kernel_tune
  spec = jax.ShapeDtypeStruct
  for num_q in sorted({n for n, _ in kernel_tune.SHAPES}):
    args = (spec((1, num_q, 32, 128), jnp.bfloat16), spec((1, 8, 4096 + num_q, 128), jnp.bfloat16),
            spec((1, 8, 4096 + num_q, 128), jnp.bfloat16), spec((1,), jnp.int32), spec((1, num_q, num_q), jnp.bool_))
    for config in kernel_tune.CONFIGS:
      only = kt.KernelTuning(rules=((1, config),))
      lower_text(lambda *a, only=only: ta.tree_attention(*a, tuning=only), *args)
  assert len(triton_modules) == 3 * len(kernel_tune.CONFIGS)
  assert [error for _, error in triton_modules if error is not None] == []

"""Kernel tuning tables: rule selection, the JSON file and its errors, where the active table comes
from, and that the kernel launches with the table's configuration (CUDA lowering) unless the call
overrides it. (test_tree_attention checks tuned configurations against the XLA reference.)"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from jetspec_jax.errors import JetSpecError
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
  with pytest.raises(JetSpecError, match=message):
    kt.load_tuning(path)


def test_missing_tuning_file(tmp_path):
  with pytest.raises(JetSpecError, match="does not exist"):
    kt.load_tuning(tmp_path / "absent.json")


def test_active_tuning_prefers_the_environment_then_the_shipped_table(tmp_path, monkeypatch):
  monkeypatch.delenv(kt.ENV_VAR, raising=False)
  monkeypatch.setattr(kt, "SHIPPED_DIR", tmp_path)
  assert kt.active_tuning("Some GPU") == kt.DEFAULT_TUNING
  assert kt.shipped_path("NVIDIA H200") == tmp_path / "nvidia_h200.json"
  TABLE.save(tmp_path / "nvidia_h200.json")
  assert kt.active_tuning("NVIDIA H200") == TABLE
  other = kt.KernelTuning(rules=((1, LARGE),))
  other.save(tmp_path / "env.json")
  monkeypatch.setenv(kt.ENV_VAR, str(tmp_path / "env.json"))
  assert kt.active_tuning("NVIDIA H200") == other
  other = kt.KernelTuning(rules=((1, SMALL),))               # an edited file is read again
  other.save(tmp_path / "env.json")
  assert kt.active_tuning("NVIDIA H200") == other


def _lowered_text(num_q: int, **kwargs) -> str:
  spec = jax.ShapeDtypeStruct
  args = (spec((1, num_q, 32, 128), jnp.bfloat16), spec((1, 8, 4096, 128), jnp.bfloat16),
          spec((1, 8, 4096, 128), jnp.bfloat16), spec((1,), jnp.int32), spec((1, num_q, num_q), jnp.bool_))
  fn = jax.jit(lambda *a: ta.tree_attention(*a, **kwargs))
  return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_kernel_launches_with_the_tables_configuration(tmp_path, monkeypatch):
  """The environment's table reaches the Triton call (warps, stages), per problem size; a call's own
  parameters override it."""
  TABLE.save(tmp_path / "t.json")
  monkeypatch.setenv(kt.ENV_VAR, str(tmp_path / "t.json"))
  assert "num_warps = 8" in _lowered_text(128) and "num_stages = 3" in _lowered_text(128)   # rows 512: LARGE
  small = _lowered_text(1)                                                                   # rows 4: SMALL
  assert "num_warps = 4" in small and "num_stages = 3" in small
  assert "num_warps = 2" in _lowered_text(128, num_warps=2)
  assert "num_warps = 8" in _lowered_text(128, tuning=kt.KernelTuning(rules=((1, LARGE),)))


def test_an_illegal_table_entry_is_refused_at_the_call(tmp_path, monkeypatch):
  kt.KernelTuning(rules=((8, kt.LaunchConfig(block_r=48)),)).save(tmp_path / "t.json")
  monkeypatch.setenv(kt.ENV_VAR, str(tmp_path / "t.json"))
  with pytest.raises(JetSpecError, match="block_r=48"):
    _lowered_text(1)


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
      jax.jit(lambda *a, only=only: ta.tree_attention(*a, tuning=only)).trace(*args).lower(lowering_platforms=("cuda",))
  assert len(triton_modules) == 3 * len(kernel_tune.CONFIGS)
  assert [error for _, error in triton_modules if error is not None] == []

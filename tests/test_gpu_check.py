"""bench/gpu_check.py, the one script a lent GPU runs: its --smoke mode on CPU (kernel in interpret
mode), its JSON and profile traces, and that a failing shape is recorded in its row instead of ending
the run. (The kernel's tolerance checks on a GPU are tests/test_gpu.py.)"""
import dataclasses
import importlib.util
import json
import os
import sys

import pytest

from pallas_kernels import kernel_tune

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu_check():
  spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench", "gpu_check.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_check"] = module                   # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_smoke_run_writes_every_section(gpu_check, tmp_path, monkeypatch):
  from pallas_kernels import tuning
  monkeypatch.setenv("OUT", str(tmp_path))
  # the profile section generates as many tokens as the decode section (its default), so it reuses its compiles
  assert gpu_check.main(["--smoke", "--decode-budgets", "16", "--profile-budgets", "16", "--decode-new-tokens", "9"]) == 0
  report = json.loads((tmp_path / "gpu_check.json").read_text())
  rows = report["kernel"]["rows"]
  assert [(r["n"], r["prefix"]) for r in rows] == [(1, 3), (1, 600), (5, 3), (5, 600)]
  assert all(r["rel_err"] <= 1e-2 and r["kernel_us"] > 0 for r in rows)
  assert [r["splits"] for r in rows] == [1, 2, 1, 2]
  assert [r["mode"] for r in report["decode"]["rows"]] == ["ar", "tree_b16", "best_b16"]
  assert all("error" not in r for r in report["decode"]["rows"])
  profile = report["profile"]["rows"]
  assert [r["mode"] for r in profile] == ["ar", "tree_b16"]
  assert profile[0]["rounds"] == 8 and 1 <= profile[1]["rounds"] <= 8      # 9 tokens, the first from the prefill
  assert all("error" not in r and 0 < r["busy_us"] <= r["span_us"] and r["events"] > 0 and r["kernels"]
             for r in profile)
  assert [p["name"] for p in profile[1]["phases"]] == [*gpu_check.PHASES, "other"]
  decode_ms = {r["mode"]: r["ms_per_round"] for r in report["decode"]["rows"]}
  for r in profile:          # the decode section's unprofiled rounds (same tokens) set the busy fraction
    assert r["unprofiled_us"] == pytest.approx(decode_ms[r["mode"]] * 1e3)
    assert r["busy_fraction_unprofiled"] == pytest.approx(r["busy_us"] / r["unprofiled_us"])
  assert sorted(os.listdir(tmp_path / "traces")) == ["ar.json.gz", "tree_b16.json.gz"]
  phases = report["phases"]["rows"]
  assert [r["phase"] for r in phases] == ["ar_forward", "verify_b16", "draft", "tree_heap_b16", "tree_best_b16"]
  assert all("error" not in r and r["ms"] > 0 for r in phases) and phases[0]["ratio_to_ar_forward"] == 1.0
  tune = report["tune"]
  assert [(r["n"], r["prefix"]) for r in tune["best"]] == [(5, 3)]
  assert all("us" in r for r in tune["rows"]) and all(r["speedup_vs_default"] >= 1 for r in tune["best"])
  # the sweep's table (one rule: rows = group 2 x N 5) was saved and passed to the model sections
  table = tuning.load_tuning(tmp_path / "kernel_tuning.json")
  assert tune["applied"] == str(tmp_path / "kernel_tuning.json")
  assert report["phases"]["kernel_tuning"] == table.to_json()           # the model sections ran with the sweep's table
  fastest = tune["best"][0]
  assert table.rules == ((10, tuning.LaunchConfig(**{k: fastest[k] for k in tuning.FIELDS})),)
  assert report["kernel"]["tuning"] == tuning.DEFAULT_TUNING.to_json()


def test_a_failing_shape_is_recorded_and_the_run_goes_on(gpu_check, tmp_path, monkeypatch):
  """gpu_check measures and reports: a failing shape is an error in its row, and the run still exits 0.
  Also: --tune-minutes bounds the sweep alone (its timings are skipped, no table is applied)."""
  monkeypatch.setenv("OUT", str(tmp_path))
  assert gpu_check.main(["--smoke", "--skip-phases", "--skip-decode", "--skip-profile", "--tune-minutes", "0",
                         "--block-k", "48"]) == 0
  report = json.loads((tmp_path / "gpu_check.json").read_text())
  rows = report["kernel"]["rows"]
  assert len(rows) == 4 and all("block_k=48" in r["error"] for r in rows)
  assert all("skipped" in r for r in report["tune"]["rows"]) and report["tune"]["table"] is None
  assert "applied" not in report["tune"]


def test_an_illegal_tuning_config_is_recorded_not_raised(gpu_check):
  shape = gpu_check.SMOKE
  configs = (kernel_tune.DEFAULT, dataclasses.replace(kernel_tune.DEFAULT, block_k=48))
  result = kernel_tune.tune_section(lambda n, p: gpu_check.make_inputs(shape, n, p, seed=0), lambda fn, args: (fn(*args), 1e-6)[1],
                                    group=2, shapes=((5, 3),), configs=configs, interpret=True)
  good, bad = result["rows"]
  assert good["us"] == 1.0 and "block_k=48" in bad["error"]
  assert result["best"] == [dict(good, default_us=1.0, speedup_vs_default=1.0)]
  assert result["table"]["rules"] == [dict(max_rows=10, **dataclasses.asdict(kernel_tune.DEFAULT))]


def _timed(n, prefix, us_by_config):
  return [dict(n=n, prefix=prefix, **dataclasses.asdict(c), us=us) for c, us in us_by_config.items()]


def test_tuning_table_takes_the_best_config_over_each_row_count():
  a, b, c = kernel_tune.CONFIGS[:3]
  rows = (_timed(1, 1024, {a: 10.0, b: 9.0, c: 30.0})           # rows 4: b is fastest
          + _timed(16, 1024, {a: 10.0, b: 20.0, c: 11.0})       # rows 64, two prefixes: relative sums
          + _timed(16, 4096, {a: 40.0, b: 41.0, c: 20.0})       # a 1+2, b 2+2.05, c 1.1+1 -> c
          + _timed(128, 1024, {a: 5.0, b: 5.0})                 # rows 512: a tie goes to the earlier config
          + [dict(n=128, prefix=1024, **dataclasses.asdict(c), error="x")])
  table = kernel_tune.tuning_table(rows, group=4, device_kind="H")
  assert table.rules == ((4, b), (64, c), (512, a)) and table.device_kind == "H"
  assert kernel_tune.tuning_table([], group=4) is None


def test_rows_after_the_time_budget_are_skipped_not_failed(gpu_check, tmp_path, monkeypatch, capsys):
  """--minutes bounds the run: rows that would start after it are recorded as skipped, the model is not even
  built, and the run still exits 0 (nothing failed)."""
  monkeypatch.setenv("OUT", str(tmp_path))
  assert gpu_check.main(["--smoke", "--minutes", "0", "--skip-profile"]) == 0
  report = json.loads((tmp_path / "gpu_check.json").read_text())
  assert all(r["skipped"] == gpu_check.SKIPPED for r in report["kernel"]["rows"])
  assert all("skipped" in r for r in report["tune"]["rows"]) and report["tune"]["table"] is None
  assert report["phases"] == report["decode"] == dict(skipped=gpu_check.SKIPPED) and "profile" not in report
  assert "8 rows or sections skipped" in capsys.readouterr().out          # 4 kernel + 2 tune rows, 2 sections


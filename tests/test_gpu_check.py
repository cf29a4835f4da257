"""bench/gpu_check.py, the one script a lent GPU runs: its --smoke mode on CPU (kernel in interpret
mode), its JSON and profile traces, and that a failing shape is recorded in its row instead of ending
the run. (The kernel's tolerance checks on a GPU are tests/test_gpu.py.)"""
import dataclasses
import importlib.util
import json
import os
import sys

import pytest

from pallas_kernels import kernel_tune, tuning

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu_check():
  spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench", "gpu_check.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_check"] = module                   # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def _config(row):
  return tuning.LaunchConfig(**{k: row[k] for k in tuning.FIELDS})


def test_smoke_run_writes_every_section(gpu_check, tmp_path, monkeypatch):
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
  # The decode section's unprofiled rounds (same tokens) set the busy fraction. Each mode takes its own
  # mode's round: the ratio of their unprofiled times is the decode section's ratio_to_ar_step.
  ratio = {r["mode"]: r["ratio_to_ar_step"] for r in report["decode"]["rows"]}
  assert profile[1]["unprofiled_us"] / profile[0]["unprofiled_us"] == pytest.approx(ratio["tree_b16"])
  for r in profile:
    # Same unit (us per round) as the trace's own span: a round measured with and without the profiler
    # (0.65x and 1.04x on one CPU, 17.6x for the AR round beside a busy test worker), not a factor of 1000 apart.
    assert 0.01 < r["span_us"] / r["unprofiled_us"] < 100, r
    # The busy time it implies is the trace's: its busy fraction of its span.
    assert r["busy_fraction_unprofiled"] * r["unprofiled_us"] == pytest.approx(r["busy_fraction"] * r["span_us"])
  assert sorted(os.listdir(tmp_path / "traces")) == ["ar.json.gz", "tree_b16.json.gz"]
  phases = report["phases"]["rows"]
  assert [r["phase"] for r in phases] == ["ar_forward", "verify_b16", "draft", "tree_heap_b16", "tree_best_b16"]
  assert all("error" not in r and r["ms"] > 0 for r in phases) and phases[0]["ratio_to_ar_forward"] == 1.0
  tune = report["tune"]
  assert [(r["n"], r["prefix"]) for r in tune["best"]] == [(5, 3)]
  assert all("us" in r for r in tune["rows"])
  for best in tune["best"]:      # the fastest of its shape's timed rows, against the default config's row
    timed = {_config(r): r["us"] for r in tune["rows"] if (r["n"], r["prefix"]) == (best["n"], best["prefix"])}
    assert best["us"] == timed[_config(best)] == min(timed.values())
    assert best["default_us"] == timed[kernel_tune.DEFAULT]
    assert best["speedup_vs_default"] == pytest.approx(timed[kernel_tune.DEFAULT] / best["us"])
  # the sweep's table (one rule: rows = group 2 x N 5) was saved and passed to the model sections
  table = tuning.load_tuning(tmp_path / "kernel_tuning.json")
  assert tune["applied"] == str(tmp_path / "kernel_tuning.json")
  assert report["phases"]["kernel_tuning"] == table.to_json()           # the model sections ran with the sweep's table
  fastest = tune["best"][0]
  assert table.rules == ((10, _config(fastest)),)
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


def test_busy_fraction_of_the_unprofiled_round_by_hand(gpu_check):
  """Each profiled mode gets its own mode's unprofiled round (ms to us) and its busy share of it; a mode
  without a busy time or without a measured round gets neither."""
  profile = [dict(mode="ar", busy_us=300.0, total_us=450.0, span_us=900.0),
             dict(mode="tree_b16", busy_us=1500.0, total_us=1800.0, span_us=2500.0),
             dict(mode="tree_b64", error="x"), dict(mode="tree_b128", busy_us=10.0, total_us=10.0, span_us=20.0)]
  decode = [dict(mode="ar", ms_per_round=0.5), dict(mode="best_b16", ms_per_round=4.0),
            dict(mode="tree_b16", ms_per_round=2.0), dict(mode="tree_b64", ms_per_round=1.0),
            dict(mode="tree_b128", error="y")]
  lines = gpu_check.relate_to_unprofiled(profile, decode)
  assert [r.get("unprofiled_us") for r in profile] == pytest.approx([500.0, 2000.0, None, None])
  assert [r.get("busy_fraction_unprofiled") for r in profile] == pytest.approx([0.6, 0.75, None, None])
  assert len(lines) == 2 and lines[0].startswith("ar: busy 0.300 ms of an unprofiled 0.500 ms round")


def test_tune_section_reports_the_fastest_config_against_the_default():
  """Times given by hand: per shape the fastest config, the default's time and their ratio; a shape whose
  default failed has the fastest config but no speedup."""
  other = kernel_tune.CONFIGS[-1]
  times = iter([3e-6, 2e-6,                     # (5, 3): the other config, 1.5x faster
                1e-6, 4e-6,                     # (1, 3): the default, fastest
                RuntimeError("failed"), 5e-6])  # (2, 3): the default failed

  def timer(fn, args):
    t = next(times)
    if isinstance(t, Exception):
      raise t
    return t
  result = kernel_tune.tune_section(lambda n, p: (), timer, group=2, shapes=((5, 3), (1, 3), (2, 3)),
                                    configs=(kernel_tune.DEFAULT, other), interpret=True)
  best = {(r["n"], r["prefix"]): r for r in result["best"]}
  assert [_config(best[s]) for s in ((5, 3), (1, 3), (2, 3))] == [other, kernel_tune.DEFAULT, other]
  assert [(r["us"], r["default_us"], r["speedup_vs_default"]) for r in best.values()] == [
      (pytest.approx(2.0), pytest.approx(3.0), pytest.approx(1.5)),
      (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0)), (pytest.approx(5.0), None, None)]
  assert "RuntimeError: failed" in result["rows"][4]["error"]


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


"""bench/gpu_check.py, the one script a lent GPU runs: its --smoke mode on CPU (kernel in interpret
mode), its JSON, and that a failing shape is recorded in its row instead of ending the run."""
import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu_check():
  spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "bench", "gpu_check.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules["gpu_check"] = module                   # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_smoke_run_writes_every_section(gpu_check, tmp_path, monkeypatch):
  monkeypatch.setenv("OUT", str(tmp_path))
  assert gpu_check.main(["--smoke", "--decode-budgets", "16"]) == 0
  report = json.loads((tmp_path / "gpu_check.json").read_text())
  rows = report["kernel"]["rows"]
  assert [(r["n"], r["prefix"]) for r in rows] == [(1, 3), (1, 600), (5, 3), (5, 600)]
  assert all(r["rel_err"] <= 1e-2 and r["kernel_us"] > 0 for r in rows)
  assert [r["splits"] for r in rows] == [1, 2, 1, 2]
  assert [r["mode"] for r in report["decode"]["rows"]] == ["ar", "tree_b16"]
  assert all("error" not in r for r in report["decode"]["rows"])


def test_a_failing_shape_is_recorded_and_fails_the_run(gpu_check, tmp_path, monkeypatch):
  monkeypatch.setenv("OUT", str(tmp_path))
  assert gpu_check.main(["--smoke", "--skip-decode", "--block-k", "48"]) == 1
  rows = json.loads((tmp_path / "gpu_check.json").read_text())["kernel"]["rows"]
  assert len(rows) == 4 and all("block_k=48" in r["error"] for r in rows)

"""The profile-guided trees from the command line: `profile` writes the JSON beside the head, and generate /
bench take --tree rank_caps | calibrated | static with --tree-profile (and --online)."""
import json
import os

from greedy import assert_agree
from jetspec_jax import cli, convert
from jetspec_jax.decode import profile
from test_cli_errors import bench_world, one_sentence  # noqa: F401  (bench_world: a fixture)

PROFILE_FLAGS = ["--num-prompts", "1", "--prompt-len", "4", "--max-new-tokens", "6", "--budget", "8", "--width", "2"]


def _json(capsys, *argv):
  capsys.readouterr()
  code = cli.main([*argv, "--json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  return json.loads(out.out)


def test_profile_then_every_new_tree(bench_world, capsys):
  target, head, bank, out = bench_world
  res = _json(capsys, "profile", "--target", target, "--head", head, "--bank", bank, "--prompt-offset", "0",
              *PROFILE_FLAGS)
  path = os.path.join(head, profile.PROFILE_FILE)
  assert res["profile"] == os.path.abspath(path) and res["rounds"] >= 1
  prof = profile.load(head)
  assert prof.depth == 3 and prof.width == 2 and prof.visits[0] == res["rounds"]
  meta = json.load(open(path))["meta"]
  assert meta["tree"]["method"] == "best_nodes" and meta["prompts"] == 1
  ar = _json(capsys, "generate", "--target", target, "--prompt-ids", "5,6,7", "--max-new-tokens", "6",
             "--eos-ids", "")["token_ids"]
  cfg, params, _ = convert.load_target(target)
  for flags in (["--tree", "static"], ["--tree", "rank_caps"], ["--tree", "calibrated", "--online", "sequence"]):
    spec = _json(capsys, "generate", "--target", target, "--head", head, "--prompt-ids", "5,6,7",
                 "--max-new-tokens", "6", "--eos-ids", "", "--budget", "6", "--width", "2", "--tree-profile", head,
                 *flags)
    assert_agree(cfg, params, [[5, 6, 7]], [ar], [spec["token_ids"]])
    assert spec["tree"]["method"] == flags[1], flags
    assert spec["tree"]["profile"] == {"depth": 3, "width": 2, "rounds": prof.visits[0]}
  res = _json(capsys, "bench", "--target", target, "--head", head, "--bank", bank, "--out", out, "--num-prompts", "1",
              "--prompt-len", "4", "--max-new-tokens", "4", "--budgets", "4", "--width", "2", "--repeats", "1",
              "--tree", "calibrated", "--tree", "static", "--online", "batch", "--tree-profile", path)
  modes = res["banks"]["bank.jsonl"]["modes"]
  assert {"cal_online_b4", "static_b4"} <= set(modes) and all(m["equals_ar"] for n, m in modes.items() if n != "ar")


def test_tree_flags_are_checked(bench_world, tmp_path, capsys):
  target, head, bank, _ = bench_world
  gen = ["generate", "--target", target, "--head", head, "--prompt-ids", "1,2", "--max-new-tokens", "2"]
  one_sentence(capsys, *gen, "--tree", "static", phrases=("'static' needs an acceptance profile",
                                                           "jetspec-jax profile"))
  one_sentence(capsys, *gen, "--tree-profile", str(tmp_path / "none.json"), phrases=("no acceptance profile at",))
  one_sentence(capsys, *gen, "--online", "batch", phrases=("online calibration needs tree method 'calibrated'",))
  (tmp_path / "wide.json").write_text(json.dumps(profile.AcceptanceProfile.from_counts(
      [4, 2], [[1, 1], [1, 0]], [[1.0, 1.0], [0.5, 0.5]]).to_json()))
  one_sentence(capsys, *gen, "--tree", "static", "--width", "3", "--tree-profile", str(tmp_path / "wide.json"),
               phrases=("covers depth 2 and width 2", "needs depth 3 and width 3"))
  one_sentence(capsys, "profile", "--target", target, "--head", head, "--bank", bank, "--out",
               str(tmp_path / "no" / "p.json"), phrases=("does not exist",))


def test_bench_load_mode(bench_world, capsys):
  """`bench --load`: ShareGPT-shaped requests through the engine, AR and the tree, all at once and at a rate."""
  target, head, _, out = bench_world
  flags = ["bench", "--load", "--target", target, "--head", head, "--out", out, "--num-requests", "3", "--slots", "2",
           "--max-new-tokens", "4", "--budgets", "4", "--width", "2", "--prefill-rows", "16"]
  res = _json(capsys, *flags, "--request-rate", "inf", "--request-rate", "50")
  assert set(res["modes"]) == {"ar", "best_nodes"} and res["requests"] == 3
  for mode in res["modes"].values():
    assert set(mode) == {"inf", "50"}
    for r in mode.values():
      assert r["output_tokens"] == 12 and 0 < r["occupancy"] <= 1 and r["ttft_s"]["p50"] > 0
  assert os.path.isfile(res["plot"]) and os.path.isfile(os.path.join(out, "bench_load.json"))
  one_sentence(capsys, *flags, "--request-rate", "fast", phrases=("--request-rate must be a number or inf",))
  one_sentence(capsys, *flags, "--slots", "0", phrases=("--slots must be at least 1",))

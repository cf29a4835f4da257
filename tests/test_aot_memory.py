"""bench/aot_memory.py at CI size: the tiny config's train step and the 30B-A3B train step and decode loop
with the target and head cut to 2 layers, compiled ahead of time with abstract weights on the 8 fake devices."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import aot_memory  # noqa: E402


def test_ci_sized_run_reports_positive_memory_within_the_budget(tmp_path, capsys):
  out = tmp_path / "aot.json"
  assert aot_memory.main(["--configs", "tiny,qwen3_30b_a3b", "--layers", "2", "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "| config" in printed and "peak_gb" in printed and "XLA:CPU fuses differently" in printed
  rows = json.loads(out.read_text())["rows"]
  assert [(r["config"], r["program"].split()[0]) for r in rows] == [
      ("tiny", "train"), ("qwen3_30b_a3b", "train"), ("qwen3_30b_a3b", "decode")]
  for r in rows:
    assert 0 < r["args_gb"] and 0 < r["temp_gb"] and 0 < r["peak_gb"] <= 80 - 10 and r["fits"], r
    # hlo_tflop: loop bodies times their trip counts, one round body per decode round (XLA's count adds every
    # body once, the round bodies' loops included), so only the analytic count bounds it
    assert r["hlo_tflop"] > 0 and r["xla_tflop"] > 0, r
    assert r["program"].startswith("decode") or r["hlo_tflop"] >= r["xla_tflop"], r
    assert 0.5 < r["hlo_vs_analytic"] < 2, r


def test_regeneration_at_8b_width_is_memory_bounded(tmp_path):
  """8 prompts of 8192 tokens at Qwen3-8B width (2 layers here) on the 8B config's mesh: the engine prefills them
  64 rows per lane and round, so its temporaries stay far below what [B, H, 8192, 9216] float32 scores per layer
  (one unchunked prefill) would take."""
  out = tmp_path / "regen.json"
  aot_memory.main(["--configs", "qwen3_8b", "--layers", "2", "--no-train", "--no-decode", "--out", str(out)])
  (row,) = json.loads(out.read_text())["rows"]
  assert row["program"].startswith("regen x8, prompts 8192 + 1024"), row
  unchunked_scores_gb = 2 * 16 * 8192 * 9216 * 4 / 1e9        # per device on the 4x2 mesh: 9.7 GB per layer
  assert row["temp_gb"] < 0.5 * unchunked_scores_gb and row["fits"], row



def test_paged_round_holds_its_pool_not_every_slots_context(tmp_path):
  """The tiny config's speculative round at 4 slots of 512 positions with a 16-page pool: its arguments are the
  weights, that pool and a small state, and the ShareGPT mix (a tokenizer trained here) fits more requests paged
  than a slot's whole context each."""
  from jetspec_jax.tokenizer import train_chat_tokenizer
  tok = train_chat_tokenizer([f"the quick brown fox {i} jumps over the lazy dog" for i in range(40)], 300,
                             str(tmp_path / "tok"))
  out = tmp_path / "paged.json"
  assert aot_memory.main(["--configs", "tiny", "--no-train", "--paged-slots", "4", "--paged-context", "512",
                          "--kv-pages", "16", "--no-contiguous", "--mix-tokenizer", tok, "--mix-requests", "20",
                          "--out", str(out)]) == 0
  result = json.loads(out.read_text())
  (row,) = result["rows"]
  info = result["details"]["tiny/paged/x4/16"]
  assert row["program"].startswith("paged engine x4, context 512, 16 pages") and row["fits"], row
  assert info["pool_pages"] == 16 < 4 * info["max_pages_per_slot"], info
  assert 0 < info["pool_gb"] and 0 <= info["state_and_other_args_gb"] < info["weights_gb"], info
  c = info["concurrency"]
  assert c["requests_in_mix"] == 20 and c["paged_requests"] > c["contiguous_requests"] > 0, c


def test_a_program_refused_for_want_of_hbm_is_a_row_that_does_not_fit():
  """XLA:TPU's out-of-memory refusal (its text as libtpu 0.0.50.1 words it) becomes a row: not fitting, the
  compiler's temporaries in GB (its "G" is GiB), the sentence kept."""
  message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
             "HLO temporaries (41.78G) exceeds available HBM (31.24G). HLO module: jit_step.\nSee https://x for more.")
  row = aot_memory.too_large("qwen3_8b", "train", message)
  assert row["fits"] is False and row["program"] == "train (not compiled)"
  assert abs(row["temp_gb"] - 41.78 * 2 ** 30 / 1e9) < 1e-9 and row["error"].startswith("RESOURCE_EXHAUSTED")

"""bench/paged_load.py --quick on a tiny target with a fresh head and a tokenizer trained here: both engines hold
one KV memory, the paged one more slots, every request answered; the shared-prefix part computes fewer prompt rows
with prefix caching than without."""
import itertools
import json
import os
import sys

import pytest

import hf_fixtures
from jetspec_jax import convert, tokenizer
from jetspec_jax.train.sources import iter_conversations
from test_cli_errors import save_head

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import paged_load  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("paged_load")
  texts = [m["content"] for c in itertools.islice(iter_conversations("sharegpt"), 60) for m in c]
  tok = tokenizer.train_chat_tokenizer(texts, 300, str(root / "tok"))
  target = hf_fixtures.save_model(hf_fixtures.build_model(hf_fixtures.hf_config("dense_tied", vocab_size=320)),
                                  str(root / "target"))
  convert.copy_side_files(tok, target, convert.TOKENIZER_FILES)
  return target, save_head(target, str(root / "head")), root


def test_quick_run_compares_paged_and_contiguous_at_one_memory(world, capsys):
  """AR (the speculative engines take the same path, with longer compiles)."""
  target, head, root = world
  out = root / "paged.json"
  paged_load.main(["--target", target, "--head", head, "--quick", "--ar", "--requests", "6", "--prefix-requests", "4",
                   "--json", str(out)])
  result = json.loads(out.read_text())
  c = result["capacity"]
  assert c["slots"]["paged"] == 8 > c["slots"]["contiguous"] == 4 and c["requests"] == 6, c
  for name, r in c["engines"].items():
    assert r["kv_pages"] == 4 * c["slot_pages"], (name, r)          # one memory: four whole contexts
    assert 0 <= r["kv_pages_peak"] <= r["kv_pages"] and r["preemptions"] >= 0 and r["tokens_per_s"] > 0, (name, r)
  assert c["paged_vs_contiguous"] > 0
  sp = result["shared_prefix"]
  assert sp["prefix_tokens"] == 64 and sp["requests"] == 4
  assert set(sp["runs"]) == {"caching", "no_caching"}
  assert sp["runs"]["no_caching"]["prompt_rows_computed"] == sp["prompt_tokens"]
  assert sp["runs"]["caching"]["prompt_rows_computed"] < sp["prompt_tokens"]      # the 64-token prefix: shared
  printed = capsys.readouterr().out
  assert "paged / contiguous tokens/s" in printed and "TTFT p99 s" in printed

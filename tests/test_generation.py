"""The engine's generation API: SamplingConfig, ``generate`` and ``EngineRun`` / ``RequestResult`` counts, a
request's own key and a wider slot, no host transfer inside the loop, the transfer guard and fetch hooks."""
import dataclasses
import functools

import jax
import numpy as np
import pytest

from jetspec_jax.bench import HOST_OPS
from greedy import assert_agree
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import reference
from jetspec_jax.decode.engine import Engine, EnginePlan, Report, Request, acceptance, generate
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3


CFG = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
HEAD = draft_head.DraftConfig.for_target(CFG, block_size=5, target_layer_ids=(1,))
TREE = TreeConfig("accum_logp", 16, 3, 4)
PROMPTS = [[5, 17, 33, 2], [61, 3, 9]]
MAX_NEW = 21               # every engine here (and in test_tree_profile) runs PROMPTS to 21 tokens: shared programs


@functools.cache
def weights():
  target = {k: v * 10 if v.ndim > 1 else v for k, v in qwen3.init_target(CFG, jax.random.key(0)).items()}
  return target, draft_head.init_head(HEAD, jax.random.key(1))


def test_sampling_config_resolves_greedy_and_rejects_bad_options():
  assert SamplingConfig(temperature=0.0, top_k=5, top_p=0.3, accept="match").resolved() == SamplingConfig()
  assert SamplingConfig().describe()["accept"] == "greedy"
  assert SamplingConfig(0.7, 3, 0.9, "match", 2).resolved() == SamplingConfig(0.7, 3, 0.9, "match", 2)
  with pytest.raises(JetSpecError):
    Engine.for_requests(CFG, weights()[0], [Request([1], 2)], slots=1,
                        sampling_cfg=SamplingConfig(temperature=1.0, top_p=0.0))


def speculative_kw(speculative_mode=True) -> dict:
  return dict(head_cfg=HEAD, head_params=weights()[1], tree=TREE) if speculative_mode else {}


def run(**kw):
  """PROMPTS to MAX_NEW tokens on an engine of one slot and one lane each (both prefilled in the first round)."""
  return generate(CFG, weights()[0], PROMPTS, MAX_NEW, lanes=2, eos_ids=(), **kw)


def test_result_counts_for_ar_and_speculative():
  """Two prompts prefilled in the first round (two lanes): AR takes a round per token after the first, every
  one of them a decode step of depth 0; a speculative request's depth histogram sums to its steps, and tau is
  its tokens after the first per step. Both equal the reference greedy tokens."""
  target, _ = weights()
  expected = [reference.greedy(CFG, target, p, MAX_NEW) for p in PROMPTS]
  ar = run()
  n = MAX_NEW - 1
  assert_agree(CFG, target, PROMPTS, expected, ar.tokens)
  assert [len(t) for t in ar.tokens] == [MAX_NEW] * 2 and [r.steps for r in ar.results] == [n, n]
  assert [r.depth_histogram.tolist() for r in ar.results] == [[n], [n]]
  assert [(r.admitted, r.first, r.finished) for r in ar.results] == [(0, 0, n), (0, 0, n)]
  assert ar.rounds == MAX_NEW and ar.busy_slot_rounds == 2 * MAX_NEW and ar.occupancy == 1.0
  spec = run(**speculative_kw())
  assert_agree(CFG, target, PROMPTS, expected, spec.tokens)
  assert all(r.depth_histogram.shape == (TREE.depth + 1,) for r in spec.results)
  assert [int(r.depth_histogram.sum()) for r in spec.results] == [r.steps for r in spec.results]
  assert spec.rounds == 1 + max(r.steps for r in spec.results)
  assert acceptance(spec.results)["tau"] == (sum(map(len, spec.tokens)) - 2) / sum(r.steps for r in spec.results)
  assert spec.wall_s > 0


def test_slot_width_and_key_reproduce_a_regeneration_batch():
  """A wider slot (room for longer prompts than these) changes no greedy request; a sampled request's own key
  reproduces its tokens, and the default key of request i is fold_in(key(seed), i); a prompt wider than the slot
  is refused."""
  target, _ = weights()
  wide = Engine(CFG, target, EnginePlan(slots=2, rows=2, lanes=1, prefill_rows=16, max_prompt=16,
                                        max_new_tokens=MAX_NEW, queue=2), eos_ids=())
  assert_agree(CFG, target, PROMPTS, run().tokens, wide.run([Request(p, MAX_NEW) for p in PROMPTS]).tokens)
  requests = [Request(p, 6) for p in PROMPTS]
  sampled = Engine.for_requests(CFG, target, requests, slots=2, eos_ids=(), sampling_cfg=SamplingConfig(1.0, seed=3))
  keyed = [Request(p, 6, key=jax.random.fold_in(jax.random.key(3), i)) for i, p in enumerate(PROMPTS)]
  tokens = sampled.run(requests).tokens
  assert sampled.run(keyed).tokens == tokens == sampled.run(keyed).tokens
  other = [Request(p, 6, key=jax.random.key(11)) for p in PROMPTS]
  assert sampled.run(other).tokens != tokens
  narrow = Engine(CFG, target, EnginePlan(slots=2, rows=2, lanes=1, prefill_rows=4, max_prompt=3, max_new_tokens=6,
                                          queue=2))
  with pytest.raises(JetSpecError, match="request 0: a prompt of 4 tokens .* does not fit a slot"):
    narrow.submit(requests)


@pytest.mark.parametrize("speculative_mode", [False, True], ids=["ar", "speculative"])
def test_no_host_transfer_inside_the_decode_loop(speculative_mode):
  """The compiled engine loop (every round, prefill and decode) holds no infeed/outfeed, send/recv or host
  callback."""
  target, _ = weights()
  kw = speculative_kw(speculative_mode)
  engine = Engine.for_requests(CFG, target, [Request(p, MAX_NEW) for p in PROMPTS], slots=2, lanes=2, prefill_rows=8,
                               eos_ids=(), **kw)
  text = engine.lower().compile().as_text()          # the program Engine.step runs (and ``run`` above)
  assert "while" in text and not HOST_OPS.findall(text)
  assert np.asarray(jax.device_get(engine.state.tokens)).shape == (2, MAX_NEW)


@pytest.mark.parametrize("speculative_mode", [False, True], ids=["ar", "speculative"])
def test_transfer_guard_and_fetch_hooks(speculative_mode, monkeypatch):
  """``transfer_guard`` wraps each step's device loop in the device-to-host guard at that level; ``on_fetch`` sees
  the arrays of the one fetch per segment (the report's, AR and speculative); the tokens are those of an
  uninstrumented engine."""
  target, _ = weights()
  kw = speculative_kw(speculative_mode)
  levels, fetches = [], []
  guard = jax.transfer_guard_device_to_host
  monkeypatch.setattr(jax, "transfer_guard_device_to_host", lambda level: levels.append(level) or guard(level))
  out = run(transfer_guard="disallow", on_fetch=fetches.append, **kw)
  assert levels == ["disallow"] and [len(f) for f in fetches] == [len(dataclasses.fields(Report))]
  assert all(isinstance(a, jax.Array) for a in fetches[0])
  assert out.tokens == run(**kw).tokens
  with pytest.raises(JetSpecError, match="transfer_guard 'sometimes'"):
    Engine.for_requests(CFG, target, [Request([1], 2)], slots=1, transfer_guard="sometimes")


def test_host_op_scan_sees_a_callback_in_a_loop():
  """Control for the check above: a host callback inside a while loop is found in the compiled text."""
  def body(i):
    jax.debug.callback(lambda v: None, i)
    return i + 1
  text = jax.jit(lambda: jax.lax.while_loop(lambda i: i < 3, body, 0)).lower().compile().as_text()
  assert HOST_OPS.findall(text)

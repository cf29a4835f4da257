"""The greedy agreement rule (``decode.agreement``) on a target whose LM head is edited so that two tokens'
logits at a chosen step differ by one float32 ulp (a near-tie: accepted) or by a clear margin (rejected)."""
import functools

import jax
import numpy as np
import pytest

from greedy import assert_agree
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import agreement, reference
from jetspec_jax.decode.agreement import TIE_ULPS, compare, first_difference, tie_gap
from jetspec_jax.decode.engine import generate
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.models import draft_head, qwen3

CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0, tie_word_embeddings=False)
PROMPT = [3, 14, 15, 92, 65]
NEW = 12


@functools.lru_cache(maxsize=None)
def base():
  """Random weights (scaled up so greedy text varies), their greedy tokens (``decode.reference``), and the step K
  edited below: the first step >= 3 whose token does not occur before it (so the edit changes no earlier choice)."""
  params = {k: np.asarray(v * 20 if v.ndim > 1 else v) for k, v in qwen3.init_target(CFG, jax.random.key(0)).items()}
  ref = reference.greedy(CFG, params, PROMPT, NEW)
  k = next(i for i in range(3, NEW) if ref[i] not in ref[:i])
  return params, ref, k


@functools.lru_cache(maxsize=None)
def edited(gap_ulps: int):
  """(params, a, b): the LM head's column of ``b`` (the runner-up at step K) set to ``a``'s (the chosen token),
  then one of its weights lowered step by step until the reference's logit of b is ``gap_ulps`` ulps or
  more below a's at step K. Returns the first edit that gets there."""
  params, ref, k = base()
  prefix = PROMPT + ref[:k]
  logits = agreement.last_logits(CFG, params, prefix)
  a = ref[k]
  b = int(np.argsort(logits)[-2])
  head = np.array(params["lm_head"])
  head[:, b] = head[:, a]
  target = qwen3.bind(CFG, params)
  h = np.asarray(target.hidden(np.asarray([prefix]), np.arange(len(prefix))[None],
                               qwen3.causal_mask(1, len(prefix)))[0][0, -1])
  j = int(np.argmax(np.abs(h)))
  step = float(agreement.row_ulp(logits)) / abs(h[j]) / 8                         # ~ 1/8 ulp of the logit per step
  w = head[j, a]
  for n in range(1, 100000):
    head[j, b] = np.float32(w - np.sign(h[j]) * step * n)
    trial = {**params, "lm_head": head.copy()}
    out = agreement.last_logits(CFG, trial, prefix)
    if out[b] < out[a] and tie_gap(out, a, b)[1] >= gap_ulps:
      return trial, a, b
  raise AssertionError("no edit reached the gap")


def test_identical_sequences_agree():
  params, ref, _ = base()
  result = assert_agree(CFG, params, [PROMPT], [ref], [list(ref)])
  assert result.identical == 1 and result.partings == () and result.label() == "yes"


def test_one_ulp_tie_is_accepted_and_the_comparison_stops_there():
  params, a, b = edited(1)
  _, ref, k = base()
  assert reference.greedy(CFG, params, PROMPT, k) == ref[:k]                  # the edit moved nothing before k
  gap, ulps = tie_gap(agreement.last_logits(CFG, params, PROMPT + ref[:k]), a, b)
  assert ulps == 1 and 0 < gap < 1e-5
  other = ref[:k] + [b] + [(t + 1) % CFG.vocab_size for t in ref[k + 1:]]     # and differs at every later token
  result = compare(CFG, params, [PROMPT], [ref[:k] + [a] + ref[k + 1:]], [other])
  assert result.agree and result.label() == "yes (1 tie)" and result.identical == 0
  (tie,) = result.ties
  assert (tie.sequence, tie.token, tie.reference_id, tie.other_id, tie.ulps) == (0, k, a, b, 1)
  assert result.as_dict()["ar_ties"] == [{"prompt": 0, "token": k, "top2_gap": gap, "ulps": 1.0, "reference_id": a,
                                          "other_id": b}]


def test_a_clear_margin_is_a_failure():
  params, a, b = edited(50 * TIE_ULPS)
  _, ref, k = base()
  other = ref[:k] + [b] + ref[k + 1:]
  result = compare(CFG, params, [PROMPT], [ref], [other])
  assert not result.agree and result.label() == "no" and result.ties == []
  (bad,) = result.elsewhere
  assert bad.token == k and bad.ulps >= 50 * TIE_ULPS
  with pytest.raises(AssertionError, match="differ beyond a near-tie"):
    assert_agree(CFG, params, [PROMPT], [ref], [other])
  # the tolerance is the rule's: the same gap is a tie for a rule that allows it
  assert compare(CFG, params, [PROMPT], [ref], [other], tie_ulps=int(bad.ulps) + 1).agree


def test_a_sequence_that_stops_early_or_goes_on_is_a_failure():
  params, ref, k = base()
  for other, where in ((ref[:k], k), (ref + [1], len(ref))):
    result = compare(CFG, params, [PROMPT], [ref], [other])
    assert not result.agree and result.elsewhere[0].gap is None and result.elsewhere[0].token == where
  assert first_difference([1, 2], [1, 2]) is None and first_difference([1, 2], [1, 3]) == 1
  assert first_difference([1, 2], [1]) == 1


@pytest.mark.parametrize("tree", [TreeConfig("best_nodes", 16, 3, 4), TreeConfig("chain", 1, 1, 4)])
def test_programs_of_other_shapes_agree_on_the_tied_target(tree):
  """On the 1-ulp target, the engine's speculative decoding and AR at batch 1 and 2, and the cache-free reference,
  may break the tie either way; by the rule they agree with AR, and anything else they emit would fail."""
  params, a, b = edited(1)
  _, ref, k = base()
  prompts = [PROMPT, PROMPT[::-1]]
  ar = generate(CFG, params, prompts, NEW, eos_ids=()).tokens
  alone = generate(CFG, params, [PROMPT], NEW, eos_ids=()).tokens
  assert ar[0][:k] == ref[:k] and ar[0][k] in (a, b)
  assert_agree(CFG, params, [PROMPT], ar[:1], alone)
  assert_agree(CFG, params, [PROMPT], ar[:1], [reference.greedy(CFG, params, PROMPT, NEW)])
  hcfg = draft_head.DraftConfig.for_target(CFG, num_layers=1, block_size=5)
  spec = generate(CFG, params, prompts, NEW, head_cfg=hcfg, head_params=draft_head.init_head(hcfg, jax.random.key(1)),
                  tree=tree, eos_ids=()).tokens
  result = assert_agree(CFG, params, prompts, ar, spec)
  assert all(t.token == k and {t.reference_id, t.other_id} == {a, b} for t in result.ties)

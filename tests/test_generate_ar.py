"""The engine's autoregressive decoding (no draft head) against transformers greedy ``generate`` (float32)."""
import dataclasses

import pytest
import torch

import hf_fixtures
from greedy import assert_agree
from jetspec_jax.decode.engine import generate
from jetspec_jax.errors import JetSpecError

NAME = "dense_gqa4"       # untied, GQA 4, head_dim != hidden/heads, theta 500
MAX_NEW = 12
PROMPTS = [[5, 17, 33, 2, 99, 140, 7], [61, 3], [12, 150, 44, 9, 88]]


@pytest.fixture(scope="module")
def target(jax_target):
  return jax_target(NAME)


@pytest.fixture(scope="module")
def hf_reference():
  model = hf_fixtures.named_model(NAME)
  return [hf_fixtures.hf_greedy(model, p, MAX_NEW) for p in PROMPTS]


def test_reference_is_not_degenerate(hf_reference):
  for ref in hf_reference:
    assert len(ref) == MAX_NEW and len(set(ref)) >= 4, ref


def test_the_reference_decoder_matches_transformers(target, hf_reference):
  """``decode.reference.greedy`` (the oracle the engine's equality tests use): transformers' tokens, and it
  stops right after the first EOS."""
  from jetspec_jax.decode import reference
  cfg, params = target
  for prompt, ref in zip(PROMPTS, hf_reference):
    assert_agree(cfg, params, [prompt], [ref], [reference.greedy(cfg, params, prompt, MAX_NEW)])
  ref = hf_reference[0]
  stop = next(i for i in range(2, MAX_NEW) if ref[i] not in ref[:i])
  assert reference.greedy(cfg, params, PROMPTS[0], MAX_NEW, eos_ids=(ref[stop],)) == ref[:stop + 1]


def test_batch1_matches_transformers(target, hf_reference):
  cfg, params = target
  out = generate(cfg, params, [PROMPTS[0]], MAX_NEW)
  assert_agree(cfg, params, PROMPTS[:1], hf_reference[:1], out.tokens)
  assert [len(t) for t in out.tokens] == [MAX_NEW]
  assert out.rounds == MAX_NEW and out.results[0].steps == MAX_NEW - 1    # one target forward per token


def test_batch3_ragged_prompts_match_transformers(target, hf_reference):
  cfg, params = target
  out = generate(cfg, params, PROMPTS, MAX_NEW)
  assert_agree(cfg, params, PROMPTS, hf_reference, out.tokens)


def test_batch3_matches_transformers_left_padded_batch(target, hf_reference):
  """transformers' own batched generate (left padding + attention mask) agrees too."""
  cfg, params = target
  model = hf_fixtures.named_model(NAME)
  width = max(map(len, PROMPTS))
  ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
  mask = torch.zeros_like(ids)
  for i, p in enumerate(PROMPTS):
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1
  with torch.no_grad():
    hf = model.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[:, width:].tolist()
  assert_agree(cfg, params, PROMPTS, hf_reference, hf)
  out = generate(cfg, params, PROMPTS, MAX_NEW)
  assert_agree(cfg, params, PROMPTS, hf, out.tokens)


def _eos_choice(continuation):
  """A token whose first occurrence is at index >= 2 of the greedy continuation: (token, index). One exists on any
  machine whose reference has 4 distinct tokens (test_reference_is_not_degenerate): at most two of their first
  occurrences fall before index 2."""
  for k, tok in enumerate(continuation):
    if k >= 2 and tok not in continuation[:k]:
      return tok, k
  raise AssertionError(f"no fresh token after index 1 in {continuation}: the reference is degenerate")


def test_eos_stops_right_after_it_like_transformers(target, hf_reference):
  cfg, params = target
  model = hf_fixtures.named_model(NAME)
  eos, k = _eos_choice(hf_reference[0])
  expected = hf_reference[0][:k + 1]
  assert expected[-1] == eos and eos not in expected[:-1]
  hf = hf_fixtures.hf_greedy(model, PROMPTS[0], MAX_NEW, eos_id=eos)
  assert hf == expected, "transformers includes the EOS and stops"
  out = generate(cfg, params, [PROMPTS[0]], MAX_NEW, eos_ids=[eos])
  if assert_agree(cfg, params, PROMPTS[:1], [expected], out.tokens).identical:    # not parted at a near-tie
    assert out.rounds == k + 1


def test_eos_in_a_batch_stops_only_that_row(target, hf_reference):
  """EOS taken from the config (eos_ids=None); a finished row must not hold the others back."""
  cfg, params = target
  eos, k = _eos_choice(hf_reference[0])
  cfg = dataclasses.replace(cfg, eos_token_ids=(eos,))
  out = generate(cfg, params, PROMPTS, MAX_NEW)
  expected = [ref[:ref.index(eos) + 1] if eos in ref else ref for ref in hf_reference]
  assert expected[0] == hf_reference[0][:k + 1]
  assert_agree(cfg, params, PROMPTS, expected, out.tokens)


def test_moe_batch1_matches_transformers(jax_target):
  cfg, params = jax_target("moe_norm")
  prompt = [7, 1, 90, 33, 12]
  ref = hf_fixtures.hf_greedy(hf_fixtures.named_model("moe_norm"), prompt, 10)
  out = generate(cfg, params, [prompt], 10)
  assert_agree(cfg, params, [prompt], [ref], out.tokens)


def test_bad_prompts_raise(target):
  cfg, params = target
  with pytest.raises(JetSpecError, match="request 1 has an empty prompt"):
    generate(cfg, params, [[1, 2], []], 2)
  with pytest.raises(JetSpecError, match="request 0: token id .* outside the vocabulary"):
    generate(cfg, params, [[1, cfg.vocab_size]], 2)


def test_bfloat16_generation_runs_on_cpu(hf_dir):
  """bf16 weights and cache, batch 2, 2 KV heads (the decode-time attention shapes)."""
  from jetspec_jax import convert
  cfg, params, _ = convert.load_target(hf_dir("dense", "bfloat16"))
  assert cfg.num_key_value_heads == 2
  out = generate(cfg, params, [[1, 2, 3], [4, 5]], 5)
  assert [len(t) for t in out.tokens] == [5, 5]
  assert all(0 <= t < cfg.vocab_size for row in out.tokens for t in row)


def test_generate_over_many_prompt_lengths_keeps_memory_maps_bounded(target):
  """A Python loop calling ``generate`` over 40 distinct prompt lengths in one process: each call's programs are
  released (``engine.programs`` keeps a few) and prompt capacities round to shared plans, so the process's memory
  maps (every XLA:CPU executable holds some) stay under the project's budget instead of growing per length."""
  from jetspec_jax import memory_maps
  from jetspec_jax.decode import reference
  cfg, params = target
  with memory_maps.Peak() as maps:
    for n in range(1, 41):
      prompt = [(7 * i + n) % cfg.vocab_size for i in range(n)]
      out = generate(cfg, params, [prompt], 3)
      if n in (1, 17, 40):            # one prompt per capacity class: the greedy reference's tokens
        assert_agree(cfg, params, [prompt], [reference.greedy(cfg, params, prompt, 3)], out.tokens)
      assert len(out.tokens[0]) == 3
  if maps.peak is None:
    pytest.skip("no /proc: memory maps cannot be counted here")
  assert maps.peak < memory_maps.BUDGET, maps.peak

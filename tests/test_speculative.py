"""Speculative decoding: lossless against AR, acceptance and KV compaction proven by oracle drafters."""
import functools

import jax
import jax.numpy as jnp
import pytest

import hf_fixtures
from greedy import assert_agree
from jetspec_jax.decode.generation import acceptance
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.generation import Generator
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.models import draft_head, qwen3

CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
PROMPTS3 = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]


@functools.lru_cache(maxsize=None)
def target():
  params = qwen3.init_target(CFG, jax.random.key(0))
  # Larger weights than the 0.02 init so greedy continuations are varied, not repeats.
  return {k: v * 20 if v.ndim > 1 else v for k, v in params.items()}


@functools.lru_cache(maxsize=None)
def head(block_size=16, causal=True):
  cfg = draft_head.DraftConfig.for_target(CFG, num_layers=2, block_size=block_size, causal=causal)
  return cfg, draft_head.init_head(cfg, jax.random.key(1))


@functools.lru_cache(maxsize=None)
def ar_tokens(batch, max_new, eos=()):
  prompts = PROMPTS3[:batch]
  return Generator(CFG, target(), eos_ids=eos).generate(prompts, max_new).tokens


LOSSLESS_CASES = [
    # (method, budget, width, depth, batch, max_new)
    ("accum_logp", 16, 7, 15, 3, 23),
    ("accum_logp", 64, 3, 4, 3, 21),
    ("accum_logp", 2, 1, 1, 1, 9),
    ("accum_logp", 1, 7, 4, 3, 6),
    ("top2gap", 16, 3, 4, 3, 21),
    ("top2gap", 64, 7, 15, 1, 30),
    ("best_nodes", 16, 7, 15, 3, 23),
    ("best_nodes", 64, 3, 4, 1, 21),
    ("chain", 1, 1, 15, 3, 25),
    ("chain", 1, 1, 4, 1, 13),
]


@pytest.mark.parametrize("method,budget,width,depth,batch,max_new", LOSSLESS_CASES)
def test_lossless_random_head(method, budget, width, depth, batch, max_new):
  hcfg, hparams = head()
  tc = TreeConfig(method, budget, width, depth)
  out = Generator(CFG, target(), head_cfg=hcfg, head_params=hparams, tree=tc).generate(PROMPTS3[:batch], max_new)
  assert_agree(CFG, target(), PROMPTS3[:batch], ar_tokens(batch, max_new), out.tokens)
  assert all(len(t) == max_new for t in out.tokens)


def test_lossless_with_eos_inside_a_round():
  ar = ar_tokens(3, 24)
  eos = (ar[0][5], ar[2][11])                      # tokens the greedy continuations emit mid-stream
  expected = ar_tokens(3, 24, eos)
  assert any(len(t) < 24 for t in expected)
  hcfg, hparams = head()
  out = Generator(CFG, target(), head_cfg=hcfg, head_params=hparams, tree=TreeConfig("accum_logp", 16, 3, 4),
                  eos_ids=eos).generate(PROMPTS3, 24)
  assert_agree(CFG, target(), PROMPTS3, expected, out.tokens)
  for toks in out.tokens:
    assert not any(t in eos for t in toks[:-1])    # nothing emitted past an EOS


def test_bidirectional_head_is_lossless():
  hcfg, hparams = head(block_size=5, causal=False)
  out = Generator(CFG, target(), head_cfg=hcfg, head_params=hparams,
                  tree=TreeConfig("accum_logp", 16, 3, 4)).generate(PROMPTS3, 12)
  assert_agree(CFG, target(), PROMPTS3, ar_tokens(3, 12), out.tokens)


def _greedy_continuation(target_params, view, depth):
  """The target's own next ``depth`` greedy tokens after the drafter's view (on a scratch copy of the cache)."""
  b = view
  batch = b.last_token.shape[0]
  one = jnp.ones((batch, 1, 1), bool)

  def step(carry, _):
    cache, tok, pos = carry
    logits, cache, _ = hf_fixtures.target_forward(target_params, CFG, tok[:, None], pos[:, None], cache, pos, one)
    nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    return (cache, nxt, pos + 1), nxt

  _, toks = jax.lax.scan(step, (b.cache, b.last_token, b.prefix_len), None, length=depth)
  return toks.T                                                                     # [B, D]


def oracle_drafter(offset):
  """A drafter proposing the target's greedy continuation (+offset mod V: always wrong if offset)."""
  def drafter(target_params, head_params, view, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
    toks = (_greedy_continuation(target_params, view, tree_cfg.depth) + offset) % cfg.vocab_size
    logits = jnp.where(jax.nn.one_hot(toks, cfg.vocab_size, dtype=bool), 0.0, -1e9)
    return logits, view.draft_cache
  return drafter


PERFECT = oracle_drafter(0)
WRONG = oracle_drafter(1)


@pytest.mark.parametrize("tc", [TreeConfig("chain", 1, 1, 4), TreeConfig("accum_logp", 16, 3, 4)])
def test_perfect_drafter_accepts_every_depth(tc):
  hcfg, hparams = head()
  rounds = 3
  max_new = 1 + rounds * (tc.depth + 1)            # prefill token + full rounds
  out = Generator(CFG, target(), head_cfg=hcfg, head_params=hparams, tree=tc, drafter=PERFECT).generate(PROMPTS3,
                                                                                                         max_new)
  assert_agree(CFG, target(), PROMPTS3, ar_tokens(3, max_new), out.tokens)
  assert out.rounds.tolist() == [rounds] * 3
  acc = acceptance([out])
  assert acc["tau"] == tc.depth + 1
  assert acc["rounds"] == 3 * rounds
  assert acc["depth_histogram"] == [0] * tc.depth + [3 * rounds]


def test_wrong_drafter_gives_tau_one():
  hcfg, hparams = head()
  out = Generator(CFG, target(), head_cfg=hcfg, head_params=hparams, tree=TreeConfig("chain", 1, 1, 4),
                  drafter=WRONG).generate(PROMPTS3, 7)
  assert_agree(CFG, target(), PROMPTS3, ar_tokens(3, 7), out.tokens)
  acc = acceptance([out])
  assert acc["tau"] == 1.0
  assert acc["acceptance_by_depth"] == [0.0] * 4


def test_finished_rows_commit_nothing_and_write_inside_the_cache():
  """EOS in one row, a max_new_tokens cut in the others, mixed per-row acceptance (row 1's drafter is always
  wrong, the others perfect), batch 3: the final state keeps every row's invariant (prefix_len = prompt +
  committed - 1, within the cache's committed region) and every row's committed cache rows equal AR's."""
  hcfg, hparams = head()
  max_new = 23
  rows = ar_tokens(3, max_new)
  stop = next(i for i in range(4, max_new) if rows[0][i] not in rows[0][:i] + rows[1] + rows[2])
  eos = (rows[0][stop],)                               # row 0 stops there; rows 1 and 2 run to max_new
  offsets = jnp.array([0, 1, 0])

  def mixed(target_params, head_params, view, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
    toks = (_greedy_continuation(target_params, view, tree_cfg.depth) + offsets[:, None]) % cfg.vocab_size
    return jnp.where(jax.nn.one_hot(toks, cfg.vocab_size, dtype=bool), 0.0, -1e9), view.draft_cache

  tc = TreeConfig("chain", 1, 1, 4)
  spec = Generator(CFG, target(), head_cfg=hcfg, head_params=hparams, tree=tc, drafter=mixed, eos_ids=eos)
  ar = Generator(CFG, target(), eos_ids=eos)
  s_state = spec.decode(spec.prefill(PROMPTS3, max_new)).base
  a_state = ar.decode(ar.prefill(PROMPTS3, max_new))
  ar_out = ar.generate(PROMPTS3, max_new).tokens
  assert_agree(CFG, target(), PROMPTS3, ar_out, spec.generate(PROMPTS3, max_new).tokens)
  assert len(ar_out[0]) == stop + 1 and [len(t) for t in ar_out[1:]] == [max_new, max_new]
  lengths = jnp.array([len(p) for p in PROMPTS3])
  assert s_state.prefix_len.tolist() == (lengths + s_state.num_tokens - 1).tolist()
  assert s_state.prefix_len.tolist() == a_state.prefix_len.tolist()
  cache_len = s_state.cache.max_len
  assert int(jnp.max(s_state.prefix_len)) + tc.num_nodes() + 1 <= cache_len
  for b, n in enumerate(s_state.prefix_len.tolist()):
    for got, want in zip(s_state.cache.k + s_state.cache.v, a_state.cache.k + a_state.cache.v):
      assert jnp.allclose(got[b, :, :n], want[b, :, :n], atol=1e-4), b


@pytest.mark.parametrize("chunk", [3, 4])
def test_chunked_prefill_equals_one_forward(chunk):
  """Prefill in chunks of rows (the long-prompt path; 3 pads the width 8 to 9) gives the first token, the
  committed cache rows and the head's context of one whole-prompt forward: AR and speculative outputs equal."""
  hcfg, hparams = head()
  for kw in ({}, dict(head_cfg=hcfg, head_params=hparams, tree=TreeConfig("best_nodes", 16, 3, 4))):
    whole, chunked = (Generator(CFG, target(), prefill_chunk=c, **kw) for c in (0, chunk))
    assert_agree(CFG, target(), PROMPTS3, whole.generate(PROMPTS3, 12).tokens, chunked.generate(PROMPTS3, 12).tokens)
    a, b = whole.prefill(PROMPTS3, 12), chunked.prefill(PROMPTS3, 12)
    a, b = (s.base if kw else s for s in (a, b))
    assert a.last_token.tolist() == b.last_token.tolist() and a.prefix_len.tolist() == b.prefix_len.tolist()
    for i, n in enumerate(a.prefix_len.tolist()):
      for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v):
        assert jnp.allclose(x[i, :, :n], y[i, :, :n], atol=1e-5)


def test_prefill_chunk_bounds_the_scores():
  from jetspec_jax.decode.engine import PREFILL_SCORE_BYTES, prefill_chunk
  # Qwen3-8B regeneration: 8 prompts of 8192 tokens, 1024 new, 32 query heads: 8 * 32 * 9216 * 4 bytes per row
  assert prefill_chunk(8, 32, 8192, 9216) == 64
  assert 8 * 32 * 64 * 9216 * 4 <= PREFILL_SCORE_BYTES < 8 * 32 * 128 * 9216 * 4
  assert prefill_chunk(1, 32, 512, 1024) == 0                       # fits: one forward

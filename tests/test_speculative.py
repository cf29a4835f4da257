"""Speculative decoding on the engine: lossless against the reference greedy decoder, acceptance and the
slots' cache rows proven by oracle drafters, chunked prefill equal to a whole-prompt prefill."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hf_fixtures
from greedy import assert_agree
from jetspec_jax import pages
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import reference
from jetspec_jax.decode.engine import Engine, Request, acceptance, generate
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.models import draft_head, qwen3

CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=10000.0)
PROMPTS3 = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
MAX_NEW = 30               # the longest generation of this file: shorter ones are prefixes of it


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
def _greedy(prompt: tuple[int, ...], eos: tuple[int, ...]) -> list[int]:
  return reference.greedy(CFG, target(), prompt, MAX_NEW, eos)


def ar_tokens(batch, max_new, eos=()):
  """The reference greedy tokens of the first ``batch`` prompts (``decode.reference``; a generation stopped at
  max_new is a prefix of a longer one)."""
  return [_greedy(tuple(p), tuple(eos))[:max_new] for p in PROMPTS3[:batch]]


def speculative(prompts, max_new, tree, head_kw=(), **kw):
  hcfg, hparams = head(*head_kw)
  return generate(CFG, target(), prompts, max_new, head_cfg=hcfg, head_params=hparams, tree=tree, **kw)


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
  out = speculative(PROMPTS3[:batch], max_new, TreeConfig(method, budget, width, depth))
  assert_agree(CFG, target(), PROMPTS3[:batch], ar_tokens(batch, max_new), out.tokens)
  assert all(len(t) == max_new for t in out.tokens)


def test_lossless_with_eos_inside_a_round():
  ar = ar_tokens(3, 24)
  eos = (ar[0][5], ar[2][11])                      # tokens the greedy continuations emit mid-stream
  expected = ar_tokens(3, 24, eos)
  assert any(len(t) < 24 for t in expected)
  out = speculative(PROMPTS3, 24, TreeConfig("accum_logp", 16, 3, 4), eos_ids=eos)
  assert_agree(CFG, target(), PROMPTS3, expected, out.tokens)
  for toks in out.tokens:
    assert not any(t in eos for t in toks[:-1])    # nothing emitted past an EOS


def test_bidirectional_head_is_lossless():
  out = speculative(PROMPTS3, 12, TreeConfig("accum_logp", 16, 3, 4), head_kw=(5, False))
  assert_agree(CFG, target(), PROMPTS3, ar_tokens(3, 12), out.tokens)


def _greedy_continuation(target_params, view, depth):
  """The target's own next ``depth`` greedy tokens after the drafter's view (on a scratch copy of the cache)."""
  b = view
  batch = b.last_token.shape[0]
  one = jnp.ones((batch, 1, 1), bool)

  def step(carry, _):
    cache, tok, pos = carry
    logits, cache, _ = hf_fixtures.target_forward(target_params, CFG, tok[:, None], pos[:, None], cache, pos, one,
                                                  table=b.table)
    nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    return (cache, nxt, pos + 1), nxt

  _, toks = jax.lax.scan(step, (b.cache, b.last_token, b.prefix_len), None, length=depth)
  return toks.T                                                                     # [B, D]


def oracle_drafter(right: bool):
  """A drafter that knows the target's greedy continuation: ``right``, it proposes it (all of its logits' mass
  there); otherwise every token but it (the continuation's token at -1e9), so whatever the tree's width, no
  candidate is ever the target's, for any target weights."""
  def drafter(target_params, head_params, view, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
    hot = jax.nn.one_hot(_greedy_continuation(target_params, view, tree_cfg.depth), cfg.vocab_size, dtype=bool)
    return jnp.where(hot == right, 0.0, -1e9), view.draft_cache
  return drafter


PERFECT = oracle_drafter(True)
WRONG = oracle_drafter(False)


@pytest.mark.parametrize("tc", [TreeConfig("chain", 1, 1, 4), TreeConfig("accum_logp", 16, 3, 4)])
def test_perfect_drafter_accepts_every_depth(tc):
  rounds = 3
  max_new = 1 + rounds * (tc.depth + 1)            # the prefill's token + full rounds
  out = speculative(PROMPTS3, max_new, tc, drafter=PERFECT, eos_ids=())
  assert_agree(CFG, target(), PROMPTS3, ar_tokens(3, max_new), out.tokens)
  assert [r.steps for r in out.results] == [rounds] * 3
  acc = acceptance(out.results)
  assert acc["tau"] == tc.depth + 1
  assert acc["rounds"] == 3 * rounds
  assert acc["depth_histogram"] == [0] * tc.depth + [3 * rounds]


def test_wrong_drafter_gives_tau_one():
  out = speculative(PROMPTS3, 7, TreeConfig("chain", 1, 1, 4), drafter=WRONG, eos_ids=())
  assert_agree(CFG, target(), PROMPTS3, ar_tokens(3, 7), out.tokens)
  acc = acceptance(out.results)
  assert acc["tau"] == 1.0
  assert acc["acceptance_by_depth"] == [0.0] * 4


@functools.partial(jax.jit, static_argnames=("hcfg",))
def _fresh_rows(params, head_params, tokens, *, hcfg):
  """Per layer, the target's keys and values [B, Hkv, W, Dh] of ONE causal forward over tokens [B, W] from an
  empty cache, and (``hcfg``) the head's context keys and values of its taps."""
  batch, width = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
  cache = qwen3.init_cache(CFG, batch, width, jnp.float32)
  taps_at = () if hcfg is None else hcfg.target_layer_ids
  _, cache, taps = hf_fixtures.target_forward(params, CFG, tokens, pos, cache, jnp.zeros((batch,), jnp.int32),
                                              qwen3.causal_mask(batch, width), tap_layers=taps_at)
  draft = None if hcfg is None else draft_head.bind(hcfg, head_params).context_kv(taps, pos)
  return cache, draft


def check_slots(engine):
  """Each slot's invariant after a step, and its cached rows: free, no prefix; prefilling, no token and
  prefix_len < prompt_len; decoding, prefix_len = prompt_len + tokens - 1 with room for a round's nodes.
  Rows < prefix_len of the target's cache (and the head's context) equal those of one causal forward over
  the slot's sequence (its prompt, then its tokens but the newest)."""
  s = jax.device_get(engine.state)
  plan = engine.plan
  width = plan.max_pages(engine.head_cfg) * plan.page_rows
  check_pages(s, plan)
  seqs = np.zeros((plan.slots, width), np.int32)
  for b in range(plan.slots):
    n, fill, m = int(s.prefix_len[b]), int(s.prompt_len[b]), int(s.num_tokens[b])
    if s.entry[b] < 0:
      assert n == 0, b
      continue
    g = b // (plan.slots // plan.groups)
    p = int(s.queue.prompt_len[g, s.entry[b]])
    if n < fill:                                       # prefilling: a new request, or a resumed one's tokens too
      assert m == 0 or fill == p + m - 1, b
    else:
      assert n == p + m - 1 and m >= 1 and n + plan.nodes + 1 <= width, b
    seq = list(s.queue.prompt[g, s.entry[b], :p]) + list(s.tokens[b, :max(m - 1, 0)])
    seqs[b, :len(seq)] = seq
  cache, draft = jax.device_get(_fresh_rows(engine.params, engine.head_params, jnp.asarray(seqs), hcfg=engine.head_cfg))
  view = lambda pool: np.asarray(pages.gather(jnp.asarray(pool), jnp.asarray(s.pages.table), width))
  got = [view(x) for x in s.cache.k + s.cache.v + (() if draft is None else s.draft_cache.k + s.draft_cache.v)]
  want = list(cache.k + cache.v) + ([] if draft is None else [k for k, _ in draft] + [v for _, v in draft])
  for b, n in enumerate(s.prefix_len.tolist()):
    for x, y in zip(got, want):
      np.testing.assert_allclose(x[b, :, :n], y[b, :, :n], rtol=1e-4, atol=1e-4, err_msg=f"slot {b}")


def check_pages(s, plan):
  """The allocator's invariant (per group, each page's reference count is the number of slots holding it; a page
  held by several slots is a keyed prompt page) and each held slot's pages cover its committed rows."""
  g, per = plan.groups, plan.slots // plan.groups
  pg = s.pages.refs.shape[1]
  for gi in range(g):
    owned = [int(x) for b in range(gi * per, (gi + 1) * per) for x in s.pages.table[b, :s.pages.held[b]]]
    counts = np.bincount(owned, minlength=pg)
    assert counts.tolist() == s.pages.refs[gi].tolist(), gi
    assert (s.pages.key[gi][counts > 1] != 0).any(axis=-1).all(), gi
  for b in range(plan.slots):
    row = s.pages.table[b, :s.pages.held[b]]
    assert len(set(row.tolist())) == len(row) and (row >= 0).all(), b
    assert (s.pages.table[b, s.pages.held[b]:] == -1).all(), b
    if s.entry[b] >= 0:
      assert s.pages.held[b] * plan.page_rows >= s.prefix_len[b], b
    else:
      assert s.pages.held[b] == 0, b


def run_stepwise(engine, requests):
  """``requests`` through ``engine`` one round per step, every slot checked after each (``check_slots``) and every
  running request's tokens so far a prefix of its final ones; results in request order."""
  engine.start()
  ids = engine.submit(requests)
  done, seen = {}, []
  while len(done) < len(requests):
    done.update((r.id, r) for r in engine.step(1))
    check_slots(engine)
    seen.append(engine.progress())
  for snapshot in seen:
    assert all(done[i].tokens[:len(t)] == t for i, t in snapshot.items())
  return [done[i] for i in ids]


def test_finished_requests_commit_nothing_and_slots_hold_their_rows():
  """EOS in one request, a max_new_tokens cut in the others, mixed acceptance (slot 1's drafter is always wrong,
  the others perfect), 3 slots: after every round each slot keeps its invariant and its committed cache rows
  (target and head) are those of a fresh forward over its sequence, a finished request's slot is free, and the
  tokens are the reference's."""
  hcfg, hparams = head()
  max_new = 23
  rows = ar_tokens(3, max_new)
  stop = next(i for i in range(4, max_new) if rows[0][i] not in rows[0][:i] + rows[1] + rows[2])
  eos = (rows[0][stop],)                               # request 0 stops there; 1 and 2 run to max_new
  offsets = jnp.array([0, 1, 0])

  def mixed(target_params, head_params, view, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
    toks = (_greedy_continuation(target_params, view, tree_cfg.depth) + offsets[:, None]) % cfg.vocab_size
    return jnp.where(jax.nn.one_hot(toks, cfg.vocab_size, dtype=bool), 0.0, -1e9), view.draft_cache

  requests = [Request(p, max_new) for p in PROMPTS3]
  engine = Engine.for_requests(CFG, target(), requests, slots=3, prefill_rows=8, tree=TreeConfig("chain", 1, 1, 4),
                               head_cfg=hcfg, head_params=hparams, drafter=mixed, eos_ids=eos)
  results = run_stepwise(engine, requests)
  expected = ar_tokens(3, max_new, eos)
  assert len(expected[0]) == stop + 1 and [len(t) for t in expected[1:]] == [max_new, max_new]
  assert_agree(CFG, target(), PROMPTS3, expected, [r.tokens for r in results])
  assert [r.depth_histogram[0] == r.steps for r in results] == [False, True, False]   # slot 1 never accepts
  assert results[0].finished < results[1].finished


def test_chunked_prefill_equals_one_forward():
  """Prompts of 5, 2 and 8 tokens prefilled in chunks of 4 rows by two lanes (the first split over both lanes in
  one round, the last over two rounds; last chunks of 1, 2 and 4 rows) leave after every round the cache rows
  (and the head's context) of one whole-prompt forward, draw the same first token and give the tokens of a
  whole-prompt prefill (one lane of 8 rows: each prompt in one forward), AR and speculative."""
  hcfg, hparams = head()
  max_new = 21
  requests = [Request(p, max_new) for p in PROMPTS3]
  # The speculative whole-prompt run is test_lossless_random_head's (the same program).
  for kw in ({}, dict(head_cfg=hcfg, head_params=hparams, tree=TreeConfig("accum_logp", 64, 3, 4))):
    whole = generate(CFG, target(), PROMPTS3, max_new, **kw)
    assert [r.first for r in whole.results] == [0, 1, 2]                 # one prompt a round, each whole
    engine = Engine.for_requests(CFG, target(), requests, slots=3, lanes=2, prefill_rows=4, **kw)
    chunked = run_stepwise(engine, requests)
    assert [r.first for r in chunked] == [0, 1, 2]
    assert_agree(CFG, target(), PROMPTS3, whole.tokens, [r.tokens for r in chunked])
    assert_agree(CFG, target(), PROMPTS3, ar_tokens(3, max_new), [r.tokens for r in chunked])


def test_prefill_chunk_bounds_the_scores():
  from jetspec_jax.decode.engine import PREFILL_SCORE_BYTES, prefill_chunk
  # Qwen3-8B regeneration: 8 prompts of 8192 tokens, 1024 new, 32 query heads: 8 * 32 * 9216 * 4 bytes per row
  assert prefill_chunk(8, 32, 8192, 9216) == 64
  assert 8 * 32 * 64 * 9216 * 4 <= PREFILL_SCORE_BYTES < 8 * 32 * 128 * 9216 * 4
  assert prefill_chunk(1, 32, 512, 1024) == 0                       # fits: one forward

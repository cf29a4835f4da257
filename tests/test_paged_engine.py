"""The engine's paged KV caches: a pool smaller than the load makes requests wait for pages and preempts running
ones, requests sharing a prompt prefix share its pages (prefix caching), and every request still ends with its own
AR generation's tokens; pages are never lost, and shared only as keyed prompt pages whose rows equal a fresh
forward's (the allocator's invariant and every slot's rows after every round); cancelling and finishing return
them; a request larger than the pool is refused in one sentence; a 2x2 mesh equals one device."""
import jax
import numpy as np
import pytest

from jetspec_jax import sharding
from jetspec_jax.decode.engine import Engine, EnginePlan, Request
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from test_engine import EOS, check_lossless, placed, random_requests
from test_speculative import CFG, check_pages, head, run_stepwise, target


TREE = TreeConfig("best_nodes", 16, 3, 4)


def paged_engine(requests, tree, *, pages, slots=4, groups=1, mesh=None, eos=(), prefix_caching=True, attn="auto"):
  hcfg, hparams = head()
  kw = {} if tree is None else dict(head_cfg=hcfg, head_params=hparams)
  t = target()
  if mesh is not None:
    t = placed(t, qwen3.param_specs(CFG), mesh)
    if tree is not None:
      kw["head_params"] = placed(hparams, draft_head.param_specs(hcfg), mesh)
  return Engine.for_requests(CFG, t, requests, slots=slots, lanes=groups, prefill_rows=8, groups=groups, tree=tree,
                             page_rows=8, pages=pages, eos_ids=eos, mesh=mesh, prefix_caching=prefix_caching,
                             attn_impl=attn, **kw)


def shared_prefix_requests(seed: int, count: int, prefix: int = 24, max_own: int = 12, max_new: int = 24):
  """``count`` requests: one ``prefix``-token system prompt, then each its own tokens (at least one)."""
  rng = np.random.default_rng(seed)
  system = [int(t) for t in rng.integers(1, CFG.vocab_size, prefix)]
  return [Request(system + [int(t) for t in rng.integers(1, CFG.vocab_size, rng.integers(1, max_own + 1))],
                  int(rng.integers(1, max_new + 1))) for _ in range(count)]


@pytest.mark.parametrize("tree, attn", [(None, "auto"), (TREE, "auto"), (None, "xla")],
                         ids=["ar", "best_nodes", "ar-gathered"])
def test_a_pool_too_small_for_the_load_preempts_and_changes_no_token(tree, attn):
  """4 slots, 9 requests of short prompts and up to 40 new tokens, a pool of 12 pages of 8 rows (a request holds
  up to 9): requests wait for the pages of their prompts, and running ones that grow past the pool are preempted and
  recomputed; after every round the allocator holds each page once and each slot the pages of its committed rows,
  whose K/V equal a fresh forward's; tokens equal AR's. Attention: auto (xla_ragged on CPU: each slot reads its
  own pages) and xla (every slot gathers the key bucket). No EOS: each request runs to its length whatever the
  random target's tokens, so the pool runs short by construction."""
  requests = random_requests(11, 9, max_prompt=12, max_new=40)
  engine = paged_engine(requests, tree, pages=12, attn=attn)
  results = run_stepwise(engine, requests)
  run = type("Run", (), {"results": results})
  check_lossless(run, requests, ())
  assert sum(r.preempted for r in results) > 0


def test_waiting_for_pages_keeps_the_order_and_a_finished_request_returns_its_pages():
  """A pool that holds one request at a time: requests are admitted one after another in submission order, each
  after the previous finished, and the pool is whole again at the end."""
  requests = [Request([3 + i] * 20, 12) for i in range(4)]
  engine = paged_engine(requests, None, pages=5, slots=2)        # 20 + 12 + 1 rows: 5 pages of 8
  run = engine.run(requests)
  check_lossless(run, requests, ())
  for a, b in zip(run.results, run.results[1:]):
    assert a.finished < b.admitted
  assert all(r.preempted == 0 for r in run.results)
  assert int(np.sum(np.asarray(engine.state.pages.free_count()))) == 5


def test_cancelling_returns_the_pages():
  requests = random_requests(3, 3)
  engine = paged_engine(requests, TREE, pages=30, slots=3)
  engine.start()
  ids = engine.submit(requests)
  engine.step(2)
  assert int(np.asarray(engine.state.pages.free_count())[0]) < 30
  engine.cancel(ids)
  check_pages(jax.device_get(engine.state), engine.plan)
  assert int(np.asarray(engine.state.pages.free_count())[0]) == 30


def test_a_request_larger_than_the_pool_is_refused_in_one_sentence():
  engine = Engine(CFG, target(), EnginePlan(slots=2, rows=2, lanes=1, prefill_rows=8, max_prompt=64, max_new_tokens=32,
                                            queue=4, page_rows=8, pages=6))
  with pytest.raises(JetSpecError, match=r"request 0: a prompt of 40 tokens with max_new_tokens 20 needs 8 KV pages "
                                         r"of 8 rows, more than the 6 of a group's pool"):
    engine.submit([Request([1] * 40, 20)])


def test_max_model_len_bounds_a_request_not_its_parts():
  """With max_model_len the prompt and reply bounds are each up to it, their sum at most it: a slot's table and
  the attention's keys span max_model_len rows (and a round's scratch), not max_prompt + max_new_tokens."""
  plan = EnginePlan(slots=2, rows=2, lanes=1, prefill_rows=8, max_prompt=63, max_new_tokens=63, queue=4, page_rows=8,
                    max_model_len=64)
  assert plan.cache_lengths(None)[0] == 80 and plan.max_pages(None) == 10     # 64 + 1 rows, in multiples of 16
  engine = Engine(CFG, target(), plan)
  engine.check([Request([1] * 60, 4), Request([1], 63)])
  with pytest.raises(JetSpecError, match=r"^request 0: a prompt of 40 tokens plus max_new_tokens 30 is more than the "
                                         r"engine's max_model_len of 64 tokens$"):
    engine.submit([Request([1] * 40, 30)])


def test_a_2x2_mesh_with_a_small_pool_equals_one_device(eight_devices):
  requests = random_requests(5, 4, max_prompt=12, max_new=40) + shared_prefix_requests(6, 4, prefix=16, max_new=30)
  mesh = sharding.make_mesh(2, 2, jax.devices()[:4])
  one = paged_engine(requests, TREE, pages=2 * 9, slots=4, groups=2).run(requests)
  two = paged_engine(requests, TREE, pages=2 * 9, slots=4, groups=2, mesh=mesh).run(requests)
  check_lossless(two, requests, ())
  assert [r.tokens for r in one.results] == [r.tokens for r in two.results]
  assert sum(r.preempted for r in two.results) > 0 and sum(r.cached_tokens for r in two.results) > 0


def test_a_forward_over_a_paged_cache_equals_the_contiguous_one():
  """A prompt, then a decode step, through ``Qwen3.hidden`` on a page pool (pages out of order) and on a contiguous
  cache: the same logits, bit for bit."""
  import jax.numpy as jnp
  import hf_fixtures
  from jetspec_jax import pages
  tokens, positions = jnp.arange(1, 11, dtype=jnp.int32)[None], jnp.arange(10, dtype=jnp.int32)[None]
  cache = qwen3.init_cache(CFG, 1, 32, jnp.float32)
  pool = qwen3.init_pool(CFG, 1, 6, 8, jnp.float32)
  p = pages.init_pages(1, 6, 1, 4).replace(used=jnp.asarray([[5, 1, 4, 0, 2, 3]], jnp.int32))
  p, ok = pages.grow(p, jnp.asarray([32]), jnp.arange(1), 8)
  assert bool(ok[0])
  for step, (toks, pos, start, mask) in enumerate([(tokens, positions, 0, qwen3.causal_mask(1, 10)),
                                                   (jnp.asarray([[11]]), jnp.asarray([[10]]), 10, jnp.ones((1, 1, 1), bool))]):
    start = jnp.asarray([start], jnp.int32)
    want, cache, _ = hf_fixtures.target_forward(target(), CFG, toks, pos, cache, start, mask)
    got, pool, _ = hf_fixtures.target_forward(target(), CFG, toks, pos, pool, start, mask, table=p.table)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"step {step}")


@pytest.mark.parametrize("tree", [None, TREE], ids=["ar", "best_nodes"])
def test_requests_sharing_a_prompt_prefix_share_its_pages_and_change_no_token(tree):
  """6 requests with one 24-token system prompt (3 pages of 8) through 3 slots: the first computes the prefix, the
  others wait for it rather than compute it again, then take its 3 pages from the cache and prefill only their
  own rows. After every round the shared pages hold a fresh forward's rows for every slot holding them (so no
  request wrote into them); tokens equal AR's, and equal an engine without prefix caching (which caches nothing)."""
  requests = shared_prefix_requests(5, 6)
  results = run_stepwise(paged_engine(requests, tree, pages=None, slots=3, eos=EOS), requests)
  check_lossless(type("Run", (), {"results": results}), requests, EOS)
  assert results[0].cached_tokens == 0 and all(r.cached_tokens == 24 for r in results[1:])
  assert all(a.admitted <= b.admitted for a, b in zip(results, results[1:]))
  off = paged_engine(requests, tree, pages=None, slots=3, eos=EOS, prefix_caching=False).run(requests)
  check_lossless(off, requests, EOS)
  assert all(r.cached_tokens == 0 for r in off.results)


def test_a_short_pool_reclaims_cached_pages_and_preempts_with_shared_prefixes():
  """Two system prompts and a pool too small for the load: cached prefix pages are taken back when the pool runs
  short (least recently released first), preempted requests resume (sharing again where the prefix is still
  cached), and every request's tokens equal AR's."""
  requests = [r for pair in zip(shared_prefix_requests(7, 5, max_new=30), shared_prefix_requests(8, 5, max_new=30))
              for r in pair]
  engine = paged_engine(requests, TREE, pages=16, slots=4, eos=EOS)
  results = run_stepwise(engine, requests)
  check_lossless(type("Run", (), {"results": results}), requests, EOS)
  assert sum(r.cached_tokens for r in results) > 0 and sum(r.preempted for r in results) > 0

"""The continuous-batching engine: every request's greedy tokens equal its own AR generation whatever
shares the batch (slot reuse, prefill chunks, EOS, max_new_tokens cuts, a batch-wide node budget that
cuts trees), sampling stays exact, segments lose or repeat nothing, a 2x2 mesh equals one device, and
the loop makes no host transfer."""
import functools
import re

import jax
import numpy as np
import pytest

from jetspec_jax import sharding
from jetspec_jax.bench import HOST_OPS
from jetspec_jax.decode.engine import Engine, EnginePlan, Request
from jetspec_jax.decode.generation import Generator, SamplingConfig
from jetspec_jax.decode.profile import AcceptanceProfile
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from greedy import assert_agree
import test_sampling
from test_speculative import CFG, head, target

EOS = (5,)


def random_requests(seed: int, count: int, max_prompt: int = 40, max_new: int = 24) -> list[Request]:
  rng = np.random.default_rng(seed)
  return [Request([int(t) for t in rng.integers(1, CFG.vocab_size, rng.integers(1, max_prompt + 1))],
                  int(rng.integers(1, max_new + 1))) for _ in range(count)]


@functools.lru_cache(maxsize=None)
def ar_reference(prompt: tuple[int, ...], max_new: int, eos: tuple[int, ...]) -> list[int]:
  """The request's own AR generation (batch of one, the static Generator)."""
  return Generator(CFG, target(), eos_ids=eos).generate([list(prompt)], max_new).tokens[0]


def check_lossless(run, requests, eos):
  assert [r.id for r in run.results] == list(range(len(requests)))
  for req, res in zip(requests, run.results):
    assert_agree(CFG, target(), [req.prompt], [ar_reference(tuple(req.prompt), req.max_new_tokens, eos)], [res.tokens])
    assert res.admitted <= res.first <= res.finished


PROFILE = AcceptanceProfile.from_counts([100, 60, 30, 10], [[40, 15, 5], [30, 10, 4], [15, 5, 2], [5, 2, 1]],
                                        [[50, 10, 5], [35, 8, 4], [20, 4, 2], [8, 2, 1]])
CASES = [
    # (tree or None, slots, rows, lanes, prefill_rows, eos): rows < slots * nodes cut trees (the batch-wide budget)
    (None, 1, 1, 1, 8, ()),
    (None, 4, 4, 2, 8, EOS),
    (None, 3, 3, 1, 5, ()),
    (TreeConfig("best_nodes", 16, 3, 4), 4, 12, 1, 8, ()),
    (TreeConfig("best_nodes", 16, 3, 4), 4, 64, 2, 16, EOS),
    (TreeConfig("accum_logp", 8, 3, 4), 3, 12, 1, 8, EOS),
    (TreeConfig("top2gap", 16, 3, 4), 2, 16, 1, 6, ()),
    (TreeConfig("chain", 1, 1, 4), 4, 14, 2, 8, EOS),
    (TreeConfig("rank_caps", 8, 3, 4, profile=PROFILE), 3, 16, 1, 3, ()),
    (TreeConfig("calibrated", 8, 3, 4, profile=PROFILE, online="sequence"), 3, 16, 3, 8, EOS),
    (TreeConfig("static", 8, 3, 4, profile=PROFILE), 2, 12, 1, 8, ()),
]
BUCKETED = [(None, 3, 3, 1, 8, EOS), (TreeConfig("best_nodes", 8, 3, 4), 3, 9, 1, 8, ())]


@pytest.mark.parametrize("tree,slots,rows,lanes,prefill_rows,eos", CASES,
                         ids=lambda x: getattr(x, "method", None) or str(x))
def test_every_request_equals_its_own_ar_generation(tree, slots, rows, lanes, prefill_rows, eos):
  requests = random_requests(slots * 7 + rows, 9)
  kw = {} if tree is None else dict(head_cfg=head()[0], head_params=head()[1])
  engine = Engine.for_requests(CFG, target(), requests, slots=slots, rows=rows, lanes=lanes,
                               prefill_rows=prefill_rows, tree=tree, eos_ids=eos, **kw)
  run = engine.run(requests)
  check_lossless(run, requests, eos)
  assert run.busy_slot_rounds <= run.rounds * slots and 0 < run.occupancy <= 1


@pytest.mark.parametrize("tree,slots,rows,lanes,prefill_rows,eos", BUCKETED, ids=["ar", "best_nodes"])
def test_key_buckets_change_no_token(tree, slots, rows, lanes, prefill_rows, eos):
  """Attention over the shortest of 3 key lengths that holds every live request (switching as requests grow
  and finish): still every request's own AR tokens."""
  requests = random_requests(31, 9)
  kw = {} if tree is None else dict(head_cfg=head()[0], head_params=head()[1])
  engine = Engine.for_requests(CFG, target(), requests, slots=slots, rows=rows, lanes=lanes, key_buckets=3,
                               prefill_rows=prefill_rows, tree=tree, eos_ids=eos, **kw)
  assert len(engine.plan.key_lengths()) == 3
  check_lossless(engine.run(requests), requests, eos)


def test_segments_lose_and_repeat_nothing():
  """Requests submitted between segments of 3 rounds, into a queue smaller than the stream: each comes out
  exactly once, equal to its AR generation, and a full queue is refused in one sentence."""
  requests = random_requests(11, 14)
  hcfg, hparams = head()
  plan = EnginePlan(slots=3, rows=12, lanes=1, prefill_rows=8, max_prompt=40, max_new_tokens=24, queue=4,
                    tree=TreeConfig("best_nodes", 8, 3, 4))
  engine = Engine(CFG, target(), plan, head_cfg=hcfg, head_params=hparams, eos_ids=EOS)
  engine.start()
  with pytest.raises(JetSpecError, match="queue is full"):
    engine.submit(requests[:5])
  seen, ids, waiting = [], {}, list(requests)
  while waiting or len(seen) < len(requests):
    free = plan.queue - sum(len(e) for e in engine._entries)
    batch, waiting = waiting[:free], waiting[free:]
    if batch:
      ids.update(zip(engine.submit(batch), batch))
    seen += engine.step(3)
  assert sorted(r.id for r in seen) == list(range(len(requests)))
  for res in seen:
    req = ids[res.id]
    assert_agree(CFG, target(), [req.prompt], [ar_reference(tuple(req.prompt), req.max_new_tokens, EOS)], [res.tokens])


def test_requests_that_cannot_run_are_refused_before_the_run():
  plan = EnginePlan(slots=2, rows=2, lanes=1, prefill_rows=4, max_prompt=8, max_new_tokens=4, queue=4)
  engine = Engine(CFG, target(), plan)
  for bad, match in [(Request([1] * 9, 2), r"request 1: a prompt of 9 tokens .* does not fit a slot"),
                     (Request([1, 2], 5), "does not fit a slot"), (Request([], 2), "request 1 has an empty prompt"),
                     (Request([1, 2], 0), "max_new_tokens must be a positive integer"),
                     (Request([1, CFG.vocab_size], 2), "outside the vocabulary")]:
    with pytest.raises(JetSpecError, match=match):
      engine.submit([Request([1], 1), bad])
  assert engine.step() == []                                 # nothing was queued
  with pytest.raises(JetSpecError, match="rows >= 4"):
    Engine(CFG, target(), EnginePlan(slots=4, rows=3, lanes=1, prefill_rows=4, max_prompt=8, max_new_tokens=4,
                                     queue=4))
  with pytest.raises(JetSpecError, match="exceeds the model's context"):
    Engine.for_requests(CFG, target(), [Request([1] * 8, CFG.max_position_embeddings)], slots=1)


@pytest.mark.parametrize("speculative_mode", [False, True], ids=["ar", "speculative"])
def test_no_host_transfer_inside_the_engine_loop(speculative_mode):
  kw = dict(head_cfg=head()[0], head_params=head()[1]) if speculative_mode else {}
  plan = EnginePlan(slots=2, rows=10, lanes=1, prefill_rows=8, max_prompt=16, max_new_tokens=8, queue=4,
                    tree=TreeConfig("best_nodes", 8, 3, 4) if speculative_mode else None)
  text = Engine(CFG, target(), plan, **kw).lower().compile().as_text()
  assert "while" in text and not HOST_OPS.findall(text)


def placed(params, specs, mesh):
  return {k: jax.device_put(v, sharding.named_sharding(specs[k].axes, specs[k].shape, mesh)) for k, v in params.items()}


def test_a_2x2_mesh_equals_one_device(eight_devices):
  """Two groups of slots over the data axis, heads over the model axis: the same tokens, rounds and
  per-request round numbers as the same plan on one device."""
  requests = random_requests(5, 10)
  hcfg, hparams = head()
  tree = TreeConfig("best_nodes", 8, 3, 4)
  make = lambda mesh, t, h: Engine.for_requests(CFG, t, requests, slots=4, rows=20, lanes=2, prefill_rows=8,
                                                groups=2,
                                                tree=tree, head_cfg=hcfg, head_params=h, eos_ids=EOS, mesh=mesh)
  ref = make(None, target(), hparams).run(requests)
  mesh = sharding.make_mesh(2, 2, jax.devices()[:4])
  run = make(mesh, placed(target(), qwen3.param_specs(CFG), mesh),
             placed(hparams, draft_head.param_specs(hcfg), mesh)).run(requests)
  same = assert_agree(CFG, target(), [r.prompt for r in requests], [r.tokens for r in ref.results],
                      [r.tokens for r in run.results])
  if same.identical == same.count:                      # a near-tie broken the other way changes the rounds after it
    assert [(r.admitted, r.first, r.finished, r.steps) for r in run.results] == \
           [(r.admitted, r.first, r.finished, r.steps) for r in ref.results]
  check_lossless(run, requests, EOS)


@pytest.mark.parametrize("sampling", ["greedy", "sampled", "per_request"])
def test_a_round_moves_nothing_between_data_shards(eight_devices, sampling):
  """On a data-only mesh the compiled engine holds one collective: the loop predicate's all-reduce (sampled:
  the acceptance walk and the first tokens' draws run per data shard, as the tree)."""
  hcfg, hparams = head()
  mesh = sharding.make_mesh(4, 1, jax.devices()[:4])
  plan = EnginePlan(slots=8, rows=40, lanes=4, prefill_rows=8, max_prompt=16, max_new_tokens=8, queue=4, groups=4,
                    tree=TreeConfig("best_nodes", 8, 3, 4), per_request_sampling=sampling == "per_request")
  engine = Engine(CFG, placed(target(), qwen3.param_specs(CFG), mesh), plan, head_cfg=hcfg,
                  head_params=placed(hparams, draft_head.param_specs(hcfg), mesh), mesh=mesh,
                  sampling_cfg=SamplingConfig(0.7, 5, 0.9) if sampling == "sampled" else None)
  text = engine.lower().compile().as_text()
  collectives = re.findall(r"= \S+ (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\(",
                           text)
  assert collectives == ["all-reduce"], collectives


SAMPLED = [
    # (accept, tree, temperature, top_k, top_p)
    ("rejection", TreeConfig("best_nodes", 8, 4, 3), 1.0, 0, 1.0),
    ("match", TreeConfig("accum_logp", 8, 4, 3), 0.8, 0, 0.9),
    ("rejection", None, 1.0, 3, 1.0),
]


@pytest.mark.parametrize("accept,tree,temperature,top_k,top_p", SAMPLED,
                         ids=lambda x: getattr(x, "method", None) or str(x))
def test_sampling_is_exact_under_continuous_batching(accept, tree, temperature, top_k, top_p):
  """3,000 requests of one prompt with uneven max_new_tokens through 500 slots (slots reused in varying
  order, the prompt prefilled in two rounds by 50 lanes, trees cut by a budget of 1.5 rows per slot): the first four
  tokens follow the target's exact distribution (chi-square, as the static loop's test)."""
  hcfg, hparams = test_sampling.head()
  n = 3000
  requests = [Request(test_sampling.PROMPT, 4 + i % 3) for i in range(n)]
  kw = {} if tree is None else dict(head_cfg=hcfg, head_params=hparams)
  engine = Engine.for_requests(test_sampling.CFG, test_sampling.target(), requests, slots=500, rows=750,
                               lanes=50, prefill_rows=2, tree=tree, eos_ids=(),
                               sampling_cfg=SamplingConfig(temperature, top_k, top_p, accept, seed=3), **kw)
  run = engine.run(requests)
  tokens = np.asarray([r.tokens[:4] for r in run.results])
  assert tokens.shape == (n, 4)
  test_sampling.check_distribution(tokens, temperature, top_k, top_p, f"engine {accept}")

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
from jetspec_jax.decode import reference
from jetspec_jax.decode.engine import Engine, EnginePlan, Request
from jetspec_jax.decode.sampling import SamplingConfig
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
  """The request's own AR generation (``decode.reference``)."""
  return reference.greedy(CFG, target(), prompt, max_new, eos)


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
  """On a data-only mesh a compiled engine round holds one collective: the all-reduce of its loop control (a few
  integers; sampled: the acceptance walk and the first tokens' draws run per data shard, as the tree)."""
  hcfg, hparams = head()
  mesh = sharding.make_mesh(4, 1, jax.devices()[:4])
  plan = EnginePlan(slots=8, rows=40, lanes=4, prefill_rows=8, max_prompt=16, max_new_tokens=8, queue=4, groups=4,
                    tree=TreeConfig("best_nodes", 8, 3, 4), per_request_sampling=sampling == "per_request")
  engine = Engine(CFG, placed(target(), qwen3.param_specs(CFG), mesh), plan, head_cfg=hcfg,
                  head_params=placed(hparams, draft_head.param_specs(hcfg), mesh), mesh=mesh,
                  sampling_cfg=SamplingConfig(0.7, 5, 0.9) if sampling == "sampled" else None)
  text = engine.lower().compile().as_text()
  collectives = re.findall(r"= (\S+) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)(?:-start)?\(",
                           text)
  # One reduction a round (the loop's control: pending, the next body, flush due), in each round body, each
  # flush and before the loop: each a few integers.
  variants = 2 * len(plan.key_lengths())
  assert {op for _, op in collectives} == {"all-reduce"} and variants <= len(collectives) <= variants + 3, collectives
  assert all(re.fullmatch(r"\(?s32\[[1-4]?\]\S*", shape) for shape, _ in collectives), collectives


SAMPLED = [
    # (accept, tree, temperature, top_k, top_p)
    ("rejection", TreeConfig("best_nodes", 8, 4, 3), 1.0, 0, 1.0),
    ("match", TreeConfig("accum_logp", 8, 4, 3), 0.8, 0, 0.9),
    ("rejection", None, 1.0, 3, 1.0),
]


def check_sampling_under_continuous_batching(accept, tree, temperature, top_k, top_p, n, slots):
  """``n`` requests of one prompt with uneven max_new_tokens through ``slots`` slots (slots reused in varying
  order, the prompt prefilled in two rounds by slots / 10 lanes, trees cut by a budget of 1.5 rows per slot): the
  first four tokens follow the target's exact distribution (chi-square, as the static loop's test)."""
  hcfg, hparams = test_sampling.head()
  requests = [Request(test_sampling.PROMPT, 4 + i % 3) for i in range(n)]
  kw = {} if tree is None else dict(head_cfg=hcfg, head_params=hparams)
  engine = Engine.for_requests(test_sampling.CFG, test_sampling.target(), requests, slots=slots, rows=slots * 3 // 2,
                               lanes=slots // 10, prefill_rows=2, tree=tree, eos_ids=(),
                               sampling_cfg=SamplingConfig(temperature, top_k, top_p, accept, seed=3), **kw)
  run = engine.run(requests)
  tokens = np.asarray([r.tokens[:4] for r in run.results])
  assert tokens.shape == (n, 4)
  test_sampling.check_distribution(tokens, temperature, top_k, top_p, f"engine {accept}")


def test_sampling_is_exact_under_continuous_batching():
  """The rule of the 3,000-request test below on every landing, at 600 requests through 100 slots (rejection over
  a best_nodes tree, the rule's hardest case: siblings drawn without replacement)."""
  check_sampling_under_continuous_batching(*SAMPLED[0], n=600, slots=100)


@pytest.mark.slow
@pytest.mark.parametrize("accept,tree,temperature,top_k,top_p", SAMPLED,
                         ids=lambda x: getattr(x, "method", None) or str(x))
def test_sampling_is_exact_under_continuous_batching_at_scale(accept, tree, temperature, top_k, top_p):
  """3,000 requests through 500 slots, for each acceptance rule (match with top_p, and AR with top_k too)."""
  check_sampling_under_continuous_batching(accept, tree, temperature, top_k, top_p, n=3000, slots=500)


def test_prompts_share_the_round_token_budget():
  """Four lanes of 8 rows (a budget of 32 prompt rows per round), oldest request first: a 20-token prompt (3 lanes)
  and an 8-token one (1 lane) complete in the round they are admitted; then a 12-token prompt takes 2 lanes and a
  40-token one the other 2, then its remaining 24 rows take 3. The tokens are each request's own AR generation, and a finished
  slot keeps no prefix (attention reads nothing of it)."""
  rng = np.random.default_rng(5)
  prompt = lambda n: [int(t) for t in rng.integers(1, CFG.vocab_size, n)]
  requests = [Request(prompt(20), 6), Request(prompt(8), 5), Request(prompt(12), 7), Request(prompt(40), 4)]
  for tree in (None, TreeConfig("best_nodes", 8, 3, 4)):
    kw = {} if tree is None else dict(head_cfg=head()[0], head_params=head()[1])
    engine = Engine.for_requests(CFG, target(), requests, slots=4, lanes=4, prefill_rows=8, tree=tree, eos_ids=(),
                                 **kw)
    assert engine.plan.prefill_budget == 32
    run = engine.run(requests)
    check_lossless(run, requests, ())
    assert [r.admitted for r in run.results] == [0] * 4
    assert [r.first for r in run.results] == [0, 0, 1, 2]
    assert not np.any(np.asarray(engine.state.prefix_len)) and np.all(np.asarray(engine.state.entry) < 0)


def test_the_round_body_follows_what_the_slots_need():
  """No lanes while no slot is prefilling; the key length covers every held slot's rows (decode rows, or the
  lanes' reach into the prompt) and nothing of free slots; a cancelled slot keeps no prefix; the state's control
  after a step is the body its next round takes."""
  from jetspec_jax.decode.engine import with_control
  plan = EnginePlan(slots=3, rows=3, lanes=2, prefill_rows=8, max_prompt=40, max_new_tokens=200, queue=4,
                    key_buckets=4)
  engine = Engine(CFG, target(), plan, eos_ids=())
  lengths = plan.key_lengths()
  ids = engine.submit([Request([1] * 40, 150), Request([2] * 3, 4)])
  variant = lambda: divmod(int(with_control(engine.state, engine.program).control[1]), 2)   # (key bucket, prefilling)
  engine.step(1)                                            # admits both; the 40-token prompt takes both lanes
  assert variant() == (next(i for i, n in enumerate(lengths) if n >= 40), 1)   # lanes reach the prompt's end
  done = engine.step(2)
  assert [r.id for r in done] == [] and variant()[1] == 0     # both prompts in: decode rounds only
  assert divmod(int(engine.state.control[1]), 2) == variant() and int(engine.state.control[0]) == 1
  prefix = np.asarray(engine.state.prefix_len)
  assert variant()[0] == next(i for i, n in enumerate(lengths) if n >= prefix.max() + 1)
  engine.cancel([ids[0]])
  assert int(np.asarray(engine.state.prefix_len).max()) < 8 and variant()[0] == 0


@pytest.mark.parametrize("tree", [TreeConfig("chain", 1, 1, 4), TreeConfig("accum_logp", 16, 3, 4)],
                         ids=["chain", "accum_logp"])
def test_a_drafter_that_is_always_right_or_always_wrong(tree):
  """The engine takes a pluggable drafter. An oracle proposing the target's own continuation: every round
  accepts the whole depth (tau = D + 1), and the profile counts say every depth was reached at rank 0; one that
  is always wrong: tau 1, only depth 1 observed, never hit. The tokens are AR's either way."""
  from jetspec_jax.decode.engine import acceptance, acceptance_profile
  from test_speculative import PERFECT, WRONG
  rounds, d = 3, tree.depth
  rng = np.random.default_rng(2)
  requests = [Request([int(t) for t in rng.integers(1, CFG.vocab_size, n)], 1 + rounds * (d + 1)) for n in (5, 9, 3)]
  hcfg, hparams = head()
  for drafter, right in ((PERFECT, True), (WRONG, False)):
    engine = Engine.for_requests(CFG, target(), requests, slots=2, tree=tree, head_cfg=hcfg, head_params=hparams,
                                 eos_ids=(), drafter=drafter)
    run = engine.run(requests)
    check_lossless(run, requests, ())
    acc = acceptance(run.results)
    w = tree.num_candidates
    for r in run.results:
      steps = rounds if right else len(r.tokens) - 1
      assert r.steps == steps
      assert r.depth_histogram.tolist() == ([0] * d + [steps] if right else [steps] + [0] * d)
      assert r.depth_visits.tolist() == ([steps] * d if right else [steps] + [0] * (d - 1))
      assert r.rank_hits.shape == (d, w) and r.rank_hits.sum() == (steps * d if right else 0)
      assert (r.rank_hits[:, 0] == r.depth_visits).all() if right else True
    assert acc["tau"] == (d + 1 if right else 1.0)
    prof = acceptance_profile(run.results)
    assert prof.visits[0] == sum(r.steps for r in run.results)


def test_transfer_guard_and_fetch_hooks(monkeypatch):
  """``transfer_guard`` wraps each step's device loop in the device-to-host guard at that level; ``on_fetch``
  sees the arrays a step fetches; an unknown level is refused in one sentence."""
  levels, fetches = [], []
  guard = jax.transfer_guard_device_to_host
  monkeypatch.setattr(jax, "transfer_guard_device_to_host", lambda level: levels.append(level) or guard(level))
  requests = random_requests(3, 3)
  # Compiled first without the guard (the same program: the guard is not part of it), so only running it is guarded.
  Engine.for_requests(CFG, target(), requests, slots=2, eos_ids=()).run(requests)
  engine = Engine.for_requests(CFG, target(), requests, slots=2, eos_ids=(), transfer_guard="disallow",
                               on_fetch=fetches.append)
  run = engine.run(requests)
  check_lossless(run, requests, ())
  assert levels == ["disallow"] and len(fetches) == 1
  assert all(isinstance(a, jax.Array) for a in fetches[0])
  with pytest.raises(JetSpecError, match="transfer_guard 'sometimes'"):
    Engine.for_requests(CFG, target(), requests, slots=2, transfer_guard="sometimes")

"""Acceptance profiles and the trees they shape: the static optimum against brute force, the reference
rule and the calibrated method against today's methods, the engine's counts, lossless decoding."""
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.decode import profile, reference
from jetspec_jax.decode.engine import acceptance, acceptance_profile, generate
from jetspec_jax.decode.profile import AcceptanceProfile, expected_tau, optimal_static_tree
from jetspec_jax.decode.speculative import TreeConfig, calibration_counts, observe_ranks
from jetspec_jax.decode.tree import build_tree
from jetspec_jax.decode.verify import Acceptance
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import qwen3
from test_generation import CFG, HEAD, MAX_NEW, PROMPTS, weights
from greedy import assert_agree


@functools.cache
def ar_tokens():
  """The reference greedy tokens of PROMPTS (``decode.reference``)."""
  return [reference.greedy(CFG, weights()[0], p, MAX_NEW) for p in PROMPTS]


def speculative(tree, mesh=None, params=None, groups=1, **kw):
  """PROMPTS through a speculative engine of one slot each, both prefilled in the first round."""
  target, head = params or weights()
  return generate(CFG, target, PROMPTS, MAX_NEW, head_cfg=HEAD, head_params=head, tree=tree, eos_ids=(), mesh=mesh,
                  lanes=len(PROMPTS), groups=groups, **kw)


def per_request(run, field):
  """One field of every request's result, stacked [R, ...]."""
  return np.stack([getattr(r, field) for r in run.results])


def _random_profile(seed, depth, width, rounds=200):
  """Counts of a made-up draft: acceptance falls with rank; mass near (not equal to) the hits."""
  rng = np.random.default_rng(seed)
  visits = np.maximum((rounds * 0.7 ** np.arange(depth)).astype(int), width + 1)
  share = np.sort(rng.dirichlet(np.ones(width + 1)), )[::-1][:width]
  hits = np.minimum(np.floor(visits[:, None] * share[None, :] * rng.uniform(0.5, 1.0, (depth, width))),
                    visits[:, None] // width).astype(int)
  mass = hits * rng.uniform(0.5, 2.0, hits.shape)
  return AcceptanceProfile.from_counts(visits, hits, mass)


def _brute_force_best(acc, budget):
  """The largest 1 + sum of path products over every set of budget - 1 nodes of the full W-ary trie of depth
  D that is closed under taking parents (siblings unconstrained)."""
  depth, width = acc.shape
  nodes = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
  value = {p: float(np.prod([acc[i, r] for i, r in enumerate(p)])) for p in nodes}
  best = 1.0
  for subset in itertools.combinations(nodes, min(budget - 1, len(nodes))):
    chosen = set(subset)
    if all(len(p) == 1 or p[:-1] in chosen for p in subset):
      best = max(best, 1.0 + sum(value[p] for p in subset))
  return best


@pytest.mark.parametrize("depth,width", [(3, 2), (2, 3), (4, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_static_optimum_matches_brute_force(depth, width, seed):
  rng = np.random.default_rng(seed)
  acc = profile.monotone(np.sort(rng.uniform(0.0, 0.9, (depth, width)), axis=1)[:, ::-1])
  for budget in range(1, 8):
    tree = optimal_static_tree(acc, budget)
    assert len(tree.parents) == min(budget, 1 + sum(width ** d for d in range(1, depth + 1)))
    got = expected_tau(acc, tree.parents, tree.depths, tree.ranks)
    np.testing.assert_allclose(got, _brute_force_best(acc, budget), rtol=1e-12)
    for i in range(1, len(tree.parents)):               # parents first; siblings are ranks 0..k-1 in order
      assert tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
    for p in set(tree.parents[1:]):
      kids = [i for i in range(1, len(tree.parents)) if tree.parents[i] == p]
      assert [tree.ranks[i] for i in kids] == list(range(len(kids)))


def test_expected_tau_by_hand():
  acc = np.array([[0.5, 0.2], [0.4, 0.1]])
  # root; depth-1 ranks 0 and 1; under rank 0 its rank-0 child: 1 + 0.5 + 0.2 + 0.5 * 0.4
  assert expected_tau(acc, (0, 0, 0, 1), (0, 1, 1, 2), (0, 0, 1, 0)) == pytest.approx(1.9)
  tree = optimal_static_tree(acc, 4)
  assert (tree.parents, tree.depths, tree.ranks) == ((0, 0, 0, 1), (0, 1, 1, 2), (0, 0, 1, 0))


def _case(seed, batch=3, depth=4, vocab=40):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.integers(0, vocab, batch), jnp.int32),
          jnp.asarray(rng.normal(0, 2.5, (batch, depth, vocab)), jnp.float32))


def _same_tree(a, b):
  for field in ("tokens", "parents", "depths", "valid", "ancestors", "candidates"):
    np.testing.assert_array_equal(np.asarray(getattr(a, field)), np.asarray(getattr(b, field)), err_msg=field)


@pytest.mark.parametrize("budget,width", [(16, 4), (7, 3)])
def test_reference_rule_without_profile_is_accum_logp(budget, width):
  anchor, logits = _case(0)
  _same_tree(build_tree(anchor, logits, method="rank_caps", budget=budget, width=width),
             build_tree(anchor, logits, method="accum_logp", budget=budget, width=width))


def test_reference_rule_caps_each_depth():
  anchor, logits = _case(1, depth=3)
  acc = np.array([[0.6, 0.3, 0.05, 0.01], [0.7, 0.01, 0.0, 0.0], [0.5, 0.2, 0.1, 0.03]])
  tree = jax.tree.map(np.asarray, build_tree(anchor, logits, method="rank_caps", budget=24, width=4,
                                             acceptance=profile.monotone(acc), cap_threshold=0.02))
  caps = {1: 3, 2: 1, 3: 4}
  for b in range(3):
    n = int(tree.valid[b].sum())
    for p in range(n):
      kids = [i for i in range(1, n) if tree.parents[b, i] == p]
      assert len(kids) <= caps.get(tree.depths[b, p] + 1, 0)
      if kids:
        assert [int(tree.tokens[b, i]) for i in kids] == tree.candidates[b, tree.depths[b, p], :len(kids)].tolist()
    assert sum(tree.parents[b, 1:n] == 0) == 3


def _brute_force_paths(logits, budget, width, ratio=None):
  """Per batch row, the token paths (root excluded) of the budget - 1 best nodes of the full W-ary trie of
  depth D, found by enumerating every node: a node's score is the sum over its path of log(q * ratio[d, r]),
  q the rank-r token's probability at depth d (float64). The fixture must be tie-free at the cut."""
  logits = np.asarray(logits, np.float64)
  batch, depth, _ = logits.shape
  lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  ratio = np.ones((depth, width)) if ratio is None else np.asarray(ratio, np.float64)
  expected = []
  for b in range(batch):
    order = np.argsort(-lp[b], axis=-1, kind="stable")[:, :width]                 # [D, W] top-W token ids
    score = np.take_along_axis(lp[b], order, axis=-1) + np.log(ratio)
    nodes = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    value = {p: sum(score[i, r] for i, r in enumerate(p)) for p in nodes}
    ranked = sorted(nodes, key=lambda p: -value[p])
    assert value[ranked[budget - 2]] - value[ranked[budget - 1]] > 1e-3, "near-tie at the cut"
    expected.append({tuple(int(order[i, r]) for i, r in enumerate(p)) for p in ranked[:budget - 1]})
  return expected


def _tree_paths(tree, b):
  """The token path (root excluded) of every valid node but the root of row b of a built Tree."""
  paths = set()
  for i in range(1, int(tree.valid[b].sum())):
    path, j = [], i
    while j:
      path.append(int(tree.tokens[b, j]))
      j = int(tree.parents[b, j])
    paths.add(tuple(path[::-1]))
  return paths


def test_best_nodes_and_calibrated_match_brute_force():
  """best_nodes, and calibrated without counts or with neutral ones (measured == predicted), build the
  budget - 1 best nodes of a brute-force enumeration; calibrated with counts that scale (depth, rank)'s
  probability by a known ratio builds the enumeration's best under the scaled scores."""
  anchor, logits = _case(2)
  budget, width = 16, 4
  neutral = (np.full((4, 4), 7.0), np.full((4, 4), 7.0))
  # At most 1 and non-increasing in rank, so neither the cap at 1 nor the running minimum over ranks binds.
  ratio = np.array([[1.0, 0.2, 0.2, 0.2], [1.0, 1.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.9, 0.9, 0.9]])
  scaled = (100 * ratio - 1, np.full((4, 4), 99.0))                 # (hits + 1) / (mass + 1) == ratio
  plain, calibrated = _brute_force_paths(logits, budget, width), _brute_force_paths(logits, budget, width, ratio)
  assert all(p != c for p, c in zip(plain, calibrated))             # the ratio changes every row's tree
  cases = [(dict(method="best_nodes"), plain), (dict(method="calibrated"), plain),
           (dict(method="calibrated", counts=neutral), plain),
           (dict(method="calibrated", counts=scaled, prior_strength=1.0), calibrated)]
  for kw, paths in cases:
    tree = jax.tree.map(np.asarray, build_tree(anchor, logits, budget=budget, width=width, **kw))
    for b, expected in enumerate(paths):
      assert tree.valid[b].all() and tree.tokens[b, 0] == anchor[b], kw
      assert all(tree.parents[b, i] < i and tree.depths[b, i] == tree.depths[b, tree.parents[b, i]] + 1
                 for i in range(1, budget)), kw
      assert _tree_paths(tree, b) == expected, (kw, b)


def test_calibrated_follows_the_measured_acceptance():
  """A profile saying the draft is 10x underconfident about depth 1's ranks 1-3 and overconfident deeper
  moves the budget to depth 1's siblings."""
  anchor, logits = _case(3)
  hits = np.array([[50, 40, 40, 40]] + [[1, 0, 0, 0]] * 3, np.float32)
  mass = np.array([[50, 4, 4, 4]] + [[50, 10, 10, 10]] * 3, np.float32)
  best = jax.tree.map(np.asarray, build_tree(anchor, logits, method="best_nodes", budget=8, width=4))
  cal = jax.tree.map(np.asarray, build_tree(anchor, logits, method="calibrated", budget=8, width=4,
                                            counts=(hits, mass), prior_strength=1.0))
  assert ((cal.depths == 1) & cal.valid).sum() == 3 * 4
  assert ((cal.depths == 1) & cal.valid).sum() > ((best.depths == 1) & best.valid).sum()


def test_calibrated_profile_without_draft_signal_is_the_static_optimum():
  """With the draft's probabilities all equal across rounds the calibrated tree is the static optimum of the
  acceptance min(1, q * ratio) (same shape; here no ties)."""
  anchor, _ = _case(4)
  q = np.array([0.5, 0.2, 0.1, 0.05])
  logits = jnp.asarray(np.broadcast_to(np.log(np.r_[q, np.full(36, 0.15 / 36)]), (3, 4, 40)), jnp.float32)
  prof = _random_profile(5, 4, 4)
  hits, mass = prof.counts(4, 4)
  ratio = (hits + 16.0) / (mass + 16.0)
  acc = profile.monotone(np.minimum(q[None, :] * ratio, 1.0))
  cal = jax.tree.map(np.asarray, build_tree(anchor, logits, method="calibrated", budget=12, width=4,
                                            counts=(hits, mass)))
  static = optimal_static_tree(acc, 12)
  assert cal.valid.all()
  for b in range(3):
    assert expected_tau(acc, *_as_static(cal, b)) == pytest.approx(
        expected_tau(acc, static.parents, static.depths, static.ranks), rel=1e-5)


def _as_static(tree, b):
  """(parents, depths, ranks) of row b of a built Tree (ranks from the candidates)."""
  ranks = [0] + [int(np.flatnonzero(tree.candidates[b, tree.depths[b, i] - 1] == tree.tokens[b, i])[0])
                 for i in range(1, tree.tokens.shape[1])]
  return tree.parents[b].tolist(), tree.depths[b].tolist(), ranks


def test_static_tree_is_the_profile_optimum_filled_each_round():
  anchor, logits = _case(6)
  prof = _random_profile(7, 4, 4)
  acc = prof.fitted(4, 4)
  tree = jax.tree.map(np.asarray, build_tree(anchor, logits, method="static", budget=12, width=4, acceptance=acc))
  shape = optimal_static_tree(acc, 12)
  top_tok = np.asarray(jax.lax.top_k(jax.nn.log_softmax(logits), 4)[1])
  for b in range(3):
    assert tree.parents[b].tolist() == list(shape.parents) and tree.depths[b].tolist() == list(shape.depths)
    assert tree.tokens[b, 0] == anchor[b] and tree.valid[b].all()
    for i in range(1, 12):
      assert tree.tokens[b, i] == top_tok[b, shape.depths[i] - 1, shape.ranks[i]]
    np.testing.assert_array_equal(tree.ancestors[b], shape.ancestors())
  with pytest.raises(JetSpecError, match="needs an acceptance profile"):
    build_tree(anchor, logits, method="static", budget=12, width=4)


def test_observe_ranks_counts_the_targets_rank_at_each_observed_depth():
  cand = jnp.asarray([[[5, 6], [7, 8], [9, 10]], [[1, 2], [3, 4], [5, 6]]], jnp.int32)       # [B=2, D=3, W=2]
  logp = jnp.log(jnp.asarray([[[0.5, 0.25]] * 3, [[0.75, 0.125]] * 3], jnp.float32))
  tree = type("T", (), {"candidates": cand, "candidate_logp": logp})()
  # row 0 accepted 1 token (6, rank 1), then the target said 7 (rank 0 of depth 2): depths 1, 2 observed;
  # row 1 accepted nothing and the target said 99 (not a candidate): depth 1 observed, no hit.
  acc = Acceptance(path=jnp.zeros((2, 4), jnp.int32), accepted=jnp.asarray([1, 0]), correction=jnp.asarray([7, 99]))
  new = jnp.asarray([[6, 7, -1, -1], [99, -1, -1, -1]], jnp.int32)
  visits, hits, mass = jax.device_get(observe_ranks(tree, acc, new, jnp.asarray([True, True])))
  assert visits.tolist() == [[1, 1, 0], [1, 0, 0]]
  assert hits.tolist() == [[[0, 1], [1, 0], [0, 0]], [[0, 0], [0, 0], [0, 0]]]
  np.testing.assert_allclose(mass, [[[0.5, 0.25], [0.5, 0.25], [0, 0]], [[0.75, 0.125], [0, 0], [0, 0]]])
  visits, _, _ = observe_ranks(tree, acc, new, jnp.asarray([True, False]))
  assert np.asarray(visits)[1].tolist() == [0, 0, 0]                 # finished sequences count nothing


def test_calibration_counts_pool_the_profile_and_the_loop():
  prof = _random_profile(8, 3, 2)
  hits = jnp.arange(12, dtype=jnp.int32).reshape(2, 3, 2)
  mass = jnp.ones((2, 3, 2), jnp.float32)
  tc = lambda online, p=prof: TreeConfig("calibrated", 8, 2, 3, profile=p, online=online)
  ph, pm = prof.counts(3, 2)
  h, m = calibration_counts(tc("off"), (hits, mass))
  np.testing.assert_array_equal(h, ph)
  h, m = calibration_counts(tc("batch"), (hits, mass))
  np.testing.assert_allclose(h, ph[None] + np.asarray(hits).sum(0, keepdims=True))
  np.testing.assert_allclose(m, (pm + 2.0)[None])
  h, m = calibration_counts(tc("sequence", None), (hits, mass))
  np.testing.assert_array_equal(h, hits)
  assert calibration_counts(tc("off", None), (hits, mass)) is None


@functools.cache
def _profile_of_random_head():
  """The counts of test_generation's speculative run (the same program: no compile of its own here)."""
  return acceptance_profile(speculative(TreeConfig("accum_logp", 16, 3, 4)).results)


LOSSLESS_CASES = [
    dict(method="rank_caps", budget=16, width=3),
    dict(method="static", budget=16, width=3),
    dict(method="calibrated", budget=16, width=3),
    dict(method="calibrated", budget=16, width=3, online="batch"),
    dict(method="calibrated", budget=8, width=2, online="sequence", prior_strength=1.0),
    dict(method="calibrated", budget=16, width=3, online="sequence", use_profile=False),
]


@pytest.mark.parametrize("kw", LOSSLESS_CASES, ids=lambda x: "-".join(map(str, x.values())))
def test_profile_guided_trees_are_lossless(kw):
  kw = dict(kw)
  prof = _profile_of_random_head() if kw.pop("use_profile", True) else None
  out = speculative(TreeConfig(depth=4, profile=prof, **kw))
  assert_agree(CFG, weights()[0], PROMPTS, ar_tokens(), out.tokens)


def test_loop_counts_are_consistent_with_the_acceptance():
  """For a chain every hit at depth d is an acceptance, so visits[d] == hits[d-1][0]; visits[d-1] counts the
  rounds that accepted at least d - 1 tokens; every round observes depth 1."""
  out = speculative(TreeConfig("chain", 1, 1, 4))
  visits, hits, hist = (per_request(out, f) for f in ("depth_visits", "rank_hits", "depth_histogram"))
  at_least = hist[:, ::-1].cumsum(axis=1)[:, ::-1]                          # [R, D+1]: rounds accepting >= d
  np.testing.assert_array_equal(visits, at_least[:, :4])
  np.testing.assert_array_equal(visits[:, 1:], hits[:, :-1, 0])
  np.testing.assert_array_equal(visits[:, 0], [r.steps for r in out.results])
  prof = acceptance_profile(out.results)
  assert prof.visits[0] == acceptance(out.results)["rounds"]
  tree_out = speculative(TreeConfig("accum_logp", 16, 3, 4))
  visits, hits, hist = (per_request(tree_out, f) for f in ("depth_visits", "rank_hits", "depth_histogram"))
  at_least = hist[:, ::-1].cumsum(axis=1)[:, ::-1]
  np.testing.assert_array_equal(visits, at_least[:, :4])
  assert (hits.sum(axis=2)[:, :-1] >= visits[:, 1:]).all()


def test_profile_json_round_trip_and_errors(tmp_path):
  prof = _random_profile(9, 5, 3)
  path = prof.save(str(tmp_path / profile.PROFILE_FILE), {"note": "test"})
  data = json.loads(open(path).read())
  assert data["format"] == profile.PROFILE_FORMAT and data["depth"] == 5 and data["width"] == 3
  assert data["meta"] == {"note": "test"}
  assert profile.load(str(tmp_path)) == prof == profile.load(path)
  (tmp_path / "bad.json").write_text('{"format": "something else"}')
  with pytest.raises(JetSpecError, match="is not an acceptance profile"):
    profile.load(str(tmp_path / "bad.json"))
  (tmp_path / "broken.json").write_text('{"format"')
  with pytest.raises(JetSpecError, match="is not valid JSON"):
    profile.load(str(tmp_path / "broken.json"))
  with pytest.raises(JetSpecError, match="no acceptance profile"):
    profile.load(str(tmp_path / "missing.json"))
  with pytest.raises(JetSpecError, match="covers depth 5 and width 3; the tree needs depth 4 and width 4"):
    TreeConfig("static", 16, 4, 4, profile=prof).validate(HEAD)
  with pytest.raises(JetSpecError, match="inconsistent"):
    AcceptanceProfile.from_counts([3], [[2, 2]], [[1.0, 1.0]])


@pytest.mark.parametrize("kw,match", [
    (dict(method="static"), "needs an acceptance profile"),
    (dict(method="best_nodes", online="batch"), "needs tree method 'calibrated'"),
    (dict(method="calibrated", online="always"), "is not one of off, batch, sequence"),
    (dict(method="calibrated", prior_strength=0.0), "prior strength must be > 0"),
])
def test_bad_tree_configs(kw, match):
  with pytest.raises(JetSpecError, match=match):
    TreeConfig(budget=8, width=3, depth=4, **kw).validate(HEAD)


def _noisy_drafter(target_params, head_params, view, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
  """Random draft logits (from the round's keys) with the target's own greedy continuation raised by 3 (slot 0)
  or 1 (slot 1): drafts hit at varying ranks, so the online counts are not empty."""
  one = jnp.ones((view.last_token.shape[0], 1, 1), bool)

  def step(carry, _):
    cache, tok, pos = carry
    target = qwen3.bind(cfg, target_params)
    h, cache, _ = target.hidden(tok[:, None], pos[:, None], one, cache=cache, prefix_len=pos, table=view.table)
    logits = target.logits(h)
    nxt = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    return (cache, nxt, pos + 1), nxt

  _, toks = jax.lax.scan(step, (view.cache, view.last_token, view.prefix_len), None, length=tree_cfg.depth)
  noise = jax.vmap(lambda k: jax.random.normal(k, (tree_cfg.depth, cfg.vocab_size)))(view.keys)
  boost = jnp.array([3.0, 1.0])[:, None, None]
  return noise + boost * jax.nn.one_hot(toks.T, cfg.vocab_size), view.draft_cache


def test_online_calibration_on_a_2x2_mesh():
  """The batch-summed counts of a data-sharded engine (two groups over the data axis; a drafter whose drafts hit
  at varying ranks): still lossless, and the counts equal those of the same plan on one device."""
  if jax.device_count() < 4:
    pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  from jetspec_jax.models import draft_head, qwen3
  from jetspec_jax.sharding import make_mesh
  from test_decode_attention import place
  mesh = make_mesh(2, 2, jax.devices()[:4])
  target, head = weights()
  placed = (place(target, qwen3.param_specs(CFG), mesh), place(head, draft_head.param_specs(HEAD), mesh))
  tc = TreeConfig("calibrated", 16, 3, 4, profile=_profile_of_random_head(), online="batch")
  out = speculative(tc, mesh, placed, groups=2, drafter=_noisy_drafter)
  ref = speculative(tc, groups=2, drafter=_noisy_drafter)
  assert_agree(CFG, target, PROMPTS, ar_tokens(), ref.tokens)
  assert per_request(ref, "rank_hits").sum() > 0
  if assert_agree(CFG, target, PROMPTS, ref.tokens, out.tokens).identical == len(PROMPTS):   # counts follow the tokens
    for field in ("rank_hits", "depth_visits"):
      np.testing.assert_array_equal(per_request(out, field), per_request(ref, field))

"""Sampling at temperature > 0 on the engine: AR and both speculative acceptance rules are lossless.

A tiny target (vocabulary 8) lets the exact distribution of the first four generated tokens be
computed by enumeration; thousands of requests of one prompt are generated in ONE engine run per
configuration and compared by chi-square tests (fixed seeds: deterministic). The first token is drawn
after the prompt's prefill, the next three by speculative rounds.

One drafter serves several draft distributions at once, chosen by engine slot (b % len(variants); each
request holds one slot from its first round to its last):
  root      the target's own logits at the round's anchor context, repeated at every depth
            (q = p at depth 1)
  random    a fixed random table indexed by (depth, anchor)
  zero_top  like root, with zero mass on the target's top token at the anchor context
  head      the random JetSpec head (the production drafter)
  oracle    the target's processed distribution along the chain the tree will sample (the drafter
            reproduces the round's Gumbel noise): q = p at every depth. Its q depends on this
            round's noise, so it is only valid with a chain (whose shape never depends on q).
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import hf_fixtures
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode import sampling, speculative
from jetspec_jax.decode.engine import Engine, EnginePlan, Request, acceptance
from jetspec_jax.decode.profile import AcceptanceProfile
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3

V = 8
CFG = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, rope_theta=10000.0)
PROMPT = [1, 2, 3]
NUM_TOKENS = 4            # joint distribution of the first 4 generated tokens
P_MIN = 1e-3


@functools.lru_cache(maxsize=None)
def target():
  params = qwen3.init_target(CFG, jax.random.key(0))
  return {k: v * 30 if v.ndim > 1 else v for k, v in params.items()}


@functools.lru_cache(maxsize=None)
def head():
  cfg = draft_head.DraftConfig.for_target(CFG, num_layers=1, block_size=4)       # depth 3
  return cfg, draft_head.init_head(cfg, jax.random.key(1))


RANDOM_Q = 3.0 * jax.random.normal(jax.random.key(7), (3, V, V))                   # [depth, anchor, V]


# ------------------------------------------------------------------------------------------------
# Exact distributions by enumeration


@functools.lru_cache(maxsize=None)
def exact_joint(temperature, top_k, top_p, n=NUM_TOKENS):
  """P(t_1..t_n | PROMPT) [V]*n under the processed target distribution, by enumeration."""
  conts = np.array(list(itertools.product(range(V), repeat=n - 1)), np.int32)       # [V^(n-1), n-1]
  seqs = np.concatenate([np.tile(PROMPT, (len(conts), 1)), conts], axis=1)
  batch, length = seqs.shape
  cache = qwen3.init_cache(CFG, batch, length, jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  logits, _, _ = hf_fixtures.target_forward(target(), CFG, jnp.asarray(seqs), pos, cache, jnp.zeros((batch,), jnp.int32),
                               qwen3.causal_mask(batch, length))
  logp = np.asarray(sampling.process_logits(logits[:, len(PROMPT) - 1:], temperature, top_k, top_p), np.float64)
  probs = np.exp(logp)                                                               # [V^(n-1), n, V]
  joint = np.ones([V] * n)
  for i in range(n):
    # P(t_{i+1} | prompt, t_1..t_i): row of any continuation starting with t_1..t_i.
    cond = probs[:, i].reshape([V] * (n - 1) + [V])
    cond = cond[tuple([slice(None)] * i + [0] * (n - 1 - i))]                         # [V]*i + [V]
    joint = joint * cond.reshape([V] * (i + 1) + [1] * (n - 1 - i))
  return joint / joint.sum()


def chi_square_p(samples: np.ndarray, joint: np.ndarray, min_expected: float = 5.0) -> float:
  """Goodness of fit of samples [S, k] (tokens) to the joint [V]*k; cells with expected count below
  ``min_expected`` are pooled into one."""
  counts = np.zeros(joint.size)
  np.add.at(counts, np.ravel_multi_index(samples.T, joint.shape), 1)
  expected = joint.ravel() * len(samples)
  small = expected < min_expected
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  assert np.all(obs[~keep] == 0), "samples in a zero-probability cell"
  obs, exp = obs[keep], exp[keep]
  return float(stats.chi2.sf(np.sum((obs - exp) ** 2 / exp), len(obs) - 1))


def check_distribution(tokens: np.ndarray, temperature, top_k, top_p, label=""):
  """Joint of the first 2, 3 and 4 generated tokens against the exact target distribution."""
  full = exact_joint(temperature, top_k, top_p)
  for n in (2, 3, 4):
    joint = full.sum(axis=tuple(range(n, NUM_TOKENS)))
    p = chi_square_p(tokens[:, :n], joint)
    assert p > P_MIN, f"{label}: first {n} tokens differ from the target distribution (chi-square p={p:.2g})"


# ------------------------------------------------------------------------------------------------
# Drafters and an engine runner that keeps per-request results


def target_step(params, cache, tok, pos, table=None):
  batch = tok.shape[0]
  logits, cache, _ = hf_fixtures.target_forward(params, CFG, tok[:, None], pos[:, None], cache, pos,
                                                jnp.ones((batch, 1, 1), bool), table=table)
  return logits[:, 0], cache


def mixed_drafter(variants, temperature, top_k, top_p):
  def drafter(target_params, head_params, view, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
    b = view
    batch, depth = b.last_token.shape[0], tree_cfg.depth
    noise = sampling.draft_gumbel(view.keys, depth, cfg.vocab_size)

    def chain_step(carry, d):
      cache, tok, pos = carry
      logits, cache = target_step(target_params, cache, tok, pos, b.table)
      lp = sampling.process_logits(logits, temperature, top_k, top_p)
      nxt = sampling.gumbel_top_k(lp, noise[:, d], 1)[:, 0]                 # what the tree will sample
      return (cache, nxt, pos + 1), logits

    _, chain = jax.lax.scan(chain_step, (b.cache, b.last_token, b.prefix_len), jnp.arange(depth))
    chain = chain.transpose(1, 0, 2)                                          # [B, D, V]
    root = jnp.broadcast_to(chain[:, :1], chain.shape)
    top = jax.nn.one_hot(jnp.argmax(root, -1), cfg.vocab_size, dtype=bool)
    options = {
        "root": root,
        "random": RANDOM_Q[:depth, b.last_token].transpose(1, 0, 2),
        "zero_top": jnp.where(top, -jnp.inf, root),
        "oracle": chain,
    }
    if "head" in variants:
      options["head"] = speculative.head_drafter(target_params, head_params, view, cfg=cfg, head_cfg=head_cfg,
                                                 tree_cfg=tree_cfg, attn_impl=attn_impl, mesh=mesh)[0]
    which = jnp.arange(batch) % len(variants)
    out = options[variants[0]]
    for i, name in enumerate(variants[1:], 1):
      out = jnp.where((which == i)[:, None, None], options[name], out)
    return out, view.draft_cache
  return drafter


@functools.lru_cache(maxsize=None)
def drafter_for(variants, temperature, top_k, top_p):
  return mixed_drafter(variants, temperature, top_k, top_p)                 # one object: one compile


def run_requests(engine: Engine, requests, chunk: int = 500):
  """What ``engine.run(requests)`` gives (ids 0.., one device loop), the requests submitted ``chunk`` at a time:
  ``Engine.submit`` stacks a call's keys in one op, whose compile time grows with the square of its requests."""
  engine.start()
  ids = [i for at in range(0, len(requests), chunk) for i in engine.submit(requests[at:at + chunk])]
  done = {r.id: r for r in engine.step()}
  return [done[i] for i in ids]


def spec_engine(tree_cfg, variants, *, max_new, temperature, top_k=0, top_p=1.0, accept, seed=0) -> Engine:
  """A speculative engine of BATCH slots in GROUPS groups for requests of PROMPT, each prefilled by its own lane
  in the first round (one program per configuration: the seed is not compiled in)."""
  hcfg, hparams = head()
  plan = EnginePlan(slots=BATCH, rows=BATCH * tree_cfg.num_nodes(), lanes=BATCH, prefill_rows=len(PROMPT),
                    max_prompt=len(PROMPT), max_new_tokens=max_new, queue=BATCH // GROUPS, groups=GROUPS,
                    tree=tree_cfg)
  return Engine(CFG, target(), plan, head_cfg=hcfg, head_params=hparams, eos_ids=(),
                sampling_cfg=SamplingConfig(temperature, top_k, top_p, accept, seed),
                drafter=drafter_for(variants, temperature, top_k, top_p))


def slot_of(request: np.ndarray) -> np.ndarray:
  """The slot request i holds in ``spec_engine`` when all are queued at once: requests go to the groups in turn
  (the one with the fewest outstanding) and take their group's slots in queue order."""
  return request % GROUPS * (BATCH // GROUPS) + request // GROUPS


def run_spec(tree_cfg, variants, *, max_new, first_round_only=False, **kw):
  """BATCH requests of PROMPT through ``spec_engine``, returning per-request tokens [B, M], depth histograms
  [B, D+1] and drafter variants [B]. Every request takes a slot in the first round and keeps it to its end: the
  drafter's variant of its slot (``slot_of``) is the request's.

  first_round_only: requests of 2 tokens in the engine planned for ``max_new`` (the same program), so every
  request runs exactly one round after its first token."""
  results = run_requests(spec_engine(tree_cfg, variants, max_new=max_new, **kw),
                         [Request(PROMPT, 2 if first_round_only else max_new)] * BATCH)
  assert all(r.admitted == 0 and r.first == 0 for r in results)
  tokens = np.asarray([r.tokens for r in results])
  assert tokens.shape == (BATCH, 2 if first_round_only else max_new)
  return tokens, np.stack([r.depth_histogram for r in results]), slot_of(np.arange(BATCH)) % len(variants)


TREE = TreeConfig("accum_logp", budget=8, width=4, depth=3)
BEST_NODES = TreeConfig("best_nodes", budget=8, width=4, depth=3)
CHAIN = TreeConfig("chain", budget=1, width=1, depth=3)
# Shapes from measured acceptance: a static tree bushy at depth 1 (a made-up profile), and a calibrated tree
# whose shape moves with the counts of the sequence's own earlier rounds.
STATIC = TreeConfig("static", budget=8, width=4, depth=3, profile=AcceptanceProfile.from_counts(
    [100, 50, 20], [[30, 20, 10, 5], [25, 5, 2, 1], [8, 2, 1, 0]], [[40, 10, 5, 5], [20, 10, 5, 5], [10, 5, 2, 1]]))
CALIBRATED_ONLINE = TreeConfig("calibrated", budget=8, width=4, depth=3, online="sequence", prior_strength=1.0)
TREE_VARIANTS = ("root", "random", "zero_top", "head")
CHAIN_VARIANTS = ("root", "random", "zero_top", "oracle")
BATCH = 12000
GROUPS = 24                # queues of 500 requests: ``Engine.submit`` scans a group's queue per request

SPEC_CASES = [
    # (accept, tree, variants, temperature, top_k, top_p, max_new)
    ("rejection", TREE, TREE_VARIANTS, 1.0, 3, 1.0, NUM_TOKENS),      # top-k 3 < width 4: support runs out
    ("rejection", BEST_NODES, TREE_VARIANTS, 0.8, 0, 0.9, NUM_TOKENS),
    ("rejection", STATIC, TREE_VARIANTS, 1.0, 0, 1.0, NUM_TOKENS),
    ("rejection", CALIBRATED_ONLINE, TREE_VARIANTS, 0.9, 0, 1.0, NUM_TOKENS),
    ("rejection", CHAIN, CHAIN_VARIANTS, 0.7, 0, 0.8, 1 + 2 * 4),     # two full oracle rounds
    ("match", TREE, TREE_VARIANTS, 1.0, 0, 1.0, NUM_TOKENS),
    ("match", CHAIN, CHAIN_VARIANTS, 1.3, 5, 0.9, NUM_TOKENS),
]


@pytest.mark.parametrize("accept,tree_cfg,variants,temperature,top_k,top_p,max_new", SPEC_CASES,
                         ids=lambda x: getattr(x, "method", None) or str(x))
def test_speculative_sampling_is_lossless(accept, tree_cfg, variants, temperature, top_k, top_p, max_new):
  tokens, hist, which = run_spec(tree_cfg, variants, max_new=max_new, temperature=temperature, top_k=top_k,
                                 top_p=top_p, accept=accept, seed=1)
  for i, name in enumerate(variants):
    check_distribution(tokens[which == i, :NUM_TOKENS], temperature, top_k, top_p, f"{accept}/{name}")
  if accept == "rejection":
    # q = p at depth 1 (root, oracle): the first candidate is always accepted.
    for name in ("root", "oracle"):
      if name in variants:
        assert hist[which == variants.index(name), 0].sum() == 0, name
  if "oracle" in variants and accept == "rejection":
    # q = p along the chain: every round accepts every drafted depth (tau = depth + 1).
    h = hist[which == variants.index("oracle")]
    assert np.all(h[:, :-1] == 0) and np.all(h[:, -1] == 2)
  if "zero_top" in variants and accept == "rejection":
    h = hist[which == variants.index("zero_top")]
    assert 0 < h[:, 1:].sum() < h.sum()


def test_match_accepts_with_the_mass_of_the_children():
  """match at depth 1 accepts with probability p(children of the root), the root's children being
  the top-W tokens of q (here q = p: the target's own top-W at the anchor context)."""
  accept, tree_cfg, variants, temperature, top_k, top_p, max_new = next(
      case for case in SPEC_CASES if case[:2] == ("match", TREE))
  tokens, hist, which = run_spec(tree_cfg, variants, max_new=max_new, temperature=temperature,
                                 top_k=top_k, top_p=top_p, accept=accept, seed=2, first_round_only=True)
  rows = which == variants.index("root")
  t1 = tokens[rows, 0]
  p2 = exact_joint(temperature, top_k, top_p, 2)
  p2 = p2 / p2.sum(1, keepdims=True)                                                  # p(t2 | t1)
  mass = np.sort(p2, axis=1)[:, ::-1][:, :tree_cfg.width].sum(1)                      # top-W mass per t1
  expected = mass[t1]
  accepted = hist[rows, 1:].sum(1)
  assert np.all(hist[rows].sum(1) == 1)
  z = (accepted.sum() - expected.sum()) / np.sqrt(np.sum(expected * (1 - expected)))
  assert abs(z) < 4, (accepted.mean(), expected.mean(), z)
  assert 0.2 < expected.mean() < 0.98                                                 # a real test


def test_ar_sampling_matches_the_target_and_is_reproducible():
  """8,000 AR requests through 2,000 slots (each serving four requests in turn): the target's distribution, and
  the same tokens when run again."""
  temperature, top_k, top_p = 0.8, 0, 0.9
  requests = [Request(PROMPT, NUM_TOKENS)] * 8000
  ar = Engine.for_requests(CFG, target(), requests, slots=2000, lanes=2000, prefill_rows=len(PROMPT), groups=8,
                           eos_ids=(), sampling_cfg=SamplingConfig(temperature, top_k, top_p, seed=3))
  out = run_requests(ar, requests)
  assert max(r.admitted for r in out) > 0                          # slots were reused
  tokens = [r.tokens for r in out]
  check_distribution(np.array(tokens), temperature, top_k, top_p, "ar")
  assert [r.tokens for r in run_requests(ar, requests)] == tokens


def test_speculative_sampling_is_reproducible_from_the_seed():
  """A speculative engine at temperature > 0 (the program of the first case of SPEC_CASES: nothing
  recompiles; 2,000 requests in its BATCH slots): a seed fixes the output; requests draw independently."""
  accept, tree_cfg, variants, temperature, top_k, top_p, max_new = SPEC_CASES[0]
  requests = [Request(PROMPT, max_new)] * 2000

  def engine(seed):
    return spec_engine(tree_cfg, variants, max_new=max_new, temperature=temperature, top_k=top_k, top_p=top_p,
                       accept=accept, seed=seed)

  a, b, c = (run_requests(engine(seed), requests) for seed in (5, 5, 6))
  tokens = lambda results: [r.tokens for r in results]
  assert tokens(a) == tokens(b) != tokens(c)
  assert len(set(map(tuple, tokens(a)[:16]))) > 1                  # per-request keys
  assert engine(5).sampling.describe() == {"temperature": 1.0, "top_k": 3, "top_p": 1.0, "accept": "rejection",
                                           "seed": 5}
  acc_a, acc_b = acceptance(a), acceptance(b)
  assert 1.0 < acc_a["tau"] <= tree_cfg.depth + 1
  assert acc_a["rounds"] == acc_b["rounds"] and len(acc_a["acceptance_by_depth"]) == tree_cfg.depth


def _reference_process(logits, temperature, top_k, top_p):
  x = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-x, kind="stable")
  keep = np.zeros(len(x), bool)
  kept = order[:top_k] if top_k else order
  keep[kept] = True
  if top_p < 1:
    p = np.exp(x[kept] - x[kept].max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep[:] = False
    keep[kept[before < top_p]] = True
  out = np.where(keep, x, -np.inf)
  return out - np.log(np.sum(np.exp(out - out.max()))) - out.max()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 3, 1.0), (2.0, 0, 0.6),
                                                     (0.7, 4, 0.5), (1.0, 1, 1.0), (1.0, 0, 1e-6)])
def test_process_logits_matches_reference(temperature, top_k, top_p):
  logits = np.array([[0.3, 2.0, -1.0, 2.0, 0.9, 0.1, -3.0, 1.5], [5.0, 0, 0, 0, 0, 0, 0, 0.1]], np.float32)
  got = np.asarray(sampling.process_logits(jnp.asarray(logits), temperature, top_k, top_p))
  for row, g in zip(logits, got):
    ref = _reference_process(row, temperature, top_k, top_p)
    assert np.array_equal(np.isinf(g), np.isinf(ref))
    np.testing.assert_allclose(g[~np.isinf(g)], ref[~np.isinf(ref)], rtol=1e-5, atol=1e-6)


ROW_SETTINGS = [(1.0, 0, 1.0), (0.5, 3, 1.0), (2.0, 0, 0.6), (0.7, 4, 0.5), (1.0, 1, 1.0), (1.0, 0, 1e-6), (0.0, 5, 0.3)]


def test_per_row_parameters_process_each_row_by_its_own():
  """One call with a different setting per row (traced arrays) gives every row what the fixed setting gives it;
  a temperature-0 row is all mass on the argmax (ties to the lower id, as argmax), whatever its top_k / top_p."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(len(ROW_SETTINGS), 2, 40)).astype(np.float32) * 2
  logits[:, 1, [3, 9]] = logits[:, 1].max() + 1                   # a tie for the most likely token
  t, k, p = (np.asarray(col) for col in zip(*ROW_SETTINGS))
  got = np.asarray(jax.jit(sampling.process_logits)(jnp.asarray(logits), jnp.asarray(t, jnp.float32),
                                                   jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32)))
  for i, (temperature, top_k, top_p) in enumerate(ROW_SETTINGS):
    for j in range(2):
      if temperature == 0:
        assert np.flatnonzero(np.isfinite(got[i, j])).tolist() == [int(np.argmax(logits[i, j]))] and got[i, j].max() == 0
        continue
      fixed = np.asarray(sampling.process_logits(jnp.asarray(logits[i, j]), temperature, top_k, top_p))
      assert np.array_equal(np.isinf(got[i, j]), np.isinf(fixed)), (i, j)
      np.testing.assert_allclose(got[i, j][np.isfinite(fixed)], fixed[np.isfinite(fixed)], rtol=1e-6, atol=1e-6)
  keys = jax.random.split(jax.random.key(0), len(ROW_SETTINGS))
  drawn = np.asarray(sampling.sample_tokens(jnp.asarray(logits[:, 0]), keys, jnp.asarray(t, jnp.float32),
                                            jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32)))
  assert drawn[-1] == np.argmax(logits[-1, 0]) and all(np.isfinite(got[i, 0, d]) for i, d in enumerate(drawn))


def test_gumbel_top_k_draws_without_replacement_in_order():
  logp = jnp.log(jnp.array([0.5, 0.3, 0.2, 0.0]))
  keys = jax.random.split(jax.random.key(0), 20000)
  draws = np.asarray(jax.vmap(lambda k: sampling.gumbel_top_k(logp, jax.random.gumbel(k, (4,)), 2))(keys))
  assert np.all(draws[:, 0] != draws[:, 1]) and not np.any(draws == 3)
  pairs = {(0, 1): .5 * .3 / .5, (0, 2): .5 * .2 / .5, (1, 0): .3 * .5 / .7, (1, 2): .3 * .2 / .7,
           (2, 0): .2 * .5 / .8, (2, 1): .2 * .3 / .8}
  obs = np.array([np.sum((draws[:, 0] == a) & (draws[:, 1] == b)) for a, b in pairs])
  exp = np.array(list(pairs.values())) * len(draws)
  assert stats.chisquare(obs, exp).pvalue > P_MIN


def test_invalid_sampling_options():
  hcfg, hparams = head()
  requests = [Request(PROMPT, 2)]
  tree = TreeConfig("chain", 1, 1, 3)
  for kw in (dict(temperature=-1.0), dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_p=1.5),
             dict(temperature=1.0, top_k=-2), dict(temperature=1.0, accept="greedy")):
    with pytest.raises(JetSpecError):
      Engine.for_requests(CFG, target(), requests, slots=1, tree=tree, head_cfg=hcfg, head_params=hparams,
                          sampling_cfg=SamplingConfig(**kw))
  with pytest.raises(JetSpecError):
    Engine.for_requests(CFG, target(), requests, slots=1, sampling_cfg=SamplingConfig(temperature=1.0, top_p=0.0))

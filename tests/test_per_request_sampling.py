"""Per-request sampling in the engine (``EnginePlan.per_request_sampling``): one program serves greedy and
sampled requests with different temperature / top_k / top_p together, each request's tokens equal to those
of an engine compiled for its setting alone (same key: so the fixed engines' exactness tests carry over),
greedy ones equal to their own AR generation; requests with bad or (fixed engine) unsupported settings are
refused in one sentence before anything runs."""
import dataclasses

import jax
import pytest

from jetspec_jax import sharding
from jetspec_jax.decode.engine import Engine, EnginePlan, Request
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from test_engine import ar_reference, placed, random_requests
from greedy import assert_agree
from test_speculative import CFG, head, target

SETTINGS = [(0.0, 0, 1.0), (0.8, 5, 1.0), (1.3, 0, 0.85)]      # (temperature, top_k, top_p): greedy, two sampled
MODES = [(None, "rejection"), (TreeConfig("best_nodes", 8, 3, 4), "rejection"), (TreeConfig("accum_logp", 8, 3, 4), "match")]


def plan(tree, per_request: bool) -> EnginePlan:
  """Rows for every slot's whole tree: no node is cut, so which nodes a request verifies is its own."""
  nodes = 1 if tree is None else tree.num_nodes()
  return EnginePlan(slots=3, rows=3 * nodes, lanes=1, prefill_rows=8, max_prompt=40, max_new_tokens=16, queue=9,
                    tree=tree, per_request_sampling=per_request)


def engine(tree, per_request: bool, sampling_cfg: SamplingConfig) -> Engine:
  kw = {} if tree is None else dict(head_cfg=head()[0], head_params=head()[1])
  return Engine(CFG, target(), plan(tree, per_request), eos_ids=(), sampling_cfg=sampling_cfg, **kw)


@pytest.mark.parametrize("tree,accept", MODES, ids=["ar", "best_nodes-rejection", "accum_logp-match"])
def test_each_request_samples_as_an_engine_compiled_for_its_setting(tree, accept):
  requests = [dataclasses.replace(r, key=jax.random.key(100 + i), **dict(zip(("temperature", "top_k", "top_p"),
                                                                             SETTINGS[i % 3])))
              for i, r in enumerate(random_requests(7, 9, max_new=16))]
  mixed = engine(tree, True, SamplingConfig(accept=accept)).run(requests).results
  for which, setting in enumerate(SETTINGS):
    mine = [(r, res) for i, (r, res) in enumerate(zip(requests, mixed)) if i % 3 == which]
    if setting[0] == 0:
      assert_agree(CFG, target(), [r.prompt for r, _ in mine],
                   [ar_reference(tuple(r.prompt), r.max_new_tokens, ()) for r, _ in mine], [res.tokens for _, res in mine])
      continue
    alone = engine(tree, False, SamplingConfig(*setting, accept=accept)).run(
        [dataclasses.replace(r, temperature=None, top_k=None, top_p=None) for r, _ in mine]).results
    assert [res.tokens for _, res in mine] == [a.tokens for a in alone], setting
  if tree is not None:                                       # drafts of sampled requests were accepted
    assert sum(res.depth_histogram[1:].sum() for i, res in enumerate(mixed) if i % 3) > 0


def test_requests_take_the_engine_setting_where_they_leave_it_out():
  sized = Engine.for_requests(CFG, target(), [Request([1], 2)], slots=1, per_request_sampling=True)
  assert sized.plan.per_request_sampling
  e = engine(None, True, SamplingConfig(0.7, 3, 0.9, seed=1))
  assert e.request_sampling(Request([1], 2)) == (0.7, 3, 0.9)
  assert e.request_sampling(Request([1], 2, top_p=0.5)) == (0.7, 3, 0.5)
  assert e.request_sampling(Request([1], 2, temperature=0, top_k=7)) == (0.0, 0, 1.0)     # greedy ignores the rest


@pytest.mark.parametrize("request_kw,message", [
    (dict(temperature=-0.5), "request 1: temperature must be >= 0"),
    (dict(temperature=1.0, top_p=0.0), "request 1: top_p must be in (0, 1]"),
    (dict(top_k=2.5), "request 1: top_k must be a non-negative integer"),
    (dict(temperature="hot"), "request 1: temperature must be a number"),
])
def test_bad_settings_are_refused_before_the_run(request_kw, message):
  e = engine(None, True, SamplingConfig())
  with pytest.raises(JetSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
    e.submit([Request([1, 2], 3), Request([1, 2], 3, **request_kw)])
  assert e.state is None or not any(e._entries)


def test_an_engine_with_one_compiled_setting_refuses_others():
  e = engine(None, False, SamplingConfig(0.7, 0, 1.0))
  e.submit([Request([1, 2], 3), Request([1, 2], 3, temperature=0.7)])          # its own setting: fine
  with pytest.raises(JetSpecError, match="request 0 asks for its own sampling .* per_request_sampling=True"):
    e.submit([Request([1, 2], 3, temperature=0.0)])


def test_a_2x2_mesh_equals_one_device(eight_devices):
  """Two groups of slots over the data axis, heads and the vocabulary over the model axis (sampling's rows
  laid out whole, ``sharding.whole_vocab``): the same tokens as one device, greedy and sampled requests mixed."""
  requests = [dataclasses.replace(r, key=jax.random.key(100 + i), **dict(zip(("temperature", "top_k", "top_p"),
                                                                             SETTINGS[i % 3])))
              for i, r in enumerate(random_requests(11, 6, max_new=12))]
  tree = TreeConfig("best_nodes", 8, 3, 4)
  hcfg, hparams = head()
  make = lambda mesh, t, h: Engine(CFG, t, dataclasses.replace(plan(tree, True), slots=4, rows=4 * tree.num_nodes(),
                                                               lanes=2, groups=2, queue=3),
                                   head_cfg=hcfg, head_params=h, eos_ids=(), sampling_cfg=SamplingConfig(), mesh=mesh)
  ref = make(None, target(), hparams).run(requests)
  mesh = sharding.make_mesh(2, 2, jax.devices()[:4])
  run = make(mesh, placed(target(), qwen3.param_specs(CFG), mesh),
             placed(hparams, draft_head.param_specs(hcfg), mesh)).run(requests)
  greedy = [i for i in range(len(requests)) if SETTINGS[i % 3][0] == 0]
  assert_agree(CFG, target(), [requests[i].prompt for i in greedy], [ref.results[i].tokens for i in greedy],
               [run.results[i].tokens for i in greedy])
  assert all(run.results[i].tokens == ref.results[i].tokens for i in range(len(requests)) if i not in greedy)

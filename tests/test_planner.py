"""The planner: candidate plans, calibration runs that measure each one, the choice by tokens per second."""
from jetspec_jax.decode import planner
from jetspec_jax.decode.engine import Engine, EnginePlan
from jetspec_jax.decode.speculative import TreeConfig
from test_engine import head, random_requests
from test_speculative import CFG, target


def test_candidates_and_the_choice():
  tree = TreeConfig("best_nodes", 8, 3, 4)
  spec = planner.candidate_plans(3, tree, row_factors=(2, 4, 16))
  assert [(n, r) for n, _, r in spec] == [("ar", 3), ("chain_d4", 15), ("best_nodes_rows6", 6),
                                          ("best_nodes_rows12", 12), ("best_nodes_rows24", 24)]
  requests = random_requests(3, 4, max_new=10)

  def make(t, rows):
    plan = EnginePlan(slots=3, rows=rows, lanes=1, prefill_rows=8, max_prompt=40, max_new_tokens=10, queue=4, tree=t)
    kw = {} if t is None else dict(head_cfg=head()[0], head_params=head()[1])
    return Engine(CFG, target(), plan, eos_ids=(), **kw)

  points = planner.calibrate(make, requests, spec[:3])
  assert [p.name for p in points] == ["ar", "chain_d4", "best_nodes_rows6"]
  assert all(p.seconds_per_round > 0 and p.tokens_per_round >= 1 for p in points)
  assert points[0].tokens_per_round < 3.01                      # AR: at most one token per slot and round
  best = planner.choose(points)
  assert best.tokens_per_second == max(p.tokens_per_second for p in points)
  plan = planner.plan_for(best, spec, make(None, 3).plan)
  assert plan.rows == best.rows and (plan.tree is None) == (best.name == "ar")

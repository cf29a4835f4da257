"""Choosing the batch-wide node budget on the device at hand: a measured cost curve.

For a slot count B, each candidate plan (plain AR decoding, a chain, and a tree whose per-round
decode rows K = B, 2B, 4B, ... are shared by the whole batch, ``decode.budget``) runs a short
calibration on a sample of the workload's own requests. The second run of each is timed (the first
compiles), giving seconds per round (the cost curve: verify time against rows, at this occupancy)
and committed tokens per round; the plan with the most tokens per second wins. At a large batch
the rows a tree adds cost more than the tokens they win, and the choice falls to a short chain or
to AR decoding by measurement, not by a rule.

Where the device a plan is for is not at hand (planning for an H200 from a CPU machine), ``modeled``
keeps the calibration's tokens per round (what a round commits does not depend on the device) and
takes seconds per round from ``jetspec_jax.hlo_cost``'s roofline model of each candidate's round as
compiled for that device: a model, not a measurement. Each point says which it holds (``cost``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from jetspec_jax import hlo_cost
from jetspec_jax.decode.engine import ROUND_BODIES, Engine, EnginePlan, Request
from jetspec_jax.decode.speculative import TreeConfig


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the cost curve: a plan's name, its decode rows per round, seconds per round and
  committed tokens per round on the calibration requests; ``cost``: where the seconds come from
  ("measured" on this machine, or "model <device>": ``modeled``)."""
  name: str
  rows: int
  seconds_per_round: float
  tokens_per_round: float
  cost: str = "measured"

  @property
  def tokens_per_second(self) -> float:
    return self.tokens_per_round / max(self.seconds_per_round, 1e-12)


def candidate_plans(slots: int, tree: TreeConfig, *, row_factors: Sequence[int] = (2, 4, 8),
                    chain_depth: int | None = None) -> list[tuple[str, TreeConfig | None, int]]:
  """(name, tree or None, decode rows) candidates: AR, a chain of ``chain_depth`` (default: the tree's
  depth) with every slot's chain, and ``tree`` with rows = factor * slots for each factor below its size,
  then every slot's whole tree."""
  depth = chain_depth or tree.depth
  out = [("ar", None, slots), (f"chain_d{depth}", TreeConfig("chain", 1, 1, depth), slots * (depth + 1))]
  for f in [f for f in row_factors if f < tree.num_nodes()] + [tree.num_nodes()]:
    out.append((f"{tree.method}_rows{f * slots}", tree, f * slots))
  return out


def calibrate(make_engine: Callable[[TreeConfig | None, int], Engine], requests: Sequence[Request],
              candidates, progress: Callable[[str], None] = lambda s: None) -> list[Candidate]:
  """Run each candidate (``make_engine(tree, rows)``) twice on ``requests``; the second run is measured."""
  out = []
  for name, tree, rows in candidates:
    engine = make_engine(tree, rows)
    engine.run(requests)                                        # compile
    t0 = time.perf_counter()
    run = engine.run(requests)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in run.results)
    out.append(Candidate(name, rows, wall / max(run.rounds, 1), tokens / max(run.rounds, 1)))
    progress(f"calibration {name}: {out[-1].tokens_per_second:.0f} tokens/s")
  return out


def modeled(points: Sequence[Candidate], candidates_spec, round_hlo: Callable[[TreeConfig | None, int], str],
            device: hlo_cost.Device) -> list[Candidate]:
  """``points`` (a calibration's) with seconds per round from the roofline model (``hlo_cost.roofline``) of each
  candidate's round on ``device``: ``round_hlo(tree, rows)`` is the optimised HLO text of the engine's program
  for that candidate compiled for the device (e.g. deviceless, ``bench/aot_memory.py``); its decode round body
  (``engine.ROUND_BODIES`` variant 0) is what is costed. Tokens per round are kept."""
  spec = {name: (tree, rows) for name, tree, rows in candidates_spec}
  out = []
  for p in points:
    kernels = hlo_cost.round_kernels(round_hlo(*spec[p.name]), ROUND_BODIES, 0)
    out.append(dataclasses.replace(p, seconds_per_round=hlo_cost.roofline(kernels, device)["time_s"],
                                   cost=f"model {device.name}"))
  return out


def choose(candidates: Sequence[Candidate]) -> Candidate:
  """The candidate with the most tokens per second."""
  return max(candidates, key=lambda c: c.tokens_per_second)


def plan_for(candidate: Candidate, candidates_spec, base: EnginePlan) -> EnginePlan:
  """``base`` with the chosen candidate's tree and rows."""
  tree = next(t for name, t, _ in candidates_spec if name == candidate.name)
  return dataclasses.replace(base, tree=tree, rows=candidate.rows)

"""Acceptance profiles: how often the target's token at depth d was the draft's rank-r token, and the
trees they imply.

A round observes depth d (1 <= d <= D) when its accepted path reached depth d - 1: the target's token
there is then known (a path token, or the correction after the path), whatever the tree held. Counts:

  visits[d-1]       rounds that observed depth d
  hits[d-1][r]      of those, rounds whose target token at depth d was the draft's rank-r candidate
                    (rank in the depth's top-W list; r < W), at most one r per round
  mass[d-1][r]      of those, the sum of the draft's probability of its rank-r candidate: what the draft
                    predicted hits[d-1][r] to be (hits / mass > 1: the draft is underconfident there)

acceptance = hits / visits estimates p(d, r), the probability that the rank-r child at depth d is
accepted given that its parent was. Under the independence model (p depends on (d, r) only) a tree's
expected committed tokens per round is 1 + sum over its non-root nodes of the product of p along the
node's root path (``expected_tau``). Exact for greedy decoding and the match rule; at temperature > 0
with the rejection rule the candidates are the round's Gumbel draws and the counts are an estimate.

JSON schema (``save`` / ``load``; written beside the head as ``acceptance_profile.json``):
  {"format": "jetspec-acceptance-profile", "version": 1, "depth": D, "width": W,
   "visits": [D ints], "hits": [D lists of W ints], "mass": [D lists of W floats],
   "acceptance": [D lists of W floats],
   "meta": {...}}   # free-form provenance: tree, banks, prompts, sampling, head
"""
from __future__ import annotations

import dataclasses
import heapq
import json
import os

import numpy as np

from jetspec_jax.errors import JetSpecError
from jetspec_jax.files import write_json

PROFILE_FORMAT = "jetspec-acceptance-profile"
PROFILE_FILE = "acceptance_profile.json"
ACCEPTANCE_FLOOR = 1e-6     # smallest acceptance a tree ranks by (keeps log-scores finite)


@dataclasses.dataclass(frozen=True)
class AcceptanceProfile:
  """Per-(depth, rank) acceptance counts (see the module docstring); hashable, so a jit static."""
  visits: tuple[int, ...]
  hits: tuple[tuple[int, ...], ...]
  mass: tuple[tuple[float, ...], ...]

  @property
  def depth(self) -> int:
    return len(self.visits)

  @property
  def width(self) -> int:
    return len(self.hits[0])

  @classmethod
  def from_counts(cls, visits, hits, mass) -> "AcceptanceProfile":
    """From arrays visits [D], hits [D, W] and mass [D, W] (already summed over sequences)."""
    visits, hits, mass = np.asarray(visits, np.int64), np.asarray(hits, np.int64), np.asarray(mass, np.float64)
    if visits.ndim != 1 or hits.shape[:1] != visits.shape or hits.ndim != 2 or hits.shape[1] < 1 or \
        mass.shape != hits.shape:
      raise JetSpecError(f"profile counts must be visits [D], hits [D, W] and mass [D, W]; got {visits.shape}, "
                         f"{hits.shape} and {mass.shape}")
    if (hits < 0).any() or (mass < 0).any() or (hits.sum(axis=1) > visits).any():
      raise JetSpecError("profile counts are inconsistent: hits and mass must be >= 0 and hits sum to at most "
                         "visits per depth")
    return cls(tuple(int(v) for v in visits), tuple(tuple(int(h) for h in row) for row in hits),
               tuple(tuple(round(float(m), 6) for m in row) for row in mass))

  def acceptance(self) -> np.ndarray:
    """hits / visits [D, W] float64 (0 where a depth was never observed)."""
    visits = np.asarray(self.visits, np.float64)[:, None]
    return np.asarray(self.hits, np.float64) / np.maximum(visits, 1.0)

  def fitted(self, depth: int, width: int) -> np.ndarray:
    """The acceptance a tree of this depth and width ranks by [depth, width]: non-increasing in rank
    (running minimum, so a rank-r child is never preferred to its rank-(r-1) sibling) and at least
    ``ACCEPTANCE_FLOOR``."""
    if depth > self.depth or width > self.width:
      raise JetSpecError(f"the acceptance profile covers depth {self.depth} and width {self.width}; the tree "
                         f"needs depth {depth} and width {width} (profile with at least that tree)")
    return monotone(self.acceptance()[:depth, :width])

  def counts(self, depth: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(hits, mass) [depth, width] float32: the calibrated tree's prior counts."""
    self.fitted(depth, width)
    return (np.asarray(self.hits, np.float32)[:depth, :width], np.asarray(self.mass, np.float32)[:depth, :width])

  def to_json(self, meta: dict | None = None) -> dict:
    return {"format": PROFILE_FORMAT, "version": 1, "depth": self.depth, "width": self.width,
            "visits": list(self.visits), "hits": [list(r) for r in self.hits], "mass": [list(r) for r in self.mass],
            "acceptance": [[round(float(a), 6) for a in row] for row in self.acceptance()], "meta": meta or {}}

  def save(self, path: str, meta: dict | None = None) -> str:
    """Write the JSON (temp file, then rename); returns the path."""
    return write_json(path, self.to_json(meta), indent=1)


def load(path: str) -> AcceptanceProfile:
  """An ``AcceptanceProfile`` from its JSON file (or from a head directory holding ``PROFILE_FILE``)."""
  if os.path.isdir(path):
    path = os.path.join(path, PROFILE_FILE)
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise JetSpecError(f"no acceptance profile at {path}; make one with `jetspec-jax profile`") from None
  except json.JSONDecodeError:
    raise JetSpecError(f"{path} is not valid JSON (an acceptance profile is written by `jetspec-jax profile`)") from None
  if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT or \
      any(k not in data for k in ("visits", "hits", "mass")):
    raise JetSpecError(f"{path} is not an acceptance profile (format {PROFILE_FORMAT!r} with visits, hits and mass)")
  return AcceptanceProfile.from_counts(data["visits"], data["hits"], data["mass"])


def monotone(acceptance: np.ndarray) -> np.ndarray:
  """Running minimum over ranks (last axis), floored at ``ACCEPTANCE_FLOOR``."""
  return np.maximum(np.minimum.accumulate(np.asarray(acceptance, np.float64), axis=-1), ACCEPTANCE_FLOOR)


@dataclasses.dataclass(frozen=True)
class StaticTree:
  """A fixed tree shape of N nodes: node i is the rank-``ranks[i]`` candidate of depth ``depths[i]``,
  child of ``parents[i]`` (root: index 0, depth 0). Parents precede children; siblings are numbered in
  rank order and their ranks are 0, 1, ..., k-1 (what the rejection rule needs)."""
  parents: tuple[int, ...]
  depths: tuple[int, ...]
  ranks: tuple[int, ...]

  def ancestors(self) -> np.ndarray:
    n = len(self.parents)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
      anc[i] |= anc[self.parents[i]]
    return anc


def optimal_static_tree(acceptance: np.ndarray, budget: int) -> StaticTree:
  """The tree of ``budget`` nodes (root included) with the highest ``expected_tau`` under the
  independence model, for acceptance [D, W] non-increasing in rank (``AcceptanceProfile.fitted``).

  A node's value (its path product) is at most its parent's and at most its left sibling's, so the
  budget - 1 nodes of highest value form a tree closed under parents and left siblings, and no other
  set of that size has a larger sum: the Sequoia dynamic program reduces to this best-first search
  (the tests check it against brute-force enumeration). Ties: lower depth, then insertion order."""
  acc = np.asarray(acceptance, np.float64)
  depth, width = acc.shape
  if budget < 1:
    raise JetSpecError(f"tree budget must be at least 1 (it counts the root); got {budget}")
  if (np.diff(acc, axis=1) > 0).any():
    raise JetSpecError("acceptance must be non-increasing in rank (use AcceptanceProfile.fitted)")
  parents, depths, ranks, values = [0], [0], [0], [1.0]
  heap, order = [], 0

  def push_children(node):
    nonlocal order
    d = depths[node]
    if d < depth:
      for r in range(width):
        heapq.heappush(heap, (-values[node] * acc[d, r], d + 1, order, node, r))
        order += 1

  push_children(0)
  while len(parents) < budget and heap:
    neg_value, d, _, parent, r = heapq.heappop(heap)
    parents.append(parent)
    depths.append(d)
    ranks.append(r)
    values.append(-neg_value)
    push_children(len(parents) - 1)
  return StaticTree(tuple(parents), tuple(depths), tuple(ranks))


def expected_tau(acceptance: np.ndarray, parents, depths, ranks) -> float:
  """1 + sum over non-root nodes of the product of acceptance[depth - 1, rank] along the root path
  (node lists in the ``StaticTree`` layout: parents precede children)."""
  acc = np.asarray(acceptance, np.float64)
  value = [1.0]
  for i in range(1, len(parents)):
    value.append(value[parents[i]] * acc[depths[i] - 1, ranks[i]])
  return float(sum(value))

"""Whether two greedy generations of the same prompts agree: identical, or parted at a float32 near-tie.

Two programs that compute the same logits with other shapes (a batch of 1 or 16, a verify forward of N
tree nodes or a one-token step) round them differently in the last bits, so where the target's two best
tokens are nearly tied the argmax can flip and the sequences continue from different prefixes. The rule:
two greedy sequences of one prompt agree when they are identical, or when, at their first differing token
k, the reference's logits for the two tokens there differ by at most ``TIE_ULPS`` float32 ulps of that
row's largest |logit| ("parted at a tie"; nothing after k is compared). Any other difference, a sequence
ending where the other goes on included, is a failure ("parted elsewhere"). The reference's logits at k
come from one forward of the target over prompt + reference[:k] (``last_logits``). docs/verification.md
has the measurements behind ``TIE_ULPS``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import qwen3

TIE_ULPS = 64
PAD_MULTIPLE = 64      # reference forwards are padded to a multiple of this length (one compile per multiple)


@dataclasses.dataclass(frozen=True)
class Parting:
  """Where sequence ``sequence`` first differs from its reference: new token ``token``; ``reference_id`` /
  ``other_id`` the two ids there (-1: that sequence ended); ``gap`` the reference's |logit difference|
  between them and ``ulps`` the gap in float32 ulps of the row's largest |logit| (None when one ended);
  ``tie``: ``ulps`` within the comparison's tolerance."""
  sequence: int
  token: int
  reference_id: int
  other_id: int
  gap: float | None
  ulps: float | None
  tie: bool

  def as_dict(self) -> dict:
    return {"prompt": self.sequence, "token": self.token, "top2_gap": self.gap, "ulps": self.ulps,
            "reference_id": self.reference_id, "other_id": self.other_id}


@dataclasses.dataclass(frozen=True)
class Agreement:
  """The comparison of ``count`` sequences with their references: the ``partings`` of those not identical."""
  count: int
  partings: tuple[Parting, ...] = ()
  tie_ulps: int = TIE_ULPS

  @property
  def ties(self) -> list[Parting]:
    return [p for p in self.partings if p.tie]

  @property
  def elsewhere(self) -> list[Parting]:
    return [p for p in self.partings if not p.tie]

  @property
  def identical(self) -> int:
    return self.count - len(self.partings)

  @property
  def agree(self) -> bool:
    """True when no sequence parted elsewhere than at a tie."""
    return not self.elsewhere

  def label(self) -> str:
    return label(self.agree, len(self.ties))

  def as_dict(self) -> dict:
    """The JSON form: ``equals_ar`` (nothing parted elsewhere), the counts, ``ar_ties`` and ``parted_elsewhere``
    (lists of {prompt, token, top2_gap, ulps, reference_id, other_id}), ``tie_ulps``."""
    ties = self.ties
    return {"equals_ar": self.agree, "label": self.label(), "sequences": self.count, "identical": self.identical,
            "ar_ties": [p.as_dict() for p in ties], "parted_elsewhere": [p.as_dict() for p in self.elsewhere],
            "max_tie_gap": max((p.gap for p in ties), default=None), "tie_ulps": self.tie_ulps}


def label(agree: bool, ties: int) -> str:
  """'yes', 'yes (1 tie)', 'yes (2 ties)' or 'no' (the tables' ``== AR`` column)."""
  if not agree:
    return "no"
  return "yes" if ties == 0 else f"yes ({ties} tie{'s' if ties > 1 else ''})"


def parting_text(p: dict) -> str:
  """Where a parting (``Parting.as_dict()``, optionally with the run's "batch") happened, and its gap."""
  where = f"prompt {p['prompt']}, new token {p['token']}" + (f" (batch {p['batch']})" if "batch" in p else "")
  return where + ("" if p["top2_gap"] is None else f": logit gap {p['top2_gap']:.2g} = {p['ulps']:.0f} float32 ulps")


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
  """Index of the first token where two sequences differ (one ending counts), None when identical."""
  for i, (a, b) in enumerate(zip(reference, other)):
    if a != b:
      return i
  return None if len(reference) == len(other) else min(len(reference), len(other))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _last_row_logits(params, tokens, length, *, cfg: Qwen3Config):
  target = qwen3.bind(cfg, params)
  width = tokens.shape[1]
  positions = jnp.arange(width, dtype=jnp.int32)[None]
  h, _, _ = target.hidden(tokens, positions, qwen3.causal_mask(1, width), rows=(length - 1)[None, None])
  return target.logits(h)[0, 0]


def last_logits(cfg: Qwen3Config, params: dict, tokens: Sequence[int]) -> np.ndarray:
  """float32 logits [V] after ``tokens`` (prompt + generated so far): one causal forward of the target,
  right-padded to a multiple of ``PAD_MULTIPLE`` rows (padding sits after the row read and is not seen)."""
  tokens = [int(t) for t in tokens]
  width = -(-len(tokens) // PAD_MULTIPLE) * PAD_MULTIPLE
  padded = np.zeros((1, width), np.int32)
  padded[0, :len(tokens)] = tokens
  return np.asarray(_last_row_logits(params, jnp.asarray(padded), jnp.int32(len(tokens)), cfg=cfg), np.float32)


def row_ulp(logits: np.ndarray) -> np.ndarray:
  """The rule's unit: the float32 ulp of each row's largest |logit| (logits [..., V] -> [...])."""
  return np.spacing(np.max(np.abs(np.asarray(logits, np.float32)), -1))


def tie_gap(logits: np.ndarray, a: int, b: int) -> tuple[float, float]:
  """(|logits[a] - logits[b]|, the same in ``row_ulp`` units) for one row of logits [V]."""
  logits = np.asarray(logits, np.float32)
  gap = abs(float(logits[a]) - float(logits[b]))
  return gap, gap / float(row_ulp(logits))


def compare(cfg: Qwen3Config, params: dict, prompts: Sequence[Sequence[int]], reference: Sequence[Sequence[int]],
            other: Sequence[Sequence[int]], *, tie_ulps: int = TIE_ULPS) -> Agreement:
  """Compare ``other[i]`` with ``reference[i]`` (greedy new tokens of ``prompts[i]``) by the module's rule;
  ``params`` are the target's (the reference's logits at each first difference come from them)."""
  if not len(prompts) == len(reference) == len(other):
    raise ValueError(f"{len(prompts)} prompts, {len(reference)} references and {len(other)} sequences to compare")
  partings = []
  for i, (prompt, ref, out) in enumerate(zip(prompts, reference, other)):
    k = first_difference(ref, out)
    if k is None:
      continue
    ref_id = int(ref[k]) if k < len(ref) else -1
    other_id = int(out[k]) if k < len(out) else -1
    gap = ulps = None
    if ref_id >= 0 and other_id >= 0:
      gap, ulps = tie_gap(last_logits(cfg, params, list(prompt) + list(ref[:k])), ref_id, other_id)
    partings.append(Parting(i, k, ref_id, other_id, gap, ulps, ulps is not None and ulps <= tie_ulps))
  return Agreement(len(reference), tuple(partings), tie_ulps)

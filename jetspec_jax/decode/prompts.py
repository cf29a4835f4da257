"""Host-side prompt batching: lists of ids -> a right-padded batch."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jetspec_jax.errors import JetSpecError


def batch_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, pad_id: int = 0,
                  width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Token-id lists -> (tokens [B, T] right-padded int32, lengths [B] int32); T = the longest prompt,
  or ``width`` when given (which must hold it)."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise JetSpecError("every prompt needs at least one token")
  bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab_size]
  if bad:
    raise JetSpecError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab_size})")
  lengths = np.array([len(p) for p in prompts], np.int32)
  if width is not None and width < lengths.max():
    raise JetSpecError(f"a prompt of {lengths.max()} tokens does not fit the batch width {width}")
  tokens = np.full((len(prompts), int(lengths.max()) if width is None else width), pad_id, np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths

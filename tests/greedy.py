"""The tests' greedy-equality check: two programs' greedy tokens agree by ``decode.agreement``'s rule
(identical, or parted at a float32 near-tie of the reference's logits)."""
from jetspec_jax.decode.agreement import Agreement, compare, parting_text


def assert_agree(cfg, params, prompts, reference, other) -> Agreement:
  """Assert ``other`` (lists of new tokens, one per prompt) agrees with ``reference``; returns the comparison."""
  result = compare(cfg, params, prompts, reference, other)
  assert len(reference) == len(other) and result.agree, "greedy outputs differ beyond a near-tie: " + "; ".join(
      parting_text(p.as_dict()) + f" ({p.reference_id} vs {p.other_id})" for p in result.elsewhere)
  return result

"""Training objective of the draft head: random anchors, a many-block training forward, KD loss.

One training row (tokens [L], target taps [L, F], final-normed target states [L, H],
loss_mask [L]: 1 on response tokens) yields A blocks. A row may pack several conversations
(segment_ids [L]: 1, 2, ... per conversation, 0 on padding; positions [L]: restarting at 0 in each
conversation); everything below stays inside the anchor's conversation. The block of anchor p is
the inference block [tokens[p], mask x (bs-1)] at positions q..q+bs-1 (q = positions[p]); it sees
the fused context rows of its conversation before p (row r at RoPE position positions[r]), its own
slots causally (all of them for a bidirectional head) and no other block, so its states equal
``DraftHead.draft_hidden`` after exactly the q context rows of its conversation.

Slot k (1..bs-1) of anchor p is trained towards the target's distribution at position p+k-1
(the distribution of token p+k), or towards the token tokens[p+k] itself with ``loss="ce"``.

Memory: the attention never forms the dense (A*bs) x (L + A*bs) mask; it scores the A*bs
queries against the L context keys (mask by comparison with the anchor) and against the bs
keys of their own block, then takes one softmax over both key sets. The loss runs the head's
blocks and their vocabulary-sized logits one chunk of anchors at a time, under
``jax.checkpoint``, so the step's memory grows with the chunk, not with the number of anchors;
the context keys/values (anchor-independent) are computed once per step.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jetspec_jax.config import Qwen3Config
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3

LOSSES = ("kl", "ce")


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int,
                   segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Up to ``num_anchors`` distinct random anchors per sequence, uniformly among the allowed ones.

  Position p of a sequence of padded length L is allowed when its block's first draft target
  is a response token of the same conversation: p + 1 < L, loss_mask[p + 1] != 0 (padding must
  carry loss_mask 0) and segment_ids[p + 1] == segment_ids[p] (when given). The anchor itself may
  be the last prompt token, as at inference right after prefill. Later block slots past the
  response are masked by the loss, not here.

  loss_mask [B, L] (any dtype, nonzero = response), segment_ids [B, L] or None (one conversation
  per row) -> anchors [B, num_anchors] int32,
  anchor_valid [B, num_anchors] bool. Per sequence the valid anchors come first, sorted
  ascending and distinct; when fewer than num_anchors positions are allowed, the remaining
  entries are invalid and hold position 0 (in range, so their blocks compute harmlessly).
  """
  batch, length = loss_mask.shape
  next_ok = loss_mask[:, 1:] != 0
  if segment_ids is not None:
    next_ok &= segment_ids[:, 1:] == segment_ids[:, :-1]
  allowed = jnp.zeros((batch, length), bool).at[:, :-1].set(next_ok)
  scores = jnp.where(allowed, jax.random.uniform(key, (batch, length)), -1.0)
  top_scores, top_pos = jax.lax.top_k(scores, min(num_anchors, length))
  # Valid picks sort first by position; invalid ones after them (keys offset by L).
  order = jnp.sort(jnp.where(top_scores >= 0, top_pos, length + top_pos), axis=1)
  pad = num_anchors - order.shape[1]
  order = jnp.pad(order, ((0, 0), (0, pad)), constant_values=length)
  valid = order < length
  return jnp.where(valid, order, 0).astype(jnp.int32), valid


def anchored_block_attention(q: jax.Array, k_block: jax.Array, v_block: jax.Array, k_ctx: jax.Array,
                             v_ctx: jax.Array, ctx_visible: jax.Array, slot_visible: jax.Array) -> jax.Array:
  """Attention of A blocks of bs slots over shared context keys and their own block's keys.

  q        [B, A*bs, Hq, Dh]   block queries, block a's slot j at row a*bs + j
  k_block  [B, Hkv, A*bs, Dh]  block keys/values, same row order
  v_block  [B, Hkv, A*bs, Dh]
  k_ctx    [B, Hkv, L, Dh]     context keys/values, one per context row
  v_ctx    [B, Hkv, L, Dh]
  ctx_visible  [B, A, L] bool  block a may see context row l (l < anchor)
  slot_visible [bs, bs] bool   slot j may see slot i of its own block; the diagonal must be True
  returns  [B, A*bs, Hq, Dh]   in q.dtype; scores and softmax in float32; Hq = Hkv * group.

  Context scores are [B, Hkv, G, A, bs, L] and block scores [B, Hkv, G, A, bs, bs]; the
  softmax runs over their concatenation (L + bs keys per query), never over L + A*bs.
  """
  batch, rows, num_heads, head_dim = q.shape
  num_kv, num_blocks = k_ctx.shape[1], ctx_visible.shape[1]
  bs = rows // num_blocks
  qg = q.reshape(batch, num_blocks, bs, num_kv, num_heads // num_kv, head_dim)
  kb = k_block.reshape(batch, num_kv, num_blocks, bs, head_dim)
  vb = v_block.reshape(batch, num_kv, num_blocks, bs, head_dim)
  scale = head_dim ** -0.5
  s_ctx = jnp.einsum("bajkgd,bkld->bkgajl", qg, k_ctx, preferred_element_type=jnp.float32) * scale
  s_blk = jnp.einsum("bajkgd,bkaid->bkgaji", qg, kb, preferred_element_type=jnp.float32) * scale
  s_ctx = jnp.where(ctx_visible[:, None, None, :, None, :], s_ctx, -jnp.inf)
  s_blk = jnp.where(slot_visible, s_blk, -jnp.inf)
  probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1).astype(v_ctx.dtype)
  p_ctx, p_blk = probs[..., :k_ctx.shape[2]], probs[..., k_ctx.shape[2]:]
  out = (jnp.einsum("bkgajl,bkld->bajkgd", p_ctx, v_ctx, preferred_element_type=jnp.float32)
         + jnp.einsum("bkgaji,bkaid->bajkgd", p_blk, vb, preferred_element_type=jnp.float32))
  return out.reshape(batch, rows, num_heads, head_dim).astype(q.dtype)


def _segments_and_positions(tokens, segment_ids, positions):
  """Defaults for unpacked rows: one conversation per row, positions 0..L-1."""
  batch, length = tokens.shape
  if segment_ids is None:
    segment_ids = jnp.ones((batch, length), jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  return segment_ids.astype(jnp.int32), positions.astype(jnp.int32)


def head_block_hidden(head_params, head_cfg: draft_head.DraftConfig, target_params, target_cfg: Qwen3Config,
                      features: jax.Array, tokens: jax.Array, anchors: jax.Array, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None) -> jax.Array:
  """Final-normed head states [B, A, bs, H] of the blocks of every anchor, in one forward.

  features [B, L, F] (concatenated target taps of every row), tokens [B, L] int,
  anchors [B, A] int in 0..L-1, segment_ids / positions [B, L] (packed rows; None = one
  conversation per row at positions 0..L-1). Block a of sequence b is [tokens[b, p], mask x (bs-1)]
  at positions q..q+bs-1 (p = anchors[b, a], q = positions[b, p]); it attends to the context rows
  r < p with segment_ids[b, r] == segment_ids[b, p] and to its own slots under
  ``draft_head.block_mask``. Invariant: out[b, a] equals ``DraftHead.draft_hidden`` for a context
  of exactly those rows and anchor token tokens[b, p].
  """
  segment_ids, positions = _segments_and_positions(tokens, segment_ids, positions)
  head = draft_head.bind(head_cfg, head_params)
  context = head.context_kv(features, positions)
  return blocks_hidden(head, qwen3.bind(target_cfg, target_params), context, tokens, anchors, segment_ids, positions)


def blocks_hidden(head: draft_head.DraftHead, target: qwen3.Qwen3, context, tokens: jax.Array, anchors: jax.Array,
                  segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
  """``head_block_hidden`` given every head layer's context keys/values [(k, v)], k, v [B, Hkv, L, Dh]
  (``DraftHead.context_kv``: anchor-independent, so the loss computes them once for all its chunks)."""
  cfg = head.cfg
  batch, length = tokens.shape
  num_anchors, bs = anchors.shape[1], cfg.block_size
  anchors = anchors.astype(jnp.int32)
  anchor_segment = jnp.take_along_axis(segment_ids, anchors, axis=1)                 # [B, A]
  ctx_visible = ((jnp.arange(length, dtype=jnp.int32)[None, None, :] < anchors[:, :, None])
                 & (segment_ids[:, None, :] == anchor_segment[:, :, None]))           # [B, A, L]
  slot_visible = draft_head.block_mask(cfg, 1)[0]                                     # [bs, bs]
  anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1).astype(jnp.int32)
  masks = jnp.full((batch, num_anchors, bs - 1), cfg.mask_token_id, jnp.int32)
  block_tokens = jnp.concatenate([anchor_tokens[..., None], masks], axis=-1).reshape(batch, num_anchors * bs)
  anchor_positions = jnp.take_along_axis(positions, anchors, axis=1)
  block_positions = (anchor_positions[..., None] + jnp.arange(bs, dtype=jnp.int32)).reshape(batch, num_anchors * bs)
  x = target.embed_tokens(block_tokens).astype(head.fc[...].dtype)

  def attend_with(k_ctx, v_ctx):
    return lambda q, k, v: (anchored_block_attention(q, k, v, k_ctx, v_ctx, ctx_visible, slot_visible), None)

  x, _ = head.blocks(x, block_positions, [attend_with(k, v) for k, v in context])
  return x.reshape(batch, num_anchors, bs, x.shape[-1])


def _slot_sums(target: qwen3.Qwen3, target_hidden, tokens, loss_mask, segment_ids, hidden,
               anchors, anchor_valid, *, loss: str, temperature: float):
  """Per-slot sums over one chunk of anchors: (loss term, top-1 matches, valid count), each [bs-1].

  hidden [B, C, bs, H] block states, anchors / anchor_valid [B, C]; the other arrays are whole
  sequences. Slot k's teacher row is p+k-1 and its target token p+k (indices clipped into
  range; out-of-range slots and slots in another conversation than the anchor's are invalid and
  contribute nothing).
  """
  batch, chunk, bs = hidden.shape[:3]
  length = tokens.shape[1]
  target_pos = anchors[..., None] + jnp.arange(1, bs, dtype=jnp.int32)                # p+k  [B, C, bs-1]
  clipped = jnp.minimum(target_pos, length - 1).reshape(batch, -1)
  gather = lambda a: jnp.take_along_axis(a, clipped, axis=1).reshape(batch, chunk, bs - 1)
  anchor_segment = jnp.take_along_axis(segment_ids, anchors, axis=1)[..., None]       # [B, C, 1]
  valid = (anchor_valid[..., None] & (target_pos < length) & (gather(loss_mask) != 0)
           & (gather(segment_ids) == anchor_segment))
  teacher_h = jnp.take_along_axis(target_hidden, (clipped - 1)[..., None], axis=1)
  teacher = jax.lax.stop_gradient(target.logits(teacher_h))
  teacher = teacher.reshape(batch, chunk, bs - 1, -1)
  student = target.logits(hidden[:, :, 1:])              # [B, C, bs-1, V]
  if loss == "kl":
    log_t = jax.nn.log_softmax(teacher / temperature, axis=-1)
    log_s = jax.nn.log_softmax(student / temperature, axis=-1)
    term = temperature ** 2 * jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)
  else:
    log_s = jax.nn.log_softmax(student, axis=-1)
    term = -jnp.take_along_axis(log_s, gather(tokens)[..., None].astype(jnp.int32), axis=-1)[..., 0]
  match = jnp.argmax(student, axis=-1) == jnp.argmax(teacher, axis=-1)
  per_slot = lambda a: jnp.sum(a, axis=(0, 1))
  return (per_slot(jnp.where(valid, term, 0.0)), per_slot(valid & match).astype(jnp.float32),
          per_slot(valid).astype(jnp.float32))


def draft_loss(head_params, head_cfg: draft_head.DraftConfig, target_params, target_cfg: Qwen3Config,
               features: jax.Array, target_hidden: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
               anchors: jax.Array, anchor_valid: jax.Array, *, segment_ids: jax.Array | None = None,
               positions: jax.Array | None = None, loss: str = "kl", temperature: float = 1.0,
               gamma: float | None = None, chunk_size: int = 8) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The head's training loss over all anchors of a batch, and metrics.

  features [B, L, F] target taps; target_hidden [B, L, H] final-normed target states;
  tokens [B, L]; loss_mask [B, L] (nonzero = response token); anchors / anchor_valid [B, A]
  (``sample_anchors``); segment_ids / positions [B, L] for packed rows (None: one conversation
  per row, positions 0..L-1). Slot k (1..bs-1) of anchor p is a valid position when the anchor is
  valid, p+k < L, loss_mask[p+k] != 0 and p+k is in the anchor's conversation. A packed row
  therefore gives exactly the sums of its conversations in separate rows. Per valid position:
    loss="kl": T^2 * KL(softmax(teacher/T) || softmax(student/T)), teacher = target logits at
               row p+k-1 (no gradient), student = logits of the block state at slot k;
    loss="ce": -log softmax(student)[tokens[p+k]] (``temperature`` does not apply).
  The loss is the mean over valid positions, weighted by exp(-(k-1)/gamma) when ``gamma`` is
  given (sum of w*term / sum of w), uniform otherwise; 0 when no position is valid.

  The head's blocks and the logits (both sides) are computed ``chunk_size`` anchors at a time (A
  is padded with invalid anchors to a multiple), each chunk under ``jax.checkpoint`` so the
  backward pass recomputes them instead of storing them.

  Returns (loss, metrics): metrics["loss"] the loss; metrics["kl"] or metrics["ce"] the uniform
  mean of the term; metrics["top1_acc"] [bs-1] per-slot share of valid positions whose student
  argmax equals the teacher argmax; metrics["num_valid"] the number of valid positions.
  """
  if loss not in LOSSES:
    raise JetSpecError(f"unknown draft loss {loss!r}; choose one of {', '.join(LOSSES)}")
  if temperature <= 0:
    raise JetSpecError(f"temperature={temperature} must be positive")
  if gamma is not None and gamma <= 0:
    raise JetSpecError(f"gamma={gamma} must be positive (gamma=None weights every slot equally)")
  if chunk_size < 1:
    raise JetSpecError(f"chunk_size={chunk_size} must be at least 1")
  segment_ids, positions = _segments_and_positions(tokens, segment_ids, positions)
  head, target = draft_head.bind(head_cfg, head_params), qwen3.bind(target_cfg, target_params)
  context = head.context_kv(features, positions)
  (batch, num_anchors), bs = anchors.shape, head_cfg.block_size
  chunk = min(chunk_size, num_anchors)
  num_chunks = math.ceil(num_anchors / chunk)
  pad = num_chunks * chunk - num_anchors

  def by_chunk(a):
    """[B, A, ...] -> [num_chunks, B, chunk, ...], padded with zeros (= invalid anchors at 0)."""
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape(batch, num_chunks, chunk, *a.shape[2:]), 1, 0)

  @jax.checkpoint
  def chunk_sums(xs):
    chunk_anchors, chunk_valid = xs
    hidden = blocks_hidden(head, target, context, tokens, chunk_anchors, segment_ids, positions)
    return _slot_sums(target, target_hidden, tokens, loss_mask, segment_ids, hidden,
                      chunk_anchors, chunk_valid, loss=loss, temperature=temperature)

  sums = jax.lax.map(chunk_sums, (by_chunk(anchors.astype(jnp.int32)), by_chunk(anchor_valid)))
  term, matches, counts = (jnp.sum(s, axis=0) for s in sums)                        # each [bs-1]
  slots = jnp.arange(bs - 1, dtype=jnp.float32)
  weights = jnp.ones_like(slots) if gamma is None else jnp.exp(-slots / gamma)
  safe_div = lambda num, den: jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
  value = safe_div(jnp.sum(weights * term), jnp.sum(weights * counts))
  metrics = {"loss": value, loss: safe_div(jnp.sum(term), jnp.sum(counts)),
             "top1_acc": safe_div(matches, counts), "num_valid": jnp.sum(counts)}
  return value, metrics

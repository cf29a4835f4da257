"""Draft-head training objective: anchors, the many-block training forward and the KD loss."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.config import Qwen3Config
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.layers import rms_norm, rope, swiglu
from jetspec_jax.train import objective

TARGET = Qwen3Config(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=1e4)
B, L, BS = 2, 24, 5
HEAD = draft_head.DraftConfig.for_target(TARGET, num_layers=2, block_size=BS, intermediate_size=36,
                                         target_layer_ids=(0,))


@functools.cache
def head_params():
  """Head weights scaled up (and norms perturbed) so states and logits are not trivially small."""
  params = draft_head.init_head(HEAD, jax.random.key(3))
  return {k: v * 10 if v.ndim > 1 else v + 0.1 * jax.random.normal(jax.random.key(len(k)), v.shape)
          for k, v in params.items()}


def make_head(causal=True):
  """(cfg, params): the same weights serve the causal and the bidirectional head."""
  return dataclasses.replace(HEAD, causal=causal), head_params()


@functools.cache
def target_params():
  p = qwen3.init_target(TARGET, jax.random.key(4))
  return {k: v * 10 if v.ndim > 1 else v for k, v in p.items()}


# Jitted once per module so tests with the same shapes and options share compilations.
block_hidden = jax.jit(objective.head_block_hidden, static_argnums=(1, 3))
draft_loss = jax.jit(objective.draft_loss, static_argnums=(1, 3),
                     static_argnames=("loss", "temperature", "gamma", "chunk_size"))


def loss_mask():
  """Sequence 0: prompt 0..5, response 6..21, padding 22..23. Sequence 1: prompt 0..9, response
  10..14, a masked turn 15..16, response 17..23 (runs to the end)."""
  m = np.zeros((B, L), np.int32)
  m[0, 6:22] = 1
  m[1, 10:15] = 1
  m[1, 17:] = 1
  return m


def batch_data(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, TARGET.vocab_size - 1, size=(B, L)).astype(np.int32)
  features = rng.normal(size=(B, L, len(HEAD.target_layer_ids) * TARGET.hidden_size)).astype(np.float32)
  target_hidden = rng.normal(size=(B, L, TARGET.hidden_size)).astype(np.float32)
  return tokens, features, target_hidden


def allowed_anchors(mask):
  """The documented rule, independently: p+1 < L and mask[p+1] != 0."""
  return [{p for p in range(mask.shape[1] - 1) if mask[b, p + 1]} for b in range(mask.shape[0])]


# ---- (e) anchors ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_anchors", [6, 30])
def test_anchors_distinct_sorted_and_allowed(num_anchors):
  mask = loss_mask()
  mask[1] = 0
  mask[1, 20:23] = 1                                   # only 3 allowed anchors: 19, 20, 21
  allowed = allowed_anchors(mask)
  sample = jax.jit(objective.sample_anchors, static_argnums=2)
  seen = [set(), set()]
  for seed in range(40):
    anchors, valid = map(np.asarray, sample(jax.random.key(seed), jnp.asarray(mask), num_anchors))
    assert anchors.shape == valid.shape == (B, num_anchors) and anchors.dtype == np.int32
    for b in range(B):
      n = min(num_anchors, len(allowed[b]))
      assert valid[b].tolist() == [True] * n + [False] * (num_anchors - n)
      picked = anchors[b, :n]
      assert np.all(np.diff(picked) > 0), "valid anchors must be distinct and sorted ascending"
      assert set(picked.tolist()) <= allowed[b]
      assert np.all(anchors[b, n:] == 0)
      seen[b] |= set(picked.tolist())
  assert seen == allowed, "every allowed position is drawn with some key"


# ---- (a) training attention vs a dense mask ---------------------------------------------------------
def dense_visibility(anchors, causal):
  """[B, A*bs, L + A*bs]: query (a, j) sees context rows < anchor a and its own block's slots."""
  num = anchors.shape[1]
  vis = np.zeros((B, num * BS, L + num * BS), bool)
  for b in range(B):
    for a in range(num):
      for j in range(BS):
        row = a * BS + j
        vis[b, row, :anchors[b, a]] = True
        vis[b, row, L + a * BS: L + a * BS + (j + 1 if causal else BS)] = True
  return vis


@functools.partial(jax.jit, static_argnums=1)
def dense_head_hidden(hp, cfg, tp, features, tokens, anchors, visible):
  """The head over the packed sequence [L context rows, A blocks] under a dense visibility mask
  [B, A*bs, L + A*bs], with k/v projected from concat[ctx, h] as the architecture states it."""
  num = anchors.shape[1]
  head = draft_head.bind(cfg, hp)
  ctx = head.fuse(features).value()
  block_tokens = jnp.concatenate([jnp.take_along_axis(tokens, anchors, 1)[..., None],
                                  jnp.full((B, num, BS - 1), cfg.mask_token_id)], -1).reshape(B, -1)
  blk_pos = (anchors[..., None] + jnp.arange(BS)).reshape(B, -1)
  kv_pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(L), (B, L)), blk_pos], axis=1)
  x = tp["embed"][block_tokens]
  group = cfg.num_attention_heads // cfg.num_key_value_heads
  for i, layer in enumerate(head.layers):
    pre = f"layers.{i}."
    h = rms_norm(x, hp[pre + "input_norm.weight"], cfg.rms_norm_eps)
    proj = lambda rows, name: jnp.einsum("bth,hnd->btnd", rows, hp[pre + f"attn.{name}_proj"])
    normed = lambda y, name: rms_norm(y, hp[pre + f"attn.{name}_norm.weight"], cfg.rms_norm_eps)
    q = rope(normed(proj(h, "q"), "q"), blk_pos, cfg.rope_theta)
    hk = jnp.concatenate([ctx, h], axis=1)
    k = rope(normed(proj(hk, "k"), "k"), kv_pos, cfg.rope_theta).transpose(0, 2, 1, 3)
    v = proj(hk, "v").transpose(0, 2, 1, 3)
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)         # [B, Hq, L + A*bs, Dh]
    s = jnp.einsum("btnd,bnsd->bnts", q, k) / np.sqrt(cfg.head_dim)
    w = jax.nn.softmax(jnp.where(visible[:, None], s, -jnp.inf), axis=-1)
    attn = jnp.einsum("bnts,bnsd->btnd", w, v)
    x = x + jnp.einsum("btnd,ndh->bth", attn, hp[pre + "attn.o_proj"])
    h = rms_norm(x, hp[pre + "post_attn_norm.weight"], cfg.rms_norm_eps)
    x = x + swiglu(h, hp[pre + "mlp.gate_up"][:, 0], hp[pre + "mlp.gate_up"][:, 1], hp[pre + "mlp.down"])
  return rms_norm(x, hp["final_norm.weight"], cfg.rms_norm_eps).reshape(B, num, BS, -1)


@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_equals_dense_mask(causal):
  cfg, hp = make_head(causal)
  tp = target_params()
  tokens, features, _ = batch_data()
  anchors = np.array([[5, 11, 17, 20, 0], [2, 9, 14, 21, 23]], np.int32)   # incl. p=0 and p=L-1
  got = block_hidden(hp, cfg, tp, TARGET, features, tokens, anchors)
  assert got.shape == (B, 5, BS, TARGET.hidden_size)
  ref = dense_head_hidden(hp, cfg, tp, features, tokens, anchors, dense_visibility(anchors, causal))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


# ---- (b) training forward vs the inference forward ---------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_block_hidden_equals_inference_draft_hidden(causal):
  cfg, hp = make_head(causal)
  tp = target_params()
  tokens, features, _ = batch_data(1)
  anchors, valid = map(np.asarray, objective.sample_anchors(jax.random.key(7), jnp.asarray(loss_mask()), 5))
  assert valid.all()
  got = np.asarray(block_hidden(hp, cfg, tp, TARGET, features, tokens, anchors))
  append = jax.jit(lambda hp, cache, feats, start: draft_head.bind(cfg, hp).append_context(cache, feats, start))
  infer = jax.jit(lambda hp, tp, cache, ctx_len, anchor: draft_head.bind(cfg, hp).draft_hidden(
      qwen3.bind(TARGET, tp), cache, ctx_len, anchor))
  rows = np.arange(L)[None, :, None]
  for a in range(anchors.shape[1]):
    p = anchors[:, a]
    # Rows >= p are replaced by unrelated noise: the inference context is exactly rows 0..p-1.
    poisoned = np.where(rows < p[:, None, None], features, np.random.default_rng(a).normal(size=features.shape))
    cache = append(hp, draft_head.init_context_cache(cfg, B, L + BS, jnp.float32),
                   jnp.asarray(poisoned, jnp.float32), jnp.zeros(B, jnp.int32))
    ref, _ = infer(hp, tp, cache, jnp.asarray(p), jnp.asarray(tokens[np.arange(B), p]))
    for b in np.flatnonzero(valid[:, a]):
      np.testing.assert_allclose(got[b, a], np.asarray(ref[b]), rtol=1e-5, atol=1e-5)


# ---- (c) the loss vs float64 NumPy -------------------------------------------------------------------
# Hand-picked anchors: slots past a response end, inside a masked turn, past L, invalid anchors.
ANCHORS = np.array([[5, 12, 19, 21, 0], [9, 13, 15, 20, 22]], np.int32)
ANCHOR_VALID = np.array([[True, True, True, True, False], [False, True, True, True, True]])


def reference_loss(hidden, target_hidden, tokens, mask, loss, temperature, gamma):
  """Float64 loop over (anchor, slot): returns loss, uniform mean term, per-slot accuracy, count."""
  w_lm = np.asarray(target_params()["lm_head"], np.float64)
  log_softmax = lambda z: z - z.max() - np.log(np.sum(np.exp(z - z.max())))
  num = den = term_sum = 0.0
  match, count = np.zeros(BS - 1), np.zeros(BS - 1)
  for b in range(B):
    for a in range(ANCHORS.shape[1]):
      p = ANCHORS[b, a]
      for k in range(1, BS):
        if not (ANCHOR_VALID[b, a] and p + k < L and mask[b, p + k]):
          continue
        teacher = target_hidden[b, p + k - 1].astype(np.float64) @ w_lm
        student = hidden[b, a, k].astype(np.float64) @ w_lm
        if loss == "kl":
          lt, ls = log_softmax(teacher / temperature), log_softmax(student / temperature)
          term = temperature ** 2 * np.sum(np.exp(lt) * (lt - ls))
        else:
          term = -log_softmax(student)[tokens[b, p + k]]
        w = 1.0 if gamma is None else np.exp(-(k - 1) / gamma)
        num, den, term_sum = num + w * term, den + w, term_sum + term
        match[k - 1] += np.argmax(student) == np.argmax(teacher)
        count[k - 1] += 1
  return num / den, term_sum / count.sum(), match / np.maximum(count, 1), count.sum()


@pytest.mark.parametrize("loss,temperature,gamma", [("kl", 2.0, None), ("kl", 0.7, 3.0), ("ce", 1.0, 2.0)])
def test_loss_equals_float64_reference(loss, temperature, gamma):
  cfg, hp = make_head()
  tp = target_params()
  tokens, features, target_hidden = batch_data(2)
  mask = loss_mask()
  args = tuple(map(jnp.asarray, (features, target_hidden, tokens, mask, ANCHORS, ANCHOR_VALID)))
  value, metrics = draft_loss(hp, cfg, tp, TARGET, *args, loss=loss, temperature=temperature, gamma=gamma,
                              chunk_size=2)
  hidden = np.asarray(block_hidden(hp, cfg, tp, TARGET, args[0], args[2], args[4]))
  ref_loss, ref_term, ref_acc, ref_count = reference_loss(hidden, target_hidden, tokens, mask, loss,
                                                          temperature, gamma)
  assert ref_count == 19 and ref_loss > 0.1
  np.testing.assert_allclose(float(value), ref_loss, rtol=2e-5)
  np.testing.assert_allclose(float(metrics["loss"]), ref_loss, rtol=2e-5)
  np.testing.assert_allclose(float(metrics[loss]), ref_term, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(metrics["top1_acc"]), ref_acc, atol=1e-6)
  assert float(metrics["num_valid"]) == ref_count


def test_no_valid_position_gives_zero_loss():
  cfg, hp = make_head()
  tokens, features, target_hidden = batch_data()
  value, metrics = draft_loss(hp, cfg, target_params(), TARGET, features, target_hidden, tokens, loss_mask(),
                              ANCHORS, np.zeros_like(ANCHOR_VALID), loss="kl", temperature=2.0, gamma=None,
                              chunk_size=2)
  assert float(value) == 0.0 and float(metrics["num_valid"]) == 0.0
  np.testing.assert_array_equal(np.asarray(metrics["top1_acc"]), 0.0)


# ---- (d) gradients, chunking ----------------------------------------------------------------------
def test_chunked_loss_and_gradients_equal_unchunked():
  cfg, hp = make_head()
  tp = target_params()
  tokens, features, target_hidden = batch_data(3)
  args = tuple(map(jnp.asarray, (features, target_hidden, tokens, loss_mask(), ANCHORS, ANCHOR_VALID)))

  def run(chunk_size):
    fn = lambda p: objective.draft_loss(p, cfg, tp, TARGET, *args, temperature=2.0, gamma=7.0,
                                        chunk_size=chunk_size)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(hp)

  (v1, m1), g1 = run(5)
  (v2, m2), g2 = run(2)
  np.testing.assert_allclose(float(v2), float(v1), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(m2["top1_acc"]), np.asarray(m1["top1_acc"]))
  for name in hp:
    assert np.all(np.isfinite(np.asarray(g1[name]))), name
    np.testing.assert_allclose(np.asarray(g2[name]), np.asarray(g1[name]), rtol=1e-4,
                               atol=1e-6 * np.abs(np.asarray(g1[name])).max())
  assert all(np.abs(np.asarray(g1[name])).max() > 0 for name in hp)


def test_bad_options_are_rejected():
  cfg, hp = make_head()
  tokens, features, target_hidden = batch_data()
  run = functools.partial(objective.draft_loss, hp, cfg, target_params(), TARGET, features, target_hidden,
                          tokens, loss_mask(), ANCHORS, ANCHOR_VALID)
  with pytest.raises(JetSpecError, match="unknown draft loss"):
    run(loss="reverse_kl")
  with pytest.raises(JetSpecError, match="gamma"):
    run(gamma=0.0)
  with pytest.raises(JetSpecError, match="temperature"):
    run(temperature=0.0)


# ---- (f) packed rows -------------------------------------------------------------------------------
def test_packed_row_gives_the_sums_of_its_conversations_in_separate_rows():
  """Two conversations packed in one row (segment mask in the target, positions restarting, blocks
  kept inside their conversation) give the same target states, head states and loss as the same
  conversations in two padded rows, with the same anchors."""
  from jetspec_jax.train.trainer import target_states
  cfg, hp = make_head()
  tp = target_params()
  rng = np.random.default_rng(11)
  len_a, len_b = 10, 12
  conv = [rng.integers(0, TARGET.vocab_size - 1, size=n).astype(np.int32) for n in (len_a, len_b)]
  separate = np.zeros((2, L), np.int32)
  separate[0, :len_a], separate[1, :len_b] = conv
  sep_mask = np.zeros((2, L), np.int32)
  sep_mask[0, 4:len_a], sep_mask[1, 5:len_b] = 1, 1
  sep_seg = (np.arange(L)[None] < np.array([[len_a], [len_b]])).astype(np.int32)
  sep_pos = np.broadcast_to(np.arange(L, dtype=np.int32), (2, L))
  packed = np.zeros((1, L), np.int32)
  packed[0, :len_a + len_b] = np.concatenate(conv)
  pk_mask = np.concatenate([sep_mask[0, :len_a], sep_mask[1, :len_b], np.zeros(L - len_a - len_b, np.int32)])[None]
  pk_seg = np.repeat([1, 2, 0], [len_a, len_b, L - len_a - len_b])[None].astype(np.int32)
  pk_pos = np.concatenate([np.arange(len_a), np.arange(len_b), np.zeros(L - len_a - len_b)])[None].astype(np.int32)

  states = jax.jit(target_states, static_argnums=(1, 5))
  sep_hidden, sep_feats = states(tp, TARGET, separate, sep_seg, sep_pos, cfg.target_layer_ids)
  pk_hidden, pk_feats = states(tp, TARGET, packed, pk_seg, pk_pos, cfg.target_layer_ids)
  for pk, sep in ((pk_hidden, sep_hidden), (pk_feats, sep_feats)):
    np.testing.assert_allclose(np.asarray(pk[0, :len_a]), np.asarray(sep[0, :len_a]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pk[0, len_a:len_a + len_b]), np.asarray(sep[1, :len_b]),
                               rtol=1e-5, atol=1e-5)

  # Anchor 6 of A has slots reaching into B (packed) or into padding (separate): both invalid.
  sep_anchors, sep_valid = np.array([[3, 6], [4, 9]], np.int32), np.ones((2, 2), bool)
  pk_anchors, pk_valid = np.array([[3, 6, len_a + 4, len_a + 9]], np.int32), np.ones((1, 4), bool)
  run = lambda *a, seg, pos: draft_loss(hp, cfg, tp, TARGET, *a, segment_ids=seg, positions=pos, loss="kl",
                                        temperature=1.0, gamma=None, chunk_size=2)
  sep_value, sep_m = run(sep_feats, sep_hidden, separate, sep_mask, sep_anchors, sep_valid, seg=sep_seg, pos=sep_pos)
  pk_value, pk_m = run(pk_feats, pk_hidden, packed, pk_mask, pk_anchors, pk_valid, seg=pk_seg, pos=pk_pos)
  assert float(pk_m["num_valid"]) == float(sep_m["num_valid"]) == 3 + 4 + 4 + 2
  np.testing.assert_allclose(float(pk_value), float(sep_value), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(pk_m["top1_acc"]), np.asarray(sep_m["top1_acc"]), atol=1e-6)
  pk_states = np.asarray(block_hidden(hp, cfg, tp, TARGET, pk_feats, packed, pk_anchors, pk_seg, pk_pos))
  sep_states = np.asarray(block_hidden(hp, cfg, tp, TARGET, sep_feats, separate, sep_anchors, sep_seg, sep_pos))
  np.testing.assert_allclose(pk_states[0], sep_states.reshape(4, BS, -1), rtol=1e-5, atol=1e-5)


def test_anchors_stay_inside_their_conversation():
  """A response token that starts the next packed conversation never makes the previous token an anchor."""
  mask = np.zeros((1, L), np.int32)
  mask[0, 5:12] = 1                                       # 10, 11 belong to conversation 2
  seg = np.repeat([1, 2], [10, L - 10])[None].astype(np.int32)
  sample = jax.jit(objective.sample_anchors, static_argnums=2)
  picked = set()
  for seed in range(20):
    anchors, valid = map(np.asarray, sample(jax.random.key(seed), jnp.asarray(mask), 6, jnp.asarray(seg)))
    picked |= set(anchors[0][valid[0]].tolist())
  assert picked == {4, 5, 6, 7, 8, 10}                    # 9 -> 10 crosses the boundary

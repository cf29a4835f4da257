"""Building blocks shared by the Qwen3 target and the draft head, as Flax NNX modules: RMSNorm,
the attention block (projections, per-head q/k norms, RoPE), the SwiGLU MLP and the decoder layer.

Layouts: projections are [in, heads, head_dim] / [heads, head_dim, out] so heads shard cleanly.
A layer does not own its attention pattern: the caller passes ``attend(q, k, v) -> (out, kv)``
(``cached_attention`` for a KV cache, or the training objective's own), and gets back ``kv``.
"""
from __future__ import annotations

import functools
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jetspec_jax import pages
from jetspec_jax.attention import attention, paged_attention
from jetspec_jax.models.params import param

# attend(q [B,T,Hq,Dh], k, v [B,Hkv,T,Dh]) -> (out [B,T,Hq,Dh], whatever the caller keeps, e.g. a cache layer)
Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]


@flax.struct.dataclass
class NormedRows:
  """Rows x [..., H] under an RMSNorm with ``weight`` [H] whose per-row float32 ``scale`` [...] =
  rsqrt(mean(x^2) + eps) is computed but not yet applied. ``project`` applies the scale to a matmul's output
  instead of its input: (x * weight) @ W * scale, the normed rows' product up to rounding, which XLA:GPU
  computes as ONE kernel for the norm (x * weight and the scale) and the scale in the matmul's epilogue instead
  of two kernels before it (docs/gpu.md). ``value()``: the normed rows themselves (``rms_norm``)."""
  x: jax.Array
  weight: jax.Array
  scale: jax.Array

  def project(self, spec: str, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, self.value(), w)`` with the scale applied to the product (``spec``'s output keeps the
    rows' leading axes first)."""
    y = jnp.einsum(spec, self.x * self.weight, w, preferred_element_type=jnp.float32)
    scale = self.scale.reshape(self.scale.shape + (1,) * (y.ndim - self.scale.ndim))
    return (y * scale).astype(jnp.result_type(self.x, self.weight, w))

  def value(self) -> jax.Array:
    """The normed rows: float32 x * scale cast back, times the weight (as transformers)."""
    return self.weight * (self.x.astype(jnp.float32) * self.scale[..., None]).astype(self.x.dtype)


def normed_rows(x: jax.Array, weight: jax.Array, eps: float) -> NormedRows:
  """x [..., H] and its RMSNorm's ``weight`` [H] as ``NormedRows`` (the scale computed in float32)."""
  xf = x.astype(jnp.float32)
  return NormedRows(x, weight, jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32 then cast back (as transformers)."""
  return normed_rows(x, weight, eps).value()


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotate-half RoPE. x [B, T, H, Dh], positions [B, T] int -> same shape and dtype."""
  head_dim = x.shape[-1]
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)   # [B, T, Dh/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  half = head_dim // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotated * sin


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
  """down(silu(x @ gate) * (x @ up)); gate/up [H, I], down [I, H]."""
  return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def write_rows(cache: jax.Array, rows: jax.Array, start: jax.Array, table: jax.Array | None = None) -> jax.Array:
  """Write ``rows`` [B, Hkv, T, Dh] at per-sequence offsets start [B] into ``cache``: contiguous [B, Hkv, S, Dh],
  or with a page ``table`` [B, T'] a page pool [G, Pg, Hkv, R, Dh] (``jetspec_jax.pages``)."""
  if table is not None:
    return pages.write(cache, rows, table, start.astype(jnp.int32))
  def one(c, r, s):
    return jax.lax.dynamic_update_slice(c, r.astype(c.dtype), (0, s, 0))
  return jax.vmap(one)(cache, rows, start.astype(jnp.int32))


def attend_cache(q, k_cache, v_cache, start, block_mask, impl, mesh, length: int | None = None,
                 table: jax.Array | None = None, sequences=lambda x: x) -> jax.Array:
  """``attention`` of q over the caches' first ``length`` rows (None: all), contiguous [B', Hkv, S, Dh] or (``table``
  [B', T']) page pools read through the table (``paged_attention``); ``sequences`` maps the caches' (or the
  table's) B' rows to q's B (e.g. the prefill lanes' sequences)."""
  if table is not None:
    return paged_attention(q, k_cache, v_cache, sequences(table), start, block_mask, impl=impl, mesh=mesh,
                           length=length)
  seen = lambda c: sequences(c[:, :, :length])
  return attention(q, seen(k_cache), seen(v_cache), start, block_mask, impl=impl, mesh=mesh)


@flax.struct.dataclass
class PackedRows:
  """Where packed rows live in attention: the layers see rows [G, K + L * C] per group (G groups, e.g. one per
  data shard). The first K are the group's chosen decode rows, laid out for attention as [B, N] (B = G *
  slots_per_group sequences of N rows): packed row (g, k) is row ``node[g, k]`` of sequence g *
  slots_per_group + ``slot[g, k]`` (slot == slots_per_group: padding, dropped). Then L prefill lanes of C =
  ``lane_rows`` consecutive prompt rows each: lane (g, l) continues sequence ``lane_slot[g, l]`` (slots_per_group:
  an idle lane) at cache row ``lane_start[g, l]``, causally; one sequence may hold several lanes (consecutive
  chunks of its prompt). Sequence b's N decode rows are written in place at cache rows write_start[b] + n (one
  contiguous write per sequence; rows of unchosen nodes hold zeros), a lane's rows at its own rows; nothing
  else of the cache is touched. Every write precedes every read of the layer's cache (XLA then updates the
  loop's cache buffers in place instead of copying them). ``key_len`` (None: all): attention reads only the
  cache's first key_len rows (the caller guarantees no row sees past them). ``dense``: the decode rows are
  every sequence's N rows in order (slot = k // N, node = k % N), so the [B, N] layout is a reshape; rows
  the caller did not choose then carry values instead of zeros (they must be ignored, as always)."""
  slot: jax.Array                 # [G, K] int32
  node: jax.Array                 # [G, K] int32
  lane_slot: jax.Array            # [G, L] int32
  lane_start: jax.Array           # [G, L] int32
  write_start: jax.Array          # [B] int32: cache row of each sequence's decode row 0 (>= its committed rows)
  slots_per_group: int = flax.struct.field(pytree_node=False)
  nodes: int = flax.struct.field(pytree_node=False)
  lane_rows: int = flax.struct.field(pytree_node=False)
  key_len: int | None = flax.struct.field(pytree_node=False, default=None)
  dense: bool = flax.struct.field(pytree_node=False, default=False)

  def scatter(self, x: jax.Array) -> jax.Array:
    """Decode rows [G, K, ...] -> [B, N, ...] (zeros where no packed row lands)."""
    if self.dense:
      return x.reshape((-1, self.nodes) + x.shape[2:])
    def one(xg, slot, node):
      out = jnp.zeros((self.slots_per_group, self.nodes) + xg.shape[1:], xg.dtype)
      return out.at[slot, node].set(xg, mode="drop")
    y = jax.vmap(one)(x, self.slot, self.node)
    return y.reshape((-1,) + y.shape[2:])

  def gather(self, y: jax.Array) -> jax.Array:
    """[B, N, ...] -> decode rows [G, K, ...] (padding rows read row 0 of the group's last slot)."""
    if self.dense:
      return y.reshape((self.slot.shape[0], -1) + y.shape[2:])
    y = self.by_group(y)
    slot = jnp.minimum(self.slot, self.slots_per_group - 1)
    return jax.vmap(lambda yg, s, n: yg[s, n])(y, slot, self.node)

  def by_group(self, x: jax.Array) -> jax.Array:
    return x.reshape((self.slot.shape[0], self.slots_per_group) + x.shape[1:])

  @property
  def num_lanes(self) -> int:
    """Lanes per group L (0: a round without prompt rows)."""
    return self.lane_slot.shape[1]

  def lane_sequences(self, x: jax.Array) -> jax.Array:
    """Per-sequence values [B, ...] -> the lanes' [G * L, ...] (an idle lane reads the group's last one)."""
    lane = jnp.minimum(self.lane_slot, self.slots_per_group - 1)
    out = jax.vmap(lambda xg, i: xg[i])(self.by_group(x), lane)
    return out.reshape((-1,) + out.shape[2:])

  def set_lane_sequences(self, x: jax.Array, values: jax.Array, keep: jax.Array | None = None) -> jax.Array:
    """Write the lanes' [G * L, ...] into per-sequence x [B, ...]: idle lanes, and lanes where ``keep`` [G * L]
    is False, write nothing (at most one written lane per sequence)."""
    lane = self.lane_slot if keep is None else jnp.where(keep.reshape(self.lane_slot.shape), self.lane_slot,
                                                         self.slots_per_group)
    vals = values.reshape(lane.shape + values.shape[1:])
    out = jax.vmap(lambda xg, i, v: xg.at[i].set(v, mode="drop"))(self.by_group(x), lane, vals)
    return out.reshape(x.shape)

  def sum_lane_sequences(self, values: jax.Array) -> jax.Array:
    """The lanes' [G * L] values summed per sequence -> [B] (0 for a sequence without lanes)."""
    vals = values.reshape(self.lane_slot.shape)
    out = jax.vmap(lambda i, v: jnp.zeros((self.slots_per_group,), v.dtype).at[i].add(v, mode="drop"))(
        self.lane_slot, vals)
    return out.reshape(-1)

  def split(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Packed [G, K + L * C, ...] -> (decode rows [G, K, ...], lane rows [G * L, C, ...])."""
    k = self.slot.shape[1]
    lanes = x[:, k:]
    return x[:, :k], lanes.reshape((-1, self.lane_rows) + x.shape[2:])

  def lane_cache_rows(self) -> tuple[jax.Array, jax.Array]:
    """(sequence within the group [G, L * C], cache row [G, L * C]) of each lane row, in packed order."""
    groups, lanes = self.lane_slot.shape
    rows = self.lane_start[..., None] + jnp.arange(self.lane_rows, dtype=jnp.int32)
    seq = jnp.broadcast_to(self.lane_slot[..., None], rows.shape)
    return seq.reshape(groups, -1), rows.reshape(groups, -1)

  def put_rows(self, cache: jax.Array, rows: jax.Array, seq: jax.Array, at: jax.Array,
               table: jax.Array | None = None) -> jax.Array:
    """Write rows [G, R, Hkv, Dh] into ``cache`` [B, Hkv, S, Dh] (or a page pool, ``table``) in place: row r of
    group g at cache row at[g, r] of the group's sequence seq[g, r] (seq == slots_per_group: dropped)."""
    if table is not None:
      return pages.scatter(cache, rows, table, seq, at)
    def one(cg, rg, sg, ag):
      return cg.at[sg, :, ag].set(rg.astype(cg.dtype), mode="drop")
    return jax.vmap(one)(self.by_group(cache), rows, seq, at).reshape(cache.shape)


def _attend_packed(packed: PackedRows, kv, start, block_mask, q, k, v, impl, mesh, table):
  """``cached_attention`` for packed rows: the decode rows' keys and values written at ``packed.write_start``, the
  lanes' at their own rows, then the decode rows attend from ``start`` in the [B, N] layout and each lane over
  its sequence's cache rows (read, never copied back; with a ``table``, read page by page by the kernels)."""
  heads_last = lambda x: x.transpose(0, 2, 1, 3)                      # [G, Hkv, K, Dh] <-> [G, K, Hkv, Dh]
  q_d, q_l = packed.split(q)
  groups, k_rows = packed.slot.shape
  decode_rows = lambda x: heads_last(packed.scatter(heads_last(x)[:, :k_rows]))      # [B, Hkv, N, Dh]
  k_cache = write_rows(kv[0], decode_rows(k), packed.write_start, table)
  v_cache = write_rows(kv[1], decode_rows(v), packed.write_start, table)
  if packed.num_lanes:
    lane_kv = lambda x: heads_last(x)[:, k_rows:]                      # [G, L * C, Hkv, Dh]
    seq, at = packed.lane_cache_rows()
    k_cache = packed.put_rows(k_cache, lane_kv(k), seq, at, table)
    v_cache = packed.put_rows(v_cache, lane_kv(v), seq, at, table)
  seen = functools.partial(attend_cache, k_cache=k_cache, v_cache=v_cache, impl=impl, mesh=mesh,
                           length=packed.key_len, table=table)
  out = packed.gather(seen(packed.scatter(q_d), start=start, block_mask=block_mask))
  if packed.num_lanes:
    rows = packed.lane_rows
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((rows, rows), bool)), (q_l.shape[0], rows, rows))
    lane_out = seen(q_l, start=packed.lane_start.reshape(-1), block_mask=causal, sequences=packed.lane_sequences)
    out = jnp.concatenate([out, lane_out.reshape((groups, -1) + lane_out.shape[2:])], axis=1)
  return out, (k_cache, v_cache)


def cached_attention(kv: tuple[jax.Array, jax.Array] | None, start: jax.Array | None, block_mask: jax.Array, *,
                     impl: str = "xla", mesh=None, packed: PackedRows | None = None,
                     table: jax.Array | None = None) -> Attend:
  """``attend`` for T new rows over one layer's cache ``kv`` = (k, v) [B, Hkv, S, Dh]: their keys are
  written at rows start[b] + t, and they see rows < start[b] plus the new rows ``block_mask`` [B, T, T]
  allows (``jetspec_jax.attention``). It returns the updated (k, v). With ``kv`` None (training, no
  cache) the rows see only each other and nothing is kept. ``packed``: the rows arrive packed
  (``PackedRows``; block_mask [B, N, N] for the decode rows) and the result is packed again. ``table`` [B, T']:
  ``kv`` are page pools [G, Pg, Hkv, R, Dh] (``jetspec_jax.pages``): rows are written through the table and
  attention reads each sequence's pages through it (``paged_attention``)."""
  def attend(q, k, v):
    if kv is None:
      return attention(q, k, v, jnp.zeros((q.shape[0],), jnp.int32), block_mask, impl=impl, mesh=mesh), None
    if packed is not None:
      return _attend_packed(packed, kv, start, block_mask, q, k, v, impl, mesh, table)
    k_cache, v_cache = write_rows(kv[0], k, start, table), write_rows(kv[1], v, start, table)
    return attend_cache(q, k_cache, v_cache, start, block_mask, impl, mesh, table=table), (k_cache, v_cache)
  return attend


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis with a learned ``weight`` [n]."""

  def __init__(self, size: int, eps: float, *, dtype):
    self.weight = param(None, (size,), ("norm",), dtype, init="ones")
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)

  def rows(self, x: jax.Array) -> NormedRows:
    """x normed lazily, for projections (``NormedRows``)."""
    return normed_rows(x, self.weight[...], self.eps)


class MLP(nnx.Module):
  """SwiGLU MLP: ``gate_up`` [H, 2, I] (gate and up stacked on axis 1: one matmul, and a model-axis shard of I
  holds both halves of its columns), ``down`` [I, H]."""

  def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
    # Drawn as gate then up, each [H, I], and stacked: a seed gives the same model as when they were two weights.
    gate, up = (param(rngs, (hidden, intermediate), ("embed", "mlp"), dtype).get_value() for _ in range(2))
    self.gate_up = nnx.Param(jnp.stack([gate, up], axis=1), logical_axes=("embed", None, "mlp"))
    self.down = param(rngs, (intermediate, hidden), ("mlp", "embed"), dtype)

  def __call__(self, h: NormedRows, mesh=None) -> jax.Array:
    """h: normed rows [..., H] -> [..., H]."""
    gate_up = h.project("...h,hki->...ki", self.gate_up[...])
    return (jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]) @ self.down[...]


class Attention(nnx.Module):
  """q/k/v/o projections with per-head RMSNorm on q and k and rotate-half RoPE."""

  def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, eps: float, theta: float,
               dtype, rngs: nnx.Rngs):
    self.q_proj = param(rngs, (hidden, num_heads, head_dim), ("embed", "q_heads", "head_dim"), dtype)
    self.k_proj = param(rngs, (hidden, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), dtype)
    self.v_proj = param(rngs, (hidden, num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), dtype)
    self.o_proj = param(rngs, (num_heads, head_dim, hidden), ("q_heads", "head_dim", "embed"), dtype)
    self.q_norm = RMSNorm(head_dim, eps, dtype=dtype)
    self.k_norm = RMSNorm(head_dim, eps, dtype=dtype)
    self.theta = theta

  def queries(self, h: NormedRows, positions: jax.Array) -> jax.Array:
    """h: normed rows [B, T, H], positions [B, T] -> q [B, T, Hq, Dh]."""
    return rope(self.q_norm(h.project("bth,hnd->btnd", self.q_proj[...])), positions, self.theta)

  def keys_values(self, h: NormedRows, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """h: normed rows [B, T, H], positions [B, T] -> k, v [B, Hkv, T, Dh] (k normed and rotated)."""
    k = rope(self.k_norm(h.project("bth,hnd->btnd", self.k_proj[...])), positions, self.theta)
    v = h.project("bth,hnd->btnd", self.v_proj[...])
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

  def __call__(self, h: NormedRows, positions: jax.Array, attend: Attend):
    """o_proj(attend(q, k, v)) over normed rows h [B, T, H]; returns ([B, T, H], what ``attend`` kept)."""
    k, v = self.keys_values(h, positions)
    out, kept = attend(self.queries(h, positions), k, v)
    return jnp.einsum("btnd,ndh->bth", out, self.o_proj[...]), kept


class DecoderLayer(nnx.Module):
  """One pre-norm Qwen3 decoder layer: x + attn(input_norm(x)), then + mlp(post_attn_norm(x)), each norm handed
  on as ``NormedRows``. ``mlp`` is an ``MLP`` or a ``moe.MoE``."""

  def __init__(self, attn: Attention, mlp: nnx.Module, hidden: int, eps: float, *, dtype):
    self.input_norm = RMSNorm(hidden, eps, dtype=dtype)
    self.attn = attn
    self.post_attn_norm = RMSNorm(hidden, eps, dtype=dtype)
    self.mlp = mlp

  def __call__(self, x: jax.Array, positions: jax.Array, attend: Attend, mesh=None):
    """x [B, T, H] -> ([B, T, H], what ``attend`` kept)."""
    with jax.named_scope("attention"):
      h, kept = self.attn(self.input_norm.rows(x), positions, attend)
    x = x + h
    with jax.named_scope("mlp"):
      return x + self.mlp(self.post_attn_norm.rows(x), mesh), kept

"""Tree-masked attention over a KV cache: a flash-attention style Pallas kernel (Triton backend).

Same contract as ``pallas_kernels.reference.xla_attention`` (the XLA reference):
  q          [B, T, Hq, Dh]   T new rows (tree nodes, one decode token, or a prompt chunk)
  k_cache    [B, Hkv, S, Dh]  the new rows' own keys/values already written at cache
  v_cache    [B, Hkv, S, Dh]  positions prefix_len[b] + t, t < T (so prefix_len[b] + T <= S)
  prefix_len [B] int32        committed keys 0..prefix_len[b]-1 are visible to every query
  block_mask [B, T, T] bool   query i may see new key t; the diagonal is True
  returns    [B, T, Hq, Dh]   in q.dtype; scores, softmax and accumulation in float32.

Kernel layout. The grid is (batch, kv head, row block, prefix split). A tile's rows are the GQA
group and the T query rows folded together, row r = t * group + g (query head kv_head * group + g,
node t), so a small tree still fills a tile: a decode step with group 4 is one 16-row tile. Each
program reads its share of its kv head's prefix keys once, in blocks of ``block_k``: whole blocks
with no mask at all, the prefix's partial last block under a length mask; the last split then
reads the tree's own keys (positions prefix_len + t) in blocks of ``block_t`` under the ancestor
mask; online softmax in float32 (exp2 domain). The ancestor mask
travels bit-packed: int32 words [B, T, W], bit (t % 32) of word t // 32 of row i is
block_mask[b, i, t].

Paged caches (``paged_tree_attention``; layout in ``pallas_kernels.paging``): k and v are the pools
[G x Pg, Hkv, R, Dh] with a table [B, T'] of global page ids (S = T' x R); a key block's rows are
gathered from their pages, cache position p at row p % R of page table[b, p // R], with the page ids
loaded inside the kernel; everything else is the contiguous kernel's.

Prefix splits (flash-decoding). A small tree at batch 1 has only (kv heads x row blocks)
programs, too few to pull the prefix through HBM at full bandwidth, so the prefix is cut into
``num_splits`` contiguous shares of whole key blocks, sized at run time from prefix_len[b] so that
the splits do equal work, the last one's tree keys counted (``split_blocks``). With
more than one split every program writes its unnormalised partial (acc, running max m, running sum
l) in float32, and ``splits.merge_splits`` (XLA, one fusion) merges them: out = sum_s 2^(m_s - m) acc_s /
sum_s 2^(m_s - m) l_s with m = max_s m_s. One split writes the normalised output directly.

Launch configuration (tile sizes, warps, stages, splits): from a tuning table by the problem's tile
rows: the ``tuning`` a call passes, else ``pallas_kernels.tuning.DEFAULT_TUNING``; explicit launch
parameters override the table's.

Triton's rules, which interpret mode does not enforce, are checked by ``launch_shapes``:
every tile dimension is a power of two and every dot operand dimension is >= 16.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.errors import KernelError, check_heads, check_problem
from pallas_kernels.paging import check_paged, flat_pages
from pallas_kernels.splits import merge_splits
from pallas_kernels.tuning import DEFAULT_TUNING, KernelTuning, LaunchConfig

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MIN_DOT_DIM = 16          # Triton: every dot operand dimension >= 16
MASK_BITS = 32            # ancestor-mask bits per int32 word
_LOG2E = math.log2(math.e)


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class LaunchShapes:
  """Tile sizes and grid of one kernel launch.

  block_r: rows per tile (GQA group x tree nodes, folded); block_k: prefix keys per step;
  block_t: tree keys per step; mask_words: int32 words per packed mask row, enough for every key
  of every tree block (bits past T are zero); num_splits: prefix shares (see module docstring);
  min_split_blocks: the fewest prefix key blocks a split takes, so the float32 partials stay
  small next to the keys they summarise; grid: (batch, kv heads, row blocks, splits).
  """
  block_r: int
  block_k: int
  block_t: int
  head_dim: int
  num_tree_blocks: int
  mask_words: int
  num_splits: int
  min_split_blocks: int
  grid: tuple[int, int, int, int]
  num_warps: int
  num_stages: int

  def triton_violations(self) -> list[str]:
    """Every breach of Triton's tile rules by these shapes (empty when the launch is legal)."""
    problems = []
    tiles = {"q tile": (self.block_r, self.head_dim),
             "prefix k/v tile": (self.block_k, self.head_dim),
             "tree k/v tile": (self.block_t, self.head_dim),
             "prefix scores": (self.block_r, self.block_k),
             "tree scores": (self.block_r, self.block_t)}
    for name, dims in tiles.items():   # each is a dot operand (q k^T, then p v)
      if not all(_is_pow2(d) for d in dims):
        problems.append(f"{name} {dims} has a dimension that is not a power of two")
      if min(dims) < MIN_DOT_DIM:
        problems.append(f"{name} {dims} has a dot dimension below {MIN_DOT_DIM}")
    if not _is_pow2(self.num_warps):
      problems.append(f"num_warps={self.num_warps} is not a power of two")
    return problems


def launch_shapes(batch: int, num_q: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                  cache_len: int | None = None, block_r: int = LaunchConfig.block_r,
                  block_k: int = LaunchConfig.block_k, num_splits: int | None = None,
                  target_programs: int = LaunchConfig.target_programs, min_split_keys: int | None = None,
                  num_warps: int = LaunchConfig.num_warps, num_stages: int = LaunchConfig.num_stages) -> LaunchShapes:
  """Tile sizes for a problem; raises ``KernelError`` for unsupported shapes or illegal tiles.

  ``block_r`` and ``block_k`` are upper bounds (powers of two >= 16): a tile never has more rows
  than the next power of two >= max(group * num_q, 16), and the tree step never has more keys
  than the next power of two >= max(num_q, 16).

  ``num_splits=None`` picks the prefix splits: enough for about ``target_programs`` programs (two
  waves of an H100/H200's 132 SMs), at most one per ``min_split_blocks`` key blocks of the cache
  (``cache_len``; one split when it is not given), where a split spans at least ``min_split_keys``
  keys, by default max(8 * block_r, 256) (its float32 partials then cost at most a quarter of its
  key/value bytes).
  """
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise KernelError(f"tree attention supports head_dim {SUPPORTED_HEAD_DIMS}, not {head_dim}; use --attention xla.")
  check_heads(batch, num_q, num_q_heads, num_kv_heads)
  for name, value in (("block_r", block_r), ("block_k", block_k)):
    if not _is_pow2(value) or value < MIN_DOT_DIM:
      raise KernelError(f"{name}={value} must be a power of two >= {MIN_DOT_DIM}.")
  if num_splits is not None and num_splits < 1:
    raise KernelError(f"num_splits={num_splits} must be at least 1 (or None to choose).")
  if target_programs < 1 or (min_split_keys is not None and min_split_keys < 1):
    raise KernelError(f"target_programs={target_programs} and min_split_keys={min_split_keys} must be at least 1.")
  rows = num_q_heads // num_kv_heads * num_q
  block_r = min(block_r, pl.next_power_of_2(max(rows, MIN_DOT_DIM)))
  block_t = min(block_k, pl.next_power_of_2(max(num_q, MIN_DOT_DIM)))
  num_tree_blocks = pl.cdiv(num_q, block_t)
  row_blocks = pl.cdiv(rows, block_r)
  min_split_blocks = pl.cdiv(max(8 * block_r, 256) if min_split_keys is None else min_split_keys, block_k)
  if num_splits is None:
    by_programs = max(target_programs // (batch * num_kv_heads * row_blocks), 1)
    by_length = max(pl.cdiv(cache_len or 0, block_k) // min_split_blocks, 1)
    num_splits = min(by_programs, by_length)
  shapes = LaunchShapes(
      block_r=block_r, block_k=block_k, block_t=block_t, head_dim=head_dim,
      num_tree_blocks=num_tree_blocks, mask_words=pl.cdiv(num_tree_blocks * block_t, MASK_BITS),
      num_splits=num_splits, min_split_blocks=min_split_blocks,
      grid=(batch, num_kv_heads, row_blocks, num_splits), num_warps=num_warps, num_stages=num_stages)
  if problems := shapes.triton_violations():
    raise KernelError(f"illegal Triton launch for this problem: {'; '.join(problems)}.")
  return shapes


def pack_block_mask(block_mask: jax.Array, mask_words: int) -> jax.Array:
  """Bit-pack block_mask [B, T, T] bool into int32 words [B, T, mask_words] (mask_words*32 >= T).

  Bit (t % 32) of word t // 32 of row i is block_mask[b, i, t]; bits for t >= T are zero.
  """
  batch, num_q, num_keys = block_mask.shape
  bits = jnp.pad(block_mask, ((0, 0), (0, 0), (0, mask_words * MASK_BITS - num_keys)))
  bits = bits.reshape(batch, num_q, mask_words, MASK_BITS).astype(jnp.uint32)
  words = jnp.sum(bits << jnp.arange(MASK_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  return lax.bitcast_convert_type(words, jnp.int32)


def _online_softmax_step(carry, scores, visible, v):
  """Folds one key block into (acc [R, Dh] f32, m [R] f32, l [R] f32); scores are log2-scaled;
  visible: [R, K] or [1, K] bool, or None when every key is visible.

  A row with no visible key yet keeps m = -inf; its probabilities are exactly zero.
  """
  acc, m_prev, l_prev = carry
  if visible is not None:                    # None: every key of the block is visible
    scores = jnp.where(visible, scores, -jnp.inf)
  m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
  m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
  alpha = jnp.exp2(m_prev - m_safe)
  p = jnp.exp2(scores - m_safe[:, None])
  l_next = l_prev * alpha + jnp.sum(p, axis=1)
  acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
  return acc, m_next, l_next


def split_blocks(split, prefix_blocks, shapes: LaunchShapes):
  """Prefix key blocks [first, last) that ``split`` reads, for a row with ``prefix_blocks`` blocks of
  ``block_k`` keys (ints or traced int32 scalars). The shares are contiguous and cover every block;
  they are sized so that every split does about the same work, the last one counting the tree keys
  it also reads, and none takes fewer than ``min_split_blocks`` blocks (later splits may be empty)."""
  tree_work = pl.cdiv(shapes.num_tree_blocks * shapes.block_t, shapes.block_k)
  share = jnp.maximum(pl.cdiv(prefix_blocks + tree_work, shapes.num_splits), shapes.min_split_blocks)
  first = jnp.minimum(split * share, prefix_blocks)
  return first, jnp.minimum(first + share, prefix_blocks)


def _kernel(prefix_ref, q_ref, k_ref, v_ref, words_ref, *refs, shapes: LaunchShapes,
            group: int, num_q: int, qk_scale: float, page_rows: int | None):
  """One (batch, kv head, row block, split) tile.

  Refs: prefix_ref [B] int32; q_ref [T, Hq, Dh] (this batch row); k_ref, v_ref [S, Dh] (this batch
  row and kv head), or with ``page_rows`` R the pools [P, R, Dh] (this kv head) and then table_ref [T']
  int32 (this batch row's global page ids: position p is row p % R of page table_ref[p // R]);
  words_ref [T, W] int32 (this batch row's packed mask). Then the outputs: o_ref [T, Hq, Dh] with
  one split, else the partials acc_ref [T, Hq, Dh] f32, m_ref and l_ref [T, Hq] f32 (this batch row
  and split).
  """
  block_r, block_k, block_t = shapes.block_r, shapes.block_k, shapes.block_t
  table_ref, out_refs = (None, refs) if page_rows is None else (refs[0], refs[1:])
  cache_len = k_ref.shape[0] if page_rows is None else table_ref.shape[0] * page_rows
  prefix = prefix_ref[pl.program_id(0)]
  split = pl.program_id(3)
  rows = pl.program_id(2) * block_r + jnp.arange(block_r)
  node = rows // group                       # tree node of each row; >= T on padding rows
  node_in = jnp.minimum(node, num_q - 1)     # padding rows recompute the last node, never stored
  head = pl.program_id(1) * group + rows % group
  q = q_ref[node_in, head, :]                # [block_r, Dh]

  head_dim = shapes.head_dim
  carry = (jnp.zeros((block_r, head_dim), jnp.float32),
           jnp.full((block_r,), -jnp.inf, jnp.float32),
           jnp.zeros((block_r,), jnp.float32))

  def rows_at(ref, start, size):
    """``ref``'s rows at cache positions start..start+size-1: a slice, or each position's page row."""
    if page_rows is None:
      return ref.at[pl.ds(start, size), :]
    pos = start + jnp.arange(size)
    page = table_ref[jnp.minimum(pos // page_rows, table_ref.shape[0] - 1)]     # positions past T' are masked
    return ref.at[page[:, None], (pos % page_rows)[:, None], jnp.arange(head_dim)[None, :]]

  def key_block(start, size, valid):
    """Keys/values at cache positions start..start+size-1, zero where not valid (None: all valid)."""
    mask = None if valid is None else valid[:, None]
    return tuple(plgpu.load(rows_at(ref, start, size), mask=mask, other=None if valid is None else 0.0)
                 for ref in (k_ref, v_ref))

  prefix_end = jnp.minimum(prefix, cache_len)
  prefix_blocks = pl.cdiv(prefix_end, block_k)
  full_blocks = prefix_end // block_k           # blocks wholly inside the prefix: no length mask
  first_block, last_block = split_blocks(split, prefix_blocks, shapes)

  def prefix_step(masked: bool):
    def step(j, carry):
      if not masked:
        k, v = key_block(j * block_k, block_k, None)
        return _online_softmax_step(carry, plgpu.dot(q, k, trans_b=True) * qk_scale, None, v)
      valid = j * block_k + jnp.arange(block_k) < prefix_end
      k, v = key_block(j * block_k, block_k, valid)
      return _online_softmax_step(carry, plgpu.dot(q, k, trans_b=True) * qk_scale, valid[None, :], v)
    return step

  if cache_len >= block_k:                      # else no prefix block is whole (and none can be sliced)
    carry = lax.fori_loop(first_block, jnp.minimum(last_block, full_blocks), prefix_step(False), carry)
  # The partial last block of the prefix (if any, and if it is this split's): under the length mask.
  carry = lax.fori_loop(jnp.maximum(first_block, full_blocks), last_block, prefix_step(True), carry)

  def tree_step(j, carry):
    keys = j * block_t + jnp.arange(block_t)          # index t into the new rows
    valid = (keys < num_q) & (prefix + keys < cache_len)
    k, v = key_block(prefix + j * block_t, block_t, valid)
    scores = plgpu.dot(q, k, trans_b=True) * qk_scale
    words = words_ref[node_in[:, None], (keys // MASK_BITS)[None, :]]       # [block_r, block_t]
    bits = lax.shift_right_logical(words, (keys % MASK_BITS)[None, :]) & 1
    return _online_softmax_step(carry, scores, (bits != 0) & valid[None, :], v)

  # The last split also reads the tree's keys. (Integer arithmetic, not jnp.where: the Triton
  # lowering of a select between two constants yields i1, which scf.for rejects as a bound.)
  tree_blocks = (split + 1) // shapes.num_splits * shapes.num_tree_blocks
  acc, m, l = lax.fori_loop(0, tree_blocks, tree_step, carry)
  stored = node < num_q
  dims = jnp.arange(head_dim)
  at_rows = lambda ref: ref.at[node[:, None], head[:, None], dims[None, :]]
  if shapes.num_splits == 1:
    (o_ref,) = out_refs
    plgpu.store(at_rows(o_ref), (acc / l[:, None]).astype(o_ref.dtype), mask=stored[:, None])
  else:
    acc_ref, m_ref, l_ref = out_refs
    plgpu.store(at_rows(acc_ref), acc, mask=stored[:, None])
    plgpu.store(m_ref.at[node, head], m, mask=stored)
    plgpu.store(l_ref.at[node, head], l, mask=stored)


def resolve_config(rows: int, tuning: KernelTuning | None = None, **overrides) -> LaunchConfig:
  """The launch configuration of a problem with ``rows`` tile rows (group x tree nodes): the tuning
  table's (default: ``DEFAULT_TUNING``), with every override that is not None applied."""
  config = (tuning or DEFAULT_TUNING).config_for(rows)
  return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})


def tree_attention(q, k_cache, v_cache, prefix_len, block_mask, **launch):
  """Tree-masked attention with the Pallas Triton kernel over a contiguous cache (shapes in the module
  docstring; ``launch``: ``_attend``'s keywords)."""
  dims = check_problem(q, k_cache, v_cache, prefix_len, block_mask)
  return _attend(q, k_cache, v_cache, prefix_len, block_mask, dims, **launch)


def paged_tree_attention(q, k_pool, v_pool, table, prefix_len, block_mask, **launch):
  """``tree_attention`` over paged caches: k_pool, v_pool [G, Pg, Hkv, R, Dh] read through table [B, T']
  (``pallas_kernels.paging``) page row by page row inside the kernel, never gathered; ``launch``: ``_attend``'s
  keywords."""
  dims = check_paged(q, k_pool, v_pool, table, prefix_len, block_mask)
  k, v, ids = flat_pages(k_pool, v_pool, table)
  return _attend(q, k, v, prefix_len, block_mask, dims, table=ids, **launch)


def _attend(q, k, v, prefix_len, block_mask, dims, *, table=None, sm_scale: float | None = None,
            interpret: bool = False, block_r: int | None = None, block_k: int | None = None,
            num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
            tuning: KernelTuning | None = None, debug: bool = False):
  """The launch for a checked problem ``dims`` = (B, T, Hq, Dh, Hkv, S): k, v a contiguous cache, or with
  ``table`` [B, T'] (global page ids) pools [P, Hkv, R, Dh].

  The launch configuration comes from ``tuning`` (default: ``DEFAULT_TUNING``) by the
  problem's tile rows; ``block_r``, ``block_k``, ``num_splits``, ``num_warps`` and ``num_stages``
  given here override it (see ``launch_shapes``). ``interpret=True`` runs the kernel on any backend;
  ``debug=True`` prints the kernel jaxpr and, when lowered for a GPU, its Triton IR.
  """
  batch, num_q, num_q_heads, head_dim, num_kv_heads, cache_len = dims
  if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in SUPPORTED_DTYPES:
    raise KernelError(f"q, k_cache and v_cache must share one of float32/bfloat16/float16, "
                       f"got {q.dtype}, {k.dtype}, {v.dtype}.")
  rows = num_q_heads // max(num_kv_heads, 1) * num_q          # launch_shapes checks the head counts
  config = resolve_config(rows, tuning, block_r=block_r, block_k=block_k, num_splits=num_splits,
                          num_warps=num_warps, num_stages=num_stages)
  shapes = launch_shapes(batch, num_q, num_q_heads, num_kv_heads, head_dim, cache_len=cache_len - num_q,
                         **dataclasses.asdict(config))
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  return _launch(q, k, v, prefix_len, block_mask, table=table, shapes=shapes, qk_scale=scale * _LOG2E,
                 interpret=interpret, debug=debug)


@functools.partial(jax.jit, static_argnames=("shapes", "qk_scale", "interpret", "debug"))
def _launch(q, k_cache, v_cache, prefix_len, block_mask, *, table, shapes: LaunchShapes, qk_scale: float,
            interpret: bool, debug: bool):
  """The pallas_call of ``_attend`` for checked inputs and their launch shapes (``table`` None: a contiguous
  cache [B, Hkv, S, Dh], else pools [P, Hkv, R, Dh] and table [B, T'])."""
  batch, num_q, num_q_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[1]
  page_rows = None if table is None else k_cache.shape[2]
  kernel = functools.partial(_kernel, shapes=shapes, group=num_q_heads // num_kv_heads,
                             num_q=num_q, qk_scale=qk_scale, page_rows=page_rows)
  per_batch_q = pl.BlockSpec((None, num_q, num_q_heads, head_dim), lambda b, h, r, s: (b, 0, 0, 0))
  if table is None:
    per_head_kv = pl.BlockSpec((None, None, k_cache.shape[2], head_dim), lambda b, h, r, s: (b, h, 0, 0))
    paging, tables = [], ()
  else:
    per_head_kv = pl.BlockSpec((k_cache.shape[0], None, page_rows, head_dim), lambda b, h, r, s: (0, h, 0, 0))
    paging, tables = [pl.BlockSpec((None, table.shape[1]), lambda b, h, r, s: (b, 0))], (table,)
  if shapes.num_splits == 1:
    out_specs, out_shape = per_batch_q, jax.ShapeDtypeStruct(q.shape, q.dtype)
  else:
    parts = (batch, shapes.num_splits, num_q, num_q_heads)
    out_specs = (pl.BlockSpec((None, None, num_q, num_q_heads, head_dim), lambda b, h, r, s: (b, s, 0, 0, 0)),
                 *[pl.BlockSpec((None, None, num_q, num_q_heads), lambda b, h, r, s: (b, s, 0, 0))] * 2)
    out_shape = (jax.ShapeDtypeStruct(parts + (head_dim,), jnp.float32),
                 *[jax.ShapeDtypeStruct(parts, jnp.float32)] * 2)
  out = pl.pallas_call(
      kernel,
      grid=shapes.grid,
      in_specs=[pl.BlockSpec((batch,), lambda b, h, r, s: (0,)), per_batch_q, per_head_kv, per_head_kv,
                pl.BlockSpec((None, num_q, shapes.mask_words), lambda b, h, r, s: (b, 0, 0)), *paging],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=shapes.num_warps, num_stages=shapes.num_stages),
      interpret=interpret,
      debug=debug,
      name="tree_attention",
  )(prefix_len.astype(jnp.int32), q, k_cache, v_cache, pack_block_mask(block_mask, shapes.mask_words), *tables)
  return out if shapes.num_splits == 1 else merge_splits(*out, axis=1, dtype=q.dtype)

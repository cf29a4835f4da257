"""Tree-masked attention over a KV cache: a Pallas Mosaic TPU kernel.

Same contract as ``pallas_kernels.reference.xla_attention`` and the Triton kernel ``pallas_kernels.tree_attention``
(q [B, T, Hq, Dh] over k_cache / v_cache [B, Hkv, S, Dh] with the T new rows' keys at prefix_len[b] + t,
prefix_len [B], block_mask [B, T, T] -> [B, T, Hq, Dh] in q.dtype; scores, softmax and accumulation in float32).
float32 and bfloat16 inputs, head dims 64 and 128.

Rows. XLA folds the GQA group and the T query rows together before the kernel, q as [B, Hkv, rows, Dh] with
row r = t * group + g (query head kv_head * group + g, node t), padded to whole blocks of ``block_r`` rows,
so a small tree still fills the MXU (a decode step with group 4 is 4 rows, a 16-node tree 64); the output is
unfolded the same way afterwards. The ancestor mask travels bit-packed and expanded to rows, int32 words
[B, rows, W]: bit (t % 32) of word t // 32 of row r is block_mask[b, r // group, t]; padding rows are zero.

Grid (batch, kv head, row block), every axis parallel (a v5p's two TensorCores share it). A program keeps its
q block, its mask words and its float32 state (acc [block_r, Dh], running max m and sum l [block_r, 1], natural
exp) in VMEM and walks the n = cdiv(prefix_len + T, block_k) key blocks of its row, keys at aligned cache
positions j * block_k .. + block_k, double-buffered: block j + 1 is copied HBM -> VMEM by DMA while block j
is computed. prefix_len is scalar-prefetched into SMEM. Blocks wholly inside the prefix run unmasked; the rest
(the prefix's partial last block and the tree's blocks, at most cdiv(T, block_k) + 1) see position < prefix_len
or the ancestor bit of position - prefix_len, and their value rows at positions >= prefix_len + T are zeroed,
so garbage (even NaN) past the tree never reaches the output.

Contiguous caches: block j is one DMA of rows min(j * block_k, S - block_k) .. + block_k (the last block of a
cache whose length is not a multiple of block_k is shifted back in bounds; its rows before j * block_k are
masked out). Paged caches (``paged_tree_attention``; layout in ``pallas_kernels.paging``): the pools flattened
to [G x Pg, Hkv, R, Dh] and the table's global page ids, the program's row [1, T'] of them copied into SMEM as a
block (once per batch row: the grid's programs of one row share it); block j is block_k / R page DMAs, position
p from row p % R of page table[b, p // R] (past the table: its last entry, masked).

TPU tiling (``launch_shapes`` refuses the rest in one sentence): a DMA moves whole (sublane, lane) tiles, so
cache lengths, page rows, block_r and block_k are multiples of the dtype's row tile, ``ROW_TILE``
(8 rows for float32, 16 for bfloat16).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.errors import KernelError, check_heads, check_problem
from pallas_kernels.paging import check_paged, flat_pages

SUPPORTED_HEAD_DIMS = (64, 128)
ROW_TILE = {jnp.dtype(jnp.float32): 8, jnp.dtype(jnp.bfloat16): 16}   # sublanes x packing of a VMEM tile
MASK_BITS = 32                      # ancestor-mask bits per int32 word
MAX_BLOCK_R = 1024                  # rows per program at most
SCORE_ELEMENTS = 256 * 1024         # block_r x block_k float32 scores per key block (1 MiB)
BLOCK_K_RANGE = (256, 1024)         # the default block_k's bounds
TABLE_BYTES = 512 * 1024            # SMEM for a row's page table, double-buffered (a chip has 1 MiB per core)


@dataclasses.dataclass(frozen=True)
class TpuLaunch:
  """Blocks and grid of one kernel launch.

  block_r: query rows per program (group x tree nodes, folded), rows: all of them padded to whole blocks;
  block_k: cache positions per key block; mask_words: int32 words per packed mask row (W = cdiv(T, 32));
  page_rows: R of a paged cache (None: contiguous); grid: (batch, kv heads, row blocks).
  """
  block_r: int
  block_k: int
  rows: int
  head_dim: int
  mask_words: int
  page_rows: int | None
  grid: tuple[int, int, int]


def launch_shapes(batch: int, num_q: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype, cache_len: int,
                  *, page_rows: int | None = None, block_r: int | None = None,
                  block_k: int | None = None) -> TpuLaunch:
  """Blocks for a problem over a cache of ``cache_len`` positions (paged: pages of ``page_rows`` rows); raises
  ``KernelError`` in one sentence for a problem the kernel cannot take.

  ``block_r`` caps the rows per program (default ``MAX_BLOCK_R``; the rows are split into equal blocks);
  ``block_k`` sets the key block (default: the power of two <= ``SCORE_ELEMENTS`` / block_r, within ``BLOCK_K_RANGE``,
  at most the cache; paged: rounded down to whole pages). Both must be multiples of the dtype's ``ROW_TILE``. Two
  rows of a paged cache's table (S / R int32 entries each) must fit ``TABLE_BYTES`` of SMEM.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in ROW_TILE:
    raise KernelError(f"the TPU tree-attention kernel takes float32 or bfloat16, not {dtype}; use --attention xla.")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise KernelError(f"the TPU tree-attention kernel supports head_dim {SUPPORTED_HEAD_DIMS}, not {head_dim}; "
                      "use --attention xla.")
  check_heads(batch, num_q, num_q_heads, num_kv_heads)
  tile = ROW_TILE[dtype]
  if page_rows is not None and page_rows % tile:
    raise KernelError(f"pages of {page_rows} rows break TPU tiling: {dtype} pages need a multiple of {tile} rows.")
  if page_rows is not None and 2 * 4 * cache_len // page_rows > TABLE_BYTES:
    raise KernelError(f"page table rows of {cache_len // page_rows} entries do not fit the "
                      f"{TABLE_BYTES // 1024} KiB of SMEM the kernel gives two of them.")
  if page_rows is None and cache_len % tile:
    raise KernelError(f"a cache of {cache_len} positions breaks TPU tiling: {dtype} caches need a multiple of "
                      f"{tile} positions.")
  for name, value in (("block_r", block_r), ("block_k", block_k)):
    if value is not None and (value < tile or value % tile):
      raise KernelError(f"{name}={value} must be a positive multiple of {tile} for {dtype}.")
  rows = num_q_heads // num_kv_heads * num_q
  row_blocks = pl.cdiv(rows, block_r or MAX_BLOCK_R)
  block_r = pl.cdiv(pl.cdiv(rows, row_blocks), tile) * tile
  if block_k is None:
    block_k = min(max(1 << (SCORE_ELEMENTS // block_r).bit_length() - 1, BLOCK_K_RANGE[0]), BLOCK_K_RANGE[1])
    block_k = min(block_k, cache_len) if page_rows is None else max(block_k // page_rows, 1) * page_rows
  if page_rows is not None:
    if block_k % page_rows:
      raise KernelError(f"block_k={block_k} must be whole pages of {page_rows} rows.")
  elif block_k > cache_len:
    raise KernelError(f"block_k={block_k} is longer than the cache ({cache_len} positions).")
  return TpuLaunch(block_r=block_r, block_k=block_k, rows=row_blocks * block_r, head_dim=head_dim,
                   mask_words=pl.cdiv(num_q, MASK_BITS), page_rows=page_rows,
                   grid=(batch, num_kv_heads, row_blocks))


def pack_row_words(block_mask: jax.Array, group: int, rows: int, mask_words: int) -> jax.Array:
  """block_mask [B, T, T] bool -> int32 words [B, rows, mask_words]: bit (t % 32) of word t // 32 of row r is
  block_mask[b, r // group, t]; rows r >= T * group and bits t >= T are zero."""
  batch, num_q, _ = block_mask.shape
  bits = jnp.pad(block_mask, ((0, 0), (0, 0), (0, mask_words * MASK_BITS - num_q)))
  bits = bits.reshape(batch, num_q, mask_words, MASK_BITS).astype(jnp.uint32)
  words = jnp.sum(bits << jnp.arange(MASK_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  words = jnp.repeat(lax.bitcast_convert_type(words, jnp.int32), group, axis=1)
  return jnp.pad(words, ((0, 0), (0, rows - num_q * group), (0, 0)))


def _kernel(*refs, launch: TpuLaunch, num_q: int, cache_len: int, sm_scale: float, precision):
  """One (batch row, kv head, row block) program.

  Refs: scalar prefetch prefix_ref [B] int32 (SMEM); q_ref [block_r, Dh] and words_ref [block_r, W] (VMEM); when
  paged table_ref [1, T'] int32 (SMEM: this batch row's global page ids); k_hbm, v_hbm (HBM): the cache
  [B, Hkv, S, Dh] or the pools [P, Hkv, R, Dh]; o_ref [block_r, Dh]; scratch k_buf, v_buf [2, block_k, Dh],
  sems (DMA, [2, 2]: k and v by slot), acc_ref [block_r, Dh] f32, m_ref and l_ref [block_r, 1] f32.
  """
  block_k, page_rows = launch.block_k, launch.page_rows
  if page_rows is None:
    prefix_ref, q_ref, words_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, acc_ref, m_ref, l_ref = refs
  else:
    prefix_ref, q_ref, words_ref, table_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, acc_ref, m_ref, l_ref = refs
    pages = cache_len // page_rows
  batch, head = pl.program_id(0), pl.program_id(1)
  prefix = jnp.minimum(prefix_ref[batch], cache_len - num_q)
  num_keys = prefix + num_q
  num_blocks = pl.cdiv(num_keys, block_k)
  full_blocks = prefix // block_k                      # blocks wholly inside the prefix: no mask

  def start_of(j):
    """The first cache position that block j's buffer holds (a contiguous cache's last block shifted back)."""
    if page_rows is not None:
      return j * block_k
    return pl.multiple_of(jnp.minimum(j * block_k, cache_len - block_k), ROW_TILE[k_buf.dtype])

  def copies(j, slot):
    """The DMAs that bring block j's keys and values into buffer ``slot``."""
    out = []
    for kv, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
      if page_rows is None:
        out.append(pltpu.make_async_copy(hbm.at[batch, head, pl.ds(start_of(j), block_k)], buf.at[slot],
                                         sems.at[kv, slot]))
        continue
      for i in range(block_k // page_rows):
        page = table_ref[0, jnp.minimum(j * (block_k // page_rows) + i, pages - 1)]
        out.append(pltpu.make_async_copy(hbm.at[page, head], buf.at[slot, pl.ds(i * page_rows, page_rows)],
                                         sems.at[kv, slot]))
    return out

  def wait(slot):
    """Waits for both buffers of ``slot`` (one wait of the whole buffer covers all of its page copies)."""
    for kv, buf in enumerate((k_buf, v_buf)):
      pltpu.make_async_copy(buf.at[slot], buf.at[slot], sems.at[kv, slot]).wait()

  def visible(j):
    """[block_r, block_k] bool: which keys of block j each row sees, and [block_k, 1]: which value rows hold
    a key of this row at all (the rest are zeroed)."""
    shape = (launch.block_r, block_k)
    pos = start_of(j) + lax.broadcasted_iota(jnp.int32, shape, 1)
    t = pos - prefix                                   # index into the tree's keys
    word_of = lax.shift_right_arithmetic(t, 5)
    word = jnp.zeros(shape, jnp.int32)
    for w in range(launch.mask_words):
      word = jnp.where(word_of == w, words_ref[:, pl.ds(w, 1)], word)
    bit = lax.shift_right_logical(word, t & (MASK_BITS - 1)) & 1
    keys = (pos >= j * block_k) & ((pos < prefix) | ((t < num_q) & (bit != 0)))
    value_pos = start_of(j) + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
    return keys, (value_pos >= j * block_k) & (value_pos < num_keys)

  def step(j, masked: bool):
    slot = lax.rem(j, 2)

    @pl.when(j + 1 < num_blocks)
    def _():
      for copy in copies(j + 1, 1 - slot):
        copy.start()

    wait(slot)
    k, v = k_buf[slot], v_buf[slot]
    scores = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32) * sm_scale
    if masked:
      keys, values = visible(j)
      scores = jnp.where(keys, scores, -jnp.inf)
      v = jnp.where(values, v, jnp.zeros_like(v))
    m_prev = m_ref[...]
    m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)   # a row that has seen no key keeps zero weight
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(scores - m_safe)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                                  preferred_element_type=jnp.float32)
    m_ref[...] = m_next

  acc_ref[...] = jnp.zeros_like(acc_ref)
  m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
  l_ref[...] = jnp.zeros_like(l_ref)
  for copy in copies(0, 0):
    copy.start()
  lax.fori_loop(0, full_blocks, lambda j, c: step(j, False), None)
  lax.fori_loop(full_blocks, num_blocks, lambda j, c: step(j, True), None)
  l = l_ref[...]
  o_ref[...] = (acc_ref[...] / jnp.where(l > 0.0, l, 1.0)).astype(o_ref.dtype)


def tree_attention(q, k_cache, v_cache, prefix_len, block_mask, *, interpret=False, sm_scale: float | None = None,
                   block_r: int | None = None, block_k: int | None = None):
  """Tree-masked attention with the Mosaic TPU kernel over a contiguous cache (shapes in the module docstring).

  ``interpret``: True (or a ``pltpu.InterpretParams``) runs the kernel in Pallas's TPU interpreter on any
  backend; ``block_r``, ``block_k``: see ``launch_shapes``.
  """
  dims = check_problem(q, k_cache, v_cache, prefix_len, block_mask)
  return _attend(q, k_cache, v_cache, prefix_len, block_mask, dims, None, interpret=interpret, sm_scale=sm_scale,
                 block_r=block_r, block_k=block_k)


def paged_tree_attention(q, k_pool, v_pool, table, prefix_len, block_mask, *, interpret=False,
                         sm_scale: float | None = None, block_r: int | None = None, block_k: int | None = None):
  """``tree_attention`` over paged caches: k_pool, v_pool [G, Pg, Hkv, R, Dh] read through table [B, T']
  (``pallas_kernels.paging``) page by page inside the kernel, never gathered; block_k is whole pages."""
  dims = check_paged(q, k_pool, v_pool, table, prefix_len, block_mask)
  k, v, ids = flat_pages(k_pool, v_pool, table)
  return _attend(q, k, v, prefix_len, block_mask, dims, ids, interpret=interpret, sm_scale=sm_scale,
                 block_r=block_r, block_k=block_k)


def _attend(q, k, v, prefix_len, block_mask, dims, table, *, interpret, sm_scale, block_r, block_k):
  """The launch for a checked problem ``dims`` = (B, T, Hq, Dh, Hkv, S): k, v a contiguous cache, or with
  ``table`` [B, T'] (global page ids) pools [P, Hkv, R, Dh]."""
  batch, num_q, num_q_heads, head_dim, num_kv_heads, cache_len = dims
  if q.dtype != k.dtype or q.dtype != v.dtype:
    raise KernelError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}.")
  launch = launch_shapes(batch, num_q, num_q_heads, num_kv_heads, head_dim, q.dtype, cache_len,
                         page_rows=None if table is None else k.shape[2], block_r=block_r, block_k=block_k)
  if interpret is True:
    interpret = pltpu.InterpretParams()
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  return _launch(q, k, v, prefix_len, block_mask, table, launch=launch, sm_scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("launch", "sm_scale", "interpret"))
def _launch(q, k, v, prefix_len, block_mask, table, *, launch: TpuLaunch, sm_scale: float, interpret):
  """The pallas_call of ``_attend`` for checked inputs: q folded to rows before, the output unfolded after."""
  batch, num_q, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[1]
  group = num_q_heads // num_kv_heads
  cache_len = k.shape[2] if table is None else table.shape[1] * k.shape[2]
  rows = num_q * group
  folded = q.reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  folded = jnp.pad(folded.reshape(batch, num_kv_heads, rows, head_dim),
                   ((0, 0), (0, 0), (0, launch.rows - rows), (0, 0)))
  words = pack_row_words(block_mask, group, launch.rows, launch.mask_words)
  tables = () if table is None else (table[:, None],)
  table_specs = [] if table is None else [pl.BlockSpec((None, 1, table.shape[1]), lambda b, h, r, *_: (b, 0, 0),
                                                       memory_space=pltpu.SMEM)]
  row_block = pl.BlockSpec((None, None, launch.block_r, head_dim), lambda b, h, r, *_: (b, h, r, 0))
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  kernel = functools.partial(_kernel, launch=launch, num_q=num_q, cache_len=cache_len, sm_scale=sm_scale,
                             precision=precision)
  itemsize = q.dtype.itemsize
  keys = batch * num_kv_heads * launch.grid[2] * cache_len       # an upper bound: every position of the cache
  cost = pl.CostEstimate(flops=4 * keys * launch.block_r * head_dim, transcendentals=keys * launch.block_r,
                         bytes_accessed=2 * keys * head_dim * itemsize + 2 * folded.size * itemsize + 4 * words.size)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=launch.grid,
          in_specs=[row_block,
                    pl.BlockSpec((None, launch.block_r, launch.mask_words), lambda b, h, r, *_: (b, r, 0)),
                    *table_specs,
                    pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=row_block,
          scratch_shapes=[pltpu.VMEM((2, launch.block_k, head_dim), q.dtype),
                          pltpu.VMEM((2, launch.block_k, head_dim), q.dtype),
                          pltpu.SemaphoreType.DMA((2, 2)),
                          pltpu.VMEM((launch.block_r, head_dim), jnp.float32),
                          pltpu.VMEM((launch.block_r, 1), jnp.float32),
                          pltpu.VMEM((launch.block_r, 1), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(folded.shape, q.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
      cost_estimate=cost,
      interpret=interpret,
      name="tree_attention_tpu",
  )(prefix_len.astype(jnp.int32), folded, words, *tables, k, v)
  out = out[:, :, :rows].reshape(batch, num_kv_heads, num_q, group, head_dim).transpose(0, 2, 1, 3, 4)
  return out.reshape(batch, num_q, num_q_heads, head_dim)

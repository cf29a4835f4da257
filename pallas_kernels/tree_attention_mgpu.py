"""Tree-masked attention over a KV cache: a Pallas Mosaic GPU kernel for Hopper (TMA + wgmma).

Same contract as ``pallas_kernels.reference.xla_attention`` and the Triton kernel
``pallas_kernels.tree_attention`` (q [B, T, Hq, Dh] over k_cache / v_cache [B, Hkv, S, Dh] with the T new
rows' keys at prefix_len[b] + t, prefix_len [B], block_mask [B, T, T] -> [B, T, Hq, Dh] in q.dtype; scores,
softmax and accumulation in float32). Only bfloat16 and float16 are taken (wgmma multiplies 16-bit
operands); float32 inputs raise ``KernelError`` (cast them, or use the Triton or XLA path). S must be a multiple of 8
(``CACHE_ROWS_MULTIPLE``; the decode loops allocate caches so: ``jetspec_jax.attention.cache_rows``).

Tiles. One warpgroup per program owns a tile of ``BLOCK_R`` = 64 rows (wgmma's M): the GQA group
and the T query rows folded together, row r = t * group + g (query head kv_head * group + g, node
t), so a decode step with group 4 is one tile, and a 256-node tree with group 4 is 16 tiles. XLA
lays q out as [B, Hkv, rows, Dh] (rows padded to whole tiles, or to a multiple of 8 when one tile
holds them all: ``MosaicLaunch.tile_rows``) before the kernel and folds the output back afterwards; the ancestor mask travels bit-packed and expanded to tile rows, int32
words [B, W, rows]: bit (t % 32) of word t // 32 of row r is block_mask[b, r // group, t].

Keys. A row of the batch has n = prefix_len + T keys (cache positions 0..n-1), read in blocks of
``block_k`` aligned cache positions; block j is the TMA box of rows min(j * block_k, S - block_k)
.. + block_k, so the last block of a cache whose length is not a multiple of block_k is shifted
back to stay in bounds (its rows before j * block_k are masked out). Blocks wholly inside the
prefix run without any mask; the others (the prefix's partial last block and the tree's blocks,
at most cdiv(T, block_k) + 1) apply key position < prefix_len or the ancestor bit of key
position - prefix_len, read from the few mask words that the block spans. Value rows at
positions >= n in the last block are zeroed in shared memory before p @ v, so garbage (even NaN)
past the tree never reaches the output. Scores are scaled into the exp2 domain; the online softmax
keeps a row that has seen no key at m = -inf with exactly zero weight.

Paged caches (``paged_tree_attention``; layout in ``pallas_kernels.paging``): k and v are the pools
[G x Pg, Hkv, R, Dh] (R a multiple of 8) with a table [B, T'] of global page ids (S = T' x R). Block j
is cache positions j * block_k .. + block_k (never shifted: a position past T' pages reads the last
table entry's page, masked), copied as block_k / gcd(block_k, R) TMA boxes, each within one page
(position p at row p % R of page table[b, p // R], the page id loaded from GMEM in the kernel); a
slot's k and v barriers each expect that many arrivals. Everything else is the contiguous kernel's.

Pipelining. Keys and values stream through a ring of ``num_stages`` shared-memory slots, each with
its own TMA barrier for k and for v: the program issues the loads of the next ``num_stages``
blocks ahead of the block it computes (q @ k^T can start before v of the same block lands), and
refills a slot once both of its wgmmas have completed.

Prefix splits (flash-decoding). A small tree at batch 1 has only Hkv x row tiles programs, too
few to pull the cache through HBM at full bandwidth, so each row's key blocks are cut into
``num_splits`` contiguous shares sized at run time from prefix_len[b] (``split_blocks``). With
more than one split every program writes its unnormalised float32 partial (acc, running max m,
running sum l, log2 domain) and XLA merges them (``splits.merge_splits``); one split writes the
normalised output. The grid is (row tiles, splits, kv heads, batch), row tiles fastest, so the
programs that read the same keys run together and share them through L2.

Interpreter trade-off (jax 0.12.0.1). The Mosaic GPU interpreter runs this kernel (TMA with
tiled and swizzled shared memory, wgmma with both operands in shared memory, barriers, swizzled
shared-memory loads and stores) except for one construct: a wgmma whose A operand is in
registers (its wgmma reads A only from shared memory). So p @ v takes p from registers on a GPU
(``p_from_smem=False``, the default when not interpreting) and from a shared-memory copy of p
when interpreting (``p_from_smem=True``); that one call is the only code the interpreter does not
execute. ``pl.run_state`` with a preloaded accumulator is not interpreted either (its wgmma falls
through to XLA:CPU, which has no rule for it), so p @ v accumulates into a fresh accumulator that is
then added to the rescaled running sum (one more float32 tile of registers).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.errors import KernelError, check_heads, check_problem
from pallas_kernels.paging import check_paged, flat_pages
from pallas_kernels.splits import merge_splits

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_BLOCK_K = (64, 128)
BLOCK_R = 64                # rows per tile: one warpgroup, wgmma's M
MASK_BITS = 32              # ancestor-mask bits per int32 word
CACHE_ROWS_MULTIPLE = 8     # a TMA box of k/v rows starts at a multiple of 8 rows (Mosaic GPU's layout rule)
_WORD_SHIFT = 5             # log2(MASK_BITS)
NUM_SMS = 132               # H100 / H200
MAX_STAGES = 4              # k/v ring slots: 4 x 32 KiB in flight per SM covers HBM latency
MAX_SMEM_BYTES = 227 * 1024
_LOG2E = math.log2(math.e)
_SWIZZLE = 128              # bytes: a 64-element row of a 16-bit operand


@dataclasses.dataclass(frozen=True)
class MosaicLaunch:
  """Tile sizes and grid of one launch.

  block_k: keys per block (a multiple of 64); num_stages: shared-memory slots of the k/v ring;
  mask_words: int32 words per mask row (W = cdiv(T, 32)); num_splits: key shares per row (module
  docstring); min_split_blocks: the fewest key blocks a split takes, so its float32 partials stay
  small next to the keys it reads; row_tiles: tiles of BLOCK_R rows per kv head; tile_rows: the rows
  of a tile that travel through HBM (q in, output or partials out): BLOCK_R, or with a single tile
  its real rows rounded up to 8 (a decode step with group 4 moves 8 rows, not 64; the tile's other
  rows are never loaded, and rows do not mix);
  grid: (row_tiles, num_splits, kv heads, batch); page_rows: rows per page of a paged cache (0: contiguous);
  copies: TMA boxes per k or v block, each of gcd(block_k, page_rows) rows so that none crosses a page
  (1 when contiguous).
  """
  block_k: int
  num_stages: int
  head_dim: int
  mask_words: int
  num_splits: int
  min_split_blocks: int
  row_tiles: int
  tile_rows: int
  grid: tuple[int, int, int, int]
  page_rows: int = 0
  copies: int = 1

  def smem_bytes(self) -> int:
    """Shared memory of one program (16-bit operands; the float32 partial tile when split)."""
    ring = self.num_stages * 2 * self.block_k * self.head_dim * 2
    tiles = BLOCK_R * self.head_dim * 2 + BLOCK_R * self.block_k * 2 + self.mask_words * BLOCK_R * 4
    partials = (BLOCK_R * self.head_dim + 2 * BLOCK_R) * 4 if self.num_splits > 1 else 0
    return ring + tiles + partials


def launch_shapes(batch: int, num_q: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                  cache_len: int, block_k: int = 64, num_stages: int | None = None, num_splits: int | None = None,
                  target_programs: int = NUM_SMS, min_split_keys: int = 512, page_rows: int = 0) -> MosaicLaunch:
  """Tile sizes and grid for a problem (``page_rows``: of a paged cache; 0: contiguous); raises ``KernelError``
  for unsupported shapes.

  ``num_splits=None`` picks enough splits for about ``target_programs`` programs (one wave of an
  H200's 132 SMs; a program's ring fills most of an SM's shared memory), at most one per
  ``min_split_keys`` keys of the cache. ``num_stages=None`` takes the most ring slots, up to
  ``MAX_STAGES``, that fit in shared memory.
  """
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise KernelError(f"the Mosaic GPU tree attention supports head_dim {SUPPORTED_HEAD_DIMS}, not {head_dim}.")
  check_heads(batch, num_q, num_q_heads, num_kv_heads)
  if block_k not in SUPPORTED_BLOCK_K:
    raise KernelError(f"block_k={block_k} must be one of {SUPPORTED_BLOCK_K}.")
  if (num_stages is not None and num_stages < 1) or (num_splits is not None and num_splits < 1):
    raise KernelError(f"num_stages={num_stages} and num_splits={num_splits} must be at least 1.")
  if target_programs < 1 or min_split_keys < 1:
    raise KernelError(f"target_programs={target_programs} and min_split_keys={min_split_keys} must be at least 1.")
  rows = num_q_heads // num_kv_heads * num_q
  row_tiles = pl.cdiv(rows, BLOCK_R)
  min_split_blocks = pl.cdiv(min_split_keys, block_k)
  if num_splits is None:
    by_programs = max(target_programs // (batch * num_kv_heads * row_tiles), 1)
    by_length = max(pl.cdiv(cache_len, block_k) // min_split_blocks, 1)
    num_splits = min(by_programs, by_length)
  launch = MosaicLaunch(block_k=block_k, num_stages=num_stages or MAX_STAGES, head_dim=head_dim,
                        mask_words=pl.cdiv(num_q, MASK_BITS), num_splits=num_splits,
                        min_split_blocks=min_split_blocks, row_tiles=row_tiles,
                        tile_rows=min(BLOCK_R, 8 * pl.cdiv(rows, 8)), grid=(row_tiles, num_splits, num_kv_heads, batch),
                        page_rows=page_rows, copies=block_k // math.gcd(block_k, page_rows) if page_rows else 1)
  while num_stages is None and launch.num_stages > 1 and launch.smem_bytes() > MAX_SMEM_BYTES:
    launch = dataclasses.replace(launch, num_stages=launch.num_stages - 1)
  if launch.smem_bytes() > MAX_SMEM_BYTES:
    raise KernelError(f"the launch needs {launch.smem_bytes()} bytes of shared memory, more than "
                      f"{MAX_SMEM_BYTES}; lower num_stages or block_k.")
  return launch


def split_blocks(split, num_blocks, launch: MosaicLaunch):
  """Key blocks [first, last) of ``split`` for a row with ``num_blocks`` blocks (ints or traced int32
  scalars): contiguous even shares of at least ``min_split_blocks`` (later splits may be empty)."""
  share = jnp.maximum(pl.cdiv(num_blocks, launch.num_splits), launch.min_split_blocks)
  first = jnp.minimum(split * share, num_blocks)
  return first, jnp.minimum(first + share, num_blocks)


def pack_row_mask(block_mask: jax.Array, group: int, num_rows: int, mask_words: int) -> jax.Array:
  """block_mask [B, T, T] bool -> int32 words [B, mask_words, num_rows]: bit (t % 32) of word t // 32
  of tile row r is block_mask[b, r // group, t]; rows r >= T * group and bits t >= T are zero."""
  batch, num_q, _ = block_mask.shape
  bits = jnp.pad(block_mask, ((0, 0), (0, 0), (0, mask_words * MASK_BITS - num_q)))
  bits = bits.reshape(batch, num_q, mask_words, MASK_BITS).astype(jnp.uint32)
  words = jnp.sum(bits << jnp.arange(MASK_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  words = jnp.repeat(lax.bitcast_convert_type(words, jnp.int32), group, axis=1)
  words = jnp.pad(words, ((0, 0), (0, num_rows - num_q * group), (0, 0)))
  return words.transpose(0, 2, 1)


def _kernel(prefix_ref, q_ref, k_ref, v_ref, words_ref, *refs, launch: MosaicLaunch, num_q: int,
            qk_scale: float, p_from_smem: bool):
  """One (row tile, split, kv head, batch row) program.

  Refs (GMEM): prefix_ref [B] int32; q_ref [B, Hkv, R, Dh] (R = row_tiles x tile_rows);
  k_ref, v_ref [B, Hkv, S, Dh], or with ``launch.page_rows`` the pools [P, Hkv, page_rows, Dh];
  words_ref [B, W, row_tiles x BLOCK_R] int32; when paged, table_ref [B, T'] int32 (global page ids:
  position p of row b is row p % page_rows of page table_ref[b, p // page_rows]). Outputs: o_ref
  [B, Hkv, R, Dh] with one split, else acc_ref [B, Hkv, P, R, Dh] f32 and m_ref, l_ref [B, Hkv, P, R]
  f32. Then the scratch (``_scratch``).
  """
  block_k, stages, page_rows = launch.block_k, launch.num_stages, launch.page_rows
  if page_rows:
    table_ref, *refs = refs
  outs, (q_smem, k_smem, v_smem, p_smem, words_smem, part_smem, bars, k_bars, v_bars) = refs[:-9], refs[-9:]
  tile, split = lax.axis_index("tile"), lax.axis_index("split")
  head, batch = lax.axis_index("head"), lax.axis_index("batch")
  rows = pl.ds(tile * launch.tile_rows, launch.tile_rows)
  in_hbm = lambda ref: ref.at[pl.ds(0, launch.tile_rows)]   # the tile's rows that HBM holds
  cache_len = table_ref.shape[1] * page_rows if page_rows else k_ref.shape[2]
  dtype = q_ref.dtype

  plgpu.copy_gmem_to_smem(q_ref.at[batch, head, rows], in_hbm(q_smem), bars.at[0])
  plgpu.copy_gmem_to_smem(words_ref.at[batch, :, pl.ds(tile * BLOCK_R, BLOCK_R)], words_smem, bars.at[1])
  prefix = jnp.minimum(prefix_ref[batch], cache_len - num_q)
  num_keys = prefix + num_q
  first, last = split_blocks(split, pl.cdiv(num_keys, block_k), launch)
  mid = jnp.clip(prefix // block_k, first, last)     # blocks before mid lie wholly in the prefix

  def start_of(j):
    """The first cache position of block j's box (a contiguous cache's last box shifted back in bounds)."""
    return j * block_k if page_rows else jnp.minimum(j * block_k, cache_len - block_k)

  def rows_at(ref, start, size):
    """GMEM rows of cache positions start .. start + size - 1 (within one page when paged)."""
    if not page_rows:
      return ref.at[batch, head, pl.ds(start, size)]
    page = table_ref[batch, jnp.minimum(start // page_rows, table_ref.shape[1] - 1)]   # past T': masked rows
    return ref.at[page, head, pl.ds(lax.rem(start, page_rows), size)]

  def fetch(j):
    slot = lax.rem(j - first, stages)
    piece = block_k // launch.copies
    for i in range(launch.copies):                     # boxes of whole pages' rows when paged
      box = pl.ds(i * piece, piece)
      for ref, smem, bar in ((k_ref, k_smem, k_bars), (v_ref, v_smem, v_bars)):
        plgpu.copy_gmem_to_smem(rows_at(ref, start_of(j) + i * piece, piece), smem.at[slot, box], bar.at[slot])

  for i in range(stages):
    pl.when(first + i < last)(functools.partial(fetch, first + i))

  def visible_keys(j):
    """[BLOCK_R, block_k] bool: which keys of block j each row sees."""
    start = start_of(j)
    col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_R, block_k), 1, layout=plgpu.Layout.WGMMA)
    pos = start + col
    t = pos - prefix                                   # index into the tree's keys
    base_word = lax.shift_right_arithmetic(start - prefix, _WORD_SHIFT)   # floor, also below 0
    word_of_col = lax.shift_right_arithmetic(t, _WORD_SHIFT) - base_word
    word = jnp.zeros((BLOCK_R, block_k), jnp.int32)
    for i in range(block_k // MASK_BITS + 1):
      at = jnp.clip(base_word + i, 0, launch.mask_words - 1)
      row_words = plgpu.load(words_smem.at[at], layout=plgpu.Layout.WGMMA.reduce(1))
      word = jnp.where(word_of_col == i, lax.broadcast_in_dim(row_words, word.shape, [0]), word)
    bit = lax.shift_right_logical(word, t & (MASK_BITS - 1)) & 1
    return (pos >= j * block_k) & ((pos < prefix) | ((t < num_q) & (bit != 0)))

  def zero_values_past_keys(j, v_slot):
    """Zeroes the value rows at positions >= num_keys (garbage, maybe NaN) of block j's slot."""
    row = plgpu.broadcasted_iota(jnp.int32, (block_k, launch.head_dim), 0, layout=plgpu.Layout.WGMMA)
    v = v_slot[...]
    v_slot[...] = jnp.where(start_of(j) + row < num_keys, v, jnp.zeros_like(v))
    plgpu.commit_smem()

  def step(j, carry, masked: bool):
    acc, m_prev, l_prev = carry
    slot = lax.rem(j - first, stages)
    plgpu.barrier_wait(k_bars.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
      return acc_ref[...]
    scores = pl.run_scoped(qk, plgpu.ACC((BLOCK_R, block_k), jnp.float32)) * qk_scale
    if masked:
      scores = jnp.where(visible_keys(j), scores, -jnp.inf)
    m_next = jnp.maximum(m_prev, scores.max(axis=1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(scores - lax.broadcast_in_dim(m_safe, scores.shape, [0]))
    l_next = l_prev * alpha + p.sum(axis=1)
    plgpu.barrier_wait(v_bars.at[slot])
    if masked:
      pl.when(start_of(j) + block_k > num_keys)(functools.partial(zero_values_past_keys, j, v_smem.at[slot]))
    if p_from_smem:
      p_smem[...] = p.astype(dtype)
      plgpu.commit_smem()

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem if p_from_smem else p.astype(dtype), v_smem.at[slot])
      return acc_ref[...]
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pl.run_scoped(
        pv, plgpu.ACC((BLOCK_R, launch.head_dim), jnp.float32))
    pl.when(j + stages < last)(functools.partial(fetch, j + stages))
    return acc, m_next, l_next

  carry = (plgpu.layout_cast(jnp.zeros((BLOCK_R, launch.head_dim), jnp.float32), plgpu.Layout.WGMMA),
           plgpu.layout_cast(jnp.full((BLOCK_R,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1)),
           plgpu.layout_cast(jnp.zeros((BLOCK_R,), jnp.float32), plgpu.Layout.WGMMA.reduce(1)))
  plgpu.barrier_wait(bars.at[0])
  plgpu.barrier_wait(bars.at[1])
  carry = lax.fori_loop(first, mid, functools.partial(step, masked=False), carry)
  acc, m, l = lax.fori_loop(mid, last, functools.partial(step, masked=True), carry)

  if launch.num_splits == 1:
    (o_ref,) = outs
    l_safe = jnp.where(l == 0.0, 1.0, l)               # padding rows past the tree see no key
    q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(in_hbm(q_smem), o_ref.at[batch, head, rows])
  else:
    acc_ref, m_ref, l_ref = outs
    acc_smem, m_smem, l_smem = part_smem
    acc_smem[...] = acc
    m_smem[...] = m
    l_smem[...] = l
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(in_hbm(acc_smem), acc_ref.at[batch, head, split, rows])
    plgpu.copy_smem_to_gmem(in_hbm(m_smem), m_ref.at[batch, head, split, rows])
    plgpu.copy_smem_to_gmem(in_hbm(l_smem), l_ref.at[batch, head, split, rows])
  plgpu.wait_smem_to_gmem(0)


def _scratch(launch: MosaicLaunch, dtype):
  """Shared memory: q tile (reused for the output), k/v ring, p tile, mask words, float32 partials
  (only with splits), and the barriers (q and mask words; k and v per slot)."""
  operand = (plgpu.TilingTransform((8, _SWIZZLE // 2)), plgpu.SwizzleTransform(_SWIZZLE))
  ring = (launch.num_stages, launch.block_k, launch.head_dim)
  parts = None
  if launch.num_splits > 1:
    parts = (plgpu.SMEM((BLOCK_R, launch.head_dim), jnp.float32,
                        transforms=(plgpu.TilingTransform((8, _SWIZZLE // 4)), plgpu.SwizzleTransform(_SWIZZLE))),
             plgpu.SMEM((BLOCK_R,), jnp.float32), plgpu.SMEM((BLOCK_R,), jnp.float32))
  return [plgpu.SMEM((BLOCK_R, launch.head_dim), dtype, transforms=operand),
          plgpu.SMEM(ring, dtype, transforms=operand), plgpu.SMEM(ring, dtype, transforms=operand),
          plgpu.SMEM((BLOCK_R, launch.block_k), dtype, transforms=operand),
          plgpu.SMEM((launch.mask_words, BLOCK_R), jnp.int32), parts,
          plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_arrivals=launch.copies, num_barriers=launch.num_stages),
          plgpu.Barrier(num_arrivals=launch.copies, num_barriers=launch.num_stages)]


def tree_attention(q, k_cache, v_cache, prefix_len, block_mask, **launch):
  """Tree-masked attention with the Mosaic GPU kernel over a contiguous cache (shapes and design in the module
  docstring; ``launch``: ``_attend``'s keywords). S must be a multiple of ``CACHE_ROWS_MULTIPLE``."""
  dims = check_problem(q, k_cache, v_cache, prefix_len, block_mask)
  if dims[-1] % CACHE_ROWS_MULTIPLE:
    raise KernelError(f"the Mosaic GPU kernel needs a cache length that is a multiple of {CACHE_ROWS_MULTIPLE} "
                      f"(its TMA boxes start at multiples of {CACHE_ROWS_MULTIPLE} rows), got {dims[-1]}.")
  return _attend(q, k_cache, v_cache, prefix_len, block_mask, dims, **launch)


def paged_tree_attention(q, k_pool, v_pool, table, prefix_len, block_mask, **launch):
  """``tree_attention`` over paged caches: k_pool, v_pool [G, Pg, Hkv, R, Dh] read through table [B, T']
  (``pallas_kernels.paging``): each key block's rows come page by page, one TMA box per page (or per
  gcd(block_k, R) rows), from page ids the kernel loads; nothing is gathered. ``launch``: ``_attend``'s keywords."""
  dims = check_paged(q, k_pool, v_pool, table, prefix_len, block_mask)
  k, v, ids = flat_pages(k_pool, v_pool, table)
  return _attend(q, k, v, prefix_len, block_mask, dims, table=ids, **launch)


def _attend(q, k, v, prefix_len, block_mask, dims, *, table=None, sm_scale: float | None = None,
            interpret: bool | plgpu.InterpretGPUParams = False, block_k: int = 64, num_stages: int | None = None,
            num_splits: int | None = None, target_programs: int = NUM_SMS, min_split_keys: int = 512,
            p_from_smem: bool | None = None):
  """The launch for a checked problem ``dims`` = (B, T, Hq, Dh, Hkv, S): k, v a contiguous cache, or with
  ``table`` [B, T'] (global page ids) pools [P, Hkv, R, Dh].

  bfloat16 or float16 only (float32 raises ``KernelError``). ``interpret=True`` (or an
  ``InterpretGPUParams``, e.g. with race detection) runs the kernel in the Mosaic GPU interpreter on
  any backend. ``block_k``, ``num_stages``, ``num_splits``, ``target_programs`` and ``min_split_keys``
  set the launch (``launch_shapes``); ``p_from_smem`` (default: only when interpreting) stages p in
  shared memory for p @ v.
  """
  batch, num_q, num_q_heads, head_dim, num_kv_heads, cache_len = dims
  if q.dtype != k.dtype or q.dtype != v.dtype or q.dtype not in SUPPORTED_DTYPES:
    raise KernelError(f"the Mosaic GPU tree attention takes q, k_cache and v_cache all bfloat16 or all "
                      f"float16 (wgmma), got {q.dtype}, {k.dtype}, {v.dtype}.")
  launch = launch_shapes(batch, num_q, num_q_heads, num_kv_heads, head_dim, cache_len=cache_len,
                         block_k=block_k, num_stages=num_stages, num_splits=num_splits,
                         target_programs=target_programs, min_split_keys=min_split_keys,
                         page_rows=0 if table is None else k.shape[2])
  if interpret is True:
    if not hasattr(plgpu, "InterpretGPUParams"):
      raise KernelError(f"the Mosaic GPU kernel runs off a GPU only in the Mosaic GPU interpreter of jax >= 0.12, "
                        f"not jax {jax.__version__}.")
    interpret = plgpu.InterpretGPUParams()
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  return _launch(q, k, v, prefix_len, block_mask, table, launch=launch, qk_scale=scale * _LOG2E,
                 interpret=interpret or None, p_from_smem=bool(interpret) if p_from_smem is None else p_from_smem)


@functools.partial(jax.jit, static_argnames=("launch", "qk_scale", "interpret", "p_from_smem"))
def _launch(q, k_cache, v_cache, prefix_len, block_mask, table, *, launch: MosaicLaunch, qk_scale: float,
            interpret, p_from_smem: bool):
  """Lays q and the mask out in tile rows, runs the kernel, merges splits and folds the rows back (``table``
  None: a contiguous cache, else pools [P, Hkv, R, Dh] read through it)."""
  batch, num_q, num_q_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[1]
  group = num_q_heads // num_kv_heads
  num_rows = launch.row_tiles * launch.tile_rows
  rows_q = q.reshape(batch, num_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  rows_q = jnp.pad(rows_q.reshape(batch, num_kv_heads, num_q * group, head_dim),
                   ((0, 0), (0, 0), (0, num_rows - num_q * group), (0, 0)))
  words = pack_row_mask(block_mask, group, launch.row_tiles * BLOCK_R, launch.mask_words)
  if table is None and k_cache.shape[2] < launch.block_k:     # a cache shorter than one key block
    pad = ((0, 0), (0, 0), (0, launch.block_k - k_cache.shape[2]), (0, 0))
    k_cache, v_cache = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad)
  tiles = (batch, num_kv_heads, num_rows)
  if launch.num_splits == 1:
    out_type = jax.ShapeDtypeStruct(tiles + (head_dim,), q.dtype)
  else:
    parts = (batch, num_kv_heads, launch.num_splits, num_rows)
    out_type = (jax.ShapeDtypeStruct(parts + (head_dim,), jnp.float32),
                jax.ShapeDtypeStruct(parts, jnp.float32), jax.ShapeDtypeStruct(parts, jnp.float32))
  kernel = functools.partial(_kernel, launch=launch, num_q=num_q, qk_scale=qk_scale, p_from_smem=p_from_smem)
  out = plgpu.kernel(
      kernel,
      out_type=out_type,
      scratch_types=_scratch(launch, q.dtype),
      grid=launch.grid,
      grid_names=("tile", "split", "head", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(prefix_len.astype(jnp.int32), rows_q, k_cache, v_cache, words, *(() if table is None else (table,)))
  if launch.num_splits > 1:
    out = merge_splits(*out, axis=2, dtype=q.dtype)
  out = out[:, :, :num_q * group].reshape(batch, num_kv_heads, num_q, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_q, num_q_heads, head_dim)

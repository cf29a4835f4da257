"""The Pallas Mosaic TPU tree-attention kernel: Pallas's TPU interpreter against the XLA reference on this CPU
machine (contiguous and paged caches, ragged prefixes, real trees, garbage past the used rows), its one-sentence
refusals, lowering to a Mosaic custom call (jax >= 0.12, no TPU) and, where libtpu is installed, compiling for
one v5e, v6e and v5p chip at Qwen3-8B decode-round shapes."""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding, PartitionSpec as P

from jetspec_jax import deviceless
from pallas_kernels import tree_attention_tpu as tt
from pallas_kernels.errors import KernelError
from pallas_kernels.reference import xla_attention

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1.5e-2}   # max |out - ref| / max |ref|; bf16 measured: <= 7e-3


def _ancestor_mask(num_q: int, rng: np.random.Generator) -> np.ndarray:
  """[T, T] bool of a random tree whose parents are numbered before their children: node i sees its ancestors."""
  mask = np.eye(num_q, dtype=bool)
  for i in range(1, num_q):
    mask[i] |= mask[int(rng.integers(0, i))]
  return mask


def _problem(seed: int, *, num_q: int, group: int, prefixes: tuple[int, ...], head_dim: int, dtype,
             num_kv: int = 2, cache_len: int | None = None):
  """Random q, k, v [B, Hkv, S, Dh], prefix_len and one random tree per batch row (S: a multiple of 16)."""
  rng = np.random.default_rng(seed)
  batch = len(prefixes)
  cache_len = cache_len or -(-(max(prefixes) + num_q + 9) // 16) * 16
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  mask = np.stack([_ancestor_mask(num_q, rng) for _ in range(batch)])
  return (normal(batch, num_q, num_kv * group, head_dim), normal(batch, num_kv, cache_len, head_dim),
          normal(batch, num_kv, cache_len, head_dim), jnp.asarray(prefixes, jnp.int32), jnp.asarray(mask))


def _rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.isfinite(out).all()
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def _paged(k, v, prefixes, num_q: int, page_rows: int, groups: int, rng: np.random.Generator, fill=None):
  """k, v [B, Hkv, S, Dh] cut into pools [G, Pg, Hkv, R, Dh] at shuffled page ids; the table [B, T'] holds -1 past
  each row's used pages. Unused pool pages (page 0 of each group among them) hold ``fill`` (None: noise)."""
  batch, num_kv, cache_len, head_dim = k.shape
  per_row = cache_len // page_rows
  per_group = batch // groups * per_row + 1
  table = np.full((batch, per_row), -1, np.int32)
  shape = (groups, per_group, num_kv, page_rows, head_dim)
  pools = [np.asarray(rng.standard_normal(shape) if fill is None else np.full(shape, fill), np.float32)
           for _ in range(2)]
  for b in range(batch):
    used = -(-(prefixes[b] + num_q) // page_rows)
    first = b % (batch // groups) * per_row
    ids = 1 + first + rng.permutation(per_row)[:used]       # page 0 of every group is never a row's
    table[b, :used] = ids
    for pool, cache in zip(pools, (k, v)):
      rows = np.asarray(cache[b, :, :used * page_rows], np.float32).reshape(num_kv, used, page_rows, head_dim)
      pool[b // (batch // groups), ids] = rows.transpose(1, 0, 2, 3)
  return jnp.asarray(pools[0], k.dtype), jnp.asarray(pools[1], k.dtype), jnp.asarray(table)


# (T, group, prefix per batch row, head_dim, dtype, kv heads, block_k): trees of 1, 16, 64 and 256 nodes, groups 1, 4
# and 8, head dims 64 and 128, both dtypes; prefixes of 0, ending mid-block and on a block boundary, over several
# unmasked key blocks (None: the default block, here the whole cache).
CASES = [
    (1, 4, (0, 700), 128, jnp.float32, 2, 128),
    (16, 8, (300, 0), 64, jnp.float32, 1, 64),
    (64, 1, (37, 512), 128, jnp.float32, 2, 128),
    (256, 4, (1, 200), 64, jnp.float32, 1, 128),
    (1, 8, (511, 5), 64, jnp.bfloat16, 2, 256),
    (16, 4, (0, 1000), 128, jnp.bfloat16, 2, 256),
    (64, 8, (129, 3), 128, jnp.bfloat16, 1, 128),
    (256, 1, (700, 0), 128, jnp.bfloat16, 1, None),
]


def _case_id(case) -> str:
  num_q, group, prefixes, head_dim, dtype, num_kv, block_k = case
  return (f"T{num_q}-g{group}-p{'_'.join(map(str, prefixes))}-d{head_dim}-{jnp.dtype(dtype).name}-kv{num_kv}"
          f"-k{block_k}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interpret_matches_xla(case):
  num_q, group, prefixes, head_dim, dtype, num_kv, block_k = case
  args = _problem(zlib.crc32(_case_id(case).encode()), num_q=num_q, group=group, prefixes=prefixes,
                  head_dim=head_dim, dtype=dtype, num_kv=num_kv)
  out = tt.tree_attention(*args, interpret=True, block_k=block_k)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert _rel_err(out, xla_attention(*args)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("block_r,block_k", [(16, 32), (32, 48)])
def test_small_blocks_and_a_shifted_last_block(block_r, block_k):
  """Several row blocks, many key blocks, a custom scale, and a cache whose length is no multiple of block_k (the
  last block is shifted back in bounds; its rows already read are masked out). The interpreter checks the double
  buffering for races (jax >= 0.12 raises on one)."""
  args = _problem(zlib.crc32(f"blocks{block_r}-{block_k}".encode()), num_q=13, group=4, prefixes=(0, 33, 100, 70),
                  head_dim=128, dtype=jnp.float32, cache_len=128)
  out = tt.tree_attention(*args, interpret=pltpu.InterpretParams(detect_races=True), sm_scale=0.3, block_r=block_r,
                          block_k=block_k)
  assert _rel_err(out, xla_attention(*args, sm_scale=0.3)) <= TOLERANCE[jnp.float32]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_paged_matches_xla_over_the_gathered_cache(dtype):
  """Pages in shuffled order in two groups, -1 past each row's pages; key blocks of 2 pages of 16 rows."""
  rng = np.random.default_rng(zlib.crc32(f"paged-{jnp.dtype(dtype).name}".encode()))
  q, k, v, prefix_len, mask = _problem(int(rng.integers(1 << 30)), num_q=16, group=4, prefixes=(0, 45, 100, 17),
                                       head_dim=128, dtype=dtype, cache_len=160)
  k_pool, v_pool, table = _paged(k, v, (0, 45, 100, 17), 16, 16, 2, rng)
  out = tt.paged_tree_attention(q, k_pool, v_pool, table, prefix_len, mask, interpret=True, block_k=32)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert _rel_err(out, xla_attention(q, k, v, prefix_len, mask)) <= TOLERANCE[dtype]


def test_garbage_past_the_used_rows_never_reaches_the_output():
  """NaN at every cache position >= prefix_len + T (contiguous), and in every pool page no row uses (paged, where
  a -1 entry reads its group's page 0): the output is the reference's over clean caches."""
  rng = np.random.default_rng(zlib.crc32(b"nan-tail"))
  prefixes = (70, 3)
  q, k, v, prefix_len, mask = _problem(int(rng.integers(1 << 30)), num_q=7, group=4, prefixes=prefixes,
                                       head_dim=64, dtype=jnp.float32, cache_len=192)
  ref = xla_attention(q, k, v, prefix_len, mask)
  used = jnp.arange(k.shape[2])[None, None, :, None] < (prefix_len + q.shape[1])[:, None, None, None]
  dirty = lambda x: jnp.where(used, x, jnp.nan)
  out = tt.tree_attention(q, dirty(k), dirty(v), prefix_len, mask, interpret=True, block_k=64)
  assert _rel_err(out, ref) <= TOLERANCE[jnp.float32]
  k_pool, v_pool, table = _paged(dirty(k), dirty(v), prefixes, 7, 16, 1, rng, fill=np.nan)
  out = tt.paged_tree_attention(q, k_pool, v_pool, table, prefix_len, mask, interpret=True, block_k=64)
  assert _rel_err(out, ref) <= TOLERANCE[jnp.float32]


def test_launch_shapes_fold_rows_and_size_blocks():
  """Qwen3-8B (32 query heads, 8 kv heads): rows = T x group in equal blocks of at most 1024; key blocks of at most
  256K scores within 256..1024 positions, at most the cache, whole pages when paged."""
  decode = tt.launch_shapes(4, 1, 32, 8, 128, jnp.bfloat16, 4096)
  assert (decode.block_r, decode.block_k, decode.grid) == (16, 1024, (4, 8, 1))
  tree = tt.launch_shapes(4, 128, 32, 8, 128, jnp.bfloat16, 4096, page_rows=16)
  assert (tree.block_r, tree.block_k, tree.rows, tree.grid) == (512, 512, 512, (4, 8, 1))
  assert tt.launch_shapes(4, 16, 32, 8, 128, jnp.bfloat16, 4800, page_rows=48).block_k == 1008
  big = tt.launch_shapes(1, 300, 32, 8, 64, jnp.float32, 96)
  assert (big.block_r, big.rows, big.block_k, big.mask_words, big.grid) == (600, 1200, 96, 10, (1, 8, 2))


def _one_sentence(message: str) -> bool:
  return "\n" not in message and message.endswith(".") and message.count(". ") == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(head_dim=96), "head_dim"),
    (dict(dtype=jnp.float16), "float32 or bfloat16"),
    (dict(num_q_heads=30), "multiple of kv heads"),
    (dict(cache_len=4104), "multiple of 16 positions"),
    (dict(page_rows=8), "pages of 8 rows break TPU tiling"),
    (dict(page_rows=16, block_k=24), "block_k=24 must be a positive multiple of 16"),
    (dict(page_rows=32, block_k=48), "whole pages of 32 rows"),
    (dict(block_r=20), "block_r=20"),
    (dict(cache_len=64, block_k=128), "longer than the cache"),
    (dict(page_rows=16, cache_len=16 * 65537), "page table rows of 65537 entries do not fit"),
])
def test_launch_shapes_refuse_in_one_sentence(kwargs, message):
  problem = dict(batch=2, num_q=16, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16,
                 cache_len=4096) | kwargs
  with pytest.raises(KernelError, match=message) as info:
    tt.launch_shapes(**problem)
  assert _one_sentence(str(info.value)), str(info.value)


def test_refuses_mismatched_inputs():
  q, k, v, prefix_len, mask = _problem(1, num_q=3, group=2, prefixes=(4,), head_dim=64, dtype=jnp.float32)
  with pytest.raises(KernelError, match="share one dtype"):
    tt.tree_attention(q, k.astype(jnp.bfloat16), v, prefix_len, mask, interpret=True)
  with pytest.raises(KernelError, match="block_mask"):
    tt.tree_attention(q, k, v, prefix_len, mask[:, :2], interpret=True)


def _qwen3_8b_decode_round(num_q: int, head_dim: int = 128, sharding=None):
  """Abstract inputs of one paged decode round at Qwen3-8B's attention shapes: B 4, Hq 32, Hkv 8, bf16, a
  4096-position cache per row in pages of 16 rows."""
  batch, cache_len, page_rows = 4, 4096, 16
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  pool = spec((1, batch * cache_len // page_rows, 8, page_rows, head_dim), jnp.bfloat16)
  return (spec((batch, num_q, 32, head_dim), jnp.bfloat16), pool, pool,
          spec((batch, cache_len // page_rows), jnp.int32), spec((batch,), jnp.int32),
          spec((batch, num_q, num_q), jnp.bool_))


@pytest.mark.skipif(not hasattr(jax.sharding, "AbstractDevice"),
                    reason="lowering for a TPU without one needs jax >= 0.12")
@pytest.mark.parametrize("num_q", [1, 16, 128])
def test_lowers_to_one_mosaic_call_without_a_tpu(num_q):
  device = jax.sharding.AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
    lowered = jax.jit(tt.paged_tree_attention).trace(*_qwen3_8b_decode_round(num_q)).lower(
        lowering_platforms=("tpu",))
  assert lowered.as_text().count("tpu_custom_call") == 1


@pytest.mark.skipif(not deviceless.tpu_available(), reason="libtpu (jax[tpu]) is not installed")
@pytest.mark.parametrize("num_q", [16, 128])
@pytest.mark.parametrize("chip", sorted(deviceless.TPU_TOPOLOGIES))
def test_compiles_for_one_tpu_chip(chip, num_q):
  """Mosaic compiles the kernel for the chip (one tpu_custom_call in the optimised HLO), and the program reads the
  cache pools in place: no relayout copy of them (which would read and write them once more: bytes accessed stay
  under twice the pools' bytes)."""
  mesh = jax.sharding.Mesh(deviceless.tpu_devices(chip), ("x",))
  args = _qwen3_8b_decode_round(num_q, sharding=NamedSharding(mesh, P()))
  fn = jax.shard_map(tt.paged_tree_attention, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)
  compiled = jax.jit(fn).lower(*args).compile()
  assert compiled.as_text().count("tpu_custom_call") == 1
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  pools = 2 * np.prod(args[1].shape) * 2
  assert pools <= cost["bytes accessed"] < 2 * pools, (cost["bytes accessed"], pools)

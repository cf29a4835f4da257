"""Attention over paged KV caches (``jetspec_jax.attention.paged_attention``): both kernels read the pages through
the table inside the kernel (interpret mode), and ``xla_ragged`` each sequence's own pages in XLA, and they give the
XLA path's result (attention over ``pages.gather``);
pages out of order, unused table entries, ragged prefixes, under a mesh, and bad input."""
from __future__ import annotations

import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jetspec_jax import pages
from jetspec_jax.attention import paged_attention, ragged_paged_attention
from jetspec_jax.errors import JetSpecError
from pallas_kernels import tree_attention as ta
from pallas_kernels import tree_attention_mgpu as tm
from pallas_kernels.errors import KernelError
from cuda_lowering import lower_text
from test_tree_attention import _ancestor_mask, _parents, _rel_err

mosaic_interpreter = pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"),
                                        reason=f"the Mosaic GPU interpreter is in jax >= 0.12, not {jax.__version__}")
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


def paged_problem(seed: int, *, page_rows: int, prefixes: tuple[int, ...], num_q: int, group: int, head_dim: int,
                  dtype, tree: str = "random", groups: int = 1, num_kv: int = 1, nan: bool = False):
  """Random q, pools [G, Pg, Hkv, R, Dh] and a table [B, T'] whose slots hold random pages of their group (out of
  order) for their prefix and tree rows, then -1; a spare page per group. ``nan``: every row no slot may read
  (spare pages, rows past a slot's prefix + T) is NaN in the pools. Returns (q, k_pool, v_pool, table, prefix_len,
  block_mask) and the pools without NaN."""
  rng = np.random.default_rng(seed)
  batch = len(prefixes)
  per = batch // groups
  held = [pages.pages_for(p + num_q, page_rows) for p in prefixes]
  width = max(held) + 1                                          # an unused (-1) entry for every slot
  pool_pages = per * width + 1
  table = np.full((batch, width), -1, np.int32)
  readable = np.zeros((groups, pool_pages, page_rows), bool)
  for g in range(groups):
    ids = rng.permutation(pool_pages)
    for s in range(per):
      b = g * per + s
      table[b, :held[b]] = ids[s * width:s * width + held[b]]
      rows = np.arange(held[b] * page_rows) < prefixes[b] + num_q
      readable[g, table[b, :held[b]]] = rows.reshape(held[b], page_rows)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q = normal(batch, num_q, num_kv * group, head_dim)
  k, v = (normal(groups, pool_pages, num_kv, page_rows, head_dim) for _ in range(2))
  masks = np.stack([_ancestor_mask(_parents(tree, num_q, rng)) for _ in range(batch)])
  dirty = lambda x: jnp.where(jnp.asarray(readable)[:, :, None, :, None], x, jnp.nan) if nan else x
  args = (q, dirty(k), dirty(v), jnp.asarray(table), jnp.asarray(prefixes, jnp.int32), jnp.asarray(masks))
  return args, (k, v)


def check(impl: str, seed: int, dtype, **problem):
  """The kernel ``impl`` on a paged problem against the XLA paged path on its NaN-free pools."""
  args, (k, v) = paged_problem(seed, dtype=dtype, **problem)
  q, _, _, table, prefix_len, mask = args
  out = paged_attention(*args, impl=impl)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert _rel_err(out, paged_attention(q, k, v, table, prefix_len, mask, impl="xla")) <= TOLERANCE[dtype]


# (page_rows, prefix per slot, tree nodes, group, head_dim, groups): pages of 8 to 64 rows, prefixes of 0, of
# whole pages and ending mid-page, trees of 1 to 256 nodes, GQA groups 1 and 4, one or two page groups.
CASES = [(8, (0, 13), 1, 4, 64, 1), (16, (37, 16), 16, 1, 128, 2), (64, (130, 0, 64, 5), 20, 4, 64, 2),
         (8, (100, 3), 256, 1, 64, 1)]
case_id = lambda c: f"R{c[0]}-p{'_'.join(map(str, c[1]))}-N{c[2]}-g{c[3]}-d{c[4]}-G{c[5]}"


def _problem_kw(case) -> dict:
  page_rows, prefixes, num_q, group, head_dim, groups = case
  return dict(page_rows=page_rows, prefixes=prefixes, num_q=num_q, group=group, head_dim=head_dim, groups=groups)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_triton_kernel_reads_the_pages(case, dtype):
  check("pallas_interpret", zlib.crc32(case_id(case).encode()), dtype, **_problem_kw(case))


@mosaic_interpreter
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mosaic_kernel_reads_the_pages(case):
  check("mosaic_interpret", zlib.crc32(case_id(case).encode()), jnp.bfloat16, **_problem_kw(case))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tpu_kernel_reads_the_pages(case, dtype):
  """``tpu_interpret``: the Mosaic TPU kernel in Pallas's TPU interpreter (bfloat16 pages: multiples of 16 rows,
  the TPU's bfloat16 tile; pages of 8 rows are refused in one sentence)."""
  if dtype == jnp.bfloat16 and case[0] % 16:
    with pytest.raises(JetSpecError, match="break TPU tiling"):
      check("tpu_interpret", 0, dtype, **_problem_kw(case))
    return
  check("tpu_interpret", zlib.crc32(case_id(case).encode()), dtype, **_problem_kw(case))


@pytest.mark.parametrize("chunk_rows, block", [(8, 1), (16, 3), (128, 8)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ragged_xla_reads_each_sequences_own_pages(case, dtype, chunk_rows, block):
  """``xla_ragged`` against the gathered XLA path: chunks of one page to several, one chunk per loop trip to
  several sequences' chunks in one trip."""
  args, _ = paged_problem(zlib.crc32(case_id(case).encode()), dtype=dtype, **_problem_kw(case))
  out = jax.jit(functools.partial(ragged_paged_attention, chunk_rows=chunk_rows, block=block))(*args)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert _rel_err(out, paged_attention(*args, impl="xla")) <= TOLERANCE[dtype]


def test_ragged_xla_under_a_mesh_and_a_length(eight_devices):
  """``xla_ragged`` per shard on a 2 x 2 mesh; ``length`` bounds the rows read; a sequence holding no page gives
  zeros."""
  from jetspec_jax.sharding import make_mesh
  mesh = make_mesh(2, 2, jax.devices()[:4])
  args, _ = paged_problem(7, page_rows=8, prefixes=(20, 0, 9, 33), num_q=6, group=2, head_dim=64,
                          dtype=jnp.float32, groups=2, num_kv=2)
  out = jax.jit(lambda *a: paged_attention(*a, impl="xla_ragged", mesh=mesh))(*args)
  assert _rel_err(out, paged_attention(*args)) <= TOLERANCE[jnp.float32]
  args, _ = paged_problem(6, page_rows=8, prefixes=(10, 3), num_q=4, group=1, head_dim=64, dtype=jnp.float32)
  assert _rel_err(paged_attention(*args, impl="xla_ragged", length=14), paged_attention(*args, length=14)) <= \
      TOLERANCE[jnp.float32]
  q, k, v, table, prefix_len, mask = args
  out = paged_attention(q, k, v, table.at[1].set(-1), prefix_len, mask, impl="xla_ragged")
  assert not jnp.any(out[1]) and _rel_err(out[0], paged_attention(*args)[0]) <= TOLERANCE[jnp.float32]


@pytest.mark.parametrize("kernel", ["pallas", pytest.param("mosaic", marks=mosaic_interpreter)])
def test_rows_no_slot_may_read_never_reach_the_output(kernel):
  """NaN in spare pages and past every slot's rows; -1 table entries (read as the group's page 0, a NaN page
  here) and prefix splits: the output is the clean pools' attention."""
  launch = dict(num_splits=3, block_k=16) if kernel == "pallas" else dict(num_splits=3, min_split_keys=64)
  args, (k, v) = paged_problem(zlib.crc32(kernel.encode()), page_rows=16, prefixes=(150, 7), num_q=9, group=4,
                               head_dim=64, dtype=jnp.bfloat16, num_kv=2, nan=True)
  module = ta if kernel == "pallas" else tm
  out = module.paged_tree_attention(*args, interpret=True, **launch)
  q, _, _, table, prefix_len, mask = args
  assert _rel_err(out, paged_attention(q, k, v, table, prefix_len, mask)) <= TOLERANCE[jnp.bfloat16]


@mosaic_interpreter
def test_mosaic_pages_that_do_not_divide_the_key_block():
  """Pages of 24 rows under 128-key blocks: each block's boxes are 8 rows (gcd), none crossing a page."""
  check("mosaic_interpret", 24, jnp.float16, page_rows=24, prefixes=(40, 11), num_q=5, group=4, head_dim=128)
  assert tm.launch_shapes(1, 5, 4, 1, 128, cache_len=96, block_k=128, page_rows=24).copies == 16


@pytest.mark.parametrize("impl", ["pallas_interpret", "tpu_interpret"])
def test_under_a_mesh_the_kernel_runs_per_shard(eight_devices, impl):
  """A 2 x 2 mesh: pools' groups and the batch over data, heads over model (shard_map)."""
  from jetspec_jax.sharding import make_mesh
  mesh = make_mesh(2, 2, jax.devices()[:4])
  args, _ = paged_problem(5, page_rows=8, prefixes=(20, 0, 9, 33), num_q=6, group=2, head_dim=64,
                          dtype=jnp.float32, groups=2, num_kv=2)
  out = jax.jit(lambda *a: paged_attention(*a, impl=impl, mesh=mesh))(*args)
  assert _rel_err(out, paged_attention(*args)) <= TOLERANCE[jnp.float32]


def test_a_length_reads_only_the_first_pages():
  """``length``: the kernels take the table's first cdiv(length, R) pages; the XLA path gathers length rows."""
  args, _ = paged_problem(6, page_rows=8, prefixes=(10, 3), num_q=4, group=1, head_dim=64, dtype=jnp.float32)
  full = paged_attention(*args, impl="pallas_interpret")
  assert _rel_err(paged_attention(*args, impl="pallas_interpret", length=14), full) <= TOLERANCE[jnp.float32]
  assert _rel_err(paged_attention(*args, length=14), full) <= TOLERANCE[jnp.float32]


def test_bad_pools_and_tables_are_refused_in_one_sentence():
  (q, k, v, table, prefix_len, mask), _ = paged_problem(7, page_rows=8, prefixes=(4, 4), num_q=3, group=1,
                                                         head_dim=64, dtype=jnp.float32, groups=2)
  with pytest.raises(KernelError, match="positive multiple of 8"):
    ta.paged_tree_attention(q, k[:, :, :, :4], v[:, :, :, :4], table, prefix_len, mask, interpret=True)
  with pytest.raises(KernelError, match="do not split"):
    ta.paged_tree_attention(q[:1], k, v, table[:1], prefix_len[:1], mask[:1], interpret=True)
  with pytest.raises(KernelError, match="table"):
    tm.paged_tree_attention(q, k, v, table[:, None], prefix_len, mask, interpret=True)
  with pytest.raises(JetSpecError, match="cannot hold"):
    paged_attention(q, k, v, table[:, :0], prefix_len, mask, impl="pallas_interpret")


def test_the_paged_triton_kernel_lowers_for_cuda(triton_modules, capsys):
  """One Triton call whose module verifies, every tensor's dims powers of two (the page-row gathers included)."""
  spec = jax.ShapeDtypeStruct
  pool = spec((2, 300, 8, 16, 128), jnp.bfloat16)
  args = (spec((4, 16, 32, 128), jnp.bfloat16), pool, pool, spec((4, 256), jnp.int32), spec((4,), jnp.int32),
          spec((4, 16, 16), jnp.bool_))
  text = lower_text(lambda *a: ta.paged_tree_attention(*a, debug=True), *args)
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert [error for _, error in triton_modules] == [None]
  ir = capsys.readouterr().out.split("The Triton module for pallas_call")[-1]
  dims = [[int(d) for d in m.split("x")] for m in re.findall(r"tensor<((?:\d+x)*\d+)x", ir)]
  assert dims and all(d & (d - 1) == 0 for shape in dims for d in shape)

"""The Pallas tree-attention kernel: interpret mode against the XLA reference, CUDA lowering to
Triton on this CPU machine, and Triton's tile rules (which interpret mode does not enforce)."""
from __future__ import annotations

import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.attention import attention
from pallas_kernels.reference import xla_attention
from pallas_kernels.errors import KernelError
from cuda_lowering import lower_text
from pallas_kernels import tree_attention as ta
from pallas_kernels import tuning

TRITON_CALL = "__gpu$xla.gpu.triton"


def _parents(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
  """Parent of every node (-1 for the root, parents numbered before children)."""
  if kind == "chain":
    return np.arange(n) - 1
  if kind == "star":
    return np.where(np.arange(n) == 0, -1, 0)
  return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def _ancestor_mask(parents: np.ndarray) -> np.ndarray:
  """[N, N] bool: node i sees node t when t is i or one of its ancestors."""
  n = len(parents)
  mask = np.eye(n, dtype=bool)
  for i in range(1, n):
    mask[i] |= mask[parents[i]]
  return mask


def _problem(seed: int, *, num_q: int, group: int, prefixes: tuple[int, ...], tree: str,
             head_dim: int, dtype, num_kv: int = 1, slack: int = 9):
  """Random inputs with a different tree per batch row; slack cache rows after the tree hold noise."""
  rng = np.random.default_rng(seed)
  batch = len(prefixes)
  cache_len = max(prefixes) + num_q + slack
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q = normal(batch, num_q, num_kv * group, head_dim)
  k = normal(batch, num_kv, cache_len, head_dim)
  v = normal(batch, num_kv, cache_len, head_dim)
  mask = np.stack([_ancestor_mask(_parents(tree, num_q, rng)) for _ in range(batch)])
  return q, k, v, jnp.asarray(prefixes, jnp.int32), jnp.asarray(mask)


def _rel_err(out, ref) -> float:
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


# (num_q, group, prefix per batch row, tree, head_dim, dtype): every N (1 to 512), group, prefix length
# and tree shape of the issue appears, in both dtypes, without the full cartesian product.
CASES = [
    (1, 4, (1000, 0), "chain", 128, jnp.float32),
    (5, 1, (1, 127), "random", 64, jnp.float32),
    (16, 8, (127, 0), "star", 64, jnp.float32),
    (100, 4, (1000, 1), "random", 128, jnp.float32),
    (256, 1, (0, 127), "chain", 64, jnp.float32),
    (1, 8, (127, 1000), "chain", 64, jnp.bfloat16),
    (5, 4, (0, 1), "star", 128, jnp.bfloat16),
    (16, 4, (1, 1000), "chain", 128, jnp.bfloat16),
    (100, 8, (127, 0), "star", 64, jnp.bfloat16),
    (256, 4, (1000, 1), "random", 128, jnp.bfloat16),
    (512, 1, (127, 0), "random", 64, jnp.float32),      # the largest tree the kernel takes
]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _case_id(case) -> str:
  num_q, group, prefixes, tree, head_dim, dtype = case
  return f"N{num_q}-g{group}-p{'_'.join(map(str, prefixes))}-{tree}-d{head_dim}-{jnp.dtype(dtype).name}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interpret_matches_xla(case):
  num_q, group, prefixes, tree, head_dim, dtype = case
  args = _problem(zlib.crc32(_case_id(case).encode()), num_q=num_q, group=group, prefixes=prefixes,
                  tree=tree, head_dim=head_dim, dtype=dtype)
  out = ta.tree_attention(*args, interpret=True)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert _rel_err(out, xla_attention(*args)) <= TOLERANCE[dtype]


def test_gqa_heads_and_random_prefix_rows():
  """Several kv heads (group 4), four batch rows with random prefix lengths, a custom scale."""
  rng = np.random.default_rng(zlib.crc32(b"gqa-rows"))
  prefixes = tuple(int(p) for p in rng.integers(0, 200, size=4))
  args = _problem(int(rng.integers(1 << 30)), num_q=20, group=4, prefixes=prefixes, tree="random",
                  head_dim=64, dtype=jnp.float32, num_kv=3)
  out = ta.tree_attention(*args, sm_scale=0.3, interpret=True)
  assert _rel_err(out, xla_attention(*args, sm_scale=0.3)) <= 1e-5


def test_unused_cache_rows_are_never_read():
  """NaN beyond each row's prefix + N (and in prefix-block padding) must not reach the output."""
  q, k, v, prefix_len, mask = _problem(zlib.crc32(b"nan-tail"), num_q=7, group=4, prefixes=(70, 3),
                                       tree="random", head_dim=64, dtype=jnp.float32, slack=100)
  used = jnp.arange(k.shape[2])[None, None, :, None] < (prefix_len + q.shape[1])[:, None, None, None]
  out = ta.tree_attention(q, jnp.where(used, k, jnp.nan), jnp.where(used, v, jnp.nan), prefix_len,
                          mask, interpret=True)
  assert _rel_err(out, xla_attention(q, k, v, prefix_len, mask)) <= 1e-5


# (num_q, group, prefix per batch row, num_splits): splits that share the prefix unevenly, splits
# left empty by a short or zero prefix, more splits than prefix blocks, prefixes of whole key blocks
# (no partial block), and a tree long enough that the last split reads no prefix block.
SPLIT_CASES = [(1, 4, (1000, 0), 3), (5, 8, (127, 1000), 4), (16, 1, (1, 700), 2), (100, 4, (1000, 0), 5),
               (3, 4, (0, 0), 4), (1, 4, (64, 512), 3), (100, 1, (32, 256), 4)]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"N{c[0]}-g{c[1]}-p{'_'.join(map(str, c[2]))}-s{c[3]}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_prefix_splits_match_xla(case, dtype):
  """Flash-decoding: the prefix cut into splits whose float32 partials are merged afterwards."""
  num_q, group, prefixes, num_splits = case
  args = _problem(zlib.crc32(repr((case, jnp.dtype(dtype).name)).encode()), num_q=num_q, group=group,
                  prefixes=prefixes, tree="random", head_dim=64, dtype=dtype, num_kv=2)
  out = ta.tree_attention(*args, interpret=True, num_splits=num_splits, block_r=16, block_k=16)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert _rel_err(out, xla_attention(*args)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("config", [
    tuning.LaunchConfig(block_r=16, block_k=128, num_warps=4, num_stages=3),
    tuning.LaunchConfig(block_r=32, block_k=32, num_warps=4, num_stages=2, num_splits=2),
    tuning.LaunchConfig(block_r=128, block_k=64, num_warps=8, num_stages=3)], ids=["r16", "r32-split2", "r128"])
def test_tuning_table_configurations_match_xla(config):
  """A configuration reached through a tuning table computes the same attention."""
  args = _problem(zlib.crc32(repr(config).encode()), num_q=9, group=4, prefixes=(300, 0), tree="random",
                  head_dim=64, dtype=jnp.float32, num_kv=2)
  out = ta.tree_attention(*args, interpret=True, tuning=tuning.KernelTuning(rules=((1, config),)))
  assert _rel_err(out, xla_attention(*args)) <= 1e-5


@pytest.mark.parametrize("num_q,prefix,num_splits", [(128, 1024, 2), (128, 4096, 4), (256, 4096, 2), (1, 16384, 33),
                                                     (16, 700, 3), (200, 64, 4), (5, 0, 2)])
def test_split_shares_cover_the_prefix_and_balance_the_work(num_q, prefix, num_splits):
  """Every prefix block is read by exactly one split, and the busiest split (the last one also reads the
  tree) does no more than an even share of prefix + tree blocks, or min_split_blocks."""
  shapes = ta.launch_shapes(1, num_q, 32, 8, 128, num_splits=num_splits)
  blocks = -(-prefix // shapes.block_k)
  ranges = [tuple(int(b) for b in ta.split_blocks(s, blocks, shapes)) for s in range(num_splits)]
  assert [b for first, last in ranges for b in range(first, last)] == list(range(blocks))
  tree = -(-shapes.num_tree_blocks * shapes.block_t // shapes.block_k)
  work = [last - first for first, last in ranges]
  work[-1] += tree
  assert max(work) <= max(-(-(blocks + tree) // num_splits), shapes.min_split_blocks)


def test_default_splits_follow_the_grid():
  """Auto splits: about target_programs programs, each split at least 256 keys and 8 tiles of rows."""
  decode = ta.launch_shapes(1, 1, 32, 8, 128, cache_len=16384)
  assert decode.grid == (1, 8, 1, 33)                                 # 264 // (8 heads x 1 row block)
  big_tree = ta.launch_shapes(1, 256, 32, 8, 128, cache_len=4096)      # 16 row blocks x 8 heads
  assert big_tree.num_splits == 2 and big_tree.min_split_blocks * big_tree.block_k == 512
  assert ta.launch_shapes(1, 16, 32, 8, 128, cache_len=300).num_splits == 1
  assert ta.launch_shapes(1, 16, 32, 8, 128).num_splits == 1          # no cache length given
  assert ta.launch_shapes(64, 1, 32, 8, 128, cache_len=16384).num_splits == 1
  # the rule's knobs (tuning tables set them): shorter splits, more programs
  assert ta.launch_shapes(1, 16, 32, 8, 128, cache_len=4096).num_splits == 8          # 512-key splits
  assert ta.launch_shapes(1, 16, 32, 8, 128, cache_len=4096, min_split_keys=256).num_splits == 16
  assert ta.launch_shapes(1, 1, 32, 8, 128, cache_len=16384, target_programs=528, min_split_keys=256).num_splits == 64


def test_attention_dispatch_uses_kernel():
  args = _problem(zlib.crc32(b"dispatch"), num_q=3, group=2, prefixes=(5, 40), tree="random",
                  head_dim=64, dtype=jnp.float32)
  out = attention(*args, impl="pallas_interpret")
  assert _rel_err(out, attention(*args, impl="xla")) <= 1e-5


@pytest.mark.parametrize("num_q", [1, 5, 31, 32, 33, 100])
def test_pack_block_mask_round_trips(num_q):
  rng = np.random.default_rng(num_q)
  mask = rng.random((2, num_q, num_q)) < 0.5
  words_per_row = math.ceil(num_q / 32) + 1
  words = np.asarray(ta.pack_block_mask(jnp.asarray(mask), words_per_row)).view(np.uint32)
  bits = (words[..., None] >> np.arange(32, dtype=np.uint32)) & 1
  bits = bits.reshape(2, num_q, words_per_row * 32).astype(bool)
  np.testing.assert_array_equal(bits[..., :num_q], mask)
  assert not bits[..., num_q:].any()


# Qwen3-8B attention: 32 query heads, 8 kv heads; head_dim 128 and 64.
LOWERING = [(num_q, head_dim) for num_q in (1, 16, 128, 256, 512) for head_dim in (128, 64)]


def _lower_for_cuda(num_q: int, head_dim: int, *, debug: bool = False) -> str:
  batch, cache_len = 2, 4096
  spec = jax.ShapeDtypeStruct
  args = (spec((batch, num_q, 32, head_dim), jnp.bfloat16),
          spec((batch, 8, cache_len, head_dim), jnp.bfloat16),
          spec((batch, 8, cache_len, head_dim), jnp.bfloat16),
          spec((batch,), jnp.int32), spec((batch, num_q, num_q), jnp.bool_))
  return lower_text(lambda *a: ta.tree_attention(*a, debug=debug), *args)


@pytest.mark.parametrize("num_q,head_dim", LOWERING)
def test_lowers_to_one_triton_call_for_cuda(num_q, head_dim, triton_modules):
  text = _lower_for_cuda(num_q, head_dim)
  assert text.count(TRITON_CALL) == 1
  assert "num_warps = 4" in text
  assert [error for _, error in triton_modules] == [None]           # the Triton module verifies


@pytest.mark.parametrize("num_q,head_dim", [(1, 128), (5, 128), (100, 64), (512, 128)])
def test_triton_ir_obeys_tile_rules(num_q, head_dim, capsys):
  """Every tensor in the emitted Triton IR has power-of-two dims; every dot operand dim >= 16 (q.k and p.v
  in each of the three key loops: whole prefix blocks, the partial prefix block, the tree)."""
  _lower_for_cuda(num_q, head_dim, debug=True)
  ir = capsys.readouterr().out.split("The Triton module for pallas_call")[-1]
  # MLIR falls back to the generic form ("tt.dot"(...)) only for a module that fails to verify.
  assert '"tt.dot"' not in ir and '"scf.for"' not in ir, "the Triton module does not verify"
  tensor_dims = [[int(d) for d in m.split("x")] for m in re.findall(r"tensor<((?:\d+x)*\d+)x", ir)]
  assert tensor_dims and all(d & (d - 1) == 0 for dims in tensor_dims for d in dims)
  dots = re.findall(r"tt\.dot .*?: tensor<(\d+)x(\d+)x\w+> \* tensor<(\d+)x(\d+)x\w+>", ir)
  assert len(dots) == 6 and all(int(d) >= ta.MIN_DOT_DIM for dot in dots for d in dot)


@pytest.mark.parametrize("num_q,group,head_dim", sorted(
    {(c[0], c[1], c[4]) for c in CASES} | {(n, 4, d) for n, d in LOWERING} | {(20, 4, 64), (7, 4, 64)}))
def test_launch_shapes_obey_triton_rules(num_q, group, head_dim):
  shapes = ta.launch_shapes(2, num_q, 8 * group, 8, head_dim)
  assert shapes.triton_violations() == []
  assert shapes.grid[2] * shapes.block_r >= group * num_q
  assert shapes.num_tree_blocks * shapes.block_t >= num_q
  assert shapes.mask_words * ta.MASK_BITS >= shapes.num_tree_blocks * shapes.block_t


@pytest.mark.parametrize("kwargs,message", [
    (dict(head_dim=96), "head_dim"),
    (dict(num_q_heads=30), "multiple of kv heads"),
    (dict(block_k=48), "block_k"),
    (dict(block_r=8), "block_r"),
    (dict(min_split_keys=0), "min_split_keys=0"),
])
def test_launch_shapes_rejects_bad_problems(kwargs, message):
  problem = dict(batch=1, num_q=4, num_q_heads=32, num_kv_heads=8, head_dim=128) | kwargs
  with pytest.raises(KernelError, match=message):
    ta.launch_shapes(**problem)


def test_rejects_mismatched_inputs():
  q, k, v, prefix_len, mask = _problem(1, num_q=3, group=2, prefixes=(4,), tree="chain",
                                       head_dim=64, dtype=jnp.float32)
  with pytest.raises(KernelError, match="share one of"):
    ta.tree_attention(q, k.astype(jnp.bfloat16), v, prefix_len, mask, interpret=True)
  with pytest.raises(KernelError, match="block_mask"):
    ta.tree_attention(q, k, v, prefix_len, mask[:, :2], interpret=True)

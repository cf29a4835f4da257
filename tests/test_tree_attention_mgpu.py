"""The Mosaic GPU tree-attention kernel: the Mosaic GPU interpreter against the XLA reference (on any
backend), input errors, and a deviceless compile for an H200 (only where the CUDA plugin is
installed, e.g. ``.venv-cuda``)."""
from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import tree_attention_mgpu as tm
from pallas_kernels.errors import KernelError
from pallas_kernels.reference import xla_attention
from test_tree_attention import _problem as _any_problem, _rel_err

MOSAIC_CALL = "mosaic_gpu_v2"
interpreter = pytest.mark.skipif(not hasattr(plgpu, "InterpretGPUParams"),
                                 reason=f"the Mosaic GPU interpreter is in jax >= 0.12, not {jax.__version__}")
TOLERANCE = 1e-2                 # bfloat16 / float16 inputs, float32 softmax (as the Triton tests)

# (num_q, group, prefix per batch row, tree, head_dim, dtype): every N, group, prefix length and tree
# shape of the Triton kernel's cases, in both 16-bit dtypes; the caches are 16 to 1272 positions
# (shorter than a key block, and lengths that are not a multiple of it).
CASES = [
    (1, 4, (1000, 0), "chain", 128, jnp.bfloat16),
    (5, 1, (1, 127), "random", 64, jnp.float16),
    (16, 8, (127, 0), "star", 64, jnp.bfloat16),
    (100, 4, (1000, 1), "random", 128, jnp.float16),
    (256, 1, (0, 127), "chain", 64, jnp.bfloat16),
    (1, 8, (127, 1000), "chain", 64, jnp.float16),
    (5, 4, (0, 1), "star", 128, jnp.bfloat16),
    (100, 8, (127, 0), "star", 64, jnp.bfloat16),
    (256, 4, (1000, 1), "random", 128, jnp.bfloat16),
]


def _problem(seed, *, num_q, prefixes, slack=9, **kw):
  """``test_tree_attention._problem`` with the cache length rounded up to the kernel's multiple of 8 rows."""
  slack += -(max(prefixes) + num_q + slack) % tm.CACHE_ROWS_MULTIPLE
  return _any_problem(seed, num_q=num_q, prefixes=prefixes, slack=slack, **kw)


def test_rejects_a_cache_length_off_the_row_multiple():
  q, k, v, prefix_len, mask = _any_problem(1, num_q=3, group=2, prefixes=(4,), tree="chain", head_dim=64,
                                           dtype=jnp.bfloat16, slack=6)
  with pytest.raises(KernelError, match="multiple of 8"):
    tm.tree_attention(q, k, v, prefix_len, mask, interpret=True)


def _case_id(case) -> str:
  num_q, group, prefixes, tree, head_dim, dtype = case
  return f"N{num_q}-g{group}-p{'_'.join(map(str, prefixes))}-{tree}-d{head_dim}-{jnp.dtype(dtype).name}"


def _check(args, *, sm_scale=None, **launch):
  out = tm.tree_attention(*args, sm_scale=sm_scale, interpret=True, **launch)
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert _rel_err(out, xla_attention(*args, sm_scale=sm_scale)) <= TOLERANCE


@interpreter
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_interpret_matches_xla(case):
  num_q, group, prefixes, tree, head_dim, dtype = case
  _check(_problem(zlib.crc32(_case_id(case).encode()), num_q=num_q, group=group, prefixes=prefixes,
                  tree=tree, head_dim=head_dim, dtype=dtype))


@interpreter
def test_gqa_heads_and_random_prefix_rows():
  """Three kv heads (group 4), four batch rows with random prefix lengths, a custom scale."""
  rng = np.random.default_rng(zlib.crc32(b"mgpu-gqa-rows"))
  prefixes = tuple(int(p) for p in rng.integers(0, 200, size=4))
  _check(_problem(int(rng.integers(1 << 30)), num_q=20, group=4, prefixes=prefixes, tree="random",
                  head_dim=64, dtype=jnp.bfloat16, num_kv=3), sm_scale=0.3)


@interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_unused_cache_rows_are_never_read(num_splits):
  """NaN in every cache row past prefix + N (the last key block holds some) must not reach the output."""
  q, k, v, prefix_len, mask = _problem(zlib.crc32(b"mgpu-nan-tail"), num_q=7, group=4, prefixes=(70, 3),
                                       tree="random", head_dim=64, dtype=jnp.bfloat16, slack=100)
  used = jnp.arange(k.shape[2])[None, None, :, None] < (prefix_len + q.shape[1])[:, None, None, None]
  out = tm.tree_attention(q, jnp.where(used, k, jnp.nan), jnp.where(used, v, jnp.nan), prefix_len, mask,
                          interpret=True, num_splits=num_splits, min_split_keys=64)
  assert _rel_err(out, xla_attention(q, k, v, prefix_len, mask)) <= TOLERANCE


# (num_q, group, prefix per batch row, num_splits) with 64-key splits: uneven shares, splits left empty
# by a short or zero prefix, more splits than key blocks, whole-block prefixes, and a tree long enough
# that the tree's blocks span several splits.
SPLIT_CASES = [(1, 4, (1000, 0), 3), (5, 8, (127, 1000), 4), (3, 4, (0, 0), 4), (1, 4, (64, 512), 3),
               (100, 1, (32, 256), 4)]


@interpreter
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"N{c[0]}-g{c[1]}-p{'_'.join(map(str, c[2]))}-s{c[3]}")
def test_prefix_splits_match_xla(case):
  """Flash-decoding: the keys cut into splits whose float32 partials XLA merges afterwards."""
  num_q, group, prefixes, num_splits = case
  _check(_problem(zlib.crc32(repr(case).encode()), num_q=num_q, group=group, prefixes=prefixes,
                  tree="random", head_dim=64, dtype=jnp.bfloat16, num_kv=2),
         num_splits=num_splits, min_split_keys=64)


@interpreter
@pytest.mark.parametrize("launch", [dict(block_k=128, num_stages=2), dict(num_stages=1),
                                    dict(block_k=128, num_splits=2, min_split_keys=128)],
                         ids=["k128-s2", "s1", "k128-split2"])
def test_launch_variants_match_xla(launch):
  """128-key blocks (five mask words per block), a ring of one slot, and the most slots that fit."""
  _check(_problem(zlib.crc32(repr(launch).encode()), num_q=40, group=4, prefixes=(300, 2), tree="random",
                  head_dim=128, dtype=jnp.bfloat16, num_kv=2), **launch)


@interpreter
def test_interpreter_finds_no_race():
  """The interpreter's happy-before race detector over TMA loads, wgmma and the shared-memory writes."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # private: the detector's state
  args = _problem(zlib.crc32(b"mgpu-races"), num_q=9, group=4, prefixes=(130, 0), tree="random",
                  head_dim=64, dtype=jnp.bfloat16)
  out = tm.tree_attention(*args, interpret=plgpu.InterpretGPUParams(detect_races=True), num_stages=2,
                          num_splits=2, min_split_keys=64)
  assert _rel_err(out, xla_attention(*args)) <= TOLERANCE
  assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("num_q,prefix,num_splits", [(1, 16384, 16), (16, 700, 3), (200, 64, 4), (5, 0, 2),
                                                     (256, 4096, 2)])
def test_split_shares_cover_the_keys(num_q, prefix, num_splits):
  """Every key block is read by exactly one split, and no split takes more than an even share (or
  min_split_blocks)."""
  launch = tm.launch_shapes(1, num_q, 32, 8, 128, cache_len=prefix + num_q, num_splits=num_splits)
  blocks = -(-(prefix + num_q) // launch.block_k)
  ranges = [tuple(int(b) for b in tm.split_blocks(s, blocks, launch)) for s in range(num_splits)]
  assert [b for first, last in ranges for b in range(first, last)] == list(range(blocks))
  assert max(last - first for first, last in ranges) <= max(-(-blocks // num_splits), launch.min_split_blocks)


def test_default_splits_fill_the_sms():
  decode = tm.launch_shapes(1, 1, 32, 8, 128, cache_len=16384)
  assert decode.grid == (1, 16, 8, 1)                        # 132 // 8 kv heads, 1024-key splits
  assert decode.tile_rows == 8 and decode.num_stages == tm.MAX_STAGES   # 4 rows (group 4) move as 8
  assert tm.launch_shapes(1, 1, 32, 8, 128, cache_len=16384, block_k=128).num_stages == 2
  assert tm.launch_shapes(1, 256, 32, 8, 128, cache_len=4096).grid == (16, 1, 8, 1)
  assert tm.launch_shapes(1, 16, 32, 8, 128, cache_len=700).num_splits == 1
  assert tm.launch_shapes(64, 1, 32, 8, 128, cache_len=16384).num_splits == 1
  assert tm.launch_shapes(1, 1, 32, 8, 128, cache_len=16384, min_split_keys=256).num_splits == 16
  assert decode.smem_bytes() <= tm.MAX_SMEM_BYTES


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=jnp.float32), "float32"),
    (dict(head_dim=96), "head_dim"),
    (dict(num_q_heads=7), "multiple of kv heads"),
    (dict(block_k=32), "block_k"),
    (dict(num_stages=0), "num_stages"),
    (dict(block_k=128, num_stages=8), "shared memory"),
])
def test_rejects_unsupported_inputs(kwargs, message):
  dtype = kwargs.pop("dtype", jnp.bfloat16)
  head_dim, num_q_heads = kwargs.pop("head_dim", 64), kwargs.pop("num_q_heads", 8)
  q, k, v, prefix_len, mask = _problem(1, num_q=3, group=4, prefixes=(4,), tree="chain", head_dim=head_dim,
                                       dtype=dtype, num_kv=2)
  q = jnp.zeros(q.shape[:2] + (num_q_heads, head_dim), dtype)
  with pytest.raises(KernelError, match=message):
    tm.tree_attention(q, k, v, prefix_len, mask, interpret=True, **kwargs)


def test_rejects_mismatched_inputs():
  q, k, v, prefix_len, mask = _problem(1, num_q=3, group=2, prefixes=(4,), tree="chain", head_dim=64,
                                       dtype=jnp.bfloat16)
  with pytest.raises(KernelError, match="bfloat16 or all"):
    tm.tree_attention(q, k.astype(jnp.float16), v, prefix_len, mask, interpret=True)
  with pytest.raises(KernelError, match="block_mask"):
    tm.tree_attention(q, k, v, prefix_len, mask[:, :2], interpret=True)
  with pytest.raises(KernelError, match="cannot hold"):
    tm.tree_attention(q, k[:, :, :2], v[:, :, :2], prefix_len, mask, interpret=True)


def compile_for_h200(fn, *args):
  """``jax.jit(fn)`` compiled by XLA:GPU for an H200 on a machine without a GPU; args are
  ShapeDtypeStructs (their sharding is replaced). Needs the CUDA plugin (``jax[cuda12]``)."""
  from jetspec_jax import deviceless
  mesh = jax.sharding.Mesh(np.asarray(deviceless.h200_devices(1)), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  return jax.jit(fn).lower(*args).compile()


# Qwen3-8B attention (32 query heads, 8 kv heads, batch 1, a 16k cache): decode, trees, a prompt chunk;
# with the launch's own splits, one split, and p staged through shared memory (the interpreter's path).
COMPILE_CASES = [(1, 128, {}), (16, 128, {}), (64, 64, {}), (256, 128, {}), (512, 128, dict(block_k=128)),
                 (16, 128, dict(num_splits=1)), (16, 64, dict(p_from_smem=True))]


@pytest.mark.parametrize("num_q,head_dim,launch", COMPILE_CASES,
                         ids=[f"N{n}-d{d}-{'-'.join(f'{k}{v}' for k, v in l.items()) or 'auto'}" for n, d, l in COMPILE_CASES])
def test_compiles_for_h200(num_q, head_dim, launch):
  pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for an H200 needs the CUDA plugin (jax[cuda12])")
  spec = jax.ShapeDtypeStruct
  cache = spec((1, 8, 16384, head_dim), jnp.bfloat16)
  args = (spec((1, num_q, 32, head_dim), jnp.bfloat16), cache, cache, spec((1,), jnp.int32),
          spec((1, num_q, num_q), jnp.bool_))
  compiled = compile_for_h200(lambda *a: tm.tree_attention(*a, **launch), *args)
  assert re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()) == [MOSAIC_CALL]
  assert compiled.memory_analysis().temp_size_in_bytes < 64 << 20


# --- inside the engine ----------------------------------------------------------------------------------

def _f16_models():
  from jetspec_jax.config import Qwen3Config
  from jetspec_jax.models import draft_head, qwen3
  cfg = Qwen3Config(vocab_size=89, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, rope_theta=10000.0)
  f16 = lambda p: {k: v.astype(jnp.float16) for k, v in p.items()}
  tp = f16({k: v * 20 if v.ndim > 1 else v for k, v in qwen3.init_target(cfg, jax.random.key(0)).items()})
  hcfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=4)
  return cfg, tp, hcfg, f16(draft_head.init_head(hcfg, jax.random.key(1)))


@interpreter
def test_the_engine_gives_the_xla_tokens():
  """A float16 model's greedy AR and speculative engines (prefill lanes, tree verification, AR rows) with
  ``--attention mosaic_interpret`` give the tokens of ``--attention xla``. Equal tokens need every
  greedy choice's top-1/top-2 logit gap to exceed the kernel's rounding difference: along these
  tokens the smallest gap is 0.106 (logits up to ~8; measured teacher-forced with XLA). The prompt
  [2, 7] has a gap of 0.015, and there, in bfloat16, the kernel's rounding of p flipped a token."""
  from jetspec_jax.decode.engine import generate
  from jetspec_jax.decode.speculative import TreeConfig
  cfg, tp, hcfg, hp = _f16_models()
  prompts, tree = [[3, 1, 4, 1, 5, 9], [2, 7, 1, 8]], TreeConfig("accum_logp", 8, 3, 3)
  spec = dict(head_cfg=hcfg, head_params=hp, tree=tree)
  ref = generate(cfg, tp, prompts, 6, eos_ids=(), **spec).tokens
  assert len({tuple(t) for t in ref}) == 2
  assert generate(cfg, tp, prompts, 6, eos_ids=(), attn_impl="mosaic_interpret", **spec).tokens == ref
  assert generate(cfg, tp, prompts, 6, eos_ids=(), attn_impl="mosaic_interpret").tokens == ref


def test_attention_names_the_kernel():
  from jetspec_jax.attention import IMPLEMENTATIONS, check_available
  from jetspec_jax.errors import JetSpecError
  assert {"mosaic", "mosaic_interpret"} <= set(IMPLEMENTATIONS)
  if jax.default_backend() != "gpu":
    with pytest.raises(JetSpecError, match="mosaic attention kernel needs a GPU.*mosaic_interpret"):
      check_available("mosaic")


@pytest.mark.skipif(hasattr(plgpu, "InterpretGPUParams"), reason="this jax has the Mosaic GPU interpreter")
def test_interpret_mode_needs_jax_0_12():
  args = _problem(1, num_q=4, group=2, prefixes=(8,), tree="chain", head_dim=64, dtype=jnp.bfloat16)
  with pytest.raises(KernelError, match="jax >= 0.12"):
    tm.tree_attention(*args, interpret=True)


@pytest.mark.parametrize("num_q", [1, 16])
def test_compiles_for_h200_at_a_decode_shard_shape(num_q):
  """One tensor-parallel shard of Qwen3-8B decoding (4 query heads, 1 kv head) over a cache whose length is a
  multiple of 8 but not of the key block (the last block shifted back), as the engine allocates."""
  pytest.importorskip("jax_plugins.xla_cuda12", reason="compiling for an H200 needs the CUDA plugin (jax[cuda12])")
  spec = jax.ShapeDtypeStruct
  cache = spec((1, 1, 4104, 128), jnp.bfloat16)
  args = (spec((1, num_q, 4, 128), jnp.bfloat16), cache, cache, spec((1,), jnp.int32), spec((1, num_q, num_q), jnp.bool_))
  compiled = compile_for_h200(tm.tree_attention, *args)
  assert re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()) == [MOSAIC_CALL]

"""The expert-tile Pallas kernels (``pallas_kernels.expert_tiles``): interpret mode against the XLA reference,
padding tiles skipped, Triton's tile rules, and the CUDA lowering on this CPU machine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_lowering import lower_text
from pallas_kernels import expert_tiles as et
from pallas_kernels.errors import KernelError

TRITON_CALL = "__gpu$xla.gpu.triton"


def problem(g, t, h, i, e, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(g, t, h)), dtype)
  gate, up = (jnp.asarray(rng.normal(size=(e, h, i)) / np.sqrt(h), dtype) for _ in range(2))
  down = jnp.asarray(rng.normal(size=(e, i, h)) / np.sqrt(i), dtype)
  experts = jnp.asarray(np.sort(rng.integers(0, e, g)), jnp.int32)      # tiles of one expert adjacent, as grouped
  return x, gate, up, down, experts


# (tiles, rows per tile, hidden, intermediate, experts): one-row pair tiles (decode), rows under and over
# Triton's 16, an intermediate size that is no power of two (768 = 6 x 128, as Qwen3-30B-A3B's), steps of 16,
# tiles of 128 rows (two row blocks per tile).
CASES = [(6, 1, 64, 32, 4), (5, 4, 128, 96, 3), (3, 32, 64, 48, 2), (4, 16, 256, 768, 8), (2, 8, 48, 16, 2),
         (2, 128, 64, 32, 2)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("g,t,h,i,e", CASES)
def test_kernel_equals_the_xla_reference(g, t, h, i, e, dtype):
  """Every tile through its expert's SwiGLU. float32: to rounding; bfloat16: within two bf16 ulps of the
  output's scale (the kernel keeps the gate and up products in float32 until silu(a) * b is rounded once)."""
  x, gate, up, down, experts = problem(g, t, h, i, e, dtype)
  out = et.tile_swiglu(x, gate, up, down, experts, interpret=True)
  assert out.shape == x.shape and out.dtype == x.dtype
  f32 = [a.astype(jnp.float32) for a in (x, gate, up, down)]
  ref = et.tile_swiglu_reference(*f32, experts, g)
  scale = float(jnp.max(jnp.abs(ref)))
  tol = 1e-5 if dtype == jnp.float32 else 2 * 2.0 ** -7
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=0, atol=tol * scale)
  if dtype == jnp.bfloat16:                          # and as close to XLA's own bfloat16 gather path
    xla = et.tile_swiglu_reference(x, gate, up, down, experts, g)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla, np.float32), rtol=0, atol=tol * scale)


def test_padding_tiles_give_zeros_and_read_nothing():
  """Tiles g >= used are zeros even when their expert ids point past the weights (they are never read)."""
  x, gate, up, down, experts = problem(6, 4, 64, 32, 4, jnp.float32, seed=1)
  experts = experts.at[4:].set(1 << 20)
  out = et.tile_swiglu(x, gate, up, down, experts, 4, interpret=True)
  ref = et.tile_swiglu_reference(x, gate, up, down, experts.at[4:].set(0), 4)
  np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
  assert not np.any(np.asarray(out[4:]))


def test_launch_shapes_follow_triton_rules():
  """Every block a power of two, dot operands >= 16 rows and columns, blocks dividing their dimension."""
  for t, h, i in [(1, 2048, 768), (8, 4096, 1536), (128, 2048, 96), (4, 48, 16)]:
    s = et.launch_shapes(t, h, i)
    assert s.rows == max(t, 16) and s.block_r == min(s.rows, 64) and s.rows % s.block_r == 0
    for block, dim in ((s.block_h, h), (s.block_i, i), (s.block_out_i, i), (s.block_out_h, h)):
      assert block >= 16 and block & (block - 1) == 0 and dim % block == 0, (t, h, i, s)


@pytest.mark.parametrize("t,h,i,match", [(3, 64, 32, "power-of-two row count"),
                                         (4, 64, 8, r"expert intermediate size \(8\)"),
                                         (4, 40, 32, r"hidden size \(40\)")])
def test_untileable_problems_are_refused_in_one_sentence(t, h, i, match):
  with pytest.raises(KernelError, match=match) as e:
    et.launch_shapes(t, h, i)
  assert "\n" not in str(e.value) and str(e.value).endswith(".")


def test_mismatched_inputs_are_refused():
  x, gate, up, down, experts = problem(2, 4, 64, 32, 2, jnp.float32)
  with pytest.raises(KernelError, match="do not match"):
    et.tile_swiglu(x, gate, up, down.transpose(0, 2, 1), experts, interpret=True)
  with pytest.raises(KernelError, match="one dtype"):
    et.tile_swiglu(x.astype(jnp.bfloat16), gate, up, down, experts, interpret=True)


def test_lowers_to_two_triton_kernels_for_cuda():
  """The Qwen3-30B-A3B layer's shapes (128 experts, H 2048, I 768; 240 tiles of 8 rows) lower for an H200
  to two Triton custom calls and nothing gathered: no [G, H, I] copy of the weights in the program."""
  g, t, h, i, e = 240, 8, 2048, 768, 128
  s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  text = lower_text(et.tile_swiglu, s(g, t, h), s(e, h, i), s(e, h, i), s(e, i, h), s(g, dtype=jnp.int32),
                    s(dtype=jnp.int32))
  assert text.count(TRITON_CALL) == 2, text.count(TRITON_CALL)
  assert f"{g}x{h}x{i}" not in text and "gather" not in text

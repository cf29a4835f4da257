"""Grouped SwiGLU over expert tiles, reading each tile's expert weights in place (Pallas, Triton backend).

Same contract as ``tile_swiglu_reference`` (the XLA reference, what ``jetspec_jax.models.moe``'s ``gather``
dispatch computes):
  x        [G, T, H]   G tiles of T rows (a tile's rows all go to one expert; T a power of two)
  gate, up [E, H, I]   the experts' weights (E local experts)
  down     [E, I, H]
  experts  [G] int32   each tile's expert, in 0..E-1
  used     [] int32    tiles g >= used are padding: their outputs are zeros and their weights are never read
  returns  [G, T, H]   silu(x @ gate[e]) * (x @ up[e]) @ down[e] per tile, in x.dtype.

The ``gather`` dispatch copies every tile's expert weights into a [G, H, I] buffer (read, written, read again);
these kernels read them once per tile straight from the [E, H, I] stacks (tiles of one expert are adjacent,
so their repeated reads are the L2 cache's). Two launches:
  1. grid (G, rows / block_r, I / block_out_i): block_r of the tile's rows against a [H, block_out_i] slab of
     gate and of up, contracted over H in steps of block_h, float32 accumulation; writes silu(a) * b in
     x.dtype, [G, rows, I].
  2. grid (G, rows / block_r, H / block_out_h): that against a [I, block_out_h] slab of down, contracted over I
     in steps of block_i.
A tile's T rows are loaded as rows = max(T, 16) (Triton's smallest dot operand), the ones past T masked to zero;
with T < 16 both launches write 16 rows per tile and the caller's result is their first T. Row blocks of at
most 64 keep a program's float32 accumulators at 64 (launch 1: two of 64 x 64) or 128 (launch 2) columns.
Launch sizes are the largest powers of two up to those caps dividing each dimension (``launch_shapes``); a
dimension without a power-of-two divisor >= 16 is refused in one sentence.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.errors import KernelError

MIN_DOT_DIM = 16          # Triton: every dot operand dimension >= 16
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _block(dim: int, cap: int) -> int:
  """The largest power of two <= cap dividing dim."""
  b = cap
  while b > 1 and dim % b:
    b //= 2
  return b


@dataclasses.dataclass(frozen=True)
class LaunchShapes:
  """rows: a tile's rows as loaded (T rounded up to >= 16), block_r of them per program; block_h / block_i: the
  steps contracting H and I; block_out_i / block_out_h: the output columns of one program of launch 1 / 2."""
  rows: int
  block_r: int
  block_h: int
  block_i: int
  block_out_i: int
  block_out_h: int
  num_warps: int = 4
  num_stages: int = 2


def launch_shapes(tile_rows: int, hidden: int, inter: int) -> LaunchShapes:
  """The launch sizes for tiles of ``tile_rows`` rows, hidden size H and expert intermediate size I, or
  ``KernelError`` naming the dimension Triton cannot tile."""
  if tile_rows < 1 or tile_rows & (tile_rows - 1):
    raise KernelError(f"expert tiles need a power-of-two row count, got {tile_rows}.")
  for name, dim in (("hidden size", hidden), ("expert intermediate size", inter)):
    if _block(dim, 128) < MIN_DOT_DIM:
      raise KernelError(f"the {name} ({dim}) has no power-of-two divisor >= {MIN_DOT_DIM}, which the Triton "
                        f"expert-tile kernel needs; use the gather dispatch.")
  rows = max(tile_rows, MIN_DOT_DIM)
  block_r = min(rows, 64)
  return LaunchShapes(rows=rows, block_r=block_r, block_h=_block(hidden, 64), block_i=_block(inter, 64),
                      block_out_i=_block(inter, 128 if block_r <= 32 else 64), block_out_h=_block(hidden, 128),
                      num_warps=4 if block_r <= 32 else 8)


def tile_swiglu_reference(x, gate, up, down, experts, used):
  """The XLA reference: each tile against gathered copies of its expert's weights; tiles >= used give zeros."""
  a = jnp.einsum("gth,ghi->gti", x, gate[experts])
  b = jnp.einsum("gth,ghi->gti", x, up[experts])
  y = jnp.einsum("gti,gih->gth", jax.nn.silu(a) * b, down[experts])
  return jnp.where((jnp.arange(x.shape[0]) < used)[:, None, None], y, 0).astype(x.dtype)


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _load_rows(ref, g, first, rows, start, size):
  """Rows first..first+rows-1 of tile g of ``ref`` [G, T, C] at columns start..start+size-1; rows past T are
  zeros."""
  r = first + jnp.arange(rows)
  tile_rows = ref.shape[1]
  at = ref.at[g, jnp.minimum(r, tile_rows - 1)[:, None], (start + jnp.arange(size))[None, :]]
  return plgpu.load(at, mask=(r < tile_rows)[:, None], other=0)


def _store_tile(used_ref, g, out_at, shape, dtype, compute) -> None:
  """Tile g's block: ``compute()`` (float32 ``shape``) cast to ``dtype`` at ``out_at`` for a used tile, zeros for
  a padding tile (g >= used), which reads nothing."""
  @pl.when(g < used_ref[0])
  def _():
    plgpu.store(out_at, compute().astype(dtype))

  @pl.when(g >= used_ref[0])
  def _():
    plgpu.store(out_at, jnp.zeros(shape, dtype))


def _gate_up_kernel(used_ref, experts_ref, x_ref, gate_ref, up_ref, h_ref, *, shapes: LaunchShapes):
  """Program (g, r, n): h[g, r-th row block, n-th block of I] = silu(x @ gate[e][:, n]) * (x @ up[e][:, n])."""
  g, r, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  br, bh, bo = shapes.block_r, shapes.block_h, shapes.block_out_i

  def compute():
    e = experts_ref[g]

    def step(j, acc):
      x = _load_rows(x_ref, g, r * br, br, j * bh, bh)
      wg = gate_ref[e, pl.ds(j * bh, bh), pl.ds(n * bo, bo)]
      wu = up_ref[e, pl.ds(j * bh, bh), pl.ds(n * bo, bo)]
      dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=_precision(x.dtype))
      return acc[0] + dot(x, wg), acc[1] + dot(x, wu)

    zero = jnp.zeros((br, bo), jnp.float32)
    a, b = lax.fori_loop(0, x_ref.shape[2] // bh, step, (zero, zero))
    return a * jax.nn.sigmoid(a) * b

  _store_tile(used_ref, g, h_ref.at[g, pl.ds(r * br, br), pl.ds(n * bo, bo)], (br, bo), h_ref.dtype, compute)


def _down_kernel(used_ref, experts_ref, h_ref, down_ref, y_ref, *, shapes: LaunchShapes):
  """Program (g, r, n): y[g, r-th row block, n-th block of H] = h @ down[e][:, n] (h and y: [G, rows, .])."""
  g, r, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  br, bi, bo = shapes.block_r, shapes.block_i, shapes.block_out_h

  def compute():
    e = experts_ref[g]

    def step(j, acc):
      h = h_ref[g, pl.ds(r * br, br), pl.ds(j * bi, bi)]
      w = down_ref[e, pl.ds(j * bi, bi), pl.ds(n * bo, bo)]
      return acc + jnp.dot(h, w, preferred_element_type=jnp.float32, precision=_precision(h.dtype))

    return lax.fori_loop(0, h_ref.shape[2] // bi, step, jnp.zeros((br, bo), jnp.float32))

  _store_tile(used_ref, g, y_ref.at[g, pl.ds(r * br, br), pl.ds(n * bo, bo)], (br, bo), y_ref.dtype, compute)


def check_problem(x, gate, up, down, experts) -> None:
  """Raise ``KernelError`` unless the shapes and dtypes are the module docstring's."""
  if x.ndim != 3 or gate.ndim != 3 or experts.ndim != 1:
    raise KernelError(f"expected x [G, T, H], gate [E, H, I] and experts [G], got {x.shape}, {gate.shape} "
                      f"and {experts.shape}.")
  g, _, h = x.shape
  e, _, i = gate.shape
  if gate.shape != (e, h, i) or up.shape != gate.shape or down.shape != (e, i, h) or experts.shape != (g,):
    raise KernelError(f"expert weights gate {gate.shape}, up {up.shape}, down {down.shape} and experts "
                      f"{experts.shape} do not match x {x.shape} (gate/up [E, H, I], down [E, I, H], experts [G]).")
  if x.dtype not in SUPPORTED_DTYPES or len({x.dtype, gate.dtype, up.dtype, down.dtype}) != 1:
    raise KernelError(f"expert tiles need one dtype among float32/bfloat16/float16 for x and the weights, got "
                      f"{x.dtype}, {gate.dtype}, {up.dtype}, {down.dtype}.")


def tile_swiglu(x, gate, up, down, experts, used=None, *, interpret: bool = False):
  """The grouped SwiGLU of the module docstring with the two Pallas launches; ``used`` None: every tile."""
  check_problem(x, gate, up, down, experts)
  shapes = launch_shapes(x.shape[1], x.shape[2], gate.shape[2])
  used = jnp.asarray(x.shape[0] if used is None else used, jnp.int32).reshape(1)
  return _launch(x, gate, up, down, experts.astype(jnp.int32), used, shapes=shapes, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("shapes", "interpret"))
def _launch(x, gate, up, down, experts, used, *, shapes: LaunchShapes, interpret: bool):
  g, t, h = x.shape
  inter, rows = gate.shape[2], shapes.rows
  params = plgpu.CompilerParams(num_warps=shapes.num_warps, num_stages=shapes.num_stages)
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  act = pl.pallas_call(
      functools.partial(_gate_up_kernel, shapes=shapes),
      grid=(g, rows // shapes.block_r, inter // shapes.block_out_i),
      in_specs=[whole(used), whole(experts), whole(x), whole(gate), whole(up)],
      out_specs=pl.BlockSpec((g, rows, inter), lambda *_: (0, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((g, rows, inter), x.dtype),
      compiler_params=params, interpret=interpret, name="expert_tiles_gate_up",
  )(used, experts, x, gate, up)
  y = pl.pallas_call(
      functools.partial(_down_kernel, shapes=shapes),
      grid=(g, rows // shapes.block_r, h // shapes.block_out_h),
      in_specs=[whole(used), whole(experts), whole(act), whole(down)],
      out_specs=pl.BlockSpec((g, rows, h), lambda *_: (0, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((g, rows, h), x.dtype),
      compiler_params=params, interpret=interpret, name="expert_tiles_down",
  )(used, experts, act, down)
  return y if rows == t else y[:, :t]

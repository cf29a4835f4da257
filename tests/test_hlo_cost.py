"""``jetspec_jax.hlo_cost`` on programs compiled here (the text format is XLA's on every backend): a kernel that
slices a large operand reads the slice, an in-place update writes the update, dots count 2 x M x N x K, a loop
with a known trip count repeats its kernels, a scoped loop body is found by its variant, and the roofline adds
what each kernel bounds plus launches."""
import jax
import jax.numpy as jnp
import pytest

from jetspec_jax import hlo_cost


def compiled_text(fn, *args, donate=()) -> str:
  return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()


def kernels(fn, *args, **kw) -> list[hlo_cost.Kernel]:
  comps, entry = hlo_cost.parse(compiled_text(fn, *args, **kw))
  return hlo_cost.kernels_of(comps, entry)


def test_a_slice_of_a_large_operand_reads_the_slice():
  big = jnp.zeros((1 << 20,), jnp.float32)                          # 4 MiB
  t = hlo_cost.totals(kernels(lambda x, i: jax.lax.dynamic_slice(x, (i,), (256,)) * 2.0, big, jnp.int32(5)))
  assert 256 * 4 <= t["bytes_read"] <= 4 * 256 * 4 and t["bytes_written"] <= 2 * 256 * 4, t


def test_an_in_place_update_writes_the_update_only():
  buf = jnp.zeros((1 << 20,), jnp.float32)
  upd = jnp.ones((256,), jnp.float32)
  t = hlo_cost.totals(kernels(lambda b, u, i: jax.lax.dynamic_update_slice(b, u * 2.0, (i,)), buf, upd,
                              jnp.int32(7), donate=(0,)))
  assert t["bytes_written"] <= 2 * 256 * 4 and t["bytes_read"] <= 4 * 256 * 4, t


def test_a_dot_counts_two_flops_per_multiply_add_and_reads_its_operands():
  a, b = jnp.ones((64, 128), jnp.float32), jnp.ones((128, 32), jnp.float32)
  t = hlo_cost.totals(kernels(lambda a, b: a @ b, a, b))
  assert t["flops"] == 2 * 64 * 128 * 32
  assert t["bytes_read"] >= (64 * 128 + 128 * 32) * 4 and t["bytes_written"] >= 64 * 32 * 4, t


def test_a_loop_with_a_known_trip_count_repeats_its_kernels():
  a = jnp.ones((64, 64), jnp.float32)
  once = hlo_cost.totals(kernels(lambda a: jnp.tanh(a @ a), a))["flops"]
  looped = hlo_cost.totals(kernels(lambda a: jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ a), a), a))
  assert looped["flops"] == 5 * once == 5 * 2 * 64 ** 3, looped


def test_the_scoped_loop_bodies_are_found_in_order():
  """Two loops in a named scope (as the engine's round bodies): variant 0 is the first, 1 the second."""
  a = jnp.ones((32, 32), jnp.float32)

  def fn(a, n):
    with jax.named_scope("bodies"):
      x = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ a), (0, a))[1]
      y = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ c[1] @ a)), (0, x))[1]
    return y

  text = compiled_text(fn, a, jnp.int32(3))
  comps, _ = hlo_cost.parse(text)
  assert len(hlo_cost.scoped_loop_bodies(comps, "bodies")) == 2
  first = hlo_cost.totals(hlo_cost.round_kernels(text, "bodies", 0))["flops"]
  second = hlo_cost.totals(hlo_cost.round_kernels(text, "bodies", 1))["flops"]
  assert (first, second) == (2 * 32 ** 3, 2 * 2 * 32 ** 3)
  body = hlo_cost.round_body(text, "bodies", 0)[1]
  assert hlo_cost.unknown_trip_loops(comps, body) == 0


def test_roofline_is_the_larger_bound_per_kernel_plus_launches():
  dev = hlo_cost.Device("test", bandwidth=1e9, peak=1e12, launch_s=1e-6, source="test")
  ks = [hlo_cost.Kernel("a", "fusion", "?", 1e6, 0.0, 1e6), hlo_cost.Kernel("b", "fusion", "?", 0.0, 0.0, 1e10,
                                                                             count=2)]
  r = hlo_cost.roofline(ks, dev)
  assert r["kernel_time_s"] == pytest.approx(1e-3 + 2 * 1e-2)
  assert r["time_s"] == pytest.approx(r["kernel_time_s"] + 3e-6)


def test_array_bytes_reads_every_array_of_a_shape():
  assert hlo_cost.array_bytes("(bf16[4,8]{1,0}, f32[3]{0}, pred[])") == 4 * 8 * 2 + 12 + 1


# XLA:TPU's text for a weight slice prefetched into VMEM (S(1)), a vector copied there, a fusion reading both there
# and its output evicted back to device memory (the layouts' memory spaces are what matter).
ON_CHIP_HLO = """HloModule m

%fused_computation (param_0: bf16[256,128], param_1: bf16[128]) -> bf16[256] {
  %param_0 = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1 = bf16[128]{0:T(256)S(1)} parameter(1)
  ROOT %dot = bf16[256]{0:T(256)S(1)} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[1024,128], x: bf16[128]) -> bf16[256] {
  %w = bf16[1024,128]{1,0:T(8,128)(2,1)} parameter(0)
  %x = bf16[128]{0:T(256)} parameter(1)
  %slice-start = ((bf16[1024,128]{1,0:T(8,128)(2,1)}), bf16[256,128]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:256], [0:128]}
  %slice-done = bf16[256,128]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start)
  %copy-start = (bf16[128]{0:T(256)S(1)}, bf16[128]{0:T(256)}, u32[]{:S(2)}) copy-start(%x)
  %copy-done = bf16[128]{0:T(256)S(1)} copy-done(%copy-start)
  %fusion = bf16[256]{0:T(256)S(1)} fusion(%slice-done, %copy-done), kind=kOutput, calls=%fused_computation
  %copy-start.1 = (bf16[256]{0:T(256)}, bf16[256]{0:T(256)S(1)}, u32[]{:S(2)}) copy-start(%fusion)
  ROOT %copy-done.1 = bf16[256]{0:T(256)} copy-done(%copy-start.1)
}
"""


def test_arrays_on_chip_move_nothing_and_async_copies_move_what_they_copy():
  """Device-memory bytes only: the slice prefetched into VMEM is read once by its copy (its slice, not the whole
  weight), the fusion reading VMEM operands into VMEM moves nothing, and the eviction writes its output back."""
  comps, entry = hlo_cost.parse(ON_CHIP_HLO)
  by_name = {k.name: k for k in hlo_cost.kernels_of(comps, entry)}
  assert set(by_name) == {"slice-start", "copy-start", "fusion", "copy-start.1"}
  assert (by_name["slice-start"].bytes_read, by_name["slice-start"].bytes_written) == (256 * 128 * 2, 0)
  assert (by_name["copy-start"].bytes_read, by_name["copy-start"].bytes_written) == (128 * 2, 0)
  assert (by_name["fusion"].bytes_read, by_name["fusion"].bytes_written) == (0, 0)
  assert by_name["fusion"].flops == 2 * 256 * 128
  assert (by_name["copy-start.1"].bytes_read, by_name["copy-start.1"].bytes_written) == (0, 256 * 2)
  assert hlo_cost.array_bytes("(bf16[4]{0:T(256)S(1)}, f32[2]{0})") == 8
  assert hlo_cost.array_bytes("(bf16[4]{0:T(256)S(1)}, f32[2]{0})", on_chip=True) == 16

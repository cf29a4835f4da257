"""On a GPU: the Pallas tree-attention kernel, compiled by Triton, against the XLA reference at Qwen3-8B
attention shapes (B=1, 32 query heads, 8 kv heads, head_dim 128, bf16) over the sweep bench/gpu_check.py
times, with the prefix splits the kernel chooses and with one split. Skipped without a GPU."""
import jax
import jax.numpy as jnp
import pytest

from jetspec_jax.attention import xla_attention
from pallas_kernels.tree_attention import tree_attention
from test_tree_attention import TOLERANCE, _problem, _rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (the kernel compiled by Triton)")]


@pytest.mark.parametrize("num_splits", [None, 1], ids=["chosen_splits", "one_split"])
@pytest.mark.parametrize("prefix", [1024, 4096, 16384])
@pytest.mark.parametrize("num_q", [1, 16, 64, 128, 256])
def test_kernel_matches_xla_at_qwen3_8b_shapes(num_q, prefix, num_splits):
  q, k, v, prefix_len, mask = _problem(1000 * num_q + prefix, num_q=num_q, group=4, prefixes=(prefix,),
                                       tree="random", head_dim=128, dtype=jnp.bfloat16, num_kv=8, slack=0)
  kernel = jax.jit(lambda *a: tree_attention(*a, **({} if num_splits is None else {"num_splits": num_splits})))
  out = kernel(q, k, v, prefix_len, mask)
  assert _rel_err(out, jax.jit(xla_attention)(q, k, v, prefix_len, mask)) <= TOLERANCE[jnp.bfloat16]

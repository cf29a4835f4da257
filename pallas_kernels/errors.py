"""The kernels' own error type (a problem with the inputs or the launch configuration, in one sentence) and
the input checks both tree-attention kernels share."""


class KernelError(ValueError):
  """An unsupported shape, an illegal launch or a bad tuning table (``jetspec_jax.attention`` turns it into
  the project's ``JetSpecError``)."""


def check_problem(q, k_cache, v_cache, prefix_len, block_mask) -> tuple[int, int, int, int, int, int]:
  """The kernels' shape contract (``pallas_kernels.reference``): returns (B, T, Hq, Dh, Hkv, S) or raises
  ``KernelError``. Dtypes are each kernel's own check."""
  if q.ndim != 4 or k_cache.ndim != 4:
    raise KernelError(
        f"expected q [B, T, Hq, Dh] and k_cache [B, Hkv, S, Dh], got {q.shape} and {k_cache.shape}.")
  batch, num_q, num_q_heads, head_dim = q.shape
  _, num_kv_heads, cache_len, _ = k_cache.shape
  if k_cache.shape != v_cache.shape or k_cache.shape[0] != batch or k_cache.shape[3] != head_dim:
    raise KernelError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must both be "
                      f"[B, Hkv, S, Dh] for q {q.shape}.")
  if block_mask.shape != (batch, num_q, num_q) or prefix_len.shape != (batch,):
    raise KernelError(f"expected block_mask [B, T, T] and prefix_len [B] for q {q.shape}, "
                      f"got {block_mask.shape} and {prefix_len.shape}.")
  if cache_len < num_q:
    raise KernelError(f"the cache ({cache_len} positions) cannot hold the {num_q} new rows.")
  return batch, num_q, num_q_heads, head_dim, num_kv_heads, cache_len


def check_heads(batch: int, num_q: int, num_q_heads: int, num_kv_heads: int) -> None:
  """Raise ``KernelError`` unless there is a batch row and a query and the query heads are a multiple of
  the kv heads."""
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    raise KernelError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads}).")
  if batch < 1 or num_q < 1:
    raise KernelError(f"tree attention needs a batch row and a query, got B={batch}, T={num_q}.")

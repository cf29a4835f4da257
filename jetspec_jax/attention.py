"""Masked attention over a KV cache: the one interface verification, prefill and decode use.

Layout (shared by every implementation):
  q          [B, T, Hq, Dh]   queries of T new rows (a prompt chunk, one decode token, or N tree nodes)
  k_cache    [B, Hkv, S, Dh]  keys; the T new rows' own keys are already written at
  v_cache    [B, Hkv, S, Dh]  cache positions prefix_len[b] + t, t < T
  prefix_len [B] int32        committed keys 0..prefix_len[b]-1 are visible to every query
  block_mask [B, T, T] bool   block_mask[b, i, t]: query i may see new key t (position prefix_len[b]+t);
                              the diagonal must be True (every row sees itself; padding rows too)
  returns    [B, T, Hq, Dh]   in q.dtype; scores and softmax in float32; Hq = Hkv * group.

Implementations: ``xla`` (reference, any backend), ``xla_chunked`` (the same numerics one block
of ``QUERY_CHUNK`` queries at a time: its float32 scores are [B, Hkv, G, QUERY_CHUNK, S], never
[B, Hkv, G, T, S]; for long prompts and training's frozen target), ``xla_ragged`` (on paged caches, each
sequence's own pages only, ``RAGGED_CHUNK_ROWS`` at a time in a loop whose trip count follows the rows the
batch holds: CPU's choice; on contiguous caches ``xla``), ``pallas`` (the Pallas Triton
kernel of ``pallas_kernels.tree_attention``; ``pallas_interpret`` runs it on CPU) and ``mosaic`` (the
Pallas Mosaic GPU kernel for Hopper, ``pallas_kernels.tree_attention_mgpu``, 16-bit inputs only;
``mosaic_interpret`` runs it in jax >= 0.12's Mosaic GPU interpreter) and ``tpu`` (the Pallas Mosaic TPU kernel,
``pallas_kernels.tree_attention_tpu``, float32 / bfloat16; ``tpu_interpret`` runs it in Pallas's TPU interpreter).
The choice travels as a
static value: a name, or an ``AttentionImpl`` that also carries the Triton kernel's launch tuning table.

Paged caches (``paged_attention``): k_pool / v_pool [G, Pg, Hkv, R, Dh] and a page table [B, T'] of page ids
within each row's group (``jetspec_jax.pages``) stand for the caches ``pages.gather`` makes of them. ``xla`` and
``xla_chunked`` attend over exactly that gathered copy (every sequence as long as the table or ``length``);
``xla_ragged`` and the kernels read each sequence's pages through the table, up to its own rows.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jetspec_jax import pages
from jetspec_jax.errors import JetSpecError
from pallas_kernels.errors import KernelError
from pallas_kernels.reference import cpu_upcast, masked_attention, visible_keys, xla_attention
from pallas_kernels.tuning import KernelTuning, load_tuning

IMPLEMENTATIONS = ("xla", "xla_chunked", "xla_ragged", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret",
                   "tpu", "tpu_interpret")
# KV cache lengths: the Mosaic GPU kernel's TMA boxes start at multiples of 8 rows; the TPU kernel's bf16 key blocks
# are whole (16, 128) VMEM tiles (``tree_attention_tpu.ROW_TILE``).
CACHE_ROWS_MULTIPLE = 16


def cache_rows(rows: int) -> int:
  """A KV cache length holding ``rows`` rows: rounded up to ``CACHE_ROWS_MULTIPLE``."""
  return -(-rows // CACHE_ROWS_MULTIPLE) * CACHE_ROWS_MULTIPLE
QUERY_CHUNK = 256   # queries per block of ``xla_chunked``
RAGGED_CHUNK_ROWS = 128   # ``xla_ragged``: key rows per chunk (whole pages: at least one page)
RAGGED_BLOCK = 8          # ``xla_ragged``: chunks per loop iteration
FLOOR = -1e30             # ``xla_ragged``: the running max of a row that has seen no key yet


@dataclasses.dataclass(frozen=True)
class AttentionImpl:
  """A static attention choice: ``name`` (one of ``IMPLEMENTATIONS``) and the kernel's launch ``tuning``
  (None: the kernel's default table; ignored by the XLA implementations). Hashable (a jit static)."""
  name: str = "xla"
  tuning: KernelTuning | None = None


def resolve_implementation(name: str | None, kernel_tuning: str | os.PathLike | None = None) -> AttentionImpl:
  """'auto' / None -> ``pallas`` on GPU, ``tpu`` on TPU, ``xla_ragged`` on CPU, ``xla`` elsewhere; other names are
  checked. ``kernel_tuning``: a tuning table file (JSON, see ``pallas_kernels.tuning``) for the Triton kernel, read
  and checked here."""
  if name in (None, "auto"):
    name = {"gpu": "pallas", "tpu": "tpu", "cpu": "xla_ragged"}.get(jax.default_backend(), "xla")
  if name not in IMPLEMENTATIONS:
    raise JetSpecError(f"unknown attention implementation {name!r}; choose auto or one of {', '.join(IMPLEMENTATIONS)}")
  check_available(name)
  try:
    tuning = None if kernel_tuning is None else load_tuning(kernel_tuning)
  except KernelError as e:
    raise JetSpecError(str(e)) from None
  return AttentionImpl(name, tuning)


def check_available(impl: str) -> None:
  """The compiled kernels run only on their accelerator (``pallas``, ``mosaic``: a GPU; ``tpu``: a TPU); say so
  instead of failing inside Pallas. Checked where an implementation is resolved, not in ``attention``, which must
  still trace the kernel on a CPU for a deviceless lowering (``lowering_platforms=("cuda",)``, a TPU topology)."""
  backend = jax.default_backend()
  needs = {"pallas": "gpu", "mosaic": "gpu", "tpu": "tpu"}.get(impl)
  if needs and backend != needs:
    raise JetSpecError(f"the {impl} attention kernel needs a {needs.upper()} but jax's backend is {backend}; use "
                       f"{impl}_interpret (the same kernel in interpret mode on {backend}, slow) or xla")


def chunked_attention(q, k_cache, v_cache, prefix_len, block_mask, *, sm_scale: float | None = None,
                      chunk: int = QUERY_CHUNK):
  """``xla_attention`` over blocks of ``chunk`` queries in a ``lax.map`` (each block's softmax spans
  all S keys, so the result is the reference's up to float32 rounding). T is padded to a multiple of
  ``chunk`` with rows that see no new key, dropped from the output. Shapes: the module docstring."""
  num_q = q.shape[1]
  if num_q <= chunk:
    return xla_attention(q, k_cache, v_cache, prefix_len, block_mask, sm_scale=sm_scale)
  num_chunks = -(-num_q // chunk)
  pad = num_chunks * chunk - num_q
  q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  block_mask = jnp.pad(block_mask, ((0, 0), (0, pad), (0, 0)))             # [B, T', T]: padding rows see no key

  def one(start):
    qc = jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1)
    rows = jax.lax.dynamic_slice_in_dim(block_mask, start, chunk, axis=1)     # [B, C, T]
    return masked_attention(qc, k_cache, v_cache, visible_keys(prefix_len, rows, k_cache.shape[2]), sm_scale)

  out = jax.lax.map(one, jnp.arange(num_chunks, dtype=jnp.int32) * chunk)   # [n, B, C, Hq, Dh]
  out = jnp.moveaxis(out, 0, 1).reshape(q.shape)
  return out[:, :num_q]


def ragged_paged_attention(q, k_pool, v_pool, table, prefix_len, block_mask, *, sm_scale: float | None = None,
                           length: int | None = None, chunk_rows: int = RAGGED_CHUNK_ROWS,
                           block: int = RAGGED_BLOCK):
  """``paged_attention`` in XLA reading each sequence's own pages only: its keys 0 .. prefix_len[b] + T - 1 (at
  most ``length``) in chunks of whole pages (``chunk_rows`` rounded to pages), ``block`` chunks of the group's
  sequences per iteration of a while loop that runs until every chunk is seen: the work follows the rows the
  sequences hold, not the longest one. A sequence holding no page (table[b, 0] < 0) reads nothing and gives
  zeros. Rows past a sequence's own (the rest of its last chunk) are read but masked: like the gathered path,
  this needs finite values there (the engine's pools only ever hold finite rows). Each chunk's softmax statistics (max, sum, weighted values) in float32 merge into its sequence's, so the
  result is the gathered ``xla``'s up to float32 rounding. Shapes: ``paged_attention``; per group (vmapped)."""
  groups, _, num_kv, page_rows, head_dim = k_pool.shape
  batch, num_q, num_heads, _ = q.shape
  per, group = batch // groups, num_heads // num_kv
  chunk_pages = max(1, chunk_rows // page_rows)
  width = chunk_pages * page_rows
  length = length or table.shape[1] * page_rows
  scale = head_dim ** -0.5 if sm_scale is None else sm_scale
  table = jnp.pad(table, ((0, 0), (0, chunk_pages)))        # a chunk's page ids never run off the table

  def one_group(k_g, v_g, q_g, table_g, start_g, mask_g):
    reach = jnp.minimum(start_g + num_q, length)
    chunks = jnp.where(table_g[:, 0] >= 0, -(-reach // width), 0)                     # [S]
    ends = jnp.cumsum(chunks)
    total = ends[-1]
    qg = q_g.reshape(per, num_q, num_kv, group, head_dim)

    def step(carry):
      i, m, l, o = carry
      k = i * block + jnp.arange(block)                                               # this block's chunks
      valid = k < total
      seq = jnp.minimum(jnp.searchsorted(ends, k, side="right", method="compare_all"), per - 1)
      first = (k - (ends[seq] - chunks[seq])) * chunk_pages                         # its first page in the table
      ids = jax.vmap(lambda b, f: jax.lax.dynamic_slice_in_dim(table_g[b], f, chunk_pages))(seq, first)
      rows = lambda pool: pool[jnp.maximum(ids, 0)]                                   # [K, P, Hkv, R, Dh]
      pos = first[:, None] * page_rows + jnp.arange(width)                           # [K, W] cache rows
      start = start_g[seq][:, None]
      new = jnp.clip(pos - start, 0, num_q - 1)
      in_block = jnp.take_along_axis(mask_g[seq], jnp.broadcast_to(new[:, None], (block, num_q, width)), axis=2)
      in_new = ((pos >= start) & (pos < start + num_q))[:, None] & in_block
      seen = ((pos < start)[:, None] | in_new) & (valid[:, None] & (pos < length))[:, None]    # [K, T, W]
      scores = jnp.einsum("ktngd,kpnrd->kngtpr", *cpu_upcast(qg[seq], rows(k_g)), preferred_element_type=jnp.float32)
      scores = jnp.where(seen[:, None, None], scores.reshape(seen.shape[:1] + scores.shape[1:4] + (width,)) * scale,
                         -jnp.inf)
      top = jnp.maximum(jnp.max(scores, axis=-1), FLOOR)                               # [K, Hkv, G, T]
      probs = jnp.exp(scores - top[..., None])
      part = jnp.einsum("kngtpr,kpnrd->kngtd",
                        *cpu_upcast(probs.astype(v_g.dtype).reshape(scores.shape[:4] + (chunk_pages, page_rows)),
                                    rows(v_g)), preferred_element_type=jnp.float32)
      seq = jnp.where(valid, seq, per)                                                # padding chunks: dropped
      m_new = m.at[seq].max(top, mode="drop")
      l, o = l * jnp.exp(m - m_new), o * jnp.exp(m - m_new)[..., None]
      w = jnp.exp(top - m_new[jnp.minimum(seq, per - 1)])
      l = l.at[seq].add(jnp.sum(probs, axis=-1) * w, mode="drop")
      o = o.at[seq].add(part * w[..., None], mode="drop")
      return i + 1, m_new, l, o

    stats = (per, num_kv, group, num_q)
    init = (jnp.int32(0), jnp.full(stats, FLOOR, jnp.float32), jnp.zeros(stats, jnp.float32),
            jnp.zeros(stats + (head_dim,), jnp.float32))
    _, _, l, o = jax.lax.while_loop(lambda c: c[0] * block < total, step, init)
    out = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None], 0.0)   # no key seen: zeros
    return out.transpose(0, 3, 1, 2, 4).reshape(per, num_q, num_heads, head_dim)

  by_group = lambda x: x.reshape((groups, per) + x.shape[1:])
  out = jax.vmap(one_group)(k_pool, v_pool, by_group(q), by_group(table), by_group(prefix_len), by_group(block_mask))
  return out.reshape(q.shape).astype(q.dtype)


def _kernel_specs(mesh, batch: int, num_heads: int, num_kv: int, groups: int | None = None):
  """shard_map specs for the kernel: batch over ``data`` and heads over ``model`` where they divide. With
  ``groups`` (paged): the inputs are q, the pools [G, Pg, Hkv, R, Dh] (groups over ``data`` with the batch), the
  table [B, T'], prefix_len and block_mask."""
  data = "data" if batch % mesh.shape["data"] == 0 and (groups or batch) % mesh.shape["data"] == 0 else None
  model = "model" if num_heads % mesh.shape["model"] == 0 and num_kv % mesh.shape["model"] == 0 else None
  caches = (P(data, model, None, None),) * 2 if groups is None else (P(data, None, model, None, None),) * 2 + (
      P(data, None),)
  return (P(data, None, model, None), *caches, P(data), P(data, None, None)), P(data, None, model, None)


def _kernel(impl: str | AttentionImpl, paged: bool, sm_scale: float | None):
  """The kernel entry point of a kernel implementation (contiguous or ``paged``), its launch options bound."""
  impl, tuning = (impl.name, impl.tuning) if isinstance(impl, AttentionImpl) else (impl, None)
  if impl in ("mosaic", "mosaic_interpret"):
    from pallas_kernels import tree_attention_mgpu as kernel
    options = dict(interpret=impl == "mosaic_interpret")
  elif impl in ("pallas", "pallas_interpret"):
    from pallas_kernels import tree_attention as kernel
    options = dict(interpret=impl == "pallas_interpret", tuning=tuning)
  elif impl in ("tpu", "tpu_interpret"):
    from pallas_kernels import tree_attention_tpu as kernel
    options = dict(interpret=impl == "tpu_interpret")
  else:
    raise JetSpecError(f"unknown attention implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
  entry = kernel.paged_tree_attention if paged else kernel.tree_attention
  return functools.partial(entry, sm_scale=sm_scale, **options)


def _run_kernel(fn, mesh, specs, *args):
  """``fn(*args)``, per shard under a ``mesh`` (shard_map with ``specs``); kernel errors as ``JetSpecError``. A mesh
  of one device runs it in shard_map too when that device is not jax's backend's (a deviceless compile: the
  kernel's lowering needs the device, e.g. a TPU's kind)."""
  if mesh is not None and (mesh.size > 1 or mesh.devices.flat[0].platform != jax.default_backend()):
    fn = jax.shard_map(fn, mesh=mesh, in_specs=specs[0], out_specs=specs[1], check_vma=False)
  try:
    return fn(*args)
  except KernelError as e:
    raise JetSpecError(str(e)) from None


def _name(impl: str | AttentionImpl) -> str:
  return impl.name if isinstance(impl, AttentionImpl) else impl


def _xla(impl: str | AttentionImpl):
  """The XLA implementation of ``impl`` on contiguous caches (``xla_ragged``'s is ``xla``'s), or None for a
  kernel."""
  name = _name(impl)
  return {"xla": xla_attention, "xla_chunked": chunked_attention, "xla_ragged": xla_attention}.get(name)


def attention(q, k_cache, v_cache, prefix_len, block_mask, *, impl: str | AttentionImpl = "xla",
              sm_scale: float | None = None, mesh=None):
  """Dispatch to an implementation (a static choice: a name or an ``AttentionImpl``). Under a ``mesh``
  the kernel runs per shard (shard_map over batch and heads); XLA's attention is partitioned by the
  compiler. The kernel's input errors come out as ``JetSpecError``."""
  if xla := _xla(impl):
    return xla(q, k_cache, v_cache, prefix_len, block_mask, sm_scale=sm_scale)
  specs = None if mesh is None else _kernel_specs(mesh, q.shape[0], q.shape[2], k_cache.shape[1])
  return _run_kernel(_kernel(impl, False, sm_scale), mesh, specs, q, k_cache, v_cache, prefix_len, block_mask)


def paged_attention(q, k_pool, v_pool, table, prefix_len, block_mask, *, impl: str | AttentionImpl = "xla",
                    sm_scale: float | None = None, mesh=None, length: int | None = None):
  """``attention`` over page pools k_pool, v_pool [G, Pg, Hkv, R, Dh] read through ``table`` [B, T'] (the module
  docstring): the result of ``attention`` over ``pages.gather`` of the pools' first ``length`` rows (None: the
  table's T' x R). ``xla`` and ``xla_chunked`` attend over that gathered copy; ``xla_ragged`` reads each sequence's
  own pages (``ragged_paged_attention``) and the kernels the table's first cdiv(length, R) pages, page by page,
  both under a ``mesh`` per shard (pools' groups and the batch over ``data``, heads over ``model``)."""
  length = length or table.shape[1] * k_pool.shape[3]
  specs = None if mesh is None else _kernel_specs(mesh, q.shape[0], q.shape[2], k_pool.shape[2], k_pool.shape[0])
  if _name(impl) == "xla_ragged":          # per shard: each data shard's loop runs its own trips
    fn = functools.partial(ragged_paged_attention, sm_scale=sm_scale, length=length)
    return _run_kernel(fn, mesh, specs, q, k_pool, v_pool, table, prefix_len, block_mask)
  if xla := _xla(impl):
    return xla(q, pages.gather(k_pool, table, length), pages.gather(v_pool, table, length), prefix_len, block_mask,
               sm_scale=sm_scale)
  table = table[:, :pages.pages_for(length, k_pool.shape[3])]
  return _run_kernel(_kernel(impl, True, sm_scale), mesh, specs, q, k_pool, v_pool, table, prefix_len, block_mask)

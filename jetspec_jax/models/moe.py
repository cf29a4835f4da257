"""Qwen3-MoE expert dispatch: routing, grouping by expert, and a tiled grouped matmul in plain XLA.

Every MoE forward (prefill, tree verification, AR decode, training's frozen target) goes through
``moe_mlp``. Routing is transformers': float32 softmax over all E experts, top-k, renormalised only
with ``norm_topk_prob``. The N = M*k (token, expert) pairs are sorted by expert, each expert's group
is padded up to a multiple of the row tile T, and the C = round_up(N + min(E, N) * (T - 1), T) rows
of a static buffer (an upper bound on the padded rows: no token is ever dropped) form C/T tiles,
each one [T, H] x [H, I] SwiGLU against its expert's weights. Three ways to run the tiles
(``DISPATCHES``, ``Qwen3Config.moe_dispatch``; "auto": ``loop`` on CPU, ``kernel`` on a GPU, ``gather``
elsewhere):

* ``loop``: a ``fori_loop`` over the tiles, each reading its expert's weights in place; tiles past
  the used ones are skipped (``lax.cond``). No copy of any weight. On XLA:CPU the loop is free; on
  XLA:GPU every iteration and every conditional reads its predicate on the host.
* ``gather``: no control flow. The tiles' expert weights are gathered into [C/T, H, I] and the
  tiles run as one batched SwiGLU; each token then sums its k results from the [C, H] outputs in
  ascending expert order (a gather, no scatter-add: deterministic). With T = 1 and every expert local
  (few tokens: decode) the pairs are the tiles and no grouping is done. Same FLOPs as ``loop`` without
  its skipping (the static bound below), plus a copy of C/T expert weights (read, write, read:
  about 3x the weight traffic of reading in place; memory: the [C/T, H, I] copies).
* ``kernel``: ``gather``'s grouping and combine, the tiles run by the Pallas (Triton) kernels of
  ``pallas_kernels.expert_tiles``, which read each tile's expert weights in place and skip the padding
  tiles past the used ones: no control flow, no weight copy. On a CPU it runs in Pallas interpret mode
  (tests).

Cost bound (static shapes): FLOPs <= C * 6HI <= N * 6HI + min(E, N) * T * 6HI + T * 6HI, i.e. the
routed work plus one tile per expert. The largest other temporaries are the [M, E] router
probabilities, [C] slot indices and the tiles' activations; no [E, rows] array is formed. With T = 1
(few tokens, e.g. batch-1 decode) C = N and only the k routed experts' weights are read per token.

Under a (data, model) mesh the layer runs in ``jax.shard_map``: each data shard routes and
dispatches its own tokens (no routing crosses the data axis); the experts' weights stay where their
declared axes (``MoE``) put them and one psum over ``model`` combines the partial outputs (tensor parallel:
each device holds I/m of every expert; expert parallel, ``cfg.expert_parallel``: E/m whole experts,
each device computes its local experts' share of its data shard's tokens).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jetspec_jax.config import Qwen3Config
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models.layers import NormedRows, swiglu
from jetspec_jax.models.params import param
from jetspec_jax.sharding import logical_to_spec
from pallas_kernels import expert_tiles
from pallas_kernels.errors import KernelError

MAX_TILE = 128
WEIGHTS = ("gate", "up", "down")
DISPATCHES = ("loop", "gather", "kernel")
TILED = ("gather", "kernel")             # the dispatches that run every tile at once


def expert_axes(cfg: Qwen3Config) -> dict[str, tuple[str, ...]]:
  """Logical axes of the router [H, E] and the stacked experts gate/up [E, H, I], down [E, I, H].
  The experts' axis is ``expert_shards`` (split over ``model``) under expert parallelism, else the
  ``mlp`` axis is (tensor parallel)."""
  ex = "expert_shards" if cfg.expert_parallel else "experts"
  return {"router": ("embed", "experts"), "gate": (ex, "embed", "mlp"), "up": (ex, "embed", "mlp"),
          "down": (ex, "mlp", "embed")}


class MoE(nnx.Module):
  """The sparse MoE block of one layer: ``router`` and stacked expert weights ``gate``, ``up``, ``down``."""

  def __init__(self, cfg: Qwen3Config, *, dtype, rngs: nnx.Rngs):
    h, e, mi = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    axes = expert_axes(cfg)
    self.router = param(rngs, (h, e), axes["router"], dtype)
    self.gate = param(rngs, (e, h, mi), axes["gate"], dtype)
    self.up = param(rngs, (e, h, mi), axes["up"], dtype)
    self.down = param(rngs, (e, mi, h), axes["down"], dtype)
    self.cfg = cfg

  def __call__(self, h: NormedRows, mesh=None) -> jax.Array:
    """h: normed rows [..., H] -> [..., H]."""
    return moe_mlp(h.value(), self.router[...], self.gate[...], self.up[...], self.down[...], self.cfg, mesh)


def tile_rows(num_rows: int, num_experts: int) -> int:
  """Static row tile T for ``num_rows`` routed rows over ``num_experts`` experts: the average group
  size rounded up to a power of two, in [1, MAX_TILE]. A typical expert then needs one or two tiles
  (each tile reads its expert's weights once: fewer, fuller tiles beat less padding on CPU), and
  T = 1 (no padding) up to E rows."""
  return min(MAX_TILE, 1 << max(0, -(-num_rows // num_experts) - 1).bit_length())


def capacity(num_rows: int, num_experts: int, tile: int) -> int:
  """Static padded-row bound C: every expert's group rounded up to ``tile`` fits, rounded to a tile."""
  bound = num_rows + min(num_experts, num_rows) * (tile - 1)
  return -(-bound // tile) * tile


def route(tokens: jax.Array, router: jax.Array, top_k: int, norm_topk_prob: bool):
  """tokens [M, H], router [H, E] -> (weights [M, k] in tokens' dtype, experts [M, k] int32)."""
  probs = jax.nn.softmax((tokens @ router).astype(jnp.float32), axis=-1)
  top_w, top_i = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
  return top_w.astype(tokens.dtype), top_i.astype(jnp.int32)


def grouped_swiglu(tokens: jax.Array, top_w: jax.Array, top_i: jax.Array, gate: jax.Array, up: jax.Array,
                   down: jax.Array, *, first_expert=0, num_experts: int | None = None,
                   dispatch: str = "loop", interpret: bool = False) -> jax.Array:
  """sum_j top_w[m, j] * swiglu_{top_i[m, j]}(tokens[m]) over the pairs whose expert is local.

  tokens [M, H]; top_w, top_i [M, k]; gate/up [El, H, I], down [El, I, H] hold experts
  first_expert .. first_expert + El - 1 of ``num_experts`` (default El; other pairs are skipped).
  The tile follows the average load M*k / num_experts; the capacity bounds the local pairs by
  M * min(k, El). ``dispatch``: one of ``DISPATCHES`` (module docstring); ``interpret``: run ``kernel``'s
  Pallas kernels in interpret mode (on a CPU). Returns [M, H] in tokens' dtype; each token's terms are added
  in ascending expert order, as transformers does.
  """
  m, h = tokens.shape
  num_local, k = gate.shape[0], top_i.shape[1]
  rows = m * min(k, num_local)
  t = tile_rows(m * k, num_experts or num_local)
  c = capacity(rows, num_local, t)
  local = top_i.reshape(-1) - first_expert
  local = jnp.where((local >= 0) & (local < num_local), local, num_local)          # [N]; El: not here
  if dispatch in TILED and t == 1 and num_local == (num_experts or num_local):
    return _pair_tiles(tokens, top_w, local.reshape(m, k), gate, up, down, (dispatch, interpret))
  order = jnp.argsort(local, stable=True)
  counts = jnp.bincount(local, length=num_local + 1)[:num_local].astype(jnp.int32)  # [El]
  tiles = -(-counts // t)
  tile_end = jnp.cumsum(tiles)
  group_start = jnp.cumsum(counts) - counts
  g_all = jnp.arange(c // t, dtype=jnp.int32)
  tile_expert = jnp.minimum(jnp.searchsorted(tile_end, g_all, side="right", method="compare_all"), num_local - 1)   # [C/T]
  first_row = (g_all - tile_end[tile_expert] + tiles[tile_expert]) * t                    # within the group
  pos = (first_row[:, None] + jnp.arange(t, dtype=jnp.int32)).reshape(-1)                 # [C]
  slot_expert = jnp.repeat(tile_expert, t)
  valid = pos < counts[slot_expert]
  pair = order[jnp.where(valid, group_start[slot_expert] + pos, 0)]
  slot_token = jnp.where(valid, pair // k, m)                                           # m: padding row
  if dispatch in TILED:
    return _all_tiles(tokens, top_w, local, order, slot_token, tile_expert, tiles, tile_end, group_start,
                      gate, up, down, t, (dispatch, interpret))
  if dispatch != "loop":
    raise ValueError(f"unknown MoE dispatch {dispatch!r}; choose one of {DISPATCHES}")
  slot_weight = jnp.where(valid, top_w.reshape(-1)[pair], 0).astype(tokens.dtype)
  used = tile_end[-1]

  def tile(g, out):
    idx = jax.lax.dynamic_slice_in_dim(slot_token, g * t, t)
    wt = jax.lax.dynamic_slice_in_dim(slot_weight, g * t, t)
    e = tile_expert[g]
    y = swiglu(tokens.at[idx].get(mode="clip"), gate[e], up[e], down[e]) * wt[:, None]
    return out.at[idx].add(y.astype(out.dtype), mode="drop")

  def body(g, out):
    return jax.lax.cond(g < used, tile, lambda g, o: o, g, out) if t > 1 else tile(g, out)

  return jax.lax.fori_loop(0, c // t, body, jnp.zeros((m, h), tokens.dtype))


def _all_tiles(tokens, top_w, local, order, slot_token, tile_expert, tiles, tile_end, group_start,
               gate, up, down, t, run):
  """The ``gather`` and ``kernel`` dispatches: every tile at once (tiles past the used ones: zeros or, with
  ``gather``, the last expert's), then each pair's result read back from its slot. local [N] (El: not here),
  order [N] pairs by expert, slot_token [C] (M: padding), tile_expert [C/T]; run: (dispatch, interpret);
  returns [M, H]."""
  m, h = tokens.shape
  num_local, k = gate.shape[0], top_w.shape[1]
  x = tokens.at[slot_token].get(mode="fill", fill_value=0).reshape(-1, t, h)           # [C/T, T, H]
  y = _tile_swiglu(x, gate, up, down, tile_expert, run, used=tile_end[-1]).reshape(-1, h)        # [C, H]
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  e = jnp.minimum(local, num_local - 1)
  slot = (tile_end[e] - tiles[e]) * t + rank - group_start[e]                           # [N]
  here = (local < num_local).reshape(m, k)
  by_expert = jnp.argsort(local.reshape(m, k), axis=1)                                    # ascending expert
  slot = jnp.take_along_axis(slot.reshape(m, k), by_expert, axis=1)
  w = jnp.where(jnp.take_along_axis(here, by_expert, axis=1),
                jnp.take_along_axis(top_w, by_expert, axis=1), 0).astype(tokens.dtype)
  return _weighted_sum(y.at[slot].get(mode="clip"), w)


def _pair_tiles(tokens, top_w, experts, gate, up, down, run):
  """The ``gather`` / ``kernel`` dispatch when every (token, expert) pair is its own tile (T = 1, all experts
  local: few tokens, e.g. decode): no grouping, each pair against its expert's weights, each token's k
  results summed in ascending expert order. tokens [M, H], top_w / experts [M, k] -> [M, H]."""
  m, h = tokens.shape
  by_expert = jnp.argsort(experts, axis=1)
  e = jnp.take_along_axis(experts, by_expert, axis=1).reshape(-1)                         # [M*k]
  w = jnp.take_along_axis(top_w, by_expert, axis=1).astype(tokens.dtype)                 # [M, k]
  x = jnp.repeat(tokens, experts.shape[1], axis=0)[:, None]                               # [M*k, 1, H]
  return _weighted_sum(_tile_swiglu(x, gate, up, down, e, run).reshape(m, -1, h), w)


def _tile_swiglu(x, gate, up, down, experts, run, used=None):
  """x [G, T, H], each tile g through the SwiGLU of expert experts[g]; run = (dispatch, interpret): ``kernel``,
  the Pallas kernels reading the weights in place (tiles g >= used: zeros); ``gather``, XLA on gathered copies
  [G, H, I] (every tile)."""
  dispatch, interpret = run
  if dispatch == "kernel":
    try:
      return expert_tiles.tile_swiglu(x, gate, up, down, experts, used, interpret=interpret)
    except KernelError as e:
      raise JetSpecError(f"moe_dispatch='kernel': {e}") from None
  a = jnp.einsum("gth,ghi->gti", x, gate[experts])
  b = jnp.einsum("gth,ghi->gti", x, up[experts])
  return jnp.einsum("gti,gih->gth", jax.nn.silu(a) * b, down[experts])


def _weighted_sum(y, w):
  """y [M, k, H], w [M, k] -> sum_j w[:, j] * y[:, j] in y's dtype, added in j order (expert order)."""
  out = jnp.zeros((y.shape[0], y.shape[2]), y.dtype)
  for j in range(y.shape[1]):
    out = out + (y[:, j] * w[:, j, None]).astype(y.dtype)
  return out


def dispatch_for(cfg: Qwen3Config, mesh=None) -> str:
  """``cfg.moe_dispatch``, "auto" resolved by the platform of the mesh's devices (else jax's backend):
  ``loop`` on CPU, ``kernel`` on a GPU, ``gather`` on other accelerators (where loops and conditionals cost
  host round-trips)."""
  if cfg.moe_dispatch != "auto":
    return cfg.moe_dispatch
  return {"cpu": "loop", "gpu": "kernel", "cuda": "kernel"}.get(_platform(mesh), "gather")


def _platform(mesh) -> str:
  """The platform of the mesh's devices, else jax's default backend."""
  return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def moe_mlp(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, cfg: Qwen3Config,
            mesh=None) -> jax.Array:
  """The sparse MoE block on x [B, T, H] -> [B, T, H] (see the module docstring); weights as ``MoE``'s."""
  weights = (router, gate, up, down)
  axes = expert_axes(cfg)
  k = cfg.num_experts_per_tok
  sharded = mesh is not None and mesh.shape["model"] > 1
  dispatch = dispatch_for(cfg, mesh)
  interpret = _platform(mesh) == "cpu"

  def local(x, router, gate, up, down):
    b, t, h = x.shape
    tokens = x.reshape(b * t, h)
    top_w, top_i = route(tokens, router, k, cfg.norm_topk_prob)
    first = jax.lax.axis_index("model") * gate.shape[0] if sharded and cfg.expert_parallel else 0
    out = grouped_swiglu(tokens, top_w, top_i, gate, up, down, first_expert=first, num_experts=cfg.num_experts,
                         dispatch=dispatch, interpret=interpret)
    if sharded:
      out = jax.lax.psum(out, "model")
    return out.reshape(b, t, h)

  if mesh is None or (mesh.size == 1 and dispatch != "kernel"):     # a Pallas kernel lowers inside shard_map
    return local(x, *weights)
  x_spec = logical_to_spec(("batch", "seq", "embed"), x.shape, mesh)
  w_specs = [logical_to_spec(axes[n], w.shape, mesh) for n, w in zip(("router",) + WEIGHTS, weights)]
  fn = jax.shard_map(local, mesh=mesh, in_specs=(x_spec, *w_specs), out_specs=x_spec, check_vma=False)
  return fn(x, *weights)

"""MoE layer benchmark: the tiled grouped matmul against the dense matmul of the same routed work.

One Qwen3-MoE block (router + experts, default Qwen3-30B-A3B width: hidden 2048, 128 experts, top-8,
moe_intermediate 768) with random weights, for each token count M (default 1, 16, 128, 1024, 8192):

* ``flops_ratio``: compiled FLOPs of the layer / routed FLOPs (2 * M*k * 3HI). Compiled FLOPs count
  every dot of the compiled HLO, loop bodies times their trip count and a conditional's costliest
  branch (XLA's ``cost_analysis`` counts a loop body once), so they are the static upper bound;
* ``run_ratio``: rows the layer really computes (the used tiles: each expert's group rounded up to a
  tile; the loop skips the rest) / routed rows, for this input's routing;
* ``temp_mib``: XLA's temporaries (``memory_analysis().temp_size_in_bytes``);
* ``ms`` / ``dense_ms``: wall time of the layer, and of one SwiGLU over the M*k routed rows against a
  single expert's weights (x[M*k, H] @ [H, 2I], @ [I, H]): the same routed FLOPs as a dense matmul.
* ``ragged_*``: compiled FLOPs ratio and temporaries of ``jax.lax.ragged_dot`` on the same routed
  rows (what the layer used before; compiled, never run).

  python bench/moe_bench.py                  # full width, float32, JSON to bench/results/moe_bench.json
  python bench/moe_bench.py --quick          # hidden 64, intermediate 32, M up to 128: seconds

Timing: each program runs once (compile, excluded), then ``--repeats`` times; the median is reported.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from jetspec_jax.bench import format_table, hlo_dot_flops, largest_array, machine_info, median, save_results, timed
from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import moe
from jetspec_jax.models.layers import swiglu
from jetspec_jax.models.params import flat_params

NAME = "moe_bench"
def config(hidden: int, intermediate: int, experts: int, top_k: int) -> Qwen3Config:
  """A one-layer MoE config of the given widths (attention sizes are irrelevant here)."""
  return Qwen3Config(vocab_size=128, hidden_size=hidden, intermediate_size=4 * intermediate, num_hidden_layers=1,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=hidden, num_experts=experts,
                     num_experts_per_tok=top_k, moe_intermediate_size=intermediate, norm_topk_prob=True)


def random_layer(cfg: Qwen3Config, dtype, key) -> dict[str, jax.Array]:
  """The weights of one ``moe.MoE`` block: {router, gate, up, down}."""
  return flat_params(moe.MoE(cfg, dtype=dtype, rngs=nnx.Rngs(key)))


def ragged_layer(x, params, cfg: Qwen3Config):
  """The previous formulation (``jax.lax.ragged_dot`` over expert-sorted rows), for its compiled cost."""
  tokens = x.reshape(-1, x.shape[-1])
  top_w, top_i = moe.route(tokens, params["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
  flat = top_i.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
  xs = tokens[order // cfg.num_experts_per_tok]
  g, u, d = (params[w] for w in moe.WEIGHTS)
  h = jax.nn.silu(jax.lax.ragged_dot(xs, g, sizes)) * jax.lax.ragged_dot(xs, u, sizes)
  out = jax.lax.ragged_dot(h, d, sizes) * top_w.reshape(-1)[order][:, None]
  return jnp.zeros_like(tokens).at[order // cfg.num_experts_per_tok].add(out)


def run_timed(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  return median([timed(lambda: jax.block_until_ready(fn(*args)))[1] for _ in range(repeats)])


def measure(cfg: Qwen3Config, params, m: int, dtype, repeats: int, ragged: bool) -> dict:
  """One row of the table for M = ``m`` tokens."""
  h, i, k, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_experts
  x = jax.random.normal(jax.random.key(m), (1, m, h), jnp.float32).astype(dtype)
  routed = 2 * m * k * 3 * h * i
  layer = jax.jit(lambda x, p: moe.moe_mlp(x, p["router"], *(p[w] for w in moe.WEIGHTS), cfg))
  compiled = layer.lower(x, params).compile()
  tile = moe.tile_rows(m * k, e)
  row = {"tokens": m, "rows": m * k, "tile": tile, "capacity": moe.capacity(m * k, e, tile),
         "flops_ratio": hlo_dot_flops(compiled.as_text()) / routed,
         "bound_ratio": 1.25 + e * tile / (m * k),
         "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 20,
         "largest_temp": largest_array(compiled.as_text())[1]}
  _, top_i = moe.route(x.reshape(m, h), params["router"], k, cfg.norm_topk_prob)
  counts = jnp.bincount(top_i.reshape(-1), length=e)
  row["run_ratio"] = float(jnp.sum(-(-counts // tile)) * tile / (m * k))
  row["ms"] = 1e3 * run_timed(compiled, (x, params), repeats)
  xr = jax.random.normal(jax.random.key(0), (m * k, h), jnp.float32).astype(dtype)
  w = [params[n][0] for n in moe.WEIGHTS]
  row["dense_ms"] = 1e3 * run_timed(jax.jit(swiglu), (xr, *w), repeats)
  row["vs_dense"] = row["ms"] / row["dense_ms"]
  if ragged:
    rc = jax.jit(lambda x, p: ragged_layer(x, p, cfg)).lower(x, params).compile()
    row["ragged_flops_ratio"] = hlo_dot_flops(rc.as_text()) / routed
    row["ragged_temp_mib"] = rc.memory_analysis().temp_size_in_bytes / 2 ** 20
  return row


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", default="1,16,128,1024,8192", help="comma-separated token counts M")
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--intermediate", type=int, default=768, help="moe_intermediate_size")
  p.add_argument("--experts", type=int, default=128)
  p.add_argument("--top-k", type=int, default=8)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--no-ragged", action="store_true", help="skip compiling the ragged_dot formulation")
  p.add_argument("--quick", action="store_true", help="hidden 64, intermediate 32, tokens 1,16,128 (CI-sized)")
  p.add_argument("--out", help="JSON path (default bench/results/moe_bench.json)")
  args = p.parse_args(argv)
  if args.quick:
    args.hidden, args.intermediate, args.tokens = 64, 32, "1,16,128"

  dtype = jnp.dtype(args.dtype)
  cfg = config(args.hidden, args.intermediate, args.experts, args.top_k)
  params = random_layer(cfg, dtype, jax.random.key(0))
  print(f"MoE layer: hidden {cfg.hidden_size}, {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, "
        f"intermediate {cfg.moe_intermediate_size}, {args.dtype}; backend {jax.default_backend()}", flush=True)
  columns = ["tokens", "rows", "tile", "capacity", "flops_ratio", "bound_ratio", "run_ratio", "temp_mib", "ms",
             "dense_ms", "vs_dense", "ragged_flops_ratio", "ragged_temp_mib"]
  rows = []
  for m in (int(t) for t in args.tokens.split(",")):
    rows.append(measure(cfg, params, m, dtype, args.repeats, not args.no_ragged))
    print(format_table(rows[-1:], columns), flush=True)
  print()
  print(format_table(rows, columns))
  result = {"benchmark": NAME, "args": vars(args), "machine": machine_info(), "rows": rows}
  for path in save_results(result, args.out, NAME):
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

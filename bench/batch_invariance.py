"""How far float32 greedy decoding depends on the program's shape, on the demo's target.

Two measurements on the demo's 64 + 64 bench prompts (``jetspec-jax demo`` work directory):

1. batch invariance: the AR engine's greedy tokens at batch 16 and at batch 1, compared by
   ``decode.agreement``'s rule (identical / parted at a near-tie / parted elsewhere);
2. logit noise between programs: the target's float32 logits at every generated position computed by
   forwards of other shapes (the prompts and their AR tokens at batch 16, at batch 1, and at batch 1 padded
   by 64 rows), their largest difference in float32 ulps of the row's largest |logit|, and the share of
   positions whose top-two gap is within ``agreement.TIE_ULPS`` (where a tie can flip).

The noise bounds the gap at which programs of other shapes can disagree, so it is what ``TIE_ULPS`` must
exceed (docs/verification.md). Run it under other numerics with XLA_FLAGS (``--xla_cpu_max_isa=SSE4_2``,
``--xla_cpu_enable_fast_math=true``, ``taskset -c 0``) on the demo built under them (bench/numerics_spread.py).

  python bench/batch_invariance.py --workdir ~/.cache/jetspec-jax [--quick] [--noise-prompts 16]
"""
from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import banks, bench, convert, demo
from jetspec_jax.decode import agreement
from jetspec_jax.decode import engine
from jetspec_jax.models import qwen3
from jetspec_jax.tokenizer import load_tokenizer

NAME = "batch_invariance"


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, tokens, *, cfg):
  target = qwen3.bind(cfg, params)
  b, t = tokens.shape
  h, _, _ = target.hidden(tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), qwen3.causal_mask(b, t))
  return target.logits(h)


def all_logits(cfg, params, rows: np.ndarray) -> np.ndarray:
  """float32 logits [B, T, V] of every row of ``rows`` [B, T] (one causal forward, no cache)."""
  return np.asarray(_forward(params, jnp.asarray(rows, jnp.int32), cfg=cfg))


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _step(params, cache, tokens, position, *, cfg):
  target = qwen3.bind(cfg, params)
  b = tokens.shape[0]
  h, cache, _ = target.hidden(tokens[:, None], jnp.full((b, 1), position), jnp.ones((b, 1, 1), bool), cache=cache,
                              prefix_len=jnp.full((b,), position))
  return target.logits(h)[:, 0], cache


def step_logits(cfg, params, rows: np.ndarray) -> np.ndarray:
  """float32 logits [B, T, V] of ``rows`` [B, T] fed one row per forward over a KV cache (the AR step's shape)."""
  cache = qwen3.init_cache(cfg, rows.shape[0], -(-rows.shape[1] // 8) * 8, jnp.float32)
  out = []
  for t in range(rows.shape[1]):
    logits, cache = _step(params, cache, jnp.asarray(rows[:, t], jnp.int32), jnp.int32(t), cfg=cfg)
    out.append(np.asarray(logits))
  return np.stack(out, 1)


def ulps(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """|x - y| per position [..., V] -> [...] in ``agreement.row_ulp`` units of x."""
  return np.max(np.abs(x - y), -1) / agreement.row_ulp(x)


def noise(cfg, params, prompts, outputs, batch: int) -> dict:
  """Largest logit difference between forwards of other shapes over the generated positions, and top-2 gaps."""
  rows = np.asarray([list(p) + list(o) for p, o in zip(prompts, outputs)], np.int32)
  gen = slice(len(prompts[0]) - 1, rows.shape[1] - 1)          # the rows whose logits chose a generated token
  batched = np.concatenate([all_logits(cfg, params, rows[i:i + batch]) for i in range(0, len(rows), batch)])[:, gen]
  alone = np.concatenate([all_logits(cfg, params, rows[i:i + 1]) for i in range(len(rows))])[:, gen]
  padded = np.concatenate([all_logits(cfg, params, np.pad(rows[i:i + 1], ((0, 0), (0, 64))))[:, :rows.shape[1]]
                           for i in range(len(rows))])[:, gen]
  stepped = np.concatenate([step_logits(cfg, params, rows[i:i + batch]) for i in range(0, len(rows), batch)])[:, gen]
  stepped1 = np.concatenate([step_logits(cfg, params, rows[i:i + 1]) for i in range(len(rows))])[:, gen]
  pairs = {"batch vs alone": (alone, batched), "padded vs alone": (alone, padded), "steps vs forward": (alone, stepped1),
           "steps batch vs alone": (stepped1, stepped)}
  order = np.argsort(alone, -1)[..., -2:]                      # the reference's top two ids per position
  scale = agreement.row_ulp(alone)

  def gap(x):                                                    # top-2 gap of x for the reference's two ids
    t = np.take_along_axis(x, order, -1)
    return (t[..., 1] - t[..., 0]) / scale

  gap_ulps = gap(alone)

  out = {}
  for name, (x, y) in pairs.items():
    d = ulps(x, y)
    out[name] = {"max_ulps": float(d.max()), "p99_ulps": float(np.percentile(d, 99)),
                 "share_identical": float(np.mean(d == 0)),
                 "max_top2_gap_change_ulps": float(np.max(np.abs(gap(y) - gap(x))))}
  return {"positions": int(gap_ulps.size), "noise": out,
          "share_top2_within_tie_ulps": float(np.mean(gap_ulps <= agreement.TIE_ULPS)),
          "share_top2_within": {n: float(np.mean(gap_ulps <= n)) for n in (16, 64, 256, 1024)},
          "min_top2_gap_ulps": float(gap_ulps.min()),
          "max_abs_logit": float(np.max(np.abs(alone)))}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True, help="a finished `jetspec-jax demo` work directory")
  p.add_argument("--quick", action="store_true", help="the work directory is a `jetspec-jax demo --quick` one")
  p.add_argument("--batch", type=int, default=None, help="the batched run's batch (default: the demo's)")
  p.add_argument("--noise-prompts", type=int, default=16, help="prompts per bank for the logit-noise pass")
  p.add_argument("--out", help="JSON path (default bench/results/batch_invariance.json)")
  a = p.parse_args(argv)
  s = demo.QUICK if a.quick else demo.DemoSettings()
  batch = a.batch or s.bench_batch
  tokenizer = load_tokenizer(os.path.join(a.workdir, "tokenizer"))
  cfg, params, _ = convert.load_target(os.path.join(a.workdir, "target_ckpt"), jnp.float32)
  rows, report = [], {"machine": {**bench.machine_info(), **demo.cpu_kind()}, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                      "tie_ulps": agreement.TIE_ULPS, "batch": batch, "banks": {}}
  for bank in banks.BANKS:
    prompts = demo.bench_prompts(s, bank, tokenizer)
    inv = bench.batch_invariance(params, cfg, prompts, max_new_tokens=s.bench_new_tokens, batch_size=batch, eos_ids=())
    few = prompts[:a.noise_prompts]
    outs = engine.generate(cfg, params, few, s.bench_new_tokens, eos_ids=()).tokens
    nz = noise(cfg, params, few, outs, batch)
    report["banks"][bank] = {"invariance": inv.as_dict(), **nz}
    rows.append({"bank": bank, "sequences": inv.count, "identical": inv.identical, "parted at ties": len(inv.ties),
                 "parted elsewhere": len(inv.elsewhere),
                 "largest tie (ulps)": max((t.ulps for t in inv.ties), default=None),
                 **{f"{k} (max ulps)": v["max_ulps"] for k, v in nz["noise"].items()},
                 "top-2 gap change (max ulps)": max(v["max_top2_gap_change_ulps"] for v in nz["noise"].values()),
                 "top-2 within tie": nz["share_top2_within_tie_ulps"]})
    for t in inv.ties + inv.elsewhere:
      print(f"  {bank}: {'tie' if t.tie else 'ELSEWHERE'} at {agreement.parting_text(t.as_dict())}")
  print(bench.format_table(rows))
  report["rows"] = rows
  for path in bench.save_results(report, a.out, NAME):
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

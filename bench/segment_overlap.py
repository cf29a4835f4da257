"""One segment in flight against none: what the driver's overlap of host and device buys, measured alternately.

The same engine and requests run two host loops, alternately, several times each:

- ``sync``: ``step(k)`` (dispatch, then wait and collect), then the host's work on the update;
- ``overlap``: the driver's loop: dispatch segment n + 1, then collect segment n and do the host's work on it.

The host's work per update is what the server does with it: every request's new tokens through its own
incremental detokenizer (``serve.TextStream``, with a stop string that never matches), the finished ones flushed.
Units are passes of --requests prompts (random token ids, ``max_new_tokens`` --new, EOS ignored, all submitted at
once) on --slots slots; the table gives each loop's median tokens/s and the overlap / sync ratio of medians,
per mode (AR and the demo's head with ``best_nodes`` 16) and segment length.

    python bench/segment_overlap.py --workdir ~/.cache/jetspec-jax --out docs/benchmark_runs/segment_overlap.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from jetspec_jax import bench


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench.add_model_args(p)
  p.add_argument("--requests", type=int, default=32)
  p.add_argument("--new", type=int, default=64)
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--segments", type=int, nargs="+", default=[1, 4])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  import jax.numpy as jnp

  from jetspec_jax import convert
  from jetspec_jax.decode.engine import Engine, Request
  from jetspec_jax.decode.speculative import TreeConfig
  from jetspec_jax.serve import TextStream
  from jetspec_jax.tokenizer import load_tokenizer
  target, head = bench.model_paths(args)
  cfg, params, side = convert.load_target(target, jnp.float32)
  head_cfg, head_params = convert.load_head(head, jnp.float32, target_cfg=cfg)
  tokenizer = load_tokenizer(side)
  rng = np.random.default_rng(0)
  requests = [Request(rng.integers(1, 1000, int(rng.integers(8, 48))).tolist(), args.new)
              for _ in range(args.requests)]
  modes = {"ar": {}, "best_nodes 16": dict(tree=TreeConfig("best_nodes", 16, 4, head_cfg.depth), head_cfg=head_cfg,
                                           head_params=head_params)}

  def publish(update, streams):
    for rid, new in update.new.items():
      streams.setdefault(rid, TextStream(tokenizer, ["<never>"])).feed(new)
    for r in update.finished:
      streams.pop(r.id).flush()

  def sync(engine, k):
    engine.start()
    engine.submit(requests)
    streams, done = {}, 0
    while done < len(requests):
      update = engine.collect(engine.dispatch(k))
      done += len(update.finished)
      publish(update, streams)

  def overlap(engine, k):
    engine.start()
    engine.submit(requests)
    streams, done, in_flight = {}, 0, None
    while done < len(requests):
      dispatched = engine.dispatch(k)
      if in_flight is not None:
        update = engine.collect(in_flight)
        done += len(update.finished)
        publish(update, streams)
      in_flight = dispatched
    engine.collect(in_flight)

  loops = {"sync": sync, "overlap": overlap}
  rows, raw = [], {}
  for mode, kw in modes.items():
    rows_kw = dict(rows=args.slots * kw["tree"].num_nodes()) if "tree" in kw else {}
    engine = Engine.for_requests(cfg, params, requests, slots=args.slots, eos_ids=(), **rows_kw, **kw)
    for k in args.segments:
      for loop in loops.values():                                   # compile, not timed
        loop(engine, k)
      times = {name: [] for name in loops}
      for _ in range(args.repeats):
        for name, loop in loops.items():                            # alternately
          t0 = time.perf_counter()
          loop(engine, k)
          times[name].append(time.perf_counter() - t0)
      tokens = args.requests * args.new
      med = {name: tokens / statistics.median(ts) for name, ts in times.items()}
      raw[f"{mode}, k={k}"] = times
      rows.append({"mode": mode, "rounds per segment": k, "sync tok/s": med["sync"], "overlap tok/s": med["overlap"],
                   "overlap / sync": med["overlap"] / med["sync"]})
      print(bench.format_table(rows[-1:]), file=sys.stderr, flush=True)
  commit = bench.commit_of(__file__)
  result = {"machine": bench.machine_info(), "commit": commit, "settings": vars(args), "rows": rows,
            "seconds": raw}
  print(bench.format_table(rows))
  for path in bench.save_results(result, args.out, "segment_overlap"):
    print(f"JSON: {path}", file=sys.stderr)
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)

"""The HTTP server under load: ``jetspec-jax serve`` (AR, then speculative with the head) as a subprocess on
127.0.0.1, driven by an async HTTP client (httpx) with ShareGPT-shaped requests (``load.sharegpt_requests``:
real prompts through the chat template, reply lengths as max_tokens, capped) arriving as a Poisson process
at each --rates, every request streamed (SSE). The server ignores EOS (--eos-ids ''): each reply has its
max_tokens.

Per rate and mode: output tokens per second (the usage counts over the time from the first arrival to the
last answer), TTFT (arrival to the first text chunk) and TPOT ((last chunk - first chunk) / (tokens - 1))
p50 / p99, and failures (an error status or event, or no answer within --time-limit). Every run is bounded:
--requests per rate, and --time-limit seconds per rate.

    python bench/serve_load.py --workdir ~/.cache/jetspec-jax --out docs/benchmark_runs/serve_load.json

(after ``jetspec-jax demo``; or --target / --head). Prints the table; writes JSON and, with --plot, a PNG.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np

from jetspec_jax import bench, load
from jetspec_jax.convert import read_target_config
from jetspec_jax.tokenizer import load_tokenizer

MODEL = "bench"


def start_server(args, head: str | None) -> tuple[subprocess.Popen, str]:
  """The server subprocess and its URL, once it listens (its programs compiled)."""
  cmd = [sys.executable, "-m", "jetspec_jax.cli", "serve", "--target", args.target, "--port", "0", "--model-name",
         MODEL, "--slots", str(args.slots), "--max-prompt", str(args.max_prompt), "--max-tokens", str(args.max_output),
         "--segment-rounds", str(args.segment_rounds), "--key-buckets", str(args.key_buckets), "--eos-ids", ""]
  if head:
    cmd += ["--head", head, "--tree", args.tree, "--budget", str(args.budget), "--width", str(args.width)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  match = re.search(r"http://\S+:\d+", line)
  if not match:
    proc.kill()
    raise SystemExit(f"the server did not start: {line!r}")
  return proc, match.group(0)


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, arrive: float,
              t0: float) -> dict:
  """One streamed completion, sent at t0 + arrive: timings relative to its arrival, tokens, error."""
  await asyncio.sleep(max(0.0, t0 + arrive - time.perf_counter()))
  sent = time.perf_counter()
  first = last = None
  tokens, error = 0, None
  body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
          "stream_options": {"include_usage": True}}
  try:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
      if r.status_code != 200:
        return {"error": f"status {r.status_code}: {(await r.aread()).decode()[:200]}"}
      async for line in r.aiter_lines():
        if not line.startswith("data: {"):
          continue
        event = json.loads(line[6:])
        if "error" in event:
          error = event["error"]["message"]
        elif event.get("usage"):
          tokens = event["usage"]["completion_tokens"]
        elif event["choices"] and event["choices"][0]["text"]:
          last = time.perf_counter()
          first = first or last
  except httpx.HTTPError as e:
    error = f"{type(e).__name__}: {e}"
  if error or first is None:
    return {"error": error or "no text came back"}
  return {"ttft_s": first - sent, "tpot_s": (last - first) / max(tokens - 1, 1), "tokens": tokens, "end": last}


async def run_rate(url: str, requests, rate: float, seed: int, time_limit: float) -> dict:
  """The requests at Poisson ``rate``/s; what is not answered within ``time_limit`` counts as failed."""
  arrive = load.arrivals(len(requests), rate, seed)
  limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
  async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit), limits=limits) as client:
    t0 = time.perf_counter()
    tasks = [asyncio.create_task(one(client, url, r.prompt, r.max_new_tokens, a, t0))
             for r, a in zip(requests, arrive)]
    done, pending = await asyncio.wait(tasks, timeout=time_limit)
    for t in pending:
      t.cancel()
  rows = [t.result() for t in done]
  ok = [r for r in rows if "error" not in r]
  wall = max((r["end"] for r in ok), default=t0) - t0
  output = sum(r["tokens"] for r in ok)
  return {"rate": rate, "requests": len(requests), "answered": len(ok), "failures": len(requests) - len(ok),
          "errors": sorted({r["error"] for r in rows if "error" in r})[:5], "wall_s": wall,
          "output_tokens": output, "tokens_per_s": output / max(wall, 1e-9),
          "requests_per_s": len(ok) / max(wall, 1e-9),
          "ttft_s": load.percentiles(r["ttft_s"] for r in ok), "tpot_s": load.percentiles(r["tpot_s"] for r in ok)}


def table(result: dict) -> str:
  rows = []
  for mode, by_rate in result["modes"].items():
    for rate, r in by_rate.items():
      rows.append({"mode": mode, "rate /s": rate, "tokens/s": r["tokens_per_s"], "answered": r["answered"],
                   "failures": r["failures"], "TTFT p50 s": r["ttft_s"]["p50"], "TTFT p99 s": r["ttft_s"]["p99"],
                   "TPOT p50 ms": None if r["tpot_s"]["p50"] is None else r["tpot_s"]["p50"] * 1e3,
                   "TPOT p99 ms": None if r["tpot_s"]["p99"] is None else r["tpot_s"]["p99"] * 1e3})
  return bench.format_table(rows)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench.add_model_args(p)
  p.add_argument("--requests", type=int, default=40, help="requests per rate")
  p.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0], help="Poisson arrivals per second")
  p.add_argument("--max-output", type=int, default=32, help="reply lengths (max_tokens) are capped at this")
  p.add_argument("--max-prompt", type=int, default=256, help="longer ShareGPT prompts are skipped")
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--segment-rounds", type=int, default=4)
  p.add_argument("--key-buckets", type=int, default=4)
  p.add_argument("--tree", default="best_nodes")
  p.add_argument("--budget", type=int, default=8)
  p.add_argument("--width", type=int, default=3)
  p.add_argument("--time-limit", type=float, default=120.0, help="seconds per rate and mode")
  p.add_argument("--modes", default="ar,speculative")
  p.add_argument("--out", default=None, help="JSON (default bench/results/serve_load.json)")
  p.add_argument("--plot", default=None, help="PNG of throughput and TPOT p50 against the rate")
  args = p.parse_args(argv)
  args.target, head = bench.model_paths(args)
  say = lambda s: print(s, file=sys.stderr, flush=True)
  tokenizer = load_tokenizer(read_target_config(args.target)[1])
  requests = load.sharegpt_requests(tokenizer, args.requests, max_output=args.max_output, max_prompt=args.max_prompt,
                                    context=args.max_prompt + 1024)
  say(f"{len(requests)} ShareGPT requests: prompt mean {np.mean([len(r.prompt) for r in requests]):.0f} tokens, "
      f"max_tokens mean {np.mean([r.max_new_tokens for r in requests]):.1f}")
  commit = bench.commit_of(__file__)
  result = {"machine": bench.machine_info(), "commit": commit, "target": os.path.abspath(args.target),
            "head": os.path.abspath(head),
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
            "modes": {}}
  for mode in args.modes.split(","):
    proc, url = start_server(args, head if mode == "speculative" else None)
    try:
      asyncio.run(run_rate(url, requests[:args.slots], 100.0, 0, args.time_limit))       # first calls, not measured
      for i, rate in enumerate(args.rates):
        r = asyncio.run(run_rate(url, requests, rate, i, args.time_limit))
        result["modes"].setdefault(mode, {})[f"{rate:g}"] = r
        say(f"{mode} rate {rate:g}/s: {r['tokens_per_s']:.0f} tokens/s, {r['failures']} failures")
    finally:
      proc.send_signal(signal.SIGTERM)
      proc.wait(60)
  print(table(result))
  for path in bench.save_results(result, args.out, "serve_load"):
    say(f"JSON: {path}")
  if args.plot:
    say(f"plot: {load.plot(result, args.plot)}")
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)

"""Soak: ``jetspec-jax serve`` under twice its capacity, with clients that leave, cancel and send garbage, a
SIGTERM under load and a restart; does every request end the way it should, and does the server stay healthy?

The server runs as a subprocess on 127.0.0.1 (greedy, EOS honoured, the demo's target, and its head with the
server's default tree unless --ar). An async client (httpx) first records, one request at a time, the answer to
each of --prompts random prompts (token ids) at each of a few max_tokens (the references), then measures the
server's capacity C (completed requests per second with 2 x slots clients in a closed loop, the request mix's
completing kinds), then sends --requests requests as a Poisson process at --overload x C, in two phases:

  1. 80% of them; at 90% of this phase's arrivals the server gets SIGTERM while requests keep arriving: the ones
     in flight must finish, new ones get 503 while it drains (or find it gone: "server down", not a failure);
     it must exit 0;
  2. a restarted server takes the other 20%; then it must answer /health "ok" with nothing outstanding, and the
     references again, identically.

Each request is one of (shares in --mix): ``stream`` (read to the end; its text must equal the reference),
``leave`` (streamed, the client hangs up after 1-3 chunks), ``cancel`` (not streamed, the client gives up after
0-0.5 s), ``plain`` (not streamed, read to the end), ``malformed`` (bad JSON, no model, n = 2, max_tokens 0 ...:
must get its 4xx), ``oversized`` (a prompt past --max-prompt: 400; a body past the server's limit: 413).

Outcomes: completed, left, cancelled (the client's doing), refused (429 / 503), rejected (the expected 4xx),
server down (after the SIGTERM only); failed: anything else (a 5xx, an error event, a wrong status, a
connection error while the server is up, a text that differs from the reference); hung: no end within
--time-limit. The server's RSS (/proc) is sampled every 0.5 s.

    python bench/serve_soak.py --workdir ~/.cache/jetspec-jax --out docs/benchmark_runs/serve_soak.json

(after ``jetspec-jax demo``). Prints the table; writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

from jetspec_jax import bench, load
from jetspec_jax.convert import read_target_config

MODEL = "soak"
KINDS = ("stream", "leave", "cancel", "plain", "malformed", "oversized")
OUTCOMES = ("completed", "left", "cancelled", "refused_429", "refused_503", "rejected", "server_down", "failed", "hung")
REFERENCE_TOKENS = (8, 32, 64)


class Server:
  """The server subprocess: its URL once listening, its RSS sampled every 0.5 s, its stderr kept (the tail)."""

  def __init__(self, args):
    cmd = [sys.executable, "-m", "jetspec_jax.cli", "serve", "--target", args.target, "--port", "0", "--json",
           "--model-name", MODEL, "--slots", str(args.slots), "--max-prompt", str(args.max_prompt),
           "--max-tokens", str(max(REFERENCE_TOKENS)), "--segment-rounds", str(args.segment_rounds),
           "--drain-timeout", str(args.drain_timeout)]
    if args.max_waiting:
      cmd += ["--max-waiting", str(args.max_waiting)]
    if args.head:
      cmd += ["--head", args.head]
    self.t0 = time.perf_counter()
    self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self.stderr: list[str] = []
    self.rss: list[tuple[float, int]] = []
    self.terminated = False
    line = self.proc.stderr.readline()
    while line and "serving" not in line:
      self.stderr.append(line)
      line = self.proc.stderr.readline()
    match = re.search(r"http://\S+:\d+", line)
    if not match:
      self.proc.kill()
      raise SystemExit(f"the server did not start:\n{''.join(self.stderr[-20:])}")
    self.url, self.start_s = match.group(0), time.perf_counter() - self.t0
    threading.Thread(target=self._read_stderr, daemon=True).start()
    threading.Thread(target=self._sample, daemon=True).start()

  def _read_stderr(self):
    for line in self.proc.stderr:
      self.stderr = (self.stderr + [line])[-200:]

  def _sample(self):
    while self.proc.poll() is None:
      try:
        with open(f"/proc/{self.proc.pid}/status") as f:
          kb = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        self.rss.append((time.perf_counter() - self.t0, kb * 1024))
      except (OSError, StopIteration):
        pass
      time.sleep(0.5)

  def terminate(self) -> None:
    """SIGTERM, once (a second one is uvicorn's "exit now")."""
    if not self.terminated:
      self.terminated = True
      self.proc.send_signal(signal.SIGTERM)

  def stop(self, timeout: float = 120.0) -> tuple[int, dict | None]:
    """(exit code, its JSON) after SIGTERM (sent here unless already)."""
    self.terminate()
    out = self.proc.stdout.read()
    code = self.proc.wait(timeout)
    try:
      return code, json.loads(out)
    except json.JSONDecodeError:
      return code, None


def prompts(seed: int, count: int, vocab: int, max_prompt: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(1, min(vocab, 1000), int(rng.integers(4, max_prompt // 2))).tolist() for _ in range(count)]


def bad_bodies(prompt_ids: list[list[int]], max_prompt: int, limit: int) -> dict[str, list[tuple[str, int]]]:
  """kind -> [(raw body, expected status)]."""
  good = {"model": MODEL, "prompt": prompt_ids[0], "max_tokens": 4}
  dump = json.dumps
  return {
      "malformed": [('{"model": "soak", "prompt": ', 400), ("[1, 2]", 400), (dump({**good, "model": "gpt-4"}), 404),
                    (dump({k: v for k, v in good.items() if k != "model"}), 400), (dump({**good, "n": 2}), 400),
                    (dump({**good, "max_tokens": 0}), 400), (dump({**good, "temperature": "hot"}), 400),
                    (dump({**good, "frequency_penalty": 0.5}), 400), (dump({**good, "prompt": [1, 10 ** 6]}), 400)],
      "oversized": [(dump({**good, "prompt": list(range(1, max_prompt + 10))}), 400),
                    (dump({**good, "prompt": "a" * (limit + 1)}), 413)]}


class Load:
  """One phase's requests and what became of them."""

  def __init__(self, args, url: str, refs: dict, bad: dict, pool: list[list[int]]):
    self.args, self.url, self.refs, self.bad, self.pool = args, url, refs, bad, pool
    self.sigterm_at: float | None = None            # perf_counter time of the SIGTERM (None: not sent)
    self.rows: list[dict] = []

  def _down(self, t: float) -> bool:
    return self.sigterm_at is not None and t >= self.sigterm_at

  async def one(self, client: httpx.AsyncClient, kind: str, rng: random.Random) -> dict:
    """Send one request of ``kind``; its outcome."""
    sent = time.perf_counter()
    prompt = rng.randrange(len(self.pool))
    max_tokens = rng.choice(REFERENCE_TOKENS)
    body = {"model": MODEL, "prompt": self.pool[prompt], "max_tokens": max_tokens}
    url = f"{self.url}/v1/completions"
    row = {"kind": kind}
    try:
      if kind in ("malformed", "oversized"):
        raw, want = rng.choice(self.bad[kind])
        r = await client.post(url, content=raw, headers={"content-type": "application/json"})
        ok = r.status_code == want and set(r.json().get("error", {})) == {"message", "type", "param", "code"}
        row["outcome"] = self._refusal(r.status_code) or ("rejected" if ok else "failed")
        if row["outcome"] == "failed":
          row["error"] = f"{kind}: status {r.status_code}, expected {want}: {r.text[:200]}"
      elif kind in ("stream", "leave"):
        leave_after = rng.randint(1, 3) if kind == "leave" else None
        row.update(await self._stream(client, url, {**body, "stream": True}, leave_after, (prompt, max_tokens)))
      else:
        call = client.post(url, json=body)
        if kind == "cancel":
          try:
            r = await asyncio.wait_for(call, rng.uniform(0.0, 0.5))
          except asyncio.TimeoutError:
            row["outcome"] = "cancelled"
            return row
        else:
          r = await call
        row["outcome"] = self._refusal(r.status_code) or self._judge(r, (prompt, max_tokens))
        if row["outcome"] == "failed":
          row["error"] = f"status {r.status_code}: {r.text[:200]}"
    except httpx.ConnectError as e:
      row["outcome"] = "server_down" if self._down(sent) else "failed"
      row["error"] = f"ConnectError: {e}"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
      row["outcome"] = "failed"
      row["error"] = f"{type(e).__name__}: {e}"
    row["latency_s"] = time.perf_counter() - sent
    return row

  def _refusal(self, status: int) -> str | None:
    return {429: "refused_429", 503: "refused_503"}.get(status)

  def _judge(self, r: httpx.Response, ref_key) -> str:
    if r.status_code != 200:
      return "failed"
    text = r.json()["choices"][0]["text"]
    return "completed" if text == self.refs[ref_key] else "failed"

  async def _stream(self, client, url, body, leave_after, ref_key) -> dict:
    parts, chunks = [], 0
    async with client.stream("POST", url, json=body) as r:
      if r.status_code != 200:
        refusal = self._refusal(r.status_code)
        return {"outcome": refusal or "failed", **({} if refusal else {"error": f"status {r.status_code}"})}
      async for line in r.aiter_lines():
        if line == "data: [DONE]":
          break
        if not line.startswith("data: "):
          continue
        event = json.loads(line[6:])
        if "error" in event:
          return {"outcome": "failed", "error": f"error event: {event['error']['message']}"}
        parts.append(event["choices"][0]["text"])
        chunks += 1
        if leave_after is not None and chunks >= leave_after:
          return {"outcome": "left"}                  # leaving the block closes the connection mid-stream
      else:
        return {"outcome": "failed", "error": "the stream ended without [DONE]"}
    text = "".join(parts)
    if text != self.refs[ref_key]:
      return {"outcome": "failed", "error": f"text {text!r} differs from the reference {self.refs[ref_key]!r}"}
    return {"outcome": "completed"}

  async def run(self, count: int, rate: float, seed: int, sigterm: tuple[int, Server] | None = None) -> dict:
    """``count`` requests of the mix at Poisson ``rate``/s; with ``sigterm`` (i, server): SIGTERM at arrival i."""
    args = self.args
    rng = random.Random(seed)
    kinds = rng.choices(KINDS, weights=args.mix, k=count)
    arrive = load.arrivals(count, rate, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.time_limit), limits=limits) as client:
      t0 = time.perf_counter()

      async def at(i):
        await asyncio.sleep(max(0.0, t0 + arrive[i] - time.perf_counter()))
        if sigterm is not None and i == sigterm[0]:
          self.sigterm_at = time.perf_counter()
          sigterm[1].terminate()
        return await self.one(client, kinds[i], random.Random(seed * 1_000_003 + i))

      tasks = [asyncio.create_task(at(i)) for i in range(count)]
      done, pending = await asyncio.wait(tasks, timeout=arrive[-1] + args.time_limit)
      for t in pending:
        t.cancel()
      wall = time.perf_counter() - t0
    rows = [t.result() if t in done else {"kind": kinds[i], "outcome": "hung"} for i, t in enumerate(tasks)]
    self.rows += rows
    return summarize(rows, wall, rate)


def summarize(rows: list[dict], wall: float, rate: float | None) -> dict:
  by_kind = {k: {o: 0 for o in OUTCOMES} for k in KINDS}
  for r in rows:
    by_kind[r["kind"]][r["outcome"]] += 1
  totals = {o: sum(by_kind[k][o] for k in KINDS) for o in OUTCOMES}
  errors = sorted({r["error"] for r in rows if r["outcome"] == "failed" and "error" in r})
  lat = [r["latency_s"] for r in rows if r["outcome"] == "completed"]
  return {"requests": len(rows), "rate": rate, "wall_s": wall, "outcomes": totals, "by_kind": by_kind,
          "errors": errors[:10], "completed_latency_s": load.percentiles(lat)}


async def references(url: str, pool: list[list[int]]) -> dict:
  """(prompt index, max_tokens) -> the text of a request sent alone."""
  out = {}
  async with httpx.AsyncClient(timeout=120) as client:
    for i, p in enumerate(pool):
      for m in REFERENCE_TOKENS:
        r = await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": m})
        r.raise_for_status()
        out[(i, m)] = r.json()["choices"][0]["text"]
  return out


async def capacity(phase: Load, clients: int, seconds: float, seed: int) -> float:
  """Requests of the mix ended per second with ``clients`` closed-loop clients: the server's capacity for it."""
  kinds, weights = KINDS, phase.args.mix
  ended = 0
  async with httpx.AsyncClient(timeout=phase.args.time_limit) as client:
    end = time.perf_counter() + seconds

    async def worker(w):
      nonlocal ended
      rng = random.Random(seed * 7919 + w)
      while time.perf_counter() < end:
        await phase.one(client, rng.choices(kinds, weights=weights)[0], rng)
        ended += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    return ended / (time.perf_counter() - t0)


def rss_summary(server: Server, start: float, end: float) -> dict:
  """The server's RSS in MiB: after listening, peak, and at the start and end of [start, end] (seconds since
  its launch; the benches take the last three quarters of a phase, after the first allocations of traffic) with
  the growth between them."""
  xs = [(t, b / 2 ** 20) for t, b in server.rss]
  inside = [m for t, m in xs if start <= t <= end] or [m for _, m in xs[-1:]]
  listening = next((m for t, m in xs if t >= server.start_s), None)
  return {"listening_mib": listening, "peak_mib": max(m for _, m in xs), "window_s": [start, end],
          "window_first_mib": inside[0], "window_last_mib": inside[-1], "growth_mib": inside[-1] - inside[0],
          "samples": [[round(t, 1), round(m, 1)] for t, m in xs[::4]]}


def table(result: dict) -> str:
  rows = []
  for name in ("phase1", "phase2"):
    p = result[name]
    rows.append({"phase": name, "requests": p["requests"], **p["outcomes"]})
  return bench.format_table(rows)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench.add_model_args(p)
  p.add_argument("--ar", action="store_true", help="no head: autoregressive")
  p.add_argument("--requests", type=int, default=5000)
  p.add_argument("--overload", type=float, default=2.0, help="arrival rate over the measured capacity")
  p.add_argument("--mix", type=float, nargs=6, default=[45, 30, 8, 5, 8, 4], metavar="SHARE",
                 help="shares of " + ", ".join(KINDS))
  p.add_argument("--prompts", type=int, default=12)
  p.add_argument("--slots", type=int, default=8)
  p.add_argument("--max-prompt", type=int, default=64)
  p.add_argument("--max-waiting", type=int, default=None, help="default: the server's")
  p.add_argument("--segment-rounds", type=int, default=4)
  p.add_argument("--drain-timeout", type=float, default=60.0)
  p.add_argument("--capacity-seconds", type=float, default=15.0)
  p.add_argument("--time-limit", type=float, default=120.0, help="a request not ended after this is hung")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="JSON (default bench/results/serve_soak.json)")
  args = p.parse_args(argv)
  args.target, head = bench.model_paths(args)
  args.head = None if args.ar else head
  say = lambda s: print(s, file=sys.stderr, flush=True)
  cfg, _ = read_target_config(args.target)
  pool = prompts(args.seed, args.prompts, cfg.vocab_size, args.max_prompt)
  commit = bench.commit_of(__file__)
  result = {"machine": bench.machine_info(), "commit": commit, "target": os.path.abspath(args.target),
            "head": args.head and os.path.abspath(args.head),
            "settings": {k: v for k, v in vars(args).items() if k != "out"}}

  server = Server(args)
  say(f"server listening after {server.start_s:.1f} s at {server.url}")
  refs = asyncio.run(references(server.url, pool))
  limit = max(1 << 20, 64 * args.max_prompt)                   # the server's body limit (serve.Service)
  bad = bad_bodies(pool, args.max_prompt, limit)
  cap = asyncio.run(capacity(Load(args, server.url, refs, bad, pool), 2 * args.slots, args.capacity_seconds,
                             args.seed))
  rate = args.overload * cap
  say(f"capacity {cap:.1f} requests/s of the mix; sending at {rate:.1f}/s")
  first = int(0.8 * args.requests)
  phase1 = Load(args, server.url, refs, bad, pool)
  began = time.perf_counter() - server.t0
  result["capacity_requests_per_s"], result["rate"] = cap, rate
  result["phase1"] = asyncio.run(phase1.run(first, rate, args.seed, sigterm=(int(0.9 * first), server)))
  code, out = server.stop()
  result["phase1"]["exit_code"], result["phase1"]["server"] = code, out
  sigterm = phase1.sigterm_at - server.t0
  result["phase1"]["rss"] = rss_summary(server, began + (sigterm - began) / 4, sigterm)
  say(f"phase 1: {result['phase1']['outcomes']}; exit code {code}")

  server = Server(args)
  say(f"restarted: listening after {server.start_s:.1f} s")
  began = time.perf_counter() - server.t0
  phase2 = Load(args, server.url, refs, bad, pool)
  result["phase2"] = asyncio.run(phase2.run(args.requests - first, rate, args.seed + 1))
  health = httpx.get(f"{server.url}/health", timeout=30)
  deadline = time.monotonic() + 60
  while health.json()["outstanding"] and time.monotonic() < deadline:
    time.sleep(0.5)
    health = httpx.get(f"{server.url}/health", timeout=30)
  again = asyncio.run(references(server.url, pool))
  metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
  ended = began + result["phase2"]["wall_s"]
  result["phase2"]["rss"] = rss_summary(server, began + (ended - began) / 4, ended)
  result["after"] = {"health": health.json(), "health_status": health.status_code,
                     "references_equal": again == refs,
                     "metrics": [line for line in metrics.splitlines() if line.startswith("jetspec_requests_total")]}
  code, out = server.stop()
  result["phase2"]["exit_code"], result["phase2"]["server"] = code, out
  rows = phase1.rows + phase2.rows
  total = summarize(rows, 0.0, rate)["outcomes"]
  admitted_wellformed = sum(1 for r in rows if r["kind"] not in ("malformed", "oversized"))
  result["total"] = {"requests": len(rows), "outcomes": total, "left_share": total["left"] / len(rows),
                     "well_formed": admitted_wellformed}
  print(table(result))
  print(json.dumps(result["total"]))
  for path in bench.save_results(result, args.out, "serve_soak"):
    say(f"JSON: {path}")
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)

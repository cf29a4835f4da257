"""Paged against contiguous KV caches at one KV memory, on CPU with the demo's target and head.

Part 1, capacity: the ShareGPT request mix (``load.sharegpt_requests``: prompts up to --max-prompt, prompt and
reply within --context, replies capped at --max-output) all at once through two engines sized for --context
(every slot can take a prompt of --max-prompt plus --context - --max-prompt new tokens) that hold the same KV
memory (--kv-memory GiB, default four slots' full contexts): the paged engine, --paged-slots slots sharing a pool
of that memory's pages, and the contiguous one, ``pages=None`` with as many slots as whole contexts fit in it.
Output tokens/s of each and their ratio, from one run (one pass each, after a warm-up run that compiles), with
the paged engine's peak pages and preemptions.

Part 2, a shared prefix (--shared-prefix N, 0: off): --prefix-requests requests whose prompts start with one
N-token system prompt followed by each one's own ShareGPT turn (replies capped at --prefix-output), all at once
through the paged engine (``Engine.for_requests``): TTFT p50 / p99 and the prompt rows the engine computed, with
prefix caching on and off, against the unique prompt rows (the system prompt once, and every request's own turn).
Prompt rows computed: the prompts' tokens less the rows the prefix cache supplied (``cached_tokens`` of the
engine's per-request results); rows recomputed after a preemption are not counted.

    python bench/paged_load.py --workdir ~/.cache/jetspec-jax --json docs/benchmark_runs/paged_load.json
    python bench/paged_load.py --workdir ~/.cache/jetspec-jax --quick      # a smoke run

Progress on stderr; tables on stdout; JSON (per-request rows dropped) to --json.
"""
from __future__ import annotations

import argparse
import sys

import jax.numpy as jnp
import numpy as np

from jetspec_jax import bench, convert, load
from jetspec_jax.decode.engine import Engine, EnginePlan, Request, page_bytes
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
from jetspec_jax.tokenizer import load_tokenizer

GIB = 1 << 30
DEFAULT_CONTEXTS = 4     # --kv-memory's default: this many slots' full contexts
QUICK = {"requests": 8, "context": 512, "max_prompt": 256, "max_output": 16, "paged_slots": 8,
         "key_buckets": 1, "shared_prefix": 64, "prefix_requests": 6, "prefix_output": 8}


def summary(res: dict) -> dict:
  return {k: v for k, v in res.items() if k != "requests"}


class Setup:
  """The model, the tree and the engines' common sizes."""

  def __init__(self, args):
    target, head = bench.model_paths(args)
    self.cfg, self.params, _ = convert.load_target(target, jnp.float32)
    self.tokenizer = load_tokenizer(convert.read_target_config(target)[1])
    self.head = None if args.ar else convert.load_head(head, jnp.float32, target_cfg=self.cfg)
    self.tree = None if args.ar else TreeConfig("best_nodes", args.budget, args.width, self.head[0].depth)
    self.args = args

  @property
  def head_kw(self) -> dict:
    return {} if self.head is None else {"head_cfg": self.head[0], "head_params": self.head[1], "tree": self.tree}

  def plan(self, slots: int, pages: int | None, queue: int) -> EnginePlan:
    """An engine plan of ``slots`` slots of the whole --context and a pool of ``pages`` pages."""
    a = self.args
    nodes = 1 if self.tree is None else self.tree.num_nodes()
    return EnginePlan(slots=slots, rows=slots * nodes, lanes=a.lanes, prefill_rows=a.prefill_rows,
                      max_prompt=a.max_prompt, max_new_tokens=a.context - a.max_prompt, queue=queue, tree=self.tree,
                      key_buckets=a.key_buckets, page_rows=a.page_rows, pages=pages)

  def engine(self, plan: EnginePlan) -> Engine:
    return Engine(self.cfg, self.params, plan, eos_ids=(), attn_impl=self.args.attention,
                  **({} if self.head is None else
                                                              {"head_cfg": self.head[0], "head_params": self.head[1]}))

  @property
  def page_size(self) -> int:
    return page_bytes(self.cfg, None if self.head is None else self.head[0], self.args.page_rows, jnp.float32)

  @property
  def slot_pages(self) -> int:
    """Pages of one slot's whole context."""
    return self.plan(1, None, 1).max_pages(None if self.head is None else self.head[0])

  @property
  def memory(self) -> float:
    """The KV memory of both engines in bytes (--kv-memory, or DEFAULT_CONTEXTS slots' whole contexts)."""
    return self.args.kv_memory * GIB if self.args.kv_memory else DEFAULT_CONTEXTS * self.slot_pages * self.page_size


def measured(engine: Engine, requests, say, label: str) -> dict:
  """A warm-up run on the first requests (compiles), then the measured run."""
  say(f"{label}: compiling (warm-up on {min(len(requests), engine.plan.slots)} requests)")
  load.run_engine(engine, requests[:max(2, engine.plan.slots)])
  say(f"{label}: measuring {len(requests)} requests")
  return load.run_engine(engine, requests, progress=say)


def capacity(s: Setup, say) -> dict:
  """Part 1 (module docstring)."""
  a = s.args
  requests = load.sharegpt_requests(s.tokenizer, a.requests, max_output=a.max_output, max_prompt=a.max_prompt,
                                    context=a.context)
  slot_pages, memory = s.slot_pages, s.memory
  pages = int(memory // s.page_size)
  contiguous_slots = pages // slot_pages
  if contiguous_slots < 1:
    raise JetSpecError(f"--kv-memory {memory / GIB:.3g} GiB holds no whole context of {a.context} positions "
                       f"({slot_pages * s.page_size / GIB:.3g} GiB); give more")
  say(f"{len(requests)} ShareGPT requests: prompt mean {np.mean([len(r.prompt) for r in requests]):.0f} tokens, "
      f"output mean {np.mean([r.max_new_tokens for r in requests]):.0f}; KV memory {memory / GIB:.4g} GiB = "
      f"{pages} pages of {a.page_rows} rows: paged {a.paged_slots} slots, contiguous {contiguous_slots} slots")
  paged = s.engine(s.plan(a.paged_slots, pages, len(requests)))
  contiguous = s.engine(s.plan(contiguous_slots, None, len(requests)))
  runs = {"contiguous": measured(contiguous, requests, say, f"contiguous x{contiguous_slots}"),
          "paged": measured(paged, requests, say, f"paged x{a.paged_slots}")}
  if [r["tokens"] for r in runs["paged"]["requests"]] != [r["tokens"] for r in runs["contiguous"]["requests"]]:
    say("note: the two engines' tokens differ for some requests (programs of other shapes can break float32 "
        "near-ties differently)")
  for name, r in runs.items():
    say(f"{name}: {r['tokens_per_s']:.0f} tokens/s, KV pages peak {r['kv_pages_peak']} of {r['kv_pages']}, "
        f"preemptions {r['preemptions']}")
  return {"requests": len(requests), "context": a.context, "kv_memory_gib": memory / GIB, "page_bytes": s.page_size,
          "slot_pages": slot_pages, "slots": {"paged": a.paged_slots, "contiguous": contiguous_slots},
          "prompt_mean": float(np.mean([len(r.prompt) for r in requests])),
          "output_mean": float(np.mean([r.max_new_tokens for r in requests])),
          "engines": {k: summary(v) for k, v in runs.items()},
          "paged_vs_contiguous": runs["paged"]["tokens_per_s"] / runs["contiguous"]["tokens_per_s"]}


def shared_prefix_requests(s: Setup) -> tuple[list[int], list[Request]]:
  """(the system prompt's N ids, the requests): ShareGPT replies from the first conversations make the system
  prompt; each request's turn is its own ShareGPT user turn."""
  from jetspec_jax.train.sources import iter_conversations
  a = s.args
  prefix: list[int] = []
  for conv in iter_conversations("sharegpt"):
    prefix += [t for m in conv if m["role"] == "assistant" for t in s.tokenizer(m["content"])["input_ids"]]
    if len(prefix) >= a.shared_prefix:
      break
  prefix = prefix[:a.shared_prefix]
  turns = load.sharegpt_requests(s.tokenizer, a.prefix_requests, max_output=a.prefix_output,
                                 max_prompt=a.max_prompt - a.shared_prefix, context=a.context - a.shared_prefix)
  return prefix, [Request(prefix + list(r.prompt), r.max_new_tokens) for r in turns]


def shared_prefix(s: Setup, say) -> dict:
  """Part 2 (module docstring)."""
  a = s.args
  prefix, requests = shared_prefix_requests(s)
  pages = int(s.memory // s.page_size)
  prompt_tokens = sum(len(r.prompt) for r in requests)
  unique = prompt_tokens - (len(requests) - 1) * len(prefix)
  out = {"prefix_tokens": len(prefix), "requests": len(requests), "prompt_tokens": prompt_tokens,
         "unique_prompt_rows": unique, "runs": {}}
  for caching in (True, False):
    engine = Engine.for_requests(s.cfg, s.params, requests, slots=a.paged_slots, lanes=a.lanes,
                                 prefill_rows=a.prefill_rows, key_buckets=a.key_buckets, page_rows=a.page_rows,
                                 pages=pages, eos_ids=(), prefix_caching=caching, attn_impl=a.attention,
                                 **s.head_kw)
    label = f"shared prefix, caching {'on' if caching else 'off'}"
    r = measured(engine, requests, say, label)
    computed = r["prompt_tokens_computed"]
    out["runs"]["caching" if caching else "no_caching"] = summary(r) | {
        "prompt_rows_computed": computed, "computed_vs_unique": computed / unique}
    say(f"{label}: TTFT p50 {r['ttft_s']['p50']:.2f}s p99 {r['ttft_s']['p99']:.2f}s, prompt rows computed "
        f"{computed} ({computed / unique:.2f}x the unique rows), {r['tokens_per_s']:.0f} tokens/s")
  runs = out["runs"]
  out["ttft_p50_caching_vs_off"] = runs["caching"]["ttft_s"]["p50"] / runs["no_caching"]["ttft_s"]["p50"]
  return out


def tables(result: dict) -> str:
  lines = []
  if "capacity" in result:
    c = result["capacity"]
    rows = [{"engine": name, "slots": c["slots"][name], "KV GiB": c["kv_memory_gib"], "tokens/s": r["tokens_per_s"],
             "kv_pages": r["kv_pages"], "kv_pages_peak": r["kv_pages_peak"], "preemptions": r["preemptions"],
             "occupancy": r["occupancy"], "tau": r["tau"], "TTFT p50 s": r["ttft_s"]["p50"]}
            for name, r in c["engines"].items()]
    lines += [bench.format_table(rows), f"paged / contiguous tokens/s: {c['paged_vs_contiguous']:.2f}x"]
  if "shared_prefix" in result:
    sp = result["shared_prefix"]
    rows = [{"prefix caching": name, "requests": sp["requests"], "prefix tokens": sp["prefix_tokens"],
             "TTFT p50 s": r["ttft_s"]["p50"], "TTFT p99 s": r["ttft_s"]["p99"],
             "prompt rows computed": r["prompt_rows_computed"], "x unique rows": r["computed_vs_unique"],
             "tokens/s": r["tokens_per_s"]}
            for name, r in sp["runs"].items()]
    lines += [bench.format_table(rows), f"TTFT p50, caching on / off: {sp['ttft_p50_caching_vs_off']:.2f}x"]
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench.add_model_args(p)
  p.add_argument("--quick", action="store_true", help="a smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
  p.add_argument("--requests", type=int, default=120, help="part 1's ShareGPT requests")
  p.add_argument("--context", type=int, default=8192, help="every slot's capacity: prompt plus new tokens")
  p.add_argument("--max-prompt", type=int, default=4096, help="every slot's prompt capacity (longer ones skipped)")
  p.add_argument("--max-output", type=int, default=1024, help="replies are capped at this many tokens")
  p.add_argument("--kv-memory", type=float, default=None,
                 help=f"GiB of KV pages both engines hold (default: {DEFAULT_CONTEXTS} slots' full contexts)")
  p.add_argument("--page-rows", type=int, default=16)
  p.add_argument("--paged-slots", type=int, default=16)
  p.add_argument("--ar", action="store_true", help="plain AR decoding (default: the head's best_nodes tree)")
  p.add_argument("--budget", type=int, default=4, help="tree nodes per slot")
  p.add_argument("--width", type=int, default=4)
  p.add_argument("--lanes", type=int, default=1, help="prefill lanes")
  p.add_argument("--prefill-rows", type=int, default=64, help="prompt rows per lane and round")
  p.add_argument("--key-buckets", type=int, default=4)
  p.add_argument("--attention", default="auto", help="the engines' attention (auto: xla_ragged on CPU; xla gathers "
                 "every slot's keys as long as the longest slot's)")
  p.add_argument("--shared-prefix", type=int, default=1000, help="part 2's system prompt tokens (0: no part 2)")
  p.add_argument("--prefix-requests", type=int, default=100)
  p.add_argument("--prefix-output", type=int, default=64, help="part 2's replies are capped at this many tokens")
  p.add_argument("--no-capacity", action="store_true", help="skip part 1")
  p.add_argument("--json", default=None, help="JSON path (default bench/results/paged_load.json)")
  args = p.parse_args(argv)
  if args.quick:
    for k, v in QUICK.items():
      if getattr(args, k) == p.get_default(k):
        setattr(args, k, v)
  say = lambda s: print(s, file=sys.stderr, flush=True)
  s = Setup(args)
  result = {"machine": bench.machine_info(), "commit": bench.commit_of(__file__),
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}
  if not args.no_capacity:
    result["capacity"] = capacity(s, say)
  if args.shared_prefix:
    result["shared_prefix"] = shared_prefix(s, say)
  print(tables(result))
  for path in bench.save_results(result, args.json, "paged_load"):
    say(f"JSON: {path}")
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)

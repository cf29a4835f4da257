"""Conversion benchmark: HF safetensors -> orbax (``convert_hf``) and orbax -> HF (``export_hf``).

What it measures, on a synthetic Qwen3-4B-shaped checkpoint (hidden 2560, 36 layers, 32 q / 8 kv
heads, head_dim 128, MLP 9728, vocab 151936, tied embeddings, random bf16: 4.02e9 parameters,
8.04 GB) or, with ``--quick``, a 0.56 GB model of the same vocabulary:

  write    the synthetic HF checkpoint is written as sharded safetensors + index, streamed one
           tensor at a time through ``convert.write_safetensors`` (a lazy adapter creates each
           tensor only when the writer asks for its data), so the writer never holds the model.
  convert  ``convert_hf`` HF -> orbax, timed around the call: GB/s = model bytes / seconds.
  export   ``export_hf`` orbax -> HF (sharded safetensors), likewise.
  verify   the export is compared with the original, tensor by tensor (keys, dtype, shape and
           bytes), one tensor in memory at a time.

Each stage runs in its own subprocess, so its peak resident memory is its own: the parent reads
the child's ``ru_maxrss`` from ``os.wait4`` and polls ``/proc/<pid>/status`` (RssAnon = heap,
RssFile = file pages mapped, e.g. safetensors mmaps), and the child itself records per-phase
peaks at the phases ``convert_hf`` / ``export_hf`` report through their ``on_phase`` hook (convert:
load / orbax_save / after_save; export: restore / safetensors_write / after_write). Peak RSS is
reported as a multiple of the model's bytes (goal: <= 1.3x). The reads come from the page cache
when the files were just written and RAM allows it (the usual case here), so GB/s is not disk
bound; the page cache is not counted in RSS.

  python bench/convert_bench.py --quick                      # ~0.5 GB, a minute or two
  python bench/convert_bench.py --workdir /work/tmp_bench    # Qwen3-4B size: needs ~26 GB disk
  python bench/convert_bench.py --keep                       # keep the checkpoints afterwards

JSON goes to --out (default bench/results/convert_bench.json) and $OUT/convert_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from jetspec_jax import bench

GB = 1e9
GOAL_RSS_MULTIPLE = 1.3

# name -> Qwen3Config kwargs
MODELS = {
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                     tie_word_embeddings=True, max_position_embeddings=40960, eos_token_ids=(151645,),
                     bos_token_id=151643),
    # ~0.56 GB: the 4B vocabulary with a narrow, shallow trunk.
    "quick": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, max_position_embeddings=40960, eos_token_ids=(151645,),
                  bos_token_id=151643),
}


# ----------------------------------------------------------------------------------------------
# Synthetic weights, created one tensor at a time.

class LazyTensor:
  """Stands in for a jax.Array in ``convert.write_safetensors``: shape / dtype / size are known up
  front; the (deterministic, random bf16) data is generated only when ``__array__`` is called,
  i.e. when the writer fetches this tensor, and is dropped by the writer right after."""

  def __init__(self, name: str, shape: tuple[int, ...], init: str, seed: int):
    import ml_dtypes
    import numpy as np
    self.name, self.shape, self.init = name, tuple(shape), init
    self.dtype = np.dtype(ml_dtypes.bfloat16)
    self.size = int(np.prod(self.shape, dtype=np.int64))
    self.ndim = len(self.shape)
    self.seed = (seed * 1_000_003 + zlib.crc32(name.encode())) & 0xFFFFFFFF

  def __array__(self, dtype=None, copy=None):
    import numpy as np
    rng = np.random.default_rng(self.seed)
    out = np.empty(self.size, np.uint16)
    # Random finite bf16 bit patterns: random sign and mantissa, exponent in a narrow band
    # (weights: |x| in [2^-10, 2^-2); norms: [0.5, 2)). Generated in chunks to bound temporaries.
    lo, span = (126, 2) if self.init == "ones" else (117, 8)
    chunk = 1 << 24
    for start in range(0, self.size, chunk):
      u = rng.integers(0, 1 << 16, size=min(chunk, self.size - start), dtype=np.uint16)
      exp = (lo + (u >> 7) % span).astype(np.uint16)
      out[start:start + u.size] = (u & 0x807F) | (exp << 7)
    arr = out.view(self.dtype).reshape(self.shape)
    return arr if dtype is None else arr.astype(dtype)


class LazyParams(dict):
  """{param name: LazyTensor} for every weight the target declares."""

  @classmethod
  def for_config(cls, cfg, seed: int = 0) -> "LazyParams":
    from jetspec_jax.models.qwen3 import param_specs
    return cls({name: LazyTensor(name, spec.shape, "ones" if spec.axes == ("norm",) else "normal", seed)
                for name, spec in param_specs(cfg).items()})


def make_config(name: str, num_layers: int | None = None):
  from jetspec_jax.config import Qwen3Config
  kwargs = dict(MODELS[name])
  if num_layers:
    kwargs["num_hidden_layers"] = num_layers
  return Qwen3Config(**kwargs)


def model_bytes(cfg) -> int:
  from jetspec_jax.models.qwen3 import param_specs
  import numpy as np
  return int(sum(int(np.prod(s.shape, dtype=np.int64)) for s in param_specs(cfg).values())) * 2


# ----------------------------------------------------------------------------------------------
# Memory sampling.

def read_status(pid: int | str = "self") -> dict[str, int]:
  """VmRSS / RssAnon / RssFile / RssShmem in bytes from /proc/<pid>/status ({} if gone)."""
  out = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
          out[key] = int(line.split()[1]) * 1024
  except (OSError, ValueError):
    pass
  return out


class PhaseSampler:
  """A thread sampling this process's RSS (every ``interval`` s) and keeping the peak of each
  component per named phase; ``phase(name)`` switches the current phase."""

  def __init__(self, interval: float = 0.02):
    self.interval, self.current, self.peaks, self.times = interval, "start", {}, {}
    self._t0 = time.perf_counter()
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def __enter__(self):
    self.phase("start")
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self._sample()

  def phase(self, name: str) -> None:
    with self._lock:
      self._sample()
      self.current = name
      self.times.setdefault(name, round(time.perf_counter() - self._t0, 3))
      self._sample()

  def _sample(self):
    s = read_status()
    peak = self.peaks.setdefault(self.current, {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "RssShmem": 0})
    for k in peak:
      peak[k] = max(peak[k], s.get(k, 0))

  def _run(self):
    while not self._stop.wait(self.interval):
      with self._lock:
        self._sample()


# ----------------------------------------------------------------------------------------------
# Stages (each runs in a child process: ``--stage NAME``).

def sampled(run, key: str = "info") -> dict:
  """``run(phase)`` timed, with a ``PhaseSampler`` whose ``phase`` it is handed: the write stage names its
  one phase itself, convert_hf / export_hf take it as their ``on_phase`` hook."""
  with PhaseSampler() as sampler:
    t0 = time.perf_counter()
    out = run(sampler.phase)
    seconds = time.perf_counter() - t0
    sampler.phase("end")
  return {"seconds": seconds, key: out, "phases": sampler.peaks, "phase_start_s": sampler.times}


def stage_write(args) -> dict:
  import jax.numpy as jnp
  from jetspec_jax import convert
  cfg = make_config(args.model, args.num_layers)
  params = LazyParams.for_config(cfg, args.seed)

  def write(phase):
    phase("write")
    with convert.atomic_directory(args.hf_dir, overwrite=True) as tmp:
      files = convert.write_safetensors(tmp, convert.target_mappings(cfg), params, shard_bytes=args.src_shard_bytes)
      with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(str(jnp.dtype(jnp.bfloat16))), f, indent=2)
    return files
  return sampled(write, key="files")


def stage_convert(args) -> dict:
  from jetspec_jax import convert
  return sampled(lambda phase: convert.convert_hf(args.hf_dir, args.ckpt_dir, overwrite=True, on_phase=phase))


def stage_export(args) -> dict:
  from jetspec_jax import convert
  return sampled(lambda phase: convert.export_hf(args.ckpt_dir, args.export_dir, shard_bytes=args.out_shard_bytes,
                                                 overwrite=True, on_phase=phase))


def stage_verify(args) -> dict:
  """Bit-exact comparison of two HF directories, one tensor at a time."""
  import numpy as np
  from safetensors import safe_open
  from jetspec_jax.convert import SafetensorsReader
  with PhaseSampler() as sampler:
    sampler.phase("verify")
    t0 = time.perf_counter()
    a, b = SafetensorsReader(args.hf_dir), SafetensorsReader(args.export_dir)
    keys_a, keys_b = a.keys(), b.keys()
    mismatches = sorted(keys_a ^ keys_b)[:5]
    compared = 0

    def read(reader, key):
      # Open, read, close: a kept-open handle would leave every page read so far mapped (and in RSS).
      with safe_open(reader.files[key], "numpy") as f:
        return f.get_tensor(key)

    for key in sorted(keys_a & keys_b):
      x, y = read(a, key), read(b, key)
      if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x.view(np.uint8), y.view(np.uint8)):
        mismatches.append(key)
      compared += 1
      del x, y
    with open(os.path.join(args.hf_dir, "config.json")) as f1, open(os.path.join(args.export_dir, "config.json")) as f2:
      config_same = json.load(f1) == json.load(f2)
    seconds = time.perf_counter() - t0
    sampler.phase("end")
  return {"seconds": seconds, "bit_exact": not mismatches and keys_a == keys_b, "config_same": config_same,
          "tensors_compared": compared, "tensors_in_source": len(keys_a), "tensors_in_export": len(keys_b),
          "first_mismatches": mismatches[:5], "phases": sampler.peaks}


STAGES = {"write": stage_write, "convert": stage_convert, "export": stage_export, "verify": stage_verify}


# ----------------------------------------------------------------------------------------------
# Parent: run each stage in a subprocess and watch its memory.

def run_stage(name: str, args, poll_s: float = 0.05) -> dict:
  """Run ``--stage name`` in a child; returns its result plus RSS as seen from outside."""
  with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
    result_path = f.name
  cmd = [sys.executable, os.path.abspath(__file__), "--stage", name, "--model", args.model,
         "--seed", str(args.seed), "--num-layers", str(args.num_layers or 0), "--hf-dir", args.hf_dir, "--ckpt-dir", args.ckpt_dir,
         "--export-dir", args.export_dir, "--src-shard-bytes", str(args.src_shard_bytes),
         "--out-shard-bytes", str(args.out_shard_bytes), "--result", result_path]
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd)
  peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
  while True:
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid:
      break
    s = read_status(proc.pid)
    for k in peak:
      peak[k] = max(peak[k], s.get(k, 0))
    time.sleep(poll_s)
  proc.returncode = os.waitstatus_to_exitcode(status)
  wall = time.perf_counter() - t0
  if proc.returncode != 0:
    raise SystemExit(f"stage {name} failed with exit code {proc.returncode}")
  with open(result_path) as f:
    res = json.load(f)
  os.unlink(result_path)
  res.update(process_wall_s=wall, ru_maxrss_bytes=usage.ru_maxrss * 1024, polled_peak=peak)
  return res


def dir_bytes(path: str) -> int:
  return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def free_bytes(path: str) -> int:
  st = os.statvfs(path)
  return st.f_bavail * st.f_frsize


def mem_available_bytes() -> int:
  with open("/proc/meminfo") as f:
    return int(next(line for line in f if line.startswith("MemAvailable")).split()[1]) * 1024


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="a ~0.56 GB model instead of the 8 GB Qwen3-4B shape")
  p.add_argument("--workdir", default=None,
                 help="directory for the checkpoints (default: a fresh directory under /work/tmp_bench "
                      "when it exists, else the system temp dir)")
  p.add_argument("--keep", action="store_true", help="keep the checkpoints instead of deleting them")
  p.add_argument("--out", default=None, help="JSON result path (default bench/results/convert_bench.json)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--src-shard-bytes", type=int, default=None,
                 help="shard size of the synthetic HF checkpoint (default 4 GiB; --quick: 128 MiB)")
  p.add_argument("--out-shard-bytes", type=int, default=None,
                 help="shard size passed to export_hf (default 4 GiB; --quick: 128 MiB)")
  p.add_argument("--num-layers", type=int, default=None,
                 help="override the number of layers (e.g. to scale the 4B shape down to probe memory scaling)")
  p.add_argument("--force", action="store_true", help="run even if disk or memory look insufficient")
  # internal (child processes)
  p.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
  p.add_argument("--model", default=None, help=argparse.SUPPRESS)
  p.add_argument("--hf-dir", help=argparse.SUPPRESS)
  p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
  p.add_argument("--export-dir", help=argparse.SUPPRESS)
  p.add_argument("--result", help=argparse.SUPPRESS)
  args = p.parse_args(argv)

  if args.stage:                                        # child
    res = STAGES[args.stage](args)
    import resource
    res["self_ru_maxrss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    bench.write_json(args.result, res)
    return 0

  from jetspec_jax.convert import DEFAULT_SHARD_BYTES
  args.model = args.model or ("quick" if args.quick else "qwen3-4b")
  small_shards = 128 * 1024 ** 2
  args.src_shard_bytes = args.src_shard_bytes or (small_shards if args.quick else DEFAULT_SHARD_BYTES)
  args.out_shard_bytes = args.out_shard_bytes or (small_shards if args.quick else DEFAULT_SHARD_BYTES)
  cfg = make_config(args.model, args.num_layers)
  nbytes = model_bytes(cfg)

  base = args.workdir or ("/work/tmp_bench" if os.path.isdir("/work/tmp_bench") else tempfile.gettempdir())
  os.makedirs(base, exist_ok=True)
  work = tempfile.mkdtemp(prefix="convert_bench-", dir=base)
  args.hf_dir, args.ckpt_dir, args.export_dir = (os.path.join(work, n) for n in ("hf", "ckpt", "export"))
  need_disk, have_disk, have_mem = 3.1 * nbytes, free_bytes(work), mem_available_bytes()
  print(f"model {args.model}: {nbytes / GB:.2f} GB bf16; workdir {work}; free disk {have_disk / GB:.0f} GB, "
        f"MemAvailable {have_mem / GB:.1f} GB", flush=True)
  if not args.force and (have_disk < need_disk or have_mem < 1.5 * nbytes):
    shutil.rmtree(work, ignore_errors=True)
    raise SystemExit(f"not enough room: need ~{need_disk / GB:.0f} GB disk and ~{1.5 * nbytes / GB:.0f} GB "
                     f"available memory (use --force to try anyway)")

  stages = {}
  try:
    for name in ("write", "convert", "export", "verify"):
      print(f"[{name}] ...", flush=True)
      stages[name] = run_stage(name, args)
      print(f"[{name}] {stages[name]['seconds']:.1f}s, peak RSS {stages[name]['ru_maxrss_bytes'] / GB:.2f} GB",
            flush=True)
    sizes = {"hf_bytes": dir_bytes(args.hf_dir), "orbax_bytes": dir_bytes(args.ckpt_dir),
             "export_bytes": dir_bytes(args.export_dir)}
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)

  rows = []
  for name, what in (("write", "synthetic HF write (streamed)"), ("convert", "HF -> orbax (convert_hf)"),
                     ("export", "orbax -> HF (export_hf)"), ("verify", "bit-exact check")):
    s = stages[name]
    rss = s["ru_maxrss_bytes"]
    phase_peaks = {ph: round(v["VmRSS"] / nbytes, 2) for ph, v in s["phases"].items() if v["VmRSS"]}
    baseline = s["phases"].get("start", {}).get("VmRSS", 0)     # interpreter + imports, before any work
    rows.append({"stage": what, "seconds": s["seconds"], "GB/s": nbytes / GB / s["seconds"],
                 "peak RSS GB": rss / GB, "RSS / model": rss / nbytes,
                 "(RSS - import baseline) / model": (rss - baseline) / nbytes,
                 "anon / file (GB)": f"{s['polled_peak']['RssAnon'] / GB:.2f} / {s['polled_peak']['RssFile'] / GB:.2f}",
                 "goal <= 1.3x": (rss / nbytes <= GOAL_RSS_MULTIPLE) if name in ("convert", "export") else None,
                 "per-phase peak RSS / model": ", ".join(f"{k} {v}" for k, v in phase_peaks.items()
                                                          if k not in ("start", "end"))})
  result = {
      "benchmark": "convert_bench", "model": args.model,
      "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in MODELS[args.model].items()}
      | {"num_hidden_layers": cfg.num_hidden_layers},
      "model_bytes": nbytes, "num_params": nbytes // 2, "dtype": "bfloat16",
      "src_shard_bytes": args.src_shard_bytes, "out_shard_bytes": args.out_shard_bytes,
      "bit_exact": stages["verify"]["bit_exact"], "goal_rss_multiple": GOAL_RSS_MULTIPLE,
      "stages": stages, "sizes": sizes, "table": rows, "kept": args.keep, "workdir": work if args.keep else None,
      "machine": bench.machine_info(),
  }
  print()
  print(bench.format_table(rows))
  print(f"\nround trip bit-exact: {result['bit_exact']} ({stages['verify']['tensors_compared']} tensors); "
        f"sizes: HF {sizes['hf_bytes'] / GB:.2f} GB, orbax {sizes['orbax_bytes'] / GB:.2f} GB, "
        f"export {sizes['export_bytes'] / GB:.2f} GB")
  for path in bench.save_results(result, args.out, "convert_bench"):
    print(f"wrote {path}")
  return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
  sys.exit(main())

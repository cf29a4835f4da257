"""The command line: JSON output on success, one sentence and exit status 2 on bad input."""
import json
import os

import pytest

from jetspec_jax import cache, cli, convert
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head


def run(capsys, *argv):
  code = cli.main(list(argv))
  out = capsys.readouterr()
  return code, out.out, out.err


def test_convert_generate_export_json(hf_dir, tmp_path, capsys):
  src = hf_dir("dense_tied", "float32")
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  code, stdout, _ = run(capsys, "convert", src, ckpt, "--json")
  assert code == 0 and json.loads(stdout)["dtype"] == "float32"
  code, stdout, _ = run(capsys, "generate", "--target", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", "5",
                        "--eos-ids", "", "--json")
  res = json.loads(stdout)
  assert code == 0 and len(res["token_ids"]) == 5 and res["wall_s"] > 0
  assert res["first_token_round"] == 0 and res["target_forwards"] == 5     # the prompt in round 0, then 4 AR rounds
  cfg, _, _ = convert.load_target(ckpt)
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=4)
  convert.save_head(str(tmp_path / "head"), head_cfg, draft_head.init_head(head_cfg, __import__("jax").random.key(0)))
  code, stdout, _ = run(capsys, "generate", "--target", ckpt, "--head", str(tmp_path / "head"), "--prompt-ids",
                        "1,2,3", "--max-new-tokens", "5", "--eos-ids", "", "--budget", "8", "--width", "2", "--json")
  spec = json.loads(stdout)
  assert code == 0 and spec["token_ids"] == res["token_ids"] and spec["rounds"] >= 1 and "tau" in spec
  code, stdout, _ = run(capsys, "export", ckpt, out, "--json")
  assert code == 0 and os.path.isfile(os.path.join(out, "config.json"))
  # restored sharded over this process's devices (model axis), written one weight at a time
  assert json.loads(stdout)["restored_on"]["model"] == convert.export_mesh(cfg).shape["model"] > 1


@pytest.mark.parametrize("argv,phrase", [
    (["generate", "--target", "/nonexistent/model", "--prompt-ids", "1"], "target not found"),
    (["convert", "/nonexistent/model", "OUT"], "not found"),
    (["train", "--config", "configs/tiny.py", "--config.train.stepz=3"], "unknown config key"),
    (["train", "--config", "configs/tiny.py", "--config.train.steps=abc"], "expects a int"),
    (["train", "--config", "no_such_config"], "config file not found"),
])
def test_bad_input_is_one_sentence_and_status_2(capsys, tmp_path, argv, phrase):
  argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
  code, _, err = run(capsys, *argv)
  assert code == 2 and phrase in err and "Traceback" not in err
  assert not os.path.exists(tmp_path / "out")


def test_bad_generate_options(hf_dir, tmp_path, capsys):
  src = hf_dir("dense_tied", "float32")
  for argv, phrase in [(["--prompt-ids", "1,x"], "comma-separated integers"),
                       (["--prompt-ids", "1", "--dtype", "fp8"], "unknown dtype"),
                       (["--prompt-ids", "1", "--mesh", "3x3"], "must fit inside one host"),
                       (["--prompt-ids", "1", "--mesh", "9x1"], "needs 9 devices"),
                       (["--prompt-ids", "1", "--attention", "cuda"], "unknown attention"),
                       (["--prompt-ids", "99999"], "outside the vocabulary"),
                       (["--prompt", "hello"], "tokenizer"),
                       (["--prompt-ids", "1", "--kernel-tuning", str(tmp_path / "none.json")], "does not exist")]:
    code, _, err = run(capsys, "generate", "--target", src, *argv)
    assert code == 2 and phrase in err, (argv, err)


def test_convert_refuses_a_non_empty_output(hf_dir, tmp_path, capsys):
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("x")
  code, _, err = run(capsys, "convert", hf_dir("dense_tied", "float32"), str(out))
  assert code == 2 and "already exists" in err and (out / "keep.txt").read_text() == "x"


def test_generate_takes_a_kernel_tuning_table(hf_dir, tmp_path, capsys, monkeypatch):
  """--kernel-tuning checks the table and hands it to the engine inside the attention choice
  (test_decode_attention runs the loops under a table); a bad table is refused before any model is loaded."""
  from jetspec_jax.attention import AttentionImpl
  from jetspec_jax.decode import engine
  from pallas_kernels import tuning
  table = tuning.KernelTuning(rules=((1, tuning.LaunchConfig(block_r=16)),))
  path = tmp_path / "tuning.json"
  table.save(path)
  seen, init = [], engine.Engine.__init__
  monkeypatch.setattr(engine.Engine, "__init__",
                      lambda self, *a, **kw: (seen.append(kw["attn_impl"]), init(self, *a, **kw))[1])
  argv = ["generate", "--target", hf_dir("dense_tied", "float32"), "--prompt-ids", "1,2", "--max-new-tokens", "2",
          "--json", "--kernel-tuning"]
  # auto on CPU: xla_ragged
  code, stdout, _ = run(capsys, *argv, str(path))
  assert code == 0 and seen == [AttentionImpl("xla_ragged", table)] and len(json.loads(stdout)["token_ids"]) == 2
  path.write_text('{"rules": [{"max_rows": 4, "blockr": 16}]}')
  code, _, err = run(capsys, *argv, str(path))
  assert code == 2 and "unknown key(s) ['blockr']" in err


def test_compilation_cache_directory_resolution(tmp_path):
  """--compilation-cache, then $JETSPEC_COMPILATION_CACHE, then jax's own directory, then xla/ under the
  demo's --workdir or $JETSPEC_CACHE; 'off' turns it off at either level."""
  resolve = cache.compilation_cache_dir
  flag, mine, jax_dir, work = (str(tmp_path / n) for n in ("flag", "env", "jax", "work"))
  env = {cache.COMPILATION_CACHE_ENV: mine}
  assert resolve(flag, env, jax_dir, work) == flag
  assert resolve(None, env, jax_dir, work) == mine
  assert resolve(None, {}, jax_dir, work) == jax_dir
  assert resolve(None, {}, None, work) == os.path.join(work, "xla")
  assert resolve("off", env, jax_dir, work) is None and resolve(None, {cache.COMPILATION_CACHE_ENV: "OFF"}, jax_dir, work) is None
  assert resolve("~/c", {}, None, None) == os.path.join(os.path.expanduser("~"), "c")


def test_an_uncreatable_default_cache_warns_and_an_asked_for_one_is_an_error(tmp_path, capsys):
  (tmp_path / "file").write_text("x")
  blocked = str(tmp_path / "file" / "xla")
  assert cache.usable_cache_dir(blocked, asked=False) is None
  assert "compiling without a cache" in capsys.readouterr().err
  with pytest.raises(JetSpecError, match="cannot create the compilation cache directory"):
    cache.usable_cache_dir(blocked, asked=True)
  assert cache.usable_cache_dir(str(tmp_path / "new" / "xla"), asked=True) == str(tmp_path / "new" / "xla")


def test_a_rerun_loads_its_programs_from_the_compilation_cache(hf_dir, tmp_path):
  """Two separate `generate` processes with one --compilation-cache: the first writes the compiled
  programs, the second loads them (jax logs the hits) and gives the same tokens; an uncreatable
  directory is one sentence and status 2."""
  import subprocess
  import sys
  cache = tmp_path / "xla"
  argv = [sys.executable, "-m", "jetspec_jax.cli", "generate", "--target", hf_dir("dense_tied", "float32"),
          "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--eos-ids", "", "--json"]
  env = dict(os.environ, JAX_LOG_COMPILES="1")
  runs = [subprocess.run(argv + ["--compilation-cache", str(cache)], env=env, capture_output=True, text=True,
                         timeout=300) for _ in range(2)]
  assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
  first, second = (json.loads(r.stdout) for r in runs)
  assert first["compilation_cache"] == second["compilation_cache"] == str(cache) and any(cache.iterdir())
  assert "Persistent compilation cache hit" not in runs[0].stderr
  assert "Persistent compilation cache hit" in runs[1].stderr
  assert first["token_ids"] == second["token_ids"]
  (tmp_path / "file").write_text("x")
  bad = subprocess.run(argv + ["--compilation-cache", str(tmp_path / "file" / "xla")], env=env,
                       capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "cannot create the compilation cache directory" in bad.stderr


def test_json_mode_keeps_library_chatter_off_stdout(tmp_path, capfd, monkeypatch):
  """`train --json` prepares a TFDS dataset, which prints "Downloading and preparing dataset ..." to stdout,
  and native code may write to file descriptor 1: all of it goes to stderr, and stdout is the JSON object."""
  import trainer_world
  from jetspec_jax.train import records
  world = trainer_world.build(str(tmp_path / "world"))
  prepare = records.prepare_dataset

  def prepare_and_write_to_fd_1(*args, **kwargs):
    os.write(1, b"native chatter on fd 1\n")
    return prepare(*args, **kwargs)
  monkeypatch.setattr(records, "prepare_dataset", prepare_and_write_to_fd_1)
  overrides = {"target": world["target"], "data.path": world["data"], "output_dir": tmp_path / "run",
               "data.seq_len": 32, "train.batch_size": 2, "train.num_anchors": 2, "train.chunk_anchors": 2,
               "head.block_size": 2, "data.eval_examples": 0, "eval.every": 0, "train.steps": 1,
               "export_dtype": "float32", "mesh.data": 1, "mesh.model": 1}
  capfd.readouterr()
  code = cli.main(["train", "--config", "tiny", "--json", *(f"--config.{k}={v}" for k, v in overrides.items())])
  out, err = capfd.readouterr()
  assert code == 0, err[-3000:]
  assert out.endswith("\n") and out.count("\n") == 1 and json.loads(out)["step"] == 1
  assert "Downloading and preparing dataset" in err and "native chatter on fd 1" in err


def test_generation_config_eos_ids_and_sampling_defaults(hf_dir, tmp_path, capsys):
  """A checkpoint whose generation_config.json lists two EOS ids stops at either (config.json names
  neither); --sampling-defaults hf takes its sampling settings, and --json says where each came from."""
  import shutil
  src = str(tmp_path / "model")
  shutil.copytree(hf_dir("dense_tied", "float32"), src)
  base = ["generate", "--target", src, "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--json"]
  code, stdout, _ = run(capsys, *base, "--eos-ids", "")
  free = json.loads(stdout)["token_ids"]
  first = lambda t: free.index(t)
  # two ids: one first produced at position i, another only later; generation stops at whichever comes first
  late = next(t for t in free[4:] if first(t) >= 4)
  early = next(t for t in free[1:first(late)] if first(t) >= 1)
  for ids, stop in (([123456, late], first(late)), ([late, early], first(early))):
    with open(os.path.join(src, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": ids, "temperature": 0.6, "top_p": 0.95, "top_k": 20}, f)
    code, stdout, _ = run(capsys, *base)
    res = json.loads(stdout)
    assert code == 0 and res["token_ids"] == free[:stop + 1], (ids, stop)
    assert set(ids) <= set(res["eos_ids"]) and res["sampling"]["accept"] == "greedy"
  code, stdout, _ = run(capsys, *base, "--sampling-defaults", "hf", "--top-k", "5")
  res = json.loads(stdout)
  assert code == 0 and res["sampling"]["temperature"] == 0.6 and res["sampling"]["top_p"] == 0.95
  assert res["sampling"]["top_k"] == 5 and res["sampling_sources"] == {
      "temperature": "generation_config.json", "top_p": "generation_config.json", "top_k": "command line"}
  with open(os.path.join(src, "generation_config.json"), "w") as f:
    json.dump({"temperature": "warm"}, f)
  code, _, err = run(capsys, *base, "--sampling-defaults", "hf")
  assert code == 2 and "non-numeric temperature" in err and "Traceback" not in err


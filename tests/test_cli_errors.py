"""Bad flags and damaged weight files end in one sentence on stderr and exit status 2, never a traceback."""
import json
import os
import shutil
import struct

import jax
import pytest

import hf_fixtures
from jetspec_jax import attention, cli, convert, tokenizer
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head

no_gpu = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the pallas kernel runs on a GPU")


def one_sentence(capsys, *argv, phrases=()):
  """Runs the CLI in-process; asserts status 2 and a single stderr line holding every phrase."""
  capsys.readouterr()                 # what building the fixtures printed
  code = cli.main([*argv, "--json"])
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and "Traceback" not in err, (argv, err)
  assert all(p in lines[0] for p in phrases), (argv, lines[0])
  return lines[0]


def save_head(target_dir: str, out_dir: str) -> str:
  cfg, _, _ = convert.load_target(target_dir)
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=4)
  convert.save_head(out_dir, head_cfg, draft_head.init_head(head_cfg, jax.random.key(0)))
  return out_dir


@pytest.fixture(scope="module")
def target(hf_dir):
  return hf_dir("dense_tied", "float32")


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
  return save_head(target, str(tmp_path_factory.mktemp("head") / "head"))


@pytest.fixture(scope="module")
def bench_world(tmp_path_factory):
  """A target with tokenizer files (bench reads prompt banks through them), its head and a one-prompt bank."""
  root = tmp_path_factory.mktemp("bench_world")
  tok_dir = tokenizer.train_chat_tokenizer([f"the quick brown fox {i} jumps over the lazy dog" for i in range(40)],
                                           300, str(root / "tok"))
  model_dir = hf_fixtures.save_model(hf_fixtures.build_model(hf_fixtures.hf_config("dense_tied", vocab_size=320)),
                                     str(root / "target"))
  convert.copy_side_files(tok_dir, model_dir, convert.TOKENIZER_FILES)
  (root / "bank.jsonl").write_text(json.dumps({"prompt": "the quick brown fox"}) + "\n")
  return model_dir, save_head(model_dir, str(root / "head")), str(root / "bank.jsonl"), str(root / "out")


GENERATE = ["--prompt-ids", "1,2", "--max-new-tokens", "2"]


@no_gpu
def test_pallas_without_a_gpu_names_the_alternatives(target, head, tmp_path, capsys):
  """Refused where the implementation is resolved: before any model is loaded, and by the library's
  resolve_implementation (attention() itself still traces the kernel, for CUDA lowerings on a CPU)."""
  phrases = ("needs a GPU", "pallas_interpret", "xla")
  one_sentence(capsys, "generate", "--target", target, *GENERATE, "--attention", "pallas", phrases=phrases)
  one_sentence(capsys, "generate", "--target", target, *GENERATE, "--attention", "pallas", "--dtype", "float16",
               phrases=phrases)
  one_sentence(capsys, "bench", "--target", target, "--head", head, "--out", str(tmp_path / "out"),
               "--attention", "pallas", phrases=phrases)
  with pytest.raises(JetSpecError, match="needs a GPU"):
    attention.resolve_implementation("pallas")


@pytest.mark.parametrize("argv,phrase", [
    (["--depth", "0"], "tree depth 0 must be between 1"),
    (["--eos-ids", "x"], "--eos-ids must be comma-separated integers"),
])
def test_bad_generate_flags(target, head, capsys, argv, phrase):
  one_sentence(capsys, "generate", "--target", target, "--head", head, *GENERATE, *argv, phrases=(phrase,))


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("argv,phrases", [
    (["--prompt-ids", "1,2,3", "--max-new-tokens", "510"],
     ("prompt (3 tokens) plus --max-new-tokens 510 is 513 positions", "max_position_embeddings (512)")),
    (["--eos-ids", "5,96"], ("--eos-ids id 96 is outside the vocabulary (size 96)",)),
    (["--eos-ids", "-1"], ("--eos-ids id -1 is outside the vocabulary",)),
    (["--attention", "pallas_interpret"], ("supports head_dim (64, 128), not 8", "use --attention xla")),
])
def test_generate_limits(target, head, capsys, speculative, argv, phrases):
  """Limits of the model (positions, vocabulary) and of the kernel (head_dim 8 here) are refused."""
  head_flags = ["--head", head, "--budget", "4", "--width", "2"] if speculative else []
  one_sentence(capsys, "generate", "--target", target, *head_flags, *GENERATE, *argv, phrases=phrases)


def test_kernel_tuning_directory_is_named(target, tmp_path, capsys):
  one_sentence(capsys, "generate", "--target", target, *GENERATE, "--kernel-tuning", str(tmp_path),
               phrases=(f"kernel tuning file {tmp_path} is a directory", "kernel_tuning.json"))


@pytest.mark.parametrize("argv,phrase", [
    (["--prompt-len", "500", "--max-new-tokens", "20"], "--prompt-len 500 plus --max-new-tokens 20 is 520 positions"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["--budgets", "a,b"], "--budgets must be comma-separated integers"),
    (["--batch-size", "2"], "batch size 2 exceeds the 1 prompt(s)"),
    (["--depth", "0"], "tree depth 0 must be between 1"),
])
def test_bad_bench_flags(bench_world, capsys, argv, phrase):
  bench_target, bench_head, bank, out = bench_world
  one_sentence(capsys, "bench", "--target", bench_target, "--head", bench_head, "--bank", bank, "--out", out,
               "--num-prompts", "1", "--prompt-len", "4", "--max-new-tokens", "2", "--budgets", "4",
               "--repeats", "1", *argv, phrases=(phrase,))


def _damage(blob: bytes, how: str) -> bytes:
  """A safetensors file truncated, with a garbage header, a header length past the end, or a tensor
  whose byte range runs past the end."""
  n = struct.unpack("<Q", blob[:8])[0]
  if how == "truncated":
    return blob[:len(blob) // 2]
  if how == "garbage header":
    return blob[:8] + b"\xff" * n + blob[8 + n:]
  if how == "header length":
    return struct.pack("<Q", len(blob) + 8) + blob[8:]
  header = json.loads(blob[8:8 + n])
  key = next(k for k in header if k != "__metadata__")
  header[key]["data_offsets"][1] = 2 * len(blob)
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  return struct.pack("<Q", len(text)) + text + blob[8 + n:]


def _copy(src: str, dst) -> str:
  shutil.copytree(src, dst)
  return str(dst)


def _damaged_copy(src: str, dst, how: str) -> tuple[str, str]:
  """A copy of model directory ``src`` at ``dst`` whose model.safetensors is damaged ``how``: (dir, file)."""
  bad = _copy(src, dst)
  path = os.path.join(bad, "model.safetensors")
  with open(path, "rb") as f:
    blob = f.read()
  with open(path, "wb") as f:
    f.write(_damage(blob, how))
  return bad, path


@pytest.mark.parametrize("how", ["truncated", "garbage header", "header length", "tensor range"])
def test_a_damaged_safetensors_file_is_named(target, head, tmp_path, capsys, how):
  bad, path = _damaged_copy(target, tmp_path / "target", how)
  one_sentence(capsys, "convert", bad, str(tmp_path / "out"), phrases=(path, "truncated or corrupt"))
  one_sentence(capsys, "generate", "--target", bad, *GENERATE, phrases=(path, "truncated or corrupt"))
  assert not os.path.exists(tmp_path / "out")
  bad_head, path = _damaged_copy(head, tmp_path / "head", how)
  one_sentence(capsys, "generate", "--target", target, "--head", bad_head, *GENERATE,
               phrases=(path, "truncated or corrupt"))


def test_damaged_or_missing_shards_are_named(hf_dir, tmp_path, capsys):
  """With an index the shards are opened tensor by tensor: a truncated one is named when it is read."""
  bad = _copy(hf_dir("dense_tied", "float32", 20_000), tmp_path / "sharded")
  shards = sorted(f for f in os.listdir(bad) if f.startswith("model-"))
  last = os.path.join(bad, shards[-1])
  with open(last, "rb") as f:
    blob = f.read()
  with open(last, "wb") as f:
    f.write(blob[:-64])
  one_sentence(capsys, "generate", "--target", bad, *GENERATE, phrases=(last, "truncated or corrupt"))
  os.remove(last)
  one_sentence(capsys, "convert", bad, str(tmp_path / "out"), phrases=("shard listed in the index is missing", last))


def test_fp8_weights_are_refused_by_name(target, tmp_path, capsys):
  import torch
  from safetensors.torch import load_file, save_file
  bad = _copy(target, tmp_path / "fp8")
  path = os.path.join(bad, "model.safetensors")
  tensors = {k: v.to(torch.float8_e4m3fn) if "q_proj" in k else v for k, v in load_file(path).items()}
  save_file(tensors, path, metadata={"format": "pt"})
  one_sentence(capsys, "convert", bad, str(tmp_path / "out"), phrases=("stored as F8_E4M3", "float32, bfloat16"))


def test_a_missing_extra_is_named_with_its_install_command(target, tmp_path, capsys, monkeypatch):
  """Without the [data] extra, the first import of the record builder (train, demo) ends in one sentence
  that names the extra (simulated: tensorflow_datasets blocked, the records module not yet imported)."""
  import sys
  import jetspec_jax.train
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
  monkeypatch.delitem(sys.modules, "jetspec_jax.train.records", raising=False)
  monkeypatch.delattr(jetspec_jax.train, "records", raising=False)     # set by an earlier import

  def convert_that_reads_records(args):
    from jetspec_jax.train import records  # noqa: F401
  monkeypatch.setattr(cli, "cmd_convert", convert_that_reads_records)
  one_sentence(capsys, "convert", target, str(tmp_path / "out"),
               phrases=("needs tensorflow_datasets", "[data] extra", "pip install 'jetspec-jax[data]'"))

"""HF <-> orbax conversion: bit-exact round trips, transformers reloads the export, and clear errors."""
import glob
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

import hf_fixtures
from jetspec_jax import config as config_lib
from jetspec_jax import convert
from jetspec_jax.errors import JetSpecError

IN_SHARD = 6_000          # bytes: save_pretrained writes several shards + index
OUT_SHARD = 10_000        # bytes: export writes several shards + index
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def read_safetensors(model_dir):
  """{key: torch tensor} over every *.safetensors of a directory; checks the index if present."""
  tensors, where = {}, {}
  for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
    with safe_open(path, "pt") as f:
      for k in f.keys():
        assert k not in tensors, f"{k} in two shards"
        tensors[k] = f.get_tensor(k)
        where[k] = os.path.basename(path)
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      assert json.load(f)["weight_map"] == where
  return tensors


def assert_bit_exact(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for k, w in want.items():
    g = got[k]
    assert g.dtype == w.dtype, k
    assert tuple(g.shape) == tuple(w.shape), k
    assert torch.equal(g.view(_INT_VIEW[w.dtype]), w.view(_INT_VIEW[w.dtype])), f"bits differ: {k}"


def read_json(*path):
  with open(os.path.join(*path)) as f:
    return json.load(f)


def no_temp_dirs(parent):
  return [n for n in os.listdir(parent) if ".tmp-" in n] == []


ROUND_TRIPS = [("dense_tied", "bfloat16"), ("dense_tied", "float32"), ("dense", "float32"),
               ("moe_norm", "float32"), ("moe_step2", "bfloat16")]


@pytest.fixture(scope="module")
def round_trip(hf_dir, tmp_path_factory):
  """round_trip(name, dtype) -> (hf_in, ckpt, exported): sharded HF -> orbax -> sharded HF (cached)."""
  cache = {}

  def get(name, dtype):
    if (name, dtype) not in cache:
      hf_in = hf_dir(name, dtype, IN_SHARD)
      work = tmp_path_factory.mktemp(f"rt_{name}_{dtype}")
      ckpt, out = str(work / "ckpt"), str(work / "exported")
      phases = []                                   # the phase hook convert_bench records memory by
      info = convert.convert_hf(hf_in, ckpt, on_phase=phases.append)
      assert info["dtype"] == dtype
      exp = convert.export_hf(ckpt, out, shard_bytes=OUT_SHARD, on_phase=phases.append)
      assert phases == ["load", "orbax_save", "after_save", "restore", "safetensors_write", "after_write"]
      assert len(exp["files"]) > 1
      assert no_temp_dirs(str(work))
      cache[(name, dtype)] = (hf_in, ckpt, out)
    return cache[(name, dtype)]
  return get


@pytest.mark.parametrize("name,dtype", ROUND_TRIPS)
def test_round_trip_is_bit_exact(name, dtype, round_trip):
  hf_in, ckpt, out = round_trip(name, dtype)
  # Input really was sharded, and so is the output.
  assert os.path.exists(os.path.join(hf_in, "model.safetensors.index.json"))
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  assert len(glob.glob(os.path.join(out, "model-*-of-*.safetensors"))) > 1
  original, exported = read_safetensors(hf_in), read_safetensors(out)
  assert_bit_exact(exported, original)
  want_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
  assert {t.dtype for t in exported.values()} == {want_dtype}
  # generation_config.json is copied unchanged; config.json (saved by transformers 5) keeps every key and
  # value and gains the transformers 4.x spellings it lacks, in the checkpoint's hf/ and in the export.
  with open(os.path.join(hf_in, "generation_config.json"), "rb") as a, \
       open(os.path.join(out, "generation_config.json"), "rb") as b:
    assert a.read() == b.read()
  saved = read_json(hf_in, "config.json")
  assert not {"rope_theta", "num_experts", "torch_dtype"} & set(saved)
  added = {"rope_theta": saved["rope_parameters"]["rope_theta"], "torch_dtype": saved["dtype"]}
  if "num_local_experts" in saved:
    added["num_experts"] = saved["num_local_experts"]
  assert read_json(ckpt, "hf", "config.json") == read_json(out, "config.json") == {**saved, **added}
  # Converted checkpoint layout.
  with open(os.path.join(ckpt, convert.CHECKPOINT_MARKER)) as f:
    meta = json.load(f)
  assert meta["kind"] == "target" and meta["dtype"] == dtype
  assert os.path.isdir(os.path.join(ckpt, "params"))
  assert os.path.isfile(os.path.join(ckpt, "hf", "config.json"))


def test_tied_export_has_no_lm_head(round_trip):
  _, _, out = round_trip("dense_tied", "bfloat16")
  keys = set(read_safetensors(out))
  assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
  _, _, out = round_trip("dense", "float32")
  assert "lm_head.weight" in read_safetensors(out)


@pytest.mark.parametrize("name,dtype", [("moe_norm", "float32"), ("moe_step2", "bfloat16")])
def test_moe_export_writes_per_expert_keys(name, dtype, round_trip, jax_target):
  _, _, out = round_trip(name, dtype)
  keys = set(read_safetensors(out))
  cfg, _ = jax_target(name)
  for i in range(cfg.num_hidden_layers):
    pre = f"model.layers.{i}.mlp."
    if cfg.is_moe_layer(i):
      assert pre + "gate.weight" in keys
      for e in range(cfg.num_experts):
        for p in ("gate", "up", "down"):
          assert f"{pre}experts.{e}.{p}_proj.weight" in keys
      assert not any(k.startswith(pre + "experts.gate_up") for k in keys)
    else:
      assert {pre + f"{p}_proj.weight" for p in ("gate", "up", "down")} <= keys
      assert not any(k.startswith(pre + "experts.") for k in keys)


@pytest.mark.parametrize("name,dtype", [("dense", "float32"), ("dense_tied", "float32"),
                                        ("moe_norm", "float32"), ("moe_step2", "bfloat16")])
def test_transformers_loads_the_export(name, dtype, round_trip):
  hf_in, _, out = round_trip(name, dtype)
  torch_dtype = getattr(torch, dtype)
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(hf_in, dtype=torch_dtype).eval()
  tokens = hf_fixtures.random_tokens(ref_model.config.vocab_size, (2, 9), seed=4)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch_dtype).eval()
  assert type(model) is type(ref_model)
  if model.config.tie_word_embeddings:
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  got, want = hf_fixtures.hf_logits(model, tokens), hf_fixtures.hf_logits(ref_model, tokens)
  np.testing.assert_array_equal(got, want)
  if dtype == "float32":   # and equal to the in-memory model the fixture saved
    np.testing.assert_allclose(got, hf_fixtures.hf_logits(hf_fixtures.named_model(name), tokens), atol=1e-6, rtol=0)


def test_export_straight_from_hf_dir(hf_dir, tmp_path):
  hf_in = hf_dir("moe_step2", "float32")          # single-file input
  out = str(tmp_path / "out")
  info = convert.export_hf(hf_in, out)            # default shard size: one file, no index
  assert info["files"] == ["model.safetensors"]
  assert not os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  assert_bit_exact(read_safetensors(out), read_safetensors(hf_in))


def test_converted_checkpoint_loads_like_hf_dir(round_trip, jax_target):
  _, ckpt, _ = round_trip("moe_norm", "float32")
  cfg_hf, params_hf = jax_target("moe_norm")
  cfg, params, side = convert.load_target(ckpt, jnp.float32)
  assert cfg == cfg_hf and side == os.path.join(ckpt, "hf")
  assert sorted(params) == sorted(params_hf)
  for k in params:
    np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(params_hf[k]), err_msg=k)


def test_bf16_checkpoint_restores_as_float32(round_trip):
  hf_in, ckpt, _ = round_trip("dense_tied", "bfloat16")
  _, p16, _ = convert.load_target(ckpt)
  _, p32, _ = convert.load_target(ckpt, jnp.float32)
  _, p_hf, _ = convert.load_target(hf_in, jnp.float32)
  for k in p16:
    assert p16[k].dtype == jnp.bfloat16 and p32[k].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(p32[k]), np.asarray(p16[k]).astype(np.float32), err_msg=k)
    np.testing.assert_array_equal(np.asarray(p32[k]), np.asarray(p_hf[k]), err_msg=k)


def test_config_dict_round_trip():
  for name in ("moe_norm", "dense_tied"):
    d = {**hf_fixtures.hf_config(name).to_dict(), "eos_token_id": [3, 4]}
    cfg = config_lib.Qwen3Config.from_hf_dict(d)
    assert cfg.eos_token_ids == (3, 4)
    assert config_lib.Qwen3Config.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_convert_casts_dtype_like_torch(hf_dir, tmp_path):
  """fp32 HF -> bf16 checkpoint: the exported bf16 tensors are torch's round-to-nearest cast."""
  hf_in = hf_dir("dense_tied", "float32")
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  assert convert.convert_hf(hf_in, ckpt, dtype=jnp.bfloat16)["dtype"] == "bfloat16"
  convert.export_hf(ckpt, out)
  want = {k: v.to(torch.bfloat16) for k, v in read_safetensors(hf_in).items()}
  assert_bit_exact(read_safetensors(out), want)
  for d in (os.path.join(ckpt, "hf"), out):              # the config names the cast dtype for 4.x and 5.x
    config = json.load(open(os.path.join(d, "config.json")))
    assert config["dtype"] == config["torch_dtype"] == "bfloat16", d


# ---------------------------------------------------------------- side files


@pytest.fixture
def hf_copy(hf_dir, tmp_path):
  """A private, editable copy of a small single-file HF dir."""
  dst = str(tmp_path / "hf_copy")
  shutil.copytree(hf_dir("dense_tied", "float32"), dst)
  return dst


def _edit_config(model_dir, fn):
  path = os.path.join(model_dir, "config.json")
  with open(path) as f:
    d = json.load(f)
  fn(d)
  with open(path, "w") as f:
    json.dump(d, f)


HF4_CONFIG_KEYS = {"rope_theta": 10_000.0, "torch_dtype": "float32"}
HF5_TOKENIZER_CONFIG = {"backend": "tokenizers", "eos_token": "<|im_end|>", "extra_special_tokens": ["<|im_start|>"],
                        "model_max_length": 512, "tokenizer_class": "TokenizersBackend"}
HF5_TOKENIZER_CONFIG_FOR_HF4 = {"backend": "tokenizers", "eos_token": "<|im_end|>", "model_max_length": 512,
                                "additional_special_tokens": ["<|im_start|>"],
                                "tokenizer_class": "PreTrainedTokenizerFast"}


def _hub_style(model_dir):
  """Give ``model_dir`` a config.json and tokenizer_config.json that transformers 4.x reads as they are
  (the 4.x keys present, odd formatting that a rewrite would not keep)."""
  _edit_config(model_dir, lambda d: d.update(HF4_CONFIG_KEYS))
  config = read_json(model_dir, "config.json")
  with open(os.path.join(model_dir, "config.json"), "w") as f:
    f.write(json.dumps(config, indent=4) + "\n\n")
  tokenizer = {**HF5_TOKENIZER_CONFIG, "tokenizer_class": "Qwen2Tokenizer", "additional_special_tokens": ["<|x|>"]}
  del tokenizer["extra_special_tokens"]
  with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
    f.write(json.dumps(tokenizer, indent=3))


def test_side_files_hf4_reads_are_copied_byte_for_byte(hf_copy, tmp_path):
  _hub_style(hf_copy)
  ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
  convert.convert_hf(hf_copy, ckpt)
  convert.export_hf(ckpt, out)
  for side in ("config.json", "tokenizer_config.json", "generation_config.json"):
    with open(os.path.join(hf_copy, side), "rb") as f:
      want = f.read()
    for d in (os.path.join(ckpt, "hf"), out):
      with open(os.path.join(d, side), "rb") as f:
        assert f.read() == want, (d, side)


def test_side_files_saved_by_hf5_gain_the_hf4_keys(hf_dir, tmp_path):
  """A transformers 5 config (rope_parameters, num_local_experts, dtype) and tokenizer config
  (TokenizersBackend, list-valued extra_special_tokens): the copies add what 4.x reads, keep the rest."""
  hf_in = str(tmp_path / "hf5")
  shutil.copytree(hf_dir("moe_norm", "float32"), hf_in)
  with open(os.path.join(hf_in, "tokenizer_config.json"), "w") as f:
    json.dump(HF5_TOKENIZER_CONFIG, f)
  saved = read_json(hf_in, "config.json")
  out, ckpt_out = str(tmp_path / "out"), str(tmp_path / "ckpt")
  convert.export_hf(hf_in, out)
  convert.convert_hf(hf_in, ckpt_out)
  for d in (out, os.path.join(ckpt_out, "hf")):
    assert read_json(d, "config.json") == {**saved, "rope_theta": 10_000.0, "num_experts": 8, "torch_dtype": "float32"}
    assert read_json(d, "tokenizer_config.json") == HF5_TOKENIZER_CONFIG_FOR_HF4
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]
  assert convert.load_target(out)[0] == convert.load_target(hf_in)[0]


def test_pretrain_copies_tokenizer_config_for_hf4(jax_target, tmp_path):
  from jetspec_jax.train import pretrain
  tok_dir = tmp_path / "tok"
  tok_dir.mkdir()
  (tok_dir / "tokenizer_config.json").write_text(json.dumps(HF5_TOKENIZER_CONFIG))
  cfg, params = jax_target("dense_tied")
  out = str(tmp_path / "target")
  assert "tokenizer_config.json" in pretrain.write_hf_directory(out, cfg, params, tokenizer_dir=str(tok_dir))
  assert read_json(out, "tokenizer_config.json") == HF5_TOKENIZER_CONFIG_FOR_HF4


# ---------------------------------------------------------------- bad inputs


def test_missing_model_dir(tmp_path):
  with pytest.raises(JetSpecError, match="not found"):
    convert.load_target(str(tmp_path / "nope"))
  with pytest.raises(JetSpecError, match="not found"):
    convert.convert_hf(str(tmp_path / "nope"), str(tmp_path / "out"))
  with pytest.raises(JetSpecError, match="model directory not found"):
    config_lib.load_hf_config(str(tmp_path / "nope"))
  assert not os.path.exists(tmp_path / "out")


def test_missing_config_json(hf_copy):
  os.remove(os.path.join(hf_copy, "config.json"))
  with pytest.raises(JetSpecError, match="config.json not found"):
    convert.load_target(hf_copy)


def test_other_architecture(hf_copy):
  def llama(d):
    d["architectures"] = ["LlamaForCausalLM"]
    d["model_type"] = "llama"
  _edit_config(hf_copy, llama)
  with pytest.raises(JetSpecError, match="unsupported architecture LlamaForCausalLM"):
    convert.load_target(hf_copy)


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "intermediate_size"])
def test_config_missing_required_key(hf_copy, key):
  _edit_config(hf_copy, lambda d: d.pop(key))
  with pytest.raises(JetSpecError, match=f"missing required key.*{key}"):
    convert.load_target(hf_copy)


def test_moe_config_missing_required_key():
  d = hf_fixtures.hf_config("moe_norm").to_dict()
  d["architectures"] = ["Qwen3MoeForCausalLM"]
  del d["moe_intermediate_size"]
  with pytest.raises(JetSpecError, match="missing required key.*moe_intermediate_size"):
    config_lib.Qwen3Config.from_hf_dict(d)


def test_invalid_json(hf_copy):
  with open(os.path.join(hf_copy, "config.json"), "w") as f:
    f.write('{"architectures": ["Qwen3ForCausalLM"], ')
  with pytest.raises(JetSpecError, match="not valid JSON"):
    convert.load_target(hf_copy)


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"config"'])
def test_config_json_not_an_object(hf_copy, text):
  with open(os.path.join(hf_copy, "config.json"), "w") as f:
    f.write(text)
  with pytest.raises(JetSpecError, match="not a JSON object"):
    convert.load_target(hf_copy)


def test_no_safetensors(hf_copy):
  for p in glob.glob(os.path.join(hf_copy, "*.safetensors")):
    os.remove(p)
  with pytest.raises(JetSpecError, match=r"no \*\.safetensors"):
    convert.load_target(hf_copy)


def test_missing_shard_listed_in_index(hf_dir, tmp_path):
  dst = str(tmp_path / "sharded")
  shutil.copytree(hf_dir("dense_tied", "bfloat16", IN_SHARD), dst)
  os.remove(sorted(glob.glob(os.path.join(dst, "model-*.safetensors")))[-1])
  with pytest.raises(JetSpecError, match="shard listed in the index is missing"):
    convert.load_target(dst)


def test_weight_missing_from_safetensors(hf_copy):
  from safetensors.torch import save_file
  path = os.path.join(hf_copy, "model.safetensors")
  tensors = read_safetensors(hf_copy)
  del tensors["model.layers.1.self_attn.k_norm.weight"]
  save_file(tensors, path, metadata={"format": "pt"})
  with pytest.raises(JetSpecError, match="model.layers.1.self_attn.k_norm.weight is missing"):
    convert.load_target(hf_copy)


def test_shapes_do_not_match_config(hf_copy):
  _edit_config(hf_copy, lambda d: d.update(hidden_size=48))
  with pytest.raises(JetSpecError, match="does not match its config"):
    convert.load_target(hf_copy)


def test_converted_checkpoint_shapes_do_not_match_config(hf_dir, tmp_path):
  ckpt = str(tmp_path / "ckpt")
  convert.convert_hf(hf_dir("dense_tied", "float32"), ckpt)
  _edit_config(os.path.join(ckpt, "hf"), lambda d: d.update(intermediate_size=80))
  with pytest.raises(JetSpecError, match="does not match its config.*mlp"):
    convert.load_target(ckpt)


def test_unknown_dtype():
  with pytest.raises(JetSpecError, match="unknown dtype 'float64'"):
    config_lib.parse_dtype("float64")
  assert config_lib.parse_dtype("bf16") == jnp.bfloat16
  assert config_lib.parse_dtype("float32") == jnp.float32


def test_non_empty_output_dir_is_refused(hf_dir, tmp_path):
  hf_in = hf_dir("dense_tied", "float32")
  out = tmp_path / "out"
  out.mkdir()
  (out / "keep.txt").write_text("precious")
  with pytest.raises(JetSpecError, match="already exists and is not empty"):
    convert.convert_hf(hf_in, str(out))
  with pytest.raises(JetSpecError, match="already exists and is not empty"):
    convert.export_hf(hf_in, str(out))
  assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
  assert no_temp_dirs(str(tmp_path))
  # An existing empty directory is fine.
  empty = tmp_path / "empty"
  empty.mkdir()
  convert.export_hf(hf_in, str(empty))
  assert os.path.isfile(empty / "model.safetensors")


class Boom(RuntimeError):
  pass


def _boom(*args, **kwargs):
  raise Boom("injected failure")


@pytest.mark.parametrize("step", ["convert", "export"])
def test_failure_mid_way_leaves_no_output(step, hf_dir, tmp_path, monkeypatch):
  hf_in = hf_dir("dense_tied", "float32")
  work = tmp_path / "work"
  work.mkdir()
  out = work / "out"
  # Fail after the weights were written (orbax params / safetensors shards), at the side files.
  monkeypatch.setattr(convert, "copy_side_files", _boom)
  with pytest.raises(Boom):
    if step == "convert":
      convert.convert_hf(hf_in, str(out))
    else:
      convert.export_hf(hf_in, str(out), shard_bytes=OUT_SHARD)
  assert os.listdir(work) == []


def test_overwrite_replaces_a_file(hf_dir, tmp_path):
  out = tmp_path / "out"
  out.write_text("a file, not a directory")
  with pytest.raises(JetSpecError, match="already exists"):
    convert.export_hf(hf_dir("dense_tied", "float32"), str(out))
  convert.export_hf(hf_dir("dense_tied", "float32"), str(out), overwrite=True)
  assert os.path.isfile(out / "model.safetensors") and os.listdir(tmp_path) == ["out"]


def test_failure_with_overwrite_keeps_the_old_output(hf_dir, tmp_path, monkeypatch):
  hf_in = hf_dir("dense_tied", "float32")
  out = tmp_path / "out"
  out.mkdir()
  (out / "old.txt").write_text("old")
  monkeypatch.setattr(convert, "write_safetensors", _boom)
  with pytest.raises(Boom):
    convert.export_hf(hf_in, str(out), overwrite=True)
  assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["old.txt"]


def test_reconvert_a_converted_checkpoint(round_trip, tmp_path):
  _, ckpt, _ = round_trip("dense_tied", "bfloat16")
  out = str(tmp_path / "ckpt32")
  convert.convert_hf(ckpt, out, dtype=jnp.float32)
  cfg, params, _ = convert.load_target(out)
  assert params["embed"].dtype == jnp.float32


@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_converted_checkpoint_without_weights(round_trip, tmp_path, damage):
  _, ckpt, _ = round_trip("dense_tied", "bfloat16")
  dst = str(tmp_path / "ckpt")
  shutil.copytree(ckpt, dst)
  shutil.rmtree(os.path.join(dst, "params"))
  if damage == "empty":
    os.makedirs(os.path.join(dst, "params"))
  match = "checkpoint weights not found" if damage == "missing" else "not a readable orbax checkpoint"
  with pytest.raises(JetSpecError, match=match):
    convert.load_target(dst)


def test_not_a_target_checkpoint(round_trip, tmp_path):
  _, ckpt, _ = round_trip("dense_tied", "bfloat16")
  dst = str(tmp_path / "ckpt")
  shutil.copytree(ckpt, dst)
  with open(os.path.join(dst, convert.CHECKPOINT_MARKER), "w") as f:
    json.dump({"kind": "draft"}, f)
  with pytest.raises(JetSpecError, match="not a target"):
    convert.load_target(dst)


def test_bad_index_files_get_clear_errors(round_trip, tmp_path):
  import json as _json
  import shutil as _shutil
  hf_dir, _, _ = round_trip("dense_tied", "float32")
  bad = tmp_path / "bad"
  _shutil.copytree(hf_dir, bad)
  index = bad / "model.safetensors.index.json"
  assert index.exists(), "round_trip saves its input in shards (IN_SHARD)"
  data = _json.loads(index.read_text())
  index.write_text(_json.dumps({"metadata": {}}))
  with pytest.raises(JetSpecError, match="no weight_map"):
    convert.load_target(str(bad))
  files = sorted(set(data["weight_map"].values()))
  key = next(k for k, f in data["weight_map"].items() if f == files[0])
  data["weight_map"][key] = files[-1] if len(files) > 1 else "missing.safetensors"
  index.write_text(_json.dumps(data))
  with pytest.raises(JetSpecError):
    convert.load_target(str(bad))

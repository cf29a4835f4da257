"""Hugging Face <-> JetSpec-JAX weights: ONE mapping table, read forwards to import and backwards
to export. Its keys are the models' parameter names, i.e. their NNX module paths
(``layers.3.attn.q_proj``, see ``models.params``).

Import streams tensors from (sharded) safetensors one at a time straight into their shardings
(``jax.make_array_from_callback``: each process materialises only its own shards), so a model is
never held twice in host memory. Export writes sharded safetensors + ``model.safetensors.index.json``
+ the original config and tokenizer files, into a temporary directory renamed on success. Side files
are copied as they are, except for the transformers 4.x keys a transformers 5 config.json or
tokenizer_config.json lacks (``copy_side_files``): every HF directory written loads as the same model
and tokenizer in 4.x and 5.x.

A converted checkpoint directory holds ``params/`` (orbax), ``hf/`` (the original config.json and
tokenizer files, 4.x keys added) and ``jetspec.json`` (kind and dtype).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jetspec_jax.checkpoint import atomic_directory, check_output_dir, restore_params, save_params
from jetspec_jax.config import Qwen3Config, load_hf_config, read_json
from jetspec_jax import files
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models.params import ParamSpec
from jetspec_jax.sharding import logical_to_spec, make_mesh, named_sharding
from jetspec_jax.tokenizer import hf4_tokenizer_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja", "added_tokens.json")
CHECKPOINT_MARKER = "jetspec.json"
DEFAULT_SHARD_BYTES = 4 * 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Mapping:
  """One weight <-> its HF tensor(s): ``to_jax`` combines the HF tensors, ``to_hf`` splits back."""
  param: str
  hf_keys: tuple[str, ...]
  to_jax: Callable[[list[np.ndarray]], np.ndarray]
  to_hf: Callable[[np.ndarray], list[np.ndarray]]


def _identity(name, hf):
  return Mapping(name, (hf,), lambda t: t[0], lambda a: [a])


def _transposed(name, hf):
  return Mapping(name, (hf,), lambda t: np.ascontiguousarray(t[0].T), lambda a: [np.ascontiguousarray(a.T)])


def _in_proj(name, hf, heads, head_dim):
  """HF [heads*head_dim, in] <-> [in, heads, head_dim]."""
  return Mapping(name, (hf,), lambda t: np.ascontiguousarray(t[0].T).reshape(-1, heads, head_dim),
                 lambda a: [np.ascontiguousarray(a.reshape(a.shape[0], -1).T)])


def _out_proj(name, hf, heads, head_dim):
  """HF [out, heads*head_dim] <-> [heads, head_dim, out]."""
  return Mapping(name, (hf,), lambda t: np.ascontiguousarray(t[0].T).reshape(heads, head_dim, -1),
                 lambda a: [np.ascontiguousarray(a.reshape(heads * head_dim, -1).T)])


def _stacked_experts(name, hf_keys):
  """Per-expert HF [out, in] tensors <-> one stacked [E, in, out] weight."""
  return Mapping(name, tuple(hf_keys), lambda t: np.stack([x.T for x in t]),
                 lambda a: [np.ascontiguousarray(x.T) for x in a])


def attention_mappings(pre: str, hf: str, num_heads: int, num_kv: int, head_dim: int) -> list[Mapping]:
  """q/k/v/o projections and q/k norms of one decoder layer ``pre`` and both its pre-norms (target and
  draft head alike)."""
  return [_in_proj(pre + "attn.q_proj", hf + "self_attn.q_proj.weight", num_heads, head_dim),
          _in_proj(pre + "attn.k_proj", hf + "self_attn.k_proj.weight", num_kv, head_dim),
          _in_proj(pre + "attn.v_proj", hf + "self_attn.v_proj.weight", num_kv, head_dim),
          _out_proj(pre + "attn.o_proj", hf + "self_attn.o_proj.weight", num_heads, head_dim),
          _identity(pre + "attn.q_norm.weight", hf + "self_attn.q_norm.weight"),
          _identity(pre + "attn.k_norm.weight", hf + "self_attn.k_norm.weight"),
          _identity(pre + "input_norm.weight", hf + "input_layernorm.weight"),
          _identity(pre + "post_attn_norm.weight", hf + "post_attention_layernorm.weight")]


def _gate_up(name, hf):
  """HF gate_proj and up_proj [I, H] <-> one [H, 2, I] (``layers.MLP``)."""
  return Mapping(name, (hf + "gate_proj.weight", hf + "up_proj.weight"),
                 lambda t: np.ascontiguousarray(np.stack([t[0].T, t[1].T], axis=1)),
                 lambda a: [np.ascontiguousarray(a[:, 0].T), np.ascontiguousarray(a[:, 1].T)])


def dense_mlp_mappings(pre: str, hf: str) -> list[Mapping]:
  return [_gate_up(pre + "mlp.gate_up", hf + "mlp."), _transposed(pre + "mlp.down", hf + "mlp.down_proj.weight")]


def target_mappings(cfg: Qwen3Config) -> list[Mapping]:
  """The table for a Qwen3 / Qwen3-MoE target (``lm_head`` only when untied)."""
  table = [_identity("embed", "model.embed_tokens.weight"), _identity("final_norm.weight", "model.norm.weight")]
  if not cfg.tie_word_embeddings:
    table.append(_transposed("lm_head", "lm_head.weight"))
  for i in range(cfg.num_hidden_layers):
    pre, hf = f"layers.{i}.", f"model.layers.{i}."
    table += attention_mappings(pre, hf, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.is_moe_layer(i):
      table.append(_transposed(pre + "mlp.router", hf + "mlp.gate.weight"))
      for p in ("gate", "up", "down"):
        table.append(_stacked_experts(pre + f"mlp.{p}",
                                      [hf + f"mlp.experts.{e}.{p}_proj.weight" for e in range(cfg.num_experts)]))
    else:
      table += dense_mlp_mappings(pre, hf)
  return table


_LOADABLE_DTYPES = ("F64", "F32", "BF16", "F16")     # safetensors names of the float weights numpy reads


def _open_safetensors(path: str):
  """``safe_open`` (numpy), with a truncated, corrupt or unreadable file stated in one sentence."""
  try:
    return safe_open(path, "numpy")
  except SafetensorError as e:        # safetensors checks the header and that the tensors cover the file here
    reason = str(e).removeprefix("Error while deserializing header: ")
    raise JetSpecError(f"{path} is truncated or corrupt ({reason}); download or export it again") from None
  except OSError as e:
    raise JetSpecError(f"cannot read {path} ({e})") from None


class SafetensorsReader:
  """Reads tensors by key from the (sharded) safetensors of a directory, lazily, one at a time."""

  def __init__(self, model_dir: str):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
      weight_map = read_json(index, "model.safetensors.index.json").get("weight_map")
      if not isinstance(weight_map, dict):
        raise JetSpecError(f"{index} has no weight_map object")
      self.files = {k: os.path.join(model_dir, f) for k, f in weight_map.items()}
      for f in sorted(set(self.files.values())):
        if not os.path.isfile(f):
          raise JetSpecError(f"safetensors shard listed in the index is missing: {f}")
    else:
      paths = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
      if not paths:
        raise JetSpecError(f"no *.safetensors weights found in {model_dir}")
      self.files = {}
      for path in paths:
        with _open_safetensors(path) as f:
          self.files.update({k: path for k in f.keys()})

  def get(self, key: str) -> np.ndarray:
    if key not in self.files:
      raise JetSpecError(f"weight {key} is missing from the safetensors files")
    path = self.files[key]
    # Open, read, close: a handle kept open keeps every page read through its mapping resident,
    # which doubles peak host memory over a whole-model load.
    with _open_safetensors(path) as f:
      if key not in f.keys():
        raise JetSpecError(f"{os.path.basename(path)} does not contain {key}, although the index maps it there")
      stored = f.get_slice(key).get_dtype()
      if stored not in _LOADABLE_DTYPES:
        raise JetSpecError(f"{key} in {path} is stored as {stored}, which cannot be loaded; use a float32, "
                           f"bfloat16 or float16 checkpoint")
      return f.get_tensor(key)

  def keys(self) -> set[str]:
    return set(self.files)


def _place(array: np.ndarray, spec: ParamSpec, dtype, mesh) -> jax.Array:
  """Put a host array into its sharding; each process touches only its addressable shards."""
  if array.shape != spec.shape:
    raise ValueError(f"shape {array.shape} != {spec.shape}")
  array = array.astype(dtype, copy=False)
  sharding = named_sharding(spec.axes, spec.shape, mesh) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.make_array_from_callback(spec.shape, sharding, lambda idx: array[idx])


def load_weights(reader: SafetensorsReader, table: Sequence[Mapping], specs: dict[str, ParamSpec],
                 dtype, mesh=None, progress: Callable[[Iterator], Iterator] = iter) -> dict[str, jax.Array]:
  """Stream every mapped tensor from ``reader`` into its sharding (one weight in host memory at a time)."""
  params = {}
  for m in progress(table):
    spec = specs[m.param]
    try:
      params[m.param] = _place(m.to_jax([reader.get(k) for k in m.hf_keys]), spec, dtype, mesh)
    except ValueError:
      shapes = [tuple(reader.get(k).shape) for k in m.hf_keys[:1]]
      raise JetSpecError(f"checkpoint does not match its config: {m.hf_keys[0]} has shape {shapes[0]}, "
                         f"which does not give {m.param} of shape {spec.shape}") from None
  return params


def host_copy(x) -> np.ndarray:
  """A host copy of ``x`` assembled from its addressable shards. Unlike ``np.asarray(x)`` it leaves no
  host copy cached on the array, so fetching a sharded model weight by weight holds one weight at a time."""
  if not isinstance(x, jax.Array) or len(x.addressable_shards) == 1:
    return np.asarray(jax.device_get(x))
  out = np.empty(x.shape, x.dtype)
  for shard in x.addressable_shards:
    out[shard.index] = np.asarray(shard.data)
  return out


def _hf_tensors(table: Sequence[Mapping], params: dict[str, jax.Array], dtype) -> Iterator[tuple[str, np.ndarray]]:
  """(HF key, host tensor) pairs in table order, fetched one weight at a time."""
  for m in table:
    host = host_copy(params[m.param])
    if dtype is not None:
      host = host.astype(dtype, copy=False)
    yield from zip(m.hf_keys, m.to_hf(host))


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64",
                       "int32": "I32", "int64": "I64", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def _write_safetensors_file(path: str, entries: list[tuple[str, tuple[int, ...], np.dtype]],
                            tensors: Iterator[tuple[str, np.ndarray]]) -> None:
  """Stream tensors into one safetensors file: the header (from shapes) first, then each tensor's
  bytes as it arrives, so only one tensor is in host memory at a time."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for key, shape, dtype in entries:
    size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[key] = {"dtype": _SAFETENSORS_DTYPES[np.dtype(dtype).name], "shape": list(shape),
                   "data_offsets": [offset, offset + size]}
    offset += size
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  expected = iter(entries)
  with open(path, "wb") as f:
    f.write(len(blob).to_bytes(8, "little"))
    f.write(blob)
    for key, array in tensors:
      want_key, want_shape, want_dtype = next(expected)
      assert key == want_key and array.shape == tuple(want_shape) and array.dtype == want_dtype, key
      f.write(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)   # no extra copy


def write_safetensors(out_dir: str, table: Sequence[Mapping], params: dict[str, jax.Array],
                      shard_bytes: int = DEFAULT_SHARD_BYTES, dtype=None, prefix: str = "model") -> list[str]:
  """Write sharded safetensors (+ index when more than one file) into ``out_dir``, one weight in
  host memory at a time; returns the shard file names."""
  entries, sizes = [], []
  for m in table:
    a = params[m.param]
    out_dtype = np.dtype(dtype if dtype is not None else a.dtype)
    shapes = [x.shape for x in m.to_hf(np.empty(a.shape, np.uint8))]     # shapes only
    entries.append([(k, s, out_dtype) for k, s in zip(m.hf_keys, shapes)])
    sizes.append(a.size * out_dtype.itemsize)
  groups, current, total = [], [], 0
  for i, size in enumerate(sizes):
    if current and total + size > shard_bytes:
      groups.append(current)
      current, total = [], 0
    current.append(i)
    total += size
  groups.append(current)
  names = ([f"{prefix}.safetensors"] if len(groups) == 1 else
           [f"{prefix}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
  weight_map = {}
  for name, group in zip(names, groups):
    file_entries = [e for i in group for e in entries[i]]
    _write_safetensors_file(os.path.join(out_dir, name), file_entries,
                            _hf_tensors([table[i] for i in group], params, dtype))
    weight_map.update({k: name for k, _, _ in file_entries})
  if len(names) > 1:
    with open(os.path.join(out_dir, f"{prefix}.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}, f, indent=2)
  return names


def hf4_model_config(config: dict) -> dict:
  """A transformers 5 ``config.json`` dict that transformers 4.x reads as the same model too: the 4.x keys
  it lacks are added (``rope_theta`` from ``rope_parameters``, which 4.x ignores for theta 10000;
  ``num_experts`` from ``num_local_experts``, else 128 experts; ``torch_dtype`` from ``dtype``). Every
  original key keeps its value, so a config that has them all comes back equal."""
  rope = config.get("rope_parameters")
  derived = {"rope_theta": rope.get("rope_theta") if isinstance(rope, dict) else None,
             "num_experts": config.get("num_local_experts"), "torch_dtype": config.get("dtype")}
  return {**config, **{k: v for k, v in derived.items() if k not in config and v is not None}}


_HF4_REWRITES = {"config.json": hf4_model_config, "tokenizer_config.json": hf4_tokenizer_config}


def copy_side_files(src_dir: str, dst_dir: str, names: Sequence[str] = ("config.json",) + TOKENIZER_FILES) -> list[str]:
  """Copy whichever of ``names`` exist in src_dir, each through a temporary file renamed into place;
  returns those copied. config.json and tokenizer_config.json get the transformers 4.x spellings they
  lack (``hf4_model_config``, ``tokenizer.hf4_tokenizer_config``); a file that needs none is copied byte
  for byte."""
  copied = []
  for n in names:
    src, dst = os.path.join(src_dir, n), os.path.join(dst_dir, n)
    if not os.path.isfile(src):
      continue
    rewrite = _HF4_REWRITES.get(n)
    original = read_json(src, n) if rewrite else None
    fixed = rewrite(original) if rewrite else None
    if fixed != original:
      files.write_json(dst, fixed, ensure_ascii=False)
    else:
      files.copy_file(src, dst)
    copied.append(n)
  return copied


def is_converted_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, CHECKPOINT_MARKER))


def read_target_config(path: str) -> tuple[Qwen3Config, str]:
  """(cfg, side_dir) of a target (HF directory or converted checkpoint) without reading its weights;
  side_dir holds the HF config/tokenizer files (``path`` itself for an HF directory)."""
  if not os.path.exists(path):
    raise JetSpecError(f"target not found: {path}")
  if not is_converted_checkpoint(path):
    return load_hf_config(path), path
  meta = read_json(os.path.join(path, CHECKPOINT_MARKER), CHECKPOINT_MARKER)
  if meta.get("kind") != "target":
    raise JetSpecError(f"{path} holds a {meta.get('kind')!r} checkpoint, not a target")
  side = os.path.join(path, "hf")
  return load_hf_config(side), side


def load_target(path: str, dtype=None, mesh=None, progress=iter):
  """Load a target from an HF directory or a converted checkpoint.

  Returns (cfg, params, side_dir) where side_dir holds the HF config/tokenizer files.
  ``dtype`` None keeps the stored dtype.
  """
  from jetspec_jax.models.qwen3 import param_specs
  cfg, side = read_target_config(path)
  if is_converted_checkpoint(path):
    return cfg, restore_params(os.path.join(path, "params"), param_specs(cfg), dtype, mesh), side
  reader = SafetensorsReader(path)
  if dtype is None:
    dtype = reader.get("model.embed_tokens.weight").dtype
  return cfg, load_weights(reader, target_mappings(cfg), param_specs(cfg), dtype, mesh, progress), path


def _no_phase(name: str) -> None:
  pass


def _declare_dtype(config_path: str, dtype: str) -> None:
  """Make the copied config.json name the weights' dtype (``dtype`` for transformers 5, ``torch_dtype`` for
  4.x) when a cast changed it; an unchanged config stays byte for byte."""
  with open(config_path) as f:
    config = json.load(f)
  if config.get("dtype", config.get("torch_dtype")) == dtype and config.get("torch_dtype", dtype) == dtype:
    return
  config["dtype"] = config["torch_dtype"] = dtype
  with open(config_path, "w") as f:
    json.dump(config, f, indent=2)


def convert_hf(hf_dir: str, out_dir: str, dtype=None, mesh=None, overwrite=False,
               progress=iter, on_phase: Callable[[str], None] = _no_phase) -> dict:
  """HF directory -> converted checkpoint (orbax params + hf/ side files), written atomically.
  ``on_phase(name)`` is called as each phase starts: "load", "orbax_save", "after_save" (side files)."""
  check_output_dir(out_dir, overwrite)
  on_phase("load")
  cfg, params, side = load_target(hf_dir, dtype, mesh, progress)
  with atomic_directory(out_dir, overwrite) as tmp:
    on_phase("orbax_save")
    save_params(os.path.join(tmp, "params"), params)
    on_phase("after_save")
    os.makedirs(os.path.join(tmp, "hf"))
    copy_side_files(side, os.path.join(tmp, "hf"))
    stored = str(params["embed"].dtype)
    _declare_dtype(os.path.join(tmp, "hf", "config.json"), stored)
    with open(os.path.join(tmp, CHECKPOINT_MARKER), "w") as f:
      json.dump({"kind": "target", "dtype": stored, "architecture": cfg.architecture, "format_version": 1}, f)
  return {"out_dir": os.path.abspath(out_dir), "dtype": stored, "num_params": int(sum(p.size for p in params.values())),
          "num_tensors": len(params)}


def export_mesh(cfg: Qwen3Config):
  """The mesh ``export_hf`` restores onto: this process's devices on the model axis, the most of them on
  which every weight's declared sharding is valid (each device then holds that share of every split weight),
  or None (one device) when only 1 is."""
  from jetspec_jax.models.qwen3 import param_specs
  specs, local = param_specs(cfg).values(), jax.local_devices()
  for n in range(len(local), 1, -1):
    if len(local) % n == 0:
      mesh = make_mesh(1, n, local[:n])
      try:
        for spec in specs:
          logical_to_spec(spec.axes, spec.shape, mesh)
      except JetSpecError:
        continue
      return mesh
  return None


def export_hf(ckpt_dir: str, out_dir: str, shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite=False,
              progress=iter, on_phase: Callable[[str], None] = _no_phase, mesh="auto") -> dict:
  """Converted checkpoint (or HF dir) -> HF directory: sharded safetensors + index + side files. The weights
  are restored sharded over ``mesh`` ("auto": ``export_mesh``; None: one device) and written one at a time
  from there, so no device holds more than its share of the model and the host one weight.
  ``on_phase(name)`` is called as each phase starts: "restore", "safetensors_write", "after_write"."""
  check_output_dir(out_dir, overwrite)
  on_phase("restore")
  if mesh == "auto":
    mesh = export_mesh(read_target_config(ckpt_dir)[0])
  cfg, params, side = load_target(ckpt_dir, None, mesh, progress)
  with atomic_directory(out_dir, overwrite) as tmp:
    on_phase("safetensors_write")
    files = write_safetensors(tmp, target_mappings(cfg), params, shard_bytes)
    on_phase("after_write")
    copied = copy_side_files(side, tmp)
    if "config.json" not in copied:
      with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(str(params["embed"].dtype)), f, indent=2)
  return {"out_dir": os.path.abspath(out_dir), "files": files,
          "restored_on": None if mesh is None else dict(mesh.shape)}


def head_mappings(head_cfg) -> list[Mapping]:
  """The table for a JetSpec / DFlash draft head (published key names, no embed / lm_head)."""
  table = [_transposed("fc", "fc.weight"), _identity("hidden_norm.weight", "hidden_norm.weight"),
           _identity("final_norm.weight", "norm.weight")]
  for i in range(head_cfg.num_hidden_layers):
    pre = f"layers.{i}."
    table += attention_mappings(pre, pre, head_cfg.num_attention_heads, head_cfg.num_key_value_heads,
                                head_cfg.head_dim)
    table += dense_mlp_mappings(pre, pre)
  return table


def save_head(out_dir: str, head_cfg, params: dict[str, jax.Array], overwrite=False) -> dict:
  """Write a draft head in the HF format of the published JetSpec heads, atomically."""
  with atomic_directory(out_dir, overwrite) as tmp:
    files = write_safetensors(tmp, head_mappings(head_cfg), params)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(head_cfg.to_hf_dict(str(params["fc"].dtype)), f, indent=2)
  return {"out_dir": os.path.abspath(out_dir), "files": files}


def load_head(path: str, dtype=None, mesh=None, target_cfg: Qwen3Config | None = None):
  """Load a draft head from its HF directory. Returns (DraftConfig, params)."""
  from jetspec_jax.models.draft_head import DraftConfig, param_specs
  if not os.path.isdir(path):
    raise JetSpecError(f"draft head directory not found: {path}")
  head_cfg = DraftConfig.from_hf_dict(read_json(os.path.join(path, "config.json"), "draft head config.json"))
  head_cfg.validate(target_cfg)
  reader = SafetensorsReader(path)
  if dtype is None:
    dtype = reader.get("fc.weight").dtype
  return head_cfg, load_weights(reader, head_mappings(head_cfg), param_specs(head_cfg), dtype, mesh)

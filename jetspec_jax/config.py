"""Qwen3 (dense and MoE) configuration, read from and written to Hugging Face ``config.json``.

``Qwen3Config`` is a frozen, hashable dataclass so it can be a static argument of ``jax.jit``.
Reading accepts transformers 4 and 5 spellings; written dicts carry both (``versioned_keys``), so
transformers 4.x and 5.x build the same model from them.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from jetspec_jax.errors import JetSpecError

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
DTYPES = ("float32", "bfloat16", "float16")


def versioned_keys(rope_theta: float, dtype: str) -> dict[str, Any]:
  """The RoPE and dtype keys in both spellings: transformers 5 reads ``rope_parameters`` and ``dtype``;
  4.x reads ``rope_theta`` (it ignores ``rope_parameters`` and would use theta 10000) and ``torch_dtype``."""
  return {"rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"}, "rope_theta": rope_theta,
          "dtype": dtype, "torch_dtype": dtype}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Hyper-parameters of a Qwen3 / Qwen3-MoE causal LM (names follow Hugging Face)."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960
  # MoE (num_experts == 0: dense).
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  eos_token_ids: tuple[int, ...] = ()
  bos_token_id: int | None = None
  pad_token_id: int | None = None
  # Runtime layout, not a property of the checkpoint (never read from or written to config.json):
  # split the MoE experts over the mesh's ``model`` axis instead of their MLP width.
  expert_parallel: bool = False
  # How the MoE experts run (``models.moe.DISPATCHES``): "auto" picks by the mesh's platform.
  moe_dispatch: str = "auto"

  @property
  def architecture(self) -> str:
    return "Qwen3MoeForCausalLM" if self.num_experts > 0 else "Qwen3ForCausalLM"

  def is_moe_layer(self, layer: int) -> bool:
    """Transformers' rule: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer."""
    return (self.num_experts > 0 and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0)

  def validate(self) -> None:
    """Raise JetSpecError for inconsistent hyper-parameters."""
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise JetSpecError(f"config value {name}={getattr(self, name)} must be positive")
    if self.num_attention_heads % self.num_key_value_heads:
      raise JetSpecError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={self.num_key_value_heads}")
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise JetSpecError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                         f"{self.num_experts}")
    if self.moe_dispatch not in ("auto", "loop", "gather", "kernel"):
      raise JetSpecError(f"moe_dispatch={self.moe_dispatch!r} must be auto, loop, gather or kernel")
    if self.num_experts and self.moe_intermediate_size <= 0:
      raise JetSpecError("moe_intermediate_size must be positive for a MoE config")

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
    """Parse a Hugging Face config dict; unsupported architectures and missing keys are errors."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and model_type not in SUPPORTED_ARCHITECTURES.values():
      got = ", ".join(archs) or f"model_type={model_type!r}"
      raise JetSpecError(f"unsupported architecture {got}: JetSpec-JAX reads "
                         f"{' and '.join(SUPPORTED_ARCHITECTURES)} checkpoints")
    is_moe = arch == "Qwen3MoeForCausalLM" or model_type == "qwen3_moe"
    if d.get("attention_bias"):
      raise JetSpecError("attention_bias=true is not a Qwen3 setting and is not supported")
    if d.get("use_sliding_window"):
      raise JetSpecError("use_sliding_window=true is not supported")
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    required += ["moe_intermediate_size", "num_experts_per_tok"] if is_moe else ["intermediate_size"]
    missing = [k for k in required if k not in d]
    if missing:
      raise JetSpecError(f"config.json is missing required key(s): {', '.join(missing)}")
    rope = d.get("rope_parameters") or {}
    theta = rope.get("rope_theta", d.get("rope_theta"))
    if theta is None:
      raise JetSpecError("config.json has neither rope_parameters.rope_theta nor rope_theta")
    if rope.get("rope_type", "default") not in ("default", None) or d.get("rope_scaling"):
      raise JetSpecError(f"RoPE scaling ({rope.get('rope_type') or d.get('rope_scaling')}) is not supported")
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    num_heads = d["num_attention_heads"]
    cfg = cls(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size", 0), num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=num_heads, num_key_value_heads=d.get("num_key_value_heads", num_heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 40960),
        num_experts=(d.get("num_experts") or d.get("num_local_experts") or 0) if is_moe else 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 0) if is_moe else 0,
        moe_intermediate_size=d.get("moe_intermediate_size", 0) if is_moe else 0,
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
        eos_token_ids=eos, bos_token_id=d.get("bos_token_id"), pad_token_id=d.get("pad_token_id"))
    if is_moe and cfg.num_experts == 0:
      raise JetSpecError("config.json of a MoE model is missing num_experts")
    cfg.validate()
    return cfg

  def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
    """A Hugging Face config dict for this configuration, read alike by transformers 4.x and 5.x (MoE
    keys in the 4.x spelling ``num_experts``, which 5.x maps to ``num_local_experts``)."""
    d: dict[str, Any] = {
        "architectures": [self.architecture],
        "model_type": "qwen3_moe" if self.num_experts else "qwen3",
        "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
        "num_attention_heads": self.num_attention_heads,
        "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
        "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
        **versioned_keys(self.rope_theta, dtype), "tie_word_embeddings": self.tie_word_embeddings,
        "max_position_embeddings": self.max_position_embeddings, "attention_bias": False, "use_sliding_window": False,
        "bos_token_id": self.bos_token_id, "pad_token_id": self.pad_token_id,
        "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) != 1
                         else self.eos_token_ids[0]) if self.eos_token_ids else None,
    }
    if self.num_experts:
      d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
               moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
               decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
    return d


def read_json(path: str, what: str) -> dict[str, Any]:
  """Read a JSON file, with errors that name the file."""
  if not os.path.isfile(path):
    raise JetSpecError(f"{what} not found: {path}")
  try:
    with open(path) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise JetSpecError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
  if not isinstance(data, dict):
    raise JetSpecError(f"{path} is not a JSON object (it holds a {type(data).__name__})")
  return data


GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
  """A checkpoint's ``generation_config.json``: the EOS ids generation stops at and its sampling settings
  (Qwen3-8B ships eos [151645, 151643], temperature 0.6, top_p 0.95, top_k 20). None: not set there."""
  eos_token_ids: tuple[int, ...] = ()
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None
  do_sample: bool | None = None

  @classmethod
  def from_hf_dict(cls, d: dict) -> "GenerationDefaults":
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(int(t) for t in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    num = lambda k, kind: None if d.get(k) is None else kind(d[k])
    try:
      return cls(eos, num("temperature", float), num("top_k", int), num("top_p", float), num("do_sample", bool))
    except (TypeError, ValueError):
      raise JetSpecError(f"{GENERATION_CONFIG} has a non-numeric temperature, top_k or top_p") from None

  def sampling(self) -> dict:
    """The sampling settings it sets, as SamplingConfig fields (greedy when do_sample is false)."""
    if self.do_sample is False:
      return {"temperature": 0.0}
    return {k: v for k, v in (("temperature", self.temperature), ("top_k", self.top_k), ("top_p", self.top_p))
            if v is not None}


def load_generation_defaults(model_dir: str) -> GenerationDefaults:
  """``model_dir/generation_config.json`` (all unset when the file is absent)."""
  path = os.path.join(model_dir, GENERATION_CONFIG)
  return GenerationDefaults.from_hf_dict(read_json(path, GENERATION_CONFIG)) if os.path.isfile(path) \
      else GenerationDefaults()


def load_hf_config(model_dir: str) -> Qwen3Config:
  """Read ``model_dir/config.json`` into a Qwen3Config; its EOS ids are config.json's followed by those only
  ``generation_config.json`` lists (real Qwen3 checkpoints end turns with an id config.json omits)."""
  if not os.path.isdir(model_dir):
    raise JetSpecError(f"model directory not found: {model_dir}")
  cfg = Qwen3Config.from_hf_dict(read_json(os.path.join(model_dir, "config.json"), "config.json"))
  extra = tuple(t for t in load_generation_defaults(model_dir).eos_token_ids if t not in cfg.eos_token_ids)
  return dataclasses.replace(cfg, eos_token_ids=cfg.eos_token_ids + extra) if extra else cfg


def parse_dtype(name: str):
  """'float32' | 'bfloat16' | 'float16' -> jnp dtype; anything else is a clear error."""
  import jax.numpy as jnp
  aliases = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}
  name = aliases.get(name, name)
  if name not in DTYPES:
    raise JetSpecError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
  return jnp.dtype(name)

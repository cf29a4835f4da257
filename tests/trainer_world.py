"""A tiny training world for trainer tests: tokenizer, random Qwen3 target (HF dir), chat JSONL."""
import json
import os
import shutil

import jax
import numpy as np

from jetspec_jax import convert
from jetspec_jax.config import Qwen3Config
from jetspec_jax.models import qwen3
from jetspec_jax.tokenizer import train_chat_tokenizer

WORDS = ("the cat sat on a mat while the dog ran to the park and a bird sang in the tree "
         "one two three four five six seven eight nine ten red green blue yellow").split()


def conversations(n: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    q = " ".join(rng.choice(WORDS, size=rng.integers(3, 8)))
    a = " ".join(rng.choice(WORDS, size=rng.integers(10, 30)))
    yield [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def build(root: str, *, scale: float = 12.0, layers: int = 2, hidden: int = 32) -> dict:
  """Write tokenizer + target + data.jsonl under ``root``; returns their paths."""
  tok_dir, target_dir, data = (os.path.join(root, n) for n in ("tok", "target", "data.jsonl"))
  convs = list(conversations(96))
  train_chat_tokenizer([m["content"] for c in convs for m in c], 320, tok_dir)
  from transformers import AutoTokenizer
  tok = AutoTokenizer.from_pretrained(tok_dir)
  cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_ids=(tok.eos_token_id,),
                    rope_theta=10000.0)
  params = qwen3.init_target(cfg, jax.random.key(0))
  params = {k: v * scale if k in ("embed", "lm_head") else v for k, v in params.items()}
  with convert.atomic_directory(target_dir, overwrite=True) as tmp:
    convert.write_safetensors(tmp, convert.target_mappings(cfg), params)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(cfg.to_hf_dict("float32"), f)
    for name in os.listdir(tok_dir):
      shutil.copy(os.path.join(tok_dir, name), tmp)
  with open(data, "w") as f:
    for c in convs:
      f.write(json.dumps({"messages": c}) + "\n")
  return {"target": target_dir, "data": data, "tokenizer": tok_dir}


def tiny_config(world: dict, out_dir: str, **overrides):
  from jetspec_jax.train.config_file import apply_override, load_config
  c = load_config("tiny")
  c.target, c.data.path, c.output_dir = world["target"], world["data"], out_dir
  c.data.seq_len, c.train.batch_size, c.train.num_anchors, c.train.chunk_anchors = 64, 8, 8, 4
  c.head.block_size, c.data.eval_examples, c.eval.every, c.log_every = 4, 0, 0, 1
  c.export_dtype = "float32"
  for k, v in overrides.items():
    apply_override(c, f"{k}={v}")
  return c

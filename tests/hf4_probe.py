"""What a transformers version makes of a Hugging Face directory, as plain JSON.

Imported by tests/test_hf4_compat.py (transformers 5 from the venv) and run as a script in a
subprocess whose PYTHONPATH starts with .venv/transformers4 (transformers 4.x):
``python tests/hf4_probe.py '{"kind": ..., ...}'`` prints one JSON object on stdout.
"""
import json
import sys

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "And 3+3?"}]
TEXTS = ["hello world", "  spaces\tand\nnewlines\n\n", "<think>x</think> <|im_start|>user\nhi<|im_end|>",
         "<|MASK|><|MASK|>a<|endoftext|>", "unicode: héllo wörld ✓ 数字 123456"]


def _ids(encoded) -> list[int]:
  """apply_chat_template's ids: a list in 4.x, a BatchEncoding in 5.x."""
  return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def model(dirs: list[str], ids: list[list[int]]) -> dict:
  """Per directory: float32 logits [B, T, V] of ``ids``, the model class, loading problems, rope_theta."""
  import torch
  import transformers
  out = {}
  for d in dirs:
    m, info = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32,
                                                                output_loading_info=True)
    with torch.no_grad():
      logits = m.eval()(torch.tensor(ids, dtype=torch.long)).logits.float()
    out[d] = {"class": type(m).__name__, "logits": logits.tolist(),
              "loading_problems": {k: sorted(map(str, v)) for k, v in info.items() if v},
              "config": json.loads(m.config.to_json_string(use_diff=False))}
  return out


def config(path: str) -> dict:
  """``AutoConfig`` of ``path``: its class and its full dict."""
  import transformers
  c = transformers.AutoConfig.from_pretrained(path)
  return {"class": type(c).__name__, "config": json.loads(c.to_json_string(use_diff=False))}


def tokenizer(path: str) -> dict:
  """``AutoTokenizer`` of ``path``: special tokens, ids of TEXTS, and the chat template's text and ids."""
  import transformers
  t = transformers.AutoTokenizer.from_pretrained(path)
  specials = {name: [getattr(t, f"{name}_token"), getattr(t, f"{name}_token_id")]
              for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask")}
  chats = {}
  for n in (1, 3, 4):
    for thinking in (True, False):
      kw = dict(add_generation_prompt=n % 2 == 0, enable_thinking=thinking)
      chats[f"{n}-{thinking}"] = [t.apply_chat_template(CHAT[:n], tokenize=False, **kw),
                                  _ids(t.apply_chat_template(CHAT[:n], tokenize=True, **kw))]
  encoded = [t(s)["input_ids"] for s in TEXTS]
  return {"len": len(t), "specials": specials, "all_special": sorted(zip(t.all_special_tokens, t.all_special_ids)),
          "added": {i: [a.content, a.special] for i, a in sorted(t.added_tokens_decoder.items())},
          "texts": encoded, "decoded": [t.decode(e, skip_special_tokens=True) for e in encoded],
          "chats": chats, "model_max_length": t.model_max_length}


if __name__ == "__main__":
  import transformers
  job = json.loads(sys.argv[1])
  kind = job.pop("kind")
  result = {"model": model, "config": config, "tokenizer": tokenizer}[kind](**job)
  json.dump({"transformers": transformers.__version__, "result": result}, sys.stdout)

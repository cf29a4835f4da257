"""A small Qwen3-style chat tokenizer for tests and toy targets, and a checked tokenizer loader.

``train_chat_tokenizer`` trains a byte-level BPE (every byte is in the alphabet, so any text
encodes) with the ``tokenizers`` library and saves it as a Hugging Face tokenizer directory:
Qwen3's special tokens (``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>`` eos, ``<think>`` /
``</think>`` as non-special added tokens) plus ``<|MASK|>`` (``tokenizer.mask_token``, the draft
head's mask id), after the BPE vocabulary as in Qwen3, and a chat template with Qwen3's layout.
The saved ``tokenizer_config.json`` loads alike in transformers 4.x and 5.x (``hf4_tokenizer_config``).
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

from jetspec_jax.errors import JetSpecError
from jetspec_jax.files import write_json

PAD, IM_START, IM_END, THINK, END_THINK, MASK = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                "</think>", "<|MASK|>")
SPECIAL_TOKENS = (PAD, IM_START, IM_END, MASK)      # skipped by decode(skip_special_tokens=True)
PLAIN_ADDED_TOKENS = (THINK, END_THINK)             # atomic, but kept when decoding (as in Qwen3)

# GPT-4 / Qwen2-style pre-tokenisation: contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newline runs, other whitespace.
PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen3's chat layout: ``<|im_start|>role\ncontent<|im_end|>\n`` per message. An assistant turn after
# the last user message is rendered with its think block (empty when it has none); earlier turns
# drop their reasoning. The generation prompt is ``<|im_start|>assistant\n``, followed by an empty
# think block when ``enable_thinking`` is false.
CHAT_TEMPLATE = r"""{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'assistant' %}
    {%- set answer = m.content %}
    {%- set thought = '' %}
    {%- if '</think>' in answer %}
      {%- set thought = answer.split('</think>')[0].split('<think>')[-1].strip('\n') %}
      {%- set answer = answer.split('</think>')[-1] %}
    {%- endif %}
    {%- if loop.index0 > ns.last_user and (loop.last or thought) %}
      {{- '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + answer.lstrip('\n') + '<|im_end|>\n' }}
    {%- else %}
      {{- '<|im_start|>assistant\n' + answer.lstrip('\n') + '<|im_end|>\n' }}
    {%- endif %}
  {%- else %}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}"""

TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def train_chat_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str, *, min_frequency: int = 2,
                         model_max_length: int = 32768) -> str:
  """Train a byte-level BPE on ``texts`` and save it (with the chat template) to ``out_dir``.

  The result has at most ``vocab_size`` ids: the 256 byte tokens and learned merges first, then the
  six added tokens. Training is deterministic (no sampling), so equal inputs give equal files.
  Returns ``out_dir``; load it with ``load_tokenizer`` or ``AutoTokenizer.from_pretrained``.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  num_added = len(SPECIAL_TOKENS) + len(PLAIN_ADDED_TOKENS)
  min_size = 256 + num_added
  if vocab_size < min_size:
    raise JetSpecError(f"vocab_size={vocab_size} is too small for a byte-level BPE (need at least {min_size})")
  tok = Tokenizer(models.BPE())
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size - num_added, min_frequency=min_frequency,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
  hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, mask_token=MASK,
                               additional_special_tokens=[IM_START], model_max_length=model_max_length,
                               clean_up_tokenization_spaces=False)
  hf.chat_template = CHAT_TEMPLATE
  os.makedirs(out_dir, exist_ok=True)
  hf.save_pretrained(out_dir)
  path = os.path.join(out_dir, "tokenizer_config.json")
  with open(path, encoding="utf-8") as f:
    config = hf4_tokenizer_config(json.load(f))
  write_json(path, config, sort_keys=True, ensure_ascii=False)    # as save_pretrained
  return out_dir


def hf4_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
  """A transformers 5 ``tokenizer_config.json`` dict that transformers 4.x loads too, with the same
  tokens and ids: 4.x knows no class ``TokenizersBackend`` (5.x maps ``PreTrainedTokenizerFast`` to it)
  and takes extra special tokens as the list ``additional_special_tokens`` (a list-valued
  ``extra_special_tokens`` fails there; 5.x reads either). Other keys are kept as they are."""
  config = dict(config)
  if config.get("tokenizer_class") == "TokenizersBackend":
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
  if isinstance(config.get("extra_special_tokens"), list):
    config["additional_special_tokens"] = config.pop("extra_special_tokens")
  return config


def load_tokenizer(path: str):
  """The Hugging Face tokenizer saved in directory ``path`` (a JetSpecError if there is none)."""
  if not os.path.isdir(path):
    raise JetSpecError(f"tokenizer directory not found: {path}")
  if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_MARKERS):
    raise JetSpecError(f"{path} holds no tokenizer files (expected one of {', '.join(TOKENIZER_MARKERS)})")
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(path)


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
  """The prompt ids of ``messages`` (role / content dicts) in the tokenizer's chat template, with the
  assistant's generation prompt and thinking off (Qwen3's empty think block)."""
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False, tokenize=True)
  return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

"""Chat encoding: a conversation rendered with the target tokenizer's chat template and tokenised
as at inference (prompt encoded, response generated): ``loss_mask`` is 1 exactly on response
tokens, i.e. assistant content and its closing ``<|im_end|>``.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Iterator

import numpy as np

from jetspec_jax.errors import JetSpecError
from jetspec_jax.train.sources import Conversation

ASSISTANT_HEADER = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"


class ChatEncoder:
  """Chat template + tokenizer for one setting of ``enable_thinking``.

  ``encode(messages)`` -> (input_ids [n] int32, loss_mask [n] int32). A response starts after the
  template's generation prompt (``<|im_start|>assistant\\n``, plus the empty think block when thinking
  is off and the template renders one) and ends after its ``<|im_end|>``; everything else is prompt.

  An assistant message may carry ``token_ids``, the ids the target generated for it (as
  ``regenerate`` writes them). When the rendered response is exactly their decoded text plus
  ``<|im_end|>``, the response is encoded as those ids plus ``<|im_end|>``, so the head trains on the
  target's own token sequence even where re-tokenising the text would segment it differently.
  Otherwise (the template changed the text) the text is tokenised.
  """

  def __init__(self, tokenizer, enable_thinking: bool = False):
    if not getattr(tokenizer, "chat_template", None):
      raise JetSpecError("the tokenizer has no chat template")
    self.tokenizer, self.enable_thinking = tokenizer, enable_thinking
    probe = [{"role": "user", "content": "x"}]
    plain = self.render(probe)
    prompted = self.render(probe, add_generation_prompt=True)
    self.generation_prompt = prompted[len(plain):]
    if not prompted.startswith(plain) or not self.generation_prompt.startswith(ASSISTANT_HEADER):
      raise JetSpecError("the chat template is not Qwen3-style: its generation prompt does not start with "
                         f"{ASSISTANT_HEADER!r}")

  def render(self, messages: Conversation, add_generation_prompt: bool = False) -> str:
    return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                              enable_thinking=self.enable_thinking)

  def prompt_ids(self, messages: Conversation) -> list[int]:
    """Token ids of ``messages`` followed by the generation prompt (what the target continues);
    earlier responses with ``token_ids`` are encoded as those ids, as in ``encode``."""
    ids = self.encode(messages)[0].tolist() if messages else []
    return ids + self.tokenizer(self.generation_prompt, add_special_tokens=False)["input_ids"]

  def pieces(self, messages: Conversation) -> list[tuple[str, bool, list[int] | None]]:
    """The rendered conversation as consecutive (text, is_response, exact ids or None) pieces."""
    text = self.render(messages)
    pieces, cursor = [], 0
    for message in [m for m in messages if m["role"] == "assistant"]:
      head = text.find(ASSISTANT_HEADER, cursor)
      if head < 0:
        break
      start = head + (len(self.generation_prompt) if text.startswith(self.generation_prompt, head)
                      else len(ASSISTANT_HEADER))
      end = text.find(TURN_END, start)
      end = len(text) if end < 0 else end + len(TURN_END)
      response = text[start:end]
      pieces += [(text[cursor:start], False, None), (response, True, self._exact_ids(message, response))]
      cursor = end
    pieces.append((text[cursor:], False, None))
    return [piece for piece in pieces if piece[0]]

  def _exact_ids(self, message: dict, response: str) -> list[int] | None:
    """The message's generated ``token_ids`` + ``<|im_end|>`` when they render as ``response``."""
    ids = message.get("token_ids")
    if ids is None or response != self.tokenizer.decode(ids, skip_special_tokens=False) + TURN_END:
      return None
    return [int(i) for i in ids] + [self.tokenizer.convert_tokens_to_ids(TURN_END)]

  def encode(self, messages: Conversation) -> tuple[np.ndarray, np.ndarray]:
    return self.encode_batch([messages])[0]

  def encode_batch(self, conversations: list[Conversation]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``encode`` for many conversations in one (parallel) tokenizer call."""
    pieces = [self.pieces(m) for m in conversations]
    flat = [text for p in pieces for text, _, exact in p if exact is None]
    ids = iter(self.tokenizer(flat, add_special_tokens=False)["input_ids"]) if flat else iter(())
    out = []
    for p in pieces:
      toks = [next(ids) if exact is None else exact for _, _, exact in p]
      out.append((np.fromiter(itertools.chain.from_iterable(toks), np.int32),
                  np.repeat(np.array([r for _, r, _ in p], np.int32), [len(t) for t in toks])))
    return out

  def encode_all(self, conversations: Iterable[Conversation],
                 group: int = 256) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``encode`` over a stream, ``group`` conversations per tokenizer call."""
    it = iter(conversations)
    while chunk := list(itertools.islice(it, group)):
      yield from self.encode_batch(chunk)

"""Tokenised chat rows stored once through a TFDS builder (``file_format="array_record"``) and read
back by index without TensorFlow. The only module that imports tensorflow_datasets.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
from typing import Any, Iterable, Iterator

import numpy as np
import tensorflow_datasets as tfds

from jetspec_jax.errors import JetSpecError
from jetspec_jax.stages import code_version
from jetspec_jax.train.chat import ChatEncoder
from jetspec_jax.train.sources import iter_conversations, source_files


def build_rows(examples: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, pack: bool,
               stats: dict[str, int]) -> Iterator[dict[str, np.ndarray]]:
  """Tokenised conversations -> rows ``{"input_ids" [n], "loss_mask" [n], "segment_lengths" [k]}``, n <= seq_len.

  A conversation longer than ``seq_len`` is truncated; one left with no response token is dropped.
  Packing fills a row greedily in order and starts a new row when the next conversation does not fit.
  ``stats`` counts conversations, dropped, truncated, rows, tokens and loss_tokens.
  """
  ids_buf, mask_buf, seg_buf = [], [], []

  def flush():
    row = {"input_ids": np.concatenate(ids_buf), "loss_mask": np.concatenate(mask_buf),
           "segment_lengths": np.asarray(seg_buf, np.int32)}
    stats["rows"] += 1
    for buf in (ids_buf, mask_buf, seg_buf):
      buf.clear()
    return row

  for ids, mask in examples:
    stats["conversations"] += 1
    stats["truncated"] += int(len(ids) > seq_len)
    ids, mask = ids[:seq_len], mask[:seq_len]
    if not mask.any():
      stats["dropped"] += 1
      continue
    stats["tokens"] += len(ids)
    stats["loss_tokens"] += int(mask.sum())
    if seg_buf and (not pack or sum(seg_buf) + len(ids) > seq_len):
      yield flush()
    ids_buf.append(ids)
    mask_buf.append(mask)
    seg_buf.append(len(ids))
  if seg_buf:
    yield flush()


class JetspecChat(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Tokenised chat rows; one config per (source, tokenizer, settings) fingerprint."""
  VERSION = tfds.core.Version("1.0.0")

  def __init__(self, *, rows_fn, metadata: dict, **kwargs):
    self._rows_fn, self._metadata = rows_fn, metadata   # rows_fn(metadata) yields the rows to write
    super().__init__(**kwargs)

  def _info(self):
    feature = lambda: tfds.features.Tensor(shape=(None,), dtype=np.int32)
    return tfds.core.DatasetInfo(
        builder=self, description="Tokenised chat conversations for JetSpec draft-head training.",
        features=tfds.features.FeaturesDict({"input_ids": feature(), "loss_mask": feature(),
                                             "segment_lengths": feature()}),
        metadata=tfds.core.MetadataDict(self._metadata),
        disable_shuffling=True)   # record i is row i, in source order; BatchIterator shuffles

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples()}

  def _generate_examples(self):
    for i, row in enumerate(self._rows_fn(self.info.metadata)):
      yield i, row


@dataclasses.dataclass
class ChatRows:
  """Prepared rows, read by index from array_record: ``read([i, ...])`` -> list of
  ``{"input_ids" [n], "loss_mask" [n], "segment_lengths" [k]}`` (int32, n <= seq_len, sum = n)."""
  source: Any          # tfds ArrayRecordDataSource
  path: str            # the prepared dataset directory
  metadata: dict

  @property
  def seq_len(self) -> int:
    return int(self.metadata["seq_len"])

  @property
  def pad_id(self) -> int:
    return int(self.metadata["pad_id"])

  def __len__(self) -> int:
    return len(self.source)

  def read(self, indices) -> list[dict[str, np.ndarray]]:
    return self.source.__getitems__([int(i) for i in indices])


def _fingerprint(source: str, limit: int | None, tokenizer, settings: dict) -> str:
  h = hashlib.sha256(json.dumps({"code": code_version([__name__]), "limit": limit, **settings}, sort_keys=True).encode())
  for path in source_files(source):
    with open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 24), b""):
        h.update(block)
  h.update(tokenizer.backend_tokenizer.to_str().encode() if hasattr(tokenizer, "backend_tokenizer") else b"")
  h.update((tokenizer.chat_template or "").encode())
  return h.hexdigest()[:16]


def prepare_dataset(source: str, tokenizer, data_dir: str, *, seq_len: int, pack: bool = False,
                    enable_thinking: bool = False, limit: int | None = None) -> ChatRows:
  """Tokenise ``source`` (see ``iter_conversations``) into rows under ``data_dir`` once; reuse it after.

  The TFDS config name fingerprints the source files' bytes, the tokenizer, its chat template, the
  settings and this module's code (``stages.code_version``), so a change re-prepares into a new
  directory. Run it on one process before the others share a ``data_dir`` (TFDS writes to a temporary directory and renames it when complete).
  """
  if seq_len <= 0:
    raise JetSpecError(f"seq_len={seq_len} must be positive")
  settings = {"seq_len": seq_len, "pack": pack, "enable_thinking": enable_thinking}
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  metadata = {**settings, "source": source, "limit": limit, "pad_id": int(pad_id or 0)}

  def rows_fn(info_metadata):
    encoder = ChatEncoder(tokenizer, enable_thinking)
    stats = dict.fromkeys(("conversations", "dropped", "truncated", "rows", "tokens", "loss_tokens"), 0)
    yield from build_rows(encoder.encode_all(itertools.islice(iter_conversations(source), limit)),
                          seq_len, pack, stats)
    if stats["rows"] == 0:
      raise JetSpecError(f"dataset {source} is empty: {stats['conversations']} conversations, none with a response "
                         f"token within seq_len={seq_len}")
    info_metadata["stats"] = stats

  config = tfds.core.BuilderConfig(name=_fingerprint(source, limit, tokenizer, settings))
  builder = JetspecChat(rows_fn=rows_fn, metadata=metadata, config=config, data_dir=data_dir,
                        file_format="array_record")
  builder.download_and_prepare()
  return ChatRows(builder.as_data_source(split="train"), os.fspath(builder.data_path), dict(builder.info.metadata))

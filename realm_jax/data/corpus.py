"""Documents -> block store + pretraining examples on disk (memory-mapped .npy arrays).

Layout of a prepared data dir:
  vocab.txt
  blocks/tokens.npy       int32 [N, block_len]  `[CLS] title [SEP] body [SEP]`, 0-padded
  blocks/lengths.npy      int32 [N]
  blocks/body_start.npy   int32 [N]             first body position (segment 1 starts here)
  blocks/uids.npy         uint64 [N]            hash of title + body (trivial-retrieval filter)
  blocks/doc_ids.npy      int32 [N]
  blocks/titles.json      [title of each document]
  examples/<split>/tokens.npy        int32 [E, max_sentence_len]  one sentence, no [CLS]/[SEP]
  examples/<split>/lengths.npy       int32 [E]
  examples/<split>/spans.npy         int32 [E, max_spans, 2]  salient spans (wordpiece [s, e))
  examples/<split>/num_spans.npy     int32 [E]
  examples/<split>/block.npy         int32 [E]   source block row
  examples/<split>/block_offsets.npy int32 [E, 2]  the sentence's [s, e) inside that block row
  examples/eval/target_span.npy      int32 [E, 2]  the span evaluated (the fact's value)
  examples/eval/answer_blocks.npy    int32 [E, max_answers]  other blocks stating the fact (-1 pad)
  stats.json
Splits: `train` (training queries) and `eval` (held-out entities: never a training query).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections import Counter, defaultdict
from typing import Iterable, Iterator

import numpy as np

from realm_jax.data.spans import span_covering, tag_salient_spans
from realm_jax.data.tokenizer import Tokenizer

MAX_SPANS = 8


@dataclasses.dataclass(frozen=True)
class SourceSentence:
  text: str
  split: str | None = "train"            # "train", "eval" or None (text only, no example)
  facts: tuple[int, ...] = ()            # ground truth, used only to measure
  value_spans: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class SourceDocument:
  title: str
  sentences: tuple[SourceSentence, ...]


def block_uid(title_ids: list[int], body_ids: list[int]) -> int:
  """64-bit hash of title + body wordpieces: equal text -> equal uid (REALM's trivial filter)."""
  raw = np.asarray(title_ids + [-1] + body_ids, np.int32).tobytes()
  return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def wordpiece_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
  """Char span [start, end) -> wordpiece span [s, e) of the tokens overlapping it."""
  inside = [i for i, (a, b) in enumerate(offsets) if b > start and a < end]
  return (inside[0], inside[-1] + 1) if inside else (0, 0)


class _SplitWriter:
  """Accumulates the examples of one split."""

  def __init__(self):
    self.rows = defaultdict(list)

  def add(self, **fields):
    for key, value in fields.items():
      self.rows[key].append(value)

  def __len__(self):
    return len(self.rows["tokens"])

  def save(self, out_dir: str, max_sentence_len: int, max_masks: int):
    os.makedirs(out_dir, exist_ok=True)
    n = len(self)
    tokens = np.zeros((n, max_sentence_len), np.int32)
    spans = np.full((n, MAX_SPANS, 2), -1, np.int32)
    for i, (ids, sp) in enumerate(zip(self.rows["tokens"], self.rows["spans"])):
      tokens[i, :len(ids)] = ids
      if sp:
        spans[i, :len(sp)] = sp
    arrays = {
        "tokens": tokens, "spans": spans,
        "lengths": np.asarray([len(t) for t in self.rows["tokens"]], np.int32),
        "num_spans": np.asarray([len(s) for s in self.rows["spans"]], np.int32),
        "block": np.asarray(self.rows["block"], np.int32),
        "block_offsets": np.asarray(self.rows["block_offsets"], np.int32).reshape(n, 2),
    }
    if "target_span" in self.rows:
      arrays["target_span"] = np.asarray(self.rows["target_span"], np.int32).reshape(n, 2)
      width = max([len(a) for a in self.rows["answer_blocks"]] + [1])
      answers = np.full((n, width), -1, np.int32)
      for i, a in enumerate(self.rows["answer_blocks"]):
        answers[i, :len(a)] = a
      arrays["answer_blocks"] = answers
    for key, value in arrays.items():
      np.save(os.path.join(out_dir, f"{key}.npy"), value)


def build_corpus(documents: Iterable[SourceDocument], tokenizer: Tokenizer, out_dir: str, *,
                 block_len: int, max_sentence_len: int, max_masks: int = 10,
                 chunk_size: int = 2000, progress_every: float = 10.0) -> dict:
  """Packs sentences greedily into blocks and writes the block store and examples.

  A block holds `[CLS] title [SEP] body [SEP]` with 3 + len(title) + len(body) <= block_len.
  Every sentence with a `split` and at least one salient span of <= `max_masks` wordpieces
  becomes an example; for `eval` sentences one example per stated fact whose value the span
  tagger covers (the target the evaluation masks).

  Returns the stats written to `out_dir/stats.json`.
  """
  t0 = time.time()
  blocks, titles, doc_ids, uids, body_starts = [], [], [], [], []
  writers = {"train": _SplitWriter(), "eval": _SplitWriter()}
  skipped = Counter()
  fact_blocks = defaultdict(list)     # fact id -> block rows stating it
  pending_eval = []                   # (example index, fact, block row)
  stats = Counter()
  last_report = t0

  for chunk in _chunks(documents, chunk_size):
    texts = [d.title for d in chunk] + [s.text for d in chunk for s in d.sentences]
    encoded = tokenizer.encode_batch(texts)
    title_enc, sent_enc = encoded[:len(chunk)], iter(encoded[len(chunk):])
    for doc, (title_ids, _) in zip(chunk, title_enc):
      doc_id = len(titles)
      titles.append(doc.title)
      stats["documents"] += 1
      budget = block_len - 3 - len(title_ids)
      body, members = [], []          # members: (sentence, ids, offsets, start within body)
      sentences = [(s, *next(sent_enc)) for s in doc.sentences]
      if budget <= 0:
        skipped["title longer than block_len"] += 1
        continue
      for sentence, ids, offsets in sentences + [(None, None, None)]:
        if sentence is not None and len(ids) > budget:
          skipped["sentence longer than a block"] += 1
          continue
        if sentence is None or len(body) + len(ids) > budget:
          if body:
            row = len(blocks)
            head = [tokenizer.cls_id] + title_ids + [tokenizer.sep_id]
            blocks.append(head + body + [tokenizer.sep_id])
            body_starts.append(len(head))
            uids.append(block_uid(title_ids, body))
            doc_ids.append(doc_id)
            for s, s_ids, s_offsets, pos in members:
              _add_examples(writers, s, s_ids, s_offsets, row, len(head) + pos,
                            max_sentence_len, max_masks, skipped, fact_blocks, pending_eval)
          body, members = [], []
        if sentence is not None:
          members.append((sentence, ids, offsets, len(body)))
          body.extend(ids)
          stats["sentences"] += 1
    if time.time() - last_report > progress_every:
      last_report = time.time()
      rate = stats["documents"] / (last_report - t0)
      print(f"  prepare: {stats['documents']:,} documents, {len(blocks):,} blocks "
            f"({rate:,.0f} docs/s)", flush=True)

  # Ground truth for recall: the other blocks that state the evaluated fact.
  answer_blocks = writers["eval"].rows["answer_blocks"]
  for index, fact, row in pending_eval:
    answer_blocks[index] = [b for b in dict.fromkeys(fact_blocks[fact]) if b != row]

  os.makedirs(os.path.join(out_dir, "blocks"), exist_ok=True)
  tokens = np.zeros((len(blocks), block_len), np.int32)
  for i, ids in enumerate(blocks):
    tokens[i, :len(ids)] = ids
  block_arrays = {"tokens": tokens, "lengths": np.asarray([len(b) for b in blocks], np.int32),
                  "body_start": np.asarray(body_starts, np.int32),
                  "uids": np.asarray(uids, np.uint64), "doc_ids": np.asarray(doc_ids, np.int32)}
  for key, value in block_arrays.items():
    np.save(os.path.join(out_dir, "blocks", f"{key}.npy"), value)
  with open(os.path.join(out_dir, "blocks", "titles.json"), "w") as f:
    json.dump(titles, f)
  for split, writer in writers.items():
    writer.save(os.path.join(out_dir, "examples", split), max_sentence_len, max_masks)

  result = {
      "documents": stats["documents"], "blocks": len(blocks),
      "max_block_wordpieces": int(block_arrays["lengths"].max(initial=0)),
      "block_len": block_len, "max_sentence_len": max_sentence_len,
      "sentences": stats["sentences"],
      "salient_spans": int(sum(len(s) for w in writers.values() for s in w.rows["spans"])),
      "examples": {split: len(w) for split, w in writers.items()},
      "vocab_size": tokenizer.vocab_size,
      "skipped": dict(skipped), "seconds": round(time.time() - t0, 2),
  }
  with open(os.path.join(out_dir, "stats.json"), "w") as f:
    json.dump(result, f, indent=2)
  return result


def _add_examples(writers, sentence: SourceSentence, ids, offsets, row, block_pos,
                  max_sentence_len, max_masks, skipped, fact_blocks, pending_eval):
  """Adds the example(s) one sentence yields and records which facts its block states."""
  for fact in sentence.facts:
    fact_blocks[fact].append(row)
  if sentence.split is None:
    return
  if len(ids) > max_sentence_len:
    skipped["sentence longer than max_sentence_len"] += 1
    return
  char_spans = tag_salient_spans(sentence.text)
  spans = [wordpiece_span(offsets, s, e) for s, e in char_spans]
  keep = [i for i, (s, e) in enumerate(spans) if 0 < e - s <= max_masks]
  if not keep:
    skipped["no salient span"] += 1
    return
  kept_spans = [spans[i] for i in keep][:MAX_SPANS]
  common = dict(tokens=ids, spans=kept_spans, block=row,
                block_offsets=(block_pos, block_pos + len(ids)))
  if sentence.split == "train":
    writers["train"].add(**common)
    return
  for fact, (vs, ve) in zip(sentence.facts, sentence.value_spans):
    covering = span_covering([char_spans[i] for i in keep][:MAX_SPANS], vs, ve)
    if covering is None:
      skipped["eval fact not covered by a salient span"] += 1
      continue
    pending_eval.append((len(writers["eval"]), fact, row))
    writers["eval"].add(target_span=kept_spans[covering], answer_blocks=[], **common)


def _chunks(items: Iterable, size: int) -> Iterator[list]:
  chunk = []
  for item in items:
    chunk.append(item)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk

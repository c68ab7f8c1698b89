"""Documents -> block store + pretraining examples, one shard at a time, then one merge.

A shard (a run of documents) is packed into blocks and examples by one worker and written to
`DIR/shards/<i>/`, its `done.json` last; `merge_shards` concatenates the finished shards into
the final memory-mapped arrays:

  vocab.txt
  blocks/tokens.npy       int32 [N, block_len]  `[CLS] title [SEP] body [SEP]`, 0-padded
  blocks/lengths.npy      int32 [N]
  blocks/body_start.npy   int32 [N]             first body position (segment 1 starts here)
  blocks/uids.npy         uint64 [N]            hash of title + body (trivial-retrieval filter)
  blocks/doc_ids.npy      int32 [N]             document of the block (index into titles)
  blocks/titles.json      [title of each document]
  examples/<split>/tokens.npy        int32 [E, max_sentence_len]  one sentence, no [CLS]/[SEP]
  examples/<split>/lengths.npy       int32 [E]
  examples/<split>/spans.npy         int32 [E, MAX_SPANS, 2]  salient spans (wordpiece [s, e))
  examples/<split>/num_spans.npy     int32 [E]
  examples/<split>/block.npy         int32 [E]   source block row
  examples/<split>/block_uid.npy     uint64 [E]  that block's uid
  examples/<split>/block_offsets.npy int32 [E, 2]  the sentence's [s, e) inside that block row
  examples/eval/target_span.npy      int32 [E, 2]  the span evaluated
  examples/eval/answer_blocks.npy    int32 [E, A]  other blocks stating the fact (-1 pad; the
                                                   generated world only)
  stats.json

Splits: `train` (training queries) and `eval` (held-out documents or, in the generated world,
held-out entities: never a training query).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections import Counter

import numpy as np

from realm_jax.data.prepared import open_block_arrays
from realm_jax.data.sentences import split_sentences
from realm_jax.data.spans import span_covering
from realm_jax.data.tokenizer import Tokenizer, windows, word_starts

MAX_SPANS = 8
SPLITS = ("train", "eval")
_EXAMPLE_KEYS = ("tokens", "lengths", "spans", "num_spans", "block", "block_offsets")


@dataclasses.dataclass(frozen=True)
class SourceSentence:
  text: str
  split: str | None = "train"            # "train", "eval" or None (text only, no example)
  facts: tuple[int, ...] = ()            # ground truth, used only to measure
  value_spans: tuple[tuple[int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class SourceDocument:
  """One document: raw `text` (split into sentences here) or pre-split `sentences`."""
  title: str
  text: str = ""
  sentences: tuple[SourceSentence, ...] = ()
  split: str | None = "train"            # split of the sentences of a raw `text`
  where: str = ""                        # file:line (or equivalent) for messages
  qas: tuple = ()                        # questions about this document (SQuAD format)


@dataclasses.dataclass(frozen=True)
class PackSettings:
  block_len: int
  max_sentence_len: int
  max_masks: int = 10


def block_uid(title_ids: list[int], body_ids: list[int]) -> int:
  """64-bit hash of title + body wordpieces: equal text -> equal uid (REALM's trivial filter)."""
  raw = np.asarray(title_ids + [-1] + body_ids, np.int32).tobytes()
  return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def wordpiece_span(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
  """Char span [start, end) -> wordpiece span [s, e) of the tokens overlapping it."""
  inside = [i for i, (a, b) in enumerate(offsets) if b > start and a < end]
  return (inside[0], inside[-1] + 1) if inside else (0, 0)


def sentences_of(doc: SourceDocument) -> tuple[SourceSentence, ...]:
  if doc.sentences:
    return doc.sentences
  return tuple(SourceSentence(doc.text[s:e], doc.split) for s, e in split_sentences(doc.text))


def eval_target(text: str, num_spans: int) -> int:
  """Which salient span of a held-out sentence is evaluated: fixed by the sentence's text."""
  return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little") \
      % num_spans


class _Split:
  """Accumulates the examples of one split of one shard."""

  def __init__(self):
    self.rows: dict[str, list] = {k: [] for k in _EXAMPLE_KEYS + ("target_span", "fact")}

  def __len__(self):
    return len(self.rows["tokens"])

  def arrays(self, max_sentence_len: int) -> dict[str, np.ndarray]:
    n = len(self)
    tokens = np.zeros((n, max_sentence_len), np.int32)
    spans = np.full((n, MAX_SPANS, 2), -1, np.int32)
    for i, (ids, sp) in enumerate(zip(self.rows["tokens"], self.rows["spans"])):
      tokens[i, :len(ids)] = ids
      spans[i, :len(sp)] = sp
    return {"tokens": tokens, "spans": spans,
            "lengths": np.asarray(self.rows["lengths"], np.int32).reshape(n),
            "num_spans": np.asarray(self.rows["num_spans"], np.int32).reshape(n),
            "block": np.asarray(self.rows["block"], np.int32).reshape(n),
            "block_offsets": np.asarray(self.rows["block_offsets"], np.int32).reshape(n, 2),
            "target_span": np.asarray(self.rows["target_span"], np.int32).reshape(n, 2),
            "fact": np.asarray(self.rows["fact"], np.int64).reshape(n)}


class _Blocks:
  """A shard's blocks as they are packed, and the examples of the sentences in each."""

  def __init__(self, settings: PackSettings, sep_id: int):
    self.settings, self.sep_id = settings, sep_id
    self.rows, self.body_starts, self.uids, self.docs = [], [], [], []
    self.facts: list[tuple[int, int]] = []
    self.splits = {s: _Split() for s in SPLITS}
    self.dropped = Counter()

  def add(self, doc_id: int, head: list[int], title_ids: list[int], body: list[int],
          members: list) -> None:
    """One block `head + body + [SEP]` of document `doc_id`; `members`: its whole sentences
    (sentence, ids, offsets, char spans, position in the body)."""
    row = len(self.rows)
    self.rows.append(head + body + [self.sep_id])
    self.body_starts.append(len(head))
    self.uids.append(block_uid(title_ids, body))
    self.docs.append(doc_id)
    for sentence, ids, offsets, char_spans, pos in members:
      self.facts.extend((f, row) for f in sentence.facts)
      _add_examples(self.splits, sentence, ids, offsets, char_spans, row, len(head) + pos,
                    self.settings, self.dropped)


def shard_input(documents: list[tuple[int, SourceDocument]], vocab_sha256: str) -> str:
  """A digest of what a shard packs (each document's id, title, text, sentences and split)
  and of the vocab it is encoded with: a re-run reuses a finished shard only for the same
  input (`done.json`'s "input")."""
  digest = hashlib.blake2b(vocab_sha256.encode(), digest_size=16)
  for doc_id, doc in documents:
    digest.update(repr((doc_id, doc.title, doc.text, doc.split, doc.sentences)).encode())
  return digest.hexdigest()


def build_shard(documents: list[tuple[int, SourceDocument]], tokenizer: Tokenizer, tagger,
                settings: PackSettings, out_dir: str, input_digest: str) -> dict:
  """Packs one shard's documents (with their global doc ids) and writes `out_dir`, its
  `done.json` holding `input_digest` (`shard_input(documents)`, which the caller computed to
  look for a finished shard).

  A block holds `[CLS] title [SEP] body [SEP]` with 3 + len(title) + len(body) <= block_len;
  titles are cut to half a block, a sentence longer than the body budget is cut into pieces.
  Every sentence with a split and at least one salient span of <= max_masks wordpieces
  becomes an example (`eval` sentences: one per evaluated span). Returns the shard's stats.
  """
  docs = [(doc_id, doc, sentences_of(doc)) for doc_id, doc in documents]
  texts = [doc.title for _, doc, _ in docs] + [s.text for _, _, ss in docs for s in ss]
  encoded = tokenizer.encode_batch(texts)
  sentence_texts = texts[len(docs):]
  spans_all = tagger.tag_batch(sentence_texts) if sentence_texts else []
  title_enc, sent_enc = encoded[:len(docs)], iter(zip(encoded[len(docs):], spans_all))
  blocks, stats = _Blocks(settings, tokenizer.sep_id), Counter()
  head_max = (settings.block_len - 3) // 2
  for (doc_id, doc, sentences), (title_ids, _) in zip(docs, title_enc):
    if len(title_ids) > head_max:
      title_ids = title_ids[:head_max]
      stats["titles_truncated"] += 1
    head = [tokenizer.cls_id] + title_ids + [tokenizer.sep_id]
    _pack_document(blocks, doc_id, head, title_ids, sentences, sent_enc, stats, tokenizer)
  return _write_shard(out_dir, settings, blocks.rows, blocks.body_starts, blocks.uids,
                      blocks.docs, blocks.facts, blocks.splits, stats, blocks.dropped, len(docs),
                      input_digest)


def _pack_document(blocks: _Blocks, doc_id: int, head: list[int], title_ids: list[int],
                   sentences, sent_enc, stats: Counter, tokenizer: Tokenizer) -> None:
  """A document's sentences (their encodings and spans drawn from `sent_enc`) into blocks:
  whole sentences while they fit, a sentence longer than a block cut into blocks of its own
  at word starts (mid-word only where one word alone is longer than a block)."""
  budget = blocks.settings.block_len - 1 - len(head)
  body, members = [], []        # members: (sentence, ids, offsets, char spans, body pos)

  def flush():
    if body:
      blocks.add(doc_id, head, title_ids, list(body), list(members))
      body.clear()
      members.clear()

  for sentence in sentences:
    (ids, offsets), char_spans = next(sent_enc)
    stats["sentences"] += 1
    if not ids:                   # only zero-width or control characters: no example either
      blocks.dropped["no wordpiece"] += sentence.split is not None
      continue
    if len(ids) > budget:         # longer than a block: its pieces fill blocks of their own
      stats["sentences_cut"] += 1
      blocks.dropped["sentence longer than a block"] += sentence.split is not None
      flush()
      for begin, end in windows(word_starts(tokenizer.tokens(ids)), budget):
        body.extend(ids[begin:end])
        flush()
      continue
    if len(body) + len(ids) > budget:
      flush()
    members.append((sentence, ids, offsets, char_spans, len(body)))
    body.extend(ids)
  flush()


def _write_shard(out_dir, settings, blocks, body_starts, uids, block_docs, block_facts, splits,
                 stats, dropped, num_documents, input_digest: str) -> dict:
  """The packed shard's arrays, then `done.json` (its stats) as the commit marker. A marker of
  an earlier build of the shard (other input) goes first: arrays half rewritten never sit
  beside a marker that a rerun of that earlier input would take for finished."""
  os.makedirs(out_dir, exist_ok=True)
  with contextlib.suppress(FileNotFoundError):
    os.remove(os.path.join(out_dir, "done.json"))
  tokens = np.zeros((len(blocks), settings.block_len), np.int32)
  for i, ids in enumerate(blocks):
    tokens[i, :len(ids)] = ids
  arrays = {"blocks.tokens": tokens,
            "blocks.lengths": np.asarray([len(b) for b in blocks], np.int32),
            "blocks.body_start": np.asarray(body_starts, np.int32),
            "blocks.uids": np.asarray(uids, np.uint64),
            "blocks.doc_ids": np.asarray(block_docs, np.int32),
            "blocks.facts": np.asarray(block_facts, np.int64).reshape(-1, 2)}
  for split, rows in splits.items():
    for key, value in rows.arrays(settings.max_sentence_len).items():
      arrays[f"{split}.{key}"] = value
  for key, value in arrays.items():
    np.save(os.path.join(out_dir, f"{key}.npy"), value)
  result = {"documents": num_documents, "input": input_digest,
            # e.g. only zero-width or control characters: no wordpiece, so no block
            "documents_without_blocks": num_documents - len(set(block_docs)),
            "blocks": len(blocks), "sentences": stats["sentences"],
            "sentences_cut": stats["sentences_cut"],
            "titles_truncated": stats["titles_truncated"],
            "salient_spans": sum(sum(rows.rows["num_spans"]) for rows in splits.values()),
            "examples": {s: len(rows) for s, rows in splits.items()},
            "examples_skipped": dict(dropped)}
  with open(os.path.join(out_dir, "done.json.tmp"), "w") as f:
    json.dump(result, f)
  os.replace(os.path.join(out_dir, "done.json.tmp"), os.path.join(out_dir, "done.json"))
  return result


def _add_examples(splits, sentence: SourceSentence, ids, offsets, char_spans, row, block_pos,
                  settings: PackSettings, dropped: Counter) -> None:
  """Adds the example(s) one sentence yields (eval: one per evaluated span)."""
  if sentence.split is None:
    return
  if len(ids) > settings.max_sentence_len:
    dropped["sentence longer than max_sentence_len"] += 1
    return
  spans = [wordpiece_span(offsets, s, e) for s, e in char_spans]
  keep = [i for i, (s, e) in enumerate(spans) if 0 < e - s <= settings.max_masks][:MAX_SPANS]
  if not keep:
    dropped["no salient span"] += 1
    return
  kept = [spans[i] for i in keep]
  common = dict(tokens=ids, spans=kept, num_spans=len(kept), lengths=len(ids), block=row,
                block_offsets=(block_pos, block_pos + len(ids)))
  if sentence.split == "train":
    _append(splits["train"], target_span=(0, 0), fact=-1, **common)
    return
  if not sentence.facts:          # real text: one span of the held-out sentence, by its hash
    _append(splits["eval"], target_span=kept[eval_target(sentence.text, len(kept))], fact=-1,
            **common)
    return
  kept_chars = [char_spans[i] for i in keep]
  for fact, (vs, ve) in zip(sentence.facts, sentence.value_spans):
    covering = span_covering(kept_chars, vs, ve)
    if covering is None:
      dropped["eval fact not covered by a salient span"] += 1
      continue
    _append(splits["eval"], target_span=kept[covering], fact=fact, **common)


def _append(split: _Split, **fields) -> None:
  for key, value in fields.items():
    split.rows[key].append(value)


def shard_done(shard_dir: str) -> dict | None:
  """The stats of a finished shard, or None (absent or interrupted before `done.json`)."""
  path = os.path.join(shard_dir, "done.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def merge_shards(shard_dirs: list[str], out_dir: str, block_len: int,
                 max_sentence_len: int) -> dict:
  """Concatenates finished shards into the final arrays (streamed: one shard in memory).

  Block rows of examples are shifted by the shard's offset; for the generated world the eval
  examples' `answer_blocks` (other blocks stating the evaluated fact) are computed here, over
  the whole corpus. Returns counts for the stats.
  """
  counts = [np.load(os.path.join(d, "blocks.lengths.npy"), mmap_mode="r").shape[0]
            for d in shard_dirs]
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
  total = int(offsets[-1])
  arrays = open_block_arrays(out_dir, total, block_len)
  for key in list(arrays):
    out = arrays.pop(key)
    for d, a, b in zip(shard_dirs, offsets[:-1], offsets[1:]):
      out[a:b] = np.load(os.path.join(d, f"blocks.{key}.npy"))
    out.flush()
    del out
  facts = np.concatenate([np.load(os.path.join(d, "blocks.facts.npy")) + [[0, a]]
                          for d, a in zip(shard_dirs, offsets[:-1])] + [np.zeros((0, 2),
                                                                                 np.int64)])
  uids = np.load(os.path.join(out_dir, "blocks", "uids.npy"), mmap_mode="r")
  sizes = {}
  for split in SPLITS:
    split_dir = os.path.join(out_dir, "examples", split)
    os.makedirs(split_dir, exist_ok=True)
    keys = _EXAMPLE_KEYS + (("target_span",) if split == "eval" else ()) + ("block_uid",)
    sizes[split] = _merge_examples(shard_dirs, offsets, split, split_dir, keys, uids)
    if split == "eval":
      fact = np.concatenate([np.load(os.path.join(d, "eval.fact.npy")) for d in shard_dirs])
      np.save(os.path.join(split_dir, "answer_blocks.npy"),
              _answer_blocks(fact, np.load(os.path.join(split_dir, "block.npy")), facts))
  return {"blocks": total, "examples": sizes}


def _merge_examples(shard_dirs: list[str], offsets: np.ndarray, split: str, split_dir: str,
                    keys: tuple[str, ...], uids: np.ndarray) -> int:
  """Writes `split_dir/<key>.npy` for the shards' examples of `split`, one shard's array in
  memory at a time: block rows shifted by the shard's first block, `block_uid` the uid of
  each example's block. Returns the number of examples."""
  counts = [np.load(os.path.join(d, f"{split}.lengths.npy"), mmap_mode="r").shape[0]
            for d in shard_dirs]
  starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
  for key in keys:
    out = None
    for d, first_block, a, b in zip(shard_dirs, offsets[:-1], starts[:-1], starts[1:]):
      value = np.load(os.path.join(d, f"{split}.{'block' if key == 'block_uid' else key}.npy"))
      if key in ("block", "block_uid"):
        value = value + first_block
      if key == "block_uid":
        value = uids[value]
      if out is None:
        out = np.lib.format.open_memmap(os.path.join(split_dir, f"{key}.npy"), mode="w+",
                                        dtype=value.dtype, shape=(int(starts[-1]),
                                                                  *value.shape[1:]))
      out[a:b] = value
    if out is not None:
      out.flush()
      del out
  return int(starts[-1])


def _answer_blocks(example_facts: np.ndarray, example_blocks: np.ndarray,
                   block_facts: np.ndarray) -> np.ndarray:
  """[E, A] other block rows stating each example's fact (-1 padded; fact -1: none)."""
  order = np.argsort(block_facts[:, 0], kind="stable")
  fact_sorted, rows_sorted = block_facts[order, 0], block_facts[order, 1]
  lo = np.searchsorted(fact_sorted, example_facts, "left")
  hi = np.searchsorted(fact_sorted, example_facts, "right")
  lists = []
  for fact, own, a, b in zip(example_facts, example_blocks, lo, hi):
    rows = [] if fact < 0 else [r for r in dict.fromkeys(rows_sorted[a:b].tolist()) if r != own]
    lists.append(rows)
  width = max([len(r) for r in lists] + [1])
  out = np.full((len(lists), width), -1, np.int32)
  for i, rows in enumerate(lists):
    out[i, :len(rows)] = rows
  return out


def remove_shards(shards_root: str) -> None:
  shutil.rmtree(shards_root, ignore_errors=True)

"""A prepared data dir's block store, read (`BlockStore`, `PreparedData`) and written
(`open_block_arrays`, `write_titles`, `write_stats`: the one writer `realm-prepare`, the world
and `realm-import-hf` share; see `realm_jax.data.corpus` for the layout). `stats.json`,
written last and atomically, marks a prepared dir complete."""

from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np

from realm_jax import paths
from realm_jax.data.tokenizer import Tokenizer, load_tokenizer


# blocks/<name>.npy: what each block row holds
BLOCK_ARRAYS = {"tokens": np.int32,      # [N, block_len] `[CLS] title [SEP] body [SEP]`, 0-padded
                "lengths": np.int32,     # [N] wordpieces of the row
                "body_start": np.int32,  # [N] where the body starts (after title's [SEP])
                "uids": np.uint64,       # [N] content uid (`corpus.block_uid`)
                "doc_ids": np.int32}     # [N] the document: its title in blocks/titles.json


def open_block_arrays(data_dir: str, num_blocks: int, block_len: int) -> dict[str, np.ndarray]:
  """Writable memory-mapped `blocks/<name>.npy` arrays of a new block store (flush and drop
  them when filled); a reader sees nothing complete until `write_stats`."""
  os.makedirs(os.path.join(data_dir, "blocks"), exist_ok=True)
  return {name: np.lib.format.open_memmap(
      os.path.join(data_dir, "blocks", f"{name}.npy"), "w+", dtype,
      (num_blocks, block_len) if name == "tokens" else (num_blocks,))
      for name, dtype in BLOCK_ARRAYS.items()}


def write_titles(data_dir: str, titles: list[str]) -> None:
  """blocks/titles.json: the title of each document (`doc_ids` index it)."""
  paths.write_text_atomic(os.path.join(data_dir, "blocks", "titles.json"), json.dumps(titles))


def write_stats(data_dir: str, stats: dict) -> None:
  """stats.json, last: what `realm-prepare` found, and the mark of a complete data dir."""
  paths.write_json(os.path.join(data_dir, "stats.json"), stats)


def _load(path: str) -> np.ndarray:
  return np.load(path, mmap_mode="r")


def segment_ids(body_start: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
  """1 on positions [body_start, length) of each row, else 0 (padding included): [..., width]."""
  pos = np.arange(width)
  return ((pos >= body_start[..., None]) & (pos < lengths[..., None])).astype(np.int32)


class BlockStore:
  """The evidence corpus: memory-mapped block token rows plus uids and titles."""

  def __init__(self, data_dir: str):
    d = os.path.join(data_dir, "blocks")
    self.tokens = _load(os.path.join(d, "tokens.npy"))
    self.lengths = np.asarray(_load(os.path.join(d, "lengths.npy")))
    self.body_start = np.asarray(_load(os.path.join(d, "body_start.npy")))
    self.uids = np.asarray(_load(os.path.join(d, "uids.npy")))
    self.doc_ids = _load(os.path.join(d, "doc_ids.npy"))
    with open(os.path.join(d, "titles.json")) as f:
      self.titles = json.load(f)

  @property
  def num_blocks(self) -> int:
    return self.tokens.shape[0]

  @property
  def block_len(self) -> int:
    return self.tokens.shape[1]

  @functools.cached_property
  def fingerprint(self) -> str:
    """sha256 over the block count, length and every block's content uid: an index built over
    another store (other text, other packing) never matches the trainer's."""
    digest = hashlib.sha256(f"{self.num_blocks}x{self.block_len}:".encode())
    digest.update(np.ascontiguousarray(self.uids).tobytes())
    return digest.hexdigest()[:32]

  def segments(self, rows: np.ndarray) -> np.ndarray:
    """Segment ids of block rows: 0 for `[CLS] title [SEP]`, 1 for `body [SEP]`."""
    return segment_ids(self.body_start[rows], self.lengths[rows], self.block_len)

  def title(self, row: int) -> str:
    return self.titles[int(self.doc_ids[row])]


class ExampleSet:
  """One split of pretraining examples (sentences with salient spans and their source block)."""

  def __init__(self, data_dir: str, split: str):
    d = os.path.join(data_dir, "examples", split)
    if not os.path.exists(os.path.join(d, "tokens.npy")):
      raise FileNotFoundError(f"no examples for split {split!r} under {d}")
    self.tokens = _load(os.path.join(d, "tokens.npy"))
    self.lengths = np.asarray(_load(os.path.join(d, "lengths.npy")))
    self.spans = np.asarray(_load(os.path.join(d, "spans.npy")))
    self.num_spans = np.asarray(_load(os.path.join(d, "num_spans.npy")))
    self.block = np.asarray(_load(os.path.join(d, "block.npy")))
    self.block_offsets = np.asarray(_load(os.path.join(d, "block_offsets.npy")))
    target = os.path.join(d, "target_span.npy")
    self.target_span = np.asarray(_load(target)) if os.path.exists(target) else None
    answers = os.path.join(d, "answer_blocks.npy")
    self.answer_blocks = np.asarray(_load(answers)) if os.path.exists(answers) else None

  def __len__(self) -> int:
    return self.tokens.shape[0]

  @functools.cached_property
  def fingerprint(self) -> str:
    """sha256 over the example count and width and every example's length, span count,
    source block and place in it, in order: other examples, or the same in another order,
    differ; no token row is read (~20 bytes an example)."""
    digest = hashlib.sha256(f"{len(self)}x{self.max_sentence_len}:".encode())
    for column in (self.lengths, self.num_spans, self.block, self.block_offsets):
      digest.update(np.ascontiguousarray(column).tobytes())
    return digest.hexdigest()[:32]

  def widest_span(self, rows: int | None = None, targets: bool = False,
                  chunk: int = 1 << 20) -> int:
    """Wordpieces of the widest salient span of the first `rows` examples (all: None), of
    their target spans alone with `targets` (what an evaluation masks), 0 for none: fewer
    mask slots (`data.max_masks`) would mask it in part. Read `chunk` examples at a time."""
    rows = len(self) if rows is None else min(rows, len(self))
    widest = 0
    for start in range(0, rows, chunk):
      stop = min(start + chunk, rows)
      spans, count = self.spans[start:stop], self.num_spans[start:stop]
      if targets:   # each example's target span (start, end), alone
        spans, count = self.target_span[start:stop][:, None], np.ones_like(count)
      slots = np.arange(spans.shape[1])[None, :] < count[:, None]
      widths = spans[..., 1] - spans[..., 0]
      widest = max(widest, int(widths[slots].max(initial=0)))
    return widest

  @property
  def max_sentence_len(self) -> int:
    return self.tokens.shape[1]


class PreparedData:
  """Vocab + blocks + example splits of one data dir, with its stats."""

  def __init__(self, data_dir: str):
    if not os.path.isdir(data_dir):
      raise FileNotFoundError(f"data dir {data_dir!r} " + (
          "is a file, not a prepared data dir" if os.path.exists(data_dir) else
          "does not exist"))
    for needed in ("vocab.txt", "stats.json", "blocks/tokens.npy"):
      if not os.path.exists(os.path.join(data_dir, needed)):
        raise FileNotFoundError(f"data dir {data_dir!r} lacks {needed} (not a prepared dir)")
    self.dir = data_dir
    self.tokenizer: Tokenizer = load_tokenizer(os.path.join(data_dir, "vocab.txt"))
    self.blocks = BlockStore(data_dir)
    with open(os.path.join(data_dir, "stats.json")) as f:
      self.stats = json.load(f)
    self._splits: dict[str, ExampleSet] = {}

  def examples(self, split: str) -> ExampleSet:
    if split not in self._splits:
      self._splits[split] = ExampleSet(self.dir, split)
    return self._splits[split]

"""Deterministic, resumable, per-host input pipeline: sampling, salient-span masking, ICT pairs,
candidate and reader inputs. Everything here is vectorised numpy over a batch (no per-example
Python); batches for upcoming steps are built ahead in a background thread.

Determinism: the batch of step t is a pure function of (seed, t): a global stream of epoch
permutations is cut into global batches, every random choice of the batch is drawn for the
global batch from `default_rng((seed, t))`, and each process keeps its own rows. The iterator
state is therefore just the next step, saved with the checkpoint.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

import numpy as np

from realm_jax.data.store import BlockStore, ExampleSet, segment_ids

NULL_BLOCK = -1  # candidate row of the null document `[CLS][SEP][SEP]`


class BatchSampler:
  """Example indices of global batch `step`, restricted to this process's rows."""

  def __init__(self, num_examples: int, global_batch: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if num_examples < global_batch:
      raise ValueError(f"{num_examples} examples < batch size {global_batch}")
    if global_batch % process_count:
      raise ValueError(f"batch size {global_batch} not divisible by {process_count} processes")
    self.n, self.batch, self.seed = num_examples, global_batch, seed
    self.local = slice(process_index * global_batch // process_count,
                       (process_index + 1) * global_batch // process_count)
    self._perms: dict[int, np.ndarray] = {}

  def _perm(self, epoch: int) -> np.ndarray:
    if epoch not in self._perms:
      self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
      self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.n)
    return self._perms[epoch]

  def global_indices(self, step: int) -> np.ndarray:
    """Example indices of the whole global batch of `step`."""
    positions = np.arange(step * self.batch, (step + 1) * self.batch)
    epochs, offsets = positions // self.n, positions % self.n
    return np.concatenate([self._perm(int(e))[offsets[epochs == e]] for e in np.unique(epochs)])

  def step_rng(self, step: int) -> np.random.Generator:
    return np.random.default_rng((self.seed, 1_000_003, step))


def splice(a: np.ndarray, a_len: np.ndarray, b: np.ndarray, b_start: np.ndarray,
           b_end: np.ndarray, out_len: int) -> np.ndarray:
  """Row-wise concatenation a[:a_len] ++ b[b_start:b_end], 0-padded to `out_len`.

  Builds reader inputs (`[CLS] x [SEP]` ++ `body [SEP]`) and ICT contexts (a block with one
  sentence cut out: a = b = block, a_len = sentence start, b_start = sentence end).
  All arguments broadcast over leading dims; a/b are [..., La] / [..., Lb].
  """
  pos = np.arange(out_len)
  a_len, b_start, b_end = (np.asarray(x)[..., None] for x in (a_len, b_start, b_end))
  from_a = pos < a_len
  b_pos = b_start + pos - a_len
  from_b = ~from_a & (b_pos < b_end)
  a_pos = np.broadcast_to(np.minimum(pos, a.shape[-1] - 1), from_a.shape)
  a_vals = np.take_along_axis(a, a_pos, axis=-1)
  b_vals = np.take_along_axis(b, np.clip(b_pos, 0, b.shape[-1] - 1), axis=-1)
  return np.where(from_a, a_vals, np.where(from_b, b_vals, 0)).astype(np.int32)


def query_ids(examples: ExampleSet, rows: np.ndarray, query_len: int, cls_id: int,
              sep_id: int) -> tuple[np.ndarray, np.ndarray]:
  """`[CLS] sentence [SEP]` for example rows -> (ids [n, query_len], lengths [n])."""
  lengths = examples.lengths[rows]
  tokens = np.asarray(examples.tokens[rows])
  ids = np.zeros((len(rows), query_len), np.int32)
  ids[:, 0] = cls_id
  width = min(tokens.shape[1], query_len - 2)
  ids[:, 1:1 + width] = tokens[:, :width]
  ids[np.arange(len(rows)), lengths + 1] = sep_id
  return ids, lengths + 2


def mask_salient_spans(ids: np.ndarray, spans: np.ndarray, max_masks: int,
                       mask_id: int) -> dict[str, np.ndarray]:
  """Replaces one salient span per query by [MASK]s (REALM: whole span, no 80/10/10).

  Args:
    ids: [n, L] `[CLS] sentence [SEP]` (modified copy is returned).
    spans: [n, 2] the chosen span per row, as wordpiece offsets in the sentence.
  Returns: query_ids, mask_positions [n, M], mask_labels [n, M], mask_weights [n, M].
  """
  ids = ids.copy()
  width = spans[:, 1] - spans[:, 0]
  positions = 1 + spans[:, :1] + np.arange(max_masks)[None, :]    # +1 for [CLS]
  valid = np.arange(max_masks)[None, :] < np.minimum(width, max_masks)[:, None]
  positions = np.where(valid, positions, 0)
  rows = np.arange(len(ids))[:, None]
  labels = np.where(valid, ids[rows, positions], 0)
  ids[rows, positions] = np.where(valid, mask_id, ids[rows, positions])
  return {"query_ids": ids, "mask_positions": positions.astype(np.int32),
          "mask_labels": labels.astype(np.int32), "mask_weights": valid.astype(np.float32)}


def choose_spans(examples: ExampleSet, rows: np.ndarray, rng_values: np.ndarray) -> np.ndarray:
  """One salient span per row, uniformly among the row's spans. rng_values: [n] in [0, 1)."""
  choice = np.floor(rng_values * examples.num_spans[rows]).astype(np.int64)
  return examples.spans[rows, choice]


def candidate_rows(retrieved: np.ndarray, query_block: np.ndarray, uids: np.ndarray,
                   k: int) -> np.ndarray:
  """Top-(k+1) retrieved rows -> k candidates: drop the query's own block (by uid, so exact
  duplicates go too), prepend the null document, truncate (REALM's trivial-retrieval rule)."""
  trivial = uids[retrieved] == uids[query_block][:, None]
  order = np.argsort(trivial, axis=1, kind="stable")
  kept = np.take_along_axis(retrieved, order, axis=1)[:, :k - 1]
  # More trivial duplicates than the one spare slot: the leftovers become null documents.
  kept = np.where(np.take_along_axis(trivial, order, axis=1)[:, :k - 1], NULL_BLOCK, kept)
  return np.concatenate([np.full((len(retrieved), 1), NULL_BLOCK), kept], axis=1)


def candidate_inputs(blocks: BlockStore, rows: np.ndarray, cls_id: int,
                     sep_id: int) -> dict[str, np.ndarray]:
  """Token rows of candidate blocks (NULL_BLOCK -> `[CLS][SEP][SEP]`), segments and bounds."""
  null = rows == NULL_BLOCK
  safe = np.where(null, 0, rows)
  flat = np.unique(safe)
  tokens = np.asarray(blocks.tokens[flat])[np.searchsorted(flat, safe)]
  tokens = np.where(null[..., None], 0, tokens)
  tokens[null, 0], tokens[null, 1], tokens[null, 2] = cls_id, sep_id, sep_id
  body_start = np.where(null, 2, blocks.body_start[safe])
  lengths = np.where(null, 3, blocks.lengths[safe])
  segments = segment_ids(body_start, lengths, tokens.shape[-1])
  return {"candidate_ids": tokens.astype(np.int32), "candidate_segments": segments,
          "body_start": body_start, "lengths": lengths}


def reader_inputs(query: np.ndarray, query_len: np.ndarray, candidates: dict[str, np.ndarray],
                  reader_len: int) -> tuple[np.ndarray, np.ndarray]:
  """`[CLS] x [SEP] body [SEP]` for every (query, candidate): ids and segments [n, k, L]."""
  k = candidates["candidate_ids"].shape[1]
  q = np.repeat(query[:, None, :], k, axis=1)
  q_len = np.repeat(query_len[:, None], k, axis=1)
  ids = splice(q, q_len, candidates["candidate_ids"], candidates["body_start"],
               candidates["lengths"], reader_len)
  segments = ((np.arange(reader_len) >= q_len[..., None]) & (ids > 0)).astype(np.int32)
  return ids, segments


def ict_inputs(examples: ExampleSet, blocks: BlockStore, rows: np.ndarray, query_len: int,
               remove: np.ndarray, cls_id: int, sep_id: int) -> dict[str, np.ndarray]:
  """ICT pairs: query = a sentence, block = its source block with the sentence removed where
  `remove` (ORQA removes it 90% of the time so the retriever also learns word overlap)."""
  queries, _ = query_ids(examples, rows, query_len, cls_id, sep_id)
  block_rows = examples.block[rows]
  block = np.asarray(blocks.tokens[block_rows])
  start, end = examples.block_offsets[rows, 0], examples.block_offsets[rows, 1]
  cut_end = np.where(remove, end, start)
  length = blocks.lengths[block_rows]
  context = splice(block, start, block, cut_end, length, blocks.block_len)
  new_len = length - (cut_end - start)
  segments = segment_ids(blocks.body_start[block_rows], new_len, blocks.block_len)
  return {"query_ids": queries, "block_ids": context, "block_segments": segments}


class Prefetcher:
  """Runs `make_batch(step)` for upcoming steps in a background thread (bounded queue).

  Errors in the thread are re-raised in the consumer, never lost.
  """

  def __init__(self, make_batch: Callable[[int], dict], start_step: int, depth: int = 2):
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, args=(make_batch, start_step), daemon=True)
    self._thread.start()

  def _run(self, make_batch, step):
    while not self._stop.is_set():
      try:
        item = (step, make_batch(step), None)
      except Exception as e:  # handed to the consumer, which re-raises it
        item = (step, None, e)
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if item[2] is not None:
        return
      step += 1

  def __iter__(self) -> Iterator[tuple[int, dict]]:
    while True:
      step, batch, error = self._queue.get()
      if error is not None:
        raise error
      yield step, batch

  def close(self):
    self._stop.set()
    self._thread.join(timeout=5)

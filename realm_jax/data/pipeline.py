"""Deterministic, checkpointable, per-host input pipeline (grain) and the vectorised numpy that
turns example rows into model inputs: salient-span masking, ICT pairs, candidate and reader
inputs.

Determinism: the job reads one stream of example rows, shuffled with a seed derived from
`seed` and reshuffled every epoch. Per-example random choices come from grain's `random_map`,
whose generator is keyed by the example's position in that stream, and global batch t is stream
positions [t * B, (t + 1) * B), data shard i of D its positions [t * B + i * B / D,
t * B + (i + 1) * B / D). A process builds only the rows of the data shards its devices hold,
in shard order (process p of P, its devices in process order: positions
[t * B + p * B / P, t * B + (p + 1) * B / P)) (batches do not stop at an epoch's end: where B
does not divide the example count, the batch across it may hold one example twice, from both
shuffles). The global batches are therefore a pure function of the seed, whatever the
number of processes: a run on 2 hosts sees the batches of a run on one, and a checkpoint
resumes on another process count with the same batches. The iterator state (grain's: the next batch index
= the next step) is saved with the checkpoint. Index bookkeeping is per example (grain);
everything that touches tokens is vectorised numpy over a batch. Batches are built ahead in
grain's prefetch threads.
"""

from __future__ import annotations

import os

import grain
import numpy as np

from realm_jax.data.prepared import BlockStore, ExampleSet, segment_ids

NULL_BLOCK = -1  # candidate row of the null document `[CLS][SEP][SEP]`
NULL_DOCUMENT_LENGTH = 3   # `[CLS][SEP][SEP]`: its wordpieces


def stream_seed(seed: int) -> int:
  """The grain pipeline seed of the example stream of config seed `seed`."""
  return int(np.random.SeedSequence([seed, 0, 1]).generate_state(1)[0])


def example_stream(num_examples: int, seed: int) -> grain.MapDataset:
  """The job's endless stream of example rows, reshuffled every epoch.

  grain's shuffle folds the epoch into its seed and `repeat` only extends the index range, so
  element i is a pure function of (seed, i). The returned dataset carries the stream seed:
  random transformations applied to it derive theirs from it.
  """
  # `[0::1]` selects every row; it stays because it is part of how grain derives the shuffle
  # from the seed: without it the order (and every result measured with it) would change.
  return grain.MapDataset.range(num_examples).seed(stream_seed(seed))[0::1].shuffle().repeat()


def process_batches(elements: grain.MapDataset, global_batch: int, shards, count: int,
                    batch_fn) -> grain.MapDataset:
  """This process's share of every global batch of `elements`: of its `count` data shards of
  b = B / `count` positions each, those in `shards` (sorted), one after the other: batch t
  holds positions t * B + i * b + j for i in `shards`, j < b, made into a batch by `batch_fn`
  (the rows `jax.make_array_from_process_local_data` hands these shards' devices)."""
  shards = tuple(int(i) for i in shards)
  if not shards or list(shards) != sorted(set(shards)) or shards[0] < 0 or shards[-1] >= count:
    raise ValueError(f"data shards {list(shards)}: expected distinct sorted shards in "
                     f"[0, {count})")
  if global_batch % count:
    raise ValueError(f"a global batch of {global_batch} cannot be split into {count} data "
                     "shards")
  size = global_batch // count
  offsets = [i * size + j for i in shards for j in range(size)]
  # batch t gathers its positions itself: one `batch` of an endless stream would count its
  # batches as a float (2**63 for a batch of one, more than len() can hold), and a process's
  # shards need not be neighbours (devices interleaved by process)
  steps = grain.MapDataset.range(len(elements) // global_batch)
  return steps.map(lambda t: batch_fn([elements[t * global_batch + o] for o in offsets]))


def prefetched(batches: grain.MapDataset, depth: int) -> grain.DatasetIterator:
  """An iterator over `batches` from index 0 that builds `depth` of them ahead in threads
  (0: built on demand). An error while building a batch is raised by `next`."""
  threads = min(depth, os.cpu_count() or 1)
  options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=depth)
  return iter(batches.to_iter_dataset(options))


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
              sep_id: int, start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """`[CLS] sentence [SEP]` for example rows -> (ids [n, query_len], lengths [n]). A sentence
  longer than query_len - 2 wordpieces is cut to its first query_len - 2 (ORQA's ICT query),
  or, given `start` [n], to the query_len - 2 from its wordpiece start[i] on (a window:
  `span_windows`)."""
  n, room = len(rows), query_len - 2
  tokens = np.asarray(examples.tokens[rows])
  start = np.zeros(n, np.int64) if start is None else np.asarray(start, np.int64)
  whole = examples.lengths[rows]
  lengths = np.minimum(whole - start, room).astype(whole.dtype)
  width = min(tokens.shape[1], room)
  columns = np.minimum(start[:, None] + np.arange(width), tokens.shape[1] - 1)
  taken = np.take_along_axis(tokens, columns, axis=1)
  ids = np.zeros((n, query_len), np.int32)
  ids[:, 0] = cls_id
  ids[:, 1:1 + width] = np.where(np.arange(width) < lengths[:, None], taken, 0)
  ids[np.arange(n), lengths + 1] = sep_id
  return ids, lengths + 2


def span_windows(spans: np.ndarray, query_len: int) -> np.ndarray:
  """[n]: the first wordpiece of the window of query_len - 2 that `query_ids` takes of each
  sentence so that its span [s, e) of `spans` [n, 2] is in the query: 0 (the sentence's start,
  ORQA's cut) unless the span ends past it, else the least shift that holds it (e - (query_len
  - 2): the span ends the query)."""
  return np.maximum(np.asarray(spans)[:, 1] - (query_len - 2), 0).astype(np.int64)


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


PACKED_QUERIES = ("packed_ids", "packed_positions", "packed_owner", "query_packed_row")


def pack_queries(query_ids: np.ndarray, rows: int, shards: int = 1,
                 numbered=None) -> dict[str, np.ndarray] | None:
  """The queries [B, L] (each `[CLS] x [SEP]`, padding after it) packed into `rows` rows of L
  wordpieces, so that the query tower computes on few padding wordpieces: first-fit by
  decreasing length within each of `shards` equal slices of the batch and of the rows (a
  device's queries in its own rows). None when a slice's queries do not fit its rows.

  Returns packed_ids [rows, L]; packed_positions [rows, L], each wordpiece's position in its
  own query; packed_owner [rows, L], the query (batch index) a wordpiece belongs to, -1 on
  padding; query_packed_row [B], the row holding each query. Slice s's queries and rows are
  numbered as those of data shard `numbered[s]` of the global batch (default s: the batch is
  whole): a process's share of a global batch numbers its own in the global batch's rows.
  """
  b, length = query_ids.shape
  placed = _first_fit((query_ids > 0).sum(1), rows, shards, length)
  if placed is None:
    return None
  numbered = np.arange(shards) if numbered is None else np.asarray(numbered)
  per_slice, rows_per_slice = b // shards, rows // shards
  first_query = (numbered - np.arange(shards)) * per_slice     # each slice's offset
  first_row = (numbered - np.arange(shards)) * rows_per_slice
  ids = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  owner = np.full((rows, length), -1, np.int32)
  for q, (row, start, n) in enumerate(placed):
    ids[row, start:start + n] = query_ids[q, :n]
    positions[row, start:start + n] = np.arange(n)
    owner[row, start:start + n] = first_query[q // per_slice] + q
  row_of = (placed[:, 0] + first_row[np.arange(b) // per_slice]).astype(np.int32)
  return dict(zip(PACKED_QUERIES, (ids, positions, owner, row_of)))


def queries_fit(lengths: np.ndarray, rows: int, shards: int, length: int) -> bool:
  """Whether queries of `lengths` wordpieces pack into `rows` rows of `length` (as
  `pack_queries` packs them)."""
  return _first_fit(np.asarray(lengths), rows, shards, length) is not None


def _first_fit(lengths: np.ndarray, rows: int, shards: int, length: int) -> np.ndarray | None:
  """[B, 3]: each query's (row, first position, wordpieces) by first-fit in decreasing length
  within each of `shards` equal slices of the queries and of the rows; None if one does not
  fit."""
  b = len(lengths)
  if b % shards or rows % shards:
    raise ValueError(f"{b} queries into {rows} rows: both must divide by the {shards} shards")
  placed = np.zeros((b, 3), np.int64)
  per_slice, rows_per_slice = b // shards, rows // shards
  for s in range(shards):
    used = np.zeros(rows_per_slice, np.int64)        # wordpieces taken in each of its rows
    for q in sorted(range(s * per_slice, (s + 1) * per_slice), key=lambda q: -lengths[q]):
      n = int(lengths[q])
      free = np.flatnonzero(used + n <= length)
      if not len(free):
        return None
      placed[q] = (s * rows_per_slice + free[0], used[free[0]], n)
      used[free[0]] += n
  return placed


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


def cut_own_sentence(cands: dict[str, np.ndarray], own: np.ndarray,
                     cut: np.ndarray) -> dict[str, np.ndarray]:
  """`candidate_inputs` with the query's sentence ([s, e) of `cut` [n, 2]) cut out of the
  candidates where `own` [n, k] (the query's own block): ORQA's ICT context, as a REALM
  candidate the reader cannot copy the sentence from."""
  lengths = cands["lengths"]
  ids, new_lengths, segments = cut_out(cands["candidate_ids"], cands["body_start"], lengths,
                                       np.where(own, cut[:, None, 0], lengths),
                                       np.where(own, cut[:, None, 1], lengths))
  return {**cands, "candidate_ids": ids, "lengths": new_lengths, "candidate_segments": segments}


def candidate_inputs(blocks: BlockStore, rows: np.ndarray, cls_id: int,
                     sep_id: int) -> dict[str, np.ndarray]:
  """Token rows of candidate blocks (NULL_BLOCK -> `[CLS][SEP][SEP]`), segments and bounds."""
  null = rows == NULL_BLOCK
  safe = np.where(null, 0, rows)
  flat = np.unique(safe)
  tokens = np.asarray(blocks.tokens[flat])[np.searchsorted(flat, safe)]
  tokens = np.where(null[..., None], 0, tokens)
  tokens[null, 0], tokens[null, 1], tokens[null, 2] = cls_id, sep_id, sep_id
  body_start = np.where(null, NULL_DOCUMENT_LENGTH - 1, blocks.body_start[safe])
  lengths = np.where(null, NULL_DOCUMENT_LENGTH, blocks.lengths[safe])
  segments = segment_ids(body_start, lengths, tokens.shape[-1])
  return {"candidate_ids": tokens.astype(np.int32), "candidate_segments": segments,
          "body_start": body_start, "lengths": lengths}


def reader_length(query_len: int, block_len: int) -> int:
  """Wordpieces of the reader's `[CLS] x [SEP] body [SEP]` for queries `[CLS] x [SEP]` of
  `query_len` and candidates `[CLS] title [SEP] body [SEP]` of `block_len` (the reader reads
  the body and its `[SEP]`: block_len - 2). The null document's is query_len + 1."""
  return query_len + block_len - 2


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
  context, _, segments = cut_out(block, blocks.body_start[block_rows],
                                 blocks.lengths[block_rows], start, np.where(remove, end, start))
  return {"query_ids": queries, "block_ids": context, "block_segments": segments}


def cut_out(tokens: np.ndarray, body_start: np.ndarray, lengths: np.ndarray, start: np.ndarray,
            end: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Block rows `tokens` [..., L] with positions [start, end) cut out (a sentence: ICT's
  context; start == end cuts nothing) -> (ids, lengths, segments), 0-padded to L."""
  width = tokens.shape[-1]
  ids = splice(tokens, start, tokens, end, lengths, width)
  new_lengths = lengths - (end - start)
  return ids, new_lengths, segment_ids(body_start, new_lengths, width)

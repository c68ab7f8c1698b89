"""The frozen reader's scores, read once (`retrieval.score_cache`).

With the reader frozen (`train.reader_lr_scale` 0, no dropout), log p(y_j | z, x) of a masked
query x and a candidate block z never changes: a REALM step needs the reader only for the
(query, span, block) triples it has not read before. `ScoreCache.fill` runs in the batch
feed's thread after the candidates are retrieved: it looks every triple of the batch up,
reads the new ones with the reader on this process's devices, stores them, and hands the step
`candidate_log_probs` [B, k, M] in place of the reader inputs. The step then computes only the
retriever (train/steps.py `realm_loss_fn`). The reads go in chunks of one shape per group
(the null document at its own length, the blocks), so a triple's scores do not depend on
which other triples were read with it; a chunk is a quarter of the group's triples in a batch
(`read_chunk`), so a batch pays for the triples it misses, not for all.

The cache lives in memory and is not checkpointed: a resumed run reads the triples again
and gets the same scores (tests/test_retriever_learning.py), so resuming stays exact. A
triple is one Python int (its key) in a dict to its row of a float32 store, ~130 bytes with
the dict's share plus 4 a mask slot (`PAIR_BYTES`): a pod's run of 10^8 triples would hold
~17 GB a process. `retrieval.score_cache_gb` bounds it: once full, a triple not in it is read
every time it comes (said once); the scores, and so the run, stay the same.
"""

from __future__ import annotations

import logging
import threading

import jax
import numpy as np

from realm_jax.data import pipeline
from realm_jax.models.realm import REALM
from realm_jax.runtime import partitioning
from realm_jax.train import candidate_rows

logger = logging.getLogger(__name__)

READ_CHUNKS = 4   # a batch's misses of a group are read in at most this many chunks
PAIR_BYTES = 130  # a triple's key, its dict entry's share and its row number (measured: ~120)
STORE_ROWS = 1 << 16   # the float32 store grows by this many triples at a time


def pair_key(row: int, span: int, block: int) -> int:
  """(query row, span, block row) as one int: a block row below 2^32 (the null document -1),
  a span index below 2^16 (a sentence's salient spans), a query row of any size."""
  return (int(row) << 48) | (int(span) << 32) | (int(block) + 1)


class ScoreCache:
  """(query row, span, block row) -> the reader's log p(y_j | z, x) at the query's masks [M]."""

  def __init__(self, config, model: REALM, reader_params, local_batch: int):
    self.config, self.model = config, model
    self.mesh = partitioning.make_mesh((-1, 1), jax.local_devices())
    self.params = jax.device_put({"params": {"reader": partitioning.host_copy(reader_params)}},
                                 partitioning.replicated(self.mesh))
    self.null_len = pipeline.reader_length(config.data.query_len,
                                           pipeline.NULL_DOCUMENT_LENGTH)
    self.null_short = candidate_rows.of(config).null_first(training=True)   # the step reads it at its length
    # rows per chunk of each group, by whether it is the null document's: a training batch
    # holds one null document (when it reads it) and k - 1 blocks per query
    devices = len(jax.local_devices())
    self.chunks = {True: read_chunk(local_batch, devices),
                   False: read_chunk(local_batch * (config.retrieval.k - 1), devices)}
    self._rows: dict[int, int] = {}        # pair_key -> its row of the store
    self._store: list[np.ndarray] = []      # [STORE_ROWS, M] float32 each, filled in order
    self.capacity = capacity(config)        # triples kept at most (None: no bound)
    self._said_full = False
    self._lock = threading.Lock()
    self.rules = partitioning.logical_rules(config.mesh.rules)
    self._read = jax.jit(self._read_fn)

  def __len__(self) -> int:
    return len(self._rows)

  def megabytes(self) -> float:
    """What the triples kept take, by `PAIR_BYTES` and the store's rows."""
    slots = self._store[0].shape[1] if self._store else 0
    return (len(self._rows) * PAIR_BYTES + sum(map(len, self._store)) * 4 * slots) / 1e6

  def full(self) -> bool:
    return self.capacity is not None and len(self._rows) >= self.capacity

  def _get(self, key: int) -> np.ndarray | None:
    row = self._rows.get(key)
    return None if row is None else self._store[row // STORE_ROWS][row % STORE_ROWS]

  def _put(self, key: int, value: np.ndarray) -> None:
    """Keeps `value` under `key` unless the cache is full (callers hold the lock)."""
    if key in self._rows or self.full():
      return
    row = len(self._rows)
    if row // STORE_ROWS == len(self._store):   # the last block no larger than the bound
      rows = STORE_ROWS if self.capacity is None else min(STORE_ROWS, self.capacity - row)
      self._store.append(np.empty((rows, len(value)), np.float32))
    self._store[row // STORE_ROWS][row % STORE_ROWS] = value
    self._rows[key] = row

  def _read_fn(self, params, ids, segments, positions, labels):
    return self.model.apply(params, ids, segments, positions, labels, True,
                            method=REALM.read_labels)

  def fill(self, batch: dict[str, np.ndarray], keys: np.ndarray
           ) -> tuple[dict, int, int, int]:
    """`batch` (a host REALM batch) with `candidate_log_probs` [B, k, M] from the cache, its
    reader inputs dropped; `keys` [B, k, 3]: (query row, span, block row) per candidate.
    Returns (batch, hits, reads, the rows the reader ran on: whole chunks)."""
    b, k = keys.shape[:2]
    out = np.zeros((b, k, batch["mask_labels"].shape[1]), np.float32)
    missing, packed = [], [[pair_key(*key) for key in row] for row in keys.tolist()]
    with self._lock:
      for i in range(b):
        for j in range(k):
          found = self._get(packed[i][j])
          if found is None:
            missing.append((i, j))
          else:
            out[i, j] = found
    rows = self._read_missing(batch, keys, packed, missing, out) if missing else 0
    batch = {name: value for name, value in batch.items()
             if name not in ("reader_ids", "reader_segments")}
    batch["candidate_log_probs"] = out
    return batch, b * k - len(missing), len(missing), rows

  def _read_missing(self, batch, keys, packed, missing, out) -> int:
    """Reads the `missing` (row, column) pairs, the null document at its own length; returns
    the rows the reader ran on (whole chunks)."""
    is_null = lambda ij: self.null_short and keys[ij][2] == pipeline.NULL_BLOCK
    rows = 0
    for null, length in ((True, self.null_len), (False, None)):
      group, chunk = [p for p in missing if is_null(p) == null], self.chunks[null]
      for start in range(0, len(group), chunk):
        part = group[start:start + chunk]
        scores = self._read_pairs(batch, part, length, chunk)
        rows += chunk
        with self._lock:
          for (i, j), value in zip(part, scores):
            out[i, j] = value
            self._put(packed[i][j], value)
    if self.full() and not self._said_full:
      self._said_full = True
      logger.warning(f"[{self.config.task}] score cache full: {len(self):,} pairs "
                     f"({self.megabytes():,.0f} MB, retrieval.score_cache_gb "
                     f"{self.config.retrieval.score_cache_gb:g}); a pair not in it is read "
                     "each time it comes from now on (the same scores)")
    return rows

  def _read_pairs(self, batch, pairs, length, chunk) -> np.ndarray:
    rows, cols = np.asarray(pairs).T
    ids = batch["reader_ids"][rows, cols, :length]
    segments = batch["reader_segments"][rows, cols, :length]
    inputs = [ids, segments, batch["mask_positions"][rows], batch["mask_labels"][rows]]
    padded = [np.zeros((chunk,) + x.shape[1:], x.dtype) for x in inputs]
    for full, x in zip(padded, inputs):
      full[:len(x)] = x
    sharding = partitioning.batch_sharding(self.mesh)
    with partitioning.mesh_rules(self.mesh, self.rules):
      scores = self._read(self.params, *[jax.device_put(x, sharding) for x in padded])
    return np.asarray(jax.device_get(scores), np.float32)[:len(pairs)]


def capacity(config) -> int | None:
  """The triples `retrieval.score_cache_gb` holds (None: 0, no bound), at `PAIR_BYTES` and 4
  bytes a mask slot each."""
  gb = config.retrieval.get("score_cache_gb", 0.0)
  return int(gb * 1e9 // (PAIR_BYTES + 4 * config.data.max_masks)) if gb else None


def read_chunk(triples: int, devices: int) -> int:
  """The rows of every chunk of a group that has `triples` in a batch: a READ_CHUNKS-th of
  them, in whole devices. A batch missing m_g triples of group g runs the reader on the sum
  over the groups of ceil(m_g / chunk_g) * chunk_g rows."""
  return -(-triples // (READ_CHUNKS * devices)) * devices


def cache_keys(queries: dict[str, np.ndarray], candidate_rows: np.ndarray) -> np.ndarray:
  """[B, k, 3] (query row, span, block row) of a batch's candidates."""
  b, k = candidate_rows.shape
  rows = np.broadcast_to(queries["query_row"][:, None], (b, k))
  spans = np.broadcast_to(queries["span_index"][:, None], (b, k))
  return np.stack([rows, spans, candidate_rows], axis=-1).astype(np.int64)

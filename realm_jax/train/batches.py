"""Host-side batch assembly for each task: queries (a grain pipeline, checkpointed with the
train state), then the reader inputs of the candidates (their rows: train/candidate_rows.py). The trainer calls these in its batch-feed thread, steps ahead of the train step
(train/feed.py); which index serves which step is decided by the candidate source
(train/candidates.py)."""

from __future__ import annotations

import grain
import numpy as np

from realm_jax.data import pipeline
from realm_jax.data.prepared import ExampleSet, PreparedData
from realm_jax.errors import ConfigError
from realm_jax.train import candidate_rows


class BatchStream:
  """A process's endless stream of batches over a grain MapDataset (`self.dataset`): batch t is
  `dataset[t]` (also `self(t)`); `iterator` walks them in order with prefetching; `state` is
  what a checkpoint keeps to resume it exactly."""

  dataset: grain.MapDataset
  count: int   # the data shards of every global batch (the data axis)

  def __call__(self, step: int) -> dict[str, np.ndarray]:
    return self.dataset[step]

  def iterator(self, prefetch: int, saved: dict | None = None) -> grain.DatasetIterator:
    """The batches from step 0, or from where the checkpoint data item `saved` left off, with
    `prefetch` of them built ahead (starting now)."""
    it = pipeline.prefetched(self.dataset, prefetch)
    if saved is not None:
      if "iterator" not in saved:
        raise ValueError(f"the checkpoint's data item {saved} holds no input-pipeline state "
                         "(written by an older version?); start from a fresh workdir")
      it.set_state(saved["iterator"])
    it.start_prefetch()
    return it

  def state(self, iterator_state: dict, next_step: int) -> dict:
    """The checkpoint's data item once the batches of steps < `next_step` were consumed
    (`iterator_state`: the grain iterator's `get_state()` right after that).

    Every process consumes one batch per step, so all processes hold the same iterator state
    and the primary's copy (the one Orbax writes) resumes each of them, on any process count
    (the global batches do not depend on it).
    """
    # "process_count": the data shards the batches were split into (nothing reads it back)
    return {"next_step": next_step, "process_count": self.count, "iterator": iterator_state}


def local_batch_size(config, shards=(0,), count: int = 1) -> int:
  """The rows of this process's batch: those of its data `shards` of the `count`."""
  if config.train.batch_size % count:
    raise ConfigError("train.batch_size", f"{config.train.batch_size} is not divisible by "
                      f"the {count} data shards")
  return config.train.batch_size // count * len(shards)


class QueryBatches(BatchStream):
  """This process's query batches: masked queries (REALM) or ICT pairs of its share of rows.

  Batch t holds this process's share (`pipeline.process_batches`) of the stream positions
  [t * B, (t + 1) * B) of `pipeline.example_stream`, each with its random choice drawn by grain's
  `random_map`, so the global batches depend on the seed and t only.
  """

  def __init__(self, config, data: PreparedData, examples: ExampleSet, shards=(0,),
               count: int = 1):
    self.local_batch = local_batch_size(config, shards, count)
    self.config, self.data, self.examples = config, data, examples
    self.shards, self.count = tuple(shards), count
    tok = data.tokenizer
    self.cls_id, self.sep_id, self.mask_id = tok.cls_id, tok.sep_id, tok.mask_id
    self.rows = pipeline.example_stream(len(examples), config.seed)
    self.dataset = pipeline.process_batches(self.rows.random_map(self._draw),
                                            config.train.batch_size, self.shards,
                                            count, self._assemble)

  def query_lengths(self, step: int) -> np.ndarray:
    """[B]: the wordpieces of each query (`[CLS] x [SEP]`, x cut as `pipeline.query_ids` cuts
    it) of global batch `step`, every process's share: like the batch, a function of the seed
    and the step alone (B lookups in the shuffled stream: ~17 ms for B = 512 on a 2-core
    EPYC)."""
    size = self.config.train.batch_size
    rows = np.fromiter((self.rows[step * size + j] for j in range(size)), np.int64, size)
    return np.minimum(self.examples.lengths[rows], self.config.data.query_len - 2) + 2

  def pack(self, step: int, batch: dict[str, np.ndarray], shards: int) -> bool:
    """`pack_queries` for this process's batch of `step` (`shards`: the data axis, a multiple
    of the data shards the batches were split into)."""
    per = shards // self.count   # data-axis shards in each of this stream's shards
    own = tuple(i * per + j for i in self.shards for j in range(per))
    return pack_queries(self.config, batch, shards, lambda: self.query_lengths(step), own)

  def _draw(self, row: int, rng: np.random.Generator) -> tuple[int, int, int]:
    """(row, choice, own): the salient span to mask (REALM), or whether to cut the sentence
    out of its block (ICT, with probability `data.ict_remove_prob`); `own`: whether a
    "mixed" warm-up query reads its own block (probability `retrieval.own_block_share`)."""
    if self.config.task == "ict":
      return row, int(rng.random() < self.config.data.ict_remove_prob), 0
    span = int(rng.integers(self.examples.num_spans[row]))
    if self.config.retrieval.candidates != "mixed":
      return row, span, 0
    return row, span, int(rng.random() < self.config.retrieval.own_block_share)

  def _assemble(self, drawn: list[tuple[int, int, int]]) -> dict[str, np.ndarray]:
    rows, choice, own = np.asarray(drawn, np.int64).reshape(-1, 3).T
    if self.config.task == "ict":
      return pipeline.ict_inputs(self.examples, self.data.blocks, rows,
                                 self.config.data.query_len, choice.astype(bool), self.cls_id,
                                 self.sep_id)
    batch = masked_queries(self.examples, rows, self.examples.spans[rows, choice], self.config,
                           self.cls_id, self.sep_id, self.mask_id)
    batch["query_row"], batch["span_index"] = rows.astype(np.int32), choice.astype(np.int32)
    if self.config.retrieval.candidates == "mixed":
      batch["reads_own_block"] = own.astype(np.int32)
    if self.config.retrieval.get("own_context", False):
      batch["sentence_cut"] = self.examples.block_offsets[rows].astype(np.int32)
    return batch   # (query row, span): what the masked query is (the score cache's key)


def masked_queries(examples: ExampleSet, rows: np.ndarray, spans: np.ndarray, config, cls_id,
                   sep_id, mask_id) -> dict[str, np.ndarray]:
  """`[CLS] x [SEP]` with one salient span masked, plus the source block of each query. A
  sentence longer than data.query_len - 2 (data.long_queries "cut") is cut to the window that
  holds its span (`pipeline.span_windows`: its first wordpieces where the span lies in them)."""
  start = pipeline.span_windows(spans, config.data.query_len)
  ids, lengths = pipeline.query_ids(examples, rows, config.data.query_len, cls_id, sep_id, start)
  batch = pipeline.mask_salient_spans(ids, spans - start[:, None], config.data.max_masks,
                                      mask_id)
  batch["query_len"] = lengths.astype(np.int32)
  batch["source_block"] = examples.block[rows].astype(np.int32)
  return batch


def realm_batch(config, data: PreparedData, queries: dict[str, np.ndarray],
                rows: np.ndarray) -> dict[str, np.ndarray]:
  """Everything the REALM step reads: queries, candidates (`rows`, to re-score) and reader
  inputs."""
  tok = data.tokenizer
  cands = pipeline.candidate_inputs(data.blocks, rows, tok.cls_id, tok.sep_id)
  if "sentence_cut" in queries:   # retrieval.own_context: the own block, its sentence cut out
    cands = pipeline.cut_own_sentence(cands, rows == queries["source_block"][:, None],
                                      queries["sentence_cut"])
  reader_len = pipeline.reader_length(
      config.data.query_len, candidate_rows.of(config).reader_block_len(data.blocks.block_len))
  reader_ids, reader_segments = pipeline.reader_inputs(queries["query_ids"],
                                                       queries["query_len"], cands, reader_len)
  batch = {"query_ids": queries["query_ids"], "mask_positions": queries["mask_positions"],
           "mask_labels": queries["mask_labels"], "mask_weights": queries["mask_weights"],
           "candidate_ids": cands["candidate_ids"],
           "candidate_segments": cands["candidate_segments"],
           "reader_ids": reader_ids, "reader_segments": reader_segments}
  if config.retrieval.get("distill_queries", "all") == "evidence":
    batch["has_evidence"] = span_in_candidates(queries["mask_labels"], queries["mask_weights"],
                                               cands).any(-1).astype(np.float32)
  return batch


def pack_queries(config, batch: dict[str, np.ndarray], shards: int,
                 global_lengths=None, own=None) -> bool:
  """With `retrieval.packed_query_rows` R, adds a training `batch`'s queries packed into the
  R / D rows of each of this process's data shards `own` (default: all `shards` D, the data
  axis; `pipeline.pack_queries`), numbered in the global batch; whether it did (not when off,
  nor when the queries do not fit: the step then reads them one a row). In a job of several
  processes every one must take the same step: `global_lengths()` [B], the wordpieces of
  every query of the global batch (`QueryBatches.query_lengths`, asked only when this
  process's shards fit), says whether every shard's queries fit, and all pack or none."""
  rows = config.retrieval.get("packed_query_rows", 0)
  if not rows:
    return False
  ids, own = batch["query_ids"], tuple(range(shards)) if own is None else tuple(own)
  packed = pipeline.pack_queries(ids, rows // shards * len(own), len(own), own)
  if packed is None:
    return False   # (then no process packs: each checks every shard)
  if len(own) < shards:
    lengths = np.asarray(global_lengths()).reshape(shards, -1)
    if not np.array_equal(lengths[list(own)].reshape(-1), (ids > 0).sum(1)):
      raise RuntimeError("the global batch's query lengths disagree with this process's "
                         "queries: the processes would pack differently")
    if not all(pipeline.queries_fit(lengths[i], rows // shards, 1, ids.shape[1])
               for i in range(shards) if i not in own):
      return False
  batch.update(packed)
  return True


def span_in_candidates(mask_labels: np.ndarray, mask_weights: np.ndarray,
                       cands: dict[str, np.ndarray]) -> np.ndarray:
  """[n, k] bool: whether candidate z's body (what the reader reads) holds query x's masked
  span, wordpiece for wordpiece (the null document never does)."""
  ids, starts, ends = cands["candidate_ids"], cands["body_start"], cands["lengths"]
  n, k, _ = ids.shape
  found = np.zeros((n, k), bool)
  for i in range(n):
    span = mask_labels[i][mask_weights[i] > 0]
    if not len(span):
      continue
    for z in range(k):
      body = ids[i, z, starts[i, z]:ends[i, z]]
      if len(body) >= len(span):
        windows = np.lib.stride_tricks.sliding_window_view(body, len(span))
        found[i, z] = bool((windows == span).all(-1).any())
  return found


def index_embeddings(loaded, rows: np.ndarray) -> np.ndarray:
  """The serving index's embeddings of candidate blocks `rows` [n, k, d] (the null document's
  row: zeros, the step embeds it itself), for `retrieval.block_gradients` False."""
  if loaded.embeddings is None:
    raise ValueError(f"index version {loaded.version} carries no block embeddings")
  null = rows == pipeline.NULL_BLOCK
  return np.where(null[..., None], 0.0,
                  loaded.embeddings[np.where(null, 0, rows)]).astype(np.float32)

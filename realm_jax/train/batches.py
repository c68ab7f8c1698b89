"""Host-side batch assembly for each task: queries (built ahead in the prefetch thread), then
candidates from the current index and the reader inputs (between steps, on the main thread,
because the index can change at any step)."""

from __future__ import annotations

import numpy as np

from realm_jax.data import pipeline
from realm_jax.data.store import ExampleSet, PreparedData


class QueryBatches:
  """Masked queries of step t for this process: a pure function of (seed, t)."""

  def __init__(self, config, data: PreparedData, examples: ExampleSet, process_index: int = 0,
               process_count: int = 1):
    self.config, self.data, self.examples = config, data, examples
    self.sampler = pipeline.BatchSampler(len(examples), config.train.batch_size, config.seed,
                                         process_index, process_count)
    tok = data.tokenizer
    self.cls_id, self.sep_id, self.mask_id = tok.cls_id, tok.sep_id, tok.mask_id

  def __call__(self, step: int) -> dict[str, np.ndarray]:
    rng = self.sampler.step_rng(step)
    rows_global = self.sampler.global_indices(step)
    uniforms = rng.random((3, len(rows_global)))  # drawn for the global batch: host-count free
    rows = rows_global[self.sampler.local]
    u_span, u_remove = uniforms[0][self.sampler.local], uniforms[1][self.sampler.local]
    if self.config.task == "ict":
      remove = u_remove < self.config.data.ict_remove_prob
      return pipeline.ict_inputs(self.examples, self.data.blocks, rows,
                                 self.config.data.query_len, remove, self.cls_id, self.sep_id)
    return masked_queries(self.examples, rows, pipeline.choose_spans(self.examples, rows, u_span),
                          self.config, self.cls_id, self.sep_id, self.mask_id)


def masked_queries(examples: ExampleSet, rows: np.ndarray, spans: np.ndarray, config, cls_id,
                   sep_id, mask_id) -> dict[str, np.ndarray]:
  """`[CLS] x [SEP]` with one salient span masked, plus the source block of each query."""
  ids, lengths = pipeline.query_ids(examples, rows, config.data.query_len, cls_id, sep_id)
  batch = pipeline.mask_salient_spans(ids, spans, config.data.max_masks, mask_id)
  batch["query_len"] = lengths.astype(np.int32)
  batch["source_block"] = examples.block[rows].astype(np.int32)
  return batch


def candidates_for(config, data: PreparedData, queries: dict[str, np.ndarray],
                   retrieved: np.ndarray | None) -> np.ndarray:
  """Candidate block rows [n, k] (column 0 = the null document) for the retrieval mode."""
  source = queries["source_block"]
  null = np.full((len(source), 1), pipeline.NULL_BLOCK)
  mode = config.retrieval.mode
  if mode == "null_only":
    return null
  if mode == "own_block":
    return np.concatenate([null, source[:, None]], axis=1)
  return pipeline.candidate_rows(retrieved, source, data.blocks.uids, config.retrieval.k)


def realm_batch(config, data: PreparedData, queries: dict[str, np.ndarray],
                candidate_rows: np.ndarray) -> dict[str, np.ndarray]:
  """Everything the REALM step reads: queries, candidates (to re-score) and reader inputs."""
  tok = data.tokenizer
  cands = pipeline.candidate_inputs(data.blocks, candidate_rows, tok.cls_id, tok.sep_id)
  reader_len = config.data.query_len + data.blocks.block_len - 2
  reader_ids, reader_segments = pipeline.reader_inputs(queries["query_ids"],
                                                       queries["query_len"], cands, reader_len)
  return {"query_ids": queries["query_ids"], "mask_positions": queries["mask_positions"],
          "mask_labels": queries["mask_labels"], "mask_weights": queries["mask_weights"],
          "candidate_ids": cands["candidate_ids"],
          "candidate_segments": cands["candidate_segments"],
          "reader_ids": reader_ids, "reader_segments": reader_segments}

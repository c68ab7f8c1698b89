"""What a REALM batch's candidates are: one object per `retrieval.candidates` mode, owning the
rows it makes from a query batch (and what was retrieved for it) and the spec the step reads
of them. `of(config)` picks it; train/candidates.py says where the retrieval comes from.

  index      the null document and the top k - 1 retrieved blocks, the query's own block
             dropped (REALM); without the null document in training
             (`retrieval.train_null_document` False) a training batch holds the blocks only;
             with `retrieval.own_context` a training batch's last candidate is the own block,
             read with the query's sentence cut out
  own_block  the null document and the query's own block, all prior mass on the block (the
             reader warm-up); a training batch leaves the null document out (it would add
             exactly nothing to the loss or its gradient, at the cost of reading it)
  mixed      as own_block, but a training query reads its own block only where its draw says
             (`reads_own_block`), else the best retrieved block that is not its own (a
             distractor); evaluation reads the own block, or with `distractor` that block
  null_only  the null document alone (the no-retrieval baseline), read at its own length

Evaluation batches hold the null document in column 0 in every mode (it measures utility).
"""

from __future__ import annotations

import numpy as np

from realm_jax.config import reading
from realm_jax.data import pipeline
from realm_jax.data.prepared import PreparedData


class CandidateRows:
  """The interface and what the modes share."""

  name = ""
  retrieves = False   # the rows come from a retrieval: the index is searched for them
  scored = False      # the retriever scores them (f(x, z) -> p(z|x)); else p(z|x) is fixed

  def __init__(self, config):
    self.config = config

  def null_first(self, training: bool) -> bool:
    """Whether candidate 0 of every query is the null document."""
    return not training

  def reader_block_len(self, block_len: int) -> int:
    """The length of the blocks the reader reads (the block store's `block_len`)."""
    return block_len

  def rows(self, data: PreparedData, queries: dict[str, np.ndarray],
           retrieved: np.ndarray | None, training: bool = False,
           distractor: bool = False) -> np.ndarray:
    """Candidate block rows [n, k'] of `queries` (`retrieved`: the index's top rows, or None
    where nothing is retrieved)."""
    raise NotImplementedError

  @staticmethod
  def _null(queries: dict[str, np.ndarray]) -> np.ndarray:
    return np.full((len(queries["source_block"]), 1), pipeline.NULL_BLOCK)


class Retrieved(CandidateRows):
  name, retrieves, scored = "index", True, True

  def null_first(self, training: bool) -> bool:
    return not training or reading.null_in_training(self.config)

  def rows(self, data, queries, retrieved, training=False, distractor=False):
    rows = pipeline.candidate_rows(retrieved, queries["source_block"], data.blocks.uids,
                                   self.config.retrieval.k)
    if training and self.config.retrieval.get("own_context", False):
      rows[:, -1] = queries["source_block"]   # read with its sentence cut out (realm_batch)
    return rows[:, 1:] if training and not reading.null_in_training(self.config) else rows


class OwnBlock(CandidateRows):
  name = "own_block"

  def rows(self, data, queries, retrieved, training=False, distractor=False):
    own = queries["source_block"][:, None]
    return own if training else np.concatenate([self._null(queries), own], axis=1)


class Mixed(CandidateRows):
  name, retrieves = "mixed", True

  def rows(self, data, queries, retrieved, training=False, distractor=False):
    own = queries["source_block"][:, None]
    other = pipeline.candidate_rows(retrieved, queries["source_block"], data.blocks.uids,
                                    2)[:, 1:]   # the best retrieved block not the query's own
    if training:
      return np.where(queries["reads_own_block"][:, None] > 0, own, other)
    return np.concatenate([self._null(queries), other if distractor else own], axis=1)


class NullDocumentOnly(CandidateRows):
  name = "null_only"

  def null_first(self, training: bool) -> bool:
    return False   # the only candidate: read at its own length, no prior to compute

  def reader_block_len(self, block_len: int) -> int:
    # padding the null document to the block length would only be read and masked out
    return pipeline.NULL_DOCUMENT_LENGTH

  def rows(self, data, queries, retrieved, training=False, distractor=False):
    return self._null(queries)


MODES = {mode.name: mode for mode in (Retrieved, OwnBlock, Mixed, NullDocumentOnly)}


def of(config) -> CandidateRows:
  """The candidates `config.retrieval.candidates` names."""
  return MODES[config.retrieval.candidates](config)

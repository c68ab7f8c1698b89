"""ORQA's prediction for one question with our model (embed, retrieve, read, argmax over
block x span): what the parity check (`hf_parity`) and `bench/peer_hf.py` compare against
Hugging Face's RealmForOpenQA.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass
class OpenQAPrediction:
  """One question's ORQA forward: the top blocks, their span scores and the best answer."""

  block_rows: np.ndarray         # [beam] block-store rows, by retrieval score
  retrieval_logits: np.ndarray   # [beam] f(question, block)
  reader_ids: np.ndarray         # [beam, reader_len] `[CLS] question [SEP] body [SEP]`
  span_mask: np.ndarray          # [beam, reader_len] positions a span may use (the body)
  span_logits: np.ndarray        # [beam, S] reader span scores (-1e9 outside the body)
  starts: np.ndarray             # [S] span starts (width-major, `span_candidates`)
  ends: np.ndarray               # [S]
  block: int                     # the answer's block (index into the beam)
  start: int                     # the answer's first position in reader_ids[block]
  end: int                       # and its last
  score: float                   # span logit + retrieval logit of the answer

  @property
  def answer_ids(self) -> np.ndarray:
    return self.reader_ids[self.block, self.start:self.end + 1]


@functools.lru_cache(maxsize=None)
def _openqa_fns(model):
  import jax
  from realm_jax.models.realm import REALM
  embed = jax.jit(lambda p, ids: model.apply({"params": p}, ids, method=REALM.embed_queries))
  spans = jax.jit(lambda p, ids, segs, mask: model.apply(
      {"params": p}, ids, segs, mask, method=REALM.read_spans))
  return embed, spans


def openqa_forward(model, params, question: np.ndarray, *, index, block_emb: np.ndarray,
                   blocks, cls_id: int, sep_id: int, reader_beam: int, reader_len: int,
                   query_len: int) -> OpenQAPrediction:
  """ORQA's prediction for one question (HF RealmForOpenQA's forward in eval mode).

  Embed `[CLS] question [SEP]` with the query tower, take the top `reader_beam` blocks of
  `index` (retrieval logit = inner product with their `block_emb` rows), read
  `[CLS] question [SEP] body [SEP]` for each, add the block's retrieval logit to its span
  scores and take the argmax over (block, span).

  Args:
    model, params: a REALM with the span head (`state.build_model` of an openqa config) and
      its params.
    question: the question's wordpiece ids, without [CLS]/[SEP].
    index: a `retrieval.index.BlockIndex` over the block store's rows.
    block_emb: [num_blocks, dim] the block embeddings the index holds.
    blocks: the `data.prepared.BlockStore` (body = tokens[body_start:length - 1]).
    cls_id, sep_id: the vocab's [CLS] and [SEP].
    reader_beam: blocks read (HF reader_beam_size); reader_len: reader input length.
    query_len: the question's input length for the query tower (longer ones are cut).
  """
  from realm_jax.train.openqa_inputs import reader_inputs
  embed, spans = _openqa_fns(model)
  question = np.asarray(question, np.int32)
  q_ids = np.zeros((1, query_len), np.int32)
  q_row = [cls_id, *question[:query_len - 2], sep_id]
  q_ids[0, :len(q_row)] = q_row
  q_emb = np.asarray(embed(params, q_ids))
  rows = np.asarray(index.search(q_emb, reader_beam))[0]
  retrieval = np.asarray(block_emb[rows], np.float32) @ q_emb[0]
  # The reader inputs realm-eval builds, spans anywhere in the body as in HF's reader.
  _, inputs = reader_inputs(blocks, rows[None], q_ids, np.asarray([len(q_row)], np.int32),
                            reader_len, cls_id, sep_id)
  ids, segments = inputs["reader_ids"][0], inputs["reader_segments"][0]
  span_mask = inputs["span_start_mask"][0]   # = the end mask: the body
  span_logits = np.asarray(spans(params, ids, segments, span_mask))
  from realm_jax.models.realm import span_candidates
  starts, ends = span_candidates(reader_len, model.max_span_width)
  joint = span_logits + retrieval[:, None]
  block, span = np.unravel_index(int(np.argmax(joint)), joint.shape)
  return OpenQAPrediction(rows, retrieval, ids, span_mask, span_logits, starts, ends, int(block),
                          int(starts[span]), int(ends[span]), float(joint[block, span]))

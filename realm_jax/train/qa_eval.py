"""Open-QA evaluation on a QA split: exact match, F1 and retrieval recall, with the evidence
behind every answer (the run's evaluation during training, `realm-eval` and `realm-predict`).

recall@k: one of the top k retrieved blocks contains an answer string (regex for CuratedTrec).
EM / F1: the reader's best span over the top `qa.reader_beam` blocks (span score + the block's
retrieval logit), with ORQA's answer normalisation (realm_jax/data/answers.py). Without the span
reader (REALM pre-training), retrieval recall only: the zero-shot retrieval evaluation.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from realm_jax.data.answers import exact_match, f1_score
from realm_jax.data.qa import QAExample
from realm_jax.data.prepared import PreparedData
from realm_jax.runtime import embedders, partitioning
from realm_jax.log import format_duration, format_rate
from realm_jax.train import steps
from realm_jax.train.openqa_inputs import FrozenIndex, QABatchBuilder

logger = logging.getLogger(__name__)

RECALL_AT = (1, 5, 20, 100)
PROGRESS_SECONDS = 10.0


class QAEvaluator:
  """One QA split against one frozen index; `run(params)` scores a set of parameters."""

  def __init__(self, config, data: PreparedData, mesh, model, examples: list[QAExample],
               frozen: FrozenIndex, reader: bool, counts: dict | None = None,
               prefix: str = "[eval] "):
    if not examples:
      raise ValueError("no questions to evaluate")
    self.config, self.data, self.mesh, self.model = config, data, mesh, model
    self.examples, self.frozen, self.reader = examples, frozen, reader
    self.counts, self.prefix = dict(counts or {}), prefix
    self.builder = QABatchBuilder(config, data, examples, frozen)
    self.recall_at = tuple(k for k in RECALL_AT if k <= frozen.num_blocks)
    self.depth = max(max(self.recall_at), self.builder.k)
    self.eval_fn = steps.make_openqa_eval(config, model, mesh) if reader else None

  def run(self, params, keep_predictions: bool = True) -> tuple[dict, list[dict]]:
    cfg, b = self.config, self.builder
    devices = self.mesh.devices.size
    bs = max(cfg.eval.batch_size // devices, 1) * devices
    n = len(self.examples)
    hits = {k: np.zeros(n, bool) for k in self.recall_at}
    em, f1, in_top_k, predictions = np.zeros(n), np.zeros(n), np.zeros(n, bool), []
    t0 = last = time.time()
    for start in range(0, n, bs):
      rows = np.arange(start, start + bs) % n    # the last batch wraps; extra rows dropped
      real = min(bs, n - start)
      q_emb = embedders.query_embeddings(self.model, self.mesh, cfg, params, b.question_ids[rows])
      ranked = self.frozen.index.search(q_emb, self.depth)
      has = b.has_answer(rows[:real], ranked[:real])
      for k in self.recall_at:
        hits[k][start:start + real] = has[:, :k].any(axis=1)
      in_top_k[start:start + real] = has[:, :b.k].any(axis=1)
      out, scores = None, None
      if not self.reader:   # the reader's logits hold them otherwise
        scores = np.einsum("bd,bkd->bk", np.asarray(q_emb[:real], np.float32),
                           self.frozen.embeddings[ranked[:real, :b.k]])
      else:
        batch = b.reader_batch(rows, ranked[:, :b.k], labels=False)
        batch["candidate_emb"] = self.frozen.embeddings[ranked[:, :b.k]]
        global_batch = partitioning.global_batch(batch, self.mesh)
        out = {key: partitioning.local_rows(v)
               for key, v in self.eval_fn(params, global_batch).items()}
      for i in range(real):
        row = start + i
        pred = self._prediction(row, ranked[i], has[i], batch if out is not None else None,
                                out, i, None if scores is None else scores[i])
        if out is not None:
          em[row], f1[row] = pred["exact_match"], pred["f1"]
        if keep_predictions:
          predictions.append(pred)
      now = time.time()
      if now - last >= PROGRESS_SECONDS:
        done = start + real
        rate = done / (now - t0)
        logger.info(f"{self.prefix}{done:,}/{n:,} questions | "
                    f"{format_rate(rate, 'q/s', 's/q', 1)} ETA "
                    f"{format_duration((n - done) / rate)}")
        last = now
    metrics = {f"recall_at_{k}": float(h.mean()) for k, h in hits.items()}
    if self.reader:
      metrics.update(exact_match=float(em.mean()), f1=float(f1.mean()))
    metrics.update(
        num_questions=n, seconds=round(time.time() - t0, 1),
        no_answer_in_top_k=int((~in_top_k).sum()), reader_beam=b.k,
        truncated_questions=int(self.builder.truncated.sum()),
        skipped=self.counts, index_version=self.frozen.version, index_step=self.frozen.step)
    return metrics, predictions

  def _prediction(self, row, ranked, has, batch, out, i, scores=None) -> dict:
    """One question's record; `scores` [k]: its blocks' retrieval scores without a reader."""
    ex, b, blocks = self.examples[row], self.builder, self.data.blocks
    pred = {"id": ex.qid, "question": ex.question, "answers": list(ex.answers),
            "answer_in_top_k": bool(has[:b.k].any())}
    evidence = []
    for j, block in enumerate(ranked[:b.k]):
      block = int(block)
      body = blocks.tokens[block][blocks.body_start[block]:blocks.lengths[block] - 1]
      item = {"block": block, "title": blocks.title(block),
              "text": self.data.tokenizer.decode(body), "contains_answer": bool(has[j])}
      if scores is not None:
        item["retrieval_score"] = float(scores[j])
      if out is not None:
        spanned = has_span(out, i, j)   # (an empty body has none: no [CLS] as its span)
        item["retrieval_score"] = float(out["retrieval_logits"][i, j])
        item["span_score"] = float(out["block_span_scores"][i, j]) if spanned else None
        item["span"] = b.span_text(batch["reader_ids"][i, j], int(
            out["block_best_span"][i, j]))[0] if spanned else None
      evidence.append(item)
    if out is not None:
      k = int(out["best_block"][i])
      answered = has_span(out, i, k)   # none of the blocks read has one: no answer ("")
      answer = b.span_text(batch["reader_ids"][i, k], int(out["best_span"][i]))[0] \
          if answered else ""
      scored = b.scored_answers(row)
      pred.update(prediction=answer, score=float(out["score"][i]) if answered else None,
                  block_rank=k,
                  exact_match=bool(exact_match(answer, scored, ex.is_regex)),
                  f1=float(f1_score(answer, scored, ex.is_regex)))
    pred["evidence"] = evidence
    return pred


def has_span(out: dict, i: int, j: int) -> bool:
  """Whether block `j` of question `i` has a valid span (its best span's score is not the
  mask's -1e9: a block whose body is empty has none)."""
  return bool(out["block_span_scores"][i, j] > -1e8)


def format_metrics(metrics: dict) -> str:
  keys = [k for k in ("exact_match", "f1") if k in metrics] + \
      [k for k in metrics if k.startswith("recall_at_")]
  return " ".join(f"{k.replace('recall_at_', 'R@').replace('exact_match', 'EM')} "
                  f"{metrics[k]:.3f}" for k in keys)

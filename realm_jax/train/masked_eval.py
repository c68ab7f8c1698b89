"""Evaluation on masked sentences about held-out entities: retrieval recall and span accuracy.

recall@n: one of the top-n retrieved blocks (the query's own block excluded) states the masked
fact (generator ground truth, used only here; real text has none, so no recall there).
span accuracy: every masked wordpiece of the span is the argmax of the marginal
p(y_j | x) = sum_z p(z|x) p(y_j|z,x); span_accuracy_null_document: the same reader's argmax of
p(y_j | null, x), the null document alone (what retrieval adds is the difference);
span_accuracy_distractor (a "mixed" warm-up): the reader given the best retrieved block that
is not the query's own, which seldom holds the span (a reader that knows when to copy keeps
this near the null document's).
"""

from __future__ import annotations

import numpy as np

from realm_jax.data import pipeline
from realm_jax.data.prepared import PreparedData
from realm_jax.retrieval.index import IndexVersion
from realm_jax.train import batches, candidate_rows
from realm_jax.runtime import partitioning

RECALL_AT = (1, 5)


def answer_in_top(ranked: np.ndarray, answers: np.ndarray, at: int) -> np.ndarray:
  """Per row, whether one of its `answers` (block rows, -1 padded) is among the first `at`
  of `ranked` (block rows; -1 where fewer blocks were left after the own block's copies were
  dropped): a padding entry is no block, and never a hit."""
  found = ranked[:, :at, None] == answers[:, None, :]
  return (found & (answers[:, None, :] >= 0)).any(axis=(1, 2))


class Evaluator:
  """Fixed eval queries (the target span masked) and the metrics computed on them."""

  def __init__(self, config, data: PreparedData, mesh, realm_eval=None):
    """Args:
      realm_eval: the jitted REALM eval fn (None for ICT: retrieval metrics only).
    """
    self.config, self.data, self.mesh = config, data, mesh
    self.candidates = candidate_rows.of(config)   # what the REALM reader reads
    self.examples = data.examples(config.eval.split)
    if self.examples.target_span is None:
      raise FileNotFoundError(f"split {config.eval.split!r} has no target spans to evaluate")
    n = min(config.eval.num_examples, len(self.examples))
    self.rows = np.arange(n)   # the first n in file order, every time (not a sample)
    tok = data.tokenizer
    self.queries = batches.masked_queries(self.examples, self.rows,
                                          self.examples.target_span[self.rows], config,
                                          tok.cls_id, tok.sep_id, tok.mask_id)
    # data.long_queries "cut": the eval queries cut to query_len - 2 wordpieces, and of them
    # those whose target span lies past the first query_len - 2 (cut to the window holding it)
    self.cut = int((self.examples.lengths[self.rows] > config.data.query_len - 2).sum())
    self.windowed = int((pipeline.span_windows(self.examples.target_span[self.rows],
                                               config.data.query_len) > 0).sum())
    self.realm_eval = realm_eval
    # Real text has no fact ground truth: no other block is known to state the masked span.
    answers = self.examples.answer_blocks
    self.has_answers = answers is not None and bool((answers[:n] >= 0).any())
    # The query's own block is dropped from what the index returns: a corpus of fewer blocks
    # than recall@5 and k ask for is read whole, and recall@k is kept where k blocks remain.
    num_blocks = data.blocks.num_blocks
    self.recall_at = tuple(at for at in RECALL_AT if at < num_blocks)
    self.depth = min(max(max(RECALL_AT), config.retrieval.k) + 1, num_blocks)

  def run(self, params, index: IndexVersion | None, keep_examples: int = 0
          ) -> tuple[dict[str, float], list[dict]]:
    """Metrics over the eval queries, and the first `keep_examples` predictions in detail.

    Args:
      params: the model params (reader + retriever that re-scores the candidates).
      index: the index version to retrieve from, with its own query tower (None when the
        mode does not retrieve).
    """
    cfg = self.config
    bs = max(cfg.eval.batch_size // self.mesh.devices.size, 1) * self.mesh.devices.size
    n = len(self.rows)
    hits = {at: [] for at in self.recall_at}
    correct, null_correct, utility, details, distracted = [], [], [], [], []
    masks = []   # each query's real masks: "per_mask" weighs its utility by them
    # Examples to show in detail, spread over the set (neighbours are about one entity).
    show = set(np.linspace(0, n - 1, keep_examples).astype(int).tolist()) \
        if keep_examples else set()
    for start in range(0, n, bs):
      idx = np.arange(start, start + bs) % n   # the last batch wraps; extra rows are dropped
      real = min(bs, n - start)
      q = {key: v[idx] for key, v in self.queries.items()}
      retrieved = None
      if index is not None and (self.has_answers or self.realm_eval is not None):
        top = index.retrieve(q["query_ids"], self.depth)
        ranked = pipeline.candidate_rows(top, q["source_block"], self.data.blocks.uids,
                                         top.shape[1])[:, 1:]   # drop the null column
        if self.has_answers:
          answers = self.examples.answer_blocks[self.rows[idx]]
          for at in self.recall_at:
            hits[at].extend(answer_in_top(ranked, answers, at)[:real])
        retrieved = top
      if self.realm_eval is None:
        continue
      cand = self.candidates.rows(self.data, q, retrieved)
      out = self._read(params, q, cand)
      preds = out["predictions"]
      ok = _every_mask_right(preds, q)
      correct.extend(ok[:real])
      null_correct.extend(_every_mask_right(out["null_predictions"], q)[:real])
      utility.extend(out["retrieval_utility"][:real])
      masks.extend(q["mask_weights"][:real].sum(-1))
      if self.candidates.name == "mixed":   # the same reader given a distractor
        other = self.candidates.rows(self.data, q, retrieved, distractor=True)
        distracted.extend(_every_mask_right(self._read(params, q, other)["predictions"],
                                            q)[:real])
      shown = [i for i in range(real) if start + i in show]
      if shown:
        details.extend(self._details(q, cand, preds, out["p_z"], ok, shown))
    metrics = {f"recall_at_{at}": float(np.mean(h)) for at, h in hits.items() if h}
    if correct:
      metrics["span_accuracy"] = float(np.mean(correct))
      metrics["span_accuracy_null_document"] = float(np.mean(null_correct))
      metrics["retrieval_utility"] = self._mean_utility(utility, masks)
    if distracted:
      metrics["span_accuracy_distractor"] = float(np.mean(distracted))
    metrics["num_examples"] = int(n)
    return metrics, details

  def _mean_utility(self, utility: list, masks: list) -> float:
    """The queries' retrieval utility as the training step means it (`losses.realm_loss`):
    over the queries ("joint"), over every real mask ("per_mask", each query's utility the
    mean of its masks')."""
    if self.config.retrieval.marginalization == "per_mask" and sum(masks) > 0:
      return float(np.average(utility, weights=masks))
    return float(np.mean(utility))

  def _read(self, params, q, cand) -> dict[str, np.ndarray]:
    """The REALM eval fn's outputs for queries `q` over candidates `cand`, every row. Every
    process built the whole batch; each feeds its rows and gets back every row."""
    batch = batches.realm_batch(self.config, self.data, q, cand)
    return partitioning.host_copy(self.realm_eval(
        params, partitioning.global_batch(partitioning.process_share(batch, self.mesh), self.mesh)))

  def _details(self, q, cand, preds, p_z, ok, rows) -> list[dict]:
    tok, blocks = self.data.tokenizer, self.data.blocks
    out = []
    for i in rows:
      valid = q["mask_weights"][i] > 0
      order = np.argsort(-p_z[i])[:3]
      evidence = []
      for j in order:
        row = int(cand[i, j])
        if row == pipeline.NULL_BLOCK:
          evidence.append({"title": "(null document)", "text": "", "p_z": float(p_z[i, j])})
          continue
        body = blocks.tokens[row][blocks.body_start[row]:blocks.lengths[row] - 1]
        evidence.append({"title": blocks.title(row), "text": tok.decode(body),
                         "p_z": float(p_z[i, j])})
      out.append({"query": tok.decode(q["query_ids"][i][1:q["query_len"][i] - 1]),
                  "answer": tok.decode(q["mask_labels"][i][valid]),
                  "prediction": tok.decode(preds[i][valid]), "correct": bool(ok[i]),
                  "evidence": evidence})
    return out


def _every_mask_right(predictions: np.ndarray, q: dict[str, np.ndarray]) -> np.ndarray:
  """Per query: the predicted wordpiece is the label at every real mask."""
  return ((predictions == q["mask_labels"]) | (q["mask_weights"] <= 0)).all(axis=1)

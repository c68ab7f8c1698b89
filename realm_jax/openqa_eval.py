"""Open-QA evaluation: exact match, F1 and retrieval recall on a QA split, with the evidence
behind every answer; and `realm-eval`, which restores a checkpoint and an index to run it.

recall@k: one of the top k retrieved blocks contains an answer string (regex for CuratedTrec).
EM / F1: the reader's best span over the top `qa.reader_beam` blocks (span score + the block's
retrieval logit), with ORQA's answer normalisation (realm_jax/data/answers.py). A checkpoint
without the span reader (REALM pre-training) gets retrieval recall only: the zero-shot
retrieval evaluation.

  realm-eval --config configs/X.py --workdir W [--step N] [--split test] [--retrieval_only]
writes W/eval/<step>/metrics.json and W/eval/<step>/predictions.jsonl.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import numpy as np

from realm_jax import log, paths, workdir as workdir_lib
from realm_jax.data.answers import exact_match, f1_score
from realm_jax.data.qa import QAExample
from realm_jax.data.prepared import PreparedData
from realm_jax.retrieval import published
from realm_jax.runtime import embedders, partitioning
from realm_jax.train import steps
from realm_jax.runtime.metrics import format_duration
from realm_jax.train.openqa_inputs import FrozenIndex, QABatchBuilder
from realm_jax.config.option_names import upgrade_flags

logger = logging.getLogger("realm_jax.openqa_eval")   # (__name__ is __main__ under python -m)

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
      out = None
      if self.reader:
        batch = b.reader_batch(rows, ranked[:, :b.k], labels=False)
        batch["candidate_emb"] = self.frozen.embeddings[ranked[:, :b.k]]
        global_batch = partitioning.global_batch(batch, self.mesh)
        out = {key: partitioning.local_rows(v)
               for key, v in self.eval_fn(params, global_batch).items()}
      for i in range(real):
        row = start + i
        pred = self._prediction(row, ranked[i], has[i], batch if out is not None else None,
                                out, i)
        if out is not None:
          em[row], f1[row] = pred["exact_match"], pred["f1"]
        if keep_predictions:
          predictions.append(pred)
      now = time.time()
      if now - last >= PROGRESS_SECONDS:
        done = start + real
        rate = done / (now - t0)
        logger.info(f"{self.prefix}{done:,}/{n:,} questions | {rate:,.1f} q/s ETA "
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

  def _prediction(self, row, ranked, has, batch, out, i) -> dict:
    ex, b, blocks = self.examples[row], self.builder, self.data.blocks
    pred = {"id": ex.qid, "question": ex.question, "answers": list(ex.answers),
            "answer_in_top_k": bool(has[:b.k].any())}
    evidence = []
    for j, block in enumerate(ranked[:b.k]):
      block = int(block)
      body = blocks.tokens[block][blocks.body_start[block]:blocks.lengths[block] - 1]
      item = {"block": block, "title": blocks.title(block),
              "text": self.data.tokenizer.decode(body), "contains_answer": bool(has[j])}
      if out is not None:
        item["retrieval_score"] = float(out["retrieval_logits"][i, j])
        item["span_score"] = float(out["block_span_scores"][i, j])
        item["span"] = b.span_text(batch["reader_ids"][i, j], int(out["block_best_span"][i, j]))[0]
      evidence.append(item)
    if out is not None:
      k = int(out["best_block"][i])
      answer, _, _ = b.span_text(batch["reader_ids"][i, k], int(out["best_span"][i]))
      scored = b.scored_answers(row)
      pred.update(prediction=answer, score=float(out["score"][i]), block_rank=k,
                  exact_match=bool(exact_match(answer, scored, ex.is_regex)),
                  f1=float(f1_score(answer, scored, ex.is_regex)))
    pred["evidence"] = evidence
    return pred


def format_metrics(metrics: dict) -> str:
  keys = [k for k in ("exact_match", "f1") if k in metrics] + \
      [k for k in metrics if k.startswith("recall_at_")]
  return " ".join(f"{k.replace('recall_at_', 'R@').replace('exact_match', 'EM')} "
                  f"{metrics[k]:.3f}" for k in keys)


def write_results(workdir: str, step: int, metrics: dict, predictions: list[dict]) -> str:
  """W/eval/<step>/{metrics.json, predictions.jsonl}, each seen whole or not at all (a local
  file is written then renamed, a bucket object written in one request)."""
  out = paths.join(workdir, "eval", str(step))
  paths.makedirs(out)
  paths.write_text_atomic(paths.join(out, "metrics.json"), json.dumps(metrics, indent=2))
  paths.write_text_atomic(paths.join(out, "predictions.jsonl"),
                          "".join(json.dumps(p) + "\n" for p in predictions))
  return out


# -- restoring a run for evaluation ---------------------------------------------------------
def load_run(config, workdir: str, step: int | None = None, retrieval_only: bool = False):
  """Params of a checkpoint of `workdir` and the index to retrieve from, for evaluation.

  Returns (config as evaluated, data, mesh, model, params, frozen index, reader?, step). The
  reader is used when the checkpoint has the span scorer (Open-QA fine-tuning) unless
  `retrieval_only`; a pre-training checkpoint gives retrieval metrics only, but one given as
  an Open-QA run (config.task 'openqa') is an error unless `retrieval_only`.
  """
  from realm_jax.errors import ConfigError
  from realm_jax.runtime.checkpoints import restore_run, saved_param_paths
  from realm_jax.config.validation import validate
  validate(config)
  saved, step = saved_param_paths(workdir, step)
  has_reader = any(p[:2] == ("reader", "qa_outputs") for p in saved)
  if config.task == "openqa" and not has_reader and not retrieval_only:
    raise ConfigError("task", f"'openqa', but {workdir}/checkpoints/{step} has no span reader "
                      "(reader/qa_outputs): it is a pre-training checkpoint. Fine-tune it with "
                      "task=openqa first, or pass --retrieval_only for the zero-shot retrieval "
                      "evaluation")
  reader = has_reader and not retrieval_only
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.task = "openqa" if reader else ("realm" if config.task == "openqa" else config.task)
  data = workdir_lib.open_data(config)
  run = restore_run(workdir, step, config=config, vocab_size=data.tokenizer.vocab_size,
                    block_len=data.blocks.block_len, partial=True)
  mesh, model, params, step, missing = run.mesh, run.model, run.params, run.step, run.missing
  if missing:
    shown = sorted({"/".join(p[:3]) for p in missing})
    raise ConfigError("model", f"{workdir}/checkpoints/{step} lacks parameters this config "
                      f"needs: {', '.join(shown)} (is config.model the run's?)")
  fingerprint, dim = data.blocks.fingerprint, config.model.retrieval_dim
  frozen, root = None, published.index_root(workdir)
  latest = published.read_latest(root) if paths.isdir(root) else None
  if latest is not None:
    manifest = published.read_manifest(root, latest)
    # Open-QA runs keep one frozen index; other runs' must come from this very checkpoint.
    if reader or manifest["step"] == step:
      frozen = FrozenIndex.load(workdir, fingerprint, dim, latest)
      logger.info(f"[eval] index {root}/{latest} (blocks embedded at step {frozen.step})")
  if frozen is None:
    frozen = FrozenIndex.embed(model, mesh, config, data, params["retriever"], step,
                                  f"[eval] index of checkpoint {step}: ")
  return config, data, mesh, model, params, frozen, reader, step


def evaluate_run(config, workdir: str, step: int | None = None, split: str = "test",
                 retrieval_only: bool = False) -> tuple[dict, str]:
  """realm-eval: metrics + predictions of one checkpoint on one QA split, written under
  W/eval/<step>/. Returns (metrics, that directory)."""
  from realm_jax.data.qa import qa_split
  examples, counts = qa_split(config.qa, split, config.data.dir)   # bad specs fail first
  config, data, mesh, model, params, frozen, reader, step = load_run(
      config, workdir, step, retrieval_only)
  logger.info(f"[eval] {workdir} step {step}: {len(examples):,} {split} questions "
              f"({config.qa.get(split)}), skipped {counts or 'none'}; "
              f"{'reader + retrieval' if reader else 'retrieval only'}")
  evaluator = QAEvaluator(config, data, mesh, model, examples, frozen, reader, counts)
  metrics, predictions = evaluator.run(params)
  metrics.update(step=step, split=split, source=config.qa.get(split), reader=reader)
  out = write_results(workdir, step, metrics, predictions)
  logger.info(f"[eval] step {step} {split}: {format_metrics(metrics)} | {metrics['num_questions']} "
              f"questions, answer in no top-{metrics['reader_beam']} block: "
              f"{metrics['no_answer_in_top_k']}, truncated: {metrics['truncated_questions']}, "
              f"skipped: {counts or 'none'} ({metrics['seconds']:.1f}s) -> {out}")
  return metrics, out


def main(argv) -> None:
  from absl import flags
  from realm_jax.errors import run_cli
  from realm_jax.runtime.checkpoints import run_config
  flags_ = flags.FLAGS
  if len(argv) > 1:
    raise SystemExit(f"realm-eval: unexpected arguments {argv[1:]}")
  log.use_absl_verbosity()   # -v N; Orbax's and TFDS's INFO lines off the console
  step = flags_.step if flags_.step >= 0 else None
  run_cli("realm-eval", lambda: evaluate_run(run_config(flags_.workdir, flags_.config),
                                             flags_.workdir, step, flags_.split,
                                             flags_.retrieval_only))


def run() -> None:
  from absl import app, flags
  from ml_collections import config_flags
  from realm_jax.config.overrides import flags_parser
  config_flags.DEFINE_config_file("config", None, "Config file (default: W/config.json).",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory with checkpoints.", required=True)
  flags.DEFINE_integer("step", -1, "Checkpoint step (default: the latest).")
  flags.DEFINE_string("split", "test", "QA split: config.qa.<split> (train | dev | test).")
  flags.DEFINE_bool("retrieval_only", False, "Retrieval recall only (no reader).")
  sys.argv = upgrade_flags(sys.argv)   # old option names, with a warning
  app.run(main, flags_parser=flags_parser("realm-eval"))


if __name__ == "__main__":
  run()

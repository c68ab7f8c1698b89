"""The Open-QA fine-tuning loop (`config.task = "openqa"`): query tower and reader trained, block
tower and index frozen (ORQA; REALM sec. 4.2), several questions per step.

The frozen index is `W/index`'s latest version. A fresh run publishes it first: the index of
the run the retriever starts from (`init.retriever` or `init.from_workdir`) when that index was
built from the very checkpoint the retriever comes from
(an imported RealmForOpenQA, a REALM run whose builder indexed its final step), else the
blocks embedded with the starting block tower (an earlier start's index without a checkpoint is
not reused). Resuming reuses it, and refuses to go on without it, so every step of a run and
`realm-eval` afterwards retrieve from the same embeddings.
"""

from __future__ import annotations

import logging

import jax
import ml_collections
import numpy as np

from realm_jax import workdir as workdir_lib
from realm_jax.data import qa as qa_lib
from realm_jax.errors import ConfigError
from realm_jax.train.qa_eval import QAEvaluator, format_metrics
from realm_jax.retrieval import published
from realm_jax.runtime import multihost, partitioning, state as state_lib, embedders
from realm_jax.config.validation import validate_against_data
from realm_jax.runtime.metrics import MetricWriter
from realm_jax.train.run import Run, StepBatch, StepBatches, checked_data
from realm_jax.train.openqa_inputs import FrozenIndex, QABatchBuilder, QuestionBatches

logger = logging.getLogger(__name__)


class OpenQATrainer(Run):
  """One Open-QA fine-tuning run in `workdir`; `run()` trains and evaluates on `qa.dev`."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               lock: workdir_lib.JobLock | None = None):
    data = checked_data(config, workdir)
    validate_against_data(config, num_blocks=data.blocks.num_blocks,
                          store_block_len=data.blocks.block_len,
                          vocab_size=data.tokenizer.vocab_size)
    # `prepared:` questions where the blocks are read (`open_data`: a gcsfuse path not mounted
    # here as its bucket's)
    data_dir = workdir_lib.check_data_dir(config)
    self.train_qa, self.train_counts = qa_lib.qa_split(config.qa, "train", data_dir)
    if len(self.train_qa) < config.train.batch_size:
      raise ConfigError("train.batch_size", f"{config.train.batch_size} > the "
                        f"{len(self.train_qa)} training questions of {config.qa.train!r}")
    self.dev_qa, self.dev_counts = (qa_lib.qa_split(config.qa, "dev", data_dir)
                                    if config.qa.dev else ([], {}))
    self.questions = (config.qa.train, len(self.train_qa),
                      qa_lib.questions_fingerprint(self.train_qa))
    if workdir_lib.holds_checkpoints(workdir):   # before the run writes anything (config.json)
      workdir_lib.check_questions(workdir, *self.questions)
      FrozenIndex.check_blocks(workdir, data.blocks.fingerprint, data.dir)
    shards, count = partitioning.data_share(partitioning.make_mesh(config.mesh.shape))
    super().__init__(config, workdir, data, QuestionBatches(
        config, len(self.train_qa), shards, count), lock)
    self.frozen: FrozenIndex | None = None   # from `begin`

  def data_records(self) -> dict[str, str]:
    """The questions: the training batches index into qa.train's, the evaluation's batches
    (collectives) go over qa.dev's."""
    return {"the questions of qa.train": self.questions[2],
            "the questions of qa.dev": qa_lib.questions_fingerprint(self.dev_qa)}

  # -- checkpoints -------------------------------------------------------------------------
  def abstract_item(self) -> dict:
    return {"step": np.zeros((), np.int32)}

  def item(self) -> dict:
    return {"step": np.asarray(self.frozen.step, np.int32)}

  def frozen_index(self, init) -> FrozenIndex:
    """W/index's latest version; on a fresh run (`init`: where its params came from),
    published first (see the module doc)."""
    cfg, task = self.config, self.config.task
    fingerprint, dim = self.data.blocks.fingerprint, cfg.model.retrieval_dim
    root = published.index_root(self.workdir)
    if init is None:   # resumed: the index its steps so far retrieved from, nothing else
      frozen = FrozenIndex.load_required(self.workdir, fingerprint, dim,
                                         "the run resumes from a checkpoint")
      logger.info(f"[{task}] frozen index: {self.workdir}/index v{frozen.version} (blocks embedded "
                  f"at step {frozen.step})")
      return frozen
    earlier = published.read_latest(root)
    if earlier is not None and jax.process_index() == 0:
      logger.info(f"[{task}] a fresh start: {root} v{earlier}, of an earlier start that saved "
                  "no checkpoint, is not reused (its retriever may have come from elsewhere); "
                  "the index of this start is published after it")
    retriever = init.sources["retriever"]   # the run the retriever started from, its step
    origin = retriever.path if retriever.kind == "workdir" else ""
    init_step, source = init.steps.get("retriever", -1), None
    if origin and init_step >= 0:   # its index, if it embedded these blocks at that step
      source = FrozenIndex.of_step(origin, init_step, fingerprint, dim, latest_only=True)
      if source is not None:
        logger.info(f"[{task}] frozen index: the block embeddings of {origin}/index "
                    f"v{source.version} (step {init_step})")
    if source is None:
      source = FrozenIndex.embed(self.model, self.mesh, cfg, self.data,
                                 self.state.params["retriever"], max(init_step, 0),
                                 f"[{task}] frozen index: ")
    query = partitioning.host_copy(embedders.query_tower_params(self.state.params["retriever"]))
    if jax.process_index() == 0:
      published.publish_arrays(published.index_root(self.workdir), source.embeddings, query,
                               step=source.step, fingerprint=fingerprint,
                               keep=cfg.builder.keep_versions)
    multihost.after_first_process("frozen index published",   # all load the version written
                                  multihost.bulk_io_timeout())
    return FrozenIndex.load(self.workdir, fingerprint, dim)

  # -- the steps ---------------------------------------------------------------------------
  def begin(self, start: int, init) -> None:
    cfg = self.config
    if jax.process_index() == 0:   # checked in __init__ where the run resumes
      workdir_lib.record_questions(self.workdir, *self.questions)
    multihost.after_first_process("questions recorded")
    self.frozen = self.frozen_index(init)
    self.builder = QABatchBuilder(cfg, self.data, self.train_qa, self.frozen)
    self.evaluator = QAEvaluator(cfg, self.data, self.mesh, self.model, self.dev_qa,
                                 self.frozen, reader=True, counts=self.dev_counts,
                                 prefix=f"{self.prefix}eval ") if self.dev_qa else None
    if self.evaluator is None:
      logger.info(f"{self.prefix}qa.dev is empty: nothing is evaluated during training (eval.every "
                  "unused); realm-eval scores the run's checkpoints on qa.test afterwards")
    logger.info(
        f"{self.prefix}{state_lib.count_params(self.state.params) / 1e6:.2f}M params, mesh "
        f"{dict(self.mesh.shape)}, {cfg.train.batch_size} questions per step, steps "
        f"{start}->{cfg.train.steps}, {len(self.train_qa):,} training questions "
        f"({int(self.builder.truncated.sum())} truncated to {cfg.data.query_len} wordpieces; "
        f"skipped {self.train_counts or 'none'}), {self.frozen.num_blocks:,} blocks, top "
        f"{self.builder.n} for the retriever, top {self.builder.k} read")

  def open_batches(self, start: int, data_iter, preemption) -> QuestionStepBatches:
    return QuestionStepBatches(self, data_iter)

  def evaluates(self) -> bool:
    return self.evaluator is not None

  def evaluate(self, writer: MetricWriter, step: int, final: bool):
    metrics, _ = self.evaluator.run(self.state.params, keep_predictions=False)
    writer.write(step, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    logger.info(f"{self.prefix}eval @ {step} on {metrics['num_questions']} dev questions: "
                f"{format_metrics(metrics)} ({metrics['seconds']:.1f}s)")
    return metrics, []

  def summary_fields(self) -> dict:
    return {"train_questions": len(self.train_qa), "train_skipped": self.train_counts,
            "index_version": self.frozen.version, "index_step": self.frozen.step}


class QuestionStepBatches(StepBatches):
  """Open-QA's step batches: the questions' top blocks by the current query tower over the
  frozen index."""

  def __init__(self, run: OpenQATrainer, data_iter):
    self.run, self.data_iter = run, data_iter

  def next(self, step: int) -> StepBatch:
    run = self.run
    rows = next(self.data_iter)["rows"]
    data_state = self.data_iter.get_state()
    q_emb = embedders.query_embeddings(run.model, run.mesh, run.config, run.state.params,
                                       run.builder.question_ids[rows])
    ranked = run.frozen.index.search(q_emb, run.builder.n)
    return StepBatch(partitioning.global_batch(run.builder.train_batch(rows, ranked), run.mesh),
                     data_state)

  def progress(self, scalars: dict) -> tuple[str, str]:
    return (f"loss {scalars['loss']:.4g} (retriever {scalars['retriever_loss']:.3g}, reader "
            f"{scalars['reader_loss']:.3g}) answer in top {self.run.builder.k} "
            f"{scalars['answer_in_top_k']:.2f}", "")

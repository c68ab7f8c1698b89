"""The Open-QA fine-tuning loop (`config.task = "openqa"`): query tower and reader trained, block
tower and index frozen (ORQA; REALM sec. 4.2), several questions per step.

The frozen index is `W/index`'s latest version. A fresh run publishes it first: the index of
the run the retriever starts from (`init.retriever` or `init.from_workdir`) when that index was
built from the very checkpoint the retriever comes from
(an imported RealmForOpenQA, a REALM run whose builder indexed its final step), else the
blocks embedded with the starting block tower. Resuming reuses it, so every step of a run and
`realm-eval` afterwards retrieve from the same embeddings.
"""

from __future__ import annotations

import os
import time

import jax
import ml_collections
import numpy as np

from realm_jax import workdir as workdir_lib
from realm_jax.data import qa as qa_lib
from realm_jax.errors import ConfigError
from realm_jax.evaluate_qa import QAEvaluator, format_metrics
from realm_jax.retrieval import published
from realm_jax.train import initialization, multihost, partitioning, state as state_lib, \
    steps
from realm_jax.train.checkpoints import Checkpointer
from realm_jax.train.config_base import validate
from realm_jax.train.metrics import MetricWriter, format_duration, window_scalars
from realm_jax.train.preemption import Preemption
from realm_jax.train.openqa import FrozenIndex, QABatchBuilder, QuestionBatches, \
    query_embeddings


class OpenQATrainer:
  """One Open-QA fine-tuning run in `workdir`; `run()` trains and evaluates on `qa.dev`."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    validate(config)
    self.data = workdir_lib.open_data(config)
    validate(config, num_blocks=self.data.blocks.num_blocks,
             store_block_len=self.data.blocks.block_len,
             vocab_size=self.data.tokenizer.vocab_size)
    self.train_qa, self.train_counts = qa_lib.qa_split(config.qa, "train", config.data.dir)
    if len(self.train_qa) < config.train.batch_size:
      raise ConfigError("train.batch_size", f"{config.train.batch_size} > the "
                        f"{len(self.train_qa)} training questions of {config.qa.train!r}")
    self.dev_qa, self.dev_counts = (qa_lib.qa_split(config.qa, "dev", config.data.dir)
                                    if config.qa.dev else ([], {}))
    self.mesh = partitioning.make_mesh(config.mesh.shape)
    if config.train.batch_size % self.mesh.shape["data"]:
      raise ConfigError("train.batch_size", f"{config.train.batch_size} is not divisible by "
                        f"the data axis ({self.mesh.shape['data']})")
    workdir_lib.record_config(config, workdir)
    self.config, self.workdir = config, workdir
    self.model = state_lib.build_model(config, self.data.tokenizer.vocab_size)
    init_rng, self.step_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    self.state, self.shardings, self.abstract = state_lib.create_train_state(
        config, self.model, self.mesh, self.data.blocks.block_len, init_rng)
    self.train_step = steps.make_train_step(config, self.model, self.shardings, self.mesh)
    self.checkpointer = Checkpointer(workdir, config.train.keep_checkpoints,
                                     config.train.async_checkpoints)
    self.questions = QuestionBatches(config, len(self.train_qa), jax.process_index(),
                                     jax.process_count())
    self.saved_data = None
    self.retriever_workdir = ""     # the run the retriever started from (its index may serve)

  # -- start -------------------------------------------------------------------------------
  def restore_or_init(self) -> tuple[int, int]:
    """Resumes from the latest checkpoint, else starts from `init.*`. Returns (next step, the
    step of the checkpoint the params came from: the index must match it)."""
    task = self.config.task
    latest = self.checkpointer.latest_step()
    if latest is not None:
      self.state, self.saved_data, _ = self.checkpointer.restore(
          latest, self.abstract, {"step": np.zeros((), np.int32)})
      print(f"[{task}] resumed from {self.checkpointer.directory}/{latest}", flush=True)
      return int(self.saved_data["next_step"]), -1
    start = initialization.start_params(self.config, self.state.params, self.abstract.params,
                                        self.shardings.params, self.data.tokenizer.vocab_path,
                                        self.data.tokenizer.vocab_size)
    self.state = self.state.replace(params=start.params)
    start.print(f"[{task}] ")
    retriever = start.sources["retriever"]
    self.retriever_workdir = retriever.path if retriever.kind == "workdir" else ""
    return 0, start.steps.get("retriever", -1)

  def frozen_index(self, init_step: int) -> FrozenIndex:
    """W/index's latest version; on a fresh run, published first (see the module doc)."""
    cfg, task = self.config, self.config.task
    fingerprint, dim = self.data.blocks.fingerprint, cfg.model.retrieval_dim
    frozen = FrozenIndex.load(self.workdir, fingerprint, dim)
    if frozen is not None:
      print(f"[{task}] frozen index: {self.workdir}/index v{frozen.version} (blocks embedded "
            f"at step {frozen.step})", flush=True)
      return frozen
    source = None
    origin = self.retriever_workdir
    if origin and init_step >= 0:
      root = published.index_root(origin)
      latest = published.read_latest(root) if os.path.isdir(str(root)) else None
      if latest is not None and published.read_manifest(root, latest)["step"] == init_step:
        source = FrozenIndex.load(origin, fingerprint, dim, latest)
        print(f"[{task}] frozen index: the block embeddings of {origin}/index "
              f"v{latest} (step {init_step})", flush=True)
    if source is None:
      source = FrozenIndex.embed(self.model, self.mesh, cfg, self.data,
                                    self.state.params["retriever"], max(init_step, 0),
                                    f"[{task}] frozen index: ")
    query = partitioning.host_copy(steps.query_tower_params(self.state.params["retriever"]))
    if jax.process_index() == 0:
      published.publish_arrays(published.index_root(self.workdir), source.embeddings, query,
                               step=source.step, fingerprint=fingerprint,
                               keep=cfg.index.keep_versions)
    multihost.barrier("frozen index published")   # every process loads the version just written
    return FrozenIndex.load(self.workdir, fingerprint, dim)

  # -- the loop ----------------------------------------------------------------------------
  def run(self) -> dict:
    cfg, task = self.config, self.config.task
    start, init_step = self.restore_or_init()
    frozen = self.frozen_index(init_step)
    builder = QABatchBuilder(cfg, self.data, self.train_qa, frozen)
    evaluator = QAEvaluator(cfg, self.data, self.mesh, self.model, self.dev_qa, frozen,
                            reader=True, counts=self.dev_counts, prefix=f"[{task}] eval ") \
        if self.dev_qa else None
    total = cfg.train.steps
    print(f"[{task}] {state_lib.count_params(self.state.params) / 1e6:.2f}M params, mesh "
          f"{dict(self.mesh.shape)}, {cfg.train.batch_size} questions per step, steps "
          f"{start}->{total}, {len(self.train_qa):,} training questions "
          f"({int(builder.truncated.sum())} truncated to {cfg.data.query_len} wordpieces; "
          f"skipped {self.train_counts or 'none'}), {frozen.num_blocks:,} blocks, top "
          f"{builder.n} for the retriever, top {builder.k} read", flush=True)
    train_log, eval_log = MetricWriter(self.workdir, "train"), MetricWriter(self.workdir, "eval")
    data_iter = self.questions.iterator(cfg.data.prefetch, self.saved_data)
    t_start, t_last, window, eval_metrics = time.time(), time.time(), [], {}
    preemption, preempted = Preemption(cfg.train.preemption_grace_seconds, f"[{task}] "), None
    try:
      if evaluator is not None and cfg.eval.every and start == 0:
        eval_metrics = self.evaluate(evaluator, eval_log, 0)
      for step in range(start, total):
        rows = next(data_iter)["rows"]
        data_state = data_iter.get_state()
        q_emb = query_embeddings(self.model, self.mesh, cfg, self.state.params,
                                 builder.question_ids[rows])
        ranked = frozen.index.search(q_emb, builder.n)
        batch = partitioning.global_batch(builder.train_batch(rows, ranked), self.mesh)
        self.state, metrics = self.train_step(self.state, batch, self.step_rng)
        window.append(metrics)
        done = step + 1
        if done % cfg.train.log_every == 0 or done == total:
          now = time.time()
          scalars = window_scalars(window, now - t_last, float(
              state_lib.learning_rate_schedule(cfg.train)(done)))
          rate = scalars["steps_per_second"]
          train_log.write(done, scalars)
          print(f"[{task}] step {done}/{total} loss {scalars['loss']:.4g} (retriever "
                f"{scalars['retriever_loss']:.3g}, reader {scalars['reader_loss']:.3g}) answer "
                f"in top {builder.k} {scalars['answer_in_top_k']:.2f} | {rate:.2f} steps/s ETA "
                f"{format_duration((total - done) / max(rate, 1e-9))}", flush=True)
          window, t_last = [], now
        if evaluator is not None and cfg.eval.every and done % cfg.eval.every == 0 \
            and done != total:
          eval_metrics = self.evaluate(evaluator, eval_log, done)
        stop = preemption.reached(done)   # the same answer on every process
        if done % cfg.train.checkpoint_every == 0 or done == total or stop:
          self.checkpointer.save(done, self.state, self.questions.state(data_state, done),
                                 {"step": np.asarray(frozen.step, np.int32)})
        if stop:
          preemption.saved(done, self.checkpointer)
          preempted = done
          break
      if evaluator is not None and preempted is None:
        eval_metrics = self.evaluate(evaluator, eval_log, total)
    finally:
      preemption.close()
      data_iter.close()
      self.checkpointer.close()
      train_log.close()
      eval_log.close()
    if preempted is not None:   # no summary.json: the run is not over
      return {"task": task, "preempted_at_step": preempted,
              "wall_seconds": round(time.time() - t_start, 1)}
    summary = {"task": task, "steps": total, "wall_seconds": round(time.time() - t_start, 1),
               "params": state_lib.count_params(self.state.params),
               "train_questions": len(self.train_qa), "train_skipped": self.train_counts,
               "index_version": frozen.version, "index_step": frozen.step,
               **{f"eval_{k}": v for k, v in eval_metrics.items()}}
    if jax.process_index() == 0:
      workdir_lib.write_summary(self.workdir, summary)
    return summary

  def evaluate(self, evaluator: QAEvaluator, writer: MetricWriter, step: int) -> dict:
    metrics, _ = evaluator.run(self.state.params, keep_predictions=False)
    writer.write(step, {k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    print(f"[{self.config.task}] eval @ {step} on {metrics['num_questions']} dev questions: "
          f"{format_metrics(metrics)} ({metrics['seconds']:.1f}s)", flush=True)
    return metrics

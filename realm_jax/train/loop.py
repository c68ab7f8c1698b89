"""The training loop of every stage (`config.task` = ict | realm): setup, resume, index refresh,
steps, metrics, evaluation, checkpoints, summary."""

from __future__ import annotations

import time

import jax
import ml_collections
import numpy as np

from realm_jax import workdir as workdir_lib
from realm_jax.errors import ConfigError
from realm_jax.evaluate import Evaluator
from realm_jax.retrieval import published
from realm_jax.retrieval.index import ExactIndex, LoadedIndex, embed_blocks
from realm_jax.retrieval.subscriber import IndexSubscriber, load_version
from realm_jax.train import batches, initialization, partitioning, state as state_lib, steps
from realm_jax.train.feed import BatchFeed, IndexSchedule
from realm_jax.train.checkpoints import Checkpointer
from realm_jax.train.config_base import uses_index_builder, validate
from realm_jax.train.metrics import MetricWriter, format_duration, window_scalars
from realm_jax.train.preemption import Preemption


class Trainer:
  """One stage's run in `workdir`; `run()` trains to `config.train.steps` and evaluates."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    validate(config)
    self.data = workdir_lib.open_data(config)
    stats = self.data.stats
    validate(config, num_blocks=self.data.blocks.num_blocks,
             store_block_len=self.data.blocks.block_len,
             max_sentence_len=stats["max_sentence_len"], vocab_size=self.data.tokenizer.vocab_size)
    try:
      self.examples = self.data.examples(config.data.split)
    except FileNotFoundError as e:
      raise ConfigError("data.split", str(e)) from None
    if len(self.examples) < config.train.batch_size:
      raise ConfigError("train.batch_size", f"{config.train.batch_size} > the "
                        f"{len(self.examples)} examples of split {config.data.split!r}")
    self.mesh = partitioning.make_mesh(config.mesh.shape)
    if config.train.batch_size % self.mesh.shape["data"]:
      raise ConfigError("train.batch_size", f"{config.train.batch_size} is not divisible by "
                        f"the data axis ({self.mesh.shape['data']})")
    self.queries = batches.QueryBatches(config, self.data, self.examples, jax.process_index(),
                                        jax.process_count())
    workdir_lib.record_config(config, workdir)
    self.config, self.workdir = config, workdir
    self.model = state_lib.build_model(config, self.data.tokenizer.vocab_size)
    self.rng = jax.random.PRNGKey(config.seed)
    init_rng, self.step_rng = jax.random.split(self.rng)
    self.state, self.shardings, self.abstract = state_lib.create_train_state(
        config, self.model, self.mesh, self.data.blocks.block_len, init_rng)
    self.train_step = steps.make_train_step(config, self.model, self.shardings, self.mesh)
    # REALM batches retrieve from the index; ICT uses one only to measure recall.
    self.retrieves = config.task == "realm" and config.retrieval.mode == "index"
    self.uses_index = config.task == "ict" or self.retrieves
    # async | deterministic: the index comes from the separate realm-index job via W/index.
    self.from_builder = uses_index_builder(config)
    self.index: LoadedIndex | None = None   # in_process: the latest rebuild
    self.index_params = None        # in_process: the retriever snapshot it was built from
    self.last_index: LoadedIndex | None = None   # the index that served the last step
    self.saved_data = None          # the data item of the checkpoint resumed from
    self.checkpointer = Checkpointer(workdir, config.train.keep_checkpoints,
                                     config.train.async_checkpoints)
    realm_eval = steps.make_realm_eval(config, self.model, self.mesh) \
        if config.task == "realm" else None
    self.evaluator = Evaluator(config, self.data, self.mesh, realm_eval)
    if config.task == "ict" and not self.evaluator.has_answers:
      self.uses_index = False       # real text: no ground truth for ICT recall, no index needed
    self.subscriber = None
    if self.from_builder and jax.process_index() == 0:
      workdir_lib.record_block_store(workdir, self.data)
      self.subscriber = IndexSubscriber(workdir, self._load_version, config.index.poll_seconds,
                                        f"[{config.task}] ")
    self.schedule = IndexSchedule(config, self.subscriber, _all_hosts_have) \
        if self.retrieves else None

  # -- retrieval ---------------------------------------------------------------------------
  def _query_encoder(self, query_params):
    return steps.QueryEncoder(self.model, self.config, query_params)

  def _load_version(self, version: int) -> LoadedIndex:
    template = steps.query_tower_params(self.abstract.params["retriever"])
    return load_version(published.index_root(self.workdir), version, config=self.config,
                        fingerprint=self.data.blocks.fingerprint, query_template=template,
                        make_encoder=self._query_encoder)

  def refresh_index(self, retriever_params, step: int) -> None:
    """Rebuilds the block index in-process from `retriever_params` (a snapshot at `step`)."""
    version = 0 if self.index is None else self.index.version + 1
    self.index_params = retriever_params
    embed_fn = steps.block_embedder(self.model, self.mesh, self.config, retriever_params)
    embeddings, _ = embed_blocks(embed_fn, self.data.blocks, self.mesh,
                                 self.config.retrieval.embed_batch_size,
                                 log_prefix=f"[{self.config.task}] index v{version}: ")
    self.index = LoadedIndex(version=version, step=step,
                             index=ExactIndex.from_embeddings(embeddings),
                             encode_queries=self._query_encoder(
                                 steps.query_tower_params(retriever_params)))

  def _snapshot(self):
    """A copy of the current retriever params (the state's buffers are donated every step)."""
    return jax.tree.map(lambda x: x.copy(), self.state.params["retriever"])

  def _in_process_refresh(self, step: int, start: int) -> None:
    """Before `step` (in_process): rebuild at multiples of refresh_every and tell the feed."""
    every = self.config.retrieval.refresh_every
    horizon = (step // every + 1) * every - 1
    if self.index is None or (step % every == 0 and step != self.index.step):
      self.refresh_index(self._snapshot(), step)
      self.schedule.announce(step, self.index, horizon)
    elif step == start:
      self.schedule.announce(step, self.index, horizon)

  def _assemble(self, step: int, queries: dict[str, np.ndarray]):
    """Step `step`'s host batch from its queries (runs in the feed thread)."""
    cfg = self.config
    if cfg.task == "ict":
      return queries, {}
    retrieved, used = None, {}
    if self.retrieves:
      loaded, waited = self.schedule.for_step(step)
      retrieved = loaded.retrieve(queries["query_ids"], cfg.retrieval.k + 1)
      used = {"index": loaded, "wait_seconds": waited}
    cand = batches.candidates_for(cfg, self.data, queries, retrieved, training=True)
    return batches.realm_batch(cfg, self.data, queries, cand), used

  # -- checkpoints -------------------------------------------------------------------------
  def _retrieval_item(self) -> dict:
    index = self.last_index or self.index
    # A host value: Orbax writes it from the primary process.
    item = {"step": np.asarray(-1 if index is None else index.step, np.int32)}
    if self.retrieves and not self.from_builder:
      item["params"] = self.index_params
    return item

  def restore_or_init(self) -> int:
    """Resumes from the latest checkpoint, else starts each part from its `config.init`
    source (train/initialization.py)."""
    latest = self.checkpointer.latest_step()
    if latest is not None:
      abstract_retrieval = {"step": np.zeros((), np.int32)}
      if self.retrieves and not self.from_builder:
        abstract_retrieval["params"] = self.abstract.params["retriever"]
      self.state, data_state, retrieval = self.checkpointer.restore(
          latest, self.abstract, abstract_retrieval)
      self.saved_data = data_state
      if "params" in retrieval:
        self.refresh_index(retrieval["params"], int(retrieval["step"]))
      print(f"[{self.config.task}] resumed from {self.checkpointer.directory}/{latest} "
            f"(data at step {data_state['next_step']})", flush=True)
      return int(data_state["next_step"])
    start = initialization.start_params(self.config, self.state.params, self.abstract.params,
                                        self.shardings.params, self.data.tokenizer.vocab_path,
                                        self.data.tokenizer.vocab_size)
    self.state = self.state.replace(params=start.params)
    start.print(f"[{self.config.task}] ")
    return 0

  def _save(self, done: int, data_state: dict) -> None:
    self.checkpointer.save(done, self.state, self.queries.state(data_state, done),
                           self._retrieval_item())

  def _checkpoint_due(self, done: int) -> bool:
    cfg = self.config
    return (done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps
            or self.from_builder and done % cfg.retrieval.refresh_every == 0)

  # -- the loop ----------------------------------------------------------------------------
  def run(self) -> dict:
    cfg, task = self.config, self.config.task
    start = self.restore_or_init()
    total = cfg.train.steps
    n_params = state_lib.count_params(self.state.params)
    print(f"[{task}] {n_params / 1e6:.2f}M params, mesh {dict(self.mesh.shape)}, "
          f"batch {cfg.train.batch_size}, steps {start}->{total}, "
          f"{self.data.blocks.num_blocks:,} blocks, {len(self.examples):,} queries" +
          (f", index from realm-index ({cfg.retrieval.refresh}, {cfg.retrieval.backend})"
           if self.from_builder else ""), flush=True)
    if self.from_builder and jax.process_index() == 0:
      workdir_lib.clear_done(self.workdir)
    train_log, eval_log = MetricWriter(self.workdir, "train"), MetricWriter(self.workdir, "eval")
    retrieval_log = MetricWriter(self.workdir, "retrieval") if self.retrieves else None
    depth = max(1, cfg.data.prefetch)
    data_iter = self.queries.iterator(cfg.data.prefetch, self.saved_data)
    feed = None
    t_start, t_last, window = time.time(), time.time(), []
    eval_metrics, staleness, versions_used = {}, [], set()
    preemption, preempted = Preemption(cfg.train.preemption_grace_seconds, f"[{task}] "), None
    try:
      if self.from_builder and start == 0:
        self._save(0, data_iter.get_state())   # the builder's first snapshot
      if self.from_builder and cfg.retrieval.refresh == "async":
        self.last_index = self.schedule.start_async(start, depth)
      if cfg.eval.every and start == 0 and self.uses_index:
        # The starting point of the curves: the retriever (and reader) as this stage got them.
        if not self.from_builder and self.index is None:
          self.refresh_index(self._snapshot(), 0)
        self.evaluate(eval_log, 0, refresh=False)
      feed = BatchFeed(data_iter, self._assemble, start, depth)
      t_step = time.time()
      for step in range(start, total):
        if self.retrieves and not self.from_builder:
          self._in_process_refresh(step, start)
        elif self.from_builder and cfg.retrieval.refresh == "async":
          self.schedule.advance_async(step, depth)
        t_feed = time.time()
        host, used, data_state = feed.next()
        feed_wait = time.time() - t_feed
        batch = partitioning.global_batch(host, self.mesh)
        self.state, metrics = self.train_step(self.state, batch, self.step_rng)
        window.append(metrics)
        done = step + 1
        if "index" in used:
          self.last_index = used["index"]
          staleness.append(step - self.last_index.step)
          versions_used.add(self.last_index.version)
          if self.from_builder:   # per-step wall time, to see what the builder costs us
            jax.block_until_ready(metrics)
          now = time.time()
          retrieval_log.write(done, {"index_version": self.last_index.version,
                                     "index_step": self.last_index.step,
                                     "index_staleness": staleness[-1],
                                     "index_wait_seconds": used["wait_seconds"],
                                     "batch_wait_seconds": feed_wait,
                                     "step_seconds": now - t_step})
          t_step = now
        if done % cfg.train.log_every == 0 or done == total:
          now = time.time()
          scalars = window_scalars(window, now - t_last, float(
              state_lib.learning_rate_schedule(cfg.train)(done)))
          rate = scalars["steps_per_second"]
          if staleness:
            scalars["index_staleness"] = staleness[-1]
          train_log.write(done, scalars)
          shown = " ".join(f"{k} {scalars[k]:.4g}" for k in ("loss", "retrieval_utility",
                                                             "ict_accuracy") if k in scalars)
          index_note = (f" | index v{self.last_index.version} (step {self.last_index.step}, "
                        f"staleness {staleness[-1]})") if staleness else ""
          print(f"[{task}] step {done}/{total} {shown} | {rate:.2f} steps/s "
                f"ETA {format_duration((total - done) / max(rate, 1e-9))}{index_note}",
                flush=True)
          window, t_last = [], now
        if cfg.eval.every and done % cfg.eval.every == 0 and done != total:
          eval_metrics = self.evaluate(eval_log, done, refresh=cfg.task == "ict")[0]
        stop = preemption.reached(done)   # the same answer on every process
        if self._checkpoint_due(done) or stop:
          self._save(done, data_state)
        if stop:
          preemption.saved(done, self.checkpointer)
          preempted = done
          break
      # The feed thread is building batches past the last step and may be waiting for an index
      # that will not come: release it before joining it.
      if self.schedule is not None:
        self.schedule.close()
      if preempted is not None and self.subscriber is not None:
        self.subscriber.close()
      feed.close()
      feed = None
      if preempted is None:
        if self.from_builder:
          # The final evaluation retrieves from the index of the final parameters, as
          # in_process does.
          self.last_index = self.subscriber.wait_for_step(total,
                                                          cfg.retrieval.first_index_timeout)
        eval_metrics, details = self.evaluate(eval_log, total,
                                              refresh=self.uses_index and not self.from_builder,
                                              keep_examples=5)
    finally:
      preemption.close()
      if feed is not None:
        if self.schedule is not None:
          self.schedule.close()
        feed.close()
      if self.subscriber is not None:
        self.subscriber.close()
      data_iter.close()
      self.checkpointer.close()
      for log in (train_log, eval_log, retrieval_log):
        if log is not None:
          log.close()
    if preempted is not None:   # no summary.json, no DONE: the run is not over
      return {"task": task, "preempted_at_step": preempted,
              "wall_seconds": round(time.time() - t_start, 1)}
    summary = {"task": task, "steps": total, "wall_seconds": round(time.time() - t_start, 1),
               "params": n_params, **{f"eval_{k}": v for k, v in eval_metrics.items()}}
    if staleness:
      summary.update(self._retrieval_summary(staleness, versions_used))
      print(f"[{task}] index staleness p50 {summary['index_staleness_p50']:g} p95 "
            f"{summary['index_staleness_p95']:g} max {summary['index_staleness_max']} over "
            f"{len(staleness)} steps; {summary['index_versions_used']} versions used; "
            f"{summary['index_blocking_waits']} blocking waits after the first index "
            f"({summary['index_wait_seconds']:.1f}s)", flush=True)
    if jax.process_index() == 0:
      workdir_lib.write_summary(self.workdir, {**summary, "examples": details})
      if self.from_builder:
        workdir_lib.mark_done(self.workdir, total)   # tells realm-index to exit
    summary["examples"] = details
    return summary

  def _retrieval_summary(self, staleness: list[int], versions_used: set[int]) -> dict:
    """Over the steps this process ran (a resumed run: since the resume)."""
    waits = self.schedule.waits
    return {"index_staleness_p50": float(np.percentile(staleness, 50)),
            "index_staleness_p95": float(np.percentile(staleness, 95)),
            "index_staleness_max": int(max(staleness)),
            "index_versions_used": len(versions_used),
            "index_blocking_waits": len(waits),
            "index_wait_seconds": round(float(sum(w for _, w in waits)), 2),
            "index_rejected": len(self.subscriber.rejected) if self.subscriber else 0}

  def evaluate(self, writer: MetricWriter, step: int, refresh: bool, keep_examples: int = 0):
    """Eval metrics at `step`; `refresh` rebuilds the index from the current params first."""
    t0 = time.time()
    if refresh:
      self.refresh_index(self._snapshot(), step)
    index = None
    if self.uses_index:
      if self.from_builder and self.last_index is None:   # deterministic, before step 0
        self.last_index = self.subscriber.wait_for_step(0, self.config.retrieval
                                                        .first_index_timeout)
      index = self.last_index if self.from_builder else self.index
    metrics, details = self.evaluator.run(self.state.params, index, keep_examples)
    if index is not None:
      metrics["index_step"] = float(index.step)
    writer.write(step, metrics)
    shown = " ".join(f"{k} {v:.3f}" for k, v in metrics.items()
                     if k not in ("num_examples", "index_step")) \
        or "nothing to measure (no recall ground truth in this data, no reader to score)"
    print(f"[{self.config.task}] eval @ {step}: {shown} ({time.time() - t0:.1f}s)", flush=True)
    return metrics, details


def _all_hosts_have(version: int) -> bool:
  """Whether every process has loaded index `version` (they switch at the same step)."""
  if jax.process_count() == 1:
    return True
  from jax.experimental import multihost_utils
  versions = multihost_utils.process_allgather(np.asarray(version, np.int64))
  return bool((np.asarray(versions) == version).all())


def train(config, workdir: str) -> dict:
  """Runs one stage; returns its summary (also written to `workdir/summary.json`)."""
  if config.task == "openqa":
    from realm_jax.train.openqa_loop import OpenQATrainer
    return OpenQATrainer(config, workdir).run()
  return Trainer(config, workdir).run()

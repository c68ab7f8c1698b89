"""Pre-training (`config.task` = ict | realm) on the run skeleton of train/run.py: the query
batches, their candidates (train/candidates.py says where they come from), the evaluation on
held-out queries, the index figures of the summary."""

from __future__ import annotations

import logging
import time

import jax
import ml_collections
import numpy as np

from realm_jax import workdir as workdir_lib
from realm_jax.errors import ConfigError
from realm_jax.train.masked_eval import Evaluator
from realm_jax.train import batches, candidate_rows, steps
from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.train.best_export import BestExport
from realm_jax.train.candidates import candidate_source
from realm_jax.config.validation import validate_against_data
from realm_jax.train.feed import BatchFeed
from realm_jax.runtime.metrics import MetricWriter
from realm_jax.retrieval.scann_index import check_corpus
from realm_jax.train.run import Run, StepBatch, StepBatches, checked_data
from realm_jax.train.score_cache import ScoreCache, cache_keys

logger = logging.getLogger(__name__)

# The figures of a progress line: REALM trained without the null document has no utility to
# show, but the entropy of p(z|x) shows the retriever committing to blocks.
_SHOWN = ("loss", "distill_kl", "retrieval_utility", "retrieval_entropy", "ict_accuracy")
# the key of a checkpoint's data item that holds the batches packed up to its step (none: 0)
PACKED_BATCHES = "query_batches_packed"
# the keys of a checkpoint's data item that hold the score cache's counts up to its step (none:
# 0): the reader forwards it saved, those it made, the rows the reader ran on for them
CACHE_COUNTS = ("score_cache_reader_forwards_saved", "score_cache_reader_forwards",
                "score_cache_reader_rows")


class Trainer(Run):
  """One pre-training stage in `workdir`; `run()` trains to `config.train.steps` and
  evaluates."""

  keep_examples = 5

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               lock: workdir_lib.JobLock | None = None):
    data = checked_data(config, workdir)
    self.examples = query_examples(config, data)
    self.trained_on = (config.data.split, len(self.examples), self.examples.fingerprint)
    if workdir_lib.holds_checkpoints(workdir):   # before the run writes anything (config.json)
      workdir_lib.check_examples(workdir, data.dir, *self.trained_on)
    shards, count = partitioning.data_share(partitioning.make_mesh(config.mesh.shape))
    super().__init__(config, workdir, data, batches.QueryBatches(
        config, data, self.examples, shards, count), lock)
    realm_eval = steps.make_realm_eval(config, self.model, self.mesh) \
        if config.task == "realm" else None
    self.evaluator = Evaluator(config, self.data, self.mesh, realm_eval)
    self.candidates = candidate_source(
        config, workdir, model=self.model, mesh=self.mesh, data=self.data,
        abstract_retriever=self.abstract.params["retriever"], snapshot=self._snapshot,
        has_answers=self.evaluator.has_answers)
    self.best = BestExport(workdir, config) \
        if config.task == "realm" and config.eval.get("export_best", False) else None
    self.step_batches: QueryStepBatches | None = None   # from `open_batches`

  def _snapshot(self):
    """A copy of the current retriever params (the state's buffers are donated every step)."""
    return jax.tree.map(lambda x: x.copy(), self.state.params["retriever"])

  # -- checkpoints -------------------------------------------------------------------------
  def abstract_item(self) -> dict:
    return self.candidates.abstract_item()

  def item(self) -> dict:
    return self.candidates.item()

  def resumed(self, item: dict) -> None:
    self.candidates.restore(item)

  def checkpoint_due(self, done: int) -> bool:
    return super().checkpoint_due(done) or self.candidates.checkpoint_due(done)

  def carried(self) -> dict:
    return {**super().carried(),
            **(self.step_batches.carried() if self.step_batches is not None else {})}

  # -- the steps ---------------------------------------------------------------------------
  def begin(self, start: int, init) -> None:
    cfg = self.config
    if jax.process_index() == 0:   # checked in __init__ where the run resumes
      workdir_lib.record_examples(self.workdir, *self.trained_on)
    if init is not None:   # a fresh start: no earlier start's index versions; its own export
      self.candidates.start_over()
      if self.best is not None:
        self.best.start_over(self.prefix, init)
    n_params = state_lib.count_params(self.state.params)
    logger.info(f"{self.prefix}{n_params / 1e6:.2f}M params, mesh {dict(self.mesh.shape)}, batch "
                f"{cfg.train.batch_size}, steps {start}->{cfg.train.steps}, "
                f"{self.data.blocks.num_blocks:,} blocks, {len(self.examples):,} queries"
                f"{self._cut_note()}{self.candidates.describe()}")

  def long_query_figures(self) -> dict:
    """data.long_queries "cut": the training queries cut to query_len - 2 wordpieces; the
    eval queries cut, and of them those cut to the window holding their target span (it lies
    past the first query_len - 2). Nothing under "refuse" (no query is cut)."""
    if self.config.data.get("long_queries", "refuse") != "cut":
      return {}
    room = self.config.data.query_len - 2
    return {"queries_cut": int((self.examples.lengths > room).sum()),
            "eval_queries_cut": self.evaluator.cut,
            "eval_queries_windowed": self.evaluator.windowed}

  def _cut_note(self) -> str:
    figures = self.long_query_figures()
    if not figures:
      return ""
    return (f" ({figures['queries_cut']:,} cut to {self.config.data.query_len - 2} wordpieces, "
            f"data.long_queries 'cut'; of the {len(self.evaluator.rows):,} eval queries "
            f"{figures['eval_queries_cut']:,} cut, {figures['eval_queries_windowed']:,} of "
            "them to the window holding their target span)")

  def open_batches(self, start: int, data_iter, preemption) -> QueryStepBatches:
    """The candidate source begins (a published index: the first snapshot saved, the first
    version awaited, FeedStopped on a SIGTERM then); the score cache starts empty (the reader
    is frozen: read once)."""
    depth = max(1, self.config.data.prefetch)

    def save_first_snapshot() -> None:
      """Step 0's checkpoint, the builder's first snapshot, unless the run resumed from it
      (stopped before its first refresh step's checkpoint)."""
      if 0 not in self.checkpointer.all_steps():
        self.save(0, data_iter.get_state())
    self.candidates.begin(start, depth, save_first_snapshot, preemption.requested,
                          preemption.noticed)
    score_cache = ScoreCache(self.config, self.model, self.state.params["reader"],
                             self.inputs.local_batch) \
        if self.config.retrieval.get("score_cache", False) else None
    self.step_batches = QueryStepBatches(
        self.config, self.data, self.mesh, self.candidates, score_cache, data_iter, start, depth,
        self.inputs.pack, carried=self.saved_data)
    return self.step_batches

  def evaluates_at_start(self) -> bool:
    return self.candidates.measures   # the starting point of the curves

  def close(self) -> None:
    self.candidates.close()

  # -- evaluation and summary --------------------------------------------------------------
  def evaluate(self, writer: MetricWriter, step: int, final: bool):
    """Eval metrics at `step` (and, `final`, examples with their evidence)."""
    t0 = time.time()
    index = self.candidates.eval_index(step, final) if self.candidates.measures else None
    metrics, details = self.evaluator.run(self.state.params, index,
                                          self.keep_examples if final else 0)
    if index is not None:
      metrics["index_step"] = int(index.step)
    writer.write(step, metrics)
    why = (f"eval.split {self.config.eval.split!r} holds no examples"
           if not len(self.evaluator.rows) else
           "no recall ground truth in this data, no reader to score")
    shown = " ".join(f"{k} {v:.3f}" for k, v in metrics.items()
                     if k not in ("num_examples", "index_step")) or f"nothing to measure ({why})"
    logger.info(f"{self.prefix}eval @ {step}: {shown} ({time.time() - t0:.1f}s)")
    if self.best is not None:
      self.best.consider(step, metrics, self.state.params, self.prefix)
    return metrics, details

  def summary_fields(self) -> dict:
    return {**(self.best.summary() if self.best is not None else {}),
            **self.long_query_figures()}

  def finished(self, summary: dict) -> None:
    self.candidates.finished(summary["steps"])


def query_examples(config: ml_collections.ConfigDict, data) -> list:
  """The training queries of `data.split`, with the config checked against the data (the
  widest span masked: REALM's training spans, and the target spans of the `eval.num_examples`
  of `eval.split` (`checked_data` found it) that evaluations mask)."""
  try:
    examples = data.examples(config.data.split)
  except FileNotFoundError as e:
    raise ConfigError("data.split", str(e)) from None
  validate_against_data(config, num_blocks=data.blocks.num_blocks,
                        store_block_len=data.blocks.block_len,
                        max_sentence_len=data.stats["max_sentence_len"],
                        vocab_size=data.tokenizer.vocab_size,
                        widest_span=max(
                            examples.widest_span() if config.task == "realm" else 0,
                            data.examples(config.eval.split).widest_span(
                                config.eval.num_examples, targets=True)))
  check_corpus(config, data.blocks.num_blocks)   # realm-index's settings, before it builds
  if len(examples) < config.train.batch_size:
    raise ConfigError("train.batch_size", f"{config.train.batch_size} > the "
                      f"{len(examples)} examples of split {config.data.split!r}")
  return examples


class QueryStepBatches(StepBatches):
  """Pre-training's step batches: the queries from the input pipeline, their candidates from
  the candidate source (which swaps the index before the step that first uses a new one),
  the reader scores from the score cache where it has them; built `depth` steps ahead in the
  batch feed's thread."""

  def __init__(self, config, data, mesh, candidates, score_cache: ScoreCache | None,
               data_iter, start: int, depth: int, pack, carried: dict | None = None):
    self.config, self.data, self.mesh, self.pack = config, data, mesh, pack
    self.candidates, self.score_cache = candidates, score_cache
    self.rows = candidate_rows.of(config)
    self.data_iter, self.start, self.depth = data_iter, start, depth
    self.feed: BatchFeed | None = None   # started by the first `next` (after the first eval)
    # the counts of the steps so far, from those before `start` on (`carried`: the data item
    # of the checkpoint resumed from): the score cache's, and the batches whose queries were
    # packed (retrieval.packed_query_rows)
    carried = carried or {}
    self.cache_hits, self.cache_reads, self.cache_rows = (int(carried.get(k, 0))
                                                          for k in CACHE_COUNTS)
    self.packed_batches = int(carried.get(PACKED_BATCHES, 0))

  def carried(self) -> dict:
    """The counts a checkpoint saved now keeps for a resumed run, each where it is not 0."""
    counts = {PACKED_BATCHES: self.packed_batches, **dict(zip(
        CACHE_COUNTS, (self.cache_hits, self.cache_reads, self.cache_rows)))}
    return {k: v for k, v in counts.items() if v}

  def next(self, step: int) -> StepBatch:
    self.candidates.before_step(step, self.start, self.depth)
    if self.feed is None:
      self.feed = BatchFeed(self.data_iter, self._assemble, self.start, self.depth,
                            end=self.config.train.steps)
    t_feed = time.time()
    if self.candidates.waits_for_index(step, self.start):   # on every process alike
      host, used, data_state = self.feed.next_together(self.candidates.stop_waiting,
                                                       self.config.retrieval.index_timeout)
    else:
      host, used, data_state = self.feed.next(self.candidates.should_stop)
    used["feed_wait"] = time.time() - t_feed
    return StepBatch(partitioning.global_batch(host, self.mesh), data_state, used)

  def _assemble(self, step: int, queries: dict[str, np.ndarray]):
    """Step `step`'s host batch from its queries (runs in the feed thread)."""
    cfg = self.config
    if cfg.task == "ict":
      return queries, {}
    loaded, waited = self.candidates.for_step(step)
    retrieved, used = None, {}
    if loaded is not None:   # ("mixed" reads one block whatever k: at most the corpus)
      retrieved = loaded.retrieve(queries["query_ids"],
                                  min(cfg.retrieval.k + 1, self.data.blocks.num_blocks))
      used = {"index": loaded, "wait_seconds": waited}
    cand = self.rows.rows(self.data, queries, retrieved, training=True)
    batch = batches.realm_batch(cfg, self.data, queries, cand)
    used["packed"] = self.pack(step, batch, self.mesh.shape["data"])
    if not cfg.retrieval.get("block_gradients", True) and loaded is not None:
      batch["candidate_emb"] = batches.index_embeddings(loaded, cand)
    if self.score_cache is not None:
      batch, hits, reads, rows = self.score_cache.fill(batch, cache_keys(queries, cand))
      used["score_cache"] = (hits, reads, rows)
    return batch, used

  def served(self, done: int, fed: StepBatch, metrics) -> None:
    used = fed.used
    self.packed_batches += used.get("packed", False)
    if "score_cache" in used:
      hits, reads, rows = used["score_cache"]
      self.cache_hits += hits
      self.cache_reads += reads
      self.cache_rows += rows
    if "index" in used:
      self.candidates.served(done, used["index"], used["wait_seconds"], used["feed_wait"],
                             metrics)

  def progress(self, scalars: dict) -> tuple[str, str]:
    if self.candidates.staleness:
      scalars["index_staleness"] = self.candidates.staleness.last
    note = self.candidates.progress_note()
    if self.score_cache is not None:
      note += (f" | score cache {len(self.score_cache):,} pairs "
               f"({self.score_cache.megabytes():.0f} MB"
               f"{', full' if self.score_cache.full() else ''}), hit rate "
               f"{self._cache_figures()['score_cache_hit_rate']:.2f}")
    return " ".join(f"{k} {scalars[k]:.4g}" for k in _SHOWN if k in scalars), note

  def _cache_figures(self) -> dict:
    """The score cache's figures: this process's look-ups over the run's steps (a resumed run:
    with those before its checkpoint, which keeps the first process's, the one that writes
    the summary), and what the cache holds now."""
    looked_up = max(self.cache_hits + self.cache_reads, 1)
    return {"score_cache_hit_rate": round(self.cache_hits / looked_up, 4),
            "score_cache_reader_forwards_saved": self.cache_hits,
            "score_cache_reader_forwards": self.cache_reads,
            # what the reader ran on for them: whole chunks (score_cache.read_chunk)
            "score_cache_reader_rows": self.cache_rows,
            # what it holds at the end (retrieval.score_cache_gb bounds it)
            "score_cache_pairs": len(self.score_cache),
            "score_cache_megabytes": round(self.score_cache.megabytes(), 1)}

  def stop(self, preempted: bool) -> None:
    # The feed thread is building batches past the last step and may be waiting for an index
    # that will not come: release it before joining it.
    self.candidates.stop_feeding(preempted)
    if self.feed is not None:
      self.feed.close()
      self.feed = None

  def close(self) -> None:
    if self.feed is not None:
      self.stop(True)

  def summary(self) -> dict:
    figures = self.candidates.summary()
    if self.score_cache is not None:
      cache = self._cache_figures()
      logger.info(
          f"[{self.config.task}] score cache: {cache['score_cache_reader_forwards_saved']:,} "
          f"reader forwards saved, {cache['score_cache_reader_forwards']:,} made in "
          f"{cache['score_cache_reader_rows']:,} rows (hit rate "
          f"{cache['score_cache_hit_rate']:.3f}); it holds {cache['score_cache_pairs']:,} "
          f"pairs in {cache['score_cache_megabytes']:,.1f} MB")
      figures = {**figures, **cache}
    if self.config.retrieval.get("packed_query_rows", 0):
      figures["query_batches_packed"] = self.packed_batches   # the others: one query a row
      logger.info(f"[{self.config.task}] queries packed in {self.packed_batches:,} batches "
                  f"({self.config.retrieval.packed_query_rows} rows each); the others one a row")
    if "index_staleness_p50" in figures:
      logger.info(
          f"[{self.config.task}] index staleness p50 {figures['index_staleness_p50']:g} p95 "
          f"{figures['index_staleness_p95']:g} max {figures['index_staleness_max']} over "
          f"{len(self.candidates.staleness)} steps; {figures['index_versions_used']} versions "
          f"used; {figures['index_blocking_waits']} blocking waits after the first index "
          f"({figures['index_wait_seconds']:.1f}s)")
    return figures


def train(config, workdir: str) -> dict:
  """Runs one stage; returns its summary (also written to `workdir/summary.json`)."""
  with workdir_lib.JobLock(workdir, "trainer") as lock:   # given up however the run ends
    if config.get("task") == "openqa":   # (a config without one is named by validate)
      from realm_jax.train.openqa_loop import OpenQATrainer
      return OpenQATrainer(config, workdir, lock).run()
    return Trainer(config, workdir, lock).run()

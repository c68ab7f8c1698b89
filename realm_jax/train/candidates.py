"""Where a pre-training step's candidate blocks come from: one source per way, behind one
interface the trainer asks (`candidate_source` picks it from the config).

  NoRetrieval      nothing is retrieved (ICT on data without recall ground truth; REALM's
                   reader warm-up on its own block, the null-document baseline); the base of
                   the others
  RebuiltIndex     rebuilt in this process from a snapshot of the retriever
                   (`retrieval.refresh=in_process`): REALM every `refresh_every` steps; ICT at
                   each evaluation, to measure recall
  PublishedIndex   the versions the separate `realm-index` job publishes under `W/index`
                   (`retrieval.refresh=async|deterministic`, see train/feed.py)

A source owns the schedule of index versions, the `retrieval` item of a checkpoint, the
staleness record (`W/metrics/retrieval.jsonl`, the summary's `index_*` figures) and its
shutdown. The main thread calls `begin`, `before_step`, `served`, `eval_index`, `item`,
`stop_feeding`, `close`; the batch feed's thread calls `for_step`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Callable

import jax
import numpy as np

from realm_jax import workdir as workdir_lib
from realm_jax.errors import ConfigError
from realm_jax.retrieval import published
from realm_jax.retrieval.index import ExactIndex, IndexVersion, embed_blocks
from realm_jax.retrieval.subscriber import IndexSubscriber, load_version
from realm_jax.runtime import embedders, multihost
from realm_jax.config.reading import uses_index_builder
from realm_jax.train import candidate_rows
from realm_jax.train.feed import (FeedStopped, VersionSchedule, deterministic_source_step,
                                  waited_together)
from realm_jax.runtime.metrics import MetricWriter

_NO_STEP = np.zeros((), np.int32)
# An async run whose staleness passes this many `refresh_every` intervals has a builder that is
# behind or gone: the trainer says so (again at each doubling) instead of training on, silent.
STALE_REFRESHES = 10
# Several processes rebuilding in process agree this often whether a SIGTERM came (a
# collective, not after every batch: at 60,000 blocks/s about every 0.3 s, at 4,500 every 4 s).
STOP_CHECK_BLOCKS = 16_384
logger = logging.getLogger(__name__)


class StalenessRecord:
  """The index staleness of every step served, as a count of each value and the last step's:
  a long run's steps add no memory once their values were seen (a list of every step's grew
  with the run), and the percentiles are those of every step's."""

  def __init__(self):
    self.counts: collections.Counter[int] = collections.Counter()
    self.last: int | None = None

  def add(self, staleness: int) -> None:
    self.counts[staleness] += 1
    self.last = staleness

  def __len__(self) -> int:
    return self.counts.total()

  def percentile(self, q: float) -> float:
    """`np.percentile` of every step's staleness (linear between the ranks around q)."""
    values = sorted(self.counts)
    ends = np.cumsum([self.counts[v] for v in values])   # the rank after each value's steps
    at = lambda rank: values[int(np.searchsorted(ends, rank, side="right"))]
    rank = (ends[-1] - 1) * q / 100
    low = int(rank)
    return at(low) + (rank - low) * (at(min(low + 1, ends[-1] - 1)) - at(low))


class NoRetrieval:
  """Nothing retrieved: training reads the own block or the null document, eval no index."""

  retrieves = False     # training batches read retrieved blocks
  measures = False      # evaluation retrieves (recall, REALM's marginal)

  def __init__(self, config, workdir: str):
    self.config, self.workdir = config, workdir
    self.last: IndexVersion | None = None   # the index that served the last step (or eval)
    self.should_stop: Callable[[], bool] | None = None    # from `begin`
    self.stop_waiting: Callable[[], bool] | None = None   # from `begin`
    self.staleness = StalenessRecord()
    self.versions_used: set[int] = set()
    self._log: MetricWriter | None = None
    self._t_step: float | None = None

  def describe(self) -> str:
    return ""

  def start_over(self) -> None:
    """A fresh start (no checkpoint to resume): checks what an earlier start left for this
    source (nothing here)."""

  # -- checkpoints -------------------------------------------------------------------------
  def abstract_item(self) -> dict:
    return {"step": _NO_STEP}

  def restore(self, item: dict) -> None:
    pass

  def item(self) -> dict:
    """The checkpoint's `retrieval` item: the step of the index that served the last step (a
    host value: Orbax writes it from the primary process)."""
    return {"step": np.asarray(-1 if self.last is None else self.last.step, np.int32)}

  def checkpoint_due(self, done: int) -> bool:
    return False

  # -- the loop ----------------------------------------------------------------------------
  def begin(self, start: int, depth: int, save_start: Callable[[], None],
            should_stop: Callable[[], bool] | None = None,
            stop_waiting: Callable[[], bool] | None = None) -> None:
    """Before the first step (after restore): `save_start` writes step `start`'s checkpoint;
    `should_stop` says a SIGTERM came to this process (a batch's wait for its data yields
    to it), `stop_waiting` to any process (a wait for an index, or its rebuild, yields to
    it: FeedStopped, EmbeddingStopped, on every process alike)."""
    self.should_stop, self.stop_waiting = should_stop, stop_waiting
    if self.retrieves:
      self._log = MetricWriter(self.workdir, "retrieval", start + 1, held=True)

  def before_step(self, step: int, start: int, depth: int) -> None:
    """On the main thread, before step `step` runs."""

  def waits_for_index(self, step: int, start: int) -> bool:
    """Whether the batch of `step` may wait long for its index, on every process alike (the
    processes then agree on a SIGTERM before the step: `BatchFeed.next_together`)."""
    return False

  def for_step(self, step: int) -> tuple[IndexVersion | None, float]:
    """The feed thread: the index serving `step` (None: nothing retrieved) and the seconds
    spent waiting for it."""
    return None, 0.0

  def served(self, done: int, loaded: IndexVersion, waited: float, feed_wait: float,
             metrics) -> None:
    """Records that `loaded` served step `done` - 1 (staleness, version, waits, wall time)."""
    self.last = loaded
    self.staleness.add(done - 1 - loaded.step)
    self.versions_used.add(loaded.version)
    now = time.time()
    record = {"index_version": loaded.version, "index_step": loaded.step,
              "index_staleness": self.staleness.last, "index_wait_seconds": waited,
              "batch_wait_seconds": feed_wait}
    if self._t_step is not None:   # the first step of a run has no previous one to time from
      record["step_seconds"] = now - self._t_step
    self._log.write(done, record)
    self._t_step = now

  def progress_note(self) -> str:
    if not self.staleness:
      return ""
    return (f" | index v{self.last.version} (step {self.last.step}, "
            f"staleness {self.staleness.last})")

  def eval_index(self, step: int, final: bool) -> IndexVersion | None:
    """The index an evaluation at `step` retrieves from (`final`: the run's last)."""
    return None

  def stop_feeding(self, preempted: bool) -> None:
    """After the last step: release a feed thread waiting for an index that will not come."""

  def close(self) -> None:
    if self._log is not None:
      self._log.close()
      self._log = None

  def finished(self, steps: int) -> None:
    """After the run's summary is written."""

  def summary(self) -> dict:
    """`index_*` figures over the steps this process ran (a resumed run: since the resume)."""
    return {}


class RebuiltIndex(NoRetrieval):
  """Rebuilt in this process from a copy of the retriever's params (`snapshot()`)."""

  measures = True

  def __init__(self, config, workdir: str, *, retrieves: bool, model, mesh, data,
               abstract_retriever, snapshot: Callable[[], dict]):
    super().__init__(config, workdir)
    self.retrieves = retrieves
    self.model, self.mesh, self.data, self.snapshot = model, mesh, data, snapshot
    self.abstract_retriever = abstract_retriever
    self.index: IndexVersion | None = None   # the latest rebuild
    self.params = None                      # the retriever snapshot it was built from
    self.schedule = VersionSchedule(config, None, _all_hosts_have) if retrieves else None

  def rebuild(self, retriever_params, step: int, should_stop=None) -> None:
    """Embeds every block with `retriever_params` (a snapshot at `step`). `should_stop`: see
    `embed_blocks` (the index and the snapshot it records stay the previous ones)."""
    version = self._version_at(step)
    embed_fn = embedders.block_embedder(self.model, self.mesh, self.config, retriever_params)
    embeddings, _ = embed_blocks(embed_fn, self.data.blocks, self.mesh,
                                 self.config.retrieval.embed_batch_size,
                                 log_prefix=f"[{self.config.task}] index v{version}: ",
                                 should_stop=should_stop)
    self.params = retriever_params
    encoder = embedders.QueryEncoder(self.model, self.config,
                                 embedders.query_tower_params(retriever_params))
    self.index = IndexVersion(version=version, step=step,
                              index=ExactIndex.from_embeddings(embeddings),
                              encode_queries=encoder, embeddings=embeddings)

  def _version_at(self, step: int) -> int:
    """REALM: the version number of the rebuild at `step`, the same in a resumed run as in an
    uninterrupted one: one per `refresh_every` steps, the final evaluation's the next. ICT
    (rebuilt for each evaluation): counted."""
    if self.retrieves:
      return -(-step // self.config.retrieval.refresh_every)
    return 0 if self.index is None else self.index.version + 1

  def abstract_item(self) -> dict:
    item = {"step": _NO_STEP}
    if self.retrieves:   # the snapshot the index was built from: resume rebuilds it
      item["params"] = self.abstract_retriever
    return item

  def restore(self, item: dict) -> None:
    if "params" in item:
      self.rebuild(item["params"], int(item["step"]))

  def item(self) -> dict:
    index = self.last or self.index
    item = {"step": np.asarray(-1 if index is None else index.step, np.int32)}
    if self.retrieves:
      item["params"] = self.params
    return item

  def before_step(self, step: int, start: int, depth: int) -> None:
    """REALM: rebuild at multiples of refresh_every and tell the feed before the first use."""
    if not self.retrieves:
      return
    every = self.config.retrieval.refresh_every
    horizon = (step // every + 1) * every - 1
    if self.index is None or (step % every == 0 and step != self.index.step):
      self.rebuild(self.snapshot(), step, self._rebuild_stops())
      self.schedule.announce(step, self.index, horizon)
    elif step == start:
      self.schedule.announce(step, self.index, horizon)

  def _rebuild_stops(self) -> Callable[[], bool] | None:
    """The `should_stop` of a rebuild between steps, asked after each embedding batch:
    whether a SIGTERM came to any process. Several processes agree on it (an allgather) after
    every STOP_CHECK_BLOCKS blocks, the same batch on each (they embed the same batches), so
    that all stop there alike."""
    if jax.process_count() == 1 or self.stop_waiting is None:
      return self.stop_waiting
    every = max(1, STOP_CHECK_BLOCKS // self.config.retrieval.embed_batch_size)
    batches = itertools.count(1)
    return lambda: (next(batches) % every == 0
                    and not multihost.on_every_process(not self.stop_waiting()))

  def for_step(self, step: int) -> tuple[IndexVersion | None, float]:
    return self.schedule.for_step(step) if self.retrieves else (None, 0.0)

  def eval_index(self, step: int, final: bool) -> IndexVersion | None:
    """Rebuilt from the current params for the first and the final evaluation, and for each
    of ICT's (REALM evaluates in between with the index its steps use)."""
    if self.index is None or final or not self.retrieves:
      self.rebuild(self.snapshot(), step)
    return self.index

  def stop_feeding(self, preempted: bool) -> None:
    if self.schedule is not None:
      self.schedule.close()

  def close(self) -> None:
    self.stop_feeding(True)
    super().close()

  def summary(self) -> dict:
    return _staleness_summary(self.staleness, self.versions_used, self.schedule.waits, 0) \
        if self.staleness else {}


class PublishedIndex(NoRetrieval):
  """The versions `realm-index` publishes from this run's checkpoints (every process loads
  them; process 0 records the block store they must be built from and, at the end, DONE)."""

  retrieves = measures = True

  def __init__(self, config, workdir: str, *, model, data, abstract_retriever):
    super().__init__(config, workdir)
    self.model, self.data = model, data
    self.query_template = embedders.query_tower_params(abstract_retriever)
    if jax.process_index() == 0:
      workdir_lib.record_block_store(workdir, data)
    self.subscriber = IndexSubscriber(workdir, self._load_version, config.builder.poll_seconds,
                                      f"[{config.task}] ",
                                      by_step=config.retrieval.refresh == "deterministic")
    self.schedule = VersionSchedule(config, self.subscriber, _all_hosts_have)
    self._stale_said = 0   # the staleness of the last warning (async)

  def describe(self) -> str:
    r = self.config.retrieval
    return f", index from realm-index ({r.refresh}, {r.backend})"

  def start_over(self) -> None:
    """A fresh start has saved no checkpoint for realm-index to build from, so a version under
    W/index is an earlier start's, whose checkpoints are gone (removed, or moved aside as
    unreadable). Refused, on every process alike: `async` would serve it to this run, and
    realm-index builds only steps above the newest it published, so none of this run's first
    refresh steps would be built."""
    root = published.index_root(self.workdir)
    versions = published.complete_versions(root)
    if not versions:
      return
    try:
      step = f", built from its step {published.read_manifest(root, versions[-1])['step']}"
    except (published.RejectedVersion, OSError, KeyError):
      step = ""
    raise ConfigError("", f"{root} holds {len(versions)} index version(s) of an earlier start "
                      f"(the newest v{versions[-1]}{step}) and {self.workdir} has no checkpoint "
                      "to resume from: they would serve this run's first steps, and realm-index "
                      f"would not build them; remove {root} (or give another --workdir)")

  def _load_version(self, version: int) -> IndexVersion:
    return load_version(published.index_root(self.workdir), version, config=self.config,
                        fingerprint=self.data.blocks.fingerprint,
                        query_template=self.query_template,
                        make_encoder=lambda p: embedders.QueryEncoder(self.model, self.config, p))

  def checkpoint_due(self, done: int) -> bool:
    return done % self.config.retrieval.refresh_every == 0   # each one a snapshot to index

  def begin(self, start: int, depth: int, save_start: Callable[[], None],
            should_stop: Callable[[], bool] | None = None,
            stop_waiting: Callable[[], bool] | None = None) -> None:
    """Clears a DONE of an earlier run, writes the builder's first snapshot (at step 0),
    and in async mode waits for the first version (the one blocking wait)."""
    super().begin(start, depth, save_start, should_stop, stop_waiting)
    if jax.process_index() == 0:
      workdir_lib.clear_done(self.workdir)
    if start == 0:
      save_start()
    if self.config.retrieval.refresh == "async":
      self.last = self.schedule.start_async(start, depth, stop_waiting)

  def before_step(self, step: int, start: int, depth: int) -> None:
    if self.config.retrieval.refresh == "async":
      self.schedule.advance_async(step, depth)

  def waits_for_index(self, step: int, start: int) -> bool:
    """Deterministic: the run's first step and each swap to another version."""
    if self.config.retrieval.refresh != "deterministic":
      return False
    r = self.config.retrieval
    source = lambda t: deterministic_source_step(t, r.refresh_every, r.swap_lag)
    return step == start or source(step) != source(step - 1)

  def for_step(self, step: int) -> tuple[IndexVersion | None, float]:
    return self.schedule.for_step(step)

  def served(self, done, loaded, waited, feed_wait, metrics) -> None:
    jax.block_until_ready(metrics)   # per-step wall time, to see what the builder costs us
    super().served(done, loaded, waited, feed_wait, metrics)
    self._say_if_stale(done, loaded)

  def _say_if_stale(self, done: int, loaded: IndexVersion) -> None:
    """Async: a warning when staleness passes STALE_REFRESHES refreshes, then each doubling
    (a deterministic run waits for its versions instead)."""
    if self.config.retrieval.refresh != "async":
      return
    refresh_every, staleness = self.config.retrieval.refresh_every, self.staleness.last
    if staleness < STALE_REFRESHES * refresh_every:
      self._stale_said = 0   # caught up: a later lag is said again from the first threshold
    if staleness < max(STALE_REFRESHES * refresh_every, 2 * self._stale_said):
      return
    self._stale_said = staleness
    if jax.process_index() == 0:
      why = self.subscriber.builder_gone() or f"it is behind or not running on {self.workdir}"
      logger.warning(
          f"[{self.config.task}] warning: index staleness {staleness} steps at step {done}: the "
          f"newest version is v{loaded.version} (step {loaded.step}), but realm-index publishes "
          f"one every retrieval.refresh_every={refresh_every} steps; {why} (without it the "
          f"final evaluation waits retrieval.index_timeout="
          f"{self.config.retrieval.index_timeout:g}s, then fails)")

  def eval_index(self, step: int, final: bool) -> IndexVersion | None:
    """The final evaluation retrieves from the index of the final params (as a rebuilt index
    does); the first one (deterministic) waits for step 0's."""
    if final or self.last is None:
      self.last = self._index_to_evaluate(step, step if final else 0)
    return self.last

  def _index_to_evaluate(self, step: int, built_from: int) -> IndexVersion:
    """The index built from checkpoint `built_from`, waited for on every process;
    FeedStopped on every process once a SIGTERM came to one, an error on every process once
    the wait of one failed (`stopped_anywhere`)."""
    t0, timeout = time.time(), self.config.retrieval.index_timeout
    loaded, stopped = waited_together(
        lambda: self.subscriber.wait_for_step(built_from, timeout, self.stop_waiting), timeout)
    if stopped:
      raise FeedStopped(step, time.time() - t0, f"the index built from step {built_from}" +
                        ("" if loaded is None else ", on another process"),
                        f"the index of the evaluation at step {step}")
    return loaded

  def stop_feeding(self, preempted: bool) -> None:
    self.schedule.close()
    if preempted:   # a deterministic feed may wait on the subscriber for a version
      self.subscriber.close()

  def close(self) -> None:
    self.schedule.close()
    self.subscriber.close()
    super().close()

  def finished(self, steps: int) -> None:
    if jax.process_index() == 0:
      workdir_lib.mark_done(self.workdir, steps)   # tells realm-index to exit

  def summary(self) -> dict:
    return _staleness_summary(self.staleness, self.versions_used, self.schedule.waits,
                              len(self.subscriber.rejected)) if self.staleness else {}


def candidate_source(config, workdir: str, *, model, mesh, data, abstract_retriever,
                     snapshot: Callable[[], dict], has_answers: bool) -> NoRetrieval:
  """The source `config` asks for (see the module doc)."""
  if uses_index_builder(config):
    return PublishedIndex(config, workdir, model=model, data=data,
                          abstract_retriever=abstract_retriever)
  retrieves = config.task == "realm" and candidate_rows.of(config).retrieves
  if retrieves or (config.task == "ict" and has_answers):
    return RebuiltIndex(config, workdir, retrieves=retrieves, model=model, mesh=mesh,
                        data=data, abstract_retriever=abstract_retriever, snapshot=snapshot)
  return NoRetrieval(config, workdir)   # the own block or the null document alone


def _staleness_summary(staleness: StalenessRecord, versions_used: set[int],
                       waits: list[tuple[int, float]], rejected: int) -> dict:
  return {"index_steps_counted": len(staleness),   # a resumed run: the steps since its start
          "index_staleness_p50": round(float(staleness.percentile(50)), 2),
          "index_staleness_p95": round(float(staleness.percentile(95)), 2),
          "index_staleness_max": int(max(staleness.counts)),
          "index_versions_used": len(versions_used),
          "index_blocking_waits": len(waits),
          "index_wait_seconds": round(float(sum(w for _, w in waits)), 2),
          "index_rejected": rejected}


def _all_hosts_have(version: int) -> bool:
  """Whether every process has loaded index `version` (they switch at the same step)."""
  if jax.process_count() == 1:
    return True
  from jax.experimental import multihost_utils
  versions = multihost_utils.process_allgather(np.asarray(version, np.int64))
  return bool((np.asarray(versions) == version).all())

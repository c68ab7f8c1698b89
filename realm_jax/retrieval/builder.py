"""`realm-index --config C --workdir W [--once]`: the separate index-builder job.

It runs beside the trainer on its own devices and shares only the workdir with it:
  1. finds the newest finalised checkpoint through Orbax's listing (never a directory glob, so
     never one still being written) and restores only the retriever params onto its own mesh
     from abstract sharded targets; a checkpoint deleted under it is skipped for the newest;
  2. embeds every block with that snapshot's block tower, sharded over its devices;
  3. builds the index (`exact`: the embeddings; `scann`: tree + AH + reorder, with recall@10
     against exact search on block-derived queries) and publishes it as `W/index/<version>/`
     (`retrieval.published`: manifest last, atomic rename, then `LATEST`), with the query-tower
     params of the same snapshot;
  4. repeats for newer checkpoints until the trainer writes `W/DONE` (`--once`: one build,
     none where the newest checkpoint is published already; beside a deterministic trainer
     the next refresh step's, as the loop would build it, none where none is left).

With several processes (`--multihost`) process 0 decides each build and the others follow it
(`multihost.from_first_process`): every process restores and embeds (the mesh spans them all);
process 0 alone writes, publishes and points LATEST.

Which checkpoints (the trainer's `retrieval.refresh` and `refresh_every` as W/config.json
records them, this config's until then): `async` builds the newest one whenever it is newer
than the last published; `deterministic` builds every refresh step (multiples of
`refresh_every`, and the final step: this config's train.steps and the trainer's) in order,
since the trainer will ask for each.
"""

from __future__ import annotations

from realm_jax import errors as _errors
if __name__ == "__main__":   # python -m (launch/local.py's children): a Ctrl-C in the imports
  _errors.take_interrupts()  # below is recorded, then one line (run_cli), not a traceback

import errno
import logging
import os
import shutil
import signal
import sys
import tempfile
import time

import numpy as np
from etils import epath

from realm_jax import log, paths, workdir as workdir_lib
from realm_jax.errors import (ConfigError, StorageUnreachable, WorkerDied,
                              raise_if_interrupted, run_cli)
from realm_jax.config.overrides import flags_parser, refuse_arguments
from realm_jax.config.reading import uses_index_builder
from realm_jax.runtime import multihost
from realm_jax.config.option_names import upgrade_flags

logger = logging.getLogger("realm_jax.retrieval.builder")   # (__name__ is __main__ under python -m)

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)   # a full disk or quota: retried at the next poll

WAIT_MESSAGE_SECONDS = 30.0      # one "still waiting" line per this many seconds
TRAINER_GONE_SECONDS = 600.0     # one "the trainer is not running" line per this many seconds
FINISHED, FAILED = -1, -2        # process 0's decisions besides a step to build (`_decided`)
STOPPED_EXIT_CODE = 128 + signal.SIGTERM   # stopped on SIGTERM (preempted): as the trainer


def _save_searcher(searcher, directory) -> None:
  """ScaNN's files into `directory` (a version's `scann/`); in a bucket through a local temp
  dir, its files then uploaded (ScaNN writes local files only: the path of a bucket dir would
  be a local dir `gs:` under the working directory, and the version would lack them)."""
  from realm_jax.retrieval import scann_index
  if not paths.is_remote(directory):
    os.makedirs(str(directory), exist_ok=True)
    scann_index.save_searcher(searcher, str(directory))
    return
  scratch = tempfile.mkdtemp(prefix="realm_scann_")
  try:
    scann_index.save_searcher(searcher, scratch)
    for name in sorted(os.listdir(scratch)):   # (flat, as the trainer's copy reads it)
      paths.upload_file(os.path.join(scratch, name), epath.Path(directory) / name)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


class IndexBuilder:
  """Builds and publishes index versions for the trainer in `workdir`."""

  def __init__(self, config, workdir: str):
    import jax
    from realm_jax.runtime import checkpoints
    from realm_jax.config import validation
    validation.validate(config)
    refuse_without_builder(config)
    self.config, self.workdir = config, workdir
    self.data = workdir_lib.open_data(config)
    from realm_jax.retrieval.scann_index import check_corpus
    check_corpus(config, self.data.blocks.num_blocks)   # ScaNN's settings, before any build
    self.fingerprint = self.data.blocks.fingerprint
    workdir_lib.check_block_store(workdir, self.fingerprint, self.data.dir)
    workdir_lib.check_compatible(workdir, config)   # the trainer's checkpoints, as it reads them
    self.model, self.mesh, abstract = checkpoints.abstract_run(
        config, self.data.tokenizer.vocab_size, self.data.blocks.block_len)
    self.abstract_retriever = abstract.params["retriever"]
    self.checkpoints = checkpoints   # not at the top: jax only after the device choice
    self.checkpoint_dir = checkpoints.checkpoint_dir(workdir)
    self.lister = self.reader = None   # Orbax managers: this process's listing, the restores
    from realm_jax.retrieval import published
    self.published = published
    self.root = published.index_root(workdir)
    self.primary = jax.process_index() == 0   # the one process that writes W/index
    self.multiprocess = jax.process_count() > 1
    self.lock = workdir_lib.JobLock(workdir, "builder")
    if self.primary:   # the one builder of W: a second would delete this one's staging dir
      self.lock.acquire()
    try:
      if self.primary and paths.isdir(self.root):
        self._recover(config.builder.keep_versions)
      from realm_jax.runtime.metrics import MetricWriter
      self.metrics = MetricWriter(workdir, "index", self._metrics_from())
    except BaseException:
      self.lock.release()   # close() is never reached on a builder that did not start
      raise
    self.built = 0   # versions published by this run
    self._retry_said, self._retries_unsaid = 0.0, 0   # `_say_retry`'s: when, how many since
    self._said_done = False
    self.ended = None   # how this run ended normally (`_ended`), for W/builder.lock
    logger.info(f"[index] {self.data.blocks.num_blocks:,} blocks of {self.data.dir} (fingerprint "
                f"{self.fingerprint}), backend {config.retrieval.backend}, mode "
                f"{config.retrieval.refresh}, mesh {dict(self.mesh.shape)} on "
                f"{jax.devices()[0].platform}")

  def _recover(self, keep: int) -> None:
    """What a builder stopped mid-publish left: staging dirs removed, and LATEST pointed at the
    newest complete version if it was stopped between the rename and LATEST (else an async
    trainer, which reads LATEST, would never see that version, and no build would repeat it)."""
    for path in self.published.clean_staging(self.root):
      logger.info(f"[index] removed {path} (left by a builder that was stopped)")
    versions, latest = self.published.complete_versions(self.root), \
        self.published.read_latest(self.root)
    if versions and (latest is None or latest < versions[-1]):
      self.published.point_latest(self.root, versions[-1], keep)
      logger.info(f"[index] LATEST now names v{versions[-1]}: a builder was stopped after "
                  f"publishing it and before LATEST (was {latest})")

  def _metrics_from(self) -> int | None:
    """The first step W/metrics/index.jsonl may already hold a line of, past the newest
    published version's (a builder going on keeps its lines); 0 where W/index holds no
    version: a fresh start's (the trainer refuses one beside an earlier start's versions), whose
    earlier start's lines go as the trainer's logs drop theirs, else each step could be there
    twice. None (every line stays) where the newest manifest cannot be read."""
    if not self.primary:
      return None
    versions = self.published.complete_versions(self.root) if paths.isdir(self.root) else []
    if not versions:
      return 0
    try:
      return int(self.published.read_manifest(self.root, versions[-1])["step"]) + 1
    except (self.published.RejectedVersion, OSError, KeyError, TypeError, ValueError):
      return None

  # -- checkpoints -------------------------------------------------------------------------
  def checkpoint_steps(self) -> list[int]:
    """Finalised checkpoint steps, from Orbax's listing (re-read every call; this process's
    own manager: process 0 lists while the others wait for its decision)."""
    if not paths.isdir(self.checkpoint_dir):
      return []
    if self.lister is None:
      import jax
      self.lister = self.checkpoints.read_only_manager(
          self.workdir, processes={jax.process_index()} if self.multiprocess else None,
          item_names=self.checkpoints.ITEMS)

    def steps() -> list[int]:
      self.lister.reload()
      return self.lister.all_steps()
    return self.checkpoints.listed_again(steps)   # a step the trainer deletes while listed

  def _reader(self):
    """The manager every process restores through (made by all of them at their first build;
    with one process, the listing's)."""
    if self.reader is None:
      self.reader = self.lister if self.lister is not None and not self.multiprocess else \
          self.checkpoints.read_only_manager(self.workdir, item_names=self.checkpoints.ITEMS)
    return self.reader

  def restore_retriever(self, step: int):
    """The retriever params of checkpoint `step` straight onto this job's mesh (nothing else
    of the state is read); None if the checkpoint vanished meanwhile (kept-N deletion). With
    several processes such a restore fails the job instead (Orbax's restore ends in a barrier
    the others would wait in); the builder started again builds the newest. One that is
    there and does not restore (a truncated or corrupt file) is a CheckpointError naming it."""
    target = {"retriever": self.abstract_retriever}
    try:
      restored = self._reader().restore(step,
                                        args=self.checkpoints.partial_params_restore(target))
    except Exception as e:  # noqa: BLE001  (Orbax raises bare Exceptions for a bad file)
      if not self.multiprocess and step not in self.checkpoint_steps():
        return None
      self.checkpoints.raise_unreadable(self._reader(), self.workdir, step, e)
    return restored.params["retriever"]

  def published_steps(self) -> dict[int, int]:
    """Checkpoint step -> the newest complete version built from it."""
    steps = {}
    for version in self.published.complete_versions(self.root):
      try:
        steps[int(self.published.read_manifest(self.root, version)["step"])] = version
      except self.published.RejectedVersion:
        pass   # a damaged version is not built; the trainer rejects it too
    return steps

  def next_step(self, steps: list[int]) -> int | None:
    """The checkpoint to build next, or None if there is nothing new."""
    newest_built = max(self.published_steps(), default=-1)   # older ones may be pruned
    trainer = workdir_lib.recorded_config(self.workdir) or {}
    if self.refresh_mode(trainer) == "deterministic":
      periods, final = self.refresh_periods(trainer), self.final_steps(trainer)
      todo = [s for s in steps if (any(s % every == 0 for every in periods) or s in final)
              and s > newest_built]
      return todo[0] if todo else None
    newest = steps[-1] if steps else None
    return newest if newest is not None and newest > newest_built else None

  def refresh_mode(self, trainer: dict) -> str:
    """How the trainer takes its versions: its retrieval.refresh as W/config.json (`trainer`)
    records it, this config's until the trainer has recorded one (a builder given 'async'
    beside a deterministic trainer built only the newest checkpoints, and the trainer, waiting
    for a refresh step passed over, stopped as though the run had changed refresh mode)."""
    mode = (trainer.get("retrieval") or {}).get("refresh")
    return mode if mode in ("async", "deterministic") else self.config.retrieval.refresh

  def refresh_periods(self, trainer: dict) -> set[int]:
    """The period of the refresh steps, which the trainer checkpoints and waits for a version
    of: the trainer's retrieval.refresh_every as W/config.json (`trainer`) records it, this
    config's until the trainer has recorded one (a builder given another period built none of
    the steps the trainer waited for, and it waited out retrieval.index_timeout; versions of
    its own period beside the trainer's would prune the trainer's sooner)."""
    every = (trainer.get("retrieval") or {}).get("refresh_every")
    return {every} if type(every) is int and every >= 1 else {
        self.config.retrieval.refresh_every}

  def final_steps(self, trainer: dict) -> set[int]:
    """The run's last step, which the trainer checkpoints and waits for a version of whether
    or not it is a refresh step: this config's train.steps, and the trainer's as W/config.json
    (`trainer`) records it (a builder given another train.steps never built the trainer's,
    whose final evaluation then waited retrieval.index_timeout and failed)."""
    steps = (trainer.get("train") or {}).get("steps")
    return {self.config.train.steps} | ({steps} if isinstance(steps, int) else set())

  # -- one build ---------------------------------------------------------------------------
  def build(self, step: int) -> dict | None:
    """Restores, embeds, indexes and publishes the snapshot of `step`; None if it vanished."""
    from realm_jax.retrieval.index import embed_blocks
    from realm_jax.runtime import embedders, partitioning
    workdir_lib.check_block_store(self.workdir, self.fingerprint, self.data.dir)
    cfg, timings = self.config, {}
    t0 = time.time()
    params = self.restore_retriever(step)
    if params is None:
      logger.warning(f"[index] checkpoint {step} was deleted while being restored; looking "
                     "again for the one to build (async: the newest; deterministic: the next "
                     "refresh step)")
      return None
    timings["restore_seconds"] = round(time.time() - t0, 3)
    embed_fn = embedders.block_embedder(self.model, self.mesh, cfg, params)
    if not self.primary:   # its share of the collectives; process 0 publishes
      embed_blocks(embed_fn, self.data.blocks, self.mesh, cfg.retrieval.embed_batch_size)
      partitioning.host_copy(embedders.query_tower_params(params))
      return {"step": step}
    version, staging = self._start_version(step)
    prefix = f"[index] v{version} (step {step}): "
    embeddings, _ = embed_blocks(embed_fn, self.data.blocks, self.mesh,
                                 cfg.retrieval.embed_batch_size, prefix, timings=timings)
    # (a collective where the `model` axis spans processes: every process calls it)
    query_params = partitioning.host_copy(embedders.query_tower_params(params))
    unreachable_since, committed = None, False
    while True:   # a full disk or an unreachable bucket: written again, or finished
      try:
        manifest = self._publish(step, version, staging, embeddings, query_params, timings,
                                 committed)
        self._retry_said, self._retries_unsaid = 0.0, 0   # the next full disk: said at once
        return manifest
      except Exception as e:  # noqa: BLE001  (anything but those two is raised again)
        unreachable = paths.unreachable(e)
        unreachable_since = (unreachable_since or time.time()) if unreachable else None
        why = self._unpublished(e, staging, version, prefix, unreachable_since)
        committed = self._committed(version)
        if committed:   # LATEST, the prune or the metrics failed: finish it
          self._say_retry(f"{prefix}{why}: v{version} is committed; finishing it in "
                          f"{cfg.builder.poll_seconds:g}s")
          time.sleep(cfg.builder.poll_seconds)
          continue
        self._say_retry(f"{prefix}{why}: nothing of v{version} is visible; writing it again in "
                        f"{cfg.builder.poll_seconds:g}s")
        time.sleep(cfg.builder.poll_seconds)
        version, staging = self._start_version(step)
        prefix = f"[index] v{version} (step {step}): "

  def _start_version(self, step: int):
    """`published.start_version`'s (version, staging dir), tried again every poll while the
    disk is full (its dir needs room too: a full disk is waited out wherever it is met)."""
    while True:
      try:
        return paths.retried("starting an index version", self.root,
                             lambda: self.published.start_version(self.root))
      except OSError as e:
        if e.errno not in NO_SPACE:
          raise
        self._say_retry(f"[index] step {step}: no space left creating "
                        f"{e.filename or self.root} ({e.strerror}): nothing is written; trying "
                        f"again in {self.config.builder.poll_seconds:g}s")
        time.sleep(self.config.builder.poll_seconds)

  def _say_retry(self, line: str) -> None:
    """A publishing retry's warning (a full disk, a bucket that does not answer): the first,
    then one per WAIT_MESSAGE_SECONDS while the retries go on, with how many were not said (a
    line every poll would fill the log, which may be on the full disk)."""
    now = time.time()
    if now - self._retry_said < WAIT_MESSAGE_SECONDS:
      self._retries_unsaid += 1
      return
    unsaid = self._retries_unsaid
    logger.warning(line + (f" ({unsaid} more tries since the last line)" if unsaid else ""))
    self._retry_said, self._retries_unsaid = now, 0

  def _unpublished(self, error: Exception, staging, version: int, prefix: str,
                   unreachable_since: float | None) -> str:
    """Why a version could not be written (a full disk, an unreachable bucket since
    `unreachable_since`), after removing what it left; any other error, or an unreachable
    bucket past the patience, is raised."""
    if getattr(error, "errno", None) in NO_SPACE:
      self.published.abandon(staging)
      return f"no space left writing {error.filename or staging} ({error.strerror})"
    if unreachable_since is None:
      raise error
    waited = time.time() - unreachable_since
    if waited > paths.patience():
      raise StorageUnreachable(
          f"{prefix}the bucket did not answer for {waited:.0f}s while publishing to "
          f"{staging} ({type(error).__name__}: {error}); giving up after "
          f"${paths.PATIENCE_ENV}={paths.patience():g}s") from error
    try:   # best effort: a version dir without a manifest is invisible to every reader
      self.published.abandon(staging)
    except Exception:  # noqa: BLE001  (the bucket is not answering)
      pass
    return (f"the bucket did not answer writing {staging} ({type(error).__name__}: {error}; "
            f"{waited:.0f}s of ${paths.PATIENCE_ENV}={paths.patience():g}s)")

  def _committed(self, version: int) -> bool:
    """Whether `version` has its manifest (readers may use it); False if that is unknown."""
    try:
      return (self.published.version_dir(self.root, version) / self.published.MANIFEST).exists()
    except Exception:  # noqa: BLE001  (the bucket is not answering: written again then)
      return False

  def _publish(self, step: int, version: int, staging, embeddings: np.ndarray,
               query_params: dict, timings: dict, committed: bool) -> dict:
    """Writes version `version`'s files into `staging` and publishes it, or finishes its
    publishing if an earlier try `committed` it; its manifest."""
    cfg, prefix = self.config, f"[index] v{version} (step {step}): "
    t0 = time.time()
    if committed:
      manifest = self.published.read_manifest(self.root, version)
      self.published.point_latest(self.root, version, cfg.builder.keep_versions)
      extra = {k: v for k, v in manifest.items()
               if k not in (*self.published.REQUIRED_KEYS, "created")}
    else:
      extra = self._write_index(staging, embeddings, query_params, timings, prefix)
      logger.info(f"{prefix}publishing")
      t0 = time.time()
      manifest = self.published.publish(
          self.root, version, staging, dict(
              step=step, num_blocks=int(len(embeddings)), dim=int(embeddings.shape[1]),
              backend=cfg.retrieval.backend, block_store_fingerprint=self.fingerprint,
              timings=timings, **extra), keep=cfg.builder.keep_versions)
    publish_seconds = time.time() - t0
    size = sum(f["bytes"] for f in manifest["files"].values())
    logger.info(f"{prefix}published {self.published.version_dir(self.root, version)} "
                f"({size / 2**20:,.1f} MiB, hashed and committed in {publish_seconds:.1f}s)")
    self._record(step, prefix, {"version": version, "index_bytes": size,
                                "publish_seconds": publish_seconds,
                                **{k: v for k, v in timings.items()},
                                **{k: v for k, v in extra.items() if isinstance(v, float)}})
    return manifest

  def _record(self, step: int, prefix: str, scalars: dict) -> None:
    """The published version's line in W/metrics/index.jsonl. A full disk or a bucket that
    does not answer there skips it with a warning: the version is out, and finishing its
    publishing again would only repeat the line (the file keeps what it could not write for
    its next write), or, with its manifest out of reach, publish the step again under
    another number."""
    try:
      self.metrics.write(step, scalars)
    except Exception as e:  # noqa: BLE001  (anything but those two is raised again)
      if getattr(e, "errno", None) in NO_SPACE:
        why = f"no space left for its line in W/metrics/index.jsonl ({e.strerror})"
      elif paths.unreachable(e):
        why = f"the bucket did not answer writing its line in W/metrics/index.jsonl ({e})"
      else:
        raise
      logger.warning(f"{prefix}{why}; the version is published without it")

  def _write_index(self, staging, embeddings: np.ndarray, query_params: dict,
                   timings: dict, prefix: str) -> dict:
    """Writes the version's files into `staging`; returns extra manifest fields."""
    cfg = self.config
    self.published.write_arrays(staging, embeddings, query_params)
    if cfg.retrieval.backend == "exact":
      timings["build_seconds"] = 0.0
      logger.info(f"{prefix}exact index: {len(embeddings):,} x {embeddings.shape[1]}")
      return {}
    from realm_jax.retrieval import scann_index
    settings = scann_index.scann_settings(len(embeddings), cfg.builder)
    logger.info(f"{prefix}building a scann index of {len(embeddings):,} x {embeddings.shape[1]} "
                f"({settings}), then its recall@10 vs exact")
    t0 = time.time()
    searcher = scann_index.build_searcher(embeddings, settings)
    timings["build_seconds"] = round(time.time() - t0, 3)
    t0 = time.time()
    _save_searcher(searcher, staging / "scann")
    timings["serialize_seconds"] = round(time.time() - t0, 3)
    recall, queries = self._scann_recall(searcher, embeddings, settings, query_params)
    logger.info(f"{prefix}scann index: {len(embeddings):,} x {embeddings.shape[1]}, {settings}, "
                f"built in {timings['build_seconds']:.1f}s, serialized in "
                f"{timings['serialize_seconds']:.1f}s, recall@10 vs exact {recall:.3f} on "
                f"{queries} block-derived queries")
    return {"scann": settings, "recall_at_10": recall}

  def _scann_recall(self, searcher, embeddings: np.ndarray, settings: dict,
                    query_params: dict) -> tuple[float, int]:
    """(recall@10 of ScaNN against exact search, queries): the query tower applied to the
    opening wordpieces of the body of sampled blocks (queries that resemble the trainer's),
    builder.recall_queries of them, or one per block of a smaller corpus."""
    from realm_jax.retrieval import scann_index
    blocks = self.data.blocks
    rng = np.random.default_rng(0)
    rows = rng.choice(blocks.num_blocks, min(self.config.builder.recall_queries,
                                             blocks.num_blocks), replace=False)
    queries = self._block_queries(rows, query_params)
    n = min(10, len(embeddings))
    approx = scann_index.ScannIndex(searcher, version=-1, step=-1,
                                    num_blocks=len(embeddings), settings=settings)
    return scann_index.recall_at(approx.search(queries, n),
                                 scann_index.exact_top_n(queries, embeddings, n)), len(rows)

  def _block_queries(self, rows: np.ndarray, query_params: dict) -> np.ndarray:
    from realm_jax.runtime import embedders
    blocks, tok = self.data.blocks, self.data.tokenizer
    q = self.config.data.query_len
    ids = np.zeros((len(rows), q), np.int32)
    for i, row in enumerate(rows):
      body = blocks.tokens[row][blocks.body_start[row]:blocks.lengths[row] - 1][:q - 2]
      ids[i, :len(body) + 2] = [tok.cls_id, *body, tok.sep_id]
    return embedders.QueryEncoder(self.model, self.config, query_params)(ids)

  # -- the job -----------------------------------------------------------------------------
  def run(self, once: bool = False) -> int:
    """Builds until the trainer is done (or once); returns the number of versions published."""
    started = time.time()
    self.built = 0
    while True:
      try:
        raise_if_interrupted()   # a Ctrl-C swallowed in a gc callback (the others told)
        step = self._decided(lambda: self._next_build(once, started))
        if step == FINISHED:
          return self._ended(once)
        if self.build(step) is not None:
          self.built += 1
          if once:
            return self._ended(once)
        # else: look again at once: a deleted checkpoint means a newer one exists
      except BaseException:   # the others wait for process 0's next decision: its failure
        if self.primary:
          multihost.from_first_process("index-build", FAILED)
        raise

  def _ended(self, once: bool) -> int:
    """Notes how this run ended, for W/builder.lock (`close`): a trainer that waits for a
    version later (a run resumed with more train.steps) says this builder ended, not that it
    died. Returns the versions published."""
    if once:
      self.ended = "it ran with --once (one build at most)"
    else:
      step = workdir_lib.done_step(self.workdir)
      at = f" at step {step}" if step not in (None, sys.maxsize) else ""
      self.ended = f"it finished with the run{at} (W/DONE)"
    return self.built

  def _decided(self, decide) -> int:
    """`decide()` on process 0 (the one listing checkpoints and versions), its answer on every
    process (FAILED: process 0 failed, and so do the others)."""
    if self.primary:
      return multihost.from_first_process("index-build", decide())
    # as long as process 0 lives: it may wait hours for the trainer's next checkpoint
    step = multihost.from_first_process("index-build", None, multihost.LONG_WAIT_SECONDS)
    if step == FAILED:
      raise WorkerDied("process 0 of the builder failed or was stopped; its output says why")
    return step

  def _next_build(self, once: bool, started: float) -> int:
    """The checkpoint step to build next (waiting for one), or FINISHED: the trainer is done."""
    cfg, last_message = self.config, 0.0
    while True:
      raise_if_interrupted()   # while it waits too
      steps = self.checkpoint_steps()
      if not steps:
        waited = time.time() - started
        if self._trainer_done():
          logger.info("[index] the trainer is done and left no checkpoint; exiting")
          return FINISHED
        trainer = workdir_lib.job_running(self.workdir, "trainer")
        if waited > cfg.builder.wait_timeout and trainer is None:
          raise FileNotFoundError(
              f"no checkpoint under {self.checkpoint_dir} after {waited:.0f}s "
              f"(config.builder.wait_timeout = {cfg.builder.wait_timeout:g}); is the trainer "
              "running with this workdir?")
        if time.time() - last_message >= WAIT_MESSAGE_SECONDS:
          logger.info(f"[index] waiting for a checkpoint under {self.checkpoint_dir} "
                      f"({waited:.0f}s of {cfg.builder.wait_timeout:g}s" + (
                          f"; the trainer (pid {trainer}) runs on this workdir: waited for "
                          "while it runs)" if trainer else ")"))
          last_message = time.time()
        time.sleep(cfg.builder.poll_seconds)
        continue
      step = self._once_build(steps) if once else self.next_step(steps)
      if step is not None:
        return step
      if self._trainer_done():
        logger.info(f"[index] the trainer is done; {self.built} versions published")
        return FINISHED
      last_message = self._say_if_trainer_gone(steps[-1], last_message)
      time.sleep(cfg.builder.poll_seconds)

  def _once_build(self, steps: list[int]) -> int:
    """`--once`'s build. Beside a deterministic trainer the step `next_step` gives (the next
    refresh step: a version of another step no trainer step reads, and it would stop every
    build of the refresh steps below it), or FINISHED where none is left (said); else
    `_newest_unpublished`."""
    if self.refresh_mode(workdir_lib.recorded_config(self.workdir) or {}) != "deterministic":
      return self._newest_unpublished(steps[-1])
    step = self.next_step(steps)
    if step is not None:
      return step
    logger.info(f"[index] no checkpoint above step {max(self.published_steps(), default=-1)} "
                f"(the newest published) is a refresh step the trainer reads (retrieval.refresh "
                f"'deterministic'; the newest checkpoint is step {steps[-1]}): nothing to build")
    return FINISHED

  def _newest_unpublished(self, newest: int) -> int:
    """`--once`'s build: the newest checkpoint, or FINISHED where a version of it is published
    already (said: building it again would only publish the same step under a new number)."""
    version = self.published_steps().get(newest)
    if version is None:
      return newest
    logger.info(f"[index] step {newest} (the newest checkpoint) is already published as "
                f"v{version} ({self.published.version_dir(self.root, version)}): nothing to "
                "build")
    return FINISHED

  def _say_if_trainer_gone(self, newest: int, last_message: float) -> float:
    """A line (then one per TRAINER_GONE_SECONDS) while nothing is new to build and the
    trainer that held W/trainer.lock is no longer running: a realm-index started on its own
    waits for the trainer's next checkpoint, or W/DONE, until it is stopped."""
    if time.time() - last_message < TRAINER_GONE_SECONDS:
      return last_message
    pid = workdir_lib.job_gone(self.workdir, "trainer")
    if pid is None:
      return last_message
    logger.warning(
        f"[index] the trainer (pid {pid}, {workdir_lib.JobLock(self.workdir, 'trainer').path}) "
        f"is not running and no W/DONE says this run's train.steps "
        f"({self.config.train.steps}) are done: waiting for a checkpoint after step {newest} "
        "from the trainer started again on this workdir (Ctrl-C stops this job)")
    return time.time()

  def _trainer_done(self) -> bool:
    """W/DONE records a step >= this config's train.steps. A DONE of a run that ended before
    it (a resumed, longer run has not cleared it yet, or the two jobs were given different
    train.steps) is not this run's end: said once, and waited out."""
    step = workdir_lib.done_step(self.workdir)
    if step is None or step >= self.config.train.steps:
      return step is not None
    if not self._said_done:
      self._said_done = True
      logger.info(
          f"[index] {workdir_lib.done_path(self.workdir)} says the trainer finished at step "
          f"{step}, before train.steps {self.config.train.steps}: waiting for the run that "
          "resumes it (the trainer and the builder need the same train.steps)")
    return False

  def close(self) -> None:
    for manager in {self.lister, self.reader} - {None}:
      manager.close()
    self.metrics.close()
    self.lock.release(ended=self.ended)


def refuse_without_builder(config) -> None:
  """A ConfigError naming the option unless `config` takes its index versions from this job
  (`uses_index_builder`): a trainer of any other config never reads them, and an Open-QA run's
  W/index holds its frozen index, read through LATEST, which newer versions would displace
  and prune."""
  if uses_index_builder(config):
    return
  r = config.retrieval
  option = ("task" if config.task != "realm" else
            "retrieval.candidates" if r.candidates != "index" else "retrieval.refresh")
  raise ConfigError(option, f"this config (task {config.task!r}, retrieval.candidates "
                    f"{r.candidates!r}, retrieval.refresh {r.refresh!r}) takes no index "
                    "versions from realm-index, which serves REALM with candidates 'index' and "
                    "refresh 'async' or 'deterministic'; give realm-index the trainer's config")


class Stopped(Exception):
  """SIGTERM reached realm-index (a preempted or stopped job)."""


def _stop(signum, frame):
  raise Stopped()


def main(argv) -> None:
  from absl import flags
  refuse_arguments("realm-index", argv)
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  if config is None or not workdir:
    print("realm-index: error: --config and --workdir are required", file=sys.stderr)
    raise SystemExit(2)
  log.use_absl_verbosity()   # -v N; Orbax's and TFDS's INFO lines off the console

  stopped = []

  def job():
    multihost.initialize_from_flags()
    builder = IndexBuilder(config, workdir)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
      raise_if_interrupted()   # a Ctrl-C recorded in the imports so far
      return builder.run(once=flags.FLAGS.once)
    except Stopped:
      # Publishing is atomic: a version cut short is an unpublished staging dir, which the
      # next start removes; every published version stays valid.
      logger.warning(f"[index] SIGTERM: stopped; {builder.built} versions published by this run")
      stopped.append(True)
      return builder.built
    finally:
      signal.signal(signal.SIGTERM, previous)
      builder.close()
  built = run_cli("realm-index", job)
  if stopped:   # not 0: a scheduler must not take a preempted builder for a finished one
    print(f"realm-index: stopped by SIGTERM, {built} versions published; rerun the same "
          "command to go on", flush=True)
    raise SystemExit(STOPPED_EXIT_CODE)
  print(f"realm-index: done, {built} versions published", flush=True)


def run() -> None:
  from absl import app, flags
  from ml_collections import config_flags
  # flagfiles read and old option names upgraded before the config flag reads sys.argv
  sys.argv = upgrade_flags(sys.argv, "realm-index")
  config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)); the same "
                                  "as the trainer's.", lock_config=True)
  flags.DEFINE_string("workdir", None, "The trainer's run directory.")
  flags.DEFINE_bool("once", False, "Build for the newest checkpoint (deterministic refresh: "
                    "the next refresh step), publish, and exit.")
  app.run(main, flags_parser=flags_parser("realm-index", __name__))


if __name__ == "__main__":
  run()

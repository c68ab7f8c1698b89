"""The trainer's side of the workdir protocol: published index versions, loaded in the background.

`IndexSubscriber` polls `W/index` in a thread. A version is loaded only once its manifest is
there; every file is checked against the manifest (bytes, sha256), and the block-store
fingerprint, the embedding dim, the backend and the query-tower parameter shapes against the
trainer's. A version that fails is rejected with the reason printed and is never used; the
trainer keeps the version it has.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Callable


from realm_jax import paths, workdir as workdir_lib
from realm_jax.errors import (SELF_EXPLAINING, IndexNeverPublished, IndexWaitTimeout,
                              StorageUnreachable, raise_if_interrupted)
from realm_jax.retrieval import published
from realm_jax.retrieval.index import ExactIndex, IndexVersion

logger = logging.getLogger(__name__)

WAIT_NOTICE_SECONDS = 60.0   # a trainer waiting for an index says so this often
MAX_LOAD_ATTEMPTS = 3   # a version that fails to load for other reasons (pruned under us) this
                        # many times is given up
NO_MANIFEST = -1   # the step of a version whose manifest cannot be read (counted by no side)


def load_version(root, version: int, *, config, fingerprint: str, query_template: dict,
                 make_encoder: Callable[[dict], Callable]) -> IndexVersion:
  """Verifies and loads one published version (RejectedVersion if it must not be used).

  Args:
    root: `W/index`.
    version: the version number.
    config: the trainer's config (retrieval.backend, model.retrieval_dim).
    fingerprint: the trainer's block-store fingerprint.
    query_template: the query-tower params' shapes (ShapeDtypeStructs) the model expects.
    make_encoder: fn(query_params) -> fn(query ids) -> embeddings, on the trainer's devices.
  """
  manifest = published.verify(root, version, fingerprint=fingerprint,
                              dim=config.model.retrieval_dim)
  if manifest["backend"] != config.retrieval.backend:
    raise published.RejectedVersion(version, f"backend {manifest['backend']!r} (index) != "
                                    f"{config.retrieval.backend!r} (trainer)")
  directory = published.version_dir(root, version)
  embeddings = published.read_embeddings(root, version, manifest)
  query_params = published.read_query_params(root, version, query_template)
  if config.retrieval.backend == "scann":
    index = _load_scann(directory, manifest)
  else:
    index = ExactIndex.from_embeddings(embeddings)
  return IndexVersion(version=version, step=int(manifest["step"]), index=index,
                      encode_queries=make_encoder(query_params), embeddings=embeddings)


def _load_scann(directory, manifest):
  from realm_jax.retrieval import scann_index
  local = str(directory / "scann")
  scratch = None
  if paths.is_remote(directory):   # ScaNN reads local files: copy the assets first
    scratch = tempfile.mkdtemp(prefix="realm_scann_")
    for path in (directory / "scann").iterdir():
      path.copy(os.path.join(scratch, path.name))
    local = scratch
  try:
    return scann_index.ScannIndex.load(local, version=manifest["version"],
                                       step=manifest["step"], num_blocks=manifest["num_blocks"],
                                       settings=manifest["scann"])
  finally:
    if scratch:
      shutil.rmtree(scratch, ignore_errors=True)


class IndexSubscriber:
  """Loads published versions as they appear; the trainer picks them up between steps.

  `want_steps(steps)` (deterministic mode, which starts with `by_step=True`: nothing is loaded
  before the first ask) asks for the versions built from those checkpoint steps; without it,
  the version `LATEST` names is loaded (async mode).
  """

  def __init__(self, workdir: str, loader: Callable[[int], IndexVersion], poll_seconds: float,
               log_prefix: str = "[realm] ", by_step: bool = False):
    self.workdir, self.root = workdir, published.index_root(workdir)
    self.loader, self.poll_seconds, self.log_prefix = loader, poll_seconds, log_prefix
    self._loaded: dict[int, IndexVersion] = {}
    self._rejected: dict[int, str] = {}
    self._failures: dict[int, int] = {}
    self._wanted: set[int] | None = set() if by_step else None
    # (by step) the checkpoint steps of the usable versions the last full listing found, and
    # the newest step of any version with a readable manifest (rejected ones too), which is
    # what realm-index counts as built
    self._published_steps: set[int] = set()
    self._newest_built = -1
    # version -> step of its manifest (NO_MANIFEST where it could not be read), rejected
    # versions too, including those the async mode rejected before any step was wanted
    self._step_of: dict[int, int] = {}
    self._cond = threading.Condition()
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="index-subscriber", daemon=True)
    self._thread.start()

  # -- the background thread ---------------------------------------------------------------
  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        self.poll()
        self._stop.wait(self.poll_seconds)
    except BaseException as e:  # noqa: BLE001  (handed to the trainer's thread)
      with self._cond:
        self._error = e
        self._cond.notify_all()

  def _candidates(self) -> list[int]:
    with self._cond:   # one look, so a version released meanwhile is in neither
      wanted = None if self._wanted is None else set(self._wanted)
      loaded, rejected = set(self._loaded), set(self._rejected)
      loaded_steps = {x.step for x in self._loaded.values()}
    if wanted is None:
      latest = published.read_latest(self.root)
      newest = max(loaded, default=0)
      return ([latest] if latest is not None and latest > newest
              and latest not in loaded | rejected else [])
    found, usable, built, listed_all = [], set(loaded_steps), set(loaded_steps), True
    listed = published.complete_versions(self.root)
    for version in listed:
      step = self._step_of.get(version)
      if step is None and version not in loaded:
        try:
          step = self._step_of[version] = int(published.read_manifest(self.root, version)["step"])
        except published.RejectedVersion as e:
          step = self._step_of[version] = NO_MANIFEST
          if version not in rejected:
            self._reject(version, e.reason)
        except OSError:   # pruned since it was listed, or the bucket did not answer: next
          listed_all = listed_all and version in rejected   # poll (a rejected one: skipped)
      if step is None or step == NO_MANIFEST:   # realm-index does not count it either
        continue
      built.add(step)
      if version in rejected:   # by the loader (another block store, damaged files): never used
        continue
      usable.add(step)
      if step in wanted and version not in loaded:
        found.append(version)
    if listed_all:
      self._step_of = {v: self._step_of[v] for v in listed if v in self._step_of}
      with self._cond:
        self._published_steps, self._newest_built = usable, max(built, default=-1)
    return found

  def poll(self) -> None:
    """One look at `W/index`; loads whatever is new and wanted (called by the thread). A
    bucket that does not answer is waited out as by every read of the path layer, then
    StorageUnreachable names W/index or the version (raised by the trainer's waits)."""
    for version in paths.retried("listing the index versions", self.root, self._candidates):
      try:
        t0 = time.time()
        loaded = paths.retried(f"loading index v{version}",
                               published.version_dir(self.root, version),
                               lambda: self.loader(version))
      except published.RejectedVersion as e:
        self._reject(version, e.reason)
        continue
      except StorageUnreachable:   # (an OSError) not the version's fault: the job stops
        raise
      except (OSError, ValueError) as e:   # e.g. pruned while we read it: try again later
        tries = self._failures[version] = self._failures.get(version, 0) + 1
        logger.warning(f"{self.log_prefix}index v{version}: could not load ({e}); "
                       f"{'giving up' if tries >= MAX_LOAD_ATTEMPTS else 'will retry'}")
        if tries >= MAX_LOAD_ATTEMPTS:
          self._reject(version, str(e))
        continue
      logger.info(f"{self.log_prefix}index v{version} (step {loaded.step}) loaded and verified in "
                  f"{time.time() - t0:.1f}s")
      with self._cond:
        self._loaded[version] = loaded
        self._cond.notify_all()

  def _reject(self, version: int, reason: str) -> None:
    logger.warning(f"{self.log_prefix}index v{version} rejected, not used: {reason}")
    with self._cond:
      self._rejected[version] = reason

  # -- the trainer's side ------------------------------------------------------------------
  @property
  def rejected(self) -> dict[int, str]:
    with self._cond:
      return dict(self._rejected)

  def newest(self) -> IndexVersion | None:
    with self._cond:
      self._raise()
      return self._loaded[max(self._loaded)] if self._loaded else None

  def want_steps(self, steps) -> None:
    with self._cond:
      self._wanted = set(steps) if self._wanted is None else self._wanted | set(steps)

  def wait(self, pick: Callable[[dict[int, IndexVersion]], IndexVersion | None], timeout: float,
           what: str, should_stop: Callable[[], bool] | None = None) -> IndexVersion | None:
    """Blocks until `pick(loaded versions)` returns one; IndexWaitTimeout after `timeout` s;
    None once `should_stop()` says so (asked at least every second: a SIGTERM). A wait for
    the first index says so at once, any wait every WAIT_NOTICE_SECONDS after."""
    start = time.time()
    deadline, notice = start + timeout, start + WAIT_NOTICE_SECONDS
    with self._cond:
      first = not self._loaded
      while True:
        self._raise()
        raise_if_interrupted()   # a recorded Ctrl-C (main thread): the wait may be long
        if self._stop.is_set():
          raise RuntimeError("the index subscriber was closed")
        found = pick(self._loaded)
        if found is not None or (should_stop is not None and should_stop()):
          return found
        now = time.time()
        if now >= deadline:
          raise IndexWaitTimeout(
              f"no published index {what} under {self.root} after {timeout:g}s "
              f"(config.retrieval.index_timeout); "
              f"{self._why_unpublished() or 'is realm-index running with this workdir?'}")
        if first or now >= notice:
          self._say_waiting(what, now - start, timeout)
          first, notice = False, now + WAIT_NOTICE_SECONDS
        self._cond.wait(min(deadline - now, notice - now, 1.0))

  def _say_waiting(self, what: str, waited: float, timeout: float) -> None:
    said = self._why_unpublished()
    logger.info(f"{self.log_prefix}waiting for a published index {what} under {self.root} "
                f"({waited:.0f}s of {timeout:g}s, config.retrieval.index_timeout): it comes from "
                f"`realm-index --config <this config> --workdir {self.workdir}` (launch/local.py "
                f"starts both){'; ' + said if said else ''}")

  def _why_unpublished(self) -> str:
    """What is known of why no version comes ('' if nothing): rejections, a builder gone."""
    return "; ".join(filter(None, (self._rejections(), self.builder_gone())))

  def builder_gone(self) -> str:
    """'' unless W/builder.lock names a realm-index that no longer runs (on this host): a
    builder that died, was stopped or ended (with the run it served: a run resumed with more
    train.steps) publishes nothing until it is started again, so the wait says which and so,
    instead of only asking whether one runs."""
    gone = workdir_lib.job_gone_and_how(self.workdir, "builder")
    if gone is None:
      return ""
    pid, ended = gone[0], gone[1] or "it died or was stopped"
    return (f"realm-index (pid {pid}, {workdir_lib.JobLock(self.workdir, 'builder').path}) is "
            f"not running: {ended}; start it again with this config and workdir")

  def _rejections(self) -> str:
    """The versions rejected so far with their reasons (the newest 3), '' if none: a builder
    run with another config publishes versions that are all rejected."""
    with self._cond:
      rejected = sorted(self._rejected.items())
    if not rejected:
      return ""
    shown = "; ".join(f"v{v}: {reason}" for v, reason in rejected[-3:])
    return f"{len(rejected)} published version(s) rejected ({shown})"

  def wait_for_step(self, step: int, timeout: float,
                    should_stop: Callable[[], bool] | None = None) -> IndexVersion | None:
    """The newest loaded version built from checkpoint `step` (waits for it; None once
    `should_stop()` says so)."""
    self.want_steps([step])

    def pick(loaded):
      matches = [v for v, x in loaded.items() if x.step == step]
      if matches:
        return loaded[max(matches)]
      self._never_published(step)
      return None
    return self.wait(pick, timeout, f"built from step {step}", should_stop)

  def _never_published(self, step: int) -> None:
    """Raises IndexNeverPublished if no usable version of checkpoint `step` is published and one
    of that step or a later one is (rejected versions count: `realm-index` builds only steps
    above the newest it published, whatever the trainer made of it), so the wait could only
    end in `retrieval.index_timeout`. (Called with the lock held.)"""
    newest = self._newest_built
    if step in self._published_steps or newest < step:
      return
    rejected = self._rejections()
    raise IndexNeverPublished(
        f"the index built from checkpoint step {step} is not published under {self.root} and "
        f"will not be: realm-index builds only steps above the newest it published (step "
        f"{newest}). It was pruned (config.builder.keep_versions), rejected, or this workdir "
        f"ran with another config.retrieval.refresh before; resume with the refresh mode it ran "
        f"with, or train in a new workdir{'; ' + rejected if rejected else ''}")

  def release(self, before_version: int = -1, before_step: int = -1) -> None:
    """Drops loaded versions older than `before_version` or built from a step before
    `before_step`, and stops wanting those steps: no batch will retrieve from them again."""
    with self._cond:
      for version, loaded in list(self._loaded.items()):
        if version < before_version or loaded.step < before_step:
          del self._loaded[version]
      if self._wanted is not None:
        self._wanted = {s for s in self._wanted if s >= before_step}

  def _raise(self) -> None:
    if isinstance(self._error, SELF_EXPLAINING):   # its message says it all: one line at the CLI
      raise self._error
    if self._error is not None:
      raise RuntimeError(f"the index subscriber failed: {self._error!r}") from self._error

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)

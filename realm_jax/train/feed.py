"""The batches of the train loop, built ahead in a thread, and the index each step retrieves from.

`VersionSchedule` decides which index version serves step t (`retrieval.refresh`):
  in_process     the trainer rebuilds at multiples of refresh_every and announces each rebuild
                 before its first step: steps [S, S + refresh_every) use the index of step S;
  deterministic  steps [S + swap_lag, S + refresh_every + swap_lag) use the version built from
                 the checkpoint of step S (the first refresh interval uses step 0's), whenever
                 it arrives: a late version makes the feed wait, so runs are reproducible;
  async          the main thread adopts the newest loaded version for the step `depth` ahead
                 of the one it runs (all hosts at the same step: they switch only once every
                 host has loaded it); batches never wait, except for the very first version.
`BatchFeed` builds step t's batch in a thread, `depth` steps ahead: the query batch from the
grain iterator, then (REALM) the candidates retrieved from the index scheduled for step t, on
this process's devices and host only, and the reader inputs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import numpy as np

from realm_jax.errors import (SELF_EXPLAINING, IndexNeverPublished, IndexWaitTimeout,
                              StorageUnreachable)
from realm_jax.retrieval.index import IndexVersion
from realm_jax.runtime import multihost

logger = logging.getLogger(__name__)

_STOPPED, _TIMED_OUT = "stopped", "timed out: "   # a host's outcome of a wait for an index
_FAILED = "failed: "   # ... that raised: "failed: <its class>: <its message>"


def deterministic_source_step(step: int, refresh_every: int, swap_lag: int) -> int:
  """The checkpoint step whose index serves `step` in deterministic mode."""
  if step < swap_lag + refresh_every:
    return 0
  return (step - swap_lag) // refresh_every * refresh_every


class VersionSchedule:
  """Which index serves each step; the feed thread asks, the main thread (or the rule) decides.

  Attributes:
    waits: (step, seconds) of every batch that had to wait for its index, the first excluded.
  """

  def __init__(self, config, subscriber=None, agree: Callable[[int], bool] | None = None):
    self.mode, self.config, self.subscriber = config.retrieval.refresh, config, subscriber
    self.timeout = config.retrieval.index_timeout
    self.agree = agree or (lambda version: True)
    self._entries: list[tuple[int, IndexVersion]] = []   # (first step, index), ascending
    self._horizon = -1                                  # steps <= horizon are decided
    self._cond = threading.Condition()
    self._closed = False
    self.waits: list[tuple[int, float]] = []
    self._first = True

  # -- the main thread ---------------------------------------------------------------------
  def announce(self, from_step: int, loaded: IndexVersion, horizon: int) -> None:
    """Steps >= from_step use `loaded`; steps <= horizon are final (in_process, async)."""
    with self._cond:
      self._entries = [e for e in self._entries if e[0] < from_step] + [(from_step, loaded)]
      self._horizon = max(self._horizon, horizon)
      self._cond.notify_all()

  def start_async(self, start: int, depth: int,
                  should_stop: Callable[[], bool] | None = None) -> IndexVersion:
    """Waits for the first version every host has, used from `start` (the one blocking wait).
    The hosts wait in rounds, each ended by an exchange of what each found, so that all act
    alike: on the version once all have the same newest one, else on another round for the
    newest any has; FeedStopped on every host once `should_stop()` held on one (a SIGTERM:
    the run stops at `start`, saved), IndexWaitTimeout once one ran out of index_timeout, the
    error of a host whose wait failed otherwise (`_exchanged`)."""
    t0 = time.time()
    deadline, least = t0 + self.timeout, 0
    while True:
      mine, loaded, error = self._first_found(least, deadline, should_stop)
      found = _exchanged("first index", mine, max(0.0, deadline - time.time())
                         + multihost.io_wait_timeout(), error)
      if _STOPPED in found:
        raise FeedStopped(start, time.time() - t0, "the first index every process has")
      timed_out = [f for f in found if f.startswith(_TIMED_OUT)]
      if timed_out:
        raise IndexWaitTimeout(timed_out[0][len(_TIMED_OUT):])
      if len(set(found)) == 1:
        break
      least = max(map(int, found))   # another host has a newer one: every host waits for it
    logger.info(f"[realm] first index v{loaded.version} (step {loaded.step}) after "
                f"{time.time() - t0:.1f}s")
    # steps up to start + depth - 1 are final: advance_async(start) decides start + depth (on
    # every host alike; a horizon one further would let a feed build that step with this
    # version while advance_async gives it the next one)
    self.announce(start, loaded, start + depth - 1)
    return loaded

  def _first_found(self, least: int, deadline: float, should_stop: Callable[[], bool] | None
                   ) -> tuple[str, IndexVersion | None, Exception | None]:
    """This host's part of a round of `start_async`: its newest version once that is `least`
    or newer (the number, and the version), else _STOPPED, _TIMED_OUT or _FAILED and why
    (and the error it raised)."""
    try:
      loaded = self.subscriber.wait(
          lambda have: have[max(have)] if have and max(have) >= least else None,
          self.timeout if least == 0 else max(0.0, deadline - time.time()),
          "at all" if least == 0 else f"v{least} or newer (another process has it; the rest "
          f"of the first wait's {self.timeout:g}s)", should_stop)
    except IndexWaitTimeout as e:
      return _TIMED_OUT + str(e), None, None
    except Exception as e:  # noqa: BLE001  (raised after the exchange, on every process)
      return f"{_FAILED}{type(e).__name__}: {e}", None, e
    return (_STOPPED, None, None) if loaded is None else (str(loaded.version), loaded, None)

  def advance_async(self, step: int, depth: int) -> None:
    """Before running `step`: adopt the newest loaded version from step + depth on, once
    every host has it. Every host asks at every step (a collective with several processes:
    a host that asked only when it had a newer version would wait in it while the others
    went on to the train step's collectives)."""
    newest = self.subscriber.newest()
    with self._cond:
      current = self._entries[-1][1]
    horizon = step + depth
    everywhere = self.agree(-1 if newest is None else newest.version)
    if newest is not None and newest.version > current.version and everywhere:
      self.announce(horizon, newest, horizon)
      return
    self.announce_horizon(horizon)

  def announce_horizon(self, horizon: int) -> None:
    with self._cond:
      self._horizon = max(self._horizon, horizon)
      self._cond.notify_all()

  # -- the feed thread ---------------------------------------------------------------------
  def for_step(self, step: int) -> tuple[IndexVersion, float]:
    """The index serving `step`, and the seconds spent waiting for that index to arrive.

    Waiting for the main thread to decide (in_process, async) is pacing, not an index wait:
    the feed is then ahead of the train step.
    """
    waited = 0.0
    if self.mode == "deterministic":
      r = self.config.retrieval
      source = deterministic_source_step(step, r.refresh_every, r.swap_lag)
      t0 = time.time()
      loaded = self.subscriber.wait_for_step(source, self.timeout)
      waited = time.time() - t0
      self.subscriber.release(before_step=source)
      following = source + r.refresh_every   # loaded in the background once published, so the
      last = self.config.train.steps - 1      # swap to it does not wait (if a step reads it)
      if following <= deterministic_source_step(last, r.refresh_every, r.swap_lag):
        self.subscriber.want_steps([following])
    else:
      with self._cond:
        while self._horizon < step and not self._closed:
          self._cond.wait(1.0)
        if self._closed:
          raise RuntimeError("the index schedule was closed")
        loaded = [idx for first, idx in self._entries if first <= step][-1]
        # entries before this one will never serve a later step again
        self._entries = [e for e in self._entries if e[1] is loaded or e[0] > step]
      if self.subscriber is not None:
        self.subscriber.release(before_version=loaded.version)
    if not self._first and waited > 0.01:
      self.waits.append((step, waited))
    self._first = False
    return loaded, waited

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()


class FeedStopped(Exception):
  """`BatchFeed.next` gave up waiting for a batch because `should_stop()` said so (a SIGTERM
  while the batch waits for its index, say a deterministic version the builder is late with),
  or a wait that every process ends alike (`stopped_anywhere`): `VersionSchedule.start_async`
  for the first index, `BatchFeed.next_together` for a deterministic version, an evaluation
  for its index (`what` then names it)."""

  def __init__(self, step: int, waited: float, waiting_for: str = "its index, or its data",
               what: str | None = None):
    super().__init__(f"{what or f'the batch of step {step + 1}'} was not ready after "
                     f"{waited:.1f}s ({waiting_for})")
    self.step = step


def stopped_anywhere(stopped: bool, index_timeout: float,
                     error: Exception | None = None) -> bool:
  """Whether a wait between steps that every process makes (for an index) stopped on a
  SIGTERM on any process: each says whether its own did, all get the one answer, so that all
  stop, or all go on (a process that went on alone would wait in the next collective for
  the others). Every process calls it at the same point; another may still wait for its
  index up to `index_timeout`, then on storage. A wait that raised `error` (its index timed
  out, or will never be published, on this process only, maybe) says so too, and every
  process raises: this one `error`, the others the first failed process's (`_peer_error`)."""
  mine = (f"{_FAILED}{type(error).__name__}: {error}" if error is not None else
          _STOPPED if stopped else "on")
  return _STOPPED in _exchanged("stopped waiting", mine,
                                index_timeout + multihost.io_wait_timeout(), error)


def _exchanged(name: str, mine: str, timeout: float, error: Exception | None) -> list[str]:
  """Every process's `mine` (`multihost.every_process`, `name`), which says how its wait for
  an index ended: where one's wait raised (`error` on this one, then `mine` says _FAILED and
  why), every process raises: this one `error`, the others the first failed process's
  (`_peer_error`)."""
  try:
    found = multihost.every_process(name, mine, timeout)
  except RuntimeError:   # another process gone: this one's error says more than that
    if error is None:
      raise
  if error is not None:
    raise error
  failed = [(p, f[len(_FAILED):]) for p, f in enumerate(found) if f.startswith(_FAILED)]
  if failed:
    raise _peer_error(*failed[0])
  return found


def waited_together(wait: Callable[[], object | None], index_timeout: float
                    ) -> tuple[object | None, bool]:
  """(`wait()`'s value, None where it stopped, and whether a wait stopped on any process):
  a wait for an index that every process makes at the same point (`stopped_anywhere`: an
  error of one, raised on every process)."""
  value, error = None, None
  try:
    value = wait()
  except FeedStopped:
    pass
  except Exception as e:  # noqa: BLE001  (raised after the exchange, on every process)
    error = e
  return value, stopped_anywhere(value is None, index_timeout, error)


def _peer_error(process: int, said: str) -> Exception:
  """The error of another process's wait for an index (`said`: its class and message): an
  index or storage error as the same class with the same message (one line at the CLI, as
  there), another as a RuntimeError naming that process."""
  name, _, message = said.partition(": ")
  known = {e.__name__: e for e in (IndexWaitTimeout, IndexNeverPublished, StorageUnreachable)}
  return known[name](message) if name in known else RuntimeError(f"process {process}: {said}")


class BatchFeed:
  """Step t's host batch, built in a thread `depth` steps ahead of the train step (up to
  `end`, the run's last step: none is built for a step the run will not take, whose index
  may never come).

  `assemble(t, queries)` turns the query batch of step t into the step's batch plus a dict of
  what it used (index version, ...). Each item also carries the grain iterator's state after
  step t's queries were taken: what a checkpoint written after step t must keep.
  """

  def __init__(self, iterator, assemble: Callable[[int, dict], tuple[dict, dict]],
               start_step: int, depth: int, end: int | None = None):
    self._iterator, self._assemble, self._end = iterator, assemble, end
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._stop = threading.Event()
    self._next = start_step
    self._thread = threading.Thread(target=self._run, args=(start_step,), name="batch-feed",
                                    daemon=True)
    self._thread.start()

  def _run(self, step: int) -> None:
    try:
      while not self._stop.is_set() and (self._end is None or step < self._end):
        queries = next(self._iterator)
        state = self._iterator.get_state()
        batch, used = self._assemble(step, queries)
        self._put((step, batch, used, state))
        step += 1
    except BaseException as e:  # noqa: BLE001  (re-raised in the train loop's thread)
      self._put(e)

  def _put(self, item) -> None:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.5)
        return
      except queue.Full:
        continue

  def next(self, should_stop: Callable[[], bool] | None = None
           ) -> tuple[dict[str, np.ndarray], dict, dict]:
    """(batch, what it used, iterator state after it) of the next step, in order; a
    FeedStopped once `should_stop()` says so while it waits."""
    t0 = time.time()
    while True:
      try:
        item = self._queue.get(timeout=0.5)
        break
      except queue.Empty:
        if should_stop is not None and should_stop():
          raise FeedStopped(self._next, time.time() - t0) from None
    if isinstance(item, SELF_EXPLAINING):   # its message says it all: one line at the CLI
      logger.error(f"the batch of step {self._next + 1} could not be built:")
      raise item
    if isinstance(item, BaseException):
      raise RuntimeError(
          f"building the batch of step {self._next + 1} failed: {item!r}") from item
    _, batch, used, state = item
    self._next += 1
    return batch, used, state

  def next_together(self, should_stop: Callable[[], bool], index_timeout: float
                    ) -> tuple[dict[str, np.ndarray], dict, dict]:
    """`next`, for a batch that may wait long for its index on every process (a deterministic
    version the builder is late with): each process waits until its batch is ready or
    `should_stop()` says so (a SIGTERM to any process), then FeedStopped on every process if
    one stopped, an error on every process if one's batch failed (`stopped_anywhere`)."""
    step, t0 = self._next, time.time()
    fed, stopped = waited_together(lambda: self.next(should_stop), index_timeout)
    if stopped:
      raise FeedStopped(step, time.time() - t0, "its index, or its data" +
                        ("" if fed is None else ", on another process"))
    return fed

  def close(self) -> None:
    self._stop.set()
    while True:   # unblock a feed waiting on a full queue
      try:
        self._queue.get_nowait()
      except queue.Empty:
        break
    self._thread.join(timeout=30)
    if self._thread.is_alive():
      logger.warning("warning: the batch feed thread did not stop within 30s")

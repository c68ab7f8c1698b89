"""Preemption: on SIGTERM the trainer finishes its step, saves a checkpoint, and exits.

One process: a SIGTERM handler notes the signal; the loop asks `reached(step)` after every step.
Several processes: JAX's preemption sync manager (started by `jax.distributed.initialize`, it
owns SIGTERM there) makes every process answer True at the same step, so all of them save the
same checkpoint. Either way a watchdog gives the save `grace_seconds` from the moment it is
known: if the checkpoint is not finalised by then, the process exits without it (the previous
finalised checkpoint stays the latest) rather than be killed mid-write by the scheduler.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

EXIT_CODE = 143   # 128 + SIGTERM: schedulers restart the job; the rerun resumes


class Preemption:
  """SIGTERM bookkeeping for one training run (`close()` restores the previous handler)."""

  def __init__(self, grace_seconds: float, prefix: str = ""):
    import jax
    self.grace, self.prefix = float(grace_seconds), prefix
    self.received_at: float | None = None
    self.multihost = jax.process_count() > 1
    self._saved = threading.Event()
    self._previous = None
    if not self.multihost and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)

  def _on_signal(self, signum, frame) -> None:
    if self.received_at is None:
      self._start(time.time())

  def _start(self, now: float) -> None:
    self.received_at = now
    print(f"{self.prefix}SIGTERM: finishing this step, then saving a checkpoint (grace "
          f"{self.grace:g}s)", flush=True)
    threading.Thread(target=self._watchdog, name="preemption-watchdog", daemon=True).start()

  def _watchdog(self) -> None:
    if self._saved.wait(max(0.0, self.received_at + self.grace - time.time())):
      return
    print(f"{self.prefix}SIGTERM: the checkpoint was not finalised within the grace period "
          f"({self.grace:g}s, config.train.preemption_grace_seconds); exiting without it",
          file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)

  def requested(self) -> bool:
    """Whether this process got SIGTERM (asked between steps, e.g. by an index rebuild that
    then yields; with several processes JAX's sync manager owns the signal: False here)."""
    return self.received_at is not None

  def reached(self, step: int) -> bool:
    """Whether to save and stop after `step` (the same answer on every process)."""
    if self.multihost:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        if self.received_at is None:
          self._start(time.time())
        return True
      return False
    return self.received_at is not None

  def saved(self, step: int, checkpointer) -> None:
    """Waits until `checkpointer` has finalised the checkpoint of `step`, then stops the
    watchdog and says so."""
    checkpointer.wait()
    self._saved.set()
    latest = checkpointer.latest_step()
    since = "the start" if latest is None else f"checkpoint {latest}"
    what = f"checkpoint {step} finalised" if latest == step else f"no step since {since}"
    print(f"{self.prefix}SIGTERM: {what} {time.time() - self.received_at:.1f}s after the "
          "signal; exiting (rerun the same command to resume)", flush=True)

  def close(self) -> None:
    """Ends the bookkeeping once the run has closed (its checkpointer too: a SIGTERM while a
    save finalises is still the run's): the watchdog stops, the previous handler is back. A
    SIGTERM the run did not answer with a saved step (it came after the last step) leaves the
    run as it stands, and goes on to a handler its caller installed (the demo's stops there).
    """
    unanswered = self.received_at is not None and not self._saved.is_set()
    self._saved.set()   # a watchdog left running would end the caller's process later
    previous, self._previous = self._previous, None
    if previous is None:
      return
    signal.signal(signal.SIGTERM, previous)
    if unanswered:
      print(f"{self.prefix}SIGTERM: no step saved for it (it came after the last step, or "
            "as the run failed); the run ends as it stands", flush=True)
      if callable(previous):
        previous(signal.SIGTERM, None)

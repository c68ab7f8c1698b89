"""Preemption: on SIGTERM the trainer finishes its step, saves a checkpoint, and exits.

One process: a SIGTERM handler notes the signal; the loop asks `reached(step)` after every step.
Several processes: JAX's preemption sync manager (started by `jax.distributed.initialize`, it
owns SIGTERM there) makes every process answer True at the same step, so all of them save the
same checkpoint. A wait between steps (for a published index: the first, a late
`deterministic` version, an evaluation's; an in-process rebuild) asks `noticed()` as it
goes, and its processes agree before they stop. Either way a watchdog gives the save
`grace_seconds` from the moment it is known: if the checkpoint is not finalised by then, the
process exits without it (code 75, not 143: the previous finalised checkpoint stays the
latest) rather than be killed mid-write by the scheduler.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

EXIT_CODE = 143   # 128 + SIGTERM: schedulers restart the job; the rerun resumes
EXIT_UNSAVED = 75    # EX_TEMPFAIL: stopped on SIGTERM, its step's save unfinished within the
                     # grace (not 143, which says the step was saved, nor 137, a kill); the
                     # rerun resumes from the latest finalised checkpoint


class Preemption:
  """SIGTERM bookkeeping for one training run (`close()` restores the previous handler)."""

  def __init__(self, grace_seconds: float, prefix: str = ""):
    import jax
    self.grace, self.prefix = float(grace_seconds), prefix
    self.received_at: float | None = None
    self.multihost = jax.process_count() > 1
    self._saved = threading.Event()
    self._previous = None
    self._answered = False  # close(): the run answered a SIGTERM with a saved step
    self._phase = "steps"   # "steps" -> "after" (the last step ran) -> "closing" (close())
    self._saving = None     # "after": whether the last step's save is still being written
    if not self.multihost and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)

  def _on_signal(self, signum, frame) -> None:
    if self.received_at is not None:
      return
    if self._phase == "closing":
      self.received_at = time.time()   # release() passes it on
    else:
      self._start(time.time())

  def _start(self, now: float, stops: bool = False) -> None:
    self.received_at = now
    if self._phase == "steps":   # `stops`: every process stops now (`stopping`)
      doing = "saving a checkpoint" if stops else "finishing this step, then saving a checkpoint"
    else:   # `stops`: the processes agreed to stop (a final evaluation's wait for its index)
      doing = "after the last step: " + ("stopping, its checkpoint kept" if stops else
                                         "finishing the run")
    logger.warning(f"{self.prefix}SIGTERM: {doing} (grace {self.grace:g}s)")
    threading.Thread(target=self._watchdog, name="preemption-watchdog", daemon=True).start()

  def _watchdog(self) -> None:
    if self._saved.wait(max(0.0, self.received_at + self.grace - time.time())):
      return
    try:
      unsaved = self._phase == "steps" or (self._saving is not None and self._saving())
    except Exception:  # noqa: BLE001  (exit regardless; not known to be saved)
      unsaved = True
    what = "the checkpoint was not finalised" if self._phase == "steps" else \
        "the run did not finish" + (" (its last step's checkpoint not finalised)"
                                    if unsaved else "")
    logger.warning(
        f"{self.prefix}SIGTERM: {what} within the grace period ({self.grace:g}s, "
        "config.train.preemption_grace_seconds); exiting (a rerun resumes from the latest "
        "finalised checkpoint)")
    os._exit(EXIT_UNSAVED if unsaved else EXIT_CODE)

  def steps_done(self, saving=None) -> None:
    """The last step ran and its checkpoint was issued: a SIGTERM from now on finds the run
    finishing (final evaluation, closing), not stepping. `saving()`: whether that checkpoint
    is still being written (then the watchdog's exit is 75, not 143: the step is not saved)."""
    self._saving = saving
    self._phase = "after"

  def requested(self) -> bool:
    """Whether this process got SIGTERM (asked between steps, e.g. by a batch's wait for its
    data, which then yields; with several processes JAX's sync manager owns the signal:
    False here)."""
    return self.received_at is not None

  def noticed(self) -> bool:
    """Whether a SIGTERM reached this process or, with several processes, any process of the
    job (the notice JAX's sync manager writes into the coordination service): for a wait
    that polls between steps. The processes may notice at different moments: those that
    wait together agree on it through an exchange before they stop (`stopping`)."""
    if self.received_at is not None:
      return True
    if not self.multihost:
      return False
    from realm_jax.runtime import multihost   # (not at the top: launchers import EXIT_CODE)
    return multihost.preemption_noticed()

  def stopping(self) -> None:
    """Every process stops to save (at JAX's sync point, or agreed during a wait): the grace
    starts now on a process whose signal JAX's handler took (several processes)."""
    if self.received_at is None:
      self._start(time.time(), stops=True)

  def reached(self, step: int) -> bool:
    """Whether to save and stop after `step` (the same answer on every process)."""
    if self.multihost:
      from jax.experimental import multihost_utils
      if multihost_utils.reached_preemption_sync_point(step):
        self.stopping()
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
    logger.warning(f"{self.prefix}SIGTERM: {what} {time.time() - self.received_at:.1f}s after the "
                   "signal; exiting (rerun the same command to resume)")

  def close(self) -> None:
    """Ends the bookkeeping of the steps once the run has closed (its checkpointer too: a
    SIGTERM while a save finalises is still the run's): the watchdog stops (it would end a
    caller's process later). The handler stays until `release()`, after the run's records:
    a SIGTERM until then is noted, not acted on."""
    self._phase = "closing"
    self._answered = self._saved.is_set()
    self._saved.set()

  def release(self, pass_on: bool = True) -> None:
    """After the run: the previous SIGTERM handler is back, and a SIGTERM the run did not
    answer with a saved step (it came after the last step) goes on to it if `pass_on` (the
    run, its closing and its summary succeeded; else their error says more): a caller that
    trains in its own process (the demo's handler stops the demo) finds the run finished."""
    previous, self._previous = self._previous, None
    if previous is None:
      return
    signal.signal(signal.SIGTERM, previous)
    if self.received_at is None or self._answered or not pass_on:
      return
    logger.warning(f"{self.prefix}SIGTERM after the last step: the run has finished"
                   f"{'; passing the signal on' if callable(previous) else ''}")
    if callable(previous):
      previous(signal.SIGTERM, None)

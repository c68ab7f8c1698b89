"""A `jax.profiler` trace of a few training steps (`train.profile_first_step`,
`train.profile_steps`) into `W/tb/profile`: TensorBoard's Profile tab (`tensorboard --logdir
W/tb`, with the `tensorboard-plugin-profile` / xprof package) or Perfetto (the
`*.trace.json.gz` beside each `*.xplane.pb`) shows where each step's time went on the device
and on the host (the feed thread's batches included).

Each process traces itself. With several processes each writes under `process_<i>`: the
trace's file is named by host name, which processes on one machine share. A bucket workdir's
trace is written locally (`paths.local_side`, as its TensorBoard events are), then uploaded
to `W/tb/profile` whole: unlike the events, it is written once."""

from __future__ import annotations

import glob
import logging
import os
import time

import jax

from realm_jax import paths

logger = logging.getLogger(__name__)


def trace_dir(tb_dir: str) -> str:
  """Where this process's trace goes under a TensorBoard dir: `profile[/process_<i>]`."""
  return paths.join(tb_dir, "profile") if jax.process_count() == 1 else \
      paths.join(tb_dir, "profile", f"process_{jax.process_index()}")


class StepTrace:
  """Traces steps `first`..`first + steps - 1` (1-based, as the progress lines count them) of
  a run that runs steps `start + 1`..`total`; nothing where `first` is 0 or outside them. A
  resumed run's first step compiles the step again, as step 1 does: it is left out."""

  def __init__(self, train_config, workdir: str, start: int, total: int, prefix: str = ""):
    first = int(train_config.get("profile_first_step", 0))
    # a run resumed inside the window traces its rest after its own compile (a trace holding
    # one holds little else: its .trace.json.gz keeps the first million events, the compile's)
    warm = start + 2 if start else 1
    self.first = max(first, warm)
    self.last = min(first + int(train_config.get("profile_steps", 3)) - 1, total)
    self.wanted = first > 0 and self.first <= self.last
    self.workdir, self.prefix = workdir, prefix
    self.directory = trace_dir(paths.local_side(workdir, "tb"))
    self._began: float | None = None   # when the trace started (None: not tracing)
    self._step = None                  # the annotation of the step being traced
    self._done = 0                     # the last step traced whole
    if first > 0 and not self.wanted:
      logger.info(f"{prefix}train.profile_first_step {first}: its steps are not among this "
                  f"run's after its compile ({warm}-{total}; {start + 1} compiles); no trace")

  def before(self, done: int) -> None:
    """Before the batch of step `done` (1-based) is fetched: the trace starts at the window's
    first step, and each step traced is marked as one (TensorBoard's step-time pages)."""
    if self.wanted and done == self.first and self._began is None:
      try:
        os.makedirs(self.directory, exist_ok=True)
        jax.profiler.start_trace(self.directory)
      except (OSError, RuntimeError) as e:   # one trace per process: the caller's own, running
        self.wanted = False
        logger.warning(f"{self.prefix}train.profile_first_step: no trace ({e})")
        return
      self._began = time.time()
      logger.info(f"{self.prefix}tracing steps {self.first}-{self.last} into {self.directory} "
                  f"(jax.profiler)")
    if self._began is not None:
      self._step = jax.profiler.StepTraceAnnotation("train", step_num=done)
      self._step.__enter__()

  def after(self, done: int, metrics, stopping: bool = False) -> None:
    """After step `done` ran (`metrics`: its outputs, waited for before the trace stops).
    `stopping`: a SIGTERM came, so step `done` is saved next; the trace is written after that
    save (`stop`, as the run closes), not out of the grace the save has."""
    if self._began is None:
      return
    self._end_step(done)
    if done >= self.last and not stopping:
      jax.block_until_ready(metrics)
      self.stop()

  def _end_step(self, done: int | None = None) -> None:
    if self._step is not None:
      self._step.__exit__(None, None, None)
      self._step = None
    if done is not None:
      self._done = done

  def stop(self) -> None:
    """Ends a trace still running (also when the run stops inside the window: its steps so
    far are kept) and says where it is."""
    if self._began is None:
      return
    self._end_step()
    began, self._began = self._began, None
    self.wanted = False
    what = f"steps {self.first}-{self._done}" if self._done else "no whole step"
    try:
      jax.profiler.stop_trace()
    except Exception as e:  # noqa: BLE001  (a full disk: the run goes on, closes its parts)
      logger.warning(f"{self.prefix}the trace could not be written to {self.directory} ({e}); "
                     f"the run goes on untraced")
      return
    seconds = time.time() - began   # from the trace's start to its written end
    sessions = sorted(glob.glob(os.path.join(self.directory, "plugins", "profile", "*")),
                      key=os.path.getmtime)
    where, logdir = self._uploaded(sessions[-1]) if sessions else (self.directory, "")
    logger.info(f"{self.prefix}trace of {what} ({seconds:.1f}s) written to {where} (tensorboard "
                f"--logdir {logdir or paths.local_side(self.workdir, 'tb')}, Profile tab; or "
                f"its .trace.json.gz in Perfetto)")

  def _uploaded(self, session: str) -> tuple[str, str]:
    """Where the trace `session` (a local dir) is, and the TensorBoard dir holding it: a bucket
    workdir's is uploaded to W/tb/profile (written once: the bucket takes it whole)."""
    local = (session, paths.local_side(self.workdir, "tb"))
    if not paths.is_remote(self.workdir):
      return local
    logdir = paths.join(self.workdir, "tb")
    target = paths.join(trace_dir(logdir), os.path.relpath(session, self.directory))
    try:
      paths.upload_tree(session, target, log=lambda line: None)
    except Exception as e:  # noqa: BLE001  (the run goes on: the trace is not its output)
      logger.warning(f"{self.prefix}the trace could not be uploaded to {target} ({e}); it "
                     f"stays in {session}")
      return local
    return target, logdir

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
    self._began: float | None = None
    if first > 0 and not self.wanted:
      logger.info(f"{prefix}train.profile_first_step {first}: its steps are not among this "
                  f"run's after its compile ({warm}-{total}; {start + 1} compiles); no trace")

  def before(self, done: int) -> None:
    """Before the batch of step `done` (1-based) is fetched."""
    if self.wanted and done == self.first and self._began is None:
      os.makedirs(self.directory, exist_ok=True)
      try:
        jax.profiler.start_trace(self.directory)
      except RuntimeError as e:   # one trace per process: its caller's own, running
        self.wanted = False
        logger.warning(f"{self.prefix}train.profile_first_step: no trace ({e})")
        return
      self._began = time.time()
      logger.info(f"{self.prefix}tracing steps {self.first}-{self.last} into {self.directory} "
                  f"(jax.profiler)")

  def after(self, done: int, metrics) -> None:
    """After step `done` ran (`metrics`: its outputs, waited for before the trace stops)."""
    if self._began is not None and done >= self.last:
      jax.block_until_ready(metrics)
      self.stop(f"steps {self.first}-{done}")

  def stop(self, what: str = "") -> None:
    """Ends a trace still running (also when the run stops inside the window: its steps so
    far are kept) and says where it is."""
    if self._began is None:
      return
    seconds, self._began = time.time() - self._began, None
    self.wanted = False
    try:
      jax.profiler.stop_trace()
    except Exception as e:  # noqa: BLE001  (a full disk: the run goes on, closes its parts)
      logger.warning(f"{self.prefix}the trace could not be written to {self.directory} ({e}); "
                     f"the run goes on untraced")
      return
    sessions = sorted(glob.glob(os.path.join(self.directory, "plugins", "profile", "*")),
                      key=os.path.getmtime)
    where = sessions[-1] if sessions else self.directory
    logdir = paths.local_side(self.workdir, "tb")
    if paths.is_remote(self.workdir) and sessions:   # written once: the bucket takes it whole
      logdir = paths.join(self.workdir, "tb")
      target = paths.join(trace_dir(logdir), os.path.relpath(where, self.directory))
      try:
        paths.upload_tree(where, target, log=lambda line: None)
        where = target
      except Exception as e:  # noqa: BLE001  (the run goes on: the trace is not its output)
        logdir = paths.local_side(self.workdir, "tb")
        logger.warning(f"{self.prefix}the trace could not be uploaded to {target} ({e}); it "
                       f"stays in {where}")
    logger.info(f"{self.prefix}trace of {what or 'the steps run'} ({seconds:.1f}s) written to "
                f"{where} (tensorboard --logdir {logdir}, Profile tab; or its .trace.json.gz "
                f"in Perfetto)")

"""Metrics to `W/metrics/<name>.jsonl` (always) and TensorBoard event files under `W/tb`."""

from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np

from realm_jax import paths

logger = logging.getLogger(__name__)


def window_scalars(window: list[dict], seconds: float, learning_rate: float) -> dict:
  """The mean of each train metric over the steps since the last log line, with the step
  rate and the learning rate."""
  scalars = {k: float(np.mean([jax.device_get(m[k]) for m in window])) for k in window[0]}
  scalars.update(steps_per_second=len(window) / seconds, learning_rate=learning_rate)
  return scalars


class MetricWriter:
  """Writes scalars as JSONL lines (`{"step", "time", ...}`) and TensorBoard scalars.

  Only process 0 writes (every process computes the same replicated metrics).

  `from_step`: the first step this run may log (a fresh start: 0; a run resumed from the
  checkpoint of step s: s + 1). What an earlier run logged from that step on (the steps after
  its last checkpoint, which this run takes again) is dropped from the JSONL and hidden in
  TensorBoard (its purge step), so that each step is there once. None: everything stays.
  """

  def __init__(self, workdir: str, name: str, from_step: int | None = None):
    self.enabled = jax.process_index() == 0
    self.name = name
    if not self.enabled:
      return
    paths.makedirs(paths.join(workdir, "metrics"))
    keep = None if from_step is None else (lambda line: _logged_before(line, from_step))
    self._jsonl = paths.AppendLog(paths.join(workdir, "metrics", f"{name}.jsonl"), keep)
    self._tb = _tensorboard_writer(_tensorboard_dir(workdir, name), from_step)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.enabled:
      return
    clean = {k: float(np.asarray(v)) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": int(step), "time": round(time.time(), 3), **clean})
                      + "\n")
    if self._tb is not None:
      for key, value in clean.items():
        self._tb.add_scalar(f"{self.name}/{key}", value, step)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


_TB_NOTED: set[str] = set()


def _tensorboard_dir(workdir: str, name: str) -> str:
  """`W/tb/<name>`; for a bucket workdir a local dir, said once per workdir: tensorboardX's
  bucket writer uploads the whole file again at every flush and blocks at exit while the
  bucket is unreachable (the metrics JSONL goes to the bucket)."""
  local = paths.local_side(workdir, "tb")
  if paths.is_remote(workdir) and workdir not in _TB_NOTED:
    _TB_NOTED.add(workdir)
    logger.info(f"TensorBoard events of {workdir} are written locally to {local} (tensorboard "
                f"--logdir {local}); the metrics JSONL goes to {workdir}/metrics")
  return paths.join(local, name)


def _logged_before(line: str, step: int) -> bool:
  """Whether a JSONL line records a step before `step` (a line that cannot be read: no)."""
  try:
    return int(json.loads(line)["step"]) < step
  except (ValueError, KeyError, TypeError, OverflowError):
    return False


def _tensorboard_writer(directory: str, purge_step: int | None = None):
  """tensorboardX's writer for `directory`; None without tensorboardX (the JSONL is always
  written). `purge_step`: TensorBoard hides the events of that step and later that the
  directory held before."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    return None
  return SummaryWriter(directory, flush_secs=10, purge_step=purge_step)


def read_jsonl(path: str) -> list[dict]:
  text = paths.read_text(path)
  return [] if text is None else [json.loads(line) for line in text.splitlines()
                                  if line.strip()]


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"

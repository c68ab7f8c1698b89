"""Metrics to `W/metrics/<name>.jsonl` (always) and TensorBoard event files under `W/tb`."""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import numpy as np

from realm_jax import paths

logger = logging.getLogger(__name__)


def _window_keys(window: list[dict]) -> list[str]:
  """The metrics of a window's steps, in the order they first come: a run resumed under
  another config (`retrieval.loss`, `retrieval.train_null_document`) steps with other metrics
  than the steps it carried over from the checkpoint."""
  return list(dict.fromkeys(k for m in window for k in m))


def window_record(window: list[dict]) -> dict:
  """The train metrics of the steps since the last log line as a checkpoint keeps them (JSON:
  each metric's dtype and values, exact; None for a step without that metric), so that a run
  resumed from that checkpoint logs the means of the same steps as a run that went on
  (`window_from_record`); {} for none."""
  record = {}
  for k in _window_keys(window):
    values = [None if k not in m else np.asarray(jax.device_get(m[k])) for m in window]
    record[k] = {"dtype": next(v for v in values if v is not None).dtype.name,
                 "values": [None if v is None else v.item() for v in values]}
  return record


def window_from_record(record: dict | None) -> list[dict]:
  """The window of `window_record(window)`, its values in their own dtypes (the same means)."""
  if not record:
    return []
  steps = len(next(iter(record.values()))["values"])
  return [{k: np.asarray(v["values"][i], jax.numpy.dtype(v["dtype"])) for k, v in record.items()
           if v["values"][i] is not None} for i in range(steps)]


def window_scalars(window: list[dict], seconds: float, learning_rate: float,
                   steps: int) -> dict:
  """The mean of each train metric over the steps since the last log line that have it,
  with the step rate (of the `steps` run in these `seconds`: a skipped update's step too
  (`train.nonfinite=skip`), which the window leaves out, and not the steps of a run stopped
  before it logged them, which a resumed window carries) and the learning rate."""
  scalars = {k: float(np.mean([jax.device_get(m[k]) for m in window if k in m]))
             for k in _window_keys(window)}
  scalars.update(steps_per_second=max(steps, 1) / seconds, learning_rate=learning_rate)
  return scalars


class MetricWriter:
  """Writes scalars as JSONL lines (`{"step", "time", ...}`) and TensorBoard scalars.

  Only process 0 writes (every process computes the same replicated metrics).

  `from_step`: the first step this run may log (a fresh start: 0; a run resumed from the
  checkpoint of step s: s + 1). What an earlier run logged from that step on (the steps after
  its last checkpoint, which this run takes again) is dropped from the JSONL and hidden in
  TensorBoard (its purge step), so that each step is there once. None: everything stays.

  `held`: a log written at every step, whose lines a bucket takes at most every
  `paths.BUCKET_HOLD_SECONDS` (the rest wait for the next send, a checkpoint or the close).
  """

  def __init__(self, workdir: str, name: str, from_step: int | None = None,
               held: bool = False):
    self.enabled = jax.process_index() == 0
    self.name = name
    if not self.enabled:
      return
    paths.makedirs(paths.join(workdir, "metrics"))
    keep = None if from_step is None else (lambda line: _logged_before(line, from_step))
    self._jsonl = paths.AppendLog(paths.join(workdir, "metrics", f"{name}.jsonl"), keep,
                                  paths.BUCKET_HOLD_SECONDS if held else 0.0)
    self._tb = _tensorboard_writer(_tensorboard_dir(workdir, name), from_step)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.enabled:
      return
    clean = {k: _number(v) for k, v in scalars.items()}
    record = {"step": int(step), "time": round(time.time(), 3), **clean}
    self._jsonl.write(json.dumps(paths.json_ready(record)) + "\n")
    if self._tb is not None:
      self._tb.write(step, {f"{self.name}/{k}": v for k, v in clean.items()})

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


def _number(value) -> float | int:
  """A scalar as a Python number: integers (counts, versions, steps) stay integers."""
  value = np.asarray(value)
  return int(value) if value.dtype.kind in "iub" else float(value)


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
  """An `_EventFile` in `directory`; None without tensorboardX (the JSONL is always written).
  `purge_step`: TensorBoard hides the events of that step and later that the directory held
  before."""
  import importlib.util
  if importlib.util.find_spec("tensorboardX") is None:
    return None
  return _EventFile(directory, purge_step)


class _EventFile:
  """A new TensorBoard event file, each event on disk when `write` returns. (tensorboardX's
  SummaryWriter queues events for a thread that flushes every few seconds: those still queued
  when a run is killed -9 were lost for good, as the resumed run logs only the steps after its
  checkpoint.)"""

  def __init__(self, directory: str, purge_step: int | None):
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.proto.summary_pb2 import Summary
    self._event, self._summary = Event, Summary   # (written every step: imported once)
    os.makedirs(directory, exist_ok=True)
    self._file = EventsWriter(os.path.join(directory, "events"))
    if purge_step is not None:   # what SummaryWriter(purge_step=) writes first
      self._file.write_event(Event(step=purge_step, file_version="brain.Event:2"))
      self._file.write_event(Event(step=purge_step,
                                   session_log=SessionLog(status=SessionLog.START)))
    self._file.flush()

  def write(self, step: int, scalars: dict[str, float]) -> None:
    values = [self._summary.Value(tag=tag, simple_value=value)
              for tag, value in scalars.items()]
    self._file.write_event(self._event(wall_time=time.time(), step=int(step),
                                       summary=self._summary(value=values)))
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def read_jsonl(path: str) -> list[dict]:
  text = paths.read_text(path)
  return [] if text is None else [json.loads(line) for line in text.splitlines()
                                  if line.strip()]



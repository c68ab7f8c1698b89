"""Metrics to `W/metrics/<name>.jsonl` (always) and TensorBoard event files under `W/tb`."""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np


def window_scalars(window: list[dict], seconds: float, learning_rate: float) -> dict:
  """The mean of each train metric over the steps since the last log line, with the step
  rate and the learning rate."""
  scalars = {k: float(np.mean([jax.device_get(m[k]) for m in window])) for k in window[0]}
  scalars.update(steps_per_second=len(window) / seconds, learning_rate=learning_rate)
  return scalars


class MetricWriter:
  """Writes scalars as JSONL lines (`{"step", "time", ...}`) and TensorBoard scalars.

  Only process 0 writes (every process computes the same replicated metrics).
  """

  def __init__(self, workdir: str, name: str):
    self.enabled = jax.process_index() == 0
    self.name = name
    if not self.enabled:
      return
    os.makedirs(os.path.join(workdir, "metrics"), exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics", f"{name}.jsonl"), "a")
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb", name), flush_secs=10)
    except ImportError:  # TensorBoard is optional; JSONL is always written
      self._tb = None

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.enabled:
      return
    clean = {k: float(np.asarray(v)) for k, v in scalars.items()}
    self._jsonl.write(json.dumps({"step": int(step), "time": round(time.time(), 3), **clean})
                      + "\n")
    self._jsonl.flush()
    if self._tb is not None:
      for key, value in clean.items():
        self._tb.add_scalar(f"{self.name}/{key}", value, step)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      if self._tb is not None:
        self._tb.close()


def read_jsonl(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"

"""realm_jax/runtime/metrics.py: what every run logs is strict JSON, typed as counted, and in
TensorBoard as soon as it is in the JSONL."""

import glob
import json
import math
import os

from realm_jax import paths
from realm_jax.runtime.metrics import MetricWriter
from tests import helpers


def strict(text: str):
  """json.loads that refuses NaN / Infinity, as strict readers (jq, JavaScript) do."""
  def refuse(name):
    raise ValueError(f"not JSON: {name}")
  return json.loads(text, parse_constant=refuse)


def test_metric_lines_are_strict_json_and_in_tensorboard_before_close(tmp_path):
  import numpy as np
  writer = MetricWriter(str(tmp_path), "train")
  writer.write(3, {"loss": np.float32(float("nan")), "grad_norm": float("inf"),
                   "index_version": np.int32(2), "entropy": np.float32(0.5)})
  line = strict(open(tmp_path / "metrics" / "train.jsonl").read())
  assert line["loss"] is None and line["grad_norm"] is None     # null, not NaN / Infinity
  assert line["index_version"] == 2 and isinstance(line["index_version"], int)
  assert line["entropy"] == 0.5
  # On disk before close: a run killed -9 keeps in TensorBoard every step its JSONL has.
  events = glob.glob(os.path.join(tmp_path, "tb", "train", "events.out.tfevents.*"))
  logged = {(v.tag, e.step): v.simple_value for e in helpers.tb_events(events[0])
            for v in e.summary.value}
  assert logged[("train/entropy", 3)] == 0.5 and math.isnan(logged[("train/loss", 3)])
  assert logged[("train/index_version", 3)] == 2
  writer.close()


def test_a_summary_with_a_nan_is_written_as_strict_json(tmp_path):
  paths.write_json(tmp_path / "summary.json",
                   {"eval_loss": float("nan"), "curve": [1.0, float("-inf")], "runs": 1})
  assert strict((tmp_path / "summary.json").read_text()) == {
      "eval_loss": None, "curve": [1.0, None], "runs": 1}


def test_a_window_resumed_under_other_metrics_is_kept_and_averaged_per_metric():
  """A run resumed under another `retrieval.loss` carries steps with `distill_kl` from its
  checkpoint and steps without it: its first line and its next checkpoint's record average
  each metric over the steps that have it (before: a KeyError on the first line)."""
  import numpy as np
  from realm_jax.runtime.metrics import window_from_record, window_record, window_scalars
  carried = [{"loss": np.float32(2.0), "distill_kl": np.float32(0.5)}]
  window = window_from_record(json.loads(json.dumps(window_record(carried))))   # as Orbax
  window += [{"loss": np.float32(4.0), "index_step": np.int32(3)}]
  scalars = window_scalars(window, 2.0, 0.1, steps=1)
  assert scalars == {"loss": 3.0, "distill_kl": 0.5, "index_step": 3.0,
                     "steps_per_second": 0.5, "learning_rate": 0.1}
  again = window_from_record(json.loads(json.dumps(window_record(window))))
  assert [sorted(m) for m in again] == [["distill_kl", "loss"], ["index_step", "loss"]]
  assert again[1]["index_step"].dtype == np.int32 and again[0]["distill_kl"] == 0.5


def test_durations_of_an_hour_or_more_are_read_in_hours():
  """An ETA of a long run read "3333m20s"; from an hour on it is hours and minutes."""
  from realm_jax.log import format_duration
  assert [format_duration(s) for s in (-3, 0, 59.9, 60, 3599, 3600, 7500, 200_000)] == \
      ["0s", "0s", "59s", "1m00s", "59m59s", "1h00m", "2h05m", "55h33m"]


def test_a_rate_too_slow_for_its_decimals_reads_as_seconds_each():
  """A step of four minutes read "0.00 steps/s" on the progress line (an Open-QA evaluation's
  slow question "0.0 q/s"); now the seconds each takes."""
  from realm_jax.log import format_rate
  assert [format_rate(r) for r in (12.345, 0.47, 0.005, 0.004, 1 / 250, 0.0)] == [
      "12.35 steps/s", "0.47 steps/s", "0.01 steps/s", "250 s/step", "250 s/step",
      "0.00 steps/s"]
  assert format_rate(0.04, "q/s", "s/q", 1) == "25 s/q"
  assert format_rate(0.06, "q/s", "s/q", 1) == "0.1 q/s"
  assert format_rate(1234.56, "q/s", "s/q", 1) == "1,234.6 q/s"   # (as the q/s line had it)

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

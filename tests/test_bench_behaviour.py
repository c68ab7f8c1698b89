"""bench/behaviour.py's verdict: a refactor keeps behaviour only if every logged figure and
every final parameter array are the same (the figures alone can change while the parameters
have not yet, e.g. a logged loss or a staleness)."""

import importlib.util
import json
import os

import numpy as np
import orbax.checkpoint as ocp

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("_test_bench_behaviour",
                                              os.path.join(REPO, "bench", "behaviour.py"))
behaviour = importlib.util.module_from_spec(spec)
spec.loader.exec_module(behaviour)


def run_dir(root, name: str, rows: list[dict], params: dict) -> str:
  """A stage run as the bench reads one: metrics/train.jsonl and the last step's params."""
  workdir = os.path.join(root, name)
  os.makedirs(os.path.join(workdir, "metrics"))
  with open(os.path.join(workdir, "metrics", "train.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(workdir, "checkpoints", str(rows[-1]["step"]), "params"),
                    params)
  checkpointer.wait_until_finished()
  return workdir


def test_the_verdict_holds_the_logged_figures_as_well_as_the_parameters(tmp_path):
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  rows = [{"step": s, "loss": 1.0 / s, "grad_norm": float("nan")} for s in (1, 2, 3)]
  base = run_dir(tmp_path, "base", rows, params)
  assert behaviour.compare(base, run_dir(tmp_path, "same", rows, params))   # NaN == NaN
  other_loss = [{**r, "loss": r["loss"] * 1.5} for r in rows]
  assert not behaviour.compare(base, run_dir(tmp_path, "loss", other_loss, params))
  one_side = [{**r, "index_staleness": 0} for r in rows]
  assert not behaviour.compare(base, run_dir(tmp_path, "extra", one_side, params))
  moved = {"w": params["w"] + np.float32(1e-7)}
  assert not behaviour.compare(base, run_dir(tmp_path, "params", rows, moved))


def test_every_logged_figure_is_held_but_the_clock(tmp_path):
  """Not only a fixed list: REALM's retrieval entropy, the distillation's KL and the learning
  rate are in the verdict too; the wall clock (time, steps/s) is not."""
  params = {"w": np.ones(3, np.float32)}
  rows = [{"step": s, "time": 100.0 + s, "loss": 1.0, "retrieval_entropy": 1.25,
           "distill_kl": 0.5, "learning_rate": 1e-3, "steps_per_second": 7.0}
          for s in (1, 2, 3)]
  base = run_dir(tmp_path, "base", rows, params)
  clock = [{**r, "time": r["time"] + 60.0, "steps_per_second": 3.5} for r in rows]
  assert behaviour.compare(base, run_dir(tmp_path, "clock", clock, params))
  for key in ("retrieval_entropy", "distill_kl", "learning_rate"):
    moved = [{**r, key: r[key] * 2} if r["step"] == 2 else r for r in rows]
    assert not behaviour.compare(base, run_dir(tmp_path, key, moved, params)), key


def test_parameters_of_another_shape_or_dtype_are_a_difference_not_a_crash(tmp_path):
  """Bitwise equal means the same shape, dtype and bits: a kernel stored transposed is
  named a difference (it raised a broadcasting error), float64 copies of the same values
  are not equal (np.array_equal said they were)."""
  rows = [{"step": s, "loss": 1.0} for s in (1, 2, 3)]
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  base = run_dir(tmp_path, "base", rows, params)
  assert not behaviour.compare(base, run_dir(tmp_path, "transposed", rows,
                                             {"w": params["w"].T.copy()}))
  assert not behaviour.compare(base, run_dir(tmp_path, "float64", rows,
                                             {"w": params["w"].astype(np.float64)}))


def test_infinite_figures_compare_as_values_and_a_nan_difference_is_shown(tmp_path, capsys):
  """A figure that is inf on both sides at a step is the same (inf - inf is NaN: it was
  called a change); one that is NaN on one side only differs, and its largest difference
  reads nan, not the finite steps' 0 (max() kept the 0 before a NaN)."""
  params = {"w": np.ones(3, np.float32)}
  rows = [{"step": s, "loss": 1.0, "grad_norm": float("inf") if s == 3 else 2.0}
          for s in (1, 2, 3)]
  base = run_dir(tmp_path, "base", rows, params)
  assert behaviour.compare(base, run_dir(tmp_path, "same", rows, params))
  capsys.readouterr()
  diverged = [{**r, "loss": float("nan")} if r["step"] == 3 else r for r in rows]
  assert not behaviour.compare(base, run_dir(tmp_path, "nan", diverged, params))
  line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("loss"))
  assert "over 3 steps: nan" in line and "DIFFERS" in line, line

"""launch/sweep.py: grid expansion, typed values, clear errors, a local sweep and its table."""

from __future__ import annotations

import csv
import importlib.util
import os

import pytest

from tests import helpers

pytestmark = pytest.mark.slow   # the slow tier: `make test` runs it, `make test-fast` does not


def sweep_module():
  spec = importlib.util.spec_from_file_location(
      "_test_sweep", os.path.join(helpers.REPO, "launch", "sweep.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


ICT = os.path.join(helpers.CONFIGS, "demo_ict.py")


def test_a_key_not_in_the_config_names_the_closest(capsys):
  with pytest.raises(SystemExit) as exit_:
    sweep_module().main(["--config", ICT, "--grid", "train.lrr=1e-3,3e-3", "--launcher", "print"])
  assert exit_.value.code == 2
  assert "'train.lrr' is not a field of the config; the closest is 'train.lr'" in \
      capsys.readouterr().err


def test_print_launcher_expands_the_grid_with_typed_values(capsys, tmp_path):
  sweep = sweep_module()
  sweep.main(["--config", ICT, "--root", str(tmp_path), "--launcher", "print",
              "--grid", "train.lr=1e-3,3e-3", "--grid", "train.batch_size=32,64",
              "--set", "train.steps=5"])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith(("/", "python"))
           or "realm_jax.train.main" in l]
  assert len(lines) == 4
  assert all("--config.train.steps=5" in l for l in lines)
  assert "--workdir=" + str(tmp_path / "train.lr-0.003_train.batch_size-64") in lines[-1]
  with pytest.raises(SystemExit):        # 3.5 is no batch size
    sweep.main(["--config", ICT, "--grid", "train.batch_size=3.5", "--launcher", "print"])


def test_local_sweep_runs_every_point_and_sorts_the_table(world_dir, tmp_path, capsys):
  sweep = sweep_module()
  argv = ["--config", ICT, "--root", str(tmp_path), "--grid", "train.lr=1e-4,1e-2",
          "--set", f"data.dir={world_dir}", "--set", "train.steps=2",
          "--set", "eval.num_examples=32", "--set", "train.batch_size=16",
          "--metric", "eval_recall_at_5"]
  assert sweep.main(argv) == 0
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert sorted(r["train.lr"] for r in rows) == ["0.0001", "0.01"]
  assert all(r["status"] == "done" for r in rows)
  recalls = [float(r["eval_recall_at_5"]) for r in rows]
  assert recalls == sorted(recalls, reverse=True)
  assert (tmp_path / "results.md").read_text().startswith("Sorted by eval_recall_at_5.")
  capsys.readouterr()
  assert sweep.main(argv) == 0            # a finished sweep is not run again
  assert capsys.readouterr().out.count("already done") == 2

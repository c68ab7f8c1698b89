"""launch/sweep.py: grid expansion, typed values, clear errors, a local sweep and its table, a
sweep stopped by SIGTERM."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from realm_jax import log
from realm_jax.runtime import preemption
from tests import helpers

pytestmark = pytest.mark.slow   # the slow tier: `make test` runs it, `make test-fast` does not


def sweep_module():
  spec = importlib.util.spec_from_file_location(
      "_test_sweep", os.path.join(helpers.REPO, "launch", "sweep.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


ICT = os.path.join(helpers.CONFIGS, "demo_ict.py")
SMALL = ["--set", "model.num_layers=1"]   # the demo's towers, one layer deep: a faster compile


@pytest.mark.parametrize("key, closest", [
    ("train.lrr", "'train.lr'"),
    ("lr", "'train.lr'"),   # the group left out: no suggestion before
    ("batch_size", "'eval.batch_size' or 'train.batch_size'")])   # (before: eval's alone)
def test_a_key_not_in_the_config_names_the_closest(capsys, key, closest):
  with pytest.raises(SystemExit) as exit_:
    sweep_module().main(["--config", ICT, "--grid", f"{key}=1e-3,3e-3", "--launcher", "print"])
  assert exit_.value.code == 2
  assert f"{key!r} is not a field of the config; the closest is {closest}\n" in \
      capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--grid", "train.lr=1e-3,3e-3", "--grid", "train.lr=1e-2"],
     "train.lr has a --grid already"),
    (["--grid", "init.from_workdir=runs/a_b,runs_a/b"],
     "two runs would share the workdir 'init.from_workdir-runs_a_b'"),
    (["--config", os.path.join(helpers.CONFIGS, "realm_base.py:huge")],
     "realm_base.py:huge': ValueError: configs/realm_base.py: unknown variant 'huge'"),
    (["--grid", "train.lr=1e-3,-1"], "config.train.lr: "),
    (["--grid", "train.lr=1e-3,0.001"], "{'train.lr': 0.001} is given twice"),
    (["--grid", "train.lr=1e-3,3e-3", "--set", "train.lr=1e-2"], "--set train.lr: also swept"),
    (["--grid", "init.from_workdir=" + ",".join(["x" * 300, "y"])], "bytes, over 255"),
], ids=["key twice", "same workdir", "config error", "a run validate refuses", "long name",
        "one value twice", "set and swept"])
def test_grids_that_would_lose_runs_and_broken_configs_are_one_line(argv, message, capsys,
                                                                    tmp_path):
  args = ["--config", ICT, "--root", str(tmp_path), "--launcher", "print"]
  with pytest.raises(SystemExit) as exit_:
    sweep_module().main([*args, *argv])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and "Traceback" not in err
  assert err.startswith("sweep.py: error: ") and message in err, err


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
  # An unset retriever field (the reader's shape) is typed as what it takes, too.
  config = helpers.load_config_module("demo_ict").get_config()
  assert sweep.expand_grid(config, ["model.retriever.num_layers=1,2"], None) == [
      {"model.retriever.num_layers": 1}, {"model.retriever.num_layers": 2}]
  with pytest.raises(SystemExit):
    sweep.main(["--config", ICT, "--grid", "model.retriever.num_layers=1,2.5", "--launcher",
                "print"])
  # Commas inside brackets or quotes belong to one value: tuples and strings with commas.
  assert sweep.expand_grid(config, ["mesh.shape=(8,1),(4, 2)"], None) == [
      {"mesh.shape": (8, 1)}, {"mesh.shape": (4, 2)}]
  assert sweep.expand_grid(config, ["init.from_workdir='runs/a,b',runs/c"], None) == [
      {"init.from_workdir": "runs/a,b"}, {"init.from_workdir": "runs/c"}]
  # A quote opens at a value's start (or inside a literal) only: an apostrophe in a word is
  # part of it, and used to take the commas after it into one value with the next.
  assert sweep.expand_grid(config, ["init.from_workdir=runs/bob's,runs/c"], None) == [
      {"init.from_workdir": "runs/bob's"}, {"init.from_workdir": "runs/c"}]
  assert sweep.grid_values("('a)b', 'c'),(1,2)") == ["('a)b', 'c')", "(1,2)"]


def test_the_sweeps_verbosity_is_handed_to_its_runs(capsys, tmp_path):
  """`-v N` reaches every run, as local.py and the demos hand theirs on (before, a run's
  `sweep.log` showed no debug lines under `-v 1`, and all its progress under `-v -1`); without
  it the commands are as they were."""
  sweep = sweep_module()
  realm = os.path.join(helpers.CONFIGS, "demo_realm.py") + ":realm"   # through local.py
  try:
    for config, verbosity in ((ICT, "1"), (ICT, "-1"), (realm, "1"), (ICT, None)):
      capsys.readouterr()
      sweep.main(["--config", config, "--root", str(tmp_path), "--launcher", "print",
                  "--grid", "train.lr=1e-3,3e-3", "--set", f"data.dir={tmp_path}",
                  *(["-v", verbosity] if verbosity else [])])
      lines = [l for l in capsys.readouterr().out.splitlines() if "--workdir=" in l]
      assert len(lines) == 2, lines
      for line in lines:
        given = [a for a in line.split() if a.startswith("--verbosity")]
        assert given == ([f"--verbosity={verbosity}"] if verbosity else []), line
  finally:
    log.set_verbosity(0)


def test_a_metric_no_run_has_or_nan_leaves_the_table_unsorted_and_says_so(tmp_path, capsys):
  sweep = sweep_module()
  for name, value in (("a", 0.5), ("b", float("nan")), ("c", 0.7)):
    (tmp_path / name).mkdir()
    (tmp_path / name / "summary.json").write_text(json.dumps({"eval_recall_at_5": value}))
  runs = [(name, {"train.lr": lr}) for name, lr in (("a", 1.0), ("b", 2.0), ("c", 3.0))]
  rows = sweep.collect(str(tmp_path), runs, "eval_recall_at_5", True, {})
  assert [r["run"] for r in rows] == ["c", "a", "b"]     # the NaN with the runs without it
  rows = sweep.collect(str(tmp_path), runs, "eval_recall_at5", True, {})
  assert [r["run"] for r in rows] == ["a", "b", "c"]
  assert ("--metric eval_recall_at5: no run's summary has it as a number (their eval fields: "
          "eval_recall_at_5)") in capsys.readouterr().out
  _, md = sweep.write_tables(str(tmp_path), rows, "eval_recall_at5")
  assert open(md).read().startswith("Not sorted: no run has eval_recall_at5.")


def test_a_run_given_the_readers_retriever_field_is_compared_as_the_trainer_recorded_it(
    tmp_path):
  """`--set model.retriever.num_layers=0` ("the same as the reader's") is recorded by the
  trainer as None: a rerun of the sweep compares the value as read, and does not refuse its
  own run; another value still differs."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.config.validation import validate
  from realm_jax.errors import ConfigError
  sweep = sweep_module()
  config = helpers.load_config_module("demo_ict").get_config()
  fixed = {"model.retriever.num_layers": 0, "model.retriever.dropout_rate": -1.0}
  recorded = config.copy_and_resolve_references()
  recorded.update_from_flattened_dict(fixed)
  validate(recorded)                                   # as the trainer reads it, then saves it
  workdir_lib.write_config(str(tmp_path / "a"), recorded)
  (tmp_path / "a" / "checkpoints" / "2").mkdir(parents=True)
  sweep.check_started_runs(str(tmp_path), [("a", {})], config, fixed)
  with pytest.raises(ConfigError, match="model.retriever.num_layers: None .recorded. != 1"):
    sweep.check_started_runs(str(tmp_path), [("a", {})], config,
                             {**fixed, "model.retriever.num_layers": 1})


def test_a_path_spelt_otherwise_is_the_same_path_to_a_sweep_run_again(tmp_path):
  """A sweep run again with `--set data.dir=D` where its runs recorded `D/` (or `./D`,
  `D//x`) refused every run as started under other values; another directory still differs."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.config.validation import validate
  from realm_jax.errors import ConfigError
  sweep = sweep_module()
  config = helpers.load_config_module("demo_ict").get_config()
  recorded = config.copy_and_resolve_references()
  recorded.data.dir = "runs/small/data/"
  validate(recorded)
  workdir_lib.write_config(str(tmp_path / "a"), recorded)
  (tmp_path / "a" / "checkpoints" / "2").mkdir(parents=True)
  for spelt in ("runs/small/data", "./runs/small/data", "runs//small/data/"):
    sweep.check_started_runs(str(tmp_path), [("a", {})], config, {"data.dir": spelt})
  with pytest.raises(ConfigError, match="data.dir: 'runs/small/data/' .recorded. != "
                     "'runs/small/other'"):
    sweep.check_started_runs(str(tmp_path), [("a", {})], config,
                             {"data.dir": "runs/small/other"})


def test_the_table_shows_a_resumed_runs_wall_over_all_its_runs(tmp_path):
  rows = [{"run": "a", "status": "done", "wall_seconds": 4.0, "wall_seconds_all_runs": 10.0,
           "runs": 2, "eval_recall_at_5": 0.5}]
  _, md = sweep_module().write_tables(str(tmp_path), rows, "eval_recall_at_5")
  header, _, cells = open(md).read().splitlines()[2:5]
  assert header == "| run | status | wall_seconds_all_runs | eval_recall_at_5 |"
  assert cells == "| a | done | 10 | 0.5 |"
  rows.append({"run": "b", "status": "done", "wall_seconds": 6.0})   # no record kept: its own
  rows.append({"run": "c", "status": "missing"})                    # no summary
  _, md = sweep_module().write_tables(str(tmp_path), rows, "eval_recall_at_5")
  assert open(md).read().splitlines()[5:7] == ["| b | done | 6 |  |", "| c | missing |  |  |"]
  rows.pop()
  del rows[0]["wall_seconds_all_runs"]                 # summaries from before the record
  _, md = sweep_module().write_tables(str(tmp_path), rows, "eval_recall_at_5")
  assert open(md).read().splitlines()[2] == "| run | status | wall_seconds | eval_recall_at_5 |"
  assert "| a | done | 4 | 0.5 |" in open(md).read()


def test_local_sweep_runs_every_point_and_sorts_the_table(world_dir, tmp_path, capsys):
  sweep = sweep_module()
  # Two seeds: the second run compiles nothing (the programs are the first's, from the XLA
  # cache); a learning rate is a constant of the step, a seed is not.
  argv = ["--config", ICT, "--root", str(tmp_path), "--grid", "seed=1,2",
          "--set", f"data.dir={world_dir}", "--set", "train.steps=2", *SMALL,
          "--set", "eval.num_examples=32", "--set", "train.batch_size=16",
          "--metric", "eval_recall_at_5"]
  assert sweep.main(argv) == 0
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert sorted(r["seed"] for r in rows) == ["1", "2"]
  assert all(r["status"] == "done" for r in rows)
  recalls = [float(r["eval_recall_at_5"]) for r in rows]
  assert recalls == sorted(recalls, reverse=True)
  assert (tmp_path / "results.md").read_text().startswith("Sorted by eval_recall_at_5.")
  # A finished sweep is not run again; its table is made again from the runs' summaries. Two
  # tiny runs may tie on the metric: given distinct values, the best comes first.
  for seed, recall in (("1", 0.25), ("2", 0.75)):
    summary = json.loads((tmp_path / f"seed-{seed}" / "summary.json").read_text())
    summary["eval_recall_at_5"] = recall
    (tmp_path / f"seed-{seed}" / "summary.json").write_text(json.dumps(summary))
  capsys.readouterr()
  assert sweep.main(argv) == 0
  assert capsys.readouterr().out.count("already done") == 2
  with open(tmp_path / "results.csv") as f:
    assert [(r["seed"], r["eval_recall_at_5"]) for r in csv.DictReader(f)] == [
        ("2", "0.75"), ("1", "0.25")]
  # The same grid with a changed --set: its runs finished under other values, and their old
  # figures are not tabled as the new sweep's (nor is any run started).
  changed = [a.replace("eval.num_examples=32", "eval.num_examples=16") for a in argv]
  with pytest.raises(SystemExit) as exit_:
    sweep.main(changed)
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and "Traceback" not in err
  assert "2 of the runs there started under other values" in err
  assert "seed-1: eval.num_examples: 32 (recorded) != 16 (now)" in err, err
  # Fewer steps than the runs took is another value too (more would resume them).
  fewer = [a.replace("train.steps=2", "train.steps=1") for a in argv]
  with pytest.raises(SystemExit):
    sweep.main(fewer)
  assert "seed-2: train.steps: 2 (recorded) != 1 (now)" in capsys.readouterr().err


def test_sigterm_to_a_local_sweep_makes_the_running_run_save_its_step(world_dir, tmp_path):
  """The sweep passes SIGTERM on to the run it is running (in a session of its own) and waits
  for it to save its step, then exits 143 saying a rerun resumes."""
  run = tmp_path / "train.lr-0.001"
  proc = subprocess.Popen(
      [sys.executable, "-u", os.path.join(helpers.REPO, "launch", "sweep.py"), "--config", ICT,
       "--root", str(tmp_path), "--grid", "train.lr=1e-3", "--set", f"data.dir={world_dir}",
       "--set", "train.steps=5000", "--set", "train.log_every=1", "--set",
       "train.batch_size=16", "--set", "train.checkpoint_every=5000", *SMALL],
      cwd=helpers.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    log, deadline = run / "sweep.log", time.monotonic() + 300
    while not (log.exists() and "step 2/5000" in log.read_text()):
      assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 2"
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=180)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
    subprocess.run(["pkill", "-KILL", "-f", f"--workdir={run}"], check=False)  # a run left over
  assert proc.returncode == preemption.EXIT_CODE, out[-3000:]
  assert ("preempted (SIGTERM; run train.lr-0.001 stopped at a saved checkpoint): rerun the "
          "same command to resume") in out, out[-3000:]
  saved = re.search(r"SIGTERM: checkpoint (\d+) finalised", log.read_text())
  assert saved and 2 <= int(saved.group(1)) < 5000, log.read_text()[-3000:]
  assert (run / "checkpoints" / saved.group(1)).is_dir()
  assert not (tmp_path / "results.csv").exists()     # the sweep stopped before its table

"""launch/sweep.py and launch/gke/render.py: what they check before any run starts (no
training: the runs are stood in for)."""

import importlib.util
import os
import sys

import pytest

from realm_jax import processes, workdir as workdir_lib
from tests import helpers

ICT = os.path.join(helpers.CONFIGS, "demo_ict.py")


def _load(name: str, path: str):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


sweep = _load("_test_sweep_checks", os.path.join(helpers.REPO, "launch", "sweep.py"))


def hyper_config(tmp_path, text: str) -> str:
  """A config file: ICT's get_config, and `text` (a get_hyper) after it."""
  config = tmp_path / "hyper.py"
  config.write_text(
      "import importlib.util\n"
      f"spec = importlib.util.spec_from_file_location('ict', {ICT!r})\n"
      "ict = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(ict)\n"
      "get_config = ict.get_config\n\n" + text)
  return str(config)


def refused_hyper(tmp_path, capsys, hyper: str):
  """The sweep of ICT's config with a get_hyper() that returns `hyper` (its Python text),
  refused: exit code 2; what it printed (stdout, stderr)."""
  config = hyper_config(tmp_path, f"def get_hyper(arg=None):\n  return {hyper}\n")
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["--config", config, "--root", str(tmp_path / "s"), "--launcher", "print"])
  assert exit_.value.code == 2
  return capsys.readouterr()


def test_get_hyper_values_given_as_text_take_the_fields_type(tmp_path, capsys):
  config = hyper_config(tmp_path,
      "def get_hyper(arg=None):\n  return [{'train.lr': '1e-3'}, {'train.lr': '3e-3'}]\n")
  assert sweep.main(["--config", config, "--root", str(tmp_path / "s"),
                     "--launcher", "print"]) == 0
  out = capsys.readouterr().out
  assert "--config.train.lr=0.001" in out and "--config.train.lr=0.003" in out


def test_a_local_sweep_without_its_data_dir_starts_no_run(tmp_path, capsys, monkeypatch):
  started = []
  monkeypatch.setattr(processes, "run_to_end", lambda *a: started.append(a) or 0)
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["--config", ICT, "--root", str(tmp_path / "s"), "--grid", "seed=0,1",
                "--set", f"data.dir={tmp_path / 'missing'}"])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and started == []
  assert err.startswith("sweep.py: error: config.data.dir: data dir ") and \
      "does not exist (run seed-0)" in err, err


def test_a_signal_after_the_last_runs_summary_says_it_finished(tmp_path, capsys, monkeypatch):
  """SIGTERM during a run's final eval, after it wrote its summary: the run is not reported
  as stopped at a checkpoint."""
  (tmp_path / "data").mkdir()
  root = tmp_path / "s"

  def stopped_after_its_summary(name, cmd, out, grace):
    workdir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))
    steps = int(next(a.split("=", 1)[1] for a in cmd if a.startswith("--config.train.steps=")))
    workdir_lib.write_summary(workdir, {"steps": steps})
    raise processes.Preempted(f"SIGTERM; {name} stopped at a saved checkpoint")
  monkeypatch.setattr(processes, "run_to_end", stopped_after_its_summary)
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["--config", ICT, "--root", str(root), "--grid", "seed=0",
                "--set", f"data.dir={tmp_path / 'data'}", "--set", "train.steps=7"])
  assert exit_.value.code == processes.EXIT_CODE
  out = capsys.readouterr().out
  assert "preempted (SIGTERM; run seed-0 had finished (its summary.json is written))" in out, out


def test_sweep_and_render_read_a_flagfile(tmp_path, capsys):
  flags = tmp_path / "sweep.flags"
  flags.write_text(f"--config={ICT}\n--root={tmp_path / 's'}\n--grid=seed=0,1\n")
  assert sweep.main([f"--flagfile={flags}", "--launcher", "print"]) == 0
  assert len([l for l in capsys.readouterr().out.splitlines() if "--config.seed=" in l]) == 2
  render = _load("_test_render_checks", os.path.join(helpers.REPO, "launch", "gke", "render.py"))
  flags.write_text("--image=us-docker.pkg.dev/p/realm/realm-jax:latest\n")
  argv = ["--config", os.path.join(helpers.CONFIGS, "realm_base.py"), "--workdir",
          "gs://my-bucket/realm/realm", "--set", "data.dir=gs://my-bucket/realm/data",
          "--set", "init.retriever=gs://my-bucket/realm/ict", "--set",
          "init.reader=gs://my-bucket/bert-base-uncased", f"--flagfile={flags}",
          "--out", str(tmp_path / "jobset.yaml")]
  assert render.main(argv) == 0
  assert "realm-jax:latest" in (tmp_path / "jobset.yaml").read_text()


def test_the_table_shows_a_swept_top_level_field(tmp_path, capsys, monkeypatch):
  """results.md holds the grid's columns: one for `seed`, a field at the config's top level,
  was left out (only dotted keys were taken for grid columns), so the table of a sweep over
  seeds did not say which seed each figure came from but in the run's name."""
  (tmp_path / "data").mkdir()
  root = tmp_path / "s"

  def finished_run(name, cmd, out, grace):
    workdir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))
    seed = int(next(a.split("=", 1)[1] for a in cmd if a.startswith("--config.seed=")))
    workdir_lib.write_summary(workdir, {"steps": 7, "eval_recall_at_5": 0.5 + seed / 10})
    return 0
  monkeypatch.setattr(processes, "run_to_end", finished_run)
  assert sweep.main(["--config", ICT, "--root", str(root), "--grid", "seed=0,1",
                     "--grid", "train.lr=1e-3", "--set", f"data.dir={tmp_path / 'data'}",
                     "--set", "train.steps=7"]) == 0
  lines = (root / "results.md").read_text().splitlines()
  assert lines[2] == "| run | seed | train.lr | status | eval_recall_at_5 |", lines
  assert lines[4] == "| seed-1_train.lr-0.001 | 1 | 0.001 | done | 0.6 |", lines


@pytest.mark.parametrize("value, message", [
    ("32.5", "'32.5' is not an integer"), ("True", "'true' is not a number")])
def test_a_get_hyper_value_of_another_type_is_one_line_naming_its_field(
    tmp_path, capsys, value, message):
  """A get_hyper() value given as a number or a bool of the wrong type (32.5 for a batch size)
  escaped as ml_collections' TypeError, a traceback; it is refused as a --grid value is."""
  config = hyper_config(tmp_path,
      f"def get_hyper(arg=None):\n  return [{{'train.batch_size': {value}}}]\n")
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["--config", config, "--root", str(tmp_path / "s"), "--launcher", "print"])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and "Traceback" not in err, err
  assert err == f"sweep.py: error: config.train.batch_size: {message}\n", err


def test_get_hyper_values_of_the_fields_type_are_taken_as_given(tmp_path, capsys):
  config = hyper_config(tmp_path,
      "def get_hyper(arg=None):\n"
      "  return [{'train.lr': 1e-3, 'train.batch_size': 16, 'mesh.shape': (-1, 1)},\n"
      "          {'train.lr': 2, 'train.batch_size': 32, 'mesh.shape': [-1, 1]}]\n")
  assert sweep.main(["--config", config, "--root", str(tmp_path / "s"),
                     "--launcher", "print"]) == 0
  lines = [l for l in capsys.readouterr().out.splitlines() if "--workdir=" in l]
  assert lines[0].endswith("--config.train.lr=0.001 --config.train.batch_size=16 "
                           "--config.mesh.shape=-1,1"), lines
  assert lines[1].endswith("--config.train.lr=2.0 --config.train.batch_size=32 "
                           "--config.mesh.shape=-1,1"), lines


def test_a_failed_runs_earlier_summary_is_not_tabled_as_its_figures(tmp_path, capsys,
                                                                    monkeypatch):
  """A run given more train.steps that then fails keeps the summary of its shorter run: its
  figures were tabled (and sorted first) as the failed run's. A summary that does not cover
  the run's steps is not this sweep's result."""
  (tmp_path / "data").mkdir()
  root = tmp_path / "s"
  workdir_lib.write_summary(str(root / "seed-0"), {"steps": 5, "eval_recall_at_5": 0.9})

  def run(name, cmd, out, grace):
    workdir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--workdir="))
    if workdir.endswith("seed-0"):
      return 1                                         # fails before its summary
    workdir_lib.write_summary(workdir, {"steps": 7, "eval_recall_at_5": 0.5})
    return 0
  monkeypatch.setattr(processes, "run_to_end", run)
  assert sweep.main(["--config", ICT, "--root", str(root), "--grid", "seed=0,1",
                     "--set", f"data.dir={tmp_path / 'data'}", "--set", "train.steps=7"]) == 1
  rows = {line.split(" | ")[0].strip("| "): line
          for line in (root / "results.md").read_text().splitlines()[4:]}
  lines = (root / "results.md").read_text().splitlines()
  assert lines[4].startswith("| seed-1 |"), lines        # the finished run first
  assert "0.9" not in rows["seed-0"] and "failed (1)" in rows["seed-0"], rows


def test_a_get_hyper_none_is_refused_naming_its_field(tmp_path, capsys):
  """A get_hyper() value None was checked as the field unset, then handed to the run as
  `--config.KEY=None`: the text 'None' for a path (a run started from a workdir named None),
  refused by the run for a number. It is refused before any run starts."""
  captured = refused_hyper(tmp_path, capsys, "[{'init.from_workdir': None}, {'seed': 1}]")
  assert "--config.init.from_workdir=None" not in captured.out
  assert captured.err.startswith("sweep.py: error: config.init.from_workdir: get_hyper() "
                                 "gives None"), captured.err


@pytest.mark.parametrize("grid", ["a=1,2", "train.lr=1e-3,3e-3"])
def test_a_get_config_without_a_configdict_is_one_line(tmp_path, capsys, grid):
  """A config file whose get_config() returns a dict, which realm-train and tpu_pod.py refuse
  in one line: the sweep ended in an AttributeError's traceback where the grid named its keys,
  and refused a field of the defaults as "not a field of the config"."""
  config = tmp_path / "plain.py"
  config.write_text("def get_config():\n  return {'a': 1}\n")
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["--config", str(config), "--root", str(tmp_path / "s"), "--grid", grid,
                "--launcher", "print"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err == (f"sweep.py: error: --config '{config}': TypeError: "
                                     "get_config() returned dict, not an "
                                     "ml_collections.ConfigDict\n")


def test_a_get_hyper_run_without_overrides_is_refused(tmp_path, capsys):
  """A get_hyper() run `{}` (the config as it is, say as a baseline) was named '' and given
  --root itself as its workdir: its checkpoints and summary beside every other run's
  directory, its config.json read as the root's, the tables written into it."""
  captured = refused_hyper(tmp_path, capsys, "[{}, {'train.lr': 3e-3}]")
  assert "--workdir=" not in captured.out
  assert captured.err.startswith("sweep.py: error: get_hyper() run 1 gives no field"), \
      captured.err


@pytest.mark.parametrize("hyper", ["{'train.lr': [1e-3, 3e-3]}", "['train.lr=1e-3']"])
def test_a_get_hyper_not_a_list_of_dicts_is_one_line(tmp_path, capsys, hyper):
  """get_hyper() returning a dict of value lists (the --grid form) or a list of texts ended
  in a ValueError's traceback from dict()."""
  err = refused_hyper(tmp_path, capsys, hyper).err
  assert err.startswith(f"sweep.py: error: get_hyper() returned {eval(hyper)!r}: not a list "
                        "of override dicts") and len(err.splitlines()) == 1, err


def test_get_hyper_may_yield_its_runs(tmp_path, capsys):
  config = hyper_config(tmp_path, "def get_hyper(arg=None):\n"
                        "  for lr in ('1e-3', '3e-3'):\n    yield {'train.lr': lr}\n")
  assert sweep.main(["--config", config, "--root", str(tmp_path / "s"),
                     "--launcher", "print"]) == 0
  out = capsys.readouterr().out
  assert "--config.train.lr=0.001" in out and "--config.train.lr=0.003" in out


def test_a_get_hyper_key_not_a_text_is_one_line(tmp_path, capsys):
  """A key that is not a text (a number) ended in an AttributeError's traceback."""
  assert refused_hyper(tmp_path, capsys, "[{'seed': 1}, {2: 3}]").err == ("sweep.py: error: get_hyper() run 2: its key 2 is not a "
                                     "field's dotted name ('train.lr')\n")


def test_a_run_name_a_bucket_path_cannot_hold_is_refused_before_any_run(tmp_path, capsys):
  """A swept text with '*' under a gs:// root names a workdir gcsfs reads as a pattern: every
  run is refused before one starts, naming the run (each was refused only as it started,
  after the runs before it had trained; the print launcher printed its commands)."""
  with pytest.raises(SystemExit) as exit_:
    sweep.main(["--config", ICT, "--root", "gs://a-bucket/s", "--launcher", "print",
                "--grid", "qa.train=squad:/x/a*.json,squad:/x/b.json"])
  assert exit_.value.code == 2
  out, err = capsys.readouterr()
  assert "--workdir" not in out, out
  assert "'*' and '[' cannot be in a bucket path" in err and \
      "(run qa.train-squad:_x_a*.json: a value it sweeps)" in err, err

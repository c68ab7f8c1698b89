"""The demo driver's own logic (the demo itself runs in `make demo`)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from realm_jax import demo, processes, stages
from tests.helpers import REPO


def test_split_host_applies_keeps_or_leaves_the_device_count():
  env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "HOME": "/h"}
  applied, count = stages.split_host(env, 2)
  assert count == 2 and applied["HOME"] == "/h"
  assert applied["XLA_FLAGS"] == ("--xla_cpu_enable_fast_math=false "
                                  "--xla_force_host_platform_device_count=2")
  assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false"   # the caller's env untouched
  user = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"}
  assert stages.split_host(user, 2) == (user, 8)                     # the user's count wins
  assert stages.split_host({}, 0) == ({}, 0)                         # JAX's default


def test_devices_names_the_realm_stage_count_only_when_it_differs():
  import jax
  here = f"{jax.device_count()} x cpu"
  assert stages.devices(0) == here
  assert stages.devices(jax.device_count()) == here
  assert stages.devices(jax.device_count() + 1) == f"{here} (REALM stage: " \
                                                 f"{jax.device_count() + 1} x cpu)"


def test_stage_overrides_start_every_part_or_each_part_from_a_stage():
  assert stages.stage_overrides("", "D", "W", 3) == {"data.dir": "D", "seed": 3,
                                                   "init.from_workdir": ""}
  assert stages.stage_overrides("ict", "D", "W", 3)["init.from_workdir"] == "W/ict"
  per_part = stages.stage_overrides({"retriever": "ict", "reader": "warmup"}, "D", "W", 3)
  assert per_part == {"data.dir": "D", "seed": 3, "init.retriever": "W/ict",
                      "init.reader": "W/warmup"}


def test_the_demo_rounds_start_no_stage_from_one_beside_it():
  rounds = demo.demo_stages()
  done = set()
  for round_ in rounds:
    names = {name for name, *_ in round_}
    for _, _, _, init in round_:
      sources = set(init.values()) if isinstance(init, dict) else {init} - {""}
      assert sources <= done and not sources & names
    done |= names
  assert done == {"ict", "warmup", "realm", "no_retrieval"}


class _Process:
  """Stands in for a stage process: ends (exit 0) at its `polls`-th poll."""

  def __init__(self, name, polls):
    self.name, self.polls = name, polls

  def poll(self):
    self.polls -= 1
    return 0 if self.polls <= 0 else None


class _Calls:
  """Stands in for the stage runners: records what ran when; a stage in `fail` raises `error`
  when it ends, a stage ends at the poll `polls` says (1 by default), one in `done` had
  already finished (no process)."""

  def __init__(self, fail=(), error=RuntimeError, polls=None, done=(), forced=()):
    self.log, self.fail, self.error, self.polls = [], set(fail), error, polls or {}
    self.done, self.forced = set(done), set(forced)

  def run(self, name, spec, overrides, workdir, host_devices=0):
    self.log.append(("run", name))
    return {"steps": 1, "name": name}

  def start(self, name, spec, overrides, workdir, host_devices=0, beside=""):
    self.log.append(("start", name, beside))
    return None if name in self.done else _Process(name, self.polls.get(name, 1))

  def finish(self, name, process, workdir, beside=""):
    self.log.append(("finish", name, beside))
    if name in self.fail:
      raise self.error(f"{name} failed")
    return {"steps": 1, "name": name}

  def stop(self, processes, grace_seconds=None, sig=signal.SIGTERM):
    self.log.append(("stop", [p and p.name for p in processes], signal.Signals(sig).name))
    self.grace_seconds = grace_seconds
    return [p for p in processes if p is not None and p.name in self.forced]


STAGES = [("a", "demo_ict", None, ""), [("b", "demo_realm", "warmup", "a"),
                                        ("c", "demo_realm", "no_retrieval", "a"),
                                        ("d", "demo_realm", "no_retrieval", "a")]]


def _runners(monkeypatch, calls):
  for attr, fn in (("run_stage", calls.run), ("start_stage", calls.start),
                   ("finish_stage", calls.finish)):
    monkeypatch.setattr(stages, attr, fn)
  monkeypatch.setattr(processes, "stop_processes", calls.stop)
  monkeypatch.setattr(stages, "ROUND_POLL_SECONDS", 0.0)
  return calls


def test_run_stages_runs_a_round_at_once_each_stage_in_a_process(monkeypatch):
  calls = _runners(monkeypatch, _Calls(polls={"b": 3, "c": 2}))
  results = stages.run_stages(STAGES, "D", "W", 0)
  # the first stage's output here, the others' beside it; each read as soon as it ends
  assert calls.log == [("run", "a"), ("start", "b", ""), ("start", "c", "b"),
                       ("start", "d", "b"), ("finish", "d", "b"), ("finish", "c", "b"),
                       ("finish", "b", "")]
  assert sorted(results) == ["a", "b", "c", "d"] and results["c"]["name"] == "c"


@pytest.mark.parametrize("error, sig", [(RuntimeError, "SIGTERM"), (stages.Preempted, "SIGTERM"),
                                        (KeyboardInterrupt, "SIGINT")])
def test_a_stage_that_fails_stops_its_round_at_once(monkeypatch, error, sig):
  """A stage beside the first fails (or was stopped: SIGTERM, Ctrl-C) long before the first
  ends: the round stops when it ends, without waiting for the first stage."""
  calls = _runners(monkeypatch, _Calls(fail={"c"}, error=error, polls={"b": 100, "c": 2}))
  with pytest.raises(error):
    stages.run_stages(STAGES, "D", "W", 0)
  assert ("finish", "b", "") not in calls.log
  assert calls.log[-2:] == [("finish", "c", "b"), ("stop", ["b", "c", "d"], sig)]


def test_stages_that_fail_in_the_same_poll_are_named_together(monkeypatch):
  _runners(monkeypatch, _Calls(fail={"c", "d"}, error=stages.StageFailed, polls={"b": 100}))
  with pytest.raises(stages.StageFailed, match=r"^c failed; d failed$"):
    stages.run_stages(STAGES, "D", "W", 0)
  _runners(monkeypatch, _Calls(fail={"c", "d"}, error=stages.Preempted, polls={"b": 100}))
  with pytest.raises(stages.Preempted) as stopped:   # each saved its step: still a preemption
    stages.run_stages(STAGES, "D", "W", 0)
  assert stopped.value.why == "c failed; d failed"


def test_a_preemption_names_the_stages_that_did_not_save_their_step(monkeypatch):
  _runners(monkeypatch, _Calls(fail={"c"}, error=stages.Preempted, polls={"b": 100},
                               forced={"b"}))
  with pytest.raises(stages.Preempted) as stopped:
    stages.run_stages(STAGES, "D", "W", 0)
  assert not stopped.value.saved and "stage b did not end as asked" in stopped.value.why
  _runners(monkeypatch, _Calls(fail={"c"}, error=stages.Preempted, polls={"b": 100}))
  with pytest.raises(stages.Preempted) as stopped:
    stages.run_stages(STAGES, "D", "W", 0)
  assert stopped.value.saved


@pytest.mark.parametrize("first, again, raised", [
    (KeyboardInterrupt, stages.Preempted("SIGTERM"), KeyboardInterrupt),
    (stages.Preempted, KeyboardInterrupt(), KeyboardInterrupt),
    (stages.StageFailed, KeyboardInterrupt(), stages.StageFailed)])
def test_an_interrupt_while_the_stages_stop_ends_the_demo_as_ctrl_c(monkeypatch, first, again,
                                                                    raised):
  """The stages were ended at once, none saving its step on purpose: the demo says what Ctrl-C
  says (their last checkpoints are kept), unless a stage's failure was what stopped them."""
  class Interrupted(_Calls):
    def stop(self, processes, grace_seconds=None, sig=signal.SIGTERM):
      super().stop(processes, grace_seconds, sig)
      raise again
  calls = _runners(monkeypatch, Interrupted(fail={"c"}, error=first, polls={"b": 100}))
  with pytest.raises(raised, match="c failed" if raised is stages.StageFailed else None):
    stages.run_stages(STAGES, "D", "W", 0)
  assert calls.log[-1][0] == "stop"


def test_a_round_gives_its_stages_the_largest_preemption_grace_to_save(monkeypatch):
  """A stage whose trainer may take 200 s to save on SIGTERM is not sent the second signal
  after the default 60 s."""
  calls = _runners(monkeypatch, _Calls(error=stages.Preempted, fail={"b"}, polls={"c": 100}))
  with pytest.raises(stages.Preempted):
    stages.run_round([("b", ("demo_realm", "warmup"), {"data.dir": "D"}, "W/b"),
                      ("c", ("demo_realm", "no_retrieval"),
                       {"data.dir": "D", "train.preemption_grace_seconds": 200}, "W/c")])
  assert calls.log[-1] == ("stop", ["b", "c"], "SIGTERM")
  assert calls.grace_seconds == 200 + processes.STOP_MARGIN_SECONDS


def test_a_signal_as_a_stage_starts_still_stops_that_stage(monkeypatch, tmp_path):
  """Ctrl-C in the instant after a stage's process started, before the round recorded it, waits
  until it is recorded: the stage is stopped with the rest, not left running unseen."""
  started = []

  def launch(command, config, host_devices, out=None):
    started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(2)                             # the handler would run here, in the main thread
    return started[-1]
  monkeypatch.setattr(stages, "_launch", launch)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist ignores SIGINT
  try:
    with pytest.raises(KeyboardInterrupt):
      stages.run_round([("warmup", ("demo_realm", "warmup"), {"data.dir": str(tmp_path)},
                       str(tmp_path / "warmup"))])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    signal.signal(signal.SIGINT, previous)
    stopped = started[0].poll()
    started[0].kill()
    started[0].wait()
  assert stopped is not None


def test_a_resumed_round_gives_the_terminal_to_its_first_stage_still_to_run(monkeypatch):
  calls = _runners(monkeypatch, _Calls(done={"b"}))
  results = stages.run_stages(STAGES, "D", "W", 0)
  assert calls.log[1:4] == [("start", "b", ""), ("start", "c", ""), ("start", "d", "c")]
  assert ("finish", "c", "") in calls.log and ("finish", "d", "c") in calls.log
  assert sorted(results) == ["a", "b", "c", "d"]


def test_a_stage_beside_another_that_fails_names_its_log_and_one_stopped_exits(tmp_path):
  workdir = str(tmp_path / "stage")
  first = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
  with pytest.raises(RuntimeError, match=r"exited with code 3; see its output above"):
    stages.finish_stage("warmup", first, workdir)   # the first stage of its round
  launcher = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)", stages.LAUNCHER])
  with pytest.raises(RuntimeError, match=r"launch/local.py exited with code 3; see its output "
                     r"above \(and .*stage/logs/trainer\.log and builder\.log, where it "
                     r"started them\)"):   # (a refusal of its own starts neither: no logs)
    stages.finish_stage("realm", launcher, workdir)   # a builder stage, the first of its round
  failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
  with pytest.raises(RuntimeError, match=r"exited with code 3; see .*stage/logs/stage\.log"):
    stages.finish_stage("no_retrieval", failing, workdir, beside="realm")
  preempted = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({stages.EXIT_CODE})"])
  with pytest.raises(stages.Preempted) as stopped:       # SIGTERM reached it: the demo stops
    stages.finish_stage("no_retrieval", preempted, workdir, beside="realm")
  assert stopped.value.code == stages.EXIT_CODE and stopped.value.saved
  unsaved = subprocess.Popen([sys.executable, "-c", "raise SystemExit(75)"])
  with pytest.raises(stages.Preempted) as late:
    stages.finish_stage("no_retrieval", unsaved, workdir, beside="realm")
  assert not late.value.saved and "did not save its step within its grace" in late.value.why
  killed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(137)"])   # OOM, say
  with pytest.raises(stages.StageFailed, match="exited with code 137"):
    stages.finish_stage("no_retrieval", killed, workdir, beside="realm")
  assert not stages._together([stages.Preempted("a saved"), late.value]).saved
  assert stages._together([stages.Preempted("a saved"), stages.Preempted("b saved")]).saved


def test_a_sigterm_while_no_stage_runs_says_so(capsys, monkeypatch):
  """SIGTERM to the driver between stages (the world being made, the tables written) said
  "the stages stopped at a saved checkpoint"; with a stage running, that stage saved."""
  import time
  from realm_jax import processes

  def job():
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
  monkeypatch.setattr(os, "environ", dict(os.environ))   # run_demo_cli sets the memory env
  previous = signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(stages.Preempted) as stopped:
      stages.run_demo_cli("realm-demo", job)
  finally:
    signal.signal(signal.SIGTERM, previous)      # run_demo_cli installs the demo's handler
  assert stopped.value.saved is None
  assert "[realm-demo] preempted (SIGTERM); no stage was running; the finished ones are kept: " \
      "rerun the same command to resume" in capsys.readouterr().out
  child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
                            "print('ready', flush=True); time.sleep(60)"],
                           stdout=subprocess.PIPE, text=True)
  assert child.stdout.readline() == "ready\n"   # a stage that saves its step on SIGTERM
  after = processes.stop_after(stages.Preempted("SIGTERM", saved=None), {"stage a": child}, 30)
  assert isinstance(after, stages.Preempted) and after.saved is True


def test_a_failed_stage_ends_the_demo_with_one_line(capsys):
  """The stage's own output says why it failed; the demo names it and where that output is,
  without a traceback of its own code."""
  why = "stage ict: its process exited with code 2; see W/ict/logs/stage.log"

  def job():
    raise stages.StageFailed(why)
  previous = signal.getsignal(signal.SIGTERM)
  try:
    with pytest.raises(SystemExit) as ended:
      stages.run_demo_cli("realm-demo", job)
  finally:
    signal.signal(signal.SIGTERM, previous)      # run_demo_cli installs the demo's handler
  assert ended.value.code == 1
  assert capsys.readouterr().err == f"[realm-demo] error: {why}\n"


def test_a_preempted_in_process_stage_stops_the_demo_instead_of_starting_the_next(
    monkeypatch, tmp_path):
  from realm_jax.train import loop
  monkeypatch.setattr(loop, "train", lambda config, workdir: {"task": "realm",
                                                              "preempted_at_step": 7})
  with pytest.raises(stages.Preempted, match=str(stages.EXIT_CODE)):
    stages.run_stage("warmup", ("demo_realm", "warmup"), {"data.dir": str(tmp_path)},
                   str(tmp_path / "warmup"))


def test_a_resumed_demo_reports_the_wall_of_every_run_and_stage(monkeypatch, tmp_path, capsys):
  """W/wall.json adds each run of the demo, one stopped by a preemption too; the summary has
  this run's wall and all runs', and each stage's wall over its own runs."""
  import json
  import types
  from realm_jax import workdir as workdir_lib
  clock = iter(range(0, 1000, 10))                    # each reading 10 s after the last
  monkeypatch.setattr(workdir_lib, "time", types.SimpleNamespace(time=lambda: next(clock)))
  monkeypatch.setattr(demo, "plot_curves", lambda *args: None)
  workdir = tmp_path / "W"
  (workdir / "data").mkdir(parents=True)
  (workdir / "data" / "stats.json").write_text("{}")   # the world is prepared

  def preempted(*args):
    raise stages.Preempted("stage realm saved step 5")
  monkeypatch.setattr(demo, "run_stages", preempted)
  with pytest.raises(stages.Preempted):
    demo.run_demo(str(workdir), seed=0, entities=10)
  assert json.loads((workdir / "wall.json").read_text()) == {"seconds": 10.0, "runs": 1}

  resumed = {"wall_seconds": 2.0, "wall_seconds_all_runs": 7.0}   # a stage resumed once
  monkeypatch.setattr(demo, "run_stages", lambda *args: {
      "ict": {"wall_seconds": 3.0}, "no_retrieval": {"wall_seconds": 4.0},
      "warmup": {"wall_seconds": 5.0}, "realm": resumed})
  summary = demo.run_demo(str(workdir), seed=0, entities=10)
  assert (summary["wall_seconds"], summary["wall_seconds_all_runs"], summary["runs"]) == \
      (10.0, 20.0, 2)
  assert summary["stage_seconds"] == {"ict": 3.0, "no_retrieval": 4.0, "warmup": 5.0,
                                      "realm": 7.0}
  assert json.loads((workdir / "summary.json").read_text())["wall_seconds_all_runs"] == 20.0
  assert [line.split()[-1] for line in capsys.readouterr().out.splitlines()
          if "wall seconds" in line] == ["20.000"]

  again = demo.run_demo(str(workdir), seed=0, entities=10)   # finished: every stage reused
  assert again == summary and json.loads((workdir / "wall.json").read_text()) == \
      {"seconds": 20.0, "runs": 2}
  monkeypatch.setattr(demo, "run_stages", lambda *args: {    # a stage trained again
      "ict": {"wall_seconds": 3.0}, "no_retrieval": {"wall_seconds": 4.0},
      "warmup": {"wall_seconds": 5.0}, "realm": {**resumed, "wall_seconds_all_runs": 9.0}})
  assert demo.run_demo(str(workdir), seed=0, entities=10)["runs"] == 3


def test_a_demo_workdir_refuses_other_arguments_than_it_was_begun_with(monkeypatch, tmp_path):
  """`make demo SEED=1` in the workdir of seed 0 would reuse seed 0's world and stages and
  report them as seed 1's: it is refused, naming the flag and the Makefile's variable, and the
  refused run adds nothing to the wall record. The same arguments go on."""
  import json
  monkeypatch.setenv("XLA_FLAGS", "")   # the device count is --host_devices' (no count here)
  from realm_jax import demo_real
  from realm_jax.errors import ConfigError
  monkeypatch.setattr(demo, "plot_curves", lambda *args: None)
  monkeypatch.setattr(demo, "run_stages", lambda *args: {
      name: {"wall_seconds": 1.0} for name in ("ict", "no_retrieval", "warmup", "realm")})
  workdir = tmp_path / "W"
  (workdir / "data").mkdir(parents=True)
  (workdir / "data" / "stats.json").write_text("{}")
  demo.run_demo(str(workdir), seed=0, entities=10)
  wall = (workdir / "wall.json").read_text()
  for seed, entities, devices, flag in ((1, 10, 2, "--seed 1"), (0, 20, 2, "--entities 20"),
                                        (0, 10, 1, "--host_devices 1")):
    with pytest.raises(ConfigError, match=f"{flag}: .*W holds a demo begun with "
                       f"{flag.split()[0]} .*make WORKDIR="):
      demo.run_demo(str(workdir), seed=seed, entities=entities, host_devices=devices)
  assert (workdir / "wall.json").read_text() == wall
  assert demo.run_demo(str(workdir), seed=0, entities=10)["seed"] == 0
  # demo-real and demo-squad check before they prepare anything
  from realm_jax import demo_squad
  from realm_jax.data import prepare as prepare_lib
  monkeypatch.setattr(demo_real, "prepare_data", lambda *a: pytest.fail("prepared first"))
  monkeypatch.setattr(prepare_lib, "prepare", lambda *a: pytest.fail("prepared first"))
  for name, flag, run in (
      ("R", "--scale gpu", lambda w: demo_real.run_demo_real(w, seed=0, scale="gpu")),
      ("S", "--seed 1", lambda w: demo_squad.run_demo_squad(w, "", seed=1))):
    stages.check_arguments(str(tmp_path / name), {"seed": 0, "scale": "cpu"}, "")
    (tmp_path / name / "data").mkdir()
    with pytest.raises(ConfigError, match=f"{flag}: .* begun with {flag.split()[0]} "):
      run(str(tmp_path / name))
  # a workdir holding nothing but the record (a demo that stopped at once) takes new ones
  stages.check_arguments(str(tmp_path / "N"), {"seed": 0}, "WORKDIR")
  stages.check_arguments(str(tmp_path / "N"), {"seed": 1}, "WORKDIR")
  assert json.loads((tmp_path / "N" / stages.DEMO_ARGUMENTS).read_text()) == {"seed": 1}
  (tmp_path / "N" / stages.DEMO_ARGUMENTS).write_text("{cut")
  with pytest.raises(ConfigError, match=r"N/demo_arguments.json: not the JSON a demo writes"):
    stages.check_arguments(str(tmp_path / "N"), {"seed": 1}, "WORKDIR")


def test_demo_squad_and_demo_openqa_keep_a_wall_record_each(monkeypatch, tmp_path):
  """They share a workdir: demo-squad's runs go to W/wall.json, demo-openqa's to their own
  file, and each summary reports all of its job's runs. Stages and evaluations are stand-ins."""
  import json
  from realm_jax import demo_squad, openqa_eval
  from realm_jax.retrieval import zero_shot
  monkeypatch.setattr(demo_squad, "pretrain", lambda workdir, squad, seed, wall, openqa=False: (
      "D", "squad:F", {"documents": 2, "blocks": 3}, {"realm": {"wall_seconds": 1.0}}))
  monkeypatch.setattr(zero_shot, "recall_table", lambda *a: {"bm25": {"questions": 1}})
  monkeypatch.setattr(zero_shot, "format_table", lambda table: "")
  monkeypatch.setattr(demo_squad, "run_stage", lambda *a: {"wall_seconds": 1.0})
  monkeypatch.setattr(openqa_eval, "evaluate_run", lambda *a, **k: (
      {"num_questions": 1, "reader_beam": 5, "recall_at_5": 0.5}, []))
  workdir = str(tmp_path / "W")
  for run in (1, 2):
    assert demo_squad.run_demo_squad(workdir)["runs"] == run
  assert demo_squad.run_demo_openqa(workdir)["runs"] == 1
  assert json.loads((tmp_path / "W" / "wall.json").read_text())["runs"] == 2
  assert json.loads((tmp_path / "W" / demo_squad.OPENQA_WALL).read_text())["runs"] == 1
  assert json.loads((tmp_path / "W" / "summary_openqa.json").read_text())["runs"] == 1


def test_the_wall_record_starts_again_from_scratch_and_never_fails_a_run(tmp_path, caplog,
                                                                           capsys):
  import logging
  from realm_jax import workdir as workdir_lib
  w = str(tmp_path)
  assert workdir_lib.add_wall(w, 5.0) == {"wall_seconds": 5.0, "wall_seconds_all_runs": 5.0,
                                          "runs": 1}
  assert workdir_lib.add_wall(w, 2.5)["wall_seconds_all_runs"] == 7.5
  assert workdir_lib.add_wall(w, 1.0, fresh=True) == {     # a run started from scratch
      "wall_seconds": 1.0, "wall_seconds_all_runs": 1.0, "runs": 1}
  (tmp_path / "wall.json").write_text("{not json")
  with caplog.at_level(logging.WARNING):
    assert workdir_lib.add_wall(w, 3.0) == {"wall_seconds": 3.0}   # this run's alone
  assert "wall.json: the runs' wall time is not recorded (JSONDecodeError" in caplog.text
  demo.print_report({"wall_seconds": 3.0}, [])          # the report shows this run's then
  assert [line.split()[-1] for line in capsys.readouterr().out.splitlines()
          if "wall seconds" in line] == ["3.000"]


def test_a_run_from_before_the_wall_record_resumed_counts_its_summarys_seconds(tmp_path):
  """A run that finished before W/wall.json was kept (2026-11-27) left its seconds in its
  summary alone: resumed to more steps, its summary counts them and that run, not this run's
  seconds as all of them (the sweep's table shows wall_seconds_all_runs)."""
  import json
  from realm_jax import workdir as workdir_lib
  (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "wall_seconds": 16.3}))
  assert workdir_lib.add_wall(str(tmp_path), 2.0) == {
      "wall_seconds": 2.0, "wall_seconds_all_runs": 18.3, "runs": 2}
  assert workdir_lib.add_wall(str(tmp_path), 1.0)["runs"] == 3     # the record from here on
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  (fresh / "summary.json").write_text(json.dumps({"steps": 4, "wall_seconds": 16.3}))
  assert workdir_lib.add_wall(str(fresh), 2.0, fresh=True)["runs"] == 1   # a start over


def test_demo_real_runs_every_stage_at_the_scale_asked(monkeypatch, tmp_path, capsys):
  """`--scale gpu` reaches every stage's config arg (VARIANT,gpu) and the summary; the data
  are prepared once whatever the scale. Stages and evaluations are stand-ins here."""
  from realm_jax import demo_real, openqa_eval
  from realm_jax.retrieval import zero_shot
  specs, tables = [], []
  monkeypatch.setattr(demo_real, "prepare_data", lambda workdir, squad, max_paragraphs: (
      str(tmp_path / "data"), "squad:F", {"blocks": 3, "documents": 2}))
  monkeypatch.setattr(demo_real, "heldout_unit", lambda data_dir: "article")   # no data here
  monkeypatch.setattr(demo_real, "check_questions",     # before any stage
                      lambda *args: specs.append(("questions checked", args[-1])))
  monkeypatch.setattr(demo_real, "run_stage",
                      lambda name, spec, overrides, workdir: specs.append((name, spec)) or {})
  def recall_table(data_dir, retrievers, heldout_articles, heldout_unit):
    tables.append({name: (config.model.num_layers, config.model.retriever.num_layers)
                   for name, (config, _) in retrievers.items()})
    return {name: {"recall_at_1": 0.0, "recall_at_5": 0.0, "recall_at_20": 0.0,
                   "questions": 1} for name in (*retrievers, "bm25")}
  monkeypatch.setattr(zero_shot, "recall_table", recall_table)
  monkeypatch.setattr(openqa_eval, "evaluate_run", lambda config, workdir, split: (
      tables.append({"openqa": config.model.num_layers}) or {"num_questions": 1}, []))
  summary = demo_real.run_demo_real(str(tmp_path / "W"), seed=1, scale="gpu")
  assert specs == [("questions checked", "gpu"), ("ict", ("real_realm", "ict,gpu")),
                   ("warmup", ("real_realm", "warmup,gpu")),
                   ("realm", ("real_realm", "realm,gpu")),
                   ("openqa_realm", ("real_realm", "openqa,gpu")),
                   ("openqa_ict", ("real_realm", "openqa,gpu"))]
  # (reader, retriever) layers: the gpu scale's reader; MiniLM's first 2 as the retriever,
  # and MiniLM whole as the reference row
  assert tables == [{"untrained": (6, 2), "ict": (6, 2), "realm": (6, 2), "minilm_6": (6, 6)},
                    {"openqa": 6}, {"openqa": 6}]
  assert summary["scale"] == "gpu" and "gpu scale" in capsys.readouterr().out
  assert summary["runs"] == 1 and summary["wall_seconds_all_runs"] == summary["wall_seconds"]
  assert demo_real.run_demo_real(str(tmp_path / "W"), seed=1, scale="gpu") == summary  # again
  assert demo_real._arg("realm", "cpu") == "realm"


def test_stages_sharing_a_device_allocate_as_needed_unless_the_environment_says_how(
    monkeypatch):
  assert processes.shared_memory_env({}) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  for own in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
              "XLA_PYTHON_CLIENT_ALLOCATOR"):
    assert processes.shared_memory_env({own: "0.4"}) == {}
  previous = signal.getsignal(signal.SIGTERM)
  try:
    for own, expected in ((None, "false"), ("XLA_PYTHON_CLIENT_MEM_FRACTION", None)):
      for name in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        monkeypatch.delenv(name, raising=False)
      if own:
        monkeypatch.setenv(own, "0.4")
      seen = stages.run_demo_cli("realm-demo",
                               lambda: os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"))
      assert seen == expected      # what the stages (and their processes) inherit
  finally:
    signal.signal(signal.SIGTERM, previous)      # run_demo_cli installs the demo's handler


def test_the_demos_outside_a_checkout_say_so(monkeypatch, tmp_path, capsys):
  """realm_jax/stages.py reads configs/ beside the package: an installed package without it
  is told to run from a checkout, in one line (the demos are `make` targets, not commands),
  before any demo writes its workdir (they wrote demo_arguments.json, and the demo began the
  world, first)."""
  from realm_jax import demo_real, demo_squad
  monkeypatch.setattr(stages, "CONFIG_DIR", str(tmp_path / "configs"))
  with pytest.raises(FileNotFoundError, match="run from a checkout of the repository"):
    stages.repo_config("demo_realm")
  previous = signal.getsignal(signal.SIGTERM)
  try:
    for module, extra in ((demo, ["--host_devices", "0", "--entities", "1"]),
                          (demo_squad, []), (demo_real, [])):
      workdir = tmp_path / module.__name__
      monkeypatch.setattr(sys, "argv", [module.__name__, "--workdir", str(workdir), *extra])
      with pytest.raises(SystemExit) as exit_:
        module.main()
      assert exit_.value.code == 2, module.__name__
      assert "run from a checkout of the repository" in capsys.readouterr().err
      assert not workdir.exists(), (module.__name__, os.listdir(workdir))
  finally:
    signal.signal(signal.SIGTERM, previous)      # run_demo_cli installs the demo's handler


def test_demo_real_keeps_its_heldout_unit_and_refuses_another(tmp_path):
  """Open-QA stages begun under one held-out unit (a workdir from before the record: articles)
  are not reused under the other, where they would be scored on questions they trained on."""
  import json
  from realm_jax import demo_real
  from realm_jax.errors import ConfigError
  old = tmp_path / "old"
  (old / "openqa_realm").mkdir(parents=True)
  (old / "demo_arguments.json").write_text(json.dumps({"seed": 0, "scale": "cpu"}))
  with pytest.raises(ConfigError, match=r"config.qa.heldout_unit: .*old was begun with "
                     r"articles held out, and its data now holds out paragraphs"):
    demo_real.check_heldout_unit(str(old), "paragraph")
  demo_real.check_heldout_unit(str(old), "article")
  assert json.loads((old / "demo_arguments.json").read_text()) == {
      "seed": 0, "scale": "cpu", "heldout_unit": "article"}
  new = tmp_path / "new"                # nothing trained yet: it takes the unit and keeps it
  new.mkdir()
  demo_real.check_heldout_unit(str(new), "paragraph")
  with pytest.raises(ConfigError, match="was begun with paragraphs held out"):
    demo_real.check_heldout_unit(str(new), "article")


def test_a_resumed_demo_real_does_not_evaluate_again_what_it_evaluated(monkeypatch, tmp_path):
  """W/evaluations.json keeps the zero-shot table and each Open-QA run's scores with the
  summaries of the stages they read: a rerun reuses them, a stage trained again (another
  summary) or other code is evaluated again, and a record cut short is rewritten. Stand-ins
  as above."""
  import json
  from realm_jax import demo_real, openqa_eval
  from realm_jax.retrieval import zero_shot
  workdir, calls = tmp_path / "W", []
  monkeypatch.setattr(demo_real, "prepare_data", lambda workdir, squad, max_paragraphs: (
      str(tmp_path / "data"), "squad:F", {"blocks": 3, "documents": 2}))
  monkeypatch.setattr(demo_real, "heldout_unit", lambda data_dir: "article")   # no data here
  monkeypatch.setattr(demo_real, "check_questions", lambda *args: None)

  def run_stage(name, spec, overrides, stage_dir):
    summary = os.path.join(stage_dir, "summary.json")
    if not os.path.exists(summary):        # a stage trains once, as `stages.finished` says
      os.makedirs(stage_dir, exist_ok=True)
      with open(summary, "w") as f:
        json.dump({"steps": 2, "trained": len(calls)}, f)
    return {}
  monkeypatch.setattr(demo_real, "run_stage", run_stage)

  def recall_table(data_dir, retrievers, heldout_articles, heldout_unit):
    calls.append("table")
    return {name: {"recall_at_1": 0.5, "recall_at_5": 0.5, "recall_at_20": 0.5,
                   "questions": 1} for name in (*retrievers, "bm25")}
  monkeypatch.setattr(zero_shot, "recall_table", recall_table)
  monkeypatch.setattr(openqa_eval, "evaluate_run", lambda config, stage_dir, split: (
      calls.append(os.path.basename(stage_dir)) or {"exact_match": 0.25}, "out"))
  first = demo_real.run_demo_real(str(workdir), seed=1)
  assert calls == ["table", "openqa_realm", "openqa_ict"]
  again = demo_real.run_demo_real(str(workdir), seed=1)
  assert calls == ["table", "openqa_realm", "openqa_ict"]            # nothing evaluated again
  assert again["recall"] == first["recall"] and again["exact_match_realm"] == 0.25
  assert again["runs"] == 1                                          # nor a run added
  (workdir / "realm" / "summary.json").unlink()                      # REALM trained again
  assert demo_real.run_demo_real(str(workdir), seed=1)["runs"] == 2   # (evaluated: a run)
  assert calls[3:] == ["table"]
  (workdir / stages.DEMO_ARGUMENTS).unlink()    # (a workdir from before that record takes
  demo_real.run_demo_real(str(workdir), seed=2)  # another seed): the seed evaluates all again
  assert calls[4:] == ["table", "openqa_realm", "openqa_ict"]
  (workdir / "evaluations.json").write_text('{"retrieval": {"ke')    # cut short
  demo_real.run_demo_real(str(workdir), seed=2)
  assert calls[7:] == ["table", "openqa_realm", "openqa_ict"]
  monkeypatch.setattr(demo_real, "code_digest", lambda: "other code")   # realm_jax changed
  demo_real.run_demo_real(str(workdir), seed=2)
  assert calls[10:] == ["table", "openqa_realm", "openqa_ict"]
  assert set(json.loads((workdir / "evaluations.json").read_text())) == {
      "retrieval", "openqa_realm", "openqa_ict"}


@pytest.mark.parametrize("module, flags, message", [
    ("realm_jax.demo", ["--seed", "-1"], "--seed must be in [0, 2**32) (the data order's seed), "
                                         "got -1"),
    ("realm_jax.demo", ["--host_devices", "3"], "--host_devices must be 0 (JAX's default) or "
                                                "divide the REALM stage's batch (32), got 3"),
    ("realm_jax.demo", ["--host_devices", "-1"], "--host_devices must be 0 (JAX's default) or "
                                                 "divide the REALM stage's batch (32), got -1"),
    ("realm_jax.demo", ["--entities", "0"], "--entities must be >= 1, got 0"),
    ("realm_jax.demo_real", ["--seed", str(2**32)], "--seed must be in [0, 2**32)"),
    ("realm_jax.demo_squad", ["--seed", "-2"], "--seed must be in [0, 2**32)"),
    ("realm_jax.demo", ["--workdir", ""], "--workdir must name a directory, got an empty "
                                          "string"),   # was an OS error line
])
def test_demo_flags_every_stage_would_refuse_are_refused_first(tmp_path, module, flags, message):
  """They used to be found by each stage after the data was made, exit 1, and the workdir
  then held a demo begun with the bad value."""
  result = subprocess.run([sys.executable, "-m", module, "--workdir", str(tmp_path / "W"),
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2 and message in result.stderr.splitlines()[-1], result.stderr
  assert not (tmp_path / "W").exists()


def test_demo_real_without_workdir_runs_in_its_scales_and_an_empty_one_is_refused(
    monkeypatch, capsys):
  """--workdir left out is the scale's default (runs/real, runs/real_gpu), not the empty
  --workdir the flag check refuses (realm-demo-real without --workdir was refused)."""
  from realm_jax import demo_real
  ran = []
  monkeypatch.setattr(demo_real, "run_demo_cli", lambda name, fn: fn())
  monkeypatch.setattr(demo_real, "run_demo_real", lambda workdir, *a: ran.append(workdir))
  for flags, workdir in (([], "runs/real"), (["--scale", "gpu"], "runs/real_gpu")):
    monkeypatch.setattr(sys, "argv", ["realm-demo-real", *flags])
    demo_real.main()
    assert ran[-1] == workdir
  monkeypatch.setattr(sys, "argv", ["realm-demo-real", "--workdir", " "])
  with pytest.raises(SystemExit) as exit_:
    demo_real.main()
  assert exit_.value.code == 2
  assert "--workdir must name a directory" in capsys.readouterr().err


def test_a_world_smaller_than_a_batch_is_refused_and_leaves_the_workdir_free(tmp_path,
                                                                           monkeypatch):
  from realm_jax.errors import ConfigError
  monkeypatch.setattr(demo, "run_stages", lambda *args: pytest.fail("a stage started"))
  workdir = tmp_path / "W"
  with pytest.raises(ConfigError, match=r"--entities 3: the world holds 24 training queries, "
                     r"fewer than a stage's batch \(64\); give more entities"):
    demo.run_demo(str(workdir), seed=0, entities=3)
  assert not (workdir / "data").exists()
  with pytest.raises(ConfigError, match="--entities 4: the world holds"):   # not: "W holds a
    demo.run_demo(str(workdir), seed=0, entities=4)                        # demo begun with 3"
  assert not (workdir / "wall.json").exists()   # a refused run adds no run


@pytest.mark.parametrize("target", ["demo-squad", "demo-openqa", "demo-real"])
def test_make_hands_squad_to_each_demo_that_reads_a_squad_file(target):
  """`make demo-squad SQUAD=PATH` (and demo-openqa, demo-real) runs its demo on PATH, as the
  README says, rather than on the default SQuADShifts file."""
  result = subprocess.run(["make", "-n", target, "SQUAD=/elsewhere/other.json"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  commands = result.stdout.replace("\\\n", " ").splitlines()   # (a recipe's continued lines)
  demo_line = [line for line in commands if "-m realm_jax.demo_" in line]
  assert demo_line, result.stdout
  words = shlex.split(demo_line[-1])   # (the recipe passes each path as one shell word)
  assert words[words.index("--squad") + 1] == "/elsewhere/other.json", result.stdout


def test_a_demo_refused_for_another_squad_file_names_its_workdir_not_its_data(monkeypatch,
                                                                               tmp_path):
  """W/data prepared from another file is refused; its message told to delete W/data, after
  which the demo reused W's stages, trained on the other file's data, on the new one (the
  zero-shot table of demo-real computed with them, its Open-QA stages started from them)."""
  import json
  from realm_jax import demo_real, demo_squad, workdir as workdir_lib
  from realm_jax.errors import ConfigError
  files = []
  for name in ("a", "b"):
    files.append(str(tmp_path / f"{name}.json"))
    paragraph = {"context": f"Town {name} was founded in 1901 by Ada Lind.", "qas": [
        {"id": name, "question": f"When was town {name} founded?",
         "answers": [{"text": "1901", "answer_start": 26}]}]}
    (tmp_path / f"{name}.json").write_text(json.dumps(
        {"data": [{"title": f"T {name}", "paragraphs": [paragraph]}]}))
  monkeypatch.setattr(demo_squad, "run_stages", lambda *args: {})
  for name, run, variable in (
      ("R", lambda w, f: demo_real.prepare_data(w, f), "REAL_WORKDIR"),
      ("S", lambda w, f: demo_squad.pretrain(w, f, 0, workdir_lib.RunWall(w)), "SQUAD_WORKDIR")):
    workdir = str(tmp_path / name)
    run(workdir, files[0])
    with pytest.raises(ConfigError, match=rf"another workdir \(--workdir, or make {variable}="
                       rf"\.\.\.\) or remove .*/{name} whole: with .*/{name}/data alone "
                       "removed, any stage of"):
      run(workdir, files[1])


@pytest.mark.parametrize("flags", [[], ["--openqa"]])
def test_demo_squad_reads_its_squad_file_by_its_absolute_path(monkeypatch, tmp_path, flags):
  """--squad given relative is recorded absolute (W/data's source, as demo-real's): recorded as
  typed, the same file named from elsewhere (make's absolute SQUAD=, another directory) was
  "prepared from another source" and refused, and from another directory not found."""
  from realm_jax import demo_squad
  ran = []
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(demo_squad, "run_demo_cli", lambda name, fn: fn())
  for name in ("run_demo_squad", "run_demo_openqa"):
    monkeypatch.setattr(demo_squad, name, lambda workdir, squad, seed: ran.append(squad))
  monkeypatch.setattr(sys, "argv", ["realm-demo-squad", "--squad", "files/a.json", *flags])
  demo_squad.main()
  assert ran == [str(tmp_path / "files" / "a.json")]


def test_a_squad_path_that_is_no_readable_file_adds_no_run(tmp_path):
  """demo-real given a directory (or a file it may not read) as its SQuAD file stops at once,
  in one line, as for a missing file; that refused run was added to W/wall.json, so the
  recipe's summary counted one run more than it ran (`runs`, `wall_seconds_all_runs`)."""
  from realm_jax import demo_real
  (tmp_path / "squad").mkdir()
  workdir = tmp_path / "W"
  with pytest.raises(IsADirectoryError):
    demo_real.run_demo_real(str(workdir), str(tmp_path / "squad"))
  assert not (workdir / "wall.json").exists()


def test_a_second_demo_in_a_workdir_is_refused_and_leaves_the_first_ones_records(tmp_path,
                                                                                 monkeypatch):
  """Two `make demo` into one WORKDIR: the second one's stages were refused by the first one's
  locks, but the second ran on to that failure and added its run to W/wall.json, so the
  first one's summary counted two runs and their seconds. The first demo holds W/demo.lock:
  the second is refused before it writes anything, naming it."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.errors import ConfigError
  workdir = tmp_path / "demo"
  (workdir / "data").mkdir(parents=True)
  (workdir / "data" / "stats.json").write_text('{"examples": {"train": 100000}}')
  arguments = {"seed": 0, "entities": 2000,
               "host_devices": stages.split_host(dict(os.environ), stages.HOST_DEVICES)[1]}
  (workdir / stages.DEMO_ARGUMENTS).write_text(json.dumps(arguments))

  def stage_refused(*args, **kwargs):   # a stage the first demo's trainer holds
    raise stages.StageFailed("stage warmup failed (exit 2): W/warmup is in use")
  monkeypatch.setattr(demo, "run_stages", stage_refused)
  with workdir_lib.JobLock(str(workdir), "demo") as first:
    first.acquire()
    with pytest.raises(ConfigError, match=rf"^{workdir} is in use: a demo \(pid {os.getpid()}\)"
                       rf" runs on it and holds {workdir}/demo.lock; stop it first"):
      demo.run_demo(str(workdir), 0, 2000)
  assert not (workdir / workdir_lib.WALL).exists()
  assert json.loads((workdir / stages.DEMO_ARGUMENTS).read_text()) == arguments

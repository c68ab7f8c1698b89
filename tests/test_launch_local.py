"""`launch/local.py`: two supervised processes, prefixed output, logs, stopping rules, GPU split.

The children are tiny `python -c` programs standing in for the trainer and the builder; they
hand-shake through files in the workdir so that no test depends on timing.
"""

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from realm_jax.errors import ConfigError
from tests.helpers import REPO

LOCAL_PY = os.path.join(REPO, "launch", "local.py")


def _load_local():
  spec = importlib.util.spec_from_file_location("_launch_local", LOCAL_PY)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


local = _load_local()

# Prepended to every child: paths in the workdir, a pid file, and a SIGINT handler that leaves
# a marker (so a test can tell "stopped by SIGINT" from "killed").
PRELUDE = textwrap.dedent("""\
    import os, signal, subprocess, sys, time
    W = sys.argv[1]
    NAME = sys.argv[2]
    def path(name):
      return os.path.join(W, name)
    def touch(name, text=''):
      with open(path(name), 'w') as f:
        f.write(text)
    def wait_for(name):
      while not os.path.exists(path(name)):
        time.sleep(0.01)
    def on_sigint(signum, frame):
      touch(NAME + '.sigint')
      sys.exit(0)
    signal.signal(signal.SIGINT, on_sigint)
    touch(NAME + '.pid', str(os.getpid()))
    """)


def child(workdir, name, body):
  return [sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(workdir), name]


def read_pid(workdir, name):
  with open(os.path.join(workdir, f"{name}.pid")) as f:
    return int(f.read())


def alive(pid):
  """Whether `pid` is a live process (a zombie waiting for its reaper counts as gone)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def gone(pid, timeout=5.0):
  """Whether `pid` ends within `timeout` seconds (a SIGKILL is delivered asynchronously)."""
  deadline = time.monotonic() + timeout
  while alive(pid):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


def run_supervise(capsys, commands, workdir, grace=5.0):
  start = time.monotonic()
  code = local.supervise(commands, str(workdir), grace=grace)
  return code, capsys.readouterr().out, time.monotonic() - start


def test_output_is_prefixed_and_logged(tmp_path, capsys):
  trainer = child(tmp_path, "trainer", """\
      print('step 1 loss 2.5')
      print('a warning', file=sys.stderr)
      sys.stdout.write('progress 10%\\rprogress 50%\\r')
      sys.stdout.flush()
      print('step 2 loss 2.1')
      touch('DONE')
      """)
  builder = child(tmp_path, "builder", """\
      print('published version 1')
      wait_for('DONE')
      print('the trainer is done')
      """)
  code, out, _ = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path)
  assert code == 0, out
  lines = out.splitlines()
  for line in ("[trainer] step 1 loss 2.5", "[trainer] a warning", "[trainer] progress 10%",
               "[trainer] progress 50%", "[trainer] step 2 loss 2.1",
               "[builder] published version 1", "[builder] the trainer is done"):
    assert line in lines, out
  assert lines.index("[trainer] step 1 loss 2.5") < lines.index("[trainer] step 2 loss 2.1")
  assert any(line.startswith("local.py: trainer: ") and "-c" in line for line in lines), out
  summary = lines[-1]
  assert summary.startswith("local.py: exit 0: trainer exit code 0 after "), summary
  assert "builder exit code 0 after " in summary, summary
  with open(tmp_path / "logs" / "trainer.log") as f:
    trainer_log = f.read().splitlines()
  with open(tmp_path / "logs" / "builder.log") as f:
    builder_log = f.read().splitlines()
  assert trainer_log[0].startswith("# local.py "), trainer_log
  assert trainer_log[1:] == ["step 1 loss 2.5", "a warning", "progress 10%", "progress 50%",
                             "step 2 loss 2.1"]
  assert builder_log[1:] == ["published version 1", "the trainer is done"]


SAVES_ON_SIGTERM = """\
    signal.signal(signal.SIGTERM, lambda *_: (touch(NAME + '.sigterm'), sys.exit(143)))
    touch('trainer.ready')
    time.sleep(60)
    """


def test_failure_stops_the_other_and_returns_its_code(tmp_path, capsys):
  """The builder failing: the trainer is stopped by SIGTERM, its preemption path, so that it
  saves its step (SIGINT lost the steps since its last checkpoint)."""
  trainer = child(tmp_path, "trainer", SAVES_ON_SIGTERM)
  builder = child(tmp_path, "builder", """\
      wait_for('trainer.ready')
      print('cannot restore checkpoint')
      sys.exit(3)
      """)
  code, out, elapsed = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path)
  assert code == 3, out
  assert "local.py: builder failed (exit code 3); stopping trainer (SIGTERM: it saves its " \
      "step)" in out.splitlines(), out
  assert (tmp_path / "trainer.sigterm").exists() and not (tmp_path / "trainer.sigint").exists()
  assert gone(read_pid(tmp_path, "trainer"))
  assert elapsed < 5, elapsed                             # well before the grace period ended
  assert "trainer exit code 143" in out.splitlines()[-1] and "stopped after the builder " \
      "failed" in out.splitlines()[-1], out


def test_a_child_ended_by_a_signal_without_a_name_is_said_by_its_number(tmp_path, capsys):
  """A real-time signal has no name in Python (`signal.Signals` refuses it): the launcher's
  line about the child that it ended was a ValueError traceback."""
  number = signal.SIGRTMIN + 1
  trainer = child(tmp_path, "trainer", "time.sleep(60)\n")
  builder = child(tmp_path, "builder", f"os.kill(os.getpid(), {int(number)})\n")
  code, out, _ = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path,
                               grace=1.0)
  assert f"builder killed by signal {int(number)}" in out, out
  assert "Traceback" not in out and code != 0, out
  assert gone(read_pid(tmp_path, "trainer"))


def test_child_ignoring_sigint_is_killed_after_grace(tmp_path, capsys):
  trainer = child(tmp_path, "trainer", """\
      signal.signal(signal.SIGINT, signal.SIG_IGN)
      signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the trainer is stopped by SIGTERM
      touch('trainer.ready')
      time.sleep(60)
      """)
  builder = child(tmp_path, "builder", """\
      wait_for('trainer.ready')
      sys.exit(5)
      """)
  code, out, elapsed = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path,
                                     grace=1.0)
  assert code == 5, out
  assert "local.py: trainer still running after 1 s; sending SIGKILL" in out.splitlines(), out
  assert "trainer killed by SIGKILL" in out.splitlines()[-1], out
  assert not (tmp_path / "trainer.sigint").exists()
  assert gone(read_pid(tmp_path, "trainer"))
  assert 1.0 <= elapsed < 10, elapsed


def test_builder_quitting_before_done_stops_the_trainer(tmp_path, capsys):
  trainer = child(tmp_path, "trainer", SAVES_ON_SIGTERM)
  builder = child(tmp_path, "builder", "wait_for('trainer.ready')\n")
  code, out, _ = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path)
  assert code == 1, out
  assert any(line.startswith("local.py: builder exited 0 while the trainer still runs")
             and "DONE does not exist" in line for line in out.splitlines()), out
  assert (tmp_path / "trainer.sigterm").exists()


def test_builder_quitting_after_done_is_fine(tmp_path, capsys):
  trainer = child(tmp_path, "trainer", """\
      touch('DONE')
      wait_for('builder.gone')
      time.sleep(0.3)      # the launcher sees the builder's exit while the trainer still runs
      """)
  builder = child(tmp_path, "builder", """\
      wait_for('DONE')
      touch('builder.gone')
      """)
  code, out, _ = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path)
  assert code == 0, out
  assert not (tmp_path / "trainer.sigint").exists()


def test_a_closed_stdout_does_not_stop_the_run(tmp_path, monkeypatch):
  """`local.py ... | head`: once the reader of our output is gone, writing to it fails; the
  children's output still goes to their logs and the run goes on to its end (the copier
  dying there left the trainer blocked on a full pipe and the launcher waiting for good)."""
  import threading

  class Closed:
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
      raise BrokenPipeError(32, "Broken pipe")
  trainer = child(tmp_path, "trainer", """\
      for i in range(5000):
        print('line', i, 'x' * 60)
      touch('DONE')
      """)
  builder = child(tmp_path, "builder", """\
      wait_for('DONE')
      """)
  monkeypatch.setattr(sys, "stdout", Closed())
  result = []
  run = threading.Thread(target=lambda: result.append(local.supervise(
      {"trainer": trainer, "builder": builder}, str(tmp_path), grace=5.0)), daemon=True)
  run.start()
  run.join(60)
  if run.is_alive():
    for name in ("trainer", "builder"):
      os.kill(read_pid(tmp_path, name), signal.SIGKILL)
  assert result == [0]
  with open(tmp_path / "logs" / "trainer.log") as f:
    assert "line 4999 " in f.read()


def test_builder_failing_after_the_trainer_finished_leaves_the_run_a_success(tmp_path, capsys):
  trainer = child(tmp_path, "trainer", "touch('DONE')\n")
  builder = child(tmp_path, "builder", """\
      wait_for('DONE')
      time.sleep(0.5)      # the launcher sees the trainer's exit first
      sys.exit(4)
      """)
  code, out, _ = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path)
  assert code == 0, out
  assert "local.py: builder failed (exit code 4) after the trainer finished; the run " \
      "succeeded (its summary is written; the builder's output is above)" in out.splitlines(), out


def test_builder_still_running_after_trainer_is_stopped_and_run_succeeds(tmp_path, capsys):
  trainer = child(tmp_path, "trainer", "wait_for('builder.ready')\n")
  builder = child(tmp_path, "builder", """\
      touch('builder.ready')
      time.sleep(60)       # never looks at DONE
      """)
  code, out, elapsed = run_supervise(capsys, {"trainer": trainer, "builder": builder}, tmp_path,
                                     grace=1.0)
  assert code == 0, out
  assert any("builder still running 1 s after the trainer finished; stopping it" in line
             for line in out.splitlines()), out
  assert "(stopped after the trainer finished)" in out.splitlines()[-1], out
  assert (tmp_path / "builder.sigint").exists()
  assert 1.0 <= elapsed < 10, elapsed


DRIVER = textwrap.dedent("""\
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("local", {local!r})
    local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local)
    sys.exit(local.supervise({commands!r}, {workdir!r}, grace=5.0))
    """)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_stops_both_and_leaves_no_process(tmp_path, sig):
  """Ctrl-C reaches the children as SIGINT; SIGTERM (preemption) as SIGTERM, so that the
  trainer saves its step."""
  # The trainer also starts a grandchild that ignores SIGINT: it must not outlive the run.
  trainer = child(tmp_path, "trainer", """\
      grandchild = subprocess.Popen([sys.executable, '-c', 'import signal, time; '
          'signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)'])
      touch('grandchild.pid', str(grandchild.pid))
      touch('trainer.ready')
      time.sleep(60)
      """)
  builder = child(tmp_path, "builder", """\
      touch('builder.ready')
      time.sleep(60)
      """)
  driver = tmp_path / "driver.py"
  driver.write_text(DRIVER.format(local=LOCAL_PY, workdir=str(tmp_path),
                                  commands={"trainer": trainer, "builder": builder}))
  launcher = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 20
    while not all((tmp_path / f).exists() for f in ("trainer.ready", "builder.ready")):
      assert time.monotonic() < deadline and launcher.poll() is None, launcher.stdout.read()
      time.sleep(0.05)
    launcher.send_signal(sig)
    out, _ = launcher.communicate(timeout=20)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  assert launcher.returncode == 128 + sig, out
  assert f"local.py: got {sig.name}; stopping trainer and builder ({sig.name}, then" in out, out
  stopped_by_sigint = [(tmp_path / f"{n}.sigint").exists() for n in ("trainer", "builder")]
  assert stopped_by_sigint == [sig == signal.SIGINT] * 2
  for name in ("trainer", "builder", "grandchild"):
    assert gone(read_pid(tmp_path, name)), name


class _Stubborn:
  """A child that ignores everything but SIGKILL."""

  def __init__(self, name):
    self.name, self.note, self.got = name, "", []

  @property
  def running(self):
    return signal.SIGKILL not in self.got

  @property
  def returncode(self):
    return -signal.SIGKILL if signal.SIGKILL in self.got else None

  def signal_group(self, sig):
    self.got.append(sig)


def test_two_signals_before_the_launchers_poll_kill_both_at_once(tmp_path):
  """A second signal that reached the launcher before it acted on the first (a demo stopping
  its stages again at once) counts as a second signal: SIGKILL now, not after the grace
  period, which children that ignore SIGINT would otherwise outlast."""
  said = []
  supervisor = local._Supervisor(str(tmp_path), grace=30.0, say=said.append)
  supervisor.children = {name: _Stubborn(name) for name in local.NAMES}
  supervisor.signals = ["SIGINT", "SIGINT"]       # both handled before the poll
  start = time.monotonic()
  assert supervisor.watch() == 128 + signal.SIGINT
  assert time.monotonic() - start < 10
  assert [c.got for c in supervisor.children.values()] == [[signal.SIGINT, signal.SIGKILL]] * 2
  assert "trainer and builder still running on a second signal; sending SIGKILL" in said


def test_a_trainer_sigkilled_on_sigterm_makes_the_launcher_exit_137_not_143(tmp_path):
  """143 says the trainer saved its step (a scheduler's or the demo's reading); a trainer
  still running after the grace period was killed instead."""
  supervisor = local._Supervisor(str(tmp_path), grace=0.5, say=lambda message: None)
  supervisor.children = {name: _Stubborn(name) for name in local.NAMES}
  supervisor.signals = ["SIGTERM"]
  assert supervisor.watch() == 128 + signal.SIGKILL


class _Saving(_Stubborn):
  """A trainer that, on SIGTERM, saves for `seconds` and then exits with `code`."""

  def __init__(self, name, seconds, code):
    super().__init__(name)
    self.seconds, self.code, self.at = seconds, code, None

  @property
  def running(self):
    return super().running and (self.at is None or time.monotonic() < self.at + self.seconds)

  @property
  def returncode(self):
    return super().returncode or (None if self.running else self.code)

  def signal_group(self, sig):
    super().signal_group(sig)
    if sig == signal.SIGTERM and self.at is None:
      self.at = time.monotonic()


@pytest.mark.parametrize("code, expected", [(143, 143), (1, 1), (75, 75)])
def test_on_sigterm_the_trainer_gets_its_save_grace_and_its_failure_is_ours(tmp_path, code,
                                                                          expected):
  """The trainer saving for longer than the launcher's --grace but within its own
  train.preemption_grace_seconds is not killed; a trainer that failed while saving (exit 1)
  makes the launcher exit 1, not 143 (143 says a saved step to resume from), one whose save
  did not finish within that grace (its watchdog's 75) 75."""
  said = []
  supervisor = local._Supervisor(str(tmp_path), grace=0.2, say=said.append, save_grace=5.0)
  supervisor.children = {"trainer": _Saving("trainer", 1.0, code),
                         "builder": _Saving("builder", 0.0, 0)}
  supervisor.signals = ["SIGTERM"]
  assert supervisor.watch() == expected, said
  assert signal.SIGKILL not in supervisor.children["trainer"].got, said
  assert "got SIGTERM; stopping trainer and builder (SIGTERM, then SIGKILL after 5 s)" in said
  assert ("trainer did not save its step within its grace; a rerun resumes from its latest "
          "finalised checkpoint" in said) == (code == 75), said


@pytest.mark.parametrize("visible, builder_ids, expected", [
    (["0", "1", "2", "3", "4", "5", "6", "7"], "6,7", ("0,1,2,3,4,5", "6,7")),
    (["0", "1", "2", "3"], " 0, 2 ", ("1,3", "0,2")),
    (["2", "3", "5"], "5", ("2,3", "5")),               # ids as CUDA_VISIBLE_DEVICES lists them
    ([], "", None),                                     # CPU: no split, environment inherited
    (["0"], "shared", ("0", "0")),                      # one GPU: both on it
    (["0", "1"], " shared ", ("0,1", "0,1")),
    ([], "shared", None),                               # CPU: nothing to share
])
def test_assign_devices(visible, builder_ids, expected):
  assert local.assign_devices(visible, builder_ids) == expected


@pytest.mark.parametrize("visible, builder_ids, words", [
    (["0", "1"], "", "disjoint"),
    (["0"], "", "or 'shared'"),
    (["0", "1"], "2", "not among the visible GPUs 0,1"),
    (["0", "1"], "0,1", "leaves none for the trainer"),
    (["0", "1", "2"], "1,1", "twice"),
    ([], "0", "no GPU is visible"),
])
def test_assign_devices_errors(visible, builder_ids, words):
  with pytest.raises(ConfigError) as e:
    local.assign_devices(visible, builder_ids)
  assert e.value.option == "builder.devices"
  assert str(e.value).startswith("config.builder.devices: ") and words in str(e.value)


def test_visible_gpus():
  listing = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaa)\n"
             "GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-bbb)\n"
             "  MIG 1g.5gb     Device  0: (UUID: MIG-ccc)\n")
  assert local.parse_gpu_list(listing) == ["0", "1"]
  assert local.visible_gpus({"CUDA_VISIBLE_DEVICES": "4, 5,6"}) == ["4", "5", "6"]
  assert local.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
  assert local.visible_gpus({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0,1"}) == []


def test_command_line_passes_overrides_to_both():
  args = local.parse_args(["--config", "configs/demo_realm.py:realm", "--workdir", "W",
                           "--config.builder.devices=6,7", "--grace", "3",
                           "--config.train.steps", "5", "--noconfig.model.share_towers"])
  assert (args.config, args.workdir, args.grace) == ("configs/demo_realm.py:realm", "W", 3.0)
  assert args.overrides == ["--config.builder.devices=6,7", "--config.train.steps", "5",
                            "--noconfig.model.share_towers"]
  config = local.config_from_flags("local.py", args.config, args.overrides)   # as the children
  assert (config.builder.devices, config.train.steps, config.model.share_towers) == (
      "6,7", 5, False)
  commands = local.default_commands(args.config, args.workdir, args.overrides)
  tail = ["--config", "configs/demo_realm.py:realm", "--workdir", "W", *args.overrides]
  assert commands["trainer"] == [sys.executable, "-m", "realm_jax.train.main", *tail]
  assert commands["builder"] == [sys.executable, "-m", "realm_jax.retrieval.builder", *tail]
  # the launcher's own -v N reaches both processes (nothing is added without one)
  loud = local.default_commands(args.config, args.workdir, args.overrides, verbosity=-1)
  assert all(c == commands[name] + ["--verbosity=-1"] for name, c in loud.items())


def test_a_flagfile_is_read_in_place_and_its_overrides_go_to_both(tmp_path):
  """The launcher's parser knows no `--flagfile`: `main` reads it in place first
  (`upgrade_flags`, as absl would), whatever names it holds."""
  flagfile = tmp_path / "run.flags"
  flagfile.write_text("--config.train.steps=5\n--config.retrieval.k=4\n")
  args = local.parse_args(local.upgrade_flags([
      "--config", "configs/demo_realm.py:realm", "--workdir", "W", "--flagfile",
      str(flagfile), "--config.seed=2"]))
  assert args.overrides == ["--config.train.steps=5", "--config.retrieval.k=4",
                            "--config.seed=2"]
  config = local.config_from_flags("local.py", args.config, args.overrides)
  assert (config.train.steps, config.retrieval.k, config.seed) == (5, 4, 2)


def test_negative_values_and_a_word_after_a_boolean_read_as_absl_reads_them(capsys):
  args = local.parse_args(["--config", "configs/demo_realm.py:realm", "--workdir", "W",
                           "--config.train.warmup_steps", "-1", "--config.train.lr", "-1e-3"])
  assert args.overrides == ["--config.train.warmup_steps", "-1", "--config.train.lr", "-1e-3"]
  config = local.config_from_flags("local.py", args.config, args.overrides)
  assert (config.train.warmup_steps, config.train.lr) == (-1, -1e-3)   # (validation aside)
  # absl gives a boolean flag no word: `false` would be left over, and the flag read as True
  flags = local.parse_args(["--config", "configs/demo_realm.py:realm", "--workdir", "W",
                            "--config.train.async_checkpoints", "false"]).overrides
  with pytest.raises(SystemExit) as exit_:
    local.config_from_flags("local.py", "configs/demo_realm.py:realm", flags)
  assert exit_.value.code == 2
  assert "unexpected argument(s) ['false']" in capsys.readouterr().err


def test_a_config_without_the_builder_runs_the_trainer_alone(tmp_path, capsys, monkeypatch):
  """ICT has no separate builder: none starts (it would embed for no trainer, never see W/DONE,
  and fail the run after builder.wait_timeout), the trainer's exit ends the run, and the
  config is checked before anything starts."""
  trainer = child(tmp_path, "trainer", "print('step 1 loss 2.5')\n")
  builder = child(tmp_path, "builder", "time.sleep(60)\n")
  monkeypatch.setattr(local, "default_commands",
                      lambda *args: {"trainer": trainer, "builder": builder})
  argv = ["--config", os.path.join(REPO, "configs", "demo_ict.py"), "--workdir", str(tmp_path),
          f"--config.data.dir={tmp_path}", "--grace", "1"]
  assert local.main(argv) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == ("local.py: the config does not use the separate index builder (task "
                      "'ict', retrieval.candidates 'index', retrieval.refresh 'in_process'): "
                      "the trainer runs alone")
  assert "[trainer] step 1 loss 2.5" in lines
  assert lines[-1].startswith("local.py: exit 0: trainer exit code 0 after "), lines[-1]
  assert "builder" not in lines[-1] and not (tmp_path / "builder.pid").exists()
  assert os.listdir(tmp_path / "logs") == ["trainer.log"]
  failing = child(tmp_path, "trainer", "sys.exit(3)\n")
  assert local.supervise({"trainer": failing}, str(tmp_path), grace=1) == 3
  (tmp_path / "logs" / "trainer.log").unlink()
  with pytest.raises(SystemExit) as exit_:              # refused as the trainer would refuse it
    local.main([*argv, "--config.train.batch_size=0"])
  assert exit_.value.code == 2
  assert capsys.readouterr().err == \
      "local.py: error: config.train.batch_size: must be >= 1, got 0\n"
  assert not (tmp_path / "logs" / "trainer.log").exists()


@pytest.mark.parametrize("cuda_visible, flags, words", [
    ("", ["--config.builder.devices=0"], "no GPU is visible"),
    ("0,1", [], "disjoint"),                           # the config's default index.devices ""
    ("0,1", ["--config.builder.devices=0,1"], "leaves none for the trainer"),
])
def test_cli_device_errors_name_the_option(tmp_path, cuda_visible, flags, words):
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=cuda_visible)
  env.pop("JAX_PLATFORMS", None)
  result = subprocess.run(
      [sys.executable, LOCAL_PY, "--config", "configs/demo_realm.py:realm",
       "--workdir", str(tmp_path / "run"), *flags],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 2, result.stdout + result.stderr
  assert "Traceback" not in result.stderr, result.stderr
  errors = result.stderr.strip().splitlines()
  assert len(errors) == 1 and errors[0].startswith("local.py: error: config.builder.devices: "), \
      result.stderr
  assert words in errors[0], errors[0]
  assert not (tmp_path / "run").exists()               # nothing started


@pytest.mark.parametrize("flags, message", [
    ([], "config.data.dir: is empty: point it at a prepared data dir"),
    (["--config.data.dir=nowhere"],      # a relative dir is named with where it was looked for
     f"config.data.dir: data dir 'nowhere' does not exist (relative to {REPO})"),
    (["--config.data.dir=/nowhere"], "config.data.dir: data dir '/nowhere' does not exist"),
])
def test_a_data_dir_that_cannot_be_read_is_refused_before_either_process_starts(
    tmp_path, flags, message):
  """Both processes used to start, then each failed on it. Nothing is said before the
  refusal (the launch's "no GPU visible" line came first, on stdout)."""
  result = subprocess.run(
      [sys.executable, LOCAL_PY, "--config", "configs/demo_realm.py:realm",
       "--config.retrieval.refresh=async", "--workdir", str(tmp_path / "run"), *flags],
      cwd=REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stderr == f"local.py: error: {message}\n"
  assert result.stdout == "" and not (tmp_path / "run").exists()


def test_a_signal_while_the_config_is_read_starts_nothing(tmp_path, capsys):
  """A Ctrl-C that came before supervise (the launcher reads the config, importing JAX for
  a second or two) used to be lost in an import, and the run started anyway."""
  trainer = child(tmp_path, "trainer", "touch('started')\n")
  local._EARLY_SIGNALS.append("SIGINT")
  code, out, _ = run_supervise(capsys, {"trainer": trainer}, tmp_path)
  assert code == 130 and not local._EARLY_SIGNALS
  assert "local.py: got SIGINT before starting anything; nothing started" in out.splitlines()
  assert not (tmp_path / "started").exists() and "trainer:" not in out


def test_main_gives_the_callers_signal_handlers_back(tmp_path, capsys):
  """main() holds SIGINT and SIGTERM from its first line (for supervise); an in-process
  caller gets its own handlers back, however main ends."""
  before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
  with pytest.raises(SystemExit):
    local.main(["--config", "configs/nowhere.py", "--workdir", str(tmp_path)])
  assert {sig: signal.getsignal(sig) for sig in before} == before and not local._EARLY_SIGNALS
  assert "--config configs/nowhere.py: no such file" in capsys.readouterr().err


def test_a_negative_grace_is_refused(capsys):
  with pytest.raises(SystemExit) as exit_:
    local.parse_args(["--config", "c.py", "--workdir", "w", "--grace", "-5"])
  assert exit_.value.code == 2
  assert "local.py: error: --grace: must be >= 0 seconds, got -5" in capsys.readouterr().err


def test_a_workdir_in_use_is_refused_before_anything_starts(tmp_path):
  """A second launcher on W used to start a second trainer and builder there (and remove
  the live run's W/DONE); the live job's lock now refuses it, naming the pid."""
  from realm_jax import workdir as workdir_lib
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "DONE").write_text("4\n")
  for job in workdir_lib.JOBS:
    with workdir_lib.JobLock(str(workdir), job) as live:
      live.acquire()
      result = subprocess.run(
          [sys.executable, LOCAL_PY, "--config", "configs/demo_realm.py:realm",
           "--config.retrieval.refresh=async", f"--config.data.dir={tmp_path}",
           "--workdir", str(workdir)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (f"local.py: error: {workdir} is in use: a {job} (pid "
                             f"{os.getpid()}) runs on it; stop it first, or use another "
                             "workdir\n")
    assert "started" not in result.stdout and (workdir / "DONE").exists()


def test_a_second_launcher_is_refused_while_the_first_ones_children_start(tmp_path, capsys,
                                                                          monkeypatch):
  """The trainer and the builder take their locks only once started (seconds: JAX, the data);
  a second launcher on W meanwhile found no lock held and started a second trainer and
  builder beside the first's (their output in the same W/logs, and where the locks fell one
  to each launcher, both runs stopped). The first launcher holds W/launcher.lock: refused."""
  import threading
  body = ("if os.path.exists(path('first')):\n  touch('second.started')\n  sys.exit(0)\n"
          "touch('first')\nwait_for('go')\n")
  monkeypatch.setattr(local, "default_commands",
                      lambda *args: {"trainer": child(tmp_path, "trainer", body)})
  argv = ["--config", os.path.join(REPO, "configs", "demo_ict.py"), "--workdir", str(tmp_path),
          f"--config.data.dir={tmp_path}", "--grace", "1"]
  first = []
  thread = threading.Thread(target=lambda: first.append(local.main(argv)), daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 30
    while not (tmp_path / "first").exists():   # the first one's trainer is starting
      assert time.monotonic() < deadline and thread.is_alive()
      time.sleep(0.02)
    with pytest.raises(SystemExit) as exit_:
      local.main(argv)
  finally:
    (tmp_path / "go").touch()
    thread.join(timeout=30)
  assert exit_.value.code == 2 and first == [0]
  assert (f"local.py: error: {tmp_path} is in use: a launch/local.py (pid {os.getpid()}) runs "
          f"on it and holds {tmp_path}/launcher.lock; stop it first, or use another dir"
          in capsys.readouterr().err.splitlines())
  assert not (tmp_path / "second.started").exists()


def test_the_launchers_children_stop_when_it_is_sigkilled(tmp_path):
  """A launcher killed outright cannot pass a signal on: the kernel sends its children SIGTERM
  (a trainer saves its step on it) and none is left running."""
  trainer = child(tmp_path, "trainer", "touch('trainer.ready')\ntime.sleep(60)\n")
  builder = child(tmp_path, "builder", "touch('builder.ready')\ntime.sleep(60)\n")
  driver = tmp_path / "driver.py"
  driver.write_text(DRIVER.format(local=LOCAL_PY, workdir=str(tmp_path),
                                  commands={"trainer": trainer, "builder": builder}))
  launcher = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT)
  try:
    deadline = time.monotonic() + 20
    while not all((tmp_path / f).exists() for f in ("trainer.ready", "builder.ready")):
      assert time.monotonic() < deadline and launcher.poll() is None
      time.sleep(0.05)
    launcher.kill()
    launcher.wait(timeout=20)
  finally:
    if launcher.poll() is None:
      launcher.kill()
  for name in ("trainer", "builder"):
    assert gone(read_pid(tmp_path, name)), name


def test_a_sigterm_while_the_config_is_checked_exits_143_and_starts_nothing(tmp_path):
  """A SIGTERM (preemption; a sweep stopping its run) that came while the launcher checked the
  config, outside an import, was raised as a Ctrl-C: the launcher said "interrupted" and died
  by SIGINT, so a sweep took its run for one that did not end as asked. It is a preemption
  before anything started: exit 143, saying so."""
  script = textwrap.dedent(f"""\
      import os, signal, sys, time
      sys.path.insert(0, {os.path.dirname(LOCAL_PY)!r})
      import local
      def checked(config):   # the launcher's own checks, with a SIGTERM landing in them
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
      local.validate = checked
      sys.exit(local.main(["--config", "configs/demo_realm.py:realm",
                           "--config.retrieval.refresh=async",
                           "--config.data.dir={tmp_path}", "--workdir", {str(tmp_path / "run")!r}]))
      """)
  result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 143, (result.returncode, result.stdout + result.stderr)
  assert "Traceback" not in result.stderr, result.stderr
  assert "local.py: got SIGTERM before starting anything; nothing started" in \
      result.stdout + result.stderr
  assert not (tmp_path / "run").exists()


class _Failed(_Stubborn):
  """A child that has already exited with `code`."""

  def __init__(self, name, code):
    super().__init__(name)
    self.code = code

  @property
  def running(self):
    return False

  @property
  def returncode(self):
    return self.code

  def poll(self):
    return self.code


class _PolledSaving(_Saving):
  def poll(self):
    return self.returncode


def test_a_sigterm_while_the_trainer_saves_after_the_builder_failed_does_not_kill_it(
    tmp_path):
  """The builder failed and the trainer, sent SIGTERM, saves its step: a SIGTERM to the
  launcher then (a preemption, or a demo or sweep stopping its run) asks for nothing more than
  what the trainer is doing, yet it was taken for a second signal and SIGKILLed the trainer
  mid-save. A second signal still ends it at once."""
  import threading
  for signals, killed in ((["SIGTERM"], False), (["SIGTERM", "SIGTERM"], True),
                          (["SIGINT"], True)):
    said = []
    supervisor = local._Supervisor(str(tmp_path), grace=0.2, say=said.append, save_grace=5.0)
    supervisor.children = {"trainer": _PolledSaving("trainer", 1.0, 143),
                           "builder": _Failed("builder", 3)}
    timer = threading.Timer(0.3, lambda: supervisor.signals.extend(signals))
    timer.start()
    try:
      assert supervisor.watch() == 3, said
    finally:
      timer.cancel()
    assert (signal.SIGKILL in supervisor.children["trainer"].got) == killed, (signals, said)


def test_a_log_that_cannot_be_written_starts_nothing(tmp_path, capsys, monkeypatch):
  """The log's first line was written after the process started: a full disk (the write
  failing) said "cannot start the trainer" while the trainer ran on, untracked, never
  stopped by the launcher."""
  import errno
  import io

  class Full(io.StringIO):
    def flush(self):
      raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(local, "open", lambda *a, **k: Full(), raising=False)
  trainer = child(tmp_path, "trainer", "time.sleep(60)\n")
  code, out, _ = run_supervise(capsys, {"trainer": trainer}, tmp_path)
  assert code == 2, out
  assert "local.py: error: cannot start the trainer: [Errno 28] No space left on device" in \
      out.splitlines(), out
  time.sleep(1.0)                                   # a started trainer has written its pid
  assert not (tmp_path / "trainer.pid").exists() or gone(read_pid(tmp_path, "trainer"), 0.5)


def test_a_log_that_fails_mid_run_does_not_stall_the_child(tmp_path, capsys, monkeypatch):
  """A log write failing after the start (the disk filled) ended the output copier with a
  traceback: the pipe was no longer read, so the child blocked on its next 64 KiB of output
  and the run hung, its output no longer shown."""
  import errno
  import io

  class FillsUp(io.StringIO):
    flushes = 0

    def flush(self):
      FillsUp.flushes += 1
      if FillsUp.flushes > 1:   # the header went through
        raise OSError(errno.ENOSPC, "No space left on device")
  monkeypatch.setattr(local, "open", lambda *a, **k: FillsUp(), raising=False)
  trainer = child(tmp_path, "trainer", """\
      signal.alarm(5)           # blocked on a pipe nobody reads: SIGALRM, exit 142
      for i in range(2000):
        print(f'step {i} ' + 'x' * 200)
      """)
  code, out, _ = run_supervise(capsys, {"trainer": trainer}, tmp_path)
  lines = out.splitlines()
  assert code == 0, out[-2000:]
  assert "[trainer] step 1999 " + "x" * 200 in lines, out[-2000:]
  assert sum("No space left on device" in line for line in lines) == 1, out[-2000:]


def test_a_character_our_stdout_cannot_encode_does_not_silence_the_run(tmp_path, capsys,
                                                                        monkeypatch):
  """Under a non-UTF-8 locale (latin-1), a child's byte that is not UTF-8 (its own locale's
  'é') decodes to U+FFFD, which our stdout cannot encode: the UnicodeEncodeError was taken
  for a closed stdout and every later line of both processes and of the launcher vanished."""
  import io
  out = io.TextIOWrapper(io.BytesIO(), encoding="latin-1", write_through=True)
  monkeypatch.setattr(sys, "stdout", out)
  trainer = child(tmp_path, "trainer", """\
      sys.stdout.buffer.write(b'caf\\xe9 \\xc3\\xa9t\\xc3\\xa9\\n')
      print('step 2', flush=True)
      """)
  assert local.supervise({"trainer": trainer}, str(tmp_path), grace=5.0) == 0
  lines = out.buffer.getvalue().decode("latin-1").splitlines()
  assert "[trainer] caf? été" in lines, lines
  assert "[trainer] step 2" in lines, lines
  assert lines[-1].startswith("local.py: exit 0: "), lines

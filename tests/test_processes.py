"""realm_jax/processes.py: children stopped as asked on Ctrl-C, SIGTERM and a second
interrupt (the demos' stages, a sweep's runs)."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from realm_jax import processes


def _ready(tmp_path, name: str, handlers: str) -> subprocess.Popen:
  """A sleeping Python process, returned once it has run `handlers` (signal set-up)."""
  mark = tmp_path / f"{name}.ready"
  process = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n" + handlers +
                              f"\nopen({str(mark)!r}, 'w').close()\ntime.sleep(60)"])
  deadline = time.monotonic() + 60
  while not mark.exists():
    assert time.monotonic() < deadline and process.poll() is None, name
    time.sleep(0.05)
  return process


def test_stop_processes_returns_those_that_did_not_end_as_asked(tmp_path, monkeypatch):
  """Only one that saved (exit 143 on SIGTERM) or had finished ended as asked; ended by the
  signal itself, failing as it saved or SIGKILLed after the second signal, it did not."""
  saving = _ready(tmp_path, "saving", "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))")
  assert processes.stop_processes([saving, None], grace_seconds=10) == []   # None: had ended
  sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  # ended by the signal itself, nothing saved
  assert processes.stop_processes([sleeping], grace_seconds=10) == [sleeping]
  assert sleeping.returncode == -signal.SIGTERM
  failing = _ready(tmp_path, "failing", "signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))")
  assert processes.stop_processes([failing], grace_seconds=10) == [failing]   # did not save
  # Ctrl-C: SIGINT is passed on; one that ignores it is killed after the grace period
  # (a pytest-xdist worker ignores SIGINT and its children inherit that: restore Python's own)
  interrupted = _ready(tmp_path, "interrupted",
                       "signal.signal(signal.SIGINT, signal.default_int_handler)")
  processes.stop_processes([interrupted], grace_seconds=30, sig=signal.SIGINT)
  assert interrupted.returncode not in (0, -signal.SIGKILL)
  deaf = _ready(tmp_path, "deaf", "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
  monkeypatch.setattr(processes, "KILL_SECONDS", 1.0)
  assert processes.stop_processes([deaf], grace_seconds=1) == [deaf]   # SIGTERM, again, SIGKILL
  assert deaf.returncode == -signal.SIGKILL


def test_stopping_signals_every_stage_at_once_and_leaves_none_when_interrupted(tmp_path,
                                                                              monkeypatch):
  """Each stage gets its signal before the demo waits for any (a stage saving its step must not
  wait for another's save), and a second interrupt while they stop kills the rest rather
  than leave a stage running, unseen, in a session of its own."""
  slow = ("def stop(*_):\n"
          "  open({mark!r}, 'w').write(repr(time.time())); time.sleep(3); sys.exit(143)\n"
          "signal.signal(signal.SIGTERM, stop)")
  marks = [str(tmp_path / f"stage{i}") for i in range(2)]
  stages = [_ready(tmp_path, f"stage{i}", slow.format(mark=mark)) for i, mark in enumerate(marks)]
  processes.stop_processes(stages, grace_seconds=30)
  assert [p.returncode for p in stages] == [143, 143]
  signalled = [float(open(mark).read()) for mark in marks]
  assert abs(signalled[1] - signalled[0]) < 2.0      # one after the other: >= 3 s apart

  class Interrupted:                                 # the demo gets Ctrl-C while it waits
    waited, killed = False, False

    def poll(self):
      return -signal.SIGKILL if self.killed else None

    def send_signal(self, sig):
      pass

    def wait(self, timeout=None):
      if not self.waited:
        self.waited = True
        raise KeyboardInterrupt

    def kill(self):
      self.killed = True
  deaf = _ready(tmp_path, "deaf", "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
  monkeypatch.setattr(processes, "KILL_SECONDS", 1.0)
  with pytest.raises(KeyboardInterrupt):
    processes.stop_processes([Interrupted(), deaf], grace_seconds=30)
  assert deaf.returncode == -signal.SIGKILL


def test_a_second_signal_lets_a_launcher_end_the_processes_it_started(tmp_path, monkeypatch):
  """A stage still running after the grace period (or when the demo is interrupted again) gets
  its signal a second time before SIGKILL: launch/local.py answers it by SIGKILLing its trainer
  and builder, which run in sessions of their own that a SIGKILL to the launcher never reaches.
  """
  mark = str(tmp_path / "launcher.ended")
  stage = _ready(tmp_path, "launcher", "import subprocess\n"
                 "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
                 " start_new_session=True)\n"
                 "signals = []\n"
                 "def on_signal(*_):\n"
                 "  signals.append(1)\n"
                 "  if len(signals) == 2:\n"
                 f"    child.kill(); child.wait(); open({mark!r}, 'w').close(); sys.exit(130)\n"
                 "signal.signal(signal.SIGTERM, on_signal)")
  monkeypatch.setattr(processes, "KILL_SECONDS", 30.0)
  processes.stop_processes([stage], grace_seconds=1)
  assert stage.returncode == 130 and os.path.exists(mark)   # its child ended by it


def test_a_third_interrupt_waits_until_every_stage_got_its_second_signal(tmp_path,
                                                                          monkeypatch):
  """Ctrl-C hammered: the interrupt that comes while the demo escalates (second signal, then
  SIGKILL) must not SIGKILL launch/local.py before it has ended its trainer and builder."""
  launcher = _ready(tmp_path, "launcher", "signals = []\n"
                    "def on_signal(*_):\n"
                    "  signals.append(1)\n"
                    "  if len(signals) == 2:\n"
                    "    time.sleep(1); sys.exit(130)\n"
                    "signal.signal(signal.SIGTERM, on_signal)")

  class Interrupting:          # the demo waits on it when Ctrl-C comes, and again during
    signals, killed = 0, False   # the escalation

    def poll(self):
      return -signal.SIGKILL if self.killed else None

    def send_signal(self, sig):
      self.signals += 1
      if self.signals == 2:
        os.kill(os.getpid(), signal.SIGINT)

    def wait(self, timeout=None):
      if self.signals == 1:
        raise KeyboardInterrupt

    def kill(self):
      self.killed = True
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist ignores SIGINT
  try:
    with pytest.raises(KeyboardInterrupt):
      processes.stop_processes([Interrupting(), launcher], grace_seconds=30)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    signal.signal(signal.SIGINT, previous)
  assert launcher.returncode == 130


def _signal_us_once(ready, *signals) -> None:
  """From a thread: once the file `ready` exists, `signals` to this process, 1 s apart (the
  main thread's handlers run them)."""
  def send():
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
      time.sleep(0.05)
    for i, sig in enumerate(signals):
      time.sleep(1 if i else 0)
      os.kill(os.getpid(), sig)
  threading.Thread(target=send, daemon=True).start()


def test_run_to_end_passes_ctrl_c_to_its_process_once_and_waits_for_it(tmp_path):
  """Ctrl-C while `run_to_end` waits (a sweep's run, in a session of its own, so the terminal's
  SIGINT reaches only us): the process gets one SIGINT, ends on its own, then we stop too."""
  stopped, ready = tmp_path / "stopped", tmp_path / "ready"
  child = ("import os, signal, sys, time\n"
           "def stop(*_):\n"
           f"  with open({str(stopped)!r}, 'a') as f:\n"
           "    f.write(f'SIGINT {os.getsid(0) == os.getpid()}\\n')\n"
           "  sys.exit(130)\n"
           "signal.signal(signal.SIGINT, stop)\n"
           f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n")
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist ignores SIGINT
  try:
    _signal_us_once(ready, signal.SIGINT)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
      processes.run_to_end("run x", [sys.executable, "-c", child])
  finally:
    signal.signal(signal.SIGINT, previous)
  # one signal, in a session of its own (the terminal's Ctrl-C is ours alone); it had ended
  assert stopped.read_text() == "SIGINT True\n"
  assert time.monotonic() - t0 < 30                    # not the 60 s sleep: it was stopped


def test_run_to_end_interrupted_again_while_it_stops_ends_its_process_as_on_ctrl_c(
    tmp_path, monkeypatch):
  """Ctrl-C, then SIGTERM while the process (which ignores SIGINT) is given its grace: it is
  ended at once (second signal, SIGKILL), and we stop as on Ctrl-C, not as a saved preemption."""
  monkeypatch.setattr(processes, "KILL_SECONDS", 1.0)   # from its second signal to SIGKILL
  ready = tmp_path / "ready"
  child = (f"import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
           f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)\n")
  previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
              signal.SIGTERM: signal.signal(signal.SIGTERM, processes.on_sigterm)}
  try:
    _signal_us_once(ready, signal.SIGINT, signal.SIGTERM)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
      processes.run_to_end("run x", [sys.executable, "-c", child], grace_seconds=50)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  assert time.monotonic() - t0 < 20        # not the 50 s grace nor the 60 s sleep


def test_the_sigterm_handler_stops_the_driver_once():
  previous = signal.signal(signal.SIGTERM, processes.on_sigterm)
  try:
    with pytest.raises(processes.Preempted) as stopped:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(5)                             # the handler raises here, in the main thread
    assert stopped.value.code == processes.EXIT_CODE
    # a second SIGTERM while the stages are being stopped is ignored
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
  finally:
    signal.signal(signal.SIGTERM, previous)


def child_pid(path, driver: subprocess.Popen) -> int:
  """The pid a driver's child writes to `path` once it runs (the driver still alive)."""
  deadline = time.monotonic() + 60
  while not path.exists() or not path.read_text():
    assert time.monotonic() < deadline and driver.poll() is None
    time.sleep(0.05)
  return int(path.read_text())


def test_a_drivers_child_gets_sigterm_when_the_driver_is_sigkilled(tmp_path):
  """run_to_end's process (a sweep's run; the demos' stages start the same way) outlives no
  driver killed outright: the kernel sends it SIGTERM, which a trainer saves its step on."""
  child = (f"import os, signal, sys, time\n"
           f"signal.signal(signal.SIGTERM, lambda *a: (open({str(tmp_path / 'term')!r}, 'w')"
           f".close(), sys.exit(143)))\n"
           f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
  driver = subprocess.Popen([sys.executable, "-c", "import sys; from realm_jax import processes; "
                             f"processes.run_to_end('run', [sys.executable, '-c', {child!r}])"])
  try:
    child_pid(tmp_path / "pid", driver)
    driver.kill()
    driver.wait(timeout=20)
    deadline = time.monotonic() + 10
    while not (tmp_path / "term").exists():
      assert time.monotonic() < deadline, "the driver's child got no SIGTERM"
      time.sleep(0.05)
  finally:
    if driver.poll() is None:
      driver.kill()


def test_a_child_started_with_another_death_signal_gets_that_one(tmp_path):
  """`start_child(death_signal=SIGKILL)` (the bucket tests' server, which has nothing to save):
  a child that ignores SIGTERM still ends when its driver is SIGKILLed."""
  child = (f"import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           f"open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
  driver = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                             "from realm_jax import processes; processes.start_child("
                             f"[sys.executable, '-c', {child!r}], death_signal=signal.SIGKILL); "
                             "time.sleep(60)"])
  try:
    pid = child_pid(tmp_path / "pid", driver)
    driver.kill()
    driver.wait(timeout=20)
    deadline = time.monotonic() + 10
    while True:   # gone, or a zombie of an init that does not reap
      try:
        with open(f"/proc/{pid}/stat") as f:
          if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break
      except FileNotFoundError:
        break
      assert time.monotonic() < deadline, "the child outlived its driver"
      time.sleep(0.05)
  finally:
    if driver.poll() is None:
      driver.kill()
    if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text():
      with contextlib.suppress(ProcessLookupError):   # a child the test failed to see end
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)


def test_a_child_started_after_jax_brings_no_fork_warning(recwarn):
  """A demo runs its first stages in its own process, then starts the REALM stage's: JAX's
  at-fork hook ("os.fork() was called ... will likely lead to a deadlock") must not reach the
  console for a child that only execs (`start_child`); the filter is for that call alone."""
  import jax
  import warnings
  jax.devices()   # a backend: JAX's at-fork hook is installed
  filters = list(warnings.filters)
  child = processes.start_child([sys.executable, "-c", "pass"])
  assert child.wait(timeout=60) == 0
  assert warnings.filters == filters   # the filter was for that call alone
  forks = [w for w in recwarn if "os.fork() was called" in str(w.message)]
  assert not forks, [str(w.message) for w in forks]
  with warnings.catch_warnings(record=True) as seen:   # the hook is there: a plain Popen warns
    warnings.simplefilter("always")
    assert subprocess.Popen([sys.executable, "-c", "pass"],
                            preexec_fn=lambda: None).wait(timeout=60) == 0
  assert any("os.fork() was called" in str(w.message) for w in seen)

"""The trainer and the separate index-builder job as two processes on one machine.

  python launch/local.py --config configs/demo_realm.py:realm --workdir runs/local \
      --config.retrieval.refresh=async [--config.builder.devices=6,7] [--grace 30]

Every `--config.*` override goes to both processes (`realm_jax.train.main` and
`realm_jax.retrieval.builder`); they share only the workdir (realm_jax/workdir.py;
docs/workdir.md). A config without the separate builder (`uses_index_builder`: ICT, REALM's
warm-up, retrieval.refresh=in_process) runs the trainer alone.
With GPUs visible, `config.builder.devices` names the builder's GPUs and the trainer gets the
rest, or is `shared`: both on every GPU (a one-GPU machine), each allocating device memory as
it needs; on CPU both inherit the environment. Output is streamed line by line with a
`[trainer] ` / `[builder] ` prefix and appended to `W/logs/<name>.log`. Ctrl-C stops both
(SIGINT to each process group, SIGKILL after the grace period, exit 130); SIGTERM (preemption)
is passed on as SIGTERM, so the trainer saves a checkpoint of its step first, within its
`train.preemption_grace_seconds` (SIGKILL only 15 s past that, or past `--grace` if longer;
exit 143; 137 if it had to be SIGKILLed, 75 if its save ran past that grace, the trainer's
own code if it failed while saving);
when one fails the other is stopped and its exit code is ours; after the trainer succeeds
the builder gets the grace period to see `W/DONE` and exit on its own.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from realm_jax import log, paths, workdir as workdir_lib
from realm_jax.errors import CommandParser, ConfigError, held_back, run_cli
from realm_jax.config.overrides import config_from_flags
from realm_jax.config.reading import uses_index_builder
from realm_jax.config.validation import validate, validate_training
from realm_jax.processes import Preempted, shared_memory_env, start_child
from realm_jax.runtime import preemption
from realm_jax.config.option_names import upgrade_flags

PROG = "local.py"
NAMES = ("trainer", "builder")
SHARED = "shared"      # config.builder.devices: trainer and builder on the same GPUs
DEFAULT_GRACE = 30.0
SAVE_MARGIN = 15.0   # seconds past the trainer's train.preemption_grace_seconds before SIGKILL
POLL_SECONDS = 0.1
_OVERRIDE = re.compile(r"^--?(no)?config\.")     # the override forms absl's config_flags takes
_FLAG = re.compile(r"^--?[A-Za-z]")               # a flag, not a value such as -1 or -1e-3
_LINE_END = re.compile(rb"\r\n|\r|\n")           # a lone \r: each progress-bar update is a line


# Signals that came before `supervise` took over (while the config was read and checked, JAX's
# import included): a Ctrl-C then used to be lost inside an import, and the run started anyway.
_EARLY_SIGNALS: list[str] = []


def _record_early_signal(signum, frame) -> None:
  """Kept for `supervise` (an interrupt raised inside an import's callback can be swallowed),
  and raised, so that a launcher stuck before it (a hung mount) still stops; inside an import,
  where it would break it with a traceback, only a second one is raised, and never inside a
  gc callback, where it would be lost (`supervise` starts nothing after the first). SIGTERM is
  raised as `Preempted` (exit 143, as after the children started), Ctrl-C as itself."""
  _EARLY_SIGNALS.append(signal.Signals(signum).name)
  if not held_back(frame, len(_EARLY_SIGNALS)):
    if signum == signal.SIGTERM:
      raise Preempted("SIGTERM", saved=None)
    raise KeyboardInterrupt


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
  """Separates `--config.a.b=v` / `--config.a.b v` overrides from the launcher's own flags.

  Args:
    argv: the command line without the program name.
  Returns:
    (the launcher's own arguments, the override tokens in their order).
  """
  own, overrides = [], []
  i = 0
  while i < len(argv):
    arg = argv[i]
    if _OVERRIDE.match(arg):
      overrides.append(arg)
      # `--config.a.b v`: the value is the next token, a negative number too (a bare boolean
      # flag has none; a word after one is refused by config_from_flags, as absl leaves it)
      if "=" not in arg and i + 1 < len(argv) and not _FLAG.match(argv[i + 1]):
        i += 1
        overrides.append(argv[i])
    else:
      own.append(arg)
    i += 1
  return own, overrides


def parse_args(argv: list[str]) -> argparse.Namespace:
  """The launcher's flags (config, workdir, grace) plus `overrides`, the `--config.*` tokens."""
  own, overrides = split_overrides(argv)
  parser = CommandParser(
      prog=PROG, allow_abbrev=False,
      description="Runs the trainer and the index builder as two processes on this machine; "
                  "every --config.a.b=v override is passed to both.")
  parser.add_argument("--config", required=True, help="config file and arg: configs/X.py[:arg]")
  parser.add_argument("--workdir", required=True, help="run directory shared by both processes")
  parser.add_argument("--grace", type=float, default=DEFAULT_GRACE,
                      help="seconds a process gets to exit after SIGINT before SIGKILL "
                           "(and the builder after the trainer finished)")
  log.add_verbosity_argument(parser)
  args = parser.parse_args(own)
  if not args.grace >= 0:
    parser.error(f"--grace: must be >= 0 seconds, got {args.grace:g}")
  args.overrides = overrides
  return args


def parse_gpu_list(nvidia_smi_output: str) -> list[str]:
  """GPU ids from `nvidia-smi -L` ("GPU 0: NVIDIA H100 (UUID: ...)"; MIG lines are skipped)."""
  return re.findall(r"^GPU (\d+):", nvidia_smi_output, flags=re.MULTILINE)


def visible_gpus(environ: dict[str, str]) -> list[str]:
  """The GPU ids the two processes can be given, [] on a CPU-only machine.

  Args:
    environ: the launcher's environment.
  Returns:
    The ids of CUDA_VISIBLE_DEVICES if it is set, else those `nvidia-smi -L` lists; [] when
    JAX_PLATFORMS excludes GPUs (the jobs would not use them).
  """
  platforms = environ.get("JAX_PLATFORMS", "")
  if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
    return []
  if "CUDA_VISIBLE_DEVICES" in environ:
    return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
  try:
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired):
    return []
  return parse_gpu_list(result.stdout) if result.returncode == 0 else []


def assign_devices(visible: list[str], builder_ids: str) -> tuple[str, str] | None:
  """Splits the visible GPUs between the trainer and the builder (disjoint sets).

  Args:
    visible: GPU ids visible to the launcher, in order ([] on CPU).
    builder_ids: `config.builder.devices`, comma-separated ids for the builder ("6,7"), or
      "shared": both processes on every visible GPU (one GPU; their memory:
      `shared_memory_env`).
  Returns:
    (trainer ids, builder ids) as CUDA_VISIBLE_DEVICES values, or None on CPU (no GPU visible
    and none asked for): both processes then inherit the environment.
  Raises:
    ConfigError naming `builder.devices` when the split is impossible.
  """
  shown = ",".join(visible)
  if builder_ids.strip() == SHARED:
    return (shown, shown) if visible else None
  wanted = [d.strip() for d in builder_ids.split(",") if d.strip()]
  if not visible:
    if wanted:
      raise ConfigError("builder.devices", f"{builder_ids!r} names GPUs for the builder, but no "
                        "GPU is visible (nvidia-smi -L, CUDA_VISIBLE_DEVICES); set "
                        "--config.builder.devices= to run both processes on CPU")
    return None
  if not wanted:
    raise ConfigError("builder.devices", f"GPUs {shown} are visible and the trainer and the "
                      "builder must get disjoint ones: set --config.builder.devices to the "
                      f"builder's ids (e.g. --config.builder.devices={visible[-1]}); the trainer "
                      f"gets the rest (or '{SHARED}': both on every GPU)")
  unknown = [d for d in wanted if d not in visible]
  if unknown:
    raise ConfigError("builder.devices", f"{','.join(unknown)} not among the visible GPUs "
                      f"{shown}")
  if len(set(wanted)) != len(wanted):
    raise ConfigError("builder.devices", f"{builder_ids!r} names a GPU twice")
  trainer = [d for d in visible if d not in wanted]
  if not trainer:
    raise ConfigError("builder.devices", f"{builder_ids!r} takes every visible GPU ({shown}) "
                      f"and leaves none for the trainer (to share them: '{SHARED}')")
  return ",".join(trainer), ",".join(wanted)


def default_commands(config: str, workdir: str, overrides: list[str],
                     verbosity: int = 0) -> dict[str, list[str]]:
  """The trainer's and the builder's argv, both with the same config, workdir and overrides
  (and the launcher's `--verbosity`, where one was given)."""
  common = ["--config", config, "--workdir", workdir, *overrides,
            *([f"--verbosity={verbosity}"] if verbosity else [])]
  return {"trainer": [sys.executable, "-m", "realm_jax.train.main", *common],
          "builder": [sys.executable, "-m", "realm_jax.retrieval.builder", *common]}


def split_lines(buf: bytes) -> tuple[list[bytes], bytes]:
  """The complete lines of `buf` (ended by \\n, \\r\\n or a lone \\r) and the unfinished rest."""
  hold = buf.endswith(b"\r")      # may be the first half of a \r\n split across two reads
  *lines, rest = _LINE_END.split(buf[:-1] if hold else buf)
  return lines, rest + (b"\r" if hold else b"")


def command_line(argv: list[str]) -> str:
  """`argv` as one shell line (a newline inside an argument shown as \\n)."""
  return shlex.join(argv).replace("\n", "\\n")


def describe(returncode: int) -> str:
  """`exit code N`, or `killed by SIGX` for a process a signal ended (`signal N` for one
  Python has no name for: a real-time signal)."""
  if returncode < 0:
    try:
      return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
      return f"killed by signal {-returncode}"
  return f"exit code {returncode}"


class _Child:
  """One supervised process: its own process group, output copier, log file and wall time."""

  def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: str, say):
    self.name = name
    self.note = ""                  # how it ended, when we ended it
    self.returncode: int | None = None
    self._say = say
    self.start = time.monotonic()
    self.end: float | None = None
    # the log first: a log that cannot be opened or written (a full disk) starts nothing (the
    # process was left untracked)
    self.log_path, self._log_failed = log_path, False
    self._log = open(log_path, "a", encoding="utf-8")
    try:
      self._log.write(f"# {PROG} {time.strftime('%Y-%m-%d %H:%M:%S')}: {command_line(argv)}\n")
      self._log.flush()
      # Own session: a terminal's Ctrl-C reaches only the launcher, which forwards it (and can
      # then SIGKILL everything the job started, grandchildren included).
      self.proc = start_child(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    except BaseException:
      self._log.close()
      raise
    self._reader = threading.Thread(target=self._copy_output, name=f"{name}-output", daemon=True)
    self._reader.start()

  @property
  def running(self) -> bool:
    return self.poll() is None

  def poll(self) -> int | None:
    """Reaps the process if it exited; what it left running in its group is killed first."""
    if self.returncode is not None:
      return self.returncode
    try:
      exited = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
      exited = True
    if exited is None:
      return None
    # The leader is a zombie until reaped, so its group id cannot have been reused yet.
    self.signal_group(signal.SIGKILL)
    self.returncode = self.proc.wait()
    self.end = time.monotonic()
    return self.returncode

  def signal_group(self, sig: int) -> None:
    """Sends `sig` to the process group; only while the leader is unreaped (see poll)."""
    if self.returncode is None:
      try:
        os.killpg(self.proc.pid, sig)
      except ProcessLookupError:
        pass

  def _copy_output(self) -> None:
    prefix = f"[{self.name}] "
    rest = b""
    while chunk := self.proc.stdout.read1(65536):
      lines, rest = split_lines(rest + chunk)
      self._emit(prefix, lines)
    self._emit(prefix, [rest.rstrip(b"\r")])

  def _emit(self, prefix: str, lines: list[bytes]) -> None:
    for raw in lines:
      if raw:                       # blank lines (and \r\r of progress bars) carry nothing
        line = raw.decode("utf-8", errors="replace")
        self._write_log(line)
        self._say(line, prefix)

  def _write_log(self, line: str) -> None:
    """Appends `line` to the log; a write that fails (a full disk) is said once and the log
    left: the output is still read (else the process blocks on a full pipe) and shown."""
    if self._log_failed:
      return
    try:
      self._log.write(line + "\n")
      self._log.flush()
    except OSError as e:
      self._log_failed = True
      self._say(f"error: cannot write {self.log_path} ({e}); the {self.name}'s output goes "
                "on here only", f"{PROG}: ")

  def close(self) -> None:
    """Waits for the output copier (the group is dead, so the pipe ends) and closes the log."""
    self._reader.join(timeout=10)
    self._log.close()

  def summary(self) -> str:
    wall = (self.end if self.end is not None else time.monotonic()) - self.start
    code = describe(self.returncode) if self.returncode is not None else "still running"
    return f"{self.name} {code} after {wall:.1f} s" + (f" ({self.note})" if self.note else "")


def _exit_code(returncode: int) -> int:
  return 128 - returncode if returncode < 0 else returncode    # a shell's code for a signal


def _log_dir(workdir: str, say) -> str:
  """`W/logs`; for a bucket workdir a local dir (the children's output is appended line by
  line), said once."""
  local = paths.local_side(workdir, "logs")
  if paths.is_remote(workdir):
    say(f"{workdir} is a bucket: the children's logs go to {local}")
  return local


class _Supervisor:
  """Watches the two children and applies the stopping rules of `supervise`."""

  def __init__(self, workdir: str, grace: float, say, save_grace: float | None = None):
    self.workdir = workdir
    self.done_path = workdir_lib.done_path(workdir)
    self.grace = grace
    # after SIGTERM: the seconds the trainer gets to save its step before SIGKILL
    self.save_grace = grace if save_grace is None else max(grace, save_grace)
    self.say = say
    self.signals: list[str] = []    # names of the signals received, appended by the handler
    self.children: dict[str, _Child] = {}

  def on_signal(self, signum, frame) -> None:
    del frame
    self.signals.append(signal.Signals(signum).name)

  def stop(self, children: list[_Child], why: str, sig: int = signal.SIGINT,
           signals_seen: int | None = None, grace: float | None = None) -> None:
    """`sig` to each running child's group, SIGKILL after `grace` (default: the grace
    period), or at once on a signal to us after the first `signals_seen` (default: those
    already received)."""
    running = [c for c in children if c.running]
    for c in running:
      c.note = why
      c.signal_group(sig)
    grace = self.grace if grace is None else grace
    deadline = time.monotonic() + grace
    if signals_seen is None:
      signals_seen = len(self.signals)
    while any(c.running for c in running) and time.monotonic() < deadline \
        and not self.pressed(sig, signals_seen):
      time.sleep(POLL_SECONDS)
    late = [c for c in running if c.running]
    if late:
      when = ("on a second signal" if self.pressed(sig, signals_seen)
              else f"after {grace:g} s")
      self.say(f"{' and '.join(c.name for c in late)} still running {when}; sending SIGKILL")
    for c in late:
      c.note = f"{why}; SIGKILL {when}"
      c.signal_group(signal.SIGKILL)
    while any(c.running for c in late):
      time.sleep(POLL_SECONDS / 10)

  def pressed(self, sig: int, signals_seen: int) -> bool:
    """Whether a signal to us after the first `signals_seen` calls for SIGKILL now: any, but
    a first SIGTERM while children stopped by SIGTERM save their step (what it asks of them)
    where none came before."""
    new = self.signals[signals_seen:]
    if sig == signal.SIGTERM and "SIGTERM" not in self.signals[:signals_seen]:
      new = new[1:] if new[:1] == ["SIGTERM"] else new
    return bool(new)

  def stop_other(self, other: _Child, why: str) -> None:
    """Stops the child that outlived the other: the trainer by SIGTERM, its preemption path,
    so that it saves its step within the save grace (SIGINT would lose every step since its
    last checkpoint); the builder by SIGINT."""
    if other.name == "trainer":
      self.stop([other], why, signal.SIGTERM, grace=self.save_grace)
    else:
      self.stop([other], why)

  def stop_on_signal(self) -> int:
    """Stops every child on the first signal received; returns the launcher's exit code."""
    # SIGTERM is a preemption: passed on, the trainer saves its step before exiting.
    sig = signal.SIGTERM if self.signals[0] == "SIGTERM" else signal.SIGINT
    grace = self.save_grace if sig == signal.SIGTERM else self.grace
    self.say(f"got {self.signals[0]}; stopping {' and '.join(self.children)} ({sig.name}, "
             f"then SIGKILL after {grace:g} s)")
    # counted from the first signal: a second one that came before this poll is one too
    self.stop(list(self.children.values()), f"stopped on {self.signals[0]}", sig,
              signals_seen=1, grace=grace)
    code = self.children["trainer"].returncode
    if sig == signal.SIGTERM and code == -signal.SIGKILL:
      return 128 + signal.SIGKILL   # not 143: the trainer did not save its step
    if sig == signal.SIGTERM and code == preemption.EXIT_UNSAVED:
      self.say("trainer did not save its step within its grace; a rerun resumes from its "
               "latest finalised checkpoint")
      return code                   # not 143 either
    if sig == signal.SIGTERM and code not in (0, 128 + signal.SIGTERM, -signal.SIGTERM):
      self.say(f"trainer failed while stopping: {describe(code)}")
      return _exit_code(code)       # not 143: no saved step to resume from
    return 128 + sig

  def watch_trainer(self) -> int:
    """The trainer alone (no builder): its exit code, or `stop_on_signal`'s."""
    trainer = self.children["trainer"]
    while not self.signals:
      code = trainer.poll()
      if code is not None:
        if code:
          self.say(f"trainer failed ({describe(code)})")
        return _exit_code(code)
      time.sleep(POLL_SECONDS)
    return self.stop_on_signal()

  def watch(self) -> int:
    """Polls until the run is decided; returns the launcher's exit code."""
    if "builder" not in self.children:
      return self.watch_trainer()
    trainer, builder = self.children["trainer"], self.children["builder"]
    trainer_done_at = None
    while True:
      if self.signals:
        return self.stop_on_signal()
      for child, other in ((trainer, builder), (builder, trainer)):
        code = child.poll()
        if code not in (None, 0) and child is builder and trainer.returncode == 0:
          self.say(f"builder failed ({describe(code)}) after the trainer finished; the run "
                   "succeeded (its summary is written; the builder's output is above)")
          return 0
        if code not in (None, 0):
          stopping = f"; stopping {other.name}" if other.running else ""
          self.say(f"{child.name} failed ({describe(code)}){stopping}"
                   + (" (SIGTERM: it saves its step)" if stopping and other is trainer else ""))
          self.stop_other(other, f"stopped after the {child.name} failed")
          return _exit_code(code)
      if trainer.returncode == 0:
        if builder.returncode is not None:
          return 0
        if trainer_done_at is None:
          trainer_done_at = time.monotonic()
          self.say(f"trainer finished; giving the builder {self.grace:g} s to see "
                   f"{workdir_lib.DONE} and exit")
        elif time.monotonic() - trainer_done_at >= self.grace:
          self.say(f"builder still running {self.grace:g} s after the trainer finished; "
                   "stopping it (the run succeeded)")
          self.stop([builder], "stopped after the trainer finished")
          return 0
      elif builder.returncode == 0 and not workdir_lib.is_done(self.workdir):
        self.say(f"builder exited 0 while the trainer still runs and {self.done_path} does not "
                 "exist (the trainer may wait forever for index versions); stopping trainer "
                 "(SIGTERM: it saves its step)")
        self.stop_other(trainer, "stopped after the builder quit early")
        return 1
      time.sleep(POLL_SECONDS)


def supervise(commands: dict[str, list[str]], workdir: str,
              env_for: dict[str, dict[str, str]] | None = None,
              grace: float = DEFAULT_GRACE, save_grace: float | None = None) -> int:
  """Runs the trainer and the builder (or the trainer alone: `commands` without "builder")
  until the run is decided, streaming their output.

  Rules: SIGINT to us -> both stopped, 130. SIGTERM -> passed on as SIGTERM, the trainer given
  `save_grace` seconds to save its step; 143, or the trainer's own code where it failed
  while stopping (137: SIGKILLed). A process failing -> the other stopped, its
  exit code (128 + N for signal N). The trainer exiting 0 -> the builder has `grace` seconds to
  exit on its own (it watches W/DONE), else is stopped; 0 (also when the builder then fails:
  the trainer's summary is complete). The builder exiting 0 while the
  trainer runs and W/DONE is absent -> the trainer is stopped; 1. "Stopped" is SIGINT to the
  process group, then SIGKILL after `grace` seconds.

  Args:
    commands: argv of "trainer" and of "builder" (of the trainer alone: as ended by its exit).
    workdir: the run directory; output is appended to `workdir/logs/<name>.log`.
    env_for: per name, variables set on top of our environment (CUDA_VISIBLE_DEVICES).
    grace: seconds between SIGINT and SIGKILL, and given to the builder after the trainer.
    save_grace: seconds between SIGTERM and SIGKILL (at least `grace`; default `grace`).
  Returns:
    The launcher's exit code.
  """
  if sorted(commands) not in (sorted(NAMES), ["trainer"]):
    raise ValueError(f"commands must name {NAMES} or the trainer, got {sorted(commands)}")
  out, lock, closed = sys.stdout, threading.Lock(), []

  def say(message: str, prefix: str = f"{PROG}: ") -> None:
    with lock:
      if closed:
        return
      try:
        _write_shown(out, prefix + message + "\n")
        out.flush()
      except (OSError, ValueError):   # our reader is gone (`| head`): the logs have it all
        closed.append(True)

  log_dir = _log_dir(workdir, say)
  os.makedirs(log_dir, exist_ok=True)
  supervisor = _Supervisor(workdir, grace, say, save_grace)
  handlers = {}
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):
      handlers[sig] = signal.signal(sig, supervisor.on_signal)
  supervisor.signals += _EARLY_SIGNALS    # come while the config was read: nothing starts
  _EARLY_SIGNALS.clear()
  if supervisor.signals:
    say(f"got {supervisor.signals[0]} before starting anything; nothing started")
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
    return 128 + signal.Signals[supervisor.signals[0]]
  if workdir_lib.is_done(workdir):   # an earlier run's: the new builder must not obey it
    workdir_lib.clear_done(workdir)
    say(f"removed {supervisor.done_path} left by an earlier run")
  code = 2
  try:
    if _start_children(supervisor, commands, env_for or {}, log_dir, say):
      code = supervisor.watch()
    return code
  finally:
    started = list(supervisor.children.values())
    supervisor.stop(started, f"stopped by {PROG}")   # nothing left running, whatever happened
    for child in started:
      child.close()
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
    if started:
      say(f"exit {code}: " + "; ".join(c.summary() for c in started))


def _write_shown(out, text: str) -> None:
  """`text` to `out`, a character its encoding lacks (a non-UTF-8 locale; U+FFFD for a
  child's byte that is not UTF-8) as the encoding's replacement, not a UnicodeEncodeError
  (which `say` would take for a reader gone)."""
  try:
    out.write(text)
  except UnicodeEncodeError:
    encoding = getattr(out, "encoding", None) or "ascii"
    out.write(text.encode(encoding, "replace").decode(encoding))


def _start_children(supervisor: _Supervisor, commands: dict[str, list[str]],
                    env_for: dict[str, dict[str, str]], log_dir: str, say) -> bool:
  """Starts the trainer and the builder, where there is one (each command said, with its
  log), in that order; False (said) when one cannot start."""
  for name in (n for n in NAMES if n in commands):
    extra = env_for.get(name, {})
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
    say(f"{name}: {shown + ' ' if shown else ''}{command_line(commands[name])}")
    say(f"{name}: log {os.path.join(log_dir, name + '.log')}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    try:
      supervisor.children[name] = _Child(name, commands[name], env,
                                         os.path.join(log_dir, f"{name}.log"), say)
      say(f"{name}: started, pid {supervisor.children[name].proc.pid}")
    except OSError as e:
      say(f"error: cannot start the {name}: {e}")
      return False
  return True


def _launch(args: argparse.Namespace) -> int:
  config = config_from_flags(PROG, args.config, args.overrides)   # as the children will read it
  validate(config)
  validate_training(config)
  commands = default_commands(args.config, args.workdir, args.overrides, args.verbosity)
  if uses_index_builder(config):
    env_for, said = _device_env(config.builder.devices)
  else:   # the trainer retrieves without index versions from a builder (or needs none)
    r = config.retrieval
    said = (f"{PROG}: the config does not use the separate index builder (task "
            f"{config.task!r}, retrieval.candidates {r.candidates!r}, retrieval.refresh "
            f"{r.refresh!r}): the trainer runs alone")
    commands, env_for = {"trainer": commands["trainer"]}, {}
  workdir_lib.check_data_dir(config)   # else both processes start, then fail on it
  # held until the children end: their own locks are taken only once they have started
  # (seconds later), and a second launcher meanwhile would find neither held
  with workdir_lib.JobLock(args.workdir, "launcher") as lock:
    lock.acquire()
    for job in workdir_lib.JOBS:         # W in use: its DONE is not ours to remove
      holder = workdir_lib.job_holding(args.workdir, job)
      if holder is not None:
        raise ConfigError("", f"{args.workdir} is in use: a {job} (pid {holder}) runs on it; "
                          "stop it first, or use another workdir")
    print(said, flush=True)   # after the refusals: a refused launch says its error alone
    # on SIGTERM the trainer saves within its own grace period: not SIGKILLed before it ends
    save_grace = config.train.preemption_grace_seconds + SAVE_MARGIN
    return supervise(commands, args.workdir, env_for, args.grace, save_grace)


def _device_env(builder_ids: str) -> tuple[dict[str, dict[str, str]], str]:
  """Each process's CUDA_VISIBLE_DEVICES (`assign_devices`; {} on CPU), and the line that
  says so (printed once every refusal has had its say)."""
  visible = visible_gpus(dict(os.environ))
  split = assign_devices(visible, builder_ids)
  if split is None:
    return {}, (f"{PROG}: no GPU visible: both processes run with this environment "
                f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}, "
                f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
  env_for = {"trainer": {"CUDA_VISIBLE_DEVICES": split[0]},
             "builder": {"CUDA_VISIBLE_DEVICES": split[1]}}
  # the same GPUs for both (builder.devices=shared): neither may take most of their memory
  memory = shared_memory_env(dict(os.environ)) if split[0] == split[1] else {}
  for env in env_for.values():
    env.update(memory)
  return env_for, (f"{PROG}: GPUs {','.join(visible)}: trainer {split[0]}, builder {split[1]} "
                   "(config.builder.devices)" +
                   "".join(f"; both with {k}={v}" for k, v in memory.items()))


def main(argv: list[str] | None = None) -> int:
  """`python launch/local.py --config C[:arg] --workdir W [--grace S] [--config.a.b=v ...]`."""
  previous = {}
  if threading.current_thread() is threading.main_thread():
    for sig in (signal.SIGINT, signal.SIGTERM):   # kept until supervise: nothing is lost
      previous[sig] = signal.signal(sig, _record_early_signal)
  try:
    args = parse_args(upgrade_flags(sys.argv[1:] if argv is None else argv, PROG))
    log.set_verbosity(args.verbosity)
    return run_cli(PROG, lambda: _launch(args))
  except Preempted:   # SIGTERM while the config was read and checked (`_record_early_signal`)
    print(f"{PROG}: got SIGTERM before starting anything; nothing started", flush=True)
    return preemption.EXIT_CODE
  finally:   # an in-process caller (a test) gets its own handlers back
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    _EARLY_SIGNALS.clear()


if __name__ == "__main__":
  sys.exit(main())

"""Child processes a driver runs (the demos' stages, a sweep's runs) and stops as asked.

Each child runs in a session of its own, so that the terminal's Ctrl-C reaches the driver
alone and every child gets exactly one signal, the driver's. On Ctrl-C or SIGTERM the driver
passes the signal on (`stop_processes`: SIGTERM makes a trainer save its step, so a rerun
resumes; Ctrl-C keeps its last checkpoint), gives them a grace period, signals those left a
second time (launch/local.py then SIGKILLs its trainer and builder) and SIGKILLs what is left
after that: nothing is left running unseen. SIGTERM surfaces as `Preempted` (exit 143),
Ctrl-C as KeyboardInterrupt. A driver killed outright (SIGKILL, the OOM killer) cannot pass
anything on: on Linux its children get SIGTERM from the kernel instead (`start_child`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import warnings

from realm_jax.runtime.preemption import EXIT_CODE

GRACE_SECONDS = 60.0   # from the first signal until the second (`stop_processes`)
STOP_MARGIN_SECONDS = 30.0  # a trainer stopped by SIGTERM gets its preemption grace + this
                            # (start-up of the save, launch/local.py's own stop): `stop_grace`
KILL_SECONDS = 5.0   # after a process's second signal, until SIGKILL (`stop_processes`)
SIGNAL_GAP_SECONDS = 0.5   # at least between a process's two signals: the OS merges a signal
                           # sent while the same one is still pending into it
_PR_SET_PDEATHSIG = 1      # prctl(2): the signal a process gets when its parent thread ends
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def start_child(command: list[str], death_signal: int = signal.SIGTERM,
                **popen) -> subprocess.Popen:
  """`subprocess.Popen(command, **popen)` for a driver's child: a session of its own (the
  terminal's Ctrl-C reaches the driver alone) and, on Linux, `death_signal` from the kernel
  when the driver dies, even by SIGKILL (SIGTERM, the default: a trainer saves its step on it;
  SIGKILL for a child with nothing to save). Start children from the thread that outlives them
  (the main thread): the signal comes when that thread ends, and the warnings filters are the
  process's. JAX warns at every fork once it has a backend ("os.fork() was called ... will
  likely lead to a deadlock"); here the child runs only `_die_with` (no lock, no import)
  before it execs, so the warning is silenced for this one call."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                            category=RuntimeWarning, module="subprocess")
    return subprocess.Popen(command, **popen, start_new_session=True,
                            preexec_fn=functools.partial(_die_with, os.getpid(), death_signal))


def _die_with(parent: int, death_signal: int) -> None:
  """Runs in the child between fork and exec."""
  if _LIBC is not None:
    _LIBC.prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0, 0)
  if os.getppid() != parent:   # the driver died before the prctl: nobody will send it
    os.kill(os.getpid(), death_signal)


class Preempted(SystemExit):
  """SIGTERM reached the driver: the running children saved their step (`saved`; else `why`
  names those that did not; None: no child was running, as between two stages); a rerun
  resumes."""

  def __init__(self, why: str, saved: bool | None = True):
    super().__init__(EXIT_CODE)
    self.why, self.saved = why, saved


def on_sigterm(signum, frame) -> None:
  """A driver's SIGTERM handler (outside an in-process stage, which saves its own step): stop
  here, and the driver passes SIGTERM on to its children. One-shot: a second SIGTERM must not
  cut short the stopping of the children."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  raise Preempted("SIGTERM", saved=None)   # `stop_after` says whether children saved theirs


def stop_signal(error: BaseException) -> int:
  """The signal a child gets when the driver stops on `error`: SIGINT for Ctrl-C (the child
  stops as on Ctrl-C), SIGTERM otherwise (its trainer saves its step first)."""
  return signal.SIGINT if isinstance(error, KeyboardInterrupt) else signal.SIGTERM


def shared_memory_env(environ: dict[str, str]) -> dict[str, str]:
  """The variables that let processes share an accelerator (a demo's stages, trainer and
  builder on one GPU): each allocates device memory as it needs, where JAX's default takes 75%
  of the device at start-up, unless `environ` already says how much each may take."""
  if any(k in environ for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                "XLA_PYTHON_CLIENT_ALLOCATOR")):
    return {}
  return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@contextlib.contextmanager
def signals_deferred():
  """Holds Ctrl-C and SIGTERM until the block ends, then delivers the first as usual (start a
  child inside, so that it is recorded before a signal can stop the driver). The handlers are
  Python's, so a process started inside inherits nothing of it (as it would a blocked signal
  mask); an ignored signal stays ignored."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  caught, previous = [], {}
  try:
    for sig in (signal.SIGINT, signal.SIGTERM):
      if signal.getsignal(sig) is not signal.SIG_IGN:
        previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    yield
  finally:
    _set_handlers(previous)
    if caught:
      signal.raise_signal(caught[0])


def _set_handlers(handlers: dict, drop: tuple = ()) -> dict:
  """Sets every signal's handler even if a pending one runs and raises as it is changed (Python
  runs pending handlers first); returns the handlers replaced, then raises the first such
  error unless it is one of `drop`."""
  replaced, error = {}, None
  for sig, handler in handlers.items():
    while sig not in replaced:
      try:
        replaced[sig] = signal.signal(sig, signal.SIG_DFL if handler is None else handler)
      except BaseException as e:   # the pending handler ran and raised; it is not pending now
        error = error or e
  if error is not None and not isinstance(error, drop):
    raise error
  return replaced


def stop_processes(processes: list, grace_seconds: float = GRACE_SECONDS,
                   sig: int = signal.SIGTERM) -> list:
  """Stops the children still running when the driver stops (one failed, SIGTERM, Ctrl-C):
  `sig` to each at once (SIGTERM: its trainer saves its step, so a rerun resumes, and the
  driver ignores another SIGTERM meanwhile; SIGINT for Ctrl-C, which the terminal sent the
  driver alone), then, to those still running `grace_seconds` later or at once if the driver
  is interrupted again, `sig` a second time, which makes launch/local.py SIGKILL its trainer
  and builder (in sessions of their own, out of the driver's reach) and exit, and SIGKILL
  `KILL_SECONDS` after that (none is left behind to run on; further interrupts wait until
  then). `processes` may hold None (a child that had already finished). Returns the processes
  that did not end as asked: signalled twice, or exiting with another code than 0 or the
  signal's."""
  running = [p for p in processes if p is not None and p.poll() is None]
  sent = time.monotonic()
  try:
    for process in running:
      process.send_signal(sig)
    with _sigterm_ignored(sig == signal.SIGTERM):
      _wait_all(running, grace_seconds)
  finally:
    late = _end_processes(running, sig, sent)
  # a child's own ending: 0 (it had just finished), 128 + sig (local.py; realm-train's 143
  # after saving on SIGTERM), -SIGINT (realm-train ends by SIGINT on Ctrl-C)
  done = (0, 128 + sig, -signal.SIGINT) if sig == signal.SIGINT else (0, 128 + sig)
  return late + [p for p in running if p not in late and p.returncode not in done]


def _end_processes(running: list, sig: int, sent: float) -> list:
  """`sig` a second time to the children still running (at least `SIGNAL_GAP_SECONDS` after
  the first), SIGKILL to those left `KILL_SECONDS` later; Ctrl-C and SIGTERM are ignored
  meanwhile, since a SIGKILL to launch/local.py before it has ended its trainer and builder
  would leave them running. Returns the children it signalled."""
  late = [p for p in running if p.poll() is None]
  if not late:
    return late
  held = _ignore_interrupts()
  try:
    time.sleep(max(0.0, sent + SIGNAL_GAP_SECONDS - time.monotonic()))
    for process in late:
      process.send_signal(sig)
    _wait_all(late, KILL_SECONDS)
  finally:
    for process in late:
      if process.poll() is None:
        process.kill()
    for process in late:
      process.wait()
    _set_handlers(held)
  return late


def _ignore_interrupts() -> dict:
  """Ignores SIGINT and SIGTERM (in the main thread); the handlers to set back. An interrupt
  pending as this starts runs its handler, whose error is dropped: the stop is under way."""
  if threading.current_thread() is not threading.main_thread():
    return {}
  return _set_handlers(dict.fromkeys((signal.SIGINT, signal.SIGTERM), signal.SIG_IGN),
                       drop=(KeyboardInterrupt, Preempted))


@contextlib.contextmanager
def _sigterm_ignored(ignored: bool):
  """The driver ignores SIGTERM in the block if `ignored` (in the main thread)."""
  if not ignored or threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
  try:
    yield
  finally:
    _set_handlers({signal.SIGTERM: previous})


def _wait_all(processes: list, seconds: float) -> None:
  """Waits until every process exited or `seconds` passed."""
  deadline = time.monotonic() + seconds
  for process in processes:
    try:
      process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      pass


def stop_grace(preemption_grace_seconds: float) -> float:
  """How long a driver waits for a trainer it sent SIGTERM before the second signal: its
  `train.preemption_grace_seconds` + STOP_MARGIN_SECONDS, at least GRACE_SECONDS."""
  return max(float(preemption_grace_seconds) + STOP_MARGIN_SECONDS, GRACE_SECONDS)


def stop_after(error: BaseException, children: dict, grace_seconds: float = GRACE_SECONDS
               ) -> BaseException:
  """Stops the `children` ({name: process or None}) after `error` stopped the driver (a
  child failed, SIGTERM, Ctrl-C) with the signal it calls for (`stop_processes`), and returns
  the error the driver goes on with: `error` itself; `Preempted` with saved=False naming the
  children that did not end as asked, after SIGTERM; KeyboardInterrupt if an interrupt came
  while they stopped (they were ended at once and none saved its step on purpose), unless
  `error` was a failure, which says more."""
  try:
    forced = stop_processes(list(children.values()), grace_seconds=grace_seconds,
                            sig=stop_signal(error))
  except (KeyboardInterrupt, Preempted):
    return KeyboardInterrupt() if isinstance(error, (KeyboardInterrupt, Preempted)) else error
  unsaved = [name for name, process in children.items() if process in forced]
  if isinstance(error, Preempted) and unsaved:
    return Preempted(f"{error.why}; {' and '.join(unsaved)} did not end as asked (still "
                     f"running {grace_seconds:g} s after the signal, or failing as it saved)",
                     saved=False)
  if isinstance(error, Preempted) and error.saved is None and \
      any(process is not None for process in children.values()):
    return Preempted(error.why)   # the children ran, and each saved its step
  return error


def run_to_end(name: str, command: list[str], out=None,
               grace_seconds: float = GRACE_SECONDS) -> int:
  """Runs `command` (a sweep's run, say) to its end in a process and session of its own, its
  output to the file `out` (else here), and returns its exit code. Ctrl-C or SIGTERM to this
  process stops it (`stop_after`), then goes on as KeyboardInterrupt or `Preempted` naming
  `name` and whether it saved its step."""
  process = None
  try:
    with signals_deferred():   # the process is recorded before a signal can stop us
      process = start_child(command, stdout=out, stderr=subprocess.STDOUT if out else None)
    return process.wait()
  except BaseException as e:
    if process is None:
      raise
    error = stop_after(e, {name: process}, grace_seconds)
    if isinstance(error, Preempted) and error.saved:
      error = Preempted(f"{error.why}; {name} stopped at a saved checkpoint", saved=True)
    if error is e:
      raise
    raise error from None

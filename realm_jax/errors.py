"""Start-up errors that name the offending option, and the CLI wrapper that reports them."""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import signal
import sys
import threading
from typing import Callable


class ConfigError(ValueError):
  """A bad option value, found before any JAX work; the CLI prints it and exits with code 2."""

  def __init__(self, option: str, message: str):
    self.option, self.message = option, message
    super().__init__(f"config.{option}: {message}" if option else message)


class DataError(ValueError):
  """Input data that cannot be used as given; the message names the file and line."""


class CheckpointError(RuntimeError):
  """A run's checkpoints cannot be used (each one tried is named); the CLI exits with code 1."""


class NonFiniteError(RuntimeError):
  """A training step's loss or gradient is not finite (`train.nonfinite=stop`); the message
  names the step, the values and the last checkpoint. The CLI exits with code 1."""


class WorkerDied(RuntimeError):
  """A worker process of the job died (the OOM killer, say); the message names its work and
  how to resume. The CLI exits with code 1."""


class IndexNeverPublished(RuntimeError):
  """The trainer waits for an index version (deterministic refresh) that the builder will never
  publish; the message names the step and the options. The CLI exits with code 1."""


class IndexWaitTimeout(TimeoutError):
  """No usable index version came within `retrieval.index_timeout`; the message names the wait,
  the index dir, the option and any rejected versions. The CLI exits with code 1."""


class StorageUnreachable(ConnectionError):
  """The storage server (a gs:// bucket) did not answer for longer than the patience
  ($REALM_JAX_STORAGE_PATIENCE); the message names the path and the operation. Exit code 1."""


REQUIRED = "the following arguments are required"   # argparse's message of missing flags


class CommandParser(argparse.ArgumentParser):
  """argparse for the project's own commands: a bad flag is the one line `PROG: error: ...`
  (exit code 2, no usage block above it, as the absl commands print theirs), and a misspelt
  `--flag` is named with the closest flag the command has, also where it misspells a required
  flag (argparse would say only that the required one is missing)."""

  def parse_known_args(self, args=None, namespace=None):
    self._given = list(sys.argv[1:] if args is None else args)
    return super().parse_known_args(args, namespace)

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {self.one_line(message)}\n")

  def one_line(self, message: str) -> str:
    """argparse's error `message` as the command says it (a caller that reports the error
    its own way, as sweep.py does tpu_pod.py's, says the same)."""
    strays = self._unknown_flags() if message.startswith(REQUIRED) else []
    if strays:
      message = f"unrecognized arguments: {' '.join(strays)}"
    return message + self._suggestion(message)

  def _flags(self) -> list[str]:
    return [s for action in self._actions for s in action.option_strings if s[:2] == "--"]

  def _unknown_flags(self) -> list[str]:
    """The `--flags` given (before a `--`) that name none of the command's."""
    flags, unknown = self._flags(), []
    for arg in getattr(self, "_given", []):
      if arg == "--":
        break
      name = arg.split("=")[0]
      if name[:2] == "--" and name not in flags and not (
          self.allow_abbrev and any(f.startswith(name) for f in flags)):
        unknown.append(name)
    return unknown

  def _suggestion(self, message: str) -> str:
    """'; did you mean --FLAG?' for the first unrecognized `--flag` close to one."""
    unknown = message.removeprefix("unrecognized arguments: ")
    for arg in (unknown.split() if unknown != message else []):
      close = closest(arg.split("=")[0], self._flags(), cutoff=0.6)
      if arg[:2] == "--" and close:
        return f"; did you mean {close}?"
    return ""


def closest(name: str, known, cutoff: float) -> str | None:
  """The one of `known` closest to a misspelt `name` (difflib's ratio >= `cutoff`), or None:
  what every "did you mean" of the project names (a flag, a config option, a field)."""
  close = difflib.get_close_matches(name, list(known), n=1, cutoff=cutoff)
  return close[0] if close else None


# The project's own errors, whose message says what went wrong and what to do: `run_cli`
# prints each in one line, and a worker thread (the batch feed) hands them on as they are. An
# OS error from anywhere (a FileNotFoundError, a broken pipe) stays wrapped there, with its
# traceback: it says neither which batch nor what to do.
SELF_EXPLAINING = (ConfigError, DataError, CheckpointError, NonFiniteError, WorkerDied,
                   IndexNeverPublished, IndexWaitTimeout, StorageUnreachable)


_INTERRUPTS: list[int] = []   # Ctrl-Cs this process received (the handler `run_cli` installs)


_UNRAISED = threading.Event()   # a Ctrl-C recorded, not raised yet (`run_cli` checks at the end)


def _on_sigint(signum, frame) -> None:
  """Records the Ctrl-C and raises it, unless it landed where raising would lose it or break
  an import (`in_gc_callback`, `in_import`): there it waits for the next
  `raise_if_interrupted` (after a job's imports, between steps, in waits; `run_cli` at the
  job's end at the latest). A second Ctrl-C inside an import raises (one that hangs still
  stops); inside a gc callback raising would only lose it."""
  _INTERRUPTS.append(signum)
  if held_back(frame, len(_INTERRUPTS)):
    _UNRAISED.set()
    return
  _UNRAISED.clear()
  raise KeyboardInterrupt


def held_back(frame, count: int) -> bool:
  """Whether the `count`-th Ctrl-C, landing in `frame`, is recorded rather than raised: inside
  a gc callback always, inside an import the first one only."""
  return in_gc_callback(frame) or (in_import(frame) and count == 1)


def in_gc_callback(frame) -> bool:
  """Whether `frame` runs inside JAX's garbage collector callback, where Python ignores an
  exception, printing a traceback ("Exception ignored in: _xla_gc_callback")."""
  return any(f.f_code.co_name == "_xla_gc_callback" for f in _frames(frame))


def in_import(frame) -> bool:
  """Whether `frame` runs inside an import, where a KeyboardInterrupt can break a C
  extension's initialisation ("ImportError: numpy._core.multiarray failed to import", a
  60-line traceback and exit code 1)."""
  return any(f.f_code.co_filename.startswith("<frozen importlib") for f in _frames(frame))


def _frames(frame):
  while frame is not None:
    yield frame
    frame = frame.f_back


def take_interrupts():
  """The `_on_sigint` handler, where Python's own is in place on the main thread (a `python -m`
  entry module's first line, so that a Ctrl-C during its imports is one line too; `run_cli`);
  returns the handler it replaced, or None."""
  if threading.current_thread() is threading.main_thread() and \
      signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    return signal.signal(signal.SIGINT, _on_sigint)
  return None


def raise_if_interrupted() -> None:
  """KeyboardInterrupt again for a recorded Ctrl-C that was not raised or whose own was
  swallowed (`_on_sigint`). Called on the main thread where a run can stop: after
  the imports of a job, between training steps, in a wait for an index, while a demo watches
  its stages, between index builds."""
  if _INTERRUPTS and threading.current_thread() is threading.main_thread():
    _UNRAISED.clear()
    raise KeyboardInterrupt


def run_cli(prog: str, main: Callable[[], object]) -> object:
  """Runs `main`; ConfigError / missing files -> one clear line on stderr and exit code 2; an
  unreachable coordinator and the project's other errors (SELF_EXPLAINING) -> one line and
  exit code 1; Ctrl-C -> one line instead of a
  traceback, and the process ends by SIGINT at once, as Python would after its traceback (a
  shell stops its script there), without the interpreter's shutdown, which XLA threads cut
  short mid-compile can crash. What was finalised before it (a checkpoint, a published
  version) stays. A Ctrl-C is also recorded (`raise_if_interrupted`), where Python's own
  handler is in place."""
  previous = take_interrupts()
  try:
    return _run(prog, main)
  finally:   # an in-process caller (a test) gets Python's handler back
    if previous is not None:
      signal.signal(signal.SIGINT, previous)


def _run(prog: str, main: Callable[[], object]) -> object:
  """`run_cli`'s body: `main()`, its errors as one line each."""
  try:
    raise_if_interrupted()   # a Ctrl-C recorded during the imports (take_interrupts)
    result = main()
    if _UNRAISED.is_set():   # recorded where it could not be raised, and polled for by none
      raise KeyboardInterrupt
    return result
  except KeyboardInterrupt:
    print(f"\n{prog}: interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    raise                           # (where a signal does not end the process at once)
  except ConfigError as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  except (FileNotFoundError, DataError) as e:
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  except (ConnectionError, *SELF_EXPLAINING) as e:   # no coordinator, no index, ...
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(1) from None
  except OSError as e:
    if not unusable_path(e):
      raise                         # anything else keeps its traceback
    print(f"{prog}: error: {path_error(e)}", file=sys.stderr)
    raise SystemExit(1 if e.errno in FULL else 2) from None


# Path errors a user gives (a workdir that is a file, a read-only or full disk): one line.
UNUSABLE_PATH = (errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR, errno.EISDIR,
                 errno.EROFS, errno.ENOSPC, errno.EDQUOT)
FULL = (errno.ENOSPC, errno.EDQUOT)


def unusable_path(e: OSError) -> bool:
  return e.errno in UNUSABLE_PATH and (e.filename is not None or e.errno in FULL)


def path_error(e: OSError) -> str:
  """`PATH: what is wrong` for an OSError of UNUSABLE_PATH (both paths of a rename; a full
  disk written through an open file names none)."""
  if e.filename is None:
    return f"{e.strerror}: free space (or quota) where the run writes, then run it again"
  exists_as_dir = e.errno == errno.EEXIST and os.path.isdir(e.filename)
  what = {errno.EEXIST: "exists" + ("" if exists_as_dir else " and is not a directory"),
          errno.ENOTDIR: "a part of this path is a file, not a directory",
          errno.EISDIR: "is a directory, not a file"}.get(e.errno, e.strerror)
  target = f" -> {e.filename2}" if e.filename2 is not None else ""
  return f"{e.filename}{target}: {what}"

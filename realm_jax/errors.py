"""Start-up errors that name the offending option, and the CLI wrapper that reports them."""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Callable


class ConfigError(ValueError):
  """A bad option value, found before any JAX work; the CLI prints it and exits with code 2."""

  def __init__(self, option: str, message: str):
    self.option = option
    super().__init__(f"config.{option}: {message}" if option else message)


class DataError(ValueError):
  """Input data that cannot be used as given; the message names the file and line."""


class CheckpointError(RuntimeError):
  """A run's checkpoints cannot be used (each one tried is named); the CLI exits with code 1."""


class NonFiniteError(RuntimeError):
  """A training step's loss or gradient is not finite (`train.nonfinite=stop`); the message
  names the step, the values and the last checkpoint. The CLI exits with code 1."""


class StorageUnreachable(ConnectionError):
  """The storage server (a gs:// bucket) did not answer for longer than the patience
  ($REALM_JAX_STORAGE_PATIENCE); the message names the path and the operation. Exit code 1."""


def run_cli(prog: str, main: Callable[[], object]) -> object:
  """Runs `main`; ConfigError / missing files -> one clear line on stderr and exit code 2; an
  unreachable coordinator -> one line and exit code 1; Ctrl-C -> one line instead of a
  traceback, and the process ends by SIGINT at once, as Python would after its traceback (a
  shell stops its script there), without the interpreter's shutdown, which XLA threads cut
  short mid-compile can crash. What was finalised before it (a checkpoint, a published
  version) stays."""
  try:
    return main()
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
  except (ConnectionError, CheckpointError, NonFiniteError) as e:   # e.g. no coordinator
    print(f"{prog}: error: {e}", file=sys.stderr)
    raise SystemExit(1) from None


def flags_parser(prog: str) -> Callable[[list[str]], list[str]]:
  """absl `app.run(main, flags_parser=flags_parser(prog))`: the command line parsed, and the
  config file of a `--config` flag loaded; a misspelt option, a bad value, a config file that
  is missing or whose get_config fails -> one line naming it on stderr and exit code 2."""
  def parse(argv: list[str]) -> list[str]:
    from absl import flags
    try:
      rest = flags.FLAGS(argv)
      if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
        flags.FLAGS["config"].value.keys()   # a file that failed to load raises only here
      return rest
    except Exception as e:   # noqa: BLE001 -- whatever parsing raises is a usage error
      print(f"{prog}: error: {flag_error(e, argv)}", file=sys.stderr)
      raise SystemExit(2) from None
  return parse


def flag_error(error: Exception, argv: list[str]) -> str:
  """One line for what parsing `argv` raised: the option or file it names, and the cause."""
  root = error
  while (root.__cause__ or root.__context__) is not None:
    root = root.__cause__ or root.__context__
  if isinstance(root, (KeyError, AttributeError)):   # a misspelt --config.* key
    wrong = str(root.args[0]).strip("'") if root.args else ""
    option = next((a.split("=")[0] for a in argv[1:] if re.match(
        r"^--?(no)?config\.(.*\.)?" + re.escape(wrong) + r"(\.|=|$)", a)), f"config.*.{wrong}")
    suggestion = re.search(r'Did you mean "([^"]+)"', str(error))
    return f"{option}: no such option" + (f"; did you mean {suggestion.group(1)!r}?"
                                          if suggestion else "")
  config_file = _config_file(argv)
  if config_file is not None and "config file" in str(error):
    path = config_file.partition(":")[0]
    if not os.path.exists(path):
      return f"--config {config_file}: no such file"
    return f"--config {config_file}: {_first_line(root)}"
  return _first_line(error)


def _config_file(argv: list[str]) -> str | None:
  """The value of --config in `argv`, or None."""
  for i, arg in enumerate(argv):
    if arg in ("--config", "-config") and i + 1 < len(argv):
      return argv[i + 1]
    if arg.startswith(("--config=", "-config=")):
      return arg.partition("=")[2]
  return None


def _first_line(error: BaseException) -> str:
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0]


def config_from_flags(prog: str, config_spec: str, overrides: list[str]):
  """The config that `--config config_spec` with the `--config.*` override tokens gives a CLI
  (the same ml_collections parser): a launcher checks what it will hand its children before it
  starts them. A bad option, value or file -> one line naming it and exit code 2."""
  from absl import flags
  from ml_collections import config_flags
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True)
  argv = [prog, "--config", config_spec, *overrides]
  saved, sys.argv = sys.argv, argv     # ml_collections reads the overrides from sys.argv
  try:
    flag_values(argv)
    flag_values["config"].value.keys()
    return flag_values["config"].value
  except Exception as e:   # noqa: BLE001 -- whatever parsing raises is a usage error
    print(f"{prog}: error: {flag_error(e, argv)}", file=sys.stderr)
    raise SystemExit(2) from None
  finally:
    sys.argv = saved

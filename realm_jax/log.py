"""The project's log. Library modules log through Python `logging` (`logging.getLogger(__name__)`,
under the `realm_jax` logger); what reaches the console is the message alone, on stdout, so
progress lines and result tables read as they always have (on stderr in a command whose stdout
is its result, as realm-predict's: `to_stderr`). A CLI sets the level from its
verbosity flag (`set_verbosity`): absl's convention, 1 = debug, 0 = info (the default),
-1 = warnings, -2 = errors only.
"""

from __future__ import annotations

import logging
import sys

ROOT = "realm_jax"
LEVELS = {1: logging.DEBUG, 0: logging.INFO, -1: logging.WARNING, -2: logging.ERROR}


class _ConsoleHandler(logging.Handler):
  """Each record's message on the current sys.stdout (looked up at every line, so a test's
  captured stdout and a CLI's redirected one both see it), or sys.stderr after `to_stderr`,
  flushed."""

  stderr = False

  def emit(self, record: logging.LogRecord) -> None:
    try:
      stream = sys.stderr if self.stderr else sys.stdout
      stream.write(self.format(record) + "\n")
      stream.flush()
    except Exception:   # noqa: BLE001 -- logging's own convention
      self.handleError(record)


def install() -> logging.Logger:
  """The `realm_jax` logger with the console handler, once (the package does it on import)."""
  logger = logging.getLogger(ROOT)
  if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
    logger.addHandler(_ConsoleHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False       # not through absl's handler on the root logger
  return logger


def to_stderr() -> None:
  """The log on stderr from now on: for a command whose stdout is its result alone
  (realm-predict's answers, `--json` lines a pipe reads)."""
  for handler in install().handlers:
    if isinstance(handler, _ConsoleHandler):
      handler.stderr = True


def set_verbosity(verbosity: int) -> None:
  """1 debug, 0 info, -1 warnings, -2 errors (clamped); the libraries' own absl logging
  (Orbax, TFDS) shows warnings only, its INFO lines too at 1, its errors alone at -2."""
  from absl import logging as absl_logging
  install().setLevel(LEVELS[max(-2, min(1, int(verbosity)))])
  absl_logging.set_verbosity(absl_logging.INFO if verbosity >= 1 else absl_logging.ERROR
                             if verbosity <= -2 else absl_logging.WARNING)


def follow_verbosity(library: str) -> None:
  """A library's own Python logger shows what this project's verbosity does for libraries:
  warnings, its debug and INFO lines too at 1, its errors alone at -2 (for a library that
  sets its logger to DEBUG when imported, as bm25s does: call this after the import)."""
  level = verbosity()
  logging.getLogger(library).setLevel(logging.DEBUG if level >= 1 else logging.ERROR
                                      if level <= -2 else logging.WARNING)


def verbosity() -> int:
  """The verbosity now set (what a driver hands the processes it starts)."""
  level = install().level
  return next((v for v, at in LEVELS.items() if at == level), 0)


def handed_on() -> list[str]:
  """The flag that hands the verbosity now set to a process a driver starts (a demo's stage,
  a sweep's run; local.py hands it to both of its processes): none at the default."""
  level = verbosity()
  return [f"--verbosity={level}"] if level else []


def use_absl_verbosity() -> int:
  """An absl CLI (realm-train, realm-index, ...): the verbosity of its `-v/--verbosity` (0 when
  not given), set; returns it."""
  from absl import flags
  flag = flags.FLAGS["verbosity"]
  given = int(flag.value) if flag.present else 0
  set_verbosity(given)
  return given


def add_verbosity_argument(parser) -> None:
  """`-v/--verbosity N` on an argparse CLI (read it with `set_verbosity(args.verbosity)`)."""
  parser.add_argument("-v", "--verbosity", type=int, default=0,
                      help="1: debug lines too; 0: progress and results (default); -1: warnings "
                      "and errors only; -2: errors only")


# -- progress lines ----------------------------------------------------------------------------
def format_duration(seconds: float) -> str:
  """`seconds` as 42s, 12m05s or, from an hour on, 3h07m (an ETA, a stage's time)."""
  seconds = int(max(seconds, 0))
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def format_rate(per_second: float, unit: str = "steps/s", per_one: str = "s/step",
                digits: int = 2) -> str:
  """`per_second` as `0.47 steps/s` (`digits` decimals); one that would read 0 there (a step of
  minutes) as the seconds each takes: `250 s/step`."""
  if 0 < per_second < 0.5 * 10 ** -digits:
    return f"{1 / per_second:,.0f} {per_one}"
  return f"{per_second:,.{digits}f} {unit}"

"""realm_jax/log.py: library modules log through Python logging; the console shows the message
alone at the level a CLI's verbosity flag sets."""

import logging
import subprocess
import sys

from realm_jax import log
from tests.helpers import REPO


def test_the_console_shows_the_message_alone_at_the_level_set(capsys):
  logger = logging.getLogger("realm_jax.some.module")
  try:
    logger.info("[realm] step 1/2 loss 3.5")
    logger.debug("hidden at the default level")
    log.set_verbosity(-1)
    logger.info("hidden at -1")
    logger.warning("[realm] index v3 rejected, not used: a reason")
    log.set_verbosity(1)
    logger.debug("shown at 1")
    log.set_verbosity(-5)     # clamped to errors only
    logger.warning("hidden at -2")
    logger.error("an error")
  finally:
    log.set_verbosity(0)
  assert capsys.readouterr().out.splitlines() == [
      "[realm] step 1/2 loss 3.5", "[realm] index v3 rejected, not used: a reason",
      "shown at 1", "an error"]


def test_a_cli_takes_its_verbosity_flag(tmp_path):
  """absl CLIs read -v/--verbosity (realm-prepare here: its progress lines go at -1)."""
  for verbosity, shown in ((0, True), (-1, False)):
    args = ["-c", "from realm_jax.data.prepare import main; main()", "--config",
            "configs/prepare.py:world", "--config.source=world:40",
            f"--config.out_dir={tmp_path / str(verbosity)}", f"--verbosity={verbosity}"]
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("[prepare]" in result.stdout) == shown, (verbosity, result.stdout[-2000:],
                                                     result.stderr[-2000:])


def test_a_demo_hands_its_verbosity_to_the_stages_it_starts():
  """`make demo`'s -v reaches the stage processes it starts (launch/local.py hands it on to
  the trainer and the builder), and at 1 the libraries' absl INFO lines show too."""
  from absl import logging as absl_logging
  from realm_jax import stages
  from tests.helpers import tiny_config
  config = tiny_config("realm")
  try:
    for verbosity, flag in ((0, []), (1, ["--verbosity=1"]), (-1, ["--verbosity=-1"])):
      log.set_verbosity(verbosity)
      assert log.verbosity() == verbosity
      command = stages.stage_command(("demo_realm", None), {"train.steps": 2}, "W", config)
      assert [a for a in command if a.startswith("--verbosity")] == flag, command
      assert absl_logging.get_verbosity() == (absl_logging.INFO if verbosity >= 1
                                              else absl_logging.WARNING)
  finally:
    log.set_verbosity(0)


def test_errors_only_hides_the_libraries_warnings_too():
  """-2 is errors only: the libraries' own warnings (Orbax's through absl, a Python library's
  logger) are hidden there as the project's are (before: they still showed at -2)."""
  from absl import logging as absl_logging
  try:
    for verbosity, absl_level, library_level in (
        (0, absl_logging.WARNING, logging.WARNING), (-1, absl_logging.WARNING, logging.WARNING),
        (-2, absl_logging.ERROR, logging.ERROR), (-7, absl_logging.ERROR, logging.ERROR)):
      log.set_verbosity(verbosity)
      log.follow_verbosity("some_library")
      assert absl_logging.get_verbosity() == absl_level, verbosity
      assert logging.getLogger("some_library").level == library_level, verbosity
  finally:
    log.set_verbosity(0)

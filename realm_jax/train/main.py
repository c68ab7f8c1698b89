"""`realm-train --config configs/X.py[:arg] --workdir W [--config.a.b=v ...]`.

On a pod every process runs the same command; see `realm_jax.runtime.multihost` for the
--multihost switch (auto on TPU slices) and the explicit --coordinator_address /
--num_processes / --process_id of GPU clusters and CPU tests."""

from __future__ import annotations

from realm_jax import errors as _errors
if __name__ == "__main__":   # python -m (launch/local.py's children): a Ctrl-C in the imports
  _errors.take_interrupts()  # below is recorded, then one line (run_cli), not a traceback

import sys

from absl import app, flags
from ml_collections import config_flags

from realm_jax import log
from realm_jax.errors import raise_if_interrupted, run_cli
from realm_jax.config.overrides import flags_parser, refuse_arguments
from realm_jax.runtime import multihost, preemption
from realm_jax.config.option_names import upgrade_flags



def main(argv) -> None:
  refuse_arguments("realm-train", argv)
  config, workdir = flags.FLAGS.config, flags.FLAGS.workdir
  if config is None or not workdir:
    print("realm-train: error: --config and --workdir are required", file=sys.stderr)
    raise SystemExit(2)
  log.use_absl_verbosity()   # -v N; Orbax's and TFDS's INFO lines off the console

  def job():
    multihost.initialize_from_flags()
    from realm_jax.train.loop import train  # jax is imported only once flags are good
    raise_if_interrupted()   # a Ctrl-C recorded in those imports
    return train(config, workdir)
  summary = run_cli("realm-train", job)
  if "preempted_at_step" in summary:
    print(f"realm-train: preempted after step {summary['preempted_at_step']} (checkpoint "
          "saved); rerun the same command to resume", flush=True)
    raise SystemExit(preemption.EXIT_CODE)
  shown = {k: v for k, v in summary.items() if k != "examples"}
  print(f"realm-train: done {shown}")


def run() -> None:
  # flagfiles read and old option names upgraded before the config flag is defined (it reads
  # sys.argv then): an unreadable --flagfile is one line, not a traceback
  sys.argv = upgrade_flags(sys.argv, "realm-train")
  config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, summary).")
  app.run(main, flags_parser=flags_parser("realm-train", __name__))


if __name__ == "__main__":
  run()

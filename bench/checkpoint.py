"""What a checkpoint save costs a run: the blocking part of an async save (what the training
step that saves waits for) and the whole save, with Orbax's replica-parallel writes (its
default off GPUs) and with each array written whole by its first replica (what `Checkpointer`
does in a one-process run, runtime/checkpoints.py).

The train state (params and Adam moments) of `--config` (default the demo REALM stage's
model) is created once on `--devices` host CPU devices, data-parallel as the demo's, and saved
`--saves` times per mode into a temporary directory, in that process; the first save of each
mode is reported apart (it traces and compiles what the mode runs per array), the others as
medians.

  python bench/checkpoint.py [--devices 8] [--saves 6] [--config configs/demo_realm.py:realm]
      [--out runs/bench_checkpoint.jsonl]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from report import append_jsonl, host_cpu, host_cpu_text, print_rows   # bench/: sys.path[0]

from realm_jax.errors import CommandParser

PROG = "bench/checkpoint.py"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = "configs/demo_realm.py:realm"
VOCAB_SIZE = 1024   # the demo world's vocab is ~900 entries; the size barely matters here


def parse_args(argv=None):
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", type=int, default=8, help="host CPU devices (XLA_FLAGS)")
  parser.add_argument("--saves", type=int, default=6, help="saves per mode (>= 2)")
  parser.add_argument("--config", default=DEFAULT_CONFIG, help="config file[:arg]")
  parser.add_argument("--out", default="", help="append the figures as a JSON line here")
  args = parser.parse_args(argv)
  if args.saves < 2 or args.devices < 1:
    parser.error("--saves must be >= 2 and --devices >= 1")
  path = args.config.partition(":")[0]
  if not os.path.isfile(path) and not os.path.isfile(os.path.join(REPO, path)):
    parser.error(f"--config {args.config}: no such file {path}")
  return args


def read_config(spec: str):
  """`--config`'s config, its path relative to the working dir or else the repository. What
  the file raises (an unknown variant, ...) is a usage error, as the launchers take it: one
  line and exit code 2."""
  from realm_jax.config.loading import load_config
  path, _, arg = spec.partition(":")
  if not os.path.exists(path):
    path = os.path.join(REPO, path)
  try:
    return load_config(f"{path}:{arg}" if arg else path)
  except Exception as e:   # noqa: BLE001 -- whatever the config file raises
    message = (str(e).strip() or type(e).__name__).splitlines()[0]
    print(f"{PROG}: error: --config {spec}: {message}", file=sys.stderr)
    raise SystemExit(2) from None


def timed_saves(checkpointer, state, saves: int) -> list[tuple[float, float]]:
  """(blocking seconds, whole seconds) of each of `saves` async saves, one after the other."""
  import numpy as np
  out = []
  for step in range(saves):
    t0 = time.perf_counter()
    checkpointer.save(step, state, {"next_step": step}, {"step": np.int32(-1)})
    blocking = time.perf_counter() - t0
    checkpointer.manager.wait_until_finished()
    out.append((blocking, time.perf_counter() - t0))
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={args.devices}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from realm_jax.runtime import partitioning, state as state_lib
  from realm_jax.runtime.checkpoints import Checkpointer
  config = read_config(args.config)
  config.model.vocab_size = config.model.vocab_size or VOCAB_SIZE
  model = state_lib.build_model(config, VOCAB_SIZE)
  mesh = partitioning.make_mesh(config.mesh.shape)
  state, _, _ = state_lib.create_train_state(config, model, mesh, config.data.block_len,
                                             jax.random.PRNGKey(0))
  jax.block_until_ready(state)
  megabytes = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
  rows = [("config", args.config), ("devices", f"{args.devices} x cpu, mesh "
                                                f"{dict(mesh.shape)}"),
          ("state", f"{len(jax.tree.leaves(state))} arrays, {megabytes:.1f} MiB"),
          ("host CPU", host_cpu_text())]
  record = {"bench": "checkpoint", "config": args.config, "devices": args.devices,
            "saves": args.saves, "state_mib": round(megabytes, 2),
            **host_cpu(), "time": time.time()}
  for mode, replica_parallel in (("replica-parallel", True), ("whole arrays", False)):
    with tempfile.TemporaryDirectory() as workdir:
      checkpointer = Checkpointer(workdir, keep=2)
      # after Checkpointer's own choice (one process: whole arrays), the mode measured here
      ocp.type_handlers.register_type_handler(
          jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=replica_parallel),
          override=True)
      times = timed_saves(checkpointer, state, args.saves)
      checkpointer.manager.close()
    blocking, whole = (np.median([t[i] for t in times[1:]]) for i in (0, 1))
    rows += [(f"{mode}: first save", f"blocking {times[0][0]:.2f} s, whole {times[0][1]:.2f} s"),
             (f"{mode}: later saves (median of {args.saves - 1})",
              f"blocking {blocking:.3f} s, whole {whole:.3f} s")]
    key = "replica_parallel" if replica_parallel else "whole_arrays"
    record[key] = {"first_blocking_s": round(times[0][0], 3), "first_s": round(times[0][1], 3),
                   "blocking_s": round(float(blocking), 3), "whole_s": round(float(whole), 3)}
  print_rows(rows)
  append_jsonl(args.out, record)
  return 0


if __name__ == "__main__":
  from realm_jax.errors import run_cli
  sys.exit(run_cli(PROG, main))

"""The stage library the demos are built from: a stage is an ordinary `realm-train` run in its
own sub-workdir (or `launch/local.py`'s trainer + builder for a stage that uses the separate
index builder), run in this process or in one of its own, skipped when finished, resumed when
not. Stages run in rounds (two side by side); a failure, SIGTERM or Ctrl-C stops them all as
`realm_jax/processes.py` says. The drivers: `demo.py` (`make demo`), `demo_squad.py`,
`demo_real.py`. It runs from a checkout (it reads `configs/` and `launch/` beside the package).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from realm_jax import log, paths, workdir as workdir_lib
from realm_jax.config.overrides import with_overrides
from realm_jax.errors import ConfigError, raise_if_interrupted, run_cli
from realm_jax.processes import (Preempted, on_sigterm, shared_memory_env, start_child,
                                 signals_deferred, stop_after, stop_grace)
from realm_jax.runtime.preemption import EXIT_CODE, EXIT_UNSAVED

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DIR = os.path.join(REPO_DIR, "configs")
LAUNCHER = os.path.join(REPO_DIR, "launch", "local.py")  # a builder stage's trainer + builder
HOST_DEVICES = 2   # the REALM stage's trainer and builder see the CPU as two JAX devices
                   # (data-parallel): its step runs ~13% faster than on one device with two
                   # threads (docs/performance.md); the small stages (in-process index or
                   # none) run faster on one. A fixed count gives the same figures on any
                   # number of cores.
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
DEMO_ARGUMENTS = "demo_arguments.json"   # what a demo's workdir was begun with
STAGE_LOG = "stage.log"  # the output of a stage run beside another (`start_stage`)
ROUND_POLL_SECONDS = 1.0   # how often a round's stage processes are looked at (`run_round`)


class StageFailed(RuntimeError):
  """A stage's process failed; the message names it and where its output is (the demo
  prints it as one line: the stage's own output says why)."""


def check_demo_flags(parser, args) -> None:
  """The demo flags every stage would refuse, refused before anything is written (they used
  to fail each stage after the data was made, and bind the workdir to the bad value):
  `--seed` outside [0, 2**32), and, where the demo has them, `--host_devices` below 0 or not
  dividing the REALM stage's batch, `--entities` below 1; an empty `--workdir`; a package with
  no configs/ beside it (installed, not a checkout: the demos wrote their workdir first)."""
  if not getattr(args, "workdir", "W").strip():
    parser.error("--workdir must name a directory, got an empty string")
  if not 0 <= args.seed < 2**32:
    parser.error(f"--seed must be in [0, 2**32) (the data order's seed), got {args.seed}")
  if getattr(args, "entities", 1) < 1:
    parser.error(f"--entities must be >= 1, got {args.entities}")
  devices = getattr(args, "host_devices", 0)
  try:
    batch = repo_config("demo_realm", "realm").train.batch_size
  except FileNotFoundError as e:   # no configs/ beside the package
    parser.error(str(e))
  if devices < 0 or (devices and batch % devices):
    parser.error(f"--host_devices must be 0 (JAX's default) or divide the REALM stage's batch "
                 f"({batch}), got {devices}")


def split_host(env: dict[str, str], devices: int) -> tuple[dict[str, str], int]:
  """(`env` for a process that should see the host CPU as `devices` JAX devices, the count
  it will see): a count already in its $XLA_FLAGS is kept, and 0 leaves JAX's default (one
  CPU device; the count returned is then 0)."""
  flags = env.get("XLA_FLAGS", "")
  kept = re.search(rf"{DEVICE_COUNT_FLAG}=(\d+)", flags)
  if kept:
    return env, int(kept.group(1))
  if not devices:
    return env, 0
  return {**env, "XLA_FLAGS": f"{flags} {DEVICE_COUNT_FLAG}={devices}".strip()}, devices


def repo_config(name: str, arg: str | None = None):
  """`configs/<name>.py` -> get_config(arg)."""
  if not os.path.isdir(CONFIG_DIR):
    raise FileNotFoundError(f"{CONFIG_DIR}: no configs/ beside the package; the demos run from "
                            "a checkout of the repository (make demo)")
  from realm_jax.config.loading import load_config as load_config_file
  return load_config_file(os.path.join(CONFIG_DIR, f"{name}.py") + (f":{arg}" if arg else ""))


def stage_overrides(init, data_dir: str, workdir: str, seed: int) -> dict:
  """The overrides of a stage started from `init` (see `demo_stages`)."""
  overrides = {"data.dir": data_dir, "seed": seed}
  if isinstance(init, dict):
    return {**overrides, **{f"init.{part}": os.path.join(workdir, stage)
                            for part, stage in init.items()}}
  return {**overrides, "init.from_workdir": os.path.join(workdir, init) if init else ""}


def run_stages(stages, data_dir: str, workdir: str, seed: int,
               host_devices: int = 0) -> dict[str, dict]:
  """Trains the stages in order, each in `workdir/name`, with the data dir and seed set
  (`host_devices`: see `run_stage`); returns their summaries. A stage is (name, config file,
  arg, init) as in `demo_stages`; an item that is a list of stages (a round) runs them at once
  (`run_round`). A round's stages must not start from one another."""
  results = {}
  for item in stages:
    specs = [(name, (config_name, arg), stage_overrides(init, data_dir, workdir, seed),
              os.path.join(workdir, name))
             for name, config_name, arg, init in (item if isinstance(item, list) else [item])]
    if len(specs) == 1:
      results[specs[0][0]] = run_stage(*specs[0], host_devices)
    else:
      results.update(run_round(specs, host_devices))
  return results


def run_round(specs: list, host_devices: int = 0) -> dict[str, dict]:
  """Runs a round's stages (name, spec, overrides, workdir) at once, each in a process of its
  own: the first that is not already done with its output here, the others with theirs in
  `workdir/logs/stage.log`. The first to fail stops the others as soon as it ends (stages
  failing in the same poll are named together), as do SIGTERM (each running stage saves its
  step, given the largest of their `stop_grace`) and Ctrl-C (each keeps its last checkpoint); an
  interrupt while they stop ends them at once (`processes.stop_after`), and the demo as on
  Ctrl-C unless a stage had failed. Returns their summaries, in the order they finished."""
  processes, besides, results, here = {}, {}, {}, ""
  grace = max(stop_grace(with_overrides(repo_config(*spec), overrides)
                         .train.preemption_grace_seconds) for _, spec, overrides, _ in specs)
  try:
    for spec in specs:
      besides[spec[0]] = here
      with signals_deferred():   # the process is recorded before a signal can stop the demo
        processes[spec[0]] = start_stage(*spec, host_devices, beside=here)
      here = here or (spec[0] if processes[spec[0]] is not None else "")
    while True:
      failures = []
      for name, _, _, stage_dir in specs:
        process = processes[name]
        if name not in results and (process is None or process.poll() is not None):
          try:
            results[name] = finish_stage(name, process, stage_dir, beside=besides[name])
          except (StageFailed, Preempted) as e:
            failures.append(e)
      if failures:
        raise _together(failures)
      if len(results) == len(specs):
        return results
      raise_if_interrupted()   # a Ctrl-C swallowed in a gc callback: the round stops here
      time.sleep(ROUND_POLL_SECONDS)
  except BaseException as e:   # a stage failed, SIGTERM, Ctrl-C: stop the rest of the round
    error = stop_after(e, {f"stage {name}": process for name, process in processes.items()},
                       grace)
    if error is e:
      raise
    raise error from None


def _together(failures: list[BaseException]) -> BaseException:
  """One error for the stages that failed in the same poll: StageFailed naming each if any
  failed, else (each saved its step on SIGTERM) one Preempted."""
  if len(failures) == 1:
    return failures[0]
  whys = "; ".join(e.why if isinstance(e, Preempted) else str(e) for e in failures)
  if all(isinstance(e, Preempted) for e in failures):
    return Preempted(whys, saved=all(e.saved for e in failures))
  return StageFailed(whys)


def stage_command(spec: tuple[str, str | None], overrides: dict, workdir: str,
                  config) -> list[str]:
  """The command that trains a stage in a process of its own: `launch/local.py` (trainer +
  `realm-index`) where the index comes from the separate builder, else `realm-train`."""
  config_arg = os.path.join(CONFIG_DIR, f"{spec[0]}.py") + (f":{spec[1]}" if spec[1] else "")
  program = [LAUNCHER] \
      if config.retrieval.refresh != "in_process" else ["-m", "realm_jax.train.main"]
  return [sys.executable, "-u", *program, f"--config={config_arg}", f"--workdir={workdir}",
          *(f"--config.{key}={value}" for key, value in overrides.items()),
          *log.handed_on()]   # the driver's -v


def finished(config, workdir: str) -> dict | None:
  """The summary of a stage that already ran all of `config`'s steps in `workdir`, else None."""
  summary = workdir_lib.read_summary(workdir)
  return summary if summary is not None and summary.get("steps") == config.train.steps \
      else None


def run_stage(name: str, spec: tuple[str, str | None], overrides: dict, workdir: str,
              host_devices: int = 0) -> dict:
  """Trains one stage unless its summary says it already finished (then reuses it).

  A stage whose index comes from the separate builder (`retrieval.refresh` async or
  deterministic) runs as trainer + `realm-index` under `launch/local.py`, as a user would;
  those two processes see the host CPU as `host_devices` devices (0: JAX's default).
  """
  config = with_overrides(repo_config(*spec), overrides)
  summary = finished(config, workdir)
  if summary is not None:
    print(f"[demo] stage {name}: already done in {workdir}", flush=True)
    return summary
  if config.retrieval.refresh == "in_process":
    from realm_jax.train.loop import train
    print(f"[demo] stage {name} -> {workdir}", flush=True)
    summary = train(config, workdir)
    if "preempted_at_step" in summary:
      raise Preempted(f"stage {name} saved step {summary['preempted_at_step']}")
    return summary
  return run_round([(name, spec, overrides, workdir)], host_devices)[name]


def start_stage(name: str, spec: tuple[str, str | None], overrides: dict, workdir: str,
                host_devices: int = 0, beside: str = "") -> subprocess.Popen | None:
  """Starts one stage in a process of its own, its output here, or in `workdir/logs/stage.log`
  when it runs beside stage `beside` (whose output is here); None if it already finished.
  `finish_stage` reads its end."""
  config = with_overrides(repo_config(*spec), overrides)
  if finished(config, workdir) is not None:
    return None
  command = stage_command(spec, overrides, workdir, config)
  what = f"trainer + index builder ({config.retrieval.refresh})" \
      if config.retrieval.refresh != "in_process" else "realm-train"
  if not beside:
    print(f"[demo] stage {name} -> {workdir}: {what}: {' '.join(command[1:])}", flush=True)
    return _launch(command, config, host_devices)
  log = _stage_log(workdir)
  os.makedirs(os.path.dirname(log), exist_ok=True)
  print(f"[demo] stage {name} -> {workdir}, beside stage {beside}: {what} (progress: {log}): "
        f"{' '.join(command[1:])}", flush=True)
  with open(log, "ab") as out:
    return _launch(command, config, host_devices, out)


def finish_stage(name: str, process: subprocess.Popen | None, workdir: str,
                 beside: str = "") -> dict:
  """Waits for a stage `start_stage` started (with the same `beside`); its summary."""
  if process is None:
    print(f"[demo] stage {name}: already done in {workdir}", flush=True)
    return workdir_lib.read_summary(workdir)
  log, where = _stage_log(workdir), ""
  if beside:                     # its output is in its log
    what, see, where = "its process", log, f" ({log})"
  elif LAUNCHER in process.args:   # (a refusal of its own, before it starts them: no logs)
    what, see = "launch/local.py", (f"its output above (and {workdir}/logs/trainer.log and "
                                    "builder.log, where it started them)")
  else:
    what, see = "its process", "its output above"
  summary = _wait_stage(name, process, workdir, what, see)
  shown = " ".join(f"{k[5:]} {v:.3f}" for k, v in summary.items()
                   if k.startswith("eval_") and isinstance(v, float)
                   and not k.startswith(("eval_num_", "eval_index_")))
  print(f"[demo] stage {name}: done in {summary.get('wall_seconds')} s: {shown}{where}",
        flush=True)
  return summary


def _stage_log(workdir: str) -> str:
  return os.path.join(workdir, "logs", STAGE_LOG)


def _launch(command: list[str], config, host_devices: int, out=None) -> subprocess.Popen:
  """A stage's process (`stage_command`), in a session of its own (realm_jax/processes.py); a
  builder stage's processes see the host CPU as `host_devices` devices (`run_stage`)."""
  env = split_host(dict(os.environ), host_devices)[0] \
      if config.retrieval.refresh != "in_process" else dict(os.environ)
  return start_child(command, env=env, stdout=out, stderr=subprocess.STDOUT if out else None)


def _wait_stage(name: str, process: subprocess.Popen, workdir: str, what: str,
                see: str) -> dict:
  """The summary of a stage process once it exits; `Preempted` if it saved its step on
  SIGTERM, StageFailed naming `what` and where to `see` if it failed."""
  code = process.wait()
  if code == EXIT_CODE:
    raise Preempted(f"stage {name} saved its step ({see})")
  if code == EXIT_UNSAVED:
    raise Preempted(f"stage {name} did not save its step within its grace ({see})", saved=False)
  if code != 0:
    raise StageFailed(f"stage {name}: {what} exited with code {code}; see {see}")
  summary = workdir_lib.read_summary(workdir)
  if summary is None:
    raise StageFailed(f"stage {name}: {what} exited 0 but left no "
                       f"{workdir}/{workdir_lib.SUMMARY}")
  return summary


def devices(stage_devices: int) -> str:
  """What the stages ran on, e.g. '1 x cpu (REALM stage: 2 x cpu)' (`stage_devices`: the
  count `split_host` gave the REALM stage's processes, 0 for JAX's default)."""
  import jax
  here = f"{jax.device_count()} x {jax.devices()[0].platform}"
  if jax.devices()[0].platform != "cpu" or stage_devices in (0, jax.device_count()):
    return here
  return f"{here} (REALM stage: {stage_devices} x cpu)"


def stage_seconds(results: dict[str, dict]) -> dict[str, float]:
  """Each stage's wall seconds over all its runs (a stage resumed after a stop counts the
  runs before it: W/wall.json, realm_jax/workdir.py)."""
  return {name: workdir_lib.wall_all_runs(summary) for name, summary in results.items()}


@contextlib.contextmanager
def demo_lock(workdir: str):
  """The one demo of `workdir`: W/demo.lock (`workdir.JobLock`) held from before a demo's
  first write to its end. A second demo there is refused at once naming the first one's pid
  (its stages would be refused by the first one's, but only after it had added its run to
  W/wall.json, which the first one's summary reports)."""
  with workdir_lib.JobLock(workdir, "demo") as lock:
    lock.acquire()
    yield


def check_arguments(workdir: str, arguments: dict, make_variable: str) -> None:
  """Refuses to go on with a demo in `workdir` begun under other `arguments` (flag -> value,
  e.g. the seed), naming the first that differs and the Makefile's `make_variable` for another
  workdir: the demo would reuse its data and finished stages as they are and report them
  under the new values. The first run records them in W/demo_arguments.json (a workdir from
  before that record is taken as it is; one with nothing else in it yet takes the new ones)."""
  path = os.path.join(workdir, DEMO_ARGUMENTS)
  try:
    recorded = paths.read_json(path)
  except ValueError as e:
    raise ConfigError("", f"{path}: not the JSON a demo writes ({e}); remove it, or "
                      f"{workdir}") from None
  begun = os.path.isdir(workdir) and any(   # its data or a stage (files are its records)
      os.path.isdir(os.path.join(workdir, entry)) for entry in os.listdir(workdir))
  if recorded is None or not begun:   # nothing made yet (a demo that stopped at once)
    os.makedirs(workdir, exist_ok=True)
    paths.write_json(path, arguments)
    return
  for flag, value in arguments.items():
    if flag in recorded and recorded[flag] != value:
      raise ConfigError("", f"--{flag} {value}: {workdir} holds a demo begun with --{flag} "
                        f"{recorded[flag]}, whose data and stages it would reuse; give it "
                        f"another workdir (--workdir, or make {make_variable}=...) or remove "
                        f"{workdir}")


def prepare_demo_data(config, workdir: str, make_variable: str) -> dict:
  """`realm-prepare` of a demo's W/data (`config.out_dir`); returns its stats. W/data prepared
  from another file or settings is refused as `realm-prepare` refuses it, naming the way on
  for the demo: another workdir or W removed whole (W's stages were trained on those data:
  with W/data alone removed, the demo would reuse them on the new data)."""
  from realm_jax.data.prepare import prepare
  try:
    return prepare(config)
  except ConfigError as e:
    if e.option != "out_dir" or not os.path.isdir(config.out_dir):   # (not W/data refused)
      raise
    raise ConfigError(e.option, f"{e.message}; for this demo, give it another workdir "
                      f"(--workdir, or make {make_variable}=...) or remove {workdir} whole: with "
                      f"{config.out_dir} alone removed, any stage of {workdir} trained on it "
                      "would be reused on the new data") from None


def trained_nothing(previous: dict | None, results: dict[str, dict]) -> bool:
  """Whether this run of a demo reused every stage of the summary `previous` wrote (None: no
  summary yet): a finished demo run again, which adds no run to its wall record."""
  return previous is not None and previous.get("stage_seconds") == stage_seconds(results)


def run_demo_cli(prog: str, job) -> object:
  """`run_cli(prog, job)` for a demo driver: SIGTERM stops it with every running stage saved
  (exit 143), Ctrl-C with every stage stopped (exit 130), a failed stage (exit 1), each with
  one line saying so."""
  signal.signal(signal.SIGTERM, on_sigterm)
  # Stages run in this process and in processes of their own (trainer + builder), one after
  # another and side by side: on an accelerator none may take most of the device's memory at
  # start-up (the variables are read when the device is first used).
  os.environ.update(shared_memory_env(dict(os.environ)))

  def stoppable_job():
    try:
      return job()
    except KeyboardInterrupt:   # before run_cli's own line: say what a rerun does
      print(f"\n[{prog}] interrupted; the stages keep their last checkpoints: rerun the same "
            "command to resume", flush=True)
      raise SystemExit(130) from None
    except StageFailed as e:
      print(f"[{prog}] error: {e}", file=sys.stderr, flush=True)
      raise SystemExit(1) from None
  try:
    return run_cli(prog, stoppable_job)
  except Preempted as e:
    saved = {True: "the stages stopped at a saved checkpoint",
             False: "each stage keeps its last checkpoint",
             None: "no stage was running; the finished ones are kept"}[e.saved]
    print(f"\n[{prog}] preempted ({e.why}); {saved}: rerun the same command to resume",
          flush=True)
    raise

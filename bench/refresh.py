"""What the separate index builder costs the trainer: step times while it builds, at swaps, idle.

Runs the demo REALM stage (`configs/demo_realm.py:realm`) with `retrieval.refresh` = `--mode`
(async by default; deterministic for comparison) through `launch/local.py`, i.e. the trainer
and the index builder as two processes sharing one workdir, for `--steps` steps with an index
version every `--refresh_every` steps and no evaluation during training (`eval.every=0`; the
run's final evaluation after the last step still runs, and is left out of the steps' figures),
into `--workdir` (wiped first).
Then it reads what the run wrote:

  W/metrics/retrieval.jsonl  per train step: time, index version, staleness, seconds waited
                             for the batch's index, step_seconds
  W/metrics/index.jsonl      per published version: end time, restore/embed/build/publish s
  W/summary.json             staleness p50/p95/max, versions used, blocking waits

and sorts every train step after the first 10 (compilation) into one class:

  swap      the first step retrieving from a new index version
  building  its wall interval [time - step_seconds, time] overlaps a build interval
            [time - (restore + embed + build + publish seconds), time] of the builder
  idle      neither

Printed (and appended as one JSON line to `--out`): per class the number of steps, the
median and p90 step time and the median's ratio to idle's; the blocking waits after the first
index (async mode must have none: PASS/FAIL, exit code 1 on FAIL); staleness p50/p95/max;
index versions used and published; the run's wall time, the trainer's, and its steps' alone
(the first step's start to the last step's end: without start-up, compile and the final
evaluation); the builder's mean embed time.

  python bench/refresh.py [--mode async|deterministic] [--steps 300] [--refresh_every 50]
      [--data_dir runs/demo/data] [--init_from runs/demo/warmup] [--workdir W]
      [--out runs/bench_refresh.jsonl] [--config.builder.devices=1 ...]
  python bench/refresh.py --data_dir /tmp/world --init_from '' --steps 60 --refresh_every 10

Extra `--config.*` overrides go to both processes (on a GPU machine the builder needs its own
GPUs: `--config.builder.devices=N`).
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

from realm_jax import workdir as workdir_lib
from realm_jax.errors import CommandParser, run_cli
from report import append_jsonl, host_cpu, host_cpu_text, print_rows   # bench/: sys.path[0]

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "configs/demo_realm.py:realm"
MODES = ("async", "deterministic")
CLASSES = ("idle", "building", "swap")
COMPILE_STEPS = 10              # the first steps compile (and wait for the first index)
WAIT_THRESHOLD_S = 0.01         # a batch that waited longer for its index blocked the step
LOG_TAIL_LINES = 40
# What a workdir of an earlier run holds; anything else is not wiped (a mistyped --workdir).
RUN_MARKERS = ("logs", "metrics", "checkpoints", "index", "summary.json")


class BenchError(RuntimeError):
  """The run did not happen or left nothing to measure; the message says why."""


def prepare_workdir(workdir: pathlib.Path) -> None:
  """Wipes an earlier run's workdir; refuses a non-empty directory that is not one."""
  if workdir.exists():
    entries = {p.name for p in workdir.iterdir()}
    if entries and not entries & set(RUN_MARKERS):
      raise BenchError(f"--workdir {workdir} is not empty and does not look like a run "
                       f"directory (none of {', '.join(RUN_MARKERS)}); not wiping it")
    shutil.rmtree(workdir)
  workdir.parent.mkdir(parents=True, exist_ok=True)


def launch_command(args, workdir: pathlib.Path, extra: list[str]) -> list[str]:
  """The `launch/local.py` argv: demo REALM stage, the bench's overrides, then `extra`."""
  config_path, _, arg = CONFIG.partition(":")
  return [
      sys.executable, str(REPO / "launch" / "local.py"),
      "--config", f"{REPO / config_path}:{arg}", "--workdir", str(workdir),
      f"--config.retrieval.refresh={args.mode}",
      f"--config.retrieval.refresh_every={args.refresh_every}",
      f"--config.train.steps={args.steps}",
      "--config.eval.every=0",
      f"--config.data.dir={os.path.abspath(args.data_dir)}",
      f"--config.init.from_workdir={os.path.abspath(args.init_from) if args.init_from else ''}",
      *extra,
  ]


def log_tail(path: pathlib.Path, lines: int = LOG_TAIL_LINES) -> str:
  if not path.exists():
    return f"  ({path} does not exist)"
  text = path.read_text(errors="replace").splitlines()[-lines:]
  return "\n".join("  " + line for line in text) or f"  ({path} is empty)"


def run_launcher(argv: list[str], workdir: pathlib.Path) -> float:
  """Runs the launcher (its output streams through); returns its wall seconds.

  Raises:
    BenchError with the tails of both logs when it exits non-zero.
  """
  t0 = time.time()
  proc = subprocess.Popen(argv, cwd=REPO)
  try:
    code = proc.wait()
  except KeyboardInterrupt:   # the launcher got the same Ctrl-C and stops both processes
    proc.wait()
    raise
  wall = time.time() - t0
  if code != 0:
    tails = "\n".join(f"--- tail of {workdir / 'logs' / name}.log ---\n"
                      + log_tail(workdir / "logs" / f"{name}.log")
                      for name in ("trainer", "builder"))
    raise BenchError(f"launch/local.py failed with exit code {code} after {wall:.0f}s\n{tails}")
  return wall


def read_jsonl(path: pathlib.Path) -> list[dict]:
  if not path.exists():
    raise BenchError(f"the run succeeded but wrote no {path}")
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  if not rows:
    raise BenchError(f"{path} is empty")
  return rows


def build_intervals(index_rows: list[dict]) -> list[tuple[float, float]]:
  """[start, end] unix times of every build: end = the line's time, start = end minus the
  measured restore + embed + build + publish seconds (file writes in between are not timed)."""
  parts = ("restore_seconds", "embed_seconds", "build_seconds", "publish_seconds")
  return [(r["time"] - sum(r.get(k, 0.0) for k in parts), r["time"]) for r in index_rows]


def classify(steps: list[dict], builds: list[tuple[float, float]]) -> dict[str, list[float]]:
  """Step seconds of each class (swap, building, idle) over the steps after COMPILE_STEPS."""
  out = {name: [] for name in CLASSES}
  for prev, row in zip(steps, steps[1:]):
    if row["step"] <= COMPILE_STEPS:
      continue
    end = row["time"]
    begin = end - row.get("step_seconds", 0.0)   # (a run's first step has none)
    if row["index_version"] != prev["index_version"]:
      kind = "swap"
    elif any(begin < b_end and b_start < end for b_start, b_end in builds):
      kind = "building"
    else:
      kind = "idle"
    out[kind].append(row["step_seconds"])
  return out


def class_stats(times: dict[str, list[float]]) -> dict[str, dict]:
  idle = float(np.median(times["idle"])) if times["idle"] else None
  stats = {}
  for name in CLASSES:
    t = times[name]
    median = float(np.median(t)) if t else None
    stats[name] = {
        "steps": len(t),
        "median_ms": round(median * 1e3, 2) if t else None,
        "p90_ms": round(float(np.percentile(t, 90)) * 1e3, 2) if t else None,
        "ratio_to_idle": round(median / idle, 3) if t and idle else None,
    }
  return stats


def _round(value, digits: int = 2):
  return None if value is None else round(float(value), digits)


def measure(args, workdir: pathlib.Path) -> dict:
  """The figures of a finished run, read from its workdir."""
  steps = sorted(read_jsonl(workdir / "metrics" / "retrieval.jsonl"), key=lambda r: r["step"])
  index_rows = read_jsonl(workdir / "metrics" / "index.jsonl")
  summary = workdir_lib.read_summary(str(workdir))
  if summary is None:
    raise BenchError(f"the run succeeded but wrote no {workdir / workdir_lib.SUMMARY}")
  if len(steps) <= COMPILE_STEPS + 1:
    raise BenchError(f"only {len(steps)} train steps logged; run more than "
                     f"{COMPILE_STEPS + 1} (--steps)")
  waits = [r["index_wait_seconds"] for r in steps
           if r["step"] > 1 and r["index_wait_seconds"] > WAIT_THRESHOLD_S]
  record = {
      "classes": class_stats(classify(steps, build_intervals(index_rows))),
      "steps_logged": len(steps),
      "blocking_waits_summary": summary.get("index_blocking_waits"),
      "blocking_waits_counted": len(waits),
      "blocking_wait_seconds_summary": summary.get("index_wait_seconds"),
      "blocking_wait_seconds_counted": round(float(sum(waits)), 3),
      "staleness_p50": _round(summary.get("index_staleness_p50")),
      "staleness_p95": _round(summary.get("index_staleness_p95")),
      "staleness_max": summary.get("index_staleness_max"),
      "versions_used": summary.get("index_versions_used"),
      "versions_published": len(index_rows),
      "trainer_wall_s": summary.get("wall_seconds"),
      # from the start of the first step to the end of the last: without start-up, compile
      # and the final evaluation (which waits for the last checkpoint's version)
      "steps_wall_s": round(steps[-1]["time"] - steps[0]["time"]
                            + steps[0].get("step_seconds", 0.0), 1),   # none on step 1
      "embed_s_mean": round(float(np.mean([r["embed_seconds"] for r in index_rows])), 3),
      "build_interval_s_mean": round(float(np.mean(
          [end - start for start, end in build_intervals(index_rows)])), 3),
  }
  if args.mode == "async":  # async swaps in what is there; a batch never waits for an index
    record["no_blocking_waits"] = (record["blocking_waits_counted"] == 0
                                   and record["blocking_waits_summary"] == 0)
  return record


def print_table(r: dict) -> None:
  # a class without steps has no figures: "-", padded to the column as a figure is
  fmt = lambda v, spec: format(v, spec) if v is not None else "-".rjust(int(spec.split(".")[0]))
  print()
  print(f"steps after the first {COMPILE_STEPS} ({r['mode']}, {r['steps']} steps, refresh every "
        f"{r['refresh_every']}):")
  print(f"{'class':<10} | {'steps':>5} | {'median ms':>9} | {'p90 ms':>9} | {'/ idle':>6}")
  for name in CLASSES:
    c = r["classes"][name]
    print(f"{name:<10} | {c['steps']:>5} | {fmt(c['median_ms'], '9.1f')} | "
          f"{fmt(c['p90_ms'], '9.1f')} | {fmt(c['ratio_to_idle'], '6.2f')}")
  verdict = ""
  if "no_blocking_waits" in r:
    verdict = " [async must be 0: " + ("PASS]" if r["no_blocking_waits"] else "FAIL]")
  rows = [
      ("blocking waits after the first index",
       f"{r['blocking_waits_summary']} (summary, {r['blocking_wait_seconds_summary']} s), "
       f"{r['blocking_waits_counted']} (wait > {WAIT_THRESHOLD_S} s after step 1, "
       f"{r['blocking_wait_seconds_counted']} s){verdict}"),
      ("staleness p50 / p95 / max",
       f"{r['staleness_p50']} / {r['staleness_p95']} / {r['staleness_max']} steps"),
      ("index versions used / published", f"{r['versions_used']} / {r['versions_published']}"),
      ("run wall time", f"{r['wall_s']:.1f} s (trainer {r['trainer_wall_s']} s, of which its "
                        f"steps {r['steps_wall_s']} s)"),
      ("builder embed per version", f"{r['embed_s_mean']:.2f} s mean (build interval "
                                    f"{r['build_interval_s_mean']:.2f} s)"),
      ("host CPU", f"{host_cpu_text()}, {r['cpus']} CPUs"),
  ]
  print_rows(rows)


def main(argv: list[str] | None = None) -> dict:
  """Launches the run, measures it, prints the table and appends the JSON line."""
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--mode", choices=MODES, default="async", help="retrieval.refresh")
  parser.add_argument("--steps", type=int, default=300, help="train steps")
  parser.add_argument("--refresh_every", type=int, default=50,
                      help="retrieval.refresh_every: steps between checkpoints for the builder")
  parser.add_argument("--data_dir", default=str(REPO / "runs/demo/data"),
                      help="prepared data dir (config.data.dir)")
  parser.add_argument("--init_from", default=str(REPO / "runs/demo/warmup"),
                      help="workdir whose params start the stage (the warm-up's; '' for "
                           "scratch)")
  parser.add_argument("--workdir", default=None,
                      help="run directory, wiped first (default runs/bench_refresh/<mode>)")
  parser.add_argument("--out", default=str(REPO / "runs/bench_refresh.jsonl"),
                      help="append the JSON record here ('' to skip)")
  args, extra = parser.parse_known_args(argv)
  unknown = [a for a in extra if a.startswith("-") and not a.lstrip("-").startswith("config.")]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)} (only --config.* overrides "
                 "are passed through)")
  if args.steps <= COMPILE_STEPS + 1:
    parser.error(f"--steps must be > {COMPILE_STEPS + 1} (the first {COMPILE_STEPS} compile)")
  if not os.path.isdir(args.data_dir):
    raise FileNotFoundError(f"--data_dir {args.data_dir} is not a directory (prepare the demo "
                            "data, or pass a prepared data dir)")
  if args.init_from and not os.path.isdir(os.path.join(args.init_from, "checkpoints")):
    raise FileNotFoundError(f"no checkpoints under --init_from {args.init_from} (run the "
                            "demo's warm-up, or pass --init_from '' to start from scratch)")
  workdir = pathlib.Path(args.workdir or REPO / "runs" / "bench_refresh" / args.mode).resolve()

  prepare_workdir(workdir)
  argv_run = launch_command(args, workdir, extra)
  command = shlex.join(argv_run)
  print(f"[bench] running: {command}", flush=True)
  wall = run_launcher(argv_run, workdir)
  record = {"bench": "refresh", "config": CONFIG, "mode": args.mode, "steps": args.steps,
            "refresh_every": args.refresh_every, "data_dir": os.path.abspath(args.data_dir),
            "init_from": os.path.abspath(args.init_from) if args.init_from else "",
            "workdir": str(workdir), "overrides": extra, "command": command,
            "host": platform.node(), "cpus": os.cpu_count(), **host_cpu(),
            "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "time": round(time.time(), 3), "wall_s": round(wall, 1)}
  record.update(measure(args, workdir))
  print_table(record)
  print(f"\ncommand: {command}")
  print(json.dumps(record), flush=True)
  append_jsonl(args.out, record)
  return record


def _cli() -> int:
  try:
    record = run_cli("bench/refresh.py", lambda: main(sys.argv[1:]))
  except BenchError as e:
    print(f"bench/refresh.py: error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print("bench/refresh.py: interrupted", file=sys.stderr)
    return 130
  return 0 if record.get("no_blocking_waits", True) else 1


if __name__ == "__main__":
  sys.exit(_cli())

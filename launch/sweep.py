"""Hyperparameter sweeps: a grid over config fields, one workdir per run, a results table.

  python launch/sweep.py --config configs/demo_realm.py:realm --root runs/sweep \
      --grid train.lr=1e-3,3e-3 --grid retrieval.k=4,8 [--set data.dir=runs/demo/data ...] \
      [--launcher local|print] [--metric eval_recall_at_5] [--ascending] [--dry-run]
  python launch/sweep.py --config configs/realm_base.py --root gs://my-bucket/sweep \
      --grid train.lr=1e-5,3e-5 --set data.dir=gs://my-bucket/realm/data \
      --set retrieval.refresh=async --set init.retriever=gs://my-bucket/realm/ict \
      --set init.reader=gs://my-bucket/bert-base-uncased --launcher tpu_pod --name realm-lr \
      [--dry-run] -- --zone us-central2-b --project my-project

The grid is the product of the `--grid KEY=V1,V2,...` flags, or, without any, the config
module's `get_hyper(arg)` (a list of override dicts). Every key must be a field of the config
(a typo names the closest field); values take the type of the field they replace. Each run
gets the name `key-value_key-value` and the workdir `ROOT/<name>`; `--set` overrides apply to
every run. `local` runs them one after another on this machine, each as its own process
(`realm-train`, or `launch/local.py` when the config uses the separate index builder), and
skips runs whose `summary.json` already covers their steps, so an interrupted sweep resumes
(a run there that started under other values stops the sweep: `check_started_runs`)
(Ctrl-C or SIGTERM to the sweep stops the running run first: `run_locally`); `print` prints
the commands instead. Then every run's `summary.json` is collected into
`ROOT/results.csv` and `ROOT/results.md`, sorted by `--metric` (best first: descending unless
`--ascending`), and the table is printed.

`tpu_pod` starts each run on TPU slices of its own, one after another, as `launch/tpu_pod.py up
--name NAME-<run id> --workdir ROOT/<name> ...` (ROOT a gs:// path; the run id is 8 hex digits of
the run's workdir URL, so a run keeps its slices when the grid grows or is reordered; the flags
after `--` go to every tpu_pod.py call; every run's call is checked as tpu_pod.py checks it
before the first starts) and returns once all are started; their summaries land
in the bucket; the tables are written as for `local`, from what the bucket holds then (a run
just started reads "started", with no figures yet: run the sweep again once they finish to
table them). As with `local`, runs that finished are skipped and a sweep whose runs started
under other values is refused; a run still training keeps its slices, where tpu_pod.py's
install refuses to touch a slice whose job is alive (the run's row says "running", which
does not count as a failure in the sweep's exit code), and a stopped one resumes on them.
`--dry-run` prints each run's command and runs nothing (`--launcher print` is `local --dry-run`).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import itertools
import math
import os
import shlex
import signal
import subprocess
import sys
import time

from realm_jax import log, paths, processes, workdir as workdir_lib
from realm_jax.errors import CommandParser, ConfigError, raise_if_interrupted, run_cli
from realm_jax.config.loading import config_module, module_config
from realm_jax.config.option_names import upgrade_config, upgrade_flags
from realm_jax.config.reading import flat_options, uses_index_builder
from realm_jax.config.overrides import (check_key, check_known_options, field_value,
                                        flag_text, parse_assignment)

PROG = "sweep.py"
HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHERS = ("local", "print", "tpu_pod")
MAX_NAME_BYTES = 255   # a directory entry (a bucket's object names allow more; local disks not)
MAX_SLICES_NAME = 31   # --name: NAME-<8 hex> fits tpu_pod.py's 40 characters
TPU_POD_OWN = ("--name", "--config", "--workdir", "--set")   # set by the sweep for each run
# the sweep's own --dry-run: after --, tpu_pod.py would print and exit 0 ("started")
TPU_POD_REFUSED = ("--dry-run",)


def expand_grid(config, grid_flags: list[str], hyper: list[dict] | None) -> list[dict]:
  """The runs' override dicts: the product of `--grid` flags, else `get_hyper()`'s list."""
  fields = flat_options(config)
  if grid_flags:
    axes = []
    for flag in grid_flags:
      key, values = parse_assignment(flag, "--grid")
      check_key(key, fields, "--grid")
      if any(axis[0][0] == key for axis in axes):
        raise ConfigError("", f"--grid {flag!r}: {key} has a --grid already (give all its "
                          "values in one: --grid KEY=V1,V2,...)")
      axes.append([(key, field_value(config, fields, key, v.strip()))
                   for v in grid_values(values)])
    runs = [dict(combo) for combo in itertools.product(*axes)]
  elif hyper:
    hyper = hyper if isinstance(hyper, (dict, str)) or not hasattr(hyper, "__iter__") \
        else list(hyper)   # a generator's runs too
    if not isinstance(hyper, list) or not all(hasattr(run, "keys") for run in hyper):
      shown = repr(hyper) if len(repr(hyper)) <= 80 else repr(hyper)[:77] + "..."
      raise ConfigError("", f"get_hyper() returned {shown}: not a list of override dicts, "
                        "one a run ([{'train.lr': 1e-3}, {'train.lr': 3e-3}])")
    runs = [dict(run) for run in hyper]
    for i, run in enumerate(runs, 1):
      if not run:   # its name would be '': its workdir --root itself, the tables in it
        raise ConfigError("", f"get_hyper() run {i} gives no field: its workdir would be "
                          "--root itself; give a field its value (the default's for a "
                          "baseline, e.g. {'seed': 0})")
      for key, value in run.items():
        if not isinstance(key, str):
          raise ConfigError("", f"get_hyper() run {i}: its key {key!r} is not a field's "
                            "dotted name ('train.lr')")
        check_key(key, fields, "get_hyper()")
        if value is None:   # a run's --config.KEY=None reads the text 'None', or is refused
          raise ConfigError(key, "get_hyper() gives None, which no --config flag hands a run; "
                            "give a value ('' for a path left unset)")
        # "1e-3" or 32.5 for an int, [8, 1] for a tuple: typed and refused as a --grid value
        run[key] = field_value(config, fields, key,
                               value if isinstance(value, str) else flag_text(value))
  else:
    raise ConfigError("", "no grid: give --grid KEY=V1,V2 flags or define get_hyper(arg) in "
                      "the config module")
  return runs


def grid_values(text: str) -> list[str]:
  """`V1,V2,...` split on the commas outside brackets and quotes: `(8,1),(4,2)` is two
  tuples, `'6,7',8` two strings. A quote opens at a value's start or inside brackets: an
  apostrophe in a word (`runs/bob's`) is part of it."""
  values, depth, quote, start = [], 0, "", 0
  for i, c in enumerate(text):
    if quote:
      quote = "" if c == quote else quote
    elif c in "'\"" and (depth or not text[start:i].strip()):
      quote = c
    elif c in "([":
      depth += 1
    elif c in ")]":
      depth -= 1
    elif c == "," and depth == 0:
      values.append(text[start:i])
      start = i + 1
  values.append(text[start:])
  return [v.strip().strip("'\"") if v.strip()[:1] in "'\"" else v for v in values]


def run_name(overrides: dict) -> str:
  """`train.lr-0.001_retrieval.k-4`: readable, and a valid directory name."""
  parts = []
  for key, value in overrides.items():
    text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
    parts.append(f"{key}-{text}".replace("/", "_").replace(" ", ""))
  return "_".join(parts)


def value_text(value) -> str:
  """An override's value as a flag writes it (a tuple as `a,b`)."""
  return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def command(config_spec: str, workdir: str, overrides: dict, builder: bool) -> list[str]:
  """The command line of one run, with the sweep's `-v`, where one was given (local.py hands
  it to both of its processes)."""
  entry = [os.path.join(HERE, "local.py")] if builder else ["-m", "realm_jax.train.main"]
  flags = [f"--config.{k}={value_text(v)}" for k, v in overrides.items()]
  return [sys.executable, "-u", *entry, f"--config={config_spec}", f"--workdir={workdir}",
          *flags, *log.handed_on()]


def tpu_pod_command(config_spec: str, workdir: str, overrides: dict, builder: bool, name: str,
                    tpu_pod_args: list[str]) -> list[str]:
  """One run as `launch/tpu_pod.py up` on slices of its own (NAME-trainer, NAME-builder)."""
  sets = [token for k, v in overrides.items() for token in ("--set", f"{k}={value_text(v)}")]
  return [sys.executable, os.path.join(HERE, "tpu_pod.py"), "up", "--name", name, "--config",
          config_spec, "--workdir", workdir, *([] if builder else ["--builder_type", "none"]),
          *sets, *tpu_pod_args]


def slice_name(name: str, workdir: str) -> str:
  """The tpu_pod.py --name of the run in `workdir` (its gs:// URL) in sweep `name`:
  `name-<8 hex of sha256(workdir)>`, the same whatever runs the grid holds besides it (a grown
  grid finds a running run's slices), and another for a run of another --root."""
  return f"{name}-{hashlib.sha256(paths.bucket_url(workdir).encode()).hexdigest()[:8]}"


def run_config(config, overrides: dict):
  """The config one run trains under: the sweep's config with the run's overrides, read as
  the trainer reads them (`upgrade_config`: the retriever's 0 for "the reader's" is None)."""
  run = config.copy_and_resolve_references()
  run.update_from_flattened_dict(overrides)
  upgrade_config(run)
  return run


def check_runs(config, runs: list[tuple[str, dict]], fixed: dict, root: str) -> None:
  """Before any run starts: every run's config passes the trainer's own checks (`validate`),
  naming the run, and every workdir name fits a directory entry (and, under a bucket root,
  holds no character a bucket path cannot: `paths.check`)."""
  from realm_jax.config.validation import validate, validate_training
  for name, overrides in runs:
    if len(name.encode()) > MAX_NAME_BYTES:
      raise ConfigError("", f"run {name[:60]}...: its workdir name is {len(name.encode())} "
                        f"bytes, over {MAX_NAME_BYTES}: sweep fewer keys, or shorter values")
    try:
      paths.check(paths.join(root, name), "workdir")
    except ConfigError as e:
      raise ConfigError("", f"{e.message} (run {name}: a value it sweeps)") from None
    try:
      run = run_config(config, {**fixed, **overrides})
      validate(run)
      validate_training(run)
    except ConfigError as e:
      raise ConfigError(e.option, f"{e.message} (run {name})") from None


def needs_builder(config, overrides: dict) -> bool:
  """Whether the run with `overrides` uses the separate index builder (the trainer's rule,
  `reading.uses_index_builder`)."""
  return uses_index_builder(run_config(config, overrides))


def check_started_runs(root: str, runs: list[tuple[str, dict]], config, fixed: dict) -> None:
  """Refuses a sweep whose runs started under other values (a `--set` or the config file
  changed since): a finished one would be skipped and its old figures tabled as this sweep's,
  a stopped one resumed under a mix of both. More `train.steps` is allowed: the runs go on.
  A path the run recorded as its gcsfuse mount (`/gcs/B/P`, tpu_pod.py --storage gcsfuse) is
  the same as `gs://B/P`."""
  stale = []
  for name, overrides in runs:
    diffs = [f"{option}: {recorded!r} (recorded) != {now!r} (now)" for option, recorded, now
             in workdir_lib.recorded_differences(paths.join(root, name),
                                                 run_config(config, {**fixed, **overrides}))
             if not (option == "train.steps" and now > recorded)
             and not paths.same_place(recorded, now)]
    if diffs:
      more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
      stale.append(f"{name}: {'; '.join(diffs[:3])}{more}")
  if stale:
    raise ConfigError("", f"--root {root}: {len(stale)} of the runs there started under other "
                      "values than this sweep gives them; use another --root, or remove those "
                      "runs to train them again: " + " | ".join(stale))


def finished(workdir: str, run: dict, fields: dict) -> bool:
  """Whether the run's summary.json covers its `train.steps` (a rerun skips it)."""
  done = _summary(workdir)
  return done is not None and done.get("steps") == int(run.get("train.steps",
                                                               fields["train.steps"]))


def _summary(workdir: str) -> dict | None:
  return workdir_lib.read_summary(workdir)


def _result(root: str, name: str, steps: dict[str, int] | None) -> dict | None:
  """Run `name`'s summary, unless `steps` gives its train.steps and the summary is of fewer
  (an earlier, shorter run's: the run given more steps failed, or still trains)."""
  summary = _summary(paths.join(root, name))
  if summary is not None and steps is not None and summary.get("steps") != steps[name]:
    return None
  return summary


def collect(root: str, runs: list[tuple[str, dict]], metric: str, descending: bool,
            status: dict[str, str], steps: dict[str, int] | None = None) -> list[dict]:
  """One row per run: its overrides, status, and the scalar fields of its summary.json (where
  `steps` gives the run's train.steps, of a summary that covers them: `_result`)."""
  rows = []
  for name, overrides in runs:
    summary = _result(root, name, steps) or {}
    row = {"run": name, **{k: v for k, v in overrides.items()},
           "status": status.get(name, "done" if summary else "missing")}
    row.update({k: v for k, v in summary.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)})
    rows.append(row)
  have = [r for r in rows if isinstance(r.get(metric), (int, float))
          and math.isfinite(r[metric])]    # a NaN sorts nowhere: with the rest
  rest = [r for r in rows if r not in have]
  if rows and not have:
    fields = sorted({k for r in rows for k in r if k.startswith("eval_")})
    print(f"[sweep] warning: --metric {metric or '(none)'}: no run's summary has it as a "
          f"number (their eval fields: {', '.join(fields) or 'none'}); the table is not "
          "sorted", flush=True)
  have.sort(key=lambda r: r[metric], reverse=descending)
  return have + rest


def write_tables(root: str, rows: list[dict], metric: str,
                 grid: tuple[str, ...] = ()) -> tuple[str, str]:
  """ROOT/results.csv (every column) and ROOT/results.md (the grid: the keys `grid` names and
  any dotted one, a top-level field such as `seed` too; status, metrics); ROOT may be a
  bucket URL."""
  columns = list(dict.fromkeys(c for r in rows for c in r))
  csv_path, md_path = paths.join(root, "results.csv"), paths.join(root, "results.md")
  table = io.StringIO(newline="")
  writer = csv.DictWriter(table, fieldnames=columns)
  writer.writeheader()
  writer.writerows(rows)
  paths.write_text_atomic(csv_path, table.getvalue())
  # A resumed run's wall is all its runs' (a summary from before the record, or whose record
  # could not be kept: its own, `workdir.wall_all_runs`).
  wall = "wall_seconds_all_runs" if "wall_seconds_all_runs" in columns else "wall_seconds"
  shown = [c for c in columns if c in ("run", "status", *grid) or c == metric or "." in c
           or c.startswith("eval_") or c == wall]
  lines = ["| " + " | ".join(shown) + " |", "|" + "---|" * len(shown)]
  for r in rows:
    seconds = workdir_lib.wall_all_runs(r)
    r = {**r, wall: "" if seconds is None else seconds}   # "": a run with no summary
    cells = [f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in shown]
    lines.append("| " + " | ".join(cells) + " |")
  sorted_by = any(isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])
                  for r in rows)
  head = f"Sorted by {metric}." if sorted_by else f"Not sorted: no run has {metric or 'a metric'}."
  paths.write_text_atomic(md_path, f"{head}\n\n" + "\n".join(lines) + "\n")
  return csv_path, md_path


def parse_args(argv: list[str]) -> argparse.Namespace:
  """The sweep's flags, plus `tpu_pod_args`: the tokens after `--` (for tpu_pod.py)."""
  cut = argv.index("--") if "--" in argv else len(argv)
  argv, tpu_pod_args = argv[:cut], argv[cut + 1:]
  parser = CommandParser(prog=PROG, description=__doc__.splitlines()[0],
                          allow_abbrev=False)
  parser.add_argument("--config", required=True, help="configs/X.py[:arg]")
  parser.add_argument("--root", default="runs/sweep", help="one workdir per run under here")
  parser.add_argument("--grid", action="append", default=[], help="KEY=V1,V2,... (repeat)")
  parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
  parser.add_argument("--launcher", default="local", help=f"one of {LAUNCHERS}")
  parser.add_argument("--metric", default="", help="sort key from summary.json (default: the "
                      "first eval_* field)")
  parser.add_argument("--ascending", action="store_true", help="smaller metric is better")
  parser.add_argument("--name", default="", help="tpu_pod: each run on slices NAME-<run id> (8 hex digits)")
  parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
  log.add_verbosity_argument(parser)
  args = parser.parse_args(argv)
  args.tpu_pod_args = tpu_pod_args
  return args


def check_tpu_pod_flags(args: argparse.Namespace) -> None:
  if args.launcher != "tpu_pod":
    if args.tpu_pod_args or args.name:
      raise ConfigError("", "--name and the flags after -- are for --launcher tpu_pod")
    return
  if not args.root.startswith("gs://"):
    raise ConfigError("", f"--root {args.root!r}: --launcher tpu_pod needs gs://BUCKET/PATH "
                      "(each run's workdir is ROOT/<run>)")
  if not args.name:
    raise ConfigError("", "--launcher tpu_pod needs --name (each run on slices NAME-<run id>)")
  if HERE not in sys.path:   # launch/ holds scripts: tpu_pod.py is imported by name (it
    sys.path.insert(0, HERE)  # imports jax, so only for this launcher)
  from tpu_pod import check_name
  raise_if_interrupted()   # a Ctrl-C in that import (jax's): no slice is made after it
  # a bucket name as tpu_pod.py's --workdir check takes it (each run's, `check_tpu_pod_call`)
  paths.check(args.root, "--root")
  check_name(args.name, "--name", MAX_SLICES_NAME)   # NAME-<8 hex>-builder: a TPU's name
  own = [t for t in args.tpu_pod_args if t.split("=")[0] in TPU_POD_OWN]
  if own:
    raise ConfigError("", f"after --: {own[0]!r} is set by the sweep for each run")
  refused = [t for t in args.tpu_pod_args if t.split("=")[0] in TPU_POD_REFUSED]
  if refused:
    raise ConfigError("", f"after --: {refused[0]!r} is the sweep's own flag: give it before --")


def check_tpu_pod_call(cmd: list[str], name: str) -> None:
  """What tpu_pod.py would refuse in run `name`'s call `cmd` (its flags, config, overrides,
  slice types, mesh), refused before any run starts: one line naming the run."""
  import tpu_pod
  parser = tpu_pod.make_parser()

  def error(message: str):
    raise ConfigError("", f"after --: {parser.one_line(message)} (tpu_pod.py, run {name})")
  parser.error = error
  pod_args = parser.parse_args(cmd[2:])
  try:
    tpu_pod.Pod(pod_args)   # checks only: it calls no gcloud
  except ConfigError as e:
    raise ConfigError(e.option, f"{e.message} (tpu_pod.py, run {name})") from None


def launch_status(code: int) -> str:
  """A run's row after its `tpu_pod.py up` exited with `code`: tpu_pod.py's own exit code for
  a run whose job is alive on its slices (left as it is) is "running", not a failure."""
  from tpu_pod import RUNNING_EXIT
  return {0: "started", RUNNING_EXIT: "running"}.get(code, f"failed ({code})")


def launch_on_tpu_pods(args: argparse.Namespace, runs: list[tuple[str, dict]], config,
                       fields: dict, fixed: dict) -> list[dict]:
  """`tpu_pod.py up` for each run not finished, one after another, on slices named after the
  run (`slice_name`); rows of the runs' launch status. Refuses, before any machine, a sweep
  whose runs in the bucket started under other values (`check_started_runs`), and one whose
  tpu_pod.py call any run would refuse (`check_tpu_pod_call`)."""
  calls = []
  for name, overrides in runs:
    run, workdir = {**fixed, **overrides}, f"{args.root.rstrip('/')}/{name}"
    slices = slice_name(args.name, workdir)
    cmd = tpu_pod_command(args.config, workdir, run, needs_builder(config, run), slices,
                          args.tpu_pod_args)
    done = not args.dry_run and finished(workdir, run, fields)
    if not done:   # a finished run starts nothing: what it would refuse now does not matter
      check_tpu_pod_call(cmd, name)
    calls.append((name, run, workdir, slices, cmd, done))
  if not args.dry_run:
    check_started_runs(args.root, runs, config, fixed)
  rows = []
  for i, (name, run, workdir, slices, cmd, done) in enumerate(calls, 1):
    if args.dry_run:
      print(shlex.join(cmd), flush=True)
      continue
    if done:
      rows.append({"run": name, "status": "done", "slices": slices})
      print(f"[sweep] {i}/{len(runs)} {name}: already done", flush=True)
      continue
    print(f"[sweep] {i}/{len(runs)} {name}: {shlex.join(cmd)}", flush=True)
    code = subprocess.run(cmd, check=False).returncode
    rows.append({"run": name, "status": launch_status(code), "slices": slices})
    print(f"[sweep] {i}/{len(runs)} {name}: {rows[-1]['status']} on {slices}-*", flush=True)
  if not args.dry_run:
    count = {status: sum(r["status"] == status for r in rows) for status in
             ("started", "running", "done")}
    print(f"[sweep] {count['started']}/{len(runs)} runs started, {count['running']} still "
          f"running, {count['done']} done before; each writes "
          f"{args.root.rstrip('/')}/<run>/summary.json when it finishes", flush=True)
  return rows


def run_locally(args: argparse.Namespace, runs: list[tuple[str, dict]], config, fields: dict,
                fixed: dict) -> dict[str, str]:
  """Runs the points one after another on this machine, skipping those already finished;
  returns {run: status}. Ctrl-C or SIGTERM stops the running one (`processes.run_to_end`: on
  SIGTERM it saves its step, within its `train.preemption_grace_seconds`), then the sweep,
  saying that a rerun resumes."""
  check_started_runs(args.root, runs, config, fixed)
  done = {name for name, overrides in runs
          if finished(paths.join(args.root, name), {**fixed, **overrides}, fields)}
  for name, overrides in runs:   # as launch/local.py does: else each run fails on it alone
    if name in done:              # (it starts nothing: its data dir may be gone)
      continue
    try:
      workdir_lib.check_data_dir(run_config(config, {**fixed, **overrides}))
    except ConfigError as e:
      raise ConfigError(e.option, f"{e.message} (run {name})") from None
  status = {}
  previous = signal.signal(signal.SIGTERM, processes.on_sigterm)
  try:
    for i, (name, overrides) in enumerate(runs, 1):
      workdir, run = paths.join(args.root, name), {**fixed, **overrides}
      if name in done:
        print(f"[sweep] {i}/{len(runs)} {name}: already done", flush=True)
        continue
      cmd = command(args.config, workdir, run, needs_builder(config, run))
      print(f"[sweep] {i}/{len(runs)} {name}: {shlex.join(cmd)}", flush=True)
      log_path = paths.local_side(workdir, "sweep.log")   # W/sweep.log; local for a bucket W
      paths.makedirs(os.path.dirname(log_path))
      grace = processes.stop_grace(run.get("train.preemption_grace_seconds",
                                           fields["train.preemption_grace_seconds"]))
      t0 = time.time()
      with open(log_path, "ab") as log:
        code = run_to_end(name, cmd, log, grace, lambda: finished(workdir, run, fields))
      status[name] = "done" if code == 0 else f"failed ({code})"
      print(f"[sweep] {i}/{len(runs)} {name}: {status[name]} in {time.time() - t0:.0f}s "
            f"(log: {log_path})", flush=True)
  except (KeyboardInterrupt, processes.Preempted) as e:
    why = f"preempted ({e.why})" if isinstance(e, processes.Preempted) else "interrupted"
    print(f"\n[{PROG}] {why}: rerun the same command to resume (finished runs are skipped; "
          "a stopped run resumes from its last checkpoint)", flush=True)
    raise
  finally:
    signal.signal(signal.SIGTERM, previous)
  return status


def run_to_end(name: str, cmd: list[str], log, grace: float, done) -> int:
  """`processes.run_to_end` of run `name`; where a signal stops the sweep after the run wrote
  its summary (`done()`: during its last eval, say), the reason says it finished rather than
  that it stopped at a checkpoint."""
  try:
    return processes.run_to_end(f"run {name}", cmd, log, grace)
  except processes.Preempted as e:
    if not done():
      raise
    raise processes.Preempted(f"{e.why.split(';')[0]}; run {name} had finished (its "
                              "summary.json is written)", saved=e.saved) from None


def sweep(args: argparse.Namespace) -> list[dict]:
  if args.launcher not in LAUNCHERS:
    raise ConfigError("", f"--launcher {args.launcher!r}: one of {LAUNCHERS}")
  check_tpu_pod_flags(args)
  path, _, arg = args.config.partition(":")
  try:
    module = config_module(path)
    config = module_config(module, arg)
    hyper = module.get_hyper(arg or None) if hasattr(module, "get_hyper") else None
  except Exception as e:     # the config module's own error, named with the flag that chose it
    raise ConfigError("", f"--config {args.config!r}: {type(e).__name__}: {e}") from None
  check_known_options(config, args.config)   # as every run's realm-train will
  upgrade_config(config)     # a file's old option names, as the runs will read them
  fields = flat_options(config)
  fixed = {}
  for text in args.set:
    key, value = parse_assignment(text, "--set")
    check_key(key, fields, "--set")
    fixed[key] = field_value(config, fields, key, value)
  grid = expand_grid(config, args.grid, hyper)
  both = sorted({key for overrides in grid for key in overrides} & set(fixed))
  if both:
    raise ConfigError("", f"--set {both[0]}: also swept (--grid or get_hyper()); give it in "
                      "one of them")
  runs = [(run_name(overrides), overrides) for overrides in grid]
  named = {}
  for name, overrides in runs:   # one workdir per run: a second would be skipped as done
    if name in named:
      why = (f"{overrides} is given twice (one value spelt two ways?)"
             if named[name] == overrides else f"{named[name]} and {overrides}; give values "
             "that differ in more than '/' or spaces")
      raise ConfigError("", f"two runs would share the workdir {name!r}: {why}")
    named[name] = overrides
  check_runs(config, runs, fixed, args.root)
  print(f"[sweep] {len(runs)} runs of {args.config} under {args.root} ({args.launcher})",
        flush=True)
  if args.launcher == "tpu_pod":
    launched = launch_on_tpu_pods(args, runs, config, fields, fixed)
    if args.dry_run:
      return launched
    # the tables of what the bucket holds now: the runs just started have no summary yet
    # the csv names each run's slices: which to stop, tail or delete
    return results(args, runs, {r["run"]: r["status"] for r in launched},
                   {r["run"]: {"slices": r["slices"]} for r in launched},
                   run_steps(runs, fields, fixed))
  paths.check(args.root, "--root")
  if args.launcher == "print" or args.dry_run:
    for name, overrides in runs:
      run = {**fixed, **overrides}
      print(shlex.join(command(args.config, paths.join(args.root, name), run,
                               needs_builder(config, run))))
    return []
  return results(args, runs, run_locally(args, runs, config, fields, fixed), None,
                 run_steps(runs, fields, fixed))


def run_steps(runs: list[tuple[str, dict]], fields: dict, fixed: dict) -> dict[str, int]:
  """Each run's train.steps (what its summary covers once it finished: `finished`)."""
  return {name: int({**fixed, **overrides}.get("train.steps", fields["train.steps"]))
          for name, overrides in runs}


def results(args: argparse.Namespace, runs: list[tuple[str, dict]], status: dict[str, str],
            extra: dict[str, dict] | None = None,
            steps: dict[str, int] | None = None) -> list[dict]:
  """Every run's summary.json under --root (a local dir or a bucket) as ROOT/results.csv and
  ROOT/results.md, with its `status` and `extra` columns; prints the table. The rows. `steps`:
  each run's train.steps, whose summary alone is its result (`_result`)."""
  metric = args.metric
  for name, _ in runs if not metric else ():
    found = [k for k, v in (_result(args.root, name, steps) or {}).items()
             if k.startswith("eval_") and isinstance(v, (int, float))]
    if found:
      metric = found[0]
      break
  rows = collect(args.root, runs, metric, not args.ascending, status, steps)
  for row in rows:
    row.update((extra or {}).get(row["run"], {}))
  grid = tuple(dict.fromkeys(key for _, overrides in runs for key in overrides))
  csv_path, md_path = write_tables(args.root, rows, metric, grid)
  print(paths.read_text(md_path))
  print(f"[sweep] wrote {csv_path} and {md_path}", flush=True)
  return rows


def main(argv: list[str] | None = None) -> int:
  args = parse_args(upgrade_flags(sys.argv[1:] if argv is None else argv, PROG))
  log.set_verbosity(args.verbosity)
  rows = run_cli(PROG, lambda: sweep(args))
  return 1 if any(str(r.get("status", "")).startswith("failed") for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())

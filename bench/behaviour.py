"""Same behaviour before and after a change: stages of the demo run by two versions of the
code on one prepared data dir and one ICT checkpoint, then each stage's loss traces and final
parameters compared.

  python bench/behaviour.py --base d61a9f2 [--work runs/behaviour] [--steps 150]
      [--stages realm,ict,mixed,distill]

Stages (`--stages`, default realm):
  realm    the demo's deterministic REALM stage: trainer + `realm-index` under launch/local.py
  ict      ICT from scratch (the retriever's warm start)
  mixed    the reader warm-up reading its own block or a retrieved distractor, as drawn
           (`retrieval.candidates=mixed`, the index rebuilt in process)
  distill  REALM with the distillation loss through the score cache, the reader frozen, the
           candidates scored with the index's embeddings (`retrieval.block_gradients` False)

`--base` is a commit (checked out into a git worktree under WORK); the other side is this
working tree. The data dir, the ICT start and the base's stage runs are made once, by the base,
and reused by later calls with the same WORK (a WORK made for another base or world size is
refused; a base run of other arguments, or unfinished, is made again); this tree's runs are
made again on every call. Prints the largest difference of each logged figure over the steps
and whether every parameter array is bitwise equal; exits 1 unless every figure is equal at
every step (NaN where both are NaN; one logged on one side only is a difference) and every
array bitwise equal. Each run's output is also written to WORK/<run>.log (the data dir's to
WORK/prepare.log); a run that fails ends the bench with one line naming it and its log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from realm_jax import paths
from realm_jax.errors import CommandParser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("realm", "ict", "mixed", "distill")
MIN_STEPS = 3   # a checkpoint (and an index version) every steps // 3 steps: at least one
# What a train log line holds that is not a figure of the run: its step and the wall clock
# (every other key is compared: the losses, the learning rate, staleness, entropy, ...)
NOT_FIGURES = ("step", "time", "steps_per_second")
# One stage of the demo, run by the code on PYTHONPATH: argv = config, variant, workdir, data,
# then key=value overrides.
STAGE = """
import sys
try:
  from realm_jax.stages import run_stage
except ImportError:   # a base from before realm_jax/stages.py
  from realm_jax.demo import run_stage
def typed(v):
  if v in ("True", "False"):
    return v == "True"
  for cast in (int, float):
    try:
      return cast(v)
    except ValueError:
      pass
  return v
if __name__ == "__main__":
  name, variant, workdir, data = sys.argv[1:5]
  overrides = {"data.dir": data, "seed": 0}
  overrides.update({k: typed(v) for k, _, v in (a.partition("=") for a in sys.argv[5:])})
  run_stage(variant, (name, None if variant == "-" else variant), overrides, workdir)
"""
PREPARE = """
import sys
from realm_jax.data.world_corpus import prepare_world
from {module} import {loader} as load
if __name__ == "__main__":
  shapes = load("demo_realm").data
  prepare_world(sys.argv[1], int(sys.argv[2]), 0, block_len=shapes.block_len,
                max_sentence_len=shapes.query_len - 2)
"""


class RunFailed(RuntimeError):
  """A run of the base's or this tree's code exited non-zero; the message names its log."""


def run_code(src: str, script: str, *args: str, log: str, what: str) -> None:
  """Runs `script` (written to a file: worker processes re-import their main module) with the
  code of `src` on the path, its output to the console and to `log`.

  Raises:
    RunFailed naming `what` and `log` when it exits non-zero.
  """
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(script)
  env = dict(os.environ, PYTHONPATH=src)
  os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
  try:
    with open(log, "w") as out:
      proc = subprocess.Popen([sys.executable, f.name, *args], cwd=src, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for line in proc.stdout:
        sys.stdout.write(line)
        out.write(line)
      code = proc.wait()
  finally:
    os.remove(f.name)
  if code:
    raise RunFailed(f"{what} exited with code {code}; its output is in {log}")


def stage_args(name: str, ict: str, steps: int) -> list[str]:
  """The STAGE arguments (config, variant, then overrides after the workdir and data) of
  stage `name`: every step logged, no evaluation, a checkpoint at the end."""
  every = [f"train.steps={steps}", "eval.every=0", "train.log_every=1",
           f"train.checkpoint_every={steps // 3}"]
  in_process = ["retrieval.refresh=in_process", f"retrieval.refresh_every={steps // 3}"]
  return {
      "realm": ["demo_realm", "realm", f"init.from_workdir={ict}", *every,
                f"retrieval.refresh_every={steps // 3}"],
      "ict": ["demo_ict", "-", *every],
      "mixed": ["demo_realm", "warmup", f"init.from_workdir={ict}", *every, *in_process,
                "retrieval.candidates=mixed"],
      "distill": ["demo_realm", "realm", f"init.from_workdir={ict}", *every, *in_process,
                  "retrieval.loss=distill", "retrieval.score_cache=True",
                  "train.reader_lr_scale=0.0", "retrieval.block_gradients=False"],
  }[name]


def run_stage_of(src: str, name: str, workdir: str, data: str, ict: str, steps: int,
                 keep: bool) -> None:
  """Stage `name` run by the code at `src` into `workdir`. With `keep` (the base's side), a
  finished run there of the same arguments is kept; anything else is removed and run again."""
  stage = stage_args(name, ict, steps)
  record = os.path.join(workdir, "behaviour_args.json")
  if keep and os.path.exists(os.path.join(workdir, "summary.json")) and \
      (paths.read_json(record) or {}).get("args") == stage:
    return
  shutil.rmtree(workdir, ignore_errors=True)
  config, variant, *overrides = stage
  run_code(src, STAGE, config, variant, workdir, data, *overrides, log=f"{workdir}.log",
           what=f"stage {name} ({os.path.basename(workdir)}, the code at {src})")
  paths.write_json(record, {"args": stage})


def trace(workdir: str) -> dict[int, dict]:
  with open(os.path.join(workdir, "metrics", "train.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r for r in rows if "loss" in r}


def final_params(workdir: str, step: int) -> dict[str, np.ndarray]:
  import jax
  import orbax.checkpoint as ocp
  path = os.path.abspath(os.path.join(workdir, "checkpoints", str(step), "params"))
  tree = ocp.StandardCheckpointer().restore(path)
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def compare(base: str, head: str) -> bool:
  a, b = trace(base), trace(head)
  print(f"steps logged: base {len(a)}, this tree {len(b)}; same steps: {sorted(a) == sorted(b)}")
  figures_same = True
  keys = dict.fromkeys(k for rows in (a, b) for r in rows.values() for k in r)
  for key in (k for k in keys if k not in NOT_FIGURES):
    pairs = [(a[s].get(key), b[s].get(key)) for s in a if s in b]
    pairs = [(x, y) for x, y in pairs if x is not None or y is not None]
    if not pairs:
      continue
    one_side = sum((x is None) != (y is None) for x, y in pairs)
    diffs = [0.0 if x == y else abs(x - y) for x, y in pairs   # (inf == inf: inf - inf is NaN)
             if x is not None and y is not None and not (x != x and y != y)]   # NaN == NaN
    same = not one_side and all(d == 0 for d in diffs)
    figures_same &= same
    worst = float("nan") if any(d != d for d in diffs) else max(diffs, default=0)
    print(f"  {key:<18} max |difference| over {len(diffs)} steps: {worst:.3g}"
          + (f"; logged on one side only at {one_side} steps" if one_side else "")
          + ("" if same else "  DIFFERS"))
  last = max(a)
  pa, pb = final_params(base, last), final_params(head, last)
  # (the same arrays of the same shapes to subtract; bitwise equal also in their dtypes)
  comparable = pa.keys() == pb.keys() and all(pa[k].shape == pb[k].shape for k in pa)
  equal = comparable and all(pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k])
                             for k in pa)
  worst = max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa) if comparable \
      else float("nan")
  print(f"final parameters (step {last}): {len(pa)} arrays, "
        f"{sum(v.size for v in pa.values()):,} values; bitwise equal: {equal}; "
        f"max |difference| {worst:.3g}")
  return sorted(a) == sorted(b) and figures_same and equal


def git_commit(cwd: str, rev: str, what: str) -> str:
  """The full hash `rev` names in the repository at `cwd`; exits naming `what` if none."""
  got = subprocess.run(["git", "rev-parse", "--verify", "--quiet", rev], cwd=cwd,
                       capture_output=True, text=True)
  if got.returncode:
    sys.exit(f"bench/behaviour.py: {what} is not a commit ({cwd})")
  return got.stdout.strip()


def open_work(work: str, base_rev: str, entities: int) -> str:
  """WORK's checkout of the base (made on first use), refused where WORK holds another base or
  another world size: its data, ICT start and base runs are theirs. Returns its path."""
  base_src = os.path.join(work, "base_src")
  base = git_commit(REPO, f"{base_rev}^{{commit}}", f"--base {base_rev!r}")
  if not os.path.isdir(base_src):
    subprocess.run(["git", "worktree", "add", "--detach", "-f", base_src, base],
                   cwd=REPO, check=True)
  top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=base_src,
                       capture_output=True, text=True).stdout.strip()
  if not top or os.path.realpath(top) != os.path.realpath(base_src):
    sys.exit(f"bench/behaviour.py: --work {work}: {base_src} is not a git worktree of its "
             f"own: remove {work} and run `git worktree prune`")
  settings, path = {"base": base, "entities": entities}, os.path.join(work, "settings.json")
  made = paths.read_json(path)
  if made is None:   # a new WORK; or one of before this record: its world unknown
    made = {"base": git_commit(base_src, "HEAD", f"{base_src}'s HEAD"),
            "entities": None if os.path.exists(os.path.join(work, "data")) else entities}
    paths.write_json(path, made)
  differ = [f"{key} {str(made[key])[:12]} (not {str(value)[:12]})"
            for key, value in settings.items() if made.get(key) not in (value, None)]
  if differ:
    sys.exit(f"bench/behaviour.py: --work {work} holds {', '.join(differ)}: give another "
             f"--work, or remove {work} and run `git worktree prune`")
  return base_src


def main() -> int:
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--base", required=True, help="the commit to compare against")
  parser.add_argument("--work", default=os.path.join(REPO, "runs", "behaviour"))
  parser.add_argument("--steps", type=int, default=150, help="steps of each stage (REALM: 3 "
                      "index versions)")
  parser.add_argument("--stages", default="realm", help="comma-separated: realm, ict, mixed, "
                      "distill (see the module doc)")
  parser.add_argument("--entities", type=int, default=600, help="size of the world")
  args = parser.parse_args()
  stages = args.stages.split(",")
  unknown = [name for name in stages if name not in STAGES]
  if unknown:   # before the data, the ICT start and the other stages are made
    parser.error(f"--stages: unknown {', '.join(map(repr, unknown))}; one or more of "
                 f"{', '.join(STAGES)}, comma-separated")
  if args.steps < MIN_STEPS:
    parser.error(f"--steps {args.steps} must be >= {MIN_STEPS}: the stages checkpoint (and "
                 "refresh the index) every steps // 3 steps")
  if args.entities < 1:
    parser.error(f"--entities {args.entities} must be >= 1")
  try:
    return compare_stages(args, stages)
  except RunFailed as e:
    print(f"bench/behaviour.py: error: {e}", file=sys.stderr)
    return 1


def compare_stages(args, stages: list[str]) -> int:
  """Makes what the stages share, runs each on both sides, compares; the exit code."""
  work = os.path.abspath(args.work)
  base_src = open_work(work, args.base, args.entities)
  data, ict = os.path.join(work, "data"), os.path.join(work, "ict")
  if not os.path.exists(os.path.join(data, "stats.json")):
    loader = "repo_config" if os.path.exists(os.path.join(base_src, "realm_jax", "train",
                                                          "run.py")) else "load_config"
    module = "realm_jax.stages" if os.path.exists(os.path.join(base_src, "realm_jax",
                                                               "stages.py")) else "realm_jax.demo"
    run_code(base_src, PREPARE.format(module=module, loader=loader), data, str(args.entities),
             log=os.path.join(work, "prepare.log"), what="the data dir (the base's code)")
  if not os.path.exists(os.path.join(ict, "summary.json")):
    run_code(base_src, STAGE, "demo_ict", "-", ict, data, "train.steps=150", "eval.every=0",
             log=f"{ict}.log", what="the ICT start (the base's code)")
  verdicts = {}
  for name in stages:
    base_run, head_run = (os.path.join(work, f"{name}_{side}") for side in ("base", "head"))
    run_stage_of(base_src, name, base_run, data, ict, args.steps, keep=True)
    run_stage_of(REPO, name, head_run, data, ict, args.steps, keep=False)   # this tree changes
    print(f"== {name}")
    verdicts[name] = compare(base_run, head_run)
  for name, same in verdicts.items():
    print(f"{name}: {'SAME BEHAVIOUR' if same else 'BEHAVIOUR CHANGED'}")
  return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
  sys.exit(main())

"""The host CPU's train step under glibc's default malloc and under the Makefile's setting
(`GLIBC_TUNABLES`, exported by `make` where no NVIDIA GPU or TPU device is): the median step's
wall seconds; per step on average (the process's rusage over the timed steps) the CPU seconds
in user and kernel mode and the minor page faults; the resident memory after them (GiB); and
whether the two give the same loss bit for bit. Every variable glibc's malloc
reads (`GLIBC_TUNABLES`, `MALLOC_*`) is removed from the default's environment.

Each setting runs in a process of its own (glibc reads them at start-up): bench/train_step.py's
case (`real`: configs/real_realm.py:realm with its reader scoring every candidate, the
recipe's heaviest CPU step; `demo`: configs/demo_realm.py), a random batch, 2 untimed steps,
then `--steps` timed ones. Run it on an idle machine: the wall figures are the point.

  python bench/host_malloc.py [--case real|demo] [--batch 8] [--steps 5]
      [--out runs/bench_host_malloc.jsonl]

With `--out` the figures are appended there as one JSON line (`"bench": "host_malloc"`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time

from report import append_jsonl, host_cpu, host_cpu_text, positive_int   # bench/: sys.path[0]

from realm_jax.errors import CommandParser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


SETTINGS = r"GLIBC_TUNABLES|MALLOC_\w+"   # the environment variables glibc's malloc reads


def makefile_settings() -> dict[str, str]:
  """The `export GLIBC_TUNABLES ?= V` (or MALLOC_X) lines of the Makefile (their one owner)."""
  with open(os.path.join(REPO, "Makefile")) as f:
    return dict(re.findall(rf"^export ({SETTINGS}) \?= (\S+)$", f.read(), re.M))


def child(case: str, batch: int, steps: int) -> None:
  """One setting: the timed steps' figures as a JSON line on stdout."""
  sys.path.insert(0, os.path.join(REPO, "bench"))
  import jax
  import numpy as np
  import train_step as ts
  from realm_jax.runtime import partitioning, state as state_lib
  from realm_jax.train import steps as steps_lib
  config = ts.case_config(case, False, batch)
  mesh = partitioning.make_mesh(config.mesh.shape)
  model = state_lib.build_model(config, config.model.vocab_size)
  rng = jax.random.PRNGKey(0)
  abstract, shardings = state_lib.abstract_train_state(config, model, mesh,
                                                       config.data.block_len, rng)
  state = ts.random_state(abstract, shardings)
  step = steps_lib.make_train_step(config, model, shardings, mesh)
  data = partitioning.global_batch(ts.random_batch(config, np.random.default_rng(0)), mesh)
  with partitioning.mesh_rules(mesh, partitioning.logical_rules(config.mesh.rules)):
    compiled = step.jitted.lower(state, data, rng).compile()
  for _ in range(2):                     # untimed: compiled, the allocator at its steady state
    state, metrics = compiled(state, data, rng)
    jax.block_until_ready(state)
  before, t0, walls = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), []
  for _ in range(steps):
    t = time.perf_counter()
    state, metrics = compiled(state, data, rng)
    jax.block_until_ready(state)
    walls.append(time.perf_counter() - t)
  after = resource.getrusage(resource.RUSAGE_SELF)
  with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  print(json.dumps({
      "wall_s": statistics.median(walls), "user_s": (after.ru_utime - before.ru_utime) / steps,
      "sys_s": (after.ru_stime - before.ru_stime) / steps,
      "faults": (after.ru_minflt - before.ru_minflt) / steps, "rss_gib": rss / 2**30,
      "loss": float(metrics["loss"]).hex(), "total_s": time.perf_counter() - t0}))


def main() -> None:
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--case", choices=("real", "demo"), default="real")
  parser.add_argument("--batch", type=positive_int, default=8, help="queries per step")
  parser.add_argument("--steps", type=positive_int, default=5,
                      help="timed steps per setting (>= 1)")
  parser.add_argument("--out", default="", help="append the figures as a JSON line here")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return child(args.case, args.batch, args.steps)
  settings = makefile_settings()
  if not settings:
    raise SystemExit(f"bench: no `export GLIBC_TUNABLES ?= ...` line in {REPO}/Makefile")
  base = {k: v for k, v in os.environ.items() if not re.fullmatch(SETTINGS, k)}
  base.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  rows = {}
  for name, env in (("glibc default", base), ("Makefile", {**base, **settings})):
    print(f"[bench] {name}: {' '.join(f'{k}={env[k]}' for k in settings if k in env) or '-'}",
          flush=True)
    out = subprocess.run([sys.executable, __file__, "--child", "--case", args.case, "--batch",
                          str(args.batch), "--steps", str(args.steps)], env=env, cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode:
      raise SystemExit(f"bench: the {name} run failed:\n{out.stderr[-3000:]}")
    rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
  print(f"\n{args.case} case, batch {args.batch}, {args.steps} timed steps, {os.cpu_count()} "
        f"cores of {host_cpu_text()}; wall: the median step, user, sys and faults: the mean "
        "per step, RSS: after the steps:")
  print(f"  {'malloc':<14}{'wall s':>8}{'user s':>8}{'sys s':>8}{'faults':>10}{'RSS GiB':>9}")
  for name, r in rows.items():
    print(f"  {name:<14}{r['wall_s']:>8.3f}{r['user_s']:>8.3f}{r['sys_s']:>8.3f}"
          f"{r['faults']:>10,.0f}{r['rss_gib']:>9.2f}")
  a, b = rows.values()
  print(f"  Makefile / default wall: {b['wall_s'] / a['wall_s']:.3f}; same loss bit for bit: "
        f"{'yes' if a['loss'] == b['loss'] else 'NO'}")
  append_jsonl(args.out, {"bench": "host_malloc", "case": args.case, "batch": args.batch,
                          "steps": args.steps, **host_cpu(), "cores": os.cpu_count(),
                          "settings": settings, "runs": rows, "same_loss": a["loss"] == b["loss"],
                          "time": time.time()})


if __name__ == "__main__":
  main()

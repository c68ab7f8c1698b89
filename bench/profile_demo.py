"""Where the demo's time goes: its stages, the REALM stage's parts, and one REALM step by op.

Two parts, both printed as tables (and appended as one JSON line to `--out`):

  run      from a finished demo workdir (`--demo`, default runs/demo): seconds per stage
           (summary.json); for the REALM stage, the evaluations (each from the train log line
           of its step to its eval record), the trainer's waits for index versions, the
           builder's embedding time (which shares the cores with the trainer), and the rest:
           train steps with their host feed, logging and checkpoints
  step     one demo REALM train step (configs/demo_realm.py, batch 32 x its k, a random batch of
           the real shapes) under `jax.profiler`: wall ms per step, and the device time of
           the compiled program's ops grouped by forward / backward, model part (the block
           and query towers of the retriever re-scoring the candidates, the reader's encoder,
           its MLM head and log-softmax, and "loss, optimizer, glue": the rest) and op kind
           (matmul, elementwise, reduction, data movement)

The parts are read from the op names JAX gives the compiled ops, which carry the Flax modules'
scopes; Adam's update and the gradient clipping carry none (optax adds no scope), so they are
counted in "loss, optimizer, glue" with the loss and what joins the parts.

  python bench/profile_demo.py [--demo runs/demo] [--steps 10] [--out runs/profile_demo.jsonl]
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.train import steps
from realm_jax.runtime.metrics import read_jsonl
from realm_jax.errors import CommandParser
from report import append_jsonl, host_cpu, host_cpu_text, positive_int   # bench/: sys.path[0]
from train_step import case_config, random_batch

REPO = pathlib.Path(__file__).resolve().parents[1]
RUNTIME_EVENTS = ("ThunkExecutor", "PjRt", "Pjit", "SlinkyThreadPool", "ParseArguments",
                  "Handle inputs", "AllocateOutput")


def run_breakdown(demo: str) -> dict:
  """Stage seconds and the REALM stage's parts from a finished demo workdir."""
  with open(os.path.join(demo, "summary.json")) as f:
    summary = json.load(f)
  realm = os.path.join(demo, "realm")
  with open(os.path.join(realm, "summary.json")) as f:
    realm_summary = json.load(f)
  train = {r["step"]: r["time"] for r in read_jsonl(os.path.join(realm, "metrics",
                                                                 "train.jsonl"))}
  evals = read_jsonl(os.path.join(realm, "metrics", "eval.jsonl"))
  eval_s = sum(r["time"] - train[r["step"]] for r in evals if r["step"] in train)
  embed_s = sum(r.get("embed_seconds", 0.0) for r in read_jsonl(
      os.path.join(realm, "metrics", "index.jsonl")))
  wall = realm_summary["wall_seconds"]
  wait = realm_summary.get("index_wait_seconds", 0.0)
  parts = {"evaluations (after step 0)": eval_s, "waits for index versions": wait,
           "steps, feed, logs, checkpoints": wall - eval_s - wait}
  return {"stage_seconds": summary.get("stage_seconds", {}),
          "demo_wall_seconds": summary.get("wall_seconds"),
          "realm_wall_seconds": wall, "realm_steps": realm_summary.get("steps"),
          "realm_parts": {k: round(v, 1) for k, v in parts.items()},
          "builder_embed_seconds": round(embed_s, 1)}


def op_kind(op_name: str) -> str:
  """The kind of the JAX primitive an HLO instruction came from (the op_name's last part)."""
  primitive = op_name.rstrip("/").rsplit("/", 1)[-1]
  if "dot_general" in primitive or "BTNH" in primitive or "BNTS" in primitive:
    return "matmul"
  if re.search(r"reduce|argmax|cumsum", primitive):
    return "reduction"
  if re.search(r"broadcast|reshape|transpose|copy|concatenate|slice|gather|scatter|pad|"
               r"select|squeeze|expand_dims|convert|iota|dynamic", primitive):
    return "data movement"
  return "elementwise"


def model_part(op_name: str) -> str:
  """The part of the model an op belongs to, from the module scopes in its op_name."""
  if "embed_blocks" in op_name:
    return "block tower"
  if "embed_queries" in op_name:
    return "query tower"
  if ("cls/" in op_name or "log_softmax" in op_name or "take_along_axis" in op_name
      or ("label_log_probs" in op_name and "mask_logits" not in op_name)):
    return "reader MLM head + log-softmax"
  if "reader" in op_name:
    return "reader encoder"
  return "loss, optimizer, glue"   # the optimizer's ops carry no scope to tell them apart


def hlo_metadata(compiled) -> dict[str, str]:
  """HLO instruction name -> the op_name of its JAX source (scopes, jvp / transpose)."""
  meta = {}
  for line in compiled.as_text().split("\n"):
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", line)
    if m:
      meta[m.group(1)] = m.group(2)
  return meta


def step_profile(num_steps: int) -> dict:
  """Profiles `num_steps` demo REALM steps; device ms per step by group."""
  config = case_config("demo", False, None)
  mesh = partitioning.make_mesh(config.mesh.shape)
  model = state_lib.build_model(config, config.model.vocab_size)
  rng = jax.random.PRNGKey(0)
  state, shardings, _ = state_lib.create_train_state(config, model, mesh,
                                                     config.data.block_len, rng)
  train_step = steps.make_train_step(config, model, shardings, mesh)
  batch = partitioning.global_batch(random_batch(config, np.random.default_rng(0)), mesh)
  with partitioning.mesh_rules(mesh, partitioning.logical_rules(config.mesh.rules)):
    meta = hlo_metadata(train_step.jitted.lower(state, batch, rng).compile())
  for _ in range(3):
    state, metrics = train_step(state, batch, rng)
  jax.block_until_ready(metrics)
  times = []
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(num_steps):
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch, rng)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    trace = sorted(glob.glob(os.path.join(trace_dir, "plugins/profile/*/*.trace.json.gz")))[-1]
    with gzip.open(trace) as f:
      events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
  groups = collections.Counter()
  for e in events:
    name = e["name"]
    if name.startswith("$") or name.startswith(RUNTIME_EVENTS) or name not in meta:
      continue
    op_name = meta[name]
    direction = "backward" if "transpose(" in op_name else "forward"
    groups[direction, model_part(op_name), op_kind(op_name)] += e["dur"] / 1e3
  per_step = {" | ".join(k): round(v / num_steps, 2) for k, v in groups.most_common()}
  return {"step_ms_median": round(statistics.median(times) * 1e3, 1),
          "device_op_ms_per_step": round(sum(groups.values()) / num_steps, 1),
          "threads": os.cpu_count(), "groups_ms_per_step": per_step}


def print_report(record: dict) -> None:
  run = record.get("run")
  if run:
    print("\nstage seconds:", ", ".join(f"{k} {v}" for k, v in run["stage_seconds"].items()),
          f"(demo wall {run['demo_wall_seconds']} s)")
    print(f"REALM stage: {run['realm_wall_seconds']} s for {run['realm_steps']} steps")
    for name, seconds in run["realm_parts"].items():
      print(f"  {name:<34} {seconds:8.1f} s  {seconds / run['realm_wall_seconds']:6.1%}")
    print(f"  (the builder embedded for {run['builder_embed_seconds']} s on the same cores)")
  step = record["step"]
  print(f"\none demo REALM step: {step['step_ms_median']} ms wall (median); device ops "
        f"{step['device_op_ms_per_step']} ms summed over {step['threads']} threads")
  by = collections.defaultdict(float)
  for key, ms in step["groups_ms_per_step"].items():
    direction, part, kind = key.split(" | ")
    by["part", f"{direction} {part}"] += ms
    by["kind", kind] += ms
  total = step["device_op_ms_per_step"]
  for axis in ("part", "kind"):
    print(f"  by {axis}:")
    for (a, name), ms in sorted(by.items(), key=lambda kv: -kv[1]):
      if a == axis:
        print(f"    {name:<40} {ms:8.1f} ms  {ms / total:6.1%}")


def main(argv=None) -> None:
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--demo", default=str(REPO / "runs/demo"),
                      help="a finished `make demo` workdir ('' to skip the run part)")
  parser.add_argument("--steps", type=positive_int, default=10, help="profiled steps (>= 1)")
  parser.add_argument("--out", default="", help="append the JSON record here")
  args = parser.parse_args(argv)
  record = {"bench": "profile_demo", "backend": jax.default_backend(), "jax": jax.__version__,
            **host_cpu()}
  print(f"[profile] host CPU {host_cpu_text()}", flush=True)
  if args.demo and os.path.exists(os.path.join(args.demo, "summary.json")):
    record["run"] = run_breakdown(args.demo)
  elif args.demo:
    print(f"[profile] no finished demo under {args.demo}: step profile only", flush=True)
  record["step"] = step_profile(args.steps)
  print_report(record)
  append_jsonl(args.out, record)


if __name__ == "__main__":
  main(sys.argv[1:])

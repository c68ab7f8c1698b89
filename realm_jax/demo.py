"""`make demo`: REALM end to end on the generated knowledge world.

world -> blocks -> reader warm-up (ICT beside it) -> REALM (the no-retrieval baseline beside it)
-> evaluation on masked sentences about held-out entities -> `W/summary.json`, `W/curves.png`,
a table and example predictions with their evidence. Every stage is an ordinary `realm-train`
run in its own sub-workdir, so an interrupted demo resumes where it stopped. The two stages of
a pair run at once, each in a process of its own (the second's output in
`W/<stage>/logs/stage.log`); one that fails stops the other as soon as it ends.

  python -m realm_jax.demo --workdir runs/demo --seed 0
"""

from __future__ import annotations

import os
import shutil

from realm_jax import log, paths, workdir as workdir_lib
from realm_jax.errors import CommandParser, ConfigError
from realm_jax.stages import (HOST_DEVICES, check_arguments, check_demo_flags, demo_lock,
                              devices, repo_config, run_demo_cli, run_stages, split_host,
                              stage_seconds, trained_nothing)


def demo_stages() -> list:
  """The four training stages in two rounds; the stages of a round run at once (`run_stages`).

  A stage is (name, config file, its arg, init): init names the stage whose params it starts
  from ("" none), or {part: stage} per part. The reader warm-up starts from nothing: its
  retriever is frozen and plays no part, and its reader starts from the same seed's initial
  values that ICT (which trains the retriever alone) would have handed it; so it runs beside
  ICT, and REALM and the baseline take the retriever from ICT and the reader from the warm-up.
  """
  after = {"retriever": "ict", "reader": "warmup"}
  return [[("warmup", "demo_realm", "warmup", ""), ("ict", "demo_ict", None, "")],
          [("realm", "demo_realm", "realm", after),
           ("no_retrieval", "demo_realm", "no_retrieval", after)]]


def _check_world_size(data_dir: str, entities: int) -> None:
  """A world with fewer training queries than a stage's batch is removed (the workdir then
  takes other flags) and refused naming --entities: every stage would fail on it."""
  queries = (paths.read_json(os.path.join(data_dir, "stats.json")) or {}).get(
      "examples", {}).get("train")
  batch = max(repo_config(name, arg).train.batch_size
              for round_ in demo_stages() for _, name, arg, _ in round_)
  if queries is not None and queries < batch:
    shutil.rmtree(data_dir, ignore_errors=True)
    raise ConfigError("", f"--entities {entities}: the world holds {queries} training queries, "
                      f"fewer than a stage's batch ({batch}); give more entities (about "
                      f"{-(-batch * entities // max(queries, 1))} or more)")


def plot_curves(realm_dir: str, out_path: str) -> None:
  """Loss, entropy of p(z|x), recall and span accuracy of the REALM stage over steps."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from realm_jax.runtime.metrics import read_jsonl
  train = read_jsonl(os.path.join(realm_dir, "metrics", "train.jsonl"))
  evals = read_jsonl(os.path.join(realm_dir, "metrics", "eval.jsonl"))
  fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
  panels = [("loss", train, "train loss (-log p(y|x))"),
            ("retrieval_entropy", train, "entropy of p(z|x), nats (train)"),
            (("recall_at_1", "recall_at_5"), evals, "held-out recall"),
            ("span_accuracy", evals, "held-out span accuracy")]
  for ax, (keys, rows, title) in zip(axes, panels):
    for key in (keys if isinstance(keys, tuple) else (keys,)):
      points = [(r["step"], r[key]) for r in rows if key in r]
      if points:
        ax.plot(*zip(*points), marker="o", markersize=3, label=key)
    ax.set_title(title)
    ax.set_xlabel("REALM step")
    ax.grid(alpha=0.3)
    if isinstance(keys, tuple):
      ax.legend()
  fig.tight_layout()
  fig.savefig(out_path, dpi=100)
  plt.close(fig)


def print_report(summary: dict, examples: list[dict]) -> None:
  rows = [("recall@1 after ICT", "recall_at_1_ict"), ("recall@5 after ICT", "recall_at_5_ict"),
          ("recall@1 after REALM", "recall_at_1_realm"),
          ("recall@5 after REALM", "recall_at_5_realm"),
          ("span accuracy, REALM", "span_accuracy_realm"),
          ("span accuracy, no retrieval", "span_accuracy_no_retrieval"),
          ("log retrieval utility, REALM", "retrieval_utility_realm"),
          ("wall seconds", None)]
  print("\n== REALM demo: masked facts about held-out entities ==")
  for label, key in rows:
    value = summary.get(key) if key else workdir_lib.wall_all_runs(summary)
    print(f"  {label:<32} {value:>8.3f}" if isinstance(value, float) else
          f"  {label:<32} {value!s:>8}")
  print("\n== example predictions (top evidence by p(z|x)) ==")
  for ex in examples:
    mark = "ok " if ex["correct"] else "ERR"
    print(f"[{mark}] {ex['query']}\n      answer: {ex['answer']!r}  predicted: "
          f"{ex['prediction']!r}")
    for ev in ex["evidence"]:
      print(f"      p={ev['p_z']:.2f}  {ev['title']}: {ev['text'][:90]}")


def run_demo(workdir: str, seed: int, entities: int, host_devices: int = HOST_DEVICES) -> dict:
  """The whole demo; returns the summary written to `workdir/summary.json`."""
  # the device count the REALM stage sees too ($XLA_FLAGS' wins): the summary's `devices`
  with demo_lock(workdir):
    check_arguments(workdir, {"seed": seed, "entities": entities,
                              "host_devices": split_host(dict(os.environ), host_devices)[1]},
                    "WORKDIR")
    with workdir_lib.RunWall(workdir) as wall:   # a resumed demo adds its earlier runs
      return _run_demo(workdir, seed, entities, host_devices, wall)


def _run_demo(workdir: str, seed: int, entities: int, host_devices: int,
              wall: workdir_lib.RunWall) -> dict:
  from realm_jax.data.world_corpus import prepare_world
  previous = workdir_lib.read_summary(workdir)   # a finished demo run again reports it
  data_dir = os.path.join(workdir, "data")
  with wall.input_checks():   # a world refused for its size adds no run to W/wall.json
    if not os.path.exists(os.path.join(data_dir, "stats.json")):
      print(f"[demo] generating the world ({entities} entities, seed {seed}) -> {data_dir}",
            flush=True)
      shapes = repo_config("demo_realm").data  # the world is cut to the demo's shapes
      stats = prepare_world(data_dir, entities, seed, block_len=shapes.block_len,
                            max_sentence_len=shapes.query_len - 2)
      print(f"[demo] {stats['blocks']:,} blocks, {stats['examples']['train']:,} training "
            f"queries, {stats['examples']['eval']:,} held-out eval queries, vocab "
            f"{stats['vocab_size']:,}", flush=True)
    _check_world_size(data_dir, entities)
  results = run_stages(demo_stages(), data_dir, workdir, seed, host_devices)
  if trained_nothing(previous, results):
    wall.keep(previous)
  _, stage_devices = split_host(dict(os.environ), host_devices)
  summary = {
      "seed": seed, "entities": entities, "devices": devices(stage_devices),
      "recall_at_1_ict": results["ict"].get("eval_recall_at_1"),
      "recall_at_5_ict": results["ict"].get("eval_recall_at_5"),
      "recall_at_1_realm": results["realm"].get("eval_recall_at_1"),
      "recall_at_5_realm": results["realm"].get("eval_recall_at_5"),
      "span_accuracy_realm": results["realm"].get("eval_span_accuracy"),
      "span_accuracy_no_retrieval": results["no_retrieval"].get("eval_span_accuracy"),
      "retrieval_utility_realm": results["realm"].get("eval_retrieval_utility"),
      "span_accuracy_warmup": results["warmup"].get("eval_span_accuracy"),
      "stage_seconds": stage_seconds(results),
      **wall.record(),
  }
  workdir_lib.write_summary(workdir, summary)
  plot_curves(os.path.join(workdir, "realm"), os.path.join(workdir, "curves.png"))
  print_report(summary, results["realm"].get("examples", []))
  print(f"\n[demo] wrote {workdir}/summary.json and {workdir}/curves.png")
  return summary


def main() -> None:
  parser = CommandParser(prog="demo", description="REALM demo on the generated knowledge world")
  parser.add_argument("--workdir", default="runs/demo", help="where everything is written")
  parser.add_argument("--seed", type=int, default=0, help="world and initialisation seed")
  parser.add_argument("--entities", type=int, default=2000, help="entities in the world "
                      "(about 4 blocks each)")
  parser.add_argument("--host_devices", type=int, default=HOST_DEVICES,
                      help="JAX devices the REALM stage's processes see the host CPU as (0: "
                      "JAX's default; a count in $XLA_FLAGS wins); the batch must divide by it")
  log.add_verbosity_argument(parser)
  args = parser.parse_args()
  check_demo_flags(parser, args)
  log.set_verbosity(args.verbosity)
  run_demo_cli("demo", lambda: run_demo(args.workdir, args.seed, args.entities,
                                        args.host_devices))


if __name__ == "__main__":
  main()

"""`make demo-squad`: REALM in miniature on a SQuAD-format file, with zero-shot retrieval;
`make demo-openqa`: then Open-QA fine-tuning from the REALM and the ICT checkpoints.

prepare (configs/squad_realm.py:prepare) -> ICT -> reader warm-up -> REALM (each an ordinary
`realm-train` stage in its own sub-workdir, so an interrupted run resumes) -> recall@1/5/20 of
the answer paragraph for the file's questions: ICT retriever, REALM retriever, BM25.
With --openqa: after the same pre-training, configs/squad_openqa.py fine-tunes each of the
REALM and ICT checkpoints on the training articles' questions and `realm-eval` scores both on
the test articles (EM, F1, recall@k).

  python -m realm_jax.demo_squad --workdir runs/squad [--squad PATH] [--openqa]
"""

from __future__ import annotations

import os

from realm_jax import log, paths, workdir as workdir_lib
from realm_jax.errors import CommandParser
from realm_jax.stages import (check_arguments, check_demo_flags, demo_lock, prepare_demo_data,
                              repo_config, run_demo_cli, run_stage, run_stages, stage_seconds)

STAGES = (("ict", ""), ("warmup", "ict"), ("realm", "warmup"))
OPENQA_STAGES = (("openqa_realm", "realm"), ("openqa_ict", "ict"))   # (stage, starts from)
OPENQA_WALL = "wall_openqa.json"   # demo-openqa's runs (W/wall.json: demo-squad's)


def pretrain(workdir: str, squad: str, seed: int, wall: workdir_lib.RunWall,
             openqa: bool = False) -> tuple[str, str, dict, dict]:
  """prepare -> ICT -> warm-up -> REALM (for Open-QA, once its questions are checked; a run
  refused there adds no run to `wall`). Returns (data dir, source, prepare stats, stage
  summaries)."""
  data_dir = os.path.join(workdir, "data")
  prep = repo_config("squad_realm", "prepare")
  if squad:
    prep.source = f"squad:{squad}"
  prep.out_dir = data_dir
  path = prep.source.partition(":")[2]
  with wall.input_checks():
    if not os.path.exists(path):
      raise FileNotFoundError(f"{path}: no such file (pass --squad PATH)")
    print(f"[demo-squad] preparing {path} -> {data_dir}", flush=True)
    stats = prepare_demo_data(prep, workdir, "SQUAD_WORKDIR")
    if openqa:
      check_openqa_questions(prep.source)
  results = run_stages([(name, "squad_realm", name, init_from) for name, init_from in STAGES],
                       data_dir, workdir, seed)
  return data_dir, prep.source, stats, results


def check_openqa_questions(source: str) -> None:
  """Before any training: the file's training and held-out articles both have questions (a
  file whose articles all fall on one side of `qa.heldout_articles` stops here, naming it)."""
  from realm_jax.data.qa import qa_split
  config = repo_config("squad_openqa", "realm")
  config.qa.train = config.qa.test = source
  train, _ = qa_split(config.qa, "train")
  test, _ = qa_split(config.qa, "test")
  print(f"[demo-openqa] questions: {len(train):,} to fine-tune on, {len(test):,} to test",
        flush=True)


def run_demo_squad(workdir: str, squad: str = "", seed: int = 0) -> dict:
  with demo_lock(workdir):
    check_arguments(workdir, {"seed": seed}, "SQUAD_WORKDIR")   # the file: prepare's own check
    with workdir_lib.RunWall(workdir) as wall:   # a resumed demo adds its earlier runs
      return _run_demo_squad(workdir, squad, seed, wall)


def _run_demo_squad(workdir: str, squad: str, seed: int, wall: workdir_lib.RunWall) -> dict:
  from realm_jax.retrieval.zero_shot import format_table, recall_table
  data_dir, source, stats, results = pretrain(workdir, squad, seed, wall)
  configs = {name: repo_config("squad_realm", name) for name, _ in STAGES}
  print("[demo-squad] zero-shot question retrieval", flush=True)
  table = recall_table(data_dir, {"ict": (configs["ict"], os.path.join(workdir, "ict")),
                                  "realm": (configs["realm"], os.path.join(workdir, "realm"))})
  summary = {
      "source": source, "seed": seed, "paragraphs": stats["documents"],
      "blocks": stats["blocks"], "questions": table["bm25"]["questions"], "recall": table,
      "realm_eval": {k: v for k, v in results["realm"].items() if k.startswith("eval_")},
      "stage_seconds": stage_seconds(results),
      **wall.record(),
  }
  workdir_lib.write_summary(workdir, summary)
  print(f"\n== zero-shot retrieval: {summary['questions']:,} questions, "
        f"{stats['documents']:,} paragraphs in {stats['blocks']:,} blocks ==")
  print(format_table(table))
  print(f"\n[demo-squad] wrote {workdir}/summary.json "
        f"({workdir_lib.wall_all_runs(summary) / 60:.1f} min, all runs)")
  return summary


def run_demo_openqa(workdir: str, squad: str = "", seed: int = 0) -> dict:
  with demo_lock(workdir):
    check_arguments(workdir, {"seed": seed}, "SQUAD_WORKDIR")
    with workdir_lib.RunWall(workdir, OPENQA_WALL) as wall:   # its own record: the workdir
      return _run_demo_openqa(workdir, squad, seed, wall)     # is demo-squad's too


def _run_demo_openqa(workdir: str, squad: str, seed: int, wall: workdir_lib.RunWall) -> dict:
  from realm_jax.openqa_eval import evaluate_run
  data_dir, source, stats, results = pretrain(workdir, squad, seed, wall, openqa=True)
  table = {}
  for name, start in OPENQA_STAGES:
    overrides = {"data.dir": data_dir, "seed": seed,
                 "init.from_workdir": os.path.join(workdir, start)}
    if squad:
      overrides.update({"qa.train": f"squad:{squad}", "qa.test": f"squad:{squad}"})
    results[name] = run_stage(name, ("squad_openqa", start), overrides,
                              os.path.join(workdir, name))
    config = repo_config("squad_openqa", start)
    for key, value in overrides.items():
      parent, _, leaf = key.rpartition(".")
      (config[parent] if parent else config)[leaf] = value
    print(f"[demo-openqa] realm-eval {os.path.join(workdir, name)} on the test articles",
          flush=True)
    table[start], _ = evaluate_run(config, os.path.join(workdir, name), split="test")
    print(f"[demo-openqa] zero-shot retrieval of {os.path.join(workdir, start)} (before "
          "fine-tuning) on the same questions", flush=True)
    before, _ = evaluate_run(config, os.path.join(workdir, start), split="test",
                             retrieval_only=True)
    table[start]["before"] = {k: v for k, v in before.items() if k.startswith("recall_at_")}
  summary = {"source": source, "seed": seed, "blocks": stats["blocks"], "test": table,
             "train_questions": results["openqa_realm"].get("train_questions"),
             "stage_seconds": stage_seconds(results), **wall.record()}
  paths.write_json(os.path.join(workdir, "summary_openqa.json"), summary)
  n = table["realm"]["num_questions"]
  print(f"\n== Open-QA on the test articles: {n:,} questions, {stats['blocks']:,} blocks, "
        f"top {table['realm']['reader_beam']} read ==")
  header = (f"{'pre-training':<14}{'EM':>8}{'F1':>8}{'R@1':>8}{'R@5':>8}{'R@20':>8}"
            f"{'R@5 before':>12}")
  print(header + "\n" + "-" * len(header))
  for start, label in (("realm", "REALM"), ("ict", "ICT only")):
    m = table[start]
    print(f"{label:<14}" + "".join(f"{m.get(k, float('nan')):>8.3f}" for k in (
        "exact_match", "f1", "recall_at_1", "recall_at_5", "recall_at_20")) +
          f"{m['before']['recall_at_5']:>12.3f}")
  print("(R@k: a top-k block contains an answer; 'before': the pre-trained retriever, "
        "zero-shot)")
  print(f"\n[demo-openqa] wrote {workdir}/summary_openqa.json "
        f"({workdir_lib.wall_all_runs(summary) / 60:.1f} min, all runs)")
  return summary


def main() -> None:
  parser = CommandParser(prog="realm-demo-squad", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default="runs/squad", help="where everything is written")
  parser.add_argument("--squad", default="", help="SQuAD v1.1-format JSON file (default: the "
                      "SQuADShifts file of ../shared/data)")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
  parser.add_argument("--openqa", action="store_true", help="then Open-QA fine-tuning from the "
                      "REALM and ICT checkpoints, scored on the test articles")
  log.add_verbosity_argument(parser)
  args = parser.parse_args()
  check_demo_flags(parser, args)
  log.set_verbosity(args.verbosity)
  demo = run_demo_openqa if args.openqa else run_demo_squad
  # W/data's source is the file's absolute path (as typed, the same file named from elsewhere
  # would be another source)
  squad = os.path.abspath(args.squad) if args.squad else ""
  run_demo_cli("realm-demo-squad", lambda: demo(args.workdir, squad, args.seed))


if __name__ == "__main__":
  main()

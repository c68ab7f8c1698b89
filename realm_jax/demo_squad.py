"""`make demo-squad`: REALM in miniature on a SQuAD-format file, with zero-shot retrieval.

prepare (configs/squad_realm.py:prepare) -> ICT -> reader warm-up -> REALM (each an ordinary
`realm-train` stage in its own sub-workdir, so an interrupted run resumes) -> recall@1/5/20 of
the answer paragraph for the file's questions: ICT retriever, REALM retriever, BM25.

  python -m realm_jax.demo_squad --workdir runs/squad [--squad PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from realm_jax.demo import load_config, run_stages
from realm_jax.errors import run_cli

STAGES = (("ict", ""), ("warmup", "ict"), ("realm", "warmup"))


def run_demo_squad(workdir: str, squad: str = "", seed: int = 0) -> dict:
  from realm_jax.data.prepare import prepare
  from realm_jax.retrieval.question_recall import format_table, recall_table
  t0 = time.time()
  data_dir = os.path.join(workdir, "data")
  prep = load_config("squad_realm", "prepare")
  if squad:
    prep.source = f"squad:{squad}"
  prep.out_dir = data_dir
  path = prep.source.partition(":")[2]
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no SQuAD-format file (pass --squad PATH)")
  print(f"[demo-squad] preparing {path} -> {data_dir}", flush=True)
  stats = prepare(prep)
  configs = {name: load_config("squad_realm", name) for name, _ in STAGES}
  results = run_stages([(name, "squad_realm", name, init_from) for name, init_from in STAGES],
                       data_dir, workdir, seed)
  print("[demo-squad] zero-shot question retrieval", flush=True)
  table = recall_table(data_dir, {"ict": (configs["ict"], os.path.join(workdir, "ict")),
                                  "realm": (configs["realm"], os.path.join(workdir, "realm"))})
  summary = {
      "source": prep.source, "seed": seed, "paragraphs": stats["documents"],
      "blocks": stats["blocks"], "questions": table["bm25"]["questions"], "recall": table,
      "realm_eval": {k: v for k, v in results["realm"].items() if k.startswith("eval_")},
      "stage_seconds": {k: v.get("wall_seconds") for k, v in results.items()},
      "wall_seconds": round(time.time() - t0, 1),
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"\n== zero-shot retrieval: {summary['questions']:,} questions, "
        f"{stats['documents']:,} paragraphs in {stats['blocks']:,} blocks ==")
  print(format_table(table))
  print(f"\n[demo-squad] wrote {workdir}/summary.json ({summary['wall_seconds'] / 60:.1f} min)")
  return summary


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workdir", default="runs/squad", help="where everything is written")
  parser.add_argument("--squad", default="", help="SQuAD v1.1-format JSON file (default: the "
                      "SQuADShifts file of ../shared/data)")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
  args = parser.parse_args()
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  run_cli("realm-demo-squad", lambda: run_demo_squad(args.workdir, args.squad, args.seed))


if __name__ == "__main__":
  main()

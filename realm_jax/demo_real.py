"""`make demo-real`: REALM's own recipe on real prose, with a reader that starts from a
pre-trained BERT (all-MiniLM-L6-v2), on any SQuAD v1.1-format file.

prepare (MiniLM's vocab) -> ICT (the retriever) -> reader warm-up (MiniLM's BERT learns an MLM
head and to read its own block) -> REALM (trainer + the separate `realm-index` job) ->
zero-shot retrieval on the held-out articles' questions (untrained start, ICT, REALM, BM25,
all-MiniLM-L6-v2 whole for reference) ->
Open-QA fine-tuning from the REALM checkpoint and from the ICT start (ICT retriever + MiniLM
reader, ORQA's start) with the same settings -> EM / F1 / recall on the held-out articles.
Every stage is an ordinary `realm-train` run in its own sub-workdir (configs/real_realm.py),
so an interrupted demo resumes where it stopped; the evaluations of finished stages are kept
in W/evaluations.json and not repeated. W/summary.json holds every figure.

  python -m realm_jax.demo_real [--workdir W] [--squad PATH] [--seed S] [--scale gpu]

`--scale gpu` runs every stage at configs/real_realm.py's accelerator scale (`VARIANT,gpu`), by
default in runs/real_gpu (runs/real at the CPU scale: the two do not resume each other).
"""

from __future__ import annotations

import bisect
import functools
import glob
import hashlib
import itertools
import json
import os
import platform

from realm_jax import log, paths, workdir as workdir_lib
from realm_jax.errors import CommandParser, ConfigError
from realm_jax.stages import (DEMO_ARGUMENTS, check_arguments, check_demo_flags, demo_lock,
                              devices, prepare_demo_data, repo_config, run_demo_cli, run_stage,
                              stage_seconds, trained_nothing)
from realm_jax.config.overrides import with_overrides
from realm_jax.config.reading import config_record
from realm_jax.packages import MINILM

CONFIG = "real_realm"
MAX_PARAGRAPHS = 2_500   # a larger SQuAD file is read up to this many paragraphs, whole
                         # articles in file order (SQuADShifts: 1,581; SQuAD v1.1 dev: 2,067):
                         # the corpus embeddings, the zero-shot table and the two Open-QA
                         # evaluations grow with it (~10 min of the hour at 1,581)
WORKDIRS = {"cpu": "runs/real", "gpu": "runs/real_gpu"}   # default workdir per scale
UNFOUND_WARNING = 0.1    # the share of questions without an answer span in their paragraph's
                         # blocks (prepare.unfound_questions) over which the recipe warns
# (stage, config variant, init options set to the workdir of the stage they name)
STAGES = (("ict", "ict", {}),
          ("warmup", "warmup", {"init.retriever": "ict"}),
          ("realm", "realm", {"init.from_workdir": "warmup"}))
# (stage, init options as above, other overrides): the same settings, two starts
EVALUATIONS = "evaluations.json"   # W/: the zero-shot table and each Open-QA run's scores, with
                                  # what they were computed from (`evaluated`)
OPENQA_STAGES = (("openqa_realm", {"init.from_workdir": "realm"}, {}),
                 ("openqa_ict", {"init.retriever": "ict"}, {"init.reader": MINILM}))


def _arg(variant: str, scale: str) -> str:
  """configs/real_realm.py's arg for `variant` at `scale` (cpu: the variant alone)."""
  return variant if scale == "cpu" else f"{variant},{scale}"


def _config(variant: str, overrides: dict, scale: str):
  return with_overrides(repo_config(CONFIG, _arg(variant, scale)), overrides)


def squad_file(squad: str) -> str:
  """The SQuAD file the demo is given: `squad`, or the recipe's default (SQuADShifts)."""
  return squad or repo_config(CONFIG, "prepare").source.partition(":")[2]


def prepare_data(workdir: str, squad: str,
                 max_paragraphs: int = MAX_PARAGRAPHS) -> tuple[str, str, dict]:
  """The SQuAD file (or its first `max_paragraphs`, `fit_to_the_hour`) -> W/data with MiniLM's
  vocab. Returns (data dir, source, stats); every stage reads the questions of that source."""
  config = repo_config(CONFIG, "prepare")
  path = squad_file(squad)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path}: no such file (pass SQUAD=PATH / --squad PATH)")
  config.source = f"squad:{fit_to_the_hour(path, workdir, max_paragraphs)}"
  config.out_dir = os.path.join(workdir, "data")
  print(f"[demo-real] preparing {config.source.partition(':')[2]} -> {config.out_dir}",
        flush=True)
  return config.out_dir, config.source, prepare_demo_data(config, workdir, "REAL_WORKDIR")


def fit_to_the_hour(path: str, workdir: str, max_paragraphs: int) -> str:
  """`path`, or, when it holds more than `max_paragraphs` paragraphs (0: no limit), its first
  whole articles up to that many (the first article whole in any case) as W/source-HASH.json,
  so that the corpus and both question sets are the same smaller file. The name carries a
  hash of the content: a rerun with another file or limit meets W/data prepared from another
  source and is refused, rather than mixing the two."""
  from realm_jax.data.sources import read_squad_articles
  articles = read_squad_articles(path)
  totals = list(itertools.accumulate(
      len(a["paragraphs"]) if isinstance(a, dict) and isinstance(a.get("paragraphs"), list)
      else 0 for a in articles))    # paragraphs in the first 1, 2, ... articles
  if not max_paragraphs or not totals or totals[-1] <= max_paragraphs:
    return path
  kept = max(1, bisect.bisect_right(totals, max_paragraphs))
  text = json.dumps({"source": f"the first {kept} articles of {os.path.basename(path)}",
                     "data": articles[:kept]})
  out = os.path.join(workdir, f"source-{hashlib.sha256(text.encode()).hexdigest()[:8]}.json")
  os.makedirs(workdir, exist_ok=True)
  with open(out + ".tmp", "w") as f:
    f.write(text)
  os.replace(out + ".tmp", out)
  print(f"[demo-real] {path}: {len(articles):,} articles, {totals[-1]:,} paragraphs; the "
        f"recipe reads the first {kept:,} articles ({totals[kept - 1]:,} paragraphs) to fit "
        f"its hour -> {out} (--max-paragraphs 0 reads them all)", flush=True)
  return out


def stage_overrides(data_dir: str, source: str, seed: int, workdir: str, inits: dict) -> dict:
  overrides = {"data.dir": data_dir, "seed": seed, "qa.train": source, "qa.test": source,
               "qa.heldout_unit": heldout_unit(data_dir)}
  overrides.update({key: os.path.join(workdir, stage) for key, stage in inits.items()})
  return overrides


def heldout_unit(data_dir: str) -> str:
  """What the recipe holds out (`qa.heldout_unit`): articles by title hash where the held-out
  articles hold between half and twice the recipe's share (`qa.heldout_articles`) of the
  questions; otherwise paragraphs by text hash where they hold out some questions, not all,
  and a share nearer it (a file of one article: paragraphs). Decided once per prepared
  question file (every stage's overrides name it)."""
  questions = os.stat(os.path.join(data_dir, "qa", "eval.jsonl"))
  return _heldout_unit(data_dir, questions.st_mtime_ns, questions.st_size)


@functools.lru_cache(maxsize=4)
def _heldout_unit(data_dir: str, *version) -> str:
  from realm_jax.data.prepared import PreparedData
  from realm_jax.retrieval.zero_shot import heldout_questions, load_questions
  fraction = repo_config(CONFIG, "openqa").qa.heldout_articles
  data, questions = PreparedData(data_dir), load_questions(data_dir)

  def share(unit: str) -> float:
    return len(heldout_questions(data, questions, fraction, unit)) / max(1, len(questions))
  article = share("article")
  if fraction / 2 <= article <= 2 * fraction:
    return "article"
  paragraph = share("paragraph")     # (data prepared without paragraph keys is named here)
  nearer = abs(paragraph - fraction) < abs(article - fraction) or not 0 < article < 1
  return "paragraph" if 0 < paragraph < 1 and nearer else "article"


def check_heldout_unit(workdir: str, unit: str) -> None:
  """Refuses a workdir whose Open-QA stages were begun under the other held-out unit (every
  one before 2026-12-06: articles): reused, they would be scored on questions they trained
  on. The unit is recorded in W/demo_arguments.json beside the seed."""
  path = os.path.join(workdir, DEMO_ARGUMENTS)
  recorded = paths.read_json(path) or {}
  begun = any(os.path.isdir(os.path.join(workdir, name)) for name, _, _ in OPENQA_STAGES)
  before = recorded.get("heldout_unit", "article" if begun else None)
  if before is not None and before != unit:
    raise ConfigError("qa.heldout_unit", f"{workdir} was begun with {before}s held out, and "
                      f"its data now holds out {unit}s: its Open-QA stages, reused, would be "
                      "scored on questions they trained on; give it another workdir "
                      f"(make REAL_WORKDIR=...) or remove {workdir}")
  if recorded.get("heldout_unit") != unit:
    paths.write_json(path, {**recorded, "heldout_unit": unit})


def check_questions(workdir: str, data_dir: str, source: str, seed: int, scale: str) -> None:
  """Before any training: the held-out articles' questions (the zero-shot table, Open-QA's
  test) and the training articles' (Open-QA's fine-tuning) exist. A file whose articles all
  fall on one side of `qa.heldout_articles` fails here, naming it, not after the hour; a
  held-out share far from it, or many questions whose own paragraph gives the reader no
  answer span (`prepare.unfound_questions`), are warned about."""
  from realm_jax.data.prepared import PreparedData
  from realm_jax.data.qa import qa_split
  from realm_jax.data.prepare import by_reason, unfound_questions
  from realm_jax.retrieval.zero_shot import load_questions, table_questions
  config = _config("openqa", stage_overrides(data_dir, source, seed, workdir, {}), scale)
  unit, fraction = config.qa.heldout_unit, config.qa.heldout_articles
  data = PreparedData(data_dir)
  try:
    scored = table_questions(data, data_dir, fraction, unit)
    train, _ = qa_split(config.qa, "train", data_dir)
    test, _ = qa_split(config.qa, "test", data_dir)
  except ConfigError as e:   # qa.heldout_articles is the recipe's (configs/real_realm.py)
    raise ConfigError(e.option, f"{e.message} (demo-real: give a file of more "
                      "articles, or a larger --max-paragraphs)") from None
  held = len(test) / max(1, len(train) + len(test))
  if unit == "paragraph":
    print(f"[demo-real] the file's articles cannot hold out ~{fraction:.0%} of its questions: "
          f"paragraphs are held out instead (qa.heldout_unit=paragraph), {held:.0%} of them",
          flush=True)
  if not fraction / 2 <= held <= 2 * fraction:
    print(f"[demo-real] warning: the held-out {unit}s hold {held:.0%} of the questions, far "
          f"from the recipe's ~{fraction:.0%} (qa.heldout_articles): few to "
          f"{'fine-tune on' if held > fraction else 'test'}", flush=True)
  print(f"[demo-real] questions: {len(scored):,} of the held-out {unit}s for the zero-shot "
        f"table, Open-QA {len(train):,} to fine-tune on and {len(test):,} to test", flush=True)
  # counted here with the reader's span width (and for data prepared before the count)
  questions = load_questions(data_dir)
  unfound = unfound_questions(data_dir, data.tokenizer, questions, config.model.max_span_width)
  if unfound:
    many = sum(unfound.values()) > UNFOUND_WARNING * len(questions)
    print(f"[demo-real] {'warning: ' if many else ''}{sum(unfound.values()):,} of the file's "
          f"{len(questions):,} questions have no answer span in their own paragraph's blocks "
          f"({by_reason(unfound)}): Open-QA's reader has no span to learn from there, and "
          "never predicts an answer spelt with [UNK]", flush=True)


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
  """sha256 of realm_jax's Python sources (names and bytes): what an evaluation was computed
  by, so that a recipe resumed under other code evaluates again."""
  root = os.path.dirname(os.path.abspath(__file__))
  digest = hashlib.sha256()
  for path in sorted(glob.glob(os.path.join(glob.escape(root), "**", "*.py"), recursive=True)):
    with open(path, "rb") as f:
      digest.update(os.path.relpath(path, root).encode() + b"\0" + f.read() + b"\0")
  return digest.hexdigest()


def evaluated(workdir: str, name: str, stages: tuple[str, ...], configs: dict, evaluate):
  """`evaluate()`, or the value an earlier run of the recipe recorded under `name` in
  W/evaluations.json from the same evaluation `configs` (name: ConfigDict), the same
  summaries of the `stages` it reads (a stage trained again has another summary) and the same
  code (`code_digest`): a resumed recipe does not evaluate again."""
  path = os.path.join(workdir, EVALUATIONS)
  key = hashlib.sha256(json.dumps(
      {"configs": {n: config_record(c) for n, c in configs.items()},
       "summaries": {stage: workdir_lib.read_summary(os.path.join(workdir, stage))
                     for stage in stages},
       "code": code_digest()}, sort_keys=True).encode()).hexdigest()
  try:
    record = paths.read_json(path) or {}
  except ValueError:       # a record cut short: evaluate again, and write it whole
    record = {}
  if record.get(name, {}).get("key") == key:
    print(f"[demo-real] {name}: evaluated by an earlier run of the recipe ({path})", flush=True)
    return record[name]["value"]
  value = evaluate()
  paths.makedirs(workdir)
  paths.write_json(path, {**record, name: {"key": key, "value": value}})
  return value


def retrieval_table(workdir: str, data_dir: str, source: str, seed: int, scale: str) -> dict:
  """recall@1/5/20 of the answer paragraph on the held-out articles' questions."""
  from realm_jax.retrieval.zero_shot import format_table, recall_table
  ict = _config("ict", stage_overrides(data_dir, source, seed, workdir, {}), scale)
  realm = _config("realm", stage_overrides(data_dir, source, seed, workdir, {}), scale)
  # MiniLM whole (6 layers): a reference only; it was trained on question-passage pairs
  minilm = _config("ict", {**stage_overrides(data_dir, source, seed, workdir, {}),
                           "model.retriever.num_layers": 6}, scale)
  configs = {"ict": ict, "realm": realm, "minilm_6": minilm}
  table = evaluated(workdir, "retrieval", ("ict", "realm"), configs,
                    lambda: recall_table(data_dir, {
                        "untrained": (ict, ""), "ict": (ict, os.path.join(workdir, "ict")),
                        "realm": (realm, os.path.join(workdir, "realm")),
                        "minilm_6": (minilm, "")}, heldout_articles=ict.qa.heldout_articles,
                        heldout_unit=ict.qa.heldout_unit))
  print(f"\n== zero-shot retrieval: {table['bm25']['questions']:,} questions of the held-out "
        f"{ict.qa.heldout_unit}s ==")
  print(format_table(table))
  return table


def open_qa(workdir: str, data_dir: str, source: str, seed: int,
            scale: str) -> tuple[dict, dict]:
  """Fine-tunes from each start and scores the held-out articles. Returns (table, summaries)."""
  from realm_jax.openqa_eval import evaluate_run
  table, summaries = {}, {}
  for name, inits, extra in OPENQA_STAGES:
    overrides = {**stage_overrides(data_dir, source, seed, workdir, inits), **extra}
    stage_dir = os.path.join(workdir, name)
    summaries[name] = run_stage(name, (CONFIG, _arg("openqa", scale)), overrides, stage_dir)
    print(f"[demo-real] realm-eval {stage_dir} on the held-out {overrides['qa.heldout_unit']}s",
          flush=True)
    config = _config("openqa", overrides, scale)
    table[name] = evaluated(workdir, name, (name,), {name: config}, lambda: (
        evaluate_run(config, stage_dir, split="test")[0]))
  return table, summaries


def print_report(summary: dict) -> None:
  rows = [("zero-shot recall@5, untrained start", "recall_at_5_untrained"),
          ("zero-shot recall@5, ICT", "recall_at_5_ict"),
          ("zero-shot recall@5, REALM", "recall_at_5_realm"),
          ("zero-shot recall@5, BM25", "recall_at_5_bm25"),
          ("zero-shot recall@5, MiniLM whole (ref.)", "recall_at_5_minilm_6"),
          ("span accuracy, REALM reader", "span_accuracy_realm"),
          ("span accuracy, null document only", "span_accuracy_no_retrieval"),
          ("Open-QA EM, from REALM", "exact_match_realm"),
          ("Open-QA EM, from ICT + MiniLM", "exact_match_ict"),
          ("Open-QA F1, from REALM", "f1_realm"),
          ("Open-QA F1, from ICT + MiniLM", "f1_ict"),
          ("Open-QA recall@5, from REALM", "openqa_recall_at_5_realm"),
          ("Open-QA recall@5, from ICT + MiniLM", "openqa_recall_at_5_ict"),
          ("wall minutes (all runs)", "wall_minutes")]
  print(f"\n== REALM on real prose: {summary['source']} (seed {summary['seed']}, "
        f"{summary['scale']} scale, {summary['machine']}) ==")
  for label, key in rows:
    value = summary.get(key)
    print(f"  {label:<40} {value:>8.3f}" if isinstance(value, float) else
          f"  {label:<40} {value!s:>8}")
  print(f"  (recall: the answer paragraph among the top k on the held-out "
        f"{summary.get('heldout_unit', 'article')}s' questions; "
        "every retriever starts from all-MiniLM-L6-v2's first 2 layers, mean-pooled: "
        "untrained, then ICT, then REALM)")


def run_demo_real(workdir: str, squad: str = "", seed: int = 0, scale: str = "cpu",
                  max_paragraphs: int = MAX_PARAGRAPHS) -> dict:
  # (another file or --max-paragraphs: W/data's own check refuses it, `fit_to_the_hour`)
  with demo_lock(workdir):
    check_arguments(workdir, {"seed": seed, "scale": scale}, "REAL_WORKDIR")
    with workdir_lib.RunWall(workdir) as wall:   # a resumed recipe adds its earlier runs
      return _run_demo_real(workdir, squad, seed, scale, max_paragraphs, wall)


def _run_demo_real(workdir: str, squad: str, seed: int, scale: str, max_paragraphs: int,
                   wall: workdir_lib.RunWall) -> dict:
  previous = workdir_lib.read_summary(workdir)   # a finished recipe run again reports it
  evaluations = paths.read_text(os.path.join(workdir, EVALUATIONS))   # ... unless it evaluates
  with wall.input_checks():
    data_dir, source, stats = prepare_data(workdir, squad, max_paragraphs)
    check_heldout_unit(workdir, heldout_unit(data_dir))
    check_questions(workdir, data_dir, source, seed, scale)
  results = {}
  for name, variant, inits in STAGES:
    overrides = stage_overrides(data_dir, source, seed, workdir, inits)
    results[name] = run_stage(name, (CONFIG, _arg(variant, scale)), overrides,
                              os.path.join(workdir, name))
  table = retrieval_table(workdir, data_dir, source, seed, scale)
  qa_table, qa_results = open_qa(workdir, data_dir, source, seed, scale)
  results.update(qa_results)
  if trained_nothing(previous, results) and \
      paths.read_text(os.path.join(workdir, EVALUATIONS)) == evaluations:
    wall.keep(previous)
  realm_eval = results["realm"]
  summary = {
      "source": source, "squad": squad_file(squad), "seed": seed,
      "scale": scale, "paragraphs": stats["documents"], "blocks": stats["blocks"],
      "machine": f"{platform.machine()}, {os.cpu_count()} cores, {devices(0)}",
      "heldout_questions": table["bm25"]["questions"],
      "heldout_unit": heldout_unit(data_dir),
      **{f"recall_at_{k}_{name}": table[name][f"recall_at_{k}"]
         for name in table for k in (1, 5, 20)},
      "span_accuracy_realm": realm_eval.get("eval_span_accuracy"),
      "span_accuracy_no_retrieval": realm_eval.get("eval_span_accuracy_null_document"),
      "span_accuracy_warmup": results["warmup"].get("eval_span_accuracy"),
      "retrieval_utility_realm": realm_eval.get("eval_retrieval_utility"),
      **{f"{metric}_{start}": qa_table[f"openqa_{start}"].get(key)
         for start in ("realm", "ict")
         for metric, key in (("exact_match", "exact_match"), ("f1", "f1"),
                             ("openqa_recall_at_5", "recall_at_5"))},
      "openqa_questions": qa_table["openqa_realm"].get("num_questions"),
      "recall": table, "openqa": qa_table,
      "stage_seconds": stage_seconds(results),
      **wall.record(),
  }
  summary["wall_minutes"] = round(workdir_lib.wall_all_runs(summary) / 60, 1)
  workdir_lib.write_summary(workdir, summary)
  print_report(summary)
  runs = summary.get("runs", 1)   # absent: the wall record could not be kept (warned)
  print(f"\n[demo-real] wrote {workdir}/summary.json ({summary['wall_minutes']} min in "
        f"{runs} run{'s' if runs > 1 else ''})")
  return summary


def main() -> None:
  parser = CommandParser(prog="realm-demo-real", description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", default=None, help="where everything is written (default: "
                      f"{WORKDIRS['cpu']}, or {WORKDIRS['gpu']} with --scale gpu)")
  parser.add_argument("--squad", default="", help="SQuAD v1.1-format JSON file (default: the "
                      "SQuADShifts file of ../shared/data)")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
  parser.add_argument("--scale", default="cpu", choices=tuple(WORKDIRS),
                      help="the recipe's size: cpu (a 2-core CPU hour) or gpu (one accelerator; "
                      "configs/real_realm.py)")
  parser.add_argument("--max-paragraphs", type=int, default=MAX_PARAGRAPHS,
                      help="read a larger file's first whole articles up to this many "
                      "paragraphs, to keep the recipe's hour (0: every paragraph)")
  log.add_verbosity_argument(parser)
  args = parser.parse_args()
  log.set_verbosity(args.verbosity)
  squad = os.path.abspath(args.squad) if args.squad else ""
  if args.workdir is None:   # the scale's (an empty --workdir given is refused below)
    args.workdir = WORKDIRS[args.scale]
  if args.max_paragraphs < 0:
    parser.error(f"--max-paragraphs must be >= 0, got {args.max_paragraphs}")
  check_demo_flags(parser, args)
  run_demo_cli("realm-demo-real", lambda: run_demo_real(args.workdir, squad, args.seed,
                                                        args.scale, args.max_paragraphs))


if __name__ == "__main__":
  main()

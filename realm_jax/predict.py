"""`realm-predict --workdir W "question" ["another question" ...] [--json] [--step N]`: the answer,
its score, and the top evidence blocks with titles and scores, from a fine-tuned Open-QA run
(a pre-training run shows the retrieved blocks only)."""

from __future__ import annotations

import json
import sys
import textwrap

from absl import app, flags

from realm_jax import log
from realm_jax.errors import run_cli
from realm_jax.config.overrides import flags_parser

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with checkpoints and its index.")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step (default: the latest).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object per question.")


def predict(workdir: str, questions: list[str], step: int | None = None) -> list[dict]:
  from realm_jax.data.qa import QAExample
  from realm_jax.openqa_eval import load_run
  from realm_jax.train.qa_eval import QAEvaluator
  from realm_jax.runtime.checkpoints import fitted_mesh, run_config
  config, data, mesh, model, params, frozen, reader, step = load_run(
      fitted_mesh(run_config(workdir)), workdir, step)
  examples = [QAExample(qid=f"q{i}", question=q, answers=(), is_regex=False)
              for i, q in enumerate(questions)]
  evaluator = QAEvaluator(config, data, mesh, model, examples, frozen, reader)
  _, predictions = evaluator.run(params)
  out = []
  for pred, truncated in zip(predictions, evaluator.builder.truncated):
    item = {"question": pred["question"], "step": step,
            "truncated": bool(truncated)}    # cut to data.query_len wordpieces
    if reader:
      item.update(answer=pred["prediction"], score=pred["score"])
    item["evidence"] = [{k: e[k] for k in ("title", "text", "retrieval_score", "span_score",
                                           "span") if k in e} for e in pred["evidence"]]
    out.append(item)
  return out


def _show(item: dict) -> str:
  lines = [f"Q: {item['question']}" + ("   (cut to data.query_len wordpieces)"
                                         if item.get("truncated") else "")]
  if "answer" in item:
    lines.append(f"A: {item['answer']}   (score {item['score']:.2f}, checkpoint {item['step']})")
  for rank, e in enumerate(item["evidence"], 1):
    scores = ", ".join(f"{k.replace('_', ' ')} {e[k]:.2f}" for k in ("retrieval_score",
                                                                     "span_score") if k in e)
    lines.append(f"  [{rank}] {e['title'] or '(untitled)'}" + (f" ({scores})" if scores else "")
                 + (f" -> \"{e['span']}\"" if "span" in e else ""))
    lines.append(textwrap.indent(textwrap.fill(e["text"], 96), "      "))
  return "\n".join(lines)


def main(argv) -> None:
  questions = argv[1:]
  if not questions or not _WORKDIR.value:
    print('realm-predict: error: usage: realm-predict --workdir W "question" [...]',
          file=sys.stderr)
    raise SystemExit(2)
  empty = [i for i, q in enumerate(questions, 1) if not q.strip()]
  if empty:
    print(f"realm-predict: error: question {empty[0]} is empty: ask something", file=sys.stderr)
    raise SystemExit(2)
  if _STEP.value < -1:
    print(f"realm-predict: error: --step {_STEP.value}: a checkpoint's step, or -1 for the "
          "latest", file=sys.stderr)
    raise SystemExit(2)
  log.use_absl_verbosity()   # -v N; Orbax's and TFDS's INFO lines off the console
  step = _STEP.value if _STEP.value >= 0 else None
  results = run_cli("realm-predict", lambda: predict(_WORKDIR.value, questions, step))
  for item in results:
    print(json.dumps(item) if _JSON.value else _show(item) + "\n")


def run() -> None:
  from realm_jax.config.option_names import upgrade_flags
  sys.argv = upgrade_flags(sys.argv, "realm-predict")   # an unreadable --flagfile: one line
  app.run(main, flags_parser=flags_parser("realm-predict"))


if __name__ == "__main__":
  run()

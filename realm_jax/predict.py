"""`realm-predict --workdir W "question" ["another question" ...] [--json] [--step N]
[--config.KEY=VALUE ...]`: the answer, its score, and the top evidence blocks with titles and
scores, from a fine-tuned Open-QA run (a pre-training run shows the retrieved blocks only),
with the checkpoint and index version that gave them. The run's own W/config.json, with the
`--config.KEY=VALUE` options set (`--config.data.dir=D` for a run whose data dir moved). Its
results alone are on stdout (a JSON line per question with --json); its log is on stderr."""

from __future__ import annotations

import json
import os
import sys
import textwrap

from absl import app, flags

from realm_jax import log
from realm_jax.errors import run_cli
from realm_jax.config.overrides import flags_parser

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with checkpoints and its index.")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step (default: the latest).")
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object per question.")


_RUN_OVERRIDES: list = []   # --config.KEY=VALUE: options of W/config.json to set (`run`)


def predict(workdir: str, questions: list[str], step: int | None = None,
            overrides=()) -> list[dict]:
  """One record per question (`overrides`: `overrides.split_run_overrides`' options)."""
  from realm_jax.openqa_eval import evaluation_config, load_run
  config = evaluation_config(workdir, overrides)   # a W without a run: named before JAX loads
  from realm_jax.data.qa import QAExample
  from realm_jax.errors import ConfigError
  from realm_jax.train.qa_eval import QAEvaluator
  config, data, mesh, model, params, frozen, reader, step = load_run(config, workdir, step)
  pieces = data.tokenizer.encode_batch(questions)
  empty = [i for i, (wp, _) in enumerate(pieces, 1) if not wp]
  if empty:   # (blank text is refused before anything is loaded)
    raise ConfigError("", f"question {empty[0]} is empty: it has no wordpieces "
                      f"({questions[empty[0] - 1]!r}): ask something")
  examples = [QAExample(qid=f"q{i}", question=q, answers=(), is_regex=False)
              for i, q in enumerate(questions)]
  evaluator = QAEvaluator(config, data, mesh, model, examples, frozen, reader)
  _, predictions = evaluator.run(params)
  out = []
  for pred, truncated in zip(predictions, evaluator.builder.truncated):
    item = {"question": pred["question"], "step": step, "index_version": frozen.version,
            "index_step": frozen.step,       # version -1: embedded for this prediction
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
    lines.append(f"A: {item['answer']}   (score {item['score']:.2f})" if item["score"] is not None
                 else "A: (none: no block read has a span)")
  version = item.get("index_version", -1)
  index = (f"index v{version} (blocks embedded at step {item.get('index_step')})"
           if version >= 0 else "blocks embedded by it (no published index)")
  lines.append(f"   checkpoint {item['step']}, {index}")
  for rank, e in enumerate(item["evidence"], 1):
    scores = ", ".join(f"{k.replace('_', ' ')} {e[k]:.2f}" for k in ("retrieval_score",
                                                                     "span_score")
                       if e.get(k) is not None)
    span = "" if "span" not in e else " (no span)" if e["span"] is None else \
        f" -> \"{e['span']}\""
    lines.append(f"  [{rank}] {e['title'] or '(untitled)'}" + (f" ({scores})" if scores else "")
                 + span)
    lines.append(textwrap.indent(textwrap.fill(e["text"], 96), "      "))
  return "\n".join(lines)


def main(argv) -> None:
  questions = argv[1:]
  if not questions or not _WORKDIR.value:
    print('realm-predict: error: usage: realm-predict --workdir W "question" [...]',
          file=sys.stderr)
    raise SystemExit(2)
  from realm_jax.data.answers import as_read
  empty = [i for i, q in enumerate(questions, 1) if not as_read(q).split()]
  if empty:   # blank, or nothing the tokenizer keeps (zero-width, control characters)
    print(f"realm-predict: error: question {empty[0]} is empty: ask something", file=sys.stderr)
    raise SystemExit(2)
  if _STEP.value < -1:
    print(f"realm-predict: error: --step {_STEP.value}: a checkpoint's step, or -1 for the "
          "latest", file=sys.stderr)
    raise SystemExit(2)
  log.use_absl_verbosity()   # -v N; Orbax's and TFDS's INFO lines off the console
  log.to_stderr()            # stdout: the results alone (`--json`: JSON lines a pipe reads)
  step = _STEP.value if _STEP.value >= 0 else None
  results = run_cli("realm-predict", lambda: predict(_WORKDIR.value, questions, step,
                                                     _RUN_OVERRIDES))
  try:
    for item in results:
      print(json.dumps(item) if _JSON.value else _show(item) + "\n", flush=True)
  except BrokenPipeError:   # its reader stopped reading (`| head -1`): nothing more to say
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (Python's exit flush)
    raise SystemExit(1) from None


def run() -> None:
  from realm_jax.config.option_names import upgrade_flags
  from realm_jax.config.overrides import refuse_config_file, split_run_overrides
  # an unreadable --flagfile: one line; --config.KEY=VALUE: options of W/config.json
  sys.argv, _RUN_OVERRIDES[:] = split_run_overrides(upgrade_flags(sys.argv, "realm-predict"),
                                                    config_flag=False)
  refuse_config_file("realm-predict", sys.argv)
  app.run(main, flags_parser=flags_parser("realm-predict", __name__))


if __name__ == "__main__":
  run()

"""`realm-eval`: restores a run's checkpoint and its index and evaluates it on a QA split
(exact match, F1 and retrieval recall, with the evidence behind every answer; the metrics
themselves: train/qa_eval.py). A checkpoint without the span reader (REALM pre-training) gets
retrieval recall only: the zero-shot retrieval evaluation.

  realm-eval --workdir W [--config configs/X.py] [--config.KEY=VALUE ...] [--step N]
             [--split test] [--retrieval_only]
(without --config: the run's own W/config.json, with the --config.KEY=VALUE options set)
writes W/eval/<step>/<split>[-retrieval]/metrics.json and predictions.jsonl.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import sys

from realm_jax import log, paths
from realm_jax.config.option_names import upgrade_flags
# JAX, grain and the evaluator are imported where they are used: a misspelt option or a
# missing config file fails in a fraction of a second instead of after ~3 s of imports.

logger = logging.getLogger("realm_jax.openqa_eval")   # (__name__ is __main__ under python -m)

# What metrics.json records of the evaluation that wrote it, beside step and split.
EVALUATED_BY = ("source", "data_dir", "config_sha256")


def results_dir(workdir: str, step: int, split: str, reader: bool) -> str:
  """W/eval/<step>/<split> (reader + retrieval) or W/eval/<step>/<split>-retrieval (retrieval
  only): each evaluation of a checkpoint keeps its own results."""
  return paths.join(workdir, "eval", str(step), split if reader else f"{split}-retrieval")


def check_writable(out: str) -> str:
  """An OSError naming `out` where this process could not write there (run_cli: one line):
  checked before the evaluation, not after it; nothing is made (an evaluation refused
  later, a workdir without checkpoints, leaves no empty dir). Returns `out`."""
  if paths.is_remote(out):
    return out
  there = out
  while not os.path.exists(there) and os.path.dirname(there) not in ("", there):
    there = os.path.dirname(there)   # the nearest existing dir makes the ones missing
  if os.path.exists(there) and not os.path.isdir(there):
    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), there)
  if not os.access(there or ".", os.W_OK):
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), out)
  return out


def write_results(out: str, metrics: dict, predictions: list[dict]) -> str:
  """out/{predictions.jsonl, metrics.json}, each seen whole or not at all (a local file is
  written then renamed, a bucket object written in one request); an earlier evaluation's
  metrics.json goes first and this one's comes last, so that the predictions beside a
  metrics.json are its own (a run killed between the two leaves none). An earlier evaluation
  there of other questions, data or settings (`EVALUATED_BY`) is replaced with a warning
  naming them."""
  paths.makedirs(out)
  try:
    before = paths.read_json(paths.join(out, "metrics.json")) or {}
  except ValueError:    # cut short: replaced
    before = {}
  changed = [f"{key}: {before.get(key)!r} -> {metrics.get(key)!r}" for key in EVALUATED_BY
             if before and before.get(key) != metrics.get(key)]
  if changed:
    logger.warning(f"[eval] {out} held an evaluation of another kind ({'; '.join(changed)}): "
                   "replaced")
  paths.remove(paths.join(out, "metrics.json"))
  paths.write_text_atomic(paths.join(out, "predictions.jsonl"),
                          "".join(json.dumps(p) + "\n" for p in predictions))
  paths.write_json(paths.join(out, "metrics.json"), metrics)
  return out


# -- restoring a run for evaluation ---------------------------------------------------------
def fine_tuned(workdir: str, step: int) -> bool:
  """Whether checkpoint `step` of a run with a span reader was saved by Open-QA fine-tuning
  (with the frozen index's step in its `retrieval` item), not written by an import (params
  only; an imported RealmForOpenQA's W/index is used while it is there): its reader learnt
  with W/index, which nothing else stands in for."""
  from realm_jax.runtime.checkpoints import checkpoint_dir
  return paths.isdir(paths.join(checkpoint_dir(workdir), str(step), "retrieval"))


# A run still writing W deletes its checkpoints past train.keep_checkpoints, so the latest one
# may go while it is read: the newest then is read instead, up to this many times in all.
LATEST_TRIES = 3


def load_run(config, workdir: str, step: int | None = None, retrieval_only: bool = False):
  """Params of a checkpoint of `workdir` and the index to retrieve from, for evaluation.

  Returns (config as evaluated, data, mesh, model, params, frozen index, reader?, step). The
  reader is used when the checkpoint has the span scorer (Open-QA fine-tuning) unless
  `retrieval_only`; a pre-training checkpoint gives retrieval metrics only, but one given as
  an Open-QA run (config.task 'openqa') is an error unless `retrieval_only`. Without `step`,
  the latest: one deleted while it is read (a run still writing W) passes to the newest.
  """
  from realm_jax.errors import CheckpointError
  from realm_jax.runtime.checkpoints import checkpoint_dir, checkpoint_steps
  for tries_left in reversed(range(LATEST_TRIES)):
    steps = checkpoint_steps(workdir) if step is None else []
    read = steps[-1] if steps else step
    try:
      return _load_run(config, workdir, read, retrieval_only)
    except (CheckpointError, FileNotFoundError):
      if step is not None or read is None or not tries_left or read in checkpoint_steps(workdir):
        raise
      logger.info(f"[eval] checkpoint {checkpoint_dir(workdir)}/{read} was deleted while it "
                  "was read (the run writing it keeps only its newest): reading the newest")


def _load_run(config, workdir: str, step: int | None, retrieval_only: bool):
  """`load_run` of one step (None: the latest)."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.config.compatibility import inference_differences
  from realm_jax.config.reading import config_record
  from realm_jax.errors import ConfigError
  from realm_jax.retrieval import published
  from realm_jax.runtime.checkpoints import restore_run, saved_param_shapes
  from realm_jax.runtime.initialization import check_run_vocab
  from realm_jax.config.validation import validate, validate_against_data
  from realm_jax.train.openqa_inputs import FrozenIndex
  validate(config)
  saved, step = saved_param_shapes(workdir, step)   # read once: restore_run takes them
  has_reader = any(p[:2] == ("reader", "qa_outputs") for p in saved)
  record = workdir_lib.recorded_config(workdir)
  differs = [] if record is None else inference_differences(
      record, config_record(config), has_reader and not retrieval_only)
  if differs:
    raise ConfigError("model", f"{workdir} was trained under other model options than this "
                      f"config's: {'; '.join(differs)}: its parameters would compute another "
                      "model; give them the run's values (its W/config.json, which realm-eval "
                      "without --config and realm-predict read)")
  if config.task == "openqa" and not has_reader and not retrieval_only:
    raise ConfigError("task", f"'openqa', but {workdir}/checkpoints/{step} has no span reader "
                      "(reader/qa_outputs): it is a pre-training checkpoint. Fine-tune it with "
                      "task=openqa first, or evaluate its zero-shot retrieval (realm-eval "
                      "--retrieval_only; realm-predict without task=openqa shows the blocks it "
                      "retrieves)")
  reader = has_reader and not retrieval_only
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.task = "openqa" if reader else ("realm" if config.task == "openqa" else config.task)
  data = workdir_lib.open_data(config)
  validate_against_data(config, store_block_len=data.blocks.block_len,
                        vocab_size=data.tokenizer.vocab_size)
  check_run_vocab(workdir, "data.dir", data.tokenizer.vocab_path)   # ids of the run's meaning
  run = restore_run(workdir, step, config=config, vocab_size=data.tokenizer.vocab_size,
                    block_len=data.blocks.block_len, partial=True, saved=saved)
  mesh, model, params, step, missing = run.mesh, run.model, run.params, run.step, run.missing
  if missing:
    shown = sorted({"/".join(p[:3]) for p in missing})
    raise ConfigError("model", f"{workdir}/checkpoints/{step} lacks parameters this config "
                      f"needs: {', '.join(shown)} (is config.model the run's?)")
  fingerprint, dim = data.blocks.fingerprint, config.model.retrieval_dim
  root = published.index_root(workdir)
  if has_reader:   # an Open-QA run keeps one frozen index: its reader learnt with it (and
    # its block tower may have moved since: the index is what its retrieval is measured on)
    latest = FrozenIndex.check_blocks(workdir, fingerprint, data.dir)
    if fine_tuned(workdir, step):   # (an imported reader has none: its blocks are embedded)
      frozen = FrozenIndex.load_required(workdir, fingerprint, dim, f"{workdir}/checkpoints/"
                                         f"{step} was fine-tuned with it", latest)
    else:
      frozen = None if latest is None else FrozenIndex.load(workdir, fingerprint, dim, latest)
  else:        # a pre-training run's: only one embedded by this very checkpoint
    frozen = FrozenIndex.of_step(workdir, step, fingerprint, dim)
  if frozen is not None:
    logger.info(f"[eval] index {published.version_dir(root, frozen.version)} (blocks embedded "
                f"at step {frozen.step})")
  else:
    frozen = FrozenIndex.embed(model, mesh, config, data, params["retriever"], step,
                                  f"[eval] index of checkpoint {step}: ")
  return config, data, mesh, model, params, frozen, reader, step


def evaluate_run(config, workdir: str, step: int | None = None, split: str = "test",
                 retrieval_only: bool = False) -> tuple[dict, str]:
  """realm-eval: metrics + predictions of one checkpoint on one QA split, written under
  `results_dir`. Returns (metrics, that directory)."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.config.validation import validate
  from realm_jax.data.qa import qa_split
  from realm_jax.errors import ConfigError, raise_if_interrupted
  from realm_jax.train.qa_eval import QAEvaluator, format_metrics
  raise_if_interrupted()   # a Ctrl-C recorded in those imports
  workdir_lib.check_run_dir(workdir)   # (with --config, W/config.json was not read)
  validate(config)   # a --config without a task (realm-prepare's) is named, before its fields
  if differs := workdir_lib.other_split(workdir, config):   # evaluating elsewhere is allowed
    logger.warning(f"[eval] {workdir} was fine-tuned under another held-out split: "
                   f"{'; '.join(differs)}: some of its {split} questions may be ones it "
                   "trained on")
  if not config.qa.get(split):   # (a pre-training run's own W/config.json names none)
    raise ConfigError(f"qa.{split}", f"is empty: name the questions to evaluate {workdir} on "
                      f"with --config.qa.{split}=SPEC (nq_open:PATH, webq:PATH, "
                      "curated_trec:PATH, squad:PATH, tfds:NAME[:SPLIT], prepared:SPLIT)")
  # `prepared:` questions where the blocks are read (`open_data`: a relative dir named with
  # the directory it was looked for from, a gcsfuse path not mounted here as its bucket's)
  data_dir = workdir_lib.check_data_dir(config)
  examples, counts = qa_split(config.qa, split, data_dir)   # bad specs fail first
  check_writable(paths.join(workdir, "eval"))   # before anything is computed
  config, data, mesh, model, params, frozen, reader, step = load_run(
      config, workdir, step, retrieval_only)
  check_writable(results_dir(workdir, step, split, reader))
  logger.info(f"[eval] {workdir} step {step}: {len(examples):,} {split} questions "
              f"({config.qa.get(split)}), skipped {counts or 'none'}; "
              f"{'reader + retrieval' if reader else 'retrieval only'}")
  evaluator = QAEvaluator(config, data, mesh, model, examples, frozen, reader, counts)
  metrics, predictions = evaluator.run(params)
  metrics.update(step=step, split=split, source=config.qa.get(split), reader=reader,
                 data_dir=config.data.dir, config_sha256=hashlib.sha256(
                     config.to_json_best_effort(sort_keys=True).encode()).hexdigest())
  out = write_results(results_dir(workdir, step, split, reader), metrics, predictions)
  logger.info(f"[eval] step {step} {split}: {format_metrics(metrics)} | {metrics['num_questions']} "
              f"questions, answer in no top-{metrics['reader_beam']} block: "
              f"{metrics['no_answer_in_top_k']}, truncated: {metrics['truncated_questions']}, "
              f"skipped: {counts or 'none'} ({metrics['seconds']:.1f}s) -> {out}")
  return metrics, out


_RUN_OVERRIDES: list = []   # --config.KEY=VALUE without --config (`run`)


def evaluation_config(workdir: str, overrides=()):
  """What realm-eval without `--config` and realm-predict evaluate under: the run's own
  W/config.json with the command line's `--config.KEY=VALUE` options set (`overrides`, from
  `overrides.split_run_overrides`: a question set, a data dir that moved), its recorded mesh
  fitted to this machine (`checkpoints.fitted_mesh`) unless they set `mesh.shape`. A W that
  holds no run and a bad option are named before JAX is imported (~0.6 s of each such
  command's start)."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.config.overrides import apply_run_overrides
  config = apply_run_overrides(workdir_lib.saved_config(workdir), overrides)
  if any(key == "mesh.shape" for _, key, _, _ in overrides):
    return config   # the command line's own mesh, as given (one that does not fit is refused)
  from realm_jax.runtime.checkpoints import fitted_mesh
  return fitted_mesh(config)


def main(argv) -> None:
  from absl import flags
  from realm_jax.errors import run_cli
  from realm_jax.config.overrides import refuse_arguments
  flags_ = flags.FLAGS
  refuse_arguments("realm-eval", argv)   # exit 2, as other bad usage
  log.use_absl_verbosity()   # -v N; Orbax's and TFDS's INFO lines off the console
  if flags_.step < -1:
    print(f"realm-eval: error: --step {flags_.step}: a checkpoint's step, or -1 for the "
          "latest", file=sys.stderr)
    raise SystemExit(2)
  step = flags_.step if flags_.step >= 0 else None
  config = lambda: flags_.config or evaluation_config(flags_.workdir, _RUN_OVERRIDES)
  run_cli("realm-eval", lambda: evaluate_run(config(), flags_.workdir, step, flags_.split,
                                             flags_.retrieval_only))


def run() -> None:
  from absl import app, flags
  from ml_collections import config_flags
  from realm_jax.config.overrides import flags_parser, split_run_overrides
  from realm_jax.data.qa import SPLITS
  # flagfiles read and old option names upgraded before the config flag reads sys.argv;
  # without --config, its --config.KEY=VALUE options set W/config.json's
  sys.argv, _RUN_OVERRIDES[:] = split_run_overrides(upgrade_flags(sys.argv, "realm-eval"))
  config_flags.DEFINE_config_file("config", None, "Config file (default: W/config.json).",
                                  lock_config=True)
  flags.DEFINE_string("workdir", None, "Run directory with checkpoints.", required=True)
  flags.DEFINE_integer("step", -1, "Checkpoint step (default: the latest).")
  flags.DEFINE_enum("split", "test", list(SPLITS), "QA split: config.qa.<split>.")
  flags.DEFINE_bool("retrieval_only", False, "Retrieval recall only (no reader).")
  app.run(main, flags_parser=flags_parser("realm-eval", __name__))


if __name__ == "__main__":
  run()

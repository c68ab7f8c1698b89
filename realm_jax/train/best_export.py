"""The best evaluation's parameters, exported beside the run (`eval.export_best`).

The original REALM code re-embeds its index from the *best* export, chosen by the retrieval
utility (log p(y|x) - log p(y|null,x)) on held-out masked sentences; question recall never
chooses it. A REALM run with `eval.export_best` does the same: after each evaluation whose
`retrieval_utility` beats every earlier one, the params are written to `W/best`, laid out as
a run's workdir (`config.json`, `checkpoints/<step>/params`) so that everything that reads a
run reads it too: `init.retriever=W/best`, `realm-eval --workdir W/best`, zero-shot recall.
`W/best/best.json` says which step and utility it holds (and, kept by a fresh start from it,
that it is an earlier start's); a resumed run reads it back, so the export survives preemption.
"""

from __future__ import annotations

import logging
import math

import jax
import orbax.checkpoint as ocp

from etils import epath

from realm_jax import paths, workdir as workdir_lib
from realm_jax.runtime import multihost
from realm_jax.errors import CheckpointError
from realm_jax.runtime.checkpoints import checkpoint_dir, first_line

logger = logging.getLogger(__name__)

BEST = "best"
METRIC = "retrieval_utility"
EARLIER = "earlier_start"   # best.json: of an earlier start that this one continues from


class BestExport:
  """Keeps `W/best` at the params of the best evaluation so far by `METRIC`."""

  def __init__(self, workdir: str, config):
    self.config, self.workdir, self.directory = config, workdir, paths.join(workdir, BEST)
    self.record = paths.join(self.directory, "best.json")
    record = paths.read_json(self.record)
    self.best: dict | None = None if record is None else {   # None: nothing exported yet
        "step": record["step"], METRIC: record[METRIC]}
    # the step of an earlier start's export that this start continues from (kept by
    # `start_over`, which says so in best.json for a resume of this start): this start's own
    # step of that number is other params
    self.earlier: int | None = self.best["step"] if record and record.get(EARLIER) else None

  def consider(self, step: int, metrics: dict, params, prefix: str = "") -> bool:
    """Exports `params` if `metrics[METRIC]` is the best yet; returns whether it did."""
    value = metrics.get(METRIC)
    if value is None or not math.isfinite(value) or \
        (self.best is not None and value <= self.best[METRIC]):
      return False
    if self.best is not None and step == self.best["step"] and step != self.earlier:
      # a resumed run evaluating the exported step again, better this time (an async index
      # is not bitwise repeatable): the export of that step stands (replacing it in place
      # would leave no export for a moment, and a kill then none at all)
      return False
    manager = ocp.CheckpointManager(
        checkpoint_dir(self.directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                             enable_async_checkpointing=False,
                                             # what a save cut short left goes
                                             cleanup_tmp_directories=True),
        item_names=("params",))
    try:
      if step == self.earlier and step in manager.all_steps():
        manager.delete(step)   # an earlier start's params under this step's number
      if step not in manager.all_steps():   # else a run killed after saving it, before best.json
        manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                     force=True)
        manager.wait_until_finished()
    except Exception as e:   # Orbax / TensorStore: ValueError, OSError ... (a full disk)
      raise self._export_failed(step, e) from e
    finally:
      manager.close()
    if jax.process_index() == 0:
      try:
        self._write_records({"step": int(step), METRIC: float(value)})
      except OSError as e:   # a full disk after the params fitted: one line, not a traceback
        raise CheckpointError(
            f"exporting step {step}'s params to {self.directory}: they are saved, but writing "
            f"its records failed: {first_line(e, 600)}; its best.json still names "
            + (f"step {self.best['step']}" if self.best is not None else "nothing")) from e
    self.best, self.earlier = {"step": int(step), METRIC: float(value)}, None
    logger.info(f"{prefix}best {METRIC} so far ({value:.4f} at step {step}): exported to "
                f"{self.directory}")
    return True

  def _write_records(self, best: dict) -> None:
    """W/best's config, vocab and best.json (process 0), best.json last: it says the export
    is whole."""
    workdir_lib.write_config(self.directory, self.config)
    vocab = paths.read_text(paths.join(self.workdir, workdir_lib.VOCAB))
    if vocab is not None:   # what a run started from W/best checks its data against
      paths.write_text_atomic(paths.join(self.directory, workdir_lib.VOCAB), vocab)
    paths.write_json(self.record, best)

  def _export_failed(self, step: int, error: Exception) -> CheckpointError:
    """An export that failed (no space left): Orbax writes under a tmp name, so W/best holds
    what it held; the run stops (its checkpoints are as they were) naming both."""
    held = (f"{self.directory} still holds step {self.best['step']} (best.json)"
            if self.best is not None else "nothing is exported yet")
    return CheckpointError(f"exporting step {step}'s params to {self.directory} failed: "
                           f"{first_line(error, 600) or type(error).__name__}; {held}")

  def start_over(self, prefix: str = "", init=None) -> None:
    """A fresh start (no checkpoint to resume: a run that died before its first save, or
    whose checkpoints are gone) drops an earlier start's export, as it drops its metrics: its
    utility would stand against this run's evaluations (a worse run exports nothing and its
    summary names the other's step, perhaps of another config). One that started from W/best
    itself (`init`: init.retriever=W/best) continues that export: kept, its record too."""
    if parts := self._read_by(init):   # the same on every process: all return here
      self.earlier = None if self.best is None else self.best["step"]
      if self.earlier is not None and jax.process_index() == 0:
        self._mark_earlier()
      logger.info(f"{prefix}a fresh start from its own export ({', '.join(parts)} <- "
                  f"{self.directory}): kept")
      return
    left = list(epath.Path(self.directory).iterdir()) \
        if jax.process_index() == 0 and paths.isdir(self.directory) else []
    if left:
      held = f" (step {self.best['step']})" if self.best is not None else ""
      for path in left:   # what is in it: W/best itself may be a mount or a link
        path.rmtree() if path.is_dir() else path.unlink()
      logger.info(f"{prefix}a fresh start: emptied {self.directory}{held}, an earlier "
                  "start's best export")
    self.best, self.earlier = None, None
    multihost.after_first_process("best-export-removed")   # before any process saves there

  def _mark_earlier(self) -> None:
    """best.json says the export is an earlier start's, until this start exports its own."""
    try:
      paths.write_json(self.record, {**self.best, EARLIER: True})
    except OSError as e:   # a full disk: one line, not a traceback
      raise CheckpointError(f"marking {self.record} as an earlier start's export: "
                            f"{first_line(e, 600)}") from e

  def _read_by(self, init) -> list[str]:
    """The parts a fresh start's `init` (initialization.Start) read from W/best."""
    here = paths.absolute(self.directory)
    return [part for part, src in (init.sources if init is not None else {}).items()
            if src.kind == "workdir" and paths.same_place(paths.absolute(src.path), here)]

  def summary(self) -> dict:
    return {} if self.best is None else {"best_step": self.best["step"],
                                         f"best_eval_{METRIC}": self.best[METRIC]}

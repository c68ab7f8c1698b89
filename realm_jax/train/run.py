"""The run every training task shares (pre-training: train/loop.py; Open-QA:
train/openqa_loop.py), read top to bottom in `Run.run`: set up, restore or initialise, the loop
{batch, step, log, evaluate, checkpoint} (the batch source swaps the index it retrieves from),
finish with the summary.

A task hands in what differs as values and objects: its data and input pipeline (to
`Run.__init__`), its step batches (`open_batches` returns a `StepBatches`: the batch of each
step, what served it, its progress note and summary figures), its evaluation, the `retrieval`
item of its checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time

import jax
import ml_collections

from realm_jax import paths, workdir as workdir_lib
from realm_jax.data.prepared import PreparedData
from realm_jax.errors import ConfigError, NonFiniteError, raise_if_interrupted
from realm_jax.retrieval.index import EmbeddingStopped
from realm_jax.train.feed import FeedStopped
from realm_jax.runtime import initialization, multihost, partitioning, state as state_lib
from realm_jax.train import steps
from realm_jax.runtime.checkpoints import Checkpointer
from realm_jax.config.reading import config_record
from realm_jax.config.validation import (training_warnings, validate, validate_against_mesh,
                                        validate_training)
from realm_jax.log import format_duration, format_rate
from realm_jax.runtime.metrics import (MetricWriter, window_from_record, window_record,
                                       window_scalars)
from realm_jax.runtime.preemption import Preemption
from realm_jax.runtime.profiling import StepTrace

logger = logging.getLogger(__name__)
# the key of a checkpoint's data item that holds the train metrics not yet logged
TRAIN_WINDOW = "train_window"
# the key of a checkpoint's data item that holds the updates skipped up to its step (none: 0)
SKIPPED_UPDATES = "skipped_updates"


def checked_data(config: ml_collections.ConfigDict, workdir: str) -> PreparedData:
  """The run's data dir, opened after the workdir and the options are checked (a bad one is
  a one-line error before anything is built; every process sees the workdir)."""
  paths.check(workdir, "--workdir")
  validate(config)
  validate_training(config)
  if jax.process_index() == 0:   # the run's warnings, said once (by the first process)
    for line in training_warnings(config):
      logger.warning(f"[{config.task}] {line}")
  check_shared_workdir(workdir)   # before any process reads the workdir
  data = workdir_lib.open_data(config)
  if config.task in ("ict", "realm"):   # evaluated on eval.split (at the end at the latest)
    examples = os.path.join(data.dir, "examples")
    evaluable = lambda split: os.path.exists(os.path.join(examples, split, "target_span.npy"))
    if not evaluable(config.eval.split):
      there = sorted(filter(evaluable, os.listdir(examples))) if os.path.isdir(examples) else []
      raise ConfigError("eval.split", f"{config.eval.split!r}: no split of examples with target "
                        f"spans to evaluate in {paths.join(config.data.dir, 'examples')} "
                        f"(there: {', '.join(there) or 'none'})")
  return data


def check_same_run(config: ml_collections.ConfigDict, data: PreparedData,
                   records: dict[str, str] | None = None) -> None:
  """Every process of a job runs the same config on the same block store: a ConfigError
  naming each top-level config field (and the store) on which some process differs from
  process 0, before anything is written (a collective: every process calls it). data.dir is
  left out: the processes may read the data at other paths (a copy on each host, /gcs/B and
  gs://B); the fingerprints of its block store, vocabulary and examples say whether it is
  the same data, and `records` (what -> fingerprint) those of what else the task reads."""
  if jax.process_count() == 1:
    return
  fields = config_record(config)
  fields["data"].pop("dir", None)   # a host's own copy, or /gcs/B for gs://B: the store decides
  mine = {f"config.{k}": hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()
          for k, v in fields.items()}
  mine["the block store of data.dir"] = data.blocks.fingerprint
  with open(data.tokenizer.vocab_path, "rb") as f:
    mine["the vocabulary of data.dir"] = hashlib.sha256(f.read()).hexdigest()
  if config.task in ("ict", "realm"):   # the examples each process reads its rows from
    for split in sorted({config.data.split, config.eval.split}):
      mine[f"the {split!r} examples of data.dir"] = data.examples(split).fingerprint
  mine.update(records or {})
  differ = multihost.disagreements([json.loads(v) for v in multihost.every_process(
      "config", json.dumps(mine), multihost.bulk_io_timeout())])   # (a bucket's data copied)
  if differ:
    raise ConfigError("", "the processes of this job disagree on " + "; ".join(
        f"{k} (process {', '.join(map(str, ps))} against process 0)" for k, ps in differ.items())
        + ": every process must run the same command on the same data")


def check_shared_workdir(workdir: str) -> None:
  """Every process sees the token process 0 writes into `workdir` (making it) at start-up,
  before any process reads anything there: a ConfigError naming the processes that do not
  otherwise (a node-local workdir, or another path on some host, would hang the first save,
  and one holding an older run would raise its own, misleading errors first). Process 0
  removes the token once all have looked, and W if the token made it (a job refused before
  its first write leaves no empty W). A collective: every process calls it."""
  if jax.process_count() == 1:
    return
  primary = jax.process_index() == 0
  made = primary and not paths.exists(workdir)
  token = workdir_lib.write_job_token(workdir) if primary else ""
  try:
    token = multihost.every_process("workdir token", token)[0]
    blind = multihost.processes_where_not(primary or workdir_lib.sees_job_token(workdir, token))
  finally:   # removed whatever ended the check (a process that never sent or looked)
    if primary:
      workdir_lib.remove_job_token(workdir, token, made)
  if blind:
    raise ConfigError("", f"--workdir {workdir}: process {', '.join(map(str, blind))} does not "
                      "see what process 0 wrote there: the workdir must be shared storage "
                      "that every process sees at the same path")


@dataclasses.dataclass
class StepBatch:
  """One step's global batch, the input pipeline's state after it, and what built it (the
  index that served it, the wait for it, the score cache's look-ups; `StepBatches.served`
  reads it back after the step)."""
  batch: dict
  data_state: dict
  used: dict = dataclasses.field(default_factory=dict)


class StepBatches:
  """A task's batches, step by step (`Run.open_batches` makes them)."""

  def next(self, step: int) -> StepBatch:
    raise NotImplementedError

  def served(self, done: int, fed: StepBatch, metrics) -> None:
    """After step `done` - 1 ran on `fed`."""

  def progress(self, scalars: dict) -> tuple[str, str]:
    """The figures of a progress line (it may add figures to `scalars`), and a note after
    its rate."""
    raise NotImplementedError

  def stop(self, preempted: bool) -> None:
    """After the last step, before the final evaluation."""

  def close(self) -> None:
    """Always, at the end (also on an error)."""

  def summary(self) -> dict:
    """Figures the run's summary adds (said in the log as well)."""
    return {}


def first_evaluated_step(start: int, total: int) -> int:
  """The first step whose evaluation a run that starts at step `start` logs: step 0's on a
  start from there (a fresh start, or a resume from step 0's checkpoint, the builder's first
  snapshot), the final one again on a resume from the last step's checkpoint (a run stopped
  before its summary), else the first after `start` (the train lines: always)."""
  return 0 if start == 0 else total if start >= total else start + 1


class Run:
  """One training run in `workdir`; `run()` trains to `config.train.steps` and evaluates.

  Attributes set here: config, workdir, data, inputs (the input pipeline's owner, with
  `iterator` / `state`), mesh, model, shardings, abstract, train_step, step_rng,
  checkpointer, saved_data (the data item of the checkpoint resumed from); state (the train
  state) from `restore_or_init` on.
  """

  keep_examples = 0   # examples with their evidence the final evaluation keeps for the summary

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, data: PreparedData,
               inputs, lock: workdir_lib.JobLock | None = None):
    self.config, self.workdir, self.data, self.inputs = config, workdir, data, inputs
    self.mesh = partitioning.make_mesh(config.mesh.shape)
    validate_against_mesh(config, self.mesh.shape["data"])
    check_same_run(config, data, self.data_records())
    # another program's config.json is named with a run's advice on every process, before
    # the vocab check and `recorded_differences` (process 0) read it with an evaluation's
    if paths.isdir(workdir):   # (a workdir that is a file is named as one further on)
      workdir_lib.recorded_config(workdir, workdir_lib.RUN_ADVICE)
    self._check_steps(workdir, config.train.steps)
    resumes = self._check_vocab(workdir, data.tokenizer.vocab_path)
    # a finished run run again trains nothing (`_finished_before`): W keeps the record of
    # the values its checkpoints were trained under
    previous = self._finished_summary(workdir, config.train.steps)
    finished = multihost.on_every_process(previous is not None)
    self.previous = previous if finished else None   # `_finished_before`'s
    changed = [(name, was, now) for name, was, now in workdir_lib.recorded_differences(
        workdir, config) if not paths.same_place(was, now)] if resumes and not finished and \
        jax.process_index() == 0 else []
    if lock is not None and jax.process_index() == 0:
      lock.acquire()   # the one trainer of W, from its first write on (train() gives it up)
    workdir_lib.record_config(config, workdir,
                              primary=jax.process_index() == 0 and not finished)
    if changed:   # allowed (not compatibility fields), and said (by the first process)
      logger.warning(f"[{config.task}] resuming {workdir} under other values than it recorded "
                     "(config.json now holds these): " + "; ".join(
                         f"{name}: {was!r} -> {now!r}" for name, was, now in changed))
    if jax.process_index() == 0 and not (
        resumes and paths.exists(paths.join(workdir, workdir_lib.VOCAB))):
      workdir_lib.record_vocab(workdir, data.tokenizer.vocab_path)
    multihost.after_first_process("workdir")   # no process goes on before the workdir exists
    self.model = state_lib.build_model(config, self.data.tokenizer.vocab_size)
    init_rng, self.step_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    # the state itself comes from `restore_or_init`: restored, or initialised on a fresh start
    self.state = None
    self._initial_state, self.abstract, self.shardings = state_lib.deferred_train_state(
        config, self.model, self.mesh, self.data.blocks.block_len, init_rng)
    self.train_step = steps.make_train_step(config, self.model, self.shardings, self.mesh)
    self.checkpointer = Checkpointer(workdir, config.train.keep_checkpoints,
                                     config.train.async_checkpoints)
    self.saved_data = None
    # the train metrics of the steps since the last log line (a checkpoint keeps them)
    self.window: list[dict] = []
    # non-finite steps not applied (train.nonfinite=skip) since the run's start: a resumed
    # run counts on from its checkpoint's
    self.skipped_updates = 0
    self.prefix = f"[{config.task}] "

  @staticmethod
  def _check_steps(workdir: str, steps: int) -> None:
    """A run does not go back: train.steps below W's latest checkpoint is refused before
    anything is written (its model would be evaluated and recorded as that earlier step)."""
    latest = workdir_lib.latest_checkpoint_step(workdir)
    if latest is not None and latest > steps:
      raise ConfigError("train.steps", f"{steps} is below {latest}, the step of the latest "
                        f"checkpoint in {workdir}: a run does not go back; give train.steps "
                        f">= {latest}, evaluate an earlier step with realm-eval --step, or "
                        "train in a new workdir")

  @staticmethod
  def _check_vocab(workdir: str, data_vocab: str) -> bool:
    """A run resumed on data of another vocab is refused before it writes anything: the ids
    would mean other words to its checkpoints (W/vocab.txt, else the data dir it recorded).
    Returns whether W holds checkpoints (the run resumes)."""
    if not workdir_lib.holds_checkpoints(workdir):
      return False   # a fresh start, or a run that died before its first save: data may change
    try:
      initialization.check_run_vocab(workdir, "data.dir", data_vocab)
    except ConfigError as e:
      raise ConfigError("data.dir", f"{e.message}; or resume {workdir} on the data it trained "
                        "on, or train in a new workdir") from None
    return True

  # -- what a task fills in ----------------------------------------------------------------
  def data_records(self) -> dict[str, str]:
    """What the task reads beyond the data dir's store, vocabulary and examples, each as
    what -> fingerprint (set before `Run.__init__`): the processes of a job must agree."""
    return {}

  def abstract_item(self) -> dict:
    """The shape of the checkpoint's `retrieval` item."""
    raise NotImplementedError

  def item(self) -> dict:
    """The checkpoint's `retrieval` item now."""
    raise NotImplementedError

  def resumed(self, item: dict) -> None:
    """After a restore, with the restored `retrieval` item."""

  def begin(self, start: int, init: initialization.Start | None) -> None:
    """Before the loop (after restore; `init`: where a fresh start took each part's params
    from): builds what the steps need, prints the header."""

  def open_batches(self, start: int, data_iter, preemption: Preemption) -> StepBatches:
    """The batches of steps `start`.. drawn from `data_iter` (before the first evaluation)."""
    raise NotImplementedError

  def carried(self) -> dict:
    """The counts of the steps so far that a run resumed from the checkpoint saved now goes on
    from, each where it is not 0 (its data item keeps them: `saved_data` after a restore): the
    updates skipped, and a task's own."""
    return {SKIPPED_UPDATES: self.skipped_updates} if self.skipped_updates else {}

  def evaluates(self) -> bool:
    return True

  def evaluates_at_start(self) -> bool:
    return self.evaluates()

  def evaluate(self, writer: MetricWriter, step: int, final: bool) -> tuple[dict, list]:
    raise NotImplementedError

  def checkpoint_due(self, done: int) -> bool:
    return done % self.config.train.checkpoint_every == 0 or done == self.config.train.steps

  def summary_fields(self) -> dict:
    return {}

  def finished(self, summary: dict) -> None:
    """After a finished run's summary is written."""

  # -- the run -----------------------------------------------------------------------------
  def restore_or_init(self) -> tuple[int, initialization.Start | None]:
    """Resumes from the latest checkpoint, else starts each part from its `config.init`
    source (runtime/initialization.py). Returns the first step to run and, on a fresh start,
    where each part's params came from."""
    def log(line: str) -> None:
      logger.info(self.prefix + line)
    restored = self.checkpointer.restore_latest(self.abstract, self.abstract_item(), log)
    if restored is not None:
      latest, self.state, self.saved_data, item = restored
      self.skipped_updates = int(self.saved_data.get(SKIPPED_UPDATES, 0))
      self.resumed(item)
      logger.info(f"{self.prefix}resumed from {self.checkpointer.directory}/{latest} "
                  f"(data at step {self.saved_data['next_step']})")
      return int(self.saved_data["next_step"]), None
    # the random init only where a part needs it (random, an HF dir, a source lacking arrays)
    initial = functools.cache(self._initial_state)
    start = initialization.start_params(self.config, lambda: initial().params,
                                        self.abstract.params, self.shardings.params,
                                        self.data.tokenizer.vocab_path,
                                        self.data.tokenizer.vocab_size)
    self.state = (initial().replace(params=start.params) if initial.cache_info().currsize
                  else self._initial_state(start.params))   # donates start.params
    start.params = self.state.params
    start.print(self.prefix)
    return 0, start

  def save(self, done: int, data_state: dict) -> None:
    """Step `done`'s checkpoint; its data item keeps the metrics of the steps not yet logged
    (a run resumed from it logs their means as one that went on) and the counts it goes on
    from (`carried`: its summary counts them as one that went on)."""
    data = self.inputs.state(data_state, done)
    if self.window:
      data[TRAIN_WINDOW] = window_record(self.window)
    data.update(self.carried())
    paths.send_held_lines()   # a bucket's metrics of the steps this checkpoint covers
    self.checkpointer.save(done, self.state, data, self.item())

  def run(self) -> dict:
    cfg = self.config
    if (finished := self._finished_before()) is not None:
      return finished
    try:
      start, init = self.restore_or_init()
      self.fresh = init is not None   # started from scratch: W/wall.json starts again
      self.begin(start, init)
      if self.fresh and jax.process_index() == 0:   # (a start `begin` refused keeps them)
        workdir_lib.clear_earlier_start(self.workdir)
    except BaseException:   # a bad init source, an index that never comes: Orbax's threads
      try:                  # stop before the process ends (they printed a traceback then)
        self.close()
      finally:
        self.checkpointer.close()
      raise
    t_start = time.time()
    logs = {"train": MetricWriter(self.workdir, "train", start + 1, held=True),
            "eval": MetricWriter(self.workdir, "eval",
                                 first_evaluated_step(start, cfg.train.steps))}
    data_iter = self.inputs.iterator(cfg.data.prefetch, self.saved_data)
    preemption = Preemption(cfg.train.preemption_grace_seconds, self.prefix)
    self.trace = StepTrace(cfg.train, self.workdir, start, cfg.train.steps, self.prefix)
    batches, eval_metrics, details, preempted = None, {}, [], None
    recorded = False   # the run's summary written: a SIGTERM after the last step goes on then
    wall, reached = None, start   # the step a wait for an index between steps comes after
    try:
      try:
        batches = self.open_batches(start, data_iter, preemption)
        if cfg.eval.every and start == 0 and self.evaluates_at_start():
          eval_metrics = self.evaluate(logs["eval"], 0, final=False)[0]
        preempted, eval_metrics = self._steps(start, batches, logs, preemption, eval_metrics)
        if preempted is None:
          preemption.steps_done(self.checkpointer.saving)
          reached = cfg.train.steps
        batches.stop(preempted is not None)
        if preempted is None and self.evaluates():
          eval_metrics, details = self.evaluate(logs["eval"], cfg.train.steps, final=True)
      except FeedStopped as e:   # SIGTERM while the first index, or an evaluation's, was
        # awaited (on every process alike): a preemption after the step reached
        preempted = self._stopped_waiting(reached, start, None, preemption, e)
      finally:
        self._close_run(batches, data_iter, logs, preemption)
      wall = self._wall(time.time() - t_start)
      if preempted is not None:   # no summary.json, no DONE: the run is not over
        return {"task": cfg.task, "preempted_at_step": preempted, **wall}
      summary = self._summarise(wall, eval_metrics, details, batches.summary())
      recorded = True
      return summary
    except KeyboardInterrupt:   # a Ctrl-C'd run's seconds count too (a demo's stage_seconds)
      if wall is None:
        self._wall(time.time() - t_start)
      raise
    finally:
      preemption.release(pass_on=recorded)

  def _finished_before(self) -> dict | None:
    """The summary of this run finished before (its checkpoint of the last step and its
    summary for this train.steps in the workdir, seen by every process): a run of a finished
    job restores, trains and evaluates nothing again (realm-eval evaluates a checkpoint) and
    leaves its metrics and wall time as they are."""
    total, previous = self.config.train.steps, self.previous   # seen in __init__
    if previous is None:
      return None
    logger.info(f"{self.prefix}finished before at step {total}: its summary is "
                f"{paths.join(self.workdir, workdir_lib.SUMMARY)}, nothing is run again (a "
                f"larger train.steps trains on; realm-eval evaluates its checkpoints)")
    try:
      self.close()
      self.checkpointer.close()
    finally:
      self.finished(previous)
    return previous

  @staticmethod
  def _finished_summary(workdir: str, total: int) -> dict | None:
    """W's summary where it is that of a run finished at `total` steps, W's latest checkpoint
    being of step `total` too; else None."""
    latest = workdir_lib.latest_checkpoint_step(workdir)
    previous = workdir_lib.read_summary(workdir) if latest == total else None
    return previous if previous is not None and previous.get("steps") == total else None

  def _wall(self, seconds: float) -> dict:
    """This run's wall time and, from the first process (W/wall.json's one writer), that of
    every run of this workdir so far (a resumed run's summary reports both)."""
    if jax.process_index() == 0:
      return workdir_lib.add_wall(self.workdir, seconds, fresh=self.fresh)
    return {"wall_seconds": round(seconds, 1)}

  def _close_run(self, batches: StepBatches | None, data_iter, logs: dict,
                 preemption: Preemption) -> None:
    """Closes the run's parts, the steps' SIGTERM bookkeeping last (a SIGTERM while the
    checkpointer finalises is still the run's)."""
    try:
      self.trace.stop()   # a run stopped inside the traced steps keeps those it ran
      if batches is not None:
        batches.close()
      self.close()
      data_iter.close()
      self.checkpointer.close()
      for log in logs.values():
        log.close()
    finally:
      preemption.close()

  def close(self) -> None:
    """What the task holds beyond its batches, closed at the end (also on an error)."""

  def _steps(self, start: int, batches: StepBatches, logs: dict, preemption: Preemption,
             eval_metrics: dict):
    """Steps `start`..total; returns (the step preempted after or None, latest eval)."""
    cfg, total = self.config, self.config.train.steps
    self.window = window_from_record((self.saved_data or {}).get(TRAIN_WINDOW)) if start else []
    window, t_last, data_state = self.window, time.time(), None
    ran = 0   # steps this run ran since the last line: the rate's (the window leaves out a
              # skipped update's, and carries those of the run stopped here, run before)
    for step in range(start, total):
      raise_if_interrupted()   # a Ctrl-C swallowed in a gc callback: the run stops here
      self.trace.before(step + 1)
      try:
        fed = batches.next(step)
      except (EmbeddingStopped, FeedStopped) as e:   # SIGTERM while the next batch waited
        return self._stopped_waiting(step, start, data_state, preemption, e), eval_metrics
      data_state = fed.data_state
      self.state, metrics = self.train_step(self.state, fed.batch, self.step_rng)
      done, ran = step + 1, ran + 1
      if self.applied(done, metrics):
        window.append(metrics)
      self.trace.after(done, metrics, preemption.requested())
      batches.served(done, fed, metrics)
      if (done % cfg.train.log_every == 0 or done == total) and window:
        now = time.time()
        # the rate of the last update applied: optax reads the schedule at the count of updates
        # before it (0 for the first); a skipped step (train.nonfinite=skip) moves no count
        applied = state_lib.updates_applied(self.state.opt_state)
        scalars = window_scalars(window, now - t_last, float(
            state_lib.learning_rate_schedule(cfg.train)((done if applied is None else applied)
                                                         - 1)), ran)
        figures, note = batches.progress(scalars)   # may add figures to the scalars
        logs["train"].write(done, scalars)
        rate = scalars["steps_per_second"]
        logger.info(f"{self.prefix}step {done}/{total} {figures} | {format_rate(rate)} ETA "
                    f"{format_duration((total - done) / max(rate, 1e-9))}{note}")
        window.clear()
        t_last, ran = now, 0
      stop = preemption.reached(done)   # the same answer on every process
      if self.evaluates() and cfg.eval.every and done % cfg.eval.every == 0 and done != total:
        if stop:   # the step is saved first: its evaluation could outlast the grace period
          logger.warning(f"{self.prefix}SIGTERM: the evaluation at step {done} is left out "
                         "(a resumed run does not take it)")
        else:
          eval_metrics = self.evaluate(logs["eval"], done, final=False)[0]
          stop = preemption.requested()   # a SIGTERM during it (several processes: their
          # sync point at the next step)
      if self.checkpoint_due(done) or stop:
        self.save(done, data_state)
      if stop:
        preemption.saved(done, self.checkpointer)
        return done, eval_metrics
    return None, eval_metrics

  def _stopped_waiting(self, step: int, start: int, data_state: dict | None,
                       preemption: Preemption, e: Exception) -> int:
    """SIGTERM while the batch of step `step` + 1 waited for its index (rebuilt here, or from
    the builder: the first one, a late version), or an evaluation at `step` for its index
    from the builder (every process stops alike): step `step` is saved, unless it was (this
    run's first, a checkpoint step). Returns `step`."""
    preemption.stopping()
    what = " during the index rebuild" if isinstance(e, EmbeddingStopped) else ""
    when = f"before step {step + 1}" if step < self.config.train.steps else "after the last step"
    logger.warning(f"{self.prefix}SIGTERM{what} {when}: {e}; saving step {step}")
    if step > start and not self.checkpoint_due(step):
      self.save(step, data_state)
    preemption.saved(step, self.checkpointer)
    return step

  def applied(self, done: int, metrics: dict) -> bool:
    """Whether step `done`'s update was applied (its loss and gradient finite; the step left
    the state unchanged otherwise). Reads one scalar per step: the host waits for each step
    while the feed thread builds the next batch. A non-finite step raises NonFiniteError
    (`train.nonfinite=stop`) or is counted and left out of the logged means (`skip`)."""
    if bool(jax.device_get(metrics.pop("finite"))):
      return True
    loss, grad_norm = (float(jax.device_get(metrics[k])) for k in ("loss", "grad_norm"))
    if self.config.train.nonfinite == "skip":
      self.skipped_updates += 1
      logger.warning(
          f"{self.prefix}step {done}: loss {loss:.4g}, gradient norm {grad_norm:.4g}: not "
          f"finite, update skipped ({self.skipped_updates} so far)")
      return False
    last = self.checkpointer.latest_step()
    raise NonFiniteError(
        f"step {done}: the loss ({loss:.4g}) or the gradient norm ({grad_norm:.4g}) is not "
        f"finite; stopped before applying it. Last checkpoint: " +
        (f"{self.checkpointer.directory}/{last} (a rerun resumes from it)" if last is not None
         else "none yet (a rerun starts over)") +
        ". Lower train.lr, or set train.nonfinite=skip to skip such updates and go on")

  def _summarise(self, wall: dict, eval_metrics: dict, details: list, figures: dict) -> dict:
    cfg = self.config
    summary = {"task": cfg.task, "steps": cfg.train.steps, **wall,
               "params": state_lib.count_params(self.state.params),
               "skipped_updates": self.skipped_updates, **figures, **self.summary_fields(),
               **{f"eval_{k}": v for k, v in eval_metrics.items()}}
    extra = {"examples": details} if self.keep_examples else {}
    if jax.process_index() == 0:
      workdir_lib.write_summary(self.workdir, {**summary, **extra})
    self.finished(summary)
    return {**summary, **extra}

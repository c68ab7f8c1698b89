"""End to end through `realm_jax.train.loop.train`: ICT -> reader warm-up -> REALM (index
refreshes), the files each stage leaves, and a REALM run stopped by SIGTERM whose rerun
reproduces the uninterrupted one step for step (its checkpoints keep the input pipeline's
state)."""

import glob
import gzip
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from realm_jax.data import pipeline
from realm_jax.train import batches, candidate_rows, steps
from realm_jax.runtime import preemption, state as state_lib
from realm_jax.runtime.checkpoints import Checkpointer, restore_run
from realm_jax.train.loop import train
from realm_jax.runtime.metrics import read_jsonl
from realm_jax.runtime.profiling import StepTrace
from tests import helpers
from tests.helpers import tiny_config

REALM_STEPS, REFRESH_EVERY, CHECKPOINT_EVERY = 8, 3, 4


def realm_config(world_dir, warmup_dir, steps):
  # A warm-up longer than the run keeps the learning rate independent of train.steps (the
  # decay that follows the warm-up depends on it), and a large retriever lr makes every step
  # move the parameters and the index enough that a wrong restore would show in the losses.
  return tiny_config("realm", None, world_dir, train__steps=steps,
                     train__checkpoint_every=CHECKPOINT_EVERY, train__warmup_steps=10,
                     train__retriever_lr_scale=1.0, retrieval__refresh_every=REFRESH_EVERY,
                     init__from_workdir=warmup_dir, **helpers.SMALL_RETRIEVER)


@pytest.fixture(scope="module")
def stages(world_dir, tmp_path_factory):
  """The three demo stages, a few steps each, every one started from the previous one; the
  retriever is smaller than the reader (towers of their own sizes)."""
  root = tmp_path_factory.mktemp("stages")
  dirs = {name: str(root / name) for name in ("ict", "warmup", "realm")}
  configs = {
      "ict": tiny_config("ict", None, world_dir, train__steps=3, train__checkpoint_every=2,
                         **helpers.SMALL_RETRIEVER),
      "warmup": tiny_config("realm", "warmup", world_dir, train__steps=3,
                            init__from_workdir=dirs["ict"], **helpers.SMALL_RETRIEVER),
      "realm": realm_config(world_dir, dirs["warmup"], REALM_STEPS),
  }
  summaries = {}
  for name in ("ict", "warmup", "realm"):
    summaries[name] = train(configs[name], dirs[name])
  return dirs, configs, summaries


def checkpoint_steps(workdir):
  return sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())


def saved_params(config, workdir, world_data):
  run = restore_run(workdir, config=config, vocab_size=world_data.tokenizer.vocab_size,
                    block_len=world_data.blocks.block_len)
  return jax.device_get(run.params), run.step


def flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("name, steps, checkpoints, eval_keys, train_keys", [
    ("ict", 3, [2, 3], {"recall_at_1", "recall_at_5"}, {"loss", "ict_accuracy", "grad_norm"}),
    # the warm-up reads only the query's own block in training: utility is an eval metric
    ("warmup", 3, [2, 3], {"span_accuracy", "retrieval_utility"}, {"loss", "grad_norm"}),
    ("realm", REALM_STEPS, [4, 8], {"recall_at_1", "recall_at_5", "span_accuracy",
                                    "retrieval_utility"},
     # the demo trains without the null document: no utility to log in training
     {"loss", "retrieval_entropy", "index_staleness", "grad_norm"}),
], ids=["ict", "warmup", "realm"])
@pytest.mark.slow
def test_stage_outputs(stages, name, steps, checkpoints, eval_keys, train_keys):
  dirs, configs, summaries = stages
  workdir = dirs[name]
  rows = read_jsonl(os.path.join(workdir, "metrics", "train.jsonl"))
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  schedule = state_lib.learning_rate_schedule(configs[name].train)
  assert [r["learning_rate"] for r in rows] == pytest.approx(   # the rate each update used
      [float(schedule(s - 1)) for s in range(1, steps + 1)]) and rows[0]["learning_rate"] == 0
  for r in rows:
    assert train_keys <= set(r), set(r)
    assert np.isfinite(r["loss"]) and r["loss"] > 0
  assert glob.glob(os.path.join(workdir, "tb", "train", "events.out.tfevents.*"))
  assert glob.glob(os.path.join(workdir, "tb", "eval", "events.out.tfevents.*"))
  evals = read_jsonl(os.path.join(workdir, "metrics", "eval.jsonl"))
  assert [e["step"] for e in evals] == [steps]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["task"] == configs[name].task and summary["steps"] == steps
  assert {f"eval_{k}" for k in eval_keys} <= set(summary), set(summary)
  assert summary["eval_num_examples"] == configs[name].eval.num_examples
  assert isinstance(evals[0]["num_examples"], int), evals[0]   # a count, as documented
  assert isinstance(summary["eval_num_examples"], int), summary
  for key in eval_keys:
    value = summary[f"eval_{key}"]
    assert value == evals[0][key]
    if "recall" in key or "accuracy" in key:
      assert 0.0 <= value <= 1.0
  if name == "ict":
    assert "eval_span_accuracy" not in summary
  if name == "warmup":     # own-block candidates: no index, no recall
    assert not any("recall" in k for k in summary)
  if name != "ict":
    assert len(summary["examples"]) == 5
    assert {"query", "answer", "prediction", "evidence"} <= set(summary["examples"][0])
  assert summaries[name]["steps"] == steps
  assert checkpoint_steps(workdir) == checkpoints
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["task"] == configs[name].task
  with open(os.path.join(workdir, "vocab.txt")) as ours, \
      open(os.path.join(configs[name].data.dir, "vocab.txt")) as data:
    assert ours.read() == data.read()   # the tokens the run's ids mean


@pytest.mark.slow
def test_an_ict_run_cuts_queries_longer_than_query_len(world_dir, world_data, tmp_path, caplog):
  """ORQA's ICT query is its sentence's first query_len - 2 wordpieces. Queries of 10 (8 of a
  sentence) on the world's sentences of up to 13 are refused at start-up; with
  data.long_queries 'cut' the run trains and evaluates, and says what it cut: the training
  queries, the eval queries, and those of them cut to the window holding their target span."""
  from realm_jax.errors import ConfigError
  shapes = dict(data__query_len=10, data__max_masks=8, train__steps=2, train__checkpoint_every=2)
  with pytest.raises(ConfigError, match=r"data\.query_len: 10 < longest prepared sentence \+ 2 "
                     "= 16; or data.long_queries 'cut'"):
    train(tiny_config("ict", None, world_dir, **shapes), str(tmp_path / "refused"))
  config = tiny_config("ict", None, world_dir, data__long_queries="cut", **shapes)
  with caplog.at_level(logging.INFO):
    summary = train(config, str(tmp_path / "ict"))
  n, room = config.eval.num_examples, 8
  held_out = world_data.examples("eval")
  cut = int((world_data.examples("train").lengths > room).sum())
  assert summary["queries_cut"] == cut > 0
  assert summary["eval_queries_cut"] == (held_out.lengths[:n] > room).sum()
  assert summary["eval_queries_windowed"] == (held_out.target_span[:n, 1] > room).sum() > 0
  assert summary["steps"] == 2 and 0 <= summary["eval_recall_at_5"] <= 1
  rows = read_jsonl(os.path.join(str(tmp_path / "ict"), "metrics", "train.jsonl"))
  assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
  assert (f"{cut:,} cut to 8 wordpieces, data.long_queries 'cut'; of the {n} eval queries "
          f"{summary['eval_queries_cut']} cut, {summary['eval_queries_windowed']} of them to "
          "the window holding their target span") in caplog.text


@pytest.mark.slow
def test_index_refreshes_every_refresh_every_steps(stages):
  dirs, _, _ = stages
  rows = read_jsonl(os.path.join(dirs["realm"], "metrics", "train.jsonl"))
  # The index was built at steps 0, 3, 6: step s (1-based) ran on an index (s-1) % 3 old.
  assert [r["index_staleness"] for r in rows] == [(s - 1) % REFRESH_EVERY
                                                  for s in range(1, REALM_STEPS + 1)]


@pytest.mark.slow
def test_warmup_starts_from_ict_and_keeps_the_frozen_retriever(stages, world_data):
  dirs, configs, _ = stages
  ict, ict_step = saved_params(configs["ict"], dirs["ict"], world_data)
  warm, warm_step = saved_params(configs["warmup"], dirs["warmup"], world_data)
  assert ict_step == warm_step == 3
  # The warm-up froze the retriever (lr scale 0): it is exactly ICT's trained retriever.
  ict_retriever, warm_retriever = flat(ict["retriever"]), flat(warm["retriever"])
  for key, value in ict_retriever.items():
    np.testing.assert_array_equal(warm_retriever[key], value, err_msg=key)
  # ... while the reader (frozen in ICT) did train.
  ict_reader, warm_reader = flat(ict["reader"]), flat(warm["reader"])
  assert any(not np.array_equal(warm_reader[k], v) for k, v in ict_reader.items())


@pytest.mark.slow
def test_a_warmup_from_nothing_trains_the_reader_a_warmup_from_ict_does(stages, world_dir,
                                                                        world_data, tmp_path):
  """What lets `make demo` run the warm-up beside ICT: ICT leaves the reader at the seed's
  initial values, so a warm-up started from nothing ends with the same reader, to the bit."""
  dirs, configs, _ = stages
  config = tiny_config("realm", "warmup", world_dir, train__steps=3, **helpers.SMALL_RETRIEVER)
  train(config, str(tmp_path / "warmup"))
  alone, _ = saved_params(config, str(tmp_path / "warmup"), world_data)
  after_ict, _ = saved_params(configs["warmup"], dirs["warmup"], world_data)
  ours, theirs = flat(alone["reader"]), flat(after_ict["reader"])
  assert ours.keys() == theirs.keys()
  for key, value in theirs.items():
    np.testing.assert_array_equal(ours[key], value, err_msg=key)


@pytest.mark.slow
def test_sigterm_saves_exits_and_the_resumed_run_matches_the_uninterrupted_one(
    stages, world_dir, world_data, tmp_path):
  """realm-train gets SIGTERM mid-run: it finishes the step, finalises a checkpoint of it and
  exits with 143; the rerun continues from that step with the uninterrupted run's losses."""
  dirs, configs, _ = stages
  resumed = str(tmp_path / "resumed")
  config = realm_config(world_dir, dirs["warmup"], REALM_STEPS)
  proc = subprocess.Popen(
      [sys.executable, "-u", "-m", "realm_jax.train.main",
       *helpers.config_flags(config, "demo_realm"), f"--workdir={resumed}"],
      cwd=helpers.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("[realm] step 2/"):
      proc.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + proc.communicate(timeout=120)[0]
  assert proc.returncode == preemption.EXIT_CODE, out[-3000:]
  saved = checkpoint_steps(resumed)
  stopped = saved[-1]
  assert 2 <= stopped < REALM_STEPS, out[-3000:]
  assert f"[realm] SIGTERM: checkpoint {stopped} finalised" in out
  assert f"realm-train: preempted after step {stopped}" in out
  assert not os.path.exists(os.path.join(resumed, "summary.json"))
  assert Checkpointer(resumed, keep=3).latest_step() == stopped   # finalised, not in flight
  with open(os.path.join(resumed, "wall.json")) as f:
    first = json.load(f)
  assert first["runs"] == 1 and first["seconds"] > 0
  # What a run killed -9 after its checkpoint leaves as well: lines of the steps after it
  # (taken again by the rerun), the last one cut short.
  stale = {"train": {"loss": 99.0, "retrieval_entropy": 99.0, "grad_norm": 99.0,
                     "index_staleness": 99},
           "eval": {"span_accuracy": 2.0}, "retrieval": {"index_step": 99}}
  for name, record in stale.items():
    with open(os.path.join(resumed, "metrics", f"{name}.jsonl"), "a") as f:
      f.write(json.dumps({"step": stopped + 1, **record}) + '\n{"step": ')

  summary = train(config, resumed)
  assert summary["runs"] == 2   # the summary counts the preempted run's wall as well
  assert summary["index_steps_counted"] == REALM_STEPS - stopped   # since the resume
  assert summary["wall_seconds_all_runs"] == pytest.approx(
      first["seconds"] + summary["wall_seconds"], abs=0.1)
  assert checkpoint_steps(resumed)[-1] == REALM_STEPS
  straight = read_jsonl(os.path.join(dirs["realm"], "metrics", "train.jsonl"))
  again = again_lines = read_jsonl(os.path.join(resumed, "metrics", "train.jsonl"))
  assert [r["step"] for r in again] == list(range(1, REALM_STEPS + 1))   # each step once
  served = read_jsonl(os.path.join(resumed, "metrics", "retrieval.jsonl"))
  assert [r["step"] for r in served] == list(range(1, REALM_STEPS + 1))
  assert [r["index_step"] for r in served] == [s - (s - 1) % REFRESH_EVERY - 1
                                               for s in range(1, REALM_STEPS + 1)]
  # The index versions are numbered as in the uninterrupted run (not from 0 again), and a
  # run's first step has no step time (nothing before it to time from).
  served_straight = read_jsonl(os.path.join(dirs["realm"], "metrics", "retrieval.jsonl"))
  assert [r["index_version"] for r in served] == \
      [r["index_version"] for r in served_straight] == \
      [(s - 1) // REFRESH_EVERY for s in range(1, REALM_STEPS + 1)]
  assert [r["step"] for r in served if "step_seconds" not in r] == [1, stopped + 1]
  evals = read_jsonl(os.path.join(resumed, "metrics", "eval.jsonl"))
  assert [e["step"] for e in evals] == [REALM_STEPS]
  # TensorBoard hides what the killed run logged after the checkpoint: the rerun's event
  # file starts with a purge at the first step it takes again.
  events = sorted(glob.glob(os.path.join(resumed, "tb", "train", "events.out.tfevents.*")),
                  key=os.path.getmtime)
  assert helpers.purge_step(events[-1]) == stopped + 1
  for a, b in zip(straight, again):
    for key in ("loss", "retrieval_entropy", "grad_norm", "index_staleness"):
      np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-6,
                                 err_msg=f"step {a['step']} {key}")
  # The checkpoints' data items hold the input pipeline's state after the batches consumed.
  from realm_jax.runtime import partitioning   # (the run's share: its mesh's data shards)
  queries = batches.QueryBatches(configs["realm"], world_data, world_data.examples("train"),
                                 *partitioning.data_share(partitioning.make_mesh(
                                     configs["realm"].mesh.shape)))
  it = queries.iterator(prefetch=0)
  for step in range(1, REALM_STEPS + 1):
    next(it)
    if step in (stopped, REALM_STEPS):
      with open(os.path.join(resumed, "checkpoints", str(step), "data", "metadata")) as f:
        assert json.load(f) == queries.state(it.get_state(), step)
  it.close()
  # Same final parameters, too.
  a_params, _ = saved_params(configs["realm"], dirs["realm"], world_data)
  b_params, _ = saved_params(configs["realm"], resumed, world_data)
  b_flat = flat(b_params)
  for key, value in flat(a_params).items():
    np.testing.assert_allclose(b_flat[key], value, rtol=0, atol=1e-6, err_msg=key)
  # The finished run run again: its summary, nothing trained, evaluated or logged again.
  logged = {name: open(os.path.join(resumed, "metrics", f"{name}.jsonl")).read()
            for name in ("train", "eval", "retrieval")}
  assert train(config, resumed) == json.load(open(os.path.join(resumed, "summary.json")))
  assert logged == {name: open(os.path.join(resumed, "metrics", f"{name}.jsonl")).read()
                    for name in logged}
  assert json.load(open(os.path.join(resumed, "wall.json")))["runs"] == 2
  # Stopped after its final checkpoint, before its summary: the rerun evaluates the last step
  # again, and that evaluation replaces the earlier one.
  os.remove(os.path.join(resumed, "summary.json"))
  rerun = train(config, resumed)
  evals = read_jsonl(os.path.join(resumed, "metrics", "eval.jsonl"))
  assert [e["step"] for e in evals] == [REALM_STEPS]
  assert rerun["eval_retrieval_utility"] == evals[0]["retrieval_utility"] == \
      summary["eval_retrieval_utility"]
  assert read_jsonl(os.path.join(resumed, "metrics", "train.jsonl")) == again_lines


class _Finalised:
  """A checkpointer whose step 3 is finalised."""

  def wait(self):
    pass

  def latest_step(self):
    return 3


def test_an_unsaved_sigterm_reaches_the_callers_handler_and_no_watchdog_outlives_the_run(
    monkeypatch, capsys):
  """SIGTERM after the last step (during the final evaluation, or as the checkpointer closes):
  closing the run hands it on to the handler its in-process caller installed (the demo's stops
  the demo) unless the run failed, and the watchdog stops instead of ending the caller's
  process later."""
  exits, handled = [], []
  monkeypatch.setattr(preemption.os, "_exit", exits.append)
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: handled.append(signum))

  def signalled(grace):
    watcher = preemption.Preemption(grace_seconds=grace, prefix="[t] ")
    watcher.steps_done()
    os.kill(os.getpid(), signal.SIGTERM)
    while not watcher.requested():
      time.sleep(0.01)
    return watcher
  try:
    finished = signalled(2.0)
    finished.close()
    for thread in threading.enumerate():   # a watchdog still waiting would exit after 2 s
      if thread.name == "preemption-watchdog":
        thread.join(5)
    os.kill(os.getpid(), signal.SIGTERM)   # while the summary is written: still the run's
    time.sleep(0.1)
    assert exits == [] and handled == []   # passed on once the run's summary is written
    finished.release()
    assert handled == [signal.SIGTERM]
    out = capsys.readouterr().out
    assert "[t] SIGTERM: after the last step: finishing the run (grace 2s)" in out
    assert "[t] SIGTERM after the last step: the run has finished; passing the signal on" in out
    failed = signalled(2.0)
    failed.close()
    failed.release(pass_on=False)          # the run failed: its error says more
    answered = signalled(2.0)              # a SIGTERM the run saved a step for
    answered.saved(3, _Finalised())
    answered.close()
    answered.release()
    assert handled == [signal.SIGTERM] and exits == []
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_a_stop_agreed_after_the_last_step_says_the_run_stops(monkeypatch, capsys):
  """Several processes (JAX's sync manager took the SIGTERM: none was noted here) that agree
  to stop while the final evaluation waits for its index: the grace starts then, and its
  line says the run stops at its last step's checkpoint, not that it finishes; between two
  steps, that a checkpoint is saved (no step runs to be finished)."""
  exits = []
  monkeypatch.setattr(preemption.os, "_exit", exits.append)
  # after the last step; agreed between steps (a rebuild, a wait for an index) or at JAX's
  # sync point
  for after_the_steps, said in (
      (True, "[t] SIGTERM: after the last step: stopping, its checkpoint kept (grace 2s)"),
      (False, "[t] SIGTERM: saving a checkpoint (grace 2s)")):
    watcher = preemption.Preemption(grace_seconds=2.0, prefix="[t] ")
    try:
      if after_the_steps:
        watcher.steps_done()
      watcher.stopping()
      watcher.saved(3, _Finalised())
    finally:
      watcher.close()
      watcher.release()
    out = capsys.readouterr().out
    assert said in out and "finishing" not in out and exits == [], out


def test_a_save_not_finalised_within_the_grace_exits_75_not_143(monkeypatch, capsys):
  """143 says the step was saved (local.py, the demos and the sweep report a saved step);
  a save still running when the grace ends leaves the latest finalised checkpoint as it was."""
  exits = []
  monkeypatch.setattr(preemption.os, "_exit", exits.append)
  previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
  try:
    watcher = preemption.Preemption(grace_seconds=0.2, prefix="[t] ")
    os.kill(os.getpid(), signal.SIGTERM)
    assert watcher.reached(4)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
      time.sleep(0.02)
    assert exits == [preemption.EXIT_UNSAVED] == [75]
    assert "[t] SIGTERM: the checkpoint was not finalised within the grace period" in \
        capsys.readouterr().out
    watcher.close()
    watcher.release()
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_after_the_last_step_the_watchdog_exits_75_while_its_save_is_unfinished(
    monkeypatch, capsys):
  """SIGTERM in the final evaluation, the run not done within the grace: 143 only where the
  last step's checkpoint is finalised; while it is still being written the step is not saved
  (75), as in the steps' phase."""
  exits = []
  monkeypatch.setattr(preemption.os, "_exit", exits.append)
  previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
  try:
    def unknown():
      raise RuntimeError("the tracker cannot be read")
    for saving, code in ((True, preemption.EXIT_UNSAVED), (False, preemption.EXIT_CODE),
                         (unknown, preemption.EXIT_UNSAVED)):   # not known to be saved
      watcher = preemption.Preemption(grace_seconds=0.2, prefix="[t] ")
      watcher.steps_done(saving if callable(saving) else lambda: saving)
      os.kill(os.getpid(), signal.SIGTERM)
      deadline = time.monotonic() + 10
      while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
      assert exits == [code], saving
      out = capsys.readouterr().out
      assert "[t] SIGTERM: the run did not finish" in out
      assert ("its last step's checkpoint not finalised" in out) == (saving is not False)
      exits.clear()
      watcher.close()
      watcher.release()
  finally:
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.slow
def test_a_sigterm_in_the_final_evaluation_reaches_the_caller_after_the_summary(
    world_dir, tmp_path, monkeypatch):
  """An in-process stage (the demos' ICT, warm-up, Open-QA) stopped during its final
  evaluation: the run writes its summary and wall time first, then the caller's handler
  (the demo's raises) gets the signal; the stage is finished, not to be run again."""
  from realm_jax import processes
  from realm_jax.train.loop import Trainer
  evaluate = Trainer.evaluate

  def stopped_in_final(self, writer, step, final):
    if final:
      os.kill(os.getpid(), signal.SIGTERM)
    return evaluate(self, writer, step, final)
  monkeypatch.setattr(Trainer, "evaluate", stopped_in_final)
  previous = signal.signal(signal.SIGTERM, processes.on_sigterm)
  workdir = str(tmp_path / "warmup")
  try:
    with pytest.raises(processes.Preempted):
      train(tiny_config("realm", "warmup", world_dir, train__steps=2), workdir)
  finally:
    signal.signal(signal.SIGTERM, previous)
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["steps"] == 2
  with open(os.path.join(workdir, "wall.json")) as f:
    assert json.load(f)["runs"] == 1


def test_no_retrieval_baseline_reads_only_the_null_document(world_dir, world_data, tmp_path):
  """The baseline's reader input is `[CLS] x [SEP] [SEP]` (no block padding to read), its
  retriever plays no part, and retrieval utility is 0 by definition."""
  config = tiny_config("realm", "no_retrieval", world_dir, train__steps=2)
  queries = batches.QueryBatches(config, world_data, world_data.examples("train"))(0)
  cand = candidate_rows.of(config).rows(world_data, queries, None, training=True)
  batch = batches.realm_batch(config, world_data, queries, cand)
  assert batch["reader_ids"].shape == (config.train.batch_size, 1, config.data.query_len + 1)
  rows = np.arange(config.train.batch_size)
  ends = queries["query_len"]
  assert (batch["reader_ids"][rows, 0, ends] == world_data.tokenizer.sep_id).all()
  summary = train(config, str(tmp_path / "no_retrieval"))
  examples = world_data.examples("train")   # what a resume must train on again
  assert json.load(open(tmp_path / "no_retrieval" / "examples.json")) == {
      "split": "train", "examples": len(examples), "fingerprint": examples.fingerprint}
  assert summary["eval_retrieval_utility"] == 0.0 and 0 <= summary["eval_span_accuracy"] <= 1
  # One candidate: training logs no retrieval figures (they would be 0 by definition).
  rows = read_jsonl(os.path.join(tmp_path, "no_retrieval", "metrics", "train.jsonl"))
  assert rows and not any(k.startswith(("retrieval_", "null_doc")) for r in rows for k in r)
  # Its only candidate is the null document: the marginal is the null document's prediction.
  assert summary["eval_span_accuracy_null_document"] == summary["eval_span_accuracy"]


def the_trace(workdir):
  """The one trace of a run's steps in W/tb/profile: its .trace.json.gz and its events."""
  traces = glob.glob(os.path.join(workdir, "tb", "profile", "plugins", "profile", "*",
                                  "*.trace.json.gz"))
  assert len(traces) == 1, traces
  with gzip.open(traces[0]) as f:
    return traces[0], json.load(f)["traceEvents"]


def step_calls(events) -> int:
  """Calls of the train step in a trace: one "Execute (jit_step)" event each (and one per
  device, "[i] ...")."""
  return sum(1 for e in events if e.get("name", "").endswith("Execute (jit_step)")
             and not e["name"].startswith("["))


def test_a_profile_traces_the_steps_asked_for_and_no_other(world_dir, tmp_path, caplog):
  """train.profile_first_step 2, 5 steps asked of a 3-step run: a jax.profiler trace of
  steps 2 and 3 (two executions of the step, each marked as a step, the first's compile
  outside it) in W/tb/profile, said where it is."""
  config = tiny_config("realm", "no_retrieval", world_dir, train__steps=3,
                       train__profile_first_step=2, train__profile_steps=5)
  workdir = str(tmp_path / "w")
  with caplog.at_level(logging.INFO):
    train(config, workdir)
  trace, events = the_trace(workdir)
  assert step_calls(events) == 2
  # each step marked as one, numbered as the progress lines number it
  assert [e["args"]["step_num"] for e in events if e.get("name") == "train"] == ["2", "3"]
  assert f"tracing steps 2-3 into {os.path.join(workdir, 'tb', 'profile')}" in caplog.text
  assert "trace of steps 2-3" in caplog.text and os.path.dirname(trace) in caplog.text


def test_a_resumed_run_traces_what_is_left_of_its_profile_steps(tmp_path, caplog):
  """The steps traced are those of the window this run runs: a run resumed inside it traces
  the rest after its first step (which compiles); one resumed after it, none (and says so);
  none where the process is already tracing."""
  config = tiny_config("realm", "no_retrieval", "", train__steps=10,
                       train__profile_first_step=4, train__profile_steps=3)
  inside = StepTrace(config.train, str(tmp_path), 4, 10)
  assert inside.wanted and (inside.first, inside.last) == (6, 6)
  before = StepTrace(config.train, str(tmp_path), 2, 10)   # step 3 compiles: 4 is warm
  assert before.wanted and (before.first, before.last) == (4, 6)
  with caplog.at_level(logging.INFO):
    after = StepTrace(config.train, str(tmp_path), 5, 10)
  assert not after.wanted and "not among this run's after its compile (7-10; 6 compiles); no " \
      "trace" in caplog.text
  assert not StepTrace(tiny_config("realm", "no_retrieval", "").train, str(tmp_path), 0,
                       4).wanted   # profile_first_step 0: none
  # a trace of the caller's own running in this process: the run says so and goes on
  jax.profiler.start_trace(str(tmp_path / "callers"))
  try:
    inside.before(6)
  finally:
    jax.profiler.stop_trace()
  assert not inside.wanted and "train.profile_first_step: no trace (Profile has" in caplog.text
  inside.after(6, {})   # nothing to stop
  # a SIGTERM came: the window's last step is saved before the trace is written (its grace)
  stopped = StepTrace(config.train, str(tmp_path / "stopped"), 0, 10)
  with caplog.at_level(logging.INFO):
    for done in range(4, 7):
      stopped.before(done)
      stopped.after(done, jax.numpy.ones(2), stopping=done == 6)
    assert "trace of steps" not in caplog.text
    stopped.stop()   # the run closing, after its save
  assert "trace of steps 4-6" in caplog.text


@pytest.mark.slow   # end-to-end runs: the slow tier
def test_a_fresh_start_clears_the_records_of_the_start_before_it(world_dir, tmp_path,
                                                                 monkeypatch, caplog):
  """W holds a finished run's summary and wall record but not its checkpoints (removed to
  train again). A fresh start there that stops after its last step's checkpoint, before its
  summary (killed in its final evaluation), is resumed to evaluate that step: not taken for
  the earlier start finished (before, the rerun said 'finished before' and returned the
  earlier start's summary, of other params, as its own); its wall record holds its own runs
  alone (before, the earlier start's too)."""
  from realm_jax.train.loop import Trainer
  workdir = str(tmp_path / "w")
  train(tiny_config("ict", None, world_dir, train__steps=3), workdir)
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  config = tiny_config("ict", None, world_dir, train__steps=3, seed=1)
  evaluate = Trainer.evaluate

  def killed(self, writer, step, final):
    if final:
      raise RuntimeError("killed in the final evaluation")
    return evaluate(self, writer, step, final)
  monkeypatch.setattr(Trainer, "evaluate", killed)
  with pytest.raises(RuntimeError, match="killed in the final evaluation"):
    train(config, workdir)
  assert not os.path.exists(os.path.join(workdir, "summary.json"))
  monkeypatch.undo()
  with caplog.at_level(logging.INFO):
    summary = train(config, workdir)
  assert "finished before" not in caplog.text
  assert f"resumed from {os.path.join(workdir, 'checkpoints', '3')}" in caplog.text
  assert summary["runs"] == 1 and summary["wall_seconds_all_runs"] == summary["wall_seconds"]
  with open(os.path.join(workdir, "summary.json")) as f:
    assert json.load(f)["eval_recall_at_5"] == summary["eval_recall_at_5"]


def test_the_trace_line_times_the_window_with_its_write(tmp_path, caplog, monkeypatch):
  """The seconds of the line that says where the trace is run to its written end, as
  docs/performance.md has them: a write of 1.5 s (the steps traced take milliseconds) is in
  them (before, the line stopped its clock before the write)."""
  written = jax.profiler.stop_trace

  def slow_write():
    time.sleep(1.5)
    written()

  monkeypatch.setattr(jax.profiler, "stop_trace", slow_write)
  config = tiny_config("realm", "no_retrieval", "", train__steps=4,
                       train__profile_first_step=2, train__profile_steps=1)
  trace = StepTrace(config.train, str(tmp_path), 0, 4)
  with caplog.at_level(logging.INFO):
    trace.before(2)
    trace.after(2, jax.numpy.ones(2))
  seconds = re.search(r"trace of steps 2-2 \(([\d.]+)s\) written to", caplog.text)
  assert seconds and float(seconds.group(1)) >= 1.5, caplog.text


def test_a_trace_that_cannot_be_written_leaves_the_run_going(world_dir, tmp_path, caplog,
                                                             monkeypatch):
  """The trace's write fails (a full disk): the run says so and finishes, its steps saved;
  the trace is not its output."""
  written = jax.profiler.stop_trace

  def full_disk():
    written()   # the profiler's state ends as after a failed write's retry
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: vm.xplane.pb; No space left on device")

  monkeypatch.setattr(jax.profiler, "stop_trace", full_disk)
  config = tiny_config("realm", "no_retrieval", world_dir, train__steps=3,
                       train__profile_first_step=2, train__profile_steps=1)
  workdir = str(tmp_path / "w")
  with caplog.at_level(logging.INFO):
    summary = train(config, workdir)
  assert summary["steps"] == 3 and os.path.isdir(os.path.join(workdir, "checkpoints", "3"))
  assert "the trace could not be written to" in caplog.text and "No space left" in caplog.text
  assert "trace of steps" not in caplog.text


def test_a_run_resumed_inside_the_profile_window_traces_its_warm_steps(world_dir, tmp_path,
                                                                      caplog):
  """A run resumed at step 3 inside the window 3-5: its step 4 compiles the step again, so
  it traces step 5 alone, and the trace holds that step (one holding a compile is full of it:
  its .trace.json.gz keeps the first million events)."""
  workdir = str(tmp_path / "w")
  train(tiny_config("realm", "no_retrieval", world_dir, train__steps=3), workdir)
  config = tiny_config("realm", "no_retrieval", world_dir, train__steps=6,
                       train__profile_first_step=3, train__profile_steps=3)
  with caplog.at_level(logging.INFO):
    train(config, workdir)
  assert "trace of steps 5-5" in caplog.text and step_calls(the_trace(workdir)[1]) == 1


@pytest.mark.slow
def test_the_null_document_embedded_once_and_read_short_changes_nothing(world_data, world_dir,
                                                                        monkeypatch):
  """A training batch's candidate 0 is the null document in every row: embedding it once and
  reading it at the query's length gives the same retrieval logits, log-probs, loss and
  gradients as the block-length path (the padding takes no part in either)."""
  config = tiny_config("realm", None, world_dir, retrieval__k=4,
                       retrieval__train_null_document=True)
  candidates = candidate_rows.of(config)
  assert candidates.null_first(training=True) and candidates.null_first(training=False)
  queries = batches.QueryBatches(config, world_data, world_data.examples("train"))(0)
  source = queries["source_block"]
  retrieved = np.stack([source + i for i in range(1, 5)], axis=1) % world_data.blocks.num_blocks
  cand = candidate_rows.of(config).rows(world_data, queries, retrieved, training=True)
  batch = batches.realm_batch(config, world_data, queries, cand)
  null_len = pipeline.reader_length(config.data.query_len, pipeline.NULL_DOCUMENT_LENGTH)
  assert batch["reader_ids"].shape[-1] > null_len
  assert not batch["reader_ids"][:, 0, null_len:].any()
  model = state_lib.build_model(config, world_data.tokenizer.vocab_size)
  inputs = state_lib.dummy_inputs(config, config.data.block_len)
  params = helpers.drawn_params(model, 0, initializer_range=config.model.initializer_range,
                                **inputs)
  # The scores and their pullback of one fixed random cotangent, both paths: the gradients of
  # both towers and both reads, each entry of order one (no cancellation).
  def scores_and_pullback(first):
    out, pullback = jax.vjp(
        lambda p: steps.realm_scores(model, p, batch, None, True, True, first), params)
    draws = jax.random.split(jax.random.PRNGKey(1), len(out))
    return out, pullback(tuple(jax.random.normal(d, o.shape, o.dtype)
                               for d, o in zip(draws, out)))[0]
  pullbacks = jax.jit(scores_and_pullback, static_argnums=0)
  (short, grads_short), (full, grads_full) = pullbacks(True), pullbacks(False)
  for a, b in zip(short, full):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # 1e-8 on top: the attention key bias's gradient is zero in exact arithmetic (a softmax
  # does not change under a shift of its logits), its float32 rounding ~1e-9.
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_short),
                          jax.tree_util.tree_leaves(grads_full)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-5 * float(np.abs(b).max()) + 1e-8,
                               err_msg=jax.tree_util.keystr(path))

  def loss(first):
    """The train step's loss with the null-first path on or off. (Its gradient is the
    pullback above through the loss's own function of the scores; compared directly, its
    retriever part at drawn parameters is p(z|x,y) - p(z|x) ~ 0 times the score gradients, a
    cancellation whose float32 rounding was ~25% of those leaves on the AVX-512 Xeon: 1.7e-6
    of 6.3e-6, 8.5e-10 with the parameters in float64.)"""
    monkeypatch.setattr(candidate_rows.Retrieved, "null_first", lambda self, training: first)
    return jax.jit(lambda p: steps.realm_loss_fn(p, model, batch, config,
                                                 jax.random.PRNGKey(0))[0])(params)
  assert float(loss(True)) == pytest.approx(float(loss(False)), rel=1e-6)


@pytest.mark.slow
def test_training_without_the_null_document(world_dir, world_data, tmp_path, capsys):
  """`retrieval.train_null_document=False`: a training batch holds the k - 1 retrieved blocks
  (no null document, never the query's own block); evaluation still reads the null document
  alone, outside the marginal the step trained; k = 2 is refused."""
  from realm_jax.errors import ConfigError
  from realm_jax.config.validation import validate
  config = tiny_config("realm", None, world_dir, train__steps=2, retrieval__k=4,
                       retrieval__train_null_document=False)
  queries = batches.QueryBatches(config, world_data, world_data.examples("train"))(0)
  source = queries["source_block"]
  retrieved = np.stack([source, source + 1, source + 2, source + 3, source + 4], axis=1)
  retrieved %= world_data.blocks.num_blocks
  cand = candidate_rows.of(config).rows(world_data, queries, retrieved, training=True)
  assert cand.shape == (len(source), 3) and (cand != pipeline.NULL_BLOCK).all()
  assert (world_data.blocks.uids[cand] != world_data.blocks.uids[source][:, None]).all()
  evaluated = candidate_rows.of(config).rows(world_data, queries, retrieved)
  assert (evaluated[:, 0] == pipeline.NULL_BLOCK).all()
  np.testing.assert_array_equal(evaluated[:, 1:], cand)
  # Three copies of the query's own block among the top k + 1 leave a slot to the null
  # document; the step finds it (and gives it no prior mass) from its wordpieces alone.
  retrieved[:, 1:3] = source[:, None]
  cand = candidate_rows.of(config).rows(world_data, queries, retrieved, training=True)
  assert (cand[:, :2] != pipeline.NULL_BLOCK).all() and (cand[:, 2] == pipeline.NULL_BLOCK).all()
  batch = batches.realm_batch(config, world_data, queries, cand)
  np.testing.assert_array_equal(np.asarray(steps.null_candidates(batch["candidate_ids"])),
                                cand == pipeline.NULL_BLOCK)
  summary = train(config, str(tmp_path / "no_null"))
  rows = read_jsonl(os.path.join(tmp_path, "no_null", "metrics", "train.jsonl"))
  assert rows and all("retrieval_utility" not in r and "null_doc_prob" not in r for r in rows)
  assert all(np.isfinite(r["loss"]) and "retrieval_entropy" in r for r in rows)
  # The progress line shows the entropy of p(z|x) (no utility without the null document).
  lines = [l for l in capsys.readouterr().out.splitlines() if " step 2/2 loss " in l]
  assert lines and " retrieval_entropy " in lines[0] and "retrieval_utility" not in lines[0]
  assert np.isfinite(summary["eval_retrieval_utility"])
  assert 0 <= summary["eval_span_accuracy_null_document"] <= 1
  config.retrieval.k = 2
  with pytest.raises(ConfigError, match="retrieval.k.*train_null_document False"):
    validate(config)


def test_every_candidates_mode_is_one_object_with_its_spec():
  """`retrieval.candidates` names one object each (train/candidate_rows.py), and what the
  step reads of it: only retrieved candidates are scored by the retriever; evaluation puts
  the null document first except when it is the only candidate; the null document alone is
  read at its own length."""
  from realm_jax.config import defaults
  assert set(candidate_rows.MODES) == set(defaults.CANDIDATE_SOURCES)
  spec = {}
  for mode in defaults.CANDIDATE_SOURCES:
    c = candidate_rows.of(tiny_config("realm", None, "", retrieval__candidates=mode))
    spec[mode] = (c.retrieves, c.scored, c.null_first(training=False), c.reader_block_len(288))
  assert spec == {"index": (True, True, True, 288), "mixed": (True, False, True, 288),
                  "own_block": (False, False, True, 288),
                  "null_only": (False, False, False, pipeline.NULL_DOCUMENT_LENGTH)}
  from realm_jax.config.reading import retriever_scores_candidates   # what validation reads
  assert all(retriever_scores_candidates(tiny_config("realm", None, "", retrieval__candidates=m))
             == scored for m, (_, scored, _, _) in spec.items())


@pytest.mark.slow
def test_a_corpus_smaller_than_the_evaluation_asks_for_is_read_whole(tmp_path):
  """Four blocks, k = 3 (the most training allows: k + 1 rows of the index): the masked
  evaluation asked the index for max(recall@5, k) + 1 = 6 rows and failed after training
  ("asked for 6 blocks from an index of 4"); it now reads the whole corpus."""
  from tests.test_zero_shot import prepare_squad
  towns = ["Carrow", "Dunmore", "Hollin", "Varn"]
  topics = [(t, " ".join(f"The {w} of {t} opened in {1800 + 7 * i + j}." for j, w in
                          enumerate(["mill", "school", "bridge", "library", "chapel", "market"])))
            for i, t in enumerate(towns)]
  data_dir = prepare_squad(tmp_path, topics, block_len=64, eval_fraction=0.3)
  config = tiny_config("realm", None, data_dir, retrieval__k=3, train__steps=2,
                       train__batch_size=8, train__checkpoint_every=2, eval__num_examples=6,
                       eval__batch_size=8, data__block_len=64, data__query_len=32)
  summary = train(config, str(tmp_path / "realm"))
  assert summary["eval_num_examples"] == 6 and 0 <= summary["eval_span_accuracy"] <= 1
  assert summary["examples"]
  for example in summary["examples"]:   # the reader read the other blocks, never the query's
    own = next(t for t in towns if t.lower() in f"{example['query']} {example['answer']}")
    titles = {e["title"] for e in example["evidence"]}
    assert own not in titles and titles <= set(towns) | {"(null document)"}, (own, titles)


@pytest.mark.slow
def test_a_run_resumed_on_data_of_another_vocab_is_refused_before_it_writes(stages, tmp_path):
  """The ICT run's data copied with two vocab tokens swapped (the same size, other words):
  resuming the run on it is refused naming data.dir and W/vocab.txt, and W is left as it was;
  a reader of the run's checkpoints checks against W/vocab.txt too, whatever data dir (here
  a relative one) the run recorded; a workdir without checkpoints may change its data, one
  from before W/vocab.txt is checked against the data dir it recorded."""
  from realm_jax.errors import ConfigError
  from realm_jax.runtime import initialization
  from realm_jax.train.run import Run
  dirs, configs, _ = stages
  workdir = dirs["ict"]
  swapped = helpers.swapped_vocab_copy(configs["ict"].data.dir, tmp_path / "swapped_vocab")
  config = configs["ict"].copy_and_resolve_references()
  config.data.dir, config.train.steps = str(swapped), 5
  before = {name: os.path.getmtime(os.path.join(workdir, name))
            for name in ("config.json", "vocab.txt")}
  with pytest.raises(ConfigError, match=r"config\.data\.dir: the data's .*swapped_vocab/vocab"
                     r"\.txt .* differs from .*/ict/vocab\.txt.* or train in a new workdir"):
    train(config, workdir)
  assert checkpoint_steps(workdir) == [2, 3]
  assert {name: os.path.getmtime(os.path.join(workdir, name)) for name in before} == before
  back = configs["ict"].copy_and_resolve_references()
  back.train.steps = 2           # below the step-3 checkpoint: it would be recorded as step 2
  with pytest.raises(ConfigError, match=r"config\.train\.steps: 2 is below 3, the step of the "
                     "latest checkpoint in .*: a run does not go back"):
    train(back, workdir)
  assert {name: os.path.getmtime(os.path.join(workdir, name)) for name in before} == before
  copy = tmp_path / "ict_copy"   # the run as recorded where it ran: a relative data dir
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("checkpoints"))
  record = json.loads((copy / "config.json").read_text())
  record["data"]["dir"] = "runs/elsewhere/data"
  (copy / "config.json").write_text(json.dumps(record))
  with pytest.raises(ConfigError, match=r"config\.init\.from_workdir: the data's .*swapped"):
    initialization.check_run_vocab(str(copy), "init.from_workdir",
                                   str(swapped / "vocab.txt"))
  initialization.check_run_vocab(str(copy), "init.from_workdir",
                                 os.path.join(configs["ict"].data.dir, "vocab.txt"))
  # Without checkpoints (a run that died before its first save) the data may change; a
  # workdir from before W/vocab.txt is checked against the data dir it recorded.
  Run._check_vocab(str(copy), str(swapped / "vocab.txt"))
  old = tmp_path / "ict_old"
  shutil.copytree(workdir, old)
  (old / "vocab.txt").unlink()
  with pytest.raises(ConfigError, match=r"config\.data\.dir: .*swapped.* or resume .*ict_old "
                     "on the data it trained on"):
    Run._check_vocab(str(old), str(swapped / "vocab.txt"))


def test_a_run_resumed_on_other_examples_is_refused_before_it_writes(world_dir, world_data,
                                                                     tmp_path):
  """The checkpoints' input-pipeline position indexes into the examples they trained on
  (W/examples.json): a resume on fewer of them, or the same in another order, is refused
  naming data.dir before anything is written; the same examples in a moved data dir, and a
  workdir from before the record, resume. Another seed or data.split is refused too."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.data.prepared import PreparedData
  from realm_jax.errors import ConfigError, DataError
  examples = world_data.examples("train")
  workdir = tmp_path / "work"
  os.makedirs(workdir / "checkpoints" / "10")   # a run that saved step 10
  workdir_lib.record_examples(str(workdir), "train", len(examples), examples.fingerprint)
  n = len(examples)
  rows = {"fewer": np.arange(200)[::-1], "reordered": np.roll(np.arange(n), 1)}
  for name, picked in rows.items():
    data = helpers.examples_copy(world_dir, tmp_path / name, picked)
    config = tiny_config("realm", "no_retrieval", str(data), train__steps=20)
    with pytest.raises(ConfigError, match=rf"config\.data\.dir: its {len(picked)} examples of "
                       rf"split 'train' .*{name}/examples/train\) are not the {n} that the "
                       r"checkpoints in .* trained on \(other examples, or the same in "
                       r"another order; examples\.json: fingerprint"):
      train(config, str(workdir))
  assert sorted(os.listdir(workdir)) == ["checkpoints", "examples.json"]
  moved = PreparedData(str(helpers.examples_copy(world_dir, tmp_path / "moved", np.arange(n))))
  workdir_lib.check_examples(str(workdir), moved.dir, "train", n,
                             moved.examples("train").fingerprint)
  with pytest.raises(ConfigError, match=r"config\.data\.split: 'other' but the checkpoints "
                     r"in .* trained on split 'train'"):
    workdir_lib.check_examples(str(workdir), world_dir, "other", n, examples.fingerprint)
  record = (workdir / "examples.json").read_text()
  (workdir / "examples.json").write_text(record[:10])   # cut short: named, no traceback
  with pytest.raises(DataError, match=r"examples\.json: not the JSON a run writes"):
    workdir_lib.check_examples(str(workdir), world_dir, "train", n, examples.fingerprint)
  os.remove(workdir / "examples.json")
  workdir_lib.check_examples(str(workdir), world_dir, "train", 200, "another")
  # The seed orders the examples and data.split names them: a resume keeps both.
  config = tiny_config("realm", "no_retrieval", world_dir)
  workdir_lib.record_config(config, str(workdir))
  for option, value in (("seed", 1), ("data.split", "other")):
    other = helpers.apply_overrides(config.copy_and_resolve_references(),
                                    {option.replace(".", "__"): value})
    with pytest.raises(ConfigError, match=rf"{option}: .* \(checkpoints\) != {value!r} "
                       r"\(this run\)"):
      workdir_lib.record_config(other, str(workdir))


def test_an_empty_eval_split_is_said_to_be_empty(world_dir, tmp_path, caplog):
  """Data prepared with no eval examples (eval_fraction 0) trains; its evaluations measure
  nothing, and say it is for that reason (not for a missing reader or ground truth)."""
  data = helpers.examples_copy(world_dir, tmp_path / "data", np.arange(0), split="eval")
  config = tiny_config("realm", "no_retrieval", str(data), train__steps=1)
  with caplog.at_level("INFO"):
    summary = train(config, str(tmp_path / "w"))
  assert summary["eval_num_examples"] == 0
  assert "eval @ 1: nothing to measure (eval.split 'eval' holds no examples)" in caplog.text


def test_a_finished_run_run_again_under_other_values_keeps_its_record(world_dir, tmp_path,
                                                                       caplog):
  """A finished run run again trains nothing: W/config.json keeps the values its checkpoints
  were trained under (not the rerun's other learning rate, which no step used), and nothing
  is said to resume."""
  workdir = str(tmp_path / "run")
  config = tiny_config("ict", None, world_dir, train__steps=2, train__checkpoint_every=2)
  summary = train(config, workdir)
  recorded = open(os.path.join(workdir, "config.json")).read()
  other = tiny_config("ict", None, world_dir, train__steps=2, train__checkpoint_every=2,
                      train__lr=config.train.lr * 2)
  with caplog.at_level(logging.INFO):
    assert train(other, workdir) == summary
  assert open(os.path.join(workdir, "config.json")).read() == recorded
  assert "under other values" not in caplog.text, caplog.text

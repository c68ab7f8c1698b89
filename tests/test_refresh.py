"""The trainer with the separate index builder (`launch/local.py`): deterministic runs repeat bit
for bit, also across a kill -9 of the trainer; async runs never wait after the first index."""

import itertools
import json
import os
import signal
import subprocess
import sys

import pytest

from realm_jax.train.feed import deterministic_source_step
from realm_jax.runtime.metrics import read_jsonl
from tests import helpers

pytestmark = pytest.mark.slow   # the slow tier: `make test` runs it, `make test-fast` does not

STEPS = 9
REFRESH_EVERY = 3
SWAP_LAG = 1
KILL_AT = 8      # the trainer is killed once it has logged this step


def refresh_config(world_dir, mode):
  return helpers.tiny_config(
      "realm", data_dir=world_dir, retrieval__refresh=mode,
      retrieval__refresh_every=REFRESH_EVERY, retrieval__swap_lag=SWAP_LAG,
      retrieval__index_timeout=240.0, builder__poll_seconds=0.1, train__steps=STEPS,
      train__checkpoint_every=6, train__log_every=1, data__prefetch=2)


def launch(config, workdir):
  flags = helpers.config_flags(config, "demo_realm")
  return subprocess.Popen([sys.executable, "-u", os.path.join("launch", "local.py"), *flags,
                           f"--workdir={workdir}", "--grace=20"], cwd=helpers.REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)


def finish(proc) -> str:
  out = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, out[-4000:]
  return out


def per_step(workdir, name, key):
  """{step: value} from W/metrics/<name>.jsonl; a resumed run's lines replace the earlier."""
  return {r["step"]: r[key] for r in read_jsonl(os.path.join(workdir, "metrics",
                                                             f"{name}.jsonl")) if key in r}


def test_deterministic_runs_repeat_exactly_also_after_a_kill(world_dir, tmp_path):
  config = refresh_config(world_dir, "deterministic")
  first = str(tmp_path / "first")
  out = finish(launch(config, first))
  assert "[builder]" in out and "[trainer]" in out
  losses = per_step(first, "train", "loss")
  assert sorted(losses) == list(range(1, STEPS + 1))
  # Step t retrieved from the version built from the checkpoint of the rule's step.
  index_steps = per_step(first, "retrieval", "index_step")
  assert index_steps == {t + 1: deterministic_source_step(t, REFRESH_EVERY, SWAP_LAG)
                         for t in range(STEPS)}
  with open(os.path.join(first, "summary.json")) as f:
    summary = json.load(f)
  assert summary["index_versions_used"] == len(set(index_steps.values()))
  assert os.path.exists(os.path.join(first, "DONE"))

  # The same run again, its trainer killed -9 before its first step (only the first snapshot,
  # checkpoint 0, saved), launched again and killed mid-run, then launched again: resumes.
  second = str(tmp_path / "second")
  for kill_at in ("index v1 (step 0) loaded", f"step {KILL_AT}/{STEPS}"):
    proc = launch(config, second)
    trainer_pid, printed = None, []
    for line in proc.stdout:
      printed.append(line)
      if "trainer: started, pid" in line:
        trainer_pid = int(line.rsplit(" ", 1)[1])
      if kill_at in line:
        os.killpg(trainer_pid, signal.SIGKILL)
        break
    printed.append(proc.communicate(timeout=300)[0])
    assert proc.returncode != 0 and "trainer failed" in "".join(printed), \
        "".join(printed)[-3000:]
    assert not os.path.exists(os.path.join(second, "DONE"))
    if kill_at.startswith("index"):   # the rerun resumes from the first snapshot alone
      saved = os.listdir(os.path.join(second, "checkpoints"))
      assert sorted(int(d) for d in saved if d.isdigit()) == [0], saved
  out = finish(launch(config, second))
  assert "resumed from" in out, out[-3000:]
  resumed = per_step(second, "train", "loss")
  assert resumed == losses           # exactly, step by step
  assert per_step(second, "retrieval", "index_step") == index_steps


def test_async_run_never_waits_after_the_first_index(world_dir, tmp_path):
  config = refresh_config(world_dir, "async")
  workdir = str(tmp_path / "async")
  out = finish(launch(config, workdir))
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  assert summary["index_blocking_waits"] == 0
  waits = per_step(workdir, "retrieval", "index_wait_seconds")
  assert all(w < 0.01 for step, w in waits.items() if step > 1), waits
  staleness = per_step(workdir, "retrieval", "index_staleness")
  assert sorted(staleness) == list(range(1, STEPS + 1))
  assert summary["index_staleness_max"] == max(staleness.values())
  for key in ("index_staleness_p50", "index_staleness_p95", "index_versions_used"):
    assert key in summary
  assert "index staleness p50" in out
  assert "eval_span_accuracy" in summary     # the final eval ran on the final step's index
  with open(os.path.join(workdir, "metrics", "eval.jsonl")) as f:
    final = [json.loads(line) for line in f][-1]
  assert final["index_step"] == STEPS and isinstance(final["index_step"], int), final
  assert "[builder]" in out and "versions published" in out


@pytest.mark.parametrize("bad", ["dim"])
def test_index_of_another_dim_is_refused_by_the_trainer(world_dir, tmp_path, bad):
  """A trainer whose model has another retrieval dim than the published index never uses it."""
  config = refresh_config(world_dir, "async")
  workdir = str(tmp_path / "run")
  builder_config = refresh_config(world_dir, "async")
  builder_config.model.retrieval_dim = 16
  from tests.test_index_builder import build_once, make_checkpoints
  make_checkpoints(builder_config, workdir, (0,))
  build_once(builder_config, workdir)
  config.retrieval.index_timeout = 3.0
  from realm_jax.train.loop import Trainer
  trainer = Trainer(config, str(tmp_path / "trainer"))
  os.symlink(os.path.join(workdir, "index"), os.path.join(str(tmp_path / "trainer"), "index"))
  with pytest.raises(TimeoutError, match=r"index_timeout\); 1 published version\(s\) "
                     r"rejected \(v1: dim 16 \(index\) != 32 \(trainer\)\)"):
    trainer.candidates.schedule.start_async(0, 2)
  assert "dim 16 (index) != 32 (trainer)" in trainer.candidates.subscriber.rejected[1]
  trainer.candidates.close()


def trained_until_sigterm_at_step_6(config, workdir: str, capsys) -> str:
  """Trains `config` (deterministic, refresh every 3, swap lag 2) in this process beside a
  thread that builds the index of checkpoint 0 once it is saved (no builder follows) and,
  once step 5 is logged and the batch of step 6 waits for the index of checkpoint 3, sends
  this process SIGTERM; the run stops preempted at step 5. Returns what it printed."""
  import threading
  import time
  from realm_jax.train.loop import train
  from tests.test_index_builder import build_once
  log = os.path.join(workdir, "metrics", "train.jsonl")

  def index_of_step_0_then_sigterm():
    while not os.path.isdir(os.path.join(workdir, "checkpoints", "0")):
      time.sleep(0.1)
    build_once(config, workdir)
    while not (os.path.exists(log) and [r["step"] for r in read_jsonl(log)][-1:] == [5]):
      time.sleep(0.1)
    time.sleep(1.0)                    # the batch of step 6 now waits for the index of 3
    os.kill(os.getpid(), signal.SIGTERM)
  thread = threading.Thread(target=index_of_step_0_then_sigterm, daemon=True)
  thread.start()
  summary = train(config, workdir)
  thread.join(timeout=10)
  out = capsys.readouterr().out
  assert summary.get("preempted_at_step") == 5, out[-3000:]
  return out


def test_a_sigterm_while_a_batch_waits_for_its_index_saves_the_last_step(
    world_dir, tmp_path, monkeypatch, capsys):
  """Deterministic refresh with the builder behind: step 6 needs the index of checkpoint 3
  (refresh every 3, swap lag 2), which no builder makes. A SIGTERM while its batch waits
  saves step 5 at once, instead of losing the steps since checkpoint 3 when the grace period
  runs out (or the index timeout)."""
  from realm_jax.runtime import preemption
  exits = []
  monkeypatch.setattr(preemption.os, "_exit", exits.append)   # the watchdog's, if it fired
  config = helpers.tiny_config(
      "realm", data_dir=world_dir, retrieval__refresh="deterministic",
      retrieval__refresh_every=3, retrieval__swap_lag=2, retrieval__index_timeout=30.0,
      train__steps=9, train__checkpoint_every=100, train__log_every=1, data__prefetch=1,
      train__preemption_grace_seconds=20.0)
  workdir = str(tmp_path / "run")
  out = trained_until_sigterm_at_step_6(config, workdir, capsys)
  assert "SIGTERM before step 6: the batch of step 6 was not ready after" in out, out[-3000:]
  assert "checkpoint 5 finalised" in out and exits == []
  assert sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
                if d.isdigit()) == [0, 3, 5]


def test_a_refresh_steps_checkpoint_outlives_the_saves_before_its_index_is_needed(
    world_dir, tmp_path, monkeypatch, capsys):
  """Deterministic refresh every 3 steps, swap lag 2, a checkpoint every step, the builder
  behind: the batch of step 6 needs the index of checkpoint 3, and steps 4 and 5 are saved
  before it waits. With the fewest train.keep_checkpoints that validation takes, checkpoint 3
  is still there for the builder then (deleted, its index would never come)."""
  from realm_jax.config.validation import validate
  from realm_jax.errors import ConfigError
  from realm_jax.runtime import preemption
  monkeypatch.setattr(preemption.os, "_exit", lambda code: None)   # the watchdog's
  config = helpers.tiny_config(
      "realm", data_dir=world_dir, retrieval__refresh="deterministic",
      retrieval__refresh_every=3, retrieval__swap_lag=2, retrieval__index_timeout=30.0,
      train__steps=9, train__checkpoint_every=1, train__log_every=1, data__prefetch=1,
      train__preemption_grace_seconds=20.0)
  for keep in range(1, 10):   # the fewest validation takes
    config.train.keep_checkpoints = keep
    try:
      validate(config)
      break
    except ConfigError as e:
      assert e.option == "train.keep_checkpoints", e
  workdir = str(tmp_path / "run")
  trained_until_sigterm_at_step_6(config, workdir, capsys)
  saved = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
  assert 3 in saved, (keep, saved)


@pytest.mark.parametrize("mode", ["async", "deterministic"])
def test_a_fresh_start_beside_an_earlier_starts_index_versions_is_refused(world_dir, tmp_path,
                                                                         mode):
  """W/checkpoints gone (removed, or moved aside as unreadable), W/index left: the versions
  are an earlier start's. They served an async run's first steps (its newest), and realm-index,
  which builds only steps above the newest it published, built none of this run's; a
  deterministic run stopped on IndexNeverPublished. Now one line naming W/index, before the
  run saves anything."""
  import numpy as np
  from realm_jax.errors import ConfigError
  from realm_jax.retrieval import published
  from realm_jax.train.loop import train
  workdir = str(tmp_path / "run")
  root = published.index_root(workdir)
  published.publish_arrays(root, np.zeros((4, 2), np.float32), {}, step=7,
                           fingerprint="blocks", keep=2)
  with pytest.raises(ConfigError, match=rf"^{root} holds 1 index version\(s\) of an earlier "
                     rf"start \(the newest v1, built from its step 7\) and {workdir} has no "
                     rf"checkpoint to resume from: .*; remove {root} \(or give another "):
    train(refresh_config(world_dir, mode), workdir)
  saved = os.path.join(workdir, "checkpoints")
  assert not os.path.isdir(saved) or not [d for d in os.listdir(saved) if d.isdigit()]


def test_the_saves_a_refresh_steps_checkpoint_must_outlive_are_counted_exactly():
  """validation's bound on train.keep_checkpoints against the saves counted step by step: at
  steps S + 1 .. S + swap_lag, multiples of checkpoint_every or of refresh_every (one save
  where they coincide: counted twice, checkpoint every 2, refresh every 5, lag 5 asked for 5
  kept where 4 do), the most over every refresh step S."""
  from realm_jax.config.validation import saves_before_needed
  for every, refresh_every, lag in itertools.product(range(1, 8), range(1, 8), range(0, 12)):
    counted = max(sum(1 for s in range(start + 1, start + lag + 1)
                      if s % every == 0 or s % refresh_every == 0)
                  for start in range(0, 8 * every * refresh_every, refresh_every))
    assert saves_before_needed(every, refresh_every, lag) == counted, (every, refresh_every, lag)


def test_a_sigterm_while_the_first_index_or_the_final_evaluations_is_awaited_stops_at_once(
    world_dir, tmp_path, monkeypatch, capsys):
  """Async refresh. No builder yet: a SIGTERM while the trainer waits for the first published
  index stops it within a second, step 0 saved (the builder's first snapshot), instead of
  after the preemption grace (exit 75: not known saved) or the index timeout. The rerun
  resumes from it once the builder has published; then, the builder behind at the end, a
  SIGTERM while the final evaluation waits for the index of the last step's checkpoint stops
  it as soon, that step saved; the third run resumes from it and evaluates."""
  import threading
  import time
  from realm_jax.runtime import preemption
  from realm_jax.train.loop import train
  from tests.test_index_builder import build_once
  exits = []
  monkeypatch.setattr(preemption.os, "_exit", exits.append)   # the watchdog's, if it fired
  config = helpers.tiny_config(
      "realm", data_dir=world_dir, retrieval__refresh="async", retrieval__index_timeout=30.0,
      train__steps=2, train__preemption_grace_seconds=10.0, builder__poll_seconds=0.1)
  workdir = str(tmp_path / "run")
  signalled = []

  def sigterm_after(checkpoint: int, build_first: bool):
    def wait_then_signal():
      if build_first:                  # v1, of step 0: the steps' index
        while not os.path.isdir(os.path.join(workdir, "checkpoints", "0")):
          time.sleep(0.1)
        build_once(config, workdir)
      while not os.path.isdir(os.path.join(workdir, "checkpoints", str(checkpoint))):
        time.sleep(0.1)
      time.sleep(1.5)                  # the trainer now waits for an index
      signalled.append(time.time())
      os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=wait_then_signal, daemon=True).start()

  for checkpoint, build_first, said in (
      (0, False, "SIGTERM before step 1: the batch of step 1 was not ready after"),
      (2, True, "SIGTERM after the last step: the index of the evaluation at step 2 was not "
                "ready after")):
    sigterm_after(checkpoint, build_first)
    summary = train(config, workdir)
    stopped_after = time.time() - signalled[-1]
    out = capsys.readouterr().out
    assert summary.get("preempted_at_step") == checkpoint, out[-3000:]
    assert stopped_after < 5 and exits == [], out[-3000:]
    assert said in out and f"checkpoint {checkpoint} finalised" in out, out[-3000:]
    if checkpoint:
      assert f"resumed from {workdir}/checkpoints/0 " in out, out[-3000:]
  build_once(config, workdir)          # v2, of step 2
  summary = train(config, workdir)
  out = capsys.readouterr().out
  assert summary["steps"] == 2 and "eval_span_accuracy" in summary, out[-3000:]
  assert f"resumed from {workdir}/checkpoints/2 " in out


def test_an_async_run_whose_builder_is_gone_says_so(world_dir, tmp_path, capsys):
  """Async, one version (of checkpoint 0) and no builder after it: the trainer warns when the
  staleness passes STALE_REFRESHES refreshes, then the final evaluation fails after
  `index_timeout`, naming it (the doublings: the next test)."""
  import threading
  import time
  from realm_jax.train.candidates import STALE_REFRESHES
  from realm_jax.train.loop import train
  from tests.test_index_builder import build_once
  config = helpers.tiny_config(
      "realm", data_dir=world_dir, retrieval__refresh="async", retrieval__refresh_every=1,
      retrieval__index_timeout=120.0, builder__poll_seconds=0.1,
      train__steps=STALE_REFRESHES + 1, train__checkpoint_every=100, train__log_every=1)
  workdir = str(tmp_path / "run")

  def index_of_step_0_only():
    while not os.path.isdir(os.path.join(workdir, "checkpoints", "0")):
      time.sleep(0.1)
    build_once(config, workdir)
    config.retrieval.index_timeout = 1.0   # the run's config: the final wait is short
  helper = threading.Thread(target=index_of_step_0_only, daemon=True)
  helper.start()
  with pytest.raises(TimeoutError, match="index_timeout"):
    train(config, workdir)
  helper.join(timeout=10)
  out = capsys.readouterr().out
  said = [line for line in out.splitlines() if "warning: index staleness" in line]
  assert [line.split("staleness ")[1].split(" ")[0] for line in said] == [
      str(STALE_REFRESHES)], out[-3000:]
  assert "newest version is v1 (step 0)" in said[0]
  assert "retrieval.refresh_every=1 steps; it is behind or not running" in said[0]


def test_a_long_run_keeps_no_record_per_step_of_its_index_staleness(tmp_path):
  """The staleness of every step served counts in the summary's figures, but a long run's
  steps take no memory once their values were seen: 50,000 steps over a refresh interval of
  50 hold what 1,000 did, and p50 / p95 / max are those of every step's."""
  import tracemalloc
  import types
  import numpy as np
  from realm_jax.train.candidates import NoRetrieval, _staleness_summary
  source = NoRetrieval(helpers.tiny_config("realm"), str(tmp_path))
  source._log = types.SimpleNamespace(write=lambda step, record: None)
  rng = np.random.default_rng(0)
  series = [int(s) for s in rng.integers(0, 50, 51_000)]   # each step's staleness
  served = lambda done: source.served(done, types.SimpleNamespace(
      version=1, step=done - 1 - series[done - 1]), 0.0, 0.0, None)
  tracemalloc.start()
  try:
    for done in range(1, 1_001):
      served(done)
    held = tracemalloc.get_traced_memory()[0]
    for done in range(1_001, 51_001):
      served(done)
    grown = tracemalloc.get_traced_memory()[0] - held
  finally:
    tracemalloc.stop()
  assert grown < 20_000, f"{grown:,} bytes more after 50,000 more steps"
  summary = _staleness_summary(source.staleness, {1}, [], 0)
  assert summary["index_steps_counted"] == 51_000
  for q in (50, 95):
    assert summary[f"index_staleness_p{q}"] == pytest.approx(np.percentile(series, q))
  assert summary["index_staleness_max"] == max(series)


def test_the_staleness_warning_comes_again_at_each_doubling_and_after_a_catch_up(caplog):
  import logging
  import types
  from realm_jax.train.candidates import STALE_REFRESHES, PublishedIndex, StalenessRecord
  config = helpers.tiny_config("realm", retrieval__refresh="async", retrieval__refresh_every=2)
  source = types.SimpleNamespace(config=config, workdir="W", staleness=StalenessRecord(),
                                 _stale_said=0,
                                 subscriber=types.SimpleNamespace(builder_gone=lambda: ""))
  loaded = types.SimpleNamespace(version=1, step=0)
  first = STALE_REFRESHES * 2
  series = [first - 1, first, first + 1, 2 * first - 1, 2 * first, 3, first, 4 * first]
  with caplog.at_level(logging.WARNING, logger="realm_jax.train.candidates"):
    for staleness in series:
      source.staleness.add(staleness)
      PublishedIndex._say_if_stale(source, staleness + 1, loaded)
  said = [int(r.getMessage().split("staleness ")[1].split(" ")[0]) for r in caplog.records]
  assert said == [first, 2 * first, first, 4 * first]   # after the catch-up (3): from the start
  assert "but realm-index publishes one every retrieval.refresh_every=2 steps" in \
      caplog.records[0].getMessage()


def test_the_staleness_warning_names_a_builder_that_died(tmp_path, caplog):
  """Async, the builder killed: W/builder.lock names a pid that no longer runs, and the
  staleness warning says so rather than 'behind or not running'."""
  import logging
  import types
  from realm_jax.retrieval.subscriber import IndexSubscriber
  from realm_jax.train.candidates import STALE_REFRESHES, PublishedIndex, StalenessRecord
  workdir = str(tmp_path / "run")
  gone = helpers.dead_job_lock(workdir, "builder")
  config = helpers.tiny_config("realm", retrieval__refresh="async", retrieval__refresh_every=2)
  subscriber = IndexSubscriber(workdir, loader=None, poll_seconds=3600)
  source = types.SimpleNamespace(config=config, workdir=workdir, _stale_said=0,
                                 staleness=StalenessRecord(), subscriber=subscriber)
  source.staleness.add(STALE_REFRESHES * 2)
  try:
    with caplog.at_level(logging.WARNING, logger="realm_jax.train.candidates"):
      PublishedIndex._say_if_stale(source, STALE_REFRESHES * 2 + 1,
                                   types.SimpleNamespace(version=1, step=0))
  finally:
    subscriber.close()
  [said] = [r.getMessage() for r in caplog.records]
  assert f"steps; realm-index (pid {gone}, {workdir}/builder.lock) is not running: it " \
      "died or was stopped" in said and "behind or not running" not in said, said

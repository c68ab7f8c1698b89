"""Several processes: 2 processes x 4 CPU devices (gloo collectives) train like 1 process x 8
devices; a lost process stops the others with its id named; bad topologies fail clearly."""

import concurrent.futures
import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from realm_jax.data import pipeline
from realm_jax.errors import ConfigError
from realm_jax.retrieval import index as index_lib
from realm_jax.runtime import multihost, state as state_lib
from realm_jax.runtime.checkpoints import restore_run
from realm_jax.train import batches
from realm_jax.train.loop import train
from tests import helpers

pytestmark = pytest.mark.slow   # the slow tier: `make test` runs it, `make test-fast` does not

# Relative tolerance of the 2-process losses against the 1-process ones. Not bit for bit: gloo
# sums the 8 devices' partial sums (the loss mean, the gradient all-reduce) in another order
# than XLA's in-process all-reduce, which moves the sums by an ulp or two.
LOSS_RTOL = 5e-6   # float32 reductions in another order across two processes: 1.2e-6 seen at step 5


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(flags: list[str], workdir: str, count: int, port: int, devices: int = 4,
           extra: tuple[str, ...] = (),
           program: tuple[str, ...] = ("-m", "realm_jax.train.main"),
           per_process: dict[int, tuple[str, ...]] | None = None) -> list[subprocess.Popen]:
  """`count` realm-train processes of one job, `devices` CPU devices each (process i's flags
  end with `per_process[i]`: a later flag wins)."""
  # PYTHONPATH: a `program` that is a script puts its own folder first, not the cwd; this
  # checkout's package must still be the one imported (not an installed copy elsewhere)
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(devices),
         "PYTHONPATH": os.pathsep.join([helpers.REPO, *filter(None, [os.environ.get(
             "PYTHONPATH")])])}
  return [subprocess.Popen(
      [sys.executable, "-u", *program, *flags, f"--workdir={workdir}",
       "--multihost=on", f"--coordinator_address=localhost:{port}", f"--num_processes={count}",
       f"--process_id={i}", "--init_timeout=60", "--heartbeat_timeout=8", *extra,
       *(per_process or {}).get(i, ())],
      cwd=helpers.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(count)]


def read_to_end(procs: list[subprocess.Popen]) -> list[str]:
  """Each process's whole output once it has exited, read side by side: one reader at a time
  would leave a process whose pipe filled blocked until the one read before it exits."""
  with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
    return list(pool.map(lambda p: p.communicate()[0], procs))


@contextlib.contextmanager
def deadline(procs: list[subprocess.Popen], seconds: float = 300):
  """The processes of a job, killed -9 if still running `seconds` from now (a process waiting
  in a collective that another process never joins, say a step of another shape, waits
  without end; the job takes ~45 s alone on the 2-core EPYC) and on the way out (a test that
  failed first leaves none behind). Yields a list that holds `seconds` once they were killed
  for it."""
  expired = []

  def kill():
    expired.append(seconds)
    for p in procs:
      p.kill()
  timer = threading.Timer(seconds, kill)
  timer.start()
  try:
    yield expired
  finally:
    timer.cancel()
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def losses(workdir: str) -> np.ndarray:
  with open(os.path.join(workdir, "metrics", "train.jsonl")) as f:
    return np.array([json.loads(line)["loss"] for line in f])


# The world's queries are 7-14 wordpieces ([CLS] and [SEP] counted). Packed two a row (each process's 8 of 16 into its 4
# of 8 rows, one a device) in rows of 23, a pair fits where its lengths sum to <= 23: with the
# tiny config's seed, every pair of steps 1, 4 and 5 does and some pair of steps 2 and 3 does
# not, so the job trains on both step shapes, packed and one query a row.
MIXED_PACKING = dict(model__retriever__pooling="mean", retrieval__packed_query_rows=8,
                     data__query_len=23)


def job_config(task: str, world_dir: str):
  """5 steps of the tiny config (exact retrieval for REALM, its queries packed where a batch's
  fit: `MIXED_PACKING`)."""
  overrides = dict(train__steps=5, train__checkpoint_every=5)
  if task == "realm":
    overrides.update(retrieval__backend="exact", **MIXED_PACKING)
  return helpers.tiny_config(task, data_dir=world_dir, **overrides)


def test_two_processes_train_like_one(world_dir, world_data, tmp_path):
  """REALM with its index rebuilt in process: each process's share of the batches, the global
  arrays made of them, the collectives of the jitted step, the blocks embedded and searched on
  every host, the checkpoint both write and the evaluation; each process's queries packed in
  its rows, numbered in the global batch, in the steps whose every share fits, and one a row
  in the others. (ICT runs the same machinery with another loss: its in-batch softmax over a
  batch split across `data` is test_sharding's.)"""
  task = "realm"
  config = job_config(task, world_dir)
  # Which steps pack: all or none, though in steps 2 and 3 process 0's share fits and 1's not.
  stream = batches.QueryBatches(config, world_data, world_data.examples("train"))
  fits = [[pipeline.queries_fit(share, 4, 4, config.data.query_len)
           for share in stream.query_lengths(t).reshape(2, -1)] for t in range(5)]
  assert fits == [[True, True], [True, False], [True, False], [True, True], [True, True]]
  # the job traces its step 4 (each process into a dir of its own: one host name here)
  procs = launch(helpers.config_flags(config, "demo_realm") + [
      "--config.train.profile_first_step=4", "--config.train.profile_steps=1"],
      str(tmp_path / "two"), 2, free_port())
  with deadline(procs) as expired:
    single = train(config, str(tmp_path / "one"))    # this process: 8 devices
    outputs = read_to_end(procs)
  assert not expired, f"the job did not end within {expired[0]} s:\n" + "\n---\n".join(
      out[-1500:] for out in outputs)
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i}:\n{out[-3000:]}"
    assert f"[multihost] process {i} of 2: 4 local / 8 global devices" in out
  one, two = losses(str(tmp_path / "one")), losses(str(tmp_path / "two"))
  assert len(one) == len(two) == 5
  np.testing.assert_allclose(two, one, rtol=LOSS_RTOL, atol=0)
  # The checkpoint both processes wrote restores here, close to the one-process params. Adam
  # moves each parameter by about the learning rate per step whatever the gradient's size, so
  # where a gradient is near zero its last-ulp difference can flip an update: the runs may then
  # differ by up to twice the summed learning rate (1e-4 here), not by the loss's 1e-6.
  one_run, two_run = (restore_run(str(tmp_path / name), mesh_shape=(-1, 1))
                      for name in ("one", "two"))
  params_one, step_one, params_two, step_two = (one_run.params, one_run.step, two_run.params,
                                                two_run.step)
  assert step_one == step_two == 5
  schedule = state_lib.learning_rate_schedule(config.train)
  bound = 2 * sum(float(schedule(t)) for t in range(5))
  param_diff = 0.0
  for a, b in zip(jax.tree.leaves(params_one), jax.tree.leaves(params_two)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=bound)
    param_diff = max(param_diff, float(np.abs(np.asarray(b) - np.asarray(a)).max()))
  print(f"{task}: 2x4 vs 1x8 max relative loss difference "
        f"{float(np.max(np.abs(two - one) / np.abs(one))):.2e}, bitwise equal losses "
        f"{int((two == one).sum())}/5, max parameter difference {param_diff:.2e}")
  with open(tmp_path / "two" / "summary.json") as f:
    summary = json.load(f)
  for key in ("eval_recall_at_1", "eval_recall_at_5"):
    assert summary[key] == single[key]
  assert summary["query_batches_packed"] == single["query_batches_packed"] == 3
  for i in range(2):
    assert glob.glob(str(tmp_path / "two" / "tb" / "profile" / f"process_{i}" / "plugins" /
                         "profile" / "*" / "*.xplane.pb")), f"process {i}: no trace"


def test_a_lost_process_stops_the_others_naming_it(world_dir, tmp_path):
  # The programs of the job above (compiled once, from the cache here). Process 0 cannot
  # finish step 4 without process 1, so killing 1 after its step 3 leaves 0 waiting on it.
  # A heartbeat timeout of 4 s (the other jobs': 8): the survivor's wait is most of the test.
  config = job_config("realm", world_dir)
  procs = launch(helpers.config_flags(config, "demo_realm"), str(tmp_path / "w"), 2,
                 free_port(), extra=("--heartbeat_timeout=4",))
  survivor, lost = procs
  with deadline(procs):
    # Kill process 1 once it is training.
    lines = []
    for line in lost.stdout:
      lines.append(line)
      if line.startswith("[realm] step 3/"):
        break
    else:
      pytest.fail("process 1 never trained:\n" + "".join(lines[-40:]))
    lost.send_signal(signal.SIGKILL)
    lost.wait()
    t0 = time.time()
    out = survivor.communicate()[0]
    seconds = time.time() - t0
  assert survivor.returncode != 0
  assert seconds < 120
  # JAX's coordination service names the process that stopped sending heartbeats.
  assert "The following tasks are unhealthy (stopped sending heartbeats):\n1" in out, out[-3000:]
  print(f"the survivor exited {seconds:.1f}s after process 1 was killed")


# realm-train whose process 1 cannot read checkpoint 4: Orbax's read fails inside its
# Checkpointer, before the cross-process barrier that ends a restore (as a shard unreadable
# from one host would).
_FAILING_READ = """
import runpy, sys
from etils import epath
from orbax.checkpoint._src.checkpointers import checkpointer
read = checkpointer.Checkpointer._restore
def failing(self, directory, args):
  if "--process_id=1" in sys.argv and epath.Path(directory).name == "4":
    raise OSError("injected: process 1 cannot read checkpoint 4")
  return read(self, directory, args)
checkpointer.Checkpointer._restore = failing
runpy.run_module("realm_jax.train.main", run_name="__main__", alter_sys=True)
"""


def test_a_checkpoint_one_process_cannot_read_sends_every_process_to_the_one_before(
    world_dir, tmp_path):
  """Checkpoints 2 and 4 of a two-process ICT job whose model axis spans both processes (no
  process holds a whole array), resumed in two processes, process 1 unable to read 4. Each
  process reads its own shards, so only 1 fails: all must still resume from the same step
  (2), 4 moved aside once it failed twice, and steps 3 and 4 train again with the first
  job's losses. Each process deciding alone, 0 resumed from 4 and 1 from 2. The first job
  trains like one process of 8 devices on the same mesh: both processes load every row
  (their devices hold the one data shard)."""
  workdir = str(tmp_path / "w")
  options = dict(data_dir=world_dir, train__checkpoint_every=2, mesh__shape=(1, 8))
  outputs = []
  for steps, program in ((4, ("-m", "realm_jax.train.main")), (6, (str(tmp_path / "r.py"),))):
    (tmp_path / "r.py").write_text(_FAILING_READ)
    config = helpers.tiny_config("ict", train__steps=steps, **options)
    procs = launch(helpers.config_flags(config, "demo_ict"), workdir, 2, free_port(),
                   program=program)
    with deadline(procs) as expired:
      if steps == 4:
        train(config, str(tmp_path / "one"))   # this process: 8 devices
      outputs = read_to_end(procs)
    assert not expired, f"the job did not end within {expired[0]} s:\n" + "\n---\n".join(
        out[-1500:] for out in outputs)
    for i, (p, out) in enumerate(zip(procs, outputs)):
      assert p.returncode == 0, f"process {i}:\n{out[-3000:]}"
    if steps == 4:
      before = losses(workdir)
      np.testing.assert_allclose(before, losses(str(tmp_path / "one")), rtol=LOSS_RTOL, atol=0)
  ckpt = os.path.join(workdir, "checkpoints")
  for i, out in enumerate(outputs):
    why = "read here, failed on process 1" if i == 0 else "OSError: injected"
    assert f"checkpoint {ckpt}/4 cannot be restored ({why}" in out, out[-3000:]
    assert f"resumed from {ckpt}/2 " in out, out[-3000:]
  assert "moved the unreadable checkpoint 4" in outputs[0]
  assert os.listdir(os.path.join(workdir, "unreadable_checkpoints")) == ["4"]
  after = losses(workdir)
  assert len(before) == 4 and len(after) == 6
  np.testing.assert_allclose(after[:4], before, rtol=LOSS_RTOL, atol=0)


# Two processes adopting index versions in async mode, with stand-in subscribers: process 0
# loads v2 before step 0, process 1 only before step 1. Each step ends in a collective (as the
# train step does).
_ASYNC_PROBE = """
import os, sys, types
pid, port = int(sys.argv[1]), sys.argv[2]
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{port}", 2, pid)
import numpy as np
from jax.experimental import multihost_utils
from realm_jax.train.candidates import _all_hosts_have
from realm_jax.train.feed import VersionSchedule
version = lambda v: types.SimpleNamespace(version=v, step=10 * v)
class Subscriber:
  have = {1: version(1)}
  def newest(self): return self.have[max(self.have)]
  def wait(self, pick, timeout, what, should_stop=None): return pick(self.have)
  def release(self, **kw): pass
subscriber = Subscriber()
config = types.SimpleNamespace(retrieval=types.SimpleNamespace(refresh="async",
                                                                index_timeout=5))
schedule = VersionSchedule(config, subscriber, _all_hosts_have)
schedule.start_async(0, 2)
for step in range(4):
  if step == pid:
    subscriber.have[2] = version(2)
  schedule.advance_async(step, 2)
  multihost_utils.process_allgather(np.ones(3, np.float32) * step)
print("serving", [schedule.for_step(t)[0].version for t in range(6)], flush=True)
"""


def test_async_hosts_switch_index_versions_together(tmp_path):
  """Every host asks the others at every step whether they have its newest version, so that
  they call the same collectives: a host that loaded v2 first waits for the others, and all
  serve v2 from the same step (`depth` after the step where the last of them had it)."""
  script = tmp_path / "probe.py"
  script.write_text(_ASYNC_PROBE)
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(2)}
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port)], cwd=helpers.REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  with deadline(procs, 120) as expired:
    outputs = read_to_end(procs)
  assert not expired, "\n---\n".join(out[-1500:] for out in outputs)
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
    assert "serving [1, 1, 1, 2, 2, 2]" in out, out[-3000:]


def launch_builders(config, workdir: str) -> list[subprocess.Popen]:
  """realm-index as one job of two processes, 4 CPU devices each."""
  env, port = {**os.environ, "XLA_FLAGS": helpers.xla_flags(4)}, free_port()
  return [subprocess.Popen(
      [sys.executable, "-u", "-m", "realm_jax.retrieval.builder",
       *helpers.config_flags(config, "demo_realm"), f"--workdir={workdir}", "--multihost=on",
       f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}",
       "--init_timeout=60", "--heartbeat_timeout=8"],
      cwd=helpers.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]


def test_a_two_process_builder_publishes_each_version_once(world_dir, tmp_path):
  """realm-index as one job of two processes (a builder slice of two hosts): both embed, the
  first alone publishes, each version once, the embeddings those of one process x 8 devices;
  both follow its decisions to the end (the trainer's DONE). The `model` axis spans the two
  processes, so the query tower's copy to the host is a collective both must join (with the
  mesh's `data` axis across them instead, each process would copy its own replica)."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.retrieval import published
  from tests.test_index_builder import builder_config, make_checkpoints, reference_embeddings
  config = builder_config(world_dir, mesh__shape=(1, 8))
  workdir = str(tmp_path / "run")
  states, model, mesh, data = make_checkpoints(config, workdir, (0, 10))
  workdir_lib.mark_done(workdir, config.train.steps)   # the trainer has finished
  procs = launch_builders(config, workdir)
  with deadline(procs, 240) as expired:
    outputs = read_to_end(procs)
  assert not expired, "\n---\n".join(out[-1500:] for out in outputs)
  for p, out in zip(procs, outputs):
    assert p.returncode == 0 and "realm-index: done, 1 versions published" in out, out[-3000:]
  root = published.index_root(workdir)
  assert sorted(os.listdir(root)) == ["00000001", "LATEST"]
  manifest = published.read_manifest(root, 1)
  assert manifest["step"] == 10 and published.read_latest(root) == 1
  np.testing.assert_allclose(published.read_embeddings(root, 1, manifest),
                             reference_embeddings(config, model, mesh, data, states[10]),
                             atol=1e-5)


def test_sigterm_stops_a_two_process_builder_waiting_for_checkpoints(world_dir, tmp_path):
  """SIGTERM to both processes while the first waits for a newer checkpoint and the second for
  its decision: both stop as one process does (`SIGTERM: stopped`, exit 143: preempted, not
  finished)."""
  from realm_jax.retrieval import published
  from tests.test_index_builder import builder_config, make_checkpoints
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0,))
  procs = launch_builders(config, workdir)
  with deadline(procs, 240) as expired:
    latest = os.path.join(str(published.index_root(workdir)), published.LATEST)
    while not os.path.exists(latest) and all(p.poll() is None for p in procs):
      time.sleep(0.2)
    time.sleep(1.0)                       # both wait: for a checkpoint, for the decision
    for p in procs:
      p.send_signal(signal.SIGTERM)
    outputs = read_to_end(procs)
  assert not expired, "\n---\n".join(out[-1500:] for out in outputs)
  for p, out in zip(procs, outputs):
    assert p.returncode == 143 and "[index] SIGTERM: stopped; 1 versions published" in out, \
        out[-3000:]


def test_sigterm_to_one_trainer_process_waiting_for_the_first_index_stops_every_one(
    world_dir, tmp_path):
  """Async REALM, no builder: SIGTERM to process 1 alone (JAX's handler takes it) while both
  wait for the first published index. Process 0 learns of it through the coordination
  service, and both stop within seconds with step 0 (the builder's first snapshot) saved,
  exit 143, instead of waiting out retrieval.index_timeout (exit 1)."""
  from realm_jax import workdir as workdir_lib
  config = helpers.tiny_config("realm", data_dir=world_dir, retrieval__refresh="async",
                               retrieval__backend="exact", retrieval__index_timeout=60.0,
                               train__preemption_grace_seconds=20.0)
  workdir = str(tmp_path / "w")
  procs = launch(helpers.config_flags(config, "demo_realm"), workdir, 2, free_port())
  with deadline(procs, 180) as expired:
    for p in procs:
      seen = []
      for line in p.stdout:
        seen.append(line)
        if "waiting for a published index" in line:
          break
      else:
        pytest.fail("no wait for the first index:\n" + "".join(seen[-40:]))
    t0 = time.time()
    procs[1].send_signal(signal.SIGTERM)
    outputs = read_to_end(procs)
    seconds = time.time() - t0
  assert not expired, "\n---\n".join(out[-1500:] for out in outputs)
  for p, out in zip(procs, outputs):
    assert p.returncode == 143, out[-3000:]
    assert "SIGTERM before step 1: the batch of step 1 was not ready after" in out, out[-3000:]
    assert "preempted after step 0 (checkpoint saved)" in out, out[-3000:]
  assert seconds < 15 and workdir_lib.latest_checkpoint_step(workdir) == 0
  print(f"both processes exited 143 {seconds:.1f}s after the SIGTERM")


def test_a_workdir_some_process_does_not_share_is_refused(world_dir, tmp_path):
  """Process 1 given a workdir of its own (as a node-local path would be), one that holds an
  older run's checkpoint: both stop at start-up naming it, before process 1 reads its own
  workdir (it would refuse train.steps below that checkpoint's step), instead of hanging at
  the first save; process 0 removes its token, and the W it made for it."""
  config = helpers.tiny_config("ict", data_dir=world_dir)
  os.makedirs(tmp_path / "local" / "checkpoints" / "99")
  procs = launch(helpers.config_flags(config, "demo_ict"), str(tmp_path / "shared"), 2,
                 free_port(), per_process={1: (f"--workdir={tmp_path / 'local'}",)})
  with deadline(procs, 180) as expired:
    outputs = read_to_end(procs)
  assert not expired, "\n---\n".join(out[-1500:] for out in outputs)
  for p, out in zip(procs, outputs):
    assert p.returncode == 2, out[-3000:]
    assert "process 1 does not see what process 0 wrote there: the workdir must be shared " \
        "storage" in out, out[-3000:]
  assert not os.path.exists(tmp_path / "shared")   # no token, nor the empty W it was made in


def test_a_fresh_job_refused_after_the_workdir_check_leaves_no_empty_workdir(
    world_dir, tmp_path, monkeypatch):
  """Process 0 of two, refused for an eval.split the data lacks, which is found after the
  workdir check made W for its token: no empty W is left (a W that was there stays)."""
  from realm_jax.train import run
  monkeypatch.setattr(run.jax, "process_count", lambda: 2)
  monkeypatch.setattr(run.jax, "process_index", lambda: 0)
  monkeypatch.setattr(multihost, "every_process", lambda name, value: [value, ""])
  monkeypatch.setattr(multihost, "processes_where_not", lambda flag: [])
  config = helpers.tiny_config("ict", data_dir=world_dir, eval__split="nosuch")
  fresh, there = tmp_path / "fresh", tmp_path / "there"
  os.makedirs(there)
  for workdir in (fresh, there):
    with pytest.raises(ConfigError, match="'nosuch': no split of examples"):
      run.checked_data(config, str(workdir))
  assert not os.path.exists(fresh) and os.listdir(there) == []


def test_a_training_warning_is_said_by_the_first_process_alone(world_dir, tmp_path,
                                                              monkeypatch, caplog):
  """ICT with a reader learning rate is a warning of the run's config: process 0 says it, as
  it says the run's other start-up warnings (resumed under other values), not every process
  of the job once each."""
  import logging
  from realm_jax.train import run
  monkeypatch.setattr(run.jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost, "every_process", lambda name, value: [value, ""])
  monkeypatch.setattr(multihost, "processes_where_not", lambda flag: [])
  config = helpers.tiny_config("ict", data_dir=world_dir, train__reader_lr_scale=1.0)
  said = {}
  for process in (0, 1):
    monkeypatch.setattr(run.jax, "process_index", lambda: process)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="realm_jax.train.run"):
      run.checked_data(config, str(tmp_path / "w"))
    said[process] = [r.getMessage() for r in caplog.records]
  assert len(said[0]) == 1 and "config.train.reader_lr_scale 1.0" in said[0][0], said
  assert said[1] == []


def test_processes_that_disagree_on_the_config_are_named(world_data, monkeypatch):
  """Each top-level config field (and the block store) where a process differs from process
  0 is named, before anything is written."""
  from realm_jax.train import run
  sent = []

  def exchange(name, value, timeout):   # process 1: another train.lr and data.dir
    sent.append(json.loads(value))
    theirs = {**sent[0], "config.train": "another", "config.data": "another"}
    return [value, json.dumps(theirs)]
  monkeypatch.setattr(run.jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost, "every_process", exchange)
  with pytest.raises(ConfigError, match=r"disagree on config\.data \(process 1 against "
                     r"process 0\); config\.train \(process 1 against process 0\): every "
                     "process must run the same command"):
    run.check_same_run(helpers.tiny_config("ict"), world_data)
  assert {"the block store of data.dir", "the vocabulary of data.dir", "config.model",
          "the 'train' examples of data.dir", "the 'eval' examples of data.dir"} <= set(sent[0])
  # data.dir itself is not compared (a host's own copy, /gcs/B for gs://B): the store is
  elsewhere = helpers.tiny_config("ict")
  elsewhere.data.dir = "/another/copy/of/" + os.path.basename(elsewhere.data.dir)
  sent.clear()
  monkeypatch.setattr(multihost, "every_process",
                      lambda name, value, timeout: sent.append(json.loads(value)) or [value, value])
  for config in (helpers.tiny_config("ict"), elsewhere):
    run.check_same_run(config, world_data)
  assert sent[0] == sent[1]
  assert multihost.disagreements([{"a": "1", "b": "2"}, {"a": "1", "b": "2"}]) == {}
  assert multihost.disagreements([{"a": "1"}, {"a": "2", "b": "3"}, {"a": "1"}]) == \
      {"a": [1], "b": [1]}


@pytest.mark.parametrize("split", ["train", "dev"])
def test_open_qa_processes_that_read_other_questions_are_named(world_dir, tmp_path,
                                                               monkeypatch, split):
  """Open-QA's examples are its questions: a process whose copy of qa.train (the rows its
  batches index into) or qa.dev (the evaluation's batches, a collective) differs from process
  0's is named before anything is written (before, only the pre-training examples were
  compared, and such a job trained on other questions on each host, silently)."""
  from realm_jax.train import run
  from realm_jax.train.openqa_loop import OpenQATrainer
  from tests.test_openqa import openqa_config

  def exchange(name, value, timeout):   # process 1: another copy of that split's questions
    theirs = {k: "another" if k == f"the questions of qa.{split}" else v
              for k, v in json.loads(value).items()}
    return [value, json.dumps(theirs)]
  monkeypatch.setattr(run.jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost, "every_process", lambda name, value, *timeout: (
      exchange(name, value, timeout) if name == "config" else [value, ""]))
  monkeypatch.setattr(multihost, "processes_where_not", lambda flag: [])
  workdir = tmp_path / "w"
  with pytest.raises(ConfigError, match=rf"disagree on the questions of qa\.{split} \(process "
                     r"1 against process 0\)"):
    OpenQATrainer(openqa_config(world_dir, qa__dev="prepared:eval"), str(workdir))
  assert not workdir.exists() or os.listdir(workdir) == []


def test_the_workdir_token_is_removed_however_the_check_ends(tmp_path, monkeypatch):
  """Process 0's token is gone after a check that failed (a process that never sent) or
  passed, and so is the W it made (a job refused next leaves no empty W), never a W that was
  there; a read of the token that fails on another host is 'not seen', not a traceback."""
  from realm_jax import paths, workdir as workdir_lib
  from realm_jax.train import run
  workdir = str(tmp_path / "w")
  monkeypatch.setattr(run.jax, "process_count", lambda: 2)
  monkeypatch.setattr(run.jax, "process_index", lambda: 0)

  def never_sent(name, value):
    raise RuntimeError("process 0 of 2: not every process sent its 'workdir token'")
  monkeypatch.setattr(multihost, "every_process", never_sent)
  with pytest.raises(RuntimeError, match="workdir token"):
    run.check_shared_workdir(workdir)
  assert not os.path.exists(workdir)
  monkeypatch.setattr(multihost, "every_process", lambda name, value: [value, ""])
  monkeypatch.setattr(multihost, "processes_where_not", lambda flag: [])
  run.check_shared_workdir(workdir)
  assert not os.path.exists(workdir)
  os.makedirs(workdir)                 # there before: it stays, empty or not
  run.check_shared_workdir(workdir)
  assert os.listdir(workdir) == []
  (tmp_path / "w" / "notes.txt").write_text("mine")
  run.check_shared_workdir(workdir)
  assert os.listdir(workdir) == ["notes.txt"]
  token = workdir_lib.write_job_token(workdir)
  assert workdir_lib.sees_job_token(workdir, token)

  def unreachable(path):
    raise OSError("the bucket is out of reach")
  monkeypatch.setattr(paths, "read_text", unreachable)
  assert not workdir_lib.sees_job_token(workdir, token)


def test_a_coordinator_that_never_answers_is_named(world_dir, tmp_path):
  config = helpers.tiny_config("ict", data_dir=world_dir)
  port = free_port()   # nobody listens there
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(4)}
  t0 = time.time()
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.train.main", *helpers.config_flags(config, "demo_ict"),
       f"--workdir={tmp_path}", "--multihost=on", f"--coordinator_address=localhost:{port}",
       "--num_processes=2", "--process_id=1", "--init_timeout=1"],
      cwd=helpers.REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert f"the coordinator localhost:{port} did not answer within 1s" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert time.time() - t0 < 60


def test_a_process_that_never_joins_is_named(world_dir, tmp_path):
  """Process 0 of 2 alone: before joining it says where, for how long and under which option
  it waits; when process 1 never connects, one line names it and the option (exit 1) instead
  of JAX's abort 5 s later (a C++ check failure naming neither, exit 134)."""
  config = helpers.tiny_config("ict", data_dir=world_dir)
  port = free_port()
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(4)}
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.train.main", *helpers.config_flags(config, "demo_ict"),
       f"--workdir={tmp_path / 'w'}", "--multihost=on", f"--coordinator_address=localhost:{port}",
       "--num_processes=2", "--process_id=0", "--init_timeout=1"],
      cwd=helpers.REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert f"process 0 of 2: joining the job at the coordinator localhost:{port} (served by " \
      "this process), waiting up to 1s (--init_timeout) for every process" in proc.stdout
  assert f"[multihost] error: process 0 of 2: the job did not form at the coordinator " \
      f"localhost:{port} within 1s (--init_timeout): process 1 never connected" in proc.stderr
  assert "Check failure" not in proc.stderr and not os.path.exists(tmp_path / "w")
  for me, count, missing in ((2, 4, "not every one of processes 1 to 3 other than this one "
                                    "connected"), (0, 3, "not every one of processes 1 to 2 "
                                                         "connected"),
                             (1, 3, "process 2 never connected"),
                             (1, 2, "it did not admit this process (is process 0 started with "
                                    "--num_processes=2?)")):
    assert f"within 60s (--init_timeout): {missing}; " in multihost._not_joined(
        multihost.Topology("h:1", count, me, 60, 10))


# A join under JAX's cluster detection that takes `sys.argv[1]` seconds (a stand-in for
# jax.distributed.initialize: the detection's wait for the coordinator's host, then the join).
_DETECTED_JOIN = """
import sys, time
import jax
from realm_jax.runtime import multihost
jax.distributed.initialize = lambda **kwargs: time.sleep(float(sys.argv[1]))
multihost.initialize(multihost.Topology(None, None, None, int(sys.argv[2]), 10, "GkeTpuCluster"))
print("joined", flush=True)
"""


def test_a_join_under_cluster_detection_may_take_twice_init_timeout(tmp_path):
  """JAX's cluster detection may wait up to --init_timeout for the coordinator's host (a pod
  host that boots late) before the join's own --init_timeout starts: a join that takes longer
  than --init_timeout in all, but less than twice, is not ended; one that takes longer than
  that ends with the line naming the option (exit 1)."""
  script = tmp_path / "join.py"
  script.write_text(_DETECTED_JOIN)
  start = lambda seconds, timeout: subprocess.Popen(
      [sys.executable, str(script), str(seconds), str(timeout)], cwd=helpers.REPO,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  # Both at once: each waits (sleeps) for most of its time. The first, e.g. 2.5 s for the
  # coordinator's host, then 2.5 s to join: over --init_timeout and the watchdog's grace
  # (2 s), under twice --init_timeout and the grace.
  procs = start(5, 2), start(60, 1)
  try:
    slow, never = (subprocess.CompletedProcess(p.args, None, *p.communicate(timeout=120))
                   for p in procs)
    slow.returncode, never.returncode = (p.returncode for p in procs)
  finally:
    for p in procs:
      p.kill()
  assert slow.returncode == 0 and "joined" in slow.stdout, slow.stderr[-2000:]
  assert never.returncode == 1, never.stderr[-2000:]
  assert "[multihost] error: the GkeTpuCluster job did not form within 2s (--init_timeout=1 " \
      "for JAX's cluster detection, then as long for every process to connect)" in never.stderr


def test_a_join_under_cluster_detection_bounds_the_shutdown_as_an_explicit_one(tmp_path):
  """The explicit join bounds JAX's shutdown barrier by --heartbeat_timeout; the join under
  cluster detection (every TPU pod) passed nothing, so a process whose peers had stopped
  waited JAX's 300 s there before its exit."""
  script = tmp_path / "join.py"
  script.write_text("\n".join([
      "import jax", "from realm_jax.runtime import multihost",
      "jax.distributed.initialize = lambda **kwargs: print(sorted(kwargs.items()))",
      "multihost.initialize(multihost.Topology(None, None, None, 30, 17, 'GkeTpuCluster'))"]))
  result = subprocess.run([sys.executable, str(script)], cwd=helpers.REPO, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert [line for line in result.stdout.splitlines() if line.startswith("[(")] == [str(sorted({
      "initialization_timeout": 30, "heartbeat_timeout_seconds": 17,
      "shutdown_timeout_seconds": 17}.items()))]


def test_process_id_out_of_range_fails_before_any_work(world_dir, tmp_path):
  config = helpers.tiny_config("ict", data_dir=world_dir)
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.train.main", *helpers.config_flags(config, "demo_ict"),
       f"--workdir={tmp_path}", "--multihost=on", "--coordinator_address=localhost:1234",
       "--num_processes=2", "--process_id=2"],
      cwd=helpers.REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "--process_id=2 is out of range: process ids run from 0 to 1 (--num_processes=2)" \
      in proc.stderr
  assert not os.path.exists(tmp_path / "checkpoints")


def test_topology_from_flags_environment_or_cluster_detection():
  none = lambda: None   # noqa: E731  (no cluster around)
  t = multihost.resolve("on", "10.0.0.2:8476", 4, 3, environ={}, detect=none)
  assert (t.coordinator_address, t.num_processes, t.process_id) == ("10.0.0.2:8476", 4, 3)
  env = {"REALM_COORDINATOR_ADDRESS": "trainer-0:8476", "REALM_NUM_PROCESSES": "8",
         "REALM_PROCESS_ID": "5"}
  t = multihost.resolve("auto", environ=env, detect=none)
  assert (t.coordinator_address, t.num_processes, t.process_id) == ("trainer-0:8476", 8, 5)
  # A flag wins over the environment.
  assert multihost.resolve("auto", process_id=0, environ=env, detect=none).process_id == 0
  assert multihost.resolve("auto", environ={}, detect=none) is None
  assert multihost.resolve("off", environ=env, detect=lambda: "GceTpuCluster") is None
  t = multihost.resolve("auto", environ={}, detect=lambda: "GceTpuCluster", init_timeout=60)
  assert t.coordinator_address is None and t.cluster == "GceTpuCluster" and t.init_timeout == 60


@pytest.mark.parametrize("kwargs, message", [
    (dict(mode="on", coordinator_address="h:1", num_processes=2),
     "--multihost=on needs --process_id \\(or REALM_PROCESS_ID\\)"),
    (dict(mode="on", coordinator_address="h:1", num_processes=2, process_id=-1),
     "--process_id=-1 is out of range"),
    (dict(mode="auto", environ={"REALM_COORDINATOR_ADDRESS": "h:1", "REALM_NUM_PROCESSES": "2",
                                "REALM_PROCESS_ID": "7"}),
     "REALM_PROCESS_ID=7 is out of range: process ids run from 0 to 1"),
    (dict(mode="on", coordinator_address="nohost", num_processes=2, process_id=0),
     "--coordinator_address='nohost': expected host:port"),
    (dict(mode="on", coordinator_address="h:1", num_processes=0, process_id=0),
     "--num_processes=0 must be >= 1"),
    (dict(mode="on", coordinator_address="h:1", num_processes=2, process_id=0, init_timeout=0),
     "--init_timeout=0 must be a positive"),
    (dict(mode="on", coordinator_address="localhost:99999", num_processes=2, process_id=0),
     "--coordinator_address='localhost:99999': port 99999 is out of range"),
    (dict(mode="auto", num_processes=2, process_id=1),
     "--num_processes and --process_id need --coordinator_address \\(or "
     "REALM_COORDINATOR_ADDRESS\\)"),
    (dict(mode="auto", environ={"REALM_PROCESS_ID": "1"}),
     "REALM_PROCESS_ID needs --coordinator_address"),
    (dict(mode="auto", environ={"REALM_COORDINATOR_ADDRESS": "h:1"}),
     "REALM_COORDINATOR_ADDRESS \\(--multihost=auto with a coordinator\\) needs "
     "--num_processes"),
])
def test_bad_topologies_name_the_flag(kwargs, message):
  kwargs.setdefault("environ", {})
  with pytest.raises(ConfigError, match=message):
    multihost.resolve(detect=lambda: None, **kwargs)


def test_a_long_wait_polls_so_a_signal_handler_can_stop_it(monkeypatch):
  """A wait for process 0 (its decision, or the end of its I/O) polls the coordination
  service with asks that return at once (a blocking ask cut into slices would leave it a
  callback for every slice that timed out), sleeping between two: a missing key asks again,
  a SIGTERM handler's exception (raised in the sleep) ends it, another error (the job ending)
  at once, and the timeout is a TimeoutError naming the key."""
  monkeypatch.setattr(multihost, "WAIT_SLICE_SECONDS", 0.01)
  monkeypatch.setattr(multihost, "FIRST_SLICE_SECONDS", 0.01)
  missing = jax.errors.JaxRuntimeError("NOT_FOUND: Config key k not found.")

  class Client:
    def __init__(self, answers):
      self.answers, self.asked = list(answers), 0

    def key_value_try_get(self, key):
      self.asked += 1
      answer = self.answers.pop(0)
      if isinstance(answer, BaseException):
        raise answer
      return answer

    def blocking_key_value_get(self, key, ms):
      raise AssertionError("a blocking ask leaves a callback behind when it times out")
  client = Client([missing] * 5 + ["7"])
  started = time.time()
  assert multihost.sliced_get(client, "k", 3600) == "7"
  assert client.asked == 6 and time.time() - started >= 0.05   # slept between the asks
  stopped = KeyboardInterrupt()   # what a signal handler raises between two asks
  with pytest.raises(KeyboardInterrupt):
    multihost.sliced_get(Client([missing, stopped]), "k", 3600)
  ended = jax.errors.JaxRuntimeError("UNAVAILABLE: the leader task died")
  with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):
    multihost.sliced_get(Client([ended, "7"]), "k", 3600)
  with pytest.raises(TimeoutError, match="'k' not set within 0.03s"):
    multihost.sliced_get(Client([missing] * 100), "k", 0.03)


def test_a_short_wait_asks_again_within_milliseconds():
  """An exchange whose processes are all there (between two steps) costs milliseconds, not
  a whole poll slice: the asks come after FIRST_SLICE_SECONDS, then twice as long each time
  up to WAIT_SLICE_SECONDS (a long wait's pace)."""
  missing = jax.errors.JaxRuntimeError("NOT_FOUND: Config key k not found.")
  answers = [missing] * 3 + ["7"]

  def key_value_try_get(key):
    answer = answers.pop(0)
    if isinstance(answer, BaseException):
      raise answer
    return answer
  started = time.time()
  assert multihost.sliced_get(types.SimpleNamespace(key_value_try_get=key_value_try_get),
                              "k", 3600) == "7"
  assert time.time() - started < 0.5   # 5 + 10 + 20 ms of sleep (before: 3 s)


def test_waits_after_process_0_writes_are_bounded_by_the_storage_patience(monkeypatch):
  """Processes that took different paths (one waits for process 0's move, process 0 sits in
  a device collective) fail after the heartbeat timeout plus twice the storage patience, or
  for process 0's bulk writes after at least BULK_IO_SECONDS, not after realm-index's wait of
  as long as process 0 lives: the timeout each wait gives `sliced_get`, on process 1."""
  from jax._src import distributed
  monkeypatch.setenv("REALM_JAX_STORAGE_PATIENCE", "30")
  asked = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  monkeypatch.setattr(distributed.global_state, "client",
                      types.SimpleNamespace(key_value_set=lambda key, value: None))
  monkeypatch.setattr(multihost, "sliced_get",
                      lambda client, key, timeout: asked.append(timeout) or "1")
  multihost.every_process("config", "x")
  multihost.after_first_process("workdir")
  multihost.after_first_process("frozen index published", multihost.bulk_io_timeout())
  io = multihost.barrier_timeout() + 60
  assert asked == [io, io, multihost.BULK_IO_SECONDS] and io < multihost.BULK_IO_SECONDS


def test_unequal_local_device_counts_are_named():
  multihost.check_device_counts([0, 0, 1, 1])
  with pytest.raises(ConfigError, match="unequal local device counts \\(process 0: 3, "
                     "process 1: 5\\)"):
    multihost.check_device_counts([0] * 3 + [1] * 5)


def test_exact_index_scores_do_not_depend_on_the_device_count(monkeypatch):
  """A host with 4 devices retrieves exactly what a host with 8 (or 1) does."""
  rng = np.random.default_rng(0)
  embeddings = rng.normal(size=(700, 32)).astype(np.float32)
  queries = rng.normal(size=(16, 32)).astype(np.float32)
  found = []
  for n in (8, 4, 1):
    monkeypatch.setattr(index_lib, "local_mesh",
                        lambda n=n: Mesh(np.asarray(jax.local_devices()[:n]), ("blocks",)))
    index = index_lib.ExactIndex.from_embeddings(embeddings)
    assert index.table.shape[0] % n == 0
    found.append(index.search(queries, 10))
  expected = np.argsort(-(queries.astype(np.float64) @ embeddings.T.astype(np.float64)),
                        axis=1, kind="stable")[:, :10]
  np.testing.assert_array_equal(found[0], expected)
  for other in found[1:]:
    np.testing.assert_array_equal(other, found[0])

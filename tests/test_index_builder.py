"""The separate index builder (`realm-index`) and the trainer's subscriber: what gets published,
what gets refused, and what survives a kill -9 at random points."""

import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from realm_jax import paths
from realm_jax.data import pipeline
from realm_jax.data.prepared import PreparedData
from realm_jax.errors import CheckpointError, ConfigError
from realm_jax.retrieval import published
from realm_jax.retrieval.builder import IndexBuilder
from realm_jax.workdir import BLOCKS_RECORD
from realm_jax.retrieval import index as index_lib
from realm_jax.retrieval.index import ExactIndex, embed_blocks
from realm_jax.retrieval.subscriber import IndexSubscriber, load_version
from realm_jax.runtime import partitioning, state as state_lib, embedders
from realm_jax.runtime.checkpoints import Checkpointer
from tests import helpers

CHECKPOINT_STEPS = (0, 10, 20)


def builder_config(world_dir, **overrides):
  overrides.setdefault("retrieval__refresh", "async")
  overrides.setdefault("builder__poll_seconds", 0.1)
  return helpers.tiny_config("realm", data_dir=world_dir, **overrides)


def make_checkpoints(config, workdir, steps_to_save=CHECKPOINT_STEPS):
  """Checkpoints whose retriever params differ per step (`drawn` per step)."""
  data = PreparedData(config.data.dir)
  model = state_lib.build_model(config, data.tokenizer.vocab_size)
  mesh = partitioning.make_mesh(config.mesh.shape)
  ckpt = Checkpointer(workdir, keep=10, async_saves=False)
  states = {}
  for step in steps_to_save:
    state, _, _ = helpers.drawn_state(config, model, mesh, data.blocks.block_len, 100 + step)
    ckpt.save(step, state, {"next_step": step}, {"step": np.int32(-1)})
    states[step] = state
  ckpt.close()
  return states, model, mesh, data


def checkpoint_again(workdir, state, step: int) -> None:
  """`state` saved again as checkpoint `step`: a newer checkpoint for the next builder."""
  ckpt = Checkpointer(workdir, keep=10, async_saves=False)
  ckpt.save(step, state, {"next_step": step}, {"step": np.int32(-1)})
  ckpt.close()


def build_once(config, workdir) -> int:
  """realm-index --once, in this process; returns the versions published."""
  builder = IndexBuilder(config, workdir)
  try:
    return builder.run(once=True)
  finally:
    builder.close()


def reference_embeddings(config, model, mesh, data, state):
  fn = embedders.block_embedder(model, mesh, config, state.params["retriever"])
  return embed_blocks(fn, data.blocks, mesh, config.retrieval.embed_batch_size)[0]


def loader_for(config, workdir, model, data):
  abstract, _ = state_lib.abstract_train_state(config, model, partitioning.make_mesh(
      config.mesh.shape), data.blocks.block_len)
  template = embedders.query_tower_params(abstract.params["retriever"])
  return lambda version: load_version(
      published.index_root(workdir), version, config=config, fingerprint=data.blocks.fingerprint,
      query_template=template,
      make_encoder=lambda p: embedders.QueryEncoder(model, config, p))


@pytest.mark.slow
def test_builder_publishes_the_newest_checkpoint_and_the_trainer_retrieves_from_it(
    world_dir, tmp_path, capsys):
  # The retriever smaller than the reader: the builder embeds with the retriever's shape.
  config = builder_config(world_dir, **helpers.SMALL_RETRIEVER)
  workdir = str(tmp_path / "run")
  states, model, mesh, data = make_checkpoints(config, workdir)
  assert build_once(config, workdir) == 1
  root = published.index_root(workdir)
  assert published.complete_versions(root) == [1] and published.read_latest(root) == 1
  manifest = published.verify(root, 1, fingerprint=data.blocks.fingerprint, dim=32)
  assert manifest["step"] == 20 and manifest["num_blocks"] == data.blocks.num_blocks
  assert manifest["backend"] == "exact"
  assert {"embeddings.npy", "query_params.npz"} <= set(manifest["files"])
  assert set(manifest["timings"]) >= {"restore_seconds", "embed_seconds", "build_seconds"}
  out = capsys.readouterr().out
  assert "embedding" in out and "published" in out
  # The published embeddings are the block tower of checkpoint 20, not of any other one.
  with (published.version_dir(root, 1) / "embeddings.npy").open("rb") as f:
    got = np.load(f)
  np.testing.assert_allclose(got, reference_embeddings(config, model, mesh, data, states[20]),
                             atol=1e-5)
  assert not np.allclose(got, reference_embeddings(config, model, mesh, data, states[10]),
                         atol=1e-3)
  # Retrieval through the loaded version = exact search with the same snapshot's query tower.
  loaded = loader_for(config, workdir, model, data)(1)
  ids = pipeline.query_ids(data.examples("train"), np.arange(8), config.data.query_len,
                          data.tokenizer.cls_id, data.tokenizer.sep_id)[0]
  query_params = embedders.query_tower_params(states[20].params["retriever"])
  emb = embedders.QueryEncoder(model, config, query_params)(ids)
  expected = ExactIndex.from_embeddings(got).search(emb, 5)
  np.testing.assert_array_equal(loaded.retrieve(ids, 5), expected)
  assert loaded.step == 20 and loaded.version == 1


@pytest.mark.slow
def test_deterministic_builder_builds_every_refresh_step_in_order(world_dir, tmp_path):
  config = builder_config(world_dir, retrieval__refresh="deterministic",
                          retrieval__refresh_every=10, retrieval__swap_lag=5,
                          train__steps=25)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0, 10, 15, 20, 25))
  builder = IndexBuilder(config, workdir)
  built = []
  while (step := builder.next_step(builder.checkpoint_steps())) is not None:
    built.append(builder.build(step)["step"])
  builder.close()
  assert built == [0, 10, 20, 25]     # 15 is no refresh step; 25 is the final one


def test_the_first_versions_blocks_per_second_leaves_the_compile_out(world_dir, tmp_path,
                                                                      capsys, monkeypatch):
  """The block tower's first call compiles it (0.5 s more here): the version's blocks/s, in
  its line and in its timings, is the embedding's after it, and the compile is said apart."""
  config = builder_config(world_dir, retrieval__embed_batch_size=64)   # 4 batches
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0,))
  block_embedder = embedders.block_embedder

  def compiling_first(*args):
    embed_fn, calls = block_embedder(*args), []

    def first_call_slow(ids, segments):
      if not calls:
        time.sleep(0.5)
      calls.append(len(ids))
      return embed_fn(ids, segments)
    return first_call_slow
  monkeypatch.setattr(embedders, "block_embedder", compiling_first)
  monkeypatch.setattr(index_lib, "_EMBEDDED", set())   # this process's first embedding
  assert build_once(config, workdir) == 1
  timings = published.read_manifest(published.index_root(workdir), 1)["timings"]
  assert 0.45 <= timings["compile_seconds"] <= timings["embed_seconds"], timings
  assert timings["blocks_per_second"] > 2 * 240 / timings["embed_seconds"], timings
  line = [l for l in capsys.readouterr().out.splitlines() if "embedded 240 blocks" in l]
  assert re.search(r"blocks/s, after \d+\.\ds compiling the block tower\)$", line[0]), line


def test_a_later_embeddings_slow_first_batch_is_not_said_as_a_compile(world_data, capsys,
                                                                         monkeypatch):
  """An in-process refresh after the first: its first batch may wait for a train step still
  running on the devices, but the block tower compiled at the process's first embedding in
  these shapes: no compile is said, and blocks/s is all of the embedding's."""
  monkeypatch.setattr(index_lib, "_EMBEDDED", set())
  mesh = partitioning.make_mesh((-1, 1))
  calls = []

  def first_call_slow(ids, segments):
    if not calls:
      time.sleep(0.3)
    calls.append(len(ids))
    return np.ones((len(ids), 4), np.float32)
  lines = []
  for _ in range(2):
    calls.clear()
    timings = {}
    embed_blocks(first_call_slow, world_data.blocks, mesh, 64, "[t] ", timings=timings)
    out = capsys.readouterr().out.splitlines()
    lines.append([l for l in out if "embedded 240 blocks in" in l][0])
  assert "compiling the block tower" in lines[0], lines
  assert "compiling the block tower" not in lines[1], lines
  assert timings["compile_seconds"] == 0.0, timings


def test_progress_lines_rate_and_eta_leave_the_compile_out(world_data, capsys, monkeypatch):
  """A compile longer than a progress interval (1 s here, 0.25 s between lines): no line
  gives the compile's blocks/s and ETA (it was the first line's, 32 blocks/s, an ETA of hours
  for a real corpus)."""
  monkeypatch.setattr(index_lib, "_EMBEDDED", set())
  monkeypatch.setattr(index_lib, "PROGRESS_SECONDS", 0.25)
  calls = []

  def compiling_first(ids, segments):
    time.sleep(1.0 if not calls else 0.1)
    calls.append(len(ids))
    return np.ones((len(ids), 4), np.float32)
  embed_blocks(compiling_first, world_data.blocks, partitioning.make_mesh((-1, 1)), 32, "[t] ")
  progress = [l for l in capsys.readouterr().out.splitlines() if "ETA" in l]
  assert progress, progress
  for line in progress:
    done, rate = re.search(r"embedded ([\d,]+)/240 blocks \(\d+%\) \| ([\d,]+) blocks/s",
                           line).groups()
    assert int(rate.replace(",", "")) >= 100, progress   # 320 after the compile
    assert int(done) > 32, progress


def test_a_compile_is_told_by_the_next_batches_mean_a_short_last_one_included(world_data,
                                                                                 capsys,
                                                                                 monkeypatch):
  """240 blocks in batches of 112 (8 CPU devices; 116 with 4): the last one is padded to a
  full batch and takes as long. A first batch of 0.45 s, the next ones of 0.1 s: a compile
  (over 3x their mean), though not over 3x the seconds per row times a batch's rows."""
  monkeypatch.setattr(index_lib, "_EMBEDDED", set())
  calls = []

  def compiling_first(ids, segments):
    time.sleep(0.45 if not calls else 0.1)
    calls.append(len(ids))
    return np.ones((len(ids), 4), np.float32)
  timings = {}
  embed_blocks(compiling_first, world_data.blocks, partitioning.make_mesh((-1, 1)), 116, "[t] ",
               timings=timings)
  assert len(calls) == 3 and calls[0] > 100, calls
  assert 0.25 <= timings["compile_seconds"] <= 0.4, timings
  line = [l for l in capsys.readouterr().out.splitlines() if "embedded 240 blocks in" in l]
  assert "compiling the block tower" in line[0], line


def test_deterministic_builder_builds_the_trainers_last_step_whatever_its_own_train_steps(
    world_dir, tmp_path):
  """The trainer's last step (train.steps in W/config.json), no refresh step: a builder given
  another train.steps builds it all the same (the trainer's final evaluation waits for it)."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "run")
  mode = dict(retrieval__refresh="deterministic", retrieval__refresh_every=10,
              retrieval__swap_lag=5)
  workdir_lib.record_config(builder_config(world_dir, train__steps=25, **mode), workdir)
  builder = IndexBuilder(builder_config(world_dir, train__steps=40, **mode), workdir)
  builder.published_steps = lambda: {20: 3}   # steps 0 to 20 built
  try:
    assert builder.next_step([0, 10, 20, 25]) == 25
  finally:
    builder.close()


def test_deterministic_builder_builds_the_trainers_refresh_steps_whatever_its_own_period(
    world_dir, tmp_path):
  """The trainer checkpoints and waits for the multiples of its retrieval.refresh_every (in
  W/config.json): a builder given another period builds them all the same, instead of none
  (the trainer, waiting for step 5's version, would never save step 10's checkpoint), and not
  its own period's (a version of step 3 beside them would prune the trainer's sooner)."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "run")
  mode = dict(retrieval__refresh="deterministic", retrieval__swap_lag=5, train__steps=40,
              train__keep_checkpoints=10, builder__keep_versions=6)
  workdir_lib.record_config(builder_config(world_dir, retrieval__refresh_every=5, **mode),
                            workdir)
  builder = IndexBuilder(builder_config(world_dir, retrieval__refresh_every=3, **mode), workdir)
  builder.published_steps = lambda: {0: 1}   # step 0 built
  try:
    assert builder.next_step([0, 3, 5]) == 5
    assert builder.next_step([0, 3, 6]) is None
  finally:
    builder.close()


@pytest.mark.parametrize("trainer_mode, builder_mode, expected", [
    ("deterministic", "async", 5), ("async", "deterministic", 7), (None, "deterministic", 5)])
def test_the_builder_takes_versions_as_the_trainer_reads_them(world_dir, tmp_path, trainer_mode,
                                                              builder_mode, expected):
  """The trainer's retrieval.refresh (in W/config.json) decides what the builder builds, its
  own config's only until the trainer has recorded one: an 'async' builder beside a
  deterministic trainer built the newest checkpoint only, and the trainer, waiting for a
  refresh step passed over, stopped as though the run had changed refresh mode."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "run")
  periods = dict(retrieval__refresh_every=5, retrieval__swap_lag=5, train__steps=40,
                 train__keep_checkpoints=10, builder__keep_versions=6)
  if trainer_mode:
    workdir_lib.record_config(builder_config(world_dir, retrieval__refresh=trainer_mode,
                                             **periods), workdir)
  builder = IndexBuilder(builder_config(world_dir, retrieval__refresh=builder_mode, **periods),
                         workdir)
  builder.published_steps = lambda: {0: 1}   # step 0 built
  try:
    assert builder.next_step([0, 5, 6, 7]) == expected
  finally:
    builder.close()


@pytest.mark.slow
def test_checkpoint_deleted_while_restoring_moves_to_the_newest(world_dir, tmp_path, capsys):
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir)
  builder = IndexBuilder(config, workdir)
  builder.checkpoint_steps()
  real_restore = builder._reader().restore
  deleted = []

  def restore_after_deletion(step, *args, **kwargs):
    if not deleted:   # kept-N deletes the checkpoint between listing and reading
      shutil.rmtree(os.path.join(workdir, "checkpoints", str(step)))
      deleted.append(step)
    return real_restore(step, *args, **kwargs)
  builder._reader().restore = restore_after_deletion
  assert builder.run(once=True) == 1
  builder.close()
  assert deleted == [20]
  manifest = published.read_manifest(published.index_root(workdir), 1)
  assert manifest["step"] == 10
  assert "checkpoint 20 was deleted while being restored" in capsys.readouterr().out


@pytest.mark.slow
def test_a_step_deleted_while_its_checkpoints_are_listed_is_listed_again(world_dir, tmp_path):
  """Orbax reads each step's metadata as it lists: a step the trainer deletes (keep-N) in
  between fails the listing with FileNotFoundError, or NotADirectoryError where the folder
  went between two of its looks. The builder lists again."""
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir)
  builder = IndexBuilder(config, workdir)
  try:
    steps = builder.checkpoint_steps()
    real_reload, failures = builder.lister.reload, [FileNotFoundError, NotADirectoryError]

    def reload_while_deleting():
      if failures:
        raise failures.pop(0)(f"{workdir}/checkpoints/20")
      real_reload()
    builder.lister.reload = reload_while_deleting
    assert builder.checkpoint_steps() == steps and not failures
  finally:
    builder.close()


def test_once_on_a_published_newest_checkpoint_says_so_and_builds_nothing(world_dir, tmp_path,
                                                                           capsys):
  """`realm-index --once` run again where its newest checkpoint is published (a rerun of a
  finished one): it names that version and exits, instead of publishing the same step again
  under a new number (and pruning an older step's version for it)."""
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0,))
  assert build_once(config, workdir) == 1
  capsys.readouterr()
  assert build_once(config, workdir) == 0
  root = published.index_root(workdir)
  assert published.complete_versions(root) == [1] and published.read_latest(root) == 1
  assert f"step 0 (the newest checkpoint) is already published as v1 " \
      f"({published.version_dir(root, 1)}): nothing to build" in capsys.readouterr().out



def test_once_beside_a_deterministic_trainer_builds_the_refresh_step_it_reads(world_dir,
                                                                              tmp_path, capsys):
  """`realm-index --once` on a deterministic run builds what the looping builder would: the
  next refresh step, not the newest checkpoint (step 15, a checkpoint_every one no step
  reads). A version of 15 would also have stopped every build of step 10, realm-index building
  only above the newest it published, and the trainer waiting for 10 failed naming
  keep_versions. With no refresh step left to build it says so and builds nothing."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.retrieval.builder import FINISHED
  workdir = str(tmp_path / "run")
  mode = dict(retrieval__refresh="deterministic", retrieval__refresh_every=10,
              retrieval__swap_lag=5, train__steps=40, train__checkpoint_every=5,
              train__keep_checkpoints=10)
  workdir_lib.record_config(builder_config(world_dir, **mode), workdir)
  builder = IndexBuilder(builder_config(world_dir, **mode), workdir)
  builder.checkpoint_steps = lambda: [0, 5, 10, 15]
  try:
    builder.published_steps = lambda: {0: 1}   # step 0 built
    assert builder._next_build(True, time.time()) == 10
    capsys.readouterr()
    builder.published_steps = lambda: {0: 1, 10: 2}
    assert builder._next_build(True, time.time()) == FINISHED
    assert "no checkpoint above step 10 (the newest published) is a refresh step" in \
        capsys.readouterr().out
  finally:
    builder.close()

@pytest.mark.slow
def test_a_checkpoint_that_does_not_restore_is_named_in_one_error(world_dir, tmp_path):
  """A finalised checkpoint whose files are truncated: the builder stops with a CheckpointError
  naming it and why (realm-index: one line, exit 1), publishing nothing."""
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0, 10))
  for root, _, files in os.walk(os.path.join(workdir, "checkpoints", "10", "params")):
    for name in files:
      if "/d" in root[len(workdir):]:   # the array data files (OCDBT's d/ dirs)
        os.truncate(os.path.join(root, name), 100)
  with pytest.raises(CheckpointError, match=f"checkpoint {workdir}/checkpoints/10 cannot be "
                     r"restored \(ValueError: .*OUT_OF_RANGE"):
    build_once(config, workdir)
  assert published.complete_versions(published.index_root(workdir)) == []


def test_no_space_for_latest_finishes_the_committed_version(world_dir, tmp_path, capsys,
                                                             monkeypatch):
  """A full disk once the version's manifest is in (readers may already use it): the builder
  points LATEST at that version when it can, and never publishes the step again."""
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (10,))
  write, failures = paths.write_text_atomic, []

  def full_for_latest(path, *args, **kwargs):
    if os.path.basename(str(path)) == published.LATEST and len(failures) < 2:
      failures.append(path)
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return write(path, *args, **kwargs)

  monkeypatch.setattr(paths, "write_text_atomic", full_for_latest)
  assert build_once(config, workdir) == 1
  root = published.index_root(workdir)
  assert len(failures) == 2
  assert published.complete_versions(root) == [1] and published.read_latest(root) == 1
  out = capsys.readouterr().out
  # the second try within builder.WAIT_MESSAGE_SECONDS of the first is not said again
  assert out.count("v1 is committed; finishing it") == 1 and "nothing of v" not in out, out
  with open(os.path.join(workdir, "metrics", "index.jsonl")) as f:
    assert [json.loads(line)["version"] for line in f] == [1]


def _full_disk():
  return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))   # a flush names no file


def _unanswered_bucket():
  from realm_jax.errors import StorageUnreachable
  try:   # raised from the connection's error, as paths.retried raises it
    raise StorageUnreachable("gs://b/run/metrics/index.jsonl: appending to failed, the "
                             "storage server did not answer") from ConnectionError("reset")
  except StorageUnreachable as e:
    return e


@pytest.mark.parametrize("error, said", [
    (_full_disk, "v1 (step 10): no space left for its line in W/metrics/index.jsonl"),
    (_unanswered_bucket, "v1 (step 10): the bucket did not answer writing its line in "
                         "W/metrics"),
], ids=["full disk", "unanswered bucket"])
def test_a_metrics_line_not_written_leaves_the_version_published_once(
    world_dir, tmp_path, capsys, monkeypatch, error, said):
  """A full disk under W/metrics, or a bucket that gives up answering there (past its
  patience), once the version is out: a warning, not the committed version's publishing done
  again (which wrote its line once per retry, the file keeping each failed line, and blamed
  the version's staging dir; with the manifest out of reach too, it published the step again
  under another number)."""
  from realm_jax.runtime.metrics import MetricWriter
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (10,))
  write, failures = MetricWriter.write, []

  def fails_once(self, step, scalars):
    if self.name == "index" and not failures:
      failures.append(step)
      raise error()
    return write(self, step, scalars)

  monkeypatch.setattr(MetricWriter, "write", fails_once)
  assert build_once(config, workdir) == 1
  out = capsys.readouterr().out
  assert failures == [10] and out.count("): published ") == 1, out
  assert said in out, out
  assert "committed; finishing it" not in out and ".tmp-" not in out, out
  assert published.complete_versions(published.index_root(workdir)) == [1]


def test_no_space_for_a_new_version_dir_is_waited_out(world_dir, tmp_path, capsys,
                                                      monkeypatch):
  """A disk already full when a build starts (its staging dir cannot be made): the builder
  waits for room as it does for a full disk met while writing, instead of exiting (under
  launch/local.py its exit stopped the trainer too)."""
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (10,))
  start, failures = published.start_version, []

  def full_for_new_dirs(root):
    if len(failures) < 2:
      failures.append(root)
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{root}/.tmp-00000001-1")
    return start(root)

  monkeypatch.setattr(published, "start_version", full_for_new_dirs)
  assert build_once(config, workdir) == 1
  root = published.index_root(workdir)
  assert len(failures) == 2
  assert published.complete_versions(root) == [1] and published.read_latest(root) == 1
  out = capsys.readouterr().out
  assert out.count("step 10: no space left creating") == 1, out   # the second: unsaid


def test_a_long_full_disk_is_said_once_per_wait_message_seconds(world_dir, tmp_path, capsys,
                                                                 monkeypatch):
  """While the disk stays full the builder tries every poll, but says so once per
  WAIT_MESSAGE_SECONDS (with the tries left unsaid), not every poll: a line every 0.1 s here
  would fill the log, which may be on that disk; a full disk after a publish is said at once."""
  from realm_jax.retrieval import builder as builder_lib
  config = builder_config(world_dir, builder__poll_seconds=0.01)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (10, 20))
  start, failures, clock = published.start_version, [], [1000.0]
  import types   # the builder's clock alone: each of its sleeps 4 s, nothing else's
  monkeypatch.setattr(builder_lib, "time", types.SimpleNamespace(
      time=lambda: clock[0], sleep=lambda seconds: clock.__setitem__(0, clock[0] + 4)))

  def full_for_30_tries(root):
    if len(failures) < 30:    # 30 tries, 4 s apart: 120 s of a full disk
      failures.append(root)
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{root}/.tmp-x")
    return start(root)

  monkeypatch.setattr(published, "start_version", full_for_30_tries)
  builder = IndexBuilder(config, workdir)
  try:
    assert builder.build(10) is not None
    lines = [line for line in capsys.readouterr().out.splitlines() if "no space left" in line]
    assert len(lines) == 4, lines   # at 0, 32, 64 and 96 s of the 120
    assert lines[0].endswith("trying again in 0.01s")
    assert [line.rsplit("(", 1)[1] for line in lines[1:]] == [
        "7 more tries since the last line)"] * 3
    failures.clear()
    assert builder.build(20) is not None   # a new full disk after a publish: said at once
    assert len([line for line in capsys.readouterr().out.splitlines()
                if "no space left" in line]) == 4
  finally:
    builder.close()


def test_a_builder_stopped_before_latest_points_it_when_it_starts_again(world_dir, tmp_path,
                                                                       capsys, monkeypatch):
  """SIGTERM (or kill -9) between the rename of v1 and the write of LATEST: v1 is complete and
  its step counts as built, so no build repeats it; the next builder points LATEST at it (an
  async trainer reads LATEST alone)."""
  from realm_jax.retrieval import builder as builder_lib
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0,))

  def stopped(*args, **kwargs):          # where the builder's SIGTERM handler raises
    raise builder_lib.Stopped()
  monkeypatch.setattr(published, "point_latest", stopped)
  with pytest.raises(builder_lib.Stopped):
    build_once(config, workdir)
  monkeypatch.undo()
  root = published.index_root(workdir)
  assert published.complete_versions(root) == [1] and published.read_latest(root) is None
  builder = IndexBuilder(config, workdir)
  try:
    assert published.read_latest(root) == 1 and builder.next_step([0]) is None
  finally:
    builder.close()
  assert "LATEST now names v1: a builder was stopped after publishing it and before LATEST " \
      "(was None)" in capsys.readouterr().out


def test_index_metrics_of_an_earlier_start_go_and_a_builder_going_on_keeps_its_own(
    world_dir, tmp_path):
  """W/metrics/index.jsonl holds each step once: a fresh start (its W/index removed, as the
  trainer asks; its checkpoints gone) drops the earlier start's lines as the trainer's logs do
  (they stayed: step 10 of the earlier start, then step 0 of this one); a builder started again
  beside its own versions keeps their lines."""
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (10,))
  assert build_once(config, workdir) == 1

  def logged_steps():
    with open(os.path.join(workdir, "metrics", "index.jsonl")) as f:
      return [json.loads(line)["step"] for line in f]
  assert logged_steps() == [10]
  shutil.rmtree(published.index_root(workdir))
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  states, *_ = make_checkpoints(config, workdir, (0,))
  assert build_once(config, workdir) == 1
  assert logged_steps() == [0]
  checkpoint_again(workdir, states[0], 20)
  assert build_once(config, workdir) == 1
  assert logged_steps() == [0, 20]


def test_builder_without_checkpoints_waits_then_fails_clearly(world_dir, tmp_path):
  config = builder_config(world_dir, builder__wait_timeout=0.5, builder__poll_seconds=0.1)
  workdir = str(tmp_path / "run")
  flags = helpers.config_flags(config, "demo_realm")
  t0 = time.time()
  proc = subprocess.run([sys.executable, "-m", "realm_jax.retrieval.builder", *flags,
                         f"--workdir={workdir}"], capture_output=True, text=True,
                        cwd=helpers.REPO, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "waiting for a checkpoint" in proc.stdout
  errors = [line for line in proc.stderr.splitlines() if "realm-index: error" in line]
  assert len(errors) == 1 and "builder.wait_timeout" in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
  assert not os.path.exists(os.path.join(workdir, "index", "LATEST"))
  assert time.time() - t0 < 120


def test_a_builder_waits_past_its_timeout_for_a_trainer_that_runs(world_dir, tmp_path, capsys):
  """No checkpoint yet, but W/trainer.lock names a live trainer (a slow start): the builder
  does not give up after builder.wait_timeout; once that trainer is gone, it does."""
  config = builder_config(world_dir, builder__wait_timeout=0.3, builder__poll_seconds=0.05)
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  lock = os.path.join(workdir, "trainer.lock")
  with open(lock, "w") as f:
    f.write(f"{os.getpid()} {socket.gethostname()}\n")
  builder = IndexBuilder(config, workdir)
  failed = []
  thread = threading.Thread(target=lambda: failed.append(pytest.raises(
      FileNotFoundError, builder.run)), daemon=True)
  try:
    thread.start()
    thread.join(timeout=1.5)
    assert thread.is_alive() and not failed    # 5x its wait_timeout, still waiting
    helpers.dead_job_lock(workdir, "trainer")   # that trainer ended
    thread.join(timeout=30)
    assert failed and "builder.wait_timeout" in str(failed[0].value)
  finally:
    builder.close()
  assert f"the trainer (pid {os.getpid()}) runs on this workdir" in capsys.readouterr().out


def test_a_builder_whose_trainer_died_says_so_and_ends_at_done(world_dir, tmp_path, capsys):
  """Everything built, W/trainer.lock names a pid that no longer runs and W/DONE is absent: the
  builder says the trainer is not running (not a silent wait), and ends when DONE comes."""
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0,))
  gone = subprocess.Popen(["true"])
  gone.wait()
  with open(os.path.join(workdir, "trainer.lock"), "w") as f:
    f.write(f"{gone.pid}\n")
  builder = IndexBuilder(config, workdir)
  ended = []
  thread = threading.Thread(target=lambda: ended.append(builder.run()), daemon=True)
  try:
    thread.start()
    deadline, out = time.time() + 120, ""
    while "is not running" not in out and time.time() < deadline:
      time.sleep(0.2)
      out += capsys.readouterr().out
    assert f"the trainer (pid {gone.pid}, {workdir}/trainer.lock) is not running and no " \
        f"W/DONE says this run's train.steps ({config.train.steps}) are done: waiting for a " \
        "checkpoint after step 0" in out, out[-2000:]
    assert not ended
    from realm_jax import workdir as workdir_lib
    workdir_lib.mark_done(workdir, config.train.steps)
    thread.join(timeout=60)
    assert ended == [1]
  finally:
    builder.close()
  from realm_jax import workdir as workdir_lib
  assert workdir_lib.job_gone(workdir, "trainer") == str(gone.pid)
  with open(os.path.join(workdir, "trainer.lock"), "w") as f:   # a trainer of another host
    f.write(f"{gone.pid} another-host\n")                       # (W on shared storage)
  assert workdir_lib.job_gone(workdir, "trainer") is None


def test_a_trainer_waiting_for_an_index_says_its_builder_finished_with_the_run(world_dir,
                                                                              tmp_path):
  """A builder that ended at W/DONE (exit 0), and its run since resumed with more
  train.steps: a trainer waiting for a version says that builder finished with the run at
  its step, not that it died or was stopped; the next builder's start clears that."""
  from realm_jax import workdir as workdir_lib
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  workdir_lib.mark_done(workdir, config.train.steps)
  builder = IndexBuilder(config, workdir)
  try:
    assert builder.run() == 0
  finally:
    builder.close()
  lock = os.path.join(workdir, "builder.lock")
  ended = open(lock).read().splitlines(True)[1:]
  helpers.dead_job_lock(workdir, "builder")   # its process has exited since
  with open(lock, "a") as f:
    f.writelines(ended)
  workdir_lib.clear_done(workdir)   # the run resumed
  sub = IndexSubscriber(workdir, loader=None, poll_seconds=3600)
  try:
    said = sub.builder_gone()
  finally:
    sub.close()
  assert said.endswith(f"builder.lock) is not running: it finished with the run at step "
                       f"{config.train.steps} (W/DONE); start it again with this config and "
                       "workdir"), said
  with workdir_lib.JobLock(workdir, "builder") as held:
    held.acquire()
    assert workdir_lib.job_ended(workdir, "builder") is None


def test_a_lock_whose_pid_another_process_took_names_a_job_gone(tmp_path):
  """W/trainer.lock of a trainer that ended, its pid since taken by another process (a pid
  reused, or a container restarted with the same host name): the job is gone, not running
  (the builder waited for it for ever, past builder.wait_timeout); the job holding the lock
  runs, and a file without the start (an older version's) is judged by its pid alone."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "run")
  lock = os.path.join(workdir, "trainer.lock")
  ended = subprocess.run(
      [sys.executable, "-c", "import sys; from realm_jax.workdir import JobLock; "
       "JobLock(sys.argv[1], 'trainer').acquire()", workdir],
      cwd=helpers.REPO, check=True)
  assert ended.returncode == 0
  pid, host, start, _ = open(lock).read().split()   # the trainer's pid, host, start, namespace
  with open(lock, "w") as f:                     # its pid now this (live) process's
    f.write(f"{os.getpid()} {host} {start}\n")
  assert workdir_lib.job_running(workdir, "trainer") is None
  assert workdir_lib.job_gone(workdir, "trainer") == str(os.getpid())
  with open(lock, "w") as f:
    f.write(f"{os.getpid()} {host}\n")
  assert workdir_lib.job_running(workdir, "trainer") == str(os.getpid())
  with workdir_lib.JobLock(workdir, "trainer") as held:   # the live holder
    held.acquire()
    assert len(open(lock).read().split()) == 4   # pid, host, start, pid namespace
    assert workdir_lib.job_running(workdir, "trainer") == str(os.getpid())
    assert workdir_lib.job_gone(workdir, "trainer") is None


def test_a_lock_of_another_pid_namespace_is_not_judged(tmp_path):
  """W/trainer.lock written in another pid namespace of the same host name (a container
  sharing the host's name and W): its pid names some other process here (pid 1 is every
  namespace's first), so the job is neither running nor gone, as a lock of another host."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "run")
  with workdir_lib.JobLock(workdir, "trainer") as held:
    held.acquire()
    pid, host, start, namespace = open(held.path).read().split()
  assert namespace == os.readlink("/proc/self/ns/pid")
  for other_start in (start, "1"):   # this process, or one that started at another time
    with open(held.path, "w") as f:
      f.write(f"{pid} {host} {other_start} pid:[1]\n")
    assert workdir_lib.job_running(workdir, "trainer") is None
    assert workdir_lib.job_gone(workdir, "trainer") is None
  with open(held.path, "w") as f:
    f.write(f"{pid} {host} {start} {namespace}\n")
  assert workdir_lib.job_running(workdir, "trainer") == pid


def test_builder_refuses_a_config_that_takes_no_versions_from_it(world_dir, tmp_path):
  """A REALM run rebuilding in process, ICT or Open-QA never reads realm-index's versions (and
  an Open-QA run's W/index is its frozen index, which they would replace and prune): refused
  naming the option, before anything is written."""
  workdir = str(tmp_path / "run")
  for config, option in [(builder_config(world_dir, retrieval__refresh="in_process"),
                          "retrieval.refresh"),
                         (helpers.tiny_config("ict", data_dir=world_dir), "task")]:
    with pytest.raises(ConfigError, match=rf"config\.{option}: this config .* takes no index "
                       "versions from realm-index"):
      IndexBuilder(config, workdir)
  assert not os.path.exists(workdir)


@pytest.mark.parametrize("overrides,option", [
    (dict(builder__num_leaves=5_000), "builder.num_leaves"),          # ~240 blocks
    (dict(builder__leaves_to_search=20), "builder.leaves_to_search"),  # derived: 1 leaf
    (dict(builder__num_leaves=4, builder__training_sample=10), "builder.training_sample"),
])
def test_scann_settings_the_corpus_cannot_take_are_refused_at_start(world_dir, tmp_path,
                                                                    overrides, option):
  """They failed the builder at its first build, after restoring and embedding (and the
  trainer then waited retrieval.index_timeout); the trainer ran until then."""
  from realm_jax.train.loop import query_examples
  config = builder_config(world_dir, retrieval__backend="scann", **overrides)
  workdir = str(tmp_path / "run")
  with pytest.raises(ConfigError, match=option):
    IndexBuilder(config, workdir)
  with pytest.raises(ConfigError, match=option):   # the trainer's check against its data
    query_examples(config, PreparedData(world_dir))


def test_builder_refuses_another_block_store(world_dir, tmp_path):
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)   # the record alone is refused: no checkpoint needs to be read first
  with open(os.path.join(workdir, BLOCKS_RECORD), "w") as f:
    json.dump({"block_store_fingerprint": "0123abcd", "data_dir": "/elsewhere"}, f)
  with pytest.raises(ConfigError) as e:
    IndexBuilder(config, workdir)
  fingerprint = PreparedData(world_dir).blocks.fingerprint
  assert "0123abcd" in str(e.value) and fingerprint in str(e.value)
  assert not os.path.exists(os.path.join(workdir, "index"))


def test_builder_refuses_a_config_other_than_the_runs(world_dir, tmp_path):
  """realm-index under a model other than the trainer's checkpoints were written under is
  refused naming the fields, as realm-train is (it was an Orbax shape traceback)."""
  from realm_jax.workdir import CHECKPOINTS, record_config
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  record_config(config, workdir)
  os.makedirs(os.path.join(workdir, CHECKPOINTS, "2"))
  other = builder_config(world_dir, model__retrieval_dim=config.model.retrieval_dim * 2)
  with pytest.raises(ConfigError, match=r"holds checkpoints of an incompatible config; fields "
                     r"that differ: model\.retrieval_dim"):
    IndexBuilder(other, workdir)
  assert not os.path.exists(os.path.join(workdir, "index"))


def _publish_fake(workdir, step, embeddings, query_params, fingerprint, backend="exact"):
  return published.publish_arrays(published.index_root(workdir), embeddings, query_params,
                                  step=step, fingerprint=fingerprint, keep=5,
                                  backend=backend)["version"]


def test_subscriber_rejects_bad_versions_and_keeps_the_good_one(world_dir, tmp_path, capsys):
  config = builder_config(world_dir)
  workdir = str(tmp_path / "run")
  states, model, mesh, data = make_checkpoints(config, workdir, (0,))
  build_once(config, workdir)
  root = published.index_root(workdir)
  good = published.read_manifest(root, 1)
  query_params = partitioning.host_copy(embedders.query_tower_params(states[0].params["retriever"]))
  n = data.blocks.num_blocks
  fp = data.blocks.fingerprint
  wrong_dim = _publish_fake(workdir, 5, np.ones((n, 16), np.float32), query_params, fp)
  other_store = _publish_fake(workdir, 6, np.ones((n, 32), np.float32), query_params, "ffff")
  corrupt = _publish_fake(workdir, 7, np.ones((n, 32), np.float32), query_params, fp)
  path = str(published.version_dir(root, corrupt) / "embeddings.npy")
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) - 1)
    f.write(b"\x07")
  no_manifest = published.version_dir(root, corrupt + 1)
  no_manifest.mkdir()
  (no_manifest / "embeddings.npy").write_bytes(b"partial")
  loader = loader_for(config, workdir, model, data)
  sub = IndexSubscriber(workdir, loader, poll_seconds=3600)
  try:
    for version in (1, wrong_dim, other_store, corrupt):
      with open(os.path.join(workdir, "index", "LATEST"), "w") as f:
        f.write(f"{version:08d}\n")
      sub.poll()
    assert sub.newest().version == 1 and sub.newest().step == good["step"]
    reasons = sub.rejected
    assert set(reasons) == {wrong_dim, other_store, corrupt}
    assert "dim 16 (index) != 32 (trainer)" in reasons[wrong_dim]
    assert "ffff" in reasons[other_store] and fp in reasons[other_store]
    assert "sha256" in reasons[corrupt] and "embeddings.npy" in reasons[corrupt]
    with open(os.path.join(workdir, "index", "LATEST"), "w") as f:
      f.write(f"{corrupt + 1:08d}\n")       # a pointer to a version without manifest
    sub.poll()
    assert sub.newest().version == 1
    out = capsys.readouterr().out
    assert out.count("rejected, not used") == 4
  finally:
    sub.close()


# -- kill -9 at random points -----------------------------------------------------------------

SLOW_DISK = """import os, time
_fsync = os.fsync
def _slow_fsync(fd):   # a slow disk: publishing takes long enough to be killed inside
  time.sleep(0.03)
  _fsync(fd)
os.fsync = _slow_fsync
"""


def _start_builder(flags, workdir, slow_disk: str | None = None):
  env = dict(os.environ)
  if slow_disk:   # sitecustomize runs in the builder before any of our code
    os.makedirs(slow_disk, exist_ok=True)
    with open(os.path.join(slow_disk, "sitecustomize.py"), "w") as f:
      f.write(SLOW_DISK)
    env["PYTHONPATH"] = slow_disk + os.pathsep + env.get("PYTHONPATH", "")
  return subprocess.Popen([sys.executable, "-u", "-m", "realm_jax.retrieval.builder", *flags,
                           f"--workdir={workdir}", "--once"], cwd=helpers.REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True, env=env)


def _kill_after_marker(proc, marker: str, delay: float) -> str:
  """kill -9 `delay` s after the builder prints `marker`; returns everything it printed."""
  out = []
  for line in proc.stdout:
    out.append(line)
    if marker in line:
      time.sleep(delay)
      os.killpg(proc.pid, signal.SIGKILL)
      break
  out.append(proc.stdout.read())
  proc.wait()
  return "".join(out)


@pytest.fixture(scope="module")
def larger_world(tmp_path_factory):
  """~2,000 blocks: embedding them in batches of 8 takes long enough to be killed inside."""
  from realm_jax.data.world_corpus import prepare_world
  out = str(tmp_path_factory.mktemp("larger_world"))
  demo = helpers.load_config_module("demo_realm").get_config().data
  prepare_world(out, num_entities=500, seed=1, block_len=demo.block_len,
                max_sentence_len=demo.query_len - 2, vocab_size=helpers.VOCAB_SIZE)
  return out


def _kill_builders(flags, workdir: str, slow_disk: str | None, marker: str, max_delay: float,
                   rng: random.Random, fingerprint: str, state, kills: int = 5) -> list[str]:
  """`kills` builders, each given a newer checkpoint (`state` saved again: --once builds no
  published step) and killed -9 a random delay after it printed `marker`; after each, every
  visible version is complete and verifies and LATEST names one of them. Returns where each
  kill landed: "before" the version's commit or "after" it."""
  root = published.index_root(workdir)
  landed = []
  for kill in range(kills):
    checkpoint_again(workdir, state, kill + 1)
    latest = published.read_latest(root)
    proc = _start_builder(flags, workdir, slow_disk)
    printed = _kill_after_marker(proc, marker, rng.uniform(0, max_delay))
    assert marker in printed, printed[-2000:]
    committed = published.read_latest(root) != latest
    assert committed or "published" not in printed, printed[-2000:]
    landed.append("after" if committed else "before")
    versions = published.complete_versions(root)
    for version in versions:
      published.verify(root, version, fingerprint=fingerprint, dim=32)
    assert published.read_latest(root) in versions
  return landed


@pytest.mark.parametrize("phase,marker,max_delay", [
    ("embedding", "embedding", 0.5),
    ("publishing", "publishing", 0.3),
])
@pytest.mark.slow
def test_builder_killed_at_random_points_never_exposes_a_partial_version(
    request, tmp_path, capsys, phase, marker, max_delay):
  if phase == "embedding":   # slow embedding (batches of 8) so that a random kill lands inside
    config = builder_config(request.getfixturevalue("larger_world"),
                            retrieval__embed_batch_size=8)
  else:   # a slow disk (below) makes publishing long; the embedding before it is not killed
    config = builder_config(request.getfixturevalue("world_dir"))
  workdir = str(tmp_path / "run")
  states, model, mesh, data = make_checkpoints(config, workdir, (0,))
  flags = helpers.config_flags(config, "demo_realm")
  root = published.index_root(workdir)
  # A first complete version, as the trainer would be using it (built here: the builders
  # killed below are processes of their own).
  assert build_once(config, workdir) == 1 and published.read_latest(root) == 1
  loader = loader_for(config, workdir, model, data)
  sub = IndexSubscriber(workdir, loader, poll_seconds=0.02)
  sub.wait(lambda have: have.get(1), 60, "v1")
  seen, stop = [], threading.Event()

  def watch():   # what the trainer would retrieve from, sampled all through the kills
    while not stop.is_set():
      newest = sub.newest()
      seen.append(None if newest is None else newest.version)
      time.sleep(0.01)
  watcher = threading.Thread(target=watch)
  watcher.start()
  try:
    slow_disk = str(tmp_path / "slow_disk") if phase == "publishing" else None
    landed = _kill_builders(flags, workdir, slow_disk, marker, max_delay,
                            random.Random(len(phase)), data.blocks.fingerprint, states[0])
    print(f"{phase}: kills landed {landed} the commit")
    if phase == "embedding":   # most kills inside the embedding (on an idle fast machine one
      assert landed.count("before") >= 3, landed   # may finish within its delay)
    else:   # inside the publish sequence, before the LATEST commit, at least sometimes
      assert "before" in landed
    time.sleep(0.2)
    assert sub.rejected == {}, sub.rejected
    before = max(published.complete_versions(root))
    # The builder restarted (here) for the trainer's next checkpoint: the next complete
    # version is taken.
    checkpoint_again(workdir, states[0], 6)
    capsys.readouterr()
    assert build_once(config, workdir) == 1
    out = capsys.readouterr().out
    if phase == "embedding":   # the killed builders' staging dirs are cleaned up
      assert "removed" in out and ".tmp-" in out
    newest = published.read_latest(root)
    assert newest > before
    sub.wait(lambda have: have.get(newest), 60, f"v{newest}")
  finally:
    stop.set()
    watcher.join()
    seen.append(None if sub.newest() is None else sub.newest().version)   # where it ended
    sub.close()
  assert sub.rejected == {}
  assert seen[0] == 1 and seen[-1] == newest
  assert all(v is not None for v in seen)   # never without an index once it had one
  assert seen == sorted(seen)               # and never back to an older one
  assert not [p for p in os.listdir(str(root)) if p.startswith(".tmp-")]


@pytest.mark.slow
def test_scann_backend_is_published_with_its_recall_and_served(larger_world, tmp_path, capsys):
  # A wide random init: the default one maps every block to nearly the same embedding
  # (cosine 0.99999 to their mean), where nearest neighbours are ties and recall is noise.
  config = builder_config(larger_world, retrieval__backend="scann", builder__num_leaves=20,
                          builder__leaves_to_search=20, builder__recall_queries=200,
                          model__initializer_range=1.0)
  workdir = str(tmp_path / "run")
  states, model, mesh, data = make_checkpoints(config, workdir, (0,))
  build_once(config, workdir)
  root = published.index_root(workdir)
  manifest = published.verify(root, 1, fingerprint=data.blocks.fingerprint, dim=32)
  assert manifest["backend"] == "scann" and manifest["scann"]["num_leaves"] == 20
  assert any(path.startswith("scann/") for path in manifest["files"])
  # Probing every leaf, the approximate index must agree closely with exact search.
  assert manifest["recall_at_10"] >= 0.9
  assert "recall@10 vs exact" in capsys.readouterr().out
  loaded = loader_for(config, workdir, model, data)(1)
  ids = pipeline.query_ids(data.examples("train"), np.arange(16), config.data.query_len,
                           data.tokenizer.cls_id, data.tokenizer.sep_id)[0]
  with (published.version_dir(root, 1) / "embeddings.npy").open("rb") as f:
    exact = ExactIndex.from_embeddings(np.load(f))
  got, want = loaded.retrieve(ids, 5), exact.search(loaded.encode_queries(ids), 5)
  assert np.mean([len(set(a) & set(b)) / 5 for a, b in zip(got, want)]) >= 0.9


def test_the_logged_recall_names_the_queries_it_was_measured_on(world_dir, tmp_path, capsys):
  """A corpus of fewer blocks than builder.recall_queries is measured on one query per block:
  the line names that many, not the option's value."""
  config = builder_config(world_dir, retrieval__backend="scann")
  workdir = str(tmp_path / "run")
  _, _, _, data = make_checkpoints(config, workdir, (0,))
  build_once(config, workdir)
  num_blocks = data.blocks.num_blocks
  assert num_blocks < config.builder.recall_queries
  assert f"recall@10 vs exact 1.000 on {num_blocks} block-derived queries" in \
      capsys.readouterr().out


def test_a_scann_build_says_what_it_does_before_it_starts(world_dir, tmp_path, capsys,
                                                          monkeypatch):
  """Between the embedding's last line and the built index's line are the ScaNN build, its
  serialization and the recall's exact search (~7 min at 13.35M blocks): the build is said
  as it starts, with its size and settings (before: nothing for those minutes)."""
  from realm_jax.retrieval import scann_index
  config = builder_config(world_dir, retrieval__backend="scann")
  workdir = str(tmp_path / "run")
  make_checkpoints(config, workdir, (0,))
  build, said = scann_index.build_searcher, []

  def build_searcher(embeddings, settings):
    said.append(capsys.readouterr().out.splitlines()[-1])
    return build(embeddings, settings)
  monkeypatch.setattr(scann_index, "build_searcher", build_searcher)
  capsys.readouterr()
  build_once(config, workdir)
  assert re.search(r"v1 \(step 0\): building a scann index of [\d,]+ x 32 \(.*num_leaves",
                   said[0]), said


def test_a_trainer_waiting_for_its_first_index_says_so_at_once_and_then_regularly(
    tmp_path, capsys, monkeypatch):
  """No builder running: the wait names where it looks and what to start, at once and every
  WAIT_NOTICE_SECONDS, and ends by the timeout naming the option."""
  from realm_jax.retrieval import subscriber
  monkeypatch.setattr(subscriber, "WAIT_NOTICE_SECONDS", 0.4)
  sub = IndexSubscriber(str(tmp_path / "run"), loader=None, poll_seconds=3600)
  try:
    t0 = time.time()
    with pytest.raises(TimeoutError, match="config.retrieval.index_timeout"):
      sub.wait(lambda have: None, 1.0, "built from step 0")
    lines = [l for l in capsys.readouterr().out.splitlines() if "waiting for" in l]
    assert time.time() - t0 >= 1.0
    assert 3 <= len(lines) <= 4, lines        # at once, at ~0.4 s and ~0.8 s
    assert f"--workdir {tmp_path / 'run'}" in lines[0] and "realm-index" in lines[0]
    assert "built from step 0" in lines[0] and "index_timeout" in lines[0]
  finally:
    sub.close()


def test_a_trainer_waiting_for_an_index_names_a_builder_that_died(tmp_path, capsys):
  """W/builder.lock names a realm-index that no longer runs (killed -9 mid-run): the waiting
  lines and the timeout say so, instead of only asking whether one runs."""
  workdir = str(tmp_path / "run")
  gone = helpers.dead_job_lock(workdir, "builder")
  said = f"realm-index (pid {gone}, {workdir}/builder.lock) is not running"
  sub = IndexSubscriber(workdir, loader=None, poll_seconds=3600)
  try:
    with pytest.raises(TimeoutError) as e:
      sub.wait(lambda have: None, 0.5, "built from step 3")
  finally:
    sub.close()
  assert said in str(e.value) and "is realm-index running" not in str(e.value)
  waiting = [l for l in capsys.readouterr().out.splitlines() if "waiting for" in l]
  assert waiting and said in waiting[0], waiting
  with open(os.path.join(workdir, "builder.lock"), "w") as f:   # a builder that runs
    f.write(f"{os.getpid()} {socket.gethostname()}\n")
  sub = IndexSubscriber(workdir, loader=None, poll_seconds=3600)
  try:
    with pytest.raises(TimeoutError, match="is realm-index running with this workdir"):
      sub.wait(lambda have: None, 0.2, "built from step 3")
  finally:
    sub.close()


def test_a_launchers_check_of_a_lock_leaves_the_file_as_the_job_left_it(tmp_path):
  """launch/local.py asks whether a trainer or a builder holds W's lock before it starts
  anything (`job_holding`): the check took the lock, which wrote this process's pid into the
  file over the ended job's pid and its `ended:` line (a trainer waiting for a version later
  named the launcher as a builder that "died or was stopped")."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "run")
  pid = helpers.dead_job_lock(workdir, "builder")
  with open(os.path.join(workdir, "builder.lock"), "a") as f:
    f.write(f"{workdir_lib.ENDED}it finished with the run at step 8 (W/DONE)\n")
  before = open(os.path.join(workdir, "builder.lock")).read()
  assert workdir_lib.job_holding(workdir, "builder") is None
  assert open(os.path.join(workdir, "builder.lock")).read() == before
  assert workdir_lib.job_gone_and_how(workdir, "builder") == (
      str(pid), "it finished with the run at step 8 (W/DONE)")
  with workdir_lib.JobLock(workdir, "builder") as held:   # a live one is still named
    held.acquire()
    assert workdir_lib.job_holding(workdir, "builder") == str(os.getpid())

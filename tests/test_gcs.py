"""Runs that live in a bucket: `realm-prepare` -> ICT -> REALM with `realm-index` in its own
process, killed -9 while publishing -> another builder -> resume -> `realm-eval`, with the data dir
and the workdirs on `gs://`, against a server speaking the GCS JSON API on 127.0.0.1
(tests/gcs_server.py; skipped with the reason where it cannot start). A malformed URL never
becomes a local path."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import ml_collections
import numpy as np
import pytest
from etils import epath

from realm_jax import paths, workdir as workdir_lib
from realm_jax.data.prepare import prepare
from realm_jax.errors import ConfigError, StorageUnreachable
from realm_jax.openqa_eval import evaluate_run
from realm_jax.retrieval import published
from realm_jax.train.loop import train
from tests import gcs_server, helpers
from tests.helpers import tiny_config

def bucket_text(url: str) -> str:
  return epath.Path(url).read_text()


_BUILDERS: list[subprocess.Popen] = []   # started by the current test


@pytest.fixture(autouse=True)
def _no_builder_outlives_its_test():
  """A test that fails between starting a builder and stopping it would leave the builder
  polling the bucket: whatever is still running at the test's end is killed with its group."""
  yield
  while _BUILDERS:
    builder = _BUILDERS.pop()
    if builder.poll() is None:
      with contextlib.suppress(ProcessLookupError):
        os.killpg(builder.pid, signal.SIGKILL)
      builder.wait(timeout=30)


def _builder(config, workdir: str, log: str, env: dict | None = None) -> subprocess.Popen:
  """realm-index on `workdir`, in its own process (the environment points it at the server,
  or `env` at another address), its output to the file `log`."""
  with open(log, "w") as out:
    builder = subprocess.Popen(
        [sys.executable, "-u", "-m", "realm_jax.retrieval.builder",
         *helpers.config_flags(config, "demo_realm"), f"--workdir={workdir}"],
        cwd=helpers.REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **(env or {})})
  _BUILDERS.append(builder)
  return builder


def _finished(builder: subprocess.Popen, log: str) -> str:
  builder.wait(timeout=300)
  out = open(log).read()
  assert builder.returncode == 0, out[-3000:]
  return out


def _kill_when(builder: subprocess.Popen, log: str, written, then) -> threading.Thread:
  """A thread that kill -9s `builder` as soon as `written` (a path) exists, then calls
  `then()`; errors are kept in `thread.errors`."""
  def watch():
    try:
      deadline = time.time() + 300
      while not epath.Path(written).exists():
        assert builder.poll() is None and time.time() < deadline, open(log).read()[-3000:]
        time.sleep(0.05)
      os.killpg(builder.pid, signal.SIGKILL)
      builder.wait()
      then()
    except BaseException as e:  # noqa: BLE001  (raised in the test's thread)
      thread.errors.append(e)
  thread = threading.Thread(target=watch, daemon=True)
  thread.errors = []
  thread.start()
  return thread


def _prepare_in_the_bucket(data: str, capsys) -> dict:
  config = helpers.load_config_module("prepare").get_config("world")
  config.source, config.out_dir = f"world:{helpers.WORLD_ENTITIES}", data
  config.vocab_size, config.num_workers = helpers.VOCAB_SIZE, 0
  stats = prepare(config)
  out = capsys.readouterr().out
  assert f"[prepare] uploaded to {data}" in out
  manifest = json.loads(bucket_text(f"{data}/{paths.FILES_MANIFEST}"))
  assert {"vocab.txt", "stats.json", "qa/eval.jsonl"} <= set(manifest["files"])
  assert json.loads(bucket_text(f"{data}/stats.json"))["blocks"] == stats["blocks"]
  assert not os.path.exists("gs:"), "a URL became a local dir"
  assert prepare(config)["blocks"] == stats["blocks"]   # finished: not prepared again
  assert "is already prepared and uploaded" in capsys.readouterr().out
  shutil.rmtree(paths.cache_dir(data))   # as on another host: nothing local yet
  return stats


@pytest.mark.slow
def test_prepare_ict_realm_with_the_builder_resume_and_eval_all_in_the_bucket(server, gcs,
                                                                              capsys, tmp_path,
                                                                              caplog,
                                                                              monkeypatch):
  data, ict_dir, workdir = f"{gcs}/world/data", f"{gcs}/world/ict", f"{gcs}/world/realm"
  at_saves = _metrics_in_the_bucket_at_each_save(monkeypatch)
  _prepare_in_the_bucket(data, capsys)

  # REALM from an ICT run, with realm-index in its own process: the two meet only in the
  # bucket. The builder starts first and waits for the REALM run's checkpoints.
  realm = tiny_config("realm", None, data, train__steps=4, train__checkpoint_every=4,
                      retrieval__refresh="deterministic", retrieval__refresh_every=4,
                      retrieval__swap_lag=1, retrieval__index_timeout=240.0,
                      builder__poll_seconds=0.2, init__from_workdir=ict_dir)
  log = str(tmp_path / "builder.log")
  # The builder reaches the bucket through a slow link for the final version's files: it is
  # killed -9 once the first of them is there, before the manifest.
  slow = gcs_server.SlowLink(server, ["/index/00000002/"], seconds=1.0)
  builder = _builder(realm, workdir, log, env=slow.env)
  ict = tiny_config("ict", None, data, train__steps=2, train__checkpoint_every=2)
  assert train(ict, ict_dir)["steps"] == 2
  out = capsys.readouterr().out
  assert "[data] copied" in out and "verified" in out   # the arrays are read locally
  assert "TensorBoard events of gs://" in out
  assert json.loads(bucket_text(f"{ict_dir}/config.json"))["data"]["dir"] == data

  # The builder is killed -9 in the middle of publishing the final version. A second builder,
  # reaching the bucket directly, with the config of the longer run that will resume this
  # one, builds it again under a new number while the trainer waits.
  resumed = realm.copy_and_resolve_references()
  resumed.train.steps = 6
  second, second_log = [], str(tmp_path / "builder2.log")
  killer = _kill_when(builder, log, f"{workdir}/index/00000002/{published.EMBEDDINGS}",
                      lambda: second.append(_builder(resumed, workdir, second_log)))
  try:
    first = train(realm, workdir)
  finally:
    killer.join(timeout=60)
    slow.close()
  assert not killer.errors and not killer.is_alive(), killer.errors
  out = capsys.readouterr().out
  assert "[data] copied" not in out   # the verified local copy is reused
  assert first["steps"] == 4 and first["eval_index_step"] == 4, first   # the final version
  assert first["index_rejected"] == 0, out[-3000:]
  assert sorted(p.name for p in epath.Path(f"{workdir}/checkpoints").iterdir()) == ["0", "4"]
  _killed_version_unseen(workdir, log, version=2, step=4, complete=[1, 3])

  # Resumed with more steps, by the same second builder: the earlier DONE (step 4) is not
  # this run's end.
  again = train(resumed, workdir)
  built = _finished(second[0], second_log)
  out = capsys.readouterr().out
  assert f"resumed from {workdir}/checkpoints/4 (data at step 4)" in out, out[-3000:]
  assert again["steps"] == 6 and again["eval_index_step"] == 6, again
  assert f"published {workdir}/index/00000003" in built and \
      f"published {workdir}/index/00000004" in built, built[-3000:]
  for version in published.complete_versions(published.index_root(workdir)):
    published.verify(published.index_root(workdir), version, dim=resumed.model.retrieval_dim)
  logged = [json.loads(line)["step"] for line in
            bucket_text(f"{workdir}/metrics/train.jsonl").splitlines()]
  assert logged == list(range(1, 7))   # appended across the restart, in the bucket
  # Held back (the per-step logs), the lines of the steps each checkpoint covers were in the
  # bucket when it was saved: a run killed after it and resumed from it writes later steps'.
  assert {(w, step) for w, step, _ in at_saves} >= {(ict_dir, 2), (workdir, 4), (workdir, 6)}
  for run, step, logged in at_saves:
    assert logged["train"] == list(range(1, step + 1)), (run, step, logged)
    assert logged["retrieval"] == (list(range(1, step + 1)) if run == workdir else []), \
        (run, step, logged)

  _evaluate_in_the_bucket(resumed, workdir, step=6)
  # A run recorded on a TPU VM through gcsfuse (data.dir /gcs/B/P), read where nothing is
  # mounted (realm-eval on a laptop): its data comes from gs://B/P
  mounted = ml_collections.ConfigDict({"data": {"dir": paths.MOUNT_ROOT + data[len("gs:/"):]}})
  assert workdir_lib.open_data(mounted).blocks.fingerprint == \
      workdir_lib.open_data(resumed).blocks.fingerprint
  assert f"{mounted.data.dir} is not mounted here: reading {data}" in caplog.text
  # realm-eval of the run as recorded there: its `prepared:` questions come from the bucket too
  recorded = resumed.copy_and_resolve_references()
  recorded.data.dir = mounted.data.dir
  _evaluate_in_the_bucket(recorded, workdir, step=6)
  # The run keeps its vocab in the bucket, and readers of the run check against it there.
  vocab = bucket_text(f"{data}/vocab.txt")
  assert bucket_text(f"{ict_dir}/vocab.txt") == vocab
  tokens = vocab.splitlines()
  swapped = tmp_path / "swapped" / "vocab.txt"
  swapped.parent.mkdir()
  swapped.write_text("\n".join(tokens[:-2] + tokens[:-3:-1]) + "\n")
  from realm_jax.runtime.initialization import check_run_vocab
  with pytest.raises(ConfigError, match=rf"config\.init\.from_workdir: the data's .*swapped/vocab"
                     rf"\.txt .* differs from {re.escape(ict_dir)}/vocab\.txt"):
    check_run_vocab(ict_dir, "init.from_workdir", str(swapped))


def _metrics_in_the_bucket_at_each_save(monkeypatch) -> list[tuple[str, int, dict]]:
  """(workdir, step, the steps of its train and retrieval JSONL in the bucket) at each
  checkpoint save from now on, the per-step logs held back for an hour (sent only before a
  checkpoint and at their close)."""
  from realm_jax.runtime import checkpoints
  monkeypatch.setattr(paths, "BUCKET_HOLD_SECONDS", 3600.0)
  seen, save = [], checkpoints.Checkpointer.save

  def steps_in(url: str) -> list[int]:
    text = paths.read_text(url)
    return [] if text is None else [json.loads(line)["step"] for line in text.splitlines()]

  def recorded_save(self, step, *args):
    seen.append((self.workdir, step, {name: steps_in(f"{self.workdir}/metrics/{name}.jsonl")
                                      for name in ("train", "retrieval")}))
    return save(self, step, *args)

  monkeypatch.setattr(checkpoints.Checkpointer, "save", recorded_save)
  return seen


def _killed_version_unseen(workdir: str, log: str, version: int, step: int,
                          complete: list[int]) -> None:
  """What the builder killed while publishing `version` wrote is there, but no reader sees it
  (no manifest); the number is not used again: the complete versions are `complete`."""
  root, name = published.index_root(workdir), f"{workdir}/index/{version:08d}"
  assert f"v{version} (step {step})" in open(log).read()
  assert f"published {name}" not in open(log).read()
  assert epath.Path(name).exists()
  assert not epath.Path(f"{name}/{published.MANIFEST}").exists()
  assert published.complete_versions(root) == complete
  assert published.read_latest(root) == complete[-1]


def _evaluate_in_the_bucket(config, workdir: str, step: int) -> None:
  """realm-eval of a bucket run: metrics and predictions written back to the bucket."""
  config.qa.test = "prepared:eval"
  metrics, out_dir = evaluate_run(config, workdir, split="test")
  assert out_dir == f"{workdir}/eval/{step}/test-retrieval"
  saved = json.loads(bucket_text(f"{out_dir}/metrics.json"))
  assert saved["step"] == step and saved["recall_at_5"] == metrics["recall_at_5"]
  predictions = bucket_text(f"{out_dir}/predictions.jsonl").splitlines()
  assert len(predictions) == saved["num_questions"] > 0
  assert not os.path.exists("gs:")


@pytest.mark.slow
def test_an_unreadable_checkpoint_in_the_bucket_is_moved_aside_and_the_run_resumes(
    gcs, world_dir, capsys):
  """A bucket has no folders to rename: the damaged latest checkpoint's objects are moved
  under unreadable_checkpoints/ and the run resumes from the one before it."""
  import fsspec
  workdir = f"{gcs}/damaged"
  config = tiny_config("ict", None, world_dir, train__steps=4, train__checkpoint_every=2)
  assert train(config, workdir)["steps"] == 4
  fs, _ = fsspec.core.url_to_fs(workdir)
  arrays = [o for o in fs.find(f"{workdir}/checkpoints/4/params") if "ocdbt.process" in o]
  assert arrays
  for name in arrays:                 # an upload that stopped half way
    fs.rm(name)
  epath.Path(f"{workdir}/summary.json").unlink()
  # and a later save cut off before Orbax's commit marker: not a checkpoint (it used to be
  # counted as step 6, so the resume with train.steps=4 was refused as going back)
  epath.Path(f"{workdir}/checkpoints/6/params").mkdir(parents=True, exist_ok=True)
  (epath.Path(f"{workdir}/checkpoints/6/params") / "cut_off").write_text("x")
  assert workdir_lib.latest_checkpoint_step(workdir) == 4
  aside = f"{workdir}/{workdir_lib.UNREADABLE_CHECKPOINTS}"
  (epath.Path(aside) / "4").mkdir(parents=True, exist_ok=True)   # step 4 failed once before
  (epath.Path(aside) / "4" / "earlier").write_text("x")
  capsys.readouterr()
  assert train(config, workdir)["steps"] == 4
  out = capsys.readouterr().out
  assert "checkpoints/4 cannot be restored" in out and "moved the unreadable checkpoint 4" in out
  assert fs.exists(f"{aside}/4.2/params") and fs.exists(f"{aside}/4/earlier")   # both kept
  assert paths.isdir(f"{workdir}/checkpoints/4")   # trained and saved again


def test_a_bucket_log_sends_only_its_new_lines_and_appends_each_once(gcs, monkeypatch,
                                                                       caplog):
  """A bucket log's append sends its new lines only (composed onto the object by the server;
  it was rewritten whole, so a run's bytes sent grew with the square of its steps). A compose
  done whose answer was lost is refused on its retry (412, the generation it named is gone):
  the lines are there once. A bucket that refuses compose gets the object rewritten whole."""
  import fsspec
  url = f"{gcs}/appends/metrics/train.jsonl"
  monkeypatch.setattr(paths, "_NOT_COMPOSED", set())
  gpath = type(epath.Path(url))
  sent, write_text = [], gpath.write_text
  monkeypatch.setattr(gpath, "write_text", lambda self, text, **kw: (
      sent.append(len(text)), write_text(self, text, **kw))[1])
  log = paths.AppendLog(url)
  lines = [json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in range(1, 41)]
  for line in lines:
    log.write(line)
  assert bucket_text(url) == "".join(lines)
  assert sent == [len(line) for line in lines]   # each line once, nothing sent again
  assert not paths.exists(f"{url}.append")         # the part is deleted after its compose

  fs = type(fsspec.core.url_to_fs(url)[0])
  call = fs.call

  def answer_lost(self, method, path, *args, **kwargs):   # the compose done, its retry refused
    answer = call(self, method, path, *args, **kwargs)
    if path.endswith("/compose"):
      raise FileExistsError(path)
    return answer

  monkeypatch.setattr(fs, "call", answer_lost)
  log.write("lost\n")
  monkeypatch.setattr(fs, "call", call)
  log.write("after\n")
  assert bucket_text(url) == "".join(lines) + "lost\nafter\n"

  def no_compose(self, method, path, *args, **kwargs):
    if path.endswith("/compose"):
      raise ValueError("Bad Request: compose is not supported for this bucket (invalid)")
    return call(self, method, path, *args, **kwargs)

  monkeypatch.setattr(fs, "call", no_compose)
  sent.clear()
  with caplog.at_level("WARNING", logger="realm_jax.paths"):
    log.write("whole\n")
    log.write("again\n")
    log.close()
  assert bucket_text(url) == "".join(lines) + "lost\nafter\nwhole\nagain\n"
  assert caplog.text.count("the bucket does not compose objects (ValueError") == 1
  assert sent[2:] == [len(bucket_text(url))]   # (part, whole), then whole: no compose tried



@pytest.mark.parametrize("done", [True, False], ids=["compose-done", "compose-not-done"])
def test_a_send_that_failed_after_the_bucket_took_it_is_not_lost_or_doubled(gcs, monkeypatch,
                                                                              done):
  """A send that gave up (the server stopped answering past the patience) may have been done
  all the same, its answer lost. The builder goes on after such a failure, its line kept for
  the next write: that send names the generation the failed one appended to, which GCS
  refuses (412) where the failed compose was done. The lines of the failed send are then
  there once, and the next line too; where it was not done, both are sent. (The server
  ignores ifGenerationMatch on compose: the wrapper refuses a stale one, as GCS does.)"""
  import fsspec
  url = f"{gcs}/appends/{'done' if done else 'not-done'}/index.jsonl"
  monkeypatch.setenv(paths.PATIENCE_ENV, "0")   # a server that does not answer: given up at once
  fs = type(fsspec.core.url_to_fs(url)[0])
  call, down = fs.call, [False]

  def like_gcs(self, method, path, *args, **kwargs):
    if path.endswith("/compose"):
      named = kwargs.get("ifGenerationMatch")
      if named is not None and paths.object_generation(url) != str(named):
        raise FileExistsError(path)
      if down[0] and not done:
        raise ConnectionError("the compose's request was cut")
    answer = call(self, method, path, *args, **kwargs)
    if path.endswith("/compose") and down[0]:
      raise ConnectionError("the compose's answer was cut")
    return answer

  monkeypatch.setattr(fs, "call", like_gcs)
  log = paths.AppendLog(url)
  log.write("1\n")
  log.write("2\n")
  down[0] = True
  with pytest.raises(StorageUnreachable):
    log.write("3\n")
  assert bucket_text(url) == ("1\n2\n3\n" if done else "1\n2\n")
  down[0] = False
  log.write("4\n")
  log.close()
  assert bucket_text(url) == "1\n2\n3\n4\n"



def test_a_log_rewritten_whole_is_not_doubled_by_a_retry_whose_answer_was_lost(gcs,
                                                                               monkeypatch):
  """In a bucket that refuses compose a log's append rewrites it whole: the object read, the
  lines added. A rewrite done whose answer was lost is tried again: it read the object with
  the lines in it and added them again. The object past the generation the append read
  before is the rewrite done."""
  import fsspec
  url = f"{gcs}/appends/whole/retrieval.jsonl"
  fs = type(fsspec.core.url_to_fs(url)[0])
  call = fs.call
  monkeypatch.setattr(fs, "call", lambda self, method, path, *args, **kwargs: (
      (_ for _ in ()).throw(ValueError("Bad Request: compose (invalid)"))
      if path.endswith("/compose") else call(self, method, path, *args, **kwargs)))
  gpath = type(epath.Path(url))
  write_text, lost = gpath.write_text, ["2\n"]

  def answer_lost(self, text, **kwargs):
    write_text(self, text, **kwargs)
    if str(self) == url and lost and text.endswith(lost[0]):
      lost.clear()
      raise ConnectionError("the rewrite's answer was cut")

  monkeypatch.setattr(gpath, "write_text", answer_lost)
  log = paths.AppendLog(url)
  log.write("1\n")
  log.write("2\n")   # refused compose: rewritten whole; its answer lost, tried again
  log.write("3\n")
  log.close()
  assert not lost
  assert bucket_text(url) == "1\n2\n3\n"


def test_the_slow_link_holds_only_uploads_of_the_named_objects(server):
  """The fault layer of the test above: through the relay, an upload naming a held object
  takes the hold; another passes at once; both land in the server."""
  slow = gcs_server.SlowLink(server, ["/held/"], seconds=1.0)
  try:
    took = {}
    for name in ("link/held/a", "link/free/b"):
      url = (f"{slow.url}/upload/storage/v1/b/{gcs_server.BUCKET}/o?uploadType=media&"
             f"name={urllib.parse.quote(name, safe='')}")
      start = time.monotonic()
      with urllib.request.urlopen(urllib.request.Request(url, data=name.encode())) as answer:
        assert answer.status == 200
      took[name] = time.monotonic() - start
  finally:
    slow.close()
  assert took["link/held/a"] >= 1.0 and took["link/free/b"] < 0.5, took
  assert bucket_text(f"gs://{gcs_server.BUCKET}/link/held/a") == "link/held/a"


def test_one_bucket_path_however_spelt_has_one_local_side(monkeypatch, tmp_path):
  """`gs://B/run/` names the objects `gs://B/run` does (as do `gs://B//run`, `gs://B/./run`):
  so does its local side (before: a resume spelt with a trailing slash wrote its TensorBoard
  events and logs to another local dir, and a data dir was copied, or a rerun of
  realm-prepare prepared it, again from nothing)."""
  monkeypatch.setenv("REALM_JAX_CACHE", str(tmp_path))
  for spelt in ("gs://bucket/run/", "gs://bucket//run", "gs://bucket/./run//"):
    assert paths.join(spelt, "tb") == "gs://bucket/run/tb"
    assert paths.local_side(spelt, "tb") == paths.local_side("gs://bucket/run", "tb")
    assert paths.cache_dir(spelt) == paths.cache_dir("gs://bucket/run")
  assert paths.cache_dir("gs://bucket/run") != paths.cache_dir("gs://bucket/run2")
  assert paths.local_side(str(tmp_path / "w") + "/", "tb") == str(tmp_path / "w" / "tb")


def test_a_bucket_data_dir_prepared_with_other_settings_is_refused(gcs, capsys):
  """A data dir in a bucket is refused to a preparation with other settings, as a local one
  is (before: "is already prepared and uploaded", and the other settings' data returned)."""
  config = helpers.load_config_module("prepare").get_config("world")
  config.source, config.out_dir = "world:40", f"{gcs}/data-settings"
  config.vocab_size, config.num_workers = helpers.VOCAB_SIZE, 0
  stats = prepare(config)
  manifest = json.loads(bucket_text(f"{config.out_dir}/{paths.FILES_MANIFEST}"))
  assert "stats.json" in manifest["files"]
  assert "prepare.lock" not in manifest["files"]   # the local copy's lock, this host's alone
  assert prepare(config) == stats   # the same settings: the finished one, as it is
  config.source = "world:80"
  with pytest.raises(ConfigError, match=re.escape(
      f"out_dir: {gcs}/data-settings holds a preparation with other settings (source: "
      "'world:40' (in ")):
    prepare(config)
  assert capsys.readouterr().out.count("is already prepared and uploaded") == 1


def test_a_vocab_in_the_bucket_is_copied_by_realm_prepare(gcs, world_dir, tmp_path):
  """`realm-prepare --config.vocab=gs://B/W`, the command a run's vocab check advises for a
  bucket run (`hf_bert.check_vocab`), and a checkpoint dir in a bucket (as launch.md's
  init.reader=gs://B/bert-base-uncased) copy its vocab.txt, and refuse a cased one (before:
  "config.vocab: 'gs://B/W' does not exist")."""
  from realm_jax.interop import hf_bert
  vocab = open(os.path.join(world_dir, "vocab.txt")).read()
  run = f"{gcs}/vocab-run"
  paths.write_text_atomic(f"{run}/vocab.txt", vocab)
  swapped = helpers.swapped_vocab_copy(world_dir, tmp_path / "swapped")
  with pytest.raises(ConfigError, match=re.escape(f"realm-prepare --config.vocab={run}")):
    hf_bert.check_vocab(str(swapped / "vocab.txt"), run)
  config = helpers.load_config_module("prepare").get_config("world")
  config.source, config.num_workers = "world:20", 0
  for given in (run, f"{run}/vocab.txt"):
    config.vocab, config.out_dir = given, str(tmp_path / given.rsplit("/", 1)[1])
    prepare(config)
    assert open(os.path.join(config.out_dir, "vocab.txt")).read() == vocab
  cased = f"{gcs}/vocab-cased"
  paths.write_text_atomic(f"{cased}/vocab.txt", vocab)
  paths.write_text_atomic(f"{cased}/tokenizer_config.json", '{"do_lower_case": false}')
  config.vocab, config.out_dir = cased, str(tmp_path / "cased")
  with pytest.raises(ConfigError, match="is a cased checkpoint"):
    prepare(config)
  config.vocab = f"{gcs}/vocab-none"
  with pytest.raises(ConfigError, match="config.vocab: 'gs://.*/vocab-none' does not exist"):
    prepare(config)
  # a vocab refused is named by its file in the bucket, not by the temp copy read here
  repeated = f"{gcs}/vocab-repeated"
  paths.write_text_atomic(f"{repeated}/vocab.txt", vocab + "the\n")
  config.vocab, config.out_dir = repeated, str(tmp_path / "repeated")
  with pytest.raises(ConfigError, match=re.escape(
      f"config.vocab: {repeated}/vocab.txt: line ")):
    prepare(config)


def test_a_bucket_data_dir_removed_is_prepared_again_with_other_settings(gcs, capsys):
  """The local dir a bucket out_dir is prepared in (its copy on this host) keeps the finished
  preparation after the data dir is removed from the bucket; a preparation of other settings
  into the now empty gs://B/D is no preparation of other settings (before: refused as one,
  naming the cache dir as `out_dir`)."""
  config = helpers.load_config_module("prepare").get_config("world")
  config.source, config.out_dir = "world:40", f"{gcs}/prepared-again-other"
  config.vocab_size, config.num_workers = helpers.VOCAB_SIZE, 0
  assert prepare(config)["documents"] == 160
  epath.Path(config.out_dir).rmtree()
  config.source = "world:50"
  assert prepare(config)["documents"] == 200
  assert json.loads(bucket_text(f"{config.out_dir}/stats.json"))["documents"] == 200
  local = workdir_lib.open_data(ml_collections.ConfigDict({"data": {"dir": config.out_dir}}))
  assert local.stats["documents"] == 200
  assert "no longer in the bucket: prepared again" in capsys.readouterr().out


def test_a_bucket_preparation_whose_upload_did_not_finish_is_kept_from_other_settings(
    gcs, monkeypatch):
  """A preparation whose upload was cut short (or still runs) left no files.json in the bucket
  either, but its local dir is the only copy of it: a preparation of other settings into
  gs://B/D is refused, as before, not let remove it (it was removed, and hours of preparing
  with it, or the upload under way failed on its files gone)."""
  config = helpers.load_config_module("prepare").get_config("world")
  config.source, config.out_dir = "world:40", f"{gcs}/upload-cut-short"
  config.vocab_size, config.num_workers = helpers.VOCAB_SIZE, 0

  def cut_short(*args, **kwargs):
    raise OSError("the connection went")
  with monkeypatch.context() as m:
    m.setattr(paths, "upload_tree", cut_short)
    with pytest.raises(OSError, match="the connection went"):
      prepare(config)
  local = paths.cache_dir(config.out_dir)
  config.source = "world:50"
  with pytest.raises(ConfigError, match=r"holds a preparation with other settings \(source: "
                     r"'world:40'"):
    prepare(config)
  assert json.loads(open(os.path.join(local, "stats.json")).read())["documents"] == 160
  config.source = "world:40"   # the same settings: the finished preparation, uploaded
  assert prepare(config)["documents"] == 160
  assert json.loads(bucket_text(f"{config.out_dir}/stats.json"))["documents"] == 160


def test_a_data_dir_prepared_here_then_elsewhere_without_a_file_loses_it_here(gcs, tmp_path):
  """realm-prepare --out gs://B/D prepares in the local dir its copy is read from on this
  host. Prepared again elsewhere into gs://B/D without a file this one has (a corpus without
  questions: no qa/eval.jsonl), the copy here loses it, as a copied one does (before: the
  preparation's own dir named no finished copy, so nothing went, and `prepared:eval` read
  the questions of the earlier data silently)."""
  from realm_jax.data.qa import read_qa
  config = helpers.load_config_module("prepare").get_config("world")
  config.source, config.out_dir = "world:40", f"{gcs}/prepared-here"
  config.vocab_size, config.num_workers = helpers.VOCAB_SIZE, 0
  prepare(config)
  assert os.path.exists(os.path.join(paths.cache_dir(config.out_dir), "qa", "eval.jsonl"))
  epath.Path(config.out_dir).rmtree()   # another host's preparation: no questions
  elsewhere = tmp_path / "elsewhere"
  (elsewhere / "blocks").mkdir(parents=True)
  for name in ("vocab.txt", "stats.json", "blocks/tokens.npy"):
    (elsewhere / name).write_text(name)
  paths.upload_tree(str(elsewhere), config.out_dir, log=lambda line: None)
  local = paths.local_copy(config.out_dir, log=lambda line: None)
  assert not os.path.exists(os.path.join(local, "qa", "eval.jsonl"))
  assert open(os.path.join(local, "stats.json")).read() == "stats.json"
  with pytest.raises(ConfigError, match="no such file"):
    read_qa("prepared:eval", data_dir=config.out_dir)


def test_a_mirrored_dir_whose_object_is_replaced_by_one_of_its_size_is_copied_again(gcs):
  """A Hugging Face dir in the bucket is copied once and reused while its listing is the
  same; an object written again (weights fine-tuned since: the same shapes, the same bytes)
  has a new generation, and its new content is copied (before: the old copy was kept, its
  size being the one listed, and the stamp said the new listing)."""
  url = f"{gcs}/mirrored/bert"
  epath.Path(f"{url}/model.safetensors").write_text("weights-1")
  epath.Path(f"{url}/config.json").write_text("{}")
  lines = []
  local = paths.local_mirror(url, log=lines.append)
  assert open(os.path.join(local, "model.safetensors")).read() == "weights-1" and len(lines) == 3
  assert paths.local_mirror(url, log=lines.append) == local and len(lines) == 3   # reused
  epath.Path(f"{url}/model.safetensors").write_text("weights-2")
  assert paths.local_mirror(url, log=lines.append) == local
  assert open(os.path.join(local, "model.safetensors")).read() == "weights-2"
  assert len(lines) == 5 and "model.safetensors" in lines[-1]   # config.json kept
  assert lines[-2].startswith("copying 1 of 2 files (9 bytes)"), lines


def test_a_file_gone_from_a_bucket_dir_is_gone_from_its_local_copy(gcs, tmp_path):
  """A bucket dir written again without a file the copy has (a Hugging Face dir whose
  model.safetensors was replaced by a pytorch_model.bin; a data dir prepared again without
  target spans): the copy loses it too (before: the readers, which look for such files,
  took the old one, as model.safetensors is read before pytorch_model.bin)."""
  url = f"{gcs}/mirrored/replaced"
  epath.Path(f"{url}/model.safetensors").write_text("old weights")
  local = paths.local_mirror(url, log=lambda line: None)
  with open(os.path.join(local, "not-copied"), "w") as f:   # no copy's: left alone
    f.write("")
  epath.Path(f"{url}/model.safetensors").unlink()
  epath.Path(f"{url}/pytorch_model.bin").write_text("new weights")
  assert paths.local_mirror(url, log=lambda line: None) == local
  assert sorted(os.listdir(local)) == [".copied.json", "not-copied", "pytorch_model.bin"]
  data = tmp_path / "data"
  (data / "examples" / "eval").mkdir(parents=True)
  for name in ("vocab.txt", "examples/eval/tokens.npy", "examples/eval/target_span.npy"):
    (data / name).write_text(name)
  url = f"{gcs}/prepared-again"
  paths.upload_tree(str(data), url, log=lambda line: None)
  local = paths.local_copy(url, log=lambda line: None)
  assert os.path.exists(os.path.join(local, "examples", "eval", "target_span.npy"))
  epath.Path(url).rmtree()
  (data / "examples" / "eval" / "target_span.npy").unlink()
  paths.upload_tree(str(data), url, log=lambda line: None)
  assert paths.local_copy(url, log=lambda line: None) == local
  assert not os.path.exists(os.path.join(local, "examples", "eval", "target_span.npy"))
  assert open(os.path.join(local, "examples", "eval", "tokens.npy")).read() == \
      "examples/eval/tokens.npy"


def test_a_hugging_face_dir_in_the_bucket_starts_the_towers(gcs, world_dir, tmp_path, capsys):
  from realm_jax.train.loop import Trainer
  from tests.test_hf_bert import world_checkpoint
  local, weights = world_checkpoint(world_dir, tmp_path / "hf")
  url = f"{gcs}/hf/bert"
  for name in os.listdir(local):   # as `gsutil cp -r` leaves it: plain objects, no files.json
    epath.Path(os.path.join(local, name)).copy(epath.Path(f"{url}/{name}"))
  config = tiny_config("realm", None, world_dir, init__hf_bert=url)
  trainer = Trainer(config, str(tmp_path / "work"))
  assert trainer.restore_or_init()[0] == 0
  out = capsys.readouterr().out
  assert f"[init] copied 1/{len(os.listdir(local))}: {url}/" in out
  assert f"init.hf_bert={url}" in out
  np.testing.assert_array_equal(
      trainer.state.params["reader"]["bert"]["embeddings"]["word_embeddings"]["embedding"],
      weights["embeddings.word_embeddings.weight"])


@pytest.mark.slow
def test_an_open_qa_checkpoint_imported_into_the_bucket_is_a_workdir_there(gcs, tmp_path):
  from realm_jax.interop import hf_realm
  from tests import test_hf_realm as hf
  tensors = hf.to_hf(hf.random_params("RealmForOpenQA", seed=1), "RealmForOpenQA")
  records, tensors["block_emb"] = hf.records_and_emb(np.random.default_rng(2))
  tensors["embedder.cls.predictions.bias"] = np.zeros(len(hf.VOCAB), np.float32)
  hf_dir = hf.write_realm_checkpoint(tmp_path / "hf", "RealmForOpenQA", tensors, records)
  url = f"{gcs}/imported/openqa"
  hf_realm.import_checkpoint(hf_dir, url)
  config = workdir_lib.saved_config(url)
  assert config.data.dir == f"{url}/data"
  assert paths.exists(f"{url}/data/{paths.FILES_MANIFEST}")   # a data dir like realm-prepare's
  data = workdir_lib.open_data(config)
  root = published.index_root(url)
  published.verify(root, published.read_latest(root), fingerprint=data.blocks.fingerprint,
                   dim=hf.SIZES["retriever_proj_size"])
  _, _, params, step = hf.restore(url)   # Orbax reads the uploaded checkpoint in the bucket
  assert step == 0
  np.testing.assert_array_equal(
      params["retriever"]["query_tower"]["projection"]["kernel"],
      tensors["embedder.cls.dense.weight"].T)
  with pytest.raises(ConfigError, match="is not empty"):
    hf_realm.import_checkpoint(hf_dir, url)


def test_a_scann_version_built_in_the_bucket_holds_its_searcher_and_is_served(
    gcs, world_dir, tmp_path, monkeypatch):
  """`retrieval.backend=scann` in a bucket workdir: the searcher ScaNN serializes (local files
  only) is uploaded into the version's scann/ (before: it went to a local dir `gs:` under the
  working directory, the version's manifest named no scann/ file, and the trainer's load of
  it failed on the missing folder)."""
  from tests.test_index_builder import builder_config, build_once, loader_for, \
      make_checkpoints
  monkeypatch.chdir(tmp_path)
  config = builder_config(world_dir, retrieval__backend="scann")
  workdir = f"{gcs}/scann"
  _, model, _, data = make_checkpoints(config, workdir, (0,))
  assert build_once(config, workdir) == 1
  assert os.listdir(tmp_path) == []
  manifest = published.verify(published.index_root(workdir), 1,
                              fingerprint=data.blocks.fingerprint,
                              dim=config.model.retrieval_dim)
  assert any(name.startswith("scann/") for name in manifest["files"]), manifest["files"]
  loaded = loader_for(config, workdir, model, data)(1)
  embeddings = np.asarray(loaded.embeddings)
  scores = embeddings[:4] @ embeddings.T   # the best block's score: exact (brute force here)
  best = loaded.index.search(embeddings[:4], 3)[:, 0]
  np.testing.assert_allclose(scores[np.arange(4), best], scores.max(axis=1), rtol=1e-5)
  assert type(loaded.index).__name__ == "ScannIndex"


def test_both_parts_of_one_bucket_workdir_however_spelt_start_from_one_step(gcs, world_dir,
                                                                             monkeypatch):
  """init.retriever and init.reader naming one bucket workdir, spelt gs://B/W and gs://B//W
  (or /gcs/B/W, its gcsfuse path): its "latest" is read once, so a source run that saves a
  new step between the two reads gives both parts the same step (before: two sources, the
  reader at the newer step)."""
  from realm_jax.runtime import initialization
  run = f"{gcs}/one-source/ict"
  paths.write_text_atomic(f"{run}/checkpoints/0/{workdir_lib.FINISHED_IN_A_BUCKET}", "")
  latest = iter([0, 5])   # the source saves step 5 after the first part's read

  def from_workdir(config, src, initial, abstract, data_vocab):
    step = next(latest) if src.step < 0 else src.step
    return src.path, [f"{src.part} <- {src.path} step {step}"], step
  monkeypatch.setattr(initialization, "_from_workdir", from_workdir)
  for other in (f"gs://{gcs_server.BUCKET}//one-source/ict/",
                f"{paths.MOUNT_ROOT}/{gcs_server.BUCKET}/one-source/ict"):
    latest = iter([0, 5])
    config = tiny_config("realm", None, world_dir, init__retriever=run, init__reader=other)
    if other.startswith(paths.MOUNT_ROOT):   # (not mounted here: read as gs://B/W)
      monkeypatch.setattr(initialization, "resolve", lambda spec, option, part, step=-1: (
          initialization.Source(part, option, "workdir", spec, step)))
    started = initialization.start_params(config, None, dict.fromkeys(("retriever", "reader")),
                                          {}, "", 0)
    assert started.steps == {"retriever": 0, "reader": 0}, (other, started.lines)


def test_a_sweep_rooted_in_the_bucket_reads_summaries_and_writes_its_tables_there(gcs):
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "_test_sweep_gcs", os.path.join(helpers.REPO, "launch", "sweep.py"))
  sweep = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(sweep)
  root = f"{gcs}/sweep"
  runs = [("lr-0.001", {"train.lr": 1e-3}), ("lr-0.003", {"train.lr": 3e-3})]
  workdir_lib.write_summary(f"{root}/lr-0.003", {"steps": 4, "eval_recall_at_5": 0.5})
  rows = sweep.collect(root, runs, "eval_recall_at_5", True, {})
  assert [(r["run"], r["status"]) for r in rows] == [("lr-0.003", "done"), ("lr-0.001", "missing")]
  csv_path, md_path = sweep.write_tables(root, rows, "eval_recall_at_5")
  assert (csv_path, md_path) == (f"{root}/results.csv", f"{root}/results.md")
  assert bucket_text(csv_path).splitlines()[1].startswith("lr-0.003,0.003,done,4,0.5")
  assert "| lr-0.003 |" in bucket_text(md_path)
  assert not os.path.exists("gs:")


def test_a_trace_of_a_bucket_runs_steps_goes_to_the_bucket_whole(gcs, caplog):
  """`train.profile_first_step` in a bucket workdir: the trace is written locally, where the
  TensorBoard events are, and uploaded to W/tb/profile once it is whole."""
  import jax
  import jax.numpy as jnp
  from realm_jax.runtime.profiling import StepTrace
  workdir = f"{gcs}/traced"
  config = ml_collections.ConfigDict({"profile_first_step": 1, "profile_steps": 1})
  trace = StepTrace(config, workdir, 0, 4)
  with caplog.at_level("INFO"):
    trace.before(1)
    trace.after(1, jax.jit(lambda x: x @ x)(jnp.ones((8, 8))))
  sessions = paths.names(f"{workdir}/tb/profile/plugins/profile")
  assert len(sessions) == 1
  uploaded = paths.names(f"{workdir}/tb/profile/plugins/profile/{sessions[0]}")
  assert any(n.endswith(".xplane.pb") for n in uploaded), uploaded
  assert f"written to {workdir}/tb/profile/plugins/profile/{sessions[0]} (tensorboard " \
      f"--logdir {workdir}/tb" in caplog.text
  assert paths.local_side(workdir, "tb").startswith(os.environ["REALM_JAX_CACHE"])


@pytest.mark.parametrize("url, message", [
    ("GS://bucket/run", "a URL's scheme is written in lowercase (gs://...)"),
    ("gs://bucket/run#2", "'#' and '?' cannot be in a bucket path"),     # TensorStore would
    ("gs://bucket/run?a", "'#' and '?' cannot be in a bucket path"),     # write under run/
    ("gs://", "not a bucket name after gs://"),           # was the bucket "checkpoints"
    ("gs:///run", "not a bucket name after gs://"),       # was the bucket "run"
    ("gs://Bad_Bucket!/run", "not a bucket name after gs://"),
    ("gcs://bucket/run", "write the bucket as gs://bucket/run"),   # gcsfs's other spelling:
                                                          # Orbax's markers, TensorStore: gs://
    ("s3://bucket/run", "s3:// is not supported"),        # was "Install s3fs"
    ("memory://run", "memory:// is not supported"),       # a workdir gone with the process
])
def test_urls_that_would_go_elsewhere_are_refused_naming_the_flag(world_dir, tmp_path, url,
                                                                 message, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=re.escape(f"--workdir '{url}': {message}")):
    train(tiny_config("ict", None, world_dir), url)
  assert os.listdir(tmp_path) == []
  assert paths.check("gs://bucket/a b%20c", "x") == "gs://bucket/a b%20c"   # these are fine


@pytest.mark.parametrize("name", ["run[1]", "lr-*"])
def test_a_bucket_path_that_gcsfs_reads_as_a_pattern_is_refused(gcs, world_dir, tmp_path, name,
                                                                monkeypatch):
  """gcsfs reads '*' and '[' in a path as a glob: a removal or move there (the builder's prune
  of old index versions, an unreadable checkpoint moved aside, Orbax's deletion of old
  checkpoints) takes whatever objects match (before: pruning gs://B/run[1]/index/00000001
  deleted gs://B/run1/index/00000001, another run's version, and left its own). A workdir,
  data dir or out_dir of such a name is refused naming the option, before anything is
  written."""
  monkeypatch.chdir(tmp_path)
  base = f"{gcs}/patterns-{len(name)}"
  other = f"{base}/{name.replace('[', '').replace(']', '').replace('*', 'x')}"
  workdir_lib.mark_done(other, 4)   # a run the pattern would match
  with pytest.raises(ConfigError, match=re.escape(
      f"--workdir '{base}/{name}': '*' and '[' cannot be in a bucket path")):
    train(tiny_config("ict", None, world_dir), f"{base}/{name}")
  with pytest.raises(ConfigError, match=re.escape("config.data.dir: data.dir")):
    train(tiny_config("ict", None, f"{base}/{name}"), str(tmp_path / "w"))
  assert workdir_lib.done_step(other) == 4
  assert paths.names(base) == [other.rsplit("/", 1)[1]]
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["ten minutes", "nan", "-5"])
def test_a_bad_storage_patience_is_refused_with_the_bucket_path(world_dir, tmp_path, value,
                                                                monkeypatch):
  """$REALM_JAX_STORAGE_PATIENCE is read at the first storage failure, maybe hours in (a
  ValueError traceback there, or a patience of NaN that never retries): a job given a bucket
  path refuses it at start, in one line naming the variable; a local job does not read it."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv(paths.PATIENCE_ENV, value)
  refused = re.escape(f"${paths.PATIENCE_ENV}={value!r}: not a number of seconds >= 0")
  with pytest.raises(ConfigError, match=refused):
    paths.check("gs://bucket/run", "--workdir")
  with pytest.raises(ConfigError, match=refused):   # before anything is read or written
    train(tiny_config("ict", None, world_dir), "gs://bucket/run")
  assert os.listdir(tmp_path) == []
  assert paths.check(str(tmp_path / "w")) == str(tmp_path / "w")


@pytest.mark.parametrize("field", ["workdir", "data.dir", "out_dir"])
def test_a_malformed_url_is_refused_not_made_a_local_dir(world_dir, tmp_path, field,
                                                         monkeypatch):
  monkeypatch.chdir(tmp_path)
  bad = "gs:/bucket/run"
  with pytest.raises(ConfigError, match="not a URL"):
    if field == "out_dir":
      config = helpers.load_config_module("prepare").get_config("world")
      config.source, config.out_dir = "world:10", bad
      prepare(config)
    elif field == "data.dir":
      train(tiny_config("ict", None, bad), str(tmp_path / "w"))
    else:
      train(tiny_config("ict", None, world_dir), bad)
  assert os.listdir(tmp_path) == [] or "gs:" not in os.listdir(tmp_path)


def test_a_copy_killed_midway_leaves_no_partial_file_in_the_cache(gcs, tmp_path):
  """A copy of a bucket data dir killed while a file came (its `<name>.tmp-<pid>`, up to the
  file's size) is removed by the next copy; a copy of a live process is left to it (before:
  each kill left its partial file in the cache for good)."""
  data = tmp_path / "data"
  data.mkdir()
  (data / "tokens.npy").write_text("tokens")
  url = f"{gcs}/killed-copy"
  paths.upload_tree(str(data), url, log=lambda line: None)
  local = paths.cache_dir(url)
  os.makedirs(local)
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True).stdout.strip()
  for pid in (dead, os.getppid()):   # (the parent: another live process of this host)
    with open(os.path.join(local, f"tokens.npy.tmp-{pid}"), "w") as f:
      f.write("tok")
  assert paths.local_copy(url, log=lambda line: None) == local
  assert sorted(os.listdir(local)) == [".copied.json", "tokens.npy",
                                       f"tokens.npy.tmp-{os.getppid()}"]


def test_an_upload_and_a_copy_say_their_size_first_and_their_rate_and_eta(gcs, tmp_path):
  """A data dir's tokens.npy is 15 GB at REALM's size: an upload or a copy says what it moves
  before its first file (before: the first line came after that file), then after each file
  the MB/s so far and an ETA by the bytes left."""
  data = tmp_path / "data"
  data.mkdir()
  (data / "a.npy").write_bytes(b"x" * 3000)
  (data / "b.npy").write_bytes(b"y" * 1000)
  url, said = f"{gcs}/said-transfer", []
  paths.upload_tree(str(data), url, log=said.append)
  assert said[0] == f"uploading 2 files (4,000 bytes) to {url}", said
  assert re.search(r"^uploaded 1/2: .*a\.npy \(3,000 bytes\) \| [\d,.]+ MB/s ETA \d+s$",
                   said[1]), said
  said.clear()
  local = paths.local_copy(url, log=said.append)
  assert said[0] == f"copying 2 of 2 files (4,000 bytes) of {url} into {local}", said
  assert re.search(r"^copied 2/2: .*b\.npy .*verified\) \| [\d,.]+ MB/s ETA 0s$", said[2]), said

"""A bucket that stops answering (tests/gcs_server.py goes down): retried with backoff and
said, then a clear failure naming the object after $REALM_JAX_STORAGE_PATIENCE, with nothing
partial visible. gcsfs's own backoff between its 6 attempts (~1 + 2 + 4 + 8 + 16 s) runs at
a tenth of its length here: what is under test is what this package says and decides around
those attempts, not their spacing."""

import asyncio
import logging

import pytest

from realm_jax import paths
from realm_jax.errors import IndexWaitTimeout, StorageUnreachable


class _TenthOfTheBackoff:
  """asyncio as gcsfs.retry sees it, with its backoff sleeps a tenth as long."""

  def __getattr__(self, name):
    return getattr(asyncio, name)

  @staticmethod
  async def sleep(seconds):
    await asyncio.sleep(seconds / 10)


@pytest.mark.slow
def test_an_unreachable_bucket_is_retried_then_a_clear_failure_with_nothing_partial(
    server, gcs, capsys, monkeypatch):
  import gcsfs.retry
  monkeypatch.setattr(gcsfs.retry, "asyncio", _TenthOfTheBackoff())
  record = f"{gcs}/outage/record.json"
  paths.write_json(record, {"try": 1})
  monkeypatch.setenv(paths.PATIENCE_ENV, "60")
  said = next(h for h in logging.getLogger("gcsfs").handlers if hasattr(h, "unsaid"))
  monkeypatch.setattr(said, "last", 0.0)   # no retry line said just before (one per 5 s)
  comes_back = server.down_for(2.0)   # refused for 2 s: the write waits it out, and says so
  paths.write_json(record, {"try": 2})
  comes_back.join(timeout=30)
  assert not comes_back.is_alive(), "the server did not come back"
  assert "[storage] a request to the bucket failed (Cannot connect" in capsys.readouterr().out
  assert paths.read_json(record) == {"try": 2}

  # Down for good: after the patience, an error naming the object, whose old content stays
  # (an object is written in one request: there whole or not at all).
  monkeypatch.setenv(paths.PATIENCE_ENV, "1")
  server.go_down()
  try:
    with pytest.raises(StorageUnreachable, match=r"outage/record.json: writing failed, the "
                       r"storage server did not answer .*REALM_JAX_STORAGE_PATIENCE=1s"):
      paths.write_json(record, {"try": 3})
  finally:
    server.come_back()
  assert "[storage] gcsfs gave up on a request" in capsys.readouterr().out
  assert paths.read_json(record) == {"try": 2}


def test_only_a_server_that_did_not_answer_is_worth_retrying():
  """A timeout or a refused connection is retried; a wait that already ran out its own
  patience (StorageUnreachable, IndexWaitTimeout: both OS errors) or an absent file is not."""
  assert paths.unreachable(TimeoutError("read timed out"))
  assert paths.unreachable(ConnectionRefusedError("refused"))
  wrapped = RuntimeError("reading failed")
  wrapped.__cause__ = TimeoutError("read timed out")
  assert paths.unreachable(wrapped)
  assert not paths.unreachable(IndexWaitTimeout("no published index after 1800s"))
  assert not paths.unreachable(StorageUnreachable("gave up after 600s"))
  assert not paths.unreachable(FileNotFoundError("gs://b/x"))
  calls = []

  def wait():
    calls.append(1)
    raise IndexWaitTimeout("no published index after 1800s")
  with pytest.raises(IndexWaitTimeout):
    paths.retried("waiting", "gs://bucket/run/index", wait)
  assert len(calls) == 1


def test_a_line_a_bucket_did_not_take_is_written_when_the_log_closes(monkeypatch, caplog):
  """An AppendLog in a bucket whose rewrite gave up (the bucket did not answer, as the
  builder's index.jsonl line after the version is out) keeps the line for its next write: on
  close it is written then (the last version's line was lost for good); a bucket still down
  then is a warning, not an error at the job's end."""
  objects, down = {}, [False]

  def append(url, text, generation):
    if down[0]:
      raise StorageUnreachable(f"{url}: appending to failed, the storage server did not "
                               "answer")
    objects[url] = objects.get(url, "") + text
    return ""

  monkeypatch.setattr(paths, "read_text", lambda path: objects.get(str(path)))
  monkeypatch.setattr(paths, "object_generation", lambda url: "1" if url in objects else None)
  monkeypatch.setattr(paths, "append_to_object", append)
  path = "gs://bucket/run/metrics/index.jsonl"
  log = paths.AppendLog(path)
  log.write("1\n")
  down[0] = True
  with pytest.raises(StorageUnreachable):
    log.write("2\n")
  assert objects[path] == "1\n"
  down[0] = False
  log.close()
  assert objects[path] == "1\n2\n"

  log = paths.AppendLog(path)
  down[0] = True
  with pytest.raises(StorageUnreachable):
    log.write("3\n")
  with caplog.at_level(logging.WARNING, logger="realm_jax.paths"):
    log.close()   # still down: said, not raised
  assert objects[path] == "1\n2\n"
  assert f"{path}: its last lines are not written (StorageUnreachable" in caplog.text


def test_a_bucket_log_written_every_step_is_sent_at_most_every_hold_seconds(monkeypatch):
  """A trainer's per-step log in a bucket was sent at every step: GCS takes about one write a
  second to an object. Held,
  the first line after a quiet spell goes at once, the rest wait for the hold to pass, for
  `send_held_lines` (before a checkpoint: its steps' lines are then in the bucket) or for the
  close; a log without a hold sends every line."""
  objects, sends, clock = {}, [], [100.0]

  def append(url, text, generation):
    sends.append(url)
    objects[url] = objects.get(url, "") + text
    return ""

  monkeypatch.setattr(paths, "read_text", lambda path: objects.get(str(path)))
  monkeypatch.setattr(paths, "object_generation", lambda url: "1" if url in objects else None)
  monkeypatch.setattr(paths, "append_to_object", append)
  monkeypatch.setattr(paths.time, "monotonic", lambda: clock[0])
  held, every = "gs://bucket/run/metrics/train.jsonl", "gs://bucket/run/metrics/index.jsonl"
  log, other = paths.AppendLog(held, hold_seconds=10.0), paths.AppendLog(every)
  log.write("1\n")                  # the first: at once
  for step in range(2, 6):
    log.write(f"{step}\n")
    other.write(f"v{step}\n")
  assert objects[held] == "1\n" and sends.count(held) == 1
  assert objects[every] == "v2\nv3\nv4\nv5\n" and sends.count(every) == 4
  paths.send_held_lines()
  assert objects[held] == "1\n2\n3\n4\n5\n" and sends.count(held) == 2
  assert sends.count(every) == 4     # nothing held there: nothing sent again
  clock[0] += 10.0
  log.write("6\n")                  # the hold has passed: at once
  log.write("7\n")
  assert objects[held].endswith("6\n") and sends.count(held) == 3
  log.close()
  assert objects[held] == "".join(f"{step}\n" for step in range(1, 8))
  assert sends.count(held) == 4
  paths.send_held_lines()            # a closed log is no longer held
  assert sends.count(held) == 4


@pytest.mark.slow
def test_the_trainers_poll_of_the_index_waits_out_an_outage_then_names_the_index_dir(
    server, gcs, monkeypatch):
  """The trainer's index subscriber on a bucket workdir: an outage longer than gcsfs's own
  retries is waited out as every other read is (the version published after it is loaded),
  and one past $REALM_JAX_STORAGE_PATIENCE ends the trainer's wait in StorageUnreachable
  naming W/index (one line at the CLI), not in a traceback of the subscriber's thread."""
  import gcsfs.retry
  import numpy as np
  from realm_jax.retrieval import published
  from realm_jax.retrieval.index import IndexVersion
  from realm_jax.retrieval.subscriber import IndexSubscriber
  monkeypatch.setattr(gcsfs.retry, "asyncio", _TenthOfTheBackoff())
  monkeypatch.setenv(paths.PATIENCE_ENV, "60")
  workdir = f"{gcs}/subscribed"
  root = published.index_root(workdir)
  loader = lambda v: IndexVersion(version=v, step=0, index=None, encode_queries=None)
  subscriber = IndexSubscriber(workdir, loader, poll_seconds=0.1)
  try:
    comes_back = server.down_for(6.0)   # gcsfs gives up after ~3 s (a tenth of its backoff)
    comes_back.join(timeout=60)
    published.publish_arrays(root, np.zeros((4, 2), np.float32), {}, step=0,
                             fingerprint="blocks", keep=2)
    assert subscriber.wait(lambda have: have.get(1), 60.0, "v1").version == 1

    monkeypatch.setenv(paths.PATIENCE_ENV, "1")
    server.go_down()
    try:
      with pytest.raises(StorageUnreachable, match=r"subscribed/index: .*failed, the storage "
                         r"server did not answer .*REALM_JAX_STORAGE_PATIENCE=1s"):
        subscriber.wait(lambda have: have.get(2), 60.0, "v2")
    finally:
      server.come_back()
  finally:
    subscriber.close()

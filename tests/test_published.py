"""The on-disk protocol of published index versions: complete or invisible, numbers never
reused, keep-N pruning, and a verify that rejects corrupt or mismatched versions."""

import hashlib
import json
import os

import pytest

from realm_jax import paths
from realm_jax.retrieval import published

FINGERPRINT = "fp-abc"
DIM = 16


def fields(step: int, **extra) -> dict:
  return {"step": step, "num_blocks": 240, "dim": DIM, "backend": "exact",
          "block_store_fingerprint": FINGERPRINT, "timings": {"embed_s": 1.5}, **extra}


def write_files(staging, seed: int) -> dict[str, bytes]:
  """Writes a top-level file and one in a subdir; returns {relpath: content}."""
  contents = {"embeddings.npy": bytes(range(seed, seed + 100)) * 3,
              "query_tower/params.msgpack": f"params of version {seed}".encode()}
  for rel, data in contents.items():
    (staging / rel).parent.mkdir(parents=True, exist_ok=True)
    (staging / rel).write_bytes(data)
  return contents


def publish_one(root, step: int, keep: int = 3, **extra) -> tuple[int, dict]:
  version, staging = published.start_version(root)
  write_files(staging, seed=step % 50)
  return version, published.publish(root, version, staging, fields(step, **extra), keep=keep)


def test_publish_two_versions_then_verify(tmp_path):
  root = published.index_root(tmp_path)
  assert published.read_latest(root) is None
  assert published.complete_versions(root) == []
  v1, _ = publish_one(root, step=100)
  version, staging = published.start_version(root)
  contents = write_files(staging, seed=7)
  (staging / published.MANIFEST).write_text("stale, from a retried build")  # never listed
  manifest = published.publish(root, version, staging, fields(200, note="extra key"), keep=3)

  assert (v1, version) == (1, 2)
  assert (root / published.LATEST).read_text() == "00000002\n"
  assert published.read_latest(root) == 2
  assert published.complete_versions(root) == [1, 2]
  assert not staging.exists()
  assert sorted(p.name for p in root.iterdir()) == ["00000001", "00000002", "LATEST"]
  assert manifest["version"] == 2 and manifest["step"] == 200 and manifest["note"] == "extra key"
  assert manifest["timings"] == {"embed_s": 1.5} and manifest["created"] > 0
  assert set(manifest["files"]) == set(contents)
  for rel, data in contents.items():
    assert manifest["files"][rel] == {"bytes": len(data),
                                      "sha256": hashlib.sha256(data).hexdigest()}
  assert published.read_manifest(root, 2) == manifest
  assert json.loads((root / "00000002" / published.MANIFEST).read_text()) == manifest
  assert published.verify(root, 2, fingerprint=FINGERPRINT, dim=DIM) == manifest
  assert published.verify(root, 1)["step"] == 100


def test_keep_prunes_and_numbers_are_never_reused(tmp_path):
  root = published.index_root(tmp_path)
  for step in (10, 20, 30, 40):
    publish_one(root, step, keep=2)
  assert published.complete_versions(root) == [3, 4]
  assert sorted(p.name for p in root.iterdir()) == ["00000003", "00000004", "LATEST"]
  assert published.read_manifest(root, 4)["step"] == 40

  # The newest dir and LATEST gone: the number still moves on from the remaining dirs.
  published.version_dir(root, 4).rmtree()
  (root / published.LATEST).unlink()
  assert published.start_version(root)[0] == 4
  # LATEST alone (its dir deleted) also counts.
  (root / published.LATEST).write_text("00000009\n")
  assert published.start_version(root)[0] == 10
  # A leftover version dir without a manifest (a killed remote builder) is skipped too.
  (root / published.LATEST).unlink()
  published.version_dir(root, 12).mkdir()
  version, staging = published.start_version(root)
  assert version == 13
  write_files(staging, seed=1)
  published.publish(root, version, staging, fields(50), keep=2)
  assert published.read_latest(root) == 13
  assert published.complete_versions(root) == [3, 13]


def test_killed_builder_staging_is_invisible_and_cleaned(tmp_path):
  root = published.index_root(tmp_path)
  publish_one(root, step=100)
  version, staging = published.start_version(root)
  write_files(staging, seed=3)                      # killed here, before publish
  (root / f"{published.LATEST}.tmp-99999").write_text("00000002\n")
  assert staging.name.startswith(".tmp-") and staging.exists()
  assert published.complete_versions(root) == [1]
  assert published.read_latest(root) == 1
  assert published.clean_staging(tmp_path / "nothing-here") == []

  # Clean from "another process": our own pid's staging dirs are spared on purpose.
  leftover = root / ".tmp-00000002-99998"
  os.rename(staging, leftover)
  removed = published.clean_staging(root)
  assert sorted(removed) == sorted([str(leftover), str(root / "LATEST.tmp-99999")])
  assert sorted(p.name for p in root.iterdir()) == ["00000001", "LATEST"]
  assert published.start_version(root)[0] == 2
  assert published.clean_staging(root) == []       # spares the live one of this process


def test_version_dir_without_manifest_is_not_there(tmp_path):
  root = published.index_root(tmp_path)
  publish_one(root, step=100)
  incomplete = published.version_dir(root, 2)
  write_files(incomplete, seed=2)
  (root / "not-a-version").mkdir()
  (root / "123").mkdir()
  assert published.complete_versions(root) == [1]
  with pytest.raises(published.RejectedVersion, match="manifest") as e:
    published.read_manifest(root, 2)
  assert e.value.version == 2 and e.value.reason == str(e.value)

  (incomplete / published.MANIFEST).write_text("{not json")
  assert published.complete_versions(root) == [1, 2]
  with pytest.raises(published.RejectedVersion, match="not valid JSON"):
    published.read_manifest(root, 2)
  (incomplete / published.MANIFEST).write_text(json.dumps({"version": 2, "step": 5}))
  with pytest.raises(published.RejectedVersion, match="num_blocks"):
    published.read_manifest(root, 2)
  (root / published.LATEST).write_text("garbled\n")
  assert published.read_latest(root) is None


@pytest.mark.parametrize("change, expected", [
    ({"step": None}, "step is None, not an integer"),
    ({"dim": 16.0}, "dim is 16.0, not an integer"),
    ({"files": []}, "files is a list, not an object"),
    ({"files": {"embeddings.npy": 5}}, r"files\['embeddings.npy'\] is 5"),
    ({"files": {"embeddings.npy": {"bytes": "300", "sha256": "ab"}}}, "embeddings.npy"),
    ({"backend": "scann"}, "ScaNN version without its settings"),
])
def test_manifest_of_wrong_types_is_rejected_naming_the_field(tmp_path, change, expected):
  """JSON of the right keys and wrong types is a rejected version, not a reader's crash."""
  root = published.index_root(tmp_path)
  publish_one(root, step=100)
  path = published.version_dir(root, 1) / published.MANIFEST
  path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
  with pytest.raises(published.RejectedVersion, match=expected) as e:
    published.verify(root, 1)
  assert str(path.parent) in e.value.reason


def test_subscriber_skips_a_version_pruned_while_it_looks(tmp_path, monkeypatch):
  """Deterministic refresh reads every complete version's manifest: one that the builder
  prunes between the listing and the read is passed over, not the subscriber's death."""
  from realm_jax.retrieval.subscriber import IndexSubscriber
  root = published.index_root(tmp_path)
  sub = IndexSubscriber(str(tmp_path), loader=None, poll_seconds=3600)
  sub.close()        # its one poll found nothing; this test looks by hand
  publish_one(root, step=0)
  sub.want_steps([10])
  read_text, pruned = type(root).read_text, []

  def prune_first(path, *args, **kwargs):
    if path.name == published.MANIFEST and path.parent.name == "00000001" and not pruned:
      pruned.append(publish_one(root, step=10, keep=1))    # the builder's next version
    return read_text(path, *args, **kwargs)

  monkeypatch.setattr(type(root), "read_text", prune_first)
  assert sub._candidates() == [] and pruned       # v1 vanished; v2 was not listed yet
  monkeypatch.undo()
  assert sub._candidates() == [2] and sub.rejected == {}


def test_a_deterministic_feed_has_the_next_version_loaded_before_its_swap(tmp_path):
  """Once the feed reads checkpoint S's version, S + refresh_every's is loaded as soon as it is
  published, so the swap to it does not wait (only a late version makes a deterministic run
  wait); nothing is loaded before the first ask (LATEST here is a version no step reads)."""
  import time
  import ml_collections
  from realm_jax.retrieval.index import IndexVersion
  from realm_jax.retrieval.subscriber import IndexSubscriber
  from realm_jax.train.feed import VersionSchedule
  root, loads = published.index_root(tmp_path), []

  def loader(version):
    manifest = published.verify(root, version)
    loads.append(manifest["step"])
    time.sleep(0.5)                      # reading and hashing the files of a version
    return IndexVersion(version=version, step=manifest["step"], index=None,
                        encode_queries=None)
  publish_one(root, step=0)
  publish_one(root, step=500)
  config = ml_collections.ConfigDict({
      "retrieval": {"refresh": "deterministic", "refresh_every": 100, "swap_lag": 25,
                    "index_timeout": 30.0}, "train": {"steps": 400}})
  subscriber = IndexSubscriber(str(tmp_path), loader, poll_seconds=0.1, by_step=True)
  schedule = VersionSchedule(config, subscriber)
  try:
    assert schedule.for_step(0)[0].step == 0 and loads == [0]
    publish_one(root, step=100)          # while steps 100..124 still read step 0's version
    deadline = time.monotonic() + 20
    while subscriber.newest().step != 100 and time.monotonic() < deadline:
      time.sleep(0.05)
    for step in range(1, 125):
      assert schedule.for_step(step)[0].step == (0 if step < 125 else 100)
    loaded, waited = schedule.for_step(125)
    assert loaded.step == 100 and waited < 0.05 and schedule.waits == []
    assert loads == [0, 100]
  finally:
    subscriber.close()


def test_a_wait_for_a_version_the_builder_will_never_build_fails_at_once(tmp_path):
  """Deterministic refresh: checkpoint 40's version missing while 80's is published (pruned,
  or a workdir that ran with async refresh) is never built (realm-index builds only above the
  newest it published): the wait says so at once, naming the options, instead of running out
  `retrieval.index_timeout`. A step above the newest still waits."""
  import time
  import ml_collections
  from realm_jax.errors import IndexNeverPublished
  from realm_jax.retrieval.index import IndexVersion
  from realm_jax.retrieval.subscriber import IndexSubscriber
  from realm_jax.train.feed import BatchFeed, VersionSchedule
  root = published.index_root(tmp_path)

  def loader(version):
    manifest = published.verify(root, version)
    return IndexVersion(version=version, step=manifest["step"], index=None,
                        encode_queries=None)
  publish_one(root, step=0)
  publish_one(root, step=80)
  subscriber = IndexSubscriber(str(tmp_path), loader, poll_seconds=0.05, by_step=True)
  try:
    assert subscriber.wait_for_step(0, timeout=30).step == 0
    t0 = time.monotonic()
    with pytest.raises(IndexNeverPublished, match=r"checkpoint step 40 .* newest it published "
                       r"\(step 80\).*builder\.keep_versions.*retrieval\.refresh"):
      subscriber.wait_for_step(40, timeout=30)
    assert time.monotonic() - t0 < 10
    assert subscriber.wait_for_step(80, timeout=30).step == 80
    with pytest.raises(TimeoutError, match="built from step 120"):
      subscriber.wait_for_step(120, timeout=0.5)
    # The batch feed of a run resumed at step 75 (read by checkpoint 40's version) hands the
    # error to the train loop as it is, for the CLI to print in one line.
    config = ml_collections.ConfigDict({
        "retrieval": {"refresh": "deterministic", "refresh_every": 40, "swap_lag": 20,
                      "index_timeout": 30.0}, "train": {"steps": 160}})
    schedule = VersionSchedule(config, subscriber)

    class Queries:
      def __next__(self):
        return {}

      def get_state(self):
        return {}
    feed = BatchFeed(Queries(), lambda step, q: ({}, {"index": schedule.for_step(step)}), 75,
                     depth=2, end=160)
    with pytest.raises(IndexNeverPublished, match="checkpoint step 40"):
      feed.next()
    feed.close()
  finally:
    subscriber.close()


def step_80_from_an_earlier_block_store(tmp_path):
  """W/index with step 0's version and step 80's from another block store (v1, v2), and a
  subscriber's loader that verifies as the trainer does: (root, loader)."""
  from realm_jax.retrieval.index import IndexVersion
  root = published.index_root(tmp_path)

  def loader(version):
    manifest = published.verify(root, version, fingerprint=FINGERPRINT)
    return IndexVersion(version=version, step=manifest["step"], index=None,
                        encode_queries=None)
  publish_one(root, step=0)
  publish_one(root, step=80, block_store_fingerprint="an earlier block store")
  return root, loader


def test_a_version_the_trainer_rejects_still_counts_as_built(tmp_path):
  """realm-index counts every version with a readable manifest as built, one the trainer
  rejects too (here: step 80's, left by an earlier block store). So checkpoint 40's version
  and a new one of 80 will never come: both waits fail at once, the second naming the
  rejection (it used to run out `retrieval.index_timeout`). A version whose manifest cannot
  be read is counted by neither side (step 200's here), so step 120 still waits."""
  import time
  from realm_jax.errors import IndexNeverPublished
  from realm_jax.retrieval.subscriber import IndexSubscriber
  root, loader = step_80_from_an_earlier_block_store(tmp_path)
  damaged, _ = publish_one(root, step=200)
  (published.version_dir(root, damaged) / published.MANIFEST).write_text("{not json")
  subscriber = IndexSubscriber(str(tmp_path), loader, poll_seconds=0.05, by_step=True)
  try:
    assert subscriber.wait_for_step(0, timeout=30).step == 0
    t0 = time.monotonic()
    with pytest.raises(IndexNeverPublished, match=r"checkpoint step 40 .*\(step 80\)"):
      subscriber.wait_for_step(40, timeout=30)
    with pytest.raises(IndexNeverPublished, match=r"checkpoint step 80 .*\(step 80\)"
                       r".*v2: block store fingerprint an earlier block store"):
      subscriber.wait_for_step(80, timeout=30)
    assert time.monotonic() - t0 < 10
    with pytest.raises(TimeoutError, match="built from step 120"):
      subscriber.wait_for_step(120, timeout=1.0)
  finally:
    subscriber.close()


def test_a_version_rejected_before_any_step_was_wanted_counts_as_built(tmp_path, caplog):
  """Under async refresh the subscriber loads what LATEST names and wants no step until the
  final evaluation asks for the last one's version. A version it rejected before (step 80's,
  from an earlier block store) still counts as built then: the wait fails at once, naming it
  (it used to run out `retrieval.index_timeout`). One whose manifest cannot be read (v3,
  step 200's) is counted by neither side, and each rejection is logged once."""
  import logging
  import time
  from realm_jax.errors import IndexNeverPublished
  from realm_jax.retrieval.subscriber import IndexSubscriber
  root, loader = step_80_from_an_earlier_block_store(tmp_path)
  caplog.set_level(logging.WARNING, logger="realm_jax.retrieval.subscriber")
  subscriber = IndexSubscriber(str(tmp_path), loader, poll_seconds=0.05)
  try:
    deadline = time.monotonic() + 10
    while 2 not in subscriber.rejected and time.monotonic() < deadline:
      time.sleep(0.05)
    damaged, _ = publish_one(root, step=200)
    (published.version_dir(root, damaged) / published.MANIFEST).write_text("{not json")
    while damaged not in subscriber.rejected and time.monotonic() < deadline:
      time.sleep(0.05)
    assert list(subscriber.rejected) == [2, 3] and subscriber.newest() is None
    t0 = time.monotonic()
    with pytest.raises(IndexNeverPublished, match=r"checkpoint step 80 .*\(step 80\)"
                       r".*v2: block store fingerprint an earlier block store"):
      subscriber.wait_for_step(80, timeout=30)
    assert time.monotonic() - t0 < 10
  finally:
    subscriber.close()
  assert [sum(f"v{v} rejected" in r.getMessage() for r in caplog.records)
          for v in (2, 3)] == [1, 1]


def test_the_batch_feed_hands_on_the_projects_errors_and_wraps_the_others(tmp_path):
  """A late version's timeout in the feed thread reaches the train loop as IndexWaitTimeout
  (one line at the CLI); an OS error there stays wrapped, naming the step, traceback kept."""
  from realm_jax.errors import IndexWaitTimeout
  from realm_jax.retrieval.subscriber import IndexSubscriber
  from realm_jax.train.feed import BatchFeed

  class Queries:
    def __next__(self):
      return {}

    def get_state(self):
      return {}
  subscriber = IndexSubscriber(str(tmp_path), loader=None, poll_seconds=0.05, by_step=True)
  try:
    late = BatchFeed(Queries(), lambda step, q: (
        {}, {"index": subscriber.wait_for_step(40, timeout=0.5)}), 0, depth=2, end=10)
    with pytest.raises(IndexWaitTimeout, match="built from step 40.*index_timeout"):
      late.next()
    late.close()
  finally:
    subscriber.close()

  def broken(step, queries):
    if step == 2:
      open(tmp_path / "gone" / "shard.npy")
    return {}, {}
  feed = BatchFeed(Queries(), broken, 0, depth=2, end=10)
  feed.next()
  feed.next()
  with pytest.raises(RuntimeError, match="building the batch of step 3 failed: "
                     "FileNotFoundError") as wrapped:
    feed.next()
  assert isinstance(wrapped.value.__cause__, FileNotFoundError)
  feed.close()


def test_a_deterministic_feed_asks_ahead_only_for_versions_a_step_reads():
  """425 steps, a refresh every 100, swap lag 25: steps 0..424 read the versions of
  checkpoints 0, 100, 200 and 300; the feed asks ahead for each of those, never for 400's
  (a whole index loaded and held for no step; the final evaluation asks for its own)."""
  import ml_collections
  from realm_jax.retrieval.index import IndexVersion
  from realm_jax.train.feed import VersionSchedule

  class Subscriber:
    def __init__(self):
      self.asked = []

    def wait_for_step(self, step, timeout):
      return IndexVersion(version=step, step=step, index=None, encode_queries=None)

    def release(self, **kwargs):
      pass

    def want_steps(self, steps):
      self.asked.extend(steps)
  config = ml_collections.ConfigDict({
      "retrieval": {"refresh": "deterministic", "refresh_every": 100, "swap_lag": 25,
                    "index_timeout": 30.0}, "train": {"steps": 425}})
  subscriber = Subscriber()
  schedule = VersionSchedule(config, subscriber)
  assert sorted({schedule.for_step(step)[0].step for step in range(425)}) == [0, 100, 200, 300]
  assert sorted(set(subscriber.asked)) == [100, 200, 300]


@pytest.mark.parametrize("damage, expected", [
    ("flip", r"embeddings\.npy has sha256"),
    ("truncate", r"embeddings\.npy has size 299 bytes != 300 bytes"),
    ("delete", r"query_tower/params\.msgpack is listed .* but missing"),
])
def test_verify_rejects_damaged_files(tmp_path, damage, expected):
  root = published.index_root(tmp_path)
  version, _ = publish_one(root, step=100)
  directory = published.version_dir(root, version)
  embeddings = directory / "embeddings.npy"
  data = bytearray(embeddings.read_bytes())
  if damage == "flip":
    data[17] ^= 0x01
    embeddings.write_bytes(bytes(data))
    assert embeddings.stat().length == 300
  elif damage == "truncate":
    embeddings.write_bytes(bytes(data[:-1]))
  else:
    (directory / "query_tower" / "params.msgpack").unlink()
  with pytest.raises(published.RejectedVersion, match=expected) as e:
    published.verify(root, version)
  assert e.value.version == version


def test_verify_rejects_fingerprint_and_dim_mismatch(tmp_path):
  root = published.index_root(tmp_path)
  version, _ = publish_one(root, step=100)
  with pytest.raises(published.RejectedVersion) as e:
    published.verify(root, version, fingerprint="fp-def", dim=DIM)
  assert str(e.value) == "block store fingerprint fp-abc (index) != fp-def (trainer)"
  with pytest.raises(published.RejectedVersion) as e:
    published.verify(root, version, fingerprint=FINGERPRINT, dim=128)
  assert str(e.value) == f"dim {DIM} (index) != 128 (trainer)"


def test_publish_refuses_bad_calls(tmp_path):
  root = published.index_root(tmp_path)
  version, staging = published.start_version(root)
  with pytest.raises(ValueError, match="block_store_fingerprint"):
    published.publish(root, version, staging, {"step": 1, "num_blocks": 2, "dim": 3,
                                               "backend": "exact", "timings": {}}, keep=2)
  published.version_dir(root, version).mkdir()
  with pytest.raises(FileExistsError, match="00000001"):
    published.publish(root, version, staging, fields(1), keep=2)


def test_remote_path_writes_in_place_with_manifest_last(tmp_path, monkeypatch):
  monkeypatch.setattr(paths, "is_remote", lambda path: True)
  root = published.index_root(tmp_path)
  assert published.clean_staging(root) == []
  publish_one(root, step=100)
  version, staging = published.start_version(root)
  assert version == 2 and staging == published.version_dir(root, 2)
  contents = write_files(staging, seed=9)
  assert published.complete_versions(root) == [1]  # files there, no manifest: invisible

  hashed = []
  real_sha256 = published.sha256_file

  def sha256_before_manifest(path):
    assert not (staging / published.MANIFEST).exists()
    hashed.append(path.name)
    return real_sha256(path)

  monkeypatch.setattr(published, "sha256_file", sha256_before_manifest)
  manifest = published.publish(root, version, staging, fields(200), keep=1)
  monkeypatch.setattr(published, "sha256_file", real_sha256)
  assert sorted(hashed) == ["embeddings.npy", "params.msgpack"]
  assert set(manifest["files"]) == set(contents)
  assert sorted(p.name for p in root.iterdir()) == ["00000002", "LATEST"]
  assert published.read_latest(root) == 2
  assert published.verify(root, 2, fingerprint=FINGERPRINT, dim=DIM) == manifest
  with pytest.raises(ValueError, match="in place"):
    published.publish(root, 3, tmp_path / "elsewhere", fields(300), keep=1)


def test_paths():
  assert not paths.is_remote("/tmp/w") and not paths.is_remote(published.index_root("rel/w"))
  assert paths.is_remote("gs://bucket/w")
  assert paths.is_remote(published.index_root("gs://bucket/w"))
  remote = published.version_dir(published.index_root("gs://b/w"), 42)
  assert str(remote) == "gs://b/w/index/00000042"

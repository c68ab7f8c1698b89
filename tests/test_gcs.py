"""Runs that live in a bucket: `realm-prepare` -> ICT -> resume with `gs://` data dir and workdir,
against a server speaking the GCS JSON API on 127.0.0.1 (tests/gcs_server.py; skipped with the
reason where it cannot start). A malformed URL never becomes a local path."""

import json
import logging
import os
import shutil

import pytest
from etils import epath

from realm_jax import paths
from realm_jax.data.prepare import prepare
from realm_jax.errors import ConfigError
from realm_jax.train.loop import train
from tests import gcs_server, helpers
from tests.helpers import tiny_config

BUCKET = f"gs://{gcs_server.BUCKET}"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """The server, with the local data cache in a temp dir; yields the bucket URL."""
  server, why = gcs_server.start_or_skip_reason()
  if server is None:
    pytest.skip(why)
  logging.getLogger("gcp_storage_emulator").setLevel(logging.CRITICAL)  # its 404 lines
  saved = os.environ.get("REALM_JAX_CACHE")
  os.environ["REALM_JAX_CACHE"] = str(tmp_path_factory.mktemp("cache"))
  yield BUCKET
  server.stop()
  if saved is None:
    os.environ.pop("REALM_JAX_CACHE", None)
  else:
    os.environ["REALM_JAX_CACHE"] = saved


def bucket_text(url: str) -> str:
  return epath.Path(url).read_text()


@pytest.mark.slow
def test_prepare_train_and_resume_with_everything_in_the_bucket(gcs, capsys):
  data, workdir = f"{gcs}/world/data", f"{gcs}/world/ict"
  config = helpers.load_config_module("prepare").get_config("world")
  config.source, config.out_dir = f"world:{helpers.WORLD_ENTITIES}", data
  config.vocab_size, config.num_workers = helpers.VOCAB_SIZE, 0
  stats = prepare(config)
  out = capsys.readouterr().out
  assert f"[prepare] uploaded to {data}" in out
  manifest = json.loads(bucket_text(f"{data}/{paths.FILES_MANIFEST}"))
  assert {"vocab.txt", "stats.json"} <= set(manifest["files"])
  assert json.loads(bucket_text(f"{data}/stats.json"))["blocks"] == stats["blocks"]
  assert not os.path.exists("gs:"), "a URL became a local dir"
  assert prepare(config)["blocks"] == stats["blocks"]   # finished: not prepared again
  assert "is already prepared and uploaded" in capsys.readouterr().out
  shutil.rmtree(paths.cache_dir(data))   # as on another host: nothing local yet

  ict = tiny_config("ict", None, data, train__steps=4, train__checkpoint_every=2)
  first = train(ict, workdir)
  out = capsys.readouterr().out
  assert "[data] copied" in out and "verified" in out   # the arrays are read locally
  assert "TensorBoard events of gs://" in out
  checkpoints = sorted(p.name for p in epath.Path(f"{workdir}/checkpoints").iterdir())
  assert checkpoints == ["2", "4"], checkpoints
  assert json.loads(bucket_text(f"{workdir}/summary.json"))["steps"] == 4 == first["steps"]
  assert json.loads(bucket_text(f"{workdir}/config.json"))["data"]["dir"] == data

  ict.train.steps = 6
  again = train(ict, workdir)
  out = capsys.readouterr().out
  assert f"resumed from {workdir}/checkpoints/4 (data at step 4)" in out, out[-3000:]
  assert "[data] copied" not in out   # the verified local copy is reused
  assert again["steps"] == 6
  logged = [json.loads(line)["step"] for line in
            bucket_text(f"{workdir}/metrics/train.jsonl").splitlines()]
  assert logged == list(range(1, 7))   # appended across the restart, in the bucket


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

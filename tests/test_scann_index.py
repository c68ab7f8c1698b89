"""The ScaNN block index: recall against exact search with the derived settings, save/load,
determinism, the exact reference itself, and the settings rule across corpus sizes."""

import math

import ml_collections
import numpy as np
import pytest

from realm_jax.errors import ConfigError
from realm_jax.retrieval import scann_index
from realm_jax.config.defaults import base_config

NUM_BLOCKS, DIM, CLUSTERS = 20_000, 32, 100


def index_config(**overrides) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(base_config().builder.to_dict())
  config.update(overrides)
  return config


@pytest.fixture(scope="module")
def clustered():
  """Unit-norm blocks from a mixture of Gaussians, and queries near random blocks."""
  rng = np.random.default_rng(0)
  centers = rng.normal(size=(CLUSTERS, DIM)).astype(np.float32)
  blocks = centers[rng.integers(0, CLUSTERS, NUM_BLOCKS)]
  blocks += 0.5 * rng.normal(size=blocks.shape).astype(np.float32)
  blocks /= np.linalg.norm(blocks, axis=1, keepdims=True)
  queries = blocks[rng.choice(NUM_BLOCKS, 500, replace=False)]
  queries = queries + 0.25 * rng.normal(size=queries.shape).astype(np.float32)
  return blocks, queries.astype(np.float32)


@pytest.fixture(scope="module")
def index(clustered):
  blocks, _ = clustered
  settings = scann_index.scann_settings(NUM_BLOCKS, index_config())
  searcher = scann_index.build_searcher(blocks, settings)
  return scann_index.ScannIndex(searcher, version=3, step=700, num_blocks=NUM_BLOCKS,
                                settings=settings)


def test_recall_at_10_with_derived_settings(clustered, index):
  blocks, queries = clustered
  assert index.settings["num_leaves"] > 1       # a real tree + hashing, not brute force
  rows = index.search(queries, 10)
  assert rows.shape == (len(queries), 10) and rows.dtype == np.int64
  exact = scann_index.exact_top_n(queries, blocks, 10)
  recall = scann_index.recall_at(rows, exact)
  assert recall >= 0.95, recall
  # Best first: ScaNN's reorder step scores exactly, so scores never increase along a row.
  scores = np.take_along_axis(queries @ blocks.T, rows, axis=1)
  assert np.all(np.diff(scores, axis=1) <= 1e-5)


def test_save_and_load_give_the_same_rows(clustered, index, tmp_path):
  _, queries = clustered
  (tmp_path / "built").mkdir()
  scann_index.save_searcher(index.searcher, str(tmp_path / "built"))
  # Published versions are copied or moved after serialization: paths must be relative.
  (tmp_path / "built").rename(tmp_path / "published")
  loaded = scann_index.ScannIndex.load(str(tmp_path / "published"), version=3, step=700,
                                       num_blocks=NUM_BLOCKS, settings=index.settings)
  assert (loaded.version, loaded.step, loaded.num_blocks) == (3, 700, NUM_BLOCKS)
  np.testing.assert_array_equal(loaded.search(queries, 10), index.search(queries, 10))
  with pytest.raises(ValueError, match="not empty"):
    scann_index.save_searcher(index.searcher, str(tmp_path / "published"))
  with pytest.raises(ValueError, match="holds 20000 blocks"):
    scann_index.ScannIndex.load(str(tmp_path / "published"), version=3, step=700,
                                num_blocks=10, settings=index.settings)


def test_a_searcher_whose_file_is_cut_short_is_a_load_error_the_trainer_retries(
    index, tmp_path):
  """ScaNN's own error for a searcher file cut short or gone (a version pruned while the
  trainer loads it) is a RuntimeError, which the trainer's index subscriber does not take as
  a failed load (retried, then the version rejected): its thread died and the run failed.
  It is a ValueError naming the directory now."""
  directory = tmp_path / "published"
  directory.mkdir()
  scann_index.save_searcher(index.searcher, str(directory))
  biggest = max(directory.iterdir(), key=lambda p: p.stat().st_size)
  biggest.write_bytes(biggest.read_bytes()[:16])
  with pytest.raises(ValueError, match=f"ScaNN could not load the searcher in {directory}: "):
    scann_index.ScannIndex.load(str(directory), version=3, step=700, num_blocks=NUM_BLOCKS,
                                settings=index.settings)


def test_two_builds_of_the_same_table_are_identical(clustered, index):
  blocks, queries = clustered
  again = scann_index.ScannIndex(scann_index.build_searcher(blocks, index.settings), version=3,
                                 step=700, num_blocks=NUM_BLOCKS, settings=index.settings)
  np.testing.assert_array_equal(again.search(queries, 50), index.search(queries, 50))


def test_more_rows_than_the_probed_leaves_hold(clustered, index):
  """n beyond what leaves_to_search covers falls back to every leaf (no padded rows)."""
  blocks, queries = clustered
  n = NUM_BLOCKS // 4
  rows = index.search(queries[:3], n)
  assert all(len(set(r)) == n for r in rows)
  assert scann_index.recall_at(rows, scann_index.exact_top_n(queries[:3], blocks, n)) > 0.9


def test_n_beyond_the_index_raises(index):
  with pytest.raises(ValueError, match=f"from an index of {NUM_BLOCKS}"):
    index.search(np.zeros((2, DIM), np.float32), NUM_BLOCKS + 1)
  assert index.search(np.zeros((0, DIM), np.float32), 5).shape == (0, 5)


def test_tiny_corpus_is_an_exact_scan(clustered):
  blocks, queries = clustered
  settings = scann_index.scann_settings(1_000, index_config())
  assert settings["num_leaves"] == 1
  index = scann_index.ScannIndex(scann_index.build_searcher(blocks[:1_000], settings),
                                 version=0, step=0, num_blocks=1_000, settings=settings)
  np.testing.assert_array_equal(index.search(queries, 10),
                                scann_index.exact_top_n(queries, blocks[:1_000], 10))


def test_exact_top_n_matches_a_full_argsort(clustered):
  blocks, queries = clustered
  reference = np.argsort(-(queries[:50] @ blocks.T), axis=1, kind="stable")[:, :20]
  np.testing.assert_array_equal(scann_index.exact_top_n(queries[:50], blocks, 20, chunk=3000),
                                reference)
  np.testing.assert_array_equal(scann_index.exact_top_n(queries[:50], blocks[:7], 7, chunk=3),
                                np.argsort(-(queries[:50] @ blocks[:7].T), axis=1,
                                           kind="stable"))
  with pytest.raises(ValueError):
    scann_index.exact_top_n(queries, blocks[:5], 6)
  # equal scores (duplicate blocks; small integers, so every product is exact): the lower
  # row first, whatever the chunks
  rng = np.random.default_rng(0)
  small = rng.integers(-2, 3, (300, 4)).astype(np.float32)
  duplicated, asked = np.concatenate([small, small]), rng.integers(-2, 3, (50, 4))
  reference = np.argsort(-(asked @ duplicated.T.astype(np.int64)), axis=1, kind="stable")
  for chunk in (8192, 100, 7):
    np.testing.assert_array_equal(
        scann_index.exact_top_n(asked.astype(np.float32), duplicated, 15, chunk=chunk),
        reference[:, :15])


def test_recall_at():
  exact = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
  assert scann_index.recall_at(exact, exact) == 1.0
  assert scann_index.recall_at(np.array([[4, 3, 9, 9], [0, 0, 0, 5]]), exact) == 0.375


@pytest.mark.parametrize("num_blocks", [1_000, 100_000, 1_000_000, 10_000_000])
def test_derived_settings_are_sane(num_blocks):
  s = scann_index.scann_settings(num_blocks, index_config())
  assert set(s) == {"num_leaves", "leaves_to_search", "training_sample", "dims_per_block",
                    "anisotropic_threshold", "reorder"}
  assert 1 <= s["leaves_to_search"] <= s["num_leaves"] <= s["training_sample"] <= num_blocks
  assert s["training_sample"] == min(num_blocks, 250_000)
  assert s["reorder"] >= 100 and s["dims_per_block"] == 2
  if num_blocks < scann_index.BRUTE_FORCE_BELOW:
    assert s["num_leaves"] == 1
  else:
    assert s["num_leaves"] == min(round(math.sqrt(num_blocks)), s["training_sample"] // 50)
    assert s["training_sample"] / s["num_leaves"] >= 50       # rows to train each leaf
    assert s["leaves_to_search"] == max(math.ceil(s["num_leaves"] / 20), 16)
    assert s["leaves_to_search"] / s["num_leaves"] <= 0.15     # sub-linear search


def test_explicit_settings_win_and_bad_ones_name_the_option():
  s = scann_index.scann_settings(50_000, index_config(num_leaves=64, leaves_to_search=4,
                                                      training_sample=10_000, reorder=300))
  assert (s["num_leaves"], s["leaves_to_search"], s["training_sample"], s["reorder"]) == (
      64, 4, 10_000, 300)
  with pytest.raises(ConfigError, match="builder.num_leaves"):
    scann_index.scann_settings(50_000, index_config(num_leaves=20_000, training_sample=10_000))
  with pytest.raises(ConfigError, match="builder.leaves_to_search"):
    scann_index.scann_settings(50_000, index_config(num_leaves=64, leaves_to_search=65))
  assert scann_index.scann_settings(5_000, index_config(training_sample=9_000))[
      "training_sample"] == 5_000                                # capped at the corpus
  with pytest.raises(ConfigError, match="builder.training_sample"):
    scann_index.scann_settings(50_000, index_config(training_sample=-1))


@pytest.mark.parametrize("num_blocks,overrides,option", [
    (2_500, dict(training_sample=10), "builder.training_sample"),   # ScaNN drew 11 rows
    (2_500, dict(training_sample=1), "builder.training_sample"),    # not the derived leaves
    (12, dict(num_leaves=6), "builder.num_leaves"),                 # 12 rows in all
])
def test_a_sample_too_small_for_the_hashing_is_refused_not_a_failed_build(num_blocks, overrides,
                                                                          option):
  """ScaNN's hashing trains 16 centres per block of dimensions: fewer sampled rows failed its
  build ("Number of clusters per block (16) is greater than ... training data size") at the
  builder's first version instead of naming the option."""
  with pytest.raises(ConfigError, match=option):
    scann_index.scann_settings(num_blocks, index_config(**overrides))
  table = np.random.default_rng(0).normal(size=(num_blocks, 8)).astype(np.float32)
  smallest = dict(overrides, training_sample=min(scann_index.MIN_AH_SAMPLE, num_blocks),
                  num_leaves=overrides.get("num_leaves", 2))
  if num_blocks >= scann_index.AH_CENTERS:
    scann_index.build_searcher(table, scann_index.scann_settings(num_blocks,
                                                                 index_config(**smallest)))

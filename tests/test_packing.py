"""Packed queries (`retrieval.packed_query_rows`, docs/design.md): several queries a row, each
attending to itself with its own positions, give the query tower's embeddings and backward
pass, and REALM's loss and gradients, of the batch read one query a row; the host packing
puts each query whole into its own data shard's rows; the settings it cannot serve are refused
naming the option. A run whose batches are packed where they fit (both shapes of the step)
resumes exactly: tests/test_retriever_learning.py (the score cache's resume)."""

import os
import shutil

import jax
import numpy as np
import pytest
from ml_collections import ConfigDict

from realm_jax.data import pipeline
from realm_jax.errors import ConfigError
from realm_jax.models.bert import Packing
from realm_jax.models.realm import REALM
from realm_jax.config.validation import validate
from realm_jax.train import batches
from realm_jax.train.loop import train
from tests.helpers import tiny_config
from tests.test_retriever_learning import cache_start, loss_and_grads

PACKED = pipeline.PACKED_QUERIES
WIDE = 32   # query_len: twice the world's longest query, so that any two share a row


def random_queries(rng, n: int, length: int, longest: int) -> tuple[np.ndarray, np.ndarray]:
  lengths = rng.integers(3, longest + 1, n)
  ids = np.zeros((n, length), np.int32)
  for i, m in enumerate(lengths):
    ids[i, :m] = rng.integers(1, 1000, m)
  return ids, lengths


def test_every_query_is_packed_whole_into_its_own_shards_rows():
  ids, lengths = random_queries(np.random.default_rng(0), 32, 24, longest=16)
  packed = pipeline.pack_queries(ids, 24, shards=4)
  assert set(packed) == set(PACKED) and packed["packed_ids"].shape == (24, 24)
  owner = packed["packed_owner"]
  for q, n in enumerate(lengths):
    row = packed["query_packed_row"][q]
    assert row // 6 == q // 8                       # shard s's queries in shard s's rows
    at = np.flatnonzero(owner[row] == q)
    assert len(at) == n and (np.diff(at) == 1).all()   # whole, contiguous
    np.testing.assert_array_equal(packed["packed_ids"][row, at], ids[q, :n])
    np.testing.assert_array_equal(packed["packed_positions"][row, at], np.arange(n))
  assert (owner >= 0).sum() == lengths.sum()         # nothing else in the rows
  np.testing.assert_array_equal(packed["packed_ids"][owner < 0], 0)
  assert pipeline.pack_queries(ids, 4, shards=4) is None   # more wordpieces than room
  for rows, fits in ((4, False), (24, True), (0, False)):   # 0: packing off
    config = ConfigDict({"retrieval": {"packed_query_rows": rows}})
    batch = {"query_ids": ids}
    assert batches.pack_queries(config, batch, shards=4) == fits
    assert set(batch) == ({"query_ids"} | (set(PACKED) if fits else set()))
  with pytest.raises(ValueError, match="shards"):
    pipeline.pack_queries(ids, 6, shards=4)


def test_each_process_packs_its_share_as_one_process_packs_its_shards(world_data):
  """Two processes of 2 data devices each pack their halves of the batch into their halves of
  the rows, numbered in the global batch: together, what one process of 4 packs. All pack or
  none, from the global batch's query lengths, which each process computes alone."""
  ids, _ = random_queries(np.random.default_rng(1), 32, 24, longest=16)
  one = pipeline.pack_queries(ids, 24, shards=4)
  config = ConfigDict({"retrieval": {"packed_query_rows": 24}})
  shares = [{"query_ids": ids[p * 16:(p + 1) * 16]} for p in range(2)]
  for p, share in enumerate(shares):
    assert batches.pack_queries(config, share, 4, lambda: (ids > 0).sum(1), (2 * p, 2 * p + 1))
  for key in PACKED:
    np.testing.assert_array_equal(np.concatenate([share[key] for share in shares]), one[key])
  # devices interleaved by process: process 0 holds data shards 0 and 2, process 1 shards 1
  # and 3; each device's rows are still those one process gives it
  for p in range(2):
    share = {"query_ids": np.concatenate([ids[i * 8:(i + 1) * 8] for i in (p, p + 2)])}
    assert batches.pack_queries(config, share, 4, lambda: (ids > 0).sum(1), (p, p + 2))
    for key in PACKED:
      rows = 8 if key == "query_packed_row" else 6   # queries or rows of a data shard
      np.testing.assert_array_equal(share[key], np.concatenate(
          [one[key][i * rows:(i + 1) * rows] for i in (p, p + 2)]))
  # process 1's queries (16 wordpieces) cannot share its 4 rows of 24, process 0's (3) can
  ids = np.zeros((16, 24), np.int32)
  ids[:8, :3], ids[8:, :16] = 7, 7
  config = ConfigDict({"retrieval": {"packed_query_rows": 8}})
  assert pipeline.pack_queries(ids[:8], 4, shards=2) is not None
  for p in range(2):
    share = {"query_ids": ids[p * 8:(p + 1) * 8]}
    assert not batches.pack_queries(config, share, 4, lambda: (ids > 0).sum(1),
                                    (2 * p, 2 * p + 1))
    assert set(share) == {"query_ids"}
  with pytest.raises(RuntimeError, match="disagree"):
    batches.pack_queries(config, {"query_ids": ids[:8]}, 4, lambda: (ids[::-1] > 0).sum(1),
                         (0, 1))
  # each process finds the global batch's lengths from the seed and the step alone
  realm = tiny_config("realm")
  examples = world_data.examples("train")
  halves = [batches.QueryBatches(realm, world_data, examples, (p,), 2) for p in range(2)]
  for step in (0, 7):
    whole = np.concatenate([(half(step)["query_ids"] > 0).sum(1) for half in halves])
    for half in halves:
      np.testing.assert_array_equal(half.query_lengths(step), whole)


def packed_start(world_dir, world_data):
  """A tiny REALM config whose 16 queries pack two a row (8 rows, one a device), its model,
  mesh and state, and one host batch with and without the packed queries."""
  config, model, mesh, state, (_, _, batch) = cache_start(
      world_dir, world_data, retrieval__score_cache=False, model__retriever__pooling="mean",
      retrieval__packed_query_rows=8, data__query_len=WIDE)
  packed = dict(batch)
  assert batches.pack_queries(config, packed, mesh.shape["data"])
  assert packed["packed_ids"].shape[0] == 8 < len(batch["query_ids"])
  return config, model, mesh, state, batch, packed


@pytest.mark.slow   # a REALM init and two query-tower backward compiles on 8 devices
def test_packed_queries_give_the_same_embeddings_and_backward_pass(world_dir, world_data):
  """On the 8 host devices: the query tower's embeddings, and its backward pass against a
  random cotangent, to float32 rounding."""
  config, model, _, state, batch, packed = packed_start(world_dir, world_data)
  packing = Packing(packed["packed_positions"], packed["packed_owner"])
  alone = lambda p: model.apply({"params": p}, batch["query_ids"], method=REALM.embed_queries)
  together = lambda p: model.apply({"params": p}, packed["packed_ids"], packing,
                                   packed["query_packed_row"], method=REALM.embed_packed_queries)
  cotangent = np.random.default_rng(0).normal(size=(len(batch["query_ids"]),
                                                     config.model.retrieval_dim))
  (first, vjp_alone), (second, vjp_together) = (
      jax.jit(lambda p, embed=embed: jax.vjp(embed, p))(state.params)
      for embed in (alone, together))
  np.testing.assert_allclose(second, first, rtol=1e-5, atol=1e-6)
  assert_same_gradients(vjp_alone(cotangent)[0]["retriever"],
                        vjp_together(cotangent)[0]["retriever"], rtol=1e-5)


@pytest.mark.slow   # two REALM train-step compiles on 8 devices
def test_a_packed_batch_gives_realms_loss_and_gradients(world_dir, world_data):
  """The step reads the packed queries when the batch has them (`steps.retrieval_logits`)."""
  config, model, mesh, state, batch, packed = packed_start(world_dir, world_data)
  full = loss_and_grads(config, model, state.params, batch, mesh)
  fast = loss_and_grads(config, model, state.params, packed, mesh)
  assert abs(full[0] - fast[0]) < 1e-5 * max(1.0, abs(full[0]))
  # At initialisation p(z|x) and p(z|x, y) nearly agree: the loss's gradient is their small
  # difference, in which the embeddings' last-bit differences weigh ~1e4 times more. A leaf
  # whose own gradient is mostly that residue (a LayerNorm bias: 1.4% of its largest entry on
  # a Zen 5 EPYC) is held to the gradient's overall scale, not to its own
  assert_same_gradients(full[2]["retriever"], fast[2]["retriever"], rtol=1e-2, per_leaf=False)


def assert_same_gradients(expected, actual, rtol: float, per_leaf: bool = True) -> None:
  """Every leaf within `rtol` of its largest entry (`per_leaf`), or of the largest entry of
  any leaf; the attention key bias's gradient (0 in exact arithmetic: a softmax does not move
  when every score moves alike) rounding alone."""
  scale = max(np.abs(g).max() for g in jax.tree.leaves(expected))
  assert scale > 0
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual)):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" in name:
      assert max(np.abs(a).max(), np.abs(b).max()) < 1e-6 * scale, name
    else:
      atol = rtol * (np.abs(a).max() if per_leaf else scale)
      np.testing.assert_allclose(b, a, rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("overrides", [
    dict(retrieval__packed_query_rows=-1),
    dict(retrieval__packed_query_rows=True),
    dict(retrieval__packed_query_rows=8),                           # [CLS] pooling
    dict(retrieval__packed_query_rows=16, model__retriever__pooling="mean"),   # batch 16
])
def test_packing_it_cannot_serve_is_refused_naming_the_option(world_dir, overrides):
  with pytest.raises(ConfigError) as e:
    validate(tiny_config("realm", None, world_dir, **overrides))
  assert e.value.option == "retrieval.packed_query_rows", str(e.value)
  with pytest.raises(ConfigError) as e:
    validate(tiny_config("ict", None, world_dir, retrieval__packed_query_rows=8,
                         model__retriever__pooling="mean"))
  assert e.value.option == "retrieval.packed_query_rows", str(e.value)


def test_rows_that_do_not_divide_the_data_axis_are_refused_at_start(world_dir, tmp_path):
  config = tiny_config("realm", None, world_dir, model__retriever__pooling="mean",
                       retrieval__packed_query_rows=6, data__query_len=WIDE)   # 8 devices
  with pytest.raises(ConfigError) as e:
    train(config, str(tmp_path / "run"))
  assert e.value.option == "retrieval.packed_query_rows" and "data axis (8)" in str(e.value)
  from realm_jax.config.validation import validate_against_mesh
  config.retrieval.packed_query_rows = 8
  validate_against_mesh(config, 8)   # however the processes hold the data axis's devices
  with pytest.raises(ConfigError, match=r"divide by the data axis \(16\)"):
    validate_against_mesh(config, 16)


@pytest.mark.slow   # end-to-end runs: the slow tier
def test_a_resumed_run_counts_the_batches_packed_before_its_checkpoint(world_dir, tmp_path):
  """The summary's `query_batches_packed` of a run resumed from step 2's checkpoint (copied
  alone: what a run killed after it leaves) counts steps 1 and 2's packed batches too, as
  the uninterrupted run's does (before, only the resumed run's own)."""
  config = tiny_config("realm", None, world_dir, model__retriever__pooling="mean",
                       retrieval__packed_query_rows=8, data__query_len=WIDE,
                       train__steps=4, train__checkpoint_every=2)
  whole = train(config, str(tmp_path / "whole"))
  assert whole["query_batches_packed"] == 4   # every pair of queries fits a row of WIDE
  os.makedirs(tmp_path / "resumed" / "checkpoints")
  shutil.copytree(tmp_path / "whole" / "checkpoints" / "2",
                  tmp_path / "resumed" / "checkpoints" / "2")
  resumed = train(config, str(tmp_path / "resumed"))
  assert resumed["query_batches_packed"] == 4

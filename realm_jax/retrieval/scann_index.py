"""The ScaNN backend of the block index: maximum inner product search on the host.

REALM (Guu et al., 2020, section 3.4) retrieves with MIPS over precomputed block embeddings
and uses ScaNN-style approximate search to keep it sub-linear in the corpus. Here the table
[num_blocks, dim] becomes a ScaNN searcher: a k-means tree (`num_leaves` partitions, of which
a query probes `leaves_to_search`), anisotropic asymmetric hashing (4-bit codes over
`dims_per_block` dimensions each) to score the probed blocks, and an exact float32 re-scoring
of the best `reorder` of them. The index-builder job builds and serializes it; the trainer
loads it with `ScannIndex.load` and searches it behind the same `search(query_emb, n)` as
`realm_jax.retrieval.index.ExactIndex`.

Builds are deterministic: the same table and settings give the same searcher bit for bit
(k-means++ seeding of the tree; ScaNN's default random centre initialisation is not
reproducible even with its clustering seed set).
"""

from __future__ import annotations

import math
import os

import numpy as np

from realm_jax.config.reading import uses_index_builder
from realm_jax.errors import ConfigError

# Below this many blocks an exhaustive float32 scan costs less than training a tree and is
# exact; ScaNN's k-means also wants >= MIN_LEAF_SAMPLE training points per leaf.
BRUTE_FORCE_BELOW = 2_000
MIN_LEAF_SAMPLE = 50
MAX_TRAINING_SAMPLE = 250_000
# The tree's k-means++ seeding costs leaves x rows x dim, sequentially: it trains on at most
# this many rows per leaf (1M blocks: 100k rows, ~20 s of a 1,000-leaf build on 2 cores).
TREE_SAMPLE_PER_LEAF = 100
# Leaves a query probes: a fraction of them, but never fewer than MIN_LEAVES_SEARCHED, since
# the leaves holding a query's top 10 grow far slower than the tree. On the demo's learned
# embeddings recall@10 vs exact was 0.92 probing 6 of 119 leaves (14k blocks), 0.97 with 12;
# 0.92 with 8 of 380 (144k blocks), 0.974 with 19 (1/20).
LEAVES_SEARCHED_FRACTION = 1 / 20
MIN_LEAVES_SEARCHED = 16
MIN_REORDER = 100
# The asymmetric hashing trains 16 centres (4-bit codes) per block of dimensions on a sample
# ScaNN draws row by row with probability training_sample / num_blocks: below 16 rows drawn
# its build fails ("Number of clusters per block (16) is greater than ... training data
# size"). A sample of the whole table is exact; a smaller one must leave a margin for the draw.
AH_CENTERS = 16
MIN_AH_SAMPLE = 64
# Anisotropic quantization weights errors parallel to a block by how much a query's score with
# it can exceed this threshold; ScaNN's advice is 0.2 for unit-norm rows, so the threshold is
# kept relative to the table's mean row norm (the towers end in a LayerNorm, not a unit norm).
ANISOTROPIC_THRESHOLD = 0.2


def check_corpus(config, num_blocks: int) -> None:
  """The builder's ScaNN settings for a corpus of `num_blocks`, refused (a ConfigError naming
  the option) when realm-train and realm-index start, not at the first build, after a
  checkpoint restored and every block embedded."""
  if config.retrieval.backend == "scann" and uses_index_builder(config):
    scann_settings(num_blocks, config.builder)


def scann_settings(num_blocks: int, index_config) -> dict:
  """The ScaNN settings for a table of `num_blocks` rows: `index_config`'s, 0s derived.

  Derivation (each applies only where the config field is 0):
    training_sample   min(num_blocks, 250,000) (a configured one is capped at num_blocks):
                      the hash codebooks train on this many rows, the tree on at most 100
                      per leaf of them.
    num_leaves        1 (no tree: an exact brute-force scan) below 2,000 blocks; else
                      round(sqrt(num_blocks)), at most training_sample / 50 so every leaf has
                      enough training rows. 1M blocks: 1,000 leaves of ~1,000 blocks.
    leaves_to_search  max(ceil(num_leaves / 20), min(num_leaves, 16)): a query scores ~5% of
                      the blocks with the hash codes (more below ~100k blocks), which kept
                      recall@10 vs exact >= 0.95 on clustered and learned embeddings while
                      searching >10x faster than an exact scan.
    reorder           max(100, num_blocks // 10,000): exact float32 re-scoring of the best
                      candidates by hash score; cheap next to the hashed scan (4x as many
                      did not change recall@10 on the demo's embeddings).
  With a tree (num_leaves > 1) the corpus needs >= 16 blocks and the sample >= min(64,
  num_blocks) rows: the hashing trains 16 centres on the rows ScaNN draws.
  `dims_per_block` is taken as is; `anisotropic_threshold` is ANISOTROPIC_THRESHOLD, relative
  to the mean row norm (`build_searcher` scales it).

  Args:
    num_blocks: rows of the table to index.
    index_config: the `config.builder` ConfigDict (num_leaves, leaves_to_search,
      training_sample, dims_per_block, reorder; 0 = derive).

  Returns:
    A plain dict with num_leaves, leaves_to_search, training_sample, dims_per_block,
    anisotropic_threshold and reorder (JSON-serializable, saved with each index version).
  """
  if num_blocks < 1:
    raise ValueError(f"cannot index {num_blocks} blocks")
  if index_config.training_sample < 0:
    raise ConfigError("builder.training_sample", f"must be >= 0, got "
                      f"{index_config.training_sample}")
  # A configured sample larger than the corpus means the whole corpus.
  sample = min(int(index_config.training_sample) or MAX_TRAINING_SAMPLE, num_blocks)
  leaves = int(index_config.num_leaves)
  if not leaves:
    leaves = 1 if num_blocks < BRUTE_FORCE_BELOW else max(
        2, min(round(math.sqrt(num_blocks)), sample // MIN_LEAF_SAMPLE))
  if leaves > 1 and num_blocks < AH_CENTERS:
    raise ConfigError("builder.num_leaves", f"{leaves}: a tree over {num_blocks} blocks, fewer "
                      f"than the {AH_CENTERS} rows its hashing trains on; use 0 (an exact scan)")
  if leaves > 1 and sample < min(MIN_AH_SAMPLE, num_blocks):
    raise ConfigError("builder.training_sample", f"{sample} rows cannot train the hashing's "
                      f"{AH_CENTERS} centres per block of dimensions: give >= "
                      f"{min(MIN_AH_SAMPLE, num_blocks)}, or 0 (the whole corpus)")
  if not 1 <= leaves <= sample:
    raise ConfigError("builder.num_leaves", f"{leaves} is not in [1, {sample}] (the training "
                      "sample: k-means needs a training row per leaf)")
  to_search = int(index_config.leaves_to_search) or max(
      math.ceil(leaves * LEAVES_SEARCHED_FRACTION), min(leaves, MIN_LEAVES_SEARCHED))
  if not 1 <= to_search <= leaves:
    raise ConfigError("builder.leaves_to_search", f"{to_search} is not in [1, {leaves}] "
                      "(num_leaves)")
  dims = int(index_config.dims_per_block)
  if dims < 1:
    raise ConfigError("builder.dims_per_block", f"must be >= 1, got {dims}")
  reorder = int(index_config.reorder) or max(MIN_REORDER, num_blocks // 10_000)
  if reorder < 1:
    raise ConfigError("builder.reorder", f"must be >= 1, got {reorder}")
  return {"num_leaves": leaves, "leaves_to_search": to_search, "training_sample": sample,
          "dims_per_block": dims, "anisotropic_threshold": ANISOTROPIC_THRESHOLD,
          "reorder": reorder}


def _scann():
  # Imported on use: only the builder job and a trainer with backend "scann" need ScaNN.
  from scann.scann_ops.py import scann_ops_pybind
  return scann_ops_pybind


def build_searcher(embeddings: np.ndarray, settings: dict, num_neighbors: int = 10):
  """A ScaNN dot-product searcher over `embeddings` (tree + asymmetric hashing + reorder).

  Args:
    embeddings: float32 [num_blocks, dim] block embeddings (host array).
    settings: `scann_settings(num_blocks, ...)`.
    num_neighbors: the searcher's default result count (`ScannIndex.search` passes its own).

  Returns:
    The `scann_ops_pybind.ScannSearcher`. With num_leaves 1 it is an exact float32 scan.
  """
  table = np.ascontiguousarray(embeddings, dtype=np.float32)
  if table.ndim != 2 or not len(table):
    raise ValueError(f"expected a non-empty [num_blocks, dim] table, got {table.shape}")
  builder = _scann().builder(table, num_neighbors, "dot_product")
  if settings["num_leaves"] <= 1:
    return builder.score_brute_force().build()
  sample = min(settings["training_sample"], len(table))
  tree_sample = min(sample, TREE_SAMPLE_PER_LEAF * settings["num_leaves"])
  threshold = settings["anisotropic_threshold"] * float(np.linalg.norm(table, axis=1).mean())
  # k-means++ seeding (random_init=False): ScaNN's random centre initialisation gives another
  # tree on every build of the same table, its clustering seed notwithstanding.
  return (builder
          .tree(settings["num_leaves"], settings["leaves_to_search"],
                training_sample_size=tree_sample, random_init=False)
          .score_ah(settings["dims_per_block"], anisotropic_quantization_threshold=threshold,
                    training_sample_size=sample)
          .reorder(settings["reorder"])
          .build())


def save_searcher(searcher, directory: str) -> None:
  """Serializes `searcher` into `directory`, which must exist and be empty."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{directory} is not a directory")
  if os.listdir(directory):
    raise ValueError(f"{directory} is not empty: serialize each index version into its own")
  # Relative paths in the assets manifest, so a published version can be moved or copied.
  searcher.serialize(directory, relative_path=True)


class ScannIndex:
  """ScaNN block index with the `BlockIndex` interface (see `realm_jax.retrieval.index`).

  Searches on the host: query embeddings are copied to numpy first.
  """

  def __init__(self, searcher, *, version: int, step: int, num_blocks: int, settings: dict):
    self.searcher = searcher
    self.version = version
    self.step = step
    self.num_blocks = num_blocks
    self.settings = dict(settings)

  @classmethod
  def load(cls, directory: str, *, version: int, step: int, num_blocks: int,
           settings: dict) -> ScannIndex:
    """The searcher `save_searcher` wrote to `directory`, as an index.

    Args:
      directory: the serialized searcher's directory.
      version: index version (increases with every rebuild).
      step: train step of the parameters the block embeddings came from.
      num_blocks: rows of the table it was built over (checked against the searcher).
      settings: the `scann_settings` it was built with (leaves_to_search, reorder).
    """
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"no ScaNN searcher at {directory}")
    try:
      searcher = _scann().load_searcher(directory)
    except RuntimeError as e:   # ScaNN's own, for a file cut short or gone (pruned mid-load)
      raise ValueError(f"ScaNN could not load the searcher in {directory}: {e}") from None
    if searcher.size() != num_blocks:
      raise ValueError(f"the searcher in {directory} holds {searcher.size()} blocks, "
                       f"expected {num_blocks}")
    return cls(searcher, version=version, step=step, num_blocks=num_blocks,
               settings=settings)

  def search(self, query_emb, n: int) -> np.ndarray:
    """Top-n block rows by inner product for each query, best first: [B, n] int64.

    Args:
      query_emb: [B, dim] query embeddings (numpy, or a jax array fetched to the host).
      n: blocks per query, at most num_blocks.
    """
    if n > self.num_blocks:
      raise ValueError(f"asked for {n} blocks from an index of {self.num_blocks}")
    queries = np.ascontiguousarray(query_emb, dtype=np.float32)
    if not len(queries):
      return np.zeros((0, n), np.int64)
    pre_reorder = max(self.settings["reorder"], n)
    rows, scores = self.searcher.search_batched(
        queries, final_num_neighbors=n, pre_reorder_num_neighbors=pre_reorder,
        leaves_to_search=self.settings["leaves_to_search"])
    rows = np.asarray(rows, np.int64)
    # The probed leaves can hold fewer than n blocks; ScaNN then pads with NaN scores. Those
    # queries are searched again over every leaf.
    short = np.isnan(np.asarray(scores)).any(axis=1)
    if short.any():
      rows[short] = np.asarray(self.searcher.search_batched(
          queries[short], final_num_neighbors=n, pre_reorder_num_neighbors=pre_reorder,
          leaves_to_search=self.settings["num_leaves"])[0], np.int64)
    return rows


def exact_top_n(queries: np.ndarray, embeddings: np.ndarray, n: int,
                chunk: int = 8192) -> np.ndarray:
  """Brute-force maximum inner product search on the host: [Q, n] int64 rows, best first.

  Scores are computed `chunk` blocks at a time and only each chunk's top n is merged into the
  running best, so memory stays at Q x chunk scores whatever the table size.

  Args:
    queries: [Q, dim] query embeddings.
    embeddings: [N, dim] block embeddings (a memory-mapped .npy is fine).
    n: rows per query, at most N.
    chunk: blocks scored per matmul.

  Returns:
    [Q, n] int64 block rows by decreasing inner product (equal scores: lower row first).
  """
  num_blocks = len(embeddings)
  if not 1 <= n <= num_blocks:
    raise ValueError(f"asked for {n} blocks from a table of {num_blocks}")
  queries = np.asarray(queries, np.float32)
  best_scores = np.zeros((len(queries), 0), np.float32)
  best_rows = np.zeros((len(queries), 0), np.int64)
  # best_rows stays ascending along each row, so a lower column is a lower block row and the
  # lowest column among equal scores (`_top_columns`) is the lowest row, across chunks too
  for start in range(0, num_blocks, chunk):
    scores = queries @ np.asarray(embeddings[start:start + chunk], np.float32).T
    top = _top_columns(scores, n)
    best_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, axis=1)], 1)
    best_rows = np.concatenate([best_rows, top + start], axis=1)
    keep = _top_columns(best_scores, n)
    best_scores = np.take_along_axis(best_scores, keep, axis=1)
    best_rows = np.take_along_axis(best_rows, keep, axis=1)
  order = np.lexsort((best_rows, -best_scores))
  return np.take_along_axis(best_rows, order, axis=1)


def _top_columns(scores: np.ndarray, n: int) -> np.ndarray:
  """Column indices of each row's n highest scores, ascending (all columns if <= n); of the
  scores equal to the n-th highest, the lowest columns."""
  if scores.shape[1] <= n:
    return np.broadcast_to(np.arange(scores.shape[1]), scores.shape)
  top = np.argpartition(-scores, n - 1, axis=1)[:, :n]
  picked = np.take_along_axis(scores, top, axis=1)
  cut = picked.min(axis=1, keepdims=True)
  # argpartition picks any of the columns tied at the cut: redo the rows where it left one out
  for i in np.flatnonzero((scores == cut).sum(1) > (picked == cut).sum(1)):
    above = np.flatnonzero(scores[i] > cut[i])
    top[i] = np.concatenate([above, np.flatnonzero(scores[i] == cut[i])[:n - len(above)]])
  return np.sort(top, axis=1)


def recall_at(approx: np.ndarray, exact: np.ndarray) -> float:
  """Mean over queries of |approx_i ∩ exact_i| / n: the share of the exact top n found.

  Args:
    approx: [Q, n] rows an approximate search returned.
    exact: [Q, n] the exact top-n rows.
  """
  approx, exact = np.asarray(approx), np.asarray(exact)
  if approx.shape != exact.shape or approx.ndim != 2:
    raise ValueError(f"shapes differ or are not [Q, n]: {approx.shape} vs {exact.shape}")
  if not approx.size:
    return 0.0
  hits = [len(np.intersect1d(a, e)) for a, e in zip(approx, exact)]
  return float(np.mean(hits)) / exact.shape[1]

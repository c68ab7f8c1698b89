"""The block and query embedders: what an index (re)build embeds every block with, and what a
query is embedded with at retrieval time (the trainer's input pipeline, the index builder's
checks, zero-shot retrieval, Open-QA). Jitted once per (model, kind, mesh, rules)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from realm_jax.models.realm import REALM
from realm_jax.runtime import partitioning


@functools.lru_cache(maxsize=None)
def _embedder(model: REALM, kind: str, mesh, rules):
  method = REALM.embed_queries if kind == "query" else REALM.embed_blocks
  fn = lambda params, *inputs: model.apply({"params": params}, *inputs, method=method)
  return jax.jit(fn, out_shardings=partitioning.batch_sharding(mesh))


def embed(model: REALM, mesh, config, params, kind: str, *inputs):
  """Query ([CLS] x [SEP]) or block embeddings with `params` (global arrays in and out)."""
  rules = partitioning.logical_rules(config.mesh.rules)
  with partitioning.mesh_rules(mesh, rules):
    return _embedder(model, kind, mesh, rules)(params, *inputs)


def block_embedder(model: REALM, mesh, config, retriever_params):
  """fn(ids, segments) on host arrays -> block embeddings with `retriever_params`: what an
  index (re)build (`retrieval.index.embed_blocks`) embeds every block with."""
  sharding = partitioning.batch_sharding(mesh)

  def embed_fn(ids, segments):
    return embed(model, mesh, config, {"retriever": retriever_params}, "block",
                 jax.device_put(ids, sharding), jax.device_put(segments, sharding))
  return embed_fn


def query_tower_params(retriever_params: dict) -> dict:
  """The part of the retriever params that embeds queries: the shared tower, or the query
  tower alone (what a published index carries next to its block embeddings)."""
  names = [n for n in ("tower", "query_tower") if n in retriever_params]
  if len(names) != 1:
    raise ValueError(f"retriever params with sub-trees {sorted(retriever_params)}: expected "
                     "'tower' (shared) or 'query_tower' + 'block_tower'")
  return {names[0]: retriever_params[names[0]]}


class QueryEncoder:
  """One snapshot's query tower on this process's devices: host `[CLS] x [SEP]` ids -> host
  embeddings. Process-local on purpose: retrieval runs in the input pipeline's thread and must
  never launch collectives across hosts next to the train step's."""

  def __init__(self, model: REALM, config, query_params: dict):
    self.model, self.config = model, config
    self.mesh = partitioning.make_mesh((-1, 1), jax.local_devices())
    self.params = jax.device_put({"retriever": partitioning.host_copy(query_params)},
                                 partitioning.replicated(self.mesh))

  def __call__(self, query_ids: np.ndarray) -> np.ndarray:
    return query_embeddings(self.model, self.mesh, self.config, self.params, query_ids)


def query_embeddings(model, mesh, config, params, query_ids: np.ndarray) -> np.ndarray:
  """This process's [b, dim] embeddings of its `[CLS] x [SEP]` rows with the query tower of
  `params` on `mesh` (the train mesh: every process calls it with the same number of rows; a
  process-local mesh: `QueryEncoder`)."""
  b, devices = len(query_ids), jax.local_device_count()
  padded = np.zeros((-(-b // devices) * devices, query_ids.shape[1]), np.int32)
  padded[:b] = query_ids
  ids = partitioning.global_batch({"ids": padded}, mesh)["ids"]
  return partitioning.local_rows(embed(model, mesh, config, params, "query", ids))[:b]

"""Retrieval indexes behind one interface, and the block-embedding pass that (re)builds them.

`BlockIndex.search(query_emb, n)` -> block rows [B, n], best first. The exact backend keeps the
embedding table on the devices, rows sharded over every device of the mesh, and does matmul +
top-k under jit. A ScaNN backend (the separate index-builder job) implements the same method.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from realm_jax.data.store import BlockStore
from realm_jax.train.partitioning import local_rows


class BlockIndex(Protocol):
  version: int        # increases with every rebuild
  step: int           # train step of the parameters the block embeddings came from
  num_blocks: int

  def search(self, query_emb: jax.Array, n: int) -> np.ndarray: ...


@dataclasses.dataclass
class ExactIndex:
  """Exact maximum inner product search: scores = Q T^T, top-n, on device."""

  table: jax.Array    # [num_padded, dim], rows sharded over all mesh devices; pad rows are 0
  num_blocks: int
  version: int
  step: int

  def search(self, query_emb: jax.Array, n: int) -> np.ndarray:
    """Top-n block rows for this process's queries ([B_local, n] numpy)."""
    if n > self.num_blocks:
      raise ValueError(f"asked for {n} blocks from an index of {self.num_blocks}")
    return local_rows(_top_n(query_emb, self.table, self.num_blocks, n))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _top_n(query_emb, table, num_blocks, n):
  scores = query_emb @ table.T
  valid = jnp.arange(table.shape[0]) < num_blocks
  scores = jnp.where(valid[None, :], scores, -jnp.inf)
  return jax.lax.top_k(scores, n)[1]


def embed_blocks(embed_fn, store: BlockStore, mesh: Mesh, batch_size: int,
                 log_prefix: str = "") -> tuple[jax.Array, float]:
  """Embeds every block with `embed_fn(ids, segments)` -> ([N_padded, dim] sharded table, s).

  Batches are padded to a multiple of the device count so every device embeds an equal share.
  """
  t0 = time.time()
  devices = mesh.devices.size
  batch_size = max(devices, batch_size // devices * devices)
  n = store.num_blocks
  chunks = []
  for start in range(0, n, batch_size):
    rows = np.arange(start, min(start + batch_size, n))
    pad = np.zeros(batch_size - len(rows), rows.dtype)
    padded = np.concatenate([rows, pad])
    ids = np.asarray(store.tokens[padded])
    emb = embed_fn(ids, store.segments(padded))
    chunks.append(emb[:len(rows)] if len(pad) else emb)
  table = jnp.concatenate(chunks)
  padded_n = -(-n // devices) * devices
  table = jnp.pad(table, ((0, padded_n - n), (0, 0)))
  table = jax.device_put(table, NamedSharding(mesh, P(mesh.axis_names)))
  table.block_until_ready()
  seconds = time.time() - t0
  if log_prefix:
    print(f"{log_prefix}embedded {n:,} blocks in {seconds:.1f}s ({n / seconds:,.0f} blocks/s)",
          flush=True)
  return table, seconds


def build_exact_index(embed_fn, store: BlockStore, mesh: Mesh, batch_size: int, step: int,
                      version: int, log_prefix: str = "") -> ExactIndex:
  """Embeds every block with the block tower behind `embed_fn` and wraps it as an index."""
  table, _ = embed_blocks(embed_fn, store, mesh, batch_size, log_prefix)
  return ExactIndex(table=table, num_blocks=store.num_blocks, version=version, step=step)

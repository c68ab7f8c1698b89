"""Retrieval indexes behind one interface, and the block-embedding pass that (re)builds them.

`BlockIndex.search(query_emb, n)` -> block rows [B, n], best first, for this process's queries
(host arrays in and out). Two backends:
  exact  matmul + top-k under jit, the table's rows sharded over this process's devices;
  scann  tree + asymmetric hashing + reorder on the host (`retrieval.scann_index`).
A `IndexVersion` pairs an index with the query encoder of the snapshot its block embeddings came
from, so retrieval scores queries and blocks of the same parameters (REALM's setup).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from realm_jax.data.prepared import BlockStore
from realm_jax.errors import NonFiniteError
from realm_jax.runtime import partitioning
from realm_jax.log import format_duration

logger = logging.getLogger(__name__)

PROGRESS_SECONDS = 10.0   # one progress line per this many seconds of embedding
COMPILE_FACTOR = 3.0   # a first batch this many times longer than the next ones: a compile
CHUNK = 256               # rows of the exact index's table scored by one matmul
# (batch, block shape, devices) of the embeddings this process ran: their block tower compiled
_EMBEDDED: set[tuple] = set()


class BlockIndex(Protocol):
  num_blocks: int

  def search(self, query_emb: np.ndarray, n: int) -> np.ndarray: ...


def local_mesh() -> Mesh:
  """This process's devices as a one-axis mesh: retrieval never waits on other hosts."""
  return Mesh(np.asarray(jax.local_devices()), ("blocks",))


@dataclasses.dataclass
class ExactIndex:
  """Exact maximum inner product search: scores = Q T^T, top-n, on this process's devices.

  The table is held in chunks of CHUNK rows and scored chunk by chunk (one einsum), so a block's
  score does not depend on how many devices share the table: XLA's CPU matmul rounds
  differently for different shard shapes, and a host with 4 devices must retrieve exactly what
  a host with 8 does.
  """

  table: jax.Array    # [num_chunks, CHUNK, dim], chunks sharded over the local devices; pad 0
  num_blocks: int

  @classmethod
  def from_embeddings(cls, embeddings: np.ndarray) -> ExactIndex:
    """[num_blocks, dim] host embeddings -> the table, padded to whole chunks per device."""
    mesh = local_mesh()
    n, devices = embeddings.shape[0], mesh.devices.size
    chunks = -(-n // (devices * CHUNK)) * devices
    padded = np.zeros((chunks * CHUNK, embeddings.shape[1]), np.float32)
    padded[:n] = embeddings
    table = jax.device_put(padded.reshape(chunks, CHUNK, -1), NamedSharding(mesh, P("blocks")))
    return cls(table=table, num_blocks=n)

  def search(self, query_emb: np.ndarray, n: int) -> np.ndarray:
    """Top-n block rows ([B, n] numpy) for host query embeddings [B, dim]."""
    if n > self.num_blocks:
      raise ValueError(f"asked for {n} blocks from an index of {self.num_blocks}")
    queries = jax.device_put(np.asarray(query_emb, np.float32),
                             NamedSharding(self.table.sharding.mesh, P()))
    return np.asarray(_top_n(queries, self.table, self.num_blocks, n))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _top_n(query_emb, table, num_blocks, n):
  scores = jnp.einsum("bd,ncd->bnc", query_emb, table).reshape(query_emb.shape[0], -1)
  valid = jnp.arange(scores.shape[1]) < num_blocks
  scores = jnp.where(valid[None, :], scores, -jnp.inf)
  return jax.lax.top_k(scores, n)[1]


@dataclasses.dataclass
class IndexVersion:
  """One index version as the trainer retrieves from it.

  Attributes:
    version: the published version number (in-process rebuilds count from 0).
    step: train step of the parameters both the block embeddings and `encode_queries` are.
    index: the block index.
    encode_queries: fn(query_ids [B, L] host) -> [B, dim] host, the query tower of `step`.
    embeddings: the blocks' embeddings [num_blocks, dim] on the host (what a step reads
      when `retrieval.block_gradients` is False), or None.
  """

  version: int
  step: int
  index: BlockIndex
  encode_queries: Callable[[np.ndarray], np.ndarray]
  embeddings: np.ndarray | None = None

  def retrieve(self, query_ids: np.ndarray, n: int) -> np.ndarray:
    """Top-n block rows for `[CLS] x [SEP]` queries (this process's rows)."""
    return self.index.search(self.encode_queries(query_ids), n)


class EmbeddingStopped(Exception):
  """`embed_blocks` gave up between two batches because `should_stop()` said so."""

  def __init__(self, done: int, total: int):
    super().__init__(f"stopped after {done:,} of {total:,} blocks")
    self.done, self.total = done, total


def device_batch(batch_size: int, devices: int) -> int:
  """`batch_size` rounded down to a multiple of `devices` (at least one row each): every device
  embeds an equal share of each batch."""
  return max(devices, batch_size // devices * devices)


def embed_blocks(embed_fn, store: BlockStore, mesh: Mesh, batch_size: int,
                 log_prefix: str = "", should_stop: Callable[[], bool] | None = None,
                 timings: dict | None = None) -> tuple[np.ndarray, float]:
  """Embeds every block with `embed_fn(ids, segments)` -> ([num_blocks, dim] host, seconds).

  Batches are padded to a multiple of the device count so every device embeds an equal share;
  one batch is in flight while the previous one is copied out. With `log_prefix`, prints a
  progress line (blocks/s, ETA) every PROGRESS_SECONDS and a final one. `should_stop` is asked
  after every batch; True raises EmbeddingStopped (a SIGTERM: the trainer saves its step).
  The first batch of a process's first embedding in these shapes is waited for and timed on
  its own: it compiles the block tower, which blocks/s leaves out and the final line says apart
  (`embedding_rate`). A later call's first batch compiles nothing: one that is slow (a train
  step still running on the devices) is no compile, and not said as one.
  `timings` gets `embed_seconds`, `compile_seconds` and `blocks_per_second`.
  """
  t0 = last = time.time()
  batch_size = device_batch(batch_size, mesh.devices.size)
  n = store.num_blocks
  if log_prefix:
    logger.info(f"{log_prefix}embedding {n:,} blocks in batches of {batch_size}")
  out = None
  pending = None   # (start, count, device array) of the batch in flight

  def drain(item):
    nonlocal out
    start, count, emb = item
    emb = partitioning.host_array(emb)[:count]   # every host gets every block's embedding
    bad = ~np.isfinite(emb).all(axis=1)
    if bad.any():
      raise NonFiniteError(
          f"{log_prefix}the embeddings of {int(bad.sum())} of blocks {start}..{start + count - 1}"
          f" are not finite (first: block {start + int(np.argmax(bad))}): the block tower's "
          f"parameters have diverged; nothing is indexed")
    if out is None:
      out = np.empty((n, emb.shape[1]), np.float32)
    out[start:start + count] = emb

  shapes = (batch_size, store.tokens.shape[1:], tuple(mesh.device_ids.flat))
  compiles = shapes not in _EMBEDDED
  first = None   # (seconds, rows) of the first batch, where it compiles the block tower
  for start in range(0, n, batch_size):
    rows = np.arange(start, min(start + batch_size, n))
    padded = np.concatenate([rows, np.zeros(batch_size - len(rows), rows.dtype)])
    emb = embed_fn(np.asarray(store.tokens[padded]), store.segments(padded))
    if compiles and first is None:
      jax.block_until_ready(emb)   # its seconds its own
      first = (time.time() - t0, len(rows))
      _EMBEDDED.add(shapes)
    if pending is not None:
      drain(pending)
    pending = (start, len(rows), emb)
    if should_stop is not None and should_stop():
      raise EmbeddingStopped(start, n)
    now = time.time()
    # a rate needs blocks on the host past a first batch that compiles (the one just sent
    # may still be embedded): before them, its blocks/s and ETA would be the compile's
    done = start
    if log_prefix and now - last >= PROGRESS_SECONDS and done > (first or (0, 0))[1]:
      rate = embedding_rate(done, now - t0, first)[0]
      logger.info(f"{log_prefix}embedded {done:,}/{n:,} blocks ({done / n:.0%}) | {rate:,.0f} "
                  f"blocks/s ETA {format_duration((n - done) / rate)}")
      last = now
  drain(pending)
  seconds = time.time() - t0
  rate, compiled = embedding_rate(n, seconds, first)
  if log_prefix:
    said = f", after {compiled:.1f}s compiling the block tower" if compiled else ""
    logger.info(f"{log_prefix}embedded {n:,} blocks in {seconds:.1f}s ({rate:,.0f} blocks/s"
                f"{said})")
  if timings is not None:
    timings.update(embed_seconds=round(seconds, 3), compile_seconds=round(compiled, 3),
                   blocks_per_second=round(rate, 1))
  return out, seconds


def embedding_rate(n: int, seconds: float,
                   first: tuple[float, int] | None) -> tuple[float, float]:
  """(blocks/s, seconds of compile) of `n` blocks embedded in `seconds`, `first` the
  (seconds, rows) of a first batch that may have compiled the block tower (None: it did not):
  a first batch COMPILE_FACTOR times longer than the next ones' mean compiled it, and blocks/s
  is the next ones' (its compile: the time over theirs); else, or where it was the only one,
  all of them (no compile said)."""
  if first is None:
    return n / max(seconds, 1e-9), 0.0
  first_seconds, first_rows = first
  rest, rest_seconds = n - first_rows, max(seconds - first_seconds, 1e-9)
  # one batch's, after the first: a short last one is padded to a full batch, and as long
  batch_seconds = rest_seconds / max(-(-rest // first_rows), 1)
  if rest <= 0 or first_seconds < COMPILE_FACTOR * batch_seconds:
    return n / max(seconds, 1e-9), 0.0
  return rest / rest_seconds, first_seconds - batch_seconds

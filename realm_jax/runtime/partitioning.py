"""Mesh, logical-axis rules and global arrays.

Parameters carry logical names (vocab, embed, heads, mlp, hidden, retrieval, position,
segment); activations use (batch, length, embed): config/defaults.py's LOGICAL_AXES, which
`validate` checks each rule against. `config.mesh.rules` maps them to the mesh
axes `data` and `model`; the default rules shard the batch over `data` and vocab / heads / mlp
over `model` (tensor parallel) and replicate the rest. No default rule shards parameters over
`data` (FSDP); a rule such as ("embed", "data") would.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from realm_jax.config.defaults import MESH_AXES
from realm_jax.config.validation import check_mesh_shape
from realm_jax.errors import ConfigError


def resolve_mesh_shape(shape: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Fills one -1 with the rest of the devices; checks the product equals the device count."""
  shape = tuple(int(s) for s in shape)
  check_mesh_shape(shape)
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if num_devices % known:
      raise ConfigError("mesh.shape", f"{shape} does not divide {num_devices} devices")
    shape = tuple(num_devices // known if s == -1 else s for s in shape)
  if int(np.prod(shape)) > num_devices:
    raise ConfigError("mesh.shape", f"{shape} needs {int(np.prod(shape))} devices, "
                      f"but {num_devices} are available")
  if int(np.prod(shape)) < num_devices:
    raise ConfigError("mesh.shape", f"{shape} uses {int(np.prod(shape))} devices, but a mesh "
                      f"must use all {num_devices} available")
  return shape


@contextlib.contextmanager
def mesh_rules(mesh: Mesh, rules):
  """The mesh and the logical-axis rules in force while tracing a step (activation constraints
  by logical name resolve against both)."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def make_mesh(shape: Sequence[int], devices: Sequence[Any] | None = None) -> Mesh:
  devices = list(devices if devices is not None else jax.devices())
  shape = resolve_mesh_shape(shape, len(devices))
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_rules(config_rules) -> tuple[tuple[str, Any], ...]:
  """Config rules (list of [logical, mesh axis or None]) as flax's rules tuple."""
  return tuple((str(name), None if axis in (None, "", "none") else axis)
               for name, axis in config_rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dim split over `data`; replicated over `model`."""
  return NamedSharding(mesh, P("data"))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """This process's rows -> global arrays sharded over `data` (multi-host safe): the rows of
  its share of the batch (`data_share`), as `pipeline.process_batches` builds them for it;
  processes that share data shards (the `model` axis spans them) pass the same rows."""
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v))
          for k, v in local.items()}


def data_shares(processes: np.ndarray) -> dict[int, tuple[tuple[int, ...], int]]:
  """Which rows of every global batch each process loads, from the process of each device of
  a [data, model] mesh: {process: (shards, D)}, the sorted data shards its devices hold of the
  D (the data axis), shard i being the rows [i * B / D, (i + 1) * B / D). A process loads
  those shards' rows one after the other, the order in which
  `jax.make_array_from_process_local_data` hands them to its devices, so processes whose
  devices hold the same data shards (the `model` axis spans them) load the same rows, and
  devices interleaved by process (process 0 holding shards 0, 1, 4, 5) get their own."""
  processes = np.asarray(processes)
  if processes.ndim != 2:
    raise ValueError(f"expected a [data, model] array of process ids, got {processes.shape}")
  shares = {int(p): tuple(int(i) for i in np.flatnonzero((processes == p).any(axis=1)))
            for p in np.unique(processes)}
  for p, shards in shares.items():   # what JAX can assemble: equal or disjoint, one size
    for q, others in shares.items():
      if len(shards) != len(others) or (shards != others and set(shards) & set(others)):
        raise ConfigError("mesh.shape", f"{processes.shape}: process {p} holds data shards "
                          f"{list(shards)} and process {q} {list(others)}; every two processes "
                          "must hold the same data shards or none in common, as many each "
                          "(put the `model` axis within a process, or across whole processes)")
  return {p: (shards, processes.shape[0]) for p, shards in shares.items()}


def mesh_processes(mesh: Mesh) -> np.ndarray:
  """The process of each device of `mesh`."""
  return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def data_share(mesh: Mesh) -> tuple[tuple[int, ...], int]:
  """(shards, D): this process's data shards of every global batch on `mesh`
  (`data_shares`)."""
  return data_shares(mesh_processes(mesh))[jax.process_index()]


def process_share(full: dict[str, np.ndarray], mesh: Mesh) -> dict[str, np.ndarray]:
  """This process's rows of a batch every process holds whole (the input of `global_batch`)."""
  shards, count = data_share(mesh)
  if len(shards) == count:
    return full
  return {k: np.concatenate([v[len(v) // count * i:len(v) // count * (i + 1)] for i in shards])
          for k, v in full.items()}


def host_array(x) -> np.ndarray:
  """The whole value of a (possibly sharded, possibly multi-host) array on this host; across
  hosts it is a collective, so every process must call it at the same point."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def host_copy(tree):
  """`host_array` of every leaf."""
  return jax.tree.map(host_array, tree)


def local_rows(x: jax.Array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, in global order."""
  if jax.process_count() == 1:
    return np.asarray(x)
  shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
  seen, rows = set(), []
  for s in shards:
    start = s.index[0].start or 0
    if start not in seen:
      seen.add(start)
      rows.append(np.asarray(s.data))
  return np.concatenate(rows)

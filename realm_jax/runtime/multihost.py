"""Multi-host start-up: one guarded `jax.distributed.initialize`, and barriers with timeouts.

Every entry point that runs on a pod (realm-train, realm-index) calls `initialize_from_flags()`
before touching a device. One switch, `--multihost`:
  off   one process (the default off a TPU pod);
  on    explicit topology: --coordinator_address / --num_processes / --process_id, each of which
        may come from REALM_COORDINATOR_ADDRESS / REALM_NUM_PROCESSES / REALM_PROCESS_ID;
  auto  (default) `on` when a coordinator is given by flag or environment; else JAX's own
        cluster detection when it finds a cluster (TPU VM slice, GKE TPU pod, SLURM, Open MPI);
        else `off`.

Failures are never swallowed. A coordinator that does not accept connections within
--init_timeout is an error naming its address; a job that does not form within it (a process
never connected) is a one-line error naming the processes it lacks, before JAX's abort (under
JAX's cluster detection, which may wait as long again for the coordinator's host first, only
once twice --init_timeout has passed: `join_seconds`). Once connected, a process that stops
sending heartbeats for --heartbeat_timeout seconds makes JAX abort every other process with "The
following tasks are unhealthy (stopped sending heartbeats): N" (N = the lost process id), or,
when the lost one is the coordinator (process 0), with "the leader task was preempted/died".
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from typing import Callable, Mapping

from absl import flags

from realm_jax.errors import ConfigError

logger = logging.getLogger(__name__)

ENV = {"coordinator_address": "REALM_COORDINATOR_ADDRESS", "num_processes": "REALM_NUM_PROCESSES",
       "process_id": "REALM_PROCESS_ID"}

_MODE = flags.DEFINE_enum("multihost", "auto", ["auto", "on", "off"],
                          "Multi-process start-up: auto | on (explicit topology) | off.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (env REALM_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Number of processes (env REALM_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "This process's id in [0, num_processes) (env REALM_PROCESS_ID).")
_INIT_TIMEOUT = flags.DEFINE_integer("init_timeout", 300, "Seconds to wait for the coordinator "
                                     "and every process to connect.")
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer("heartbeat_timeout", 100, "Seconds without heartbeats "
                                          "after which a process counts as lost.")

_initialized: Topology | None = None


@dataclasses.dataclass(frozen=True)
class Topology:
  """How this process joins the job (`coordinator_address` None: JAX's cluster detection)."""

  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  init_timeout: int
  heartbeat_timeout: int
  cluster: str | None = None   # what JAX's detection found, when it supplies the topology


def detected_cluster() -> str | None:
  """The cluster JAX's own detection finds (a TPU VM slice via its metadata server, GKE TPU,
  SLURM, Open MPI, Kubernetes), or None. Imports jax but initialises no backend."""
  from jax._src import clusters
  for env in clusters.ClusterEnv._cluster_types:
    if not env.opt_in_only_method and env.is_env_present():
      return env.__name__
  return None


def resolve(mode: str = "auto", coordinator_address: str | None = None,
            num_processes: int | None = None, process_id: int | None = None,
            init_timeout: int = 300, heartbeat_timeout: int = 100,
            environ: Mapping[str, str] | None = None,
            detect: Callable[[], str | None] = detected_cluster) -> Topology | None:
  """The topology from flags (first) or environment; None for a single process.

  Raises ConfigError naming the flag (or variable) that is missing or out of range.
  """
  environ = os.environ if environ is None else environ
  given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
           "process_id": process_id}
  source = {k: f"--{k}" for k in given}
  for key, var in ENV.items():
    if given[key] is None and environ.get(var, "") != "":
      given[key], source[key] = environ[var], var
  if mode not in ("auto", "on", "off"):
    raise ConfigError("", f"--multihost={mode!r}: expected auto | on | off")
  if mode == "off":
    return None
  for key, seconds in (("init_timeout", init_timeout), ("heartbeat_timeout", heartbeat_timeout)):
    if int(seconds) <= 0:
      raise ConfigError("", f"--{key}={seconds} must be a positive number of seconds")
  explicit = given["coordinator_address"] is not None
  if mode == "auto" and not explicit:
    stray = [source[k] for k in ("num_processes", "process_id") if given[k] is not None]
    if stray:
      raise ConfigError("", f"{' and '.join(stray)} need{'s' if len(stray) == 1 else ''} "
                        f"--coordinator_address (or "
                        f"{ENV['coordinator_address']}): without it they would be ignored")
    cluster = detect()
    if cluster is None:
      return None
    return Topology(None, None, None, int(init_timeout), int(heartbeat_timeout), cluster)
  missing = [f"--{k} (or {ENV[k]})" for k, v in given.items() if v is None]
  if missing:
    needs = "--multihost=on" if mode == "on" else \
        f"{source['coordinator_address']} (--multihost=auto with a coordinator)"
    raise ConfigError("", f"{needs} needs " + ", ".join(missing))
  address = str(given["coordinator_address"])
  host, _, port = address.rpartition(":")
  if not host or not port.isdigit():
    raise ConfigError("", f"{source['coordinator_address']}={address!r}: expected host:port")
  if not 1 <= int(port) <= 65535:
    raise ConfigError("", f"{source['coordinator_address']}={address!r}: port {int(port)} "
                      "is out of range (1 to 65535)")
  values = {}
  for key in ("num_processes", "process_id"):
    try:
      values[key] = int(given[key])
    except ValueError:
      raise ConfigError("", f"{source[key]}={given[key]!r} is not an integer") from None
  if values["num_processes"] < 1:
    raise ConfigError("", f"{source['num_processes']}={values['num_processes']} must be >= 1")
  if not 0 <= values["process_id"] < values["num_processes"]:
    raise ConfigError("", f"{source['process_id']}={values['process_id']} is out of range: "
                      f"process ids run from 0 to {values['num_processes'] - 1} "
                      f"({source['num_processes']}={values['num_processes']})")
  return Topology(address, values["num_processes"], values["process_id"], int(init_timeout),
                  int(heartbeat_timeout))


def _wait_for_coordinator(address: str, timeout: float) -> None:
  """Until `address` accepts a TCP connection; ConnectionError naming it after `timeout`."""
  host, _, port = address.rpartition(":")
  deadline, last_error = time.time() + timeout, None
  while time.time() < deadline:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
        return
    except OSError as e:
      last_error = e
      time.sleep(0.5)
  raise ConnectionError(f"the coordinator {address} did not answer within {timeout:g}s "
                        f"(--init_timeout; last error: {last_error}). Is process 0 running with "
                        "--coordinator_address pointing at it?")


def initialize(topology: Topology | None) -> None:
  """Joins the job once. A second call with the same topology is a no-op; a different one is an
  error (JAX can join only one job per process)."""
  global _initialized
  if topology is None:
    return
  if _initialized is not None:
    if _initialized != topology:
      raise RuntimeError(f"jax.distributed is already initialized as {_initialized}, "
                         f"not {topology}")
    return
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")   # CPU processes: gloo
  waits = (f"waiting up to {topology.init_timeout}s (--init_timeout) for every process to "
           f"connect; heartbeat timeout {topology.heartbeat_timeout}s (--heartbeat_timeout)")
  if topology.coordinator_address is None:
    logger.info(f"[multihost] joining the {topology.cluster} job (JAX's cluster detection, "
                f"which first waits up to {topology.init_timeout}s for the coordinator's host "
                f"to be known): {waits}")
    with _join_deadline(topology):
      jax.distributed.initialize(initialization_timeout=topology.init_timeout,
                                 heartbeat_timeout_seconds=topology.heartbeat_timeout,
                                 shutdown_timeout_seconds=topology.heartbeat_timeout)
  else:
    served = " (served by this process)" if topology.process_id == 0 else ""
    logger.info(f"[multihost] process {topology.process_id} of {topology.num_processes}: "
                f"joining the job at the coordinator {topology.coordinator_address}{served}, "
                f"{waits}")
    if topology.process_id != 0:
      # JAX aborts the process (no exception, no address) when the coordinator never answers.
      _wait_for_coordinator(topology.coordinator_address, topology.init_timeout)
    with _join_deadline(topology):
      jax.distributed.initialize(topology.coordinator_address, topology.num_processes,
                                 topology.process_id,
                                 initialization_timeout=topology.init_timeout,
                                 heartbeat_timeout_seconds=topology.heartbeat_timeout,
                                 shutdown_timeout_seconds=topology.heartbeat_timeout)
  _initialized = topology
  logger.info(f"[multihost] process {jax.process_index()} of {jax.process_count()}: "
              f"{jax.local_device_count()} local / {jax.device_count()} global devices")
  check_device_counts([d.process_index for d in jax.devices()])


JOIN_GRACE_SECONDS = 2.0   # past the join's time: JAX has given the join up, and aborts 5 s later


def join_seconds(topology: Topology) -> int:
  """The most `jax.distributed.initialize` takes on a healthy start: --init_timeout for every
  process to connect, and under JAX's cluster detection as long again before that (a pod host
  waits up to --init_timeout for the coordinator's host name to resolve: hosts boot at their
  own pace, and the join's own --init_timeout starts only after)."""
  detection = topology.init_timeout if topology.coordinator_address is None else 0
  return detection + topology.init_timeout


@contextlib.contextmanager
def _join_deadline(topology: Topology):
  """Around `jax.distributed.initialize`: if it has not returned JOIN_GRACE_SECONDS after
  `join_seconds`, a process of the job never connected, and JAX is about to abort this one
  with a C++ check failure that names neither it nor the option: the process ends first,
  with one line that does (exit 1)."""
  joined = threading.Event()

  def expire() -> None:
    if not joined.wait(join_seconds(topology) + JOIN_GRACE_SECONDS):
      print(f"[multihost] error: {_not_joined(topology)}", file=sys.stderr, flush=True)
      os._exit(1)
  threading.Thread(target=expire, name="multihost-join-deadline", daemon=True).start()
  try:
    yield
  finally:
    joined.set()


def _not_joined(topology: Topology) -> str:
  """What a join that ran out of --init_timeout says: the processes that may be missing."""
  if topology.coordinator_address is None:
    return (f"the {topology.cluster} job did not form within {join_seconds(topology)}s "
            f"(--init_timeout={topology.init_timeout} for JAX's cluster detection, then as long "
            "for every process to connect): not every process of it connected")
  me, count = topology.process_id, topology.num_processes
  others = [p for p in range(1, count) if p != me]
  if not others:
    missing = f"it did not admit this process (is process 0 started with --num_processes={count}?)"
  elif len(others) == 1:
    missing = f"process {others[0]} never connected"
  else:
    missing = (f"not every one of processes 1 to {count - 1}"
               f"{' other than this one' if me else ''} connected")
  return (f"process {me} of {count}: the job did not form at the coordinator "
          f"{topology.coordinator_address} within {topology.init_timeout}s (--init_timeout): "
          f"{missing}; start every process with --coordinator_address="
          f"{topology.coordinator_address} --num_processes={count} and its own --process_id")


def check_device_counts(device_processes: list[int]) -> None:
  """Every process of the job has as many devices as the others (`device_processes`: the
  process of each device of the job); ConfigError naming each process's count otherwise."""
  counts = collections.Counter(device_processes)
  if len(set(counts.values())) > 1:
    raise ConfigError("", "the processes have unequal local device counts (" + ", ".join(
        f"process {p}: {n}" for p, n in sorted(counts.items())) + "): every process of a "
        "job needs the same number of devices")


def initialize_from_flags() -> Topology | None:
  """`initialize(resolve(<the --multihost flags>))`; returns the topology (None: one process)."""
  topology = resolve(_MODE.value, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                     _INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value)
  initialize(topology)
  return topology


def barrier_timeout() -> int:
  """Seconds any cross-process wait may take (the heartbeat timeout of the job)."""
  return _initialized.heartbeat_timeout if _initialized is not None else 300


_barriers = 0


def barrier(name: str, timeout: float | None = None) -> None:
  """Waits until every process reaches barrier `name` (each call is a new barrier); an error
  naming it after `timeout` seconds (default: the heartbeat timeout)."""
  import jax
  global _barriers
  if jax.process_count() == 1:
    return
  from jax._src import distributed
  _barriers += 1
  timeout = barrier_timeout() if timeout is None else timeout
  try:
    distributed.global_state.client.wait_at_barrier(f"realm-{name}-{_barriers}",
                                                    int(timeout * 1000))
  except Exception as e:  # noqa: BLE001  (re-raised with the barrier's name)
    raise RuntimeError(f"process {jax.process_index()} of {jax.process_count()}: barrier "
                       f"{name!r} not reached by every process within {timeout:g}s: {e}") from e


def on_every_process(flag: bool) -> bool:
  """Whether `flag` holds on every process of the job: each process asks with its own, and
  all get the one answer (a collective: every process calls it at the same point)."""
  return not processes_where_not(flag)


def processes_where_not(flag: bool) -> list[int]:
  """The processes on which `flag` does not hold (every process gets the one list; a
  collective: every process calls it at the same point)."""
  import jax
  if jax.process_count() == 1:
    return [] if flag else [0]
  import numpy as np
  from jax.experimental import multihost_utils
  flags = np.asarray(multihost_utils.process_allgather(np.asarray(flag, np.int32))).reshape(-1)
  return [i for i, f in enumerate(flags) if not f]


def first_process_list(values: list[int]) -> list[int]:
  """Process 0's list of ints on every process (each passes its own; a collective)."""
  import jax
  if jax.process_count() == 1:
    return [int(v) for v in values]
  import numpy as np
  from jax.experimental import multihost_utils
  count = int(multihost_utils.broadcast_one_to_all(np.asarray(len(values), np.int32)))
  padded = np.full(count, -1, np.int32)
  padded[:min(count, len(values))] = np.asarray(values[:count], np.int32)
  return [int(v) for v in multihost_utils.broadcast_one_to_all(padded)]


_exchanges = 0


def every_process(name: str, value: str, timeout: float | None = None) -> list[str]:
  """Every process's `value`, in process order, on every process (each call is a new
  exchange; every process calls it at the same point), through the coordination service's
  key-value store: values of any length, even where the processes disagree on them. An error
  naming `name` after `timeout` seconds (default: `io_wait_timeout()`, since a process may
  open its data slower than the others)."""
  import jax
  if jax.process_count() == 1:
    return [value]
  from jax._src import distributed
  global _exchanges
  _exchanges += 1
  me, client = jax.process_index(), distributed.global_state.client
  key = f"realm-{name}-exchange-{_exchanges}"
  client.key_value_set(f"{key}/{me}", value)
  timeout = io_wait_timeout() if timeout is None else timeout
  try:
    return [value if p == me else sliced_get(client, f"{key}/{p}", timeout)
            for p in range(jax.process_count())]
  except (jax.errors.JaxRuntimeError, TimeoutError) as e:
    raise RuntimeError(f"process {me} of {jax.process_count()}: not every process sent its "
                       f"{name!r} within {timeout:g}s: {e}") from e


def disagreements(values: list[dict[str, str]]) -> dict[str, list[int]]:
  """{key: the processes whose value differs from process 0's} for every key on which the
  processes' `values` (one dict a process, in process order) disagree."""
  keys = sorted(set().union(*values))
  found = {k: [p for p, v in enumerate(values) if v.get(k) != values[0].get(k)] for k in keys}
  return {k: ps for k, ps in found.items() if ps}


_shared = 0
LONG_WAIT_SECONDS = 7 * 24 * 3600.0   # a wait by design as long as process 0 lives (its death
                                      # ends the job by heartbeat): realm-index's decisions


def io_wait_timeout() -> float:
  """Seconds a process waits for what process 0 alone writes (or for the others to arrive
  at an exchange): the heartbeat timeout plus twice the storage patience
  ($REALM_JAX_STORAGE_PATIENCE), so slow storage is waited out, while processes that took
  different paths (one in a device collective, one waiting here) fail instead of hanging."""
  from realm_jax import paths
  return barrier_timeout() + 2 * paths.patience()


BULK_IO_SECONDS = 4 * 3600.0   # the least wait for process 0's bulk writes (`bulk_io_timeout`)


def bulk_io_timeout() -> float:
  """Seconds a process waits for process 0's bulk writes (an index's block embeddings, a
  checkpoint moved aside in a bucket): a healthy transfer of gigabytes may outlast the
  storage patience, which bounds silence, not size; at least BULK_IO_SECONDS."""
  return max(io_wait_timeout(), BULK_IO_SECONDS)


def from_first_process(name: str, value: int | None, timeout: float | None = None) -> int:
  """Process 0's `value` on every process, the others passing None and waiting for it (each
  call is a new one): a decision that all processes act on, through the coordination
  service's key-value store, not a device collective, so the others may wait while process 0
  works alone: up to `timeout` seconds (default `io_wait_timeout()`; realm-index waits
  LONG_WAIT_SECONDS for process 0's next decision)."""
  import jax
  if jax.process_count() == 1:
    return int(value)
  from jax._src import distributed
  global _shared
  _shared += 1
  key, client = f"realm-{name}-{_shared}", distributed.global_state.client
  timeout = io_wait_timeout() if timeout is None else timeout
  if jax.process_index() == 0:
    client.key_value_set(key, str(int(value)))
    return int(value)
  try:
    return int(sliced_get(client, key, timeout))
  except (jax.errors.JaxRuntimeError, TimeoutError) as e:   # the wait's end, or the job's
    raise RuntimeError(f"process {jax.process_index()} of {jax.process_count()}: no {name!r} "
                       f"from process 0 within {timeout:g}s (it may have ended, or taken "
                       f"another path): {e}") from e


WAIT_SLICE_SECONDS = 1.0   # a long wait's polls: between two, signal handlers run
FIRST_SLICE_SECONDS = 0.005   # a short wait's (an exchange whose processes are all there)


def sliced_get(client, key: str, timeout: float) -> str:
  """The coordination service's value of `key`, asked for until `timeout` seconds have
  passed: after FIRST_SLICE_SECONDS, then twice as long each time up to WAIT_SLICE_SECONDS
  (an exchange between steps costs milliseconds, not half a second). Each ask returns at
  once (`key_value_try_get`), and the wait between two is a `time.sleep`, so a SIGTERM's
  Python handler (realm-index stops at once) runs during it; a blocking get would hold the
  main thread in C++, and one cut into slices leaves the coordination service a callback for
  every slice that timed out (memory that grows through an hours-long wait). TimeoutError
  naming `key` after `timeout`; JaxRuntimeError at once on another error than the key's
  absence (the job ending)."""
  deadline, pause = time.monotonic() + timeout, FIRST_SLICE_SECONDS
  while (value := try_get(client, key)) is None:
    left = deadline - time.monotonic()
    if left <= 0:
      raise TimeoutError(f"{key!r} not set within {timeout:g}s")
    time.sleep(min(left, pause, WAIT_SLICE_SECONDS))
    pause *= 2
  return value


def try_get(client, key: str) -> str | None:
  """The coordination service's value of `key`, None while it is not set (one ask, answered
  at once); JaxRuntimeError on another error than the key's absence (the job ending)."""
  import jax
  try:
    return client.key_value_try_get(key)
  except jax.errors.JaxRuntimeError as e:
    if not str(e).startswith("NOT_FOUND"):   # ("NOT_FOUND: Config key K not found.")
      raise
    return None


PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"   # JAX's preemption sync manager (XLA's
                                                       # tsl/.../preemption_sync_manager.cc)


def preemption_noticed() -> bool:
  """Whether some process of the job got SIGTERM: JAX's preemption sync manager (it owns the
  signal once `jax.distributed` is initialised) writes its notice into the coordination
  service, where every process reads it. One ask, answered at once: for a wait that polls
  (`reached_preemption_sync_point` answers only at step boundaries). The processes may read
  it at different moments, so those that wait together agree on it (`every_process`) before
  acting on it. False with one process."""
  import jax
  if jax.process_count() == 1:
    return False
  from jax._src import distributed
  return try_get(distributed.global_state.client, PREEMPTION_NOTICE_KEY) is not None


def after_first_process(name: str, timeout: float | None = None) -> None:
  """Waits until process 0 gets here (each call is a new one; every process calls it): for
  what process 0 alone writes before the others read it (the workdir, an index version, a
  checkpoint moved aside). Not a barrier of the heartbeat timeout: process 0's I/O may take
  longer (a slow bucket) without anything being wrong, so the wait is `io_wait_timeout()`
  (or `timeout`), then an error naming `name`; the others poll (`sliced_get`), so a SIGTERM
  still stops them."""
  import jax
  if jax.process_count() > 1:
    from_first_process(f"{name}-done", 1 if jax.process_index() == 0 else None, timeout)

"""The trainer and the index builder on two Cloud TPU VM slices that share a gs:// workdir.

  python launch/tpu_pod.py up --name realm --zone us-central2-b --project my-project \
      --config configs/realm_base.py --workdir gs://my-bucket/realm/realm \
      --set data.dir=gs://my-bucket/realm/data --set retrieval.refresh=async \
      --set init.retriever=gs://my-bucket/realm/ict \
      --set init.reader=gs://my-bucket/bert-base-uncased [--dry-run]

Slices `NAME-trainer` (--trainer_type, default v4-32) and `NAME-builder` (--builder_type,
default v4-8; `none` for a config without the separate index builder). Actions:
  create   describe each slice; create it only if there is none (a READY slice of the same
           type is reused; another type or state is refused, saying what to do)
  install  build this repository's wheel, copy it and configs/ to every worker, install it with
           its [tpu] extra into ~/realm_env (--storage gcsfuse: and mount every bucket the run
           names at /gcs/BUCKET)
           (first, refused on a slice whose job is running: nothing is replaced under it)
  start    `realm-train ... --multihost=auto` on every trainer worker and `realm-index ...` on
           every builder worker, nohup'd, output to ~/realm_logs/{trainer,builder}.log (a job
           still running is refused on its slice; the other job is started all the same)
  tail     follow worker 0's log of --job (trainer or builder)
  stop     SIGTERM both jobs on every worker (the trainer saves a checkpoint), wait --grace s
           (with the run's --config [--set ...]: at least its train.preemption_grace_seconds +
           30, the save's own grace)
  delete   delete both slices (no job is stopped first: run stop before it)
  up       create, install, start
Both jobs get the same config, `--set KEY=VALUE` overrides (as `--config.KEY=VALUE`) and workdir;
its `mesh.shape` must fit each slice's devices (-1 for the data axis takes them all).
--storage gcs (default): the jobs read and write the gs:// paths themselves (Orbax/TensorStore
for checkpoints, gcsfs for the rest; the index published with its manifest as the commit
marker); --storage gcsfuse: every gs://BUCKET/PATH becomes /gcs/BUCKET/PATH, where gcsfuse
mounts the bucket on each worker.
`--dry-run` prints each command, shell-quoted, one per line, and runs nothing.
Exit codes: 0 done, 1 a command failed, 2 a bad flag, 3 (RUNNING_EXIT) refused because a job
of the run is already running on its slice (install, start, up: nothing was changed there).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import shutil
import subprocess
import sys

from realm_jax import log, paths, processes
from realm_jax.errors import CommandParser, ConfigError, run_cli
from realm_jax.config.loading import load_config
from realm_jax.config.reading import flat_options, uses_index_builder
from realm_jax.config.validation import validate, validate_against_mesh, validate_training
from realm_jax.config.option_names import upgrade_flags
from realm_jax.config.defaults import RANDOM_START
from realm_jax.config.overrides import apply_assignments, check_known_options, flag_text
from realm_jax.runtime.partitioning import resolve_mesh_shape

HERE = os.path.dirname(os.path.abspath(__file__))

PROG = "tpu_pod.py"
REPO = os.path.dirname(HERE)
ACTIONS = ("create", "install", "start", "tail", "stop", "delete", "up")
JOBS = ("trainer", "builder")
ENTRY = {"trainer": "realm-train", "builder": "realm-index"}
MOUNT_ROOT = paths.MOUNT_ROOT   # where gcsfuse mounts gs://B: /gcs/B
STORAGES = ("gcs", "gcsfuse")   # the jobs on gs:// themselves | buckets mounted by gcsfuse
PATH_FIELDS = ("data.dir", "init.from_workdir", "init.hf_bert", "init.retriever",
               "init.reader")     # paths read on the machines
QA_FIELDS = ("qa.train", "qa.dev", "qa.test")     # question sets: KIND:ARG
QA_FILE_KINDS = ("nq_open", "webq", "curated_trec", "squad")   # KIND:PATH, opened by the job
RUNNING_EXIT = 3            # refused: a job of the run is alive on its slice (sweep: "running")
RUNNING = "is already running"   # what the slice's refusal says (`_refuse_if_running`)
GRACE_SECONDS = 120         # after SIGTERM: the trainer saves a checkpoint before it exits
PYTHON = "python3.11"       # the package needs 3.11+; Ubuntu 22.04's python3 is 3.10
ENV_BIN = "$HOME/realm_env/bin"
LOGS = "$HOME/realm_logs"
LIBTPU_RELEASES = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"
SCOPES = "https://www.googleapis.com/auth/cloud-platform"   # the jobs (or gcsfuse) write buckets
# Slice sizes as GKE names their topologies; chips -> topology.
_TOPOLOGY_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
                256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_TOPOLOGY_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
                256: "16x16"}
# family -> (GKE accelerator, number in the name counts TensorCores (2 per chip) or chips)
_FAMILIES = {"v4": ("tpu-v4-podslice", 2), "v5p": ("tpu-v5p-slice", 2),
             "v5litepod": ("tpu-v5-lite-podslice", 1), "v6e": ("tpu-v6e-slice", 1)}
# family -> the TPU VM image (software version) Cloud TPU names for JAX on it
RUNTIME_VERSIONS = {"v4": "tpu-ubuntu2204-base", "v5p": "v2-alpha-tpuv5",
                    "v5litepod": "v2-alpha-tpuv5-lite", "v6e": "v2-alpha-tpuv6e"}


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice: how many hosts (one process of a job each) and chips it has."""

  accelerator_type: str     # "v4-32"
  hosts: int                # TPU VM workers = pods of a GKE Job
  chips_per_host: int       # google.com/tpu of each pod
  gke_accelerator: str      # node label cloud.google.com/gke-tpu-accelerator
  topology: str             # node label cloud.google.com/gke-tpu-topology

  @property
  def runtime_version(self) -> str:
    """The TPU VM image for its family (`--runtime_version` overrides it)."""
    return RUNTIME_VERSIONS[self.accelerator_type.rsplit("-", 1)[0]]

  @property
  def devices(self) -> int:
    """JAX devices: one per chip (a v4 or v5p chip's two TensorCores are one device)."""
    return self.hosts * self.chips_per_host


def tpu_slice(accelerator_type: str, flag: str) -> Slice:
  """`v4-32` -> Slice(hosts=4, chips_per_host=4, ...); a ConfigError naming `flag` otherwise."""
  m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", accelerator_type)
  if m:
    gke, per_chip = _FAMILIES[m.group(1)]
    chips = int(m.group(2)) // per_chip
    table = _TOPOLOGY_3D if per_chip == 2 else _TOPOLOGY_2D
    if int(m.group(2)) % per_chip == 0 and chips in table:
      per_host = chips if per_chip == 1 and chips <= 8 else min(chips, 4)
      return Slice(accelerator_type, chips // per_host, per_host, gke, table[chips])
  known = [f"{f}-{c * n}" for f, (_, n) in _FAMILIES.items()
           for c in (_TOPOLOGY_3D if n == 2 else _TOPOLOGY_2D)]
  raise ConfigError("", f"{flag} {accelerator_type!r}: not a TPU slice type; one of "
                    f"{', '.join(known)} (v4/v5p count TensorCores, v5litepod/v6e chips)")


def job_slices(args: argparse.Namespace) -> dict[str, Slice]:
  """{job: its slice} from --trainer_type and --builder_type (none: no builder; every run has
  a trainer)."""
  return {job: tpu_slice(getattr(args, f"{job}_type"), f"--{job}_type") for job in JOBS
          if not (job == "builder" and args.builder_type == "none")}


def check_name(name: str, flag: str, max_len: int) -> None:
  if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) or len(name) > max_len:
    raise ConfigError("", f"{flag} {name!r}: lowercase letters, digits and '-', starting with a "
                      f"letter, at most {max_len} characters")


def gcs_bucket(url: str, flag: str, storage: str = "gcs") -> tuple[str, str]:
  """`gs://B/p/q` -> ("B", the path the jobs get): "gs://B/p/q" itself (--storage gcs), or
  "/gcs/B/p/q", where gcsfuse mounts the bucket on every machine (--storage gcsfuse)."""
  m = re.fullmatch(rf"gs://({paths.BUCKET_NAME})/+(.*[^/])/*", url)
  if not m:
    raise ConfigError("", f"{flag} {url!r}: must be gs://BUCKET/PATH")
  if storage == "gcsfuse":
    return m.group(1), f"{MOUNT_ROOT}/{m.group(1)}/{m.group(2)}"
  return m.group(1), f"gs://{m.group(1)}/{m.group(2)}"


@dataclasses.dataclass(frozen=True)
class Plan:
  """What both jobs run, as the machines name it."""

  config: str               # configs/X.py[:arg], relative to the job's working directory
  workdir: str              # gs://BUCKET/PATH, or /gcs/BUCKET/PATH with gcsfuse
  overrides: tuple          # --config.KEY=VALUE tokens (gs:// values mounted with gcsfuse)
  buckets: tuple            # every bucket the jobs read or write, the workdir's first
  builder: bool             # the config needs the separate index builder (realm-index)
  storage: str = "gcs"      # STORAGES
  stop_grace: float = processes.GRACE_SECONDS   # after SIGTERM, until SIGKILL: the trainer's
                                                # save (`processes.stop_grace`)

  @property
  def mounts(self) -> tuple:
    """The buckets gcsfuse mounts on every machine (none with --storage gcs)."""
    return self.buckets if self.storage == "gcsfuse" else ()


def run_config(config_spec: str, sets: list[str]):
  """(the config the jobs run: `config_spec` with the `--set` assignments, validated as the
  workers' realm-train will; {key: value text} of the assignments)."""
  try:
    config = load_config(config_spec)
  except Exception as e:     # a config module's own error, named with the flag that chose it
    raise ConfigError("", f"--config {config_spec!r}: {type(e).__name__}: {e}") from None
  check_known_options(config, config_spec)
  given = apply_assignments(config, sets, "--set")
  validate(config)
  validate_training(config)
  return config, given


def plan_run(config_spec: str, workdir: str, sets: list[str], storage: str = "gcs",
             slices: dict[str, Slice] | None = None) -> Plan:
  """Checks the config, its overrides and the workdir before any machine is touched.

  Args:
    config_spec: `configs/X.py[:arg]`, a file in this repository's configs/.
    workdir: gs://BUCKET/PATH, the run directory both jobs share.
    sets: `KEY=VALUE` config overrides, applied to both jobs.
    storage: "gcs" (the jobs use the gs:// paths) or "gcsfuse" (mounted at /gcs/BUCKET).
    slices: {job: its Slice}, to check `mesh.shape` against (`check_mesh`); None: unchecked.
  Returns:
    The Plan. Raises ConfigError naming the bad flag or config field.
  """
  if storage not in STORAGES:
    raise ConfigError("", f"--storage {storage!r} is not one of {STORAGES}")
  bucket, workdir_path = gcs_bucket(workdir, "--workdir", storage)
  path, _, arg = config_spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError("", f"--config {config_spec!r}: no such file {path!r}")
  if os.path.dirname(os.path.abspath(path)) != os.path.join(REPO, "configs"):
    raise ConfigError("", f"--config {config_spec!r}: the machines get this repository's "
                      f"configs/ directory; put the file in {os.path.join(REPO, 'configs')}")
  config, given = run_config(config_spec, sets)
  check_mesh(config, slices or {})
  buckets, overrides = [bucket], []
  final = flat_options(config)
  for key in [*given, *(k for k in final if k not in given)]:
    value = final[key]   # as typed: written back in the form the workers' flag parser reads
    if key in QA_FIELDS and str(value).partition(":")[0] in QA_FILE_KINDS:
      where, value = qa_file(key, value, storage)
      buckets += [where] if where not in buckets else []
    elif isinstance(value, str) and value.startswith("gs://"):
      where, value = gcs_bucket(value, f"config.{key}", storage)
      buckets += [where] if where not in buckets else []
    elif _local_path(key, value):
      where = f"{value!r} is not in a bucket, so the machines cannot read it" if value else \
          "is empty (the prepared data dir)"
      raise ConfigError(key, f"{where}: give --set {key}=gs://BUCKET/PATH")
    elif key not in given:
      continue
    # None: a value validate() reads as unset (the retriever's 0, -1 or "" for "the same as
    # the reader's"), which no flag spells: the jobs get the text given, and read it alike
    overrides.append(f"--config.{key}={given[key] if value is None else flag_text(value)}")
  builder = uses_index_builder(config)
  remote = "configs/" + os.path.basename(path) + (f":{arg}" if arg else "")
  grace = processes.stop_grace(config.train.preemption_grace_seconds)
  return Plan(remote, workdir_path, tuple(overrides), tuple(buckets), builder, storage, grace)


def qa_file(key: str, spec: str, storage: str) -> tuple[str, str]:
  """A question file `KIND:PATH` of field `key` as the jobs read it: (its bucket, the spec
  they get). The question readers open PATH as a file of the machine (no gs://), so only a
  bucket mounted by gcsfuse reaches them; anything else is a ConfigError saying what to give."""
  kind, _, path = spec.partition(":")
  if path.startswith("gs://") and storage == "gcsfuse":
    bucket, mounted = gcs_bucket(path, f"config.{key}", storage)
    return bucket, f"{kind}:{mounted}"
  other = f"or {key}=prepared:SPLIT (realm-prepare's DATA/qa/) or tfds:NAME"
  if path.startswith("gs://"):
    raise ConfigError(key, f"{spec!r}: the question readers open local files, not gs://: give "
                      f"--storage gcsfuse (the bucket mounted at {MOUNT_ROOT}/BUCKET), {other}")
  raise ConfigError(key, f"{spec!r} is a file of this machine, which the machines cannot "
                    f"read: give {key}={kind}:gs://BUCKET/PATH with --storage gcsfuse (the "
                    f"question readers open local files, not gs://), {other}")


def check_mesh(config, slices: dict[str, Slice]) -> None:
  """`mesh.shape` against the devices of each job's slice (the builder's where the config
  uses one), and the trainer's batch against its data axis. Both jobs get the same shape:
  where their slices' device counts differ, only -1 for the data axis fits both."""
  for job, tpu in slices.items():
    if job == "builder" and not uses_index_builder(config):
      continue
    try:
      shape = resolve_mesh_shape(config.mesh.shape, tpu.devices)
      if job == "trainer":
        validate_against_mesh(config, shape[0])
    except ConfigError as e:
      hint = ("; both jobs get this one shape, and -1 as its data axis takes each slice's "
              "devices") if e.option == "mesh.shape" else ""
      raise ConfigError(e.option, f"{e.message} on the {job}'s slice (--{job}_type "
                        f"{tpu.accelerator_type}){hint}") from None


def _local_path(key: str, value) -> bool:
  """Whether field `key` = `value` is a path outside a bucket that the machines would read."""
  if key not in PATH_FIELDS or str(value).startswith("pkg:"):   # pkg:MODULE/DIR: in a
    return False                                                 # package they install
  if key.startswith("init.") and value == RANDOM_START:         # no path at all
    return False
  return bool(value) or key == "data.dir"


def check_builder(plan: Plan, builder_type: str) -> None:
  """The builder slice exists exactly when the config has the trainer wait for its index."""
  if plan.builder and builder_type == "none":
    raise ConfigError("", "--builder_type none: the config's retrieval.refresh is async or "
                      "deterministic, so the trainer waits for index versions from realm-index")
  if not plan.builder and builder_type != "none":
    raise ConfigError("", f"--builder_type {builder_type}: the config does not use the separate "
                      "index builder (task other than realm, or retrieval.refresh in_process); "
                      "give --builder_type none, or --set retrieval.refresh=async")


def job_argv(plan: Plan, job: str) -> list[str]:
  """The command of every process of `job`: one per host, JAX finds the others (auto)."""
  return [ENTRY[job], "--config", plan.config, "--workdir", plan.workdir, "--multihost=auto",
          *plan.overrides]


def local_path(path: str) -> str:
  """`path` relative to the working directory when it lies inside it (what --dry-run shows
  from the repo root), else absolute."""
  rel = os.path.relpath(path)
  return path if rel == ".." or rel.startswith(".." + os.sep) else rel


def wheel_name() -> str:
  with open(os.path.join(REPO, "setup.py")) as f:
    version = re.search(r'version="([^"]+)"', f.read()).group(1)
  return f"realm_jax-{version}-py3-none-any.whl"


def wheel_command(wheel_dir: str) -> list[str]:
  """`pip wheel` of this checkout into `wheel_dir`. With build isolation: pip fetches the
  backend setup.py needs (setuptools with `wheel`), which a venv's own setuptools may lack
  ("invalid command 'bdist_wheel'")."""
  return [local_path(sys.executable), "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheel_dir,
          local_path(REPO)]


def install_script(plan: Plan) -> str:
  """Python 3.11, ~/realm_env with the wheel's [tpu] extra; with gcsfuse, every bucket
  mounted."""
  wheel = f"$HOME/{wheel_name()}"
  gcsfuse_repo = ('echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] '
                  'https://packages.cloud.google.com/apt gcsfuse-$(lsb_release -cs) main" '
                  "| sudo tee /etc/apt/sources.list.d/gcsfuse.list > /dev/null")
  key = ("curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg "
         "| sudo tee /usr/share/keyrings/cloud.google.asc > /dev/null")
  steps = ["set -e", "sudo apt-get update -qq",
           f"sudo apt-get install -y -qq {PYTHON} {PYTHON}-venv"]
  if plan.mounts:
    steps.append(f"if ! command -v gcsfuse > /dev/null; then {gcsfuse_repo}; {key}; "
                 "sudo apt-get update -qq; sudo apt-get install -y -qq gcsfuse; fi")
  steps += [
      f"{PYTHON} -m venv $HOME/realm_env", f"{ENV_BIN}/pip install -q -U pip",
      f'{ENV_BIN}/pip install -q "{wheel}[tpu]" -f {LIBTPU_RELEASES}',
      f'{ENV_BIN}/pip install -q --no-deps --force-reinstall "{wheel}"']   # same version, new code
  for bucket in plan.mounts:
    mount = f"{MOUNT_ROOT}/{bucket}"
    steps.append(f"if ! mountpoint -q {mount}; then sudo mkdir -p {mount}; "
                 f'sudo chown "$USER" {mount}; gcsfuse --implicit-dirs {bucket} {mount}; fi')
  return "; ".join(steps)


def _refuse_if_running(job: str, why: str) -> str:
  """A shell step that exits 1 while `job`'s process (~/realm_logs/JOB.pid) is alive."""
  pid = f"{LOGS}/{job}.pid"
  return (f'if [ -f {pid} ] && kill -0 "$(cat {pid})" 2> /dev/null; then echo "{job} {RUNNING} '
          f'(pid $(cat {pid})){": " + why if why else ""}" >&2; exit 1; fi')


def idle_script() -> str:
  """`install`'s first step on a slice: exits 1, before anything is copied, while a job runs
  there (its package and configs are not replaced under it)."""
  return "; ".join(_refuse_if_running(job, "nothing is copied or installed under it; stop it "
                                      f"first ({PROG} stop)") for job in JOBS)


def start_script(plan: Plan, job: str) -> str:
  """Starts `job` in the background unless it runs already; its pid in ~/realm_logs/JOB.pid."""
  log, pid = f"{LOGS}/{job}.log", f"{LOGS}/{job}.pid"
  steps = [f'mountpoint -q {MOUNT_ROOT}/{b} || {{ echo "{MOUNT_ROOT}/{b} is not mounted: run '
           f'{PROG} install" >&2; exit 1; }}' for b in plan.mounts]
  steps += ["cd $HOME", f"mkdir -p {LOGS}",
            _refuse_if_running(job, ""),
            f'echo "# {PROG} start $(date -u +%FT%TZ)" >> {log}',
            f"nohup {ENV_BIN}/{shlex.join(job_argv(plan, job))} >> {log} 2>&1 < /dev/null & "
            f"echo $! > {pid}"]
  return "; ".join(steps)


def stop_script(job: str, grace: int) -> str:
  """SIGTERM to `job` (never SIGKILL); waits up to `grace` s for it to exit, else fails."""
  return (f'p=$(cat {LOGS}/{job}.pid 2> /dev/null || true); '
          f'if [ -n "$p" ] && kill -0 "$p" 2> /dev/null; then kill -TERM "$p"; '
          f'for i in $(seq {grace}); do kill -0 "$p" 2> /dev/null || break; sleep 1; done; '
          f'if kill -0 "$p" 2> /dev/null; then echo "{job}: still running {grace} s after '
          f'SIGTERM (pid $p)" >&2; exit 1; fi; echo "{job}: stopped (SIGTERM)"; '
          f'else echo "{job}: not running"; fi')


def check_flags(args: argparse.Namespace) -> None:
  """What gcloud or the remote scripts would take without a word: an empty --zone, --project
  or --runtime_version (an empty value passes to gcloud as none), a negative --grace."""
  for flag in ("zone", "project", "runtime_version"):
    value = getattr(args, flag)
    if value is not None and not value.strip():
      raise ConfigError("", f"--{flag} is empty: give a value, or leave the flag out"
                        if flag == "runtime_version" else f"--{flag} is empty: give a value")
  check_seconds(args.grace, "--grace")


def check_seconds(value: int, flag: str) -> None:
  if value < 0:
    raise ConfigError("", f"{flag} {value}: must be 0 or more")


class CommandFailed(RuntimeError):
  """A command this script ran exited non-zero."""


class JobRunning(CommandFailed):
  """A slice refused install or start: a job of the run is alive there (exit RUNNING_EXIT)."""


class Pod:
  """One method per action; `_call` prints each command (--dry-run) or runs it."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    check_name(args.name, "--name", 40)
    check_flags(args)
    self.slices = job_slices(args)
    self.names = {job: f"{args.name}-{job}" for job in self.slices}
    self.plan = None
    if args.action in ("create", "install", "start", "up"):
      if not args.config or not args.workdir:
        raise ConfigError("", f"{args.action}: --config and --workdir are required")
      self.plan = plan_run(args.config, args.workdir, args.set, args.storage, self.slices)
      check_builder(self.plan, args.builder_type)
    self.wheel_dir = None   # the wheel of this checkout, once built
    self.stop_wait = args.grace
    if args.action == "stop" and (args.config or args.set):
      if not args.config:
        raise ConfigError("", "stop: --set needs the run's --config (it sets the trainer's "
                          "save grace, train.preemption_grace_seconds)")
      config = run_config(args.config, args.set)[0]
      self.stop_wait = max(args.grace, math.ceil(
          processes.stop_grace(config.train.preemption_grace_seconds)))

  def gcloud(self, verb: str, targets: list[str], *flags: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", verb, *targets, "--zone", self.args.zone,
            "--project", self.args.project, *flags]

  def ssh(self, job: str, command: str, worker: str = "all") -> list[str]:
    return self.gcloud("ssh", [self.names[job]], f"--worker={worker}", "--command", command)

  def create(self) -> None:
    for job, tpu in self.slices.items():
      describe = self.gcloud("describe", [self.names[job]], "--format",
                             "value(state,acceleratorType)")
      create = self.gcloud("create", [self.names[job]],
                           f"--accelerator-type={tpu.accelerator_type}",
                           f"--version={self.args.runtime_version or tpu.runtime_version}",
                           f"--scopes={SCOPES}",
                           *(["--spot"] if self.args.spot else []))
      if self.args.dry_run:
        print(shlex.join(describe))
        print(shlex.join(create) + "  # only if the describe finds no such TPU")
        continue
      found = self._call(describe, capture=True)
      if found.returncode == 0:
        state, found_type = (found.stdout.split() + ["", ""])[:2]   # value(): tab-separated
        self.check_existing(job, tpu.accelerator_type, state, found_type)
        print(f"{PROG}: {self.names[job]} exists ({state}, {found_type}): reusing it",
              flush=True)
      elif "NOT_FOUND" in found.stderr or "not found" in found.stderr.lower():
        self._call(create)
      else:
        raise CommandFailed(f"exit code {found.returncode}: {shlex.join(describe)}\n"
                            f"{found.stderr.strip()}")

  def check_existing(self, job: str, wanted: str, state: str, found_type: str) -> None:
    """An existing slice is reused only as the slice this run asks for, and READY."""
    name = self.names[job]
    delete = shlex.join(self.gcloud("delete", [name], "--quiet"))
    if found_type and found_type != wanted:   # (none described: the state decides)
      raise CommandFailed(f"{name} exists as a {found_type}, but --{job}_type is {wanted}: "
                          f"delete it first ({delete}), or give --{job}_type {found_type}")
    if state in ("PREEMPTED", "TERMINATED"):
      raise CommandFailed(f"{name} is {state}: run `{PROG} delete` and create it again (a "
                          "spot or preempted TPU cannot be restarted)")
    describe = shlex.join(self.gcloud("describe", [name]))
    if state in ("STOPPED", "STOPPING"):   # (a STOPPING one cannot be started yet)
      start = shlex.join(self.gcloud("start", [name]))
      wait = f"wait until it is STOPPED ({describe}), then " if state == "STOPPING" else ""
      raise CommandFailed(f"{name} is {state}: {wait}start it ({start}) or delete it "
                          f"({delete}), then run this again")
    if state == "DELETING":   # never READY again: created anew once it is gone
      raise CommandFailed(f"{name} is {state}: wait until it is gone ({describe} says "
                          "NOT_FOUND), then run this again")
    if state != "READY":   # CREATING, STARTING, REPAIRING, ...: no ssh reaches it yet
      raise CommandFailed(f"{name} is {state}, not READY: wait until it is READY ({describe}), "
                          "then run this again")

  def build_wheel(self) -> str:
    """The wheel of this checkout in build/tpu_pod, built once (`up` builds it before any slice
    is created: a checkout that does not build costs no slice); its directory."""
    if self.wheel_dir is None:
      wheel_dir = local_path(os.path.join(REPO, "build", "tpu_pod"))
      self._call(wheel_command(wheel_dir))
      self.wheel_dir = wheel_dir
    return self.wheel_dir

  def install(self) -> None:
    for job in self.slices:   # no slice is touched while a job of the run still runs there
      self._refusable(self.ssh(job, idle_script()))
    wheel_dir = self.build_wheel()
    for job in self.slices:
      files = [os.path.join(wheel_dir, wheel_name()), local_path(os.path.join(REPO, "configs"))]
      self._call(self.gcloud("scp", [*files, f"{self.names[job]}:~/"], "--worker=all",
                             "--recurse"))
      self._call(self.ssh(job, install_script(self.plan)))

  def start(self) -> None:
    """Each job that is not running is started; one that is refuses on its slice (JobRunning,
    raised once the other slice has had its start: a builder that ended beside a live trainer
    is started again)."""
    refused = None
    for job in self.slices:
      try:
        self._refusable(self.ssh(job, start_script(self.plan, job)))
      except JobRunning as e:
        refused = refused or e
    if refused is not None:
      raise refused

  def tail(self) -> None:
    if self.args.job not in self.slices:
      raise ConfigError("", f"--job {self.args.job}: no such slice (--builder_type none)")
    self._call(self.ssh(self.args.job, f"tail -n 100 -F {LOGS}/{self.args.job}.log", "0"))

  def stop(self) -> None:
    """Each slice's job is sent its stop, whichever failed before it (a builder left running
    beside a trainer that could not be reached keeps its slice busy): each failure is one line,
    the last one raised once every slice has been tried."""
    failures = []
    for job in self.slices:
      try:
        self._call(self.ssh(job, stop_script(job, self.stop_wait)))
      except CommandFailed as e:
        failures.append(e)
    for failure in failures[:-1]:
      print(f"{PROG}: error: {failure}", file=sys.stderr, flush=True)
    if failures:
      raise failures[-1]

  def delete(self) -> None:
    for job in self.slices:
      self._call(self.gcloud("delete", [self.names[job]], "--quiet"))

  def up(self) -> None:
    self.build_wheel()
    self.create()
    self.install()
    self.start()

  def _refusable(self, argv: list[str]) -> None:
    """Runs a remote step that a live job refuses: that refusal raises JobRunning (told by
    its text, which survives gcloud whatever exit code it passes on), other failures
    CommandFailed. The step's output is short: captured, then shown."""
    result = self._call(argv, capture=True)
    if result is None:
      return
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    if result.returncode != 0:
      kind = JobRunning if RUNNING in result.stderr else CommandFailed
      raise kind(f"exit code {result.returncode}: {shlex.join(argv)}")

  def _call(self, argv: list[str], capture: bool = False) -> subprocess.CompletedProcess | None:
    """Prints `argv` (--dry-run) or runs it; a non-zero exit raises CommandFailed naming it."""
    line = shlex.join(argv)
    if self.args.dry_run:
      print(line, flush=True)
      return None
    if shutil.which(argv[0]) is None:
      raise CommandFailed(f"{argv[0]} is not installed (https://cloud.google.com/sdk/docs/"
                          "install); --dry-run prints the commands without running them")
    print(f"+ {line}", flush=True)
    result = subprocess.run(argv, capture_output=capture, text=True, check=False)
    if result.returncode != 0 and not capture:
      raise CommandFailed(f"exit code {result.returncode}: {line}")
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
  return make_parser().parse_args(argv)


def make_parser() -> argparse.ArgumentParser:
  """The flags of every action (sweep.py checks each run's call with it before any starts)."""
  parser = CommandParser(prog=PROG, description=__doc__.splitlines()[0],
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog="\n".join(__doc__.splitlines()[1:]),
                          allow_abbrev=False)
  parser.add_argument("action", choices=ACTIONS)
  parser.add_argument("--name", required=True, help="slices NAME-trainer and NAME-builder")
  parser.add_argument("--zone", required=True, help="e.g. us-central2-b (v4)")
  parser.add_argument("--project", required=True, help="Google Cloud project id")
  parser.add_argument("--trainer_type", default="v4-32", help="the trainer's slice")
  parser.add_argument("--builder_type", default="v4-8",
                      help="the index builder's slice; none: no builder (in_process refresh)")
  parser.add_argument("--runtime_version", default=None, help="TPU VM image of both slices "
                      "(default: each slice's own: tpu-ubuntu2204-base for v4, v2-alpha-tpuv5 "
                      "for v5p, v2-alpha-tpuv5-lite for v5litepod, v2-alpha-tpuv6e for v6e)")
  parser.add_argument("--spot", action="store_true", help="create spot slices")
  parser.add_argument("--config", default="", help="configs/X.py[:arg]")
  parser.add_argument("--workdir", default="", help="gs://BUCKET/PATH shared by both jobs")
  parser.add_argument("--set", action="append", default=[], help="KEY=VALUE config override "
                      "for both jobs (repeat)")
  parser.add_argument("--storage", choices=STORAGES, default="gcs", help="gcs: the jobs read "
                      "and write gs:// paths themselves; gcsfuse: mount every bucket at "
                      "/gcs/BUCKET and pass those paths")
  parser.add_argument("--job", choices=JOBS, default="trainer", help="tail: whose log")
  parser.add_argument("--grace", type=int, default=GRACE_SECONDS,
                      help="stop: seconds a job gets to exit after SIGTERM (more where the "
                      "trainer's save needs more: give stop the run's --config and --set)")
  parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
  log.add_verbosity_argument(parser)
  return parser


def main(argv: list[str] | None = None) -> int:
  """`python launch/tpu_pod.py ACTION --name N --zone Z --project P [...] [--dry-run]`."""
  args = parse_args(upgrade_flags(sys.argv[1:] if argv is None else argv, PROG))
  log.set_verbosity(args.verbosity)
  try:
    run_cli(PROG, lambda: getattr(Pod(args), args.action)())
  except CommandFailed as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return RUNNING_EXIT if isinstance(e, JobRunning) else 1
  return 0


if __name__ == "__main__":
  sys.exit(main())

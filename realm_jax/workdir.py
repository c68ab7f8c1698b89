"""A run's workdir W: the one owner of its layout and of the records the jobs sharing it
(trainer, `realm-index`, `realm-eval`, launchers) read and write.

  W/config.json          the run's resolved config: recorded at start, checked on resume
  W/blocks.json          the block store the trainer's block rows refer to (realm-index checks)
  W/vocab.txt            the tokens the run's ids mean: its data's vocab, copied by a run that
                         starts without checkpoints (a workdir realm-import-hf writes: the
                         checkpoint's own); a resume and every reader of the run's checkpoints
                         check their data's against it
  W/checkpoints/<step>/  Orbax checkpoints (runtime/checkpoints.py)
  W/unreadable_checkpoints/<step>/   a checkpoint that failed to restore on resume, moved
                         aside (kept for a post-mortem; that step is saved again, and
                         if it fails again too, moved beside it as <step>.2, .3, ...)
  W/index/<version>/     published index versions (retrieval/published.py)
  W/metrics/<kind>.jsonl, W/tb/<kind>/   metrics (runtime/metrics.py)
  W/summary.json         the run's summary, written when it finishes (absent: not finished; a
                         run resumed with more steps finds the shorter run's, its `steps` less)
  W/wall.json            the seconds of every run of W that finished or stopped on SIGTERM or
                         Ctrl-C (a demo's: also one that failed), so a resumed job reports
                         them all
  W/DONE                 the trainer's last step: tells realm-index to exit
  W/trainer.lock, W/builder.lock   held (flock) by the trainer's and realm-index's first
                         process while they run on a local W: a second one is refused; a
                         job that ended normally leaves how it ended there (`job_ended`)
  W/launcher.lock        held by launch/local.py from its check of the two locks above until
                         its trainer and builder ended: a second launcher is refused
  W/logs/                launch/local.py: the trainer's and the builder's output

W may be a local dir or a bucket URL (`gs://B/P`): every file goes through realm_jax/paths.py.
Every record is written whole (a local temp name renamed into place; one object write in a
bucket), so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
import uuid

from realm_jax import paths
from realm_jax.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

CONFIG = "config.json"
BLOCKS_RECORD = "blocks.json"
QUESTIONS_RECORD = "questions.json"
EXAMPLES_RECORD = "examples.json"
CHECKPOINTS = "checkpoints"
UNREADABLE_CHECKPOINTS = "unreadable_checkpoints"
VOCAB = "vocab.txt"
SUMMARY = "summary.json"
WALL = "wall.json"
DONE = "DONE"
JOB_TOKEN = ".job_token-"   # + an id of its own each start: process 0's token, read back by
                            # every other process at start-up, then removed


def write_job_token(workdir: str) -> str:
  """Process 0's token of this start, written to `W/.job_token-<id>` (W made if need be):
  its id. A name of its own each start, so that no cache of an earlier start's file (a
  gcsfuse stat cache, an NFS lookup cache) can answer for it."""
  token = uuid.uuid4().hex
  paths.makedirs(workdir)
  paths.write_text_atomic(paths.join(workdir, JOB_TOKEN + token), token)
  return token


def sees_job_token(workdir: str, token: str) -> bool:
  """Whether this process reads process 0's token `token` in `workdir` (a read that fails,
  storage this host cannot reach, is not seeing it: said in the log)."""
  try:
    return paths.read_text(paths.join(workdir, JOB_TOKEN + token)) == token
  except Exception as e:   # noqa: BLE001 -- any failure to read is an answer: not seen
    logger.warning(f"--workdir {workdir}: process 0's token not read here ({e})")
    return False


def remove_job_token(workdir: str, token: str, made_workdir: bool = False) -> None:
  """Removes process 0's token, and `workdir` too where the token made it (`made_workdir`)
  and it is empty now: a job refused after the check leaves no empty W behind (the job's
  first write makes it again; a bucket has no empty dirs). A failure is said, not raised
  (it would hide what ended the check, and the token only takes a file's room)."""
  try:
    paths.remove(paths.join(workdir, JOB_TOKEN + token))
  except Exception as e:   # noqa: BLE001 -- storage out of reach: the token stays
    logger.warning(f"--workdir {workdir}: the job token {JOB_TOKEN}{token} not removed ({e})")
    return
  if made_workdir and not paths.is_remote(workdir):
    with contextlib.suppress(OSError):   # not empty: something else writes there, it stays
      os.rmdir(workdir)


# -- the prepared data a run reads -------------------------------------------------------------
def check_data_dir(config) -> str:
  """Where `config.data.dir` is read from: itself, or for a TPU VM's gcsfuse path that is not
  mounted here, the bucket path it mounts. A ConfigError for one that is empty, malformed, or
  a local dir that does not exist; reads nothing else (launchers check it before starting a
  process)."""
  data_dir = config.data.dir
  if not data_dir:
    raise ConfigError("data.dir", "is empty: point it at a prepared data dir")
  try:
    paths.check(data_dir, "data.dir")
  except ValueError as e:
    raise ConfigError("data.dir", str(e)) from None
  if paths.is_remote(data_dir) or os.path.exists(data_dir):
    return data_dir
  if paths.bucket_url(data_dir) == data_dir:
    where = "" if os.path.isabs(data_dir) else f" (relative to {os.getcwd()})"
    raise ConfigError("data.dir", f"data dir {data_dir!r} does not exist{where}")
  return paths.bucket_url(data_dir)


def open_data(config):
  """Opens `config.data.dir` (a PreparedData), a missing or partial dir, or one without a
  block, as a ConfigError."""
  from realm_jax.data.prepared import PreparedData
  data_dir = check_data_dir(config)
  if data_dir != config.data.dir:
    logger.info(f"[data] {config.data.dir} is not mounted here: reading {data_dir}, the "
                "bucket path it mounts")
  try:
    # Memory-mapped arrays: a data dir in a bucket is read from a verified local copy.
    data = PreparedData(paths.local_dir(
        data_dir, log=lambda line: logger.info(f"[data] {line}")))
  except FileNotFoundError as e:
    raise ConfigError("data.dir", str(e)) from None
  if not data.blocks.num_blocks:   # (its documents gave no wordpiece: nothing to retrieve)
    raise ConfigError("data.dir", f"{config.data.dir} holds no block: none of its documents "
                      "gave a wordpiece (its stats.json: documents_without_blocks); prepare "
                      "it from other text")
  return data


# -- W/config.json -----------------------------------------------------------------------------
def read_record(workdir: str, name: str, advice: str = "") -> dict | None:
  """W's JSON record `name` (config.json, examples.json, questions.json), None where W has
  none; one edited by hand or cut short is a DataError naming it (`advice` added)."""
  path = paths.join(workdir, name)
  text = paths.read_text(path)
  if text is None:
    return None
  try:
    record = json.loads(text)
  except ValueError as e:
    raise DataError(f"{path}: not the JSON a run writes ({e}); restore it from a copy of "
                    f"the run{advice}") from None
  if not isinstance(record, dict):   # a list, a number, `null`
    raise DataError(f"{path}: not the JSON object a run writes{advice}")
  return record


EVALUATION_ADVICE = " (an evaluation may give --config instead)"
# what a training run says of a config.json that is not a run's (it would overwrite it)
RUN_ADVICE = " (a run would overwrite it: give --workdir a run's directory or a new one)"


def recorded_config(workdir: str, advice: str = EVALUATION_ADVICE) -> dict | None:
  """`W/config.json` with options renamed since moved to their names (`upgrade_record`);
  None where W has none. One that is not a run's is a DataError naming it, `advice` added."""
  from realm_jax.config.option_names import upgrade_record
  record = read_record(workdir, CONFIG, advice)
  if record is None:
    return None
  # another program's config.json (a Hugging Face model dir's): named here, not an
  # AttributeError further on or a missing option blamed on the command line
  if not isinstance(record.get("task"), str) or not all(
      isinstance(record.get(section), dict) for section in ("model", "data", "train")):
    raise DataError(f"{paths.join(workdir, CONFIG)}: not the config a run writes (no task, or "
                    f"no model, data and train sections: another program's file?){advice}")
  return upgrade_record(record, f"{paths.join(workdir, CONFIG)}: ")


def record_config(config, workdir: str, primary: bool = True) -> None:
  """Refuses a workdir whose checkpoints come from an incompatible config; records ours (the
  `primary` process of a job writes it; every process checks). A config.json that is not a
  run's (a Hugging Face model dir's, or not JSON) is refused, not overwritten."""
  recorded_config(workdir, RUN_ADVICE)
  check_compatible(workdir, config)
  if primary:
    write_config(workdir, config)


def check_compatible(workdir: str, config) -> None:
  """ConfigError naming the fields that differ where W's checkpoints come from a config
  incompatible with `config` (config/compatibility.py); reads only."""
  from realm_jax.config.compatibility import incompatible_fields
  from realm_jax.config.reading import config_record
  saved = recorded_config(workdir) if holds_checkpoints(workdir) else None
  if saved is not None:
    diffs = incompatible_fields(saved, config_record(config))
    if diffs:
      raise ConfigError("", f"workdir {workdir} holds checkpoints of an incompatible config; "
                        "fields that differ: " + "; ".join(diffs))


def other_split(workdir: str, config) -> list[str]:
  """The held-out split options (the TASK_FIELDS of the run's task: Open-QA's) whose value in
  `config` differs from the one the run in `workdir` trained under, as `field: run != config`
  lines; [] where W has no record or the same split."""
  from realm_jax.config.compatibility import changed_fields, task_fields
  from realm_jax.config.reading import config_record, flat_options
  saved = recorded_config(workdir)
  if saved is None or saved.get("task") != "openqa":   # (a pre-training run's: no questions)
    return []
  current = config_record(config)
  return [f"{name}: {a!r} (the run) != {b!r} (this config)" for name, a, b in changed_fields(
      flat_options(saved), flat_options(current), task_fields(saved, current))]


def recorded_differences(workdir: str, config) -> list[tuple[str, object, object]]:
  """(option, value in W/config.json, value in `config`) for every option whose values differ,
  where W holds a run's work (a checkpoint or a summary): [] for a fresh W or the same values.
  An option added since that W's record lacks reads as the value it ran under where
  `compatibility.ADDED_FIELDS` names one (an old run resumed under train.optimizer "bert" is
  said to change it); other options that only one side has are not compared."""
  from realm_jax.config.compatibility import ADDED_FIELDS
  from realm_jax.config.reading import config_record, flat_options
  if not (holds_checkpoints(workdir) or read_summary(workdir) is not None):
    return []
  record = recorded_config(workdir)
  if record is None:
    return []
  saved = {**ADDED_FIELDS, **flat_options(record)}
  current = flat_options(config_record(config))
  same = lambda a, b: json.dumps(a) == json.dumps(b)   # a tuple is its record's list
  return [(name, saved[name], current[name]) for name in sorted(saved.keys() & current.keys())
          if not same(saved[name], current[name])]


def holds_checkpoints(workdir: str) -> bool:
  """Whether `W/checkpoints` holds a step (Orbax names a step's folder by its number once it
  is finished; a run that died before its first save left the folder empty, and its config
  may change)."""
  return latest_checkpoint_step(workdir) is not None


# Orbax's marker of a finished checkpoint in a bucket, which has no atomic rename: a step's
# folder there exists from its first upload (on a file system a step is renamed into place).
FINISHED_IN_A_BUCKET = "commit_success.txt"


def latest_checkpoint_step(workdir: str) -> int | None:
  """The largest finished step in `W/checkpoints` (its folders named by number; in a bucket,
  holding Orbax's commit marker, as Orbax itself counts them), None without one."""
  directory = paths.join(workdir, CHECKPOINTS)
  if not paths.isdir(directory):
    return None
  steps = sorted((int(name) for name in paths.names(directory) if name.isdigit()), reverse=True)
  if not paths.is_remote(directory):
    return steps[0] if steps else None
  return next((step for step in steps
               if paths.exists(paths.join(directory, str(step), FINISHED_IN_A_BUCKET))), None)


def write_config(workdir: str, config) -> None:
  """`W/config.json` (also for a workdir written by a converter: `realm-import-hf`)."""
  from realm_jax.config.reading import config_record
  paths.makedirs(workdir)
  paths.write_json(paths.join(workdir, CONFIG), config_record(config))


def check_run_dir(workdir: str) -> None:
  """A FileNotFoundError naming `workdir` where it does not exist or is a file."""
  if not paths.isdir(workdir):
    what = "a file, not a run directory" if paths.exists(workdir) else "no such run directory"
    raise FileNotFoundError(f"{workdir}: {what}")


def saved_config(workdir: str):
  """The run's own resolved config (`W/config.json`) as a ConfigDict, with the options added
  since it was written (`compatibility.with_added_fields`); a FileNotFoundError naming a
  missing W, or a W without one (not a run directory)."""
  import ml_collections
  from realm_jax.config.compatibility import with_added_fields
  check_run_dir(workdir)
  record = recorded_config(workdir)
  if record is None:
    raise FileNotFoundError(f"{paths.join(workdir, CONFIG)}: not found, so {workdir} is not a "
                            f"run directory (a run writes its resolved config there)")
  return ml_collections.ConfigDict(with_added_fields(record))


# -- W/vocab.txt ------------------------------------------------------------------------------
def record_vocab(workdir: str, data_vocab: str) -> None:
  """W/vocab.txt := a copy of `data_vocab` (the data's vocab.txt). train/run.py writes it
  where the run starts without checkpoints (or W has none from before this record existed),
  after checking a resumed run's data against it."""
  with open(data_vocab, encoding="utf-8") as f:
    paths.write_text_atomic(paths.join(workdir, VOCAB), f.read())


# -- W/blocks.json -----------------------------------------------------------------------------
def record_block_store(workdir: str, data) -> None:
  """The trainer's side of `check_block_store`: which block store its rows refer to."""
  paths.makedirs(workdir)
  paths.write_json(paths.join(workdir, BLOCKS_RECORD),
              {"block_store_fingerprint": data.blocks.fingerprint, "data_dir": data.dir,
               "num_blocks": data.blocks.num_blocks})


def check_block_store(workdir: str, fingerprint: str, data_dir: str) -> None:
  """Refuses to serve a trainer whose block store differs from ours (both fingerprints shown)."""
  trainer = read_record(workdir, BLOCKS_RECORD)
  if trainer is None:
    return
  if trainer.get("block_store_fingerprint") != fingerprint:
    raise ConfigError("data.dir", f"the block store of {data_dir} (fingerprint {fingerprint}) "
                      f"differs from the trainer's in {workdir} ({trainer.get('data_dir')}, "
                      f"fingerprint {trainer.get('block_store_fingerprint')}): an index over "
                      "other blocks would retrieve the wrong rows")


# -- W/questions.json --------------------------------------------------------------------------
def record_questions(workdir: str, spec: str, count: int, fingerprint: str) -> None:
  """The questions an Open-QA run trains on (`qa_lib.questions_fingerprint`), written by its
  first process once its start or resume (`check_questions`) is settled."""
  paths.write_json(paths.join(workdir, QUESTIONS_RECORD),
                   {"qa_train": spec, "questions": count, "fingerprint": fingerprint})


def check_questions(workdir: str, spec: str, count: int, fingerprint: str) -> None:
  """Refuses to resume an Open-QA run on other training questions than its checkpoints
  trained on (a changed file, questions read another way): the steps' batches index into
  them. A moved file with the same questions resumes; W without the record (a run from
  before it) is not checked. Reads only: every process of a job may call it."""
  record = read_record(workdir, QUESTIONS_RECORD)
  changed = _fingerprint_change(QUESTIONS_RECORD, record, fingerprint)
  if changed:
    raise ConfigError("qa.train", f"its {count} training questions ({spec!r}) are not the "
                      f"{record.get('questions', '?')} that the checkpoints in {workdir} "
                      f"trained on ({record.get('qa_train')!r}; {changed}): resume on those "
                      "questions and the same qa.heldout_* split, or train in a new workdir")


def _fingerprint_change(name: str, record: dict | None, fingerprint: str) -> str | None:
  """`name: fingerprint OLD != NEW` where W's record `name` (questions.json, examples.json)
  holds another fingerprint than `fingerprint`, the inputs of this start; None where it
  holds the same, or W has no record (a run from before it: not checked)."""
  if record is None or record.get("fingerprint") == fingerprint:
    return None
  return f"{name}: fingerprint {str(record.get('fingerprint'))[:12]} != {fingerprint[:12]}"


# -- W/examples.json ---------------------------------------------------------------------------
def record_examples(workdir: str, split: str, count: int, fingerprint: str) -> None:
  """The examples a pre-training run trains on (`ExampleSet.fingerprint`), written by its
  first process once its start or resume (`check_examples`) is settled."""
  paths.write_json(paths.join(workdir, EXAMPLES_RECORD),
                   {"split": split, "examples": count, "fingerprint": fingerprint})


def check_examples(workdir: str, data_dir: str, split: str, count: int,
                   fingerprint: str) -> None:
  """Refuses to resume a pre-training run on other examples than its checkpoints trained on
  (other rows, the same in another order): the input pipeline's saved position indexes into
  them. A moved data dir with the same examples resumes; W without the record (a run from
  before it) is not checked. Reads only: every process of a job may call it."""
  record = read_record(workdir, EXAMPLES_RECORD)
  if record is not None and record.get("split", split) != split:
    raise ConfigError("data.split", f"{split!r} but the checkpoints in {workdir} trained on "
                      f"split {record['split']!r}: resume with data.split={record['split']!r}, "
                      "or train in a new workdir (init.from_workdir keeps the params)")
  changed = _fingerprint_change(EXAMPLES_RECORD, record, fingerprint)
  if changed:
    raise ConfigError("data.dir", f"its {count} examples of split {split!r} "
                      f"({paths.join(data_dir, 'examples', split)}) are not the "
                      f"{record.get('examples', '?')} that the checkpoints in {workdir} "
                      f"trained on (other examples, or the same in another order; {changed}): "
                      "resume on the data they trained on, or train in a new workdir "
                      "(init.from_workdir keeps the params)")


# -- W/DONE ------------------------------------------------------------------------------------
def done_path(workdir: str) -> str:
  return paths.join(workdir, DONE)


def mark_done(workdir: str, step: int) -> None:
  """The trainer finished at `step`: realm-index exits when it sees this."""
  paths.write_text_atomic(done_path(workdir), f"{step}\n")


def clear_done(workdir: str) -> None:
  """A trainer (re)starting: the builder must not exit on an earlier run's DONE."""
  paths.remove(done_path(workdir))


def is_done(workdir: str) -> bool:
  return done_step(workdir) is not None


def done_step(workdir: str) -> int | None:
  """The step W/DONE records; None without W/DONE. A DONE that holds no step (written by
  hand, or by an older version) counts as the end of any run."""
  text = paths.read_text(done_path(workdir))
  if text is None:
    return None
  try:
    return int(text.strip())
  except ValueError:
    return sys.maxsize


# -- W/trainer.lock, W/builder.lock -------------------------------------------------------------
JOBS = ("trainer", "builder")   # a workdir's; realm-prepare locks its out_dir as "prepare"
# what a refusal names the holder of a lock of another kind: realm-prepare's of its out_dir,
# launch/local.py's of the workdir whose trainer and builder it starts
HOLDERS = {"prepare": "realm-prepare", "launcher": "launch/local.py"}
ENDED = "ended: "   # a lock file's line after the holder's: how the job ended normally


class JobLock:
  """The one trainer, or the one `realm-index`, of a local workdir (and the one
  realm-prepare of an out dir, launch/local.py or demo of a workdir: `HOLDERS`): an exclusive
  flock on `W/<job>.lock` (holding the pid), taken by `acquire()` just before the job first
  writes to W and given up by `release()` or when the process ends, however it ends (no stale
  lock after a crash). A second job of the kind is refused naming the holder's pid: it would
  delete the first one's checkpoint or index version in the making. A bucket has no locks:
  there the launchers keep one job of each kind (tpu_pod.py refuses a live one)."""

  def __init__(self, workdir: str, job: str):
    self.workdir, self.job, self._file = workdir, job, None

  @property
  def path(self) -> str:
    return os.path.join(self.workdir, f"{self.job}.lock")

  def acquire(self) -> None:
    """Takes the lock (a ConfigError naming the holder when another process has it)."""
    if paths.is_remote(self.workdir) or self._file is not None:
      return
    paths.makedirs(self.workdir)
    lock = open(self.path, "a+")
    taken, holder = _tried(lock)
    if not taken:
      lock.close()
      if holder is None:   # a file system without flock: as a bucket
        return
      who = HOLDERS.get(self.job, self.job)
      raise ConfigError("", f"{self.workdir} is in use: a {who} (pid {holder}) runs on it "
                        f"and holds {self.path}; stop it first, or use another dir")
    lock.truncate(0)   # (W may be shared by hosts; the start tells a reused pid apart)
    lock.write(f"{os.getpid()} {socket.gethostname()}{_start_and_namespace()}\n")
    lock.flush()
    self._file = lock

  def release(self, ended: str | None = None) -> None:
    """Gives up the lock; `ended`: how the job ended normally, kept in the file for
    `job_ended` (a job that died or was stopped leaves none; the next holder's start clears
    it). A file that cannot take the line (a full disk) is left without it."""
    if self._file is not None:
      if ended:
        with contextlib.suppress(OSError):
          self._file.write(f"{ENDED}{ended}\n")
          self._file.flush()
      self._file.close()    # closing gives up the flock
      self._file = None

  def __enter__(self) -> "JobLock":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _tried(lock) -> tuple[bool, str | None]:
  """W's lock tried on the open lock file `lock` (opened "a+": NFS locks only a file open for
  writing): (taken by this process, None), or (False, the pid as written of the process
  holding it), or (False, None) on a file system without flock (a FUSE mount may refuse it)."""
  import fcntl
  try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    lock.seek(0)
    return False, _holder(lock.read())
  except OSError:
    return False, None
  return True, None


def _pid_and_host(text: str) -> tuple[str, str | None]:
  """A lock file's `pid host [start]`: the pid as written, and its host where that is not
  this one (None: this host, or a file from before the host was written)."""
  pid, host = (_holder_fields(text) + ["", ""])[:2]
  return pid, (host if host and host != socket.gethostname() else None)


def _holder_fields(text: str) -> list[str]:
  """A lock file's first line, the holder's `pid host [start [namespace]]`, split."""
  return text.partition("\n")[0].split()


def _start_ticks(pid) -> str | None:
  """When process `pid` started, as Linux's /proc/<pid>/stat gives it (clock ticks since
  boot, never changed by a clock set later); None where that is not known (no /proc, no
  such process). A lock file keeps its holder's: a process of the same pid that started at
  another time is not the holder (the pid reused after the holder ended)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rpartition(")")[2].split()[19]   # field 22; the name may hold spaces
  except (OSError, IndexError):
    return None


def _pid_namespace() -> str | None:
  """This process's pid namespace (Linux: `pid:[N]`, as /proc/self/ns/pid names it); None
  where that is not known. Two processes of one host name (containers sharing the host's name
  and W) whose namespaces differ do not see each other's pids."""
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return None


def _start_and_namespace() -> str:
  """What a lock file keeps after `pid host`: ` START NAMESPACE`, ` START` or ''."""
  start = _start_ticks(os.getpid())
  if start is None:
    return ""
  namespace = _pid_namespace()
  return f" {start}" + (f" {namespace}" if namespace else "")


def _holder(text: str) -> str:
  """A lock file's holder as a message names it: the pid, with its host where that is not
  this one."""
  pid, host = _pid_and_host(text)
  return (f"{pid} on {host}" if host else pid) or "?"


def job_gone(workdir: str, job: str) -> str | None:
  """The pid in W's `job` lock file when no process of that pid runs any more on this host
  (the job died or was stopped without finishing), else None; None for a bucket, and for a
  job of another host (a shared file system) or of another pid namespace. A look at the file
  and the pid (with the start the file records: a pid reused by another process is not the
  job) alone, never at the lock: a job starting now is not refused for it."""
  found = _job_pid(_lock_text(workdir, job))
  return found[0] if found is not None and not found[1] else None


def job_gone_and_how(workdir: str, job: str) -> tuple[str, str | None] | None:
  """(`job_gone`'s pid, how that job ended normally or None: `job_ended`), None where
  `job_gone` says None; from one read of the lock file, so that both are of one holder (a
  job started between two reads would lend the other's pid its ending, or none)."""
  text = _lock_text(workdir, job)
  found = _job_pid(text)
  return (found[0], _ended(text)) if found is not None and not found[1] else None


def job_running(workdir: str, job: str) -> str | None:
  """The pid in W's `job` lock file while a process of that pid runs on this host, else None
  (as `job_gone`: a look at the file and the pid, never at the lock)."""
  found = _job_pid(_lock_text(workdir, job))
  return found[0] if found is not None and found[1] else None


def _lock_text(workdir: str, job: str) -> str | None:
  """W's `job` lock file as written; None for a bucket (no lock files) or no readable file."""
  if paths.is_remote(workdir):
    return None
  try:
    with open(JobLock(workdir, job).path) as f:
      return f.read()
  except OSError:
    return None


def _job_pid(text: str | None) -> tuple[str, bool] | None:
  """(the pid in a lock file's `text`, whether it runs on this host); None for no file, a
  job of another host or of another pid namespace (a container of the same host name)."""
  if text is None:
    return None
  pid_text, host = _pid_and_host(text)
  # after `pid host`: the holder's start and pid namespace (a file of an older version: none)
  fields = _holder_fields(text)
  written, namespace = fields[2:3], fields[3:4]
  if host is not None or (namespace and namespace[0] != _pid_namespace()):
    return None   # its pid names another host's or another namespace's process
  try:
    os.kill(int(pid_text), 0)
  except ProcessLookupError:
    return pid_text, False
  except (OSError, ValueError):
    return None
  return pid_text, not written or _start_ticks(pid_text) in (None, written[0])


def job_ended(workdir: str, job: str) -> str | None:
  """How the job in W's `job` lock file ended normally (`JobLock.release`'s `ended`), None
  where it left no such line (it died, was stopped, or still runs), or for a bucket."""
  return _ended(_lock_text(workdir, job))


def _ended(text: str | None) -> str | None:
  """A lock file's `ended: ...` line after the holder's, without its prefix; None if none."""
  lines = (text or "").splitlines()[1:]
  return next((line[len(ENDED):] for line in lines if line.startswith(ENDED)), None)


def job_holding(workdir: str, job: str) -> str | None:
  """The pid (as written) of the live `job` holding W's lock, None when none does (a
  launcher's check before it starts anything: the lock is tried, not taken, so the file
  keeps the job that ended and how, for `job_gone_and_how`)."""
  path = JobLock(workdir, job).path
  if paths.is_remote(workdir) or not os.path.exists(path):
    return None
  with open(path, "a+") as f:   # (closing gives up a flock this took)
    return _tried(f)[1]


# -- W/summary.json ----------------------------------------------------------------------------
def write_summary(workdir: str, summary: dict) -> None:
  paths.makedirs(workdir)
  paths.write_json(paths.join(workdir, SUMMARY), summary)


# what a summary.json that is not a run's says: without it, a run is not finished
SUMMARY_ADVICE = (" (or remove it: realm-train with the run's train.steps evaluates its last "
                  "checkpoint again and writes it)")


def read_summary(workdir: str) -> dict | None:
  """The summary of the last run of W that finished (its `steps`: a run resumed with a larger
  train.steps has not finished until it holds that), None while none has; one cut short or
  edited by hand is a DataError naming it."""
  return read_record(workdir, SUMMARY, SUMMARY_ADVICE)


def clear_earlier_start(workdir: str) -> None:
  """A run started from scratch (no checkpoint to resume): the summary and the wall record of
  an earlier start, whose checkpoints are gone, go (the metrics logs drop its lines alike).
  Kept, its summary was taken for this run's once this run's last checkpoint was saved (a
  rerun of a run stopped before its own summary trained and evaluated nothing)."""
  for name in (SUMMARY, WALL):
    paths.remove(paths.join(workdir, name))


# -- W/wall.json -------------------------------------------------------------------------------
def add_wall(workdir: str, seconds: float, fresh: bool = False, record: str = WALL) -> dict:
  """Adds one run's `seconds` to W/wall.json (one writer: the job's first process; `fresh`: a
  run that started from scratch, which starts the record again). Returns the summary fields:
  this run's `wall_seconds`, `wall_seconds_all_runs` and `runs` (the runs added so far; a run
  killed outright adds nothing). A record that cannot be read or written is only warned about:
  the fields are then this run's alone. (`record`: another job's own file in the workdir.)"""
  path = paths.join(workdir, record)
  this = {"wall_seconds": round(seconds, 1)}
  try:
    before = {"seconds": 0.0, "runs": 0} if fresh else (
        paths.read_json(path) or _before_the_record(workdir, record))
    after = {"seconds": round(float(before["seconds"]) + seconds, 1),
             "runs": int(before["runs"]) + 1}
    paths.makedirs(workdir)
    paths.write_json(path, after)
  except (OSError, ValueError, KeyError, TypeError) as e:
    logger.warning(f"{path}: the runs' wall time is not recorded ({type(e).__name__}: {e})")
    return this
  return {**this, "wall_seconds_all_runs": after["seconds"], "runs": after["runs"]}


def _before_the_record(workdir: str, record: str) -> dict:
  """W/wall.json's start where W has none: the runs its summary counts (a run finished before
  the record was kept, 2026-11-27, has its seconds there alone), else none."""
  try:
    summary = paths.read_json(paths.join(workdir, SUMMARY)) if record == WALL else None
  except ValueError:   # (named where the summary is read)
    summary = None
  seconds = wall_all_runs(summary) if isinstance(summary, dict) else None
  if not isinstance(seconds, (int, float)):
    return {"seconds": 0.0, "runs": 0}
  return {"seconds": float(seconds), "runs": int(summary.get("runs", 1))}


def wall_all_runs(fields: dict) -> float | None:
  """The seconds of every recorded run in `fields` (`add_wall`'s, or a summary holding
  them); this run's alone where the record could not be kept."""
  return fields.get("wall_seconds_all_runs", fields.get("wall_seconds"))


WALL_FIELDS = ("wall_seconds", "wall_seconds_all_runs", "runs")   # `add_wall`'s


# A path given as input that cannot be read: missing, a directory, or not this user's to read
INPUT_PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


class RunWall:
  """Times one run of a job in `workdir`, from its creation: `record()` adds its seconds to
  W/wall.json and returns `add_wall`'s fields (after `keep`, a summary's own, adding nothing);
  a `with` block that ends by an exception first (a preempted or failed run) adds them then."""

  def __init__(self, workdir: str, record: str = WALL):
    self.workdir, self.record_name = workdir, record
    self.start, self.fields = time.time(), None

  def keep(self, previous: dict) -> None:
    """This run trained nothing (a finished job run again): `record()` gives `previous`'s wall
    fields (the summary it reproduces) and W/wall.json is left as it is."""
    self.fields = {key: previous[key] for key in WALL_FIELDS if key in previous}

  @contextlib.contextmanager
  def input_checks(self):
    """A block of checks of the run's input before any stage runs: a run it refuses (a
    missing or bad file, a split that holds out nothing: ConfigError, DataError,
    `INPUT_PATH_ERRORS`) adds no run to W/wall.json."""
    try:
      yield
    except (ConfigError, DataError, *INPUT_PATH_ERRORS):
      self.fields = {}
      raise

  def record(self) -> dict:
    if self.fields is None:
      self.fields = add_wall(self.workdir, time.time() - self.start, record=self.record_name)
    return self.fields

  def __enter__(self) -> RunWall:
    return self

  def __exit__(self, *exc) -> None:
    self.record()

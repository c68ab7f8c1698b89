"""Where a run's files live: a local path or a bucket URL (`gs://B/P`), through one layer.

Every file of a workdir goes through `etils.epath` here, so `--workdir gs://B/P` is written to
the bucket as it is (Orbax takes the URL itself). A URL never becomes a local path: a string
that looks like one but is malformed (`gs:/B`, `gs:B`) is refused, and `absolute()` leaves URLs
alone (a bare `os.path.abspath("gs://B")` is `<cwd>/gs:/B`).

Object stores have no rename and no append: `write_text_atomic` writes a local file under a
temp name and renames it, and a bucket object in one request (readers see the old object or
the new one, never half); `AppendLog` appends to a local file, and to a bucket object by
composing the new lines onto it (a log written every step at most every `BUCKET_HOLD_SECONDS`).

A storage server that does not answer: gcsfs retries each request itself (6 attempts, 1 to 16 s
apart, about 30 s), which is said here as `[storage]` lines; an operation that still fails is
tried again with backoff until $REALM_JAX_STORAGE_PATIENCE seconds (default 600) have passed
since its first failure, then `StorageUnreachable` names the path. Writes are single requests
(an object is there whole or not at all), so a failure leaves nothing partial visible.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import shutil
import time
import weakref
from typing import Callable

import fsspec
from etils import epath

from realm_jax.errors import ConfigError, IndexWaitTimeout, StorageUnreachable

logger = logging.getLogger(__name__)

# Jobs sharing a bucket workdir watch each other's files (the builder lists the trainer's
# checkpoints, the trainer the builder's versions): gcsfs must list afresh every time, not
# from its listings cache.
for _protocol in ("gs", "gcs"):
  fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")
BUCKET_NAME = r"[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9]"   # Cloud Storage's bucket names
_BROKEN_URL = re.compile(r"^(gs|s3|gcs|hf|https?):/?(?!/)", re.IGNORECASE)


def is_remote(path) -> bool:
  """Whether `path` is a URL (`gs://...`), i.e. not a local file name."""
  return bool(_URL.match(str(path)))


def check(path: str, what: str = "path") -> str:
  """`path` unchanged; a malformed URL (`gs:/B/P`, `gs:B`) is a ConfigError (a ValueError)
  naming `what` (it would otherwise become a local dir called `gs:`)."""
  text = str(path)
  if not is_remote(text) and _BROKEN_URL.match(text):
    raise ConfigError("", f"{what} {text!r}: not a URL (gs://BUCKET/PATH) and not a local "
                      "path")
  if not is_remote(text) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", text):
    raise ConfigError("", f"{what} {text!r}: a URL's scheme is written in lowercase "
                      f"({text.split(':', 1)[0].lower()}://...)")
  if text.startswith("gcs://"):   # gcsfs reads it; Orbax's commit marker and TensorStore not
    raise ConfigError("", f"{what} {text!r}: write the bucket as gs://{text[len('gcs://'):]} "
                      "(checkpoints and their commit markers are read through gs:// only)")
  scheme = "gs://" if text.startswith("gs://") else ""
  if is_remote(text) and not scheme:   # fsspec would name a package to install, or fail later
    raise ConfigError("", f"{what} {text!r}: {text.split('://')[0]}:// is not supported (a "
                      "Cloud Storage bucket, gs://BUCKET/PATH, or a local path)")
  if scheme and not re.fullmatch(BUCKET_NAME, text[len(scheme):].split("/")[0]):
    raise ConfigError("", f"{what} {text!r}: not a bucket name after {scheme} (3-222 lowercase "
                      "letters, digits, '-', '_' and '.', starting and ending with a letter or "
                      "digit): gs://BUCKET/PATH")
  if scheme:
    patience()   # a bad $REALM_JAX_STORAGE_PATIENCE: refused now, not at the first failure
  if is_remote(text) and ("#" in text or "?" in text):   # TensorStore: a fragment or query
    raise ConfigError("", f"{what} {text!r}: '#' and '?' cannot be in a bucket path (the "
                      "checkpoint arrays would go to the path before them)")
  if is_remote(text) and ("*" in text or "[" in text):   # gcsfs: a glob pattern
    raise ConfigError("", f"{what} {text!r}: '*' and '[' cannot be in a bucket path (gcsfs "
                      "reads them as a pattern: removing an old index version or checkpoint "
                      "there would delete the objects of other paths that match it)")
  return text


def absolute(path) -> str:
  """A local path made absolute; a URL as it is."""
  text = check(str(path))
  return text if is_remote(text) else os.path.abspath(text)


# gcsfuse mounts bucket B at MOUNT_ROOT/B on every TPU VM worker (`launch/tpu_pod.py --storage
# gcsfuse`), so a run there records /gcs/B/P for gs://B/P.
MOUNT_ROOT = "/gcs"


def bucket_url(path) -> str:
  """`/gcs/B/P` (a gcsfuse mount of bucket B) as `gs://B/P`, and a `gs://` URL without doubled
  or trailing slashes (as `launch/tpu_pod.py` passes it to the jobs); any other path as it
  is."""
  text = str(path)
  prefix = MOUNT_ROOT + "/"
  if text.startswith(prefix):
    text = "gs://" + text[len(prefix):]
  if not text.startswith("gs://"):
    return text
  return "gs://" + "/".join(part for part in text[len("gs://"):].split("/") if part)


def same_place(a, b) -> bool:
  """Whether two option values name one bucket path (`bucket_url` of both; `/gcs/B/P` and
  `gs://B/P/` alike) or one local path however spelt (`D/`, `./D`); False for values that are
  not both strings."""
  if not (isinstance(a, str) and isinstance(b, str)):
    return False
  a, b = bucket_url(a), bucket_url(b)
  return a == b or (bool(a) and bool(b) and not is_remote(a) and not is_remote(b)
                    and os.path.normpath(a) == os.path.normpath(b))


def join(base, *parts) -> str:
  """`base/part/...` for local paths and URLs alike (a string)."""
  return str(epath.Path(check(str(base))).joinpath(*parts))


# -- a storage server that does not answer ---------------------------------------------------
PATIENCE_ENV = "REALM_JAX_STORAGE_PATIENCE"
DEFAULT_PATIENCE = 600.0    # seconds a bucket may not answer before an operation fails
MAX_BACKOFF = 60.0


def patience() -> float:
  """$REALM_JAX_STORAGE_PATIENCE's seconds (DEFAULT_PATIENCE unset); a ConfigError naming it
  where it is no number of seconds >= 0 (`check` asks as a job is given a bucket path, not
  at its first storage failure, maybe hours in)."""
  text = os.environ.get(PATIENCE_ENV, "")
  try:
    seconds = float(text) if text else DEFAULT_PATIENCE
  except ValueError:
    seconds = math.nan
  if not seconds >= 0:   # (NaN too: it would never retry)
    raise ConfigError("", f"${PATIENCE_ENV}={text!r}: not a number of seconds >= 0 (unset: "
                      f"{DEFAULT_PATIENCE:g})")
  return seconds


def unreachable(error: BaseException) -> bool:
  """Whether `error` (or the error it was raised from) says the storage server did not answer
  (worth retrying), rather than that a file is absent, a request was refused or a certificate
  is wrong."""
  import asyncio
  import aiohttp
  import requests
  for e in (error, error.__cause__):
    if e is None or isinstance(e, (StorageUnreachable, IndexWaitTimeout, FileNotFoundError,
                                   PermissionError)):
      continue   # StorageUnreachable, IndexWaitTimeout: each already waited out its patience
    if isinstance(e, (aiohttp.ClientSSLError, requests.exceptions.SSLError)):
      continue   # a bad certificate does not heal by waiting
    if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError,
                      aiohttp.ClientConnectionError, fsspec.exceptions.FSTimeoutError,
                      requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
      return True
    if type(e).__name__ == "TransportError":   # google-auth could not reach its token server
      return True
    code = getattr(e, "code", None)   # gcsfs's HttpError: 5xx, 408 and 429 are transient
    if isinstance(code, int) and (code >= 500 or code in (408, 429)):
      return True
  return False


def retried(what: str, path, fn):
  """`fn()`; for a bucket path, an unreachable server is retried with backoff (1, 2, 4 ... 60 s)
  and a line per retry, until `patience()` seconds after the first failure: then
  StorageUnreachable naming `path` and `what` was being done."""
  if not is_remote(path):
    return fn()
  first, delay, attempt = None, 1.0, 1
  while True:
    began = time.monotonic()
    try:
      return fn()
    except Exception as e:  # noqa: BLE001  (only an unreachable server is retried)
      if not unreachable(e):
        raise
      first = first or began   # gcsfs's own retries count: it failed since this attempt began
      waited, limit = time.monotonic() - first, patience()
      error = f"{type(e).__name__}: {e}"
      if waited + delay > limit:
        raise StorageUnreachable(
            f"{path}: {what} failed, the storage server did not answer ({attempt} attempts "
            f"over {waited:.0f}s, each retried by gcsfs; last: {error}); giving up after "
            f"${PATIENCE_ENV}={limit:g}s") from e
      logger.warning(f"[storage] {path}: {what} failed ({error}); trying again in {delay:.0f}s "
                     f"({waited:.0f}s of ${PATIENCE_ENV}={limit:g}s)")
      time.sleep(delay)
      delay, attempt = min(2 * delay, MAX_BACKOFF), attempt + 1


class _GcsfsRecords(logging.Handler):
  """Every record of gcsfs and its child loggers: gcsfs retries a failed request itself and
  says so only at debug level; each retry becomes a `[storage]` line (at most one per 5 s) and
  its giving up (an error with a traceback) one line; other warnings and errors go on to the
  root logger's handlers; the rest is dropped."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.last, self.unsaid = 0.0, 0

  def emit(self, record) -> None:
    message = record.getMessage()
    if "out of retries on exception" in message:
      logger.warning(f"[storage] gcsfs gave up on a request after its retries "
                     f"({message.split('exception: ', 1)[-1]})")
    elif "retrying after exception" in message:
      if time.monotonic() - self.last < 5.0:
        self.unsaid += 1
        return
      more = f" (+{self.unsaid} more retries)" if self.unsaid else ""
      logger.warning(
          f"[storage] a request to the bucket failed ({message.split('exception: ', 1)[-1]})"
          f"; gcsfs retries it with backoff{more}")
      self.last, self.unsaid = time.monotonic(), 0
    elif record.levelno >= logging.WARNING:
      logging.getLogger().handle(record)


def _say_gcsfs_retries() -> None:
  """Installs _GcsfsRecords once, unless the user has set gcsfs's log level themselves."""
  log = logging.getLogger("gcsfs")
  if log.level != logging.NOTSET or any(isinstance(h, _GcsfsRecords) for h in log.handlers):
    return
  log.setLevel(logging.DEBUG)
  log.propagate = False
  log.addHandler(_GcsfsRecords())


_say_gcsfs_retries()


# -- files -------------------------------------------------------------------------------------
def exists(path) -> bool:
  return retried("checking", path, epath.Path(path).exists)


def isdir(path) -> bool:
  if not is_remote(path):
    return epath.Path(path).is_dir()
  fs, name = fsspec.core.url_to_fs(str(path))

  def probe() -> bool:   # gcsfs's isdir answers False for any error, an outage included
    try:
      return fs.info(name)["type"] == "directory"
    except FileNotFoundError:
      return False
  return retried("checking", path, probe)


def makedirs(path) -> None:
  """A local dir and its parents; nothing in a bucket (an object's name is its dir there)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def names(directory) -> list[str]:
  """The names of the entries of a folder (local or in a bucket)."""
  return retried("listing", directory,
                 lambda: [p.name for p in epath.Path(directory).iterdir()])


def move_tree(source, target) -> None:
  """Moves a folder (replacing `target`): a rename on local disk; in a bucket, where a folder
  is only its objects' names, each object copied under the new name, then the old deleted."""
  if not is_remote(source):
    if os.path.exists(target):
      shutil.rmtree(target)
    os.makedirs(os.path.dirname(str(target)), exist_ok=True)
    os.rename(source, target)
    return
  fs, name = fsspec.core.url_to_fs(str(source))
  _, new = fsspec.core.url_to_fs(str(target))
  if retried("checking", target, lambda: fs.exists(new)):
    retried("deleting", target, lambda: fs.rm(new, recursive=True))
  retried("moving", source, lambda: fs.mv(name, new, recursive=True))


def remove(path) -> None:
  """Deletes a file if it is there (a retried delete may find it gone already)."""
  retried("deleting", path, lambda: epath.Path(path).unlink(missing_ok=True))


def read_text(path) -> str | None:
  """The file's text, None if it is absent."""
  def read():
    try:
      return epath.Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
      return None
  return retried("reading", path, read)


def fsync(path) -> None:
  """fsync of a local file or directory (a directory's fsync makes renames in it durable)."""
  fd = os.open(str(path), os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_text_atomic(path, text: str, durable: bool = False) -> None:
  """Readers see the old or the new content, never half: a local file via a temp name
  (`<name>.tmp-<pid>`) and a rename, a bucket object in one request. `durable`: the local
  file and its directory are fsynced too, so the new content survives a machine crash."""
  if is_remote(path):
    retried("writing", path, lambda: epath.Path(path).write_text(text, encoding="utf-8"))
    return
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
    if durable:
      f.flush()
      os.fsync(f.fileno())
  os.replace(tmp, str(path))
  if durable:
    fsync(os.path.dirname(os.path.abspath(str(path))))


def read_json(path) -> dict | None:
  text = read_text(path)
  return None if text is None else json.loads(text)


def write_json(path, record: dict) -> None:
  write_text_atomic(path, json.dumps(json_ready(record), indent=2))


def json_ready(value):
  """`value` with every NaN and infinity (at any depth) as None, JSON's null: `json.dumps`
  would write the literals NaN / Infinity, which strict JSON readers refuse."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: json_ready(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_ready(v) for v in value]
  return value


# A bucket log written at every step (a trainer's train and retrieval JSONL) is sent at most
# this often (GCS takes about one write a second to one object). `send_held_lines` sends what
# waits before each checkpoint.
BUCKET_HOLD_SECONDS = 10.0
_HOLDING: weakref.WeakSet = weakref.WeakSet()   # the open bucket logs that hold lines back


def send_held_lines() -> None:
  """Every open bucket `AppendLog`'s held lines, sent now: before a checkpoint, so that the lines
  of the steps it covers are in the bucket (a run resumed from it writes only later steps')."""
  for log in list(_HOLDING):
    log.flush()


class AppendLog:
  """Lines appended to a file: a local file in append mode; a bucket object (no append in an
  object store) through `append_to_object`, which sends only the new lines, so a reader always
  sees complete lines. `hold_seconds` > 0: a bucket's lines are sent at most that often (the
  first after a quiet spell at once), and at `flush`, `send_held_lines` and `close`.

  `keep(line)`: which of the lines already there stay (None: all); the file is rewritten
  without the others at open, readers seeing the old or the new text. A last line without
  its newline (a write cut short) never stays: a line appended after it would join it."""

  def __init__(self, path, keep: Callable[[str], bool] | None = None,
               hold_seconds: float = 0.0):
    self.path, self.remote = str(path), is_remote(path)
    before = read_text(self.path)
    if before is not None:
      complete = before.split("\n")[:-1]   # the last piece: "" or a line cut short
      kept = "".join(line + "\n" for line in complete if keep is None or keep(line))
      if kept != before:
        write_text_atomic(self.path, kept)
    # a bucket's: lines not in the object yet (held back, or a send that failed)
    self._unwritten: list[str] = []
    self._generation = None if before is None else ""   # "": there, generation not read yet
    self._doubt: tuple[str, int] | None = None   # a failed send's (generation, lines): done?
    self.hold_seconds, self._sent = hold_seconds, -math.inf
    if self.remote:
      self._file = None
      if hold_seconds > 0:
        _HOLDING.add(self)
    else:
      self._file = open(self.path, "a")

  def write(self, line: str) -> None:
    if self.remote:
      self._unwritten.append(line)
      if time.monotonic() - self._sent >= self.hold_seconds:
        self._send()
    else:
      self._file.write(line)
      self._file.flush()

  def flush(self) -> None:
    """A bucket's lines not in the object yet, sent now (a local file's are on disk)."""
    if self._unwritten:
      self._send()

  def _send(self) -> None:
    if self._doubt is not None:
      self._settle()
      if not self._unwritten:   # the failed send's lines were all there is, and are there
        return
    text = "".join(self._unwritten)
    if self._generation == "":   # read first: a retry of the append must not read its own
      self._generation = retried("reading", self.path, lambda: object_generation(self.path))
    try:
      self._generation = retried("appending to", self.path,
                                 lambda: append_to_object(self.path, text, self._generation))
    except BaseException:
      if self._generation:   # appended to an object that was there: done, its answer lost?
        self._doubt = (self._generation, len(self._unwritten))
      raise
    self._unwritten, self._sent = [], time.monotonic()

  def _settle(self) -> None:
    """After a send that gave up, which may have been done all the same (its answer lost):
    where the object is past the generation that send appended to, its lines are there and
    are dropped here (sent again, they would be refused with the next lines as a retry of a
    done compose, or doubled where a compose is not refused); where the object is still at
    it, they go with the next lines."""
    generation, lines = self._doubt
    now = retried("reading", self.path, lambda: object_generation(self.path))
    if now != generation:
      del self._unwritten[:lines]
      self._generation = now
    self._doubt = None

  def close(self) -> None:
    """A bucket's lines not in the object yet (held back, or left out by a failed send that
    the next write would have carried) are written now: the last ones would be lost for good
    otherwise; where the bucket still does not answer, a warning says so."""
    _HOLDING.discard(self)
    if self._file is not None:
      self._file.close()
    elif self._unwritten:
      try:
        self._send()
      except OSError as e:   # StorageUnreachable among them: the job's work is done
        logger.warning(f"{self.path}: its last lines are not written ({type(e).__name__}: "
                       f"{e})")


_NOT_COMPOSED: set[str] = set()   # bucket objects whose compose was refused: rewritten whole


def object_generation(url: str) -> str | None:
  """The bucket object's generation (a number, as text); None where it is not there."""
  fs, name = fsspec.core.url_to_fs(url)
  try:
    return str(fs.info(name)["generation"])
  except FileNotFoundError:
    return None


def append_to_object(url: str, text: str, generation: str | None) -> str:
  """Appends `text` to the bucket object `url` of `generation` (None: not there yet) and
  returns its generation after ("": not known, read it before the next append). Only `text`
  is sent: as an object of its own (`<url>.append`), composed onto the end of `url` by the
  server and deleted. The compose names the generation it appends to, so a retry of one that
  was done but whose answer was lost is refused (412), not done twice. Where the bucket
  refuses the compose (a zonal bucket has none), the object is rewritten whole, and not again
  by a retry of a rewrite done whose answer was lost (the object is past `generation`)."""
  if generation is None:
    epath.Path(url).write_text(text)
    return ""
  if url in _NOT_COMPOSED:
    return _rewrite_whole(url, text, generation)
  fs, _ = fsspec.core.url_to_fs(url)
  bucket, key, _ = fs.split_path(url)
  part = f"{key}.append"
  epath.Path(f"{url}.append").write_text(text)
  try:
    done = fs.call("POST", "b/{}/o/{}/compose", bucket, key, ifGenerationMatch=generation,
                   json={"kind": "storage#composeRequest",
                         "sourceObjects": [{"name": key}, {"name": part}],
                         "destination": {"name": key, "bucket": bucket}}, json_out=True)
    generation = str(done["generation"])
  except FileExistsError:   # 412: `url` is past `generation`, this very compose done before
    generation = ""
  except Exception as e:  # noqa: BLE001  (an unreachable server: retried by the caller)
    if unreachable(e):
      raise
    _NOT_COMPOSED.add(url)
    logger.warning(f"[storage] {url}: the bucket does not compose objects ({type(e).__name__}: "
                   f"{e}); each append rewrites it whole from now on")
    generation = _rewrite_whole(url, text, generation)
  with contextlib.suppress(Exception):   # (left behind, the next append writes it over)
    fs.rm(f"{bucket}/{part}")
  return generation


def _rewrite_whole(url: str, text: str, generation: str) -> str:
  """The object `url` rewritten with `text` added, unless it is past `generation` (the
  generation read before this append): then this very rewrite was done before, its answer
  lost, and the object holds `text`. Returns "" (read the generation before the next)."""
  if object_generation(url) == generation:
    epath.Path(url).write_text((read_text(url) or "") + text)
  return ""


# -- a prepared data dir in a bucket -----------------------------------------------------------
FILES_MANIFEST = "files.json"   # every file of an uploaded dir: size and sha256 (written last)
COPIED = ".copied.json"   # a local copy's: the files.json (or listing) of its finished copy
_CHUNK = 8 << 20


def sha256_file(path) -> str:
  """Hex sha256 of a file (local or in a bucket), read in chunks."""
  import hashlib
  digest = hashlib.sha256()
  with epath.Path(path).open("rb") as f:
    while chunk := f.read(_CHUNK):
      digest.update(chunk)
  return digest.hexdigest()


def _local_files(directory: str) -> list[str]:
  """Relative paths of every file under `directory`, sorted."""
  out = []
  for root, _, files in os.walk(directory):
    out += [os.path.relpath(os.path.join(root, f), directory) for f in files]
  return sorted(out)


# Uploaded after the files they name, the deepest first: an index version's manifest, Orbax's
# marker of a complete checkpoint in a bucket, the index's LATEST, a workdir's config.
COMMIT_FILES = ("manifest.json", "commit_success.txt", "LATEST", "config.json")


def upload_tree(local_dir: str, url: str, log=print, exclude: str = "") -> dict:
  """Copies `local_dir` (but names starting with `exclude`) to `url` file by file, a dir's
  commit files (COMMIT_FILES) after its other files, then writes `url/files.json` (size and
  sha256 of each: the commit marker a reader checks). Returns that manifest. `log` hears
  the files' count and bytes first, then each file with the MB/s so far and an ETA."""
  files = {}
  names = [n for n in _local_files(local_dir)
           if n not in (FILES_MANIFEST, COPIED) and not (exclude and n.startswith(exclude))]
  names.sort(key=lambda n: (os.path.basename(n) in COMMIT_FILES,
                            -n.count("/") if os.path.basename(n) in COMMIT_FILES else 0, n))
  total = sum(os.path.getsize(os.path.join(local_dir, n)) for n in names)
  log(f"uploading {len(names)} files ({total:,} bytes) to {url}")
  t0, sent = time.time(), 0
  for i, name in enumerate(names):
    source = os.path.join(local_dir, name)
    target = upload_file(source, epath.Path(url) / name)
    files[name] = {"bytes": os.path.getsize(source), "sha256": sha256_file(source)}
    sent += files[name]["bytes"]
    log(f"uploaded {i + 1}/{len(names)}: {target} ({files[name]['bytes']:,} bytes)"
        + _transfer_rate(sent, total, t0))
  manifest = {"files": files}
  write_text_atomic(join(url, FILES_MANIFEST), manifest_text(manifest))
  return manifest


def upload_file(source: str, target) -> epath.Path:
  """The local file `source` copied to `target` (a bucket path; its dir made), retried while
  the bucket does not answer, up to the storage patience. Returns `target`."""
  target = epath.Path(target)
  makedirs(target.parent)
  retried("uploading", target, lambda: epath.Path(source).copy(target, overwrite=True))
  return target


def manifest_text(manifest: dict) -> str:
  """A files.json's text, as `upload_tree` writes it."""
  return json.dumps(manifest, indent=1, sort_keys=True)


def mark_copied(local: str, manifest: dict) -> None:
  """`local` (`cache_dir(url)`, where realm-prepare prepared what it uploaded to `url` with
  `manifest`) marked as the finished copy of `url`: `local_copy` reuses it as it is, and
  removes its files that a later upload to `url` (from another host) does not name."""
  write_text_atomic(os.path.join(local, COPIED), manifest_text(manifest))


def cache_dir(url: str) -> str:
  """The local copy of `url`: $REALM_JAX_CACHE (default ~/.cache/realm_jax)/<url hash>, the
  hash of the URL as its objects are named (`gs://B/P/` and `gs://B//P` are `gs://B/P`)."""
  import hashlib
  root = os.environ.get("REALM_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "realm_jax")
  name = str(epath.Path(url))
  return os.path.join(root, "data", hashlib.sha256(name.encode()).hexdigest()[:16])


def local_side(workdir: str, name: str) -> str:
  """`workdir/name` for a local workdir; for a bucket workdir the local path that stands in
  for it (`cache_dir(workdir)/name`): files appended line by line or flushed often (logs,
  TensorBoard events), which an object store would take whole again at every write."""
  return join(cache_dir(workdir), name) if is_remote(workdir) else join(workdir, name)


def local_dir(data_dir: str, log=print) -> str:
  """`data_dir` itself when local, else its verified local copy (`local_copy`)."""
  return local_copy(data_dir, log) if is_remote(data_dir) else data_dir


def local_copy(url: str, log=print) -> str:
  """A verified local copy of the dir `upload_tree` wrote at `url` (memory-mapped arrays need a
  local file): each file copied once into `cache_dir(url)` and checked against the manifest's
  size and sha256; a later call with the same manifest reuses it. Returns the local dir."""
  text = read_text(join(url, FILES_MANIFEST))
  if text is None:
    raise FileNotFoundError(f"{url}: no {FILES_MANIFEST} (not a data dir realm-prepare "
                            "uploaded, or its upload did not finish)")
  return _fetch_all(url, json.loads(text)["files"], text, log)


def local_mirror(url: str, log=print) -> str:
  """A local copy of a dir in a bucket that no realm_jax job uploaded (a Hugging Face
  checkpoint): every object under `url` copied once into `cache_dir(url)`, each checked against
  the size the listing gives, and reused while the listing (names, sizes, generations) is the
  same. A dir with files.json goes through `local_copy` (sha256 checked too)."""
  if exists(join(url, FILES_MANIFEST)):
    return local_copy(url, log)
  fs, root = fsspec.core.url_to_fs(url)
  found = retried("listing", url, lambda: fs.find(root, detail=True))
  files = {os.path.relpath(p, root): {"bytes": int(info["size"]),
                                      "generation": str(info.get("generation", ""))}
           for p, info in found.items() if info.get("type") == "file"}
  if not files:
    raise FileNotFoundError(f"{url}: no files there")
  return _fetch_all(url, files, json.dumps(files, sort_keys=True), log)


def _fetch_all(url: str, files: dict, stamp_text: str, log) -> str:
  """Copies each of `files` ({name: {"bytes", ["sha256" | "generation"]}}) from `url` into
  `cache_dir(url)` unless a checked copy is there (one checked by its size alone is not, where
  the finished copy before named it with another generation: an object written again with
  the same size), and removes those the finished copy before named that `files` does not
  (gone from `url` since); `stamp_text` marks the finished copy. The local dir."""
  local = cache_dir(url)
  stamp = os.path.join(local, COPIED)
  before = read_text(stamp)
  if before == stamp_text:
    return local
  copied = _stamped(before)
  names = sorted(files)
  todo = {name for name in names if not (_matches(os.path.join(local, name), files[name]) and (
      "sha256" in files[name] or copied.get(name, files[name]) == files[name]))}
  total = sum(files[name]["bytes"] for name in todo)
  if todo:
    log(f"copying {len(todo)} of {len(names)} files ({total:,} bytes) of {url} into {local}")
  t0, came = time.time(), 0
  for i, name in enumerate(names):
    want, target = files[name], os.path.join(local, name)
    if name not in todo:
      continue
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    retried("copying", join(url, name), lambda: (epath.Path(url) / name).copy(
        tmp, overwrite=True))
    if not _matches(tmp, want):
      got = (os.path.getsize(tmp), sha256_file(tmp))
      os.remove(tmp)
      raise OSError(f"{url}/{name}: copied {got[0]:,} bytes with sha256 {got[1][:12]}..., "
                    f"expected {want['bytes']:,} bytes" +
                    (f", {want['sha256'][:12]}..." if "sha256" in want else ""))
    os.replace(tmp, target)
    came += want["bytes"]
    log(f"copied {i + 1}/{len(names)}: {url}/{name} -> {target} ({want['bytes']:,} bytes, "
        "verified)" + _transfer_rate(came, total, t0))
  for name in set(copied) - set(files):   # gone from `url`: a reader must not find it
    with contextlib.suppress(FileNotFoundError):   # (another process of the job removed it)
      os.remove(os.path.join(local, name))
  _remove_killed_copies(local)
  write_text_atomic(stamp, stamp_text)
  return local


def _transfer_rate(done: int, total: int, t0: float) -> str:
  """` | <MB/s> MB/s ETA <time>` of a transfer of `total` bytes started at `t0`, `done` moved."""
  from realm_jax.log import format_duration
  rate = done / max(time.time() - t0, 1e-9)
  return f" | {rate / 1e6:,.1f} MB/s ETA {format_duration((total - done) / max(rate, 1e-9))}"


def _remove_killed_copies(local: str) -> None:
  """Removes the `<name>.tmp-<pid>` files under `local` whose process is gone: a copy killed
  while a file came left up to that file's size, which no later copy (another pid) reuses.
  A live process's (another process of the job copying on this host) is left to it."""
  for root, _, names in os.walk(local):
    for name in names:
      pid = name.rpartition(".tmp-")[2]
      if ".tmp-" in name and pid.isdigit() and not _process_alive(int(pid)):
        with contextlib.suppress(FileNotFoundError):
          os.remove(os.path.join(root, name))


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:   # another user's: alive
    return True
  return True


def _stamped(text: str | None) -> dict:
  """The files a finished copy's stamp names ({name: {"bytes", "sha256" | "generation"}}:
  `local_copy`'s, a files.json, holds them under "files"); {} for none."""
  try:
    record = json.loads(text) if text else {}
  except ValueError:
    return {}
  record = record.get("files", record) if isinstance(record, dict) else {}
  return record if isinstance(record, dict) else {}


def _matches(path: str, want: dict) -> bool:
  """The local file has the size (and, when given, the sha256) `want` names."""
  return os.path.exists(path) and os.path.getsize(path) == want["bytes"] and (
      "sha256" not in want or sha256_file(path) == want["sha256"])

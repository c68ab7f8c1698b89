"""Where a run's files live: a local path or a bucket URL (`gs://B/P`), through one layer.

Every file of a workdir goes through `etils.epath` here, so `--workdir gs://B/P` is written to
the bucket as it is (Orbax takes the URL itself). A URL never becomes a local path: a string
that looks like one but is malformed (`gs:/B`, `gs:B`) is refused, and `absolute()` leaves URLs
alone (a bare `os.path.abspath("gs://B")` is `<cwd>/gs:/B`).

Object stores have no rename and no append: `write_text_atomic` writes a local file under a
temp name and renames it, and a bucket object in one request (readers see the old object or
the new one, never half); `AppendLog` appends to a local file and rewrites the object of a
remote one.
"""

from __future__ import annotations

import json
import os
import re

import fsspec
from etils import epath

# Jobs sharing a bucket workdir watch each other's files (the builder lists the trainer's
# checkpoints, the trainer the builder's versions): gcsfs must list afresh every time, not
# from its listings cache.
for _protocol in ("gs", "gcs"):
  fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)

_URL = re.compile(r"^[a-z][a-z0-9+.-]*://")
_BROKEN_URL = re.compile(r"^(gs|s3|gcs|hf|https?):/?(?!/)", re.IGNORECASE)


def is_remote(path) -> bool:
  """Whether `path` is a URL (`gs://...`), i.e. not a local file name."""
  return bool(_URL.match(str(path)))


def check(path: str, what: str = "path") -> str:
  """`path` unchanged; a malformed URL (`gs:/B/P`, `gs:B`) is an error naming `what` (it would
  otherwise become a local dir called `gs:`)."""
  text = str(path)
  if not is_remote(text) and _BROKEN_URL.match(text):
    raise ValueError(f"{what} {text!r}: not a URL (gs://BUCKET/PATH) and not a local path")
  return text


def absolute(path) -> str:
  """A local path made absolute; a URL as it is."""
  text = check(str(path))
  return text if is_remote(text) else os.path.abspath(text)


def join(base, *parts) -> str:
  """`base/part/...` for local paths and URLs alike (a string)."""
  return str(epath.Path(check(str(base))).joinpath(*parts))


def exists(path) -> bool:
  return epath.Path(path).exists()


def isdir(path) -> bool:
  return epath.Path(path).is_dir()


def makedirs(path) -> None:
  epath.Path(path).mkdir(parents=True, exist_ok=True)


def remove(path) -> None:
  """Deletes a file if it is there."""
  p = epath.Path(path)
  if p.exists():
    p.unlink()


def read_text(path) -> str | None:
  """The file's text, None if it is absent."""
  p = epath.Path(path)
  try:
    return p.read_text()
  except FileNotFoundError:
    return None


def write_text_atomic(path, text: str) -> None:
  """Readers see the old or the new content, never half: a local file via a temp name and a
  rename, a bucket object in one request."""
  if is_remote(path):
    epath.Path(path).write_text(text)
    return
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, str(path))


def read_json(path) -> dict | None:
  text = read_text(path)
  return None if text is None else json.loads(text)


def write_json(path, record: dict) -> None:
  write_text_atomic(path, json.dumps(record, indent=2))


class AppendLog:
  """Lines appended to a file: a local file in append mode; a bucket object (no append in an
  object store) rewritten whole after each append, from what it held at open plus the new
  lines, so a reader always sees complete lines."""

  def __init__(self, path):
    self.path, self.remote = str(path), is_remote(path)
    if self.remote:
      self._lines = read_text(self.path) or ""
      self._file = None
    else:
      self._file = open(self.path, "a")

  def write(self, line: str) -> None:
    if self.remote:
      self._lines += line
      epath.Path(self.path).write_text(self._lines)
    else:
      self._file.write(line)
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


# -- a prepared data dir in a bucket -----------------------------------------------------------
FILES_MANIFEST = "files.json"   # every file of an uploaded dir: size and sha256 (written last)
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


def upload_tree(local_dir: str, url: str, log=print) -> dict:
  """Copies `local_dir` to `url` file by file, then writes `url/files.json` (size and sha256
  of each: the commit marker a reader checks). Returns that manifest."""
  files = {}
  names = [n for n in _local_files(local_dir) if n != FILES_MANIFEST]
  for i, name in enumerate(names):
    source = os.path.join(local_dir, name)
    target = epath.Path(url) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    epath.Path(source).copy(target, overwrite=True)
    files[name] = {"bytes": os.path.getsize(source), "sha256": sha256_file(source)}
    log(f"uploaded {i + 1}/{len(names)}: {target} ({files[name]['bytes']:,} bytes)")
  manifest = {"files": files}
  (epath.Path(url) / FILES_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
  return manifest


def cache_dir(url: str) -> str:
  """The local copy of `url`: $REALM_JAX_CACHE (default ~/.cache/realm_jax)/<url hash>."""
  import hashlib
  root = os.environ.get("REALM_JAX_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "realm_jax")
  return os.path.join(root, "data", hashlib.sha256(url.encode()).hexdigest()[:16])


def local_copy(url: str, log=print) -> str:
  """A verified local copy of the dir `upload_tree` wrote at `url` (memory-mapped arrays need a
  local file): each file copied once into `cache_dir(url)` and checked against the manifest's
  size and sha256; a later call with the same manifest reuses it. Returns the local dir."""
  text = read_text(join(url, FILES_MANIFEST))
  if text is None:
    raise FileNotFoundError(f"{url}: no {FILES_MANIFEST} (not a data dir realm-prepare "
                            "uploaded, or its upload did not finish)")
  manifest = json.loads(text)
  local = cache_dir(url)
  stamp = os.path.join(local, FILES_MANIFEST)
  if read_text(stamp) == text:
    return local
  names = sorted(manifest["files"])
  for i, name in enumerate(names):
    want, target = manifest["files"][name], os.path.join(local, name)
    if os.path.exists(target) and os.path.getsize(target) == want["bytes"] and \
        sha256_file(target) == want["sha256"]:
      continue
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    (epath.Path(url) / name).copy(tmp, overwrite=True)
    got = (os.path.getsize(tmp), sha256_file(tmp))
    if got != (want["bytes"], want["sha256"]):
      os.remove(tmp)
      raise OSError(f"{url}/{name}: copied {got[0]:,} bytes with sha256 {got[1][:12]}..., "
                    f"{FILES_MANIFEST} says {want['bytes']:,} bytes, {want['sha256'][:12]}...")
    os.replace(tmp, target)
    log(f"copied {i + 1}/{len(names)}: {url}/{name} -> {target} ({want['bytes']:,} bytes, "
        "verified)")
  write_text_atomic(stamp, text)
  return local

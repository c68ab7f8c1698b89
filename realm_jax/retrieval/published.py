"""Published block-index versions on disk: `W/index/<version>/`, complete or invisible.

The builder job calls `start_version`, writes the index files into the staging dir, then
`publish`; the trainer calls `read_latest` / `complete_versions` and `verify` before using a
version. Locally a version is staged in a `.tmp-*` dir and renamed into place; on remote paths
(`gs://`, no atomic rename) files go straight into the final dir and `manifest.json`, written
last, is the commit marker. Readers treat a version dir without a manifest as not there.

Every version holds `embeddings.npy` (the block embeddings, [num_blocks, dim] float32) and
`query_params.npz` (the query tower of the same snapshot, flattened with '/'); this module
writes (`write_arrays`, `publish_arrays`) and reads (`read_embeddings`, `read_query_params`)
them for the builder, Open-QA's frozen index, the HF import and the trainer.
"""

from __future__ import annotations

import json
import os
import re
import time

import numpy as np
from etils import epath

from realm_jax import paths
from realm_jax.paths import sha256_file  # noqa: F401  (also read as published.sha256_file)

MANIFEST = "manifest.json"
EMBEDDINGS = "embeddings.npy"
QUERY_PARAMS = "query_params.npz"
LATEST = "LATEST"
# Keys a manifest must hold; `fields` given to `publish` must hold all but version and files.
REQUIRED_KEYS = ("version", "step", "num_blocks", "dim", "backend", "block_store_fingerprint",
                 "files", "timings")
_VERSION_NAME = re.compile(r"^[0-9]{8}$")
_STAGING_PREFIX = ".tmp-"


class RejectedVersion(Exception):
  """An index version that must not be used; `str(e)` is the reason."""

  def __init__(self, version: int, reason: str):
    super().__init__(reason)
    self.version = version
    self.reason = reason


def index_root(workdir) -> epath.Path:
  return epath.Path(workdir) / "index"


def version_dir(root, version: int) -> epath.Path:
  return epath.Path(root) / f"{version:08d}"


def _version_names(root: epath.Path) -> dict[int, epath.Path]:
  """Every dir named like a version (8 digits), complete or not."""
  if not root.exists():
    return {}
  return {int(p.name): p for p in root.iterdir() if _VERSION_NAME.match(p.name) and p.is_dir()}


def read_latest(root) -> int | None:
  """The version LATEST names; None if LATEST is absent or garbled."""
  path = epath.Path(root) / LATEST
  try:
    text = path.read_text().strip() if path.exists() else ""
  except (FileNotFoundError, UnicodeDecodeError):  # Deleted between exists() and read.
    return None
  return int(text) if _VERSION_NAME.match(text) else None


def complete_versions(root) -> list[int]:
  """Version dirs that hold a manifest, ascending."""
  return sorted(v for v, p in _version_names(epath.Path(root)).items()
                if (p / MANIFEST).exists())


def start_version(root) -> tuple[int, epath.Path]:
  """Picks the next version number and returns (version, staging dir to write files into).

  The number exceeds every version dir (even without a manifest) and LATEST, so a number is
  never reused: a reader that cached version N never sees different files under N.
  """
  root = epath.Path(root)
  root.mkdir(parents=True, exist_ok=True)
  version = 1 + max([*_version_names(root), read_latest(root) or 0, 0])
  if paths.is_remote(root):
    staging = version_dir(root, version)
  else:
    staging = root / f"{_STAGING_PREFIX}{version:08d}-{os.getpid()}"
    if staging.exists():
      staging.rmtree()
  staging.mkdir(parents=True, exist_ok=True)
  return version, staging


def abandon(staging) -> None:
  """Removes what a failed write left of an unpublished version (no manifest: no reader ever
  used it)."""
  staging = epath.Path(staging)
  if staging.exists() and not (staging / MANIFEST).exists():
    staging.rmtree()


def _list_files(directory: epath.Path, prefix: str = "") -> list[tuple[str, epath.Path]]:
  out = []
  for p in sorted(directory.iterdir(), key=lambda p: p.name):
    rel = f"{prefix}{p.name}"
    if p.is_dir():
      out.extend(_list_files(p, rel + "/"))
    elif rel != MANIFEST:
      out.append((rel, p))
  return out


def publish(root, version: int, staging, fields: dict, keep: int) -> dict:
  """Commits the files under `staging` as `version`, points LATEST at it, prunes old versions.

  Args:
    root: the index root (`index_root(workdir)`).
    version: the number `start_version` returned.
    staging: the dir `start_version` returned, holding every file of the version.
    fields: step, num_blocks, dim, backend, block_store_fingerprint, timings, and any extra
      keys; all are copied into the manifest.
    keep: how many of the newest complete versions to keep (>= 1).

  Returns:
    The manifest written.
  """
  root, staging = epath.Path(root), epath.Path(staging)
  target = version_dir(root, version)
  local = not paths.is_remote(root)
  missing = [k for k in REQUIRED_KEYS if k not in ("version", "files") and k not in fields]
  if missing or keep < 1:
    raise ValueError(f"publish needs fields {missing} and keep >= 1 (got {keep})")
  if not local and staging != target:
    raise ValueError(f"remote versions are written in place: staging {staging} != {target}")
  if local and target.exists():
    raise FileExistsError(f"index version dir {target} already exists; numbers are not reused")
  files = {}
  for rel, path in _list_files(staging):
    if local:
      paths.fsync(path)
    files[rel] = {"bytes": path.stat().length, "sha256": sha256_file(path)}
  manifest = {"version": version, **fields, "files": files, "created": time.time()}
  text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
  if local:
    paths.write_text_atomic(staging / MANIFEST, text, durable=True)
    os.rename(str(staging), str(target))
    paths.fsync(root)
  else:
    (target / MANIFEST).write_text(text)
  point_latest(root, version, keep)
  return manifest


def point_latest(root, version: int, keep: int) -> None:
  """Points LATEST at the complete `version` (unless it names a newer one) and prunes: the
  last part of `publish`, which a publisher whose LATEST write failed calls again."""
  root = epath.Path(root)
  latest = read_latest(root)
  if latest is None or latest < version:
    if paths.is_remote(root):
      (root / LATEST).write_text(f"{version:08d}\n")
    else:
      paths.write_text_atomic(root / LATEST, f"{version:08d}\n", durable=True)
  _prune(root, keep)


def _prune(root: epath.Path, keep: int) -> None:
  """Deletes version dirs older than the `keep` newest complete ones, never LATEST's."""
  kept = complete_versions(root)[-keep:]
  if not kept:
    return
  latest = read_latest(root)
  for v, path in sorted(_version_names(root).items()):
    if v < kept[0] and v != latest:
      # Manifest first, so a half-deleted dir never looks complete to a reader.
      if (path / MANIFEST).exists():
        (path / MANIFEST).unlink()
      path.rmtree()


def read_manifest(root, version: int) -> dict:
  """The manifest of `version`; RejectedVersion if it is missing, not JSON, or incomplete."""
  path = version_dir(root, version) / MANIFEST
  if not path.exists():
    raise RejectedVersion(version, f"no {MANIFEST} in {path.parent} (not published)")
  try:
    manifest = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise RejectedVersion(version, f"{MANIFEST} of {path.parent} is not valid JSON: {e}") from e
  if not isinstance(manifest, dict):
    raise RejectedVersion(version, f"{MANIFEST} of {path.parent} is not a JSON object")
  missing = [k for k in REQUIRED_KEYS if k not in manifest]
  if missing:
    raise RejectedVersion(version, f"{MANIFEST} of {path.parent} lacks keys {missing}")
  wrong = _wrong_types(manifest)
  if wrong:
    raise RejectedVersion(version, f"{MANIFEST} of {path.parent}: {wrong}")
  if manifest["version"] != version:
    raise RejectedVersion(version, f"{MANIFEST} says version {manifest['version']} != {version}")
  return manifest


def _wrong_types(manifest: dict) -> str:
  """What in a manifest has the wrong type ("" if nothing): a reader indexes every field."""
  for key in ("version", "step", "num_blocks", "dim"):
    if type(manifest[key]) is not int:
      return f"{key} is {manifest[key]!r}, not an integer"
  files = manifest["files"]
  if not isinstance(files, dict):
    return f"files is a {type(files).__name__}, not an object"
  for rel, entry in files.items():
    if not (isinstance(entry, dict) and type(entry.get("bytes")) is int
            and isinstance(entry.get("sha256"), str)):
      return f"files[{rel!r}] is {entry!r}, not {{\"bytes\": int, \"sha256\": str}}"
  if manifest["backend"] == "scann" and not isinstance(manifest.get("scann"), dict):
    return "a ScaNN version without its settings (\"scann\": {...})"
  return ""


def verify(root, version: int, *, fingerprint: str | None = None,
           dim: int | None = None) -> dict:
  """Checks the manifest against the trainer's expectations and every file's size and sha256.

  Args:
    root: the index root.
    version: the version to check.
    fingerprint: the trainer's block store fingerprint; None skips the check.
    dim: the trainer's retrieval embedding dim; None skips the check.

  Returns:
    The manifest. Raises RejectedVersion with the reason otherwise.
  """
  manifest = read_manifest(root, version)
  if fingerprint is not None and manifest["block_store_fingerprint"] != fingerprint:
    raise RejectedVersion(version, f"block store fingerprint {manifest['block_store_fingerprint']}"
                          f" (index) != {fingerprint} (trainer)")
  if dim is not None and manifest["dim"] != dim:
    raise RejectedVersion(version, f"dim {manifest['dim']} (index) != {dim} (trainer)")
  directory = version_dir(root, version)
  for rel, want in sorted(manifest["files"].items()):
    path = directory / rel
    if not path.exists():
      raise RejectedVersion(version, f"{rel} is listed in {MANIFEST} but missing")
    size = path.stat().length
    if size != want["bytes"]:
      raise RejectedVersion(version, f"{rel} has size {size} bytes != {want['bytes']} bytes "
                            f"in {MANIFEST}")
    digest = sha256_file(path)
    if digest != want["sha256"]:
      raise RejectedVersion(version, f"{rel} has sha256 {digest} != {want['sha256']} "
                            f"in {MANIFEST}")
  return manifest


def clean_staging(root) -> list[str]:
  """Removes staging dirs and LATEST temp files left by a killed builder (local roots only).

  Only this process's own staging dirs are spared, so call it before `start_version` and
  with one builder per workdir. Returns the paths removed.
  """
  root = epath.Path(root)
  if paths.is_remote(root) or not root.exists():
    return []
  removed = []
  own_suffix = f"-{os.getpid()}"
  for p in sorted(root.iterdir(), key=lambda p: p.name):
    if p.name.startswith(_STAGING_PREFIX) and p.is_dir() and not p.name.endswith(own_suffix):
      p.rmtree()
    elif p.name.startswith(f"{LATEST}.tmp-") and not p.is_dir():
      p.unlink()
    else:
      continue
    removed.append(str(p))
  return removed


# -- the arrays of a version -------------------------------------------------------------------
def write_arrays(staging, embeddings: np.ndarray, query_params: dict) -> None:
  """The files every version has, into its staging dir (see the module doc). A failed write
  raises OSError naming the file, with its errno (ENOSPC for a full disk)."""
  from flax import traverse_util
  staging = epath.Path(staging)
  embeddings = np.ascontiguousarray(embeddings)
  path = staging / EMBEDDINGS
  try:
    with path.open("wb") as f:
      # np.save's own writer (ndarray.tofile) drops the errno of a failed write
      np.lib.format.write_array_header_1_0(
          f, np.lib.format.header_data_from_array_1_0(embeddings))
      f.write(embeddings.data)
    path = staging / QUERY_PARAMS
    with path.open("wb") as f:
      np.savez(f, **traverse_util.flatten_dict(query_params, sep="/"))
  except OSError as e:
    raise OSError(e.errno, e.strerror or str(e), str(path)) from e


def publish_arrays(root, embeddings: np.ndarray, query_params: dict, *, step: int,
                   fingerprint: str, keep: int, backend: str = "exact",
                   timings: dict | None = None, **fields) -> dict:
  """Block embeddings computed elsewhere (Open-QA's frozen index, an imported checkpoint's) as
  the next version of `root` (`W/index`), with no other index files; returns its manifest."""
  version, staging = start_version(root)
  embeddings = np.asarray(embeddings, np.float32)
  write_arrays(staging, embeddings, query_params)
  return publish(root, version, staging, dict(
      step=int(step), num_blocks=int(embeddings.shape[0]), dim=int(embeddings.shape[1]),
      backend=backend, block_store_fingerprint=fingerprint, timings=timings or {}, **fields),
      keep=keep)


def read_embeddings(root, version: int, manifest: dict) -> np.ndarray:
  """A verified version's block embeddings, of the shape its manifest states."""
  with (version_dir(root, version) / EMBEDDINGS).open("rb") as f:
    embeddings = np.load(f)
  if embeddings.shape != (manifest["num_blocks"], manifest["dim"]):
    raise RejectedVersion(version, f"{EMBEDDINGS} has shape {embeddings.shape}, the manifest "
                          f"says ({manifest['num_blocks']}, {manifest['dim']})")
  return embeddings


def read_query_params(root, version: int, template: dict) -> dict:
  """A version's query-tower params, refused unless their shapes are `template`'s."""
  from flax import traverse_util
  with (version_dir(root, version) / QUERY_PARAMS).open("rb") as f:
    flat = dict(np.load(f))
  expected = {k: tuple(v.shape) for k, v in
              traverse_util.flatten_dict(template, sep="/").items()}
  got = {k: tuple(v.shape) for k, v in flat.items()}
  if got != expected:
    diff = sorted(set(got.items()) ^ set(expected.items()))[:3]
    raise RejectedVersion(version, f"{QUERY_PARAMS} does not fit this model's query tower "
                          f"(first differences: {diff})")
  return traverse_util.unflatten_dict(flat, sep="/")

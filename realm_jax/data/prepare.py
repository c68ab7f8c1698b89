"""`realm-prepare --config configs/prepare.py --config.source=... --config.out_dir=DIR`.

source -> (validated, de-duplicated documents) -> vocab (copied or trained) -> shards of
`shard_documents` documents, packed in parallel by `num_workers` processes into
`DIR/shards/<i>/` -> one merge into the memory-mapped block store and examples (layout in
`realm_jax.data.corpus`) -> QA sets -> `DIR/stats.json`, written last.

Restartable: `DIR/prepare.json` records the settings; a re-run with the same settings reuses
the vocab where it was made from the same file or the same first documents (`DIR/vocab.json`),
and every finished shard (its `done.json` exists) that holds the same documents encoded with
the same vocab (a source edited since is packed again where it changed); a finished
preparation (stats.json present) is returned as is.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter, deque

import ml_collections
import numpy as np
from etils import epath

from realm_jax import packages, paths
from realm_jax.data import corpus, sources
from realm_jax.data.prepared import write_stats, write_titles
from realm_jax.data.tokenizer import check_uncased, load_tokenizer, train_tokenizer
from realm_jax.errors import ConfigError, DataError, WorkerDied

logger = logging.getLogger("realm_jax.data.prepare")   # (__name__ is __main__ under python -m)

# Why a kept question's answer is in no block of its paragraph (stats.json: questions_unfound).
ANSWER_UNSPELT = "no answer the vocab can spell ([UNK], or nothing left normalised)"
ANSWER_NOT_IN_BLOCKS = "answer not in its paragraph's blocks"   # not in its context at all,
                                                                # or across a block boundary
ANSWER_TOO_WIDE = "answer wider than the reader's spans (model.max_span_width)"
# Settings that change the output: a re-run must agree on all of them to reuse anything.
# (A field a prepare.json written before it was added lacks reads as its default.)
FINGERPRINT_FIELDS = ("source", "title_field", "text_field", "tfds_data_dir", "world_seed",
                      "vocab", "vocab_size", "vocab_documents", "block_len", "max_sentence_len",
                      "max_masks", "tagger", "eval_fraction", "shard_documents", "max_doc_bytes")


def prepare_config() -> ml_collections.ConfigDict:
  """Every prepare option with its default (`configs/prepare.py` starts from here)."""
  c = ml_collections.ConfigDict()
  c.source = ""                    # jsonl:PATH (file or glob) | squad:PATH | tfds:NAME[:SPLIT]
                                   # | world:ENTITIES (the generated world)
  c.out_dir = ""                   # prepared data dir to write; a re-run skips finished shards
  c.title_field = "title"          # JSONL / TFDS field holding a document's title
  c.text_field = "text"            # JSONL / TFDS field holding a document's text
  c.tfds_data_dir = ""             # TFDS data dir ("": TFDS's default, ~/tensorflow_datasets)
  c.world_seed = 0                 # world:ENTITIES: seed of the generated world
  c.vocab = ""                     # vocab.txt or HF BERT dir to copy, here or in a bucket
                                   # (pkg:MODULE/SUBDIR: one inside an installed package); "":
                                   # train WordPiece
  c.vocab_size = 30522             # WordPiece entries when training the vocab
  c.vocab_documents = 100_000      # the first this many documents train the vocab
  c.block_len = 288                # wordpieces per block: [CLS] title [SEP] body [SEP]
  c.max_sentence_len = 94          # longest example sentence kept (query_len - 2)
  c.max_masks = 10                 # salient spans of more wordpieces are never masked
  c.tagger = "regex"               # salient-span tagger: "regex" or "hf_ner:PATH"
  c.eval_fraction = 0.01           # documents held out as the eval split (not for world:)
  c.num_workers = 2                # worker processes (0: all in this process)
  c.shard_documents = 2000         # documents per shard: unit of parallel work and of resume
  c.strict = False                 # stop at the first bad record (file:line), not skip it
  c.max_doc_bytes = sources.MAX_DOC_BYTES   # a larger document is skipped (10 MB)
  c.progress_every = 10.0          # seconds between progress lines
  return c


def validate_prepare(config) -> None:
  """ConfigError naming the first bad option, before any work."""
  if "task" in config:
    raise ConfigError("", "--config is a training config (it has a task), read by realm-train; "
                      "realm-prepare takes configs/prepare.py[:variant] or X.py:prepare")
  if not config.out_dir:
    raise ConfigError("out_dir", "is empty: name the data dir to write")
  try:
    paths.check(config.out_dir, "out_dir")
  except ValueError as e:
    raise ConfigError("out_dir", str(e)) from None
  kind, _ = sources.parse_source(config.source)
  _refuse_unread_options(config, kind)
  if config.block_len < 8:
    raise ConfigError("block_len", f"{config.block_len} < 8 wordpieces")
  if not 1 <= config.max_sentence_len:
    raise ConfigError("max_sentence_len", f"must be >= 1, got {config.max_sentence_len}")
  if config.max_masks < 1:
    raise ConfigError("max_masks", f"must be >= 1, got {config.max_masks}")
  if not 0 <= config.eval_fraction < 1:
    raise ConfigError("eval_fraction", f"must be in [0, 1), got {config.eval_fraction}")
  if config.num_workers < 0 or config.shard_documents < 1:
    raise ConfigError("num_workers" if config.num_workers < 0 else "shard_documents",
                      "must be >= 0 / >= 1")
  if config.max_doc_bytes < 1:
    raise ConfigError("max_doc_bytes", f"must be >= 1, got {config.max_doc_bytes} (every "
                      "document would be skipped)")
  if not config.progress_every > 0:
    raise ConfigError("progress_every", f"must be > 0 seconds, got {config.progress_every}")
  from realm_jax.data.taggers import check_tagger
  check_tagger(config.tagger)    # an unknown one failed after the WordPiece training
  if config.vocab and not _vocab_exists(packages.resolve(config.vocab, "vocab")):
    raise ConfigError("vocab", f"{config.vocab!r} does not exist")
  if not config.vocab and config.vocab_size < 10:
    raise ConfigError("vocab_size", f"{config.vocab_size} is too small")
  if not config.vocab and config.vocab_documents < 1:
    raise ConfigError("vocab_documents", f"must be >= 1 (the documents the vocab is trained "
                      f"on), got {config.vocab_documents}")


def _vocab_exists(vocab: str) -> bool:
  """Whether the `vocab` option's file or dir is there (on this machine, or in a bucket)."""
  if not paths.is_remote(vocab):
    return os.path.exists(vocab)
  try:
    return paths.exists(paths.check(vocab, "vocab"))
  except ValueError as e:   # a malformed or unsupported URL
    raise ConfigError("vocab", str(e)) from None


# Options that only some sources read (source kind -> reads it)
SOURCE_OPTIONS = {"title_field": ("jsonl", "tfds"), "text_field": ("jsonl", "tfds"),
                  "tfds_data_dir": ("tfds",), "world_seed": ("world",),
                  "eval_fraction": ("jsonl", "squad", "tfds")}


def _refuse_unread_options(config, kind: str) -> None:
  """A ConfigError for an option set (away from its default) that `kind`'s source never reads:
  it would change nothing but the data's fingerprint, silently."""
  defaults = prepare_config()
  for option, readers in SOURCE_OPTIONS.items():
    if kind not in readers and config[option] != defaults[option]:
      raise ConfigError(option, f"{config[option]!r} is not read by a {kind}: source (only by "
                        + ", ".join(f"{r}:" for r in readers) + "); leave it unset")


def _fingerprint(config) -> dict:
  return {k: config[k] for k in FINGERPRINT_FIELDS}


def _check_out_dir(config) -> dict | None:
  """Refuses an out_dir prepared with other settings; returns its stats if it is finished."""
  out = config.out_dir
  path = os.path.join(out, "prepare.json")
  current = _fingerprint(config)
  written = _names_left_whole(out) if os.path.isdir(out) else set()
  if os.path.exists(path):
    with open(path) as f:
      diffs = _other_settings(json.load(f), config, out)
    if diffs and written <= UNPACKED:   # stopped before packing any shard
      logger.info(f"[prepare] {out} holds no packed document yet: preparing it with this "
                  "run's settings (a vocab there is reused only if made from the same file or "
                  "documents)")
    elif diffs:
      _refuse_other_settings(out, diffs)
    if os.path.exists(os.path.join(out, "stats.json")):
      with open(os.path.join(out, "stats.json")) as f:
        return json.load(f)
  elif written - {LOCK}:
    raise ConfigError("out_dir", f"{out} exists, is not empty and was not written by "
                      "realm-prepare (no prepare.json); use another out_dir")
  os.makedirs(out, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(current, f, indent=2)
  os.replace(path + ".tmp", path)
  return None


def _other_settings(saved: dict, config, out: str) -> list[str]:
  """`option: saved (in out) != this run's` for each fingerprint option of a preparation's
  record (`prepare.json`) that differs from `config`'s."""
  current, defaults = _fingerprint(config), prepare_config()
  saved = {k: saved.get(k, defaults[k]) for k in FINGERPRINT_FIELDS}
  return [f"{k}: {saved[k]!r} (in {out}) != {current[k]!r} (this run)"
          for k in FINGERPRINT_FIELDS if saved[k] != current[k]]


def _refuse_other_settings(out: str, diffs: list[str]) -> None:
  raise ConfigError("out_dir", f"{out} holds a preparation with other settings ("
                    + "; ".join(diffs) + "); use another out_dir or delete this one")


LOCK = "prepare.lock"   # held (flock) by the run preparing the dir (workdir.JobLock)
# What DIR/vocab.txt was made from (the copied file's sha256, or a digest of the documents it
# was trained on): a rerun reuses the vocab only when that is unchanged.
VOCAB_RECORD = "vocab.json"
# A dir holding no more than these packed nothing yet: it takes other settings (a run that
# stopped on a bad or empty source, whose vocab checks itself against its record)
UNPACKED = {"prepare.json", LOCK, "vocab.txt", VOCAB_RECORD, "vocab.tmp"}
# What a run killed while it wrote prepare.json, copied the vocab or recorded it leaves (the
# temp names of `_check_out_dir`, `_vocab`, `paths.write_text_atomic`): no part of a dir
KILLED_WRITES = ("prepare.json.tmp", "vocab.txt.tmp", f"{VOCAB_RECORD}.tmp-")


def _names_left_whole(out: str) -> set[str]:
  """The names in `out`, the temp files of writes cut short (KILLED_WRITES) removed first (the
  run that calls this holds the dir's lock: no other run writes them now; left, they were
  uploaded with a bucket's data)."""
  names = set(os.listdir(out))
  for name in names:
    if name.startswith(KILLED_WRITES):
      os.remove(os.path.join(out, name))
  return {name for name in names if not name.startswith(KILLED_WRITES)}


def _vocab(config):
  """The tokenizer of the run: copied from `config.vocab`, else trained on the first
  `vocab_documents` documents; `DIR/vocab.txt` of an earlier attempt is reused when it was
  made from the same file or documents (VOCAB_RECORD), else made again (the shards packed
  with it are then packed again: their reuse key holds the vocab's sha256)."""
  path = os.path.join(config.out_dir, "vocab.txt")
  if config.vocab:
    src = packages.resolve(config.vocab, "vocab")
    if not paths.is_remote(src):
      return _copied_vocab(config, src, path)
    with tempfile.TemporaryDirectory(prefix="realm_vocab_") as scratch:   # read here
      return _copied_vocab(config, scratch, path, named=_fetched_vocab(src, scratch))
  t0 = time.time()
  titles, texts, made_from = _vocab_documents(config)
  if _reusable_vocab(config.out_dir, made_from):
    return load_tokenizer(path)
  logger.info(f"[prepare] vocab: training WordPiece ({config.vocab_size:,} entries) on "
              f"{len(titles):,} documents")
  tmp = os.path.join(config.out_dir, "vocab.tmp")
  tokenizer = train_tokenizer(titles + texts, tmp, config.vocab_size,
                              lambda line: logger.info(f"[prepare] vocab: {line}"),
                              config.progress_every)
  _keep_vocab(config.out_dir, os.path.join(tmp, "vocab.txt"), made_from)
  shutil.rmtree(tmp, ignore_errors=True)
  logger.info(f"[prepare] trained a {tokenizer.vocab_size:,}-entry WordPiece vocab on "
              f"{len(titles):,} documents ({time.time() - t0:.1f}s)")
  return load_tokenizer(path)


def _copied_vocab(config, src: str, path: str, named: str = ""):
  """`_vocab` of a `config.vocab` (a vocab.txt or a checkpoint dir holding one) at the local
  path `src`: checked, then copied to `path` unless the copy there was made from it. `named`:
  the vocab.txt a refusal names, where `src` is a local copy of it (one in a bucket)."""
  check_uncased(src, "vocab", config.vocab)
  src = os.path.join(src, "vocab.txt") if os.path.isdir(src) else src
  if not os.path.exists(src):
    raise ConfigError("vocab", f"no vocab.txt in {config.vocab}")
  named = named or src
  try:   # REALM's special tokens, [PAD] at id 0: refused before the copy
    repeated = load_tokenizer(src).repeated_line()
  except Exception as e:  # noqa: BLE001  (the tokenizers library's own: not UTF-8, no [SEP])
    text = str(e)
    raise ConfigError("vocab", named + text[len(src):] if text.startswith(src) else
                      f"{named}: {text}") from None
  if repeated is not None:
    raise ConfigError("vocab", f"{named}: line {repeated}'s token is repeated further on: the "
                      "ids would run past the vocab size (the model's embedding rows)")
  made_from = {"copied": paths.sha256_file(src)}
  if not _reusable_vocab(config.out_dir, made_from):
    shutil.copyfile(src, path + ".tmp")
    _keep_vocab(config.out_dir, path + ".tmp", made_from)
  return load_tokenizer(path)


def _fetched_vocab(url: str, scratch: str) -> str:
  """A bucket `vocab` (a vocab.txt, or a checkpoint dir holding one) read into the local dir
  `scratch`: its vocab.txt and the tokenizer_config.json beside it (`check_uncased`), where
  there; returns the URL of that vocab.txt (what a refusal of it names)."""
  vocab = paths.join(url, "vocab.txt") if paths.isdir(url) else url
  beside = vocab.rsplit("/", 1)[0]
  for source, name in ((vocab, "vocab.txt"), (paths.join(beside, "tokenizer_config.json"),
                                              "tokenizer_config.json")):
    if paths.exists(source):
      data = paths.retried("reading", source, epath.Path(source).read_bytes)
      with open(os.path.join(scratch, name), "wb") as f:
        f.write(data)
  return vocab


def _vocab_documents(config) -> tuple[list[str], list[str], dict]:
  """(titles, texts, their digest) of the first `vocab_documents` documents, read as the run
  reads them (`strict` stops at the first bad record here, before any training); a source
  without one usable document is a DataError before a vocab is made of nothing."""
  t0 = last = time.time()
  titles, texts, skips = [], [], sources.Skips(config.strict)
  digest = hashlib.blake2b(str(config.vocab_size).encode(), digest_size=16)
  for doc in sources.read_documents(config, skips):
    titles.append(doc.title)
    texts.extend([doc.text] if doc.text else [s.text for s in doc.sentences])
    digest.update(repr((doc.title, doc.text, [s.text for s in doc.sentences])).encode())
    if len(titles) >= config.vocab_documents:
      break
    if time.time() - last >= config.progress_every:
      last = time.time()
      logger.info(f"[prepare] vocab: {len(titles):,} of at most {config.vocab_documents:,} "
                  f"documents read ({len(titles) / (last - t0):,.0f} docs/s)")
  if not titles:
    raise DataError(f"{config.source}: no usable document (skipped: {dict(skips.counts)})")
  return titles, texts, {"documents": len(titles), "digest": digest.hexdigest()}


def _reusable_vocab(out_dir: str, made_from: dict) -> bool:
  """Whether `out_dir/vocab.txt` exists and was made from `made_from` (said when it was not)."""
  if not os.path.exists(os.path.join(out_dir, "vocab.txt")):
    return False
  record = paths.read_json(os.path.join(out_dir, VOCAB_RECORD))
  if record == made_from:
    return True
  logger.info(f"[prepare] {out_dir}/vocab.txt " + (
      "has no record of what it was made from (an earlier version wrote it)" if record is None
      else "was made from another vocab file or other documents (the source changed since)")
      + ": making it again")
  return False


def _keep_vocab(out_dir: str, made: str, made_from: dict) -> None:
  """Moves the vocab file `made` to `out_dir/vocab.txt`, then records what it was made from
  (a crash between the two leaves no record: the next run makes it again)."""
  record = os.path.join(out_dir, VOCAB_RECORD)
  if os.path.exists(record):
    os.remove(record)
  os.replace(made, os.path.join(out_dir, "vocab.txt"))
  paths.write_text_atomic(record, json.dumps(made_from, indent=1))


# -- workers -------------------------------------------------------------------------------
_WORKER: dict = {}


def _worker_tools(vocab_path: str, tagger_spec: str, single_threaded: bool):
  """This process's tokenizer and tagger, loaded on first use. (Not a Pool initializer: an
  initializer that fails makes the pool respawn workers forever instead of failing the job.)"""
  key = (vocab_path, tagger_spec)
  if _WORKER.get("key") != key:
    if single_threaded:    # one process per core already: no nested tokenizer threads
      os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from realm_jax.data.taggers import make_tagger
    _WORKER.update(key=key, tokenizer=load_tokenizer(vocab_path), tagger=make_tagger(tagger_spec))
  return _WORKER["tokenizer"], _WORKER["tagger"]


def _exit_with_parent(parent: int) -> None:
  """A worker's watch: it exits once `parent` is gone (killed -9, or by the OOM killer), as
  it would otherwise wait on the task queue for good, holding memory."""
  def watch():
    while os.getppid() == parent:
      time.sleep(1.0)
    os._exit(1)
  threading.Thread(target=watch, daemon=True).start()


def _run_shard(args) -> tuple[int, dict]:
  index, docs, settings, shard_dir, tools, digest = args
  tokenizer, tagger = _worker_tools(*tools)
  return index, corpus.build_shard(docs, tokenizer, tagger, settings, shard_dir, digest)


class _Progress:
  """One line every `every` seconds: documents read, shards, blocks, rates (blocks/s of the
  blocks packed by this run: a rerun's reused shards took no packing)."""

  def __init__(self, every: float):
    self.every, self.t0, self.last = every, time.time(), time.time()

  def maybe(self, docs: int, shards_done: int, shards: int, blocks: int, reused: int = 0,
            force=False):
    now = time.time()
    if not force and now - self.last < self.every:
      return
    self.last = now
    dt = max(now - self.t0, 1e-9)
    said = f", {reused:,} of them reused" if reused else ""
    logger.info(f"[prepare] {docs:,} docs read ({docs / dt:,.0f} docs/s) | shards {shards_done}/"
                f"{shards} done | {blocks:,} blocks{said} ({(blocks - reused) / dt:,.0f} "
                f"blocks/s) | {dt:,.0f}s")


def prepare(config) -> dict:
  """Runs the whole preparation (or returns the stats of a finished one). A bucket `out_dir`
  (gs://B/D) is prepared in a local dir (`paths.cache_dir`; a rerun resumes there) and then
  uploaded, its `files.json` (size and sha256 of every file) last; an uploaded one prepared
  with other settings is refused, as a local one is."""
  validate_prepare(config)
  if not paths.is_remote(config.out_dir):
    return _prepare_local(config)
  url = config.out_dir
  if paths.exists(paths.join(url, paths.FILES_MANIFEST)):
    saved = paths.read_json(paths.join(url, "prepare.json"))   # uploaded with the rest
    diffs = [] if saved is None else _other_settings(saved, config, url)
    if diffs:
      _refuse_other_settings(url, diffs)
    stats = paths.read_json(paths.join(url, "stats.json"))
    logger.info(f"[prepare] {url} is already prepared and uploaded ({stats['blocks']:,} blocks)")
    return stats
  local = paths.cache_dir(url)
  _drop_removed_copy(config, local)
  logger.info(f"[prepare] {url}: preparing in {local}, then uploading")
  config.out_dir = local
  try:
    stats = _prepare_local(config)
  finally:
    config.out_dir = url
  manifest = paths.upload_tree(local, url, log=lambda line: logger.info(f"[prepare] {line}"),
                               exclude=LOCK)   # (this host's lock of its local copy)
  paths.mark_copied(local, manifest)   # this host's copy of the data dir: files.json's files
  logger.info(f"[prepare] uploaded to {url} ({paths.FILES_MANIFEST} written last)")
  return stats


def _drop_removed_copy(config, local: str) -> None:
  """`local`, the dir a bucket out_dir is prepared in and read from on this host, holding a
  finished copy (its stamp, `paths.mark_copied`) of a preparation of other settings while the
  bucket holds none (no files.json: the data dir was removed from it): that copy of data no
  longer there is removed, so that this run prepares its own. A preparation never uploaded
  whole (no stamp: its upload cut short, or under way) is this host's only copy: refused, as
  an unfinished one of other settings is, as in a local dir."""
  saved = paths.read_json(os.path.join(local, "prepare.json"))
  if saved is None or not os.path.exists(os.path.join(local, "stats.json")) or \
      not os.path.exists(os.path.join(local, paths.COPIED)) or \
      not _other_settings(saved, config, local):
    return
  logger.info(f"[prepare] {config.out_dir}: {local} holds the data prepared there before with "
              "other settings, no longer in the bucket: prepared again")
  shutil.rmtree(local)


class _ShardPacker:
  """Packs the documents shard by shard, in worker processes or this one; a shard a previous
  try finished is reused. `results[i]` is shard i's summary once it is done. A worker that
  dies (the OOM killer, say) fails the job naming the shards in flight, instead of leaving it
  waiting for good."""

  def __init__(self, config, tools: tuple, settings, in_process: bool):
    self.config, self.tools, self.settings = config, tools, settings
    self.root = os.path.join(config.out_dir, "shards")
    self.pool = None if in_process else concurrent.futures.ProcessPoolExecutor(
        config.num_workers, mp_context=multiprocessing.get_context("spawn"),
        initializer=_exit_with_parent, initargs=(os.getpid(),))
    self.vocab_sha256 = paths.sha256_file(tools[0])   # a shard packed with another is redone
    self.shard_dirs: list[str] = []
    self.results: dict = {}
    self.pending: deque = deque()   # (shard index, future), in order
    self.reused = self.blocks_done = self.blocks_reused = 0

  def collect(self) -> None:
    """Takes in the shards finished so far, in order (without waiting)."""
    while self.pending and self.pending[0][1].done():
      try:
        index, result = self.pending[0][1].result()
      except concurrent.futures.process.BrokenProcessPool as e:
        shards = ", ".join(str(i) for i, _ in self.pending)
        raise WorkerDied(f"a worker process died while shards {shards} were being packed ({e}; "
                         "out of memory?): rerun the same command to resume (finished shards "
                         "are reused)") from None
      self.pending.popleft()
      self._done(index, result)

  def wait_first(self) -> None:
    """Waits until the oldest pending shard is finished, then takes in what is."""
    concurrent.futures.wait([self.pending[0][1]])
    self.collect()

  def _done(self, index: int, result: dict) -> None:
    self.results[index] = result
    self.blocks_done += result["blocks"]

  def submit(self, docs: list) -> None:
    index = len(self.shard_dirs)
    shard_dir = os.path.join(self.root, f"{index:05d}")
    self.shard_dirs.append(shard_dir)
    done, digest = corpus.shard_done(shard_dir), corpus.shard_input(docs, self.vocab_sha256)
    if done is not None and done.get("input") == digest:   # the same documents
      self.reused += 1
      self.blocks_reused += done["blocks"]
      self._done(index, done)
      return
    job = (index, docs, self.settings, shard_dir, self.tools, digest)
    if self.pool is None:
      self._done(index, _run_shard(job)[1])
      return
    while len(self.pending) >= 2 * self.config.num_workers:
      self.wait_first()
    self.pending.append((index, self.pool.submit(_run_shard, job)))

  def close(self) -> None:
    """Ends the workers: at once while shards are still pending (an error, Ctrl-C)."""
    if self.pool is None:
      return
    if self.pending:
      for process in list((getattr(self.pool, "_processes", None) or {}).values()):
        process.terminate()
    self.pool.shutdown(wait=True, cancel_futures=True)


def _prepare_local(config) -> dict:
  from realm_jax.workdir import JobLock
  # one run per dir, from before its settings are read or written (prepare.json): a second
  # one would rewrite them under the first, or race it on the same files
  with JobLock(config.out_dir, "prepare") as lock:
    lock.acquire()
    finished = _check_out_dir(config)
    if finished is not None:
      logger.info(f"[prepare] {config.out_dir} is already prepared ({finished['blocks']:,} "
                  "blocks)")
      return finished
    return _prepare_locked(config)


def _prepare_locked(config) -> dict:
  t0 = time.time()
  tokenizer = _vocab(config)
  settings = corpus.PackSettings(config.block_len, config.max_sentence_len, config.max_masks)
  in_process = config.num_workers == 0 or config.tagger.strip().startswith("hf_ner:")
  if in_process and config.num_workers > 0:
    logger.info("[prepare] hf_ner runs its model on this process's devices: shards are packed "
                "in this process")
  packer = _ShardPacker(config, (tokenizer.vocab_path, config.tagger, not in_process),
                        settings, in_process)
  skips = sources.Skips(config.strict)
  progress = _Progress(config.progress_every)
  titles, qas = [], []

  def show(force: bool = False) -> None:
    progress.maybe(len(titles), len(packer.results), len(packer.shard_dirs),
                   packer.blocks_done, packer.blocks_reused, force=force)
  try:
    shard: list = []
    for doc in sources.read_documents(config, skips):
      doc_id = len(titles)
      titles.append(doc.title)
      qas.extend({**qa, "doc_id": doc_id} for qa in doc.qas)
      shard.append((doc_id, doc))
      if len(shard) == config.shard_documents:
        packer.submit(shard)
        shard = []
      packer.collect()
      show()
    if shard:
      packer.submit(shard)
    while packer.pending:
      packer.wait_first()
      show()
  finally:
    packer.close()
  show(force=True)
  if not titles:
    raise DataError(f"{config.source}: no usable document (skipped: {dict(skips.counts)})")
  return _finish(config, tokenizer, skips, titles, qas, packer.shard_dirs, packer.results,
                 packer.reused, t0)


def _finish(config, tokenizer, skips, titles, qas, shard_dirs, results, reused, t0) -> dict:
  """Merges the packed shards into the block store and writes titles, questions, stats."""
  shards_root = os.path.join(config.out_dir, "shards")
  t_merge = time.time()
  logger.info(f"[prepare] merging {len(shard_dirs):,} shards into the block store and examples")
  merged = corpus.merge_shards(shard_dirs, config.out_dir, config.block_len,
                               config.max_sentence_len)
  write_titles(config.out_dir, titles)
  written = _write_qa(config, qas)
  unfound = unfound_questions(config.out_dir, tokenizer, qas)
  stats = _stats(config, tokenizer, skips, titles, results, merged, qas, reused, t0, t_merge)
  stats["questions"] = sum(written.values())   # a world's own questions too
  stats["questions_by_split"] = written
  stats["questions_unfound"] = unfound
  write_stats(config.out_dir, stats)
  corpus.remove_shards(shards_root)
  logger.info(
      f"[prepare] {stats['documents']:,} documents -> {stats['blocks']:,} blocks, "
      f"{stats['examples']['train']:,} train / {stats['examples']['eval']:,} eval examples, "
      f"{sum(stats['examples_skipped'].values()):,} sentences without an example, "
      f"{sum(stats['skipped'].values()):,} documents skipped, in {stats['seconds']:.1f}s "
      f"({stats['blocks_per_second']:,.0f} blocks/s)")
  if stats["skipped"]:
    logger.info("[prepare] skipped: " + ", ".join(
        f"{reason}: {n:,} (first at {stats['skipped_first_at'][reason]})"
        for reason, n in sorted(stats["skipped"].items(), key=lambda item: -item[1])))
  if stats["questions"] or stats["questions_skipped"]:
    logger.info(f"[prepare] {questions_line(stats)}")
  return stats


def unfound_questions(out_dir: str, tokenizer, qas: list[dict],
                      max_width: int = 0) -> dict[str, int]:
  """The questions of `qas` whose own paragraph gives a reader no answer span, by reason:
  `ANSWER_UNSPELT`, `ANSWER_NOT_IN_BLOCKS` and, given a reader's `max_width` (its
  `model.max_span_width`), `ANSWER_TOO_WIDE`. They stay in the question set (the zero-shot
  table scores paragraphs, not answers); an answer spelt with [UNK] can never be predicted,
  the others may still be found in another paragraph's block. A file in a script the vocab
  does not spell, or whose answers are not in their contexts, shows here before any
  training."""
  from realm_jax.data.answers import AnswerMatcher, vocab_pieces
  from realm_jax.data.prepared import BlockStore
  if not qas:
    return {}
  blocks, vocab, unfound = BlockStore(out_dir), vocab_pieces(tokenizer), Counter()
  doc_ids = np.asarray(blocks.doc_ids)
  order = np.argsort(doc_ids, kind="stable")            # block rows, document by document
  first = np.searchsorted(doc_ids[order], np.arange(len(blocks.titles) + 1))
  for qa in qas:
    matcher = AnswerMatcher(tokenizer, qa["answer"], vocab=vocab)
    rows = order[first[qa["doc_id"]]:first[qa["doc_id"] + 1]]
    tokens, body = np.asarray(blocks.tokens[rows]), blocks.segments(rows).astype(bool)
    if matcher.empty:
      unfound[ANSWER_UNSPELT] += 1
    elif not matcher.contains_rows(tokens, mask=body).any():
      unfound[ANSWER_NOT_IN_BLOCKS] += 1
    elif max_width and not any(end - start < max_width for row, valid in zip(tokens, body)
                               for start, end in matcher.spans(row, valid)):
      unfound[ANSWER_TOO_WIDE] += 1
  return dict(unfound)


def questions_line(stats: dict) -> str:
  """What became of a source's questions, for the console: kept, skipped and unfound."""
  kept, unfound = stats.get("questions", 0), stats.get("questions_unfound") or {}
  skipped = stats.get("questions_skipped") or {}
  line = f"{kept:,} questions kept"
  if unfound:
    n = sum(unfound.values())
    line += (f", {n:,} of them ({n / max(kept, 1):.0%}) with no answer span in their "
             f"paragraph's blocks ({by_reason(unfound)})")
  if skipped:
    line += f"; {sum(skipped.values()):,} skipped ({by_reason(skipped)})"
  return line


def by_reason(counts: dict[str, int]) -> str:
  """Counts by reason for a line, the largest first: "reason: n, ..."."""
  return ", ".join(f"{reason}: {n:,}" for reason, n in
                   sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _write_qa(config, qas: list[dict]) -> dict[str, int]:
  """Writes `D/qa/<split>.jsonl` (a world's own questions, or the source's); returns how many
  questions each split holds."""
  kind, _ = sources.parse_source(config.source)
  # a squad: source always writes its (possibly empty) questions: the zero-shot table says why
  sets = sources.world_qa(config) if kind == "world" else (
      {"eval": qas} if qas or kind == "squad" else {})
  if not sets:
    return {}
  os.makedirs(os.path.join(config.out_dir, "qa"), exist_ok=True)
  for split, rows in sets.items():
    with open(os.path.join(config.out_dir, "qa", f"{split}.jsonl"), "w") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  return {split: len(rows) for split, rows in sets.items()}


def _stats(config, tokenizer, skips, titles, results, merged, qas, reused, t0, t_merge):
  total = Counter()
  dropped = Counter()
  for r in results.values():
    total.update({k: r.get(k, 0) for k in ("sentences", "sentences_cut", "titles_truncated",
                                           "salient_spans", "documents_without_blocks")})
    dropped.update(r["examples_skipped"])
  lengths = np.load(os.path.join(config.out_dir, "blocks", "lengths.npy"), mmap_mode="r")
  seconds = time.time() - t0
  return {
      "source": config.source, "read": len(titles) + sum(skips.counts.values()),
      "documents": len(titles), "skipped": dict(skips.counts),
      "skipped_first_at": dict(skips.first),   # where each reason's first record is
      "documents_without_blocks": total["documents_without_blocks"],
      "blocks": merged["blocks"], "max_block_wordpieces": int(lengths.max(initial=0)),
      "block_len": config.block_len, "max_sentence_len": config.max_sentence_len,
      "sentences": total["sentences"], "sentences_cut": total["sentences_cut"],
      "titles_truncated": total["titles_truncated"], "salient_spans": total["salient_spans"],
      "examples": merged["examples"], "examples_skipped": dict(dropped),
      "questions": len(qas), "questions_skipped": dict(skips.questions),
      "vocab_size": tokenizer.vocab_size, "tagger": config.tagger,
      "shards": len(results), "shards_reused": reused,
      "seconds": round(seconds, 2), "merge_seconds": round(time.time() - t_merge, 2),
      "documents_per_second": round(len(titles) / max(seconds, 1e-9), 1),
      "blocks_per_second": round(merged["blocks"] / max(seconds, 1e-9), 1),
      "sentences_per_second": round(total["sentences"] / max(seconds, 1e-9), 1),
  }


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def main() -> None:
  from absl import app, flags
  from ml_collections import config_flags
  from realm_jax.errors import run_cli
  from realm_jax.config.overrides import flags_parser, refuse_arguments
  from realm_jax.config.option_names import upgrade_flags
  # flagfiles read and old option names upgraded before the config flag reads sys.argv
  sys.argv = upgrade_flags(sys.argv, "realm-prepare")
  config = config_flags.DEFINE_config_file("config", None, "configs/prepare.py[:variant]",
                                           lock_config=True)

  def _main(argv):
    refuse_arguments("realm-prepare", argv)
    signal.signal(signal.SIGTERM, _interrupt)   # a scheduler's stop: as Ctrl-C, workers too
    from realm_jax import log
    log.use_absl_verbosity()   # -v N; Orbax's and TFDS's INFO lines off the console
    if config.value is None:
      print("realm-prepare: error: --config is required (configs/prepare.py)", file=sys.stderr)
      raise SystemExit(2)
    run_cli("realm-prepare", lambda: prepare(config.value))
  del flags
  app.run(_main, flags_parser=flags_parser("realm-prepare", __name__, prepare_config))


if __name__ == "__main__":
  main()

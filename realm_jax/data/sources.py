"""Corpus sources for `realm-prepare`: `jsonl:PATH`, `squad:PATH`, `tfds:NAME[:SPLIT]`,
`world:ENTITIES`.

Each source yields `SourceDocument`s in a fixed order. Bad records never crash the job and are
never dropped silently: each is skipped and counted by reason (`Skips`), or, with
`strict=True`, stops the job with the file and line (or record) that is wrong. Every record
read is either a document or a skip, so `read == documents + sum(skipped)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import gzip
import hashlib
import importlib
import json
import os
import tempfile
import unicodedata
import zlib
from collections import Counter
from typing import Iterator

from realm_jax.data.answers import as_read
from realm_jax.data.corpus import SourceDocument, SourceSentence
from realm_jax.errors import ConfigError, DataError

KINDS = ("jsonl", "squad", "tfds", "world")
# Skip reasons, as they appear in stats.json.
MALFORMED_JSON = "malformed JSON"
# What `json.loads` raises on text that is no JSON it can read: JSONDecodeError, a ValueError
# (as is a number of more digits than `int` converts), and RecursionError (nested deeper than
# Python recurses)
MALFORMED = (ValueError, RecursionError)
NOT_AN_OBJECT = "not a JSON object"
MISSING_TITLE = "missing title field"
MISSING_TEXT = "missing text field"
INVALID_UTF8 = "invalid UTF-8"
EMPTY = "empty or whitespace-only document"
TOO_LARGE = "document over max_doc_bytes"
DUPLICATE = "duplicate document"
# What reading a gzip file that is cut short or damaged raises (zlib's error for damaged
# compressed data is no OSError)
GZIP_ERRORS = (OSError, EOFError, zlib.error)
MAX_DOC_BYTES = 10 * 2**20   # prepare's default `max_doc_bytes`, and the Open-QA reader's
# Skip reasons of a SQuAD file's questions (here and in `realm_jax.data.qa`).
MISSING_QUESTION = "missing question"
NO_ANSWERS = "no answers"
NON_STRING_ANSWERS = "non-string answers"
DUPLICATE_ID = "duplicate question id"
UNANSWERABLE = "unanswerable (SQuAD v2)"
PARAGRAPH_SKIPPED = "its paragraph skipped"


class Skips:
  """Counts skipped records by reason; in strict mode the first one is an error instead.
  A `squad:` source's questions have counts of their own (`questions`)."""

  def __init__(self, strict: bool):
    self.strict, self.counts, self.questions = strict, Counter(), Counter()
    self.first: dict[str, str] = {}   # reason -> where its first record was (stats.json)

  def skip(self, reason: str, where: str) -> None:
    if self.strict:
      raise DataError(f"{where}: {reason} (strict=True stops here; without it the record "
                      "is skipped and counted in stats.json)")
    self.counts[reason] += 1
    self.first.setdefault(reason, where)

  def skip_question(self, reason: str, where: str) -> None:
    if self.strict:
      raise DataError(f"{where}: {reason} (strict=True stops here; without it the question "
                      "is skipped and counted in stats.json)")
    self.questions[reason] += 1

  def drop_questions(self, qas) -> None:
    """Counts the questions of a skipped document (its skip is already counted)."""
    if isinstance(qas, (list, tuple)) and qas:
      self.questions[PARAGRAPH_SKIPPED] += len(qas)


def _nfc(text: str) -> str:
  """`text` in Unicode NFC: one document written with composed and with decomposed accents
  is one document (the tokenizer reads both as the same wordpieces)."""
  return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)


class Deduplicator:
  """Drops a document whose title + text (whitespace- and NFC-normalised) was already seen, and
  keeps one text in one split (`split_of_text`)."""

  def __init__(self):
    self.seen: set[bytes] = set()
    self.text_splits: dict[bytes, str] = {}   # `split_of_text`'s

  @staticmethod
  def text_key(text: str) -> bytes:
    """A digest of the whitespace-normalised text (what `is_new` and `split_of_text` take:
    a long document's text is normalised and hashed once)."""
    return hashlib.blake2b(" ".join(_nfc(text).split()).encode("utf-8", "surrogatepass"),
                           digest_size=12).digest()

  def is_new(self, title: str, text_key: bytes) -> bool:
    """Whether no document of this title (whitespace-normalised) and text (`text_key`) was
    seen before."""
    title_key = " ".join(_nfc(title).split()).encode("utf-8", "surrogatepass")
    key = hashlib.blake2b(title_key + b"\x00" + text_key, digest_size=12).digest()
    if key in self.seen:
      return False
    self.seen.add(key)
    return True

  def split_of_text(self, text_key: bytes, split: str) -> str:
    """The split of the first document with this text (`text_key`), whatever its title;
    `split` for a text not seen before. A text under two titles (a redirect's copy) is then
    never held out and trained on at once."""
    return self.text_splits.setdefault(text_key, split)


def paragraph_key(context: str) -> str:
  """A SQuAD paragraph's key for the held-out split by paragraph (`qa.heldout_unit`): a digest
  of its whitespace-normalised text, so one text under two titles is one paragraph."""
  return Deduplicator.text_key(context).hex()


def squad_paragraph_skipped(title, context, dedup: Deduplicator,
                            max_doc_bytes: int = MAX_DOC_BYTES) -> str | None:
  """Why a SQuAD paragraph (its article's title, its context) is no document, or None (`dedup`
  then holds it): the one rule of `realm-prepare`'s `squad:` source and of the Open-QA reader
  (`realm_jax.data.qa`), so that Open-QA asks only questions whose paragraph is a block."""
  if not isinstance(title, str):
    return MISSING_TITLE
  if not isinstance(context, str):
    return MISSING_TEXT
  size = utf8_size(title, context)
  if size is None:
    return INVALID_UTF8
  if size > max_doc_bytes:
    return TOO_LARGE
  if not context.strip():
    return EMPTY
  return None if dedup.is_new(title, Deduplicator.text_key(context)) else DUPLICATE


def parse_source(spec: str) -> tuple[str, str]:
  """`kind:arg` -> (kind, arg) with a ConfigError naming `source` when malformed."""
  kind, _, arg = spec.partition(":")
  if kind not in KINDS or not arg:
    raise ConfigError("source", f"{spec!r}: expected one of jsonl:PATH, squad:PATH, "
                      "tfds:NAME[:SPLIT], world:ENTITIES")
  if kind == "world" and not (arg.isdigit() and int(arg) > 0):
    raise ConfigError("source", f"{spec!r}: world:ENTITIES takes a positive entity count")
  if kind in ("jsonl", "squad") and not matching_files(arg):
    if os.path.isdir(arg):
      raise ConfigError("source", f"{spec!r}: {arg!r} is a directory; " + (
          f"give a file or a glob (jsonl:{os.path.join(arg, '*.jsonl')})" if kind == "jsonl"
          else f"give a file (squad:{os.path.join(arg, 'FILE.json')})"))
    raise ConfigError("source", f"{spec!r}: no such file {arg!r}")
  if kind == "squad" and not os.path.isfile(arg):
    raise ConfigError("source", f"{spec!r}: squad: reads one file, not a glob (as the Open-QA "
                      "reader's squad: does); prepare each file on its own")
  return kind, arg


def read_documents(config, skips: Skips) -> Iterator[SourceDocument]:
  """The source's documents in order, validated and de-duplicated (skips counted)."""
  kind, arg = parse_source(config.source)
  raw = {"jsonl": _jsonl, "squad": _squad, "tfds": _tfds, "world": _world}[kind](arg, config,
                                                                               skips)
  dedup = Deduplicator()
  for doc in raw:
    if not doc.sentences and not doc.text.strip():
      skips.skip(EMPTY, doc.where)
      skips.drop_questions(doc.qas)
      continue
    key = dedup.text_key(doc.text or " ".join(s.text for s in doc.sentences))
    if not dedup.is_new(doc.title, key):
      skips.skip(DUPLICATE, doc.where)
      skips.drop_questions(doc.qas)
    elif doc.text and doc.split is not None and \
        (split := dedup.split_of_text(key, doc.split)) != doc.split:
      yield dataclasses.replace(doc, split=split)
    else:
      yield doc


def utf8_size(title: str, text: str) -> int | None:
  """The bytes of `text` in UTF-8; None if `title` or `text` is no UTF-8 text: JSON can escape
  a lone surrogate ("\\ud800"), which decodes to a str that no encoder, tokenizer or sentence
  splitter takes."""
  try:
    title.encode("utf-8")
    return len(text.encode("utf-8"))
  except UnicodeEncodeError:
    return None


def is_utf8(*texts: str) -> bool:
  """Whether every one of `texts` is UTF-8 text (no lone surrogate, which JSON can escape:
  a question or answer holding one would stop the tokenizer, `utf8_size`)."""
  try:
    for text in texts:
      text.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def matching_files(pattern: str) -> list[str]:
  """The files a pattern names, a file or a glob (its directories left out): a `jsonl:` or
  `squad:` source's, and a question set's (`realm_jax.data.qa`). A file named as given is
  that file, though its name holds a glob's characters (`squad[v2].json`)."""
  if any(c in pattern for c in "*?[") and not os.path.isfile(pattern):
    return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
  return [pattern] if os.path.isfile(pattern) else []


def open_maybe_gzip(path: str):
  """`path` opened for reading bytes, decompressed when it is gzip'd (by its magic bytes, as
  a SQuAD file is read); a truncated one fails naming the file when its end is reached."""
  with open(path, "rb") as f:
    gzipped = f.read(2) == b"\x1f\x8b"
  return _GzipNamed(path) if gzipped else open(path, "rb")


class _GzipNamed(gzip.GzipFile):
  """A gzip file whose corrupt or truncated data is a DataError naming it."""

  def __init__(self, path: str):
    super().__init__(path, "rb")
    self.path = path

  def readline(self, size=-1):
    try:
      return super().readline(size)
    except GZIP_ERRORS as e:
      raise DataError(f"{self.path}: a corrupt or truncated gzip file ({e})") from None

  def read(self, size=-1):
    try:
      return super().read(size)
    except GZIP_ERRORS as e:
      raise DataError(f"{self.path}: a corrupt or truncated gzip file ({e})") from None


def _lines(f, limit: int) -> Iterator[tuple[int, bytes | None]]:
  """(number, line) of a binary file; a line of more than `limit` bytes as None, read past
  in chunks (never held whole)."""
  lineno = 0
  while line := f.readline(limit + 1):
    lineno += 1
    if len(line) > limit and not line.endswith(b"\n"):
      while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
        pass
      line = None
    yield lineno, line


def _document(obj, title_key: str, text_key: str, config, where: str, skips: Skips,
              qas: tuple = ()) -> SourceDocument | None:
  """The document of one decoded record, or None after counting why not."""
  if not isinstance(obj, dict):
    skips.skip(NOT_AN_OBJECT, where)
    return None
  title, text = obj.get(title_key), obj.get(text_key)
  if not isinstance(title, str):
    skips.skip(MISSING_TITLE, where)
    return None
  if not isinstance(text, str):
    skips.skip(MISSING_TEXT, where)
    return None
  size = utf8_size(title, text)
  if size is None:
    skips.skip(INVALID_UTF8, where)
    return None
  if size > config.max_doc_bytes:
    skips.skip(TOO_LARGE, where)
    return None
  return SourceDocument(title, text, split=_split_of(title, text, config.eval_fraction),
                        where=where, qas=qas)


def _split_of(title: str, text: str, eval_fraction: float) -> str:
  """Held-out documents for the eval split, chosen by a hash of their content."""
  if eval_fraction <= 0:
    return "train"
  content = _nfc(title + "\x00" + text).encode("utf-8", "surrogatepass")
  h = int.from_bytes(hashlib.blake2b(content, digest_size=4).digest(), "little")
  return "eval" if h % 1_000_000 < eval_fraction * 1_000_000 else "train"


def _jsonl(pattern: str, config, skips: Skips) -> Iterator[SourceDocument]:
  # a record's line: its text JSON-escaped (up to 6 bytes a character, "\\u0001") and fields
  limit = 6 * config.max_doc_bytes + (1 << 16)
  for path in matching_files(pattern):
    with open_maybe_gzip(path) as f:
      for lineno, line in _lines(f, limit):
        where = f"{path}:{lineno}"
        if line is None:
          skips.skip(TOO_LARGE, where)
          continue
        if lineno == 1:
          line = line.removeprefix(b"\xef\xbb\xbf")   # a BOM'd file
        if not line.strip():
          continue                         # a blank line is not a record
        try:
          decoded = line.decode("utf-8")
        except UnicodeDecodeError:
          skips.skip(INVALID_UTF8, where)
          continue
        try:
          obj = json.loads(decoded)
        except MALFORMED:
          skips.skip(MALFORMED_JSON, where)
          continue
        doc = _document(obj, config.title_field, config.text_field, config, where, skips)
        if doc is not None:
          yield doc


def read_squad_articles(path: str) -> list:
  """The article list of a SQuAD-format file (v1.1 or v2.0 JSON; UTF-8 with or without a
  byte-order mark, or gzip'd). `realm-prepare`'s corpus and the Open-QA questions both read a
  file through this. A DataError names the file when it is not one."""
  with open(path, "rb") as f:
    raw = f.read()
  if raw[:2] == b"\x1f\x8b":
    try:
      raw = gzip.decompress(raw)
    except GZIP_ERRORS as e:
      raise DataError(f"{path}: a corrupt or truncated gzip file ({e})") from None
  try:
    data = json.loads(raw.decode("utf-8-sig"))
  except (UnicodeDecodeError, *MALFORMED) as e:
    raise DataError(f"{path}: not a SQuAD-format JSON file ({type(e).__name__}: {e})") from None
  articles = data.get("data") if isinstance(data, dict) else None
  if not isinstance(articles, list):
    if not isinstance(data, dict):
      found = _json_kind(data)
    elif "data" in data:
      found = f"an object whose 'data' is {_json_kind(articles)}"
    else:
      found = f"an object without 'data' (keys: {', '.join(map(repr, list(data)[:5])) or 'none'})"
    raise DataError(f"{path}: not a SQuAD-format JSON file: expected an object "
                    f"{{\"data\": [article, ...]}}, found {found}")
  return articles


def _json_kind(value) -> str:
  kinds = {list: "an array", dict: "an object", str: "a string", bool: "a boolean",
           int: "a number", float: "a number", type(None): "null"}
  return kinds.get(type(value), type(value).__name__)


def _squad(path: str, config, skips: Skips) -> Iterator[SourceDocument]:
  """SQuAD v1.1 / v2.0 format: every paragraph is a document titled with its article's title;
  its questions travel with it (`qas`) to become the QA set, each kept or skipped as the
  Open-QA reader (`realm_jax.data.qa`) keeps or skips it. A paragraph skipped here takes its
  questions with it (`its paragraph skipped`; the paragraph's own reason in `skipped`)."""
  seen_ids: set[str] = set()
  name, dedup = os.path.basename(path), Deduplicator()   # a repeat's questions are never read
  for a, article in enumerate(read_squad_articles(path)):
    paragraphs = article.get("paragraphs", []) if isinstance(article, dict) else None
    if not isinstance(paragraphs, list):
      skips.skip(NOT_AN_OBJECT, f"{path}: data[{a}]")
      continue
    for p, paragraph in enumerate(paragraphs):
      where = f"{path}: data[{a}].paragraphs[{p}]"
      if not isinstance(paragraph, dict):
        skips.skip(NOT_AN_OBJECT, where)
        continue
      title, text = article.get("title"), paragraph.get("context")
      why = squad_paragraph_skipped(title, text, dedup, config.max_doc_bytes)
      if why is not None:
        skips.skip(why, where)
        skips.drop_questions(paragraph.get("qas"))
        continue
      key = paragraph_key(text)
      qas = ({**qa, "paragraph": key}
             for qa in squad_questions(paragraph, where, skips, seen_ids, f"{name}:{a}.{p}"))
      yield SourceDocument(title, text, split=_split_of(title, text, config.eval_fraction),
                           where=where, qas=tuple(qas))


def squad_questions(paragraph: dict, where: str, skips: Skips, seen_ids: set[str],
                    default_id: str) -> Iterator[dict]:
  """The answerable questions of one SQuAD paragraph, {id, question, answer, answer_start}:
  an unanswerable (v2), question-less, answer-less or repeated-id record is skipped and
  counted. A question without an id is `default_id.q`, as Open-QA names it."""
  records = paragraph.get("qas") or []
  if not isinstance(records, list):
    skips.skip_question(NOT_AN_OBJECT, f"{where}.qas")
    return
  for q, qa in enumerate(records):
    at = f"{where}.qas[{q}]"
    if not isinstance(qa, dict):
      skips.skip_question(NOT_AN_OBJECT, at)
    elif qa.get("is_impossible"):
      skips.skip_question(UNANSWERABLE, at)
    elif (answers := squad_answers(qa)) is None:
      skips.skip_question(NON_STRING_ANSWERS, at)
    elif not isinstance(qa.get("question"), str) or not as_read(qa["question"]).split():
      skips.skip_question(MISSING_QUESTION, at)
    elif not answers:
      skips.skip_question(NO_ANSWERS, at)
    elif not is_utf8(qa["question"], *(text for text, _ in answers)):
      skips.skip_question(INVALID_UTF8, at)
    elif (qid := question_id(qa.get("id"), f"{default_id}.{q}")) in seen_ids:
      skips.skip_question(DUPLICATE_ID, at)
    else:
      seen_ids.add(qid)
      yield {"id": qid, "question": qa["question"],
             "answer": [text for text, _ in answers],
             "answer_start": [start for _, start in answers]}


def question_id(value, default: str) -> str:
  """A question's id: its own (a non-empty string or an int), else `default`."""
  return str(value) if isinstance(value, (str, int)) and str(value) else default


def squad_answers(qa: dict) -> list[tuple[str, int | None]] | None:
  """A SQuAD question's non-blank answers as (text, answer_start): {"text", "answer_start"}
  items or bare strings; None when an answer's text is not a string (the Open-QA reader's
  rule: such a question is skipped whole)."""
  raw = qa.get("answers")
  raw = [raw] if isinstance(raw, str) else [] if raw is None else raw
  if not isinstance(raw, list):
    return None
  answers = [(ans.get("text"), ans.get("answer_start")) if isinstance(ans, dict) else (ans, None)
             for ans in raw]
  if not all(isinstance(text, str) for text, _ in answers):
    return None
  return [(text, start) for text, start in answers if text.strip()]


def _tfds(arg: str, config, skips: Skips) -> Iterator[SourceDocument]:
  """A TFDS text dataset (e.g. `wikipedia/20230601.en`) that the user has prepared locally."""
  name, _, split = arg.partition(":")
  split = split or "train"
  dataset = open_tfds(name, split, config.tfds_data_dir or None, "source",
                      "--config.tfds_data_dir picks another TFDS data dir")
  for i in range(len(dataset)):
    where = f"tfds:{name}:{split}[{i}]"
    example = dataset[i]
    fields = {}
    for key in (config.title_field, config.text_field):
      value = example.get(key) if isinstance(example, dict) else None
      if isinstance(value, bytes):
        try:
          value = value.decode("utf-8")
        except UnicodeDecodeError:
          fields = None
          break
      fields[key] = value
    if fields is None:
      skips.skip(INVALID_UTF8, where)
      continue
    doc = _document(fields, config.title_field, config.text_field, config, where, skips)
    if doc is not None:
      yield doc


def _world(arg: str, config, skips: Skips) -> Iterator[SourceDocument]:
  """The generated knowledge world: sentences about held-out entities are `eval` only."""
  world = _generate_world(int(arg), config.world_seed)
  for i, doc in enumerate(world.documents):
    split = "eval" if world.entities[doc.entity].held_out else "train"
    yield SourceDocument(doc.title, sentences=tuple(
        SourceSentence(s.text, split, s.facts, s.value_spans) for s in doc.sentences),
        where=f"world:{arg}[{i}]")


def world_qa(config) -> dict[str, list[dict]]:
  """The world's question/answer pairs by split (held-out entities -> eval)."""
  world = _generate_world(int(parse_source(config.source)[1]), config.world_seed)
  out = {"train": [], "eval": []}
  for qa in world.qa_pairs:
    split = "eval" if world.entities[qa.entity].held_out else "train"
    out[split].append({"question": qa.question, "answer": [qa.answer]})
  return out


@functools.lru_cache(maxsize=1)
def _generate_world(entities: int, seed: int):
  from realm_jax.data.world import generate_world
  return generate_world(entities, seed)


def open_tfds(name: str, split: str, data_dir: str | None, option: str, hint: str = "",
              register: str | None = None):
  """The locally prepared TFDS split `name:split`, opened for random access
  (`as_data_source`); otherwise a ConfigError naming `option` that says how to prepare it.
  `register`: a module to import first (TFDS registers some builders only then)."""
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    raise ConfigError(option, f"tfds:{name} needs tensorflow-datasets: "
                      "pip install 'realm_jax[tfds]'") from None
  build = f"tfds build {name}" + (f" --data_dir={data_dir}" if data_dir else "")
  how = (f"Prepare it once with `{build} --file_format=array_record` (or "
         f"tfds.builder({name!r}).download_and_prepare()), then re-run" +
         (f"; {hint}" if hint else ""))
  try:
    if register:
      importlib.import_module(register)
    builder = _tfds_builder(tfds, name, data_dir)
  except Exception as e:  # unknown name, or its code is not importable here
    raise ConfigError(option, f"TFDS dataset {name!r} is not available ({type(e).__name__}: "
                      f"{str(e).splitlines()[0]}). {how}") from None
  try:
    return builder.as_data_source(split=split)
  except Exception as e:
    if not builder.is_prepared():
      raise ConfigError(option, f"TFDS dataset {name!r} is not prepared under "
                        f"{builder.data_dir}. {how}") from None
    raise ConfigError(option, f"tfds:{name}:{split}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0]} (read by random access: prepare with "
                      "--file_format=array_record)") from None


def _tfds_builder(tfds, name: str, data_dir: str | None):
  """`tfds.builder`, without the empty `tmp*tfds` folder it leaves in the temp dir for a
  dataset that has no local metadata (it makes one for metadata from GCS, then finds none)."""
  tmp = tempfile.gettempdir()
  before = set(os.listdir(tmp))
  try:
    return tfds.builder(name, data_dir=data_dir)
  finally:
    for entry in set(os.listdir(tmp)) - before:
      if entry.startswith("tmp") and entry.endswith("tfds"):
        with contextlib.suppress(OSError):   # rmdir: only ever an empty folder
          os.rmdir(os.path.join(tmp, entry))

"""Open-QA question sets: `nq_open:PATH`, `webq:PATH`, `curated_trec:PATH`, `squad:PATH`,
`tfds:NAME[:SPLIT]` and `prepared:SPLIT` -> `QAExample`s, and the questions as query-tower
inputs `[CLS] question [SEP]`.

As with corpus sources (`realm_jax.data.sources`), a bad record never crashes a run and is never
dropped silently: it is skipped and counted by reason, or with `strict=True` stops the run
naming the file and line (or the index in a JSON list). Every record read is either a question
or a skip.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import itertools
import json
import os
from typing import Iterator, Sequence

import numpy as np

from realm_jax import paths
from realm_jax.config.defaults import HELDOUT_UNITS
from realm_jax.data.answers import as_read, compile_answer_regex
from realm_jax.data.sources import (DUPLICATE_ID, INVALID_UTF8, MALFORMED, MALFORMED_JSON,
                                    MISSING_QUESTION, NO_ANSWERS, NON_STRING_ANSWERS,
                                    NOT_AN_OBJECT, UNANSWERABLE, Deduplicator, Skips, is_utf8,
                                    matching_files, open_maybe_gzip, open_tfds, paragraph_key,
                                    question_id, read_squad_articles, squad_answers,
                                    squad_paragraph_skipped)
from realm_jax.errors import ConfigError, DataError

KINDS = ("nq_open", "webq", "curated_trec", "squad", "tfds", "prepared")
SPLITS = ("train", "dev", "test")
# TFDS datasets read by `tfds:`: their question and answer-list features.
TFDS_FEATURES = {"natural_questions_open": ("question", "answer"),
                 "web_questions": ("question", "answers")}
# Builders that TFDS registers only when their module is imported.
_TFDS_MODULES = {"web_questions": "tensorflow_datasets.question_answering.web_questions"}
# Skip reasons, as callers report them.
MALFORMED_TSV = "malformed TSV line"
BAD_REGEX = "invalid answer regex"   # or one that matches "" (answers everything)


@dataclasses.dataclass(frozen=True)
class QAExample:
  """One question and its answers (regular expressions for CuratedTrec)."""

  qid: str
  question: str
  answers: tuple[str, ...]
  is_regex: bool
  title: str = ""          # SQuAD article title: the unit of the held-out-articles split
  paragraph: str = ""      # SQuAD paragraph key (`sources.paragraph_key`): the unit instead
                           # with qa.heldout_unit = "paragraph"


class QASkips(Skips):
  """`Skips` whose strict-mode error speaks of questions."""

  def skip(self, reason: str, where: str) -> None:
    if self.strict:
      raise DataError(f"{where}: {reason} (strict=True stops here; without it the question "
                      "is skipped and counted)")
    self.counts[reason] += 1


class _Collector:
  """Turns decoded records into `QAExample`s, counting the ones it cannot use."""

  def __init__(self, skips: QASkips, is_regex: bool = False):
    self.skips, self.is_regex = skips, is_regex
    self.examples: list[QAExample] = []
    self.seen: set[str] = set()

  def add(self, obj, where: str, default_id: str, question_key: str = "question",
          answers_key: str = "answer", id_key: str = "id", title: str | None = None,
          paragraph: str | None = None) -> None:
    if not isinstance(obj, dict):
      return self.skips.skip(NOT_AN_OBJECT, where)
    question = obj.get(question_key)
    if not isinstance(question, str) or not as_read(question).split():   # (nothing the
      return self.skips.skip(MISSING_QUESTION, where)   # tokenizer keeps: zero-width, controls)
    answers = obj.get(answers_key)
    answers = [answers] if isinstance(answers, str) else answers
    if answers is not None and (not isinstance(answers, (list, tuple))
                                or not all(isinstance(a, str) for a in answers)):
      return self.skips.skip(NON_STRING_ANSWERS, where)
    answers = tuple(dict.fromkeys(a.strip() for a in answers or () if a.strip()))
    if not answers:
      return self.skips.skip(NO_ANSWERS, where)
    if not is_utf8(question, *answers):         # a JSON-escaped lone surrogate
      return self.skips.skip(INVALID_UTF8, where)
    if self.is_regex and not all(compile_answer_regex(a) for a in answers):
      return self.skips.skip(BAD_REGEX, where)
    qid = question_id(obj.get(id_key), default_id)
    if qid in self.seen:
      return self.skips.skip(DUPLICATE_ID, where)
    self.seen.add(qid)
    if title is None:
      title = obj.get("title") if isinstance(obj.get("title"), str) else ""
    if paragraph is None:
      paragraph = obj.get("paragraph") if isinstance(obj.get("paragraph"), str) else ""
    self.examples.append(QAExample(qid, " ".join(question.split()), answers, self.is_regex,
                                   title, paragraph))


def parse_qa_spec(spec: str, option: str = "qa") -> tuple[str, str]:
  """`kind:arg` -> (kind, arg), with a ConfigError naming `option` when malformed."""
  kind, _, arg = spec.partition(":")
  if kind not in KINDS or not arg:
    raise ConfigError(option, f"{spec!r}: expected one of nq_open:PATH, webq:PATH, "
                      "curated_trec:PATH, squad:PATH, tfds:NAME[:SPLIT], prepared:SPLIT")
  if kind in ("nq_open", "curated_trec") and not _files(arg):
    raise ConfigError(option, f"{spec!r}: no file matches {arg!r}")
  if kind in ("webq", "squad") and not os.path.isfile(arg):
    raise ConfigError(option, f"{spec!r}: no such file {arg!r}")
  if kind == "tfds" and arg.partition(":")[0] not in TFDS_FEATURES:
    raise ConfigError(option, f"{spec!r}: TFDS question sets are {sorted(TFDS_FEATURES)}")
  return kind, arg


def read_qa(spec: str, *, strict: bool = False, data_dir: str = "", option: str = "qa",
            tfds_data_dir: str | None = None) -> tuple[list[QAExample], dict[str, int]]:
  """The questions of `spec` in file order, and the skipped records counted by reason.

  Args:
    spec: `nq_open:PATH` (JSONL {"question", "answer": [...]}; a file or a glob),
      `webq:PATH` (JSON list of {"qId", "qText", "answers"}), `curated_trec:PATH` (TSV
      `question<TAB>regex` or `question<TAB>["regex", ...]` as DPR ships it, or JSONL
      {"question", "answer": [regex, ...]} as DrQA and ORQA do; a file or a glob), `squad:PATH`
      (SQuAD v1.1 / v2 JSON), `tfds:natural_questions_open[:SPLIT]`,
      `tfds:web_questions[:SPLIT]` (default split: train), `prepared:SPLIT`
      (`data_dir/qa/SPLIT.jsonl`, written by realm-prepare).
    strict: the first bad record raises DataError naming its file and line instead.
    data_dir: the prepared data dir `prepared:` reads from.
    option: the config option named by a ConfigError about `spec`.
    tfds_data_dir: TFDS data dir (None: TFDS's default).
  Returns:
    (examples, skipped counts by reason).
  """
  kind, arg = parse_qa_spec(spec, option)
  skips = QASkips(strict)
  collect = _Collector(skips, is_regex=kind == "curated_trec")
  if kind == "prepared":
    if not data_dir:
      raise ConfigError(option, f"{spec!r} reads DATA/qa/{arg}.jsonl: set data.dir")
    path = os.path.join(paths.local_dir(data_dir), "qa", f"{arg}.jsonl")
    if not os.path.isfile(path):
      raise ConfigError(option, f"{spec!r}: no such file {path} (realm-prepare writes the QA "
                        "sets of squad: and world: sources there)")
    _read_jsonl(path, collect)
  elif kind == "nq_open":
    for path, name in _files(arg).items():
      _read_jsonl(path, collect, name)
  elif kind == "curated_trec":
    for path, name in _files(arg).items():
      _read_curated_trec(path, collect, name)
  elif kind == "webq":
    _read_webq(arg, collect)
  elif kind == "squad":
    _read_squad(arg, collect)
  else:
    _read_tfds(arg, collect, option, tfds_data_dir)
  return collect.examples, dict(skips.counts)


def qa_split(config_qa, split: str, data_dir: str = "", *, strict: bool = False
             ) -> tuple[list[QAExample], dict[str, int]]:
  """The questions of `config.qa.<split>` ("train" | "dev" | "test") and the skip counts.

  With `qa.heldout_articles` = f > 0, articles are assigned by a stable hash of their title
  (paragraphs by one of their text with `qa.heldout_unit` = "paragraph"): a share f is held
  out; train keeps the other articles, dev and test keep the held-out ones.
  """
  if split not in SPLITS:
    raise ValueError(f"split {split!r} is not one of {SPLITS}")
  option = f"qa.{split}"
  spec = config_qa.get(split, "")
  if not spec:
    raise ConfigError(option, "is empty: name the questions (nq_open:PATH, webq:PATH, "
                      "curated_trec:PATH, squad:PATH, tfds:NAME[:SPLIT], prepared:SPLIT)")
  heldout = config_qa.get("heldout_articles", 0.0)
  if not 0.0 <= heldout < 1.0:
    raise ConfigError("qa.heldout_articles", f"must be in [0, 1), got {heldout}")
  unit = heldout_unit(config_qa)
  examples, counts = read_qa(spec, strict=strict, data_dir=data_dir, option=option,
                             tfds_data_dir=config_qa.get("tfds_data_dir") or None)
  articles = ""
  if heldout > 0:
    keys = [ex.title if unit == "article" else ex.paragraph for ex in examples]
    without = sum(not key for key in keys)
    if without and (unit == "paragraph" or not spec.startswith("squad:")):
      by, carry = (("article title", "only squad: questions carry titles") if unit == "article"
                   else ("paragraph (qa.heldout_unit)", "only squad: questions, and prepared: "
                         "ones prepared since 2026-12-06, carry them"))
      raise ConfigError("qa.heldout_articles", f"{heldout} splits by {by}, but {without} of "
                        f"the {len(examples)} questions of {option}={spec!r} have none "
                        f"({carry}); set it to 0")
    held = sum(is_heldout_article(key, heldout) for key in set(keys))
    articles = (f", which holds out {held} of its {len(set(keys))} {unit}s by "
                f"{'title' if unit == 'article' else 'text'} hash")
    keep_heldout = split != "train"
    examples = [ex for ex, key in zip(examples, keys)
                if is_heldout_article(key, heldout) == keep_heldout]
  if not examples:
    raise ConfigError(option, f"{spec!r} gives no questions for the {split} split "
                      f"(skipped: {counts or 'none'}; qa.heldout_articles={heldout}{articles})")
  return examples, counts


def heldout_unit(config_qa) -> str:
  """`qa.heldout_unit` ("article" if unset), checked."""
  return checked_unit(config_qa.get("heldout_unit", "article"))


def checked_unit(unit: str) -> str:
  """`unit` if it is one of HELDOUT_UNITS, else a ConfigError naming qa.heldout_unit."""
  if unit not in HELDOUT_UNITS:
    raise ConfigError("qa.heldout_unit", f"{unit!r} is not one of {HELDOUT_UNITS}")
  return unit


def is_heldout_article(title: str, fraction: float) -> bool:
  """Whether the article `title` (or the paragraph of that key) is held out, by a hash stable
  across runs and machines."""
  h = int.from_bytes(hashlib.blake2b(title.encode("utf-8", "surrogatepass"),
                                     digest_size=4).digest(), "little")
  return h % 1_000_000 < fraction * 1_000_000


def questions_fingerprint(examples: Sequence[QAExample]) -> str:
  """sha256 of the questions in order (id, text, answers): what a run's batches index into,
  the same wherever the file lives."""
  digest = hashlib.sha256()
  for e in examples:
    digest.update(json.dumps([e.qid, e.question, list(e.answers), e.is_regex]).encode(
        "utf-8", "surrogatepass") + b"\n")
  return digest.hexdigest()


def question_inputs(tokenizer, examples: Sequence[QAExample | str], query_len: int
                    ) -> tuple[np.ndarray, np.ndarray]:
  """Query-tower inputs `[CLS] question [SEP]`, 0-padded to `query_len`: ids [Q, query_len]
  int32, and bool [Q] marking the questions cut to fit (the caller counts them)."""
  if query_len < 3:
    raise ValueError(f"query_len {query_len} < 3 leaves no room for a question")
  texts = [ex.question if isinstance(ex, QAExample) else ex for ex in examples]
  ids = np.zeros((len(texts), query_len), np.int32)
  truncated = np.zeros(len(texts), bool)
  for i, (wp, _) in enumerate(tokenizer.encode_batch(texts) if texts else []):
    truncated[i] = len(wp) > query_len - 2
    row = [tokenizer.cls_id] + wp[:query_len - 2] + [tokenizer.sep_id]
    ids[i, :len(row)] = row
  return ids, truncated


def _files(pattern: str) -> dict[str, str]:
  """The files a pattern names, each with the name its questions' default ids start with:
  its path below the pattern's last folder without a wildcard (a file's own name; `a/test.jsonl`
  for `D/*/test.jsonl`), so that no two questions get one id and a question keeps its id when
  the glob matches more files."""
  parts = pattern.split(os.sep)
  fixed = list(itertools.takewhile(lambda part: not any(c in part for c in "*?["), parts[:-1]))
  root = os.path.abspath(os.sep.join(fixed) or (os.sep if pattern.startswith(os.sep) else "."))
  return {path: os.path.relpath(os.path.abspath(path), root)
          for path in matching_files(pattern)}


def _lines(path: str, skips: QASkips) -> Iterator[tuple[str, str]]:
  """(where, text) of each non-blank line that is valid UTF-8 (of a gzip'd file too, as a
  corpus's or a SQuAD file's)."""
  with open_maybe_gzip(path) as f:
    for lineno, raw in enumerate(f, 1):
      raw = raw.removeprefix(b"\xef\xbb\xbf")   # a BOM'd file
      if not raw.strip():
        continue                           # a blank line is not a record
      where = f"{path}:{lineno}"
      try:
        yield where, raw.decode("utf-8")
      except UnicodeDecodeError:
        skips.skip(INVALID_UTF8, where)


def _read_jsonl(path: str, collect: _Collector, name: str | None = None) -> None:
  name = name or os.path.basename(path)
  for where, line in _lines(path, collect.skips):
    try:
      obj = json.loads(line)
    except MALFORMED:
      collect.skips.skip(MALFORMED_JSON, where)
      continue
    collect.add(obj, where, default_id=f"{name}:{where.rsplit(':', 1)[1]}")


def _read_curated_trec(path: str, collect: _Collector, name: str | None = None) -> None:
  name = name or os.path.basename(path)
  for where, line in _lines(path, collect.skips):
    default_id = f"{name}:{where.rsplit(':', 1)[1]}"
    if line.lstrip().startswith("{"):
      try:
        obj = json.loads(line)
      except MALFORMED:
        collect.skips.skip(MALFORMED_JSON, where)
        continue
    else:
      columns = line.rstrip("\r\n").split("\t")
      if len(columns) < 2:
        collect.skips.skip(MALFORMED_TSV, where)
        continue
      answers = []
      for column in columns[1:]:
        answers.extend(_tsv_answers(column))
      obj = {"question": columns[0], "answer": answers}
    collect.add(obj, where, default_id=default_id)


def _tsv_answers(column: str) -> list:
  """A TSV answer column: a list literal (DPR's `["a", "b"]` / `['a']`) or one pattern."""
  text = column.strip()
  if text.startswith("[") and text.endswith("]"):
    for parse in (json.loads, ast.literal_eval):
      try:
        value = parse(text)
      except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        continue
      if isinstance(value, list):
        return value
  return [column]


def _read_json(path: str):
  try:
    with open_maybe_gzip(path) as f:
      return json.loads(f.read().decode("utf-8-sig"))
  except (UnicodeDecodeError, *MALFORMED) as e:
    raise DataError(f"{path}: not a JSON file ({type(e).__name__}: {e})") from None


def _read_webq(path: str, collect: _Collector) -> None:
  data = _read_json(path)
  if not isinstance(data, list):
    raise DataError(f"{path}: expected a JSON list of {{qId, qText, answers}}")
  name = os.path.basename(path)
  for i, obj in enumerate(data):
    collect.add(obj, f"{path}: [{i}]", default_id=f"{name}[{i}]", question_key="qText",
                answers_key="answers", id_key="qId")


def _read_squad(path: str, collect: _Collector) -> None:
  """The questions of a SQuAD file whose paragraph `realm-prepare` keeps in the corpus
  (`sources.squad_paragraph_skipped`, at prepare's default `max_doc_bytes`): a skipped
  paragraph's questions are counted by its reason, so Open-QA and the zero-shot table ask the
  same ones."""
  skip, dedup = collect.skips.skip, Deduplicator()
  for a, article in enumerate(read_squad_articles(path)):
    if not isinstance(article, dict) or not isinstance(article.get("paragraphs", []), list):
      skip(NOT_AN_OBJECT, f"{path}: data[{a}]")
      continue
    title = article.get("title")
    for p, paragraph in enumerate(article.get("paragraphs", [])):
      if not isinstance(paragraph, dict):
        skip(NOT_AN_OBJECT, f"{path}: data[{a}].paragraphs[{p}]")
        continue
      # every paragraph realm-prepare reads passes the rule (and `dedup`), questions or not
      lost = squad_paragraph_skipped(title, paragraph.get("context"), dedup)
      qas = paragraph.get("qas") or []
      if not isinstance(qas, list):
        skip(NOT_AN_OBJECT, f"{path}: data[{a}].paragraphs[{p}]")
        continue
      for q, qa in enumerate(qas):
        where = f"{path}: data[{a}].paragraphs[{p}].qas[{q}]"
        if lost or (isinstance(qa, dict) and qa.get("is_impossible")):
          skip(lost or UNANSWERABLE, where)
          continue
        record = qa
        if isinstance(qa, dict):
          answers = squad_answers(qa)
          if answers is None:
            skip(NON_STRING_ANSWERS, where)
            continue
          record = {**qa, "answers": [text for text, _ in answers]}
        collect.add(record, where, default_id=f"{os.path.basename(path)}:{a}.{p}.{q}",
                    answers_key="answers", title=title,
                    paragraph=paragraph_key(paragraph.get("context")))


def _read_tfds(arg: str, collect: _Collector, option: str, data_dir: str | None) -> None:
  """A TFDS question set that the user has prepared locally (read by random access)."""
  name, _, split = arg.partition(":")
  split = split or "train"
  question_key, answers_key = TFDS_FEATURES[name]
  dataset = open_tfds(name, split, data_dir, option, register=_TFDS_MODULES.get(name))
  for i in range(len(dataset)):
    where = f"tfds:{name}:{split}[{i}]"
    example = dataset[i]
    try:
      record = {question_key: _text(example[question_key]),
                answers_key: [_text(a) for a in example[answers_key]]}
    except UnicodeDecodeError:
      collect.skips.skip(INVALID_UTF8, where)
      continue
    except (KeyError, TypeError):
      collect.skips.skip(NOT_AN_OBJECT, where)
      continue
    collect.add(record, where, default_id=f"{name}:{split}[{i}]", question_key=question_key,
                answers_key=answers_key)


def _text(value):
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  return value.decode("utf-8") if isinstance(value, bytes) else value

"""Data-preparation figures on real prose: salient-span agreement and tagger throughput.

Reads a SQuAD v1.1-format file (by default the SQuADShifts "New Wikipedia" test set in
``../shared/data/``, which is never copied into the repository) and reports:

* agreement: the share of the answers that are names or dates (``answer_kind``) that a
  salient span of the tagger covers exactly (``answer_agreement``), overall and per kind;
* throughput: sentences per second of the tagger's ``tag_batch`` on all sentences of the
  paragraphs (split with ``realm_jax.data.sentences.split_sentences``, as prepare does);
* prepare: blocks/s and sentences/s of the whole ``realm-prepare`` job (default tagger,
  ``--workers`` processes, blocks of 288) on the file's paragraphs written ``--copies`` times
  as JSONL documents with distinct titles;
* world (``--world_entities N``, off by default): the generated world of N entities (about
  4.2 blocks each at the demo's 40-wordpiece blocks; 240,000 -> ~1M blocks), end to end:
  generation, vocab training, packing, merge.

  python bench/prepare.py [--squad PATH] [--tagger regex|hf_ner:PATH] [--copies 20]
      [--workers 2] [--world_entities 240000] [--out runs/prepare.jsonl]

Each section prints a small table and one JSON line (also appended to ``--out`` when
given); with a tagger other than regex, the regex tagger's throughput is measured as well.
Exits with a clear message when the data file is absent.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import sys
import tempfile
import time

from realm_jax.data.sentences import split_sentences
from realm_jax.data.sources import read_squad_articles
from realm_jax.data.taggers import make_tagger
from realm_jax.errors import CommandParser, run_cli

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_SQUAD = REPO.parent / "shared" / "data" / "squadshifts_new_wiki_v1.0.json"

_MONTHS = frozenset(("January", "February", "March", "April", "May", "June", "July",
                     "August", "September", "October", "November", "December"))
# A word of a date: a number, possibly an ordinal, a decade or a range ("12th", "1990s",
# "1914–1918", "3,400"), an era marker, a century, a spelled ordinal, or a month name.
_DATE_WORD = re.compile(
    r"(?:(?:early|mid|late)-)?(?:[\d][\d,.–—/-]*(?:st|nd|rd|th|s)?"
    r"|AD|BC|BCE|CE|A\.D\.|B\.C\.|centur(?:y|ies)|millenni(?:um|a)"
    r"|(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth"
    r"|twentieth|twenty-first))", re.IGNORECASE)
# What makes such words a date: a month, a year 1000-2099, a decade, a century or an era.
_DATE_CORE = re.compile(
    r"\b(?:" + "|".join(sorted(_MONTHS)) + r")\b"
    r"|\d\s?(?:AD|BCE?|CE|A\.D\.|B\.C\.)|\b(?:AD|A\.D\.)\s?\d"
    r"|(?<![\d,.])(?:1\d{3}|20\d{2})(?![\d,])"
    r"|(?<!\d)\d{2,3}0s\b"
    r"|centur(?:y|ies)|millenni(?:um|a)", re.IGNORECASE)
# Lowercase words allowed inside a name (never first or last): "Bank of England", "Leonardo
# da Vinci", "Pratt & Whitney". Not "and", which mostly joins two names.
NAME_CONNECTORS = frozenset((
    "of", "the", "de", "da", "di", "du", "del", "della", "der", "den", "des", "la", "le",
    "von", "van", "y", "al", "bin", "for", "on", "upon", "at", "&"))
MAX_ANSWER_WORDS = 6
_TRIM = " \t\n\"'“”‘’«»()[]{}.,;:!?"


def trim_span(text: str, start: int, end: int) -> tuple[int, int]:
  """``[start, end)`` without surrounding whitespace/punctuation and a leading "the "."""
  while True:
    while start < end and text[start] in _TRIM:
      start += 1
    while end > start and text[end - 1] in _TRIM:
      end -= 1
    if text[start:start + 4].lower() == "the " and end - start > 4:
      start += 4
      continue
    return start, end


def answer_kind(paragraph: str, start: int, end: int) -> str | None:
  """"date", "name" or None for the (trimmed) answer ``paragraph[start:end]``.

  The rule looks at the answer text alone (and, for one word, its paragraph), never at a
  tagger. An answer of at most ``MAX_ANSWER_WORDS`` words (trailing ",;:" cut from each) is

  * a date when every word is a date word (a month name; a number, ordinal, decade or
    range such as "12th", "1990s", "1914–1918"; "AD"/"BC"/"BCE"/"CE"; "century"; a spelled
    ordinal; optionally "early-"/"mid-"/"late-" in front) and it holds a month name, a year
    1000-2099, a decade, a century or a number with an era: "12 March 1843", "the 1850s",
    "19th century", "AD 79"; but not "in 1843", "late 1941", "1917 and 1918" or "37";
  * a name when every word starts with an uppercase letter apart from lowercase
    ``NAME_CONNECTORS`` inside it ("Bank of England"), no word but the last ends in a comma
    (so no lists), and it is not one sentence-initial word whose lowercase form also occurs
    in the paragraph (a common word capitalised by its position, like "Many").
  """
  text = paragraph[start:end]
  raw = text.split()
  words = [w.rstrip(",;:") for w in raw]
  if not words or len(words) > MAX_ANSWER_WORDS or not all(words):
    return None
  if all(w in _MONTHS or _DATE_WORD.fullmatch(w) for w in words) and _DATE_CORE.search(text):
    return "date"
  if any(w.endswith(",") for w in raw[:-1]):
    return None
  if not (words[0][0].isupper() and words[-1][0].isupper()):
    return None
  if not all(w[0].isupper() or w in NAME_CONNECTORS for w in words):
    return None
  if len(words) == 1:
    before = paragraph[:start].rstrip(" \"'“‘(")
    sentence_initial = not before or before[-1] in ".!?\n"
    if sentence_initial and re.search(rf"\b{re.escape(text.lower())}\b", paragraph):
      return None
  return "name"


def _sentence_of(sentences: list[tuple[int, int]], start: int, end: int) -> int | None:
  """Index of the sentence holding ``[start, end)`` entirely, or None."""
  for i, (s, e) in enumerate(sentences):
    if s <= start and end <= e:
      return i
  return None


def load_paragraphs(squad_path) -> list[tuple[str, list[tuple[int, int]]]]:
  """``(context, sorted distinct answer char spans)`` of each paragraph of a SQuAD file (read
  as realm-prepare reads it: a byte-order mark, gzip)."""
  data = read_squad_articles(str(squad_path))
  paragraphs = []
  for article in data:
    for paragraph in article["paragraphs"]:
      context = paragraph["context"]
      answers = {(a["answer_start"], a["answer_start"] + len(a["text"]))
                 for qa in paragraph["qas"] for a in qa["answers"]}
      paragraphs.append((context, sorted(answers)))
  return paragraphs


def tag_paragraphs(paragraphs, tagger, batch_size: int = 256):
  """Sentences of each paragraph and their tagged spans (paragraph offsets), and the time.

  Returns ``(sentences, spans, seconds)``: per paragraph its sentence spans and, per
  sentence, the tagged spans shifted to paragraph offsets; ``seconds`` is the time spent in
  ``tagger.tag_batch`` alone (not in splitting).
  """
  sentences = [split_sentences(context) for context, _ in paragraphs]
  flat = [context[s:e] for (context, _), sents in zip(paragraphs, sentences) for s, e in sents]
  tagged, seconds = [], 0.0
  for i in range(0, len(flat), batch_size):
    t0 = time.perf_counter()
    tagged.extend(tagger.tag_batch(flat[i:i + batch_size]))
    seconds += time.perf_counter() - t0
  spans, k = [], 0
  for sents in sentences:
    spans.append([[(s + a, s + b) for a, b in tagged[k + j]] for j, (s, _) in enumerate(sents)])
    k += len(sents)
  return sentences, spans, seconds


def ratio(a: float, b: float) -> float:
  """``a / b``, or 0 when ``b`` is 0."""
  return a / b if b else 0.0


def answer_agreement(squad_path, tagger) -> dict:
  """Share of name/date answers of a SQuAD file that a tagged span covers exactly.

  Each distinct (paragraph, trimmed answer span) counts once; ``trim_span`` removes
  surrounding whitespace/punctuation and a leading "the". Answers that are names or dates
  are chosen by ``answer_kind`` (which does not use the tagger). Paragraphs are split with
  ``split_sentences`` and each sentence is tagged on its own, as prepare does; an answer is
  covered when some tagged span of the sentence holding it, trimmed the same way, equals the
  answer span. Answers that cross a sentence boundary count as misses.

  Returns a dict: answers, name_or_date, covered, agreement, names, names_covered,
  name_agreement, dates, dates_covered, date_agreement, sentences, tag_seconds,
  sentences_per_s.
  """
  paragraphs = load_paragraphs(squad_path)
  sentences, spans, seconds = tag_paragraphs(paragraphs, tagger)
  counts = {"answers": 0, "name": 0, "date": 0, "name_covered": 0, "date_covered": 0}
  for (context, answers), sents, sent_spans in zip(paragraphs, sentences, spans):
    trimmed = {trim_span(context, s, e) for s, e in answers}
    for start, end in sorted(span for span in trimmed if span[0] < span[1]):
      counts["answers"] += 1
      kind = answer_kind(context, start, end)
      if kind is None:
        continue
      counts[kind] += 1
      i = _sentence_of(sents, start, end)
      if i is not None and any(trim_span(context, s, e) == (start, end) for s, e in sent_spans[i]):
        counts[kind + "_covered"] += 1
  n_sentences = sum(len(s) for s in sentences)
  return {
      "tagger": tagger.name,
      "answers": counts["answers"],
      "name_or_date": counts["name"] + counts["date"],
      "covered": counts["name_covered"] + counts["date_covered"],
      "agreement": ratio(counts["name_covered"] + counts["date_covered"],
                         counts["name"] + counts["date"]),
      "names": counts["name"], "names_covered": counts["name_covered"],
      "name_agreement": ratio(counts["name_covered"], counts["name"]),
      "dates": counts["date"], "dates_covered": counts["date_covered"],
      "date_agreement": ratio(counts["date_covered"], counts["date"]),
      "sentences": n_sentences, "tag_seconds": seconds,
      "sentences_per_s": ratio(n_sentences, seconds),
  }


def regex_throughput(squad_path) -> dict:
  """Sentences per second of the regex tagger on all sentences of the file's paragraphs."""
  paragraphs = load_paragraphs(squad_path)
  sentences, _, seconds = tag_paragraphs(paragraphs, make_tagger("regex"))
  n_sentences = sum(len(s) for s in sentences)
  return {"tagger": "regex", "sentences": n_sentences, "tag_seconds": seconds,
          "sentences_per_s": ratio(n_sentences, seconds)}


def prepare_throughput(squad_path, copies: int, workers: int) -> dict:
  """realm-prepare on the file's paragraphs x `copies` (JSONL, distinct titles): its rates.

  The vocab is trained first, outside the timed run (it is a one-off per corpus)."""
  from realm_jax.data.prepare import prepare, prepare_config
  articles = read_squad_articles(str(squad_path))   # as realm-prepare reads it
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="realm_prepare_bench_"))
  try:
    corpus = tmp / "docs.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
      for k in range(copies):
        for a in articles:
          for p in a["paragraphs"]:
            f.write(json.dumps({"title": f"{a['title']} ({k})", "text": p["context"]}) + "\n")
    config = prepare_config()
    config.source, config.out_dir = f"squad:{squad_path}", str(tmp / "vocab")
    config.vocab_size, config.num_workers = 30522, 0
    prepare(config)
    config.source, config.out_dir = f"jsonl:{corpus}", str(tmp / "out")
    config.vocab, config.num_workers = str(tmp / "vocab" / "vocab.txt"), workers
    t0 = time.time()
    stats = prepare(config)
    seconds = time.time() - t0
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return {"corpus": f"{pathlib.Path(squad_path).name} x {copies}", "workers": workers,
          "documents": stats["documents"], "blocks": stats["blocks"],
          "sentences": stats["sentences"], "seconds": round(seconds, 2),
          "blocks_per_s": ratio(stats["blocks"], seconds),
          "sentences_per_s": ratio(stats["sentences"], seconds),
          "documents_per_s": ratio(stats["documents"], seconds)}


def world_throughput(entities: int, workers: int) -> dict:
  """realm-prepare on `world:ENTITIES` at the demo's shapes, everything included."""
  from realm_jax.data.prepare import prepare, prepare_config
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="realm_prepare_world_"))
  try:
    config = prepare_config()
    config.source, config.out_dir = f"world:{entities}", str(tmp / "out")
    config.block_len, config.max_sentence_len, config.vocab_size = 40, 14, 4000
    config.num_workers, config.shard_documents = workers, 20_000
    t0 = time.time()
    stats = prepare(config)
    seconds = time.time() - t0
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return {"corpus": f"world:{entities}", "workers": workers, "documents": stats["documents"],
          "blocks": stats["blocks"], "sentences": stats["sentences"],
          "seconds": round(seconds, 2), "minutes": round(seconds / 60, 2),
          "blocks_per_s": ratio(stats["blocks"], seconds),
          "sentences_per_s": ratio(stats["sentences"], seconds)}


def print_throughput(result: dict) -> None:
  print(f"realm-prepare on {result['corpus']} ({result['workers']} workers): "
        f"{result['documents']:,} documents -> {result['blocks']:,} blocks in "
        f"{result['seconds']:.1f} s")
  print(f"  {result['blocks_per_s']:,.0f} blocks/s, {result['sentences_per_s']:,.0f} "
        "sentences/s")


def print_agreement(result: dict) -> None:
  """A small table of ``answer_agreement``'s figures."""
  print(f"salient-span agreement with SQuAD answers ({result['tagger']}, "
        f"{result['answers']} distinct answers)")
  print(f"  {'kind':<14}{'answers':>9}{'covered':>9}{'agreement':>11}")
  for label, n, c, a in (
      ("name", result["names"], result["names_covered"], result["name_agreement"]),
      ("date", result["dates"], result["dates_covered"], result["date_agreement"]),
      ("name or date", result["name_or_date"], result["covered"], result["agreement"])):
    print(f"  {label:<14}{n:>9}{c:>9}{a:>11.3f}")
  print(f"  tagger throughput: {result['sentences_per_s']:,.0f} sentences/s "
        f"({result['sentences']} sentences in {result['tag_seconds']:.2f} s)")


def main(argv=None) -> list[dict]:
  """Runs each section, prints its table and a JSON line; returns the JSON records."""
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--squad", default=str(DEFAULT_SQUAD),
                      help="SQuAD v1.1-format JSON (default: %(default)s)")
  parser.add_argument("--tagger", default="regex", help="regex or hf_ner:PATH")
  parser.add_argument("--copies", type=int, default=20,
                      help="times the paragraphs are written for the prepare throughput")
  parser.add_argument("--workers", type=int, default=2, help="realm-prepare worker processes")
  parser.add_argument("--world_entities", type=int, default=0,
                      help="also prepare a generated world of this many entities (0: skip)")
  parser.add_argument("--out", default=None, help="append the JSON lines to this file")
  args = parser.parse_args(argv)
  if not pathlib.Path(args.squad).is_file():
    sys.exit(f"prepare bench: {args.squad} not found (the SQuADShifts file lives in "
             "../shared/data/ next to the repository; pass --squad PATH)")
  tagger = make_tagger(args.tagger)
  records = []
  result = answer_agreement(args.squad, tagger)
  print_agreement(result)
  records.append({"bench": "prepare_agreement", **result})
  if tagger.name != "regex":
    result = regex_throughput(args.squad)
    print(f"  regex tagger throughput: {result['sentences_per_s']:,.0f} sentences/s")
    records.append({"bench": "prepare_tagger_throughput", **result})
  if args.copies > 0:
    result = prepare_throughput(args.squad, args.copies, args.workers)
    print_throughput(result)
    records.append({"bench": "prepare_throughput", **result})
  if args.world_entities > 0:
    result = world_throughput(args.world_entities, args.workers)
    print_throughput(result)
    records.append({"bench": "prepare_world", **result})
  lines = [json.dumps(record) for record in records]
  print("\n".join(lines))
  if args.out:
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a", encoding="utf-8") as f:
      f.write("".join(line + "\n" for line in lines))
  return records


if __name__ == "__main__":
  run_cli("bench/prepare.py", main)

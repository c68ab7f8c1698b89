"""Salient-span tagger: dates, numbers and named entities found by regular expressions.

REALM masks one salient span per pre-training sentence, salient spans being named entities
(from a BERT tagger trained on CoNLL-2003) and dates (from a regular expression). This
offline stand-in needs no model:

* Dates and numbers: "12 March 1843", "12th March 1843", "March 12, 1843", "March 1843",
  years 1000-2099, decades ("1990s"), numbers with thousands separators ("3,400") and plain
  numbers of at least two digits. A unit after a number is left out of the span
  ("3,400 inhabitants" tags "3,400"), so masking it hides the quantity, not the unit.
* Named entities: maximal runs of capitalised words, joined across inner connectors such
  as "of" or "von" ("University of Kelmar"). A month name is never part of an entity. At a
  sentence start a common word ("The", "In", "She") is dropped from the run, so "The" alone
  is not an entity while "Alice Borin was born ..." and "Kelmar has ..." are.
"""

from __future__ import annotations

import re

_MONTH_NAMES = ("january", "february", "march", "april", "may", "june", "july", "august",
                "september", "october", "november", "december")
_MONTH = r"(?:January|February|March|April|May|June|July|August|September|October|November|December)"
_DAY = r"(?:3[01]|[12]\d|0?[1-9])(?:st|nd|rd|th)?"
_YEAR = r"(?:1\d{3}|20\d{2})"
# Digit runs must not start or end inside a longer number ("3,400" is never cut to "400").
_BEFORE = r"(?<![\w])(?<!\d[.,])"
_AFTER = r"(?![\w])(?![.,]\d)"
# Alternatives are tried in order at each position, so the longest date forms come first.
_DATE_OR_NUMBER = re.compile(_BEFORE + "(?:" + "|".join((
    rf"{_DAY}\s+{_MONTH},?\s+{_YEAR}",     # 12 March 1843
    rf"{_MONTH}\s+{_DAY},?\s+{_YEAR}",     # March 12, 1843
    rf"{_MONTH},?\s+{_YEAR}",              # March 1843
    r"(?:1\d{2}|20\d)0s",                  # 1990s
    r"\d{1,3}(?:,\d{3})+(?:\.\d+)?",       # 3,400
    r"\d{2,}(?:\.\d+)?",                   # 1843, 37
)) + ")" + _AFTER)

_UPPER, _LOWER = "A-ZÀ-ÖØ-Þ", "a-zß-öø-ÿ"
# "O'Neill" and "Saint-Malo" are one word; a possessive "'s" is not part of the name.
_CAPITALISED_WORD = re.compile(
    rf"(?<![\w'-])[{_UPPER}][{_UPPER}{_LOWER}]*(?:-[{_UPPER}{_LOWER}]+|'[{_UPPER}][{_LOWER}]+)*")
_CONNECTORS = ("of", "the", "de", "da", "di", "du", "del", "della", "der", "den", "des",
               "la", "le", "von", "van", "y", "al", "bin")
# The text between two words of one entity: spaces, optionally one or two connectors.
_ENTITY_GAP = re.compile(rf"\s+(?:(?:{'|'.join(_CONNECTORS)})\s+){{0,2}}")
# Capitalised at a sentence start only because they start the sentence (lowercase).
SENTENCE_START_WORDS = frozenset("""
    a an the this that these those there here it its he she his her him they them their we
    our you your i my me one some many most much more all both each every any no none few
    several little other such another in on at of for to from by with without about above
    after before during since until under over into onto upon within through across among
    between behind beyond near around against toward towards as if when where while why
    how what which who whom whose because although though unless whether and but or nor so
    yet then also however therefore thus meanwhile later today yesterday tomorrow now once
    still even only just perhaps often sometimes never always usually finally first second
    next last according despite following including like unlike is was are were be been has
    have had do does did can could will would shall should may might must not yes
    """.split())
_SENTENCE_END = ".!?"
_OPENING_PUNCTUATION = "\"'([{“‘«"


def _is_sentence_start(text: str, position: int) -> bool:
  """Whether only opening punctuation separates ``position`` from a sentence boundary."""
  i = position - 1
  while i >= 0 and (text[i].isspace() or text[i] in _OPENING_PUNCTUATION):
    if text[i] == "\n":
      return True
    i -= 1
  return i < 0 or text[i] in _SENTENCE_END


def _named_entity_spans(text: str, blocked: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Runs of capitalised words outside the ``blocked`` (date/number) spans."""
  words = [m.span() for m in _CAPITALISED_WORD.finditer(text)
           if m.group().lower() not in _MONTH_NAMES and m.group() != "I"
           and not any(s < m.end() and m.start() < e for s, e in blocked)]
  runs: list[list[tuple[int, int]]] = []
  for word in words:
    if runs and _ENTITY_GAP.fullmatch(text, runs[-1][-1][1], word[0]):
      runs[-1].append(word)
    else:
      runs.append([word])
  spans = []
  for run in runs:
    first_start, first_end = run[0]
    if (_is_sentence_start(text, first_start)
        and text[first_start:first_end].lower() in SENTENCE_START_WORDS):
      run = run[1:]  # "The Orvane Institute" -> "Orvane Institute"; "The" -> nothing
    if run:
      spans.append((run[0][0], run[-1][1]))
  return spans


def tag_salient_spans(text: str) -> list[tuple[int, int]]:
  """Char spans [start, end) of salient spans in one sentence: dates and named entities (REALM's salient spans).

  Args:
    text: a sentence (several sentences also work; boundaries are found at ".!?").

  Returns:
    Sorted, non-overlapping ``(start, end)`` character spans: dates, numbers (without their
    unit) and runs of capitalised words that are not explained by a sentence start.
  """
  dates = [m.span() for m in _DATE_OR_NUMBER.finditer(text)]
  return sorted(dates + _named_entity_spans(text, dates))


def span_covering(spans: list[tuple[int, int]], start: int, end: int) -> int | None:
  """Index of the tightest span covering the char range [start, end).

  Args:
    spans: ``(start, end)`` character spans, e.g. from ``tag_salient_spans``.
    start: start of the range to cover.
    end: end (exclusive) of the range to cover.

  Returns:
    The index in ``spans`` of the shortest span ``(s, e)`` with ``s <= start`` and
    ``end <= e`` (the first one on ties), or ``None`` if no span covers the range.
  """
  best = None
  for i, (s, e) in enumerate(spans):
    if s <= start and end <= e and (best is None or e - s < spans[best][1] - spans[best][0]):
      best = i
  return best

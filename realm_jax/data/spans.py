"""Salient-span tagger: dates, numbers and named entities found by regular expressions.

REALM masks one salient span per pre-training sentence, salient spans being named entities
(from a BERT tagger trained on CoNLL-2003) and dates (from a regular expression). This
offline stand-in needs no model:

* Dates (``tag_dates``): "12 March 1843", "14–15 May 1945", "March 12, 1843", "March 1843",
  "1 November", "June 14", years 1000-2099, ranges ("1914–1918", "1905–7"), decades
  ("1990s", "mid-1990s"), eras ("AD 79", "300 BC") and centuries ("19th century",
  "mid-19th century", "the nineteenth century" without "the"). A month name alone is not a
  date ("in May").
* Numbers: thousands separators ("3,400"), decimals ("4.5"), numbers of at least two
  digits, "2.5 million", and single digits before a recognised unit ("5%", "3 km"). A unit
  after a number is left out of the span ("3,400 inhabitants" tags "3,400"), so masking it
  hides the quantity, not the unit; the letter of a degree ("35 °C", "30°S") is no name.
* Named entities: maximal runs of capitalised words (any alphabet: "Topkapı", "İpekçi") on
  one line, joined across inner connectors such as "of", "von" or "&" ("University of Kelmar",
  "Pratt & Whitney"). Words may be hyphenated ("Saint-Malo", "Löwenheim–Skolem"; but
  "French-speaking" gives "French"), hold an inner apostrophe ("O'Neill"), digits ("M3",
  "O-1") or be initials and abbreviations ("J. R. R. Tolkien", "U.S. Congress",
  "St. Louis"). A possessive "'s" is not part of a name, nor joins two, except after a
  plural ("Women's Hockey League", "Seven Years' War") or in a saint's name. Person titles
  are not part of the name ("President Barack Obama" tags "Barack Obama"), and "of" after
  a person's name starts a new entity ("Chris Christie of New Jersey", unlike "Royal Bank
  of Scotland"). A month name is never part of an entity. At a sentence start a common
  word ("The", "In", "She", "Subsequently") is dropped from the run, so "The" alone is not
  an entity while "Alice Borin was born ..." and "Kelmar has ..." are.
"""

from __future__ import annotations

import bisect
import functools
import re
import sys
import unicodedata

_MONTH_NAMES = ("january", "february", "march", "april", "may", "june", "july", "august",
                "september", "october", "november", "december")
_MONTH = (r"(?:January|February|March|April|May|June|July|August|September|October|November"
          r"|December)")
_DAY = r"(?:3[01]|[12]\d|0?[1-9])(?:st|nd|rd|th)?"
_DAYS = rf"{_DAY}(?:\s?[–-]\s?{_DAY})?"   # "14–15"
_YEAR = r"(?:1\d{3}|20\d{2})"
_PREFIX = r"(?:(?:early|mid|late)-)?"       # "mid-1990s"
_ERA = r"(?:BCE|BC|CE|AD|B\.C\.(?:E\.)?|A\.D\.|C\.E\.)"
_ORDINAL = (r"(?:\d{1,2}(?:st|nd|rd|th)|(?:[Tt]wenty-)?(?:[Ff]irst|[Ss]econd|[Tt]hird|"
            r"[Ff]ourth|[Ff]ifth|[Ss]ixth|[Ss]eventh|[Ee]ighth|[Nn]inth)|[Tt]enth|"
            r"[Ee]leventh|[Tt]welfth|(?:[Tt]hir|[Ff]our|[Ff]if|[Ss]ix|[Ss]even|[Ee]igh|"
            r"[Nn]ine)teenth|[Tt]wentieth)")
_CENTURY = rf"{_ORDINAL}[\s-](?:centur(?:y|ies)|millenni(?:um|a))(?:\s{_ERA})?"
_MULTIPLIER = r"\s(?:million|billion|trillion)"
_UNIT = (r"(?:\s?%|\s?°|\s?(?:percent|per cent|km|cm|mm|kg|ft|lb|miles?|feet|foot|metres?|"
         r"meters?|kilometres?|kilometers?|acres?|hectares?|tons?|tonnes?|degrees?)\b)")
# Digit runs must not start or end inside a longer number ("3,400" is never cut to "400").
_BEFORE = r"(?<![\w])(?<!\d[.,])(?<![A-Z]-)"   # nor a model number ("B-52")
_AFTER = r"(?![\w])(?![.,]\d)"
# Alternatives are tried in order at each position, so the longest date forms come first;
# they are grouped by their first character, which makes a failing position cheap.
_DATE_OR_NUMBER = re.compile(_BEFORE + "(?:(?=\\d)(?:" + "|".join((
    rf"{_DAYS}\s+{_MONTH},?\s+{_YEAR}",                  # 12 March 1843, 14–15 May 1945
    rf"{_DAYS}\s+{_MONTH}",                              # 1 November
    _CENTURY,                                            # 19th century, 2nd millennium BC
    rf"\d{{1,4}}\s?{_ERA}",                              # 300 BC
    rf"{_YEAR}\s?[–—-]\s?(?:{_YEAR}|\d{{1,2}})",          # 1914–1918, 1905–7
    r"(?:1\d{2}|20\d)0s",                                # 1990s
    rf"\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?(?:{_MULTIPLIER})?",  # 3,400
    rf"\d+(?:\.\d+)?{_MULTIPLIER}",                      # 2.5 million
    r"\d+\.\d+",                                         # 4.5
    r"\d{2,}",                                           # 1843, 37
    rf"\d(?={_UNIT})",                                   # 5%, 3 km
)) + ")|(?=[A-Z])(?:" + "|".join((
    rf"{_MONTH}\s+{_DAYS},?\s+{_YEAR}",                  # March 12, 1843
    rf"{_MONTH},?\s+{_YEAR}",                            # March 1843
    rf"{_MONTH}\s+{_DAYS}",                              # June 14
    rf"{_ERA}\s?\d{{1,4}}",                              # AD 79
    _CENTURY,                                            # Nineteenth century
)) + ")|(?=[a-z])(?:" + "|".join((
    rf"{_PREFIX}{_CENTURY}",                             # mid-19th century
    r"(?:early|mid|late)-(?:1\d{2}|20\d)0s",            # mid-1990s
    rf"(?:early|mid|late)-{_YEAR}",                      # mid-1918
)) + "))" + _AFTER)

_LETTER = r"[^\W\d_]"
# Candidate words (capitalisation is checked in code, since ``re`` has no Unicode classes):
# dotted abbreviations ("U.S.", "B.A.M.S"), short forms ("St.", "Dr."), initials ("J."),
# and words with inner apostrophes ("O'Neill") and hyphen/dash parts ("Saint-Malo",
# "French-speaking", cut in code). Never a word that starts inside another ("O'Neill" has
# no word "Neill"), nor after a degree sign (the unit of "35 °C", "30°S"); a word after an
# opening quote ("'Der Saadet'") is fine.
_WORD = re.compile(
    r"(?=[^\W\d_a-z])"  # a fast way past lowercase words
    rf"(?<!\w['’])(?<![\w.°–-])(?:{_LETTER}(?:\.{_LETTER})+\.?"
    r"|(?:St|Dr|Mr|Mrs|Ms|Mt|Ft|Jr|Sr|Prof|Rev|Gen|Col|Capt|Lt|Gov|Sen|Rep|Hon)\."
    rf"|[A-Z]\.(?=\s+{_LETTER})"
    r"|\w+(?:&\w+|['’][A-Z]\w*)*(?:[–-]\w+(?:['’][A-Z]\w*)*)*)(?![\w$])")
_HYPHEN = re.compile(r"[–-]")
_CONNECTORS = ("of", "the", "de", "da", "di", "du", "del", "della", "der", "den", "des",
               "la", "le", "von", "van", "y", "al", "bin", "for", "upon", "am", "dos", "das",
               "&")
# The text between two words of one entity: spaces, optionally one or two connectors.
_ENTITY_GAP = re.compile(rf"\s+(?:(?:{'|'.join(_CONNECTORS)})\s+){{0,2}}")
_POSSESSIVE_GAP = re.compile(r"['’]s?\s+")
_PLURAL_POSSESSORS = frozenset(("Men", "Women", "Children", "People", "Workers", "Peoples"))
# Last words of names that go on with "of": "Royal Bank of Scotland", "Metropolitan Museum
# of Art", "Democratic Republic of the Congo".
_HEAD_WORDS = frozenset("""
    University College Institute Institution School Academy Seminary Museum Library Gallery
    Bank Department Ministry Office Council Committee Commission Board Bureau Agency
    Authority Court Church Cathedral Abbey Society Association Federation Union League Party
    Republic Kingdom Empire Emirate Commonwealth States Province County District City Isle
    Island Islands Bay Gulf Strait Straits Cape Sea Lake Duke Duchess Earl Prince Princess
    Archbishop Bishop Secretary Minister Order Battle Siege Treaty Act Declaration House
    Hall Center Centre Foundation Trust Fund Company Corporation Service Army Navy Force
    Forces Corps Chamber Parliament Assembly Congress Conference Convention Festival Cup
    Prize Award Hospital Knights Sisters Brothers Bachelor Master Doctor Professor Chair
    Director President Governor Chancellor Speaker Lord Lady Queen King Emperor Faculty
    Division Palace Castle Garden Gardens Park Square Temple Mosque
    """.split())
# Person titles: "President Barack Obama" -> "Barack Obama" (the CoNLL-2003 convention).
_TITLES = frozenset("""
    President Governor Mayor Senator Congressman Congresswoman Chairman Chairwoman Director
    Pope Archbishop Bishop Cardinal Reverend Professor Judge Dr. Mr. Mrs. Ms. Prof. Rev.
    Gov. Sen. Rep. Gen. Col. Capt. Lt. Hon. Sir Minister Speaker
    """.split())
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
# More of them, used by the tagger only (the generated world reserves the words above).
_MORE_SENTENCE_START_WORDS = frozenset("""
    former instead otherwise besides hence indeed overall prior due based aside along throughout
    outside inside beside per via except regardless soon early late recent modern various
    numerous major neither either certain different similar whereas moreover nevertheless
    nonetheless furthermore beginning starting using having being given among amongst
    afterwards whilst whenever wherever whatever whichever whoever almost nearly
    approximately roughly
    """.split())
# Sentence-initial adverbs such as "Subsequently" or "Historically".
_ADVERB = re.compile(r"[A-Z][a-z]{2,}(?:ally|ently|antly|ously|ively|ingly|edly|ately|arly)")
_TITLE_MODIFIERS = frozenset(("Prime", "Vice", "Deputy", "Chief", "Former", "Acting"))
_SENTENCE_END = ".!?"
_OPENING_PUNCTUATION = "\"'([{“‘«"


def _is_sentence_start(text: str, position: int) -> bool:
  """Whether only opening punctuation or a bracketed note ("[1]") separates ``position``
  from a sentence boundary."""
  i = position - 1
  while i >= 0 and (text[i].isspace() or text[i] in _OPENING_PUNCTUATION or text[i] == "]"):
    if text[i] == "\n":
      return True
    if text[i] == "]":
      opening = text.rfind("[", 0, i)
      if opening < 0:
        return False
      i = opening
    i -= 1
  return i < 0 or text[i] in _SENTENCE_END


def _is_common_start(text: str, start: int, end: int) -> bool:
  """Whether ``text[start:end]`` is a common word capitalised by a sentence start."""
  word = text[start:end]
  return ((word.lower() in SENTENCE_START_WORDS or word.lower() in _MORE_SENTENCE_START_WORDS
           or _ADVERB.fullmatch(word) is not None) and _is_sentence_start(text, start))


def _kept_length(word: str) -> int:
  """Length of the part of a hyphenated word that belongs to a name.

  Parts are kept while they are capitalised or numbers ("Saint-Malo", "O-1"), or a
  connector between capitalised parts ("Stratford-upon-Avon"), so "French-speaking" keeps
  "French".
  """
  parts = _HYPHEN.split(word)
  keep = 1
  while keep < len(parts):
    part = parts[keep]
    if part[:1].isupper() or part[:1].isdigit():
      keep += 1
    elif part in _CONNECTORS and keep + 1 < len(parts) and parts[keep + 1][:1].isupper():
      keep += 2
    else:
      break
  return sum(map(len, parts[:keep])) + keep - 1


def _capitalised_words(text: str, blocked: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Spans of the capitalised words of ``text`` outside the ``blocked`` spans (sorted and
  disjoint: each word looks at the one blocked span that can overlap it, so a long text of
  many numbers and names costs linear time, not their product)."""
  ends = [e for _, e in blocked]
  words = []
  for m in _WORD.finditer(text):
    word = m.group()
    if not word[0].isupper() or word.lower() in _MONTH_NAMES or word == "I":
      continue
    start, end = m.span()
    if "-" in word or "–" in word:
      end = start + _kept_length(word)
    after = bisect.bisect_right(ends, start)   # the first blocked span ending after start
    if after == len(blocked) or blocked[after][0] >= end:
      words.append((start, end))
  return words


def _joins(text: str, run: list[tuple[int, int]], word: tuple[int, int]) -> bool:
  """Whether ``word`` continues the entity whose words so far are ``run``.

  Words join across spaces and connectors ("University of Kelmar"), but not into a new
  sentence ("... D.C. The") nor across a line break (which starts one: a heading, a list
  item), and "of" after a name of two or more words that does not end
  in an institution word ("Chris Christie of New Jersey", unlike "Royal Bank of
  Scotland") starts a new entity. A possessive joins only after a plural ("Women's Hockey
  League", "Seven Years' War") or in a saint's name ("St. Paul's Cathedral").
  """
  end = run[-1][1]
  if "\n" in text[end:word[0]]:
    return False
  if _ENTITY_GAP.fullmatch(text, end, word[0]) is None:
    return (_POSSESSIVE_GAP.fullmatch(text, end, word[0]) is not None
            and (text[run[-1][0]:end] in _PLURAL_POSSESSORS
                 or text[end - 1:end + 1] in ("s'", "s’")
                 or text[run[0][0]:run[0][1]] in ("St.", "Saint")))
  if text[end - 1] == "." and _is_common_start(text, *word):
    return False
  if "of" in text[end:word[0]].split():
    words = len(run) - _is_common_start(text, *run[0])
    return words < 2 or text[run[-1][0]:end] in _HEAD_WORDS
  return True


def _named_entity_spans(text: str, blocked: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Runs of capitalised words outside the ``blocked`` (date/number) spans."""
  runs: list[list[tuple[int, int]]] = []
  for word in _capitalised_words(text, blocked):
    if runs and _joins(text, runs[-1], word):
      runs[-1].append(word)
    else:
      runs.append([word])
  spans = []
  for run in runs:
    if _is_common_start(text, *run[0]):
      run = run[1:]  # "The Orvane Institute" -> "Orvane Institute"; "The" -> nothing
    # A title followed directly by a name is left out, and ends what comes before it.
    piece: list[tuple[int, int]] = []
    for i, word in enumerate(run):
      is_title = (text[word[0]:word[1]] in _TITLES and i + 1 < len(run)
                  and text[word[1]:run[i + 1][0]].isspace())
      if is_title:
        while piece and text[piece[-1][0]:piece[-1][1]] in _TITLE_MODIFIERS:
          piece.pop()  # "Prime Minister Paul Keating" -> "Paul Keating"
        if piece:
          spans.append((piece[0][0], piece[-1][1]))
        piece = []
      else:
        piece.append(word)
    if piece:
      spans.append((piece[0][0], piece[-1][1]))
  return spans


@functools.cache
def _marks_to_letter() -> dict[int, str]:
  """A `str.translate` table: every Unicode mark (categories Mn, Mc, Me: the accent of a
  decomposed "é", a vowel sign) to "a"; built on first use."""
  return {c: "a" for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c))[0] == "M"}


def _marks_as_letters(text: str) -> str:
  """`text` with each combining mark that follows a letter (or such a mark) read as a
  lowercase letter, at the same offsets: `re`'s word characters leave marks out, which cut a
  decomposed (NFD) "Beyonce\u0301 Knowles" into "Beyonce" and "Knowles"; as a letter, the
  mark stays inside its word. Marks after anything else (a keycap's after a digit) stay."""
  if text.isascii():
    return text
  read = text.translate(_marks_to_letter())
  if read == text:
    return text
  chars = list(read)
  for i, (was, now) in enumerate(zip(text, read)):   # chars[i - 1] != text[i - 1]: a mark read
    if was != now and not (i and (text[i - 1].isalpha() or chars[i - 1] != text[i - 1])):
      chars[i] = was
  return "".join(chars)


def tag_dates(text: str) -> list[tuple[int, int]]:
  """Sorted, non-overlapping char spans of the dates and numbers alone (no names)."""
  return _dates(_marks_as_letters(text))


def _dates(text: str) -> list[tuple[int, int]]:
  return [m.span() for m in _DATE_OR_NUMBER.finditer(text)]


def tag_salient_spans(text: str) -> list[tuple[int, int]]:
  """Char spans [start, end) of REALM's salient spans in one sentence: dates, named entities.

  Args:
    text: a sentence (several sentences also work; boundaries are found at ".!?").

  Returns:
    Sorted, non-overlapping ``(start, end)`` character spans: dates, numbers (without their
    unit) and runs of capitalised words that are not explained by a sentence start.
  """
  text = _marks_as_letters(text)
  dates = _dates(text)
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

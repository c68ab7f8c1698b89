"""Answer strings in Open-QA: ORQA's normalisation, exact match and SQuAD F1, and the
`AnswerMatcher` that finds a question's answers inside wordpiece blocks.

ORQA fine-tuning needs answers in token space twice: the retriever loss marginalises over the
top blocks that *contain* an answer (up to `qa.searcher_beam` = 5000 per question), and the
reader loss over every (block, span) that *is* an answer. The matcher serves both.
"""

from __future__ import annotations

import dataclasses
import re
import string
import unicodedata
from collections import Counter
from typing import Sequence

import numpy as np

REGEX_FLAGS = re.IGNORECASE | re.UNICODE | re.MULTILINE   # ORQA's regex_match_score flags
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = str.maketrans("", "", string.punctuation)


# The spacings a text read back from wordpieces may have had around the characters BERT's
# tokenizer splits off as words of their own (`lone`: "U.S." -> "u . s ."): as split, glued to
# the word before ("st. louis", as a decoded span reads), glued on both sides ("u.s.",
# "jean-paul", "40,449", "東京").
SPACINGS = ("split", "before", "glued")


def lone(c: str) -> bool:
  """Whether BERT's basic tokenizer splits character `c` off as a word of its own: its
  punctuation (every non-alphanumeric ASCII character, "_" too, and Unicode's P* categories)
  or a CJK ideograph."""
  cp = ord(c)
  return (33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126
          or unicodedata.category(c).startswith("P") or 0x4E00 <= cp <= 0x9FFF
          or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2CEAF
          or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _spaced(spacing: str, lone_before: bool, lone_here: bool) -> bool:
  """Whether a space parts a word from the word before it (neither of them a `##` piece),
  as `spacing` places lone characters: `respaced`'s and `_segment_text`'s rule (`rows_text`
  applies it to whole arrays)."""
  return not ((spacing != "split" and lone_here) or (spacing == "glued" and lone_before))


def respaced(text: str, spacing: str) -> str:
  """`text` with its `lone` characters spaced as `spacing` says (`SPACINGS`), as `rows_text`
  spaces wordpieces."""
  words: list[tuple[str, bool]] = []   # (word, lone)
  for part in text.split():
    word = ""
    for c in part:
      if lone(c):
        words += [(word, False)] * bool(word) + [(c, True)]
        word = ""
      else:
        word += c
    words += [(word, False)] * bool(word)
  out = []
  for i, (word, alone) in enumerate(words):
    if i and _spaced(spacing, words[i - 1][1], alone):
      out.append(" ")
    out.append(word)
  return "".join(out)


def _strip_accents(s: str) -> str:
  """NFD with the combining marks dropped, as BERT's uncased tokenizer does."""
  return "".join(c for c in unicodedata.normalize("NFD", s) if unicodedata.category(c) != "Mn")


def as_read(s: str) -> str:
  """`s` as the uncased tokenizer reads it, so that an answer compares with a span decoded from
  its wordpieces: what it drops gone (control and format characters but tab and newlines, so a
  soft hyphen or a zero-width joiner, private-use ones, U+FFFD), accents stripped, lowercased,
  a final sigma as the tokenizer's per-character lowercasing leaves it ("ΟΔΟΣ" is "οδοσ")."""
  s = "".join(c for c in s if c in "\t\n\r"
              or not (unicodedata.category(c)[0] == "C" or c == "\ufffd"))
  return _strip_accents(s).lower().replace("\u03c2", "\u03c3")


def normalize_answer(s: str) -> str:
  """ORQA's `normalize_answer`: NFD, lowercase, ASCII punctuation and a/an/the dropped,
  whitespace squashed.

  One addition: the text is read as the uncased tokenizer reads it (`as_read`): combining
  marks (category Mn) are dropped after NFD, so "Pelé" == "Pele", and so are the characters
  the tokenizer drops ("Hydro\xadgen", a soft hyphen inside, == "Hydrogen").
  ORQA keeps them (NFD alone only makes composed and decomposed accents agree), which works
  there because its predictions are cut from the original block text; here predictions are
  decoded from uncased wordpieces, whose tokenizer strips accents exactly this way (BERT's
  `_run_strip_accents`), so keeping the marks would fail every accented answer. SQuAD's
  script does no unicode normalisation at all.
  """
  s = as_read(s)
  s = _ARTICLES.sub(" ", s.translate(_PUNCTUATION))
  return " ".join(s.split())


# Starts of predictions on which a pattern must not match nothing (`compile_answer_regex`).
_EMPTY_PROBES = ("", "a", "A", "1", " ", ".", "a b")


def compile_answer_regex(pattern: str) -> re.Pattern | None:
  """A CuratedTrec answer pattern compiled with ORQA's flags; None if invalid or if it can
  match an empty string at the start of a prediction (`x*`, a word boundary, a lookahead),
  since it would accept nearly every prediction. Accents are dropped from the pattern, as the
  uncased tokenizer drops them from the text it is matched against ("Pelé" finds "pele")."""
  try:
    compiled = re.compile(_strip_accents(pattern), REGEX_FLAGS)
  except re.error:
    return None
  empty = any((m := compiled.match(probe)) is not None and m.end() == 0
              for probe in _EMPTY_PROBES)
  return None if empty else compiled


def _whole_words(pattern: re.Pattern) -> re.Pattern | None:
  """`pattern` matching only from a word's start to a word's end in space-separated words
  (None if it cannot be wrapped, e.g. a global flag inside it)."""
  try:
    return re.compile(rf"(?<!\S)(?:{pattern.pattern})(?!\S)", pattern.flags)
  except re.error:
    return None


def regex_match(prediction: str, pattern: str) -> bool:
  """ORQA's and DrQA's `regex_match_score`: `re.match` (anchored at the start of the
  prediction only, not a full match) with IGNORECASE | UNICODE | MULTILINE on the prediction
  (not normalised), as given or in any of the `SPACINGS` (a span read back from wordpieces has
  lost how its punctuation was spaced: "u. s." for "U.S."); accents dropped from both. A
  pattern `compile_answer_regex` rejects matches nothing."""
  compiled = compile_answer_regex(pattern)
  prediction = _strip_accents(prediction)
  return compiled is not None and any(
      compiled.match(text) is not None
      for text in dict.fromkeys([prediction] + [respaced(prediction, s) for s in SPACINGS]))


def exact_match(prediction: str, answers: Sequence[str], is_regex: bool = False) -> bool:
  """EM: the normalised prediction, as given or in any of the `SPACINGS` (a span read back
  from wordpieces has lost how its text spaced punctuation: "40, 449" may be "40,449", "a. i."
  "A.I.", where alone its "a" would go as an article), equals a normalised answer (answers
  normalising to "" never match); for regex answers (CuratedTrec) `regex_match` with any
  pattern."""
  if is_regex:
    return any(regex_match(prediction, a) for a in answers)
  golds = [norm for norm in map(normalize_answer, answers) if norm]
  return (any(pred in golds for pred in _normalised(prediction))
          or _spelt_as_answer(prediction, answers))


def _spelt_as_answer(prediction: str, answers: Sequence[str]) -> bool:
  """Whether the prediction is an answer (one that does not normalise to "") spelt with other
  spaces around its `lone` characters: a span read back from wordpieces spaces them alike,
  which no one of the `SPACINGS` undoes where the answer spaced them differently ("u. s. navy"
  for "U.S. Navy", "modern - day kozan, adana" for "modern-day Kozan, Adana")."""
  words = _words(prediction)
  return any(_words(answer) == words for answer in answers if normalize_answer(answer))


def _words(text: str) -> list[str]:
  """The words and `lone` characters of `text` as the uncased tokenizer reads it."""
  return respaced(as_read(text), "split").split()


def _normalised(prediction: str) -> list[str]:
  """The normalised prediction as given and in each of the `SPACINGS`, once each."""
  return list(dict.fromkeys(normalize_answer(text) for text in
                            [prediction] + [respaced(prediction, s) for s in SPACINGS]))


def f1_score(prediction: str, answers: Sequence[str], is_regex: bool = False) -> float:
  """SQuAD's token-overlap F1 of the normalised strings, the max over answers and over the
  prediction's spacings (as `exact_match` compares them); for regex
  answers F1 is EM as a float (a pattern has no tokens to overlap)."""
  if is_regex:
    return float(exact_match(prediction, answers, is_regex=True))
  if _spelt_as_answer(prediction, answers):
    return 1.0
  best, golds = 0.0, [normalize_answer(answer).split() for answer in answers]
  for pred in _normalised(prediction):   # as given and in each spacing (`exact_match`)
    pred = pred.split()
    for gold in golds:
      same = sum((Counter(pred) & Counter(gold)).values())
      if gold and same:
        precision, recall = same / len(pred), same / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
  return best


@dataclasses.dataclass(frozen=True)
class VocabPieces:
  """What the matcher needs to know of each vocabulary id; build once per tokenizer with
  `vocab_pieces` and share it among the matchers of many questions."""

  continuation: np.ndarray   # bool [V]: a `##` piece (continues the word before it)
  boundary: np.ndarray       # bool [V]: [PAD] [UNK] [CLS] [SEP] [MASK]: never inside an answer
  text: tuple[str, ...]      # the piece's text, `##` stripped
  lone: np.ndarray           # bool [V]: one character the tokenizer splits off (`lone`: "."
                             # "-" "," "東"), which `SPACINGS` glue to its neighbours
  forms: np.ndarray          # uint8: UTF-8 of each id's text as it extends a row's text, bare
                             # (2i) and after a word (2i + 1: " word"; "\n" at a boundary),
                             # then (2V, 2V + 1) the end of a row, "\n\0\n"
  form_offsets: np.ndarray   # int64 [2V + 3]: where each form starts in `forms`


def vocab_pieces(tokenizer) -> VocabPieces:
  """The `VocabPieces` of a `realm_jax.data.tokenizer.Tokenizer` (~10 ms for BERT's vocab)."""
  tokens = tokenizer.tokens(range(tokenizer.vocab_size))
  continuation = np.array([t.startswith("##") for t in tokens], bool)
  boundary = np.zeros(len(tokens), bool)
  boundary[[tokenizer.pad_id, tokenizer.unk_id, tokenizer.cls_id, tokenizer.sep_id,
            tokenizer.mask_id]] = True
  text = tuple(t[2:] if c else t for t, c in zip(tokens, continuation))
  alone = np.array([not c and not b and len(t) == 1 and lone(t)
                    for t, c, b in zip(text, continuation.tolist(), boundary.tolist())], bool)
  forms = [f.encode("utf-8") for t, c, b in zip(text, continuation.tolist(), boundary.tolist())
           for f in (("\n", "\n") if b else (t, t) if c else (t, " " + t))]
  forms += [b"\n\x00\n"] * 2
  offsets = np.zeros(len(forms) + 1, np.int64)
  np.cumsum([len(f) for f in forms], out=offsets[1:])
  return VocabPieces(continuation, boundary, text, alone,
                     np.frombuffer(b"".join(forms), np.uint8), offsets)


def rows_text(vocab: VocabPieces, ids: np.ndarray, spacing: str = "split") -> str:
  """The words of each row of `ids` [n, L] as the matcher sees them (single-spaced, `##`
  pieces glued, "\n" for a boundary id; punctuation spaced as `spacing` says, one of
  `SPACINGS`), each row ended by "\n\0\n"; built with numpy."""
  n, L = ids.shape
  V = len(vocab.continuation)
  flat = np.concatenate([ids, np.full((n, 1), V, ids.dtype)], axis=1).ravel()
  breaks = np.append(vocab.boundary, True)[flat]
  spaced = np.ones(len(flat), bool)
  spaced[1:] = ~breaks[:-1]
  spaced[0] = False
  spaced &= ~breaks & ~np.append(vocab.continuation, False)[flat]
  if spacing != "split":   # `_spaced`: no space before a lone character, nor (glued) after one
    alone = np.append(vocab.lone, False)[flat]
    spaced &= ~alone
    if spacing == "glued":
      spaced[1:] &= ~alone[:-1]
  form = 2 * flat.astype(np.int64) + spaced
  starts, lengths = vocab.form_offsets[form], np.diff(vocab.form_offsets)[form]
  out_starts = np.cumsum(lengths) - lengths
  src = np.repeat(starts - out_starts, lengths) + np.arange(lengths.sum())
  return vocab.forms[src].tobytes().decode("utf-8")


class AnswerMatcher:
  """Finds one question's answers in wordpiece ids, only on word boundaries.

  String answers are tokenised once and matched as contiguous id sequences that neither start
  on nor are followed by a `##` piece (so "art" is not found in "art ##icle"). Answers that
  normalise to "", tokenise to nothing or contain [UNK] are ignored (an [UNK] would match any
  other unknown character). Regex answers (CuratedTrec) are searched in the block's words as
  the uncased tokenizer split them, single-spaced with `##` pieces glued back (`u . s .`,
  `jimmy carter`), and again with punctuation glued to the word before it and to both sides
  (`SPACINGS`: the text's own spacing is lost); special tokens split the text, and a match
  counts where it starts and ends on word boundaries, as DrQA's `has_answer` searches a
  passage. Patterns that
  `compile_answer_regex` rejects are ignored. `empty` says that no usable answer is left:
  nothing will ever match.
  """

  def __init__(self, tokenizer, answers: Sequence[str], is_regex: bool = False, *,
               vocab: VocabPieces | None = None):
    self.vocab = vocab if vocab is not None else vocab_pieces(tokenizer)
    self.is_regex = is_regex
    self.pad_id = tokenizer.pad_id
    self.patterns: list[re.Pattern] = []
    self.word_patterns: list[re.Pattern] = []
    self.answer_ids: list[np.ndarray] = []
    if is_regex:
      self.patterns = [p for p in map(compile_answer_regex, dict.fromkeys(answers)) if p]
      # the same patterns held to whole words, so that the engine backtracks to an alternative
      # that ends on a word boundary ("jimmy carter|jimmy" in "jimmy carters")
      self.word_patterns = list(filter(None, map(_whole_words, self.patterns)))
    else:
      texts = [a for a in dict.fromkeys(answers) if normalize_answer(a)]
      seen = set()
      for ids, _ in (tokenizer.encode_batch(texts) if texts else []):
        key = tuple(ids)
        if key and key not in seen and tokenizer.unk_id not in key:
          seen.add(key)
          self.answer_ids.append(np.asarray(key, np.int64))
    self.empty = not (self.patterns or self.answer_ids)

  def spans(self, token_ids: np.ndarray, valid: np.ndarray | None = None
            ) -> list[tuple[int, int]]:
    """Every (start, end), inclusive, where an answer occurs in `token_ids` [L], sorted;
    `valid` [L] (bool) limits the matches to the positions it marks."""
    token_ids = np.asarray(token_ids)
    if self.is_regex:
      return sorted(self._regex_spans(token_ids, valid))
    out = set()
    mask = None if valid is None else np.asarray(valid, bool)[None]
    for rows, starts, m in self._string_matches(token_ids[None], None, mask):
      out.update((int(s), int(s) + m - 1) for s in starts)
    return sorted(out)

  def contains(self, token_ids: np.ndarray, valid: np.ndarray | None = None) -> bool:
    """Whether an answer occurs in `token_ids` [L]."""
    return bool(self.spans(token_ids, valid))

  def contains_rows(self, tokens: np.ndarray, lengths: np.ndarray | None = None,
                    mask: np.ndarray | None = None) -> np.ndarray:
    """bool [n]: which rows of `tokens` [n, L] hold an answer, within the first `lengths`
    [n] ids of each row or the positions `mask` [n, L] marks (default: the whole row).

    String answers: one shifted comparison of the whole [n, L] array per answer wordpiece,
    then the boundary checks at the hits only. Regex answers: one search over the text of all
    rows at once, then the exact check of the rows it flags. 5,000 blocks x 128 ids of real
    prose (BERT's 30,522-piece vocab), 3 answers, one CPU core: about 4 ms for strings
    (tests/test_answers.py prints the figure), about 100 ms for CuratedTrec-like regexes in
    one spacing, most of it Python's `re` searching 4 MB of text case-insensitively; the three
    `SPACINGS` take ~2.5x that (1,581 SQuADShifts paragraphs, 3 patterns, AVX-512 Xeon: 45
    -> 110 ms).
    """
    tokens = np.asarray(tokens)
    n = tokens.shape[0]
    found = np.zeros(n, bool)
    if self.empty or n == 0:
      return found
    lengths = None if lengths is None else np.asarray(lengths)
    mask = None if mask is None else np.asarray(mask, bool)
    if self.is_regex:
      ids = np.array(tokens, copy=True)
      if lengths is not None:
        ids[np.arange(ids.shape[1])[None] >= lengths[:, None]] = self.pad_id
      if mask is not None:
        ids[~mask] = self.pad_id
      for i in self._regex_candidates(ids):
        found[i] = bool(self._regex_spans(ids[i], None))
      return found
    for rows, _, _ in self._string_matches(tokens, lengths, mask):
      found[rows] = True
    return found

  def _string_matches(self, tokens, lengths, mask):
    """(rows, starts, length) of each string answer's word-boundary matches in [n, L]."""
    n, L = tokens.shape
    bad = None
    if mask is not None:   # prefix sums of masked-out positions: a window is valid iff 0
      bad = np.zeros((n, L + 1), np.int32)
      np.cumsum(~mask, axis=1, out=bad[:, 1:])
    for ids in self.answer_ids:
      m = len(ids)
      if m > L:
        continue
      w = L - m + 1
      hit = tokens[:, :w] == ids[0]
      for j in range(1, m):
        hit &= tokens[:, j:j + w] == ids[j]
      rows, starts = np.nonzero(hit)
      if not len(rows):
        continue
      nxt = starts + m
      limit = np.full(len(rows), L) if lengths is None else np.minimum(lengths[rows], L)
      ok = nxt <= limit
      inside = nxt < limit
      follow = tokens[rows, np.minimum(nxt, L - 1)]
      if bad is not None:
        ok &= bad[rows, nxt] == bad[rows, starts]
        inside &= mask[rows, np.minimum(nxt, L - 1)]
      ok &= ~(inside & self.vocab.continuation[follow])
      yield rows[ok], starts[ok], m

  def _regex_candidates(self, ids: np.ndarray) -> list[int]:
    """Rows of `ids` [n, L] whose text a pattern matches somewhere (a superset of the rows with
    a word-boundary match), by searching the text of all rows at once: rows end in "\\0", a
    match that crosses one is retried a character later, and a flagged row is passed over."""
    rows = set()
    for spacing in SPACINGS:
      self._search_rows(rows_text(self.vocab, ids, spacing), len(ids), rows)
    return sorted(rows)

  def _search_rows(self, text: str, n: int, rows: set) -> None:
    """Adds to `rows` the rows of `text` (`rows_text` of n rows) a pattern matches inside."""
    row_ends = np.array([m.start() for m in re.finditer("\x00", text)])
    for pattern in self.patterns:
      pos = 0
      while (match := pattern.search(text, pos)) is not None:
        row = int(np.searchsorted(row_ends, match.start()))
        if row >= n:
          break
        # a match running past the row's end may hide one inside it ("carter\W*")
        if (match.start() < match.end() <= row_ends[row]
            or pattern.search(text, match.start(), row_ends[row]) is not None):
          rows.add(row)
          pos = row_ends[row] + 1
        else:
          pos = match.start() + 1

  def _regex_spans(self, token_ids, valid) -> set[tuple[int, int]]:
    """The regex spans of one row, found run by run between boundary (or invalid) ids."""
    out, segment = set(), []
    ids = token_ids.tolist()
    is_boundary = self.vocab.boundary[token_ids]
    if valid is not None:
      is_boundary = is_boundary | ~np.asarray(valid, bool)
    for i, b in enumerate(is_boundary.tolist()):
      if b:
        self._segment_spans(ids, segment, out)
        segment = []
      else:
        segment.append(i)
    self._segment_spans(ids, segment, out)
    return out

  def _segment_spans(self, ids, segment, out) -> None:
    """Adds the pattern matches in one run of ordinary tokens (positions `segment`), its text
    in each of the `SPACINGS`."""
    if not segment:
      return
    for spacing in SPACINGS:
      text, start_at, end_at = self._segment_text(ids, segment, spacing)
      words = lambda c0, c1: self._word_span(ids, segment, text, start_at, end_at, c0, c1)
      ends = sorted(end_at, reverse=True)
      for pattern in self.patterns + self.word_patterns:
        at = 0
        while at <= len(text) and (match := pattern.search(text, at)):
          start, end = match.span()
          span = words(start, end)
          if span is None:   # glued text: a greedy match may run into the next word
            span, end = _backed_off(pattern, text, start, end, ends, words)
          if span is not None:
            out.add(span)
          # a rejected match may hide a valid one that starts inside it
          at = end if span is not None else start + 1

  def _word_span(self, ids, segment, text, start_at, end_at, c0, c1):
    """(first, last) position of the pieces text[c0:c1] covers (its spaces trimmed) where it
    starts and ends on word boundaries, else None."""
    cont = self.vocab.continuation
    while c0 < c1 and text[c0] == " ":
      c0 += 1
    while c1 > c0 and text[c1 - 1] == " ":
      c1 -= 1
    k0, k1 = start_at.get(c0), end_at.get(c1)
    if (c0 < c1 and k0 is not None and k1 is not None and not cont[ids[segment[k0]]]
        and (k1 + 1 == len(segment) or not cont[ids[segment[k1 + 1]]])):
      return segment[k0], segment[k1]
    return None

  def _segment_text(self, ids, segment, spacing: str) -> tuple[str, dict, dict]:
    """(the words of `segment` as `rows_text` spaces them, {char offset: k of the piece that
    starts there}, {char offset: k of the piece that ends there})."""
    cont, alone, pieces = self.vocab.continuation, self.vocab.lone, self.vocab.text
    parts, start_at, end_at, pos = [], {}, {}, 0
    for k, i in enumerate(segment):
      if k and not cont[ids[i]] and _spaced(spacing, alone[ids[segment[k - 1]]], alone[ids[i]]):
        parts.append(" ")
        pos += 1
      start_at[pos] = k
      parts.append(pieces[ids[i]])
      pos += len(parts[-1])
      end_at[pos] = k
    return "".join(parts), start_at, end_at


def _backed_off(pattern: re.Pattern, text: str, start: int, stop: int, ends: list[int],
                words) -> tuple[tuple[int, int] | None, int]:
  """(span, its end) of the longest match of `pattern` from `start` that ends at a piece's end
  (`ends`, longest first) before `stop` on a word boundary (`words(start, end)`), else (None,
  stop)."""
  for end in ends:
    if start < end < stop and pattern.fullmatch(text, start, end):
      span = words(start, end)
      if span is not None:
        return span, end
  return None, stop

"""Sentence splitting with `sentencex` (rule-based, no model download at run time)."""

from __future__ import annotations

import sentencex


def split_sentences(text: str, language: str = "en") -> list[tuple[int, int]]:
  """Char spans [start, end) of the sentences of `text`, surrounding whitespace stripped.

  Empty sentences (whitespace only) are left out; the spans are sorted and disjoint.
  """
  spans = []
  for boundary in _boundaries(text, language):
    start, end = boundary["start_index"], boundary["end_index"]
    while start < end and text[start].isspace():
      start += 1
    while end > start and text[end - 1].isspace():
      end -= 1
    if end > start:
      spans.append((start, end))
  return spans


def _boundaries(text: str, language: str) -> list[dict]:
  """sentencex's sentences of `text`. sentencex 1.0 panics on a capital letter, a space other
  than ASCII's and a period ("plan A\\u00a0."): such a text is split with every space read
  as " " (the same char offsets), a text it splits as it stands is split as before."""
  try:
    return sentencex.get_sentence_boundaries(language, text)
  except BaseException as e:
    if type(e).__module__ != "pyo3_runtime":   # not a panic in sentencex (a Ctrl-C, say)
      raise
  spaced = "".join(" " if c.isspace() and not c.isascii() else c for c in text)
  return sentencex.get_sentence_boundaries(language, spaced)

"""Sentence splitting with `sentencex` (rule-based, no model download at run time)."""

from __future__ import annotations

import sentencex


def split_sentences(text: str, language: str = "en") -> list[tuple[int, int]]:
  """Char spans [start, end) of the sentences of `text`, surrounding whitespace stripped.

  Empty sentences (whitespace only) are left out; the spans are sorted and disjoint.
  """
  spans = []
  for boundary in sentencex.get_sentence_boundaries(language, text):
    start, end = boundary["start_index"], boundary["end_index"]
    while start < end and text[start].isspace():
      start += 1
    while end > start and text[end - 1].isspace():
      end -= 1
    if end > start:
      spans.append((start, end))
  return spans

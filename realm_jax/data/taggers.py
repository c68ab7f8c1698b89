"""Salient-span taggers chosen by a config string.

``make_tagger(spec)`` returns an object with a ``name`` and ``tag_batch(texts)``, which gives
for each sentence its sorted, non-overlapping ``(start, end)`` character spans:

  regex          the offline regular-expression tagger (``spans.tag_salient_spans``): dates,
                 numbers and capitalised names; needs nothing but Python
  hf_ner:PATH    named entities from a token-classification model saved at PATH
                 (``realm_jax.interop.hf_ner.NerTagger``), merged with the date and number
                 spans of the regex tagger (``spans.tag_dates``), as REALM combines a BERT
                 NER tagger with a date regex
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

from realm_jax.data import spans as spans_lib
from realm_jax.errors import ConfigError

Span = tuple[int, int]
_CHOICES = "choose regex or hf_ner:PATH"


class Tagger(Protocol):
  """What ``make_tagger`` returns."""
  name: str

  def tag_batch(self, texts: list[str]) -> list[list[Span]]:
    ...


class RegexTagger:
  """The offline tagger: ``spans.tag_salient_spans`` on each sentence."""
  name = "regex"

  def tag_batch(self, texts: list[str]) -> list[list[Span]]:
    return [spans_lib.tag_salient_spans(text) for text in texts]


def merge_spans(preferred: Sequence[Span], other: Sequence[Span]) -> list[Span]:
  """Union of two span lists with overlaps resolved: the longer span wins.

  Spans are taken longest first and kept unless they overlap a span already kept; between
  two overlapping spans of the same length the one from ``preferred`` wins (then the earlier
  one). So "12 March 1843" (date) beats "March" (entity), and "Apollo 11" (entity) beats
  "11" (number). Returns the kept spans sorted; empty spans are dropped.
  """
  candidates = [(s, e, 0) for s, e in preferred if e > s] + [(s, e, 1) for s, e in other if e > s]
  candidates.sort(key=lambda c: (c[0] - c[1], c[2], c[0]))
  kept: list[Span] = []
  for s, e, _ in candidates:
    if all(e <= ks or ke <= s for ks, ke in kept):
      kept.append((s, e))
  return sorted(kept)


class HfNerTagger:
  """Entity spans from a saved NER model, merged with the regex date/number spans.

  The overlap rule is ``merge_spans``: the longer span wins, the entity on equal lengths.
  """

  def __init__(self, path: str, ner=None):
    if ner is None:
      from realm_jax.interop.hf_ner import NerTagger  # lazy: only this tagger needs it
      ner = NerTagger(path)
    self.path = path
    self.name = f"hf_ner:{path}"
    self._ner = ner

  def tag_batch(self, texts: list[str]) -> list[list[Span]]:
    entities = self._ner.tag_batch(list(texts))
    return [merge_spans(ents, spans_lib.tag_dates(text)) for ents, text in zip(entities, texts)]


def make_tagger(spec: str = "regex") -> Tagger:
  """The tagger named by ``spec``: "regex" or "hf_ner:PATH".

  Raises:
    ConfigError: (option "tagger") for an unknown spec, an hf_ner spec without a path or
      one whose path does not exist.
  """
  spec = check_tagger(spec)
  return RegexTagger() if spec == "regex" else HfNerTagger(spec.partition(":")[2])


def check_tagger(spec: str) -> str:
  """``spec`` stripped, if it names a tagger `make_tagger` can load (checked before any work,
  nothing loaded); else the ConfigError `make_tagger` documents."""
  spec = (spec or "").strip()
  if spec == "regex":
    return spec
  kind, sep, path = spec.partition(":")
  if kind == "hf_ner" and sep and path:
    if not os.path.exists(path):
      raise ConfigError("tagger", f"hf_ner model path {path!r} does not exist")
    return spec
  if kind == "hf_ner":
    raise ConfigError("tagger", f"{spec!r} names no model path; use hf_ner:PATH")
  raise ConfigError("tagger", f"unknown tagger {spec!r}; {_CHOICES}")

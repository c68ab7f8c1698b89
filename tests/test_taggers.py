"""Tagger selection (regex, hf_ner merged with dates) and the SQuAD answer-agreement figure."""

import importlib.util
import json
import os
import sys
import types

import pytest

from realm_jax.data import taggers
from realm_jax.data.spans import tag_salient_spans
from realm_jax.errors import ConfigError
from tests.helpers import REPO

SQUADSHIFTS = os.path.join(os.path.dirname(REPO), "shared", "data",
                           "squadshifts_new_wiki_v1.0.json")


def load_bench():
  """bench/prepare.py, imported by path (bench/ is not a package)."""
  spec = importlib.util.spec_from_file_location(
      "_test_bench_prepare", os.path.join(REPO, "bench", "prepare.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bench = load_bench()


# ----------------------------------------------------------------------------- make_tagger

def test_regex_is_the_default_and_tags_like_tag_salient_spans():
  texts = ["Alice Borin was born on 12 March 1843.", "Nothing here.", ""]
  for spec in ("regex", " regex "):
    tagger = taggers.make_tagger(spec)
    assert tagger.name == "regex"
    assert tagger.tag_batch(texts) == [tag_salient_spans(t) for t in texts]
  assert taggers.make_tagger().name == "regex"


@pytest.mark.parametrize("spec, words", [
    ("bert", ["unknown tagger", "'bert'", "choose regex or hf_ner:PATH"]),
    ("", ["unknown tagger", "choose regex or hf_ner:PATH"]),
    ("regex:x", ["unknown tagger", "choose regex or hf_ner:PATH"]),
    ("hf_ner", ["names no model path", "hf_ner:PATH"]),
    ("hf_ner:", ["names no model path", "hf_ner:PATH"]),
    ("hf_ner:/no/such/ner-model", ["/no/such/ner-model", "does not exist"]),
])
def test_make_tagger_errors_name_the_option(spec, words):
  with pytest.raises(ConfigError) as info:
    taggers.make_tagger(spec)
  assert info.value.option == "tagger"
  assert str(info.value).startswith("config.tagger: ")
  for word in words:
    assert word in str(info.value)


class FakeNer:
  """Stands in for realm_jax.interop.hf_ner.NerTagger: fixed entity spans per text."""
  instances = []

  def __init__(self, path, batch_size=64, max_len=128):
    self.path, self.calls = path, []
    FakeNer.instances.append(self)

  def tag_batch(self, texts):
    self.calls.append(list(texts))
    out = []
    for text in texts:
      spans = []
      for name in ("Alice Borin", "March", "Apollo 11", "12"):
        start = text.find(name)
        if start >= 0:
          spans.append((start, start + len(name)))
      out.append(sorted(spans))
    return out


@pytest.fixture
def fake_hf_ner(monkeypatch):
  module = types.ModuleType("realm_jax.interop.hf_ner")
  module.NerTagger = FakeNer
  monkeypatch.setitem(sys.modules, "realm_jax.interop.hf_ner", module)
  FakeNer.instances = []
  return FakeNer


def test_hf_ner_merges_entities_with_dates_longer_span_wins(fake_hf_ner, tmp_path):
  tagger = taggers.make_tagger(f"hf_ner:{tmp_path}")
  assert tagger.name == f"hf_ner:{tmp_path}"
  assert fake_hf_ner.instances[0].path == str(tmp_path)
  texts = ["Alice Borin flew Apollo 11 on 12 March 1843 with 3,400 others.",
           "Kelmar grew in May."]
  out = tagger.tag_batch(texts)
  assert fake_hf_ner.instances[0].calls == [texts]
  # The date "12 March 1843" beats the shorter entities "12" and "March"; the entity
  # "Apollo 11" beats the shorter number "11"; "Kelmar" is no entity of the fake model and
  # the regex names are not used.
  assert [texts[0][s:e] for s, e in out[0]] == ["Alice Borin", "Apollo 11", "12 March 1843",
                                               "3,400"]
  assert out[1] == []


def test_merge_spans_rule():
  # Longer first; on equal length the preferred (entity) list wins; disjoint spans all stay.
  assert taggers.merge_spans([(0, 5), (10, 12)], [(3, 9), (10, 12), (20, 22)]) == [
      (3, 9), (10, 12), (20, 22)]
  assert taggers.merge_spans([(0, 5)], [(0, 6)]) == [(0, 6)]
  assert taggers.merge_spans([(4, 8)], [(2, 6)]) == [(4, 8)]
  assert taggers.merge_spans([(1, 1)], []) == []
  assert taggers.merge_spans([], [(5, 7), (0, 2)]) == [(0, 2), (5, 7)]


# ----------------------------------------------------------------------------- agreement

@pytest.mark.parametrize("answer, kind", [
    ("12 March 1843", "date"), ("March 1843", "date"), ("the 1850s", "date"),
    ("1914–1918", "date"), ("19th century", "date"), ("AD 79", "date"), ("1843", "date"),
    ("in 1843", None), ("late 1941", None), ("1917 and 1918", None), ("37", None),
    ("Kelmar", "name"), ("Bank of England", "name"), ("Leonardo da Vinci", "name"),
    ("J. R. R. Tolkien", "name"), ("Pratt & Whitney", "name"),
    ("Virginia and New Jersey", None), ("Paris, France", None), ("Apollo 11", None),
    ("the quiet streets", None), ("A B C D E F G", None),
])
def test_answer_kind(answer, kind):
  paragraph = f"It was about {answer} then."
  start, end = bench.trim_span(paragraph, 13, 13 + len(answer))
  assert bench.answer_kind(paragraph, start, end) == kind


def test_answer_kind_leaves_out_sentence_initial_common_words():
  paragraph = "Many came too; many left. Kelmar grew."
  assert bench.answer_kind(paragraph, 0, 4) is None
  assert bench.answer_kind(paragraph, 26, 32) == "name"


def test_trim_span():
  text = ' "the University of Port Selva", '
  s, e = bench.trim_span(text, 0, len(text))
  assert text[s:e] == "University of Port Selva"
  assert bench.trim_span("the", 0, 3) == (0, 3)


def write_squad(path, paragraphs):
  """A SQuAD v1.1 file; each paragraph is (context, [answer texts]), one question each."""
  data = [{"title": "Test", "paragraphs": [
      {"context": context,
       "qas": [{"id": f"{p}-{q}", "question": "?", "answers": [
           {"text": answer, "answer_start": context.index(answer)}]}
           for q, answer in enumerate(answers)]}
      for p, (context, answers) in enumerate(paragraphs)]}]
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"version": "1.1", "data": data}, f)


TINY = [
    ("Alice Borin was born on 12 March 1843 in Kelmar. "
     "In 1870 she moved to the University of Port Selva.",
     ["Alice Borin", "Alice Borin", "12 March 1843", "March 1843", "Kelmar.",
      "the University of Port Selva", "In 1870", "born"]),
    ("Tomas Vell visited Kelmar. Borin Institute hired him in the 1890s. "
     "Many came too; many left.",
     ["Kelmar. Borin Institute", "the 1890s", "Many", "Tomas"]),
]


def test_answer_agreement_on_a_tiny_file(tmp_path):
  path = tmp_path / "tiny.json"
  write_squad(path, TINY)
  result = bench.answer_agreement(path, taggers.make_tagger("regex"))
  # Distinct answers: 7 + 4 (the repeated "Alice Borin" counts once). Names: Alice Borin,
  # Kelmar, University of Port Selva (covered after trimming), "Kelmar. Borin Institute"
  # (crosses a sentence boundary: a miss), Tomas (only "Tomas Vell" is tagged: a miss).
  # Dates: 12 March 1843 and the 1850s (covered), March 1843 (inside a longer date: a miss).
  # "In 1870", "born" and the sentence-initial "Many" are neither.
  assert (result["answers"], result["name_or_date"], result["covered"]) == (11, 8, 5)
  assert (result["names"], result["names_covered"]) == (5, 3)
  assert (result["dates"], result["dates_covered"]) == (3, 2)
  assert result["agreement"] == pytest.approx(5 / 8)
  assert result["name_agreement"] == pytest.approx(3 / 5)
  assert result["date_agreement"] == pytest.approx(2 / 3)
  assert result["sentences"] == 5 and result["tagger"] == "regex"


class WholeSentenceTagger:
  """Tags every sentence as one span: shows that tagging is per sentence."""
  name = "whole"

  def tag_batch(self, texts):
    return [[(0, len(t))] for t in texts]


def test_answer_agreement_tags_each_sentence_on_its_own(tmp_path):
  path = tmp_path / "tiny.json"
  write_squad(path, [("Kelmar Borin. Port Selva Institute.",
                      ["Kelmar Borin.", "Port Selva Institute", "Borin. Port Selva"])])
  result = bench.answer_agreement(path, WholeSentenceTagger())
  # The first two are whole sentences (after trimming); the third crosses the boundary.
  assert (result["names"], result["names_covered"]) == (3, 2)


def test_bench_main_prints_a_table_and_a_json_line(tmp_path, capsys):
  path = tmp_path / "tiny.json"
  write_squad(path, TINY)
  out = tmp_path / "runs" / "prepare.jsonl"
  records = bench.main(["--squad", str(path), "--out", str(out), "--copies", "3",
                        "--workers", "0"])
  assert [r["bench"] for r in records] == ["prepare_agreement", "prepare_throughput"]
  printed = capsys.readouterr().out
  assert "name or date" in printed and "sentences/s" in printed and "blocks/s" in printed
  lines = [json.loads(x) for x in printed.strip().splitlines()[-2:]]
  assert lines[0]["agreement"] == pytest.approx(5 / 8)
  # The whole prepare job ran on the paragraphs written 3 times (distinct titles).
  assert lines[1]["documents"] == 3 * len(TINY) and lines[1]["blocks"] >= lines[1]["documents"]
  assert [json.loads(x) for x in out.read_text().strip().splitlines()] == lines
  with pytest.raises(SystemExit, match="not found"):
    bench.main(["--squad", str(tmp_path / "absent.json")])


def test_bench_main_with_hf_ner_also_times_the_regex_tagger(fake_hf_ner, tmp_path, capsys):
  path = tmp_path / "tiny.json"
  write_squad(path, TINY)
  records = bench.main(["--squad", str(path), "--tagger", f"hf_ner:{tmp_path}",
                        "--copies", "0"])
  assert [r["bench"] for r in records] == ["prepare_agreement", "prepare_tagger_throughput"]
  assert records[0]["tagger"] == f"hf_ner:{tmp_path}" and records[1]["tagger"] == "regex"
  # The fake model finds "Alice Borin" (twice asked, once counted) and the regex adds the
  # dates 12 March 1843 and the 1890s.
  assert (records[0]["names_covered"], records[0]["dates_covered"]) == (1, 2)
  assert "regex tagger throughput" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists(SQUADSHIFTS),
                    reason=f"SQuADShifts file absent ({SQUADSHIFTS})")
def test_regex_agreement_on_squadshifts():
  result = bench.answer_agreement(SQUADSHIFTS, taggers.make_tagger("regex"))
  print(f"agreement {result['agreement']:.3f} (names {result['name_agreement']:.3f} of "
        f"{result['names']}, dates {result['date_agreement']:.3f} of {result['dates']}); "
        f"{result['sentences_per_s']:,.0f} sentences/s")
  assert result["name_or_date"] > 2000
  assert result["agreement"] >= 0.6

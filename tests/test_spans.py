"""The regex salient-span tagger, on hand-written cases and on the generated world."""

import pytest

from realm_jax.data.spans import span_covering, tag_salient_spans
from realm_jax.data.world import generate_world


def tagged(text):
  return [text[s:e] for s, e in tag_salient_spans(text)]


@pytest.mark.parametrize("text, expected", [
    ("Alice Borin was born on 12 March 1843.", ["Alice Borin", "12 March 1843"]),
    ("She was born on March 12, 1843 in Kelmar.", ["March 12, 1843", "Kelmar"]),
    ("The bridge opened on 3rd May 1901.", ["3rd May 1901"]),
    ("The company was founded in March 1843.", ["March 1843"]),
    ("Kelmar was founded in 1843.", ["Kelmar", "1843"]),
    ("The town grew quickly in the 1990s.", ["1990s"]),
    ("Kelmar has 3,400 inhabitants.", ["Kelmar", "3,400"]),
    ("The firm employs 1,200,000 people and sold 12.5 tonnes.", ["1,200,000", "12.5"]),
    ("She wrote 37 books and 4 plays.", ["37"]),
    ("She studied at the University of Kelmar.", ["University of Kelmar"]),
    ("Ludwig von Brandt met Anna de la Cruz in Port Selva.",
     ["Ludwig von Brandt", "Anna de la Cruz", "Port Selva"]),
    ("The Orvane Institute is in Kelmar.", ["Orvane Institute", "Kelmar"]),
    ("The place is often mentioned in travel accounts.", []),
    ("In 1843, Kelmar was founded.", ["1843", "Kelmar"]),
    ("In Kelmar the winters are long.", ["Kelmar"]),
    ("It rained. The end came in May.", []),
    ("Kelmar's harbour is busy.", ["Kelmar"]),
    ("Alice Borin and Tomas Vell wrote it.", ["Alice Borin", "Tomas Vell"]),
    ("He met Alice Borin, Tomas Vell and Kelmar.", ["Alice Borin", "Tomas Vell", "Kelmar"]),
])
def test_tagged_spans(text, expected):
  assert tagged(text) == expected


def test_spans_are_sorted_and_disjoint():
  text = ("On 4 July 1901, Alice Borin of Kelmar moved to the University of Port Selva, "
          "which had 3,400 students in the 1990s and 12 March 1843 as its founding date.")
  spans = tag_salient_spans(text)
  assert spans == sorted(spans)
  assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
  assert "4 July 1901" in tagged(text) and "University of Port Selva" in tagged(text)


def test_numbers_are_never_cut_inside():
  assert tagged("It cost 3,400.") == ["3,400"]
  assert tagged("It used the ids 3a7, x12 and 4-5.") == []


def test_span_covering_prefers_tightest():
  spans = [(0, 10), (2, 6), (2, 8), (12, 15)]
  assert span_covering(spans, 3, 5) == 1
  assert span_covering(spans, 2, 7) == 2
  assert span_covering(spans, 12, 15) == 3
  assert span_covering(spans, 9, 13) is None
  assert span_covering([], 0, 1) is None


def test_world_fact_values_and_person_names_are_tagged():
  world = generate_world(600, seed=0)
  covered = exact = facts = names = person_sentences = filler_spans = 0
  for doc in world.documents:
    entity = world.entities[doc.entity]
    for sentence in doc.sentences:
      spans = tag_salient_spans(sentence.text)
      if not sentence.facts:
        filler_spans += len(spans)
        continue
      for start, end in sentence.value_spans:
        facts += 1
        covered += span_covering(spans, start, end) is not None
        exact += (start, end) in spans
      if entity.kind == "person":
        person_sentences += 1
        start = sentence.text.index(entity.name)
        names += span_covering(spans, start, start + len(entity.name)) is not None
  print(f"fact values covered {covered / facts:.4f} (exact {exact / facts:.4f}) of {facts}; "
        f"person names tagged {names / person_sentences:.4f} of {person_sentences}")
  assert covered / facts >= 0.98
  assert names / person_sentences >= 0.98
  assert filler_spans == 0

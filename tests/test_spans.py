"""The regex salient-span tagger, on hand-written cases and on the generated world."""

import unicodedata

import pytest

from realm_jax.data.spans import span_covering, tag_dates, tag_salient_spans
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


@pytest.mark.parametrize("text, expected", [
    # Dates: days without a year, ranges, decades, eras, centuries.
    ("They moved to St. Louis in the 1850s.", ["St. Louis", "1850s"]),
    ("She was born on 1 January 1900 in Saint-Malo.", ["1 January 1900", "Saint-Malo"]),
    ("It fell on 14–15 May 1945.", ["14–15 May 1945"]),
    ("It happened on June 14 and on 5 April.", ["June 14", "5 April"]),
    ("The style peaked in the mid-19th century.", ["mid-19th century"]),
    ("It was rebuilt in the nineteenth century.", ["nineteenth century"]),
    ("The 7th millennium BCE and the 3rd century AD.", ["7th millennium BCE", "3rd century AD"]),
    ("Pompeii was destroyed in AD 79 by Vesuvius.", ["Pompeii", "AD 79", "Vesuvius"]),
    ("The city was founded around 300 BC.", ["300 BC"]),
    ("He served from 1914–1918 and again 1939-45.", ["1914–1918", "1939-45"]),
    ("It slowed in the mid-1990s and mid-2008.", ["mid-1990s", "mid-2008"]),
    # Numbers: the quantity without its unit; multipliers belong to the number.
    ("Unemployment fell to 5% while prices rose 12.5 percent.", ["Unemployment", "5", "12.5"]),
    ("The population was 2.5 million in 2010.", ["2.5 million", "2010"]),
    ("It was 4 hours long and 3 km away.", ["3"]),
    ("It cost US$360,700 in total.", ["360,700"]),
    # a degree's letter is its unit, not a name (BERT reads "°c" and "30°s" as one word)
    ("It reaches 35 °C in July, 95°F, and lies at 30°S 70°W.", ["35", "95", "30", "70"]),
    # Names: any alphabet, after "the", hyphens, possessives, initials, abbreviations.
    ("He fought in the Battle of Hastings and the First World War.",
     ["Battle of Hastings", "First World War"]),
    ("The novel was written by J. R. R. Tolkien in Oxford.", ["J. R. R. Tolkien", "Oxford"]),
    ("The French-speaking monks lived near Topkapı Palace.", ["French", "Topkapı Palace"]),
    ("Istanbul-based Star TV was the first private channel.", ["Istanbul", "Star TV"]),
    ("Kelmar's harbour and O'Neill's pub are in Dún Laoghaire.",
     ["Kelmar", "O'Neill", "Dún Laoghaire"]),
    ("The Canadian Women's Hockey League met near St. Paul's Cathedral.",
     ["Canadian Women's Hockey League", "St. Paul's Cathedral"]),
    ("He was sent to the Seven Years' War.", ["Seven Years' War"]),
    ("Leonardo da Vinci painted the Mona Lisa.", ["Leonardo da Vinci", "Mona Lisa"]),
    ("Pratt & Whitney bought shares of AT&T.", ["Pratt & Whitney", "AT&T"]),
    ("He flew the B-52 along I-95 to Saint-Étienne.", ["B-52", "I-95", "Saint-Étienne"]),
    ("The U.S. Congress met in Washington, D.C. The session ended.",
     ["U.S. Congress", "Washington", "D.C."]),
    ("It stood on the Rhine–Meuse–Scheldt delta.", ["Rhine–Meuse–Scheldt"]),
    # Titles are not part of a person's name; "of" after a person starts a new entity.
    ("President Barack Obama met Prime Minister Paul Keating.", ["Barack Obama", "Paul Keating"]),
    ("It was chaired by Governor Chris Christie of New Jersey.", ["Chris Christie", "New Jersey"]),
    ("He banked with the Royal Bank of Scotland.", ["Royal Bank of Scotland"]),
    # Sentence starts: common words, adverbs, bracketed notes.
    ("Subsequently the Bible was translated into Armenian.", ["Bible", "Armenian"]),
    ("[citation needed] On 26 October 1943, it was organised.", ["26 October 1943"]),
    ("Historically, Kelmar was poor.", ["Kelmar"]),
    # A line break ends a name, as it starts a sentence (a heading, a list item, a paragraph).
    ("He lived in Paris\nThe city is big.", ["Paris"]),
    ("Workshop Participation\nIn 1900 it met at Port Selva\r\nKelmar Institute hired him.",
     ["Workshop Participation", "1900", "Port Selva", "Kelmar Institute"]),
])
def test_tagged_spans_on_real_prose(text, expected):
  assert tagged(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("Beyoncé Knowles was born in Houston in 1981.", ["Beyoncé Knowles", "Houston", "1981"]),
    ("Émile Zola lived in Médan from 1878.", ["Émile Zola", "Médan", "1878"]),
    ("The river Nguyễn Trãi named flows past Hà Nội.", ["Nguyễn Trãi", "Hà Nội"]),
])
def test_decomposed_accents_tag_as_their_composed_form(text, expected):
  """A text in NFD (an accent as its own combining character) gives the spans of its NFC
  form, at the same offsets of its own characters."""
  decomposed = unicodedata.normalize("NFD", text)
  assert decomposed != text
  assert [unicodedata.normalize("NFC", span) for span in tagged(decomposed)] == expected
  assert tagged(text) == expected


def test_a_mark_after_a_digit_leaves_the_number_as_it_was():
  assert tagged("It has 10\ufe0f\u20e3 parts and 37 more.") == ["10", "37"]   # a keycap


def test_tag_dates_leaves_names_out():
  text = "Alice Borin moved to Kelmar on 12 March 1843 with 3,400 others."
  assert [text[s:e] for s, e in tag_dates(text)] == ["12 March 1843", "3,400"]


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

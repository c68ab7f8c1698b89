"""Answer normalisation, EM / F1 (SQuAD values by hand, CuratedTrec regexes) and the
`AnswerMatcher` on a trained WordPiece vocab: word boundaries, regex spans, and the vectorised
`contains_rows` against a slow reference."""

import time

import numpy as np
import pytest

from realm_jax.data.answers import (AnswerMatcher, exact_match, f1_score, normalize_answer,
                                    regex_match, rows_text, vocab_pieces)
from realm_jax.data.tokenizer import train_tokenizer

# "article" is rare: it stays `art ##i ##c ##l ##e`, and "1977" stays `19 ##7 ##7`
CORPUS = ["modern art and the art of the state", "art is art", "the united states",
          "jimmy carter was president in 1977", "james earl carter was born in 1924",
          "carter and the carters", "art art art art art art"] * 5 + [
              "an article about art", "the article"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  return train_tokenizer(CORPUS, str(tmp_path_factory.mktemp("vocab")), vocab_size=80)


def ids_of(tok, text: str) -> list[int]:
  return tok.encode_batch([text])[0][0]


def block(tok, title: str, body: str) -> np.ndarray:
  return np.asarray([tok.cls_id] + ids_of(tok, title) + [tok.sep_id] + ids_of(tok, body)
                    + [tok.sep_id], np.int32)


def text_of(tok, ids, span) -> str:
  return tok.decode(ids[span[0]:span[1] + 1])


def test_normalize_answer():
  assert normalize_answer("The  Beatles!") == "beatles"
  assert normalize_answer("An apple a day") == "apple day"
  assert normalize_answer("theater") == "theater"            # articles are whole words only
  assert normalize_answer("U.S.A.") == "usa"
  assert normalize_answer("Pelé") == normalize_answer("Pele\u0301") == "pele"
  assert normalize_answer("Café  au\tlait\n") == "cafe au lait"
  assert normalize_answer("the") == normalize_answer(" ,. ") == ""


def test_exact_match_and_f1_follow_squad():
  assert exact_match("the Beatles", ["Rolling Stones", "Beatles."])
  assert not exact_match("Beatles band", ["Beatles"])
  assert not exact_match("a", ["the"])            # an answer that normalises to "" never matches
  # "cat sat on mat" vs "cat on mat": P = 3/4, R = 1
  assert f1_score("the cat sat on the mat", ["a cat on a mat"]) == pytest.approx(6 / 7)
  # vs "obama": P 1/2 R 1 -> 2/3; vs "president barack obama": P 1 R 2/3 -> 0.8
  assert f1_score("Barack Obama", ["Obama", "President Barack Obama"]) == pytest.approx(0.8)
  # repeated tokens count once each: "cat cat" vs "cat" -> P 1/2 R 1
  assert f1_score("the cat cat", ["cat"]) == pytest.approx(2 / 3)
  assert f1_score("Paris", ["London"]) == 0.0
  assert f1_score("", ["London"]) == 0.0


def test_regex_answers_match_like_orqa():
  carter, year = r"Jimmy Carter|James Earl Carter", r"1\s*9\s*7\s*7"
  assert exact_match("Jimmy Carter", [carter], is_regex=True)
  assert exact_match("JAMES EARL CARTER", [carter], is_regex=True)
  assert exact_match("Jimmy Carter Jr", [carter], is_regex=True)  # re.match: start-anchored
  assert not exact_match("President Jimmy Carter", [carter], is_regex=True)
  assert exact_match("1 9 77", ["nope", year], is_regex=True)
  assert not exact_match("1978", [year], is_regex=True)
  assert not regex_match("anything", "(unclosed") and not regex_match("anything", "")
  assert not regex_match("anything", "(the )?")      # matches "": it would accept everything
  for empty_at_start in (r"\b", r"(?=\w)", r"\s*", r"(?:jimmy)?"):
    assert not regex_match("anything", empty_at_start), empty_at_start
  assert regex_match("jimmy", r"\bjimmy\b")
  assert f1_score("1977", [year], is_regex=True) == 1.0
  assert f1_score("1978", [year], is_regex=True) == 0.0


def test_string_answers_match_on_word_boundaries_only(tok):
  assert tok.tokens(ids_of(tok, "article"))[0] == "art" and len(ids_of(tok, "article")) > 1
  ids = block(tok, "modern art", "an article about art and jimmy carter")
  matcher = AnswerMatcher(tok, ["Art", "Jimmy Carter", "Jímmy  Carter"])
  spans = matcher.spans(ids)
  assert [text_of(tok, ids, s) for s in spans] == ["art", "art", "jimmy carter"]
  article = 1 + len(ids_of(tok, "modern art")) + 1 + len(ids_of(tok, "an"))
  assert all(s[0] != article for s in spans)       # "art" of "art ##icle" is no answer
  body = np.arange(len(ids)) > 1 + len(ids_of(tok, "modern art"))
  assert [text_of(tok, ids, s) for s in matcher.spans(ids, valid=body)] == ["art",
                                                                            "jimmy carter"]
  assert matcher.contains(ids) and not AnswerMatcher(tok, ["carters"]).contains(
      block(tok, "carter", "the carter"))
  assert not AnswerMatcher(tok, ["article"]).contains(block(tok, "art", "art"))


def test_answers_that_normalise_to_nothing_are_ignored(tok):
  ids = block(tok, "the art", "the united states")
  matcher = AnswerMatcher(tok, ["the", " ", "!!"])
  assert matcher.empty and matcher.spans(ids) == [] and not matcher.contains_rows(ids[None])[0]
  assert AnswerMatcher(tok, ["", "(unclosed"], is_regex=True).empty
  assert not AnswerMatcher(tok, ["the", "united states"]).empty


def test_regex_answers_map_to_token_spans(tok):
  assert len(ids_of(tok, "1977")) > 1           # the year is several pieces: glued back
  ids = block(tok, "jimmy carter", "james earl carter was president in 1977 . art")
  matcher = AnswerMatcher(tok, [r"Jimmy Carter|James Earl Carter", r"1\s*9\s*7\s*7"],
                          is_regex=True)
  assert [text_of(tok, ids, s) for s in matcher.spans(ids)] == [
      "jimmy carter", "james earl carter", "1977"]
  assert not AnswerMatcher(tok, ["carte", "art"], is_regex=True).contains(
      block(tok, "carter", "an article"))              # matches must end on word boundaries
  assert AnswerMatcher(tok, [r"art\w*"], is_regex=True).spans(block(tok, "x", "article")) \
      == [(3, 2 + len(ids_of(tok, "article")))]
  across = block(tok, "jimmy", "carter")                # [SEP] splits the text
  assert not AnswerMatcher(tok, [r"jimmy\s*carter"], is_regex=True).contains(across)
  assert AnswerMatcher(tok, [r"^carter$"], is_regex=True).contains(across)
  # an alternative that ends on a word boundary behind one that does not
  carters = block(tok, "x", "jimmy carters")
  either = AnswerMatcher(tok, [r"jimmy carter|jimmy"], is_regex=True)
  assert [text_of(tok, carters, s) for s in either.spans(carters)] == ["jimmy"]
  assert either.contains_rows(carters[None]).tolist() == [True]


PUNCTUATED = ["he lived in st. louis for years", "the u.s. army", "jean-paul sartre wrote",
              "a town of 40,449 people", "pelé scored twice", "(born 1950) in paris, france",
              "he lived in 東京", "foo_bar was read", "the u.s.) army"] * 3


@pytest.fixture(scope="module")
def punctuated_tok(tmp_path_factory):
  return train_tokenizer(PUNCTUATED, str(tmp_path_factory.mktemp("vocab")), vocab_size=120)


@pytest.mark.parametrize("pattern, body, span", [
    (r"St\.? Louis", "he lived in St. Louis for years", "st . louis"),   # glued before
    (r"U\.S\.", "the U.S. army", "u . s ."),                             # glued both sides
    (r"Jean-Paul", "Jean-Paul Sartre wrote", "jean - paul"),
    (r"40,?449", "a town of 40,449 people", "40 , 449"),
    (r"Pelé", "Pelé scored twice", "pele"),                               # accents dropped
    (r"\(born 1950\)", "(born 1950) in Paris, France", "( born 1950 )"),
    (r"Paris, France", "(born 1950) in Paris, France", "paris , france"),
    (r"東京", "he lived in 東京", "東 京"),                                # CJK: split too
    (r"foo_bar", "foo_bar was read", "foo _ bar"),                         # "_" is punctuation
    (r"U\.?S\.?A?", "the U.S. army", "u . s ."),   # glued "u.s.army": greedy "u.s.a" backs off
    (r"U\. S\.\) army", "the U.S.) army", "u . s . ) army"),            # marks in a row
])
def test_regex_answers_match_the_text_however_its_punctuation_was_spaced(
    punctuated_tok, pattern, body, span):
  """The tokenizer spaces punctuation apart and drops accents ("U.S." is `u . s .`): a pattern
  written against the text finds the block and the span, and the span as read back from
  wordpieces (decoded) matches as a prediction."""
  tok = punctuated_tok
  ids = block(tok, "x", body)
  matcher = AnswerMatcher(tok, [pattern], is_regex=True)
  found = [" ".join(tok.tokens(ids[a:b + 1])).replace(" ##", "") for a, b in matcher.spans(ids)]
  assert found == [span], found
  assert matcher.contains_rows(ids[None]).tolist() == [True]
  decoded = text_of(tok, ids, matcher.spans(ids)[0])
  assert exact_match(decoded, [pattern], is_regex=True), decoded
  assert not AnswerMatcher(tok, [pattern], is_regex=True).contains(block(tok, "x", "the army"))


def test_a_span_read_back_from_wordpieces_scores_as_its_answer_and_nothing_else():
  """EM / F1 compare the strings also glued around punctuation: a decoded span ("40, 449",
  "a. i.") is its answer; a word that spacing made ("a" of "a. i.", an article) is not."""
  for answer, decoded in [("40,449", "40, 449"), ("A.I.", "a. i."), ("The A-Team", "the a - team"),
                          ("Sir Mix-a-Lot", "sir mix - a - lot"), ("St. Louis", "st. louis"),
                          ("東京", "東 京"), ("foo_bar", "foo _ bar")]:
    assert exact_match(decoded, [answer]) and f1_score(decoded, [answer]) == 1.0, answer
  for answer, wrong in [("A.I.", "I"), ("A-ha", "ha"), ("The A-Team", "team"), ("a.m.", "m")]:
    assert not exact_match(wrong, [answer]) and f1_score(wrong, [answer]) == 0.0, answer


def test_an_answer_spaced_its_own_way_or_with_what_the_tokenizer_drops_scores_its_span():
  """A span read back from wordpieces spaces every mark alike, and has lost what the tokenizer
  drops (a soft hyphen, a zero-width joiner; NQ-open has "Hydro\xadgen"), where no one of the
  `SPACINGS` gives the answer's own text: each scores EM 1 and F1 1; other words still don't."""
  for answer, decoded in [("U.S. Navy", "u. s. navy"), ("A.I. Artificial Intelligence",
                                                        "a. i. artificial intelligence"),
                          ("modern-day Kozan, Adana", "modern - day kozan, adana"),
                          ("6,961 m (22,838 ft)", "6, 961 m ( 22, 838 ft )"),
                          ("Hydro\xadgen", "hydrogen"), ("Jay\u200dZ", "jayz"),
                          ("\ufeffParis", "paris"), ("ΟΔΟΣ", "οδοσ")]:
    assert exact_match(decoded, [answer]) and f1_score(decoded, [answer]) == 1.0, answer
  for answer, wrong in [("U.S. Navy", "u navy"), ("U.S. Navy", "u. s. navy yard"),
                        ("A.I.", "i")]:
    assert not exact_match(wrong, [answer]) and f1_score(wrong, [answer]) < 1.0, answer


def reference_contains(tok, row, answers) -> bool:
  """The definition, position by position."""
  pieces = tok.tokens(row)
  for answer in answers:
    a = ids_of(tok, answer)
    for s in range(len(row) - len(a) + 1):
      if list(row[s:s + len(a)]) == a and not pieces[s].startswith("##") and (
          s + len(a) == len(row) or not pieces[s + len(a)].startswith("##")):
        return True
  return False


def test_contains_rows_equals_a_slow_reference(tok):
  answers = ["art", "jimmy carter", "1977"]
  pool = sorted({i for a in answers + ["article", "carters", "the", "1924"]
                 for i in ids_of(tok, a)})
  rng = np.random.default_rng(0)
  tokens = rng.choice(pool, size=(400, 24)).astype(np.int32)
  lengths = rng.integers(0, 25, size=400)
  for i in range(0, 400, 7):                           # plant whole answers
    a = ids_of(tok, answers[i % 3])
    tokens[i, 5:5 + len(a)] = a
  matcher = AnswerMatcher(tok, answers)
  got = matcher.contains_rows(tokens, lengths=lengths)
  want = [reference_contains(tok, tokens[i, :lengths[i]], answers) for i in range(400)]
  assert got.tolist() == want and 20 < sum(want) < 380
  mask = np.arange(24)[None] < lengths[:, None]
  assert matcher.contains_rows(tokens, mask=mask).tolist() == want
  full = [reference_contains(tok, row, answers) for row in tokens]
  assert matcher.contains_rows(tokens).tolist() == full
  regex = AnswerMatcher(tok, [r"art", r"jimmy carter", r"1\s*9\s*7\s*7"], is_regex=True)
  assert regex.contains_rows(tokens, lengths=lengths).tolist() == want
  assert regex.contains_rows(tokens, mask=mask).tolist() == want


def test_regex_rows_are_searched_without_matches_across_rows(tok):
  first, second = block(tok, "jimmy", "1977 art"), block(tok, "the", "art")
  pad = len(first) - len(second)
  two = np.stack([first, np.pad(second, (0, pad))])
  assert rows_text(vocab_pieces(tok), two) == (
      "\njimmy\n1977 art\n\n\x00\n" + "\nthe\nart\n" + "\n" * pad + "\n\x00\n")
  rows = np.zeros((3, 6), np.int32)
  for i, text in enumerate(["art carter", "art is art", "carter"]):
    rows[i, :len(ids_of(tok, text))] = ids_of(tok, text)
  # one search over all rows: "carter\W*art" reaches from row 0 into row 1 and must not hide
  # row 1's own "art is"
  matcher = AnswerMatcher(tok, [r"carter\W*art|art is"], is_regex=True)
  assert matcher.contains_rows(rows).tolist() == [False, True, False]
  assert matcher.contains_rows(rows, lengths=[6, 1, 6]).tolist() == [False, False, False]
  # a greedy match running past a row's end still flags the row it holds a match in, as
  # `spans` finds it
  greedy, last = AnswerMatcher(tok, [r"carter\W*"], is_regex=True), block(tok, "jimmy", "carter")
  assert greedy.spans(last) and greedy.contains_rows(last[None]).tolist() == [True]


def test_contains_rows_is_fast_on_5000_blocks(tok, capsys):
  rng = np.random.default_rng(1)
  tokens = rng.integers(5, tok.vocab_size, size=(5000, 128)).astype(np.int32)
  lengths = np.full(5000, 128)
  matcher = AnswerMatcher(tok, ["jimmy carter", "1977", "art"], vocab=vocab_pieces(tok))
  planted = ids_of(tok, "jimmy carter") + [tok.sep_id]
  tokens[::50, 40:40 + len(planted)] = planted
  best = float("inf")
  for _ in range(5):
    t0 = time.perf_counter()
    found = matcher.contains_rows(tokens, lengths=lengths)
    best = min(best, time.perf_counter() - t0)
  with capsys.disabled():
    print(f"\n[answers] contains_rows: 5,000 blocks x 128 ids, 3 answers: {best * 1e3:.1f} ms")
  assert found[::50].all()
  assert best < 0.5

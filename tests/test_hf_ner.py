"""The NER tagger: a random BertForTokenClassification checkpoint written here gives the logits
of a NumPy reference; BIO / IOB1 decoding, word pieces and windows on handcrafted labels; and
classifiers whose bias forces one label give the spans that label implies."""

import json
import os

import numpy as np
import pytest

from realm_jax.data.tokenizer import windows
from realm_jax.errors import ConfigError
from realm_jax.interop.hf_ner import Entity, NerTagger, decode_entities, word_labels
from tests.test_hf_bert import VOCAB, hf_config, numpy_bert, random_bert, write_checkpoint

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
TEXT = "John Smith lives in New York, washington."
WORDS = ["John", "Smith", "lives", "in", "New", "York", ",", "washington", "."]


def word_spans(text, words):
  spans, at = [], 0
  for w in words:
    at = text.index(w, at)
    spans.append((at, at + len(w)))
    at += len(w)
  return spans


def ner_checkpoint(path, forced=None, tokenizer_config=None, vocab=VOCAB):
  """A random token classifier; `forced` names a label every piece gets (a huge bias)."""
  config = hf_config(len(vocab), architectures=["BertForTokenClassification"],
                     id2label={str(i): l for i, l in enumerate(LABELS)},
                     label2id={l: i for i, l in enumerate(LABELS)})
  weights = random_bert(config, seed=5, pooler=False)
  rng = np.random.default_rng(6)
  weights["classifier.weight"] = rng.normal(0, 0.5, (len(LABELS), 32)).astype(np.float32)
  weights["classifier.bias"] = rng.normal(0, 0.1, len(LABELS)).astype(np.float32)
  if forced is not None:
    weights["classifier.bias"][LABELS.index(forced)] = 1e4
  write_checkpoint(path, weights, config, vocab)
  if tokenizer_config is not None:
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
      json.dump(tokenizer_config, f)
  return str(path), weights, config


def test_logits_match_numpy_reference(tmp_path):
  path, weights, config = ner_checkpoint(tmp_path / "ner")
  tagger = NerTagger(path, batch_size=8, max_len=16)
  ids = np.array([[2, 5, 9, 13, 3, 0, 0, 0], [2, 30, 31, 40, 41, 42, 22, 3],
                  [2, 12, 3, 0, 0, 0, 0, 0]] * 4, np.int32)    # 12 rows: two device batches
  logits = tagger.logits(ids)
  hidden = numpy_bert(weights, config, ids, np.zeros_like(ids))
  expected = hidden @ weights["classifier.weight"].T.astype(np.float64) + weights[
      "classifier.bias"]
  assert logits.shape == (12, 8, len(LABELS))
  np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)
  assert tagger.batch_size % 8 == 0 and len(tagger.labels) == len(LABELS)


@pytest.mark.parametrize("labels, expected", [
    # BIO
    (["B-PER", "I-PER", "O", "O", "B-LOC", "I-LOC", "O", "B-LOC", "O"],
     [(0, 10, "PER"), (20, 28, "LOC"), (30, 40, "LOC")]),
    # IOB1: I- after O or another type starts an entity; B- only splits two of one type
    (["I-PER", "I-PER", "O", "O", "I-LOC", "I-LOC", "O", "I-LOC", "O"],
     [(0, 10, "PER"), (20, 28, "LOC"), (30, 40, "LOC")]),
    (["I-PER", "B-PER", "O", "O", "I-LOC", "I-ORG", "I-ORG", "I-ORG", "I-ORG"],
     [(0, 4, "PER"), (5, 10, "PER"), (20, 23, "LOC"), (24, 41, "ORG")]),
    # BIOES ends, and a B- right after an entity of the same type
    (["S-PER", "S-PER", "O", "O", "B-LOC", "E-LOC", "I-LOC", "B-LOC", "B-LOC"],
     [(0, 4, "PER"), (5, 10, "PER"), (20, 28, "LOC"), (28, 29, "LOC"), (30, 40, "LOC"),
      (40, 41, "LOC")]),
    (["O"] * 9, []),
])
def test_decode_entities(labels, expected):
  assert decode_entities(labels, word_spans(TEXT, WORDS)) == [Entity(*e) for e in expected]


def test_words_take_the_label_of_their_first_piece():
  tokens = ["john", "wash", "##ing", "##ton", "lives", "new", "##s"]
  offsets = [(0, 4), (5, 9), (9, 12), (12, 15), (16, 21), (22, 25), (25, 26)]
  pieces = ["B-PER", "I-PER", "O", "B-LOC", "O", "B-LOC", "I-PER"]
  words, labels = word_labels(tokens, offsets, pieces)
  assert words == [(0, 4), (5, 15), (16, 21), (22, 26)]
  assert labels == ["B-PER", "I-PER", "O", "B-LOC"]
  assert decode_entities(labels, words) == [Entity(0, 15, "PER"), Entity(22, 26, "LOC")]


def test_windows_cut_at_word_starts():
  starts = [True, True, False, False, True, False, True, True]
  assert windows(starts, 8) == [(0, 8)]
  assert windows(starts, 5) == [(0, 4), (4, 8)]
  assert windows(starts, 3) == [(0, 1), (1, 4), (4, 7), (7, 8)]
  assert windows([True, False, False, False, False], 2) == [(0, 2), (2, 4), (4, 5)]
  assert windows([], 4) == []


@pytest.mark.parametrize("forced, max_len", [("B-LOC", 128), ("B-LOC", 5), ("I-PER", 128),
                                             ("I-PER", 5), ("O", 128)])
def test_a_forced_label_gives_the_spans_it_implies(tmp_path, forced, max_len):
  path, _, _ = ner_checkpoint(tmp_path / "ner", forced=forced)
  tagger = NerTagger(path, batch_size=8, max_len=max_len)
  texts = [TEXT, "", "the city", TEXT + " " + TEXT]
  spans = tagger.tag_batch(texts)
  words = word_spans(TEXT, WORDS)
  if forced == "B-LOC":       # every word is an entity of its own; washington is one word
    assert spans[0] == words
    assert spans[2] == [(0, 3), (4, 8)]
    assert spans[3] == words + [(s + len(TEXT) + 1, e + len(TEXT) + 1) for s, e in words]
  elif forced == "I-PER":     # one entity over the whole text, across windows
    assert spans[0] == [(0, len(TEXT))]
    assert spans[2] == [(0, 8)]
    assert spans[3] == [(0, 2 * len(TEXT) + 1)]
  else:
    assert spans == [[], [], [], []]
  assert spans[1] == []
  typed = tagger.tag_entities(["the city"])[0]
  assert [e.type for e in typed] == ({"B-LOC": ["LOC", "LOC"], "I-PER": ["PER"]}.get(forced, []))


def test_windows_do_not_change_the_pieces_a_model_sees_as_words(tmp_path):
  # With max_len 5 (3 pieces per window), "washington" (3 pieces) fills a window alone and
  # "john smith" is split between words only.
  path, _, _ = ner_checkpoint(tmp_path / "ner", forced="B-PER")
  tagger = NerTagger(path, batch_size=8, max_len=5)
  ids, _ = tagger.tokenizer.encode_batch(["washington john"])[0]
  assert tagger.tokenizer.tokens(ids) == ["wash", "##ing", "##ton", "john"]
  assert tagger.tag_batch(["washington john"]) == [[(0, 10), (11, 15)]]


def test_cased_vocab_from_tokenizer_config(tmp_path):
  cased = VOCAB + ["John", "Smith"]
  path, _, _ = ner_checkpoint(tmp_path / "cased", tokenizer_config={"do_lower_case": False},
                              vocab=cased)
  tokenizer = NerTagger(path, batch_size=8).tokenizer
  ids, _ = tokenizer.encode_batch(["John Smith"])[0]
  assert tokenizer.tokens(ids) == ["John", "Smith"]
  path, _, _ = ner_checkpoint(tmp_path / "uncased", vocab=cased)
  ids, _ = NerTagger(path, batch_size=8).tokenizer.encode_batch(["John Smith"])[0]
  assert NerTagger(path, batch_size=8).tokenizer.tokens(ids) == ["john", "smith"]


def test_strip_accents_from_tokenizer_config(tmp_path):
  """HF's BertTokenizer: strip_accents unset follows do_lower_case; set, it decides."""
  vocab = VOCAB + ["cafe", "café"]
  pieces = {}
  for name, settings in (("default", {}), ("kept", {"strip_accents": False}),
                         ("cased_stripped", {"do_lower_case": False, "strip_accents": True})):
    path, _, _ = ner_checkpoint(tmp_path / name, tokenizer_config=settings, vocab=vocab)
    tokenizer = NerTagger(path, batch_size=8).tokenizer
    pieces[name] = tokenizer.tokens(tokenizer.encode_batch(["Café"])[0][0])
  assert pieces == {"default": ["cafe"], "kept": ["café"], "cased_stripped": ["[UNK]"]}


def test_bad_checkpoints_are_named(tmp_path):
  path, weights, config = ner_checkpoint(tmp_path / "ner")
  assert NerTagger(path, max_len=100).max_len == 64     # the checkpoint's positions
  with pytest.raises(ConfigError, match="max_len 2 < 3"):
    NerTagger(path, max_len=2)
  config.pop("id2label")
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ConfigError, match="no id2label"):
    NerTagger(path)
  path, _, _ = ner_checkpoint(tmp_path / "bad")
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin"):
    NerTagger(path)


def test_a_damaged_tokenizer_config_is_one_error_naming_it(tmp_path):
  """realm-prepare with hf_ner:PATH printed a JSONDecodeError's traceback."""
  from realm_jax.errors import DataError
  path, _, _ = ner_checkpoint(tmp_path / "ner", tokenizer_config={})
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    f.write('{"do_lower_case": fals')
  with pytest.raises(DataError, match=f"{path}/tokenizer_config.json: not valid JSON"):
    NerTagger(path, batch_size=8)

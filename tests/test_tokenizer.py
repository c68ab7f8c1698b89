"""The WordPiece vocab trainer: the same texts give the same vocab in any process, and the
vocab splits text as a BERT vocab trained the usual way does."""

import os
import subprocess
import sys

from tokenizers import BertWordPieceTokenizer

from realm_jax.data.tokenizer import SPECIAL_TOKENS, train_tokenizer, wordpiece_vocab
from tests.helpers import REPO

TEXTS = [f"The river {name} flows through {city} and empties into the {sea} Sea."
         for name, city, sea in [("Danube", "Vienna", "Black"), ("Rhine", "Basel", "North"),
                                 ("Elbe", "Dresden", "North"), ("Oder", "Wroclaw", "Baltic"),
                                 ("Volga", "Kazan", "Caspian"), ("Dnieper", "Kyiv", "Black")]]
TEXTS += [f"Prize number {i} went to the physicist {chr(65 + i % 26)}ouri{i % 7} in {1900 + i}."
          for i in range(60)]
VOCAB_IN_A_PROCESS = (
    "import sys; from realm_jax.data.tokenizer import wordpiece_vocab; "
    "from tests.test_tokenizer import TEXTS; print('\\n'.join(wordpiece_vocab(TEXTS, 150)))")


def test_the_vocab_is_the_same_in_every_process():
  vocabs = []
  for hash_seed in ("1", "2", "3"):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run([sys.executable, "-c", VOCAB_IN_A_PROCESS], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout
    vocabs.append(out.split())
  assert vocabs[0] == vocabs[1] == vocabs[2]
  assert vocabs[0] == wordpiece_vocab(TEXTS, 150)
  assert len(vocabs[0]) == 150


def test_the_vocab_holds_specials_alphabet_and_frequent_words():
  vocab = wordpiece_vocab(TEXTS, 150)
  assert tuple(vocab[:len(SPECIAL_TOKENS)]) == SPECIAL_TOKENS
  assert len(set(vocab)) == len(vocab)
  for piece in ("t", "##e", "1", "##9"):   # every character, word-initial and continuing
    assert piece in vocab
  for word in ("the", "river", "prize", "physicist"):   # frequent words merge to one piece
    assert word in vocab


def test_the_vocab_splits_text_as_the_tokenizers_trainer_does(tmp_path):
  """Same pieces per text within 3% as HF's (hash-ordered) trainer at the same size."""
  ours = train_tokenizer(TEXTS, str(tmp_path), 150)
  hf = BertWordPieceTokenizer(lowercase=True, strip_accents=True)
  hf.train_from_iterator(TEXTS, vocab_size=150, min_frequency=1,
                         special_tokens=list(SPECIAL_TOKENS), show_progress=False)
  n_ours = sum(len(ids) for ids, _ in ours.encode_batch(TEXTS))
  n_hf = sum(len(e.ids) for e in hf.encode_batch(TEXTS, add_special_tokens=False))
  assert abs(n_ours - n_hf) <= 0.03 * n_hf, (n_ours, n_hf)
  assert ours.unk_id not in {i for ids, _ in ours.encode_batch(TEXTS) for i in ids}


def test_text_never_gives_padding(tmp_path):
  """A literal [PAD] in a text (a question, a block) is [UNK], not id 0: padding marks where
  a row ends; the other special tokens keep their ids, as HF's tokenizer gives them."""
  ours = train_tokenizer(TEXTS, str(tmp_path), 150)
  (ids, offsets), = ours.encode_batch(["the [PAD] river [SEP]"])
  assert ours.pad_id not in ids and ours.unk_id in ids and ids[-1] == ours.sep_id
  assert len(offsets) == len(ids)


def test_wordpiece_training_says_how_it_goes():
  """A vocab trained on 100,000 documents takes tens of minutes: its progress is said."""
  said = []
  quiet = wordpiece_vocab(["the cat sat on the mat"] * 3, 40)
  loud = wordpiece_vocab(["the cat sat on the mat"] * 3, 40, said.append, 0.0)
  assert loud == quiet                                  # the same vocab, only said
  counted = [i for i, line in enumerate(said) if "distinct words counted" in line]
  assert said[counted[0]].startswith("5 distinct words counted"), said
  assert said[counted[0]].endswith("; merging"), said
  assert any(" of 40 entries (" in line for line in said[counted[0] + 1:]), said


def test_counting_the_words_says_how_it_goes():
  """The words of 100,000 documents take minutes to count before any merge: the count is
  said every `every` seconds too (before: the first line came after it), with its total."""
  said = []
  texts = ["the cat sat on the mat", "a dog", "the end"]
  assert wordpiece_vocab(texts, 40, said.append, 0.0) == wordpiece_vocab(texts, 40)
  counting = [line for line in said if "texts' words counted" in line]
  assert [line.split(" of ")[0] for line in counting] == ["1", "2"], said
  assert counting[0].startswith("1 of 3 texts' words counted ("), said

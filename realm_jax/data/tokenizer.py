"""BERT uncased WordPiece: load a `vocab.txt` (or an HF tokenizer dir), or train one on a corpus."""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable

from tokenizers import BertWordPieceTokenizer

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclasses.dataclass
class Tokenizer:
  """Thin wrapper over HF `tokenizers` with the special ids REALM needs."""

  wordpiece: BertWordPieceTokenizer
  vocab_path: str

  def __post_init__(self):
    ids = {t: self.wordpiece.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
      raise ValueError(f"{self.vocab_path}: vocabulary lacks special tokens {missing}")
    if ids["[PAD]"] != 0:
      raise ValueError(f"{self.vocab_path}: [PAD] must have id 0 (padding is id 0 throughout)")
    self.pad_id, self.unk_id = ids["[PAD]"], ids["[UNK]"]
    self.cls_id, self.sep_id, self.mask_id = ids["[CLS]"], ids["[SEP]"], ids["[MASK]"]

  @property
  def vocab_size(self) -> int:
    return self.wordpiece.get_vocab_size()

  def encode_batch(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Wordpiece ids and char offsets of each text, without [CLS]/[SEP]."""
    encodings = self.wordpiece.encode_batch(texts, add_special_tokens=False)
    return [(e.ids, e.offsets) for e in encodings]

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in ids if int(i) != self.pad_id]
    return self.wordpiece.decode(ids, skip_special_tokens=False)

  def tokens(self, ids: Iterable[int]) -> list[str]:
    return [self.wordpiece.id_to_token(int(i)) for i in ids]


def load_tokenizer(path: str, lowercase: bool = True) -> Tokenizer:
  """Loads `path` = a vocab.txt or a directory holding one (an HF tokenizer dir); a cased
  vocab (`lowercase=False`) also keeps accents, as HF's BertTokenizer does."""
  vocab = os.path.join(path, "vocab.txt") if os.path.isdir(path) else path
  if not os.path.exists(vocab):
    raise FileNotFoundError(f"no WordPiece vocabulary at {vocab}")
  return Tokenizer(BertWordPieceTokenizer(vocab, lowercase=lowercase, strip_accents=lowercase),
                   vocab)


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int) -> Tokenizer:
  """Trains an uncased WordPiece vocab on `texts` and saves `out_dir/vocab.txt`."""
  wordpiece = BertWordPieceTokenizer(lowercase=True, strip_accents=True)
  wordpiece.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=1,
                                special_tokens=list(SPECIAL_TOKENS), show_progress=False)
  os.makedirs(out_dir, exist_ok=True)
  wordpiece.save_model(out_dir)
  return load_tokenizer(os.path.join(out_dir, "vocab.txt"))

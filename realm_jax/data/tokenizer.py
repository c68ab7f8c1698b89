"""BERT uncased WordPiece: load a `vocab.txt` (or an HF tokenizer dir), or train one on a corpus."""

from __future__ import annotations

import collections
import dataclasses
import heapq
import os
import time
from typing import Iterable, Sequence, Sized

from tokenizers import BertWordPieceTokenizer, normalizers, pre_tokenizers

from realm_jax.errors import ConfigError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CONTINUE = "##"   # marks a wordpiece that continues a word


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
    """Wordpiece ids and char offsets of each text, without [CLS]/[SEP]. A literal "[PAD]" in
    a text is [UNK]: id 0 is padding throughout (a question's length counts its non-zero ids).
    The other special tokens written out ("[SEP]", "[MASK]") keep their ids, as HF's
    tokenizer gives them."""
    encodings = self.wordpiece.encode_batch(texts, add_special_tokens=False)
    pad, unk = self.pad_id, self.unk_id
    return [(e.ids if pad not in e.ids else [unk if i == pad else i for i in e.ids], e.offsets)
            for e in encodings]

  def decode(self, ids: Iterable[int]) -> str:
    ids = [int(i) for i in ids if int(i) != self.pad_id]
    return self.wordpiece.decode(ids, skip_special_tokens=False)

  def tokens(self, ids: Iterable[int]) -> list[str]:
    return [self.wordpiece.id_to_token(int(i)) for i in ids]

  def repeated_line(self) -> int | None:
    """The first line of vocab.txt whose token a later line repeats, None if none does: a
    token's id is its last line's, and the vocab size counts distinct tokens, so ids would
    then run past the size (a model sized by it embeds its last id as NaN)."""
    taken = set(self.wordpiece.get_vocab().values())
    gaps = set(range(max(taken) + 1)) - taken
    return min(gaps) + 1 if gaps else None


def word_starts(tokens: Sequence[str]) -> list[bool]:
  """Whether each wordpiece begins a word (continuations carry the `##` prefix)."""
  return [not t.startswith(CONTINUE) for t in tokens]


def windows(starts: Sequence[bool], size: int) -> list[tuple[int, int]]:
  """Consecutive [begin, end) piece ranges of at most `size` pieces, cut at word starts
  (mid-word only when one word alone is longer than `size`)."""
  out, begin, n = [], 0, len(starts)
  while begin < n:
    end = min(begin + size, n)
    if end < n:
      cut = next((i for i in range(end, begin, -1) if starts[i]), end)
      end = cut
    out.append((begin, end))
    begin = end
  return out


def load_tokenizer(path: str, lowercase: bool = True,
                   strip_accents: bool | None = None) -> Tokenizer:
  """Loads `path` = a vocab.txt or a directory holding one (an HF tokenizer dir); accents
  are stripped where `strip_accents` says, by default (None) where the vocab is lowercased,
  as HF's BertTokenizer does."""
  vocab = os.path.join(path, "vocab.txt") if os.path.isdir(path) else path
  if not os.path.exists(vocab):
    raise FileNotFoundError(f"no WordPiece vocabulary at {vocab}")
  strip = lowercase if strip_accents is None else bool(strip_accents)
  return Tokenizer(BertWordPieceTokenizer(vocab, lowercase=lowercase, strip_accents=strip),
                   vocab)


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int,
                    progress=None, every: float = 10.0) -> Tokenizer:
  """Trains an uncased WordPiece vocab on `texts` and saves `out_dir/vocab.txt`.

  The same texts always give the same vocab (`wordpiece_vocab`): the `tokenizers` trainer
  breaks ties between equally frequent merges in hash order, which differs run to run.
  `progress(line)`, if given, hears how the training goes every `every` seconds.
  """
  vocab = wordpiece_vocab(texts, vocab_size, progress, every)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, "vocab.txt")
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    f.writelines(token + "\n" for token in vocab)
  os.replace(path + ".tmp", path)
  return load_tokenizer(path)


def word_counts(texts: Iterable[str], progress=None, every: float = 10.0
                ) -> collections.Counter:
  """Words of `texts` as BERT uncased splits them (normalised, split on spaces and punctuation).
  `progress(line)`, if given, hears the texts counted every `every` seconds (but the last)."""
  normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                          strip_accents=True, lowercase=True)
  splitter = pre_tokenizers.BertPreTokenizer()
  counts = collections.Counter()
  total = f" of {len(texts):,}" if isinstance(texts, Sized) else ""
  t0 = last = time.time()
  for i, text in enumerate(texts):
    if progress is not None and i and time.time() - last >= every:
      last = time.time()
      progress(f"{i:,}{total} texts' words counted ({last - t0:.0f}s)")
    counts.update(w for w, _ in splitter.pre_tokenize_str(normalizer.normalize_str(text)))
  return counts


def wordpiece_vocab(texts: Iterable[str], vocab_size: int, progress=None,
                    every: float = 10.0) -> list[str]:
  """A WordPiece vocab learnt as BERT's is (BPE merges over words, "##" marking a piece that
  continues a word), deterministically: the most frequent pair is merged first, ties going
  to the lexicographically smallest pair. Returns the special tokens, the alphabet (sorted),
  then the merged pieces in merge order up to `vocab_size` entries; the special tokens and the
  whole alphabet are always there, so a `vocab_size` below their count is exceeded.
  `progress(line)`: the word count, then the entries made every `every` seconds."""
  t0 = last = time.time()
  counts = word_counts(texts, progress, every)
  if progress is not None:
    progress(f"{len(counts):,} distinct words counted ({time.time() - t0:.1f}s); merging")
  ordered = sorted(counts)
  words = [[w[0]] + [CONTINUE + c for c in w[1:]] for w in ordered]
  freqs = [counts[w] for w in ordered]
  vocab = list(SPECIAL_TOKENS) + sorted({p for w in words for p in w} - set(SPECIAL_TOKENS))
  known = set(vocab)
  pair_count: collections.Counter = collections.Counter()
  pair_words: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
  for i, pieces in enumerate(words):
    for pair in zip(pieces, pieces[1:]):
      pair_count[pair] += freqs[i]
      pair_words[pair].add(i)
  heap = [(-n, pair) for pair, n in pair_count.items()]
  heapq.heapify(heap)
  while len(vocab) < vocab_size and heap:
    if progress is not None and time.time() - last >= every:
      last = time.time()
      progress(f"{len(vocab):,} of {vocab_size:,} entries ({last - t0:.0f}s)")
    negative, pair = heapq.heappop(heap)
    if pair_count.get(pair, 0) != -negative or negative == 0:
      continue   # a stale entry: the pair's count changed since it was pushed
    merged = pair[0] + pair[1][len(CONTINUE):]
    if merged not in known:
      known.add(merged)
      vocab.append(merged)
    changed = set()
    for i in sorted(pair_words.pop(pair)):
      changed |= _merge_in_word(words, i, pair, merged, freqs[i], pair_count, pair_words)
    pair_count.pop(pair, None)
    for other in changed - {pair}:
      if pair_count.get(other, 0) > 0:
        heapq.heappush(heap, (-pair_count[other], other))
  return vocab


def _merge_in_word(words, i, pair, merged, freq, pair_count, pair_words) -> set:
  """Replaces each `pair` in `words[i]` by `merged`, keeping the pair counts; returns the pairs
  whose counts changed."""
  old = words[i]
  new, j = [], 0
  while j < len(old):
    if j + 1 < len(old) and (old[j], old[j + 1]) == pair:
      new.append(merged)
      j += 2
    else:
      new.append(old[j])
      j += 1
  changed = set()
  for p in zip(old, old[1:]):
    pair_count[p] -= freq
    changed.add(p)
  for p in set(zip(old, old[1:])) - {pair}:
    pair_words[p].discard(i)
  for p in zip(new, new[1:]):
    pair_count[p] += freq
    pair_words[p].add(i)
    changed.add(p)
  words[i] = new
  return changed


def check_uncased(src: str, option: str, shown: str) -> None:
  """Refuses a cased checkpoint's vocab (`src`, a checkpoint dir or its vocab.txt, whose
  tokenizer_config.json says do_lower_case false, or strip_accents false), naming `option`
  (= `shown`): the tokenizer here lowercases and strips accents, so the data's ids would not
  be the ones the checkpoint was trained on."""
  import json
  directory = src if os.path.isdir(src) else os.path.dirname(src)
  settings = os.path.join(directory, "tokenizer_config.json")
  if not os.path.isfile(settings):
    return
  try:
    with open(settings) as f:
      read = json.load(f)
    lower, strip = read.get("do_lower_case", True), read.get("strip_accents")
  except (OSError, ValueError, AttributeError) as e:
    raise ConfigError(option, f"{settings}: unreadable ({e})") from None
  if lower is False:
    raise ConfigError(option, f"{shown} is a cased checkpoint ({settings}: do_lower_case "
                      "false); the tokenizer here lowercases and strips accents, so the data's "
                      "ids would not be the checkpoint's: use an uncased one")
  if strip is False:
    raise ConfigError(option, f"{shown} keeps accents ({settings}: strip_accents false); the "
                      "tokenizer here strips them, so the data's ids would not be the "
                      "checkpoint's: use a checkpoint whose tokenizer strips them")

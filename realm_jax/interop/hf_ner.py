"""A named-entity tagger run in our Flax BERT from an HF BertForTokenClassification dir.

The dir holds config.json (with `id2label`), the weights (`bert.*` + `classifier.weight` /
`classifier.bias`, read by `hf_bert.read_weights`) and vocab.txt; `do_lower_case` comes from
tokenizer_config.json (default True). Each word takes the label of its first wordpiece; BIO
and IOB1 labels (and BIOES / BILOU ends) decode to character spans. Texts longer than
`max_len - 2` wordpieces are tagged in consecutive windows cut at word starts.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.data.tokenizer import load_tokenizer, windows, word_starts
from realm_jax.errors import ConfigError
from realm_jax.interop import hf_bert
from realm_jax.models.bert import BertConfig, BertEncoder
from realm_jax.runtime import partitioning

OPTION = "tagger"
BUCKETS = (16, 32, 64, 128, 256, 512)   # padded lengths (capped at max_len): few recompiles


class Entity(NamedTuple):
  """An entity's characters [start, end) and its type (`PER`, `LOC`, ...)."""
  start: int
  end: int
  type: str


def decode_entities(labels: Sequence[str], words: Sequence[tuple[int, int]]) -> list[Entity]:
  """Entity spans from one label per word (`words`: the words' [start, end) characters).

  `B-X` starts an entity; `I-X` continues an X entity, or starts one after `O` or another type
  (IOB1, as in CoNLL); `E-X`/`L-X` end one, `S-X`/`U-X` are single-word entities; a bare `X`
  reads as `I-X`. A span runs from its first word's start to its last word's end.
  """
  entities: list[Entity] = []
  current: list | None = None       # [start, end, type] of the open entity

  def close():
    nonlocal current
    if current is not None:
      entities.append(Entity(*current))
    current = None

  for label, (start, end) in zip(labels, words):
    tag, _, kind = label.partition("-") if "-" in label else ("I", "", label)
    if label == "O" or not kind:
      close()
      continue
    if tag in ("B", "S", "U") or current is None or current[2] != kind:
      close()
      current = [start, end, kind]
    else:
      current[1] = end
    if tag in ("S", "U", "E", "L"):
      close()
  close()
  return entities


def word_labels(tokens: Sequence[str], offsets: Sequence[tuple[int, int]],
                piece_labels: Sequence[str]) -> tuple[list[tuple[int, int]], list[str]]:
  """Words ([start, end) characters) of a text's wordpieces, each with its first piece's label."""
  words, labels = [], []
  for token, (start, end), label in zip(tokens, offsets, piece_labels):
    if token.startswith("##") and words:
      words[-1] = (words[-1][0], end)
    else:
      words.append((start, end))
      labels.append(label)
  return words, labels


class TokenClassifier(nn.Module):
  """BertForTokenClassification: BERT (no pooler) -> dense to the label logits."""

  cfg: BertConfig
  num_labels: int

  @nn.compact
  def __call__(self, token_ids, segment_ids):
    hidden, _ = BertEncoder(self.cfg, add_pooler=False, name="bert")(token_ids, segment_ids)
    return nn.Dense(self.num_labels, dtype=self.cfg.dtype, name="classifier")(hidden).astype(
        jnp.float32)


def _read_json(file: str) -> dict:
  """`file`'s JSON object, {} without the file (damaged: a DataError naming it)."""
  return hf_bert.read_config_json(file) if os.path.isfile(file) else {}


class NerTagger:
  """Entity spans of texts from a saved token-classification BERT (see the module doc).

  The forward pass is jitted once per padded length, its batch sharded over all local devices.
  """

  def __init__(self, path: str, batch_size: int = 64, max_len: int = 128):
    """`max_len`: wordpieces per window, [CLS] and [SEP] included (at most the checkpoint's
    max_position_embeddings); `batch_size` is rounded up to a multiple of the devices."""
    hf = hf_bert.read_config(path)
    if "id2label" not in hf:
      raise ConfigError(OPTION, f"{path}/config.json has no id2label: not a token "
                        "classification model")
    self.labels = [hf["id2label"][str(i)] for i in range(len(hf["id2label"]))]
    problems = hf_bert.unsupported_settings(hf, os.path.join(path, "config.json"),
                                            hidden_acts=hf_bert.HIDDEN_ACTS)
    max_len = min(max_len, hf["max_position_embeddings"])
    if max_len < 3:
      problems.append(f"max_len {max_len} < 3 (room for [CLS], a piece and [SEP])")
    if problems:
      raise ConfigError(OPTION, f"{path} cannot be run by our BERT: " + "; ".join(problems))
    settings = _read_json(os.path.join(path, "tokenizer_config.json"))
    self.tokenizer = load_tokenizer(path, lowercase=bool(settings.get("do_lower_case", True)),
                                    strip_accents=settings.get("strip_accents"))
    if self.tokenizer.vocab_size > hf["vocab_size"]:
      raise ConfigError(OPTION, f"{path}/vocab.txt has {self.tokenizer.vocab_size} entries, "
                        f"more than the model's vocab_size {hf['vocab_size']}")
    self.max_len = max_len
    self.buckets = sorted({b for b in BUCKETS if b < max_len} | {max_len})
    self.mesh = partitioning.make_mesh((-1, 1), jax.local_devices())
    n = self.mesh.shape["data"]
    self.batch_size = -(-batch_size // n) * n
    cfg = BertConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                     hidden_act=hf["hidden_act"],
                     num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                     intermediate_size=hf["intermediate_size"],
                     max_position=hf["max_position_embeddings"],
                     type_vocab_size=hf["type_vocab_size"], dropout_rate=0.0,
                     layer_norm_eps=hf["layer_norm_eps"])
    self.model = TokenClassifier(cfg, len(self.labels))
    self.params = jax.device_put(self._load(path), partitioning.replicated(self.mesh))
    batch = partitioning.batch_sharding(self.mesh)
    self._forward = jax.jit(lambda p, ids: self.model.apply({"params": p}, ids, ids * 0),
                            in_shardings=(partitioning.replicated(self.mesh), batch),
                            out_shardings=batch)

  def _load(self, path: str) -> dict:
    ids = jnp.zeros((1, 4), jnp.int32)
    abstract = jax.eval_shape(lambda: self.model.init(jax.random.PRNGKey(0), ids, ids))
    abstract = nn.meta.unbox(abstract["params"])
    tensors, file = hf_bert.read_weights(path)
    conv = hf_bert.Conversion(tensors, file)
    params = {"bert": conv.bert(abstract["bert"], "bert"), "classifier": {}}
    for leaf, ours in abstract["classifier"].items():
      name = f"classifier.{'weight' if leaf == 'kernel' else 'bias'}"
      if name not in tensors:
        conv.missing[name] = "missing"
      else:
        params["classifier"][leaf] = conv.value(name, leaf, ours, f"classifier/{leaf}")
    conv.raise_errors(OPTION, path)
    return params

  def logits(self, token_ids: np.ndarray) -> np.ndarray:
    """Label logits [n, length, labels] of padded `[CLS] ... [SEP]` rows (id 0 = padding)."""
    token_ids = np.asarray(token_ids, np.int32)
    out = []
    for begin in range(0, len(token_ids), self.batch_size):
      rows = token_ids[begin:begin + self.batch_size]
      padded = np.zeros((self.batch_size, token_ids.shape[1]), np.int32)
      padded[:len(rows)] = rows
      out.append(np.asarray(self._forward(self.params, padded))[:len(rows)])
    if not out:
      return np.zeros((0, token_ids.shape[1], len(self.labels)), np.float32)
    return np.concatenate(out)

  def tag_entities(self, texts: list[str]) -> list[list[Entity]]:
    """Typed entity spans of each text."""
    encoded = self.tokenizer.encode_batch(list(texts))
    tokens = [self.tokenizer.tokens(ids) for ids, _ in encoded]
    rows, owners = [], []          # one row per window: its pieces and (text, first piece)
    for t, (ids, _) in enumerate(encoded):
      for begin, end in windows(word_starts(tokens[t]), self.max_len - 2):
        rows.append([self.tokenizer.cls_id, *ids[begin:end], self.tokenizer.sep_id])
        owners.append((t, begin))
    piece_labels = [np.zeros(len(ids), np.int64) for ids, _ in encoded]
    order = sorted(range(len(rows)), key=lambda r: len(rows[r]))
    for chunk in range(0, len(order), self.batch_size):
      members = order[chunk:chunk + self.batch_size]
      longest = max(len(rows[r]) for r in members)
      length = next(b for b in self.buckets if b >= longest)
      ids = np.zeros((len(members), length), np.int32)
      for i, r in enumerate(members):
        ids[i, :len(rows[r])] = rows[r]
      best = self.logits(ids).argmax(-1)
      for i, r in enumerate(members):
        t, begin = owners[r]
        n = len(rows[r]) - 2
        piece_labels[t][begin:begin + n] = best[i, 1:n + 1]
    out = []
    for toks, (_, offsets), labels in zip(tokens, encoded, piece_labels):
      words, word_tags = word_labels(toks, offsets, [self.labels[int(i)] for i in labels])
      out.append(decode_entities(word_tags, words))
    return out

  def tag_batch(self, texts: list[str]) -> list[list[tuple[int, int]]]:
    """Entity character spans [start, end) of each text."""
    return [[(e.start, e.end) for e in ents] for ents in self.tag_entities(texts)]

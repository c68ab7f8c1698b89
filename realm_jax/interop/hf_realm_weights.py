"""Hugging Face REALM checkpoints read into our parameters: which layout a checkpoint is (from its
config.json), what our model cannot express, and every HF key -> our parameter (`convert`, with
the report of what came from where). No workdir, no model built: `realm-import-hf`
(interop/hf_realm.py) and `init.*` (runtime/initialization.py) both read checkpoints through it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

import numpy as np

from realm_jax.errors import ConfigError
from realm_jax.interop import hf_bert

REALM_ARCHITECTURES = ("RealmEmbedder", "RealmKnowledgeAugEncoder", "RealmReader",
                       "RealmForOpenQA")
# HF RealmConfig's defaults (transformers 4.x), for keys a config.json leaves out.
REALM_DEFAULTS = {**hf_bert.HF_DEFAULTS, "hidden_act": "gelu_new", "retriever_proj_size": 128,
                  "num_candidates": 8, "span_hidden_size": 256, "max_span_width": 10,
                  "reader_layer_norm_eps": 1e-3, "reader_beam_size": 5, "reader_seq_len": 320,
                  "num_block_records": 13353718, "searcher_beam_size": 5000,
                  "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                  "initializer_range": 0.02}
# RealmConfig keys read as numbers, beside BERT's (hf_bert._TYPED_KEYS), and their types.
_TYPED_KEYS = {**hf_bert._TYPED_KEYS,
               **{key: int for key in ("retriever_proj_size", "num_candidates",
                                       "span_hidden_size", "max_span_width", "reader_beam_size",
                                       "reader_seq_len", "searcher_beam_size")},
               "reader_layer_norm_eps": float}
_LEAF = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}


# -- the layout ---------------------------------------------------------------------------
def read_hf_config(hf_dir: str) -> tuple[str, dict]:
  """(layout, config with the defaults of its model type) of the checkpoint dir `hf_dir`.

  The layout is "bert" or one of REALM_ARCHITECTURES. An unknown model type, or a REALM
  config naming none of the four architectures, is a ConfigError naming the dir.
  """
  file = os.path.join(hf_dir, "config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"{hf_dir} has no config.json (not a Hugging Face checkpoint dir)")
  raw = hf_bert.read_config_json(file)
  model_type = raw.get("model_type")
  if model_type == "bert":
    return "bert", hf_bert.checked_config({**hf_bert.HF_DEFAULTS, **raw}, file)
  if model_type != "realm":
    raise ConfigError("", f"{hf_dir}: model_type {model_type!r} in config.json is not supported "
                      "(expected 'realm' or 'bert'" + ("; an older BERT dir may lack it: "
                      "add \"model_type\": \"bert\")" if model_type is None else ")"))
  architectures = raw.get("architectures") or []
  found = [a for a in architectures if a in REALM_ARCHITECTURES]
  if len(found) != 1:
    raise ConfigError("", f"{hf_dir}: config.json architectures {architectures} name "
                      f"{'none' if not found else 'more than one'} of "
                      f"{', '.join(REALM_ARCHITECTURES)}; cannot tell which REALM model "
                      "the weights are")
  return found[0], hf_bert.checked_config({**REALM_DEFAULTS, **raw}, file, _TYPED_KEYS)


def unsupported(hf: Mapping, source: str, layout: str) -> list[str]:
  """What our model cannot reproduce: BERT settings (an activation other than erf / tanh GELU,
  LayerNorm eps, positions, token types, heads) and, for RealmForOpenQA (the one layout whose
  reader reads reader_seq_len), a reader input longer than the position table."""
  lines = hf_bert.unsupported_settings(hf, source, hidden_acts=hf_bert.HIDDEN_ACTS)
  if hf["type_vocab_size"] != hf_bert.OUR_TYPE_VOCAB:
    lines.append(f"type_vocab_size: {hf['type_vocab_size']} ({source}) != "
                 f"{hf_bert.OUR_TYPE_VOCAB} (our BERT)")
  if hf["hidden_size"] % hf["num_attention_heads"]:
    lines.append(f"num_attention_heads: {hf['num_attention_heads']} does not divide hidden_size "
                 f"{hf['hidden_size']} ({source})")
  if layout == "RealmForOpenQA" and hf["reader_seq_len"] > hf["max_position_embeddings"]:
    lines.append(f"reader_seq_len: {hf['reader_seq_len']} > max_position_embeddings "
                 f"{hf['max_position_embeddings']} ({source})")
  return lines


POOLING_RECORD = os.path.join("1_Pooling", "config.json")   # a sentence-transformers dir's
# The REALM layouts whose retriever weights embed [CLS] through the pooler (HF's RealmEmbedder).
CLS_EMBEDDERS = ("RealmEmbedder", "RealmForOpenQA")


def sentence_pooling(hf_dir: str) -> tuple[str | None, list[str]]:
  """The pooling of a sentence-transformers model in `hf_dir`: ("mean" or "cls" where its
  pooling record names one of those, mean first, else None), and the other modes it names,
  which the retriever does not have (max, weighted mean, ...; [CLS] beside mean: the model
  embeds each mode's vector concatenated). (None, []) without a record: a plain BERT, whose
  retriever keeps the default, [CLS]."""
  path = os.path.join(hf_dir, POOLING_RECORD)
  if not os.path.exists(path):
    return None, []
  record = hf_bert.read_config_json(path)   # damaged: a DataError naming it
  named = [key[len("pooling_mode_"):] for key, on in record.items()
           if key.startswith("pooling_mode_") and on is True]
  pooling = "mean" if "mean_tokens" in named else "cls" if "cls_token" in named else None
  used = {"mean": "mean_tokens", "cls": "cls_token"}.get(pooling)
  return pooling, [mode for mode in named if mode != used]


def trained_pooling(hf_dir: str, layout: str) -> tuple[str | None, str]:
  """(the pooling the checkpoint's retriever weights were trained under, where that is said):
  a sentence-transformers record's, [CLS] for REALM's embedder; (None, "") where nothing says
  (a plain BERT: either pooling may start from it)."""
  if layout in CLS_EMBEDDERS:
    return "cls", f"{os.path.join(hf_dir, 'config.json')}: {layout}"
  if layout == "bert":
    pooling, _ = sentence_pooling(hf_dir)
    return pooling, os.path.join(hf_dir, POOLING_RECORD) if pooling else ""
  return None, ""


# -- our names <-> HF keys ----------------------------------------------------------------
def _flat(tree: Mapping, prefix: str = "") -> dict:
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    out.update(_flat(value, name + "/") if isinstance(value, Mapping) else {name: value})
  return out


def _sub(tree: Mapping, path: str):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def _head_names(params: Mapping, ours: str, hf_prefix: str) -> dict[str, str]:
  """Dense / LayerNorm leaves under `ours` -> `hf_prefix<module>.<weight|bias>`."""
  out = {}
  for name in _flat(_sub(params, ours)):
    *module, leaf = name.split("/")
    out[f"{ours}/{name}"] = hf_prefix + ".".join(module + [_LEAF[leaf]])
  return out


def realm_key_map(params: Mapping, layout: str) -> dict[str, str]:
  """Our flat parameter path -> its HF key, for the parameters `layout` holds."""
  from realm_jax.models.bert import hf_parameter_names
  names: dict[str, str] = {}

  def bert(ours: str, hf_prefix: str):
    names.update({f"{ours}/{k}": v for k, v in
                  hf_parameter_names(_sub(params, ours), prefix=hf_prefix).items()})

  def embedder(ours: str, hf_prefix: str):
    bert(f"{ours}/bert", hf_prefix + "realm.")
    for module, hf_module in (("projection", "cls.dense."), ("projection_norm", "cls.LayerNorm.")):
      for leaf, hf_leaf in _head_names(params, f"{ours}/{module}", "").items():
        names[leaf] = hf_prefix + hf_module + hf_leaf

  def reader(hf_prefix: str, span_head: bool):
    bert("reader/bert", hf_prefix + "realm.")
    names.update({f"reader/cls/{k}": hf_prefix + v
                  for k, v in hf_bert._mlm_head_names(params["reader"]["cls"]).items()})
    if span_head and "qa_outputs" in params["reader"]:
      names.update(_head_names(params, "reader/qa_outputs", hf_prefix + "qa_outputs."))

  retriever = params["retriever"]
  if layout == "RealmEmbedder":   # one BERT embeds queries and blocks: every tower from it
    for tower in ("tower",) if "tower" in retriever else ("query_tower", "block_tower"):
      embedder(f"retriever/{tower}", "")
  elif layout == "RealmKnowledgeAugEncoder":
    reader("", span_head=False)
  elif layout == "RealmReader":
    reader("", span_head=True)
  elif layout == "RealmForOpenQA":
    embedder("retriever/tower" if "tower" in retriever else "retriever/query_tower", "embedder.")
    reader("reader.", span_head=True)
  else:
    raise ValueError(f"no REALM key map for layout {layout!r}")
  return names


# -- the report ---------------------------------------------------------------------------
@dataclasses.dataclass
class ImportReport:
  """Which of our parameters came from which HF key, which were initialised, and the rest."""

  source: str
  layout: str
  from_hf: dict[str, str]            # our flat path -> HF key
  initialised: list[str]             # our flat paths left as the model initialises them
  unused: list[str]                  # float tensors of the checkpoint no parameter took
  notes: list[str]
  index: dict | None = None          # Open-QA: the published index's manifest fields
  block_store: dict | None = None    # Open-QA: the block store's stats

  @staticmethod
  def _group(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[:3 if parts[0] == "retriever" else 2])

  def lines(self) -> list[str]:
    out = [f"realm-import-hf: {self.layout} from {self.source}"]
    groups: dict[str, list[str]] = {}
    for ours, hf in self.from_hf.items():
      groups.setdefault(self._group(ours), []).append(hf)
    for group, keys in sorted(groups.items()):
      prefix = os.path.commonprefix(keys)   # cut back to a whole dotted name
      named = keys[0] if len(keys) == 1 else prefix[:prefix.rfind(".") + 1] + "*"
      out.append(f"  {group}: {len(keys)} params <- {named}")
    init: dict[str, int] = {}
    for path in self.initialised:
      init[self._group(path)] = init.get(self._group(path), 0) + 1
    out += [f"  {group}: {n} params initialised (not in the checkpoint)"
            for group, n in sorted(init.items())]
    out += [f"  note: {x}" for x in self.notes]
    if self.unused:
      shown = ", ".join(self.unused[:6]) + (", ..." if len(self.unused) > 6 else "")
      out.append(f"  {len(self.unused)} checkpoint tensors not used: {shown}")
    if self.block_store:
      s = self.block_store
      out.append(f"  block store: {s['blocks']:,} records -> blocks of {s['block_len']} "
                 f"wordpieces ({s['records_cut']:,} records cut to fit)")
    if self.index:
      out.append(f"  index: version {self.index['version']} ({self.index['backend']}, "
                 f"{self.index['num_blocks']:,} x {self.index['dim']}) at {self.index['dir']}")
    return out

  def __str__(self) -> str:
    return "\n".join(self.lines())

  def to_json(self) -> dict:
    return {"source": self.source, "layout": self.layout,
            "params": {**self.from_hf, **{p: "initialised" for p in self.initialised}},
            "unused": self.unused, "notes": self.notes, "index": self.index,
            "block_store": self.block_store}


# -- conversion ---------------------------------------------------------------------------
def convert(params: Mapping, tensors: dict[str, np.ndarray], layout: str, source: str,
            hf_dir: str, only: str = "", option: str = "") -> tuple[dict, ImportReport]:
  """`params` (our initialised tree) with every leaf the checkpoint holds replaced (with
  `only`, a top-level part such as "retriever", the leaves of that part alone).

  Raises ConfigError for a weight the layout must hold that is missing, and for every shape
  mismatch. The MLM decoder is tied to the word embeddings in our model: an untied one is
  noted and not used.
  """
  conv = hf_bert.Conversion(tensors, source)
  names = {ours: hf for ours, hf in realm_key_map(params, layout).items()
           if not only or ours.startswith(only + "/")}
  flat = _flat(params)
  words = next(k for k in flat if k.startswith((only or "reader") + "/")
               and k.endswith("bert/embeddings/word_embeddings/embedding"))
  conv.our_hidden = flat[words].shape[-1]
  new, from_hf = {}, {}
  for ours, hf in names.items():
    if hf not in tensors:
      conv.missing.setdefault(hf, "missing")
      continue
    value = conv.value(hf, ours.rsplit("/", 1)[-1], flat[ours], ours)
    if value is not None:
      new[ours], from_hf[ours] = value, hf
  for prefix in sorted({hf[:hf.index("cls.predictions.") + len("cls.predictions.")]
                        for hf in names.values() if "cls.predictions." in hf}):
    _check_tied_decoder(conv, prefix, prefix.replace("cls.predictions.",
                                                     "realm.embeddings.word_embeddings.weight"))
  conv.raise_errors(option, hf_dir)
  out = hf_bert._replaced(params, new)
  initialised = sorted(p for p in flat if p not in from_hf
                       and (not only or p.startswith(only + "/")))
  unused = conv.unused()
  conv.notes.extend(_layers_left(tensors, set(from_hf.values())))
  embedder_head = {"RealmEmbedder": "cls.predictions.",
                   "RealmForOpenQA": "embedder.cls.predictions."}.get(layout)
  if embedder_head and any(n.startswith(embedder_head) for n in unused):
    conv.notes.append(f"{embedder_head}* (an LM head inside HF's RealmScorerProjection) is not "
                      "part of the embedder's forward: not used")
  report = ImportReport(source, layout, from_hf, initialised, unused, conv.notes)
  return out, report


def _layers_left(tensors: Mapping, used: set[str]) -> list[str]:
  """A note per encoder whose checkpoint has more layers than our model read (the first N of
  them are read, as from a plain BERT)."""
  layers: dict[str, set[int]] = {}
  read: dict[str, set[int]] = {}
  for name in tensors:
    if match := re.match(r"(.*encoder\.layer\.)(\d+)\.", name):
      layers.setdefault(match.group(1), set()).add(int(match.group(2)))
      if name in used:
        read.setdefault(match.group(1), set()).add(int(match.group(2)))
  return [f"layers of {prefix[:-len('.layer.')]}: the first {len(read[prefix])} of the "
          f"checkpoint's {len(found)}" for prefix, found in sorted(layers.items())
          if prefix in read and len(read[prefix]) < len(found)]


def _check_tied_decoder(conv, prefix: str, words_key: str) -> None:
  decoder, words = conv.tensors.get(prefix + "decoder.weight"), conv.tensors.get(words_key)
  if prefix + "decoder.bias" in conv.tensors:     # HF ties it to cls.predictions.bias
    conv.used.add(prefix + "decoder.bias")
  if decoder is None:
    return
  conv.used.add(prefix + "decoder.weight")
  if words is not None and (decoder.shape != words.shape or not np.array_equal(decoder, words)):
    conv.notes.append(f"{prefix}decoder.weight differs from {words_key}: our MLM decoder is "
                      "tied to the word embeddings, so it is not used")


def bert_report(params: Mapping, bert_report, tensors: Mapping) -> ImportReport:
  """The plain-BERT import (hf_bert.load_bert_towers) in this module's report form."""
  from realm_jax.models.bert import hf_parameter_names
  flat = _flat(params)
  from_hf = {}
  for tower in bert_report.loaded:
    sub = _sub(params, tower)
    names = (hf_parameter_names(sub) if tower.endswith("/bert")
             else hf_bert._mlm_head_names(sub))
    from_hf.update({f"{tower}/{k}": v for k, v in names.items() if v in tensors})
  initialised = sorted(p for p in flat if p not in from_hf)
  return ImportReport(bert_report.source, "bert", from_hf, initialised, bert_report.unused,
                      list(bert_report.notes))

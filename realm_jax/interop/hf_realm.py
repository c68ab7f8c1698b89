"""`realm-import-hf --hf-dir D --out W2`: a Hugging Face REALM (or BERT) checkpoint -> a workdir.

Layouts, told apart by D/config.json (`model_type`, `architectures`); HF key -> our params:

  RealmEmbedder             realm.*            -> retriever/tower/bert (one tower serves query
                            cls.dense/LayerNorm -> retriever/tower/projection(_norm)  and block,
                                                   as HF's RealmScorer uses it: share_towers)
  RealmKnowledgeAugEncoder  realm.*            -> reader/bert;  cls.predictions.* -> reader/cls
  RealmReader               realm.*, cls.predictions.* as above; qa_outputs.* -> reader/qa_outputs
  RealmForOpenQA            embedder.{realm,cls}.* -> retriever/query_tower/...
                            reader.{realm,cls,qa_outputs}.* -> reader/...
                            block_emb + block_records.npy -> W2/data (a prepared block store)
                              and W2/index/<v> (a published `exact` index of block_emb)
  bert (model_type bert)    every BERT tower, and reader/cls if it has an MLM head
                            (`hf_bert.load_bert_towers`)

W2 gets config.json (a full realm_jax config with the checkpoint's model shape and activation;
task realm, or openqa for RealmReader / RealmForOpenQA, `--task` to choose), an Orbax
checkpoint W2/checkpoints/0 (item `params`, what `checkpoints.restore_params` and
`init.from_workdir=W2` read) and import_report.json (every parameter's HF key, or
"initialised"). Parameters the checkpoint lacks are initialised as the model does, and listed.
RealmForOpenQA's index is published as the builder would (`published.start_version`: version 1
in a new W2, built from step 0); a version 0 would never be picked up by the trainer's
IndexSubscriber.

The activation is carried over: HF RealmConfig's default `gelu_new` (the tanh GELU of the
released google/realm-* checkpoints) or BERT's erf `gelu` (see `bert.HIDDEN_ACTS`). What our
BERT cannot express (another activation, LayerNorm eps, ...) is refused with the reason.

`openqa_forward` is the ORQA prediction for one question (embed, retrieve, read, argmax over
block x span) that the parity check (`hf_parity`) compares against HF's RealmForOpenQA.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping

import numpy as np

from realm_jax import log, paths
from realm_jax.errors import ConfigError, DataError, run_cli
from realm_jax.interop import hf_bert

logger = logging.getLogger("realm_jax.interop.hf_realm")   # (__name__ is __main__ under python -m)

PROG = "realm-import-hf"
REALM_ARCHITECTURES = ("RealmEmbedder", "RealmKnowledgeAugEncoder", "RealmReader",
                       "RealmForOpenQA")
BLOCK_RECORDS = "block_records.npy"
# HF RealmConfig's defaults (transformers 4.x), for keys a config.json leaves out.
REALM_DEFAULTS = {**hf_bert.HF_DEFAULTS, "hidden_act": "gelu_new", "retriever_proj_size": 128,
                  "num_candidates": 8, "span_hidden_size": 256, "max_span_width": 10,
                  "reader_layer_norm_eps": 1e-3, "reader_beam_size": 5, "reader_seq_len": 320,
                  "num_block_records": 13353718, "searcher_beam_size": 5000,
                  "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
                  "initializer_range": 0.02}
# The stage each layout's checkpoint starts by default (`--task` overrides).
DEFAULT_TASK = {"bert": "realm", "RealmEmbedder": "realm", "RealmKnowledgeAugEncoder": "realm",
                "RealmReader": "openqa", "RealmForOpenQA": "openqa"}
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
  with open(file) as f:
    raw = json.load(f)
  model_type = raw.get("model_type")
  if model_type == "bert":
    return "bert", {**hf_bert.HF_DEFAULTS, **raw}
  if model_type != "realm":
    raise ConfigError("", f"{hf_dir}: model_type {model_type!r} in config.json is not supported "
                      "(expected 'realm' or 'bert')")
  architectures = raw.get("architectures") or []
  found = [a for a in architectures if a in REALM_ARCHITECTURES]
  if len(found) != 1:
    raise ConfigError("", f"{hf_dir}: config.json architectures {architectures} name "
                      f"{'none' if not found else 'more than one'} of "
                      f"{', '.join(REALM_ARCHITECTURES)}; cannot tell which REALM model "
                      "the weights are")
  return found[0], {**REALM_DEFAULTS, **raw}


def unsupported(hf: Mapping, source: str) -> list[str]:
  """What our model cannot reproduce: BERT settings (an activation other than erf / tanh GELU,
  LayerNorm eps, positions, token types, heads) and, for REALM, a reader input longer than the
  position table."""
  lines = hf_bert.unsupported_settings(hf, source, hidden_acts=hf_bert.HIDDEN_ACTS)
  if hf["type_vocab_size"] != hf_bert.OUR_TYPE_VOCAB:
    lines.append(f"type_vocab_size: {hf['type_vocab_size']} ({source}) != "
                 f"{hf_bert.OUR_TYPE_VOCAB} (our BERT)")
  if hf["hidden_size"] % hf["num_attention_heads"]:
    lines.append(f"num_attention_heads: {hf['num_attention_heads']} does not divide hidden_size "
                 f"{hf['hidden_size']} ({source})")
  if "reader_seq_len" in hf and hf["reader_seq_len"] > hf["max_position_embeddings"]:
    lines.append(f"reader_seq_len: {hf['reader_seq_len']} > max_position_embeddings "
                 f"{hf['max_position_embeddings']} ({source})")
  return lines


def make_config(layout: str, hf: Mapping, *, task: str | None = None, data_dir: str = "",
                block_len: int | None = None):
  """The realm_jax config of an import: base_config with the checkpoint's model shape and
  activation.

  Data lengths keep their defaults unless the checkpoint's positions are fewer (then they are
  scaled down to fit) or the layout fixes them (Open-QA: the block store's block_len, the rest
  of HF's reader_seq_len for the question).
  """
  from realm_jax.config.defaults import base_config
  from realm_jax.config.validation import validate
  c = base_config()
  c.task = task or DEFAULT_TASK[layout]
  m = c.model
  for field, key in hf_bert.SHAPE_FIELDS.items():
    m[field] = int(hf[key])
  m.hidden_act = str(hf["hidden_act"])
  m.dropout_rate = float(hf.get("hidden_dropout_prob", 0.1))
  attention_dropout = float(hf.get("attention_probs_dropout_prob", m.dropout_rate))
  m.attention_dropout_rate = -1.0 if attention_dropout == m.dropout_rate else attention_dropout
  m.initializer_range = float(hf.get("initializer_range", 0.02))
  if layout != "bert":
    m.retrieval_dim = int(hf["retriever_proj_size"])
    m.span_hidden_size = int(hf["span_hidden_size"])
    m.max_span_width = int(hf["max_span_width"])
    m.span_layer_norm_eps = float(hf["reader_layer_norm_eps"])
    m.share_towers = layout in ("RealmEmbedder", "RealmKnowledgeAugEncoder")
    c.qa.reader_beam = int(hf["reader_beam_size"])
    c.qa.searcher_beam = int(hf["searcher_beam_size"])
    c.retrieval.k = int(hf["num_candidates"])
  c.retrieval.backend = "exact"
  c.data.dir = data_dir
  d, max_position = c.data, m.max_position
  if block_len is not None:
    d.block_len = block_len
    d.query_len = max(16, min(int(hf.get("reader_seq_len", 320)), max_position) - block_len)
  elif d.query_len + d.block_len > max_position:
    d.query_len = max(16, max_position // 4)
    d.block_len = max_position - d.query_len
  shapes = c.copy_and_resolve_references()
  shapes.task = "realm"     # the checks of every stage; the task's data (questions) come later
  validate(shapes)
  return c


def init_params(config, model) -> dict:
  """Our parameters as the model initialises them (host NumPy), from config.seed."""
  import flax.linen as nn
  import jax
  from realm_jax.runtime import state as state_lib
  inputs = state_lib.dummy_inputs(config, config.data.block_len)
  params = jax.jit(lambda rng: nn.meta.unbox(model.init(rng, **inputs)["params"]))(
      jax.random.PRNGKey(config.seed))
  return jax.tree.map(np.asarray, params)


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
  if layout == "RealmEmbedder":
    embedder("retriever/tower" if "tower" in retriever else "retriever/query_tower", "")
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
    out = [f"{PROG}: {self.layout} from {self.source}"]
    groups: dict[str, list[str]] = {}
    for ours, hf in self.from_hf.items():
      groups.setdefault(self._group(ours), []).append(hf)
    for group, keys in sorted(groups.items()):
      prefix = os.path.commonprefix(keys)
      prefix = prefix[:prefix.rfind(".") + 1] if "." in prefix else prefix
      out.append(f"  {group}: {len(keys)} params <- {prefix}*")
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
  if "block_emb" in tensors:
    conv.used.add("block_emb")
  out = hf_bert._replaced(params, new)
  initialised = sorted(p for p in flat if p not in from_hf
                       and (not only or p.startswith(only + "/")))
  unused = conv.unused()
  embedder_head = {"RealmEmbedder": "cls.predictions.",
                   "RealmForOpenQA": "embedder.cls.predictions."}.get(layout)
  if embedder_head and any(n.startswith(embedder_head) for n in unused):
    conv.notes.append(f"{embedder_head}* (an LM head inside HF's RealmScorerProjection) is not "
                      "part of the embedder's forward: not used")
  report = ImportReport(source, layout, from_hf, initialised, unused, conv.notes)
  return out, report


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


# -- Open-QA evidence: block records -> block store + published index ---------------------
def load_block_records(path: str) -> np.ndarray:
  """HF's block_records.npy (an object array of UTF-8 bytes, i.e. a pickle) read with a
  restricted unpickler (NumPy arrays and bytes only); plain bytes/str arrays load directly."""
  from realm_jax.interop import torch_pickle
  with open(path, "rb") as f:
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
      raise DataError(f"{path}: .npy format version {version} is not read here")
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, _, dtype = read_header(f)
    if not dtype.hasobject:
      f.seek(0)
      return np.load(f)
    data = f.read()

  try:
    from numpy._core.multiarray import _reconstruct
  except ImportError:      # NumPy 1.x
    from numpy.core.multiarray import _reconstruct

  class _Records(torch_pickle.RestrictedUnpickler):
    allowed = {(module, "_reconstruct"): _reconstruct
               for module in ("numpy.core.multiarray", "numpy._core.multiarray")}
    allowed.update({("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype})

  records = _Records(data, path).load()
  if not isinstance(records, np.ndarray) or records.shape != shape:
    raise DataError(f"{path}: expected an array of shape {shape}, got {type(records).__name__}")
  return records


def write_block_store(records: np.ndarray, tokenizer, out_dir: str, max_block_len: int,
                      source: str) -> dict:
  """Block records -> a prepared data dir (`store.PreparedData` reads it): rows
  `[CLS] [SEP] body [SEP]` (empty titles), block_len = the longest record's + 3, at most
  `max_block_len` (longer records are cut, and counted). Returns the stats written."""
  from realm_jax.data.corpus import block_uid
  texts = [r.decode("utf-8") if isinstance(r, bytes) else str(r) for r in records.reshape(-1)]
  bodies = [ids for ids, _ in tokenizer.encode_batch(texts)]
  longest = max((len(b) for b in bodies), default=0)
  block_len = max(8, min(longest + 3, max_block_len))
  budget = block_len - 3
  n = len(bodies)
  tokens = np.zeros((n, block_len), np.int32)
  lengths = np.zeros(n, np.int32)
  uids = np.zeros(n, np.uint64)
  cut = 0
  for i, body in enumerate(bodies):
    cut += len(body) > budget
    body = body[:budget]
    row = [tokenizer.cls_id, tokenizer.sep_id, *body, tokenizer.sep_id]
    tokens[i, :len(row)] = row
    lengths[i] = len(row)
    uids[i] = block_uid([], body)
  blocks = os.path.join(out_dir, "blocks")
  os.makedirs(blocks, exist_ok=True)
  for name, value in (("tokens", tokens), ("lengths", lengths),
                      ("body_start", np.full(n, 2, np.int32)), ("uids", uids),
                      ("doc_ids", np.zeros(n, np.int32))):
    np.save(os.path.join(blocks, f"{name}.npy"), value)
  with open(os.path.join(blocks, "titles.json"), "w") as f:
    json.dump([""], f)
  shutil.copyfile(tokenizer.vocab_path, os.path.join(out_dir, "vocab.txt"))
  stats = {"source": source, "documents": 1, "blocks": n, "block_len": block_len,
           "max_block_wordpieces": int(lengths.max(initial=0)), "records_cut": int(cut),
           "longest_record_wordpieces": int(longest), "max_sentence_len": 0,
           "examples": {"train": 0, "eval": 0}, "vocab_size": tokenizer.vocab_size}
  with open(os.path.join(out_dir, "stats.json"), "w") as f:
    json.dump(stats, f, indent=2)
  return stats


def publish_index(workdir: str, block_emb: np.ndarray, query_params: dict, fingerprint: str,
                  source: str) -> dict:
  """block_emb as a published `exact` index version of `workdir` (the files and manifest the
  index builder writes, the query tower's params included), built from step 0."""
  from realm_jax.retrieval import published
  root = published.index_root(workdir)
  manifest = published.publish_arrays(root, block_emb, query_params, step=0,
                                      fingerprint=fingerprint, keep=1,
                                      timings={"build_seconds": 0.0},
                                      source=f"hf:{source} block_emb")
  return {**{k: manifest[k] for k in ("version", "num_blocks", "dim", "backend")},
          "dir": str(published.version_dir(root, manifest["version"]))}


# -- writing the workdir ------------------------------------------------------------------
def _import_block_records(hf_dir: str, hf: dict, tensors: dict, source: str, vocab: str,
                          data_dir: str) -> dict:
  """RealmForOpenQA's evidence blocks (block_records.npy, tokenised with `vocab`) as a block
  store in `data_dir`, after checking they match block_emb; returns the store's stats."""
  from realm_jax.data.tokenizer import load_tokenizer
  records_file = os.path.join(hf_dir, BLOCK_RECORDS)
  if not os.path.isfile(records_file):
    raise FileNotFoundError(f"{hf_dir} has no {BLOCK_RECORDS} (the evidence blocks of "
                            "RealmForOpenQA)")
  if "block_emb" not in tensors:
    raise ConfigError("", f"{source} has no block_emb (RealmForOpenQA's block embeddings)")
  tokenizer = load_tokenizer(vocab)
  if tokenizer.vocab_size != hf["vocab_size"]:
    raise ConfigError("", f"{vocab} has {tokenizer.vocab_size} tokens but {hf_dir}/config.json "
                      f"says vocab_size {hf['vocab_size']}: pass the checkpoint's vocab")
  records = load_block_records(records_file)
  if len(records) != tensors["block_emb"].shape[0]:
    raise ConfigError("", f"{records_file} has {len(records)} records but block_emb has "
                      f"{tensors['block_emb'].shape[0]} rows")
  reader_len = min(int(hf["reader_seq_len"]), int(hf["max_position_embeddings"]))
  return write_block_store(records, tokenizer, data_dir, reader_len, f"hf:{records_file}")


def import_checkpoint(hf_dir: str, out: str, vocab: str | None = None,
                      task: str | None = None) -> ImportReport:
  """Converts the checkpoint in `hf_dir` into the workdir `out` (see the module docstring).

  Args:
    hf_dir: a dir with config.json and model.safetensors or pytorch_model.bin (and, for
      RealmForOpenQA, block_records.npy and vocab.txt).
    out: the workdir to write: a new or empty dir.
    vocab: the vocab.txt block records are tokenised with (default: hf_dir/vocab.txt).
    task: the stage the checkpoint starts (ict | realm | openqa); default by layout.
  Returns:
    The report (also written to out/import_report.json).
  """
  from realm_jax import workdir as workdir_lib
  from realm_jax.runtime import checkpoints
  from realm_jax.config.defaults import TASKS
  if paths.is_remote(hf_dir):   # read from a local copy
    hf_dir = paths.local_mirror(hf_dir, log=lambda line: logger.info(f"[import] {line}"))
  if paths.is_remote(out):
    return _import_into_bucket(hf_dir, out, vocab, task)
  t0 = time.time()
  layout, hf = read_hf_config(hf_dir)
  if task is not None and task not in TASKS:
    raise ConfigError("", f"--task {task!r} is not one of {TASKS}")
  lines = unsupported(hf, os.path.join(hf_dir, "config.json"))
  if lines:
    raise ConfigError("", f"{hf_dir} cannot be expressed by our model:\n  " + "\n  ".join(lines))
  if os.path.isdir(out) and os.listdir(out):
    raise ConfigError("", f"{out} is not empty (an earlier import or run?); import into a new "
                      "dir")
  os.makedirs(out, exist_ok=True)
  out = os.path.abspath(out)
  tensors, source = hf_bert.read_weights(hf_dir)
  vocab = vocab or os.path.join(hf_dir, "vocab.txt")

  data_dir, block_len, block_stats = "", None, None
  if layout == "RealmForOpenQA":
    data_dir = os.path.join(out, "data")
    block_stats = _import_block_records(hf_dir, hf, tensors, source, vocab, data_dir)
    block_len = block_stats["block_len"]

  from realm_jax.runtime.state import build_model
  config = make_config(layout, hf, task=task, data_dir=data_dir, block_len=block_len)
  model = build_model(config, config.model.vocab_size)
  params = init_params(config, model)
  if layout == "bert":
    params, bert_report = hf_bert.load_bert_towers(params, hf_dir, option="")
    report = _bert_report(params, bert_report, tensors)
  else:
    params, report = convert(params, tensors, layout, source, hf_dir)
  if layout == "RealmForOpenQA":
    from realm_jax.data.prepared import BlockStore
    from realm_jax.runtime.embedders import query_tower_params
    report.block_store = block_stats
    report.index = publish_index(out, tensors["block_emb"],
                                 query_tower_params(params["retriever"]),
                                 BlockStore(data_dir).fingerprint, hf_dir)
    if "block_tower" in params["retriever"]:
      report.notes.append("retriever/block_tower is not in a RealmForOpenQA checkpoint: its "
                          "block embeddings are block_emb, published as the index")
  workdir_lib.write_config(out, config)
  checkpoints.write_params(out, params)
  report.notes.append(f"written {out}/config.json and checkpoints/0 (task {config.task}) in "
                      f"{time.time() - t0:.1f}s")
  with open(os.path.join(out, "import_report.json"), "w") as f:
    json.dump(report.to_json(), f, indent=1)
  return report


def _import_into_bucket(hf_dir: str, url: str, vocab: str | None, task: str | None
                        ) -> ImportReport:
  """The import written into a local dir (in the cache) and uploaded to the workdir `url`:
  its data dir (RealmForOpenQA) first, with its own files.json (a data dir in a bucket is read
  through a verified copy), then the rest, config.json and the index's commit files last."""
  from realm_jax import workdir as workdir_lib
  check = paths.check(url, "--out")
  if paths.isdir(check):
    raise ConfigError("", f"--out {url} is not empty (an earlier import or run?); import into "
                      "a new dir")
  local = paths.cache_dir(url) + "-import"
  shutil.rmtree(local, ignore_errors=True)
  report = import_checkpoint(hf_dir, local, vocab, task)
  log = lambda line: logger.info(f"[import] {line}")  # noqa: E731
  if os.path.isdir(os.path.join(local, "data")):
    config = workdir_lib.saved_config(local)
    config.data.dir = paths.join(url, "data")
    workdir_lib.write_config(local, config)
    paths.upload_tree(os.path.join(local, "data"), config.data.dir, log)
  paths.upload_tree(local, url, log, exclude="data/")
  shutil.rmtree(local)
  report.notes.append(f"uploaded to {url}")
  return report


def _bert_report(params: Mapping, bert_report, tensors: Mapping) -> ImportReport:
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


# -- Open-QA prediction -------------------------------------------------------------------
@dataclasses.dataclass
class OpenQAPrediction:
  """One question's ORQA forward: the top blocks, their span scores and the best answer."""

  block_rows: np.ndarray         # [beam] block-store rows, by retrieval score
  retrieval_logits: np.ndarray   # [beam] f(question, block)
  reader_ids: np.ndarray         # [beam, reader_len] `[CLS] question [SEP] body [SEP]`
  span_mask: np.ndarray          # [beam, reader_len] positions a span may use (the body)
  span_logits: np.ndarray        # [beam, S] reader span scores (-1e9 outside the body)
  starts: np.ndarray             # [S] span starts (width-major, `span_candidates`)
  ends: np.ndarray               # [S]
  block: int                     # the answer's block (index into the beam)
  start: int                     # the answer's first position in reader_ids[block]
  end: int                       # and its last
  score: float                   # span logit + retrieval logit of the answer

  @property
  def answer_ids(self) -> np.ndarray:
    return self.reader_ids[self.block, self.start:self.end + 1]


@functools.lru_cache(maxsize=None)
def _openqa_fns(model):
  import jax
  from realm_jax.models.realm import REALM
  embed = jax.jit(lambda p, ids: model.apply({"params": p}, ids, method=REALM.embed_queries))
  spans = jax.jit(lambda p, ids, segs, mask: model.apply(
      {"params": p}, ids, segs, mask, method=REALM.read_spans))
  return embed, spans


def openqa_forward(model, params, question: np.ndarray, *, index, block_emb: np.ndarray,
                   blocks, cls_id: int, sep_id: int, reader_beam: int, reader_len: int,
                   query_len: int) -> OpenQAPrediction:
  """ORQA's prediction for one question (HF RealmForOpenQA's forward in eval mode).

  Embed `[CLS] question [SEP]` with the query tower, take the top `reader_beam` blocks of
  `index` (retrieval logit = inner product with their `block_emb` rows), read
  `[CLS] question [SEP] body [SEP]` for each, add the block's retrieval logit to its span
  scores and take the argmax over (block, span).

  Args:
    model, params: a REALM with the span head (`state.build_model` of an openqa config) and
      its params.
    question: the question's wordpiece ids, without [CLS]/[SEP].
    index: a `retrieval.index.BlockIndex` over the block store's rows.
    block_emb: [num_blocks, dim] the block embeddings the index holds.
    blocks: the `data.prepared.BlockStore` (body = tokens[body_start:length - 1]).
    cls_id, sep_id: the vocab's [CLS] and [SEP].
    reader_beam: blocks read (HF reader_beam_size); reader_len: reader input length.
    query_len: the question's input length for the query tower (longer ones are cut).
  """
  from realm_jax.train.openqa_inputs import reader_inputs
  embed, spans = _openqa_fns(model)
  question = np.asarray(question, np.int32)
  q_ids = np.zeros((1, query_len), np.int32)
  q_row = [cls_id, *question[:query_len - 2], sep_id]
  q_ids[0, :len(q_row)] = q_row
  q_emb = np.asarray(embed(params, q_ids))
  rows = np.asarray(index.search(q_emb, reader_beam))[0]
  retrieval = np.asarray(block_emb[rows], np.float32) @ q_emb[0]
  # The reader inputs realm-eval builds, spans anywhere in the body as in HF's reader.
  _, inputs = reader_inputs(blocks, rows[None], q_ids, np.asarray([len(q_row)], np.int32),
                            reader_len, cls_id, sep_id)
  ids, segments = inputs["reader_ids"][0], inputs["reader_segments"][0]
  span_mask = inputs["span_start_mask"][0]   # = the end mask: the body
  span_logits = np.asarray(spans(params, ids, segments, span_mask))
  from realm_jax.models.realm import span_candidates
  starts, ends = span_candidates(reader_len, model.max_span_width)
  joint = span_logits + retrieval[:, None]
  block, span = np.unravel_index(int(np.argmax(joint)), joint.shape)
  return OpenQAPrediction(rows, retrieval, ids, span_mask, span_logits, starts, ends, int(block),
                          int(starts[span]), int(ends[span]), float(joint[block, span]))


# -- the command --------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> ImportReport:
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
  parser.add_argument("--hf-dir", required=True, help="HF checkpoint dir (config.json + "
                      "model.safetensors or pytorch_model.bin)")
  parser.add_argument("--out", required=True, help="workdir to write (config.json, "
                      "checkpoints/0, and for RealmForOpenQA data/ and index/)")
  parser.add_argument("--vocab", default=None, help="vocab.txt for the block records "
                      "(default: HF_DIR/vocab.txt)")
  parser.add_argument("--task", default=None, help="stage the checkpoint starts: ict | realm | "
                      "openqa (default: realm, or openqa for RealmReader / RealmForOpenQA)")
  log.add_verbosity_argument(parser)
  args = parser.parse_args(argv)
  log.set_verbosity(args.verbosity)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # host-side conversion; no accelerator needed

  def job():
    return import_checkpoint(args.hf_dir, args.out, args.vocab, args.task)
  report = run_cli(PROG, job)
  print(report, flush=True)
  return report


def run() -> None:
  main(sys.argv[1:])


if __name__ == "__main__":
  run()

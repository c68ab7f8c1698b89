"""`realm-import-hf --hf-dir D --out W2`: a Hugging Face REALM (or BERT) checkpoint -> a workdir.

Layouts, told apart by D/config.json (`model_type`, `architectures`); HF key -> our params:

  RealmEmbedder             realm.*            -> retriever/tower/bert (one tower serves query
                            cls.dense/LayerNorm -> retriever/tower/projection(_norm)  and block,
                                                   as HF's RealmScorer uses it: share_towers;
                                                   `init.retriever` into a retriever with a
                                                   tower of each starts both from it)
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

Reading a checkpoint's layout and weights into our parameters: interop/hf_realm_weights.py;
ORQA's prediction for one question, which the parity check compares against HF's
RealmForOpenQA: interop/hf_realm_openqa.py. This module is the import job and its CLI.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import sys
import time
from collections.abc import Mapping

import numpy as np

from realm_jax import log, paths
from realm_jax.errors import CommandParser, ConfigError, DataError, run_cli
from realm_jax.interop import hf_bert, torch_pickle
from realm_jax.interop.hf_realm_weights import (POOLING_RECORD, ImportReport, bert_report,
                                                convert, read_hf_config, sentence_pooling,
                                                unsupported)

logger = logging.getLogger("realm_jax.interop.hf_realm")   # (__name__ is __main__ under python -m)

PROG = "realm-import-hf"
BLOCK_RECORDS = "block_records.npy"
# The stage each layout's checkpoint starts by default (`--task` overrides).
DEFAULT_TASK = {"bert": "realm", "RealmEmbedder": "realm", "RealmKnowledgeAugEncoder": "realm",
                "RealmReader": "openqa", "RealmForOpenQA": "openqa"}
MIN_QUERY_LEN = 16   # the question's wordpieces an import's data.query_len leaves at least
TOKENISE_CHUNK = 100_000   # block records tokenised per call (a progress line between calls)
PROGRESS_SECONDS = 10.0    # one progress line per this many seconds of tokenising


def make_config(layout: str, hf: Mapping, *, task: str | None = None, data_dir: str = "",
                block_len: int | None = None):
  """The realm_jax config of an import: base_config with the checkpoint's model shape and
  activation.

  Data lengths keep their defaults unless the checkpoint's positions are fewer (then they are
  scaled down to fit) or the layout fixes them (Open-QA: the block store's block_len, the rest
  of HF's reader_seq_len for the question, and the reader's input cut to reader_seq_len as
  HF's RealmForOpenQA cuts it, so realm-eval and realm-predict read what HF reads).
  """
  from realm_jax.config.defaults import base_config
  from realm_jax.config.validation import validate
  c = base_config()
  c.task = task or DEFAULT_TASK[layout]
  if c.task == "ict":
    c.train.reader_lr_scale = 0.0   # ICT trains the retriever only (as configs/ict_base.py)
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
    reader_len = min(int(hf.get("reader_seq_len", 320)), max_position)
    d.block_len = block_len
    d.query_len = max(MIN_QUERY_LEN, reader_len - block_len)
    if c.task == "openqa" and reader_len >= d.query_len + 2:
      c.qa.reader_len = reader_len   # HF's reader input: the pair cut longest first to it
  elif d.query_len + d.block_len > max_position:
    d.query_len = max(MIN_QUERY_LEN, max_position // 4)
    d.block_len = max_position - d.query_len
  shapes = c.copy_and_resolve_references()
  shapes.task = "realm"     # the checks of every stage; the task's data (questions) come later
  shapes.qa.reader_len = 0
  validate(shapes)
  return c


def _model_init(config, model):
  """rng -> our parameter tree as the model initialises it (plain dicts)."""
  import flax.linen as nn
  from realm_jax.runtime import state as state_lib
  inputs = state_lib.dummy_inputs(config, config.data.block_len)
  return lambda rng: nn.meta.unbox(model.init(rng, **inputs)["params"])


def abstract_params(config, model) -> dict:
  """Our parameter tree with a jax.ShapeDtypeStruct for each leaf: nothing computed."""
  import jax
  return jax.eval_shape(_model_init(config, model), jax.random.PRNGKey(config.seed))


def initialise_rest(config, model, params: Mapping) -> dict:
  """`params` with each leaf still abstract (a ShapeDtypeStruct: the checkpoint lacks it) as
  the model initialises it from config.seed, host NumPy. One jitted init returns those leaves
  alone, so XLA drops the random draws of the others (a whole REALM's init is most of an
  import's time otherwise); each parameter's key comes from its module path, so the values
  are the whole init's."""
  import jax
  from flax import traverse_util
  flat = traverse_util.flatten_dict(params)
  rest = sorted(k for k, v in flat.items() if isinstance(v, jax.ShapeDtypeStruct))
  if rest:
    init = _model_init(config, model)

    def init_rest(rng):
      initialised = traverse_util.flatten_dict(init(rng))
      return [initialised[k] for k in rest]
    values = jax.jit(init_rest)(jax.random.PRNGKey(config.seed))
    flat.update({k: np.asarray(v) for k, v in zip(rest, values)})
  return traverse_util.unflatten_dict(flat)


# -- Open-QA evidence: block records -> block store + published index ---------------------
def load_block_records(path: str) -> np.ndarray:
  """HF's block_records.npy (an object array of UTF-8 bytes, i.e. a pickle) read with a
  restricted unpickler that rebuilds the array itself from a list of bytes or str (`_Records`);
  plain bytes/str arrays load directly."""
  with open(path, "rb") as f:
    try:
      version = np.lib.format.read_magic(f)
      if version not in ((1, 0), (2, 0)):
        raise DataError(f"{path}: .npy format version {version} is not read here")
      read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                     else np.lib.format.read_array_header_2_0)
      shape, _, dtype = read_header(f)
      if not dtype.hasobject:
        f.seek(0)
        return np.load(f)
    except DataError:
      raise
    except ValueError as e:   # cut short (header or data), or not a .npy file at all
      raise DataError(f"{path}: not a readable .npy file ({e})") from None
    data = f.read()

  try:
    records = _Records(data, path).load()
  except (pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
    raise DataError(f"{path}: not block records ({e})") from None
  if not isinstance(records, _RecordsArray) or records.items is None:
    raise DataError(f"{path}: expected a pickled object array, got {type(records).__name__}")
  if len(records.items) != int(np.prod(shape)) or records.shape != shape:
    raise DataError(f"{path}: {len(records.items)} records for an array of shape {shape}")
  out = np.empty(len(records.items), dtype=object)
  out[:] = records.items
  return out.reshape(shape)


# What NumPy pickles an object array as, rebuilt without NumPy: its own `__setstate__` would
# take the pickle's dtype flags and raw bytes as object pointers (a crafted file could point
# them anywhere). `_reconstruct(ndarray, (0,), b"b")` -> _RecordsArray, `dtype("O8", False,
# True)` -> _ObjectDtype, and the array's state must hold a list of bytes or str.
class _ObjectDtype:
  def __setstate__(self, state) -> None:
    pass   # byte order, flags...: nothing of it is used


def _object_dtype(name, align=False, copy=True) -> _ObjectDtype:
  if name != "O8":
    raise pickle.UnpicklingError(f"block records of dtype {name!r}, not objects")
  return _ObjectDtype()


class _RecordsArray:
  shape, items = None, None

  def __setstate__(self, state) -> None:
    if not (isinstance(state, tuple) and len(state) == 5):
      raise pickle.UnpicklingError("not an object array's state")
    _, shape, dtype, _, items = state
    if not isinstance(dtype, _ObjectDtype) or not isinstance(items, list) or not all(
        isinstance(x, (bytes, str)) for x in items):
      raise pickle.UnpicklingError("an object array whose items are not all bytes or str")
    if not (isinstance(shape, tuple) and all(type(d) is int and d >= 0 for d in shape)):
      raise pickle.UnpicklingError(f"an array shape of {shape!r}")
    self.shape, self.items = shape, items


def _reconstruct(cls, shape, typecode) -> _RecordsArray:
  return _RecordsArray()


class _Records(torch_pickle.RestrictedUnpickler):
  allowed = {(module, "_reconstruct"): _reconstruct
             for module in ("numpy.core.multiarray", "numpy._core.multiarray")}
  allowed.update({("numpy", "ndarray"): _RecordsArray, ("numpy", "dtype"): _object_dtype})


def write_block_store(records: np.ndarray, tokenizer, out_dir: str, max_block_len: int,
                      source: str) -> dict:
  """Block records -> a prepared data dir (`store.PreparedData` reads it): rows
  `[CLS] [SEP] body [SEP]` (empty titles), block_len = the longest record's + 3, at most
  `max_block_len` (longer records are cut, and counted). Returns the stats written."""
  from realm_jax.data.corpus import block_uid
  from realm_jax.data.prepared import open_block_arrays, write_stats, write_titles
  texts = [r.decode("utf-8") if isinstance(r, bytes) else str(r) for r in records.reshape(-1)]
  bodies = _tokenised(texts, tokenizer, source)
  longest = max((len(b) for b in bodies), default=0)
  block_len = max(8, min(longest + 3, max_block_len))
  budget = block_len - 3
  n = len(bodies)
  arrays = open_block_arrays(out_dir, n, block_len)
  arrays["tokens"][:] = 0
  cut = 0
  for i, body in enumerate(bodies):
    cut += len(body) > budget
    body = body[:budget]
    row = [tokenizer.cls_id, tokenizer.sep_id, *body, tokenizer.sep_id]
    arrays["tokens"][i, :len(row)] = row
    arrays["lengths"][i] = len(row)
    arrays["uids"][i] = block_uid([], body)
  arrays["body_start"][:] = 2
  arrays["doc_ids"][:] = 0
  longest_row = int(np.max(arrays["lengths"], initial=0))
  for array in arrays.values():
    array.flush()
  del arrays
  write_titles(out_dir, [""])
  shutil.copyfile(tokenizer.vocab_path, os.path.join(out_dir, "vocab.txt"))
  stats = {"source": source, "documents": 1, "blocks": n, "block_len": block_len,
           "max_block_wordpieces": longest_row, "records_cut": int(cut),
           "longest_record_wordpieces": int(longest), "max_sentence_len": 0,
           "examples": {"train": 0, "eval": 0}, "vocab_size": tokenizer.vocab_size}
  write_stats(out_dir, stats)
  return stats


def _tokenised(texts: list[str], tokenizer, source: str) -> list[list[int]]:
  """The wordpiece ids of each of `texts`, said as it starts and then every PROGRESS_SECONDS
  (records/s, ETA): RealmForOpenQA's 13.35M records take minutes."""
  from realm_jax.log import format_duration
  logger.info(f"[import] tokenising {len(texts):,} block records of {source}")
  bodies, t0 = [], time.time()
  last = t0
  for start in range(0, len(texts), TOKENISE_CHUNK):
    bodies += [ids for ids, _ in tokenizer.encode_batch(texts[start:start + TOKENISE_CHUNK])]
    now = time.time()
    if now - last >= PROGRESS_SECONDS and len(bodies) < len(texts):
      rate = len(bodies) / max(now - t0, 1e-9)
      logger.info(f"[import] tokenised {len(bodies):,}/{len(texts):,} block records | "
                  f"{rate:,.0f} records/s ETA {format_duration((len(texts) - len(bodies)) / rate)}")
      last = now
  return bodies


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
  tokenizer = load_tokenizer(vocab)   # its size checked against config.json: _checked_vocab
  records = load_block_records(records_file)
  if len(records) != tensors["block_emb"].shape[0]:
    raise ConfigError("", f"{records_file} has {len(records)} records but block_emb has "
                      f"{tensors['block_emb'].shape[0]} rows")
  max_position = int(hf["max_position_embeddings"])
  # A block of HF's reader_seq_len, less the question's MIN_QUERY_LEN where that would overrun
  # the positions (reader_seq_len = max_position_embeddings): data.query_len follows it
  max_block_len = min(int(hf["reader_seq_len"]), max_position - MIN_QUERY_LEN)
  return write_block_store(records, tokenizer, data_dir, max_block_len, f"hf:{records_file}")


def _checked_source(hf_dir: str, out: str, task: str | None) -> tuple[str, dict]:
  """(layout, HF config) of `hf_dir`, after refusing a layout our model cannot express, an
  unknown `task` and a non-empty `out` (each a ConfigError naming it)."""
  from realm_jax.config.defaults import TASKS
  layout, hf = read_hf_config(hf_dir)
  if task is not None and task not in TASKS:
    raise ConfigError("", f"--task {task!r} is not one of {TASKS}")
  lines = unsupported(hf, os.path.join(hf_dir, "config.json"), layout)
  if lines:
    raise ConfigError("", f"{hf_dir} cannot be expressed by our model:\n  " + "\n  ".join(lines))
  if os.path.isdir(out) and os.listdir(out):
    raise ConfigError("", f"{out} is not empty (an earlier import or run?); import into a new "
                      "dir")
  return layout, hf


def _checked_vocab(hf_dir: str, hf: dict, vocab: str | None) -> str:
  """The checkpoint's vocab.txt (`vocab`, default HF_DIR/vocab.txt), after refusing one that
  is missing (a run's data could never be checked against the workdir), lists another number
  of tokens than config.json's vocab_size, is cased (`tokenizer.check_uncased`), or, given
  beside HF_DIR/vocab.txt, lists other tokens than it."""
  from realm_jax.data.tokenizer import check_uncased, load_tokenizer
  given = vocab is not None
  vocab = vocab or os.path.join(hf_dir, "vocab.txt")
  if not os.path.isfile(vocab):
    raise ConfigError("", f"{vocab}: no such file; the workdir keeps the checkpoint's vocab.txt "
                      "so that a run's data is checked against it (a tokenizer.json alone is "
                      "not read): " + ("give the checkpoint's vocab" if given else
                                       "give it with --vocab PATH"))
  check_uncased(hf_dir, "", hf_dir)
  if given:
    check_uncased(vocab, "", f"--vocab {vocab}")
  size = load_tokenizer(vocab).vocab_size
  if size != int(hf["vocab_size"]):
    raise ConfigError("", f"{vocab} has {size} tokens but {hf_dir}/config.json says vocab_size "
                      f"{hf['vocab_size']}: pass the checkpoint's vocab")
  own = os.path.join(hf_dir, "vocab.txt")
  if given and os.path.isfile(own):   # the ids of its embeddings: no other vocab's
    differ = hf_bert.vocab_difference(vocab, own)
    if differ is not None:
      raise ConfigError("", f"--vocab {vocab} lists other tokens than the checkpoint's {own} "
                        f"(first at {differ}): the block records' ids would mean other words "
                        "to its embeddings; leave --vocab out (it gives the vocab of a dir "
                        "without vocab.txt)")
  return vocab


def import_checkpoint(hf_dir: str, out: str, vocab: str | None = None,
                      task: str | None = None) -> ImportReport:
  """Converts the checkpoint in `hf_dir` into the workdir `out` (see the module docstring).

  Args:
    hf_dir: a dir with config.json and model.safetensors or pytorch_model.bin (and, for
      RealmForOpenQA, block_records.npy and vocab.txt).
    out: the workdir to write: a new or empty dir.
    vocab: the checkpoint's vocab.txt where hf_dir has none (default: hf_dir/vocab.txt);
      block records are tokenised with it.
    task: the stage the checkpoint starts (ict | realm | openqa); default by layout.
  Returns:
    The report (also written to out/import_report.json).
  """
  if paths.is_remote(hf_dir):   # read from a local copy
    hf_dir = paths.local_mirror(hf_dir, log=lambda line: logger.info(f"[import] {line}"))
  if paths.is_remote(out):
    return _import_into_bucket(hf_dir, out, vocab, task)
  t0 = time.time()
  layout, hf = _checked_source(hf_dir, out, task)
  vocab = _checked_vocab(hf_dir, hf, vocab)
  created = not os.path.isdir(out)
  os.makedirs(out, exist_ok=True)
  out = os.path.abspath(out)
  try:
    return _write_import(hf_dir, out, layout, hf, vocab, task, t0)
  except BaseException:   # refused weights (after RealmForOpenQA's block store), a full disk,
    _remove_import(out, created)   # Ctrl-C: no partial workdir, which a retry would refuse
    raise


def _remove_import(out: str, created: bool) -> None:
  """What a failed import wrote into `out` (new, or empty before it: all in it is the
  import's), and `out` itself if the import created it."""
  if created:
    shutil.rmtree(out, ignore_errors=True)
    return
  for name in os.listdir(out):
    path = os.path.join(out, name)
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path, ignore_errors=True)
    else:
      os.remove(path)


def _write_import(hf_dir: str, out: str, layout: str, hf: dict, vocab: str, task: str | None,
                  t0: float) -> ImportReport:
  """`import_checkpoint`'s work after its checks, into the new or empty dir `out`."""
  from realm_jax import workdir as workdir_lib
  from realm_jax.runtime import checkpoints
  tensors, source = hf_bert.read_weights(hf_dir)

  data_dir, block_len, block_stats = "", None, None
  if layout == "RealmForOpenQA":
    data_dir = os.path.join(out, "data")
    block_stats = _import_block_records(hf_dir, hf, tensors, source, vocab, data_dir)
    block_len = block_stats["block_len"]

  from realm_jax.runtime.state import build_model
  config = make_config(layout, hf, task=task, data_dir=data_dir, block_len=block_len)
  pooling, other_pooling = sentence_pooling(hf_dir) if layout == "bert" else (None, [])
  if pooling:   # a sentence encoder (all-MiniLM-L6-v2): retrieve as it was trained to embed
    config.model.retriever.pooling = pooling
  model = build_model(config, config.model.vocab_size)
  params = abstract_params(config, model)    # the checkpoint's leaves, then the rest's init
  if layout == "bert":
    params, towers = hf_bert.load_bert_towers(params, hf_dir, option="")
    report = bert_report(params, towers, tensors)
    if pooling:
      report.notes.append(f"model.retriever.pooling {pooling!r}, as the checkpoint's "
                          f"{POOLING_RECORD} says it was trained to embed")
    if other_pooling:
      report.notes.append(
          f"the checkpoint's {POOLING_RECORD} also pools by {', '.join(other_pooling)}, which "
          f"the retriever cannot reproduce (model.retriever.pooling: one of cls | mean): its "
          f"embeddings are model.retriever.pooling {config.model.retriever.pooling!r} alone")
  else:
    params, report = convert(params, tensors, layout, source, hf_dir)
  params = initialise_rest(config, model, params)
  if layout == "RealmForOpenQA":
    from realm_jax.data.prepared import BlockStore
    from realm_jax.runtime.embedders import query_tower_params
    report.block_store = block_stats
    report.index = publish_index(out, tensors["block_emb"],
                                 query_tower_params(params["retriever"]),
                                 BlockStore(data_dir).fingerprint, hf_dir)
    report.unused.remove("block_emb")   # no parameter: the published index
    if "block_tower" in params["retriever"]:
      report.notes.append("retriever/block_tower is not in a RealmForOpenQA checkpoint: its "
                          "block embeddings are block_emb, published as the index")
  workdir_lib.write_config(out, config)
  shutil.copyfile(vocab, os.path.join(out, "vocab.txt"))   # what init.* checks data against
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


# -- the command --------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> ImportReport:
  parser = CommandParser(prog=PROG, description=__doc__.split("\n")[0])
  parser.add_argument("--hf-dir", required=True, help="HF checkpoint dir (config.json + "
                      "model.safetensors or pytorch_model.bin)")
  parser.add_argument("--out", required=True, help="workdir to write (config.json, "
                      "checkpoints/0, and for RealmForOpenQA data/ and index/)")
  parser.add_argument("--vocab", default=None, help="the checkpoint's vocab.txt, where "
                      "HF_DIR has none (default: HF_DIR/vocab.txt)")
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

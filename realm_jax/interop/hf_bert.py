"""Hugging Face BERT checkpoints (a dir with config.json + model.safetensors) -> our Flax BERT.

The mapping is built from our own parameter tree (`bert.hf_parameter_names`), so every one of
our BERT parameters is either found in the checkpoint or reported. Torch Dense weights are
[out, in] and are transposed into Flax kernels; LayerNorm `gamma`/`beta` (old names) are read
as `weight`/`bias`; names with or without the `bert.` prefix are accepted.

  load_bert_towers(params, path)  every BERT tower of a REALM tree (+ the MLM head if saved)
  bert_config_mismatches(...)     config.model vs the checkpoint's config.json, as text lines
  model_overrides(path)           the config.model values that fit the checkpoint (shape, and
                                  hidden_act: "gelu" erf or "gelu_new" tanh, bert.HIDDEN_ACTS)
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from realm_jax import paths
from realm_jax.errors import ConfigError, DataError
from realm_jax.interop import torch_pickle
from realm_jax.models.bert import HIDDEN_ACTS, hf_parameter_names

OPTION = "init.hf_bert"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# HF `BertConfig` defaults, for keys a config.json leaves out.
HF_DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
               "num_attention_heads": 12, "intermediate_size": 3072,
               "max_position_embeddings": 512, "type_vocab_size": 2, "hidden_act": "gelu",
               "layer_norm_eps": 1e-12, "position_embedding_type": "absolute"}
# Our config.model field -> the HF config key of the same meaning.
SHAPE_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
                "max_position": "max_position_embeddings", "vocab_size": "vocab_size"}
OUR_TYPE_VOCAB, OUR_LAYER_NORM_EPS = 2, 1e-12   # fixed in models/bert.py's BertConfig
_LEAF_NAMES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}
# An encoder layer's tensor, under any prefix (`bert.`, `realm.`, `reader.realm.`).
_LAYER = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")


# -- reading a checkpoint ------------------------------------------------------------------
def read_config(path: str) -> dict:
  """The checkpoint's config.json with HF's defaults filled in."""
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no HF BERT config at {file}")
  return checked_config({**HF_DEFAULTS, **read_config_json(file)}, file)


def read_config_json(file: str) -> dict:
  """A checkpoint's config.json as a dict; broken JSON or another value is a DataError
  naming the file (it was a JSONDecodeError traceback)."""
  try:
    with open(file, encoding="utf-8") as f:
      raw = json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise DataError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(raw, dict):
    raise DataError(f"{file}: not a JSON object (a checkpoint's config)")
  return raw


# config.json keys this code reads as numbers or names, and their types.
_TYPED_KEYS = {**{key: int for key in ("vocab_size", "hidden_size", "num_hidden_layers",
                                       "num_attention_heads", "intermediate_size",
                                       "max_position_embeddings", "type_vocab_size")},
               **{key: float for key in ("layer_norm_eps", "hidden_dropout_prob",
                                         "attention_probs_dropout_prob", "initializer_range")},
               "hidden_act": str, "position_embedding_type": str}


def checked_config(hf: dict, file: str, typed: Mapping[str, type] = _TYPED_KEYS) -> dict:
  """`hf` if every `typed` value has its type (an int counts as a float), else a DataError
  naming the key and the file."""
  for key, kind in typed.items():
    value = hf.get(key)
    fits = isinstance(value, (int, float) if kind is float else kind) and \
        not isinstance(value, bool)
    if key in hf and not fits:
      raise DataError(f"{file}: {key} is {value!r}, not {'a' if kind is not int else 'an'} "
                      f"{kind.__name__}")
  return hf


def normalise_name(name: str) -> str:
  """`bert.encoder...LayerNorm.gamma` -> `encoder...LayerNorm.weight` (heads keep their names)."""
  name = name[len("bert."):] if name.startswith("bert.") else name
  return re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight",
                re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name))


def sharded(path: str) -> str:
  """', a sharded checkpoint (X.index.json), which is not read: save it as one file' where
  PATH holds one, else ''."""
  index = next((f + ".index.json" for f in WEIGHT_FILES
                if os.path.isfile(os.path.join(path, f + ".index.json"))), None)
  return "" if index is None else (f", but a sharded checkpoint ({index}), which is not read: "
                                   "save it as one file (save_pretrained with a larger "
                                   "max_shard_size)")


def read_weights(path: str) -> tuple[dict[str, np.ndarray], str]:
  """(tensors by normalised name, the file read): model.safetensors, else pytorch_model.bin."""
  safetensors_file, torch_file = (os.path.join(path, f) for f in WEIGHT_FILES)
  if os.path.isfile(safetensors_file):
    raw, file = _load_safetensors(safetensors_file), safetensors_file
  elif os.path.isfile(torch_file):
    raw, file = _load_torch(torch_file), torch_file
  else:
    raise FileNotFoundError(f"no HF BERT weights in {path}: expected {WEIGHT_FILES[0]} or "
                            f"{WEIGHT_FILES[1]}{sharded(path)}")
  tensors: dict[str, np.ndarray] = {}
  for name in sorted(raw, key=lambda n: not n.startswith("bert.")):  # `bert.` names win
    tensors.setdefault(normalise_name(name), raw[name])
  return tensors, file


def _load_safetensors(file: str) -> dict[str, np.ndarray]:
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  try:
    tensors = load_file(file)
  except SafetensorError as e:
    raise DataError(f"{file}: not a readable safetensors file ({e}); a damaged or partial "
                    "download?") from None
  except (TypeError, ValueError):   # dtypes numpy lacks: read through JAX
    from safetensors.flax import load_file as load_jax
    tensors = {k: np.asarray(v) for k, v in load_jax(file).items()}
  # floats as float32, as from pytorch_model.bin (a bfloat16 tensor is no np.floating)
  return {k: v.astype(np.float32) if torch_pickle.is_float(v.dtype) else v
          for k, v in tensors.items()}


def _load_torch(file: str) -> dict[str, np.ndarray]:
  try:
    import torch
  except ImportError:   # torch-free: the zip format read with a restricted unpickler
    try:
      return torch_pickle.load_state_dict(file, floats_as=np.float32)
    except (ValueError, pickle.UnpicklingError) as e:   # each names the file
      raise DataError(str(e)) from None
  try:
    state = torch.load(file, map_location="cpu", weights_only=True)
  except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as e:   # as above
    raise DataError(f"{file}: not a readable torch checkpoint ({e}); a damaged or partial "
                    "download?") from None
  return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


# -- configs -------------------------------------------------------------------------------
def bert_config_mismatches(model_cfg, hf_config: Mapping | str, *, vocab_size: int | None = None,
                           source: str | None = None,
                           options: Mapping[str, str] | None = None) -> list[str]:
  """Lines `model.hidden_size: 128 (config) != 384 (PATH/config.json)`, one per difference.

  `hf_config` is a checkpoint dir or its config dict; `vocab_size` is the data vocab's size
  (used when model.vocab_size is 0). Our max_position may be smaller than the checkpoint's
  (the first rows of its position table are taken). model.hidden_act must compute the
  checkpoint's GELU (erf or tanh: the names of one form are interchangeable); an activation
  our BERT lacks is reported as unsupported. `model_cfg` may be one part's shape
  (`reading.part_model`); `options` then names the option that sets each field for that
  part (`reading.part_options`; default `model.<field>`).
  """
  options = options or {}
  model_option = lambda field: options.get(field, f"model.{field}")
  if isinstance(hf_config, str):
    source = source or os.path.join(hf_config, "config.json")
    hf_config = read_config(hf_config)
  hf = {**HF_DEFAULTS, **hf_config}
  source = source or "the checkpoint's config.json"
  lines = []
  for field, key in SHAPE_FIELDS.items():
    ours, theirs = model_cfg.get(field), hf[key]
    if field == "vocab_size":
      ours = ours or vocab_size
      if not ours:
        continue
    if field in ("max_position", "num_layers"):   # fewer: the first rows / layers are taken
      if ours > theirs:
        what = "positions" if field == "max_position" else "layers"
        lines.append(f"{model_option(field)}: {ours} (config) > {theirs} ({source}): "
                     f"the checkpoint has only {theirs} {what}")
    elif ours != theirs:
      where = "config / data vocab.txt" if field == "vocab_size" else "config"
      lines.append(f"{model_option(field)}: {ours} ({where}) != {theirs} ({source})")
  ours, theirs = model_cfg.get("hidden_act", "gelu"), hf["hidden_act"]
  if theirs in HIDDEN_ACTS and HIDDEN_ACTS.get(ours) != HIDDEN_ACTS[theirs]:
    lines.append(f"{model_option('hidden_act')}: {ours!r} (config) != {theirs!r} "
                 f"({source})")
  if hf["type_vocab_size"] != OUR_TYPE_VOCAB:
    lines.append(f"type_vocab_size: {OUR_TYPE_VOCAB} (our BERT) != {hf['type_vocab_size']} "
                 f"({source})")
  lines += unsupported_settings(hf, source, hidden_acts=HIDDEN_ACTS)
  return lines


def unsupported_settings(hf: Mapping, source: str,
                         hidden_acts: Collection[str] = ("gelu",)) -> list[str]:
  """Checkpoint settings our BERT cannot reproduce (activation, LayerNorm eps, positions).

  `hidden_acts`: the activations the caller's BertConfig is given (the default, erf gelu
  alone, is for callers that leave BertConfig.hidden_act at its default).
  """
  lines = []
  if hf["hidden_act"] not in hidden_acts:
    lines.append(f"hidden_act: {hf['hidden_act']!r} ({source}) is not supported: "
                 f"{_describe_acts(hidden_acts)}")
  if not np.isclose(hf["layer_norm_eps"], OUR_LAYER_NORM_EPS, rtol=1e-3, atol=0):
    lines.append(f"layer_norm_eps: {OUR_LAYER_NORM_EPS} (our BERT) != {hf['layer_norm_eps']} "
                 f"({source})")
  if hf["position_embedding_type"] != "absolute":
    lines.append(f"position_embedding_type: {hf['position_embedding_type']!r} ({source}) != "
                 "'absolute' (our BERT)")
  return lines


def _describe_acts(names: Collection[str]) -> str:
  """`our BERT has 'gelu', ... (erf GELU) or 'gelu_new', ... (its tanh approximation)`."""
  forms = [(", ".join(repr(n) for n in names if HIDDEN_ACTS.get(n) is tanh), what)
           for tanh, what in ((False, "erf GELU"), (True, "its tanh approximation"))]
  return "our BERT has " + " or ".join(f"{n} ({what})" for n, what in forms if n)


def model_overrides(path: str) -> dict[str, Any]:
  """The config.model values of the checkpoint's shape and activation, for
  `config.model.update(...)` (an activation our BERT lacks is passed on as it is:
  `bert_config_mismatches` and `validate` name it)."""
  hf = read_config(path)
  return {**{field: hf[key] for field, key in SHAPE_FIELDS.items()},
          "hidden_act": hf["hidden_act"]}


def check_vocab(data_vocab: str, path: str, option: str = OPTION) -> None:
  """ConfigError unless `data_vocab` (a vocab.txt) lists the same tokens as PATH/vocab.txt
  (PATH local or in a bucket)."""
  theirs_file = paths.join(path, "vocab.txt")
  if not paths.exists(theirs_file):
    raise ConfigError(option, f"{path} has no vocab.txt, so the data's token ids cannot be "
                      "checked against the checkpoint's embeddings")
  differ = vocab_difference(data_vocab, theirs_file)
  if differ is None:
    return
  raise ConfigError(option, f"the data's {data_vocab} ({len(_vocab_tokens(data_vocab))} tokens) "
                    f"differs from {theirs_file} ({len(_vocab_tokens(theirs_file))} tokens; "
                    f"first at {differ}): prepare the data with that vocab: realm-prepare "
                    f"--config.vocab={path}")


def vocab_difference(ours_file: str, theirs_file: str) -> str | None:
  """Where two vocab.txt files first list other tokens (`line N: 'a' vs 'b'`, or `one is a
  prefix of the other`); None where they list the same."""
  ours, theirs = _vocab_tokens(ours_file), _vocab_tokens(theirs_file)
  if ours == theirs:
    return None
  first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
               min(len(ours), len(theirs)))
  return (f"line {first + 1}: {ours[first]!r} vs {theirs[first]!r}"
          if first < min(len(ours), len(theirs)) else "one is a prefix of the other")


def _vocab_tokens(file: str) -> list[str]:
  tokens = [line.rstrip("\r") for line in (paths.read_text(file) or "").split("\n")]
  while tokens and not tokens[-1]:
    tokens.pop()
  return tokens


# -- converting ----------------------------------------------------------------------------
@dataclasses.dataclass
class Conversion:
  """Our parameter trees filled from one checkpoint's tensors, with what was used, missing,
  of another shape, and notes (`bert` converts one BertEncoder tree)."""

  tensors: dict[str, np.ndarray]
  source: str
  used: set[str] = dataclasses.field(default_factory=set)
  mismatches: dict[str, str] = dataclasses.field(default_factory=dict)
  missing: dict[str, str] = dataclasses.field(default_factory=dict)
  notes: list[str] = dataclasses.field(default_factory=list)
  our_hidden: int = 0

  def value(self, hf_name: str, flax_leaf: str, ours, where: str):
    """The checkpoint's tensor in our layout and dtype, or None (recorded as a mismatch)."""
    tensor = self.tensors[hf_name]
    value = tensor.T if flax_leaf == "kernel" else tensor
    shape = tuple(ours.shape)
    if hf_name.endswith("embeddings.position_embeddings.weight") \
        and value.shape[1:] == shape[1:] and value.shape[0] > shape[0]:   # also realm.* names
      note = (f"position embeddings: the first {shape[0]} of the checkpoint's "
              f"{value.shape[0]} rows (model.max_position = {shape[0]})")
      if note not in self.notes:
        self.notes.append(note)
      value = value[:shape[0]]
    if not np.issubdtype(tensor.dtype, np.floating):   # a quantised or wrong file
      self.mismatches.setdefault(hf_name, (
          f"{hf_name}: {tensor.dtype} in the checkpoint, a float parameter in our model "
          f"({where}); a quantised checkpoint is not read: give its float weights"))
      return None
    if value.shape != shape:
      ours_hf = shape[::-1] if flax_leaf == "kernel" else shape
      self.mismatches.setdefault(hf_name, (
          f"{hf_name}: {tuple(tensor.shape)} in the checkpoint, {ours_hf} in our model "
          f"({where}); {self.advice(hf_name, tuple(tensor.shape), ours_hf)}"))
      return None
    self.used.add(hf_name)
    return np.asarray(value, dtype=ours.dtype)

  def layers(self) -> set[int]:
    """The encoder layers the checkpoint has a tensor of (a REALM's `realm.encoder...`,
    `reader.realm.encoder...` included)."""
    return {int(m.group(1)) for n in self.tensors if (m := _LAYER.search(n))}

  def missing_whole_layers(self, missing: list[str]) -> bool:
    """Whether every missing weight is of a layer at or above the checkpoint's layer count
    (our model is deeper), not a tensor absent from a layer the checkpoint has."""
    count = max(self.layers(), default=-1) + 1
    found = [_LAYER.search(n) for n in missing]
    return all(m is not None and int(m.group(1)) >= count for m in found)

  def advice(self, hf_name: str, theirs: tuple, ours: tuple) -> str:
    """What to change so that `hf_name` fits: the config option deciding its shape."""
    rows_differ = theirs[:1] != ours[:1]
    if hf_name.startswith("classifier."):
      return "config.json's id2label needs one label per classifier row"
    if rows_differ and ("word_embeddings" in hf_name or hf_name == "cls.predictions.bias"):
      return "change model.vocab_size (and the data's vocab.txt)"
    if rows_differ and "position_embeddings" in hf_name:
      return "change model.max_position"
    if rows_differ and "token_type_embeddings" in hf_name:
      return f"our BERT has {OUR_TYPE_VOCAB} token types"
    words = self.tensors.get("embeddings.word_embeddings.weight")
    if words is not None and words.shape[-1] != self.our_hidden:
      return "change model.hidden_size"
    if re.search(r"layer\.\d+\.(intermediate|output)\.dense", hf_name):
      return "change model.intermediate_size"
    return "change model.hidden_size"

  def bert(self, ours: Mapping, where: str) -> dict:
    """Our BertEncoder params (`ours`) with every leaf the checkpoint has replaced."""
    names = hf_parameter_names(ours)
    self.our_hidden = ours["embeddings"]["word_embeddings"]["embedding"].shape[-1]
    layers = self.layers()
    if len(ours["encoder"]) < len(layers):
      note = f"layers: the first {len(ours['encoder'])} of the checkpoint's {len(layers)}"
      if note not in self.notes:
        self.notes.append(note)
    flat = {}
    for flax_name, hf_name in names.items():
      leaf = _get(ours, flax_name)
      if hf_name not in self.tensors:
        kind = "pooler" if hf_name.startswith("pooler.") else "missing"
        self.missing.setdefault(hf_name, kind)
        continue
      value = self.value(hf_name, flax_name.rsplit("/", 1)[-1], leaf, f"{where}/{flax_name}")
      if value is not None:
        flat[flax_name] = value
    return _replaced(ours, flat)

  def raise_errors(self, option: str, path: str) -> None:
    """One ConfigError naming every missing weight and every shape mismatch."""
    missing = sorted(n for n, kind in self.missing.items() if kind == "missing")
    lines = list(self.mismatches.values())
    if missing:
      hint = (" (our model has more layers than the checkpoint: lower model.num_layers)"
              if self.missing_whole_layers(missing) else
              " (it has BERT layers but not these: an incomplete or damaged file?)"
              if self.layers() else
              " (is it a BERT? names are read with or without the `bert.` prefix)")
      lines.append(f"{len(missing)} weights our BERT needs are not in {self.source}{hint}: "
                   + ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else ""))
    if lines:
      raise ConfigError(option, f"{path} does not fit our model:\n  " + "\n  ".join(lines))

  def unused(self) -> list[str]:
    """Float tensors of the checkpoint no parameter took (buffers such as position_ids aside)."""
    return sorted(n for n, t in self.tensors.items()
                  if n not in self.used and np.issubdtype(t.dtype, np.floating))


def _get(tree: Mapping, flax_name: str):
  for key in filter(None, flax_name.split("/")):
    tree = tree[key]
  return tree


def _replaced(tree: Mapping, flat: dict[str, Any], prefix: str = "") -> dict:
  """A copy of `tree` (plain dicts) with the leaves named in `flat` replaced."""
  out = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    out[key] = (_replaced(value, flat, name + "/") if isinstance(value, Mapping)
                else flat.get(name, value))
  return out


def _bert_towers(tree: Mapping, path: tuple = ()):
  """(path, subtree) of every BertEncoder in `tree` (a `bert` with embeddings and encoder)."""
  for key, value in tree.items():
    if not isinstance(value, Mapping):
      continue
    if key == "bert" and "embeddings" in value and "encoder" in value:
      yield path + (key,), value
    else:
      yield from _bert_towers(value, path + (key,))


def _mlm_head_names(cls_params: Mapping) -> dict[str, str]:
  """Our MLMHead's params (`transform_dense/kernel`, ..., `bias`) -> HF `cls.predictions.*`."""
  names = {}
  for flax_name in _flat_names(cls_params):
    *module, leaf = flax_name.split("/")
    hf_module = [m.replace("_", ".", 1) for m in module]
    names[flax_name] = ".".join(["cls.predictions", *hf_module, _LEAF_NAMES[leaf]])
  return names


def _flat_names(tree: Mapping, prefix: str = "") -> list[str]:
  return [n for key, value in tree.items() for n in (
      _flat_names(value, f"{prefix}{key}/") if isinstance(value, Mapping) else [prefix + key])]


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


@dataclasses.dataclass
class LoadReport:
  """What `load_bert_towers` loaded and what it left at its initial values."""

  source: str
  loaded: list[str]
  left_at_init: list[str]
  notes: list[str]
  unused: list[str]
  option: str = OPTION             # the init option that asked for the load

  def lines(self) -> list[str]:
    out = [f"{self.option}: BERT weights from {self.source} loaded into "
           + ", ".join(self.loaded)]
    out += [f"  left at init: {x}" for x in self.left_at_init]
    out += [f"  {x}" for x in self.notes]
    if self.unused:
      shown = ", ".join(self.unused[:6]) + (", ..." if len(self.unused) > 6 else "")
      out.append(f"  {len(self.unused)} checkpoint tensors not used: {shown}")
    return out

  def __str__(self) -> str:
    return "\n".join(self.lines())


def load_bert_towers(params: Mapping, path: str, option: str = OPTION) -> tuple[dict, LoadReport]:
  """Loads the checkpoint at `path` into every BERT tower of a REALM parameter tree.

  Retriever tower(s) and reader/bert all start from the checkpoint's BERT; reader/cls takes
  its MLM head (`cls.predictions.*`) when the checkpoint has one (the decoder is tied to the
  word embeddings). The retriever projections stay as initialised. Loaded leaves come back as
  host numpy arrays, the others unchanged. Raises ConfigError for a weight our BERT needs
  that the checkpoint lacks and for every shape mismatch.
  """
  tensors, file = read_weights(path)
  conv = Conversion(tensors, file)
  new = _replaced(params, {})
  loaded, left, heads, projections = [], [], [], []
  for tower_path, ours in _bert_towers(params):
    where = "/".join(tower_path)
    _set(new, tower_path, conv.bert(ours, where))
    loaded.append(where)
    if "pooler" in ours and conv.missing.get("pooler.dense.weight") == "pooler":
      left.append(f"{where}/pooler (the checkpoint has no pooler)")
    parent = _get(params, "/".join(tower_path[:-1]))
    heads += [tower_path[:-1] + ("cls",)] if "cls" in parent else []
    projections += ["/".join(tower_path[:-1] + (name,)) for name in parent
                    if name.startswith("projection")]
  if not loaded:
    raise ValueError("no BERT tower (`bert` with embeddings and encoder) in the params")
  for head_path in heads:
    where = "/".join(head_path)
    if _load_mlm_head(conv, new, head_path, _get(params, where), where):
      loaded.append(where)
    else:
      left.append(f"{where} (MLM head: the checkpoint has no cls.predictions)")
  conv.raise_errors(option, path)
  return new, LoadReport(file, sorted(loaded), left + projections, conv.notes, conv.unused(),
                         option or OPTION)


def _load_mlm_head(conv: Conversion, new: dict, path: tuple, cls_params: Mapping,
                   where: str) -> bool:
  names = _mlm_head_names(cls_params)
  absent = sorted(hf for hf in names.values() if hf not in conv.tensors)
  if len(absent) == len(names):     # no head: left at init, said in the report
    return False
  if absent:                        # part of one: a damaged file, refused with the rest
    conv.mismatches.setdefault("cls.predictions", (
        f"cls.predictions: {len(names) - len(absent)} of the MLM head's {len(names)} tensors "
        f"are in the checkpoint, not {', '.join(absent)} (an incomplete or damaged file? a "
        "checkpoint gives the whole head or none of it)"))
    return False
  flat = {}
  for flax_name, hf_name in names.items():
    value = conv.value(hf_name, flax_name.rsplit("/", 1)[-1], _get(cls_params, flax_name),
                       f"{where}/{flax_name}")
    if value is not None:
      flat[flax_name] = value
  _set(new, path, _replaced(cls_params, flat))
  decoder = conv.tensors.get("cls.predictions.decoder.weight")
  words = conv.tensors.get("embeddings.word_embeddings.weight")
  if "cls.predictions.decoder.bias" in conv.tensors:     # HF ties it to cls.predictions.bias
    conv.used.add("cls.predictions.decoder.bias")
  if decoder is not None:
    conv.used.add("cls.predictions.decoder.weight")
    if words is not None and (decoder.shape != words.shape or not np.allclose(decoder, words)):
      conv.notes.append("cls.predictions.decoder.weight differs from the word embeddings: "
                        "our decoder is tied to them, so it is not used")
  return True

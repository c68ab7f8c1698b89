"""Where a run's parameters start: the retriever and the reader, each from a source of its own.

  init.retriever / init.reader   "random"; a run's workdir (its latest checkpoint, or the step
                                 in init.<part>_step); a Hugging Face BERT or REALM dir; or
                                 pkg:MODULE[/SUBDIR], such a dir inside an installed package
                                 (all-MiniLM-L6-v2: `packages.MINILM`); "" falls back to
  init.from_workdir / init.hf_bert   the older whole-tree options (both parts), else random.

A workdir part restores only that part's parameters, straight into their shardings, once its
shapes are checked against this run's (a mismatch names the config fields that differ), and the
fields that change what they compute (heads, GELU, the retriever's pooling) too. An HF
part is checked field by field against that part's shape (`reading.part_model`) and GELU, a
retriever against the pooling the checkpoint records (`hf_realm_weights.trained_pooling`),
and the data's vocab against the checkpoint's. `start_params` prints where every part came
from and what stayed at its initial values. Resuming a run's own checkpoint is not this module's job
(the trainers resume first and only start from here when there is nothing to resume).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any, Callable

import jax
import numpy as np
from flax import traverse_util

from realm_jax import packages, paths, workdir as workdir_lib
from realm_jax.errors import ConfigError
from realm_jax.config.defaults import PARTS, RANDOM_START
from realm_jax.config.reading import part_model, part_options

logger = logging.getLogger(__name__)

# Parameters a part may lack in a workdir source: Open-QA's span scorer after pre-training.
MAY_BE_MISSING = (("reader", "qa_outputs"),)
# The config.model fields that shape each part's parameters.
SHAPE_FIELDS = {
    "retriever": ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                  "max_position", "retrieval_dim", "share_towers"),
    "reader": ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
               "max_position", "span_hidden_size", "max_span_width")}
# The config.model fields that change what each part's parameters compute, not their shapes:
# a workdir part trained under other values would start as another function (an HF dir is
# checked alike, `hf_bert.bert_config_mismatches` and `check_hf_source`).
COMPUTE_FIELDS = {"retriever": ("num_heads", "hidden_act", "pooling"),
                  "reader": ("num_heads", "hidden_act")}


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one part starts: kind "random", "workdir" (at `step`, -1: latest) or "hf"."""

  part: str
  option: str                      # the option that chose it, for messages
  kind: str
  path: str = ""
  step: int = -1
  url: str = ""                    # an HF dir in a bucket, of which `path` is the local copy

  @property
  def shown(self) -> str:
    return self.url or self.path

  def describe(self) -> str:
    if self.kind == "random":
      return "random init"
    if self.kind == "workdir":
      return f"workdir {self.path}" + (f" step {self.step}" if self.step >= 0 else "")
    return f"HF dir {self.shown}"


@dataclasses.dataclass
class Start:
  """The starting params and what `start_params` reports about them."""

  params: Any
  lines: list[str]
  sources: dict[str, Source]
  steps: dict[str, int]            # part -> the checkpoint step a workdir part came from

  def print(self, prefix: str) -> None:
    """One `PREFIX init PART <- SOURCE` line per part, its details indented below."""
    logger.info("\n".join(f"{prefix}{'  ' if line.startswith(' ') else 'init '}{line.strip()}"
                          for line in self.lines))


def resolve(spec: str, option: str, part: str, step: int = -1) -> Source:
  """One init option's value -> its Source; ConfigError if it is none of the accepted forms."""
  if spec in ("", RANDOM_START):
    if step >= 0:
      raise ConfigError(f"init.{part}_step", f"{step}, but {option}={spec!r} starts at random "
                        "(no checkpoint steps): leave it at -1")
    return Source(part, option, "random")
  path, url = packages.resolve(spec, option), ""
  from realm_jax.interop.hf_bert import WEIGHT_FILES, sharded
  if paths.is_remote(path):   # a run's workdir (read there) or an HF dir (copied here)
    if paths.isdir(paths.join(path, workdir_lib.CHECKPOINTS)):
      return Source(part, option, "workdir", path, step)
    if not paths.exists(paths.join(path, "config.json")):
      raise ConfigError(option, f"{spec!r}: neither checkpoints/ nor config.json under it (a "
                        "bucket URL must be a run's workdir or a Hugging Face dir)")
    url, path = path, paths.local_mirror(path, log=lambda line: logger.info(f"[init] {line}"))
  if os.path.isdir(os.path.join(path, workdir_lib.CHECKPOINTS)):
    return Source(part, option, "workdir", path, step)
  if os.path.isfile(os.path.join(path, "config.json")) and any(
      os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
    if step >= 0:
      raise ConfigError(f"init.{part}_step", f"{step}, but {option}={spec!r} is a Hugging Face "
                        "dir (no checkpoint steps): leave it at -1")
    return Source(part, option, "hf", path, url=url)
  why = "does not exist" if not os.path.exists(path) else "is not a directory" \
      if not os.path.isdir(path) else f"holds neither checkpoints/ nor config.json with " \
      f"{' or '.join(WEIGHT_FILES)}{sharded(path)}"
  raise ConfigError(option, f"{spec!r} is neither a run's workdir nor a Hugging Face BERT / "
                    f"REALM dir: {path} {why}")


def sources(config) -> dict[str, Source]:
  """The Source of each part: init.<part>, else the whole-tree options, else random."""
  init, out = config.init, {}
  for part in PARTS:
    own, step = init.get(part, ""), int(init.get(f"{part}_step", -1))
    if own:
      out[part] = resolve(own, f"init.{part}", part, step)
    elif step >= 0:
      raise ConfigError(f"init.{part}_step", f"{step} is set but init.{part} is empty")
    elif init.from_workdir:
      out[part] = resolve(init.from_workdir, "init.from_workdir", part)
      if out[part].kind != "workdir":
        raise ConfigError("init.from_workdir", f"{init.from_workdir} has no checkpoints/ "
                          "(not a run's workdir; an HF dir goes in init.hf_bert or init.<part>)")
    elif init.get("hf_bert"):
      out[part] = resolve(init.hf_bert, "init.hf_bert", part)
      if out[part].kind != "hf":
        raise ConfigError("init.hf_bert", f"{init.hf_bert} is a run's workdir, not an HF dir")
    else:
      out[part] = Source(part, f"init.{part}", "random")
  return out


def start_params(config, initial: Callable[[], dict], abstract_params, shardings,
                 data_vocab: str, vocab_size: int) -> Start:
  """The run's starting params: each part from its Source (see the module doc).

  Args:
    initial: returns the freshly initialised params (sharded), kept where a part starts at
      random or its source lacks arrays, and filled in by an HF part; called only then (a
      start whose every part is restored whole from workdirs runs no random init).
    abstract_params: their ShapeDtypeStructs with shardings (restore targets).
    shardings: the params' shardings (for parts loaded on the host).
    data_vocab, vocab_size: the data dir's vocab.txt and its size.
  """
  srcs = sources(config)
  out, lines, steps = {}, [], {}
  latest = {}   # a workdir -> the step its "latest" was for the first part read from it: the
                # parts of one source agree, though its run may save another step meanwhile
  for part, src in srcs.items():
    if src.kind == "random":
      out[part] = initial()[part]
      lines.append(f"{part} <- random init (seed {config.seed})")
      continue
    if src.kind == "workdir":
      # one workdir, however spelt (gs://B//W/ and /gcs/B/W: gs://B/W)
      where = paths.bucket_url(paths.absolute(src.path)).rstrip("/")
      pinned = src if src.step >= 0 else dataclasses.replace(src, step=latest.get(where, -1))
      out[part], line, steps[part] = _from_workdir(config, pinned, lambda: initial()[part],
                                                   abstract_params[part], data_vocab)
      if src.step < 0:
        latest.setdefault(where, steps[part])
    else:
      host, line = _from_hf(config, src, initial(), data_vocab, vocab_size)
      out[part] = jax.device_put(host, shardings[part])
    lines += line
  return Start(out, lines, srcs, steps)


def initial_params(config, model, mesh, data):
  """The params a fresh run of `config` starts from (the parts' sources applied), outside a
  trainer: the untrained reference of an evaluation."""
  from realm_jax.runtime import state as state_lib
  make, abstract, shardings = state_lib.deferred_train_state(
      config, model, mesh, data.blocks.block_len, jax.random.split(
          jax.random.PRNGKey(config.seed))[0])
  initial = functools.cache(lambda: make().params)
  return start_params(config, initial, abstract.params, shardings.params,
                      data.tokenizer.vocab_path, data.tokenizer.vocab_size).params


# -- a run's workdir ------------------------------------------------------------------------
def _from_workdir(config, src: Source, initial: Callable[[], Any], abstract, data_vocab: str):
  from realm_jax.runtime.checkpoints import restore_params, saved_param_shapes, shape_mismatches
  part, option = src.part, src.option
  try:
    saved, step = saved_param_shapes(src.path, None if src.step < 0 else src.step)
  except FileNotFoundError as e:
    raise ConfigError(option, str(e)) from None
  ours = {(part, *p): a.shape for p, a in traverse_util.flatten_dict(abstract).items()}
  missing = [p for p in ours if p not in saved]
  wrong = shape_mismatches(saved, ours)
  fatal = [p for p in missing if not any(p[:len(m)] == m for m in MAY_BE_MISSING)]
  if wrong or fatal:
    lines = _field_differences(config, src.path, part) + wrong[:4] + [
        f"{'/'.join(p)}: not in the checkpoint" for p in fatal[:4]]
    more = len(wrong) + len(fatal) - min(len(wrong), 4) - min(len(fatal), 4)
    raise ConfigError(option, f"{src.path} step {step}: its {part} parameters do not fit "
                      f"this run's config:\n  " + "\n  ".join(lines) +
                      (f"\n  ... and {more} more" if more > 0 else ""))
  otherwise = _computes_otherwise(config, src.path, part)
  if otherwise:
    raise ConfigError(option, f"{src.path} step {step}: its {part} parameters compute "
                      f"otherwise under this run's config:\n  " + "\n  ".join(otherwise))
  check_run_vocab(src.path, src.option, data_vocab)
  restored, step, _ = restore_params(src.path, {part: abstract}, step, partial=True,
                                     saved=saved)
  value = restored[part]
  if missing:   # keep our initial values for what the checkpoint lacks
    flat = traverse_util.flatten_dict(initial())
    flat.update(traverse_util.flatten_dict(value))
    value = traverse_util.unflatten_dict(flat)
  fresh = sorted({"/".join(p[:2]) for p in missing})
  line = f"{part} <- {src.option}={src.path} step {step} ({len(ours) - len(missing)} arrays)"
  return value, ([line] + [f"  {note}" for note in _layers_left(saved, ours)]
                 + [f"  left at init: {f} (not in that checkpoint)" for f in fresh]), step


def _layers_left(saved, ours) -> list[str]:
  """A note per tower whose checkpoint has more encoder layers than this run's: its first ones
  are read (as from an HF dir), the others left out."""
  def layers(paths) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in paths:
      if "encoder" in p[:-2]:
        at = p.index("encoder")
        out.setdefault("/".join(p[:at]), set()).add(p[at + 1])
    return out
  theirs, mine = layers(saved), layers(ours)
  return [f"layers of {tower}: the first {len(mine[tower])} of the checkpoint's {len(found)}"
          for tower, found in sorted(theirs.items())
          if tower in mine and len(found) > len(mine[tower])]


def _field_differences(config, workdir: str, part: str) -> list[str]:
  """`option: ours (this run) != theirs (W/config.json)` for each shape field of `part`."""
  from realm_jax.runtime.checkpoints import run_config
  try:
    theirs_config = run_config(workdir)
  except FileNotFoundError:
    return []
  return _differences(config, theirs_config, workdir, part, SHAPE_FIELDS[part])


def _computes_otherwise(config, workdir: str, part: str) -> list[str]:
  """`option: ours (this run) != theirs (W/config.json)` for each COMPUTE_FIELDS field of
  `part` whose value differs (two spellings of one GELU are the same); [] where the run
  recorded no config, or none readable (as `check_run_vocab`)."""
  from realm_jax.runtime.checkpoints import run_config
  try:
    theirs_config = run_config(workdir)
  except (FileNotFoundError, ValueError):   # none, or not a run's JSON
    return []
  return _differences(config, theirs_config, workdir, part, COMPUTE_FIELDS[part])


def _differences(config, theirs_config, workdir: str, part: str, fields) -> list[str]:
  """`option: ours (this run) != theirs (W/config.json)` for each of `fields` of `part`, as
  its tower is built (`_computed`) from `config` and from `theirs_config`, W's: a vocab size
  unset on either side is not compared, two spellings of one GELU are the same."""
  from realm_jax.models.bert import HIDDEN_ACTS
  options = {**part_options(config, part), "pooling": "model.retriever.pooling"}
  lines = []
  for field in fields:
    a, b = (_computed(c, part, field) for c in (config, theirs_config))
    if field == "vocab_size" and not (a and b):
      continue
    same = HIDDEN_ACTS.get(a, a) == HIDDEN_ACTS.get(b, b) if field == "hidden_act" else a == b
    if not same:
      lines.append(f"{options.get(field, 'model.' + field)}: {a!r} (this run) != {b!r} "
                   f"({workdir}/config.json)")
  return lines


def _computed(config, part: str, field: str):
  """`field` of `part` as its tower is built from `config` (`state.build_model`)."""
  if field == "pooling":
    return config.model.retriever.get("pooling", "cls")
  return part_model(config, part).get(field, "gelu" if field == "hidden_act" else None)


def check_run_vocab(workdir: str, option: str, data_vocab: str) -> None:
  """A run's token ids must mean what `data_vocab`'s mean (its data dir's vocab.txt, or the
  checkpoint's own that realm-import-hf keeps in the workdir it writes, or the copy of its
  data's every training run keeps there since 2026-12-06; W local or in a bucket): else a
  ConfigError naming `option` and the first line that differs. A run without W/vocab.txt is
  checked against its recorded data dir's; not checked then: one without a readable
  config.json, or whose recorded data dir is relative (to where it ran, unknown here) or not
  on this machine's disk."""
  from realm_jax.interop import hf_bert
  from realm_jax.runtime.checkpoints import run_config
  if paths.exists(paths.join(workdir, workdir_lib.VOCAB)):   # (in a bucket too)
    hf_bert.check_vocab(data_vocab, workdir, option)
    return
  try:
    data_dir = run_config(workdir).data.dir
  except (FileNotFoundError, ValueError):   # none, or not JSON: the caller's config rules
    return
  theirs = os.path.join(data_dir, "vocab.txt") if data_dir else ""
  if os.path.isabs(theirs) and os.path.isfile(theirs) and \
      os.path.abspath(theirs) != os.path.abspath(data_vocab):
    hf_bert.check_vocab(data_vocab, data_dir, option)


# -- a Hugging Face dir ---------------------------------------------------------------------
def check_hf_source(config, src: Source, data_vocab: str, vocab_size: int) -> str:
  """ConfigError (naming src.option) unless the HF dir fits its part's shape and the data's
  vocab is the checkpoint's; returns the checkpoint's layout ("bert" or a REALM class)."""
  from realm_jax.interop import hf_bert, hf_realm_weights
  part, option, path = src.part, src.option, src.path
  try:
    layout, hf = hf_realm_weights.read_hf_config(path)
  except ConfigError as e:
    raise ConfigError(option, str(e)) from None
  lines = hf_bert.bert_config_mismatches(part_model(config, part), hf, vocab_size=vocab_size,
                                         source=os.path.join(path, "config.json"),
                                         options=part_options(config, part))
  if layout != "bert" and part == "retriever" and \
      int(hf["retriever_proj_size"]) != config.model.retrieval_dim:
    lines.append(f"model.retrieval_dim: {config.model.retrieval_dim} (config) != "
                 f"{hf['retriever_proj_size']} ({path}/config.json)")
  if part == "retriever":   # under the other pooling it would embed as another model
    (trained, where), ours = (hf_realm_weights.trained_pooling(path, layout),
                              _computed(config, part, "pooling"))
    if trained and trained != ours:
      lines.append(f"model.retriever.pooling: {ours!r} (config) != {trained!r} ({where})")
  if layout in ("RealmReader", "RealmForOpenQA") and part == "reader" and \
      config.task == "openqa":   # the span scorer's settings (its width a shape too: the
    # load would advise model.hidden_size for each qa_outputs tensor)
    for ours, theirs, kind in (("span_hidden_size", "span_hidden_size", int),
                               ("max_span_width", "max_span_width", int),
                               ("span_layer_norm_eps", "reader_layer_norm_eps", float)):
      if kind(hf[theirs]) != kind(config.model[ours]):
        lines.append(f"model.{ours}: {config.model[ours]} (config) != {theirs} {hf[theirs]} "
                     f"({path}/config.json)")
  if lines:
    raise ConfigError(option, f"{path} does not fit the {part}'s config:\n  " +
                      "\n  ".join(lines))
  hf_bert.check_vocab(data_vocab, path, option)
  from realm_jax.data.tokenizer import check_uncased
  check_uncased(path, option, src.shown)
  return layout


def _from_hf(config, src: Source, params, data_vocab: str, vocab_size: int):
  from realm_jax.interop import hf_bert, hf_realm_weights
  part, option, path = src.part, src.option, src.path
  layout = check_hf_source(config, src, data_vocab, vocab_size)
  host = jax.tree.map(np.asarray, dict(params))
  if layout == "bert":
    new, report = hf_bert.load_bert_towers({part: host[part]}, path, option)
    head = f"{part} <- {option}={src.shown} (BERT: {', '.join(report.loaded)})"
    said = " ".join(report.loaded + report.left_at_init)
    others = [f"  left at init: {part}/{key} (not in a BERT checkpoint)" for key in host[part]
              if f"{part}/{key}" not in said]
    return new[part], ([head] + [f"  {line.strip()}" for line in report.lines()[1:]]
                       + others)
  tensors, file = hf_bert.read_weights(path)
  new, report = hf_realm_weights.convert(host, tensors, layout, file, path, only=part,
                                         option=option)
  if not report.from_hf:
    raise ConfigError(option, f"{path} is a {layout}, which holds no {part} parameters")
  if part == "retriever" and "block_emb" in tensors:   # RealmForOpenQA's: no parameter
    report.notes.append(f"block_emb (the blocks' embeddings) is not read by {option}: "
                        f"realm-import-hf --hf-dir {src.shown} --out W2 publishes it as W2's "
                        "index, and an Open-QA run started from init.retriever=W2 retrieves "
                        "from it")
  left = sorted({"/".join(p.split("/")[:3]) for p in report.initialised})
  unused = [f"  not used: {len(report.unused)} arrays of the checkpoint ("
            f"{', '.join(report.unused[:4])}{', ...' if len(report.unused) > 4 else ''})"] \
      if report.unused else []
  return new[part], ([f"{part} <- {option}={src.shown} ({layout}, "
                      f"{len(report.from_hf)} arrays)"]
                     + [f"  left at init: {x}" for x in left]
                     + [f"  note: {x}" for x in report.notes] + unused)

"""Which options a workdir's checkpoints fix: a run resumes only under the same values of the
compatibility fields (execution fields may change; fields added later read as the value old
checkpoints were written under)."""

from __future__ import annotations

from realm_jax.config.defaults import TOWER_FIELDS
from realm_jax.config.reading import (config_record, flat_options, freezing_options,
                                      frozen_paths, option_parent, part_model,
                                      uses_index_builder)

# Fields that fix parameter shapes or the meaning of a checkpoint: a workdir whose
# checkpoints were written under other values cannot be resumed.
# The seed orders the examples: the checkpoints' input position means a place in its order.
COMPATIBILITY_FIELDS = ("task", "model", "data.query_len", "data.block_len", "retrieval.k",
                        "retrieval.candidates", "train.batch_size", "seed")
# Fields a task's checkpoints fix besides: an Open-QA run trained on the questions its split
# leaves for training, so resuming under another split would test on questions it trained on;
# a pre-training run's input position indexes into the examples of its data.split.
TASK_FIELDS = {"openqa": ("qa.heldout_articles", "qa.heldout_unit"),
               "ict": ("data.split",), "realm": ("data.split",)}
# A field -> the field without which it has no effect (compared only where that one is set on
# either side): the unit of a split that holds out nothing fixes nothing.
INERT_WITHOUT = {"qa.heldout_unit": "qa.heldout_articles"}
# Fields under `model` that decide how the step computes, not what the parameters mean: a run
# may resume with other values (e.g. in bfloat16, or with remat to fit a smaller device).
EXECUTION_FIELDS = ("model.dtype", "model.attention", "model.remat")
# Fields under `model` that change what restored parameters compute without changing their
# shapes (a checkpoint of other shapes is refused by them): an evaluation under other values
# would score another model. `model.retriever.*` ones unset read as the reader's; the span
# scorer's only matter where the checkpoint has one.
INFERENCE_FIELDS = ("model.hidden_act", "model.num_heads", "model.num_layers",
                    "model.retriever.hidden_act", "model.retriever.num_heads",
                    "model.retriever.num_layers", "model.retriever.pooling")
READER_INFERENCE_FIELDS = ("model.span_layer_norm_eps",)
# Fields added later -> the value a run saved without them ran under, whatever the default
# becomes: compatibility fields at the value its checkpoints were written under, and options
# a run may resume under other values of (train.optimizer: both forms keep the same state;
# data.long_queries; qa.reader_len: no parameter depends on it; the retriever-learning
# options, which runs before them trained as their defaults do) at what it ran with, so that
# such a resume is said as other learning-rate values are (`workdir.recorded_differences`).
# (Not those that change no figure of a run: retrieval.score_cache_gb, train.profile_*.)
ADDED_FIELDS = {"model.hidden_act": "gelu", "model.attention_dropout_rate": -1.0,
                "model.retriever.pooling": "cls", "qa.heldout_articles": 0.0,
                "qa.heldout_unit": "article", "train.optimizer": "optax_adamw",
                "data.long_queries": "refuse", "qa.reader_len": 0,
                "retrieval.train_null_document": True, "retrieval.loss": "marginal",
                "retrieval.distill_temperature": 1.0, "retrieval.retriever_temperature": 1.0,
                "retrieval.distill_queries": "all", "retrieval.block_gradients": True,
                "retrieval.packed_query_rows": 0, "retrieval.own_block_share": 0.5,
                "retrieval.own_context": False, "retrieval.score_cache": False,
                **{f"model.retriever.{f}": None for f in TOWER_FIELDS}}


def with_added_fields(record: dict) -> dict:
  """A run's saved config `record` (the JSON of W/config.json) with the options added since it
  was written: an ADDED_FIELDS one at the value it ran under, any other at its default. A
  run's own config read back to run under (realm-eval without --config, realm-predict) then
  holds every option the code reads."""
  import copy
  from realm_jax.config.defaults import base_config
  out = _merged(config_record(base_config()), copy.deepcopy(record))
  recorded = flat_options(record)
  for name, value in ADDED_FIELDS.items():
    parent, leaf = option_parent(out, name)
    if name not in recorded and parent is not None:
      parent[leaf] = value
  return out


def _merged(defaults: dict, record: dict) -> dict:
  """`record` over `defaults`, group by group."""
  out = dict(defaults)
  for key, value in record.items():
    nested = isinstance(value, dict) and isinstance(defaults.get(key), dict)
    out[key] = _merged(defaults[key], value) if nested else value
  return out


def incompatible_fields(saved: dict, current: dict) -> list[str]:
  """`field: saved -> current` for every compatibility field whose value changed."""
  saved_flat, current_flat = flat_options(saved), flat_options(current)
  built = [_tower_resolved(c) for c in (saved, current)]
  diffs = [f"{name}: {a!r} (checkpoints) != {b!r} (this run)" for name, a, b in changed_fields(
      saved_flat, current_flat, COMPATIBILITY_FIELDS + task_fields(saved, current))
      if not _same_tower(name, *built)]
  return diffs + _index_source_differs(saved, current, saved_flat, current_flat) + \
      _frozen_differs(saved, current, current_flat)


def inference_differences(saved: dict, current: dict, reader: bool) -> list[str]:
  """`field: run != config` for every INFERENCE_FIELDS option (and, with the span `reader`,
  READER_INFERENCE_FIELDS) whose effective value differs between the run's record `saved`
  and `current`."""
  fields = INFERENCE_FIELDS + (READER_INFERENCE_FIELDS if reader else ())
  effective = [_tower_resolved(c) for c in (saved, current)]
  return [f"{name}: {a!r} (the run) != {b!r} (this config)"
          for name, a, b in changed_fields(*effective, fields)]


def _same_tower(name: str, saved_built: dict, current_built: dict) -> bool:
  """Whether `name` is a `model.retriever.<field>` that builds the same retriever on both
  sides (set to the reader's value on one, unset on the other: one model, `state.build_model`);
  its reader's `model.<field>`, where that changed, is named on its own."""
  return name.startswith("model.retriever.") and name.split(".")[-1] in TOWER_FIELDS and \
      _norm(saved_built.get(name)) == _norm(current_built.get(name))


def _tower_resolved(config: dict) -> dict:
  """The flat options of the record `config`, each `model.retriever.<field>` as the retriever
  is built from it (`reading.part_model`: unset, the reader's `model.<field>`)."""
  import ml_collections
  flat = flat_options(config)
  tower = part_model(ml_collections.ConfigDict(config), "retriever")
  flat.update({f"model.retriever.{f}": tower.get(f, ADDED_FIELDS.get(f"model.{f}"))
               for f in TOWER_FIELDS})
  return flat


def task_fields(saved: dict, current: dict) -> tuple[str, ...]:
  """The TASK_FIELDS of the saved run's task, where both configs have that task."""
  same = saved.get("task") == current.get("task")
  return TASK_FIELDS.get(saved.get("task"), ()) if same else ()


def changed_fields(saved_flat: dict, current_flat: dict,
                   fields: tuple[str, ...]) -> list[tuple[str, object, object]]:
  """(option, saved value, current value) for each option in or under `fields` whose value
  changed: an option absent from a side reads as its ADDED_FIELDS value; EXECUTION_FIELDS and
  an option inert without its INERT_WITHOUT field on both sides are not compared."""
  value = lambda flat, name: flat.get(name, ADDED_FIELDS.get(name))
  changed = []
  for name in sorted(set(saved_flat) | set(current_flat)):
    if name in EXECUTION_FIELDS:
      continue
    if name in INERT_WITHOUT and not (value(saved_flat, INERT_WITHOUT[name]) or
                                      value(current_flat, INERT_WITHOUT[name])):
      continue
    if any(name == f or name.startswith(f + ".") for f in fields):
      a, b = value(saved_flat, name), value(current_flat, name)
      if _norm(a) != _norm(b):
        changed.append((name, a, b))
  return changed


def _index_source_differs(saved: dict, current: dict, saved_flat: dict,
                          current_flat: dict) -> list[str]:
  """A REALM run retrieving from the index keeps the snapshot its index was built from in
  the checkpoints when it rebuilds in process, nothing when realm-index builds it: the
  `retrieval` item differs, so the switch is refused here rather than every checkpoint read
  as unreadable."""
  if uses_index_builder(saved) == uses_index_builder(current):
    return []
  was, now = saved_flat.get("retrieval.refresh"), current_flat.get("retrieval.refresh")
  return [f"retrieval.refresh: {was!r} (checkpoints) != {now!r} (this run): in-process "
          "rebuilds and realm-index's versions checkpoint the index differently; to switch, "
          "start a new workdir with init.from_workdir"]


def _frozen_differs(saved: dict, current: dict, current_flat: dict) -> list[str]:
  """The freezing options that changed, where they change what the run trains: the optimiser
  keeps no state for a frozen sub-tree (`frozen_paths`), so the checkpoints' optimiser state
  has another shape. A learning-rate scale changed between two non-zero values is no diff,
  nor is `retrieval.block_gradients` where no block tower of its own exists."""
  shared = current_flat.get("model.share_towers", False)   # a change is named above
  was, now = _frozen(frozen_paths(saved), shared), _frozen(frozen_paths(current), shared)
  if was == now or saved.get("task") != current.get("task"):   # a new task is named above
    return []
  names = lambda paths: "+".join("/".join(p) for p in paths) or "nothing"
  before, after = freezing_options(saved), freezing_options(current)
  changed = [f for f in before if before[f] != after[f]]
  return [f"{', '.join(changed) or 'the freezing options'} changes the frozen parameters: "
          f"{names(was)} (checkpoints) != {names(now)} (this run); to train other parameters, "
          f"start a new workdir with init.from_workdir"]


def _frozen(paths: tuple[tuple[str, ...], ...], shared_towers: bool) -> tuple:
  """The sub-trees `paths` freeze in a model: no block tower where the towers are shared, and
  no path inside another."""
  paths = [p for p in paths if not (shared_towers and p == ("retriever", "block_tower"))]
  return tuple(p for p in paths if not any(q != p and p[:len(q)] == q for q in paths))


def _norm(v):
  return list(map(_norm, v)) if isinstance(v, (list, tuple)) else v

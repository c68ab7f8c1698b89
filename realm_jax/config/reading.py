"""What a config says, read the same way everywhere: each part's tower shape (the retriever's
`model.retriever.*` over the shared `model.*`), the flat option names, and the questions the
trainer, the builder and the evaluators ask of a config."""

from __future__ import annotations

import ml_collections

from realm_jax.config.defaults import PARTS, TOWER_FIELDS

def config_record(config) -> dict:
  """`config` as the plain JSON record a workdir keeps (W/config.json) and compares against:
  ml_collections' best-effort JSON, read back into dicts and lists."""
  import json
  return json.loads(config.to_json_best_effort())


def retriever_own_fields(config) -> dict:
  """The `model.retriever.*` fields set apart from `model.*`: those not None (configs saved
  before the per-tower shapes have none)."""
  own = config.model.get("retriever") or {}
  return {f: own[f] for f in TOWER_FIELDS if own.get(f) is not None}


def part_model(config, part: str) -> ml_collections.ConfigDict:
  """`config.model` with the shape of `part` ("retriever" or "reader"): the retriever's
  `model.retriever.*` fields replace the shared ones where set."""
  if part not in PARTS:
    raise ValueError(f"part {part!r} is not one of {PARTS}")
  m = ml_collections.ConfigDict(config.model.to_dict())
  if "retriever" in m:
    del m["retriever"]
  if part == "retriever":
    m.update(retriever_own_fields(config))
  return m


def part_options(config, part: str) -> dict[str, str]:
  """field -> the option that decides it for `part` in this config: model.retriever.X where
  the retriever sets X itself, else model.X."""
  own = retriever_own_fields(config) if part == "retriever" else {}
  return {f: f"model.retriever.{f}" if f in own else f"model.{f}" for f in TOWER_FIELDS}


def flat_options(config, prefix: str = "") -> dict:
  """{dotted name: value} of every leaf option of a ConfigDict or of its JSON record."""
  out = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    out.update(flat_options(value, name + ".") if hasattr(value, "items") else {name: value})
  return out


def option_parent(root, name: str):
  """(the mapping that holds dotted option `name`'s leaf under `root`, the leaf's key): `root`
  a ConfigDict or its JSON record; the mapping is None where a level is missing or no mapping."""
  *parents, leaf = name.split(".")
  node = root
  for key in parents:
    node = node.get(key) if hasattr(node, "get") else None
  return (node if hasattr(node, "keys") else None), leaf


def null_in_training(config) -> bool:
  """Whether a REALM training batch's candidate 0 is the null document (saved configs from
  before `retrieval.train_null_document`: yes)."""
  r = config.retrieval
  return r.candidates != "index" or r.get("train_null_document", True)


def retriever_scores_candidates(config) -> bool:
  """Whether the retriever scores a REALM batch's candidates (f(x, z) -> p(z|x)): the
  `index` mode (`train.candidate_rows`' `scored`); the warm-ups and the no-retrieval baseline
  fix p(z|x), so their retriever gets no gradient."""
  return config.retrieval.candidates == "index"


def uses_index_builder(config) -> bool:
  """Whether the trainer takes its index versions from the separate realm-index job (REALM
  retrieving from the index, refreshed async or deterministic), which then must run beside it
  (`config` a ConfigDict or its JSON record)."""
  r = config.get("retrieval") or {}
  return config.get("task") == "realm" and r.get("candidates") == "index" and \
      r.get("refresh", "in_process") != "in_process"


def freezing_options(config) -> dict[str, bool]:
  """For each option beside `task` that decides `frozen_paths`, whether its value freezes
  something (`config` a ConfigDict or its JSON record; an option missing from an old record
  reads as its default). The optimiser keeps no state for a frozen sub-tree, so a checkpoint
  restores only under the same frozen sub-trees (`compatibility`)."""
  t, r = config["train"], config.get("retrieval") or {}
  return {"train.retriever_lr_scale": t.get("retriever_lr_scale", 1.0) == 0,
          "train.reader_lr_scale": t.get("reader_lr_scale", 1.0) == 0,
          "retrieval.block_gradients": not r.get("block_gradients", True)}


def frozen_paths(config) -> tuple[tuple[str, ...], ...]:
  """Every parameter sub-tree the run does not train, as path prefixes: a half whose learning
  rate scale is 0 (`train.retriever_lr_scale`, `train.reader_lr_scale`), and a block tower of
  its own that the steps never use: Open-QA's (the block tower and the index built from it
  stay fixed, as in ORQA and REALM's fine-tuning) and REALM's with `retrieval.block_gradients`
  False (the index's block embeddings score the candidates; weight decay alone would shrink
  the tower the index is rebuilt from; the null document's embedding, which that tower
  computes, stays fixed with it). The one owner of freezing: the optimiser
  (`runtime.state.make_optimizer`) neither updates nor decays these, and the steps
  (`runtime.state.stop_frozen_gradients`) compute no gradient for them. `config` is a
  ConfigDict or its JSON record, as in `freezing_options`."""
  freezes = freezing_options(config)
  halves = tuple((part,) for part in ("retriever", "reader")
                 if freezes[f"train.{part}_lr_scale"])
  fixed_blocks = config["task"] == "openqa" or (
      config["task"] == "realm" and freezes["retrieval.block_gradients"])
  return halves + ((("retriever", "block_tower"),) if fixed_blocks else ())

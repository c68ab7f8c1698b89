"""What a config says, read the same way everywhere: each part's tower shape (the retriever's
`model.retriever.*` over the shared `model.*`), the flat option names, and the questions the
trainer, the builder and the evaluators ask of a config."""

from __future__ import annotations

import ml_collections

from realm_jax.config.defaults import PARTS, TOWER_FIELDS

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


def uses_index_builder(config) -> bool:
  """Whether the trainer takes its index versions from the separate realm-index job (REALM
  retrieving from the index, refreshed async or deterministic), which then must run beside it."""
  r = config.retrieval
  return config.task == "realm" and r.candidates == "index" and r.refresh != "in_process"

"""Freezing has one owner (config/reading.py, `frozen_paths`): the steps compute no gradient
for a frozen sub-tree, the optimiser neither updates nor decays it, and a workdir resumes only
under the same frozen sub-trees."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.config.compatibility import incompatible_fields
from realm_jax.config.defaults import base_config
from realm_jax.config.reading import frozen_paths
from realm_jax.runtime import state as state_lib


def params():
  leaf = lambda v: jnp.full((2,), v, jnp.float32)
  return {"retriever": {"query_tower": {"kernel": leaf(1.0)}, "block_tower": {"kernel": leaf(2.0)}},
          "reader": {"kernel": leaf(3.0)}}


def test_what_a_run_freezes():
  c = base_config()
  assert frozen_paths(c) == ()
  c.train.reader_lr_scale = 0.0
  assert frozen_paths(c) == (("reader",),)
  c.task, c.train.reader_lr_scale, c.train.retriever_lr_scale = "openqa", 1.0, 0.0
  assert frozen_paths(c) == (("retriever",), ("retriever", "block_tower"))
  c = base_config()
  c.task, c.retrieval.block_gradients = "realm", False   # the index's embeddings score blocks
  assert frozen_paths(c) == (("retriever", "block_tower"),)
  c.task = "ict"                                         # ICT trains both towers
  assert frozen_paths(c) == ()


def test_a_block_tower_the_realm_step_does_not_use_is_not_decayed():
  """With `retrieval.block_gradients` False the REALM step scores its candidates with the
  index's block embeddings: the block tower's gradient is zero, and AdamW's weight decay must
  not shrink it either (the builder re-embeds the corpus with it)."""
  c = base_config()
  c.task, c.retrieval.block_gradients, c.train.lr, c.train.warmup_steps = "realm", False, 1e-2, 0
  p = params()
  tx = state_lib.make_optimizer(c.train, frozen_paths(c))
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)
  assert not np.asarray(updates["retriever"]["block_tower"]["kernel"]).any()
  assert np.asarray(updates["retriever"]["query_tower"]["kernel"]).all()   # decayed
  assert np.asarray(updates["reader"]["kernel"]).all()


def test_frozen_sub_trees_get_no_gradient_and_no_update():
  c = base_config()
  c.task, c.train.reader_lr_scale, c.train.lr, c.train.warmup_steps = "openqa", 0.0, 1e-2, 0
  frozen = frozen_paths(c)
  p = params()
  loss = lambda q: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(
      state_lib.stop_frozen_gradients(q, frozen)))
  grads = jax.grad(loss)(p)
  assert np.asarray(grads["retriever"]["query_tower"]["kernel"]).all()
  assert not np.asarray(grads["retriever"]["block_tower"]["kernel"]).any()
  assert not np.asarray(grads["reader"]["kernel"]).any()
  tx = state_lib.make_optimizer(c.train, frozen)
  ones = jax.tree.map(jnp.ones_like, p)     # a gradient everywhere: the optimiser must drop it
  updates, _ = tx.update(ones, tx.init(p), p)
  assert np.asarray(updates["retriever"]["query_tower"]["kernel"]).all()
  assert not np.asarray(updates["retriever"]["block_tower"]["kernel"]).any()
  assert not np.asarray(updates["reader"]["kernel"]).any()     # no update, no weight decay


def test_a_resume_under_other_frozen_parameters_is_refused_naming_the_option():
  """The optimiser keeps no state for a frozen sub-tree, so its state's shape follows
  `frozen_paths`: the workdir check names the option that changed it (a restore would fail
  with no option named)."""
  record = lambda c: json.loads(c.to_json_best_effort())
  c = base_config()
  c.task = "realm"
  saved = record(c)
  c.train.reader_lr_scale = 0.0
  frozen = record(c)
  p = params()
  structure = lambda cfg: jax.tree.structure(
      state_lib.make_optimizer(cfg.train, frozen_paths(cfg)).init(p))
  assert structure(base_config()) != structure(c)          # why a restore would fail
  (diff,) = incompatible_fields(saved, frozen)
  assert diff.startswith("train.reader_lr_scale changes the frozen parameters: nothing "
                         "(checkpoints) != reader (this run)")
  c.train.reader_lr_scale, c.train.retriever_lr_scale = 0.5, 2.0   # other non-zero scales
  assert incompatible_fields(saved, record(c)) == []
  c.retrieval.block_gradients = False                      # REALM: the block tower freezes
  (diff,) = incompatible_fields(saved, record(c))
  assert "retrieval.block_gradients" in diff and "retriever/block_tower (this run)" in diff
  c.model.share_towers = True                              # ... unless it is the query's
  shared = record(c)
  c.retrieval.block_gradients = True
  assert incompatible_fields(shared, record(c)) == []
  c.model.share_towers, c.train.retriever_lr_scale = False, 0.0   # the retriever frozen whole
  whole = record(c)
  c.retrieval.block_gradients = False
  assert incompatible_fields(whole, record(c)) == []
  ict = base_config()
  ict.task = "ict"                                         # ICT trains both towers anyway
  ict_saved = record(ict)
  ict.retrieval.block_gradients = False
  assert incompatible_fields(ict_saved, record(ict)) == []
  del saved["train"]["reader_lr_scale"]                    # a record from before the option
  assert incompatible_fields(saved, record(base_config()) | {"task": "realm"}) == []
  now = record(base_config()) | {"task": "realm"}
  now["train"]["retriever_lr_scale"] = 0.0                 # only the option that freezes named
  (diff,) = incompatible_fields(saved, now)
  assert diff.startswith("train.retriever_lr_scale changes the frozen parameters: nothing "
                         "(checkpoints) != retriever (this run)")

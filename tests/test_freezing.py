"""Freezing has one owner (runtime/state.py, `frozen_paths`): the steps compute no gradient
for a frozen sub-tree and the optimiser neither updates nor decays it."""

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.config.defaults import base_config
from realm_jax.runtime import state as state_lib


def params():
  leaf = lambda v: jnp.full((2,), v, jnp.float32)
  return {"retriever": {"query_tower": {"kernel": leaf(1.0)}, "block_tower": {"kernel": leaf(2.0)}},
          "reader": {"kernel": leaf(3.0)}}


def test_what_a_run_freezes():
  c = base_config()
  assert state_lib.frozen_paths(c) == ()
  c.train.reader_lr_scale = 0.0
  assert state_lib.frozen_paths(c) == (("reader",),)
  c.task, c.train.reader_lr_scale, c.train.retriever_lr_scale = "openqa", 1.0, 0.0
  assert state_lib.frozen_paths(c) == (("retriever",), ("retriever", "block_tower"))
  c = base_config()
  c.task, c.retrieval.block_gradients = "realm", False   # the index's embeddings score blocks
  assert state_lib.frozen_paths(c) == (("retriever", "block_tower"),)
  c.task = "ict"                                         # ICT trains both towers
  assert state_lib.frozen_paths(c) == ()


def test_a_block_tower_the_realm_step_does_not_use_is_not_decayed():
  """With `retrieval.block_gradients` False the REALM step scores its candidates with the
  index's block embeddings: the block tower's gradient is zero, and AdamW's weight decay must
  not shrink it either (the builder re-embeds the corpus with it)."""
  c = base_config()
  c.task, c.retrieval.block_gradients, c.train.lr, c.train.warmup_steps = "realm", False, 1e-2, 0
  p = params()
  tx = state_lib.make_optimizer(c.train, state_lib.frozen_paths(c))
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)
  assert not np.asarray(updates["retriever"]["block_tower"]["kernel"]).any()
  assert np.asarray(updates["retriever"]["query_tower"]["kernel"]).all()   # decayed
  assert np.asarray(updates["reader"]["kernel"]).all()


def test_frozen_sub_trees_get_no_gradient_and_no_update():
  c = base_config()
  c.task, c.train.reader_lr_scale, c.train.lr, c.train.warmup_steps = "openqa", 0.0, 1e-2, 0
  frozen = state_lib.frozen_paths(c)
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

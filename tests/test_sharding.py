"""One train step on a single device and on a 2x4 mesh (batch over `data`, tensor parallel over
`model`): same loss, same gradients (ICT, REALM, and REALM with a retriever of another size than
the reader); and the parameter shardings the default rules give on 1x8 and 2x4.

The model is sized so every tensor-parallel dim divides 8: hidden 64, 8 heads, mlp 128, and
`model.vocab_size` set explicitly to the tokenizer's vocab rounded up to a multiple of 8
(state and steps are built directly, so the data-dir vocab check of `validate` does not apply;
the extra embedding rows are simply never looked up)."""

import jax
import numpy as np
import pytest

from realm_jax.train import batches, candidate_rows, steps
from realm_jax.runtime import partitioning, state as state_lib
from tests.helpers import drawn_state, tiny_config

pytestmark = pytest.mark.slow   # the slow tier: `make test` runs it, `make test-fast` does not

MESHES = {"1 device": (1, 1), "1x8": (1, 8), "2x4": (2, 4)}


def sharding_config(run, world_dir, vocab_size):
  """run: "ict", "realm" or "towers" (REALM whose retriever is smaller than its reader)."""
  task = "ict" if run == "ict" else "realm"
  config = tiny_config(task, None, world_dir)
  m = config.model
  m.hidden_size, m.num_heads, m.intermediate_size, m.retrieval_dim = 64, 8, 128, 32
  m.vocab_size = -(-vocab_size // 8) * 8
  if run == "towers":   # every tensor-parallel dim of the retriever still divides 8
    m.share_towers = False
    r = m.retriever
    r.hidden_size, r.num_heads, r.intermediate_size, r.num_layers = 32, 8, 96, 1
  if task == "realm":
    config.retrieval.k = 4                    # null + 3 blocks, re-scored by the retriever
    config.train.retriever_lr_scale = 0.1     # train both halves: gradients everywhere
  return config


def host_batch(config, data):
  examples = data.examples("train")
  queries = batches.QueryBatches(config, data, examples)(0)
  if config.task == "ict":
    return queries
  # A fixed stand-in for the index's top k+1 (the index itself is not under test here).
  retrieved = np.random.default_rng(0).integers(
      0, data.blocks.num_blocks, (len(queries["query_ids"]), config.retrieval.k + 1))
  cands = candidate_rows.of(config).rows(data, queries, retrieved)
  assert cands.shape[1] == config.retrieval.k and (cands[:, 0] == -1).all()
  return batches.realm_batch(config, data, queries, cands)


def reference_state(config, data):
  """The train state (`drawn` params) made once, on a single device."""
  model = state_lib.build_model(config, data.tokenizer.vocab_size)
  mesh = partitioning.make_mesh((1, 1), jax.devices()[:1])
  state, _, _ = drawn_state(config, model, mesh, data.blocks.block_len)
  return model, jax.device_get(state)


def run_on_mesh(config, data, model, host_state, mesh_shape, train_step):
  """Loss and gradients (jax.grad of the task's loss fn under the mesh and the logical rules),
  and optionally the metrics of the jitted train step, for the same state and batch."""
  devices = jax.devices()[:int(np.prod(mesh_shape))]
  mesh = partitioning.make_mesh(mesh_shape, devices)
  _, shardings = state_lib.abstract_train_state(config, model, mesh, data.blocks.block_len)
  params = jax.tree.map(jax.device_put, host_state.params, shardings.params)
  batch = partitioning.global_batch(host_batch(config, data), mesh)
  rules = partitioning.logical_rules(config.mesh.rules)
  loss_fn = steps.LOSS_FNS[config.task]
  rng = jax.random.PRNGKey(1)

  def grads_fn(params, batch, rng):
    return jax.value_and_grad(loss_fn, has_aux=True)(params, model, batch, config, rng)

  with partitioning.mesh_rules(mesh, rules):
    (loss, _), grads = jax.jit(grads_fn, in_shardings=(
        shardings.params, partitioning.batch_sharding(mesh), partitioning.replicated(mesh)))(
            params, batch, jax.random.fold_in(rng, 0))
  out = {"mesh": mesh, "shardings": shardings, "loss": float(loss),
         "grads": jax.device_get(grads)}
  if train_step:
    # Leaf by leaf: the state takes the treedef (optimizer object included) of `shardings`.
    state = jax.tree.unflatten(jax.tree.structure(shardings), [
        jax.device_put(x, s) for x, s in zip(jax.tree.leaves(host_state),
                                             jax.tree.leaves(shardings), strict=True)])
    _, metrics = steps.make_train_step(config, model, shardings, mesh)(state, batch, rng)
    out["metrics"] = jax.device_get(metrics)
  return out


_RUNS = {}


def runs_for(run, world_dir, world_data):
  """Runs of `run` (see sharding_config) on the meshes (computed once per module)."""
  if run not in _RUNS:
    config = sharding_config(run, world_dir, world_data.tokenizer.vocab_size)
    task = config.task
    if run != "ict":
      model, host_state = reference_state(config, world_data)
    else:   # same model, same parameter tree: reuse REALM's initial state (params only used)
      _, host_state, _ = runs_for("realm", world_dir, world_data)
      model = state_lib.build_model(config, world_data.tokenizer.vocab_size)
    # 2x4 splits the batch over `data` (ICT's in-batch softmax, REALM's marginal) and every
    # tensor-parallel dim over `model`: what 1x8 splits, 8 ways instead of 4 (the rules and
    # constraints are the same; test_default_rules_shard_parameters_over_model reads 1x8's).
    runs = {name: run_on_mesh(config, world_data, model, host_state, MESHES[name],
                              train_step=name == "2x4" and task == "realm")
            for name in ("1 device", "2x4")}
    _RUNS[run] = config, host_state, runs
  return _RUNS[run]


@pytest.fixture(scope="module", params=["realm", "ict", "towers"])
def results(request, world_dir, world_data):
  yield runs_for(request.param, world_dir, world_data)


@pytest.fixture(scope="module")
def realm_results(world_dir, world_data):
  yield runs_for("realm", world_dir, world_data)
  _RUNS.clear()


def flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_same_loss_and_gradients_on_every_mesh(results):
  config, _, runs = results
  ref = runs["1 device"]
  ref_grads = flat(ref["grads"])
  assert np.isfinite(ref["loss"]) and ref["loss"] > 0
  # Both halves (for ICT the retriever alone) get real gradients.
  nonzero = {k for k, g in ref_grads.items() if np.abs(g).max() > 0}
  assert any("retriever" in k for k in nonzero)
  assert any("reader" in k for k in nonzero) == (config.task == "realm")
  for name in set(runs) - {"1 device"}:
    run = runs[name]
    np.testing.assert_allclose(run["loss"], ref["loss"], rtol=1e-5, atol=1e-5, err_msg=name)
    grads = flat(run["grads"])
    assert grads.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
      np.testing.assert_allclose(grads[key], g, rtol=1e-5, atol=1e-5, err_msg=f"{name} {key}")
    # Relative to the gradient's size too (ICT's gradients at init are small: its towers
    # barely tell the blocks apart yet, so float32 keeps only ~3 digits of them).
    diff = np.sqrt(sum(float(((grads[k] - g) ** 2).sum()) for k, g in ref_grads.items()))
    assert diff <= (1e-4 if config.task == "realm" else 1e-2) * global_norm(ref_grads), name
  if config.task != "realm":
    return
  # The jitted train step (2x4 mesh) reports the same loss and gradient norm.
  metrics = runs["2x4"]["metrics"]
  np.testing.assert_allclose(metrics["loss"], ref["loss"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], global_norm(ref_grads), rtol=1e-4)


def global_norm(grads):
  return np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values()))


def spec(sharding):
  """PartitionSpec as a tuple without trailing Nones (P(None,) and P() are the same layout)."""
  entries = list(sharding.spec)
  while entries and entries[-1] is None:
    entries.pop()
  return tuple(entries)


def test_default_rules_shard_parameters_over_model(realm_results, world_data):
  config, _, runs = realm_results
  mesh = partitioning.make_mesh(MESHES["1x8"], jax.devices()[:8])
  model = state_lib.build_model(config, world_data.tokenizer.vocab_size)
  _, shardings = state_lib.abstract_train_state(config, model, mesh,
                                                world_data.blocks.block_len)
  tower = "tower" if config.model.share_towers else "query_tower"
  for half in (("reader", "bert"), ("retriever", tower, "bert")):
    node = shardings.params
    for key in half:
      node = node[key]
    assert spec(node["embeddings"]["word_embeddings"]["embedding"]) == ("model",)
    assert spec(node["embeddings"]["position_embeddings"]["embedding"]) == ()
    layer = node["encoder"]["0"]
    assert spec(layer["attention"]["self"]["query"]["kernel"]) == (None, "model")
    assert spec(layer["attention"]["self"]["query"]["bias"]) == ("model",)
    assert spec(layer["attention"]["output"]["dense"]["kernel"]) == ("model",)
    assert spec(layer["intermediate"]["dense"]["kernel"]) == (None, "model")
    assert spec(layer["output"]["dense"]["kernel"]) == ("model",)
    assert spec(layer["output"]["LayerNorm"]["scale"]) == ()
  assert spec(shardings.params["reader"]["cls"]["bias"]) == ("model",)
  assert spec(shardings.params["retriever"][tower]["projection"]["kernel"]) == ()
  assert spec(shardings.step) == ()
  assert all(s.mesh == mesh for s in jax.tree_util.tree_leaves(shardings))
  # Adam moments follow their parameter's sharding.
  for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(shardings.opt_state)[0]:
    names = jax.tree_util.keystr(leaf_path)
    if names.endswith("['word_embeddings']['embedding']"):
      assert spec(leaf) == ("model",), names
    if names.endswith("['query']['kernel']"):
      assert spec(leaf) == (None, "model"), names
  # On the 2x4 mesh a vocab row shard is vocab / 4 rows.
  word = runs["2x4"]["shardings"].params["reader"]["bert"]["embeddings"]["word_embeddings"]
  shape = (config.model.vocab_size, config.model.hidden_size)
  assert word["embedding"].shard_shape(shape) == (config.model.vocab_size // 4,
                                                  config.model.hidden_size)


@pytest.mark.parametrize("task", ["realm", "openqa"])
def test_the_logical_axes_validate_knows_are_the_models_and_the_default_rules(
    world_dir, world_data, task):
  """mesh.rules are checked against LOGICAL_AXES: every name the models' parameters carry is
  one, and the default rules map each of them."""
  import flax.linen as nn
  from jax.sharding import PartitionSpec as P
  from realm_jax.config.defaults import LOGICAL_AXES, base_config
  config = tiny_config(task, data_dir=world_dir)
  model = state_lib.build_model(config, world_data.tokenizer.vocab_size)
  inputs = state_lib.dummy_inputs(config, world_data.blocks.block_len)
  boxed = jax.eval_shape(lambda r: model.init(r, **inputs)["params"], jax.random.PRNGKey(0))
  named = {name for spec_ in jax.tree_util.tree_leaves(
      nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, P)) for name in spec_}
  assert named and named - {None} <= set(LOGICAL_AXES), named
  assert {axis for axis, _ in base_config().mesh.rules} == set(LOGICAL_AXES)


def test_a_mesh_shape_that_leaves_devices_idle_says_every_device_is_used():
  """(3, 1) on 8 devices: not "needs 3 devices" (it has them) but that all 8 must be used."""
  from realm_jax.errors import ConfigError
  resolve_mesh_shape = partitioning.resolve_mesh_shape
  assert resolve_mesh_shape((-1, 2), 8) == (4, 2)
  with pytest.raises(ConfigError, match=r"config\.mesh\.shape: \(3, 1\) uses 3 devices, but a "
                     r"mesh must use all 8 available"):
    resolve_mesh_shape((3, 1), 8)
  with pytest.raises(ConfigError, match=r"\(16, 1\) needs 16 devices, but 8 are available"):
    resolve_mesh_shape((16, 1), 8)




def test_the_null_document_embedded_alone_has_finite_gradients_on_a_tensor_parallel_mesh(
    world_dir, tmp_path):
  """With retrieval.block_gradients False the step embeds the null document (3 wordpieces)
  once for the batch. As one row under a data axis > 1 with a model axis > 1, XLA padded it
  unevenly and its backward pass read the padding: the shared tower's word-embedding row 0
  got NaN gradients and the run stopped at step 1 (4x2 and 2x4, every run; the null document
  embedded once at block_len without dropout did the same in some runs). Same losses as on
  8x1."""
  import json
  import os
  from realm_jax.train.loop import train

  def losses(mesh_shape):
    workdir = str(tmp_path / "x".join(map(str, mesh_shape)))
    config = tiny_config("realm", None, world_dir, train__steps=2, model__dropout_rate=0.0,
                         retrieval__block_gradients=False, mesh__shape=mesh_shape)
    train(config, workdir)
    with open(os.path.join(workdir, "metrics", "train.jsonl")) as f:
      return [json.loads(line)["loss"] for line in f if '"loss"' in line]
  ref = losses((8, 1))
  for shape in ((4, 2), (2, 4)):
    got = losses(shape)
    assert len(got) == 2 and np.isfinite(got).all(), shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5, err_msg=str(shape))

"""The paper-scale configs (BERT-base towers, k=8, queries of 96 / 64, blocks of 288, vocab
30522): the train state is built abstractly (nothing allocated) and one train step is
lowered on abstract inputs over the 8 test devices (its FLOPs and output shardings checked),
its towers cut to 2 layers (`lower_step`)."""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.train import steps
from realm_jax.config.reading import frozen_paths, null_in_training
from realm_jax.models.realm import span_candidates
from realm_jax.train.openqa_inputs import reader_length
from realm_jax.config.validation import validate
from tests.helpers import CONFIGS, REPO, load_config_module

QUERIES = 8           # a small global batch: the shapes that matter are per query


def abstract_batch(config, mesh, k=None):
  """A training batch's shapes (`k` candidates per query; default retrieval.k)."""
  sharding = partitioning.batch_sharding(mesh)
  q, lb, m, k = (config.data.query_len, config.data.block_len, config.data.max_masks,
                 k or config.retrieval.k)
  spec = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct((QUERIES,) + shape, dtype,
                                                              sharding=sharding)
  if config.task == "ict":
    return {"query_ids": spec(q), "block_ids": spec(lb), "block_segments": spec(lb)}
  if config.task == "openqa":   # the top-N blocks' frozen embeddings, the top K read
    n, k = config.qa.searcher_beam, config.qa.reader_beam
    length = reader_length(config, lb)
    spans = len(span_candidates(length, config.model.max_span_width)[0])
    return {"question_ids": spec(q),
            "candidate_emb": spec(n, config.model.retrieval_dim, dtype=jnp.float32),
            "has_answer": spec(n, dtype=jnp.bool_), "reader_ids": spec(k, length),
            "reader_segments": spec(k, length), "span_start_mask": spec(k, length, dtype=bool),
            "span_end_mask": spec(k, length, dtype=bool),
            "span_correct": spec(k, spans, dtype=bool)}
  return {"query_ids": spec(q), "mask_positions": spec(m), "mask_labels": spec(m),
          "mask_weights": spec(m, dtype=jnp.float32), "candidate_ids": spec(k, lb),
          "candidate_segments": spec(k, lb), "reader_ids": spec(k, q + lb - 2),
          "reader_segments": spec(k, q + lb - 2)}


@pytest.mark.slow
@pytest.mark.parametrize("name, task", [("realm_base", "realm"), ("ict_base", "ict")])
def test_base_config_train_step_lowers(name, task):
  if not os.path.exists(os.path.join(CONFIGS, f"{name}.py")):
    pytest.skip(f"configs/{name}.py does not exist yet")
  config = load_config_module(name).get_config()
  validate(config)
  assert config.task == task
  assert config.model.vocab_size == 30522
  assert (config.model.hidden_size, config.model.num_layers) == (768, 12)
  assert config.data.block_len == 288 and config.retrieval.k == 8
  assert config.data.query_len == (96 if task == "realm" else 64)
  # ORQA cuts an ICT query to its length; REALM masks a span inside its query: kept whole
  assert config.data.long_queries == ("refuse" if task == "realm" else "cut")

  mesh = partitioning.make_mesh(config.mesh.shape)
  assert QUERIES % mesh.shape["data"] == 0
  abstract, _ = abstract_state(config, mesh)
  leaves = jax.tree.leaves(abstract)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
  # Three BERT-base towers (query, block, reader) of ~110M each, or fewer with shared towers.
  towers = 2 if config.model.share_towers else 3
  assert 100e6 * towers < n_params < 115e6 * towers
  assert len(abstract.params["reader"]["bert"]["encoder"]) == 12
  word = abstract.params["reader"]["bert"]["embeddings"]["word_embeddings"]["embedding"]
  assert word.shape == (30522, 768)

  lowered = lower_step(config, mesh)
  # Lowered, not compiled: XLA's CPU compile of three BERT-base towers takes a minute of the
  # test budget, and the tiny configs compile the same program on every mesh (test_sharding).
  cost = lowered.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  # BERT-base widths at 2 layers a tower: 2.3e12 (REALM), 1.5e11 (ICT); 2.1e13 at 12 layers
  assert cost["flops"] > (1e12 if task == "realm" else 1e11)


@pytest.mark.slow
def test_the_paper_openqa_config_fine_tunes_as_orqa():
  """configs/realm_base.py:openqa: ORQA's fine-tuning of the base run (reader of 320, span
  scorer 256 over spans of up to 10, top 5 read, loss over the top 5,000, lr 1e-5, one
  question a step, the block tower frozen) validates, and its step lowers on batches of
  those shapes over the 8 test devices."""
  base, config = (load_config_module("realm_base").get_config(v) for v in ("base", "openqa"))
  validate(config)
  assert config.task == "openqa" and config.init.from_workdir
  assert (config.qa.reader_len, config.qa.reader_beam, config.qa.searcher_beam) == (320, 5, 5000)
  assert (config.model.span_hidden_size, config.model.max_span_width) == (256, 10)
  assert (config.train.lr, config.train.batch_size, base.train.lr) == (1e-5, 1, 3e-5)
  assert config.model == base.model and config.data == base.data
  assert frozen_paths(config) == (("retriever", "block_tower"),)
  mesh = partitioning.make_mesh(config.mesh.shape)
  cost = lower_step(config, mesh).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  assert cost["flops"] > 1e11


def abstract_state(config, mesh):
  """(abstract train state, its shardings) of `config` on `mesh`: nothing allocated."""
  model = state_lib.build_model(config, config.model.vocab_size)
  return state_lib.abstract_train_state(config, model, mesh, config.data.block_len)


def lower_step(config, mesh, k=None):
  """`config`'s train step lowered on abstract training batches (`k` candidates a query;
  default retrieval.k) with every tower cut to at most 2 layers: an inner layer and the last
  (which computes only the positions read) are the two kinds a layer stack has, and tracing
  the other 10 of BERT-base's took ~20 s of this tier. The step's outputs keep the state in
  its shardings."""
  config = config.copy_and_resolve_references()
  config.model.num_layers = min(config.model.num_layers, 2)
  if config.model.retriever.num_layers is not None and config.model.retriever.num_layers > 2:
    config.model.retriever.num_layers = 2
  validate(config)
  model = state_lib.build_model(config, config.model.vocab_size)
  abstract, shardings = abstract_state(config, mesh)
  step = steps.make_train_step(config, model, shardings, mesh)
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
  with partitioning.mesh_rules(mesh, partitioning.logical_rules(config.mesh.rules)):
    lowered = step.jitted.lower(abstract, abstract_batch(config, mesh, k), rng)
  out_state, _ = lowered.out_info
  assert [x.sharding for x in jax.tree.leaves(out_state)] == jax.tree.leaves(shardings)
  return lowered


def test_the_config_reference_covers_every_option_and_is_current():
  """docs/config_reference.md is generated from base_config's one comment per field: every
  option is listed with a comment, and the page matches the code."""
  from realm_jax.config import reference as config_reference
  from realm_jax.config.defaults import base_config
  from realm_jax.config.reading import flat_options
  rows = config_reference.fields()
  assert sorted(name for name, _, _ in rows) == sorted(flat_options(base_config()))
  assert all(comment for _, _, comment in rows), [n for n, _, c in rows if not c]
  with open(os.path.join(REPO, "docs", "config_reference.md")) as f:
    assert f.read() == config_reference.markdown(), (
        "docs/config_reference.md is stale: python -m realm_jax.config.reference > "
        "docs/config_reference.md")


def test_the_docs_list_every_value_of_an_option_they_enumerate():
  """A hand-written page that lists an option's values (`retrieval.refresh` (`in_process` |
  `async` | `deterministic`)) lists the values validation accepts, no more and no fewer."""
  import glob
  import re
  from realm_jax.config import defaults as d
  from realm_jax.models import bert, losses
  values = {"task": d.TASKS, "retrieval.candidates": d.CANDIDATE_SOURCES,
            "retrieval.refresh": d.REFRESH_MODES, "retrieval.backend": d.BACKENDS,
            "retrieval.marginalization": losses.MARGINALIZATIONS,
            "retrieval.loss": losses.RETRIEVER_LOSSES, "train.optimizer": d.OPTIMIZERS,
            "train.nonfinite": d.NONFINITE_ACTIONS, "model.dtype": d.COMPUTE_DTYPES,
            "model.remat": tuple(bert.REMAT_POLICIES),
            "model.attention": bert.ATTENTION_IMPLEMENTATIONS,
            "retrieval.distill_queries": d.DISTILL_QUERIES,
            "qa.heldout_unit": d.HELDOUT_UNITS, "data.long_queries": d.LONG_QUERIES}
  listed = re.compile(r"`([a-z_.]+)` \(((?:`[a-z_0-9]+` \| )+`[a-z_0-9]+`)[):]")
  dated = ("results.md", "test_times.md", "testing.md", "config_reference.md")
  pages = [os.path.join(REPO, "README.md")] + [
      p for p in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
      if os.path.basename(p) not in dated]
  found, wrong = 0, []
  for page in pages:
    with open(page) as f:
      text = " ".join(f.read().split())
    for option, names in listed.findall(text):
      assert option in values, f"{page}: {option}'s values are not known to this test"
      found += 1
      if sorted(re.findall(r"`([a-z_0-9]+)`", names)) != sorted(values[option]):
        wrong.append(f"{os.path.basename(page)}: {option} ({names}), not {values[option]}")
  assert found and not wrong, wrong


def test_the_real_text_recipe_scales():
  """configs/real_realm.py's `VARIANT,SCALE`: cpu is the variant alone; gpu validates and is
  larger where it says; a bad scale names itself."""
  module = load_config_module("real_realm")
  for variant in module.VARIANTS:
    assert module.get_config(f"{variant},cpu") == module.get_config(variant)
    if variant != "prepare":
      validate(module.get_config(f"{variant},gpu"))
  cpu, gpu = module.get_config("realm"), module.get_config("realm,gpu")
  assert (gpu.model.num_layers, cpu.model.num_layers) == (6, 4)
  assert gpu.train.steps > cpu.train.steps and gpu.retrieval.k > cpu.retrieval.k
  assert (gpu.builder.devices, cpu.builder.devices) == ("shared", "")
  assert module.get_config("prepare,gpu") == module.get_config("prepare")
  with pytest.raises(ValueError, match="unknown scale 'tpu'"):
    module.get_config("realm,tpu")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["ict,gpu", "warmup,gpu", "realm,gpu"])
def test_the_real_text_recipe_at_gpu_scale_lowers(variant):
  """Each pre-training stage's train state at the accelerator scale has all 6 of MiniLM's
  layers in the reader, and its train step lowers on abstract inputs of its training batches'
  shapes over the 8 test devices (`lower_step`)."""
  config = load_config_module("real_realm").get_config(variant)
  mesh = partitioning.make_mesh(config.mesh.shape)
  abstract, _ = abstract_state(config, mesh)
  assert sorted(abstract.params["reader"]["bert"]["encoder"], key=int) == \
      [str(i) for i in range(6)]
  lower_step(config, mesh, training_k(config))


def training_k(config):
  """Candidates per query in a training batch (train/candidate_rows.py, `rows`): the
  warm-up's own block alone; the retrieved blocks without the null document when training
  leaves it out."""
  if config.task != "realm":
    return None
  if config.retrieval.candidates == "own_block":
    return 1
  return config.retrieval.k - (0 if null_in_training(config) else 1)

"""What the retriever learns from and how cheaply (docs/design.md, "How the retriever learns
from the reader"): the frozen reader's score cache (a step fed cached scores gives the loss and
gradients of the step that reads every candidate, marginal and distillation, with and without
the null document; a cached run resumes exactly and reports its hit rate), scoring with the
index's block embeddings, the best evaluation's export, the "mixed" warm-up's candidates, and
the bad settings refused naming the option. The losses themselves: tests/test_losses.py."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from realm_jax.data import pipeline
from realm_jax.errors import ConfigError
from realm_jax.train import batches, candidate_rows, steps
from realm_jax.runtime import embedders, partitioning, state as state_lib
from realm_jax.config.reading import null_in_training
from realm_jax.config.validation import validate
from realm_jax.train.loop import train
from realm_jax.runtime.metrics import read_jsonl
from realm_jax.train.best_export import BestExport
from realm_jax.train.score_cache import PAIR_BYTES, ScoreCache, cache_keys, read_chunk
from tests.helpers import drawn_state, tiny_config


def cache_config(world_dir, **overrides):
  settings = dict(train__reader_lr_scale=0.0, train__retriever_lr_scale=1.0,
                  retrieval__score_cache=True, retrieval__k=4)
  return tiny_config("realm", None, world_dir, **{**settings, **overrides})


def host_batch(config, data, seed=0):
  queries = batches.QueryBatches(config, data, data.examples("train"))(0)
  retrieved = np.random.default_rng(seed).integers(
      0, data.blocks.num_blocks, (len(queries["query_ids"]), config.retrieval.k + 1))
  cands = candidate_rows.of(config).rows(data, queries, retrieved, training=True)
  return queries, cands, batches.realm_batch(config, data, queries, cands)


def cache_start(world_dir, world_data, model_init=False, **overrides):
  """A checked cache config, its model, mesh and initial train state (`drawn` params, or with
  `model_init` the model's random init), and one host batch."""
  config = cache_config(world_dir, **overrides)
  validate(config)
  model = state_lib.build_model(config, world_data.tokenizer.vocab_size)
  mesh = partitioning.make_mesh((-1, 1))
  if model_init:
    state, _, _ = state_lib.create_train_state(config, model, mesh, world_data.blocks.block_len,
                                               jax.random.PRNGKey(0))
  else:
    state, _, _ = drawn_state(config, model, mesh, world_data.blocks.block_len)
  return config, model, mesh, state, host_batch(config, world_data)


def loss_and_grads(config, model, params, batch, mesh):
  rules = partitioning.logical_rules(config.mesh.rules)
  fn = lambda p, b: jax.value_and_grad(steps.realm_loss_fn, has_aux=True)(
      p, model, b, config, jax.random.PRNGKey(0))
  with partitioning.mesh_rules(mesh, rules):
    (loss, metrics), grads = jax.jit(fn)(params, partitioning.global_batch(batch, mesh))
  return float(loss), jax.device_get(metrics), jax.device_get(grads)


@pytest.mark.parametrize("loss, null_document", [
    ("marginal", True),
    # two more REALM loss-and-gradient compiles on 8 devices: the slow tier
    pytest.param("distill", False, marks=pytest.mark.slow)])
def test_cached_scores_give_the_same_loss_and_gradients(world_dir, world_data, loss,
                                                        null_document):
  # Distillation without the null document is compared at the model's own init, as it always
  # was: at drawn params a few retriever gradients (e.g. tower/projection/bias, 7e-7 off a
  # 5.5e-6 gradient) miss the 1e-7 atol. Not shown to be float32 rounding; docs/testing.md.
  config, model, mesh, state, (queries, cands, batch) = cache_start(
      world_dir, world_data, model_init=loss == "distill", retrieval__loss=loss,
      retrieval__train_null_document=null_document)
  assert (cands[:, 0] == pipeline.NULL_BLOCK).all() == null_document
  cache = ScoreCache(config, model, state.params["reader"], len(cands))
  keys = cache_keys(queries, cands)
  cached, hits, reads, _ = cache.fill(dict(batch), keys)
  assert (hits, reads) == (0, cands.size) and len(cache) == len({tuple(k) for k in
                                                                 keys.reshape(-1, 3)})
  assert "reader_ids" not in cached and cached["candidate_log_probs"].shape == \
      cands.shape + (config.data.max_masks,)
  again, hits, reads, rows = cache.fill(dict(batch), keys)   # every triple seen: none read
  assert (hits, reads, rows) == (cands.size, 0, 0)
  np.testing.assert_array_equal(again["candidate_log_probs"], cached["candidate_log_probs"])

  full = loss_and_grads(config, model, state.params, batch, mesh)
  fast = loss_and_grads(config, model, state.params, cached, mesh)
  assert abs(full[0] - fast[0]) < 1e-5 * max(1.0, abs(full[0]))
  for name in full[1]:
    np.testing.assert_allclose(fast[1][name], full[1][name], rtol=1e-5, atol=1e-6)
  flat_full = jax.tree_util.tree_leaves_with_path(full[2]["retriever"])
  flat_fast = jax.tree.leaves(fast[2]["retriever"])
  assert any(np.abs(g).max() > 0 for _, g in flat_full)   # the retriever does learn
  for (path, a), b in zip(flat_full, flat_fast):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
  # the frozen reader gets no gradient either way
  assert all(np.abs(g).max() == 0 for g in jax.tree.leaves(fast[2]["reader"]))


@pytest.mark.parametrize("null_document", [True, False])
def test_a_batch_reads_the_chunks_its_misses_fill_and_the_same_scores(world_dir, world_data,
                                                                      null_document):
  """A batch half of whose triples are cached reads fewer rows than the same batch cold (whole
  chunks of a quarter of each group's triples, not the batch), and every triple's scores are
  the ones it gets read with other neighbours."""
  config, model, _, state, (queries, cands, batch) = cache_start(
      world_dir, world_data, retrieval__loss="distill",
      retrieval__train_null_document=null_document)
  b, keys = len(cands), cache_keys(queries, cands)
  cold = ScoreCache(config, model, state.params["reader"], b)
  devices = jax.local_device_count()
  assert cold.chunks == {True: read_chunk(b, devices),
                         False: read_chunk(b * (config.retrieval.k - 1), devices)}

  def rows_for(missed):   # whole chunks per group: the null document's, the blocks'
    null = missed[:, 2] == pipeline.NULL_BLOCK
    return sum(-(-int(n) // cold.chunks[g]) * cold.chunks[g]
               for g, n in ((True, null.sum()), (False, (~null).sum())))

  read_cold, _, _, cold_rows = cold.fill(dict(batch), keys)
  assert cold_rows == rows_for(keys.reshape(-1, 3)) == cands.size   # the tiny batch divides
  split = ScoreCache(config, model, state.params["reader"], b)
  split.fill({name: value[:b // 2] for name, value in batch.items()}, keys[:b // 2])
  read_split, hits, reads, rows = split.fill(dict(batch), keys)
  seen = {tuple(key) for key in keys[:b // 2].reshape(-1, 3)}
  missed = np.array([key for key in keys.reshape(-1, 3) if tuple(key) not in seen])
  assert hits == cands.size - len(missed) > 0 and reads == len(missed)
  assert rows == rows_for(missed) < cold_rows
  np.testing.assert_array_equal(read_split["candidate_log_probs"],
                                read_cold["candidate_log_probs"])


def test_a_full_cache_keeps_what_it_holds_and_reads_the_rest_to_the_same_scores(
    world_dir, world_data, caplog):
  """`retrieval.score_cache_gb` as small as 10 pairs: the cache keeps the first 10 triples it
  reads, says once that it is full, and every later batch reads the others again, with the
  scores of an unbounded cache to the bit."""
  config, model, _, state, (queries, cands, batch) = cache_start(world_dir, world_data)
  keys = cache_keys(queries, cands)
  unbounded = ScoreCache(config, model, state.params["reader"], len(cands))
  assert unbounded.capacity is None or unbounded.capacity > 10 ** 6   # the default: 4 GB
  expected = unbounded.fill(dict(batch), keys)[0]["candidate_log_probs"]
  assert len(unbounded) == cands.size and unbounded.megabytes() > 0
  config.retrieval.score_cache_gb = 10 * (PAIR_BYTES + 4 * config.data.max_masks) / 1e9
  bounded = ScoreCache(config, model, state.params["reader"], len(cands))
  assert bounded.capacity == 10
  for attempt in range(2):
    with caplog.at_level("WARNING"):
      filled, hits, reads, _ = bounded.fill(dict(batch), keys)
    assert len(bounded) == 10 and bounded.full()
    assert bounded.megabytes() * 1e6 <= 10 * (PAIR_BYTES + 4 * config.data.max_masks)
    assert (hits, reads) == ((0, cands.size) if attempt == 0 else (10, cands.size - 10))
    np.testing.assert_array_equal(filled["candidate_log_probs"], expected)
  said = [r.getMessage() for r in caplog.records if "score cache full" in r.getMessage()]
  assert len(said) == 1 and "retrieval.score_cache_gb" in said[0], said
  config.retrieval.score_cache_gb = 0.0     # no bound
  assert ScoreCache(config, model, state.params["reader"], len(cands)).capacity is None


@pytest.mark.slow   # end-to-end runs: the slow tier
def test_a_run_with_the_cache_resumes_exactly_and_reports_its_hits(world_dir, tmp_path,
                                                                   capsys):
  """30 steps of 16 read the tiny world's 392 queries 1.2 times: the second epoch's triples
  are found (those whose candidates the refreshed index still retrieves). The queries are
  packed two a row where they fit (`retrieval.packed_query_rows`, mean pooling), as the
  real-prose recipe packs them: in rows of 24 wordpieces most of the batches' pairs of
  queries (at most 16 wordpieces each) fit, the other batches are read one a row."""
  run = lambda steps: cache_config(world_dir, train__steps=steps, train__checkpoint_every=15,
                                   retrieval__refresh_every=10, train__warmup_steps=10,
                                   train__log_every=5, model__retriever__pooling="mean",
                                   retrieval__packed_query_rows=8, data__query_len=24)
  whole = train(run(30), str(tmp_path / "whole"))
  assert 0 < whole["query_batches_packed"] < 30   # both shapes of the step ran
  assert 0 < whole["score_cache_hit_rate"] < 1
  read_per_query = 4 if null_in_training(run(30)) else 3   # k, or k - 1 without the null
  assert whole["score_cache_reader_forwards_saved"] + whole["score_cache_reader_forwards"] \
      == 30 * 16 * read_per_query
  # the reader ran on whole chunks: at most one partly filled per step and group
  padding = sum(read_chunk(n, jax.local_device_count()) - 1 for n in (16, 16 * 3))
  assert whole["score_cache_reader_forwards"] <= whole["score_cache_reader_rows"] \
      <= whole["score_cache_reader_forwards"] + 30 * padding
  assert " | score cache " in capsys.readouterr().out
  # The whole run's step-15 checkpoint (what a run stopped there leaves: its lr schedule does
  # not depend on train.steps, warm-up 10) resumed by a new run: a fresh cache, every triple
  # read again. Its figures are the whole run's: the checkpoint keeps the counts of the steps
  # before it (they counted the steps after the resume alone, half the reads).
  os.makedirs(tmp_path / "resumed" / "checkpoints")
  shutil.copytree(tmp_path / "whole" / "checkpoints" / "15",
                  tmp_path / "resumed" / "checkpoints" / "15")
  resumed = train(run(30), str(tmp_path / "resumed"))
  assert resumed["score_cache_reader_forwards_saved"] + resumed["score_cache_reader_forwards"] \
      == 30 * 16 * read_per_query
  assert resumed["score_cache_reader_forwards"] >= whole["score_cache_reader_forwards"]
  assert resumed["score_cache_hit_rate"] == round(
      resumed["score_cache_reader_forwards_saved"] / (30 * 16 * read_per_query), 4)
  assert resumed["query_batches_packed"] == whole["query_batches_packed"]
  losses = [[r["loss"] for r in read_jsonl(os.path.join(tmp_path, name, "metrics",
                                                        "train.jsonl"))]
            for name in ("whole", "resumed")]
  assert len(losses[0]) == 6 and len(losses[1]) == 3 and losses[1] == losses[0][-3:]


@pytest.mark.parametrize("overrides, option", [
    (dict(train__reader_lr_scale=1.0), "retrieval.score_cache"),
    (dict(model__dropout_rate=0.1), "retrieval.score_cache"),
    (dict(retrieval__candidates="own_block"), "retrieval.score_cache"),
    (dict(retrieval__loss="pdist"), "retrieval.loss"),
    (dict(retrieval__distill_temperature=0.0), "retrieval.distill_temperature"),
    (dict(retrieval__retriever_temperature=-1.0), "retrieval.retriever_temperature"),
    (dict(model__retriever__pooling="max"), "model.retriever.pooling"),
    (dict(retrieval__own_block_share=1.5), "retrieval.own_block_share"),
    (dict(retrieval__score_cache_gb=-1.0), "retrieval.score_cache_gb"),
    (dict(retrieval__score_cache_gb=float("nan")), "retrieval.score_cache_gb"),
    (dict(retrieval__distill_queries="some"), "retrieval.distill_queries"),
    (dict(retrieval__loss="marginal", retrieval__distill_queries="evidence"),
     "retrieval.distill_queries"),
    (dict(retrieval__score_cache=False, retrieval__candidates="own_block",
          retrieval__own_context=True), "retrieval.own_context"),
    # distill trains the retriever alone: with it frozen nothing learns from the KL
    (dict(retrieval__score_cache=False, retrieval__loss="distill",
          train__retriever_lr_scale=0.0), "retrieval.loss"),
])
def test_bad_settings_are_refused_naming_the_option(world_dir, overrides, option):
  config = cache_config(world_dir, **overrides)
  with pytest.raises(ConfigError) as e:
    validate(config)
  assert e.value.option == option, str(e.value)


def test_own_context_with_one_retrieved_candidate_is_refused_for_training(world_dir):
  """With the null document and k=2, the own block (retrieval.own_context) takes the one
  retrieved block's place: every training step read no retrieved block, the index built and
  refreshed for nothing. Refused for training (realm-eval still reads a run recorded so)."""
  from realm_jax.config.validation import validate_training
  config = cache_config(world_dir, retrieval__score_cache=False, retrieval__own_context=True,
                        retrieval__k=2, retrieval__train_null_document=True)
  validate(config)
  with pytest.raises(ConfigError) as e:
    validate_training(config)
  assert e.value.option == "retrieval.k", str(e.value)
  config.retrieval.k = 3
  validate_training(config)


@pytest.mark.slow   # two REALM loss-and-gradient compiles on 8 devices, and an index
def test_without_block_gradients_the_index_embeddings_score_and_only_queries_learn(
    world_dir, world_data):
  """`retrieval.block_gradients` False: the candidates are scored with the serving index's
  embeddings (here built from the same params, so the loss is REALM's), the query tower's
  gradient is REALM's, and none reaches the block tower."""
  from types import SimpleNamespace
  from realm_jax.retrieval.index import embed_blocks
  config = cache_config(world_dir, model__share_towers=False, retrieval__loss="distill",
                        retrieval__train_null_document=False)
  model = state_lib.build_model(config, world_data.tokenizer.vocab_size)
  mesh = partitioning.make_mesh((-1, 1))
  state, _, _ = drawn_state(config, model, mesh, world_data.blocks.block_len)
  embeddings, _ = embed_blocks(embedders.block_embedder(model, mesh, config,
                                                    state.params["retriever"]),
                               world_data.blocks, mesh, 256)
  _, cands, batch = host_batch(config, world_data, seed=1)
  served = SimpleNamespace(version=0, embeddings=np.asarray(embeddings))
  index_batch = dict(batch, candidate_emb=batches.index_embeddings(served, cands))
  full = loss_and_grads(config, model, state.params, batch, mesh)
  fast = loss_and_grads(config, model, state.params, index_batch, mesh)
  assert abs(full[0] - fast[0]) < 1e-5 * max(1.0, abs(full[0]))
  flat = lambda grads: np.concatenate([g.ravel() for g in jax.tree.leaves(
      grads["retriever"]["query_tower"])])
  # the index embedded the blocks in batches of another size: their logits agree to 1e-6
  # (float32 rounding), which the gradient p(z|x) - q(z|x) of a peaked target amplifies
  np.testing.assert_allclose(flat(fast[2]), flat(full[2]),
                             atol=1e-2 * np.abs(flat(full[2])).max())
  assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(full[2]["retriever"]["block_tower"]))
  assert all(np.abs(g).max() == 0 for g in jax.tree.leaves(fast[2]["retriever"]["block_tower"]))


@pytest.mark.slow   # end-to-end runs: the slow tier
def test_the_best_evaluation_is_exported_as_a_workdir(world_dir, world_data, tmp_path):
  """`eval.export_best`: W/best holds the params of the evaluation with the highest retrieval
  utility (the start counts), readable as a run's workdir; the summary names its step."""
  from realm_jax.runtime.checkpoints import restore_run
  config = tiny_config("realm", None, world_dir, train__steps=6, eval__every=2,
                       train__checkpoint_every=2, train__keep_checkpoints=5,
                       retrieval__train_null_document=True, retrieval__k=4,
                       train__retriever_lr_scale=1.0, eval__export_best=True)
  workdir = str(tmp_path / "run")
  summary = train(config, workdir)
  evals = read_jsonl(os.path.join(workdir, "metrics", "eval.jsonl"))
  best = max(evals, key=lambda r: r["retrieval_utility"])
  assert summary["best_step"] == best["step"], evals
  assert summary["best_eval_retrieval_utility"] == pytest.approx(best["retrieval_utility"])
  exported = restore_run(os.path.join(workdir, "best"), vocab_size=world_data.tokenizer.vocab_size)
  assert exported.step == best["step"]
  # with the run's vocab, as every workdir (init.retriever=W/best checks the data against it)
  assert open(os.path.join(workdir, "best", "vocab.txt")).read() == \
      open(os.path.join(workdir, "vocab.txt")).read()
  if best["step"] > 0:
    saved = restore_run(workdir, step=best["step"], vocab_size=world_data.tokenizer.vocab_size)
    for a, b in zip(jax.tree.leaves(saved.params), jax.tree.leaves(exported.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_resumed_run_keeps_the_export_of_a_step_it_evaluates_again(tmp_path):
  """A run exported step 300, then stopped before a checkpoint after it; resumed, it evaluates
  step 300 again with a higher utility (an async index is not bitwise repeatable): the
  export of that step stands (Orbax has the step already; replacing it in place would leave
  a moment without one), and a later, better step is exported as before."""
  from realm_jax.runtime.checkpoints import restore_params
  config = tiny_config("realm")
  params = lambda value: {"w": np.full((4,), value, np.float32)}
  abstract = {"w": jax.ShapeDtypeStruct((4,), np.float32)}
  BestExport(str(tmp_path), config).consider(300, {"retrieval_utility": 3.0}, params(1.0))
  resumed = BestExport(str(tmp_path), config)
  assert resumed.best == {"step": 300, "retrieval_utility": 3.0}
  assert not resumed.consider(300, {"retrieval_utility": 3.5}, params(3.0))
  saved, step = restore_params(str(tmp_path / "best"), abstract)
  assert step == 300 and json.load(open(tmp_path / "best" / "best.json")) == resumed.best
  np.testing.assert_array_equal(np.asarray(saved["w"]), params(1.0)["w"])
  assert resumed.consider(400, {"retrieval_utility": 3.6}, params(4.0))
  saved, step = restore_params(str(tmp_path / "best"), abstract)
  assert step == 400 and json.load(open(tmp_path / "best" / "best.json"))["step"] == 400
  np.testing.assert_array_equal(np.asarray(saved["w"]), params(4.0)["w"])


def _params_of(value: float) -> dict:
  return {"w": np.full((4,), value, np.float32)}


_ABSTRACT_PARAMS = {"w": jax.ShapeDtypeStruct((4,), np.float32)}


def _export_of_an_earlier_start(tmp_path, config):
  """W/best (in `tmp_path`) holding an earlier start's step 300 at utility 3.0 (params 1.0);
  returns the initialization.Start of a fresh start from it (init.retriever=W/best)."""
  from realm_jax.runtime.initialization import Source, Start
  BestExport(str(tmp_path), config).consider(300, {"retrieval_utility": 3.0}, _params_of(1.0))
  return Start({}, [], {"retriever": Source("retriever", "init.retriever", "workdir",
                                            str(tmp_path / "best"))}, {"retriever": 300})


def _a_better_step_300_replaces_the_earlier_one(export: BestExport, tmp_path) -> None:
  """`export`, W/best holding the earlier start's step 300 (utility 3.0, params 1.0), exports
  this start's own step 300 where it evaluates better (3.5, not 2.0), in place of the other."""
  from realm_jax.runtime.checkpoints import restore_params
  assert export.best == {"step": 300, "retrieval_utility": 3.0}   # kept
  assert not export.consider(300, {"retrieval_utility": 2.0}, _params_of(2.0))
  assert export.consider(300, {"retrieval_utility": 3.5}, _params_of(3.0))
  saved, step = restore_params(str(tmp_path / "best"), _ABSTRACT_PARAMS)
  assert step == 300 and json.load(open(tmp_path / "best" / "best.json")) == \
      {"step": 300, "retrieval_utility": 3.5}
  np.testing.assert_array_equal(np.asarray(saved["w"]), _params_of(3.0)["w"])


def test_a_fresh_start_from_its_own_export_replaces_it_with_a_better_step_of_that_number(
    tmp_path):
  """W/best holds step 300 of an earlier start, which a fresh start continues from
  (init.retriever=W/best: kept). This start's own step 300 is other params: evaluated better,
  it is exported in place of the earlier start's (not taken for a resumed run's second look at
  the step it exported), and a later step must beat it."""
  config = tiny_config("realm")
  init = _export_of_an_earlier_start(tmp_path, config)
  fresh = BestExport(str(tmp_path), config)
  fresh.start_over(init=init)
  _a_better_step_300_replaces_the_earlier_one(fresh, tmp_path)
  assert not fresh.consider(400, {"retrieval_utility": 3.4}, _params_of(4.0))
  assert fresh.summary() == {"best_step": 300, "best_eval_retrieval_utility": 3.5}


def test_a_fresh_start_from_its_own_export_resumed_still_replaces_the_earlier_step(tmp_path):
  """The fresh start from its own export (step 300 of an earlier start) is preempted before it
  exported anything, and resumed: its own step 300, evaluated better, is still other params
  than the export's and replaces it, as it would have before the resume (the resumed run
  used to take the export for its own, kept the earlier start's params and dropped the
  better evaluation)."""
  from realm_jax.runtime.checkpoints import restore_params
  config, params, abstract = tiny_config("realm"), _params_of, _ABSTRACT_PARAMS
  init = _export_of_an_earlier_start(tmp_path, config)
  BestExport(str(tmp_path), config).start_over(init=init)
  resumed = BestExport(str(tmp_path), config)   # no start_over: a resumed run
  _a_better_step_300_replaces_the_earlier_one(resumed, tmp_path)
  # resumed again after its own export of step 300: that one is this start's and stands
  again = BestExport(str(tmp_path), config)
  assert not again.consider(300, {"retrieval_utility": 3.8}, params(5.0))
  np.testing.assert_array_equal(np.asarray(restore_params(str(tmp_path / "best"),
                                                          abstract)[0]["w"]), params(3.0)["w"])


def test_an_export_killed_before_its_record_is_finished_by_the_resumed_run(tmp_path,
                                                                           monkeypatch):
  """Killed after saving step 400 in W/best and before best.json: best.json still names 300.
  The resumed run evaluates 400 again: the record is written, not the step saved a second
  time (Orbax refused it at every rerun). A NaN utility is never the best."""
  from realm_jax import paths
  from realm_jax.runtime.checkpoints import restore_params
  config = tiny_config("realm")
  params = lambda value: {"w": np.full((4,), value, np.float32)}
  BestExport(str(tmp_path), config).consider(300, {"retrieval_utility": 1.0}, params(3.0))
  write_json = paths.write_json

  def killed(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(paths, "write_json", killed)
  with pytest.raises(KeyboardInterrupt):
    BestExport(str(tmp_path), config).consider(400, {"retrieval_utility": 2.0}, params(4.0))
  monkeypatch.setattr(paths, "write_json", write_json)
  resumed = BestExport(str(tmp_path), config)
  assert resumed.best == {"step": 300, "retrieval_utility": 1.0}
  assert resumed.consider(400, {"retrieval_utility": 2.0}, params(4.0))
  saved, step = restore_params(str(tmp_path / "best"), {"w": jax.ShapeDtypeStruct((4,),
                                                                                 np.float32)})
  assert step == 400 and json.load(open(tmp_path / "best" / "best.json"))["step"] == 400
  np.testing.assert_array_equal(np.asarray(saved["w"]), params(4.0)["w"])
  assert not resumed.consider(500, {"retrieval_utility": float("nan")}, params(5.0))


def test_an_export_to_a_full_disk_stops_the_run_naming_it_and_keeps_the_last_one(
    tmp_path, monkeypatch):
  """TensorStore reports a full disk under W/best as a ValueError (RESOURCE_EXHAUSTED ... No
  space left on device): a CheckpointError names W/best and the step it still holds (the
  run stops in one line), not a traceback; best.json and the exported params stay as they
  were, and what the cut-short save left goes when the next export starts."""
  import orbax.checkpoint as ocp
  from realm_jax import paths
  from realm_jax.errors import CheckpointError
  from realm_jax.runtime.checkpoints import restore_params
  config = tiny_config("realm")
  params = lambda value: {"w": np.full((4,), value, np.float32)}
  BestExport(str(tmp_path), config).consider(300, {"retrieval_utility": 1.0}, params(3.0))
  save = ocp.CheckpointManager.save

  def full_disk(self, step, *args, **kwargs):
    os.makedirs(os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp"))
    raise ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{self.directory}/{step}'
                     '.orbax-checkpoint-tmp/params/_sharding": No space left on device')
  monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk)
  best = BestExport(str(tmp_path), config)
  with pytest.raises(CheckpointError) as error:
    best.consider(400, {"retrieval_utility": 2.0}, params(4.0))
  best_dir = tmp_path / "best"
  assert str(error.value).startswith(
      f"exporting step 400's params to {best_dir} failed: RESOURCE_EXHAUSTED: "), error.value
  assert "No space left on device" in str(error.value)
  assert f"{best_dir} still holds step 300" in str(error.value), error.value
  assert json.load(open(best_dir / "best.json")) == {"step": 300, "retrieval_utility": 1.0}
  saved, step = restore_params(str(best_dir), {"w": jax.ShapeDtypeStruct((4,), np.float32)})
  assert step == 300
  np.testing.assert_array_equal(np.asarray(saved["w"]), params(3.0)["w"])
  monkeypatch.setattr(ocp.CheckpointManager, "save", save)   # space again
  assert best.consider(500, {"retrieval_utility": 3.0}, params(5.0))
  assert sorted(os.listdir(best_dir / "checkpoints")) == ["500"]
  # the params fit, the records after them do not: one line too, best.json as it was
  monkeypatch.setattr(paths, "write_json", lambda path, record: (_ for _ in ()).throw(
      OSError(28, "No space left on device", path)))
  with pytest.raises(CheckpointError) as error:
    best.consider(600, {"retrieval_utility": 4.0}, params(6.0))
  assert str(error.value).startswith(f"exporting step 600's params to {best_dir}: they are "
                                     "saved, but writing its records failed: "), error.value
  assert "No space left on device" in str(error.value) and \
      str(error.value).endswith("its best.json still names step 500")
  assert best.best["step"] == 500
  assert json.load(open(best_dir / "best.json")) == {"step": 500, "retrieval_utility": 3.0}


def exported_then_checkpoints_gone(world_dir, tmp_path, monkeypatch):
  """A 4-step REALM run evaluated every 2 steps with `eval.export_best`, the utility of each
  evaluation set by the test (the returned dict, step -> utility: step 2 the best), W/best
  holding step 2, then W/checkpoints removed. Returns (utility, config, workdir)."""
  utility = {0: -2.0, 2: 0.0, 4: -1.0}
  consider = BestExport.consider
  monkeypatch.setattr(BestExport, "consider", lambda self, step, metrics, *args: consider(
      self, step, {**metrics, "retrieval_utility": utility[step]}, *args))
  config = tiny_config("realm", None, world_dir, train__steps=4, eval__every=2,
                       eval__export_best=True)
  workdir = str(tmp_path / "run")
  assert train(config, workdir)["best_step"] == 2
  shutil.rmtree(os.path.join(workdir, "checkpoints"))
  return utility, config, workdir


@pytest.mark.slow   # end-to-end runs: the slow tier
def test_a_fresh_start_does_not_keep_an_earlier_starts_export(world_dir, tmp_path,
                                                               monkeypatch):
  """A workdir without checkpoints (a run that died before its first save, or whose
  checkpoints are gone) starts over, its metrics dropped; W/best of that earlier start goes
  too: its utility would stand against this run's (nothing of this run exported, the summary
  naming the other run's step)."""
  from realm_jax.runtime.checkpoints import restore_run
  utility, config, workdir = exported_then_checkpoints_gone(world_dir, tmp_path, monkeypatch)
  utility.update({0: -3.0, 2: -5.0, 4: -4.0})   # all below the earlier start's best
  summary = train(config, workdir)
  assert (summary["best_step"], summary["best_eval_retrieval_utility"]) == (0, -3.0)
  assert json.load(open(os.path.join(workdir, "best", "best.json"))) == \
      {"step": 0, "retrieval_utility": -3.0}
  assert restore_run(os.path.join(workdir, "best")).step == 0


@pytest.mark.slow   # end-to-end runs: the slow tier
def test_a_fresh_start_from_its_own_export_keeps_it(world_dir, tmp_path, monkeypatch, caplog):
  """A workdir whose checkpoints are gone started again from its own export
  (init.retriever=W/best): the export it read is what this start continues from, not an
  earlier start's to drop; emptied, that retriever would be lost with nothing in its place."""
  import logging
  from realm_jax.runtime.checkpoints import restore_run
  utility, config, workdir = exported_then_checkpoints_gone(world_dir, tmp_path, monkeypatch)
  again = tiny_config("realm", None, world_dir, train__steps=4, eval__every=2,
                      eval__export_best=True, init__retriever=os.path.join(workdir, "best"))
  utility.update({0: -3.0, 2: -5.0, 4: -4.0})   # none beats the export it started from
  with caplog.at_level(logging.INFO, logger="realm_jax.train.best_export"):
    summary = train(again, workdir)
  assert (summary["best_step"], summary["best_eval_retrieval_utility"]) == (2, 0.0)
  # still the earlier start's step 2, and said so (a resume of this start reads it)
  assert json.load(open(os.path.join(workdir, "best", "best.json"))) == \
      {"step": 2, "retrieval_utility": 0.0, "earlier_start": True}
  assert restore_run(os.path.join(workdir, "best")).step == 2
  assert "a fresh start from its own export" in caplog.text, caplog.text


@pytest.mark.slow   # end-to-end runs: the slow tier
def test_a_mixed_warmup_reads_its_own_block_or_a_distractor_as_drawn(world_dir, world_data,
                                                                    tmp_path):
  """`retrieval.candidates` "mixed": a training query reads its own block where its draw says
  (about `own_block_share` of them), else the best retrieved block that is not its own; the
  evaluation reports span accuracy with the own block, with that distractor and with the null
  document."""
  config = tiny_config("realm", "warmup", world_dir, retrieval__candidates="mixed",
                       retrieval__own_block_share=0.75, retrieval__refresh_every=100,
                       train__steps=3)
  validate(config)
  stream = batches.QueryBatches(config, world_data, world_data.examples("train"))
  drawn = np.concatenate([stream(t)["reads_own_block"] for t in range(20)])
  assert 0.65 < drawn.mean() < 0.85
  queries = stream(0)
  source = queries["source_block"]
  retrieved = np.stack([source, (source + 7) % world_data.blocks.num_blocks,
                        (source + 9) % world_data.blocks.num_blocks], axis=1)
  cand = candidate_rows.of(config).rows(world_data, queries, retrieved, training=True)
  own = queries["reads_own_block"] > 0
  assert cand.shape == (len(source), 1) and own.any() and (~own).any()
  np.testing.assert_array_equal(cand[own, 0], source[own])
  uids = world_data.blocks.uids
  assert (uids[cand[~own, 0]] != uids[source[~own]]).all() and (cand[~own, 0] >= 0).all()
  evaluated = candidate_rows.of(config).rows(world_data, queries, retrieved, distractor=True)
  assert (evaluated[:, 0] == pipeline.NULL_BLOCK).all()
  assert (uids[evaluated[:, 1]] != uids[source]).all()
  summary = train(config, str(tmp_path / "mixed"))
  for key in ("span_accuracy", "span_accuracy_distractor", "span_accuracy_null_document"):
    assert 0 <= summary[f"eval_{key}"] <= 1
  config.retrieval.refresh = "async"      # its distractors come from an in-process index
  with pytest.raises(ConfigError) as e:
    validate(config)
  assert e.value.option == "retrieval.refresh"


def test_a_mixed_warmup_retrieves_no_more_blocks_than_the_corpus_holds(world_dir, world_data):
  """"mixed" reads one block a query whatever `retrieval.k` (which its config need not fit to
  the corpus, as "index" must): a k past the corpus's blocks asked the index for k + 1 of
  them, and the batch of step 1 failed (ValueError: asked for 241 blocks from an index of
  240)."""
  from realm_jax.retrieval.index import ExactIndex, IndexVersion
  from realm_jax.train.loop import QueryStepBatches
  num_blocks = world_data.blocks.num_blocks
  config = tiny_config("realm", "warmup", world_dir, retrieval__candidates="mixed",
                       retrieval__k=num_blocks)
  validate(config, num_blocks=num_blocks)
  rng = np.random.default_rng(0)
  index = IndexVersion(version=0, step=0, index=ExactIndex.from_embeddings(
      rng.normal(size=(num_blocks, 8)).astype(np.float32)),
      encode_queries=lambda ids: rng.normal(size=(len(ids), 8)).astype(np.float32))

  class Source:   # the index of every step
    def for_step(self, step):
      return index, 0.0
  queries = batches.QueryBatches(config, world_data, world_data.examples("train"))(0)
  step_batches = QueryStepBatches(config, world_data, partitioning.make_mesh((-1, 1)),
                                  Source(), None, None, 0, 1,
                                  pack=lambda step, batch, shards: False)
  batch, used = step_batches._assemble(0, queries)
  assert used["index"] is index
  assert batch["candidate_ids"].shape[:2] == (len(queries["query_ids"]), 1)


@pytest.mark.parametrize("null_document", [True, False])
def test_own_context_reads_the_own_block_without_the_query_sentence(world_dir, world_data,
                                                                   null_document):
  """`retrieval.own_context`: a training batch's last candidate is the query's own block with
  the query's sentence cut out (its other candidates and their reader inputs unchanged);
  evaluation rows still drop the own block."""
  config = cache_config(world_dir, retrieval__score_cache=False, retrieval__own_context=True,
                        retrieval__train_null_document=null_document)
  validate(config)
  queries, cands, batch = host_batch(config, world_data)
  plain = cache_config(world_dir, retrieval__score_cache=False,
                       retrieval__train_null_document=null_document)
  _, plain_cands, plain_batch = host_batch(plain, world_data)
  source, (start, end) = queries["source_block"], queries["sentence_cut"].T
  np.testing.assert_array_equal(cands[:, -1], source)
  np.testing.assert_array_equal(cands[:, :-1], plain_cands[:, :-1])
  for key in ("reader_ids", "reader_segments", "candidate_ids"):
    np.testing.assert_array_equal(batch[key][:, :-1], plain_batch[key][:, :-1])
  blocks, examples = world_data.blocks, world_data.examples("train")
  rows = queries["query_row"]
  for i in range(len(source)):
    block = np.asarray(blocks.tokens[source[i]])[:blocks.lengths[source[i]]]
    sentence = np.asarray(examples.tokens[rows[i]])[:examples.lengths[rows[i]]]
    np.testing.assert_array_equal(block[start[i]:end[i]], sentence)   # the cut is the sentence
    kept = np.concatenate([block[:start[i]], block[end[i]:]])
    got = batch["candidate_ids"][i, -1]
    np.testing.assert_array_equal(got[:len(kept)], kept)
    assert not got[len(kept):].any()
    segments = batch["candidate_segments"][i, -1]
    assert segments[blocks.body_start[source[i]]:len(kept)].all() and \
        not segments[len(kept):].any()
  retrieved = np.concatenate([source[:, None], cands], axis=1)
  evaluated = candidate_rows.of(config).rows(world_data, queries, retrieved)
  assert not (evaluated == source[:, None]).any()


@pytest.mark.parametrize("task", ["ict", "openqa"])
def test_a_retriever_loss_other_than_the_marginal_outside_realm_is_refused(task):
  """retrieval.loss 'distill' is REALM's: ICT and Open-QA have losses of their own, which
  ran without a word instead."""
  config = tiny_config("ict" if task == "ict" else "realm", None, "", retrieval__loss="distill")
  config.task = task
  with pytest.raises(ConfigError) as e:
    validate(config)
  assert e.value.option == "retrieval.loss", str(e.value)


@pytest.mark.parametrize("candidates", ["own_block", "null_only", "mixed"])
def test_open_qa_refuses_a_pre_training_candidate_source(candidates):
  """Open-QA reads what its retriever finds (ORQA): a REALM pre-training source, such as the
  warm-up's own block, ran as 'index' without a word."""
  config = tiny_config("realm", retrieval__candidates=candidates)
  config.task = "openqa"
  with pytest.raises(ConfigError) as e:
    validate(config)
  assert e.value.option == "retrieval.candidates", str(e.value)


def test_the_score_cache_names_the_attention_dropout_that_keeps_it_off(world_dir):
  config = cache_config(world_dir, model__attention_dropout_rate=0.1)
  with pytest.raises(ConfigError) as e:
    validate(config)
  assert e.value.option == "retrieval.score_cache"
  assert "model.attention_dropout_rate 0.1" in str(e.value), str(e.value)


@pytest.mark.parametrize("marginalization", ["joint", "per_mask"])
def test_the_evaluations_retrieval_utility_is_weighed_as_the_steps(world_dir, world_data,
                                                                    marginalization):
  """The held-out retrieval utility (what `eval.export_best` chooses by) is the mean the
  training step's `retrieval_utility` takes over the same queries (`losses.realm_loss`): over
  the queries ("joint"), over every real mask ("per_mask"), whatever eval.batch_size cuts."""
  from realm_jax.models import losses
  from realm_jax.train.masked_eval import Evaluator
  config = tiny_config("realm", "warmup", world_dir, eval__num_examples=37, eval__batch_size=8,
                       retrieval__marginalization=marginalization)
  rng = np.random.default_rng(0)
  mask_lp = -rng.random((37, 2, config.data.max_masks)) * 5   # [query, (null, own), mask]

  row_of = {}   # query ids -> eval query

  def realm_eval(params, batch):   # the reader's figures of each eval query
    rows = np.asarray([row_of[ids.tobytes()] for ids in np.asarray(batch["query_ids"])])
    weights = np.asarray(batch["mask_weights"])
    logits = np.full((len(rows), 2), -1e9, np.float32)
    logits[:, -1] = 0.0
    utility = (losses.realm_log_likelihood(logits, mask_lp[rows], weights, marginalization)
               - losses.null_log_likelihood(mask_lp[rows], weights, marginalization))
    labels = np.asarray(batch["mask_labels"])
    return {"predictions": labels, "null_predictions": labels, "p_z": np.exp(logits),
            "retrieval_utility": np.asarray(utility)}

  evaluator = Evaluator(config, world_data, partitioning.make_mesh((-1, 1)), realm_eval)
  row_of.update((ids.tobytes(), i) for i, ids in enumerate(evaluator.queries["query_ids"]))
  assert len(row_of) == 37
  weights = evaluator.queries["mask_weights"]
  assert len(set(weights.sum(-1).tolist())) > 1   # spans of several widths
  logits = np.full((37, 2), -1e9, np.float32)
  logits[:, -1] = 0.0
  _, expected = losses.realm_loss(logits, mask_lp, weights, marginalization)
  metrics, _ = evaluator.run(None, None)
  assert metrics["retrieval_utility"] == pytest.approx(float(expected["retrieval_utility"]),
                                                       rel=1e-5)

"""How the step computes, against what it computes: attention through
`jax.nn.dot_product_attention` matches the textbook formula, `model.remat` leaves the loss and
gradients unchanged, and a bfloat16 step stays close to the float32 one with the retrieval
logits and the marginal in float32."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.data import pipeline
from realm_jax.errors import ConfigError
from realm_jax.models.bert import BertConfig, BertEncoder
from realm_jax.runtime import state as state_lib
from realm_jax.train import steps
from realm_jax.config.compatibility import incompatible_fields
from realm_jax.config.validation import validate
from tests.helpers import drawn_params, tiny_config

VOCAB = 96


def reference_attention(q, k, v, key_mask):
  """softmax(q k^T / sqrt(d) + padding bias) v in float64 numpy (the formula, head by head)."""
  q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  scores = scores + np.where(np.asarray(key_mask), 0.0, -1e9)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("bhqk,bkhd->bqhd", weights, v)


def padded_ids(rng, batch=3, length=12):
  """Token ids with 0 ([PAD]) after a random length per row (>= 3 real tokens)."""
  ids = rng.integers(1, VOCAB, (batch, length)).astype(np.int32)
  for row, n in enumerate(rng.integers(3, length + 1, batch)):
    ids[row, n:] = 0
  return ids


def encoder(**fields):
  cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                   intermediate_size=64, max_position=32, dropout_rate=0.0, **fields)
  return BertEncoder(cfg)


def test_attention_matches_the_formula_with_padding():
  """The self-attention output of a layer, captured with its q / k / v projections, equals
  the float64 formula within 1e-5 (padded keys masked out)."""
  rng = np.random.default_rng(0)
  ids = padded_ids(rng)
  model = encoder()
  params = drawn_params(model, 0, ids, np.zeros_like(ids))
  (_, _), state = jax.jit(functools.partial(model.apply, capture_intermediates=True,
                                            mutable=["intermediates"]))(
      {"params": params}, ids, np.zeros_like(ids))
  inter = state["intermediates"]["encoder"]["0"]["attention"]["self"]
  split = lambda t: np.asarray(t).reshape(t.shape[:-1] + (4, 8))
  q, k, v = (split(inter[name]["__call__"][0]) for name in ("query", "key", "value"))
  got = np.asarray(inter["__call__"][0]).reshape(q.shape)
  want = reference_attention(q, k, v, ids[:, None, None, :] > 0)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_padding_does_not_reach_the_real_tokens():
  """Appending [PAD]s leaves every real token's output unchanged (the mask is applied)."""
  rng = np.random.default_rng(1)
  ids = rng.integers(1, VOCAB, (2, 7)).astype(np.int32)
  longer = np.concatenate([ids, np.zeros((2, 5), np.int32)], axis=1)
  model = encoder()
  params = drawn_params(model, 0, longer, np.zeros_like(longer))
  apply = jax.jit(model.apply)
  short, _ = apply({"params": params}, ids, np.zeros_like(ids))
  long, _ = apply({"params": params}, longer, np.zeros_like(longer))
  np.testing.assert_allclose(np.asarray(long)[:, :7], np.asarray(short), atol=1e-5, rtol=0)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_the_last_layer_computes_only_the_positions_read(remat):
  """`positions`: the sequence output at those positions and the pooled output as the full
  encoder's (padding included, the gradients too), for a fraction of the last layer's work."""
  rng = np.random.default_rng(4)
  ids = padded_ids(rng, batch=3, length=24)
  # [CLS] first (the pooler reads the first row), then any positions, repeats allowed
  positions = np.array([[0, 2, 3], [0, 5, 5], [0, 7, 1]], np.int32)
  model = encoder(remat=remat)
  params = drawn_params(model, 0, ids, np.zeros_like(ids))
  weights = rng.normal(size=(3, 3, 32)).astype(np.float32)

  def read(params, at):
    out, pooled = model.apply({"params": params}, ids, np.zeros_like(ids), True, at)
    picked = out if at is not None else jnp.take_along_axis(out, positions[..., None], axis=1)
    return (picked * weights).sum() + pooled.sum(), (picked, pooled)

  value_and_grad = lambda at: jax.jit(jax.value_and_grad(lambda p: read(p, at), has_aux=True))
  (_, (want, want_pooled)), want_grads = value_and_grad(None)(params)
  (_, (got, got_pooled)), got_grads = value_and_grad(positions)(params)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
  np.testing.assert_allclose(np.asarray(got_pooled), np.asarray(want_pooled), atol=1e-5, rtol=0)
  for name, w, g in compared(want_grads, got_grads):
    assert relative_error(w, g) < 1e-5, name
  def flops(at):
    lowered = jax.jit(lambda p: read(p, at)[0]).lower(params)
    cost = lowered.cost_analysis() or lowered.compile().cost_analysis()  # None: PJRT plugins
    return (cost[0] if isinstance(cost, list) else cost)["flops"]
  assert flops(positions) < 0.75 * flops(None)


def test_attention_dropout_is_applied_in_training_only():
  """With attention dropout the training output depends on the rng (the weights are dropped)
  and the deterministic one is the fused path's."""
  rng = np.random.default_rng(2)
  ids = padded_ids(rng)
  plain, dropping = encoder(), encoder(attention_dropout_rate=0.5)
  params = drawn_params(plain, 0, ids, np.zeros_like(ids))
  run = lambda model, det, seed: np.asarray(model.apply(
      {"params": params}, ids, np.zeros_like(ids), det,
      rngs={"dropout": jax.random.PRNGKey(seed)})[0])
  np.testing.assert_array_equal(run(dropping, True, 0), run(plain, True, 0))
  assert np.abs(run(dropping, False, 0) - run(dropping, False, 1)).max() > 1e-3
  np.testing.assert_array_equal(run(plain, False, 0), run(plain, True, 0))


def test_erf_gelu_is_jax_gelu_keeping_one_tensor_for_the_backward_pass():
  """The model's erf GELU: jax.nn.gelu(approximate=False) bit for bit, the same gradient,
  and one saved residual where autodiff through erfc saves three tensors and a constant."""
  from jax._src.ad_checkpoint import saved_residuals
  from realm_jax.models.bert import erf_gelu
  x = jnp.asarray(np.random.default_rng(3).normal(size=(64, 48)).astype(np.float32) * 3)
  reference = functools.partial(jax.nn.gelu, approximate=False)
  np.testing.assert_array_equal(np.asarray(erf_gelu(x)), np.asarray(reference(x)))
  weighted = lambda f: jax.grad(lambda x: (f(x) * jnp.cos(x)).sum())(x)
  np.testing.assert_allclose(np.asarray(weighted(erf_gelu)), np.asarray(weighted(reference)),
                             atol=1e-6, rtol=1e-6)
  assert len(saved_residuals(erf_gelu, x)) == 1 < len(saved_residuals(reference, x))


def equations(jaxpr):
  """Every equation of a jaxpr, those of its sub-jaxprs (jit, remat, custom_vjp) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from equations(inner)


def test_embedding_gradients_scatter_only_the_word_ids_and_in_float32():
  """In a bfloat16 model the embeddings' gradient is one scatter-add, of the word ids into the
  float32 table (a bfloat16 scatter is compare-and-swap loops on a GPU); the positions (a slice)
  and the token types (a select) scatter nothing; the forward pass equals the three lookups."""
  from realm_jax.models.bert import BertEmbeddings
  rng = np.random.default_rng(5)
  ids = padded_ids(rng)
  segments = np.broadcast_to(np.arange(ids.shape[1]) >= 5, ids.shape).astype(np.int32)
  model = encoder(dtype=jnp.bfloat16)
  params = drawn_params(model, 0, ids, segments)
  loss = lambda p: model.apply({"params": p}, ids, segments)[0].astype(jnp.float32).sum()
  gradient = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
  scatters = [eqn.outvars[0].aval for eqn in equations(gradient)
              if eqn.primitive.name.startswith("scatter")]
  assert [(a.shape, a.dtype) for a in scatters] == [((VOCAB, 32), jnp.float32)]

  plain = encoder()    # float32: the forward pass against the three lookups + LayerNorm
  params = drawn_params(plain, 1, ids, segments)["embeddings"]
  table = {name: np.asarray(params[name]["embedding"], np.float64)
           for name in ("word_embeddings", "position_embeddings", "token_type_embeddings")}
  summed = (table["word_embeddings"][ids] + table["position_embeddings"][None, :ids.shape[1]]
            + table["token_type_embeddings"][segments])
  norm = params["LayerNorm"]
  expected = ((summed - summed.mean(-1, keepdims=True))
              / np.sqrt(summed.var(-1, keepdims=True) + plain.cfg.layer_norm_eps)
              * np.asarray(norm["scale"]) + np.asarray(norm["bias"]))
  got = BertEmbeddings(plain.cfg).apply({"params": params}, ids, segments, True)
  np.testing.assert_allclose(np.asarray(got), expected, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="max_position"):
    BertEmbeddings(plain.cfg).apply({"params": params}, np.ones((1, 40), np.int32),
                                    np.zeros((1, 40), np.int32), True)


def random_realm_batch(config, rng):
  """A REALM batch of the config's shapes (random wordpieces, padded blocks; candidate 0 is
  the null document, as in a training batch of the pipeline)."""
  b, k, m = config.train.batch_size, config.retrieval.k, config.data.max_masks
  q, lb = config.data.query_len, config.data.block_len
  ids = lambda *shape: rng.integers(1, VOCAB, shape).astype(np.int32)
  candidates = ids(b, k, lb)
  candidates[:, :, lb - 6:] = 0
  candidates[:, 0, pipeline.NULL_DOCUMENT_LENGTH:] = 0
  reader_len = pipeline.reader_length(q, lb)
  reader_ids = ids(b, k, reader_len)
  reader_ids[:, 0, pipeline.reader_length(q, pipeline.NULL_DOCUMENT_LENGTH):] = 0
  return {
      "query_ids": ids(b, q), "mask_labels": ids(b, m),
      "mask_positions": np.broadcast_to(np.arange(1, m + 1), (b, m)).astype(np.int32),
      "mask_weights": np.ones((b, m), np.float32),
      "candidate_ids": candidates,
      "candidate_segments": np.broadcast_to(np.arange(lb) > 4, (b, k, lb)).astype(np.int32),
      "reader_ids": reader_ids,
      "reader_segments": np.broadcast_to(np.arange(reader_len) >= q,
                                         (b, k, reader_len)).astype(np.int32),
  }


_REFERENCE = {}


def reference_loss_and_grads(dropout_rate=0.0):
  """loss_and_grads of the float32, no-remat step (computed once per dropout rate)."""
  if dropout_rate not in _REFERENCE:
    _REFERENCE[dropout_rate] = loss_and_grads(step_config(dropout_rate=dropout_rate))
  return _REFERENCE[dropout_rate]


def loss_and_grads(config, params=None, seed=0, dropout_rng=3):
  """REALM loss, metrics and gradients of one random batch; the params are the model's init
  from `seed` unless given (jitted: the bf16 test's per-tensor direction checks are sized to
  the init's gradients, where drawn params leave 8 of the retriever's tensors under their
  0.1%-of-the-norm floor)."""
  config.model.vocab_size = VOCAB
  validate(config)
  model = state_lib.build_model(config, VOCAB)
  batch = random_realm_batch(config, np.random.default_rng(seed))
  if params is None:
    inputs = state_lib.dummy_inputs(config, config.data.block_len)
    params = jax.jit(model.init)(jax.random.PRNGKey(seed), **inputs)["params"]
  grad_fn = jax.jit(jax.value_and_grad(
      lambda p: steps.realm_loss_fn(p, model, batch, config, jax.random.PRNGKey(dropout_rng)),
      has_aux=True))
  (loss, metrics), grads = grad_fn(params)
  return params, float(loss), metrics, grads


def step_config(**model_fields):
  config = tiny_config("realm", None, "")
  config.data.query_len, config.data.block_len, config.retrieval.k = 12, 24, 4
  config.train.batch_size, config.train.retriever_lr_scale = 4, 0.3
  config.retrieval.train_null_document = True   # the random batches' column 0 is the null
  config.model.max_position = 40
  config.model.num_layers = 1      # one layer per tower: the compile is most of these tests
  for name, value in model_fields.items():
    config.model[name] = value
  return config


def flat(tree):
  return {jax.tree_util.keystr(p): np.asarray(v, np.float32)
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def compared(grads, other):
  """(name, reference, other) for every gradient that is not zero in exact arithmetic: the key
  biases' are (a shift of every score by q.b leaves the softmax alone) and come out as
  rounding noise ~1e-11."""
  want, got = flat(grads), flat(other)
  assert set(got) == set(want)
  total = np.sqrt(sum(float((g ** 2).sum()) for g in want.values()))
  return [(name, want[name], got[name]) for name in want
          if np.linalg.norm(want[name]) > 1e-6 * total]


def relative_error(a, b):
  return float(np.linalg.norm(b - a) / np.linalg.norm(a))


@pytest.mark.slow
@pytest.mark.parametrize("remat, dropout", [("full", 0.0), ("matmuls", 0.1)])
def test_remat_gives_the_same_loss_and_gradients(remat, dropout):
  """Every transformer layer rematerialised: same parameter tree, same loss and gradients as
  without, up to float32 reassociation (with dropout too: the recomputed masks are the same)."""
  params, loss, _, grads = reference_loss_and_grads(dropout)
  remat_params, remat_loss, _, remat_grads = loss_and_grads(
      step_config(dropout_rate=dropout, remat=remat))
  assert jax.tree.structure(remat_params) == jax.tree.structure(params)
  assert remat_loss == pytest.approx(loss, rel=1e-6)
  for name, want, got in compared(grads, remat_grads):
    assert relative_error(want, got) < 1e-4, name


@pytest.mark.slow
def test_bfloat16_step_stays_close_to_float32():
  """The same params and batch in bfloat16 compute: loss within 0.2% and retrieval utility
  within 0.01 nats of the float32 step's, the whole gradient within 5% (relative L2) and the
  direction of every tensor holding >= 0.1% of the gradient's norm within cos 0.97 (measured
  2026-11-27 at the model's init: 3e-6, 9e-5, 0.95%, 0.998 for the lowest, 42 tensors
  checked); the retrieval logits and the reader's log-probs are float32."""
  params, loss, metrics, grads = reference_loss_and_grads()
  _, bf16_loss, bf16_metrics, bf16_grads = loss_and_grads(step_config(dtype="bfloat16"),
                                                          params=params)
  assert bf16_loss == pytest.approx(loss, rel=2e-3)
  assert float(bf16_metrics["retrieval_utility"]) == pytest.approx(
      float(metrics["retrieval_utility"]), abs=0.01)
  pairs = compared(grads, bf16_grads)
  everything = lambda i: np.concatenate([p[i].ravel() for p in pairs])
  assert relative_error(everything(1), everything(2)) < 0.05
  total = np.linalg.norm(everything(1))
  for name, a, b in pairs:   # tensors with a share of the gradient (value biases' are ~3e-5)
    if np.linalg.norm(a) < 1e-3 * total:
      continue
    cos = a.ravel() @ b.ravel() / (np.linalg.norm(a) * np.linalg.norm(b))
    assert cos > 0.97, (name, cos)
  config = step_config(dtype="bfloat16")
  config.model.vocab_size = VOCAB
  model = state_lib.build_model(config, VOCAB)
  batch = random_realm_batch(config, np.random.default_rng(0))
  logits, vocab_lp = jax.jit(steps.realm_scores, static_argnums=(0,))(model, params, batch)
  assert logits.dtype == jnp.float32 and vocab_lp.dtype == jnp.float32


def test_execution_options_are_checked_and_do_not_block_resume():
  for field, value in (("dtype", "float16"), ("attention", "flash"), ("remat", "some")):
    with pytest.raises(ConfigError, match=f"model.{field}"):
      validate(step_config(**{field: value}))
  with pytest.raises(ConfigError, match="model.attention.*bfloat16"):
    validate(step_config(attention="cudnn"))
  with pytest.raises(ConfigError, match="model.attention_dropout_rate"):
    validate(step_config(attention_dropout_rate=1.5))
  if jax.default_backend() == "cpu":   # a cuDNN run is restored / evaluated with XLA's
    with pytest.warns(UserWarning, match="model.attention 'cudnn' needs an NVIDIA GPU"):
      model = state_lib.build_model(step_config(attention="cudnn", dtype="bfloat16"), VOCAB)
    assert model.cfg.attention == "xla"
  saved = step_config().to_dict()
  faster = step_config(dtype="bfloat16", remat="full").to_dict()
  assert incompatible_fields(saved, faster) == []
  assert incompatible_fields(saved, step_config(attention_dropout_rate=0.2).to_dict())


def test_an_evaluation_names_the_options_that_change_what_the_parameters_compute():
  """`inference_differences`: a retriever option unset reads as the reader's (the same model
  spelt two ways is no difference), execution options and dropout are none, the span
  scorer's only count with a reader, and a record from before an option reads as the value
  it was written under."""
  from realm_jax.config.compatibility import inference_differences
  saved = step_config().to_dict()
  spelt = step_config()
  spelt.model.retriever.num_layers = spelt.model.num_layers
  spelt.model.retriever.hidden_act = spelt.model.hidden_act
  same = [spelt, step_config(dtype="bfloat16", remat="full", dropout_rate=0.3)]
  assert [inference_differences(saved, c.to_dict(), True) for c in same] == [[], []]
  heads = step_config()
  heads.model.retriever.num_heads = heads.model.num_heads * 2
  assert inference_differences(saved, heads.to_dict(), False) == [
      f"model.retriever.num_heads: {heads.model.num_heads} (the run) != "
      f"{heads.model.num_heads * 2} (this config)"]
  eps = step_config()
  eps.model.span_layer_norm_eps = 0.5
  assert inference_differences(saved, eps.to_dict(), False) == []
  assert [d.split(":")[0] for d in inference_differences(saved, eps.to_dict(), True)] == [
      "model.span_layer_norm_eps"]
  old = step_config().to_dict()
  del old["model"]["retriever"]["pooling"]          # before pooling: [CLS]
  assert inference_differences(old, saved, False) == []
  mean = step_config()
  mean.model.retriever.pooling = "mean"
  assert len(inference_differences(old, mean.to_dict(), False)) == 1


def test_dropout_anywhere_makes_the_step_stochastic():
  """The step draws dropout when any tower drops anything: the shared rate, the retriever's
  own, or the attention weights' alone."""
  assert steps.without_dropout(step_config(dropout_rate=0.0))
  assert not steps.without_dropout(step_config(dropout_rate=0.1))
  assert not steps.without_dropout(step_config(dropout_rate=0.0, attention_dropout_rate=0.1))
  towers = step_config(dropout_rate=0.0)
  towers.model.retriever.dropout_rate = 0.1
  assert not steps.without_dropout(towers)


def test_a_config_saved_before_the_execution_fields_loads_and_resumes():
  """A run's config.json from before model.attention / remat / attention_dropout_rate: the
  same model (XLA attention, no remat, attention dropout = dropout_rate) and no resume
  conflict."""
  current = step_config(dropout_rate=0.1)
  saved = current.to_dict()
  for field in ("attention", "remat", "attention_dropout_rate"):
    del saved["model"][field]
  assert incompatible_fields(saved, current.to_dict()) == []
  import ml_collections
  old = ml_collections.ConfigDict(saved)
  old.model.vocab_size = VOCAB
  cfg = state_lib.build_model(old, VOCAB).cfg
  assert (cfg.attention, cfg.remat, cfg.attention_dropout) == ("xla", "none", 0.1)


def test_mean_pooling_is_the_mean_over_real_tokens_then_the_projection():
  """`model.retriever.pooling` "mean": the tower's embedding is LayerNorm(dense(mean of the
  last layer over the non-padding tokens)), against float64 numpy from the tower's own
  sequence output; padding added to a row changes nothing; the tower has no pooler."""
  from realm_jax.models.realm import Embedder
  cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                   intermediate_size=64, max_position=32, dropout_rate=0.0)
  ids = padded_ids(np.random.default_rng(5), batch=4, length=12)
  segments = np.zeros_like(ids)
  tower = Embedder(cfg, 16, pooling="mean")
  params = drawn_params(tower, 0, ids, segments)
  assert "pooler" not in params["bert"]
  embed = jax.jit(lambda ids, segments: tower.apply({"params": params}, ids, segments))
  out = np.asarray(embed(ids, segments), np.float64)
  hidden, _ = jax.jit(BertEncoder(cfg, add_pooler=False).apply)({"params": params["bert"]},
                                                                ids, segments)
  hidden = np.asarray(hidden, np.float64)
  real = (ids > 0)[..., None]
  mean = (hidden * real).sum(1) / real.sum(1)
  dense = mean @ np.asarray(params["projection"]["kernel"], np.float64) + \
      np.asarray(params["projection"]["bias"])
  normed = (dense - dense.mean(-1, keepdims=True)) / np.sqrt(dense.var(-1, keepdims=True)
                                                             + cfg.layer_norm_eps)
  ref = normed * np.asarray(params["projection_norm"]["scale"]) + \
      np.asarray(params["projection_norm"]["bias"])
  np.testing.assert_allclose(out, ref, atol=2e-5)
  longer = np.concatenate([ids, np.zeros((4, 5), np.int32)], axis=1)
  np.testing.assert_allclose(np.asarray(embed(longer, np.zeros_like(longer))), out, atol=1e-5)
  cls = jax.eval_shape(Embedder(cfg, 16).init, jax.random.PRNGKey(0), ids, segments)["params"]
  assert "pooler" in cls["bert"]

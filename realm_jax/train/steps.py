"""The jitted computations: ICT / REALM / Open-QA train steps and their evaluations (the
embedders the index refresh and retrieval use: `runtime/embedders.py`). Each is jitted with
explicit shardings; train steps donate the state."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from realm_jax.data import pipeline
from realm_jax.models import losses
from realm_jax.models.bert import Packing
from realm_jax.models.realm import REALM
from realm_jax.config import defaults, reading
from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.train import candidate_rows


def realm_scores(model: REALM, params, batch, rngs=None, deterministic=True,
                 rescore: bool = True, null_first: bool = False, labels: bool = False):
  """Re-scores the k candidates with the current towers and reads each one.

  With `rescore=False` the retriever plays no part (the reader warm-up, whose last candidate
  is the query's own block, after the null document in evaluation): the prior puts all mass
  on the block, so the reader is trained only to read it (with the null document in the
  mixture it learns to memorise facts instead); in evaluation the null column is read to
  measure retrieval utility. The no-retrieval baseline's only candidate, the null document,
  also gets all the mass.
  `null_first`: candidate 0 of every query is the null document (`null_first` below); it is
  then read at its own length, not the block's, and, when no dropout is drawn (with dropout
  each row keeps its own draw), embedded once for the batch: the same values for a fraction
  of the work.
  Returns (retrieval_logits [B, k], vocab log-probs at the masks [B, k, M, V]), or with
  `labels` (training), log p(y_j | z, x) of the true wordpieces [B, k, M] in their place.
  """
  variables = {"params": params}
  k = batch["candidate_ids"].shape[1]
  null_first = null_first and k > 1
  logits = retrieval_logits(model, params, batch, rngs, deterministic, rescore, null_first)
  read = functools.partial(_read, model, variables, batch["mask_positions"],
                           batch["mask_labels"] if labels else None, rngs, deterministic)
  null_len = pipeline.reader_length(batch["query_ids"].shape[-1], pipeline.NULL_DOCUMENT_LENGTH)
  if not null_first or null_len >= batch["reader_ids"].shape[-1]:
    return logits, read(batch["reader_ids"], batch["reader_segments"])
  null = read(batch["reader_ids"][:, :1, :null_len], batch["reader_segments"][:, :1, :null_len])
  rest = read(batch["reader_ids"][:, 1:], batch["reader_segments"][:, 1:])
  return logits, jnp.concatenate([null, rest], axis=1)


def retrieval_logits(model: REALM, params, batch, rngs=None, deterministic=True,
                     rescore: bool = True, null_first: bool = False):
  """f(x, z) [B, k] of the k candidates with the current towers (`realm_scores`); without
  `rescore`, all prior mass on the last candidate."""
  b, k, _ = batch["candidate_ids"].shape
  if not rescore:
    return jnp.full((b, k), -1e9, jnp.float32).at[:, -1].set(0.0)
  variables = {"params": params}
  query = query_embeddings(model, params, batch, rngs, deterministic)
  if "candidate_emb" in batch:
    blocks = _index_candidates(model, variables, batch, rngs, deterministic)
  else:
    blocks = _embed_candidates(model, variables, batch, rngs, deterministic,
                               null_first and k > 1 and deterministic)
  return jnp.einsum("bd,bkd->bk", query, blocks)


def query_embeddings(model: REALM, params, batch, rngs=None, deterministic=True):
  """The query tower's embeddings [B, d] of a batch's queries: packed several a row where the
  batch carries them so (`retrieval.packed_query_rows`, `pipeline.pack_queries`), else one a
  row."""
  variables = {"params": params}
  if "packed_ids" in batch:
    packing = Packing(batch["packed_positions"], batch["packed_owner"])
    return model.apply(variables, batch["packed_ids"], packing, batch["query_packed_row"],
                       deterministic, rngs=rngs, method=REALM.embed_packed_queries)
  return model.apply(variables, batch["query_ids"], deterministic, rngs=rngs,
                     method=REALM.embed_queries)


def _index_candidates(model: REALM, variables, batch, rngs, deterministic):
  """The candidates' embeddings [B, k, d] from the serving index (`candidate_emb`, no gradient
  reaches the block tower through them), the null document's embedded once by the tower
  (from candidate 0 of row 0: the null document whenever training reads it; without it, a
  null only fills a slot left by duplicates, whose prior mass `without_untrained_null`
  removes, so its embedding takes no part)."""
  ids, segments = batch["candidate_ids"], batch["candidate_segments"]
  rows = _data_shards()
  null = model.apply(variables, ids[:rows, 0, :pipeline.NULL_DOCUMENT_LENGTH],
                     segments[:rows, 0, :pipeline.NULL_DOCUMENT_LENGTH], deterministic,
                     rngs=rngs, method=REALM.embed_blocks)[:1]        # [1, d]
  return jnp.where(null_candidates(ids)[..., None], null[None],
                   batch["candidate_emb"].astype(null.dtype))


def _data_shards() -> int:
  """The data axis of the mesh the step is traced under (1 outside one): the null document is
  embedded once per data shard, not as a single row: a batch of 1 over a data axis > 1 (the
  towers constrain their activations' batch to it) is split unevenly, and with a model axis
  > 1 too the word embeddings' row 0 got NaN gradients (every run with
  retrieval.block_gradients False on 4x2 and 2x4, some runs with the null document embedded
  once on 4x2; tests/test_sharding.py). Seen from outside XLA's partitioner, not traced in
  it: most likely its backward pass reads the uneven split's padding."""
  return dict(jax.sharding.get_abstract_mesh().shape).get("data", 1)


def _embed_candidates(model: REALM, variables, batch, rngs, deterministic, null_once: bool):
  """The block tower's embeddings of the candidates [B, k, d]; with `null_once`, candidate 0
  (the null document in every row) is embedded once and broadcast."""
  ids, segments = batch["candidate_ids"], batch["candidate_segments"]
  embed = lambda i, s: model.apply(variables, i.reshape(-1, i.shape[-1]),
                                   s.reshape(-1, s.shape[-1]), deterministic, rngs=rngs,
                                   method=REALM.embed_blocks)
  b, k, _ = ids.shape
  if not null_once:
    return embed(ids, segments).reshape(b, k, -1)
  rows = _data_shards()
  null = embed(ids[:rows, 0], segments[:rows, 0])[:1]             # [1, d]
  rest = embed(ids[:, 1:], segments[:, 1:]).reshape(b, k - 1, -1)
  return jnp.concatenate([jnp.broadcast_to(null[None], (b, 1, null.shape[-1])), rest], axis=1)


def _read(model: REALM, variables, mask_positions, mask_labels, rngs, deterministic,
          reader_ids, reader_segments):
  """The reader's vocab log-probs at the masks [B, n, M, V] for reader inputs [B, n, L]; with
  `mask_labels` [B, M], those of the labels alone [B, n, M]."""
  b, n, length = reader_ids.shape
  m = mask_positions.shape[1]
  per_read = lambda t: jnp.broadcast_to(t[:, None], (b, n, m)).reshape(b * n, m)
  inputs = (reader_ids.reshape(b * n, length), reader_segments.reshape(b * n, length),
            per_read(mask_positions))
  if mask_labels is not None:
    return model.apply(variables, *inputs, per_read(mask_labels), deterministic, rngs=rngs,
                       method=REALM.read_labels).reshape(b, n, m)
  log_probs = model.apply(variables, *inputs, deterministic, rngs=rngs, method=REALM.read)
  return log_probs.reshape(b, n, m, -1)


def without_dropout(config) -> bool:
  """Whether no tower drops anything (`model.dropout_rate`, the retriever's own, the attention
  weights'): the step then runs deterministically, with no dropout rng drawn."""
  for part in defaults.PARTS:
    m = reading.part_model(config, part)
    attention = m.get("attention_dropout_rate", -1.0)
    if m.dropout_rate > 0 or attention > 0:
      return False
  return True


def label_log_probs(vocab_log_probs, mask_labels):
  """log p(y_j | z, x) of the true wordpiece at each mask: [B, k, M, V], [B, M] -> [B, k, M]."""
  labels = jnp.broadcast_to(mask_labels[:, None, :, None], vocab_log_probs.shape[:3] + (1,))
  return jnp.take_along_axis(vocab_log_probs, labels, axis=-1)[..., 0]


def realm_loss_fn(params, model, batch, config, rng):
  """REALM's loss (plus metrics) for one batch: the negative marginal log-likelihood, or with
  `retrieval.loss` "distill" that of the reader plus the retriever's KL (`retriever_loss`).
  A batch carrying `candidate_log_probs` (the score cache's, train/score_cache.py) is not
  read again: those are the frozen reader's log p(y_j | z, x)."""
  params = state_lib.stop_frozen_gradients(params, reading.frozen_paths(config))
  deterministic = without_dropout(config)
  candidates = candidate_rows.of(config)
  rngs, first = {"dropout": rng}, candidates.null_first(training=True)
  if "candidate_log_probs" in batch:
    logits = retrieval_logits(model, params, batch, rngs, deterministic, candidates.scored,
                              first)
    mask_lp = batch["candidate_log_probs"]
  else:
    logits, mask_lp = realm_scores(model, params, batch, rngs, deterministic,
                                   candidates.scored, first, labels=True)
  logits = without_untrained_null(config, batch, logits)
  loss, metrics = retriever_loss(config, logits, mask_lp, batch["mask_weights"],
                                 batch.get("has_evidence"))
  if logits.shape[1] == 1:
    metrics = {}    # one candidate (the warm-up's own block, the baseline's null document):
                    # no p(z|x) to measure, no utility to measure against
  elif not reading.null_in_training(config):   # candidate 0 is a retrieved block
    metrics = {k: v for k, v in metrics.items()
               if k not in ("retrieval_utility", "null_doc_prob")}
  return loss, metrics


def retriever_loss(config, logits, mask_lp, mask_weights, query_weights=None):
  """`retrieval.loss`: "marginal", REALM's -log p(y|x) (both halves learn from it); "distill",
  the same marginal with p(z|x) held fixed (the reader's term) plus the KL from the reader's
  per-candidate target to p(z|x) (the retriever's; `losses.distill_loss`)."""
  r = config.retrieval
  if r.get("loss", "marginal") == "marginal":
    return losses.realm_loss(logits, mask_lp, mask_weights, r.marginalization)
  nll, metrics = losses.realm_loss(jax.lax.stop_gradient(logits), mask_lp, mask_weights,
                                   r.marginalization)
  kl, kl_metrics = losses.distill_loss(logits, mask_lp, mask_weights, r.distill_temperature,
                                       r.retriever_temperature, r.marginalization,
                                       query_weights)
  return nll + kl, {**metrics, **kl_metrics}


def null_candidates(candidate_ids):
  """[B, k] True where a candidate is the null document: `[CLS][SEP][SEP]` and padding
  (pipeline.candidate_inputs), the only candidate whose 4th wordpiece is padding (a block
  holds `[CLS]`, a title or body wordpiece and two `[SEP]`s at least)."""
  return candidate_ids[:, :, pipeline.NULL_DOCUMENT_LENGTH] == 0


def without_untrained_null(config, batch, logits):
  """Retrieval logits with no prior mass on a null document when training leaves it out
  (`retrieval.train_null_document` False): in a training batch, one filling a slot left by
  duplicate blocks; in evaluation, column 0, read alone outside the marginal."""
  if reading.null_in_training(config):
    return logits
  return jnp.where(null_candidates(batch["candidate_ids"]), -1e9, logits)


def ict_loss_fn(params, model, batch, config, rng):
  """Inverse Cloze Task loss with in-batch negatives over the global batch."""
  params = state_lib.stop_frozen_gradients(params, reading.frozen_paths(config))
  deterministic = without_dropout(config)
  variables, rngs = {"params": params}, {"dropout": rng}
  query = model.apply(variables, batch["query_ids"], deterministic, rngs=rngs,
                      method=REALM.embed_queries)
  blocks = model.apply(variables, batch["block_ids"], batch["block_segments"], deterministic,
                       rngs=rngs, method=REALM.embed_blocks)
  return losses.ict_loss(query, blocks)


def openqa_scores(model: REALM, params, batch, rngs=None, deterministic=True):
  """The current query tower against the top-N candidates' frozen block embeddings, and the
  reader's span scores on the top-K blocks.

  Returns (retrieval_logits [B, N], span_logits [B, K, S])."""
  variables = {"params": params}
  query = model.apply(variables, batch["question_ids"], deterministic, rngs=rngs,
                      method=REALM.embed_queries)
  logits = jnp.einsum("bd,bnd->bn", query, batch["candidate_emb"])
  b, k, lr = batch["reader_ids"].shape
  spans = model.apply(variables, batch["reader_ids"].reshape(b * k, lr),
                      batch["reader_segments"].reshape(b * k, lr),
                      batch["span_start_mask"].reshape(b * k, lr),
                      batch["span_end_mask"].reshape(b * k, lr), deterministic, rngs=rngs,
                      method=REALM.read_spans)
  return logits, spans.reshape(b, k, -1)


def openqa_loss_fn(params, model, batch, config, rng):
  """ORQA's retriever + reader marginal log-likelihood (block tower and index frozen)."""
  params = state_lib.stop_frozen_gradients(params, reading.frozen_paths(config))
  deterministic = without_dropout(config)
  logits, spans = openqa_scores(model, params, batch, {"dropout": rng}, deterministic)
  return losses.openqa_loss(logits, batch["has_answer"], spans, batch["span_correct"])


LOSS_FNS = {"realm": realm_loss_fn, "ict": ict_loss_fn, "openqa": openqa_loss_fn}


def make_train_step(config, model, state_shardings, mesh):
  """jit(step, explicit in/out shardings, donated state) for `config.task`."""
  loss_fn = LOSS_FNS[config.task]

  def step(state, batch, rng):
    rng = jax.random.fold_in(rng, state.step)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, metrics), grads = grad_fn(state.params, model, batch, config, rng)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A non-finite loss or gradient is never applied: params and optimizer state stay as they
    # were (the step counter moves on); the loop stops or counts it (`train.nonfinite`).
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                             state.apply_gradients(grads=grads), state)
    new_state = new_state.replace(step=state.step + 1)
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, finite=finite)
    return new_state, metrics

  rules = partitioning.logical_rules(config.mesh.rules)
  jitted = jax.jit(step, in_shardings=(state_shardings, partitioning.batch_sharding(mesh),
                                       partitioning.replicated(mesh)),
                   out_shardings=(state_shardings, partitioning.replicated(mesh)),
                   donate_argnums=(0,))

  def run(state, batch, rng):
    with partitioning.mesh_rules(mesh, rules):
      return jitted(state, batch, rng)

  run.jitted = jitted
  return run


def make_realm_eval(config, model, mesh):
  """Per-example evaluation of a REALM batch: log-likelihood, p(z|x) and the predicted
  wordpiece at each mask (argmax of the marginal over candidates; and of the null document's
  own distribution, the reader without evidence). Without the null document in training, the
  marginal is over the retrieved blocks only, as in the step."""
  rules = partitioning.logical_rules(config.mesh.rules)
  candidates = candidate_rows.of(config)

  def evaluate(params, batch):
    logits, vocab_lp = realm_scores(model, params, batch, rescore=candidates.scored,
                                    null_first=candidates.null_first(training=False))
    logits = without_untrained_null(config, batch, logits)
    marginal = losses.marginal_token_log_probs(logits, vocab_lp)
    mask_lp = label_log_probs(vocab_lp, batch["mask_labels"])
    log_lik = losses.realm_log_likelihood(logits, mask_lp, batch["mask_weights"],
                                          config.retrieval.marginalization)
    null_lik = losses.null_log_likelihood(mask_lp, batch["mask_weights"],
                                          config.retrieval.marginalization)
    return {"predictions": jnp.argmax(marginal, axis=-1).astype(jnp.int32),
            # the same reader given the null document alone (candidate 0)
            "null_predictions": jnp.argmax(vocab_lp[:, 0], axis=-1).astype(jnp.int32),
            "p_z": jax.nn.softmax(logits, axis=-1),
            "log_likelihood": log_lik, "retrieval_utility": log_lik - null_lik}

  jitted = jax.jit(evaluate, out_shardings=partitioning.batch_sharding(mesh))

  def run(params, batch):
    with partitioning.mesh_rules(mesh, rules):
      return jitted(params, batch)

  return run


def make_openqa_eval(config, model, mesh):
  """Per question: the best (block, span) of the top-K blocks by span + retrieval logit, its
  score, and each block's retrieval logit and best span score (the evidence shown)."""
  rules = partitioning.logical_rules(config.mesh.rules)

  def evaluate(params, batch):
    logits, spans = openqa_scores(model, params, batch)
    k = spans.shape[1]
    joint = spans + logits[:, :k, None]
    flat = joint.reshape(joint.shape[0], -1)
    best = jnp.argmax(flat, axis=-1)
    return {"best_block": (best // spans.shape[2]).astype(jnp.int32),
            "best_span": (best % spans.shape[2]).astype(jnp.int32),
            "score": jnp.max(flat, axis=-1), "retrieval_logits": logits[:, :k],
            "block_span_scores": jnp.max(spans, axis=-1),
            "block_best_span": jnp.argmax(spans, axis=-1).astype(jnp.int32)}

  jitted = jax.jit(evaluate, out_shardings=partitioning.batch_sharding(mesh))

  def run(params, batch):
    with partitioning.mesh_rules(mesh, rules):
      return jitted(params, batch)

  return run

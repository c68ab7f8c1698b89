"""REALM's marginal likelihood over retrieved candidates, retrieval utility, and the ICT loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

MARGINALIZATIONS = ("joint", "per_mask")


@jax.custom_vjp
def label_log_softmax(logits: Array, labels: Array) -> Array:
  """log softmax(logits)[label] over the last axis: [..., V] float, [...] int -> [...].

  The same values as `log_softmax` then a gather, without either's [..., V] backward: the
  gradient g * (one_hot(label) - softmax) is one element-wise pass over the logits (the
  gather's own backward would scatter into a zero tensor of the logits' shape).
  """
  return _label_log_softmax_fwd(logits, labels)[0]


def _label_log_softmax_fwd(logits, labels):
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  return picked - lse, (logits, lse, labels)


def _label_log_softmax_bwd(residuals, g):
  logits, lse, labels = residuals
  one_hot = labels[..., None] == jnp.arange(logits.shape[-1], dtype=labels.dtype)
  return g[..., None] * (one_hot - jnp.exp(logits - lse[..., None])), None


label_log_softmax.defvjp(_label_log_softmax_fwd, _label_log_softmax_bwd)


def realm_log_likelihood(retrieval_logits: Array, mask_log_probs: Array, mask_weights: Array,
                         marginalization: str = "joint") -> Array:
  """log p(y|x) per query (REALM eq. 1-2).

  joint (the paper):     log sum_z p(z|x) prod_j p(y_j|z,x)
  per_mask (released code, HF): mean_j log sum_z p(z|x) p(y_j|z,x)
  With one mask the two coincide.

  Args:
    retrieval_logits: [B, k] f(x, z) for the k candidates (null document included).
    mask_log_probs: [B, k, M] log p(y_j | z, x) of the true token at each mask.
    mask_weights: [B, M] 1 for real masks, 0 for padding.
    marginalization: "joint" or "per_mask".
  Returns:
    [B] log p(y|x).
  """
  log_p_z = jax.nn.log_softmax(retrieval_logits, axis=-1)  # [B, k]
  masked = mask_log_probs * mask_weights[:, None, :]
  if marginalization == "joint":
    return jax.nn.logsumexp(log_p_z + masked.sum(-1), axis=-1)
  if marginalization == "per_mask":
    per_mask = jax.nn.logsumexp(log_p_z[:, :, None] + masked, axis=1)  # [B, M]
    return (per_mask * mask_weights).sum(-1) / jnp.maximum(mask_weights.sum(-1), 1.0)
  raise ValueError(f"marginalization must be one of {MARGINALIZATIONS}, got {marginalization!r}")


def null_log_likelihood(mask_log_probs: Array, mask_weights: Array,
                        marginalization: str = "joint") -> Array:
  """log p(y | null, x): the reader's likelihood given only the null document (candidate 0)."""
  null = mask_log_probs[:, 0, :] * mask_weights
  if marginalization == "joint":
    return null.sum(-1)
  return null.sum(-1) / jnp.maximum(mask_weights.sum(-1), 1.0)


def realm_loss(retrieval_logits: Array, mask_log_probs: Array, mask_weights: Array,
               marginalization: str = "joint") -> tuple[Array, dict[str, Array]]:
  """Mean negative log-likelihood plus metrics (retrieval utility, p(z|x) entropy): the mean
  over queries ("joint"), or over every real mask of the batch ("per_mask", as the released
  code and HF's RealmForMaskedLM average their per-mask marginals).

  Log retrieval utility = log p(y|x) - log p(y|null,x) (REALM sec. 4); positive means the
  retrieved documents helped.
  """
  log_lik = realm_log_likelihood(retrieval_logits, mask_log_probs, mask_weights, marginalization)
  null_lik = null_log_likelihood(mask_log_probs, mask_weights, marginalization)
  p_z = jax.nn.softmax(retrieval_logits, axis=-1)
  mean = jnp.mean                     # over queries
  if marginalization == "per_mask":   # over every real mask of the batch (released code, HF)
    share = mask_weights.sum(-1) / jnp.maximum(mask_weights.sum(), 1.0)
    mean = lambda per_query: jnp.sum(share * per_query)
  metrics = {
      "retrieval_utility": mean(log_lik - null_lik),
      "null_doc_prob": jnp.mean(p_z[:, 0]),
      "retrieval_entropy": jnp.mean(-(p_z * jax.nn.log_softmax(retrieval_logits, -1)).sum(-1)),
  }
  return -mean(log_lik), metrics


RETRIEVER_LOSSES = ("marginal", "distill")


def candidate_log_likelihood(mask_log_probs: Array, mask_weights: Array,
                             marginalization: str = "joint") -> Array:
  """log p(y | z, x) of each candidate [B, k]: the sum over the real masks ("joint"), or
  their mean ("per_mask", the scale the released code's per-mask marginal reads)."""
  summed = (mask_log_probs * mask_weights[:, None, :]).sum(-1)
  if marginalization == "joint":
    return summed
  return summed / jnp.maximum(mask_weights.sum(-1), 1.0)[:, None]


def distill_loss(retrieval_logits: Array, mask_log_probs: Array, mask_weights: Array,
                 temperature: float, retriever_temperature: float = 1.0,
                 marginalization: str = "joint",
                 query_weights: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """Atlas's PDist: the retriever learns the reader's ranking of the candidates.

  loss = mean_x KL(q(.|x) || p(.|x)), where the target q(z|x) = softmax_z(log p(y|z,x) / tau)
  is the reader's likelihood of the masked span given candidate z alone (no gradient: the
  reader is the teacher), tau = `temperature`, and p(z|x) = softmax_z(f(x,z) / tau_s),
  tau_s = `retriever_temperature`. Every candidate the step reads is in both softmaxes: the
  null document too when training reads it (`retrieval.train_null_document`), so the
  retriever learns where "no evidence" ranks; a candidate masked out of the prior (logit
  -1e9: a null document filling a slot when training leaves it out) gets no target mass either.
  Its gradient with respect to f(x, z) is (p(z|x) - q(z|x)) / (tau_s B). With
  `query_weights` [B] (`retrieval.distill_queries=evidence`: 1 where a candidate holds the
  span), the KL is their weighted mean instead (0 when every weight is 0).

  Returns (mean KL, metrics: the KL and the target's entropy).
  """
  masked_out = retrieval_logits <= -1e8
  reader = candidate_log_likelihood(jax.lax.stop_gradient(mask_log_probs), mask_weights,
                                    marginalization)
  target_logits = jnp.where(masked_out, -1e9, reader / temperature)
  log_q = jax.nn.log_softmax(target_logits, axis=-1)
  q = jnp.exp(log_q)
  log_p = jax.nn.log_softmax(retrieval_logits / retriever_temperature, axis=-1)
  kl = jnp.where(masked_out, 0.0, q * (log_q - log_p)).sum(-1)
  entropy = jnp.where(masked_out, 0.0, -q * log_q).sum(-1)
  if query_weights is None:
    return jnp.mean(kl), {"distill_kl": jnp.mean(kl),
                          "distill_target_entropy": jnp.mean(entropy)}
  total = jnp.maximum(query_weights.sum(), 1.0)
  mean_kl = (kl * query_weights).sum() / total
  return mean_kl, {"distill_kl": mean_kl,
                   "distill_target_entropy": (entropy * query_weights).sum() / total,
                   "distill_queries": query_weights.mean()}


def marginal_token_log_probs(retrieval_logits: Array, vocab_log_probs: Array) -> Array:
  """log p(y_j = v | x) = log sum_z p(z|x) p(v|z,x) for every vocabulary entry.

  Args: retrieval_logits [B, k]; vocab_log_probs [B, k, M, V]. Returns [B, M, V].
  """
  log_p_z = jax.nn.log_softmax(retrieval_logits, axis=-1)
  return jax.nn.logsumexp(log_p_z[:, :, None, None] + vocab_log_probs, axis=1)


def ict_loss(query_emb: Array, block_emb: Array) -> tuple[Array, dict[str, Array]]:
  """Inverse Cloze Task: in-batch softmax over the global batch (ORQA eq. 4).

  The i-th query's positive is the i-th block; every other block of the (global) batch is a
  negative. Under jit on globally sharded arrays the [B, B] score matrix spans all devices.
  """
  scores = query_emb @ block_emb.T  # [B, B]
  log_probs = jax.nn.log_softmax(scores, axis=-1)
  labels = jnp.arange(scores.shape[0])
  loss = -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))
  accuracy = jnp.mean(jnp.argmax(scores, axis=-1) == labels)
  return loss, {"ict_accuracy": accuracy}


def openqa_loss(retrieval_logits: Array, has_answer: Array, span_logits: Array,
                span_correct: Array) -> tuple[Array, dict[str, Array]]:
  """ORQA's fine-tuning loss: retriever + reader marginal log-likelihoods, per question.

  retriever: -log sum_{z in top-N, z contains an answer} p(z|x), p over the top N;
  reader: -log sum_{(z, s) matching an answer} p(z, s|x), p over every span s of the top K
  blocks, each scored span(s) + f(x, z) (the block's retrieval logit added to its spans).
  A question with no answer-bearing block (no matching span) adds 0 to that term.

  Args:
    retrieval_logits: [B, N] f(x, z) of the top-N blocks, best first.
    has_answer: [B, N] bool, block z contains an answer string.
    span_logits: [B, K, S] span scores of the top-K blocks' reader inputs (invalid: -1e9).
    span_correct: [B, K, S] bool, the span's tokens are an answer.
  Returns:
    (mean loss, metrics).
  """
  k = span_logits.shape[1]
  log_p_z = jax.nn.log_softmax(retrieval_logits, axis=-1)
  retriever_ok = has_answer.any(-1)
  retriever_ll = jax.nn.logsumexp(jnp.where(has_answer, log_p_z, -1e9), axis=-1)
  joint = (span_logits + retrieval_logits[:, :k, None]).reshape(span_logits.shape[0], -1)
  correct = span_correct.reshape(joint.shape)
  reader_ok = correct.any(-1)
  reader_ll = (jax.nn.logsumexp(jnp.where(correct, joint, -1e9), axis=-1)
               - jax.nn.logsumexp(joint, axis=-1))
  retriever_loss = jnp.where(retriever_ok, -retriever_ll, 0.0)
  reader_loss = jnp.where(reader_ok, -reader_ll, 0.0)
  best = jnp.argmax(joint, axis=-1)
  metrics = {
      "retriever_loss": jnp.mean(retriever_loss), "reader_loss": jnp.mean(reader_loss),
      "answer_in_top_n": jnp.mean(retriever_ok), "answer_in_top_k": jnp.mean(has_answer[:, :k]
                                                                           .any(-1)),
      "span_accuracy": jnp.mean(jnp.take_along_axis(correct, best[:, None], axis=1)[:, 0]),
  }
  return jnp.mean(retriever_loss + reader_loss), metrics

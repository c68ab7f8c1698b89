"""REALM's marginal likelihood and its gradient, retrieval utility and the ICT loss, checked
against independent float64 numpy computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from realm_jax.models import losses


def random_case(seed, b=4, k=5, m=3, vocab=7, one_valid=False):
  """Retrieval logits [B,k], log p(y_j|z,x) [B,k,M] gathered from real log-softmaxes over a
  small vocab, and 0/1 mask weights with at least one real mask per row."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(b, k)) * 2.0
  vocab_logits = rng.normal(size=(b, k, m, vocab)) * 2.0
  vocab_lp = vocab_logits - np.log(np.exp(vocab_logits).sum(-1, keepdims=True))
  labels = rng.integers(0, vocab, size=(b, 1, m, 1))
  mask_lp = np.take_along_axis(vocab_lp, np.broadcast_to(labels, (b, k, m, 1)), -1)[..., 0]
  if one_valid:
    weights = np.zeros((b, m))
    weights[np.arange(b), rng.integers(0, m, size=b)] = 1.0
  else:
    weights = (rng.random((b, m)) < 0.7).astype(np.float64)
    weights[:, 0] = 1.0
    rng.shuffle(weights, axis=1)
  return logits, mask_lp, weights


def np_reference(logits, mask_lp, weights):
  """float64: p(z|x), p(y|z,x) = exp(sum_j w_j log p(y_j|z,x)), p(y|x) = sum_z p(z|x) p(y|z,x)."""
  p_z = np.exp(logits - logits.max(-1, keepdims=True))
  p_z /= p_z.sum(-1, keepdims=True)
  p_y_given_z = np.exp((mask_lp * weights[:, None, :]).sum(-1))
  p_y = (p_z * p_y_given_z).sum(-1)
  return p_z, p_y_given_z, p_y


def f32(*arrays):
  return [jnp.asarray(a, jnp.float32) for a in arrays]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_log_likelihood_and_gradient_match_realm_r_of_z(seed):
  logits, mask_lp, weights = random_case(seed)
  p_z, p_y_given_z, p_y = np_reference(logits, mask_lp, weights)
  l, lp, w = f32(logits, mask_lp, weights)

  log_lik = losses.realm_log_likelihood(l, lp, w, "joint")
  np.testing.assert_allclose(np.asarray(log_lik), np.log(p_y), rtol=1e-5, atol=1e-5)

  # Rows are independent, so the gradient of the sum is each row's own gradient.
  grad = jax.grad(lambda x: losses.realm_log_likelihood(x, lp, w, "joint").sum())(l)
  r_z = (p_y_given_z / p_y[:, None] - 1.0) * p_z          # REALM eq. (4)
  np.testing.assert_allclose(np.asarray(grad), r_z, atol=1e-5)
  assert np.abs(r_z).max() > 1e-2      # the case is not degenerate: retrieval matters
  # Sanity of the identity itself: r(z) sums to zero over candidates.
  np.testing.assert_allclose(np.asarray(grad).sum(-1), 0.0, atol=1e-5)


def test_per_mask_marginalization_matches_numpy():
  logits, mask_lp, weights = random_case(3)
  p_z, _, _ = np_reference(logits, mask_lp, weights)
  per_mask = np.log((p_z[:, :, None] * np.exp(mask_lp)).sum(1))         # [B, M]
  expected = (per_mask * weights).sum(-1) / weights.sum(-1)
  got = losses.realm_log_likelihood(*f32(logits, mask_lp, weights), "per_mask")
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
  joint = losses.realm_log_likelihood(*f32(logits, mask_lp, weights), "joint")
  assert not np.allclose(np.asarray(got), np.asarray(joint), atol=1e-3)


@pytest.mark.parametrize("m, one_valid", [(1, False), (4, True)])
def test_per_mask_equals_joint_with_one_mask(m, one_valid):
  logits, mask_lp, weights = random_case(4, m=m, one_valid=one_valid)
  assert (weights.sum(-1) == 1).all()
  args = f32(logits, mask_lp, weights)
  joint = losses.realm_log_likelihood(*args, "joint")
  per_mask = losses.realm_log_likelihood(*args, "per_mask")
  np.testing.assert_allclose(np.asarray(per_mask), np.asarray(joint), rtol=1e-6, atol=1e-6)
  _, _, p_y = np_reference(logits, mask_lp, weights)
  np.testing.assert_allclose(np.asarray(joint), np.log(p_y), rtol=1e-5, atol=1e-5)


def test_joint_with_a_single_candidate_is_the_sum_of_mask_log_probs():
  logits, mask_lp, weights = random_case(5, k=1, m=6)
  got = losses.realm_log_likelihood(*f32(logits, mask_lp, weights), "joint")
  np.testing.assert_allclose(np.asarray(got), (mask_lp[:, 0] * weights).sum(-1),
                             rtol=1e-5, atol=1e-5)


def test_unknown_marginalization_is_rejected():
  with pytest.raises(ValueError, match="marginalization"):
    losses.realm_log_likelihood(*f32(*random_case(0)), "mean")


@pytest.mark.parametrize("marginalization", ["joint", "per_mask"])
def test_realm_loss_and_retrieval_utility(marginalization):
  logits, mask_lp, weights = random_case(6)
  weights[0], weights[1] = [1, 0, 0], [1, 1, 1]      # spans of 1, 3 and 2 wordpieces
  p_z, p_y_given_z, p_y = np_reference(logits, mask_lp, weights)
  if marginalization == "joint":
    log_lik = np.log(p_y)
    null_lik = (mask_lp[:, 0] * weights).sum(-1)           # log p(y | null, x)
  else:
    per_mask = np.log((p_z[:, :, None] * np.exp(mask_lp)).sum(1))
    log_lik = (per_mask * weights).sum(-1) / weights.sum(-1)
    null_lik = (mask_lp[:, 0] * weights).sum(-1) / weights.sum(-1)
  # joint: the mean over queries; per_mask: over every real mask of the batch, as the released
  # code and HF's RealmForMaskedLM (-sum_{b,j} marginal_bj w_bj / sum w)
  share = np.full(len(logits), 1 / len(logits)) if marginalization == "joint" else \
      weights.sum(-1) / weights.sum()
  assert marginalization == "joint" or len(set(weights.sum(-1))) > 1   # the cases differ
  loss, metrics = losses.realm_loss(*f32(logits, mask_lp, weights), marginalization)
  np.testing.assert_allclose(float(loss), -(share * log_lik).sum(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(metrics["retrieval_utility"]),
                             (share * (log_lik - null_lik)).sum(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(metrics["null_doc_prob"]), p_z[:, 0].mean(), atol=1e-6)
  entropy = -(p_z * np.log(p_z)).sum(-1).mean()
  np.testing.assert_allclose(float(metrics["retrieval_entropy"]), entropy, rtol=1e-5)


def test_retrieval_utility_sign():
  """All mass on a candidate that explains y better than the null document: utility > 0;
  all mass on the null document: utility = 0."""
  logits, mask_lp, weights = random_case(7, k=2, m=2)
  mask_lp[:, 0] = -5.0
  mask_lp[:, 1] = -0.5
  sure = np.array([[-30.0, 30.0]] * len(logits))
  _, metrics = losses.realm_loss(*f32(sure, mask_lp, weights))
  assert float(metrics["retrieval_utility"]) > 4.0
  _, metrics = losses.realm_loss(*f32(-sure, mask_lp, weights))
  assert abs(float(metrics["retrieval_utility"])) < 1e-4


def test_ict_loss_is_in_batch_softmax_cross_entropy():
  rng = np.random.default_rng(8)
  q, b = rng.normal(size=(6, 5)), rng.normal(size=(6, 5))
  scores = q @ b.T
  shifted = scores - scores.max(1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
  expected = -np.mean(np.diag(log_probs))
  loss, metrics = losses.ict_loss(*f32(q, b))
  np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
  np.testing.assert_allclose(float(metrics["ict_accuracy"]),
                             np.mean(scores.argmax(1) == np.arange(6)))
  # A block set where each query's positive clearly wins: accuracy 1 and a small loss.
  loss, metrics = losses.ict_loss(*f32(q * 10, q))
  assert float(metrics["ict_accuracy"]) == 1.0 and float(loss) < 0.1


def test_marginal_token_log_probs():
  rng = np.random.default_rng(9)
  logits = rng.normal(size=(2, 3))
  vocab_logits = rng.normal(size=(2, 3, 4, 5))
  vocab_lp = vocab_logits - np.log(np.exp(vocab_logits).sum(-1, keepdims=True))
  p_z, _, _ = np_reference(logits, np.zeros((2, 3, 1)), np.ones((2, 1)))
  expected = np.log((p_z[:, :, None, None] * np.exp(vocab_lp)).sum(1))
  got = losses.marginal_token_log_probs(*f32(logits, vocab_lp))
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.exp(np.asarray(got)).sum(-1), 1.0, rtol=1e-5)


def test_label_log_softmax_is_log_softmax_at_the_label_with_its_gradient():
  """The fused log p(label): the values and the gradient of log_softmax + gather, for labels
  anywhere in the vocab and logits of any scale (the one-hot minus softmax backward)."""
  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.normal(size=(3, 4, 50)) * np.array([0.1, 1.0, 30.0])[:, None, None],
                       jnp.float32)
  labels = jnp.asarray(rng.integers(0, 50, (3, 4)).astype(np.int32))
  labels = labels.at[0, 0].set(0).at[0, 1].set(49)
  weights = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)
  reference = lambda x: jnp.take_along_axis(jax.nn.log_softmax(x), labels[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(losses.label_log_softmax(logits, labels)),
                             np.asarray(reference(logits)), rtol=1e-6, atol=1e-6)
  grad = lambda f: jax.grad(lambda x: (f(x) * weights).sum())(logits)
  np.testing.assert_allclose(np.asarray(grad(lambda x: losses.label_log_softmax(x, labels))),
                             np.asarray(grad(reference)), rtol=1e-5, atol=1e-6)


def np_distill(logits, mask_lp, weights, tau, tau_s, marginalization, masked=None):
  """float64 Atlas PDist: KL(q || p), q = softmax(log p(y|z,x) / tau), p = softmax(f / tau_s);
  `masked` [B, k] candidates take no part in either. Returns (KL [B], d KL / d logits)."""
  score = (mask_lp * weights[:, None, :]).sum(-1)
  if marginalization == "per_mask":
    score = score / weights.sum(-1, keepdims=True)
  masked = np.zeros(logits.shape, bool) if masked is None else masked
  softmax = lambda x: (lambda e: e / e.sum(-1, keepdims=True))(
      np.where(masked, 0.0, np.exp(x - np.where(masked, -np.inf, x).max(-1, keepdims=True))))
  q, p = softmax(score / tau), softmax(logits / tau_s)
  with np.errstate(divide="ignore", invalid="ignore"):
    kl = np.where(masked | (q == 0), 0.0, q * (np.log(q) - np.log(p))).sum(-1)
  return kl, (p - q) / tau_s


@pytest.mark.parametrize("tau, tau_s, marginalization", [
    (1.0, 1.0, "joint"), (0.1, 1.0, "joint"), (2.0, 0.5, "per_mask")])
def test_distill_loss_and_gradient_match_a_float64_reference(tau, tau_s, marginalization):
  logits, mask_lp, weights = random_case(3)
  masked = np.zeros(logits.shape, bool)
  masked[1, 2] = True            # a null document filling a slot training leaves it out of
  logits = np.where(masked, -1e9, logits)
  kl_ref, grad_ref = np_distill(logits, mask_lp, weights, tau, tau_s, marginalization, masked)
  l, lp, w = f32(logits, mask_lp, weights)
  fn = lambda x: losses.distill_loss(x, lp, w, tau, tau_s, marginalization)[0]
  np.testing.assert_allclose(float(fn(l)), kl_ref.mean(), rtol=1e-5, atol=1e-6)
  grad = np.asarray(jax.grad(fn)(l))
  np.testing.assert_allclose(grad, grad_ref / len(logits), atol=1e-6)
  assert np.abs(grad_ref).max() > 1e-2 and grad[1, 2] == 0
  # the reader is the teacher: no gradient reaches its log-likelihoods
  assert not np.asarray(jax.grad(lambda m: losses.distill_loss(l, m, w, tau, tau_s,
                                                               marginalization)[0])(lp)).any()


def test_distill_over_the_queries_with_evidence_is_their_weighted_mean():
  """retrieval.distill_queries=evidence: the KL and its gradient come from the weighted
  queries alone (float64 reference); no weighted query: no loss, no gradient."""
  logits, mask_lp, weights = random_case(3, b=3)
  kl_ref, grad_ref = np_distill(logits, mask_lp, weights, 1.0, 1.0, "joint")
  query_weights = np.array([1.0, 0.0, 1.0])
  l, lp, w, qw = f32(logits, mask_lp, weights, query_weights)
  fn = lambda x, q: losses.distill_loss(x, lp, w, 1.0, 1.0, "joint", q)[0]
  np.testing.assert_allclose(float(fn(l, qw)), (kl_ref * query_weights).sum() / 2, rtol=1e-5)
  grad = np.asarray(jax.grad(fn)(l, qw))
  np.testing.assert_allclose(grad, grad_ref * query_weights[:, None] / 2, atol=1e-6)
  assert not grad[1].any() and grad[0].any()
  none = jnp.zeros(3)
  assert float(fn(l, none)) == 0 and not np.asarray(jax.grad(fn)(l, none)).any()


def test_a_span_is_found_in_a_candidates_body_only():
  from realm_jax.train.batches import span_in_candidates
  ids = np.array([[[101, 7, 8, 102, 5, 6, 9, 102, 0, 0],     # title 7 8, body 5 6 9
                   [101, 5, 102, 4, 5, 102, 0, 0, 0, 0],      # body 4 5: the span cut short
                   [101, 102, 102, 0, 0, 0, 0, 0, 0, 0]]])     # the null document
  cands = {"candidate_ids": ids, "body_start": np.array([[4, 3, 2]]),
           "lengths": np.array([[8, 6, 3]])}
  found = lambda labels, weights: span_in_candidates(np.array([labels]), np.array([weights]),
                                                     cands)[0].tolist()
  assert found([5, 6, 0], [1, 1, 0]) == [True, False, False]
  assert found([7, 8, 0], [1, 1, 0]) == [False, False, False]    # only in a title
  assert found([5, 0, 0], [1, 0, 0]) == [True, True, False]
  assert found([0, 0, 0], [0, 0, 0]) == [False, False, False]    # no span

"""`train.optimizer`: "optax_adamw" (the default: optax's bias-corrected AdamW, lr warmed up to
`train.lr` then decayed linearly from there; checked against optax.adamw as the optimizer was
built before the option) and "bert" (BERT's AdamWeightDecayOptimizer and `create_optimizer`'s
schedule, as REALM and ORQA trained; checked against a float64 numpy reference of both). Both
keep the same state, so a run resumes under the other, which start-up says."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from realm_jax import workdir as workdir_lib
from realm_jax.config.compatibility import incompatible_fields, with_added_fields
from realm_jax.config.defaults import base_config
from realm_jax.config.reading import frozen_paths
from realm_jax.config.validation import validate
from realm_jax.errors import ConfigError
from realm_jax.runtime import partitioning, state as state_lib
from tests.helpers import load_config_module, tiny_config

# a leaf per kind: decayed kernels, BERT's undecayed bias and LayerNorm, a frozen block tower
SHAPES = {("retriever", "query_tower", "dense", "kernel"): (3, 2),
          ("retriever", "query_tower", "dense", "bias"): (2,),
          ("retriever", "block_tower", "dense", "kernel"): (3, 2),
          ("reader", "LayerNorm", "scale"): (4,),
          ("reader", "dense", "kernel"): (4, 3)}
BERT_NO_DECAY = ("LayerNorm", "layer_norm", "bias")   # BERT's exclude_from_weight_decay


def nested(flat: dict) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    for name in path[:-1]:
      node = node.setdefault(name, {})
    node[path[-1]] = value
  return out


def flat(tree) -> dict:
  return {tuple(str(k.key) for k in path): np.asarray(leaf, np.float64)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def bert_rate(step: int, lr: float, warm: int, steps: int) -> float:
  """create_optimizer's rate at global step `step` (float64)."""
  if warm and step < warm:
    return lr * step / warm
  return lr * (1.0 - min(step, steps) / steps)


def bert_reference(params: dict, grads: list[dict], t, scales: dict, frozen) -> dict:
  """BERT's training step in float64, `len(grads)` times: the gradients of the trained
  leaves clipped to global norm `clip_norm`, then AdamWeightDecayOptimizer (raw moments,
  update = m / (sqrt(v) + eps) + wd * param where decayed, param -= rate * update), the rate
  times the half's scale; a frozen leaf is left as it is and counts nothing in the norm."""
  p = {k: v.copy() for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  trained = [k for k in p if not any(k[:len(f)] == f for f in frozen)]
  for step, g in enumerate(grads):
    norm = np.sqrt(sum(np.sum(g[k] ** 2) for k in trained))
    rate = bert_rate(step, t.lr, state_lib.warmup_steps(t), t.steps)
    for k in trained:
      clipped = g[k] * t.clip_norm / max(norm, t.clip_norm)
      m[k] = t.b1 * m[k] + (1 - t.b1) * clipped
      v[k] = t.b2 * v[k] + (1 - t.b2) * clipped ** 2
      update = m[k] / (np.sqrt(v[k]) + t.eps)
      if not any(re.search(r, "/".join(k)) for r in BERT_NO_DECAY):
        update = update + t.weight_decay * p[k]
      p[k] = p[k] - rate * scales[k[0]] * update
  return p


def train_config(optimizer: str):
  c = base_config()
  c.task = "realm"
  c.retrieval.block_gradients = False           # REALM's block tower of its own: frozen
  c.train.update(optimizer=optimizer, lr=0.05, steps=10, warmup_steps=4, weight_decay=0.1,
                 retriever_lr_scale=2.0, reader_lr_scale=0.5)
  return c


def run_optimizer(c, params: dict, grads: list[dict]) -> dict:
  tx = state_lib.make_optimizer(c.train, frozen_paths(c))
  p = nested({k: jnp.asarray(v, jnp.float32) for k, v in params.items()})
  state = tx.init(p)
  update = jax.jit(tx.update)
  for g in grads:
    updates, state = update(nested({k: jnp.asarray(x, jnp.float32) for k, x in g.items()}),
                            state, p)
    p = optax.apply_updates(p, updates)
  return flat(p)


def draws(steps: int):
  """Params and `steps` gradients; their global norm is over 1 on some steps (clipped) and
  under it on others."""
  rng = np.random.RandomState(0)
  params = {k: rng.normal(0, 1, s) for k, s in SHAPES.items()}
  grads = [{k: rng.normal(0, 0.05 if step % 3 else 1.0, s) for k, s in SHAPES.items()}
           for step in range(steps)]
  return params, grads


def test_bert_updates_match_bert_in_float64_through_warm_up_and_decay():
  """Ten steps of a 10-step run warming up for 4 (rates 0 .. 0.75 lr, then 0.6 lr .. 0.1 lr),
  clipped on every third step, with the per-half rate scales and a frozen block tower."""
  c = train_config("bert")
  params, grads = draws(c.train.steps)
  got = run_optimizer(c, params, grads)
  want = bert_reference(params, grads, c.train, {"retriever": 2.0, "reader": 0.5},
                        frozen_paths(c))
  for k in SHAPES:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=2e-6, err_msg="/".join(k))
  frozen = ("retriever", "block_tower", "dense", "kernel")
  np.testing.assert_array_equal(got[frozen], np.float32(params[frozen]))
  # optax's form is another optimizer: bias-corrected moments, another schedule
  other = run_optimizer(train_config("optax_adamw"), params, grads)
  assert max(np.abs(other[k] - want[k]).max() for k in SHAPES) > 1e-2


def test_the_default_form_is_optax_adamw():
  """"optax_adamw" is the optimizer before the option, bit for bit: optax.adamw at the rate
  that warms up to lr and then decays linearly from lr."""
  c = train_config("optax_adamw")
  params, grads = draws(6)
  got = run_optimizer(c, params, grads)
  t = c.train
  schedule = optax.join_schedules([optax.linear_schedule(0.0, t.lr, 4),
                                   optax.linear_schedule(t.lr, 0.0, t.steps - 4)], [4])
  trained = [k for k in SHAPES if k[1] != "block_tower"]
  p = nested({k: jnp.asarray(params[k], jnp.float32) for k in trained})
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
      {h: optax.adamw(lambda s, h=h: schedule(s) * {"retriever": 2.0, "reader": 0.5}[h],
                      b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                      mask=lambda q: jax.tree_util.tree_map_with_path(
                          lambda path, _: state_lib.decays(path), q))
       for h in ("retriever", "reader")}, lambda q: {h: jax.tree.map(lambda _: h, q[h])
                                                    for h in q}))
  state, update = tx.init(p), jax.jit(tx.update)
  for g in grads:
    updates, state = update(nested({k: jnp.asarray(g[k], jnp.float32) for k in trained}),
                            state, p)
    p = optax.apply_updates(p, updates)
  for k, want in flat(p).items():
    np.testing.assert_array_equal(got[k], want)
  assert base_config().train.optimizer == "optax_adamw"


@pytest.mark.parametrize("warmup_steps", [-1, 0])
def test_the_bert_schedule_is_create_optimizers(warmup_steps):
  """At step 0, mid warm-up, the end of the warm-up, mid decay and the last step of 200k
  steps with BERT's 10k warm-up: lr * step / 10k, then lr * (1 - step / 200k), 0.95 lr at
  the warm-up's end (optax's form: lr); without a warm-up the decay from step 0."""
  t = base_config().train
  t.update(optimizer="bert", lr=3e-5, steps=200_000, warmup_steps=warmup_steps)
  warm = 10_000 if warmup_steps < 0 else 0
  schedule = state_lib.learning_rate_schedule(t)
  for step in (0, 5_000, 9_999, 10_000, 105_000, 199_999, 200_000, 250_000):
    want = bert_rate(step, 3e-5, warm, 200_000)
    assert float(schedule(step)) == pytest.approx(want, rel=1e-6, abs=1e-12), step
    assert float(jax.jit(schedule)(jnp.int32(step))) == pytest.approx(want, rel=1e-6,
                                                                      abs=1e-12)
  if warm:
    assert float(schedule(10_000)) == pytest.approx(0.95 * 3e-5, rel=1e-6)
    t.optimizer = "optax_adamw"
    assert float(state_lib.learning_rate_schedule(t)(10_000)) == pytest.approx(3e-5)


def test_both_forms_keep_the_same_state():
  """The train state's tree, shapes and dtypes are the same under either form (the step
  counts and Adam's two moments): a checkpoint of one restores under the other."""
  mesh = partitioning.make_mesh((1, 1), jax.devices()[:1])

  def abstract(optimizer):
    config = tiny_config("realm", train__optimizer=optimizer)
    model = state_lib.build_model(config, 64)
    state, _ = state_lib.abstract_train_state(config, model, mesh, config.data.block_len)
    return (jax.tree.structure(state.opt_state),   # (the state's own treedef holds its tx)
            [(x.shape, x.dtype) for x in jax.tree.leaves(state)])
  assert abstract("bert") == abstract("optax_adamw")


def test_a_run_resumed_under_the_other_form_is_said_not_refused(tmp_path):
  """Not a compatibility field: a resume under the other form goes on, and the change is said
  as other learning rates are (recorded_differences). A run recorded before the option read
  back (realm-eval, realm-predict) or resumed is one that trained with optax's form."""
  workdir = tmp_path / "w"
  (workdir / "checkpoints" / "3").mkdir(parents=True)
  old = json.loads(tiny_config("realm").to_json_best_effort())
  del old["train"]["optimizer"]                  # a run from before the option
  (workdir / "config.json").write_text(json.dumps(old))
  now = tiny_config("realm", train__optimizer="bert")
  assert incompatible_fields(old, json.loads(now.to_json_best_effort())) == []
  assert workdir_lib.recorded_differences(str(workdir), now) == [
      ("train.optimizer", "optax_adamw", "bert")]
  assert with_added_fields(old)["train"]["optimizer"] == "optax_adamw"
  assert workdir_lib.saved_config(str(workdir)).train.optimizer == "optax_adamw"
  assert workdir_lib.recorded_differences(str(workdir), tiny_config("realm")) == []


def test_an_unknown_form_is_one_line_naming_the_option():
  c = tiny_config("realm", train__optimizer="adam")
  with pytest.raises(ConfigError) as refused:
    validate(c)
  assert refused.value.option == "train.optimizer"
  assert str(refused.value) == ("config.train.optimizer: 'adam' is not one of "
                                "('optax_adamw', 'bert')")


def test_the_paper_scale_configs_train_with_berts_optimizer():
  """configs/realm_base.py and ict_base.py claim REALM's and ORQA's hyperparameters, whose
  code trained with BERT's optimization.create_optimizer; the demos keep optax's."""
  for name in ("realm_base", "ict_base"):
    for arg in (None, "small"):
      assert load_config_module(name).get_config(arg).train.optimizer == "bert"
  for name in ("demo_realm", "demo_ict"):
    assert load_config_module(name).get_config().train.optimizer == "optax_adamw"


@pytest.mark.slow
def test_a_run_trains_and_resumes_under_the_other_form(world_dir, tmp_path, caplog):
  """End to end: an ICT run of 2 steps under optax's form resumed to 4 under BERT's restores
  its checkpoint, says the change, and logs the rate each update used: BERT's from step 3."""
  from realm_jax.train.loop import train
  workdir = str(tmp_path / "w")
  config = lambda steps, form: tiny_config("ict", None, world_dir, train__steps=steps,
                                           train__warmup_steps=2, train__optimizer=form)
  train(config(2, "optax_adamw"), workdir)
  summary = train(config(4, "bert"), workdir)
  assert summary["steps"] == 4
  assert f"resuming {workdir} under other values than it recorded (config.json now holds " \
      "these): train.optimizer: 'optax_adamw' -> 'bert'; train.steps: 2 -> 4" in caplog.text
  rows = [json.loads(line) for line in open(f"{workdir}/metrics/train.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  assert [r["learning_rate"] for r in rows[2:]] == pytest.approx(
      [bert_rate(s, config(4, "bert").train.lr, 2, 4) for s in (2, 3)])

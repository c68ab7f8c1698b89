"""Model construction, the optimizer (optax's AdamW or BERT's), and the train state created
directly in its shardings."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from realm_jax.models.bert import BertConfig
from realm_jax.models.realm import REALM
from realm_jax.runtime import partitioning
from realm_jax.config.reading import frozen_paths, part_model
from realm_jax.config.validation import check_cudnn_dtype
from realm_jax.errors import ConfigError

TrainState = train_state.TrainState


def build_model(config, vocab_size: int) -> REALM:
  """The REALM module for `config.model` (the reader's shape, and the retriever's as
  `model.retriever.*` change it); vocab_size comes from the data's vocab if 0."""
  vocab_size = config.model.vocab_size or vocab_size
  attention = attention_here(config)

  def tower(part):
    m = part_model(config, part)
    m.attention = attention
    return BertConfig.from_config(m, vocab_size=vocab_size)

  reader, retriever = tower("reader"), tower("retriever")
  openqa = config.task == "openqa"
  return REALM(reader, retriever_cfg=None if retriever == reader else retriever,
               retrieval_dim=config.model.retrieval_dim,
               share_towers=config.model.share_towers,
               pooling=config.model.retriever.get("pooling", "cls"),
               span_hidden=config.model.span_hidden_size if openqa else 0,
               max_span_width=config.model.max_span_width,
               span_eps=config.model.span_layer_norm_eps)


def attention_here(config) -> str:
  """`model.attention`, or "xla" (with a warning) for "cudnn" where no CUDA GPU is: a run
  trained with cuDNN attention is restored, evaluated and indexed anywhere."""
  attention = config.model.get("attention", "xla")
  device = jax.devices()[0]
  if attention == "cudnn" and not (device.platform == "gpu"
                                   and "cuda" in device.client.platform_version.lower()):
    warnings.warn(f"model.attention 'cudnn' needs an NVIDIA GPU; this process runs on "
                  f"{device.platform}: using 'xla' (the same attention)", stacklevel=2)
    return "xla"
  check_cudnn_dtype(config.model)
  return attention


def _is_frozen(names: tuple[str, ...], frozen: tuple[tuple[str, ...], ...]) -> bool:
  return any(names[:len(prefix)] == prefix for prefix in frozen)


def stop_frozen_gradients(params, frozen: tuple[tuple[str, ...], ...]):
  """`params` with stop_gradient on the `frozen` sub-trees, so that XLA drops their backward
  pass altogether."""
  return jax.tree_util.tree_map_with_path(
      lambda path, p: jax.lax.stop_gradient(p) if _is_frozen(tuple(_path_names(path)), frozen)
      else p, params)


def warmup_steps(train_config) -> int:
  """REALM's and ORQA's rule (their code's num_warmup_steps): min(10000, max(100, steps / 10))
  unless set explicitly."""
  if train_config.warmup_steps >= 0:
    return int(train_config.warmup_steps)
  return int(min(10000, max(100, train_config.steps // 10)))


def optimizer_form(train_config) -> str:
  """`train.optimizer`: "optax_adamw" (a config from before the option) or "bert"."""
  return train_config.get("optimizer", "optax_adamw")


def learning_rate_schedule(train_config) -> optax.Schedule:
  """The learning rate of the update after `count` updates. "optax_adamw": linear warm-up
  to `lr`, then linear decay from `lr` to 0 at `steps`; "bert": `bert_schedule`."""
  warm = warmup_steps(train_config)
  if optimizer_form(train_config) == "bert":
    return bert_schedule(train_config.lr, warm, train_config.steps)
  return optax.join_schedules([
      optax.linear_schedule(0.0, train_config.lr, max(warm, 1)),
      optax.linear_schedule(train_config.lr, 0.0, max(train_config.steps - warm, 1)),
  ], [warm])


def updates_applied(opt_state) -> int | None:
  """The optimizer's count of updates applied (Adam's `count`, the same in every trained
  half), None without a trained half: behind the trainer's step by the non-finite steps it
  skipped (train.nonfinite=skip), and what the schedule read for the last update (at count - 1).
  Read from this process's copy (the state is replicated)."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
    if getattr(path[-1], "name", None) == "count":
      return int(np.asarray(leaf.addressable_data(0)))
  return None


def bert_schedule(lr: float, warm: int, steps: int) -> optax.Schedule:
  """BERT's `create_optimizer`: lr * (1 - step / steps) (a polynomial decay of power 1 to 0,
  from step 0 on), and while step < warm the warm-up's lr * step / warm instead; so the
  rate at the end of the warm-up is lr * (1 - warm / steps), not lr."""
  def schedule(count):
    step = jnp.asarray(count, jnp.float32)
    decayed = lr * (1.0 - jnp.minimum(step, steps) / steps)
    return jnp.where(step < warm, lr * (step / max(warm, 1)), decayed)
  return schedule


def _path_names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def param_group(path) -> str:
  """'retriever' or 'reader': the top-level module a parameter belongs to."""
  return _path_names(path)[0]


def decays(path) -> bool:
  """AdamW weight decay applies to kernels and embeddings, not LayerNorm or biases."""
  names = _path_names(path)
  return not (any("LayerNorm" in n or "norm" in n for n in names)
              or any(n in ("bias", "scale") for n in names))


def scale_by_uncorrected_adam(b1: float, b2: float, eps: float
                              ) -> optax.GradientTransformation:
  """BERT's AdamWeightDecayOptimizer before its weight decay and rate: m / (sqrt(v) + eps),
  m and v Adam's exponential averages as they are, not corrected for their zero start (at b1
  0.9, b2 0.999 and a steady gradient, (1 - b1^t) / sqrt(1 - b2^t) times optax's: 3.2x at the
  first update, 6.6x at the 12th, 1.26x at the 1,000th, 1.00x by the 10,000th). Its state is
  optax.scale_by_adam's."""
  def init(params):
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=optax.tree.zeros_like(params),
                                  nu=optax.tree.zeros_like(params))

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(updates, state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
    return out, optax.ScaleByAdamState(count=optax.safe_increment(state.count), mu=mu, nu=nu)
  return optax.GradientTransformation(init, update)


def make_optimizer(train_config, frozen: tuple[tuple[str, ...], ...]
                   ) -> optax.GradientTransformation:
  """AdamW (wd 0.01 not on LayerNorm/bias, eps 1e-6) in the `train.optimizer` form
  (optax's bias-corrected one, or BERT's own), global-norm clipping, and a learning-rate
  scale per half of the model; the `frozen` sub-trees (`frozen_paths`: a half whose scale is
  0 among them) get no update, no decay and no state. Both forms keep the same state."""
  t = train_config
  schedule = learning_rate_schedule(t)
  scales = {"retriever": t.retriever_lr_scale, "reader": t.reader_lr_scale}
  decayed = lambda p: jax.tree_util.tree_map_with_path(lambda q, _: decays(q), p)

  def adamw(scale):
    rate = lambda step: schedule(step) * scale
    if optimizer_form(t) == "bert":   # (update + wd * param) * rate, as optax.adamw chains it
      return optax.chain(scale_by_uncorrected_adam(t.b1, t.b2, t.eps),
                         optax.add_decayed_weights(t.weight_decay, decayed),
                         optax.scale_by_learning_rate(rate))
    return optax.adamw(rate, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                       mask=decayed)

  def label(path):
    return "frozen" if _is_frozen(tuple(_path_names(path)), frozen) else param_group(path)

  def labels(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: label(path), params)

  groups = {name: adamw(scale) for name, scale in scales.items() if scale > 0}
  groups["frozen"] = optax.set_to_zero()
  zero_frozen = optax.multi_transform(
      {**{name: optax.identity() for name in scales}, "frozen": optax.set_to_zero()}, labels)
  return optax.chain(zero_frozen, optax.clip_by_global_norm(train_config.clip_norm),
                     optax.multi_transform(groups, labels))


def dummy_inputs(config, block_len: int) -> dict[str, jnp.ndarray]:
  """Smallest inputs that touch every parameter (for init and abstract shapes)."""
  q, r = config.data.query_len, config.data.query_len + block_len
  return {"query_ids": jnp.ones((1, q), jnp.int32), "block_ids": jnp.ones((1, block_len),
                                                                         jnp.int32),
          "block_segments": jnp.zeros((1, block_len), jnp.int32),
          "reader_ids": jnp.ones((1, r), jnp.int32),
          "reader_segments": jnp.zeros((1, r), jnp.int32),
          "mask_positions": jnp.zeros((1, 1), jnp.int32)}


def _state_setup(config, model: REALM, mesh, block_len: int, rng):
  """The init fn, the fn building a state around given params, the abstract state
  (ShapeDtypeStructs with shardings) and its shardings.

  One optimizer object serves both, so the abstract state and the real one share a treedef.
  """
  tx = make_optimizer(config.train, frozen_paths(config))
  inputs = dummy_inputs(config, block_len)
  rules = partitioning.logical_rules(config.mesh.rules)

  def around(params):
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def init(rng):
    return around(nn.meta.unbox(model.init(rng, **inputs)["params"]))

  boxed = jax.eval_shape(lambda r: model.init(r, **inputs)["params"], rng)
  param_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  check_divisible(nn.meta.unbox(boxed), param_shardings, mesh)
  # the state's shapes around the params' (the model is traced once here, not again)
  abstract = jax.eval_shape(around, nn.meta.unbox(boxed))
  shardings = _state_shardings(abstract, param_shardings, partitioning.replicated(mesh))
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return init, around, abstract, shardings


def abstract_train_state(config, model: REALM, mesh, block_len: int, rng=None):
  """The train state's shapes, dtypes and shardings, allocating nothing (for AOT lowering of
  full-size configs). Returns (abstract_state, state_shardings)."""
  rng = jax.random.PRNGKey(config.seed) if rng is None else rng
  _, _, abstract, shardings = _state_setup(config, model, mesh, block_len, rng)
  return abstract, shardings


def create_train_state(config, model: REALM, mesh, block_len: int, rng):
  """Creates the state sharded from the start: eval_shape -> logical specs -> jit(out_shardings).

  Parameters are initialised boxed with their logical names, unboxed into plain arrays; each
  optimizer-state leaf takes the sharding of the parameter whose path ends its own path.
  Returns (state, state_shardings, abstract_state).
  """
  make, abstract, shardings = deferred_train_state(config, model, mesh, block_len, rng)
  return make(), shardings, abstract


def deferred_train_state(config, model: REALM, mesh, block_len: int, rng):
  """(make, abstract_state, state_shardings): `make()` creates the state as
  `create_train_state` does; `make(params)` builds the state around `params` (sharded as the
  state's params, donated) without the random init: a fresh start whose every part is
  restored from elsewhere. The optimizer state is the same either way (it starts at zero
  whatever the params). A run that resumes restores into the abstract state and calls
  neither: no random init compiled, run and thrown away."""
  init, around, abstract, shardings = _state_setup(config, model, mesh, block_len, rng)
  rules = partitioning.logical_rules(config.mesh.rules)

  def make(params=None):
    with partitioning.mesh_rules(mesh, rules):
      if params is None:
        return jax.jit(init, out_shardings=shardings)(rng)
      return jax.jit(around, out_shardings=shardings, donate_argnums=0)(params)
  return make, abstract, shardings


def check_divisible(abstract_params, param_shardings, mesh) -> None:
  """ConfigError naming mesh.shape where a mesh axis splits a parameter's dimension into
  unequal parts (e.g. a model axis of 2 over a vocab of 30,523 rows): before any JAX work."""
  for (path, sharding), leaf in zip(jax.tree_util.tree_flatten_with_path(param_shardings)[0],
                                    jax.tree_util.tree_leaves(abstract_params)):
    for dim, (size, axes) in enumerate(zip(leaf.shape, sharding.spec)):
      axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
      ways = int(np.prod([mesh.shape[a] for a in axes]))
      if size % ways:
        raise ConfigError("mesh.shape", f"{dict(mesh.shape)} splits dimension {dim} (size "
                          f"{size}) of the parameter {'/'.join(_path_names(path))} {ways} "
                          f"ways over mesh axis {'+'.join(axes)} (config.mesh.rules), which "
                          f"does not divide it: give that axis a size dividing {size}")


def _state_shardings(abstract_state, param_shardings, replicated):
  by_path = {tuple(_path_names(p)): (s, leaf.shape) for (p, s), leaf in zip(
      jax.tree_util.tree_flatten_with_path(param_shardings)[0],
      jax.tree_util.tree_leaves(abstract_state.params))}

  def for_leaf(path, leaf):
    names = tuple(_path_names(path))
    for start in range(len(names)):
      match = by_path.get(names[start:])
      if match is not None and match[1] == leaf.shape:
        return match[0]
    return replicated

  return jax.tree_util.tree_map_with_path(for_leaf, abstract_state)


def count_params(params) -> int:
  return sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(params)))

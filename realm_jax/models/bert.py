"""BERT encoder in Flax with logical sharding names on every parameter.

The module tree mirrors the Hugging Face BERT layout one-to-one (`embeddings/word_embeddings`,
`encoder/<i>/attention/self/query` for HF's `encoder.layer.<i>...`, ..., `pooler/dense`), so a
checkpoint in that layout maps onto it by renaming alone (see `hf_parameter_names`).

Logical axis names used by the parameters (mapped to mesh axes by the rules in the config):
  vocab, embed, heads (query/key/value output = heads x head_dim), mlp, position, segment.
Activations are constrained with ('batch', 'length', 'embed').
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
# `hidden_act` values (HF ACT2FN names, transformers/activations.py) -> whether the GELU is
# the tanh approximation (TF BERT's; HF RealmConfig's default "gelu_new") rather than erf.
HIDDEN_ACTS = {"gelu": False, "gelu_python": False, "gelu_new": True,
               "gelu_pytorch_tanh": True, "gelu_python_tanh": True, "gelu_fast": True,
               "gelu_accurate": True}


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Shape and regularisation of one BERT tower (names follow HF `BertConfig`)."""

  vocab_size: int
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  intermediate_size: int = 3072
  max_position: int = 512
  type_vocab_size: int = 2
  dropout_rate: float = 0.1
  layer_norm_eps: float = 1e-12
  initializer_range: float = 0.02
  hidden_act: str = "gelu"  # feed-forward and MLM-transform activation: a HIDDEN_ACTS name
  dtype: Any = jnp.float32  # compute dtype; parameters stay float32

  def __post_init__(self):
    if self.hidden_act not in HIDDEN_ACTS:
      raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; choose one of "
                       f"{', '.join(HIDDEN_ACTS)}")

  @classmethod
  def from_config(cls, model_config, vocab_size: int | None = None) -> "BertConfig":
    """Builds the tower config from `config.model` (an ml_collections ConfigDict)."""
    return cls(
        vocab_size=vocab_size or model_config.vocab_size,
        hidden_size=model_config.hidden_size,
        num_layers=model_config.num_layers,
        num_heads=model_config.num_heads,
        intermediate_size=model_config.intermediate_size,
        max_position=model_config.max_position,
        dropout_rate=model_config.dropout_rate,
        initializer_range=model_config.initializer_range,
        hidden_act=model_config.get("hidden_act", "gelu"),   # configs saved before the field
        dtype=jnp.dtype(model_config.dtype),
    )


def activation(cfg: BertConfig) -> Callable[[Array], Array]:
  """`cfg.hidden_act` as a function: erf GELU or its tanh approximation (as HF's ACT2FN)."""
  return functools.partial(nn.gelu, approximate=HIDDEN_ACTS[cfg.hidden_act])


def dense(features: int, names: tuple[str, str], cfg: BertConfig, name: str) -> nn.Dense:
  """A Dense layer whose kernel and bias carry logical axis names."""
  return nn.Dense(
      features,
      dtype=cfg.dtype,
      kernel_init=nn.with_logical_partitioning(
          nn.initializers.normal(cfg.initializer_range), names),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[1:]),
      name=name,
  )


def layer_norm(cfg: BertConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(
      epsilon=cfg.layer_norm_eps,
      dtype=cfg.dtype,
      scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
      name=name,
  )


class BertEmbeddings(nn.Module):
  cfg: BertConfig

  def setup(self):
    cfg = self.cfg
    init = nn.initializers.normal(cfg.initializer_range)
    self.word_embeddings = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.dtype,
        embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))
    self.position_embeddings = nn.Embed(
        cfg.max_position, cfg.hidden_size, dtype=cfg.dtype,
        embedding_init=nn.with_logical_partitioning(init, ("position", "embed")))
    self.token_type_embeddings = nn.Embed(
        cfg.type_vocab_size, cfg.hidden_size, dtype=cfg.dtype,
        embedding_init=nn.with_logical_partitioning(init, ("segment", "embed")))
    self.LayerNorm = layer_norm(cfg, "LayerNorm")
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def __call__(self, token_ids: Array, segment_ids: Array, deterministic: bool) -> Array:
    positions = jnp.arange(token_ids.shape[-1])[None, :]
    x = (self.word_embeddings(token_ids) + self.position_embeddings(positions)
         + self.token_type_embeddings(segment_ids))
    return self.dropout(self.LayerNorm(x), deterministic=deterministic)

  def attend(self, hidden: Array) -> Array:
    """Logits against the word embeddings (the MLM decoder tied to them)."""
    return self.word_embeddings.attend(hidden)


class BertLayer(nn.Module):
  """One post-LN transformer layer, named as HF's `encoder/layer/<i>`."""

  cfg: BertConfig

  def setup(self):
    cfg = self.cfg
    self.attention = _AttentionBlock(cfg)
    self.intermediate = _Projection(cfg, cfg.intermediate_size, ("embed", "mlp"))
    self.output = _Residual(cfg, ("mlp", "embed"))

  def __call__(self, x, attention_bias, deterministic):
    x = self.attention(x, attention_bias, deterministic)
    h = activation(self.cfg)(self.intermediate(x))
    x = self.output(h, x, deterministic)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class _AttentionBlock(nn.Module):
  """HF `attention`: `self` (q, k, v) then `output` (dense, dropout, residual, LayerNorm)."""

  cfg: BertConfig

  def setup(self):
    self.self = _SelfAttentionOnly(self.cfg)
    self.output = _Residual(self.cfg, ("heads", "embed"))

  def __call__(self, x, attention_bias, deterministic):
    return self.output(self.self(x, attention_bias, deterministic), x, deterministic)


class _SelfAttentionOnly(nn.Module):
  cfg: BertConfig

  @nn.compact
  def __call__(self, x, attention_bias, deterministic):
    cfg = self.cfg
    head_dim = cfg.hidden_size // cfg.num_heads
    split = lambda t: t.reshape(t.shape[:-1] + (cfg.num_heads, head_dim))
    q = split(dense(cfg.hidden_size, ("embed", "heads"), cfg, "query")(x))
    k = split(dense(cfg.hidden_size, ("embed", "heads"), cfg, "key")(x))
    v = split(dense(cfg.hidden_size, ("embed", "heads"), cfg, "value")(x))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(head_dim)
    weights = jax.nn.softmax(scores + attention_bias, axis=-1)
    weights = nn.Dropout(cfg.dropout_rate)(weights, deterministic=deterministic)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(cfg.dtype), v)
    return out.reshape(out.shape[:-2] + (cfg.hidden_size,))


class _Projection(nn.Module):
  """HF `intermediate`: a single `dense`."""

  cfg: BertConfig
  features: int
  names: tuple[str, str]

  @nn.compact
  def __call__(self, x):
    return dense(self.features, self.names, self.cfg, "dense")(x)


class _Residual(nn.Module):
  """HF `output`: `dense`, dropout, residual add, `LayerNorm` (post-LN)."""

  cfg: BertConfig
  names: tuple[str, str]

  @nn.compact
  def __call__(self, h, residual, deterministic):
    h = dense(self.cfg.hidden_size, self.names, self.cfg, "dense")(h)
    h = nn.Dropout(self.cfg.dropout_rate)(h, deterministic=deterministic)
    return layer_norm(self.cfg, "LayerNorm")(h + residual)


class _LayerStack(nn.Module):
  """HF `encoder`: layers under `layer/<i>`."""

  cfg: BertConfig

  def setup(self):
    self.layer = [BertLayer(self.cfg, name=str(i)) for i in range(self.cfg.num_layers)]

  def __call__(self, x, attention_bias, deterministic):
    for layer in self.layer:
      x = layer(x, attention_bias, deterministic)
    return x


class BertEncoder(nn.Module):
  """BERT: embeddings (with segment ids) -> post-LN transformer -> optional pooler.

  Returns (sequence_output [batch, length, hidden], pooled_output [batch, hidden] or None).
  Padding is token id 0 ([PAD]); padded keys are masked out of attention.
  """

  cfg: BertConfig
  add_pooler: bool = True

  def setup(self):
    self.embeddings = BertEmbeddings(self.cfg)
    self.encoder = _LayerStack(self.cfg)
    if self.add_pooler:
      self.pooler = _Projection(self.cfg, self.cfg.hidden_size, ("embed", "hidden"))

  def __call__(self, token_ids: Array, segment_ids: Array, deterministic: bool = True):
    attention_bias = jnp.where(token_ids[:, None, None, :] > 0, 0.0, -1e9).astype(jnp.float32)
    x = self.embeddings(token_ids, segment_ids, deterministic)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    x = self.encoder(x, attention_bias, deterministic)
    pooled = jnp.tanh(self.pooler(x[:, 0])) if self.add_pooler else None
    return x, pooled

  def attend(self, hidden: Array) -> Array:
    return self.embeddings.attend(hidden)


def hf_parameter_names(params: dict, prefix: str = "") -> dict[str, str]:
  """Maps each flattened Flax parameter path of a BertEncoder to its HF (PyTorch) state-dict key.

  Flax `kernel` of a Dense is HF `weight` transposed; `embedding` is `weight`; LayerNorm
  `scale`/`bias` are HF `weight`/`bias`.
  """
  names = {}
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for path, _ in flat:
    keys = [getattr(k, "key", str(k)) for k in path]
    flax_name = "/".join(keys)
    *module, leaf = keys
    if module and module[-1] == "LayerNorm":
      leaf = {"scale": "weight", "bias": "bias"}[leaf]
    else:
      leaf = {"kernel": "weight", "embedding": "weight", "bias": "bias"}[leaf]
    # Flax names the layers `encoder/<i>`; HF nests them as `encoder.layer.<i>`.
    module = [part for i, m in enumerate(module) for part in (
        ["layer", m] if m.isdigit() and i > 0 and module[i - 1] == "encoder" else [m])]
    names[flax_name] = prefix + ".".join(module + [leaf])
  return names

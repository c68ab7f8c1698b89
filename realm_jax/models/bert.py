"""BERT encoder in Flax with logical sharding names on every parameter.

The module tree mirrors the Hugging Face BERT layout one-to-one (`embeddings/word_embeddings`,
`encoder/<i>/attention/self/query` for HF's `encoder.layer.<i>...`, ..., `pooler/dense`), so a
checkpoint in that layout maps onto it by renaming alone (see `hf_parameter_names`).

Logical axis names used by the parameters (mapped to mesh axes by the rules in the config):
  vocab, embed, heads (query/key/value output = heads x head_dim), mlp, position, segment.
Activations are constrained with ('batch', 'length', 'embed').

A batch of short sequences may come packed (`Packing`): several sequences a row, each
attending only to its own wordpieces, its positions restarting at 0, so that few of the
wordpieces computed are padding.

How a layer computes (not what it means) is chosen by three fields that leave the parameters
alone: `attention` (the `jax.nn.dot_product_attention` implementation: XLA, or cuDNN's fused
flash attention on NVIDIA GPUs), `remat` (recompute each layer's activations in the backward
pass: none, all, or all but the weight matmuls' outputs) and `dtype` (the compute dtype).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# `hidden_act` values (HF ACT2FN names, transformers/activations.py) -> whether the GELU is
# the tanh approximation (TF BERT's; HF RealmConfig's default "gelu_new") rather than erf.
HIDDEN_ACTS = {"gelu": False, "gelu_python": False, "gelu_new": True,
               "gelu_pytorch_tanh": True, "gelu_python_tanh": True, "gelu_fast": True,
               "gelu_accurate": True}
# `attention` values: implementations of `jax.nn.dot_product_attention` ("cudnn": NVIDIA GPUs,
# bfloat16 compute only; [PAD]s must trail, as every input this project builds has them).
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn")
# `remat` values -> the `jax.checkpoint` policy of each transformer layer ("none": no remat;
# "full": save only the layer's inputs; "matmuls": also save the outputs of the weight
# matmuls, recomputing the element-wise parts and attention (its batched matmuls included)).
REMAT_POLICIES = {"none": None, "full": None,
                  "matmuls": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Packing(NamedTuple):
  """Sequences packed into rows (`pipeline.pack_queries`): each wordpiece's `positions`
  [rows, L] in its own sequence, and its `owner` [rows, L], the sequence it belongs to (-1:
  padding). A wordpiece attends to its owner's wordpieces alone."""
  positions: Array
  owner: Array

  def key_mask(self) -> Array:
    """[rows, 1, L, L]: query wordpiece i may attend to key wordpiece j."""
    keys = self.owner[:, None, None, :]
    return (self.owner[:, None, :, None] == keys) & (keys >= 0)


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
  attention_dropout_rate: float = -1.0  # dropout on the attention weights (-1: dropout_rate)
  attention: str = "xla"    # an ATTENTION_IMPLEMENTATIONS name
  remat: str = "none"       # a REMAT_POLICIES name

  def __post_init__(self):
    if self.hidden_act not in HIDDEN_ACTS:
      raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; choose one of "
                       f"{', '.join(HIDDEN_ACTS)}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention {self.attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat {self.remat!r} is not one of {tuple(REMAT_POLICIES)}")

  @property
  def attention_dropout(self) -> float:
    """The dropout rate of the attention weights (HF's attention_probs_dropout_prob)."""
    return self.dropout_rate if self.attention_dropout_rate < 0 else self.attention_dropout_rate

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
        attention_dropout_rate=model_config.get("attention_dropout_rate", -1.0),
        attention=model_config.get("attention", "xla"),
        remat=model_config.get("remat", "none"),
    )


def activation(cfg: BertConfig) -> Callable[[Array], Array]:
  """`cfg.hidden_act` as a function: erf GELU or its tanh approximation (as HF's ACT2FN)."""
  if HIDDEN_ACTS[cfg.hidden_act]:
    return functools.partial(nn.gelu, approximate=True)
  return erf_gelu


@jax.custom_jvp
def erf_gelu(x: Array) -> Array:
  """x / 2 * erfc(-x / sqrt(2)): `jax.nn.gelu(x, approximate=False)`, value for value, with a
  derivative that keeps one tensor for the backward pass (autodiff through erfc keeps four:
  at BERT-base's feed-forward width that is 3 x [tokens, 3072] floats a layer)."""
  return nn.gelu(x, approximate=False)


@erf_gelu.defjvp
def _erf_gelu_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  cdf = 0.5 * jax.lax.erfc(-x * np.sqrt(0.5).astype(x.dtype))
  pdf = jnp.exp(-0.5 * x * x) * np.sqrt(0.5 / np.pi).astype(x.dtype)
  return x * cdf, dx * (cdf + x * pdf)


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
    # The lookups are float32 whatever cfg.dtype: a lookup's gradient is a scatter-add into
    # the table, which in bfloat16 a GPU runs as compare-and-swap loops (the token types' two
    # rows take every token's update: two thirds of a BERT-base REALM step's device time on an
    # H100, docs/performance.md). The sum goes to the LayerNorm, which computes in float32.
    self.word_embeddings = nn.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=jnp.float32,
        embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))
    self.position_embeddings = nn.Embed(
        cfg.max_position, cfg.hidden_size, dtype=jnp.float32,
        embedding_init=nn.with_logical_partitioning(init, ("position", "embed")))
    self.token_type_embeddings = nn.Embed(
        cfg.type_vocab_size, cfg.hidden_size, dtype=jnp.float32,
        embedding_init=nn.with_logical_partitioning(init, ("segment", "embed")))
    self.LayerNorm = layer_norm(cfg, "LayerNorm")
    self.dropout = nn.Dropout(cfg.dropout_rate)

  def __call__(self, token_ids: Array, segment_ids: Array, deterministic: bool,
               position_ids: Array | None = None) -> Array:
    # positions 0..T-1 are the table's first rows: a slice (its gradient a pad, not a scatter);
    # packed sequences (`position_ids`, each restarting at 0) look theirs up
    if token_ids.shape[-1] > self.cfg.max_position:
      raise ValueError(f"sequences of {token_ids.shape[-1]} tokens: the position table has "
                       f"{self.cfg.max_position} rows (max_position)")
    if position_ids is None:
      positions = self.position_embeddings.embedding[:token_ids.shape[-1]][None]
    else:
      positions = self.position_embeddings(position_ids)
    x = self.word_embeddings(token_ids) + positions + self.token_types(segment_ids)
    return self.dropout(self.LayerNorm(x), deterministic=deterministic)

  def token_types(self, segment_ids: Array) -> Array:
    """The segment embeddings as a select over BERT's few types (the gradient a reduction per
    type, where a lookup's would be a scatter of every token into one of two rows)."""
    table = self.token_type_embeddings.embedding
    if table.shape[0] > 8:
      return self.token_type_embeddings(segment_ids)
    out = jnp.full(segment_ids.shape + table.shape[-1:], jnp.nan, table.dtype)  # as a lookup
    for value in range(table.shape[0]):
      out = jnp.where((segment_ids == value)[..., None], table[value], out)
    return out

  def attend(self, hidden: Array) -> Array:
    """Logits against the word embeddings (the MLM decoder tied to them), in cfg.dtype."""
    table = self.word_embeddings.embedding.astype(self.cfg.dtype)
    return jnp.dot(hidden.astype(self.cfg.dtype), table.T)


class BertLayer(nn.Module):
  """One post-LN transformer layer, named as HF's `encoder/layer/<i>`."""

  cfg: BertConfig

  def setup(self):
    cfg = self.cfg
    self.attention = _AttentionBlock(cfg)
    self.intermediate = _Projection(cfg, cfg.intermediate_size, ("embed", "mlp"))
    self.output = _Residual(cfg, ("mlp", "embed"))

  def __call__(self, x, key_mask, deterministic, positions=None):
    """x [batch, length, hidden] -> the same; with `positions` ([batch, P] int), only those
    positions' outputs ([batch, P, hidden]): every position still gives keys and values, but
    queries, the attention output and the feed-forward run on the P alone."""
    queries = x if positions is None else jnp.take_along_axis(x, positions[..., None], axis=1)
    x = self.attention(queries, x, key_mask, deterministic)
    h = activation(self.cfg)(self.intermediate(x))
    x = self.output(h, x, deterministic)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class _AttentionBlock(nn.Module):
  """HF `attention`: `self` (q, k, v) then `output` (dense, dropout, residual, LayerNorm)."""

  cfg: BertConfig

  def setup(self):
    self.self = _SelfAttentionOnly(self.cfg)
    self.output = _Residual(self.cfg, ("heads", "embed"))

  def __call__(self, x, context, key_mask, deterministic):
    return self.output(self.self(x, context, key_mask, deterministic), x, deterministic)


class _SelfAttentionOnly(nn.Module):
  """Multi-head self-attention of `x` over the positions of `context` (x itself, or the whole
  sequence when x holds some of its positions) that `key_mask` lets through ([batch, 1, 1,
  keys], or [batch, 1, queries, keys] for packed rows)."""

  cfg: BertConfig

  @nn.compact
  def __call__(self, x, context, key_mask, deterministic):
    cfg = self.cfg
    head_dim = cfg.hidden_size // cfg.num_heads
    split = lambda t: t.reshape(t.shape[:-1] + (cfg.num_heads, head_dim))
    q = split(dense(cfg.hidden_size, ("embed", "heads"), cfg, "query")(x))
    k = split(dense(cfg.hidden_size, ("embed", "heads"), cfg, "key")(context))
    v = split(dense(cfg.hidden_size, ("embed", "heads"), cfg, "value")(context))
    if not deterministic and cfg.attention_dropout > 0:
      out = self.attention_with_dropout(q, k, v, key_mask)   # materialised: no fused kernel
    elif (cfg.attention == "cudnn" and q.shape[1] % 2 == 0 and k.shape[1] % 2 == 0
          and key_mask.shape[2] == 1):   # not packed rows (their mask is per query wordpiece)
      # cuDNN's own padding mask (no [B, 1, 1, S] bias, which its kernel does not take); its
      # masked kernel trains on even lengths only, so a last layer that computes [CLS] alone
      # (or an odd number of positions) attends through XLA below, the same function
      lengths = key_mask.sum(axis=-1, dtype=jnp.int32).reshape(-1)
      out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                         implementation="cudnn")
    else:
      # padding as an additive bias: a boolean mask would be broadcast to [B, N, T, S] and
      # kept for the backward pass
      bias = jnp.where(key_mask, 0.0, -1e9).astype(jnp.float32)
      out = jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")
    return out.reshape(out.shape[:-2] + (cfg.hidden_size,))

  def attention_with_dropout(self, q, k, v, key_mask):
    """softmax(q k / sqrt(d)) v with BERT's dropout on the attention weights; the softmax in
    float32 as in `jax.nn.dot_product_attention`."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k,
                        preferred_element_type=jnp.float32) / jnp.sqrt(q.shape[-1])
    weights = jax.nn.softmax(jnp.where(key_mask, scores, -1e9), axis=-1)
    weights = nn.Dropout(self.cfg.attention_dropout)(weights, deterministic=False)
    return jnp.einsum("bhqk,bkhd->bqhd", weights.astype(self.cfg.dtype), v)


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
  """HF `encoder`: layers under `layer/<i>`, each rematerialised as `cfg.remat` says (the
  parameter tree is the same either way)."""

  cfg: BertConfig

  def setup(self):
    layer = BertLayer
    if self.cfg.remat != "none":   # argument 3 (counting the module): `deterministic`
      layer = nn.remat(BertLayer, static_argnums=(3,), policy=REMAT_POLICIES[self.cfg.remat])
    self.layer = [layer(self.cfg, name=str(i)) for i in range(self.cfg.num_layers)]

  def __call__(self, x, key_mask, deterministic, positions=None):
    """`positions` ([batch, P] or None): the last layer computes only those (`BertLayer`)."""
    *inner, last = self.layer
    for layer in inner:
      x = layer(x, key_mask, deterministic)
    return last(x, key_mask, deterministic, positions)


class BertEncoder(nn.Module):
  """BERT: embeddings (with segment ids) -> post-LN transformer -> optional pooler.

  Returns (sequence_output [batch, length, hidden], pooled_output [batch, hidden] or None).
  Padding is token id 0 ([PAD]); padded keys are masked out of attention. A caller that reads
  only some positions passes them (`positions` [batch, P] int): the last layer then computes
  those alone and the sequence output is [batch, P, hidden], the same values as the full
  output's rows at them (a retriever tower reads [CLS], the reader its [MASK]s: the last
  layer's queries, attention output and feed-forward shrink from `length` rows to P). The
  pooler reads the first row: [CLS] unless `positions` starts elsewhere. With `packing`
  (`Packing`) the rows hold several sequences each, every one attending to itself alone.
  """

  cfg: BertConfig
  add_pooler: bool = True

  def setup(self):
    self.embeddings = BertEmbeddings(self.cfg)
    self.encoder = _LayerStack(self.cfg)
    if self.add_pooler:
      self.pooler = _Projection(self.cfg, self.cfg.hidden_size, ("embed", "hidden"))

  def __call__(self, token_ids: Array, segment_ids: Array, deterministic: bool = True,
               positions: Array | None = None, packing: Packing | None = None):
    if packing is not None and positions is not None:
      raise ValueError("packed rows hold several sequences: `positions` (a last layer that "
                       "computes some positions of each row) does not apply to them")
    if packing is None:
      key_mask = token_ids[:, None, None, :] > 0     # [PAD] keys take no part
      x = self.embeddings(token_ids, segment_ids, deterministic)
    else:
      key_mask = packing.key_mask()
      x = self.embeddings(token_ids, segment_ids, deterministic, packing.positions)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    x = self.encoder(x, key_mask, deterministic, positions)
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

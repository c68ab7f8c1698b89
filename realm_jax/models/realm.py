"""REALM's two models in one parameter tree: the retriever (query + block towers) and the
knowledge-augmented encoder (the reader).

Parameter tree (top level):
  retriever/query_tower/{bert, projection, projection_norm}
  retriever/block_tower/{...}         (absent when towers are shared: `retriever/tower`)
  reader/{bert, cls}                  (BERT + MLM head, decoder tied to the word embeddings)
  reader/qa_outputs                   (ORQA span scorer; only with `span_hidden` > 0: Open-QA)
Every stage (ICT, reader warm-up, REALM) uses the same tree, so one stage's checkpoint starts
the next; the optimizer decides which half is trained. The retriever towers may have a shape of
their own (`retriever_cfg`: another hidden size, depth, width), e.g. a small retriever beside
a pre-trained reader.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.models.bert import (BertConfig, BertEncoder, Packing, activation, dense,
                                   layer_norm)
from realm_jax.models.losses import label_log_softmax

Array = jax.Array


POOLINGS = ("cls", "mean")


def mean_pool(hidden: Array, token_ids: Array) -> Array:
  """The mean of `hidden` [n, L, H] over each row's non-padding tokens (id > 0): [n, H], as
  sentence encoders (all-MiniLM-L6-v2 among them) are trained to be read."""
  return _mean_over(hidden, token_ids > 0)


def _mean_over(hidden: Array, keep: Array) -> Array:
  """The mean of `hidden` [n, L, H] over the positions `keep` [n, L] marks (0 where none)."""
  weights = keep.astype(hidden.dtype)[..., None]
  return (hidden * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)


def packed_mean_pool(hidden: Array, owner: Array, packed_row: Array) -> Array:
  """`mean_pool` of sequences packed into rows (`Packing`): hidden [rows, L, H], owner [rows,
  L] (the sequence of each wordpiece, -1: padding), packed_row [n] (the row holding sequence
  i) -> [n, H]."""
  own = owner[packed_row] == jnp.arange(packed_row.shape[0])[:, None]     # [n, L]
  return _mean_over(hidden[packed_row], own)


class Embedder(nn.Module):
  """Retriever tower: BERT pooled output -> dense to `retrieval_dim` -> LayerNorm (REALM's
  `Embed_input` / `Embed_doc`).

  `pooling`: "cls" reads [CLS] through BERT's pooler (REALM's); "mean" averages the last layer
  over the non-padding tokens (a sentence encoder's; the tower then has no pooler). With
  `packing` (`Packing` plus `packed_row`, the row of each sequence), mean pooling only,
  `token_ids` are packed rows and the output has one embedding per sequence."""

  cfg: BertConfig
  retrieval_dim: int
  pooling: str = "cls"

  @nn.compact
  def __call__(self, token_ids: Array, segment_ids: Array, deterministic: bool = True,
               packing: Packing | None = None, packed_row: Array | None = None) -> Array:
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
    bert = BertEncoder(self.cfg, add_pooler=self.pooling == "cls", name="bert")
    if packing is not None:
      if self.pooling != "mean":
        raise ValueError("packed sequences are read with mean pooling only")
      hidden, _ = bert(token_ids, segment_ids, deterministic, packing=packing)
      pooled = packed_mean_pool(hidden, packing.owner, packed_row)
    elif self.pooling == "cls":
      cls_only = jnp.zeros((token_ids.shape[0], 1), jnp.int32)   # the last layer: [CLS] alone
      _, pooled = bert(token_ids, segment_ids, deterministic, cls_only)
    else:
      hidden, _ = bert(token_ids, segment_ids, deterministic)
      pooled = mean_pool(hidden, token_ids)
    x = nn.Dense(
        self.retrieval_dim, dtype=self.cfg.dtype,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(self.cfg.initializer_range), ("embed", "retrieval")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("retrieval",)),
        name="projection")(pooled)
    x = nn.LayerNorm(   # float32 whatever the compute dtype: retrieval logits come from here
        epsilon=self.cfg.layer_norm_eps, dtype=jnp.float32,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("retrieval",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("retrieval",)),
        name="projection_norm")(x)
    return x


class Retriever(nn.Module):
  """f(x, z) = Embed_input(x) . Embed_doc(z), with shared or separate towers."""

  cfg: BertConfig
  retrieval_dim: int
  share_towers: bool = False
  pooling: str = "cls"

  def setup(self):
    if self.share_towers:
      self.tower = Embedder(self.cfg, self.retrieval_dim, self.pooling)
    else:
      self.query_tower = Embedder(self.cfg, self.retrieval_dim, self.pooling)
      self.block_tower = Embedder(self.cfg, self.retrieval_dim, self.pooling)

  def embed_queries(self, query_ids: Array, deterministic: bool = True) -> Array:
    """`[CLS] x [SEP]` (segment 0) -> [batch, retrieval_dim]."""
    tower = self.tower if self.share_towers else self.query_tower
    return tower(query_ids, jnp.zeros_like(query_ids), deterministic)

  def embed_packed_queries(self, packed_ids: Array, packing: Packing, packed_row: Array,
                           deterministic: bool = True) -> Array:
    """Queries packed into rows (`pipeline.pack_queries`) -> [queries, retrieval_dim], the
    same embeddings as `embed_queries` of the unpacked batch (mean pooling)."""
    tower = self.tower if self.share_towers else self.query_tower
    return tower(packed_ids, jnp.zeros_like(packed_ids), deterministic, packing, packed_row)

  def embed_blocks(self, block_ids: Array, block_segments: Array,
                   deterministic: bool = True) -> Array:
    """`[CLS] title [SEP] body [SEP]` (segments 0 / 1) -> [batch, retrieval_dim]."""
    tower = self.tower if self.share_towers else self.block_tower
    return tower(block_ids, block_segments, deterministic)

  def __call__(self, query_ids, block_ids, block_segments, deterministic=True):
    return (self.embed_queries(query_ids, deterministic),
            self.embed_blocks(block_ids, block_segments, deterministic))


class MLMHead(nn.Module):
  """HF `cls/predictions`: transform (dense, hidden_act, LayerNorm), tied decoder + bias."""

  cfg: BertConfig

  @nn.compact
  def __call__(self, hidden: Array, bert: BertEncoder) -> Array:
    cfg = self.cfg
    h = dense(cfg.hidden_size, ("embed", "hidden"), cfg, "transform_dense")(hidden)
    h = layer_norm(cfg, "transform_LayerNorm")(activation(cfg)(h))
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                      (cfg.vocab_size,))
    return bert.attend(h).astype(jnp.float32) + bias


def span_candidates(length: int, max_width: int) -> tuple[np.ndarray, np.ndarray]:
  """(starts, ends) of every span of width 1..max_width in a sequence of `length`, ordered
  width-major then by start (HF `RealmReaderProjection`'s order): S = sum_w (length - w + 1)."""
  widths = range(1, min(max_width, length) + 1)
  starts = np.concatenate([np.arange(length - w + 1) for w in widths]).astype(np.int32)
  ends = np.concatenate([np.arange(w - 1, length) for w in widths]).astype(np.int32)
  return starts, ends


class SpanHead(nn.Module):
  """ORQA's span scorer (HF `qa_outputs`): score(s, e) = w . LayerNorm(ReLU(W_s h_s + W_e h_e)).

  `dense_intermediate` projects each position to [start half | end half] of 2 * span_hidden;
  spans may only start on tokens of `start_mask` and end on tokens of `end_mask` (the block
  body; the trainer also keeps them on word boundaries, HF's class uses the body alone).
  ReLU whatever the BERT's hidden_act, as in HF's RealmReaderProjection.
  """

  cfg: BertConfig
  span_hidden: int = 256
  max_width: int = 10
  eps: float = 1e-3

  @nn.compact
  def __call__(self, hidden: Array, start_mask: Array, end_mask: Array | None = None) -> Array:
    """hidden [n, L, H], start/end masks [n, L] bool (end: the start mask if None) -> span
    logits [n, S] (masked: -1e9)."""
    cfg = self.cfg
    h = dense(2 * self.span_hidden, ("embed", "mlp"), cfg, "dense_intermediate")(hidden)
    start, end = jnp.split(h, 2, axis=-1)
    starts, ends = span_candidates(hidden.shape[1], self.max_width)
    x = nn.relu(start[:, starts] + end[:, ends])
    x = nn.LayerNorm(
        epsilon=self.eps, dtype=cfg.dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("mlp",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        name="layer_normalization")(x)
    logits = dense(1, ("mlp", None), cfg, "dense_output")(x)[..., 0].astype(jnp.float32)
    end_mask = start_mask if end_mask is None else end_mask
    valid = start_mask[:, starts] & end_mask[:, ends]
    return jnp.where(valid, logits, -1e9)


class Reader(nn.Module):
  """Knowledge-augmented encoder: `[CLS] x [SEP] body [SEP]` -> MLM log-probs at the masks.

  The last layer and the MLM head run only at the masked positions (the vocab projection is
  the costly part).
  """

  cfg: BertConfig
  span_hidden: int = 0             # > 0: with the Open-QA span scorer
  max_span_width: int = 10
  span_eps: float = 1e-3

  def setup(self):
    self.bert = BertEncoder(self.cfg, add_pooler=False)
    self.cls = MLMHead(self.cfg)
    if self.span_hidden:
      self.qa_outputs = SpanHead(self.cfg, self.span_hidden, self.max_span_width, self.span_eps)

  def __call__(self, reader_ids: Array, reader_segments: Array, mask_positions: Array,
               deterministic: bool = True) -> Array:
    """Args: reader_ids/segments [n, L]; mask_positions [n, M]. Returns log-probs [n, M, V]."""
    return jax.nn.log_softmax(
        self.mask_logits(reader_ids, reader_segments, mask_positions, deterministic), axis=-1)

  def mask_logits(self, reader_ids, reader_segments, mask_positions, deterministic=True):
    """The MLM logits at the masks [n, M, V] (float32)."""
    at_masks, _ = self.bert(reader_ids, reader_segments, deterministic, mask_positions)
    return self.cls(at_masks, self.bert)

  def label_log_probs(self, reader_ids, reader_segments, mask_positions, mask_labels,
                      deterministic=True):
    """log p(y_j | z, x) of the wordpieces `mask_labels` [n, M] at the masks: [n, M] (what
    training reads of the [n, M, V] log-probs, for less work; `losses.label_log_softmax`)."""
    return label_log_softmax(
        self.mask_logits(reader_ids, reader_segments, mask_positions, deterministic),
        mask_labels)

  def spans(self, reader_ids: Array, reader_segments: Array, start_mask: Array,
            end_mask: Array | None = None, deterministic: bool = True) -> Array:
    """`[CLS] question [SEP] body [SEP]` -> span logits [n, S] (see `span_candidates`)."""
    hidden, _ = self.bert(reader_ids, reader_segments, deterministic)
    return self.qa_outputs(hidden, start_mask, end_mask)


class REALM(nn.Module):
  """Retriever + reader; the methods below are what the training and eval steps call."""

  cfg: BertConfig                  # the reader's BERT
  retrieval_dim: int = 128
  share_towers: bool = False
  span_hidden: int = 0             # > 0: the reader has the Open-QA span scorer
  max_span_width: int = 10
  span_eps: float = 1e-3
  retriever_cfg: BertConfig | None = None   # the retriever towers' BERT (None: as `cfg`)
  pooling: str = "cls"             # the retriever towers' pooling (`Embedder`)

  @property
  def retriever_bert(self) -> BertConfig:
    return self.retriever_cfg or self.cfg

  def setup(self):
    self.retriever = Retriever(self.retriever_bert, self.retrieval_dim, self.share_towers,
                               self.pooling)
    self.reader = Reader(self.cfg, self.span_hidden, self.max_span_width, self.span_eps)

  def embed_queries(self, query_ids, deterministic=True):
    return self.retriever.embed_queries(query_ids, deterministic)

  def embed_packed_queries(self, packed_ids, packing, packed_row, deterministic=True):
    return self.retriever.embed_packed_queries(packed_ids, packing, packed_row, deterministic)

  def embed_blocks(self, block_ids, block_segments, deterministic=True):
    return self.retriever.embed_blocks(block_ids, block_segments, deterministic)

  def read(self, reader_ids, reader_segments, mask_positions, deterministic=True):
    return self.reader(reader_ids, reader_segments, mask_positions, deterministic)

  def read_labels(self, reader_ids, reader_segments, mask_positions, mask_labels,
                  deterministic=True):
    return self.reader.label_log_probs(reader_ids, reader_segments, mask_positions,
                                       mask_labels, deterministic)

  def read_spans(self, reader_ids, reader_segments, start_mask, end_mask=None,
                 deterministic=True):
    return self.reader.spans(reader_ids, reader_segments, start_mask, end_mask, deterministic)

  def __call__(self, query_ids, block_ids, block_segments, reader_ids, reader_segments,
               mask_positions, deterministic=True):
    """Touches every parameter (used for init)."""
    q, b = self.retriever(query_ids, block_ids, block_segments, deterministic)
    out = self.read(reader_ids, reader_segments, mask_positions, deterministic)
    if self.span_hidden:
      self.read_spans(reader_ids, reader_segments, reader_segments > 0,
                      deterministic=deterministic)
    return q, b, out

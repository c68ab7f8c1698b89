"""REALM's two models in one parameter tree: the retriever (query + block towers) and the
knowledge-augmented encoder (the reader).

Parameter tree (top level):
  retriever/query_tower/{bert, projection, projection_norm}
  retriever/block_tower/{...}         (absent when towers are shared: `retriever/tower`)
  reader/{bert, cls}                  (BERT + MLM head, decoder tied to the word embeddings)
Every stage (ICT, reader warm-up, REALM) uses the same tree, so one stage's checkpoint starts
the next; the optimizer decides which half is trained.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from realm_jax.models.bert import BertConfig, BertEncoder, dense, layer_norm

Array = jax.Array


class Embedder(nn.Module):
  """Retriever tower: BERT pooled output -> dense to `retrieval_dim` -> LayerNorm (REALM's
  `Embed_input` / `Embed_doc`)."""

  cfg: BertConfig
  retrieval_dim: int

  @nn.compact
  def __call__(self, token_ids: Array, segment_ids: Array, deterministic: bool = True) -> Array:
    _, pooled = BertEncoder(self.cfg, add_pooler=True, name="bert")(
        token_ids, segment_ids, deterministic)
    x = nn.Dense(
        self.retrieval_dim, dtype=self.cfg.dtype,
        kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(self.cfg.initializer_range), ("embed", "retrieval")),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("retrieval",)),
        name="projection")(pooled)
    x = nn.LayerNorm(
        epsilon=self.cfg.layer_norm_eps, dtype=self.cfg.dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("retrieval",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("retrieval",)),
        name="projection_norm")(x)
    return x.astype(jnp.float32)


class Retriever(nn.Module):
  """f(x, z) = Embed_input(x) . Embed_doc(z), with shared or separate towers."""

  cfg: BertConfig
  retrieval_dim: int
  share_towers: bool = False

  def setup(self):
    if self.share_towers:
      self.tower = Embedder(self.cfg, self.retrieval_dim)
    else:
      self.query_tower = Embedder(self.cfg, self.retrieval_dim)
      self.block_tower = Embedder(self.cfg, self.retrieval_dim)

  def embed_queries(self, query_ids: Array, deterministic: bool = True) -> Array:
    """`[CLS] x [SEP]` (segment 0) -> [batch, retrieval_dim]."""
    tower = self.tower if self.share_towers else self.query_tower
    return tower(query_ids, jnp.zeros_like(query_ids), deterministic)

  def embed_blocks(self, block_ids: Array, block_segments: Array,
                   deterministic: bool = True) -> Array:
    """`[CLS] title [SEP] body [SEP]` (segments 0 / 1) -> [batch, retrieval_dim]."""
    tower = self.tower if self.share_towers else self.block_tower
    return tower(block_ids, block_segments, deterministic)

  def __call__(self, query_ids, block_ids, block_segments, deterministic=True):
    return (self.embed_queries(query_ids, deterministic),
            self.embed_blocks(block_ids, block_segments, deterministic))


class MLMHead(nn.Module):
  """HF `cls/predictions`: transform (dense, gelu, LayerNorm) then the tied decoder + bias."""

  cfg: BertConfig

  @nn.compact
  def __call__(self, hidden: Array, bert: BertEncoder) -> Array:
    cfg = self.cfg
    h = dense(cfg.hidden_size, ("embed", "hidden"), cfg, "transform_dense")(hidden)
    h = layer_norm(cfg, "transform_LayerNorm")(nn.gelu(h, approximate=False))
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                      (cfg.vocab_size,))
    return bert.attend(h).astype(jnp.float32) + bias


class Reader(nn.Module):
  """Knowledge-augmented encoder: `[CLS] x [SEP] body [SEP]` -> MLM log-probs at the masks.

  Logits are computed only at the masked positions (the vocab projection is the costly part).
  """

  cfg: BertConfig

  def setup(self):
    self.bert = BertEncoder(self.cfg, add_pooler=False)
    self.cls = MLMHead(self.cfg)

  def __call__(self, reader_ids: Array, reader_segments: Array, mask_positions: Array,
               deterministic: bool = True) -> Array:
    """Args: reader_ids/segments [n, L]; mask_positions [n, M]. Returns log-probs [n, M, V]."""
    hidden, _ = self.bert(reader_ids, reader_segments, deterministic)
    at_masks = jnp.take_along_axis(hidden, mask_positions[..., None], axis=1)
    return jax.nn.log_softmax(self.cls(at_masks, self.bert), axis=-1)


class REALM(nn.Module):
  """Retriever + reader; the methods below are what the training and eval steps call."""

  cfg: BertConfig
  retrieval_dim: int = 128
  share_towers: bool = False

  def setup(self):
    self.retriever = Retriever(self.cfg, self.retrieval_dim, self.share_towers)
    self.reader = Reader(self.cfg)

  def embed_queries(self, query_ids, deterministic=True):
    return self.retriever.embed_queries(query_ids, deterministic)

  def embed_blocks(self, block_ids, block_segments, deterministic=True):
    return self.retriever.embed_blocks(block_ids, block_segments, deterministic)

  def read(self, reader_ids, reader_segments, mask_positions, deterministic=True):
    return self.reader(reader_ids, reader_segments, mask_positions, deterministic)

  def __call__(self, query_ids, block_ids, block_segments, reader_ids, reader_segments,
               mask_positions, deterministic=True):
    """Touches every parameter (used for init)."""
    q, b = self.retriever(query_ids, block_ids, block_segments, deterministic)
    return q, b, self.read(reader_ids, reader_segments, mask_positions, deterministic)

"""Presets the config files under `configs/` share: a change of scale, applied on top of
`defaults.base_config()`."""

from __future__ import annotations

import ml_collections


def tiny_model(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A 2-layer d=128 BERT per tower: the model of the demo and of the `:small` variants."""
  c.model.hidden_size = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.intermediate_size = 256   # 2x hidden: the REALM step is compute-bound on 2 cores
  return c


def demo_scale(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The miniature every demo stage shares: the tiny model, short queries and blocks."""
  tiny_model(c)
  c.model.hidden_act = "gelu_new"  # tanh GELU (HF REALM's): the demo's REALM step is ~11%
                                   # faster on CPU than with erf's (docs/performance.md)
  c.model.max_position = 128
  c.model.dropout_rate = 0.0
  c.model.share_towers = True      # one tower: ICT learns in 300 steps (separate: it stalls)
  c.data.query_len = 16            # the world's sentences are <= 13 wordpieces
  c.data.block_len = 40            # its sections are <= 37 wordpieces with title
  c.data.max_masks = 8             # its salient spans are <= 8 wordpieces (seeds 0-3): the
                                   # MLM head runs at 8 mask slots per reader input, not 10
  c.retrieval.embed_batch_size = 512
  c.eval.num_examples = 1000
  c.eval.batch_size = 128
  return c

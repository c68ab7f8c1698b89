"""REALM on a SQuAD-format file in miniature: prepare -> ICT -> reader warm-up -> REALM, then
zero-shot question retrieval (recall@1/5/20 of the answer paragraph) for the ICT retriever,
the REALM retriever and BM25. `make demo-squad` runs it all (realm_jax/demo_squad.py).

Variants by arg (one per stage, all on the same data and shapes):
  prepare  realm-prepare settings (source = the SQuAD file; default: the SQuADShifts file of
           ../shared/data)
  ict      ICT warm start of the retriever (in-batch softmax)
  warmup   the reader learns to read: its only candidate is the query's own block
  realm    REALM with retrieval from the index (the query's own block excluded)

  realm-prepare --config configs/squad_realm.py:prepare --config.out_dir runs/squad/data
  realm-train --config configs/squad_realm.py:ict --workdir runs/squad/ict \
      --config.data.dir runs/squad/data
"""

import os

from realm_jax.data.prepare import prepare_config
from realm_jax.config.defaults import base_config
from realm_jax.config.presets import tiny_model

VARIANTS = ("prepare", "ict", "warmup", "realm")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SQUAD = os.path.join(REPO, "..", "shared", "data", "squadshifts_new_wiki_v1.0.json")
BLOCK_LEN = 128                    # SQuAD paragraphs average ~170 wordpieces: ~2 blocks each
QUERY_LEN = 64                     # ICT's query length; longer sentences are not queries


def get_config(arg=None):
  variant = arg or "realm"
  if variant not in VARIANTS:
    raise ValueError(f"configs/squad_realm.py: unknown variant {variant!r}; one of {VARIANTS}")
  if variant == "prepare":
    c = prepare_config()
    c.source = f"squad:{os.path.normpath(SQUAD)}"
    c.block_len = BLOCK_LEN
    c.max_sentence_len = QUERY_LEN - 2
    c.vocab_size = 8000            # trained on the file itself (~1.2M characters)
    c.eval_fraction = 0.05         # ~80 paragraphs whose sentences are only evaluated
    c.shard_documents = 400
    return c
  c = tiny_model(base_config())
  c.model.max_position = QUERY_LEN + BLOCK_LEN
  c.model.dropout_rate = 0.0
  c.model.share_towers = True      # one tower learns fastest in miniature (as in the demo)
  c.data.query_len = QUERY_LEN
  c.data.block_len = BLOCK_LEN
  c.retrieval.embed_batch_size = 512
  c.eval.num_examples = 256
  c.eval.batch_size = 64
  c.train.log_every = 50
  c.train.checkpoint_every = 100
  if variant == "ict":
    c.task = "ict"
    c.train.batch_size = 64
    c.train.steps = 300
    c.train.lr = 1e-3
    c.train.reader_lr_scale = 0.0  # ICT trains the retriever only
    return c
  c.task = "realm"
  c.retrieval.k = 8
  c.retrieval.refresh_every = 100
  c.train.batch_size = 16
  c.train.lr = 1e-3
  c.train.retriever_lr_scale = 0.3
  c.train.steps = 300              # ~2.2 s a step here (16 queries x 8 candidates x 190)
  if variant == "warmup":
    c.retrieval.candidates = "own_block"
    c.retrieval.k = 2
    c.train.batch_size = 32
    c.train.retriever_lr_scale = 0.0
    c.train.lr = 2e-3
    c.train.steps = 400
  return c

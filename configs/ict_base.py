"""ICT warm start of the retriever at ORQA's settings (Lee et al., 2019), as REALM
initialises its retriever (Guu et al., 2020).

Inverse Cloze Task with in-batch negatives: queries of 64 wordpieces, batch 4096, lr 1e-4,
100k steps with BERT's optimizer and schedule (`train.optimizer`, as ORQA's code trained), the
reader not trained. Both retriever towers start from pre-trained BERT-base
(`init.retriever`: a local Hugging Face BERT-base dir; the data's vocab is checked against it;
the projection to 128 starts at random). Separate BERT-base towers, blocks of 288 wordpieces and
the query sentence cut from its block 90% of the time are `base_config()` defaults, so only
what differs is set below.

  realm-train --config configs/ict_base.py --workdir gs://BUCKET/realm/ict \
      --config.data.dir gs://BUCKET/realm/data --config.init.retriever /data/bert-base-uncased

A query is `[CLS]` the sentence's first 62 wordpieces `[SEP]`, as ORQA cuts it
(`data.long_queries` "cut"), so the data dir configs/prepare.py writes for REALM (sentences of
up to 94 wordpieces) serves ICT as it is; the run says how many queries were cut. A held-out
query whose target span lies past the first 62 is cut to the 62 that end with the span.

Variants by arg:
  base   (default) the paper's settings
  small  the same data shapes with a 2-layer d=128 model, a small batch and a few steps: a
         smoke test of a launch on the real prepared data
"""

from realm_jax.config.defaults import base_config
from realm_jax.config.presets import tiny_model

VARIANTS = ("base", "small")
BERT_BASE = "bert-base-uncased"    # a local Hugging Face BERT-base dir (never downloaded)


def get_config(arg=None):
  variant = arg or "base"
  if variant not in VARIANTS:
    raise ValueError(f"configs/ict_base.py: unknown variant {variant!r}; one of {VARIANTS}")
  c = base_config()
  c.task = "ict"                   # Inverse Cloze Task: trains the retriever's two towers
  c.model.vocab_size = 30522       # BERT-base uncased wordpieces (imported BERT fits as is)
  c.data.query_len = 64            # ICT queries are single sentences (ORQA: 64)
  c.data.long_queries = "cut"      # a longer sentence is cut to its first 62, as ORQA's are
  c.train.batch_size = 4096        # in-batch negatives: a large batch is the point
  c.train.lr = 1e-4                # ORQA's ICT learning rate
  c.train.steps = 100_000          # ORQA's ICT schedule
  c.train.reader_lr_scale = 0.0    # the reader is not part of ICT (frozen, no optimizer state)
  c.train.optimizer = "bert"       # BERT's AdamW and schedule, as the paper trained with
  c.init.retriever = BERT_BASE     # both retriever towers from pre-trained BERT-base
  if variant == "small":
    _small(c)
  return c


def _small(c):
  """Shrinks the model, batch and schedule; keeps the data shapes, so the data dir the base
  variant reads works."""
  tiny_model(c)                    # a 2-layer d=128 BERT per tower
  c.init.retriever = ""            # a random start: BERT-base does not fit the tiny towers
  c.train.batch_size = 64          # in-batch negatives per step
  c.train.steps = 40               # a few steps and one checkpoint
  c.train.log_every = 10           # progress every 10 steps
  c.train.checkpoint_every = 40    # one checkpoint at the end
  c.eval.num_examples = 64         # a quick final evaluation

"""`realm-prepare`: a corpus -> vocab, block store, pretraining examples (+ QA sets).

  realm-prepare --config configs/prepare.py --config.source=squad:PATH --config.out_dir=DIR
  realm-prepare --config configs/prepare.py --config.source=jsonl:'dump/*.jsonl' \
      --config.out_dir=DIR --config.vocab=PATH/TO/HF_BERT --config.num_workers=16
  realm-prepare --config configs/prepare.py:world --config.source=world:2000 --config.out_dir=DIR

Variants by arg: (none) REALM's shapes (blocks of 288, queries of 96); `world` the demo's
miniature shapes (blocks of 40, queries of 16, a 4,000-entry vocab).
"""

from realm_jax.data.prepare import prepare_config

VARIANTS = ("", "world")


def get_config(arg=None):
  variant = arg or ""
  if variant not in VARIANTS:
    raise ValueError(f"configs/prepare.py: unknown variant {variant!r}; one of {VARIANTS}")
  c = prepare_config()
  if variant == "world":
    c.block_len = 40               # the world's sections are <= 37 wordpieces with title
    c.max_sentence_len = 14        # its sentences are <= 13 wordpieces (query_len 16)
    c.vocab_size = 4000
    c.num_workers = 0              # a few thousand documents: one process is quickest
  return c

"""REALM on the generated world, in miniature (docs/demos.md, "The demo").

Variants by arg:
  realm          (default) REALM: retrieval from the index, retriever lr 0.15x the reader's
  warmup         reader warm-up: the reader reads the query's own block (the retriever plays
                 no part and stays frozen); the null document is read only to measure utility
  no_retrieval   the baseline: the null document only, same encoder and steps

  python launch/local.py --config configs/demo_realm.py:realm --workdir runs/demo/realm \
      --config.data.dir runs/demo/data --config.init.from_workdir runs/demo/warmup
  realm-train --config configs/demo_realm.py:warmup --workdir runs/demo/warmup \
      --config.data.dir runs/demo/data --config.init.from_workdir runs/demo/ict
"""

from realm_jax.config.defaults import base_config
from realm_jax.config.presets import demo_scale

VARIANTS = ("realm", "warmup", "no_retrieval")


def get_config(arg=None):
  variant = arg or "realm"
  if variant not in VARIANTS:
    raise ValueError(f"configs/demo_realm.py: unknown variant {variant!r}; one of {VARIANTS}")
  c = demo_scale(base_config())
  c.task = "realm"
  c.retrieval.k = 5                # training reads the top 4 blocks: 940 steps of 4 take the
                                   # time of 700 of 6 and learn more (6 or 3 blocks: less;
                                   # docs/performance.md)
  c.retrieval.refresh_every = 100
  c.retrieval.refresh = "deterministic"   # the separate realm-index job (launch/local.py);
                                   # deterministic: the demo's numbers repeat run to run
  c.retrieval.swap_lag = 25        # the index of checkpoint S serves steps S+26 .. S+125
                                   # (as the progress lines count them, from 1)
  c.retrieval.train_null_document = False  # training reads the blocks only: with the null
                                   # document in the marginal, recall@1 at step 600 was
                                   # 0.29 instead of 0.60 (seed 0, docs/performance.md)
  c.train.batch_size = 32
  c.train.lr = 2e-3
  c.train.retriever_lr_scale = 0.15  # the retriever (3e-4) moves ~7x slower than the reader
  c.train.steps = 940                # recall@1 jumps as the lr decays: most of it comes in
                                     # the last third of any schedule tried (400 to 1000)
  c.train.log_every = 50
  c.train.checkpoint_every = 250
  c.eval.every = 470
  if variant == "warmup":
    c.retrieval.refresh = "in_process"   # no index at all
    c.retrieval.candidates = "own_block"
    c.retrieval.k = 2
    c.train.retriever_lr_scale = 0.0
    c.train.batch_size = 64          # REALM's span accuracy follows the reader's copying:
                                     # batch 64 x 1,800 instead of 32 x 1,800 lifted seed 0's
                                     # at REALM step 600 from 0.52 to 0.65 (performance.md)
    c.train.lr = 2e-3                # copying from a block "clicks" after ~40k queries
    c.train.steps = 1500
    c.eval.every = 0
  elif variant == "no_retrieval":
    c.retrieval.refresh = "in_process"
    c.retrieval.candidates = "null_only"
    c.retrieval.k = 1
    c.train.retriever_lr_scale = 0.0
    c.eval.every = 0
  return c

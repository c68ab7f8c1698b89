"""REALM on the generated world, in miniature (docs/demos.md, "The demo").

Variants by arg:
  realm          (default) REALM: retrieval from the index, retriever lr 0.3x the reader's
  warmup         reader warm-up: the reader reads the query's own block (the retriever plays
                 no part and stays frozen); the null document is read only to measure utility
  no_retrieval   the baseline: the null document only, same encoder and steps

  python launch/local.py --config configs/demo_realm.py:realm --workdir runs/demo/realm \
      --config.data.dir runs/demo/data --config.init.from_workdir runs/demo/warmup
  realm-train --config configs/demo_realm.py:warmup --workdir runs/demo/warmup \
      --config.data.dir runs/demo/data --config.init.from_workdir runs/demo/ict
"""

from realm_jax.train.config_base import base_config, demo_scale

VARIANTS = ("realm", "warmup", "no_retrieval")


def get_config(arg=None):
  variant = arg or "realm"
  if variant not in VARIANTS:
    raise ValueError(f"configs/demo_realm.py: unknown variant {variant!r}; one of {VARIANTS}")
  c = demo_scale(base_config())
  c.task = "realm"
  c.retrieval.k = 8
  c.retrieval.refresh_every = 100
  c.retrieval.refresh = "deterministic"   # the separate realm-index job (launch/local.py);
                                   # deterministic: the demo's numbers repeat run to run
  c.retrieval.swap_lag = 25        # the index of checkpoint S serves steps S+25 .. S+124
  c.train.batch_size = 32
  c.train.lr = 1e-3
  c.train.retriever_lr_scale = 0.3   # the retriever moves 3x slower than the reader
  c.train.steps = 1000               # recall and span accuracy still climb at 900 on some seeds
  c.train.log_every = 50
  c.train.checkpoint_every = 250
  c.eval.every = 250
  if variant == "warmup":
    c.retrieval.refresh = "in_process"   # no index at all
    c.retrieval.candidates = "own_block"
    c.retrieval.k = 2
    c.train.retriever_lr_scale = 0.0
    c.train.lr = 2e-3                # copying from a block "clicks" after ~600 steps
    c.train.steps = 1800
    c.eval.every = 0
  elif variant == "no_retrieval":
    c.retrieval.refresh = "in_process"
    c.retrieval.candidates = "null_only"
    c.retrieval.k = 1
    c.train.retriever_lr_scale = 0.0
    c.eval.every = 0
  return c

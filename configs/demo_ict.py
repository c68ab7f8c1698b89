"""ICT warm start of the retriever on the generated world (the demo's first stage).

  realm-train --config configs/demo_ict.py --workdir runs/demo/ict \
      --config.data.dir runs/demo/data
"""

from realm_jax.config.defaults import base_config
from realm_jax.config.presets import demo_scale


def get_config(arg=None):
  if arg:   # as the other configs refuse a variant they do not have
    raise ValueError(f"configs/demo_ict.py: unknown variant {arg!r}; it has none")
  c = demo_scale(base_config())
  c.task = "ict"
  c.train.batch_size = 64
  c.train.steps = 300
  c.train.lr = 1e-3
  c.train.reader_lr_scale = 0.0      # ICT trains the retriever only
  c.train.log_every = 50
  c.train.checkpoint_every = 300
  c.eval.every = 0
  return c

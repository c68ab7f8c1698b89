"""Open-QA fine-tuning on the SQuADShifts file in miniature (ORQA's recipe: query tower and
reader trained, block tower and index frozen), starting from the REALM-pretrained or the
ICT-only checkpoint of configs/squad_realm.py. `make demo-openqa` runs it all.

The questions are split by article: `qa.heldout_articles` of the 48 articles (by title hash)
are the test articles, the rest train. The corpus holds every paragraph of every article, so a
test question's answer is in the corpus, as in open-domain QA; its article's questions were
never trained on.

Variants by arg: realm | ict (which pre-training the run starts from; the demo sets
init.from_workdir to runs/squad/realm or runs/squad/ict).

  realm-train --config configs/squad_openqa.py:realm --workdir runs/squad/openqa_realm \
      --config.data.dir runs/squad/data --config.init.from_workdir runs/squad/realm
  realm-eval --workdir runs/squad/openqa_realm
"""

import os

from realm_jax.config.loading import config_module

VARIANTS = ("realm", "ict")
HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(arg=None):
  variant = arg or "realm"
  if variant not in VARIANTS:
    raise ValueError(f"configs/squad_openqa.py: unknown variant {variant!r}; one of {VARIANTS}")
  squad_realm = config_module(os.path.join(HERE, "squad_realm.py"))
  c = squad_realm.get_config("realm")   # the pre-training's model and data shapes
  c.task = "openqa"
  source = f"squad:{os.path.normpath(squad_realm.SQUAD)}"
  c.qa.train = source
  c.qa.dev = ""                    # no dev articles to spare: realm-eval scores the test ones
  c.qa.test = source
  c.qa.heldout_articles = 0.2      # 11 of SQuADShifts' 48 articles are test articles
  c.qa.searcher_beam = 5000        # capped at the corpus (~3,200 blocks): every block
  c.qa.reader_beam = 5             # ORQA / REALM read the top 5
  c.model.span_hidden_size = 128   # the tiny reader's width (ORQA: 256 over BERT-base)
  c.model.max_span_width = 10
  c.train.batch_size = 16          # questions per step (ORQA: 1)
  c.train.steps = 400
  c.train.lr = 1e-3                # the tiny model's rate (ORQA fine-tunes BERT at 1e-5)
  c.train.warmup_steps = 40
  c.train.retriever_lr_scale = 0.3  # as in the REALM stage
  c.train.checkpoint_every = 100
  c.eval.batch_size = 64
  return c

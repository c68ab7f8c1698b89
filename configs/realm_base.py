"""REALM pre-training at the paper's settings (Guu et al., 2020).

Task "realm" with a BERT-base reader and two separate BERT-base retriever towers (128-d
embeddings), k = 8 candidates with the null document, queries of 96 and blocks of 288
wordpieces, batch 512, lr 3e-5, 200k steps, the block index rebuilt every 500 steps, dropout
0.1: all of these are `base_config()` defaults, so only what differs is set below. The paper
trained on 64 TPUs (16 more embedded the corpus); use `--config.model.dtype=bfloat16` there.

The paper starts the retriever from ICT and the knowledge-augmented encoder (the reader) from
pre-trained BERT-base with its MLM head; so do the defaults below: `init.retriever` is the
ICT run of configs/ict_base.py (only its retriever is restored) and `init.reader` a Hugging
Face BERT-base dir (config.json, model.safetensors or pytorch_model.bin, vocab.txt; the data
must be prepared with that vocab, which is checked at start-up). Point them at your copies:

  realm-train --config configs/realm_base.py --workdir gs://BUCKET/realm/realm \
      --config.data.dir gs://BUCKET/realm/data --config.init.retriever gs://BUCKET/realm/ict \
      --config.init.reader /data/bert-base-uncased

and `realm-index` with the same flags on devices of its own: the corpus is re-embedded by the
separate builder (`retrieval.refresh=async`), as in the paper; in the trainer's process a
rebuild of 13.35M blocks would stall training for hours between two steps.
launch/tpu_pod.py starts both.

Variants by arg:
  base   (default) the paper's settings
  small  the same data shapes (query 96, block 288, k 8) with a 2-layer d=128 model, a small
         batch and a few steps: a smoke test of a launch on the real prepared data
"""

from realm_jax.config.defaults import base_config
from realm_jax.config.presets import tiny_model

VARIANTS = ("base", "small")
ICT_RUN = "runs/ict_base"          # the workdir of the configs/ict_base.py run
BERT_BASE = "bert-base-uncased"    # a local Hugging Face BERT-base dir (never downloaded)


def get_config(arg=None):
  variant = arg or "base"
  if variant not in VARIANTS:
    raise ValueError(f"configs/realm_base.py: unknown variant {variant!r}; one of {VARIANTS}")
  c = base_config()
  c.model.vocab_size = 30522       # BERT-base uncased wordpieces (imported BERT fits as is)
  c.init.retriever = ICT_RUN       # the retriever from the ICT warm start
  c.init.reader = BERT_BASE        # the reader (BERT + MLM head) from pre-trained BERT-base
  c.retrieval.refresh = "async"    # the separate realm-index job re-embeds the corpus
  if variant == "small":
    _small(c)
  return c


def _small(c):
  """Shrinks the model, batch and schedule; keeps the data shapes so the same data dir works."""
  tiny_model(c)                    # a 2-layer d=128 BERT per tower
  c.init.retriever = ""            # random starts: BERT-base does not fit the tiny towers
  c.init.reader = ""
  c.train.batch_size = 16          # queries per step
  c.train.steps = 40               # long enough to cross a refresh and a checkpoint
  c.train.log_every = 10           # progress every 10 steps
  c.train.checkpoint_every = 20    # two checkpoints
  c.retrieval.refresh_every = 20   # one index rebuild mid-run
  c.retrieval.refresh = "in_process"   # by the trainer itself: one command
  c.eval.num_examples = 64         # a quick final evaluation

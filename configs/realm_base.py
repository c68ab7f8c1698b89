"""REALM pre-training at the paper's settings (Guu et al., 2020).

Task "realm" with a BERT-base reader and two separate BERT-base retriever towers (128-d
embeddings), k = 8 candidates with the null document, queries of 96 and blocks of 288
wordpieces, batch 512, lr 3e-5, 200k steps, the block index rebuilt every 500 steps, dropout
0.1: all of these are `base_config()` defaults, so only what differs is set below, as BERT's
optimizer and schedule are (`train.optimizer`, which REALM's code trained with; docs/design.md).
The paper trained on 64 TPUs (16 more embedded the corpus); use
`--config.model.dtype=bfloat16` there.

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
  openqa Open-QA fine-tuning of the `base` run at the paper's settings (ORQA's code and
         defaults, which REALM's release fine-tunes with): the reader reads `[CLS] question
         [SEP] body [SEP]` of 320 wordpieces (cut longest first), span scorer of width 256
         over spans of at most 10 wordpieces, the top 5 blocks read, the retriever's loss
         over the top 5,000, the block tower and the index frozen, lr 1e-5, one question a
         step (`_openqa` says which settings are ORQA's code and which could not be
         confirmed). Give it the questions
         (--config.qa.train, --config.qa.test: docs/openqa.md), the REALM run's data dir
         and workdir (--config.data.dir, --config.init.from_workdir) as for `base`
"""

from realm_jax.config.defaults import base_config
from realm_jax.config.presets import tiny_model

VARIANTS = ("base", "small", "openqa")
ICT_RUN = "runs/ict_base"          # the workdir of the configs/ict_base.py run
REALM_RUN = "runs/realm_base"      # the workdir of this config's `base` run
NQ_OPEN_TRAIN = 79_168             # NQ-open's training questions (ORQA's resplit)
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
  c.train.optimizer = "bert"       # BERT's AdamW and schedule, as the paper trained with
  if variant == "small":
    _small(c)
  if variant == "openqa":
    _openqa(c)
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


def _openqa(c):
  """ORQA's fine-tuning (google-research/language, orqa/experiments/orqa_experiment.py and
  orqa_model.py) from the REALM run: REALM's release fine-tunes with that very code, its
  flags' defaults, only the modules REALM's (realm/README.md). Model, data shapes and
  optimiser otherwise the base's."""
  c.task = "openqa"
  c.init.from_workdir = REALM_RUN  # query tower, block tower and reader from the REALM run
  c.init.retriever = ""            # (from_workdir starts every part)
  c.init.reader = ""
  c.retrieval.refresh = "in_process"   # the index is embedded once and frozen: no builder
  c.qa.reader_len = 320            # ORQA's reader_seq_len 288 + 32 (HF RealmConfig's too)
  c.qa.reader_beam = 5             # ORQA's reader_beam_size: the top 5 blocks are read
  c.qa.searcher_beam = 5000        # ORQA's retriever_beam_size: the retriever's loss is over
                                   # the top 5,000
  c.model.span_hidden_size = 256   # ORQA's span_hidden_size
  c.model.max_span_width = 10      # ORQA's max_span_width
  c.train.lr = 1e-5                # ORQA's learning_rate (REALM's pre-training: 3e-5)
  # (the warm-up stays min(10000, max(100, steps / 10)), ORQA's as REALM's; and so do AdamW's
  # weight decay 0.01 and checkpoints every 1,000 steps, ORQA's save_checkpoints_steps)
  # One question a step: ORQA's model_fn reads one question (its input_fn does not batch),
  # as a PyTorch port of its fine-tuning on HF's REALM classes does (batch_size=1). Neither
  # the REALM nor the ORQA paper's text gave a batch size that could be confirmed here. On
  # several devices the batch must divide the data axis: give --config.mesh.shape or
  # --config.train.batch_size.
  c.train.batch_size = 1
  # ORQA's released command trains 20 epochs of the training questions at one a step
  # (`--num_train_steps=$(( 3417 * 20 ))` for WebQuestions); here NQ-open's. REALM's release
  # gives no step count of its own, nor could the papers' text confirm one: set 20 x your
  # training questions.
  c.train.steps = 20 * NQ_OPEN_TRAIN

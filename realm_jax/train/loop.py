"""The training loop of every stage (`config.task` = ict | realm): setup, resume, index refresh,
steps, metrics, evaluation, checkpoints, summary."""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from realm_jax.data.store import PreparedData
from realm_jax.errors import ConfigError
from realm_jax.evaluate import Evaluator
from realm_jax.retrieval.index import build_exact_index
from realm_jax.train import batches, partitioning, state as state_lib, steps
from realm_jax.train.checkpoints import Checkpointer, restore_params
from realm_jax.train.config_base import incompatible_fields, validate
from realm_jax.train.metrics import MetricWriter, format_duration


def load_data(config) -> PreparedData:
  """Opens `config.data.dir`, turning a missing or partial dir into a ConfigError."""
  if not config.data.dir:
    raise ConfigError("data.dir", "is empty: point it at a prepared data dir")
  try:
    return PreparedData(config.data.dir)
  except FileNotFoundError as e:
    raise ConfigError("data.dir", str(e)) from None


def check_workdir(config, workdir: str) -> None:
  """Refuses a workdir whose checkpoints come from an incompatible config; records ours."""
  path = os.path.join(workdir, "config.json")
  current = json.loads(config.to_json_best_effort())
  if os.path.exists(path) and os.path.isdir(os.path.join(workdir, "checkpoints")):
    with open(path) as f:
      saved = json.load(f)
    diffs = incompatible_fields(saved, current)
    if diffs:
      raise ConfigError("", f"workdir {workdir} holds checkpoints of an incompatible config; "
                        "fields that differ: " + "; ".join(diffs))
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(current, f, indent=2)
    os.replace(path + ".tmp", path)


class Trainer:
  """One stage's run in `workdir`; `run()` trains to `config.train.steps` and evaluates."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    validate(config)
    self.data = load_data(config)
    stats = self.data.stats
    validate(config, num_blocks=self.data.blocks.num_blocks,
             store_block_len=self.data.blocks.block_len,
             max_sentence_len=stats["max_sentence_len"], vocab_size=self.data.tokenizer.vocab_size)
    try:
      self.examples = self.data.examples(config.data.split)
    except FileNotFoundError as e:
      raise ConfigError("data.split", str(e)) from None
    if len(self.examples) < config.train.batch_size:
      raise ConfigError("train.batch_size", f"{config.train.batch_size} > the "
                        f"{len(self.examples)} examples of split {config.data.split!r}")
    self.mesh = partitioning.make_mesh(config.mesh.shape)
    if config.train.batch_size % self.mesh.shape["data"]:
      raise ConfigError("train.batch_size", f"{config.train.batch_size} is not divisible by "
                        f"the data axis ({self.mesh.shape['data']})")
    self.queries = batches.QueryBatches(config, self.data, self.examples, jax.process_index(),
                                        jax.process_count())
    check_workdir(config, workdir)
    self.config, self.workdir = config, workdir
    self.model = state_lib.build_model(config, self.data.tokenizer.vocab_size)
    self.rng = jax.random.PRNGKey(config.seed)
    init_rng, self.step_rng = jax.random.split(self.rng)
    self.state, self.shardings, self.abstract = state_lib.create_train_state(
        config, self.model, self.mesh, self.data.blocks.block_len, init_rng)
    self.train_step = steps.make_train_step(config, self.model, self.shardings, self.mesh)
    # REALM batches retrieve from the index; ICT uses one only to measure recall.
    self.retrieves = config.task == "realm" and config.retrieval.mode == "index"
    self.uses_index = config.task == "ict" or self.retrieves
    self.index = None
    self.index_params = None        # retriever params the current index was built with
    self.saved_data = None          # the data item of the checkpoint resumed from
    self.checkpointer = Checkpointer(workdir, config.train.keep_checkpoints,
                                     config.train.async_checkpoints)
    realm_eval = steps.make_realm_eval(config, self.model, self.mesh) \
        if config.task == "realm" else None
    self.evaluator = Evaluator(config, self.data, self.mesh, self._embed_queries, realm_eval)
    if config.task == "ict" and not self.evaluator.has_answers:
      self.uses_index = False       # real text: no ground truth for ICT recall, no index needed

  # -- retrieval ---------------------------------------------------------------------------
  def _embed_queries(self, retriever_params, query_ids):
    return steps.embed(self.model, self.mesh, self.config, {"retriever": retriever_params},
                       "query", query_ids)

  def refresh_index(self, retriever_params, step: int) -> None:
    """Rebuilds the block index from `retriever_params` (a snapshot taken at `step`)."""
    version = 0 if self.index is None else self.index.version + 1
    self.index_params = retriever_params
    embed_fn = steps.block_embedder(self.model, self.mesh, self.config, retriever_params)
    self.index = build_exact_index(embed_fn, self.data.blocks, self.mesh,
                                   self.config.retrieval.embed_batch_size, step, version,
                                   log_prefix=f"[{self.config.task}] index v{version}: ")

  def _snapshot(self):
    """A copy of the current retriever params (the state's buffers are donated every step)."""
    return jax.tree.map(lambda x: x.copy(), self.state.params["retriever"])

  # -- checkpoints -------------------------------------------------------------------------
  def _retrieval_item(self) -> dict:
    item = {"step": jnp.asarray(-1 if self.index is None else self.index.step, jnp.int32)}
    if self.retrieves:
      item["params"] = self.index_params
    return item

  def restore_or_init(self) -> int:
    """Resumes from the latest checkpoint, else starts from `config.init.from_workdir` or
    `config.init.hf_bert`."""
    latest = self.checkpointer.latest_step()
    if latest is not None:
      abstract_retrieval = {"step": jax.ShapeDtypeStruct((), jnp.int32)}
      if self.retrieves:
        abstract_retrieval["params"] = self.abstract.params["retriever"]
      self.state, data_state, retrieval = self.checkpointer.restore(
          latest, self.abstract, abstract_retrieval)
      self.saved_data = data_state
      if "params" in retrieval:
        self.refresh_index(retrieval["params"], int(retrieval["step"]))
      print(f"[{self.config.task}] resumed from {self.checkpointer.directory}/{latest} "
            f"(data at step {data_state['next_step']})", flush=True)
      return int(data_state["next_step"])
    if self.config.init.from_workdir:
      params, step = restore_params(self.config.init.from_workdir, self.abstract.params)
      self.state = self.state.replace(params=params)
      print(f"[{self.config.task}] params from {self.config.init.from_workdir} step {step}",
            flush=True)
    elif self.config.init.hf_bert:
      from realm_jax.interop import hf_bert
      params, report = hf_bert.init_params(self.config, self.state.params,
                                           self.data.tokenizer.vocab_path,
                                           self.data.tokenizer.vocab_size)
      self.state = self.state.replace(params=jax.device_put(params, self.shardings.params))
      print("\n".join(f"[{self.config.task}] {line}" for line in report.lines()), flush=True)
    return 0

  # -- the loop ----------------------------------------------------------------------------
  def run(self) -> dict:
    cfg, task = self.config, self.config.task
    start = self.restore_or_init()
    total = cfg.train.steps
    n_params = state_lib.count_params(self.state.params)
    print(f"[{task}] {n_params / 1e6:.2f}M params, mesh {dict(self.mesh.shape)}, "
          f"batch {cfg.train.batch_size}, steps {start}->{total}, "
          f"{self.data.blocks.num_blocks:,} blocks, {len(self.examples):,} queries", flush=True)
    train_log, eval_log = MetricWriter(self.workdir, "train"), MetricWriter(self.workdir, "eval")
    data_iter = self.queries.iterator(cfg.data.prefetch, self.saved_data)
    t_start, t_last, window = time.time(), time.time(), []
    eval_metrics = {}
    try:
      if cfg.eval.every and start == 0 and self.uses_index:
        # The starting point of the curves: the retriever (and reader) as this stage got them.
        if self.index is None:
          self.refresh_index(self._snapshot(), 0)
        self.evaluate(eval_log, 0, refresh=False)
      for step in range(start, total):
        host = next(data_iter)
        if self.retrieves and (self.index is None or step % cfg.retrieval.refresh_every == 0
                               and step != self.index.step):
          self.refresh_index(self._snapshot(), step)
        batch = self._device_batch(host)
        self.state, metrics = self.train_step(self.state, batch, self.step_rng)
        window.append(metrics)
        done = step + 1
        if done % cfg.train.log_every == 0 or done == total:
          scalars = {k: float(np.mean([jax.device_get(m[k]) for m in window])) for k in window[0]}
          now = time.time()
          rate = len(window) / (now - t_last)
          scalars.update(steps_per_second=rate, learning_rate=float(
              state_lib.learning_rate_schedule(cfg.train)(done)))
          if self.index is not None:
            scalars["index_staleness"] = done - 1 - self.index.step
          train_log.write(done, scalars)
          shown = " ".join(f"{k} {scalars[k]:.4g}" for k in ("loss", "retrieval_utility",
                                                             "ict_accuracy") if k in scalars)
          print(f"[{task}] step {done}/{total} {shown} | {rate:.2f} steps/s "
                f"ETA {format_duration((total - done) / max(rate, 1e-9))}", flush=True)
          window, t_last = [], now
        if cfg.eval.every and done % cfg.eval.every == 0 and done != total:
          eval_metrics = self.evaluate(eval_log, done, refresh=cfg.task == "ict")[0]
        if done % cfg.train.checkpoint_every == 0 or done == total:
          self.checkpointer.save(done, self.state, self.queries.state(data_iter, done),
                                 self._retrieval_item())
      eval_metrics, details = self.evaluate(eval_log, total, refresh=self.uses_index,
                                            keep_examples=5)
    finally:
      data_iter.close()
      self.checkpointer.close()
      train_log.close()
      eval_log.close()
    summary = {"task": task, "steps": total, "wall_seconds": round(time.time() - t_start, 1),
               "params": n_params, **{f"eval_{k}": v for k, v in eval_metrics.items()}}
    if jax.process_index() == 0:
      with open(os.path.join(self.workdir, "summary.json"), "w") as f:
        json.dump({**summary, "examples": details}, f, indent=2)
    summary["examples"] = details
    return summary

  def _device_batch(self, host: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    cfg = self.config
    if cfg.task == "ict":
      return partitioning.global_batch(host, self.mesh)
    retrieved = None
    if self.retrieves:
      emb = self._embed_queries(self.index_params, partitioning.global_batch(
          {"q": host["query_ids"]}, self.mesh)["q"])
      retrieved = self.index.search(emb, cfg.retrieval.k + 1)
    cand = batches.candidates_for(cfg, self.data, host, retrieved)
    return partitioning.global_batch(batches.realm_batch(cfg, self.data, host, cand), self.mesh)

  def evaluate(self, writer: MetricWriter, step: int, refresh: bool, keep_examples: int = 0):
    """Eval metrics at `step`; `refresh` rebuilds the index from the current params first."""
    t0 = time.time()
    if refresh:
      self.refresh_index(self._snapshot(), step)
    index = self.index if self.uses_index else None
    # Eval queries are embedded with the query tower the index was built with.
    metrics, details = self.evaluator.run(self.state.params, index, self.index_params,
                                          keep_examples)
    writer.write(step, metrics)
    shown = " ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k != "num_examples") \
        or "nothing to measure (no recall ground truth in this data, no reader to score)"
    print(f"[{self.config.task}] eval @ {step}: {shown} ({time.time() - t0:.1f}s)", flush=True)
    return metrics, details


def train(config, workdir: str) -> dict:
  """Runs one stage; returns its summary (also written to `workdir/summary.json`)."""
  return Trainer(config, workdir).run()

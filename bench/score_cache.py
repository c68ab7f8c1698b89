"""REALM retriever steps/s with and without the frozen reader's score cache
(`retrieval.score_cache`, realm_jax/train/score_cache.py), on the real-prose recipe's shapes.

configs/real_realm.py:realm (reader frozen: MiniLM's shape, 4 layers; the small retriever;
batch 32, 4 blocks read per query, query 64 + block 128 wordpieces) on a prepared data dir
(`make demo-real` writes runs/real/data). Each step's candidates are random blocks (a fixed
stand-in for the index: the search is not what is measured). For `--steps` batches it times:

  uncached   the train step reading every candidate (what a run without the cache does)
  cold       the cache's look-up and reads of a batch never seen, then the step
  warm       the same batches again, every triple found: look-up + the step alone
  half       other batches, the triples of their first half of queries read beforehand
             (untimed): the reads of the other half, then the step (a run's later epochs
             find some of a batch, not all: the recipe's hit rate is 0.2-0.5)

With `--set retrieval.block_gradients=False` the candidates are scored with a random table's
embeddings (the serving index's stand-in) and only the query side is trained.

Each figure: the median of the timed steps (host batch building excluded, the cache's work
included), as steps/s, and warm / uncached. Then what a warm step is made of (the same
batches): the loss alone, the loss and its gradients (no update), and within them the query
tower's forward and forward + backward, beside the share of the query batch's wordpieces that
are not padding (the tower computes on every one of them). `--set KEY=VALUE` changes the config (e.g.
`--set model.retriever.num_layers=2`).

  python bench/score_cache.py --data runs/real/data [--steps 20] [--set KEY=VALUE ...]
      [--out runs/bench_score_cache.jsonl]

With `--out` the figures are appended there as one JSON line (`"bench": "score_cache"`).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from types import SimpleNamespace

import jax
import numpy as np

from realm_jax.data import pipeline
from realm_jax.data.prepared import PreparedData
from realm_jax.stages import repo_config
from realm_jax.config.overrides import apply_assignments, with_overrides
from realm_jax.train import batches, candidate_rows, steps
from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.errors import CommandParser, ConfigError, run_cli
from realm_jax.config.validation import validate, validate_against_mesh
from realm_jax.train.score_cache import ScoreCache, cache_keys
from report import append_jsonl, host_cpu, host_cpu_text, positive_int   # bench/: sys.path[0]


def host_batches(config, data, n: int, first: int = 0, shards: int = 1):
  """n REALM batches from step `first`: (queries, candidate rows, host batch), random
  candidates; without `retrieval.block_gradients`, with a random table's embeddings of them
  (the serving index's stand-in); with `retrieval.packed_query_rows`, the queries packed
  (in `shards` data shards) where they fit."""
  stream = batches.QueryBatches(config, data, data.examples("train"))
  rng = np.random.default_rng(first)
  index = SimpleNamespace(version=0, embeddings=rng.normal(
      size=(data.blocks.num_blocks, config.model.retrieval_dim)).astype(np.float32))
  out = []
  for t in range(first, first + n):
    queries = stream(t)
    retrieved = rng.integers(0, data.blocks.num_blocks,
                             (len(queries["query_ids"]), config.retrieval.k + 1))
    cands = candidate_rows.of(config).rows(data, queries, retrieved, training=True)
    batch = batches.realm_batch(config, data, queries, cands)
    if not config.retrieval.block_gradients:
      batch["candidate_emb"] = batches.index_embeddings(index, cands)
    batches.pack_queries(config, batch, shards)
    out.append((queries, cands, batch))
  return out


def timed(run, items) -> list[float]:
  seconds = []
  for item in items:
    t0 = time.perf_counter()
    jax.block_until_ready(run(item))
    seconds.append(time.perf_counter() - t0)
  return seconds


def warm_parts(config, model, params, found: list[dict], rng) -> dict[str, float]:
  """ms of a warm step's parts on batches whose scores were all found (`found`: filled
  batches, the first one compiles): the loss, loss + gradients, the query tower's forward
  and forward + backward; and the query wordpieces' non-padding share."""
  loss = lambda p, b: steps.realm_loss_fn(p, model, b, config, rng)[0]
  tower = lambda p, b: steps.query_embeddings(model, p, b).sum()

  parts = {"loss": jax.jit(loss), "loss + gradients": jax.jit(jax.grad(loss)),
           "query tower": jax.jit(tower), "query tower + gradients": jax.jit(jax.grad(tower))}
  figures = {}
  for name, fn in parts.items():
    jax.block_until_ready(fn(params, found[0]))    # compile
    figures[name] = statistics.median(timed(lambda b: fn(params, b), found[1:])) * 1e3
  ids = np.concatenate([np.asarray(b.get("packed_ids", b["query_ids"])) for b in found])
  figures["real wordpieces"] = float((ids > 0).mean())
  figures["packed"] = sum("packed_ids" in b for b in found) / len(found)
  return figures


def main() -> None:
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", required=True, help="a prepared data dir (runs/real/data)")
  parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per case (>= 1)")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  parser.add_argument("--out", default="", help="append the figures as a JSON line here")
  args = parser.parse_args()
  config = with_overrides(repo_config("real_realm", "realm"),
                          {"data.dir": args.data, "retrieval.refresh": "in_process",
                           "retrieval.score_cache": True})
  data = PreparedData(args.data)
  try:
    apply_assignments(config, args.set, "--set")   # read as the launchers read theirs
    validate(config, num_blocks=data.blocks.num_blocks, store_block_len=data.blocks.block_len)
  except ConfigError as e:
    raise SystemExit(f"bench: {e}") from None
  model = state_lib.build_model(config, data.tokenizer.vocab_size)
  mesh = partitioning.make_mesh(tuple(config.mesh.shape))
  try:
    validate_against_mesh(config, mesh.shape["data"])
  except ConfigError as e:
    raise SystemExit(f"bench: {e}") from None
  state, shardings, _ = state_lib.create_train_state(config, model, mesh,
                                                     data.blocks.block_len,
                                                     jax.random.PRNGKey(0))
  step = steps.make_train_step(config, model, shardings, mesh)
  rng = jax.random.PRNGKey(1)
  shards = mesh.shape["data"]
  work = host_batches(config, data, args.steps + 1, shards=shards)
  cache = ScoreCache(config, model, state.params["reader"], config.train.batch_size)

  def run_step(batch):
    nonlocal state
    state, metrics = step(state, partitioning.global_batch(batch, mesh), rng)
    return metrics

  rows_read = []

  def cached_step(item):
    queries, cands, batch = item
    batch, _, _, rows = cache.fill(dict(batch), cache_keys(queries, cands))
    rows_read.append(rows)
    return run_step(batch)

  figures, rows, first_work = {}, {}, work
  for name, run in (("uncached", lambda item: run_step(item[2])), ("cold", cached_step),
                    ("warm", cached_step), ("half", cached_step)):
    if name == "half":                            # other batches, their first halves read
      work = host_batches(config, data, args.steps + 1, first=args.steps + 1, shards=shards)
      for queries, cands, batch in work:
        first_half = len(cands) // 2
        cache.fill({key: value[:first_half] for key, value in batch.items()
                    if key not in pipeline.PACKED_QUERIES},   # those are [rows, ...]
                   cache_keys(queries, cands)[:first_half])
    run(work[0])                                  # compile (warm: the first batch is found)
    rows_read.clear()
    figures[name] = statistics.median(timed(run, work[1:]))
    rows[name] = sum(rows_read) / args.steps
  machine = f"{host_cpu_text()}, {os.cpu_count()} cores, {jax.device_count()} x " \
            f"{jax.devices()[0].platform}"
  print(f"score cache on configs/real_realm.py:realm shapes (batch {config.train.batch_size}, "
        f"{work[0][1].shape[1]} candidates read per query, reader {config.model.num_layers} "
        f"layers; {machine}), median of {args.steps} steps:")
  for name, seconds in figures.items():
    read = f"  reader rows/step {rows[name]:6.1f}" if name != "uncached" else ""
    print(f"  {name:<9} {seconds * 1e3:8.1f} ms/step  {1 / seconds:7.2f} steps/s{read}")
  print(f"  warm / uncached: {figures['uncached'] / figures['warm']:.1f}x steps/s, half / "
        f"uncached {figures['uncached'] / figures['half']:.2f}x ({len(cache):,} triples "
        f"cached; reads in chunks of {cache.chunks[False]} rows, the null document's "
        f"{cache.chunks[True]})")
  found = [partitioning.global_batch(cache.fill(dict(batch), cache_keys(queries, cands))[0],
                                     mesh) for queries, cands, batch in first_work]
  parts = warm_parts(config, model, state.params, found, rng)
  real, packed = parts.pop("real wordpieces"), parts.pop("packed")
  packed_rows = config.retrieval.packed_query_rows
  print("  a warm step's parts (ms): " + ", ".join(f"{name} {ms:.1f}"
                                                    for name, ms in parts.items()) +
        f"; {real:.0%} of the query tower's wordpieces are not padding" +
        (f" (queries packed into {packed_rows} rows in {packed:.0%} of the batches)"
         if packed_rows else ""))
  append_jsonl(args.out, {
      "bench": "score_cache", "steps": args.steps, "batch": config.train.batch_size,
      "candidates_read": int(work[0][1].shape[1]), "set": args.set, **host_cpu(),
      "cores": os.cpu_count(), "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
      "ms_per_step": {name: round(s * 1e3, 2) for name, s in figures.items()},
      "reader_rows_per_step": {name: rows[name] for name in figures if name != "uncached"},
      "warm_over_uncached": round(figures["uncached"] / figures["warm"], 3),
      "half_over_uncached": round(figures["uncached"] / figures["half"], 3),
      "triples_cached": len(cache), "warm_parts_ms": {k: round(v, 2) for k, v in parts.items()},
      "real_wordpieces": round(real, 4), "time": time.time()})


if __name__ == "__main__":
  sys.exit(run_cli("bench/score_cache.py", main))

"""The ScaNN block index on learned embeddings: embedding throughput, build, load, recall, QPS.

A generated world of `--entities` entities (242,000: ~1.0M blocks of 40 wordpieces) is
prepared with the demo's vocab (the model only knows those wordpieces), every block is
embedded with the block tower of a trained demo REALM model (`--model_workdir`'s latest
checkpoint; '' for a randomly initialised retriever), and the [num_blocks, 128] table is
indexed with the derived `realm_jax.retrieval.scann_index` settings. Printed, and appended
as one JSON line to `--out`:

  embedding      blocks/s, and the block tower's FLOP/s (analytic count) as a ratio to an
                 in-process 2048^3 fp32 matmul
  build          ScaNN build + serialize seconds (target <= 60 s at 1M blocks), load seconds,
                 bytes on disk
  recall@10      of ScaNN vs exact search, on `--queries` block-derived queries: the query
                 tower on `[CLS] x [SEP]`, x = the first query_len - 2 body wordpieces of a
                 random block (target >= 0.95)
  QPS            ScaNN vs exact brute force (numpy matmul + argpartition, and jax matmul +
                 top_k, over the whole table) at batch 1 and `--batch` (target ScaNN >= 10x)

The prepared world (`--cache/world/...`) and the embeddings (`--cache/embeddings/*.npy`) are
cached, so a rerun skips both (the embedding figures then come from the cached run).

  python bench/index.py [--entities 242000] [--model_workdir runs/demo/realm] \\
      [--vocab runs/demo/data/vocab.txt] [--out runs/bench_index.jsonl]
  python bench/index.py --entities 3000 --model_workdir '' --vocab DATA_DIR/vocab.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.data.prepare import prepare_config, prepare
from realm_jax.data.prepared import PreparedData
from realm_jax.stages import repo_config
from realm_jax.errors import CommandParser, run_cli
from realm_jax.retrieval import scann_index
from realm_jax.retrieval.index import device_batch, embed_blocks
from realm_jax.runtime import partitioning, state as state_lib, embedders
from realm_jax.runtime.checkpoints import restore_run
from report import append_jsonl, positive_int, print_rows, verdict   # bench/: sys.path[0]
from train_step import matmul_flops_per_s, tower_flops

REPO = pathlib.Path(__file__).resolve().parents[1]
TOP_N = 10
# What the index has to deliver on ~1M blocks (smaller corpora show the marks for reference).
TARGETS = {"build_s": 60.0, "recall_at_10": 0.95, "speedup": 10.0}


def sha8(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:8]


def prepared_world(cache: pathlib.Path, entities: int, seed: int, vocab: str, workers: int,
                   config) -> pathlib.Path:
  """The world's prepared data dir under `cache/world/`, prepared on first use (demo shapes)."""
  with open(vocab, "rb") as f:
    vocab_id = hashlib.sha256(f.read()).hexdigest()[:8]
  out = cache / "world" / f"{entities}-seed{seed}-vocab{vocab_id}"
  c = prepare_config()
  c.source, c.world_seed, c.out_dir = f"world:{entities}", seed, str(out)
  c.vocab = os.path.abspath(vocab)
  c.block_len = config.data.block_len                 # 40, like the demo
  c.max_sentence_len = config.data.query_len - 2      # 14
  c.num_workers, c.shard_documents = workers, 20_000
  prepare(c)
  return out


def retriever_params(config, model, mesh, data, workdir: str, seed: int) -> tuple[dict, dict]:
  """The retriever params to embed with, and {"model": description, "checkpoint_step"}."""
  if not workdir:
    state, _, _ = state_lib.create_train_state(config, model, mesh, data.blocks.block_len,
                                               jax.random.PRNGKey(seed))
    return state.params["retriever"], {
        "model": f"random init (seed {seed}): NOT a trained model", "checkpoint_step": None}
  run = restore_run(workdir, config=config, vocab_size=data.tokenizer.vocab_size,
                    block_len=data.blocks.block_len)
  params, step = run.params, run.step
  return params["retriever"], {"model": f"{os.path.abspath(workdir)} @ step {step}",
                               "checkpoint_step": int(step)}


def block_flops(config) -> float:
  """Forward FLOPs of the block tower on one block: encoder matmuls (the last layer at the
  positions the tower reads), pooler, projection (at the retriever's own shape)."""
  return float(tower_flops(config, config.data.block_len))


def block_embeddings(cache: pathlib.Path, world: pathlib.Path, data: PreparedData, config,
                     model, mesh, params, model_meta: dict,
                     args) -> tuple[np.ndarray, dict]:
  """The table [num_blocks, dim] float32 and how it was made; cached as .npy + .json."""
  path = cache / "embeddings" / f"{world.name}-{sha8(model_meta['model'])}.npy"
  meta_path = path.with_suffix(".json")
  if path.exists() and meta_path.exists() and not args.reembed:
    print(f"[bench] cached embeddings {path} ({model_meta['model']})", flush=True)
    return np.load(path, mmap_mode="r"), {**json.loads(meta_path.read_text()),
                                          "embed_cached": True}
  embed_fn = embedders.block_embedder(model, mesh, config, params)
  # One untimed batch of the shape embed_blocks uses (every batch is padded to it): the rate
  # below is the embedding's, the compile is reported beside it.
  rows = np.arange(device_batch(args.embed_batch, mesh.devices.size)) % data.blocks.num_blocks
  t0 = time.perf_counter()
  jax.block_until_ready(embed_fn(np.asarray(data.blocks.tokens[rows]),
                                 data.blocks.segments(rows)))
  compile_s = time.perf_counter() - t0
  table, seconds = embed_blocks(embed_fn, data.blocks, mesh, args.embed_batch, "[bench] ")
  # np.asarray(...)[:num_blocks] also accepts the older contract (a padded device table).
  table = np.ascontiguousarray(np.asarray(table)[:data.blocks.num_blocks], np.float32)
  path.parent.mkdir(parents=True, exist_ok=True)
  np.save(str(path) + ".tmp.npy", table)
  os.replace(str(path) + ".tmp.npy", path)
  meta = {**model_meta, "embed_s": round(seconds, 2), "embed_compile_s": round(compile_s, 2),
          "embed_backend": jax.default_backend(),
          "embed_devices": mesh.devices.size}
  meta_path.write_text(json.dumps(meta))
  return table, {**meta, "embed_cached": False}


def block_queries(data: PreparedData, config, model, mesh, params, rows: np.ndarray,
                  batch_size: int = 256) -> np.ndarray:
  """Query-tower embeddings of `[CLS] x [SEP]`, x = the first query_len - 2 body wordpieces
  of each block row (a sentence-like span the block itself answers)."""
  blocks, tok, q = data.blocks, data.tokenizer, config.data.query_len
  ids = np.zeros((len(rows), q), np.int32)
  for i, row in enumerate(rows):
    body = blocks.tokens[row][blocks.body_start[row]:blocks.lengths[row] - 1][:q - 2]
    ids[i, :len(body) + 2] = [tok.cls_id, *body, tok.sep_id]
  batch_size = device_batch(batch_size, mesh.devices.size)
  sharding = partitioning.batch_sharding(mesh)
  out = []
  for start in range(0, len(ids), batch_size):
    chunk = ids[start:start + batch_size]
    padded = np.zeros((batch_size, q), np.int32)
    padded[:len(chunk)] = chunk
    emb = embedders.embed(model, mesh, config, {"retriever": params}, "query",
                      jax.device_put(padded, sharding))
    out.append(np.asarray(emb)[:len(chunk)])
  return np.concatenate(out).astype(np.float32)


def queries_per_s(search, queries: np.ndarray, batch: int, budget_s: float) -> float:
  """Queries/s of `search(q [batch, dim])` over `queries` in full batches only (a shorter last
  one would compile another shape for the jitted search inside the timing; one untimed
  warm-up), stopping early once `budget_s` seconds are spent."""
  if batch > len(queries):
    raise SystemExit(f"bench/index.py: --batch {batch} > {len(queries)} queries")
  search(queries[:batch])
  done, t0 = 0, time.perf_counter()
  for start in range(0, len(queries) - batch + 1, batch):
    done += len(search(queries[start:start + batch]))
    if time.perf_counter() - t0 > budget_s:
      break
  return done / (time.perf_counter() - t0)


def jax_exact_search(table: np.ndarray):
  """fn(q) -> top-10 rows by jitted matmul + top_k over the table on the default device."""
  device_table = jax.device_put(np.asarray(table))
  top = jax.jit(lambda q, t: jax.lax.top_k(q @ t.T, TOP_N)[1])
  return lambda q: np.asarray(top(jnp.asarray(q), device_table))


def serialize(searcher, index_dir: pathlib.Path) -> tuple[float, int]:
  """Saves `searcher` into a fresh `index_dir`: (seconds, bytes on disk)."""
  shutil.rmtree(index_dir, ignore_errors=True)
  index_dir.mkdir(parents=True)
  t0 = time.perf_counter()
  scann_index.save_searcher(searcher, str(index_dir))
  seconds = time.perf_counter() - t0
  return seconds, sum(p.stat().st_size for p in index_dir.rglob("*") if p.is_file())


def load(index_dir: pathlib.Path, num_blocks: int, settings: dict):
  """The serialized index as the trainer loads it: (ScannIndex, seconds)."""
  t0 = time.perf_counter()
  index = scann_index.ScannIndex.load(str(index_dir), version=0, step=0, num_blocks=num_blocks,
                                      settings=settings)
  return index, time.perf_counter() - t0


def bench_index(table: np.ndarray, queries: np.ndarray, config, cache: pathlib.Path,
                args) -> dict:
  """Builds, serializes, loads and searches the ScaNN index; exact search for reference."""
  num_blocks, dim = table.shape
  settings = scann_index.scann_settings(num_blocks, config.builder)
  print(f"[bench] building ScaNN over {num_blocks:,} x {dim}: {settings}", flush=True)
  t0 = time.perf_counter()
  searcher = scann_index.build_searcher(table, settings)
  build_s = time.perf_counter() - t0
  index_dir = cache / "index"
  serialize_s, index_bytes = serialize(searcher, index_dir)
  index, load_s = load(index_dir, num_blocks, settings)
  print(f"[bench] built in {build_s:.1f}s, serialized in {serialize_s:.1f}s "
        f"({index_bytes / 1e6:,.0f} MB), loaded in {load_s:.1f}s; exact top-{TOP_N} of "
        f"{len(queries):,} queries", flush=True)
  rows = index.search(queries, TOP_N)
  in_memory = scann_index.ScannIndex(searcher, version=0, step=0, num_blocks=num_blocks,
                                     settings=settings).search(queries, TOP_N)
  t0 = time.perf_counter()
  exact = scann_index.exact_top_n(queries, table, TOP_N)
  exact_s = time.perf_counter() - t0
  record = {
      "blocks": num_blocks, "dim": dim, "scann": settings, "build_s": round(build_s, 2),
      "serialize_s": round(serialize_s, 2), "build_serialize_s": round(build_s + serialize_s, 2),
      "load_s": round(load_s, 2), "index_bytes": index_bytes, "queries": len(queries),
      "recall_at_10": scann_index.recall_at(rows, exact),
      "loaded_matches_in_memory": bool(np.array_equal(rows, in_memory)),
      "exact_ground_truth_s": round(exact_s, 2), "qps": {},
  }
  print(f"[bench] recall@{TOP_N} {record['recall_at_10']:.4f}; timing searches", flush=True)
  searches = {"scann": lambda q: index.search(q, TOP_N)}
  if not args.skip_exact_qps:
    searches["exact_numpy"] = lambda q: scann_index.exact_top_n(q, table, TOP_N,
                                                                chunk=num_blocks)
    searches["exact_jax"] = jax_exact_search(table)
  for batch in sorted({1, args.batch}):
    for name, search in searches.items():
      qps = queries_per_s(search, queries, batch, args.qps_seconds)
      record["qps"][f"{name}_b{batch}"] = round(qps, 1)
      print(f"[bench]   {name} batch {batch}: {qps:,.1f} queries/s", flush=True)
    exact_best = max((v for k, v in record["qps"].items()
                      if k.startswith("exact") and k.endswith(f"_b{batch}")), default=0)
    if exact_best:
      record[f"speedup_b{batch}"] = round(record["qps"][f"scann_b{batch}"] / exact_best, 1)
  shutil.rmtree(index_dir, ignore_errors=True)
  return record


def print_table(r: dict) -> None:
  settings = ", ".join(f"{k} {v}" for k, v in r["scann"].items())
  rows = [
      ("model", r["model"]),
      ("device", f"{r['devices']} x {r['device_kind']} ({r['backend']})"),
      ("corpus", f"world:{r['entities']:,} -> {r['blocks']:,} blocks x {r['dim']}"),
      ("embedding", f"{r['embed_s']:.1f} s, {r['blocks_per_s']:,.0f} blocks/s (compiled "
                    f"before, in {r.get('embed_compile_s', float('nan')):.1f} s)"
                    + (" (cached run)" if r["embed_cached"] else "")),
      ("embedding FLOP/s", f"{r['embed_flops_per_s'] / 1e9:,.1f} GFLOP/s = "
                           f"{r['embed_ratio_to_matmul']:.1%} of fp32 matmul "
                           f"({r['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s)"),
      ("ScaNN settings", settings),
      ("build + serialize", f"{r['build_s']:.1f} + {r['serialize_s']:.1f} s "
                            f"[target at ~1M blocks <= {TARGETS['build_s']:.0f} s: "
                            f"{verdict(r['build_serialize_s'] <= TARGETS['build_s'])}]"),
      ("load", f"{r['load_s']:.2f} s"),
      ("index on disk", f"{r['index_bytes'] / 1e6:,.1f} MB"),
      (f"recall@{TOP_N}", f"{r['recall_at_10']:.4f} on {r['queries']:,} block queries "
                          f"[target at ~1M blocks >= {TARGETS['recall_at_10']}: "
                          f"{verdict(r['recall_at_10'] >= TARGETS['recall_at_10'])}]"),
      ("loaded == in-memory", str(r["loaded_matches_in_memory"])),
  ]
  for key, qps in r["qps"].items():
    rows.append((f"QPS {key}", f"{qps:,.1f}"))
  for key in sorted(k for k in r if k.startswith("speedup_b")):
    rows.append((f"ScaNN / exact, {key[8:]}", f"{r[key]:.1f}x [target at ~1M blocks >= "
                 f"{TARGETS['speedup']:.0f}x: {verdict(r[key] >= TARGETS['speedup'])}]"))
  print_rows(rows)


def parse_args(argv=None) -> argparse.Namespace:
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model_workdir", default=str(REPO / "runs/demo/realm"),
                      help="trained demo REALM workdir ('' for a random retriever)")
  parser.add_argument("--vocab", default=str(REPO / "runs/demo/data/vocab.txt"),
                      help="the model's vocab.txt (a prepared data dir's)")
  parser.add_argument("--entities", type=positive_int, default=242_000,
                      help="world entities (~4.1 blocks each; 242,000: ~1.0M blocks)")
  parser.add_argument("--world_seed", type=int, default=0, help="seed of the generated world")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the query rows (and of a random retriever)")
  parser.add_argument("--queries", type=positive_int, default=1000,
                      help="block-derived queries (>= --batch)")
  parser.add_argument("--batch", type=positive_int, default=32, help="search batch besides 1")
  parser.add_argument("--qps_seconds", type=float, default=10.0,
                      help="time budget per QPS measurement")
  parser.add_argument("--skip_exact_qps", action="store_true",
                      help="do not time exact brute-force search")
  parser.add_argument("--embed_batch", type=positive_int, default=None,
                      help="blocks per embedding batch (default: the config's)")
  parser.add_argument("--reembed", action="store_true", help="ignore cached embeddings")
  parser.add_argument("--workers", type=int, default=2, help="processes preparing the world")
  parser.add_argument("--cache", default=str(REPO / "runs/bench_index"),
                      help="where the world, embeddings and the index under test live")
  parser.add_argument("--out", default=str(REPO / "runs/bench_index.jsonl"),
                      help="append the JSON record here ('' to skip)")
  args = parser.parse_args(argv)
  if args.queries < args.batch:   # before the world is made and embedded: no batch to time
    parser.error(f"--queries {args.queries} must be >= --batch ({args.batch}): the queries/s "
                 "figures search them in batches of 1 and --batch")
  return args


def main(argv=None) -> dict:
  """Prepares (or reuses) the world and the embeddings, benches the index, prints and logs."""
  args = parse_args(argv)
  if args.model_workdir and not os.path.isdir(os.path.join(args.model_workdir, "checkpoints")):
    raise FileNotFoundError(f"no checkpoints under {args.model_workdir} (train the demo, or "
                            "pass --model_workdir '' for a random retriever)")
  if not os.path.isfile(args.vocab):
    raise FileNotFoundError(f"--vocab {args.vocab} is not a file")

  config = repo_config("demo_realm")
  args.embed_batch = args.embed_batch or config.retrieval.embed_batch_size
  cache = pathlib.Path(args.cache)
  print(f"[bench] backend {jax.default_backend()}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}; world:{args.entities:,}", flush=True)
  world = prepared_world(cache, args.entities, args.world_seed, args.vocab, args.workers,
                         config)
  data = PreparedData(str(world))
  mesh = partitioning.make_mesh(config.mesh.shape)
  model = state_lib.build_model(config, data.tokenizer.vocab_size)
  matmul = matmul_flops_per_s(jnp.float32)
  params, model_meta = retriever_params(config, model, mesh, data, args.model_workdir,
                                        args.seed)
  table, meta = block_embeddings(cache, world, data, config, model, mesh, params, model_meta,
                                 args)
  num_blocks = data.blocks.num_blocks
  rows = np.random.default_rng(args.seed).choice(num_blocks, min(args.queries, num_blocks),
                                                 replace=False)
  queries = block_queries(data, config, model, mesh, params, rows)
  record = {"bench": "index", "backend": jax.default_backend(),
            "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
            "entities": args.entities, **meta,
            "blocks_per_s": num_blocks / meta["embed_s"],
            "embed_flops_per_block": block_flops(config)}
  record["embed_flops_per_s"] = record["blocks_per_s"] * record["embed_flops_per_block"]
  record["matmul_flops_per_s"] = matmul
  record["embed_ratio_to_matmul"] = record["embed_flops_per_s"] / matmul
  record.update(bench_index(table, queries, config, cache, args))
  print_table(record)
  print(json.dumps(record))
  append_jsonl(args.out, record)
  return record


if __name__ == "__main__":
  run_cli("bench/index.py", lambda: main(sys.argv[1:]))

"""The block index at REALM's corpus size: 13.35M x 128 synthetic embeddings, ScaNN vs exact.

REALM's Wikipedia corpus is ~13.35M blocks of 288 wordpieces. No trained model embeds that
many blocks here, so the table is SYNTHETIC: `--clusters` Gaussian clusters in `--dim`
dimensions, each row standardised to zero mean and unit variance as the towers' final
LayerNorm leaves them (norm ~ sqrt(dim)); the queries are fresh draws from the same mixture,
not perturbed table rows. Printed, and appended as one JSON line to `--out`:

  table          generation seconds (cached as .npy under --cache for reruns), bytes
  ScaNN          the derived `scann_index.scann_settings` of `configs/realm_base.py`, build +
                 serialize seconds, peak resident memory during the build (the process's RSS,
                 the memory-mapped table's touched pages included), load seconds, bytes on disk
  recall@10      ScaNN vs exact on `--queries` queries (target >= 0.95)
  queries/s      ScaNN and exact numpy (chunked matmul + top-n) at batch 1 and at a REALM
                 batch (`--batch`, 512 queries a step), and the speedup (target >= 10x)
  exact top-k    on device (`retrieval.index.ExactIndex`, what `retrieval.backend=exact`
                 serves): the compiled search's memory (XLA's analysis: the table and the
                 [batch, blocks] scores) at batch 1, 32 and the REALM batch, and its queries/s at
                 batch 1, 32 and the REALM batch where the memory holds it (on CPU the host
                 keeps the table twice; on an accelerator, where its memory holds the
                 compiled search), and its recall@10 against the host (numpy, float32)
                 search (GPUs multiply float32 in TF32 by default)
  refresh rate   blocks/s the builder must embed to rebuild the index every `--refresh_every`
                 steps at `--step_s` seconds a step (default: an estimate of the paper's step
                 from its FLOPs, shown with its assumptions), against the BERT-base block
                 tower's measured blocks/s at 288 wordpieces on this host (in bfloat16 on an
                 accelerator, as the builder runs there)

`--table_only` generates the table into the cache and stops (to have it ready beforehand).
`--skip_scann` leaves the host-side ScaNN build and numpy's queries/s (its baseline) out: on a
GPU machine the figures wanted are the device's.

  python bench/index_scale.py [--blocks 13350000] [--queries 1000] [--batch 512]
      [--skip_scann] [--cache runs/bench_index_scale] [--out runs/bench_index_scale.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import threading
import time

import jax
import numpy as np

from realm_jax.stages import repo_config
from realm_jax.retrieval import index as index_lib, scann_index
from realm_jax.errors import CommandParser
from index import load, serialize        # bench/ is this script's directory: sys.path[0]
from report import append_jsonl, host_cpu, host_cpu_text, positive_int, print_rows, verdict
from train_step import analytic_flops, host_available_gb

REPO = pathlib.Path(__file__).resolve().parents[1]
TOP_N = 10
GENERATE_CHUNK = 1 << 20
TPU_V3_BF16_FLOPS = 123e12    # one TPU v3 chip, dense bf16 peak (the paper's 64 TPUs)


def synthetic_table(path: pathlib.Path, blocks: int, dim: int, clusters: int,
                    seed: int) -> tuple[np.ndarray, float]:
  """[blocks, dim] float32 clustered rows, standardised per row; cached at `path`."""
  if path.exists():
    return np.load(path, mmap_mode="r"), 0.0
  t0 = time.perf_counter()
  rng = np.random.default_rng(seed)
  centers = rng.normal(size=(clusters, dim)).astype(np.float32)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(".tmp.npy")
  table = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(blocks, dim))
  for start in range(0, blocks, GENERATE_CHUNK):
    count = min(GENERATE_CHUNK, blocks - start)
    table[start:start + count] = mixture_draws(rng, centers, count)
    print(f"[scale] table {start + count:,}/{blocks:,} rows", end="\r", flush=True)
  table.flush()
  del table
  os.replace(tmp, path)
  print(flush=True)
  return np.load(path, mmap_mode="r"), time.perf_counter() - t0


def mixture_draws(rng: np.random.Generator, centers: np.ndarray, count: int) -> np.ndarray:
  """`count` rows: a random centre + N(0, 0.7^2) noise, standardised as a LayerNorm would."""
  rows = centers[rng.integers(0, len(centers), count)]
  rows += 0.7 * rng.normal(size=rows.shape).astype(np.float32)
  rows -= rows.mean(axis=1, keepdims=True)
  rows /= rows.std(axis=1, keepdims=True)
  return rows


class PeakRSS:
  """Samples this process's resident set every 0.2 s while in use; `.gb` is the peak."""

  def __enter__(self):
    self.peak, self._stop = 0, threading.Event()
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def _sample(self):
    while not self._stop.is_set():
      with open("/proc/self/status") as f:
        for line in f:
          if line.startswith("VmRSS:"):
            self.peak = max(self.peak, int(line.split()[1]) * 1024)
      self._stop.wait(0.2)

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()

  @property
  def gb(self) -> float:
    return self.peak / 1e9


def queries_per_s(search, queries: np.ndarray, batch: int, budget_s: float) -> float:
  """Queries/s of `search(q [batch, dim])` (one untimed warm-up), passing over `queries` again
  until ~`budget_s` are spent (bench/index.py's makes one pass: at 13.35M blocks one pass of
  fast ScaNN searches is too short to time)."""
  search(queries[:batch])
  done, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < budget_s:
    for start in range(0, len(queries) - batch + 1, batch):
      done += len(search(queries[start:start + batch]))
      if time.perf_counter() - t0 > budget_s:
        break
  return done / (time.perf_counter() - t0)


def bench_scann(table, queries, exact, cache: pathlib.Path, args) -> dict:
  settings = scann_index.scann_settings(len(table), repo_config("realm_base").builder)
  print(f"[scale] building ScaNN over {len(table):,} x {table.shape[1]}: {settings}", flush=True)
  with PeakRSS() as rss:
    t0 = time.perf_counter()
    searcher = scann_index.build_searcher(table, settings)
    build_s = time.perf_counter() - t0
  index_dir = cache / "index"
  serialize_s, index_bytes = serialize(searcher, index_dir)
  del searcher    # at full size the built and the loaded index do not both fit
  index, load_s = load(index_dir, len(table), settings)
  recall = scann_index.recall_at(index.search(queries, TOP_N), exact)
  print(f"[scale] built in {build_s:.0f} s (peak RSS {rss.gb:.1f} GB), serialized in "
        f"{serialize_s:.0f} s ({index_bytes / 1e9:.2f} GB), loaded in {load_s:.0f} s; "
        f"recall@{TOP_N} {recall:.4f}", flush=True)
  qps = {f"scann_b{b}": round(queries_per_s(lambda q: index.search(q, TOP_N), queries, b,
                                            args.qps_seconds), 1)
         for b in (1, args.batch)}
  shutil.rmtree(index_dir, ignore_errors=True)
  return {"scann": settings, "build_s": round(build_s, 1), "serialize_s": round(serialize_s, 1),
          "build_peak_rss_gb": round(rss.gb, 2), "load_s": round(load_s, 1),
          "index_bytes": index_bytes, "recall_at_10": recall, "qps": qps}


def device_memory_gb() -> float | None:
  """The first device's memory (an accelerator's bytes_limit; None on CPU or if unknown)."""
  if jax.default_backend() == "cpu":
    return None
  stats = jax.devices()[0].memory_stats() or {}
  return stats["bytes_limit"] / 1e9 if "bytes_limit" in stats else None


def bench_exact_device(table, queries, exact, args) -> dict:
  """Memory of the on-device exact search (compiled, nothing allocated) at three batches, its
  recall@10 against `exact` (numpy), and its queries/s at each batch whose compiled search the
  memory holds: on CPU the host holds the padded table twice (host copy + device copy) beside
  it, on an accelerator its own memory holds the search."""
  n, dim = table.shape
  chunks = -(-n // index_lib.CHUNK)
  abstract_table = jax.ShapeDtypeStruct((chunks, index_lib.CHUNK, dim), np.float32)
  memory = {}
  for b in sorted({1, 32, args.batch}):
    compiled = index_lib._top_n.lower(jax.ShapeDtypeStruct((b, dim), np.float32),
                                      abstract_table, n, TOP_N).compile()
    stats = compiled.memory_analysis()
    memory[b] = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                 + stats.temp_size_in_bytes) / 1e9
  record = {"exact_device_memory_gb": {f"b{b}": round(gb, 2) for b, gb in memory.items()},
            "exact_device_qps": {}}
  device_gb = device_memory_gb()
  if device_gb is None:
    needed_gb = 2 * chunks * index_lib.CHUNK * dim * 4 / 1e9
    available_gb = host_available_gb()
    if available_gb is not None and available_gb < needed_gb * 1.2:
      record["exact_device_qps_skipped"] = (f"needs ~{needed_gb:.1f} GB, "
                                            f"{available_gb:.1f} GB available")
      return record
    timed = [b for b in (1, 32) if b in memory]
  else:   # XLA's GEMM autotuner profiles into a second buffer of the [batch, blocks] scores
    scores_gb = lambda b: b * chunks * index_lib.CHUNK * 4 / 1e9
    timed = [b for b, gb in memory.items() if gb + scores_gb(b) < 0.9 * device_gb]
    record["device_memory_gb"] = round(device_gb, 1)
    if not timed:
      record["exact_device_qps_skipped"] = (f"needs {min(memory.values()):.1f} GB + a second "
                                            f"score buffer, the device has {device_gb:.1f} GB")
      return record
  t0 = time.perf_counter()
  exact_index = index_lib.ExactIndex.from_embeddings(np.asarray(table))
  jax.block_until_ready(exact_index.table)
  record["exact_device_load_s"] = round(time.perf_counter() - t0, 1)
  found = np.concatenate([exact_index.search(queries[i:i + timed[-1]], TOP_N)
                          for i in range(0, len(queries), timed[-1])])
  record["exact_device_recall_at_10"] = scann_index.recall_at(found, exact)
  for b in timed:
    record["exact_device_qps"][f"b{b}"] = round(queries_per_s(
        lambda q: exact_index.search(q, TOP_N), queries, b, args.qps_seconds), 1)
  print(f"[scale] exact on device: recall@{TOP_N} {record['exact_device_recall_at_10']:.4f}, "
        f"queries/s {record['exact_device_qps']}", flush=True)
  return record


def refresh_rate(args) -> dict:
  """Blocks/s needed to re-embed the corpus every refresh_every steps, and what the BERT-base
  block tower embeds here (a few batches of random 288-wordpiece blocks)."""
  from realm_jax.runtime import partitioning, state as state_lib
  from realm_jax.runtime import embedders
  config = repo_config("realm_base")
  if jax.default_backend() != "cpu":
    config.model.dtype = "bfloat16"   # as the builder runs on an accelerator
  step_s, basis = args.step_s, "given (--step_s)"
  if not step_s:
    flops = analytic_flops(config)    # batch 512, the paper's
    step_s = flops / (64 * TPU_V3_BF16_FLOPS * args.mfu)
    basis = (f"estimate: {flops / 1e15:.2f} PFLOP a step (batch 512) on 64 TPU v3 chips at "
             f"{args.mfu:.0%} of their {TPU_V3_BF16_FLOPS / 1e12:.0f} TFLOP/s bf16")
  needed = args.blocks / (args.refresh_every * step_s)
  mesh = partitioning.make_mesh(config.mesh.shape)
  model = state_lib.build_model(config, config.model.vocab_size)
  abstract, shardings = state_lib.abstract_train_state(config, model, mesh,
                                                       config.data.block_len)
  rng = np.random.default_rng(0)   # the retriever's parameters alone (not the reader's, nor
  retriever = jax.tree.map(        # the optimizer's moments: ~5 GB a device at realm_base)
      lambda a, s: jax.device_put((0.02 * rng.standard_normal(a.shape, np.float32))
                                  .astype(a.dtype), s),
      abstract.params["retriever"], shardings.params["retriever"])
  embed = embedders.block_embedder(model, mesh, config, retriever)
  batch = max(jax.device_count(), args.embed_batch // jax.device_count() * jax.device_count())
  rng = np.random.default_rng(0)
  ids = rng.integers(1, config.model.vocab_size, (batch, config.data.block_len)).astype(np.int32)
  segments = (np.arange(config.data.block_len) >= 40)[None].repeat(batch, 0).astype(np.int32)
  sharding = partitioning.batch_sharding(mesh)
  run = lambda: np.asarray(embed(jax.device_put(ids, sharding), jax.device_put(segments,
                                                                              sharding)))
  run()
  t0 = time.perf_counter()
  for _ in range(args.embed_batches):
    run()
  measured = args.embed_batches * batch / (time.perf_counter() - t0)
  return {"step_s": round(step_s, 3), "step_s_basis": basis,
          "refresh_every": args.refresh_every, "needed_blocks_per_s": round(needed),
          "measured_blocks_per_s": round(measured, 2),
          "measured_on": f"{jax.device_count()} x {jax.devices()[0].device_kind} "
                         f"({jax.default_backend()}), BERT-base block tower, "
                         f"{config.model.dtype}, batch {batch}",
          "refresh_s_at_measured": round(args.blocks / measured)}


def print_table(r: dict) -> None:
  f = r["refresh"]
  rows = [
      ("device", f"{r['devices']} x {r['device_kind']} ({r['backend']}), jax {r['jax']}"),
      ("host CPU", host_cpu_text()),
      ("table", f"{r['blocks']:,} x {r['dim']} float32 SYNTHETIC ({r['clusters']:,} clusters), "
                f"{r['table_gb']:.1f} GB"),
  ]
  if "scann" in r:
    rows += scann_rows(r)
  for key, qps in {**r["qps"], **{f"exact_device_{k}": v
                                  for k, v in r["exact_device_qps"].items()}}.items():
    rows.append((f"queries/s {key}", f"{qps:,.1f}"))
  for b in (1, r["batch"]) if "scann" in r else ():
    speedup = r["qps"][f"scann_b{b}"] / r["qps"][f"exact_numpy_b{b}"]
    rows.append((f"ScaNN / exact, batch {b}",
                 f"{speedup:.1f}x [>= 10x: {verdict(speedup >= 10)}]"))
  rows.append(("exact on-device memory", ", ".join(
      f"batch {k[1:]}: {v:.1f} GB" for k, v in r["exact_device_memory_gb"].items())))
  if "exact_device_recall_at_10" in r:
    rows.append((f"exact on-device recall@{TOP_N}", f"{r['exact_device_recall_at_10']:.4f} "
                 "vs the host's numpy search"))
  if "exact_device_qps_skipped" in r:
    rows.append(("exact on-device qps", "skipped: " + r["exact_device_qps_skipped"]))
  rows += [
      ("paper step", f"{f['step_s']} s ({f['step_s_basis']})"),
      ("refresh needs", f"{f['needed_blocks_per_s']:,} blocks/s (all blocks every "
                        f"{f['refresh_every']} steps)"),
      ("block tower here", f"{f['measured_blocks_per_s']:,} blocks/s on {f['measured_on']}: "
                           f"one refresh {f['refresh_s_at_measured'] / 3600:,.1f} h"),
  ]
  print_rows(rows)


def scann_rows(r: dict) -> list[tuple[str, str]]:
  return [
      ("ScaNN settings", ", ".join(f"{k} {v}" for k, v in r["scann"].items())),
      ("build + serialize", f"{r['build_s']:.0f} + {r['serialize_s']:.0f} s, peak RSS "
                            f"{r['build_peak_rss_gb']:.1f} GB"),
      ("index on disk / load", f"{r['index_bytes'] / 1e9:.2f} GB / {r['load_s']:.1f} s"),
      (f"recall@{TOP_N} vs exact", f"{r['recall_at_10']:.4f} on {r['queries']:,} queries "
                                   f"[>= 0.95: {verdict(r['recall_at_10'] >= 0.95)}]"),
  ]


def parse_args(argv=None) -> argparse.Namespace:
  parser = CommandParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--blocks", type=positive_int, default=13_350_000, help="rows of the table")
  parser.add_argument("--dim", type=positive_int, default=128, help="embedding size (REALM: 128)")
  parser.add_argument("--clusters", type=positive_int, default=16_384, help="mixture components")
  parser.add_argument("--seed", type=int, default=0, help="seed of the table and queries")
  parser.add_argument("--queries", type=positive_int, default=1000,
                      help="queries for recall and qps")
  parser.add_argument("--batch", type=positive_int, default=512,
                      help="the REALM batch (queries/step)")
  parser.add_argument("--qps_seconds", type=float, default=20.0, help="budget per qps figure")
  parser.add_argument("--step_s", type=float, default=0.0,
                      help="seconds per train step (0: estimated from the paper's FLOPs)")
  parser.add_argument("--mfu", type=float, default=0.4, help="MFU assumed for --step_s 0")
  parser.add_argument("--refresh_every", type=positive_int, default=500,
                      help="steps between rebuilds")
  parser.add_argument("--embed_batch", type=positive_int, default=16, help="blocks per embed batch")
  parser.add_argument("--embed_batches", type=positive_int, default=2, help="timed embed batches")
  parser.add_argument("--table_only", action="store_true",
                      help="generate (or find) the cached table and stop")
  parser.add_argument("--skip_scann", action="store_true",
                      help="leave the host-side ScaNN build, and numpy's queries/s (its "
                           "baseline), out")
  parser.add_argument("--cache", default=str(REPO / "runs/bench_index_scale"),
                      help="where the table and the index under test live")
  parser.add_argument("--out", default=str(REPO / "runs/bench_index_scale.jsonl"),
                      help="append the JSON record here ('' to skip)")
  args = parser.parse_args(argv)
  if args.queries < max(32, args.batch):   # batches of fewer queries would never be timed
    parser.error(f"--queries {args.queries} must be >= --batch ({args.batch}) and >= 32: the "
                 "queries/s figures search them in batches of 1, 32 and --batch")
  return args


def main(argv=None) -> dict:
  """Builds the synthetic table, benches exact search and ScaNN on it, prints and logs."""
  args = parse_args(argv)
  cache = pathlib.Path(args.cache)
  print(f"[scale] backend {jax.default_backend()}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}, host CPU {host_cpu_text()}; {args.blocks:,} x "
        f"{args.dim} synthetic", flush=True)
  name = f"table-{args.blocks}x{args.dim}-c{args.clusters}-s{args.seed}.npy"
  table, generate_s = synthetic_table(cache / name, args.blocks, args.dim, args.clusters,
                                      args.seed)
  if args.table_only:
    done = f"generated in {generate_s:.0f} s" if generate_s else "found in the cache"
    print(f"[scale] table {cache / name}: {done}", flush=True)
    return {}
  centers = np.random.default_rng(args.seed).normal(size=(args.clusters, args.dim))
  queries = mixture_draws(np.random.default_rng(args.seed + 1), centers.astype(np.float32),
                          args.queries)
  exact_search = lambda q: scann_index.exact_top_n(q, table, TOP_N, chunk=1 << 18)
  t0 = time.perf_counter()
  exact = exact_search(queries)
  print(f"[scale] exact top-{TOP_N} of {len(queries):,} queries in "
        f"{time.perf_counter() - t0:.0f} s", flush=True)
  record = {"bench": "index_scale", "backend": jax.default_backend(), "jax": jax.__version__,
            "device_kind": jax.devices()[0].device_kind, "devices": jax.device_count(),
            **host_cpu(),
            "blocks": args.blocks, "dim": args.dim, "clusters": args.clusters,
            "synthetic": True, "table_gb": round(table.nbytes / 1e9, 2),
            "generate_s": round(generate_s, 1), "queries": len(queries), "batch": args.batch}
  record["qps"] = {}
  if not args.skip_scann:
    record.update(bench_scann(table, queries, exact, cache, args))
  for b in (1, args.batch) if not args.skip_scann else ():   # the baseline of ScaNN's speedup
    record["qps"][f"exact_numpy_b{b}"] = round(queries_per_s(exact_search, queries, b,
                                                             args.qps_seconds), 1)
    print(f"[scale] queries/s at batch {b}: ScaNN {record['qps'].get(f'scann_b{b}', '-')}, "
          f"exact {record['qps'][f'exact_numpy_b{b}']:,}", flush=True)
  record.update(bench_exact_device(table, queries, exact, args))
  try:
    record["refresh"] = refresh_rate(args)
  except Exception as e:   # what is measured so far is kept, the failure named in it
    record["refresh_failed"] = f"{type(e).__name__}: {e}"
    append_jsonl(args.out, record)
    raise
  append_jsonl(args.out, record)   # first: the figures are kept should the table fail
  print_table(record)
  print(json.dumps(record))
  return record


if __name__ == "__main__":
  main(sys.argv[1:])

"""Throughput of the REALM train step: step time, tokens/s, FLOPs, FLOP/s and utilisation.

Three cases, each one jitted `make_train_step` on a random batch of the real shapes and dtypes
(the keys `realm_jax.train.batches.realm_batch` produces), on a mesh of the config's shape
over whatever devices exist:

  demo  configs/demo_realm.py (mode index): 2-layer d=128 shared tower and reader, batch 32, k 5
        (4 blocks read per query: no null document in training), query 16 + block 40, vocab 4000
  real  configs/real_realm.py:realm (`make demo-real`'s REALM stage): MiniLM-shaped reader
        (4 layers, d=384), 2-layer retriever, batch 32, k 5 (4 blocks read), query 64 +
        block 128, vocab 30522; its queries unpacked (random full-length queries do not pack)
  base  configs/realm_base.py: three BERT-base encoders, k 8, query 96 + block 288,
        vocab 30522; batch 1 query on CPU (8 candidates, 8 reader sequences of 382: in fp32
        the step's temporaries are ~10 GB per query), 8 on an accelerator (the paper's 512
        on 64 devices; 32.4 GB at its peak on an H100 in bf16 without remat)

It prints the host CPU (model, AVX-512 or not: XLA:CPU's figures depend on it), then for
each case the compile time, the median of `--steps` timed steps after one warm-up
step, tokens per second (reader tokens B*k*(query_len+block_len-2) plus retriever tokens
B*query_len + B*k*block_len), the FLOPs of one step from XLA's cost analysis of the compiled
program next to an analytic 3 x forward count, the achieved FLOP/s, and its ratio to a matmul
timed in the same process (2048^3 on CPU, 8192^3 on an accelerator, in the step's dtype). The
rates use XLA's count on CPU and the analytic count on an accelerator (XLA's GPU count leaves
out the GEMMs it hands to cuBLAS). On GPU/TPU the model runs in bfloat16 and the MFU against
the chip's dense bf16 peak is printed as well. `--profile DIR` traces 3 more steps per case
(jax.profiler; `python bench/trace_summary.py DIR` lists where the device time went).

Only the device step is measured: host-side batch building and the index search are not.

`--set KEY=VALUE` (repeatable) sets a config field of every case run, e.g. on a GPU
`--set model.attention=cudnn --set model.attention_dropout_rate=0` (the fused kernel; with
dropout on the attention weights they are materialised) or `--set model.remat=full`.

  python bench/train_step.py [--steps N] [--only demo|real|base] [--batch B]
      [--set KEY=VALUE ...] [--out runs/bench.jsonl]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from realm_jax.stages import repo_config
from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.train import steps
from realm_jax.errors import CommandParser, ConfigError
from realm_jax.config.reading import part_model
from realm_jax.config.overrides import apply_assignments
from realm_jax.config.validation import validate
from report import append_jsonl, host_cpu, host_cpu_text, positive_int   # bench/: sys.path[0]



# Dense bf16 peak FLOP/s per chip, matched in order against `device_kind` (first hit wins).
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("GH200", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12),
    ("V100", 125e12),
    ("TPU v6", 918e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5", 459e12),
    ("TPU v4", 275e12),
)


def case_config(case: str, accelerator: bool, batch_size: int | None, sets: list[str] = ()):
  """The config of a bench case with its bench-only overrides (vocab, batch, dtype) and the
  `--set KEY=VALUE` ones last, read as the launchers read theirs."""
  if case == "demo":
    config = repo_config("demo_realm", "realm")
    config.model.vocab_size = 4000      # the demo's vocab comes from its data dir (0)
  elif case == "real":                  # demo-real: MiniLM-shaped reader, small retriever
    config = repo_config("real_realm", "realm")
    config.retrieval.packed_query_rows = 0  # its random full-length queries do not pack
  else:
    config = repo_config("realm_base")
    config.train.batch_size = 8 if accelerator else 1  # ~10 GB of fp32 temporaries a query
  if batch_size is not None:
    config.train.batch_size = batch_size
  if accelerator:
    config.model.dtype = "bfloat16"
  try:
    apply_assignments(config, sets, "--set")   # read as the launchers read theirs
    validate(config)
  except ConfigError as e:
    raise SystemExit(f"bench: {e}") from None
  return config


def candidates_read(config) -> int:
  """Candidates a training step reads: k, or k - 1 without the null document in training."""
  from realm_jax.config.reading import null_in_training
  return config.retrieval.k - (0 if null_in_training(config) else 1)


def random_batch(config, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """A REALM batch of full-length (unpadded) sequences with one span of max_masks masks."""
  b, k, m = config.train.batch_size, candidates_read(config), config.data.max_masks
  q, lb = config.data.query_len, config.data.block_len
  vocab = config.model.vocab_size
  ids = lambda *shape: rng.integers(1, vocab, shape, dtype=np.int32)
  start = rng.integers(1, q - 1 - m, (b, 1))
  title = lb // 8  # segment 0 = [CLS] title [SEP], segment 1 = body [SEP]
  return {
      "query_ids": ids(b, q),
      "mask_positions": (start + np.arange(m)).astype(np.int32),
      "mask_labels": ids(b, m),
      "mask_weights": np.ones((b, m), np.float32),
      "candidate_ids": ids(b, k, lb),
      "candidate_segments": np.broadcast_to(np.arange(lb) >= title, (b, k, lb)).astype(np.int32),
      "reader_ids": ids(b, k, q + lb - 2),
      "reader_segments": np.broadcast_to(np.arange(q + lb - 2) >= q,
                                         (b, k, q + lb - 2)).astype(np.int32),
  }


def token_counts(config) -> dict[str, int]:
  b, k = config.train.batch_size, candidates_read(config)
  q, lb = config.data.query_len, config.data.block_len
  reader = b * k * (q + lb - 2)
  retriever = b * q + b * k * lb
  return {"reader_tokens": reader, "retriever_tokens": retriever, "tokens": reader + retriever}


def encoder_flops(d: int, ff: int, num_layers: int, sequences: int, length: int,
                  outputs: int) -> float:
  """Forward matmul FLOPs of a BERT encoder (hidden d, feed-forward ff) over `sequences` of
  `length`: projections, feed-forward and attention at every position, except the last
  layer, which gives keys and values at every position and computes the rest at the
  `outputs` positions read (`BertEncoder(positions=...)`; `outputs=length`: all of them)."""
  layer = lambda rows: 2 * rows * (2 * d * d + 2 * d * ff) + 4 * rows * length * d
  kv = 2 * length * 2 * d * d
  return sequences * ((num_layers - 1) * (layer(length) + kv) + layer(outputs) + kv)


def tower_flops(config, length: int) -> float:
  """Forward matmul FLOPs of a retriever tower (`realm.Embedder`, at the retriever's own shape)
  on one sequence of `length`: the encoder, whose last layer computes [CLS] alone where the
  tower reads it through BERT's pooler (`model.retriever.pooling` cls) and every position
  where it mean-pools them (no pooler then), and the projection to retrieval_dim."""
  mc = part_model(config, "retriever")
  mean = config.model.retriever.get("pooling", "cls") == "mean"
  r = mc.hidden_size
  encoder = encoder_flops(r, mc.intermediate_size, mc.num_layers, 1, length,
                          length if mean else 1)
  return encoder + 2 * (0 if mean else r * r) + 2 * r * config.model.retrieval_dim


def analytic_flops(config) -> float:
  """The forward matmul FLOPs of the three encoders and heads, x 3 where they are trained
  (backward = 2 x forward; a frozen part, `train.*_lr_scale` 0, runs forward only),
  each tower at its own shape (`reading.part_model`: the retriever may differ)."""
  reader = part_model(config, "reader")
  v = config.model.vocab_size
  b, k, m = config.train.batch_size, candidates_read(config), config.data.max_masks
  q, lb = config.data.query_len, config.data.block_len
  d = reader.hidden_size
  retrieval = b * tower_flops(config, q) + b * k * tower_flops(config, lb)
  reading = encoder_flops(d, reader.intermediate_size, reader.num_layers, b * k, q + lb - 2,
                          m)                                                 # the masks
  reading += b * k * m * 2 * (d * d + d * v)                    # MLM head at the masks
  # a frozen part has no backward: the retriever's gradient needs p(y|z,x), not its gradient
  reader_backward = 2.0 if config.train.reader_lr_scale else 0.0
  retriever_backward = 2.0 if config.train.retriever_lr_scale else 0.0
  return (1 + retriever_backward) * retrieval + (1 + reader_backward) * reading


def xla_flops(compiled) -> float:
  """FLOPs of the compiled (per-device) program; cost_analysis() is a dict or a list of them."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  if not cost or "flops" not in cost:
    return float("nan")
  return float(cost["flops"])


def matmul_size() -> int:
  """The reference matmul's size: one that fills the device (a CPU is filled by 2048^3)."""
  return 2048 if jax.default_backend() == "cpu" else 8192


def matmul_flops_per_s(dtype, n: int = 2048, reps: int = 5) -> float:
  """FLOP/s of a jitted n x n @ n x n matmul on the default device (median of `reps`)."""
  key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(key_a, (n, n), dtype)
  b = jax.random.normal(key_b, (n, n), dtype)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2.0 * n**3 / statistics.median(times)


def memory_gb(compiled) -> dict[str, float]:
  """Argument (state + batch) and temporary buffer sizes of the compiled step, in GB."""
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  return {"argument_gb": stats.argument_size_in_bytes / 1e9,
          "temp_gb": stats.temp_size_in_bytes / 1e9}


def host_available_gb() -> float | None:
  try:
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024 / 1e9
  except (OSError, KeyError, ValueError):
    return None


def peak_bf16_flops(device) -> float | None:
  kind = getattr(device, "device_kind", "")
  for name, peak in PEAK_BF16_FLOPS:
    if name.lower() in kind.lower():
      return peak
  return None


def bench_case(case: str, config, num_steps: int, matmul: dict[str, float],
               profile: str = "") -> dict:
  """Builds the state, compiles the step, times it; returns the JSON record of the case."""
  name = {"demo": "demo_realm", "real": "real_realm", "base": "realm_base"}[case]
  log = lambda msg: print(f"[bench] {name}: {msg}", flush=True)
  mesh = partitioning.make_mesh(config.mesh.shape)
  if config.train.batch_size % mesh.shape["data"]:
    raise SystemExit(f"bench: batch {config.train.batch_size} is not divisible by the data "
                     f"axis ({mesh.shape['data']} devices); pass --batch")
  model = state_lib.build_model(config, config.model.vocab_size)
  rng = jax.random.PRNGKey(config.seed)
  log("creating the train state (host-side random parameters)")
  t0 = time.perf_counter()
  abstract, shardings = state_lib.abstract_train_state(config, model, mesh,
                                                       config.data.block_len, rng)
  state = random_state(abstract, shardings)
  jax.block_until_ready(state)
  n_params = state_lib.count_params(state.params)
  log(f"{n_params / 1e6:.1f}M params in {time.perf_counter() - t0:.1f}s; compiling the step")
  train_step = steps.make_train_step(config, model, shardings, mesh)
  batch = partitioning.global_batch(random_batch(config, np.random.default_rng(0)), mesh)
  t0 = time.perf_counter()
  with partitioning.mesh_rules(mesh, partitioning.logical_rules(config.mesh.rules)):
    compiled = train_step.jitted.lower(state, batch, rng).compile()
  compile_s = time.perf_counter() - t0
  memory = memory_gb(compiled)
  log(f"compiled in {compile_s:.1f}s; " + ", ".join(f"{k[:-3]} {v:.2f} GB"
                                                    for k, v in memory.items()))
  available = host_available_gb() if jax.default_backend() == "cpu" else None
  if memory and available is not None and memory["temp_gb"] > available:
    # Fail with a message rather than be killed by the OOM killer mid-step.
    raise SystemExit(f"bench: {name} needs {memory['temp_gb']:.1f} GB of temporaries, only "
                     f"{available:.1f} GB of host memory are available; pass a smaller --batch")
  times = timed_steps(compiled, state, batch, rng, num_steps, profile, log)
  return case_record(name, config, mesh, compiled, n_params, compile_s, memory, times, matmul)


def timed_steps(compiled, state, batch, rng, num_steps: int, profile: str, log) -> list[float]:
  """Seconds of each of `num_steps` steps after one warm-up (then 3 traced into `profile`)."""
  log(f"1 warm-up + {num_steps} timed steps" + (f" + 3 traced into {profile}" if profile else ""))
  times = []
  for i in range(num_steps + 1):
    t0 = time.perf_counter()
    state, metrics = compiled(state, batch, rng)
    jax.block_until_ready((state, metrics))
    if i:  # step 0 is the warm-up
      times.append(time.perf_counter() - t0)
      log(f"step {i}/{num_steps} {times[-1]:.3f}s loss {float(metrics['loss']):.3f}")
  if profile:   # after the timed steps: tracing slows the host side
    with jax.profiler.trace(profile):
      for _ in range(3):
        state, metrics = compiled(state, batch, rng)
      jax.block_until_ready((state, metrics))
  return times


def case_record(name: str, config, mesh, compiled, n_params: int, compile_s: float,
                memory: dict, times: list[float], matmul: dict[str, float]) -> dict:
  """The JSON record of a case: shapes, compile time, memory, step time, rates, MFU."""
  step_s = statistics.median(times)
  devices = mesh.devices.size
  device = mesh.devices.flat[0]
  flops_device = xla_flops(compiled)
  flops = flops_device * devices        # an SPMD program's cost is that of one device
  tokens = token_counts(config)
  compute_dtype = config.model.dtype
  matmul_ref = matmul["bfloat16" if compute_dtype == "bfloat16" else "float32"]
  rate_flops = step_flops_device(flops_device, config, devices)
  record = {
      "bench": "train_step", "config": name, "backend": jax.default_backend(),
      "device_kind": device.device_kind, "devices": devices, **host_cpu(),
      "mesh": dict(mesh.shape), "dtype": compute_dtype, "params": n_params,
      "attention": attention_used(config), "remat": config.model.remat,
      "attention_dropout": config.model.attention_dropout_rate,
      "batch": config.train.batch_size, "k": config.retrieval.k,
      "query_len": config.data.query_len, "block_len": config.data.block_len,
      "vocab_size": config.model.vocab_size, "layers": config.model.num_layers,
      "hidden": config.model.hidden_size,
      "retriever_layers": part_model(config, "retriever").num_layers,
      "retriever_hidden": part_model(config, "retriever").hidden_size,
      "compile_s": round(compile_s, 2),
      **{k: round(v, 3) for k, v in memory.items()},
      "step_s": step_s, "step_s_all": [round(t, 4) for t in times],
      **tokens, "tokens_per_s": tokens["tokens"] / step_s,
      "queries_per_s": config.train.batch_size / step_s,
      "xla_flops": flops, "analytic_flops": analytic_flops(config),
      "flops_per_s": rate_flops * devices / step_s, "flops_per_s_per_device": rate_flops / step_s,
      "matmul_dtype": compute_dtype, "matmul_flops_per_s": matmul_ref,
      # the matmul runs on one device: on an accelerator a device of its own, on XLA:CPU every
      # core (host devices share them), so there the step's rate is all devices' together
      "ratio_to_matmul": rate_flops * (devices if jax.default_backend() == "cpu" else 1)
                         / step_s / matmul_ref,
  }
  stats = device.memory_stats() if jax.default_backend() != "cpu" else None
  if stats and "peak_bytes_in_use" in stats:   # what the allocator really held at its peak
    record["device_peak_gb"] = round(stats["peak_bytes_in_use"] / 1e9, 2)
  peak = peak_bf16_flops(device) if jax.default_backend() != "cpu" else None
  if peak:
    record.update(peak_bf16_flops=peak,
                  mfu=rate_flops / step_s / peak)
  return record


def step_flops_device(xla_flops_device: float, config, devices: int) -> float:
  """One device's FLOPs a step for the rates: XLA's count on CPU; on an accelerator the model's
  (3 x forward), since XLA's GPU count leaves out the GEMMs it hands to cuBLAS (custom calls)."""
  if jax.default_backend() == "cpu":
    return xla_flops_device
  return analytic_flops(config) / devices


def attention_used(config) -> str:
  """The attention the step ran: `model.attention`, or "xla" where cuDNN's is not available."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # the model warned once already when it was built
    return state_lib.attention_here(config)


def random_state(abstract, shardings, seed: int = 0):
  """A train state of `abstract`'s shapes: parameters N(0, 0.02^2) drawn on the host, every
  other leaf (optimizer moments, step) zero; placed with `shardings`. The step's speed does not
  depend on the values (not zeros: they can run faster), and this skips compiling the
  initialisers of a BERT-base x 3 model (minutes on a GPU)."""
  rng = np.random.default_rng(seed)

  def place(leaf, sharding, draw):
    if draw and np.issubdtype(leaf.dtype, np.floating):
      value = (0.02 * rng.standard_normal(leaf.shape, np.float32)).astype(leaf.dtype)
    else:
      value = np.zeros(leaf.shape, leaf.dtype)
    return jax.device_put(value, sharding)

  state = jax.tree.map(lambda a, s: place(a, s, False), abstract, shardings)
  return state.replace(params=jax.tree.map(lambda a, s: place(a, s, True), abstract.params,
                                           shardings.params))


def _si(x: float, unit: str = "") -> str:
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}".rstrip()


def print_table(records: list[dict], matmul: dict[str, float]) -> None:
  rows = [
      ("device", lambda r: f"{r['devices']} x {r['device_kind']} ({r['backend']})"),
      ("dtype", lambda r: r["dtype"]),
      ("attention / remat", lambda r: f"{r.get('attention', 'xla')} / {r.get('remat', 'none')}"),
      ("params", lambda r: f"{r['params'] / 1e6:.1f}M"),
      ("layers x hidden", lambda r: f"{r['layers']} x {r['hidden']}"),
      ("batch x k", lambda r: f"{r['batch']} x {r['k']}"),
      ("query + block", lambda r: f"{r['query_len']} + {r['block_len']}"),
      ("vocab", lambda r: str(r["vocab_size"])),
      ("compile", lambda r: f"{r['compile_s']:.1f} s"),
      ("state / temporaries", lambda r: f"{r.get('argument_gb', float('nan')):.2f} / "
                                        f"{r.get('temp_gb', float('nan')):.2f} GB"),
      ("step (median)", lambda r: f"{r['step_s'] * 1e3:.1f} ms"),
      ("queries/s", lambda r: f"{r['queries_per_s']:.3g}"),
      ("reader tokens/step", lambda r: str(r["reader_tokens"])),
      ("retriever tokens/step", lambda r: str(r["retriever_tokens"])),
      ("tokens/s", lambda r: _si(r["tokens_per_s"])),
      ("FLOPs/step (XLA)", lambda r: _si(r["xla_flops"])),
      ("FLOPs/step (3 x fwd)", lambda r: _si(r["analytic_flops"])),
      ("achieved FLOP/s", lambda r: _si(r["flops_per_s"])),
      ("matmul FLOP/s", lambda r: f"{_si(r['matmul_flops_per_s'])} ({r['matmul_dtype']})"),
      ("step / matmul", lambda r: f"{r['ratio_to_matmul']:.1%}"),
  ]
  if any("device_peak_gb" in r for r in records):
    rows.append(("device peak (process)", lambda r: f"{r['device_peak_gb']:.1f} GB"
                 if "device_peak_gb" in r else "-"))
  if any("mfu" in r for r in records):
    rows.append(("bf16 MFU", lambda r: f"{r['mfu']:.1%} of "
                 f"{_si(r['peak_bf16_flops'])}" if "mfu" in r else "-"))
  width = max(len(name) for name, _ in rows)
  cells = [[fmt(r) for r in records] for _, fmt in rows]
  col = [max(len(r["config"]), *(len(c[i]) for c in cells)) for i, r in enumerate(records)]
  print()
  print(" | ".join([" " * width] + [r["config"].ljust(w) for r, w in zip(records, col)]))
  print("-+-".join(["-" * width] + ["-" * w for w in col]))
  for (name, _), row in zip(rows, cells):
    print(" | ".join([name.ljust(width)] + [c.ljust(w) for c, w in zip(row, col)]))
  shown = ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in matmul.items())
  print(f"\n{matmul_size()}^3 matmul: {shown}; host CPU {host_cpu_text()}")


def main(argv=None) -> None:
  parser = CommandParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=positive_int, default=None,
                      help="timed steps per case, >= 1 (default: demo 10, real 5, base 3)")
  parser.add_argument("--only", choices=("demo", "real", "base"), default=None,
                      help="run one case only")
  parser.add_argument("--batch", type=positive_int, default=None,
                      help="override the batch (queries, >= 1) of every case run")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="set a config field of every case (repeatable)")
  parser.add_argument("--profile", default="", metavar="DIR",
                      help="trace 3 more steps of each case into DIR (jax.profiler)")
  parser.add_argument("--out", default=None, help="append one JSON line per case here")
  args = parser.parse_args(argv)

  accelerator = jax.default_backend() != "cpu"
  print(f"[bench] backend {jax.default_backend()}, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}; host CPU {host_cpu_text()}",
        flush=True)
  cases = [args.only] if args.only else ["demo", "real", "base"]
  configs = {case: case_config(case, accelerator, args.batch, args.set) for case in cases}
  n = matmul_size()
  matmul = {"float32": matmul_flops_per_s(jnp.float32, n)}
  if any(c.model.dtype == "bfloat16" for c in configs.values()):
    matmul["bfloat16"] = matmul_flops_per_s(jnp.bfloat16, n)
  records = []
  for case, config in configs.items():
    num_steps = args.steps if args.steps is not None else {"demo": 10, "real": 5}.get(case, 3)
    record = bench_case(case, config, num_steps, matmul,
                        os.path.join(args.profile, case) if args.profile else "")
    records.append(record)
    print(json.dumps(record), flush=True)
    append_jsonl(args.out, record)
  print_table(records, matmul)


if __name__ == "__main__":
  main(sys.argv[1:])

"""Per-device peak memory of the compiled train step at the paper's scale, fp32 / bf16 x remat.

For `realm_base` (three BERT-base encoders, k 8, query 96 + block 288) and `ict_base` (two
BERT-base towers, query 64 + block 288) at one device's share of the paper's batch (REALM:
512 queries on 64 TPUs = 8 per device; ICT: 4,096 / 64 = 64), the train step of
`steps.make_train_step` is lowered on abstract inputs (`state.abstract_train_state`: nothing is
allocated) and compiled on one device of this backend. Two figures per case:

  XLA peak   arguments (train state + batch) + outputs - aliased (the donated state) +
             temporaries, from XLA's memory analysis of the compiled program on this backend;
  estimate   arguments + outputs - aliased + the activations saved for the backward pass
             (JAX's own residual accounting of the loss, which `model.remat` decides and no
             backend changes) + the gradients and the optimizer's update (2 x the parameters'
             float32 bytes) + with remat, the activations of the layer being recomputed (one
             layer of every tower together, residuals without remat / layers: an upper bound,
             the backward recomputes one tower's layer at a time). This is what a
             memory-aware scheduler needs.

On CPU the XLA peak is far above the estimate and remat hardly moves it: XLA's CPU scheduler
is not memory-aware (it runs the recomputation right after the forward pass, so the program
keeps every activation anyway; only across a loop boundary, e.g. layers under `lax.scan`, is
it ordered late), and CPU has no native bfloat16 matmul, so bf16 programs keep float32 copies.
GPU and TPU compilers schedule for memory; run the script there for their own peak. The
`fits` columns use the estimate on CPU and XLA's own peak on an accelerator. ICT's in-batch
softmax over the global batch adds an all-gather of 4,096 x 128 embeddings, not counted.

  python bench/memory.py [--only realm_base|ict_base] [--dtype float32 bfloat16]
      [--remat none full matmuls] [--out runs/memory.jsonl]
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
from jax._src.ad_checkpoint import saved_residuals   # (aval, source) of each saved residual

from realm_jax.stages import repo_config
from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.train import steps
from realm_jax.config.validation import validate
from realm_jax.errors import CommandParser
from report import append_jsonl   # bench/ is this script's directory: sys.path[0]

PAPER_DEVICES = 64          # REALM and ORQA trained on 64 TPUs
DEVICE_GB = (16, 32, 80)    # device memories to check the peak against


def case_config(name: str, dtype: str, remat: str):
  """`configs/<name>.py` at one device's share of its batch, in `dtype`, with `remat`."""
  config = repo_config(name)
  config.train.batch_size //= PAPER_DEVICES
  config.model.dtype = dtype
  config.model.remat = remat
  config.mesh.shape = [1, 1]
  validate(config)
  return config


def abstract_batch(config) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes and dtypes of a training batch of `config.task` (ICT or REALM)."""
  b, k, m = config.train.batch_size, config.retrieval.k, config.data.max_masks
  q, lb = config.data.query_len, config.data.block_len
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
  if config.task == "ict":
    return {"query_ids": i32(b, q), "block_ids": i32(b, lb), "block_segments": i32(b, lb)}
  return {"query_ids": i32(b, q), "mask_positions": i32(b, m), "mask_labels": i32(b, m),
          "mask_weights": jax.ShapeDtypeStruct((b, m), np.float32),
          "candidate_ids": i32(b, k, lb), "candidate_segments": i32(b, k, lb),
          "reader_ids": i32(b, k, q + lb - 2), "reader_segments": i32(b, k, q + lb - 2)}


def residual_bytes(config, model, abstract_state, batch) -> int:
  """Bytes of the activations the loss saves for its backward pass (inputs excluded)."""
  loss_fn = steps.LOSS_FNS[config.task]
  rng = jax.random.PRNGKey(0)
  saved = saved_residuals(lambda p, b: loss_fn(p, model, b, config, rng)[0],
                          abstract_state.params, batch)
  return sum(aval.size * aval.dtype.itemsize for aval, source in saved
             if "from the argument" not in source)


def measure(name: str, dtype: str, remat: str) -> dict:
  """Compiles the step of one case; returns its memory record (GB)."""
  config = case_config(name, dtype, remat)
  mesh = partitioning.make_mesh((1, 1), jax.devices()[:1])
  model = state_lib.build_model(config, config.model.vocab_size)
  abstract_state, shardings = state_lib.abstract_train_state(
      config, model, mesh, config.data.block_len)
  batch = abstract_batch(config)
  rng = jax.ShapeDtypeStruct((2,), np.uint32)
  train_step = steps.make_train_step(config, model, shardings, mesh)
  t0 = time.perf_counter()
  with partitioning.mesh_rules(mesh, partitioning.logical_rules(config.mesh.rules)):
    compiled = train_step.jitted.lower(abstract_state, batch, rng).compile()
    compile_s = time.perf_counter() - t0   # (the residual traces below are not the compile)
    residuals = residual_bytes(config, model, abstract_state, batch)
    plain = case_config(name, dtype, "none")
    one_layer = (residual_bytes(plain, state_lib.build_model(plain, plain.model.vocab_size),
                                abstract_state, batch) / config.model.num_layers
                 if remat != "none" else 0)
  stats = compiled.memory_analysis()
  sizes = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
           "alias": stats.alias_size_in_bytes, "temp": stats.temp_size_in_bytes}
  held = sizes["argument"] + sizes["output"] - sizes["alias"]
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_state.params))
  estimate = held + residuals + 2 * param_bytes + one_layer
  peak = held + sizes["temp"]
  on_cpu = jax.default_backend() == "cpu"
  basis = estimate if on_cpu else peak    # an accelerator's compiler schedules for memory
  return {"bench": "memory", "config": name, "backend": jax.default_backend(),
          "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
          "dtype": dtype, "remat": remat, "batch_per_device": config.train.batch_size,
          "k": config.retrieval.k if config.task == "realm" else None,
          "params": state_lib.count_params(abstract_state.params),
          "compile_s": round(compile_s, 1),
          **{f"{key}_gb": round(value / 1e9, 3) for key, value in sizes.items()},
          "residual_gb": round(residuals / 1e9, 3),
          "xla_peak_gb": round(peak / 1e9, 3),
          "estimate_gb": round(estimate / 1e9, 3),
          "fits_basis": "estimate" if on_cpu else "xla_peak",
          "fits_gb": [gb for gb in DEVICE_GB if basis <= gb * 1e9]}


def print_table(records: list[dict]) -> None:
  basis = records[0]["fits_basis"].replace("xla_peak", "XLA peak") if records else ""
  head = (f"{'config':<11} {'dtype':<9} {'remat':<8} {'batch':>5} {'state+batch':>11} "
          f"{'saved act.':>10} {'XLA peak':>9} {'estimate':>9}  fits ({basis}) "
          + " / ".join(f"{g} GB" for g in DEVICE_GB))
  print("\n" + head + "\n" + "-" * len(head))
  gb = lambda x: f"{x:.1f} GB"
  for r in records:
    fits = " / ".join("yes" if g in r["fits_gb"] else "no" for g in DEVICE_GB)
    print(f"{r['config']:<11} {r['dtype']:<9} {r['remat']:<8} {r['batch_per_device']:>5} "
          f"{gb(r['argument_gb']):>11} {gb(r['residual_gb']):>10} {gb(r['xla_peak_gb']):>9} "
          f"{gb(r['estimate_gb']):>9}  {fits}")


def main(argv=None) -> None:
  parser = CommandParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", choices=("realm_base", "ict_base"), default=None)
  parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                      choices=("float32", "bfloat16"))
  parser.add_argument("--remat", nargs="+", default=["none", "full", "matmuls"],
                      choices=("none", "full", "matmuls"))
  parser.add_argument("--out", default=None, help="append one JSON line per case here")
  args = parser.parse_args(argv)
  print(f"[memory] backend {jax.default_backend()}, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}", flush=True)
  names = [args.only] if args.only else ["realm_base", "ict_base"]
  cases = [(n, d, r) for n in names for d in args.dtype for r in args.remat]
  records = []
  for i, (name, dtype, remat) in enumerate(cases, 1):
    print(f"[memory] {i}/{len(cases)} {name} {dtype} remat={remat}: compiling", flush=True)
    record = measure(name, dtype, remat)
    print(f"[memory] {i}/{len(cases)} XLA peak {record['xla_peak_gb']:.2f} GB, saved "
          f"activations {record['residual_gb']:.2f} GB, estimate {record['estimate_gb']:.2f} "
          f"GB; compiled in {record['compile_s']:.0f} s", flush=True)
    records.append(record)
    append_jsonl(args.out, record)
  print_table(records)


if __name__ == "__main__":
  main(sys.argv[1:])

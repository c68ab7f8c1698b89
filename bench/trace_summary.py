"""Where a traced step's device time went: the kernels of a `jax.profiler` trace, summed by name.

Reads the newest `*.xplane.pb` under DIR (what `bench/train_step.py --profile DIR` writes) and
prints, for each accelerator plane (`/device:GPU:0`, ...), the busy time of its kernel lines,
the kernels grouped into kinds (GEMM, attention, fusion, copies, RNG, ...) and the `--top` kernels
by total time; the busy time per step assumes the trace holds `--steps` steps. On a CPU trace
(no device plane) it says so: XLA's CPU ops run on host threads.

  python bench/trace_summary.py DIR [--steps 3] [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

from jax.profiler import ProfileData

from report import positive_int   # bench/ is this script's directory: sys.path[0]

# (kind, pattern on the lower-cased kernel name); the first match wins.
KINDS = (
    ("attention (cuDNN)", r"cudnn|flash|fmha|sdpa"),
    ("scatter (lookup gradients)", r"scatter"),
    ("GEMM (cuBLAS, Triton)", r"nvjet|gemm|cublas|cutlass|xmma|matmul"),
    ("RNG", r"threefry|philox|rng|random"),
    ("copy / transpose", r"copy|transpose|memcpy|memset"),
    ("reduction", r"reduce|reduction"),
    ("loop / input fusion", r"fusion|loop_|input_"),
)


def kind_of(name: str) -> str:
  lowered = name.lower()
  for kind, pattern in KINDS:
    if re.search(pattern, lowered):
      return kind
  return "other"


def newest_trace(directory: pathlib.Path) -> pathlib.Path:
  traces = sorted(directory.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
  if not traces:
    raise SystemExit(f"trace_summary: no *.xplane.pb under {directory}")
  return traces[-1]


def summarise(path: pathlib.Path, steps: int, top: int) -> int:
  data = ProfileData.from_file(str(path))
  devices = [p for p in data.planes if p.name.startswith("/device:")]
  print(f"{path}")
  if not devices:
    print("no device plane: a CPU trace (XLA's CPU ops run on host threads; open it in a "
          "trace viewer instead)")
    return 1
  for plane in devices:
    by_name = collections.Counter()
    count = collections.Counter()
    for line in plane.lines:
      if "stream" not in line.name.lower():
        continue   # stream lines only (XLA's op and module lines nest the same kernels)
      for event in line.events:
        by_name[event.name] += event.duration_ns
        count[event.name] += 1
    busy = sum(by_name.values())
    if not busy:
      print(f"{plane.name}: no kernel events; its lines: "
            + ", ".join(f"{line.name} ({sum(1 for _ in line.events)})" for line in plane.lines))
      continue
    print(f"\n{plane.name}: kernels busy (summed over streams) {busy / 1e6:.1f} ms in {steps} "
          f"steps ({busy / 1e6 / steps:.1f} ms a step), {sum(count.values()):,} launches")
    kinds = collections.Counter()
    for name, ns in by_name.items():
      kinds[kind_of(name)] += ns
    for kind, ns in kinds.most_common():
      print(f"  {kind:<28} {ns / 1e6 / steps:8.2f} ms a step  {ns / busy:6.1%}")
    print(f"\n  top {top} kernels (ms a step, share, launches a step)")
    for name, ns in by_name.most_common(top):
      print(f"  {ns / 1e6 / steps:8.2f} {ns / busy:6.1%} {count[name] / steps:6.0f}  "
            f"{name[:110]}")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("dir", help="the --profile DIR of bench/train_step.py (or any trace dir)")
  parser.add_argument("--steps", type=positive_int, default=3,
                      help="steps the trace holds (>= 1)")
  parser.add_argument("--top", type=positive_int, default=15, help="kernels to list (>= 1)")
  args = parser.parse_args(argv)
  return summarise(newest_trace(pathlib.Path(args.dir)), args.steps, args.top)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

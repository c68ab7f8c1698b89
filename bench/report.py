"""What the bench scripts share: a `name | value` table on stdout, one JSON line per record
appended to an `--out` file, the host CPU they ran on, and a count option's argparse type."""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform


def print_rows(rows: list[tuple[str, str]]) -> None:
  """`name | value` lines, the names padded to one width, after a blank line."""
  width = max(len(name) for name, _ in rows)
  print()
  for name, value in rows:
    print(f"{name.ljust(width)} | {value}")


def verdict(good: bool) -> str:
  """How a table row marks a target: "ok", or "MISSED"."""
  return "ok" if good else "MISSED"


def append_jsonl(path: str, record: dict) -> None:
  """Appends `record` as one JSON line to `path` (its directory made); '' or None: nothing."""
  if not path:
    return
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def positive_int(text: str) -> int:
  """argparse type of a count (steps, batches, queries): an int >= 1. Zero or less would leave
  nothing to time (a median of no steps, a rate over none) after the expensive compile."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} is not >= 1")
  return value


@functools.lru_cache(maxsize=None)
def host_cpu(cpuinfo: str = "/proc/cpuinfo") -> dict:
  """The host CPU: {"cpu_model": /proc/cpuinfo's model name (the machine's architecture where
  there is none), "avx512": whether it has AVX-512 (the `avx512f` flag; None where unknown)}.
  XLA:CPU's figures differ by CPU, AVX-512 Xeon against AVX2-only EPYC above all, so a record
  of host figures names it."""
  model, flags = None, None
  try:
    with open(cpuinfo) as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
          model = " ".join(value.split())
        elif key == "flags" and flags is None:
          flags = value.split()
        if model is not None and flags is not None:
          break
  except OSError:
    pass
  return {"cpu_model": model or platform.machine() or "unknown",
          "avx512": None if flags is None else "avx512f" in flags}


def host_cpu_text() -> str:
  """host_cpu() in words, e.g. "Intel(R) Xeon(R) ... (AVX-512)"."""
  cpu = host_cpu()
  avx = {True: "AVX-512", False: "no AVX-512", None: "AVX-512 unknown"}[cpu["avx512"]]
  return f"{cpu['cpu_model']} ({avx})"

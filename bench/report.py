"""What the bench scripts do with their figures: a `name | value` table on stdout and one JSON
line per record appended to an `--out` file."""

from __future__ import annotations

import json
import pathlib


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

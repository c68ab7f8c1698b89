"""The config reference (docs/config_reference.md), generated from `defaults.base_config`,
whose one comment per field is the documentation:

  python -m realm_jax.config.reference > docs/config_reference.md

`tests/test_base_configs.py` checks that the page matches the code.
"""

from __future__ import annotations

import inspect
import re

from realm_jax.config import defaults, reading
from realm_jax.config.option_names import RENAMED_OPTIONS

_FIELD = re.compile(r"^  c\.([\w.]+) = (.*?)(?:\s+#\s?(.*))?$")
_MORE = re.compile(r"^\s{20,}#\s?(.*)$")


def fields() -> list[tuple[str, str, str]]:
  """(dotted name, default, comment) of every field `base_config` sets."""
  values = reading.flat_options(defaults.base_config())
  rows: list[list[str]] = []
  current = None
  for line in inspect.getsource(defaults).splitlines():   # base_config and its sections
    field = _FIELD.match(line)
    if field and "ConfigDict()" not in field.group(2):
      current = [field.group(1), field.group(2).strip(), (field.group(3) or "").strip()]
      rows.append(current)
    elif _MORE.match(line) and current is not None:
      current[2] = f"{current[2]} {_MORE.match(line).group(1).strip()}".strip()
    elif field:
      current = None
  return [(name, repr(_plain(values[name])), comment) for name, _, comment in rows]


def _plain(value):
  return tuple(map(_plain, value)) if isinstance(value, (list, tuple)) else value


def markdown() -> str:
  lines = ["# Config reference", "",
           "Every training option, its default and what it does, as `realm_jax/config/"
           "defaults.py` defines them (generated: `python -m "
           "realm_jax.config.reference > docs/config_reference.md`). `realm-prepare`'s "
           "own options are in `realm_jax/data/prepare.py`; configs, per-part initialisation "
           "and sharding: docs/configs.md. Renamed options (the old name is still read, with a "
           "warning): " + ", ".join(f"`{old}` -> `{new}`" for old, new in
                                      RENAMED_OPTIONS.items()) + ".", ""]
  group = None
  for name, default, comment in fields():
    head = name.split(".")[0] if "." in name else "(top level)"
    if head != group:
      group = head
      lines += ["", f"## {group}", "", "| option | default | what |", "|---|---|---|"]
    default = default.replace("|", "\\|")
    lines.append(f"| `{name}` | `{default}` | {comment.replace('|', chr(92) + '|')} |")
  return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


if __name__ == "__main__":
  print(markdown(), end="")

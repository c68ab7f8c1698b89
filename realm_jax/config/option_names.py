"""Options renamed since they were first released, and the reading of old names and values.

A saved `W/config.json`, a config file that sets a renamed leaf (`c.retrieval.mode = ...`) and a
`--config.*` flag keep working under the old name: the value moves to the new name and a
`RenamedOptionWarning` names it. A config file must spell a renamed group the new way
(`c.builder.keep_versions`, not `c.index.keep_versions`): the old group no longer exists to be
assigned into. A saved config also reads the values that once meant "the same as the reader's"
in `model.retriever.*` (0, -1.0, "") as that meaning's spelling now, None.
"""

from __future__ import annotations

import sys
import warnings

from realm_jax.config.defaults import OLD_SAME_AS_READER, TOWER_FIELDS
from realm_jax.config.reading import option_parent

# old dotted name -> new
RENAMED_OPTIONS = {
    "retrieval.mode": "retrieval.candidates",       # where a step's candidates come from
    "retrieval.first_index_timeout": "retrieval.index_timeout",   # bounds every wait
    "index": "builder",                             # the index-builder job's settings
}


class RenamedOptionWarning(UserWarning):
  """An option was given under its old name."""


_FORMAT_WARNING = warnings.formatwarning


def _format_warning(message, category, filename, lineno, line=None) -> str:
  """A renamed option's warning as one line, `warning: ...` (Python's own format adds the
  file and line of this module and its source line, which say nothing to a user)."""
  if issubclass(category, RenamedOptionWarning):
    return f"warning: {message}\n"
  return _FORMAT_WARNING(message, category, filename, lineno, line)


def one_line_warnings() -> None:
  """A command-line program's renamed-option warnings as one line each (`upgrade_flags`
  installs it: the CLIs and launchers, not a library importing this module)."""
  warnings.formatwarning = _format_warning


def new_name(name: str) -> str | None:
  """The current name of dotted option `name` (maybe inside a renamed group); None when it was
  not renamed."""
  for old, new in RENAMED_OPTIONS.items():
    if name == old or name.startswith(old + "."):
      return new + name[len(old):]
  return None


def _warn(old: str, new: str, where: str) -> None:
  warnings.warn(f"{where}config.{old} is now config.{new}; read as config.{new}",
                RenamedOptionWarning, stacklevel=3)


def upgrade_record(record: dict, where: str = "") -> dict:
  """A saved config (the JSON of `W/config.json`) with old names moved to the new ones and
  the retriever's old "same as the reader's" values as None."""
  out = _same_as_reader_unset(record)
  for old, new in RENAMED_OPTIONS.items():
    parent, old_leaf = option_parent(out, old)
    if parent is None or old_leaf not in parent:
      continue
    _warn(old, new, where)
    parent = _copy_path(out, old.split(".")[:-1])
    value = parent.pop(old_leaf)
    *new_parents, new_leaf = new.split(".")
    target = _copy_path(out, new_parents, create=True)
    if isinstance(value, dict) and isinstance(target.get(new_leaf), dict):
      target[new_leaf] = {**target[new_leaf], **value}
    else:
      target[new_leaf] = value
  return out


def _old_same_as_reader(field: str, value) -> bool:
  """Whether `model.retriever.<field>` = `value` is the old spelling of "the reader's"."""
  old = OLD_SAME_AS_READER.get(field, 0)
  return field in TOWER_FIELDS and type(value) is type(old) and value == old


def _same_as_reader_unset(record: dict) -> dict:
  own = (record.get("model") or {}).get("retriever")
  if not isinstance(own, dict):
    return dict(record)
  own = {f: None if _old_same_as_reader(f, v) else v for f, v in own.items()}
  return {**record, "model": {**record["model"], "retriever": own}}


def _copy_path(root: dict, keys: list[str], create: bool = False) -> dict:
  """The dict at `keys` under `root`, each level copied so that the caller's stays as it was."""
  node = root
  for key in keys:
    child = node.get(key)
    if child is None and create:
      child = {}
    node[key] = dict(child)
    node = node[key]
  return node


def upgrade_config(config) -> None:
  """Moves options a ConfigDict sets under an old leaf name to the new one, and reads the
  retriever's old "same as the reader's" values as unset (in place, each with a warning).

  A config file that sets the old leaf also has the new one (the defaults'); a `--config`
  flag, under either name, sets the new one after the file ran. So a new leaf that differs
  from the defaults was given explicitly and is kept over the old leaf's value."""
  _unset_old_same_as_reader(config)
  for old, new in RENAMED_OPTIONS.items():
    parent, old_leaf = option_parent(config, old)
    if parent is None or old_leaf not in parent.keys():
      continue
    target, new_leaf = option_parent(config, new)
    value = parent[old_leaf]
    if new_leaf in target.keys() and target[new_leaf] != _default(new) \
        and target[new_leaf] != value:
      warnings.warn(f"config.{old}={value!r} and config.{new}={target[new_leaf]!r} are both "
                    f"given: config.{new} is kept (a --config flag comes after the config "
                    "file)", RenamedOptionWarning, stacklevel=2)
      value = target[new_leaf]
    else:
      _warn(old, new, "")
    with parent.unlocked(), target.unlocked():
      del parent[old_leaf]
      target[new_leaf] = value


def flags_win(config, flagged) -> None:
  """Drops a config file's old leaf where the command line set its new name (`flagged`: the
  dotted names ml_collections applied as overrides, however spelt, from a flagfile too): the
  flag comes after the file, whatever its value. `upgrade_config` alone cannot tell a flag
  giving the default from no flag, and would keep the old leaf. (A flag under the old name
  set the old leaf itself: kept.)"""
  for old, new in RENAMED_OPTIONS.items():
    parent, old_leaf = option_parent(config, old)
    if new not in flagged or parent is None or old_leaf not in parent.keys():
      continue
    target, new_leaf = option_parent(config, new)
    warnings.warn(f"config.{old}={parent[old_leaf]!r} (the config file) and --config.{new}="
                  f"{target[new_leaf]!r} are both given: the flag is kept",
                  RenamedOptionWarning, stacklevel=2)
    with parent.unlocked():
      del parent[old_leaf]


def _default(name: str):
  """The defaults' value of dotted option `name` (None if it has none)."""
  from realm_jax.config.defaults import base_config
  parent, leaf = option_parent(base_config(), name)
  return None if parent is None or leaf not in parent.keys() else parent[leaf]


def _unset_old_same_as_reader(config) -> None:
  """`model.retriever.X` set to what once meant "the reader's" (0, -1.0, ""; a config file
  or a --config flag, which cannot say None) -> None, warned."""
  own = config.get("model", {}).get("retriever") if hasattr(config, "get") else None
  if not hasattr(own, "keys"):
    return
  for field in TOWER_FIELDS:
    value = own.get(field)
    if _old_same_as_reader(field, value):
      warnings.warn(f"config.model.retriever.{field}={value!r} is the old spelling of \"the "
                    f"same as the reader's\"; read as unset (None)", RenamedOptionWarning,
                    stacklevel=3)
      own[field] = None


def current_name(name: str, where: str = "") -> str:
  """Dotted option `name` as it is called now (an old name: with a warning)."""
  current = new_name(name)
  if current is None:
    return name
  _warn(name, current, where)
  return current


CONFIG_PREFIXES = ("--config.", "-config.")   # absl takes a flag with one dash or two


def upgrade_flags(args: list[str], prog: str = "") -> list[str]:
  """Command-line arguments with every `--flagfile` read in place (as absl would: the file's
  flags take its place; the launchers' own parsers know no flagfile) and old option names
  spelt the new way in `--config.<old>` and `-config.<old>` tokens. An unreadable flagfile
  exits naming it (given `prog`, as `PROG: error: ...` with exit code 2)."""
  one_line_warnings()
  if any(arg.lstrip("-").startswith("flagfile") for arg in args if arg.startswith("-")):
    from absl import flags
    try:
      args = flags.FLAGS.read_flags_from_files(list(args), force_gnu=True)
    except flags.Error as e:
      message = f"--flagfile: {str(e).removeprefix('ERROR:: ')}"
      if not prog:
        raise SystemExit(message) from None
      print(f"{prog}: error: {message}", file=sys.stderr)
      raise SystemExit(2) from None
  return [_upgraded(arg) for arg in args]


def _upgraded(arg: str) -> str:
  """A `--config.X[=v]` / `-config.X[=v]` token with X's current name; any other as it is."""
  for prefix in CONFIG_PREFIXES:
    if arg.startswith(prefix):
      name, sep, value = arg[len(prefix):].partition("=")
      return f"{prefix}{current_name(name, '--')}{sep}{value}"
  return arg

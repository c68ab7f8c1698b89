"""Config overrides, parsed in one place.

- On the command line, `--config path.py[:arg] --config.a.b=v`: ml_collections' own parser,
  behind `flags_parser` (the absl CLIs: realm-train, realm-index, ...) and `config_from_flags`
  (a launcher reading what it will hand its children); a misspelt option, a bad value or a
  missing config file is one line naming it (with ml_collections' "did you mean") and exit 2.
- `KEY=VALUE` text (`--set`, `--grid` of sweep.py and the pod launchers): `parse_assignment`,
  `check_key`, `typed_value` (the field's type), `apply_assignments`.
- A dict of dotted names set in code (the demos' stages, benches, tests): `with_overrides`.
- `--config.a.b=v` without `--config` (realm-eval, realm-predict: a run's own W/config.json
  with options set): `split_run_overrides` takes them off the command line before absl reads
  it, `apply_run_overrides` sets them, typed as `apply_assignments` types its own.
"""

from __future__ import annotations

import ast
import math
import os
import re
import sys
from typing import Callable

from realm_jax.config.option_names import current_name, flags_win
from realm_jax.config.reading import flat_options, option_parent
from realm_jax.errors import ConfigError, closest


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def flags_parser(prog: str, module: str, defaults: Callable | None = None
                 ) -> Callable[[list[str]], list[str]]:
  """absl `app.run(main, flags_parser=flags_parser(prog, __name__))`: the command line parsed,
  and the config file of a `--config` flag loaded; a misspelt option, a bad value, a config
  file that is missing or whose get_config fails -> one line naming it on stderr and exit
  code 2. `module`, the command's own (`__name__`), is what its --help describes; `defaults`,
  the options of a config without a task (realm-prepare's `prepare_config`)."""
  def parse(argv: list[str]) -> list[str]:
    from absl import flags
    _help_of(flags.FLAGS, module)
    return _parse_or_exit(prog, flags.FLAGS, _short_help(argv), defaults)
  return parse


def _short_help(argv: list[str]) -> list[str]:
  """`argv` with `-h` (before any `--`) as `--help`: absl has no `-h` and refuses it as an
  unknown flag, where the argparse commands (launchers, demos, realm-import-hf) show help."""
  cut = argv.index("--") if "--" in argv else len(argv)
  return [a if a != "-h" or not 0 < i < cut else "--help" for i, a in enumerate(argv)]


def _help_of(flag_values, module: str) -> None:
  """absl's --help shows the docstring and flags of `__main__`: under an installed command
  (`realm-train`) that is pip's wrapper script, with neither; they are taken from `module`,
  the one that defines the command (under `python -m` it is `__main__` already)."""
  if module == "__main__":
    return
  main = sys.modules["__main__"]
  for flag in flag_values.get_flags_for_module(module):
    flag_values.register_key_flag_for_module(sys.argv[0], flag)
  main.__doc__ = main.__doc__ or sys.modules[module].__doc__


def _parse_or_exit(prog: str, flag_values, argv: list[str],
                   defaults: Callable | None = None) -> list[str]:
  """`flag_values(argv)` with its `--config` file loaded (a file that failed to load raises
  only when the config is read); whatever that raises -> one line and exit code 2."""
  try:
    try:
      rest = flag_values(argv)
    except SystemExit as e:   # absl's --help prints the usage, then exits 1: a success here
      if e.code == 1 and any(a in HELP_FLAGS for a in argv[1:]):
        raise SystemExit(0) from None
      raise
    if "config" in flag_values and flag_values["config"].value is not None:
      from ml_collections import config_flags
      flags_win(flag_values["config"].value,   # (a file that failed to load raises here)
                config_flags.get_override_values(flag_values["config"]))
      check_known_options(flag_values["config"].value, _config_file(argv), defaults)
    if "config" in flag_values and _config_file(argv) is not None:
      import ml_collections
      value = flag_values["config"].value
      if not isinstance(value, ml_collections.ConfigDict):
        raise ConfigError("", f"--config {_config_file(argv)}: get_config() returned "
                          f"{type(value).__name__}, not an ml_collections.ConfigDict")
    return rest
  except Exception as e:   # noqa: BLE001 -- whatever parsing raises is a usage error
    print(f"{prog}: error: {flag_error(e, argv, defaults)}", file=sys.stderr)
    raise SystemExit(2) from None


_RUN_OVERRIDE = re.compile(r"^--?(no)?config\.([^=\s]+)(?:=(.*))?$", re.S)


def split_run_overrides(argv: list[str], config_flag: bool = True
                        ) -> tuple[list[str], list[tuple[str, str, str | None, bool]]]:
  """(`argv` less its `--config.KEY[=VALUE]` / `--noconfig.KEY` tokens, those as (flag, KEY,
  VALUE or None for a bare flag, negated)): options of a run's own W/config.json to set
  (`apply_run_overrides`). Where the command has a `--config` flag (`config_flag`; realm-eval)
  and `argv` names a file, `argv` whole and none: ml_collections parses them. Tokens after
  `--` are arguments."""
  if config_flag and _config_file(argv) is not None:
    return argv, []
  rest, found = [], []
  for i, arg in enumerate(argv):
    if arg == "--":
      return rest + argv[i:], found
    match = _RUN_OVERRIDE.match(arg) if i else None
    if match is None:
      rest.append(arg)
      continue
    negated, key, value = match.groups()
    found.append((arg.partition("=")[0], key, value, bool(negated)))
  return rest, found


def apply_run_overrides(config, overrides: list[tuple[str, str, str | None, bool]]):
  """`config` (a run's W/config.json) with each of `split_run_overrides`' options set, checked
  against its fields and typed as the field; a bare flag sets a boolean true, `--noconfig.KEY`
  (no value) false. Returns it."""
  for flag, key, value, negated in overrides:
    fields = flat_options(config)
    key = current_name(key)
    check_key(key, fields, flag)
    if value is None or negated:
      current = fields[key] if fields[key] is not None else _unset_example(config, key)
      if negated and not isinstance(current, bool):   # (--noconfig.K=V would fail again)
        raise ConfigError("", f"{flag}: config.{key} is not a boolean; set it with "
                          f"--config.{key}=VALUE")
      if not isinstance(current, bool) or value is not None:
        raise ConfigError("", f"{flag}" + (f"={value}: --no takes no value" if negated else
                                            f" takes a value: {flag}=VALUE"))
      value = "false" if negated else "true"
    config.update_from_flattened_dict({key: field_value(config, fields, key, value)})
  return config


def check_known_options(config, config_file: str | None,
                        defaults: Callable | None = None) -> None:
  """A training config (one with a `task`) holds the defaults' options (config/defaults.py)
  and no other, one without a task those of `defaults()` if given (realm-prepare's): a field
  its file added, a misspelt assignment (`c.train.stesp = 4`, which ConfigDict takes as a new
  field and training ignores), is a ConfigError naming it."""
  from realm_jax.config.defaults import base_config
  from realm_jax.config.option_names import new_name
  if "task" not in config and defaults is None:   # options of another command's own
    return
  known = flat_options(base_config() if "task" in config else defaults())
  for key in flat_options(config):
    if key not in known and new_name(key) not in known:
      meant = " or ".join(repr(name) for name in options_meant(key, known))
      raise ConfigError(key, f"set by {config_file}, but not an option" +
                        (f"; did you mean {meant}?" if meant else ""))


def _raised_by_config_dict(error: BaseException) -> bool:
  """Whether ml_collections raised `error` (a field a ConfigDict does not have), not the config
  file's own code (`os.environ["X"]`, a dict of its variants)."""
  frame = error.__traceback__
  while frame is not None and frame.tb_next is not None:
    frame = frame.tb_next
  return frame is not None and "ml_collections" in frame.tb_frame.f_code.co_filename


def options_meant(key: str, known) -> list[str]:
  """The options of `known` (whole names: `train.steps`) a misspelt or misplaced KEY most
  likely meant: those whose last part is KEY's (`steps` -> train.steps; `batch_size` -> both
  train's and eval's); else, in KEY's group where it has one, the closest last part
  (`train.stpes`); else the closest name (`trian.steps`) or last part (`temperature`); []
  where nothing is close. Every "did you mean" of a config option names these."""
  group, _, leaf = key.rpartition(".")
  known = list(known)
  leaves = {}
  for name in known:
    leaves.setdefault(name.rpartition(".")[2], []).append(name)
  if leaf in leaves:
    return leaves[leaf]
  in_group = [name for name in known if name.rpartition(".")[0] == group]
  if group and in_group:
    close = closest(leaf, [name.rpartition(".")[2] for name in in_group], cutoff=0.6)
    return [f"{group}.{close}"] if close else []
  close = closest(key, known, cutoff=0.6)
  if close:
    return [close]
  close = closest(leaf, leaves, cutoff=0.6)
  return leaves[close] if close else []


def _options_meant(option: str, defaults: Callable | None) -> list[str]:
  """`options_meant` of a `--config.KEY` flag among the training defaults' options
  (config/defaults.py), or those of `defaults()` (realm-prepare's)."""
  from realm_jax.config.defaults import base_config
  key = re.sub(r"^--?(no)?config\.", "", option)
  return options_meant(key, flat_options(defaults() if defaults is not None else base_config()))


def flag_error(error: Exception, argv: list[str], defaults: Callable | None = None) -> str:
  """One line for what parsing `argv` raised: the option or file it names, and the cause
  (`defaults`: as `flags_parser`'s, for the option a misspelt one meant)."""
  root = error
  while (root.__cause__ or root.__context__) is not None:
    root = root.__cause__ or root.__context__
  config_file = _config_file(argv)
  inside, raised = _line_in(error, config_file)
  if config_file is not None and config_file.partition(":")[0].endswith(".json"):
    return (f"--config {config_file}: a JSON file (a run's W/config.json?); --config takes a "
            "Python config file (configs/NAME.py)")   # read as Python, it fails oddly
  unloadable = "" if inside else _unloadable_config_file(config_file, root)
  if unloadable:
    return unloadable
  if inside:   # raised by the config file's own code (a misspelt field there, say)
    if isinstance(root, KeyError) and root.args and _raised_by_config_dict(root):
      what = f"the config has no field {str(root.args[0])!r}"
      suggestion = re.search(r'Did you mean "([^"]+)"', repr(raised.args))
      what += f"; did you mean {suggestion.group(1)!r}?" if suggestion else ""
    else:   # (a SyntaxError's own text repeats the file and line)
      text = raised.msg if isinstance(raised, SyntaxError) else _first_line(raised)
      what = f"{type(raised).__name__}: {text}"
    return f"--config {config_file}, line {inside}: {what}"
  if isinstance(root, (KeyError, AttributeError)):   # a misspelt --config.* key
    wrong = str(root.args[0]).strip("'") if root.args else ""
    below_a_leaf = re.search(r"Attribute <class '(\w+)'>\.(\w+) does not exist.* Attempting "
                             r"to lookup: (\S+)", wrong)
    if below_a_leaf:   # --config.train.lr.x: a field under a value
      kind, attribute, key = below_a_leaf.groups()
      parts = key.split(".")
      leaf = ".".join(parts[:parts.index(attribute, 1)])   # the value looked into
      article = "an" if kind[0] in "aeiou" else "a"
      return f"--config.{key}: no such option (config.{leaf} is {article} {kind}, not a group)"
    option = next((a.split("=")[0] for a in argv[1:] if re.match(
        r"^--?(no)?config\.(.*\.)?" + re.escape(wrong) + r"(\.|=|$)", a)), f"config.*.{wrong}")
    prefix = re.match(r"^--?(no)?config\.", option)
    meant = " or ".join(f"{prefix.group(0) if prefix else '--config.'}{name}"
                        for name in _options_meant(option, defaults))
    suggestion = re.search(r'Did you mean "([^"]+)"', str(error))
    return f"{option}: no such option" + (
        f"; did you mean {meant}?" if meant else
        f"; did you mean {suggestion.group(1)!r}?" if suggestion else "")
  if config_file is not None and "config file" in str(error):
    path = config_file.partition(":")[0]
    if not os.path.exists(path):
      return f"--config {config_file}: no such file"
    return f"--config {config_file}: {_first_line(root)}"
  return _first_line(error)


def _unloadable_config_file(config_file: str | None, root: BaseException) -> str:
  """The line for a `--config` that is a directory or a module without get_config; ""."""
  if config_file is None:
    return ""
  path = config_file.partition(":")[0]
  if os.path.isdir(path):
    return f"--config {config_file}: a directory; give a config file (configs/NAME.py)"
  if isinstance(root, AttributeError) and "get_config" in str(root):
    return f"--config {config_file}: defines no get_config()"
  return ""


def _line_in(error: BaseException, config_file: str | None) -> tuple[str, BaseException]:
  """(the line of the config file's last frame, the exception that passed through it) in the
  chain of `error` (the innermost such exception; a SyntaxError in the file: its line);
  ("", error) if the file raised none."""
  found = ("", error)
  if config_file is None:
    return found
  path = os.path.abspath(config_file.partition(":")[0])
  while error is not None:
    if isinstance(error, SyntaxError) and error.filename and error.lineno and \
        os.path.abspath(error.filename) == path:   # (compiled: no frame of the file's own)
      return str(error.lineno), error
    frame = error.__traceback__
    while frame is not None:
      if os.path.abspath(frame.tb_frame.f_code.co_filename) == path:
        found = (str(frame.tb_lineno), error)
      frame = frame.tb_next
    error = error.__cause__ or error.__context__
  return found


def _config_file(argv: list[str]) -> str | None:
  """The value of --config in `argv` (before any `--`; the last one, which absl reads), or
  None."""
  found = None
  for i, arg in enumerate(argv):
    if arg == "--":
      break
    if arg in ("--config", "-config") and i + 1 < len(argv):
      found = argv[i + 1]
    elif arg.startswith(("--config=", "-config=")):
      found = arg.partition("=")[2]
  return found


def _first_line(error: BaseException) -> str:
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0]


def config_from_flags(prog: str, config_spec: str, overrides: list[str]):
  """The config that `--config config_spec` with the `--config.*` override tokens gives a CLI
  (the same ml_collections parser): a launcher checks what it will hand its children before it
  starts them. A bad option, value or file -> one line naming it and exit code 2."""
  from absl import flags
  from ml_collections import config_flags
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True)
  argv = [prog, "--config", config_spec, *overrides]
  saved, sys.argv = sys.argv, argv     # ml_collections reads the overrides from sys.argv
  try:
    refuse_arguments(prog, _parse_or_exit(prog, flag_values, argv))
    return flag_values["config"].value
  finally:
    sys.argv = saved


def refuse_arguments(prog: str, argv: list[str]) -> None:
  """A command that takes flags only: what absl left over (`argv[1:]`) is one line and exit
  code 2 (e.g. `--config.flag false`: absl gives a boolean flag no word)."""
  if argv[1:]:
    print(f"{prog}: error: unexpected argument(s) {argv[1:]} among the flags (a boolean takes "
          "--config.KEY=true|false)", file=sys.stderr)
    raise SystemExit(2)


def refuse_config_file(prog: str, argv: list[str]) -> None:
  """A command that reads the run's own W/config.json (realm-predict): a `--config` file is
  one line and exit code 2, saying how its options are set instead."""
  if _config_file(argv) is not None:
    print(f"{prog}: error: --config {_config_file(argv)}: {prog} reads the run's own "
          "W/config.json; set its options with --config.KEY=VALUE", file=sys.stderr)
    raise SystemExit(2)


def typed_value(text: str, current, key: str):
  """`text` as the type of the field's current value (a bool accepts true/false/1/0)."""
  if isinstance(current, bool):
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ConfigError(key, f"{text!r} is not a boolean")
  if isinstance(current, int):   # (a bool was read above)
    try:
      return int(text)   # exact at any size (a float holds 53 bits)
    except ValueError:
      pass
  if isinstance(current, (int, float)):
    try:
      number = float(text)
    except ValueError:
      raise ConfigError(key, f"{text!r} is not a number") from None
    if isinstance(current, float):
      return number
    if not math.isfinite(number) or number != int(number) or abs(number) >= 2 ** 53:
      raise ConfigError(key, f"{text!r} is not an integer" + (
          " (write it out in digits)" if abs(number) >= 2 ** 53 else ""))
    return int(number)
  if isinstance(current, (tuple, list)):
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = None
    if not isinstance(value, (tuple, list)):
      raise ConfigError(key, f"{text!r} is not a tuple literal, e.g. (8, 1)")
    return tuple(value)
  return text


def flag_text(value) -> str:
  """`value` written as the text of a `--config.KEY=TEXT` flag that ml_collections parses
  back to it (`typed_value` takes more spellings: 1e3 for an int, yes for a bool)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (tuple, list)):
    return repr(tuple(value))
  return str(value)


def check_key(key: str, fields: dict, where: str) -> None:
  if key not in fields:
    meant = " or ".join(repr(name) for name in options_meant(key, fields))
    hint = f"; the closest is {meant}" if meant else ""
    raise ConfigError("", f"{where}: {key!r} is not a field of the config{hint}")


def parse_assignment(text: str, flag: str) -> tuple[str, str]:
  key, sep, value = text.partition("=")
  if not sep or not key.strip():   # an empty VALUE sets "" (a path field: unset)
    raise ConfigError("", f"{flag} {text!r}: expected KEY=VALUE")
  return current_name(key.strip()), value.strip()   # an old name: read as the new, warned


def apply_assignments(config, texts: list[str], flag: str = "--set") -> dict:
  """`config` with each `KEY=VALUE` of `texts` set (checked against its fields, typed as the
  field); returns {key: the value given, as text}."""
  fields, given = flat_options(config), {}
  for text in texts:
    key, value = parse_assignment(text, flag)
    check_key(key, fields, flag)
    config.update_from_flattened_dict({key: field_value(config, fields, key, value)})
    given[key] = value
  return given


def field_value(config, fields: dict, key: str, text: str):
  """`text` typed as field `key` of `config` (`fields`: its flat options), also where the
  field is unset (None)."""
  current = fields[key] if fields[key] is not None else _unset_example(config, key)
  return typed_value(text, current, key)


def _unset_example(config, key: str):
  """A value of the type an unset (None) field takes (`defaults.same_as_reader`), to parse
  a value given for it: the config's own record of it, else (a config whose references were
  resolved has lost it) the defaults'; None where neither knows."""
  from realm_jax.config.defaults import base_config
  for source in (config, base_config()):
    node, leaf = option_parent(source, key)
    if hasattr(node, "get_type") and leaf in node:
      kind = node.get_type(leaf)
      if kind is not type(None):
        return kind()
  return None


def with_overrides(config, overrides: dict):
  """`config` with dotted `overrides` (`{"data.dir": D}`) set; returns it."""
  for key, value in overrides.items():
    node, leaf = option_parent(config, key)
    if node is None:
      raise KeyError(f"{key}: the config has no group {key.rsplit('.', 1)[0]!r}")
    node[leaf] = value
  return config

"""Renamed options: saved configs, config files and flags that use an old name keep working,
with a warning naming the new one; a workdir recorded under old names resumes."""

import json
import os

import pytest

from realm_jax import workdir as workdir_lib
from realm_jax.errors import ConfigError
from realm_jax.config.defaults import base_config
from realm_jax.config.validation import validate
from realm_jax.config.option_names import (RenamedOptionWarning, new_name,
                                          upgrade_flags, upgrade_record)
from realm_jax.config.overrides import with_overrides
from realm_jax.config.reading import option_parent
from tests.helpers import REPO, tiny_config


def old_style(record: dict) -> dict:
  """`record` as a config.json written before the renames."""
  old = json.loads(json.dumps(record))
  old["retrieval"]["mode"] = old["retrieval"].pop("candidates")
  old["retrieval"]["first_index_timeout"] = old["retrieval"].pop("index_timeout")
  old["index"] = old.pop("builder")
  return old


def test_new_names():
  assert new_name("retrieval.mode") == "retrieval.candidates"
  assert new_name("index.keep_versions") == "builder.keep_versions"
  assert new_name("indexes.x") is None and new_name("retrieval.k") is None


def test_one_walk_finds_an_option_in_a_config_and_in_its_record():
  config = base_config()
  record = json.loads(config.to_json_best_effort())
  for root in (config, record):
    parent, leaf = option_parent(root, "model.retriever.pooling")
    assert leaf == "pooling" and parent["pooling"] == "cls"
    assert option_parent(root, "task") == (root, "task")
    assert option_parent(root, "nowhere.x")[0] is None
    assert option_parent(root, "task.x")[0] is None        # a leaf is no group
  assert with_overrides(config, {"model.retriever.pooling": "mean"}).model.retriever.pooling \
      == "mean"
  with pytest.raises(KeyError, match="model.nowhere.x: the config has no group 'model.nowhere'"):
    with_overrides(config, {"model.nowhere.x": 1})


def test_a_saved_config_under_old_names_reads_as_the_new_ones():
  current = json.loads(base_config().to_json_best_effort())
  old = old_style(current)
  old["retrieval"]["mode"], old["index"]["keep_versions"] = "own_block", 7
  snapshot = json.dumps(old)
  with pytest.warns(RenamedOptionWarning) as warned:
    upgraded = upgrade_record(old)
  assert sorted(str(w.message).split(";")[0] for w in warned) == [
      "config.index is now config.builder",
      "config.retrieval.first_index_timeout is now config.retrieval.index_timeout",
      "config.retrieval.mode is now config.retrieval.candidates"]
  assert json.dumps(old) == snapshot                    # the caller's record is untouched
  assert upgraded["retrieval"]["candidates"] == "own_block"
  assert "mode" not in upgraded["retrieval"] and "index" not in upgraded
  assert upgraded["builder"]["keep_versions"] == 7
  assert upgraded["retrieval"]["index_timeout"] == current["retrieval"]["index_timeout"]


def test_a_workdir_recorded_under_old_names_resumes(tmp_path):
  config = tiny_config("realm", "warmup")
  workdir = str(tmp_path)
  os.makedirs(os.path.join(workdir, workdir_lib.CHECKPOINTS, "0"))   # a finished step
  with open(os.path.join(workdir, workdir_lib.CONFIG), "w") as f:
    json.dump(old_style(json.loads(config.to_json_best_effort())), f)
  with pytest.warns(RenamedOptionWarning):
    assert workdir_lib.saved_config(workdir).retrieval.candidates == "own_block"
  with pytest.warns(RenamedOptionWarning):
    workdir_lib.record_config(config, workdir)        # compatible: no error
  with open(os.path.join(workdir, workdir_lib.CONFIG)) as f:
    assert json.load(f)["retrieval"]["candidates"] == "own_block"   # recorded the new way
  # A real difference under the old name is still refused, by its new name.
  with open(os.path.join(workdir, workdir_lib.CONFIG), "w") as f:
    json.dump(old_style(json.loads(tiny_config("realm").to_json_best_effort())), f)
  with pytest.warns(RenamedOptionWarning), pytest.raises(ConfigError,
                                                         match="retrieval.candidates: 'index'"):
    workdir_lib.record_config(config, workdir)


def test_a_config_file_setting_an_old_leaf_still_validates():
  config = tiny_config("realm")
  config.lock()
  with config.unlocked():
    del config.retrieval["candidates"]
    config.retrieval.mode = "null_only"          # as a config file written before the rename
  config.train.retriever_lr_scale = 0.0          # (null_only trains no retriever)
  with pytest.warns(RenamedOptionWarning, match="retrieval.mode"):
    validate(config)
  assert config.retrieval.candidates == "null_only" and "mode" not in config.retrieval
  with pytest.raises(AttributeError):
    config.retrieval.mode = "index"              # still locked: no field of that name


def test_old_flags_are_spelt_the_new_way():
  with pytest.warns(RenamedOptionWarning, match="--config.index.devices is now "
                    "config.builder.devices"):
    args = upgrade_flags(["--config=c.py", "--config.index.devices=6,7",
                          "--config.retrieval.k=4"])
  assert args == ["--config=c.py", "--config.builder.devices=6,7", "--config.retrieval.k=4"]
  with pytest.warns(RenamedOptionWarning):
    assert upgrade_flags(["--config.retrieval.mode", "own_block"]) == [
        "--config.retrieval.candidates", "own_block"]


def test_old_flags_with_one_dash_or_in_a_flagfile_are_spelt_the_new_way(tmp_path):
  """absl reads `-config.X` as `--config.X` and a `--flagfile`'s lines in its place: an old
  name there is renamed too (the flagfile read in place: test_launch_local for the launcher);
  an unreadable one exits naming it."""
  with pytest.warns(RenamedOptionWarning, match="index.devices"):
    assert upgrade_flags(["-config.index.devices=6,7", "-config.retrieval.k", "4"]) == [
        "-config.builder.devices=6,7", "-config.retrieval.k", "4"]
  old = tmp_path / "old.flags"
  old.write_text("--config.retrieval.mode=own_block\n--config.train.steps=3\n")
  with pytest.warns(RenamedOptionWarning, match="retrieval.mode"):
    args = upgrade_flags(["prog", "--config=c.py", f"--flagfile={old}", "--config.seed=2"])
  assert args == ["prog", "--config=c.py", "--config.retrieval.candidates=own_block",
                  "--config.train.steps=3", "--config.seed=2"]
  with pytest.raises(SystemExit, match=r"--flagfile: Unable to open flagfile: .*missing"):
    upgrade_flags(["prog", f"--flagfile={tmp_path}/missing"])


def test_the_retriever_is_the_reader_unless_it_says_otherwise(tmp_path):
  """`model.retriever.*` unset (None) is the reader's shape, said as such; a value set on the
  command line or with --set is parsed as the field's type; a workdir recorded when "the
  reader's" was written 0 / -1.0 / "" reads as unset and resumes; on the command line that old
  spelling still resets a field (warned); a bad size is refused naming the option."""
  from realm_jax.config import reading
  from realm_jax.config.overrides import apply_assignments, config_from_flags
  config = tiny_config("realm")
  assert config.model.retriever.num_layers is None and config.model.retriever.hidden_act is None
  assert reading.part_model(config, "retriever").num_layers == config.model.num_layers
  flagged = config_from_flags("realm-train", os.path.join(REPO, "configs/demo_realm.py"), [
      "--config.model.retriever.num_layers=3", "--config.model.retriever.dropout_rate=0.2"])
  assert flagged.model.retriever.num_layers == 3 and flagged.model.retriever.dropout_rate == 0.2
  resolved = config.copy_and_resolve_references()   # a resolved copy no longer knows the type
  apply_assignments(resolved, ["model.retriever.num_heads=2"])
  assert resolved.model.retriever.num_heads == 2 and isinstance(resolved.model.retriever.num_heads,
                                                                 int)
  assert reading.part_options(resolved, "retriever")["num_heads"] == "model.retriever.num_heads"
  # A record from before: the retriever's shape fields said "the reader's" with 0 / -1 / "".
  workdir = str(tmp_path)
  os.makedirs(os.path.join(workdir, workdir_lib.CHECKPOINTS, "0"))   # a finished step
  record = json.loads(config.to_json_best_effort())
  record["model"]["retriever"].update(hidden_size=0, num_layers=0, num_heads=0,
                                      intermediate_size=0, max_position=0, dropout_rate=-1.0,
                                      hidden_act="")
  with open(os.path.join(workdir, workdir_lib.CONFIG), "w") as f:
    json.dump(record, f)
  saved = workdir_lib.saved_config(workdir)
  assert saved.model.retriever.num_layers is None and saved.model.retriever.hidden_act is None
  workdir_lib.record_config(config, workdir)        # compatible: no error
  # A flag cannot say None: the old spelling, 0, resets a config file's own shape to the
  # reader's, with a warning; a value that was never a spelling of it is refused.
  reset = config_from_flags("realm-train", os.path.join(REPO, "configs/real_realm.py"),
                            ["--config.model.retriever.num_layers=0"])
  assert reset.model.retriever.num_layers == 0
  with pytest.warns(RenamedOptionWarning, match="retriever.num_layers=0 is the old spelling"):
    validate(reset)
  assert reset.model.retriever.num_layers is None
  assert reading.part_model(reset, "retriever").num_layers == reset.model.num_layers
  negative = tiny_config("realm", model__retriever__num_layers=-2)
  with pytest.raises(ConfigError, match="model.retriever.num_layers: must be >= 1, got -2"):
    validate(negative)


def test_a_flag_wins_over_a_config_file_setting_the_old_leaf():
  """The file ran first (old leaf, the defaults' new leaf); the flag set the new leaf after."""
  config = tiny_config("realm")
  with config.unlocked():
    config.retrieval.mode = "own_block"              # the file, under the old name
    config.retrieval.first_index_timeout = 60.0
  config.retrieval.candidates = "null_only"          # --config.retrieval.candidates (or .mode)
  config.train.retriever_lr_scale = 0.0              # (null_only trains no retriever)
  with pytest.warns(RenamedOptionWarning) as warned:
    validate(config)
  assert config.retrieval.candidates == "null_only"  # the flag's
  assert config.retrieval.index_timeout == 60.0      # the file's: no flag for it
  assert "mode" not in config.retrieval and "first_index_timeout" not in config.retrieval
  assert any("are both given: config.retrieval.candidates is kept" in str(w.message)
             for w in warned)


def test_a_flag_giving_the_default_still_wins_over_the_old_leaf_of_a_config_file(tmp_path):
  """`--config.retrieval.index_timeout=1800` (the defaults' value) after a file that sets the
  old `first_index_timeout = 600`: the flag's, though the new leaf then looks untouched."""
  from realm_jax.config.overrides import config_from_flags
  default = base_config().retrieval.index_timeout
  path = tmp_path / "old_leaf.py"
  path.write_text(
      "import importlib.util\n"
      f"spec = importlib.util.spec_from_file_location('d', {REPO + '/configs/demo_realm.py'!r})\n"
      "base = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(base)\n"
      "def get_config():\n  c = base.get_config()\n"
      "  c.retrieval.first_index_timeout = 600.0\n  return c\n")
  flagfile = tmp_path / "flags"
  flagfile.write_text(f"--config.retrieval.index_timeout={default}\n")
  for spelt in ([f"--config.retrieval.index_timeout={default}"],
                ["--config.retrieval.index_timeout", str(default)],
                [f"-config.retrieval.index_timeout={default}"], [f"--flagfile={flagfile}"]):
    with pytest.warns(RenamedOptionWarning, match="the flag is kept"):
      flagged = config_from_flags("realm-train", str(path), spelt)
    validate(flagged)
    assert flagged.retrieval.index_timeout == default, spelt
  plain = config_from_flags("realm-train", str(path), ["--config.retrieval.k=4"])
  with pytest.warns(RenamedOptionWarning, match="first_index_timeout is now"):
    validate(plain)
  assert plain.retrieval.index_timeout == 600.0       # no flag for it: the file's


FILE_SUFFIXES = ("py", "json", "jsonl", "md", "txt", "npy", "npz", "safetensors", "bin", "log")
QUOTED_ERRORS = ("no such option", "not a field", "not an option")   # misspelt on purpose


def test_every_option_the_docs_name_exists():
  """Every option a hand-written page names (`group.option` in backticks, `--config.X` flags
  of the training and `realm-prepare` configs) is one, or a renamed one's old name; a file
  name (`train.jsonl`), a glob (`qa.heldout_*`), the syntax's `a.b` and a misspelling in a
  quoted error are not options."""
  import glob
  import re
  from realm_jax.config.reading import flat_options
  from realm_jax.data.prepare import prepare_config
  known = set(flat_options(base_config())) | set(flat_options(prepare_config())) | {"a.b"}
  known |= {".".join(n.split(".")[:i]) for n in set(known) for i in range(1, n.count(".") + 1)}
  groups = "|".join(sorted({n.split(".")[0] for n in flat_options(base_config()) if "." in n}))
  named = re.compile(rf"`(?:--config\.|config\.)?((?:{groups})\.[a-z_.]*[a-z_])(?:=[^`]*)?`")
  flagged = re.compile(r"--(?:no)?config\.([a-z_][a-z_0-9.]*[a-z_0-9])")
  dated = ("results.md", "test_times.md", "testing.md", "config_reference.md")
  pages = [os.path.join(REPO, "README.md")] + [
      p for p in sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
      if os.path.basename(p) not in dated]
  unknown = []
  for page in pages:
    with open(page) as f:
      lines = f.read().splitlines()
    misspelt = {name for line in lines if any(error in line for error in QUOTED_ERRORS)
                for name in flagged.findall(line)}   # the command and its error both name it
    for number, line in enumerate(lines, 1):
      names = [n for n in named.findall(line) if n.rpartition(".")[2] not in FILE_SUFFIXES]
      names += [n for n in flagged.findall(line) if n not in misspelt]
      unknown += [f"{os.path.basename(page)}:{number}: {name}" for name in names
                  if name not in known and new_name(name) is None]
  assert not unknown, unknown

"""A bad option is refused by name before anything is written (in process), and the CLI,
`python -m realm_jax.train.main`, prints it as one clear line, exit code 2, no traceback."""

import importlib
import os
import re
import subprocess
import sys
import time

import pytest

from realm_jax import workdir as workdir_lib
from realm_jax.errors import ConfigError
from tests.helpers import REPO, apply_overrides, config_flags, tiny_config

DATA_BLOCK_LEN = tiny_config("realm").data.block_len     # what the world_dir fixture uses


def run_cli(flags, workdir, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  if "--xla_force_host_platform_device_count=8" not in env.get("XLA_FLAGS", ""):
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
  return subprocess.run([sys.executable, "-m", "realm_jax.train.main", "--workdir", workdir,
                         *flags], cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=timeout)


def assert_clear_error(result, option):
  assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("realm-train: error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  assert option in errors[0], errors[0]


@pytest.fixture(scope="module")
def realm_flags(world_dir):
  return config_flags(tiny_config("realm", None, world_dir), "demo_realm")


@pytest.mark.parametrize("overrides, option", [
    ({"retrieval__k": 1}, "retrieval.k"),
    ({"retrieval__k": 1000}, "retrieval.k"),          # > the ~240 blocks
    ({"data__block_len": 4}, "data.block_len"),
    ({"data__block_len": DATA_BLOCK_LEN + 8}, "data.block_len"),  # != the data's
    ({"mesh__shape": (3, 1)}, "mesh.shape"),           # 8 devices
    ({"task": "bogus"}, "task"),
    ({"retrieval__candidates": "bogus"}, "retrieval.candidates"),
    ({"train__batch_size": 100000}, "train.batch_size"),
    ({"train__keep_checkpoints": 0}, "train.keep_checkpoints"),   # Orbax would delete each
    ({"train__checkpoint_every": 0}, "train.checkpoint_every"),
    ({"retrieval__refresh": "deterministic", "retrieval__swap_lag": 2,
      "train__checkpoint_every": 0}, "train.checkpoint_every"),   # was a ZeroDivisionError
    ({"train__log_every": 0}, "train.log_every"),
    ({"retrieval__refresh": "deterministic", "retrieval__refresh_every": 0},
     "retrieval.refresh_every"),
    # checkpoint 3 (its index serves steps 5-7) would be deleted by the save of step 4
    ({"retrieval__refresh": "deterministic", "retrieval__refresh_every": 3,
      "retrieval__swap_lag": 2, "train__checkpoint_every": 1, "train__keep_checkpoints": 1},
     "train.keep_checkpoints"),
    # numbers outside their ranges: -1 would evaluate after every step, a dim of 0 fail at the
    # first checkpoint, a NaN learning rate train nothing
    ({"eval__every": -1}, "eval.every"),
    ({"model__retrieval_dim": 0}, "model.retrieval_dim"),
    ({"train__lr": float("nan")}, "train.lr"),
    ({"train__b2": 1.5}, "train.b2"),
    ({"data__ict_remove_prob": 2.0}, "data.ict_remove_prob"),
    ({"train__warmup_steps": -5}, "train.warmup_steps"),
    ({"train__reader_lr_scale": float("nan")}, "train.reader_lr_scale"),
    ({"train__preemption_grace_seconds": float("inf")}, "train.preemption_grace_seconds"),
    ({"retrieval__embed_batch_size": -1}, "retrieval.embed_batch_size"),
    ({"seed": -1}, "seed"),                            # the data order's seed: a traceback
    ({"mesh__rules": (("batch", "foo"),)}, "mesh.rules"),
    ({"mesh__shape": (4, 2), "model__intermediate_size": 63}, "mesh.shape"),  # 63 / 2 rows
    ({"eval__split": "bogus"}, "eval.split"),          # was found at the final evaluation
    ({"eval__split": "train", "data__split": "eval"}, "eval.split"),   # no target spans
    ({"data__split": "eval"}, "eval.split"),           # would evaluate on its training queries
    ({"data__max_masks": 2}, "data.max_masks"),        # the world's spans: up to 5 wordpieces
    ({"train__profile_first_step": -1}, "train.profile_first_step"),
    ({"train__profile_first_step": 5}, "train.profile_first_step"),   # after step 4: no trace
    ({"train__profile_first_step": 1, "train__profile_steps": 0}, "train.profile_steps"),
    ({"train__optimizer": "adam"}, "train.optimizer"),
], ids=["k=1", "k>blocks", "block_len=4", "block_len!=data", "mesh=3x1", "task", "candidates",
        "batch>examples", "keep=0", "checkpoint_every=0", "checkpoint_every=0_deterministic",
        "log_every=0", "refresh_every=0",
        "keep<swap_lag", "eval_every=-1", "retrieval_dim=0", "lr=nan", "b2=1.5",
        "ict_remove_prob=2", "warmup=-5", "reader_lr_scale=nan", "grace=inf",
        "embed_batch=-1", "seed=-1", "rules_axis", "model_axis!|mlp", "eval_split",
        "eval_split_unscored", "train_on_eval", "max_masks<span", "profile_first=-1",
        "profile_after_last", "profile_steps=0", "optimizer"])
def test_bad_option_is_named(world_dir, tmp_path, overrides, option):
  """In process: the trainer refuses the option by name before it writes anything."""
  from realm_jax.train.loop import train
  config = apply_overrides(tiny_config("realm", None, world_dir), overrides)
  with pytest.raises(ConfigError) as refused:
    train(config, str(tmp_path / "w"))
  assert refused.value.option == option, str(refused.value)
  assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_a_mesh_axis_that_does_not_divide_a_parameter_names_it(world_dir, tmp_path):
  from realm_jax.train.loop import train
  config = apply_overrides(tiny_config("realm", None, world_dir),
                           {"mesh__shape": (4, 2), "model__intermediate_size": 63})
  with pytest.raises(ConfigError, match=r"config\.mesh\.shape: \{'data': 4, 'model': 2\} "
                     r"splits dimension \d \(size 63\) of the parameter .*intermediate.* 2 "
                     r"ways over mesh axis model"):
    train(config, str(tmp_path / "w"))


def test_the_cli_prints_a_bad_option_in_one_line(realm_flags, tmp_path):
  result = run_cli(realm_flags + ["--config.retrieval.k=1"], str(tmp_path / "w"))
  assert_clear_error(result, "retrieval.k")
  result = run_cli(realm_flags + ["--config.qa.reader_len=320"], str(tmp_path / "w"))
  assert_clear_error(result, "qa.reader_len")
  assert not os.path.exists(tmp_path / "w" / "checkpoints")
  # absl gives a boolean flag no word: the usage text and "unexpected arguments" before
  result = run_cli(realm_flags + ["--config.train.async_checkpoints", "false"],
                   str(tmp_path / "w"))
  assert_clear_error(result, "unexpected argument(s) ['false'] among the flags (a boolean "
                     "takes --config.KEY=true|false)")


def test_a_workdir_that_cannot_be_one_is_one_line(realm_flags, tmp_path):
  """A workdir that is a file (or under one): the OSError as `PATH: what is wrong`, exit 2."""
  (tmp_path / "afile").write_text("")
  result = run_cli(realm_flags, str(tmp_path / "afile"))
  assert_clear_error(result, f"{tmp_path / 'afile'}: exists and is not a directory")


def test_missing_data_dir_is_named(realm_flags, tmp_path):
  result = run_cli(realm_flags + [f"--config.data.dir={tmp_path / 'nowhere'}"],
                   str(tmp_path / "w"))
  assert_clear_error(result, "data.dir")
  assert "nowhere" in result.stderr
  (tmp_path / "afile").write_text("")
  result = run_cli(realm_flags + [f"--config.data.dir={tmp_path / 'afile'}"],
                   str(tmp_path / "w"))
  assert_clear_error(result, "afile' is a file, not a prepared data dir")


def test_a_realm_run_whose_index_never_comes_ends_in_one_line(realm_flags, tmp_path):
  """Builder refresh and no realm-index: the wait for the first version runs out
  `retrieval.index_timeout` and the CLI says so in one line, naming the option and what to
  start (exit code 1), where it printed the timeout inside a traceback."""
  result = run_cli(realm_flags + ["--config.retrieval.refresh=async",
                                  "--config.retrieval.index_timeout=1"], str(tmp_path / "w"))
  assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith("realm-train: error:")]
  assert len(errors) == 1, result.stderr[-3000:]
  assert "no published index" in errors[0], errors[0]
  assert "config.retrieval.index_timeout" in errors[0] and "realm-index" in errors[0]


@pytest.mark.slow
def test_workdir_of_an_incompatible_config_is_refused(world_dir, tmp_path):
  workdir = str(tmp_path / "w")
  config = tiny_config("realm", "warmup", world_dir, train__steps=1)
  flags = config_flags(config, "demo_realm", "warmup")
  assert "--config.model.hidden_size=32" in flags
  from realm_jax.train.loop import train
  train(config, workdir)   # the workdir of a finished run (made here: the CLI is under test)
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["1"]
  # Same workdir, wider model: refused before anything is overwritten.
  with open(os.path.join(workdir, "config.json")) as f:
    saved = f.read()
  second = run_cli(flags + ["--config.model.hidden_size=64"], workdir)
  assert_clear_error(second, "model.hidden_size")
  with open(os.path.join(workdir, "config.json")) as f:
    assert f.read() == saved


def test_a_workdir_without_a_finished_checkpoint_takes_another_config(tmp_path):
  """A run that died before its first save (say, out of memory in step 1) left config.json
  and an empty checkpoints/: the usual fix, a smaller batch, is no incompatible config."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "w")
  workdir_lib.record_config(tiny_config("ict", train__batch_size=16), workdir)
  os.makedirs(os.path.join(workdir, "checkpoints"))
  smaller = tiny_config("ict", train__batch_size=8)
  workdir_lib.record_config(smaller, workdir)
  os.makedirs(os.path.join(workdir, "checkpoints", "3"))      # a finished step of batch 8
  with pytest.raises(ConfigError, match="train.batch_size: 8 .checkpoints. != 16"):
    workdir_lib.record_config(tiny_config("ict", train__batch_size=16), workdir)


def test_a_run_resumes_under_either_long_query_rule_and_old_records_read_refuse(tmp_path):
  """data.long_queries is no compatibility field: under 'refuse' no query was cut, so 'cut'
  sees the same queries, and a run that cut is refused at start-up under 'refuse' by the data
  check. A record written before the option existed reads as 'refuse', what it ran under."""
  import json
  from realm_jax import workdir as workdir_lib
  from realm_jax.config.compatibility import with_added_fields
  workdir = str(tmp_path / "w")
  workdir_lib.record_config(tiny_config("ict"), workdir)
  os.makedirs(os.path.join(workdir, "checkpoints", "3"))
  workdir_lib.record_config(tiny_config("ict", data__long_queries="cut"), workdir)
  workdir_lib.record_config(tiny_config("ict"), workdir)
  old = json.loads(tiny_config("ict").to_json_best_effort())
  del old["data"]["long_queries"]
  assert with_added_fields(old)["data"]["long_queries"] == "refuse"


def test_a_run_recorded_before_the_query_and_reader_lengths_resumed_under_others_is_told(
    tmp_path):
  """A record from before data.long_queries and qa.reader_len ran under 'refuse' and the
  whole pair (0): a resume under 'cut' or a reader of 320 changes them, and start-up says so
  (`recorded_differences`), as it does for a record that holds them."""
  import json
  from realm_jax import workdir as workdir_lib
  for group, option, was, now in (("data", "long_queries", "refuse", "cut"),
                                  ("qa", "reader_len", 0, 320)):
    workdir = tmp_path / option
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    old = json.loads(tiny_config("ict").to_json_best_effort())
    del old[group][option]
    (workdir / "config.json").write_text(json.dumps(old))
    config = tiny_config("ict", **{f"{group}__{option}": now})
    assert workdir_lib.recorded_differences(str(workdir), config) == [
        (f"{group}.{option}", was, now)]
    assert workdir_lib.recorded_differences(str(workdir), tiny_config("ict")) == []


def test_a_run_recorded_before_the_retriever_learning_options_resumed_under_others_is_told(
    tmp_path):
  """The retriever-learning options came after the first runs (2026-11-24 to 11-27), which
  trained as their defaults do (the marginal loss, the block tower's gradient, the null
  document read, no packing, cache or own context): a resume or a sweep under other values
  is not what such a run trained under, and start-up says so (`recorded_differences`; a
  sweep refuses the run) as it does for a record that holds them."""
  import json
  from realm_jax import workdir as workdir_lib
  for option, was, now in (
      ("loss", "marginal", "distill"), ("distill_queries", "all", "evidence"),
      ("distill_temperature", 1.0, 2.0), ("retriever_temperature", 1.0, 2.0),
      ("block_gradients", True, False), ("train_null_document", True, False),
      ("packed_query_rows", 0, 2), ("own_context", False, True),
      ("own_block_share", 0.5, 0.25), ("score_cache", False, True)):
    workdir = tmp_path / option
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    same = tiny_config("realm", **{f"retrieval__{option}": was})
    old = json.loads(same.to_json_best_effort())
    del old["retrieval"][option]                 # a run from before the option
    (workdir / "config.json").write_text(json.dumps(old))
    config = tiny_config("realm", **{f"retrieval__{option}": now})
    assert workdir_lib.recorded_differences(str(workdir), config) == [
        (f"retrieval.{option}", was, now)]
    assert workdir_lib.recorded_differences(str(workdir), same) == []


def test_another_programs_config_json_is_refused_not_overwritten(tmp_path):
  """A --workdir that holds another program's config.json (a Hugging Face model dir's) or a
  file that is not JSON: a run there would have overwritten it. Each is named in one line and
  left as it was, with checkpoints or without."""
  from realm_jax.errors import DataError
  foreign = '{"model_type": "bert", "hidden_size": 384}'
  for name, text, expected in [("hf", foreign, "not the config a run writes"),
                               ("list", "[1, 2]", "not the JSON object a run writes"),
                               ("null", "null", "not the JSON object a run writes"),
                               ("notes", "my notes", "not the JSON a run writes")]:
    for checkpoint in (False, True):
      workdir = tmp_path / f"{name}{int(checkpoint)}"
      workdir.mkdir()
      (workdir / "config.json").write_text(text)
      if checkpoint:
        os.makedirs(workdir / "checkpoints" / "3")
      with pytest.raises(DataError, match=re.escape(f"{workdir}/config.json: {expected}") +
                         ".*a run would overwrite it: give --workdir a run's directory"):
        workdir_lib.record_config(tiny_config("ict"), str(workdir))
      assert (workdir / "config.json").read_text() == text
  ours = tmp_path / "ours"     # a run's own config.json: written again, as before
  workdir_lib.record_config(tiny_config("ict", train__batch_size=16), str(ours))
  workdir_lib.record_config(tiny_config("ict", train__batch_size=8), str(ours))
  assert workdir_lib.recorded_config(str(ours))["train"]["batch_size"] == 8


def test_a_summary_or_block_record_that_is_not_json_is_named_in_one_line(tmp_path):
  """W/summary.json (read by a trainer resumed at its last step, a demo, a sweep) and
  W/blocks.json (read by realm-index) cut short, or written over by hand, are named as the
  other records are (before: a JSONDecodeError traceback naming no file)."""
  from realm_jax.errors import DataError
  for text, expected in (("", "not the JSON a run writes"),
                         ('{"task": "realm", "eval_', "not the JSON a run writes"),
                         ("[1]", "not the JSON object a run writes")):
    (tmp_path / "summary.json").write_text(text)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/summary.json: {expected}") +
                       r".*\(or remove it: realm-train with the run's train.steps evaluates"):
      workdir_lib.read_summary(str(tmp_path))
    (tmp_path / "blocks.json").write_text(text)
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/blocks.json: {expected}")):
      workdir_lib.check_block_store(str(tmp_path), "f" * 64, "data")
  (tmp_path / "summary.json").write_text('{"steps": 4}')
  assert workdir_lib.read_summary(str(tmp_path)) == {"steps": 4}


def test_a_run_names_another_programs_config_json_with_its_own_advice(world_dir, tmp_path):
  """realm-train on such a workdir that holds checkpoints: the vocab check and the recorded
  differences read config.json before record_config; the line still gives a run's advice
  (not an evaluation's --config), on every process alike."""
  from realm_jax.errors import DataError
  from realm_jax.train.loop import train
  foreign = '{"model_type": "bert", "hidden_size": 384}'
  for vocab in (False, True):
    workdir = tmp_path / f"vocab{int(vocab)}"
    os.makedirs(workdir / "checkpoints" / "3")
    (workdir / "config.json").write_text(foreign)
    if vocab:
      with open(os.path.join(world_dir, "vocab.txt")) as f:
        (workdir / "vocab.txt").write_text(f.read())
    with pytest.raises(DataError, match="a run would overwrite it: give --workdir a run's"):
      train(tiny_config("ict", data_dir=world_dir, train__steps=4), str(workdir))
    assert (workdir / "config.json").read_text() == foreign


def test_checkpoints_that_are_a_file_are_named_before_the_run_trains(tmp_path):
  """W/checkpoints as a file: found by the first save, after `checkpoint_every` steps of
  training, until the checkpointer looked at start; now the CLI's one line comes first."""
  from realm_jax.errors import path_error
  from realm_jax.runtime.checkpoints import Checkpointer
  (tmp_path / "checkpoints").write_text("x")
  with pytest.raises(FileExistsError) as error:
    Checkpointer(str(tmp_path), keep=1)
  assert path_error(error.value) == f"{tmp_path}/checkpoints: exists and is not a directory"
  assert (tmp_path / "checkpoints").read_text() == "x"


def test_a_realm_run_switching_between_in_process_and_builder_refresh_is_refused(tmp_path):
  """In process, the checkpoints keep the snapshot the index was built from; with realm-index,
  not: resumed under the other, every checkpoint would read as unreadable. async and
  deterministic keep the same, and a run that retrieves nothing may switch."""
  from realm_jax import workdir as workdir_lib
  workdir = str(tmp_path / "w")
  workdir_lib.record_config(tiny_config("realm", retrieval__refresh="in_process"), workdir)
  os.makedirs(os.path.join(workdir, "checkpoints", "2"))
  with pytest.raises(ConfigError, match=r"retrieval.refresh: 'in_process' \(checkpoints\) != "
                     r"'async' \(this run\): in-process rebuilds and realm-index"):
    workdir_lib.record_config(tiny_config("realm", retrieval__refresh="async"), workdir)
  builder = str(tmp_path / "b")
  workdir_lib.record_config(tiny_config("realm", retrieval__refresh="async"), builder)
  os.makedirs(os.path.join(builder, "checkpoints", "2"))
  workdir_lib.record_config(tiny_config("realm", retrieval__refresh="deterministic"), builder)
  warmup = str(tmp_path / "warmup")                        # the own block: no index at all
  workdir_lib.record_config(tiny_config("realm", "warmup", retrieval__refresh="in_process"),
                            warmup)
  os.makedirs(os.path.join(warmup, "checkpoints", "2"))
  workdir_lib.record_config(tiny_config("realm", "warmup", retrieval__refresh="async"), warmup)


def test_ctrl_c_ends_a_cli_with_one_line_and_by_sigint():
  """Ctrl-C in any CLI (`errors.run_cli`): one line naming the program, no traceback, and the
  process still ends by SIGINT, so that a shell stops a script there (the demo's stage
  processes get SIGINT when the demo is interrupted)."""
  import signal
  # a pytest-xdist worker ignores SIGINT and its children inherit that: restore Python's own
  code = ("import signal, time; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
          "from realm_jax.errors import run_cli\n"
          "def job():\n"
          "  print('ready', flush=True); time.sleep(60)\n"
          "run_cli('realm-train', job)\n")
  process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  try:
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.5)                      # inside time.sleep, not the print
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
  finally:
    process.kill()
  assert process.returncode == -signal.SIGINT
  assert err.strip() == "realm-train: interrupted"


def _broken_config(tmp_path):
  """A config file whose get_config misspells a field of its own (line 5)."""
  path = tmp_path / "broken.py"
  path.write_text("from realm_jax.config.defaults import base_config\n\n"
                  "def get_config(arg=None):\n  c = base_config()\n"
                  "  c.train.checkpoint_every = c.train.stepz // 10\n  return c\n")
  return path


CLI_MODULES = {"realm-train": ["-m", "realm_jax.train.main", "--workdir", "W"],
               "realm-index": ["-m", "realm_jax.retrieval.builder", "--workdir", "W"],
               "realm-eval": ["-m", "realm_jax.openqa_eval", "--workdir", "W"],
               "realm-prepare": ["-m", "realm_jax.data.prepare"],
               "local.py": ["launch/local.py", "--workdir", "W"]}


def run_entry(prog, args, tmp_path):
  command = [str(tmp_path / "w") if a == "W" else a for a in CLI_MODULES[prog]]
  return subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)


@pytest.mark.parametrize("prog", sorted(CLI_MODULES))
def test_every_cli_names_a_misspelt_option_and_a_missing_config_file_in_one_line(
    prog, tmp_path):
  """ml_collections' "did you mean" reaches the line; nothing starts, nothing is written."""
  config = "configs/prepare.py" if prog == "realm-prepare" else "configs/demo_realm.py"
  leaf = "out_dir" if prog == "realm-prepare" else "train.steps"
  cases = [(["--config", config, f"--config.{leaf}z=1"],
            f"--config.{leaf}z: no such option; did you mean --config.{leaf}?"),
           (["--config", "configs/nowhere.py"], "--config configs/nowhere.py: no such file"),
           ([f"--config={config}:bogus"], "unknown variant 'bogus'"),
           (["--config", str(_broken_config(tmp_path))],   # its own error: file and line
            f"{tmp_path}/broken.py, line 5: the config has no field 'stepz'; did you mean "
            "'steps'?")]
  for args, expected in cases:
    result = run_entry(prog, args, tmp_path)
    assert result.returncode == 2, (args, result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line and line]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), result.stderr[-2000:]
    assert expected in lines[0], lines[0]
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("prog", sorted(CLI_MODULES))
def test_every_cli_names_an_unloadable_config_or_flagfile_in_one_line(prog, tmp_path):
  """A `--config` that is a directory or defines no get_config, and a `--flagfile` that
  cannot be read (ml_collections read it while the module was imported, a traceback), are
  one line naming them, exit code 2; nothing is written."""
  (tmp_path / "noget.py").write_text("x = 1\n")
  cases = [(["--config", "configs"], "--config configs: a directory; give a config file"),
           (["--config", f"{tmp_path}/noget.py"],
            f"--config {tmp_path}/noget.py: defines no get_config()"),
           ([f"--flagfile={tmp_path}/missing.flags"],
            f"--flagfile: Unable to open flagfile: [Errno 2] No such file or directory: "
            f"'{tmp_path}/missing.flags'")]
  for args, expected in cases:
    result = run_entry(prog, args, tmp_path)
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line and line]
    assert result.returncode == 2 and len(lines) == 1, (args, result.stderr[-2000:])
    assert lines[0].startswith(f"{prog}: error: {expected}"), lines[0]
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("command, prog, args, expected", [
    (["-m", "realm_jax.interop.hf_realm", "--hf-dir", "D", "--out", "W"], "realm-import-hf",
     ["--taks", "openqa"], "unrecognized arguments: --taks openqa; did you mean --task?"),
    (["-m", "realm_jax.interop.hf_realm", "--hf-dir", "D", "--out", "W"], "realm-import-hf",
     ["--vocabb=v"], "unrecognized arguments: --vocabb=v; did you mean --vocab?"),
    (["-m", "realm_jax.interop.hf_realm", "--out", "W"], "realm-import-hf", [],
     "the following arguments are required: --hf-dir"),
    (["-m", "realm_jax.interop.hf_realm", "--out", "W"], "realm-import-hf", ["--hf-dri", "D"],
     "unrecognized arguments: --hf-dri; did you mean --hf-dir?"),
    (["launch/local.py", "--config", "configs/demo_realm.py:realm"], "local.py",
     ["--workdri", "W"], "unrecognized arguments: --workdri; did you mean --workdir?"),
    (["launch/local.py", "--config", "configs/demo_realm.py:realm", "--workdir", "W"],
     "local.py", ["--grcae", "3"], "unrecognized arguments: --grcae 3; did you mean --grace?"),
    (["launch/local.py", "--config", "configs/demo_realm.py:realm", "--workdir", "W"],
     "local.py", ["--grace", "-5"], "--grace: must be >= 0 seconds, got -5"),
    (["launch/tpu_pod.py", "up", "--name", "realm", "--zone", "z", "--project", "p", "--config",
      "configs/realm_base.py", "--workdir", "gs://b/w"], "tpu_pod.py", ["--dry-rnu"],
     "unrecognized arguments: --dry-rnu; did you mean --dry-run?"),
    (["launch/sweep.py", "--config", "configs/demo_ict.py", "--root", "W"], "sweep.py",
     ["--rid", "train.lr=1"], "unrecognized arguments: --rid train.lr=1; did you mean --grid?"),
    (["launch/gke/render.py", "--config", "configs/realm_base.py", "--workdir", "gs://b/w"],
     "render.py", ["--imgae", "x"], "unrecognized arguments: --imgae x; did you mean --image?"),
    # the demos (make demo / demo-real pass their flags on), the HF parity check, a bench
    (["-m", "realm_jax.demo", "--workdir", "W"], "demo", ["--sede", "1"],
     "unrecognized arguments: --sede 1; did you mean --seed?"),
    (["-m", "realm_jax.demo_real", "--workdir", "W"], "realm-demo-real", ["--scael", "gpu"],
     "unrecognized arguments: --scael gpu; did you mean --scale?"),
    (["-m", "realm_jax.interop.hf_parity", "--out", "W"], "hf_parity", ["--hf-dri", "D"],
     "unrecognized arguments: --hf-dri D; did you mean --hf-dir?"),
    (["bench/score_cache.py", "--out", "W"], "score_cache.py", ["--dta", "D"],
     "unrecognized arguments: --dta; did you mean --data?")])
def test_the_argparse_commands_name_a_bad_flag_in_one_line(command, prog, args, expected,
                                                            tmp_path):
  """realm-import-hf's flags, the launchers', the demos' and the benches' own, as the absl
  commands do theirs: one line
  (no usage block), exit code 2, a misspelt flag named with the closest one, also where it is
  a required flag's misspelling (argparse says only that the flag is missing); nothing
  written."""
  command = [str(tmp_path / "w") if a == "W" else a for a in command]
  result = subprocess.run([sys.executable, *command, *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  lines = [line for line in result.stderr.splitlines() if "Warning" not in line and line]
  assert result.returncode == 2 and lines == [f"{prog}: error: {expected}"], result.stderr
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("module, prog", [("realm_jax.openqa_eval", "realm-eval"),
                                          ("realm_jax.predict", "realm-predict")])
def test_a_workdir_that_is_not_a_run_is_named_in_one_line(module, prog, tmp_path):
  """A W that does not exist, or holds no run (no config.json, or another program's) or a
  broken record of one, is named as such, as is a negative --step but -1; a misspelt --split
  of realm-eval names the splits, and a --config without a task (realm-prepare's) the task."""
  (tmp_path / "empty").mkdir()
  (tmp_path / "broken").mkdir()
  (tmp_path / "broken" / "config.json").write_text('{"model": {')     # cut short
  (tmp_path / "foreign").mkdir()   # another program's config.json (a Hugging Face model's)
  (tmp_path / "foreign" / "config.json").write_text('{"model_type": "bert", "model": "x"}')
  (tmp_path / "file").write_text("")
  cases = [([f"--workdir={tmp_path}/nowhere"], f"{tmp_path}/nowhere: no such run directory"),
           ([f"--workdir={tmp_path}/file"], f"{tmp_path}/file: a file, not a run directory"),
           ([f"--workdir={tmp_path}/empty"],
            f"{tmp_path}/empty/config.json: not found, so {tmp_path}/empty is not a run "
            "directory"),
           ([f"--workdir={tmp_path}/broken"],
            f"{tmp_path}/broken/config.json: not the JSON a run writes"),
           ([f"--workdir={tmp_path}/foreign"],
            f"{tmp_path}/foreign/config.json: not the config a run writes"),
           ([f"--workdir={tmp_path}/empty", "--step=-3"],
            "--step -3: a checkpoint's step, or -1 for the latest")]
  if prog == "realm-eval":
    cases.append(([f"--workdir={tmp_path}/empty", "--split=tset"],
                  "flag --split=tset: value should be one of <train|dev|test>"))
    cases.append(([f"--workdir={tmp_path}/nowhere", "--config=configs/squad_openqa.py"],
                  f"{tmp_path}/nowhere: no such run directory"))
    cases.append(([f"--workdir={tmp_path}/empty", "--config=configs/prepare.py"],
                  "config.task: missing: not a training config"))   # was an AttributeError
  for args, expected in cases:
    result = subprocess.run([sys.executable, "-m", module, *args,
                             *(["who?"] if prog == "realm-predict" else [])],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (args, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line and line]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: {expected}"), lines


def _argparse_descriptions():
  """(file, the description its ArgumentParser shows) for every script whose description
  is cut from its docstring (`description=__doc__...`)."""
  import ast
  import glob
  for path in sorted(glob.glob(os.path.join(REPO, "**", "*.py"), recursive=True)):
    rel = os.path.relpath(path, REPO)
    if not rel.startswith(("realm_jax/", "launch/", "bench/")):
      continue
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.keyword) and node.arg == "description" and any(
          isinstance(n, ast.Name) and n.id == "__doc__" for n in ast.walk(node.value)):
        shown = eval(compile(ast.Expression(node.value), rel, "eval"),
                     {"__doc__": ast.get_docstring(tree, clean=False)})
        yield rel, " ".join(shown.split())


def test_every_scripts_help_shows_its_first_sentence_whole():
  """`--help` shows the docstring's first sentence, not its first line cut mid-sentence."""
  found = dict(_argparse_descriptions())
  assert "realm_jax/demo_real.py" in found and len(found) >= 10, sorted(found)
  cut = {rel: text for rel, text in found.items() if not text.rstrip(")").endswith(".")}
  assert not cut, cut


@pytest.mark.parametrize("flag, meant", [
    ("--config.steps=3", "; did you mean --config.train.steps?"),   # the group left out
    ("--config.lr=1", "; did you mean --config.train.lr?"),
    ("--config.model.pooling=mean", "; did you mean --config.model.retriever.pooling?"),
    ("--config.batch_size=4", "; did you mean --config.eval.batch_size or "
     "--config.train.batch_size?"),
    ("--config.train.stpes=3", "; did you mean --config.train.steps?"),   # misspelt
    ("--config.trian.steps=3", "; did you mean --config.train.steps?"),
    ("--noconfig.train.shufle", ""),   # nothing close in its group
    ("--config.zzz=1", "")])
def test_a_misplaced_option_is_named_by_the_whole_name_it_meant(monkeypatch, capsys, flag,
                                                               meant):
  """`--config.steps` got "no such option" and nothing more, though train.steps is one;
  `--config.train.stpes` got "did you mean 'steps'?", a name that is no flag."""
  from absl import flags
  from ml_collections import config_flags as ml_config_flags
  from realm_jax.config.overrides import _parse_or_exit
  argv = ["realm-train", "--config", os.path.join(REPO, "configs/demo_realm.py"), flag]
  monkeypatch.setattr(sys, "argv", argv)   # (the config flag takes its overrides from it)
  values = flags.FlagValues()
  ml_config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True)
  with pytest.raises(SystemExit) as exit_:
    _parse_or_exit("realm-train", values, argv)
  assert exit_.value.code == 2
  option = flag.split("=")[0]
  assert capsys.readouterr().err == f"realm-train: error: {option}: no such option{meant}\n"


def test_a_config_file_is_read_for_what_it_says(tmp_path):
  """realm-train, one line each: a field the config file adds (a misspelt assignment, which
  training would ignore), an error of the file's own code (not "no field"), and a realm-prepare
  config; nothing written."""
  make = "\n".join(["import os", "from realm_jax.config.defaults import base_config", "",
                    "def get_config(arg=None):", "  c = base_config()", "  {}", "  return c", ""])
  cases = {"typo": ("c.train.stesp = 100", "config.train.stesp: set by {}, but not an option; "
                    "did you mean 'train.steps'?"),
           "env": ('c.data.dir = os.environ["REALM_JAX_TEST_UNSET"]',
                   "--config {}, line 6: KeyError: 'REALM_JAX_TEST_UNSET'"),
           # (it named the file's base name and line, not the --config given, in Python's words)
           "syntax": ("c.train.steps = (4", "--config {}, line 6: SyntaxError: ")}
  for name, (line, expected) in cases.items():
    (tmp_path / f"{name}.py").write_text(make.format(line))
    result = run_cli(["--config", str(tmp_path / f"{name}.py")], str(tmp_path / "w"))
    assert_clear_error(result, expected.format(tmp_path / f"{name}.py"))
  result = run_cli(["--config", "configs/squad_realm.py:prepare"], str(tmp_path / "w"))
  assert_clear_error(result, "config.task: missing: not a training config")
  result = run_cli(["--config", "configs/demo_ict.py", "--config.train.lr.x.y=1"],
                   str(tmp_path / "w"))
  assert_clear_error(result, "--config.train.lr.x.y: no such option (config.train.lr is a "
                     "float, not a group)")
  assert not os.path.exists(tmp_path / "w")


def test_of_two_config_flags_the_error_names_the_one_read(tmp_path):
  """absl reads the last `--config` (a flagfile's, then the command line's): an error of its
  file names that file, and the line, not the first one given."""
  (tmp_path / "typo.py").write_text("from realm_jax.config.defaults import base_config\n\n"
                                    "def get_config(arg=None):\n  c = base_config()\n"
                                    "  c.train.stesp = 3\n  return c\n")
  cases = [(tmp_path / "typo.py", f"config.train.stesp: set by {tmp_path}/typo.py, but not "
            "an option"), (_broken_config(tmp_path), f"--config {tmp_path}/broken.py, line 5: "
                           "the config has no field 'stepz'")]
  for path, expected in cases:
    result = run_cli(["--config", "configs/demo_ict.py", "--config", str(path)],
                     str(tmp_path / "w"))
    assert_clear_error(result, expected)
  assert not os.path.exists(tmp_path / "w")


def test_a_misspelt_field_of_a_prepare_config_file_is_named(tmp_path):
  """realm-prepare, as realm-train: a field its config file adds (`c.block_lenn = 40`) is one
  line naming it; it prepared the data with the default block_len, saying nothing."""
  path = tmp_path / "prep.py"
  path.write_text("from realm_jax.data.prepare import prepare_config\n\n"
                  "def get_config(arg=None):\n  c = prepare_config()\n  c.block_lenn = 40\n"
                  "  return c\n")
  result = run_entry("realm-prepare", ["--config", str(path), "--config.source=world:30",
                                       f"--config.out_dir={tmp_path}/data"], tmp_path)
  lines = [line for line in result.stderr.splitlines() if "Warning" not in line and line]
  assert result.returncode == 2 and lines == [
      f"realm-prepare: error: config.block_lenn: set by {path}, but not an option; did you "
      "mean 'block_len'?"], result.stderr[-2000:]
  assert not os.path.exists(tmp_path / "data")


def test_versions_kept_are_a_builders_concern():
  """builder.keep_versions bounds what the separate builder keeps: 1 is refused with one
  (the trainer may still read the version before the newest), taken without."""
  from realm_jax.config.validation import validate
  validate(apply_overrides(tiny_config("realm"), {"builder__keep_versions": 1}))   # in_process
  for overrides in ({"retrieval__refresh": "async", "builder__keep_versions": 1},
                    {"builder__keep_versions": 0}):
    with pytest.raises(ConfigError) as refused:
      validate(apply_overrides(tiny_config("realm"), overrides))
    assert refused.value.option == "builder.keep_versions"


@pytest.mark.parametrize("rules", [(4, 2), (("batch", "data"), None)])
def test_mesh_rules_that_are_not_pairs_are_named(rules):
  """A rule that is not a sequence (mesh.shape's sizes given to mesh.rules) was a TypeError
  traceback from validate."""
  from realm_jax.config.validation import validate
  with pytest.raises(ConfigError) as refused:
    validate(apply_overrides(tiny_config("realm"), {"mesh__rules": rules}))
  assert refused.value.option == "mesh.rules", str(refused.value)
  assert "each rule is (logical axis, mesh axis)" in str(refused.value)


def test_a_mesh_rule_for_no_logical_axis_of_the_models_is_named():
  """A misspelt logical axis (("emebd", "data") for FSDP over embed) was taken, and every
  array it meant stayed replicated without a word; each rule now names one of the models'."""
  from realm_jax.config.validation import validate
  rules = (("emebd", "data"), *tiny_config("realm").mesh.rules)
  with pytest.raises(ConfigError, match=r"\('emebd', 'data'\): 'emebd' is no logical axis of "
                     r"the models \(batch, length, .*\); did you mean 'embed'\?"):
    validate(apply_overrides(tiny_config("realm"), {"mesh__rules": rules}))
  validate(apply_overrides(tiny_config("realm"), {"mesh__rules": (("embed", "data"),)}))


@pytest.mark.parametrize("shape", [(8,), (-1, 1, 1), (), (0, 8), (-1, -1), (-2, 4)])
def test_a_mesh_shape_of_no_mesh_is_named_by_validate(shape):
  """A mesh.shape without one size per mesh axis, or with a size 0, passed `validate` (whose
  refusal says "2 integers") and was named only where the mesh was made, after the data was
  opened, and never by the launchers, which validate what they start (a sweep's grid)."""
  from realm_jax.config.validation import validate
  with pytest.raises(ConfigError) as refused:
    validate(apply_overrides(tiny_config("realm"), {"mesh__shape": shape}))
  assert refused.value.option == "mesh.shape", str(refused.value)
  validate(apply_overrides(tiny_config("realm"), {"mesh__shape": [2, -1]}))   # a JSON record's


def test_integers_are_read_exactly_at_any_size():
  from realm_jax.config.overrides import typed_value
  assert typed_value("1732790000123456789", 0, "seed") == 1732790000123456789
  assert typed_value("1e3", 0, "seed") == 1000 and typed_value("-3", 0, "seed") == -3
  for text in ("1.5", "1e20", "nan", "x"):
    with pytest.raises(ConfigError):
      typed_value(text, 0, "seed")


def test_options_of_a_runs_own_config_are_set_from_the_command_line(tmp_path):
  """Without --config, realm-eval's and realm-predict's --config.KEY=VALUE options set the
  run's W/config.json (typed as its fields); a misspelt one, a bare flag of a value, a JSON
  --config file and a stray argument are one line each, exit 2."""
  from realm_jax.config.overrides import apply_run_overrides, split_run_overrides
  argv = ["p", "--workdir=W", "--config.qa.test=nq_open:x.jsonl", "q?",
          "--noconfig.model.share_towers", "--", "--config.a=b", "--config", "c.py"]
  rest, found = split_run_overrides(argv)   # (a --config after -- is a question)
  assert rest == ["p", "--workdir=W", "q?", "--", "--config.a=b", "--config", "c.py"]
  assert found == [("--config.qa.test", "qa.test", "nq_open:x.jsonl", False),
                   ("--noconfig.model.share_towers", "model.share_towers", None, True)]
  assert split_run_overrides(["--config", "c.py"] + argv) == (["--config", "c.py"] + argv, [])
  assert split_run_overrides(["p", "--config=c.py", "--config.a=b"], config_flag=False) == (
      ["p", "--config=c.py"], [("--config.a", "a", "b", False)])
  config = apply_run_overrides(tiny_config("openqa"), [
      ("--config.data.dir", "data.dir", "/moved", False),
      ("--config.qa.reader_beam", "qa.reader_beam", "2", False),
      ("--noconfig.model.share_towers", "model.share_towers", None, True)])
  assert (config.data.dir, config.qa.reader_beam, config.model.share_towers) == (
      "/moved", 2, False)
  for negated, message in (   # --no of a string (with a value too); --no with a value
      ([("--noconfig.data.dir", "data.dir", None, True)],
       "--noconfig.data.dir: config.data.dir is not a boolean; set it with "
       "--config.data.dir=VALUE"),
      ([("--noconfig.data.dir", "data.dir", "/moved", True)],
       "--noconfig.data.dir: config.data.dir is not a boolean"),
      ([("--noconfig.model.share_towers", "model.share_towers", "true", True)],
       "--noconfig.model.share_towers=true: --no takes no value")):
    with pytest.raises(ConfigError, match=re.escape(message)):
      apply_run_overrides(tiny_config("openqa"), negated)
  workdir_lib.write_config(str(tmp_path / "w"), tiny_config("openqa"))
  cases = [(["--config.qa.tst=x"], "--config.qa.tst: 'qa.tst' is not a field of the config; "
            "the closest is 'qa.test'"),
           (["--config.qa.test"], "--config.qa.test takes a value: --config.qa.test=VALUE"),
           (["--config.qa.reader_beam=two"], "config.qa.reader_beam: 'two' is not a number")]
  json_config = ["--config", str(tmp_path / "w" / "config.json")]
  for module, prog, extra, more in (
      ("realm_jax.openqa_eval", "realm-eval", [], [
          (json_config, f"--config {tmp_path}/w/config.json: a JSON file (a run's "
           "W/config.json?); --config takes a Python config file"),
          (["stray"], "unexpected argument(s) ['stray']")]),
      ("realm_jax.predict", "realm-predict", ["who?"], [
          (json_config, f"--config {tmp_path}/w/config.json: realm-predict reads the run's "
           "own W/config.json; set its options with --config.KEY=VALUE")])):
    for args, expected in cases + more:
      result = subprocess.run([sys.executable, "-m", module, f"--workdir={tmp_path}/w", *args,
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
      assert result.returncode == 2, (args, result.stderr[-2000:])
      lines = [line for line in result.stderr.splitlines() if "Warning" not in line and line]
      assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: {expected}"), lines


def test_a_mesh_given_on_the_command_line_is_not_replaced_by_a_fitted_one(tmp_path):
  """realm-eval / realm-predict fit the run's own recorded mesh to this machine's 8 devices;
  a `--config.mesh.shape` given on the command line is the user's, kept as given (one that does
  not fit is refused when the mesh is made), not silently replaced by (-1, 1)."""
  from realm_jax.openqa_eval import evaluation_config
  workdir_lib.write_config(str(tmp_path / "w"), tiny_config("openqa", mesh__shape=(16, 1)))
  assert tuple(evaluation_config(str(tmp_path / "w")).mesh.shape) == (-1, 1)
  given = [("--config.mesh.shape", "mesh.shape", "(3,1)", False)]
  assert tuple(evaluation_config(str(tmp_path / "w"), given).mesh.shape) == (3, 1)


@pytest.mark.parametrize("empty", ["  ", "\u200b\u200d\u00ad"])   # blank; nothing read
def test_realm_predict_refuses_an_empty_question(tmp_path, empty):
  """Before anything is loaded (`--workdir` is not even a run)."""
  result = subprocess.run([sys.executable, "-m", "realm_jax.predict", "--workdir",
                           str(tmp_path), "who?", empty], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip() == "realm-predict: error: question 2 is empty: ask something"


def test_help_succeeds_and_a_get_config_without_a_configdict_is_one_line(tmp_path):
  """`realm-train --help && ...` goes on (absl's --help exits 1); a config file whose
  get_config returns a dict or None is named, not an AttributeError traceback later."""
  helped = subprocess.run([sys.executable, "-m", "realm_jax.train.main", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert helped.returncode == 0 and "--workdir" in helped.stdout, helped.stderr[-2000:]
  for returned in ("{'task': 'ict'}", "None"):
    path = tmp_path / "returns.py"
    path.write_text(f"def get_config(arg=None):\n  return {returned}\n")
    result = run_cli(["--config", str(path)], str(tmp_path / "w"))
    assert_clear_error(result, f"--config {path}: get_config() returned "
                       f"{'dict' if returned != 'None' else 'NoneType'}, not an "
                       "ml_collections.ConfigDict")


@pytest.mark.parametrize("module", ["realm_jax.train.main", "realm_jax.predict"])
def test_dash_h_is_help_as_in_every_other_command(module):
  """`-h` shows the help and exits 0, as it does in the argparse commands (local.py, sweep.py,
  realm-import-hf, the demos); absl has no `-h` and refused it as an unknown flag (exit 2)."""
  helped = subprocess.run([sys.executable, "-m", module, "-h"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
  assert helped.returncode == 0 and "--workdir" in helped.stdout, helped.stderr[-2000:]


def console_scripts() -> dict[str, str]:
  """setup.py's console scripts: {command: "module:function"}."""
  with open(os.path.join(REPO, "setup.py")) as f:
    return dict(re.findall(r'"(realm-[\w-]+)=([\w.]+:\w+)"', f.read()))


def test_every_installed_commands_help_shows_its_docstring_and_flags(tmp_path):
  """An installed command runs pip's wrapper script as __main__, from anywhere: its --help
  shows the command's own docstring and flags (absl's showed the wrapper's: none of either)."""
  commands = console_scripts()
  assert len(commands) == 6, commands
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
  for command, target in commands.items():
    module, _, function = target.partition(":")
    script = tmp_path / command   # what pip writes into the environment's bin/
    script.write_text(f"import re\nimport sys\nfrom {module} import {function}\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      f"    sys.exit({function}())\n")
    result = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    first = " ".join(importlib.import_module(module).__doc__.splitlines()[0].split())
    assert result.returncode == 0, (command, result.stderr[-2000:])
    assert first in " ".join(result.stdout.split()), (command, first, result.stdout[-2000:])
    assert re.search(r"^ +--\w", result.stdout, re.M), (command, result.stdout[-2000:])


def test_path_errors_name_both_paths_and_a_full_disk_is_one_line(tmp_path):
  """What run_cli prints for an OSError: a rename names both paths, EEXIST says whether the
  path is a directory, and a full disk written through an open file (no filename) is still
  one line; another OSError is not one of these (it keeps its traceback)."""
  import errno
  from realm_jax.errors import path_error, unusable_path
  (tmp_path / "afile").write_text("")
  cases = [(OSError(errno.EACCES, "Permission denied", "/a", None, "/b"),
            "/a -> /b: Permission denied"),
           (FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "afile")),
            f"{tmp_path / 'afile'}: exists and is not a directory"),
           (FileExistsError(errno.EEXIST, "File exists", str(tmp_path)), f"{tmp_path}: exists"),
           (OSError(errno.ENOSPC, "No space left on device"),
            "No space left on device: free space (or quota) where the run writes")]
  for error, line in cases:
    assert unusable_path(error) and path_error(error).startswith(line), path_error(error)
  assert not unusable_path(OSError(errno.EPIPE, "Broken pipe"))
  assert not unusable_path(OSError(errno.EACCES, "Permission denied"))   # no path to name


def test_an_old_option_name_is_one_warning_line(tmp_path):
  """Not Python's `FILE:LINE: RenamedOptionWarning: ...` and the source line under it."""
  result = run_entry("realm-train", ["--config", "configs/demo_ict.py",
                                     "--config.retrieval.mode=index", "--config.train.stepz=1"],
                     tmp_path)
  assert result.stderr.splitlines() == [
      "warning: --config.retrieval.mode is now config.retrieval.candidates; read as "
      "config.retrieval.candidates",
      "realm-train: error: --config.train.stepz: no such option; did you mean "
      "--config.train.steps?"]


def test_a_second_trainer_or_builder_on_a_workdir_is_refused_naming_the_first(world_dir,
                                                                             tmp_path):
  """A second trainer resumed the first one's workdir and deleted its checkpoint in the
  making; a second realm-index deleted the first one's staging dir. Each is now refused
  before it writes anything, naming the pid that holds W/<job>.lock; the lock is given up
  when the job ends, however it ends."""
  from realm_jax.retrieval.builder import IndexBuilder
  from realm_jax.train.loop import train
  workdir = str(tmp_path / "w")
  first = workdir_lib.JobLock(workdir, "trainer")
  first.acquire()                           # a live trainer (flock: even in this process)
  config = tiny_config("ict", None, world_dir, train__steps=2)
  with pytest.raises(ConfigError, match=rf"{workdir} is in use: a trainer \(pid {os.getpid()}\) "
                     r"runs on it and holds .*trainer\.lock; stop it first"):
    train(config, workdir)
  assert not os.path.exists(os.path.join(workdir, "config.json"))
  assert workdir_lib.job_holding(workdir, "trainer") == str(os.getpid())
  first.release()
  assert workdir_lib.job_holding(workdir, "trainer") is None
  assert train(config, workdir)["steps"] == 2
  with pytest.raises(ConfigError, match="train.steps"):   # nor after a refused run
    train(tiny_config("ict", None, world_dir, train__steps=1), workdir)
  assert workdir_lib.job_holding(workdir, "trainer") is None
  realm = tiny_config("realm", None, world_dir, retrieval__refresh="async")
  other = str(tmp_path / "realm")
  with workdir_lib.JobLock(other, "builder") as held:
    held.acquire()
    with pytest.raises(ConfigError, match=r"is in use: a builder \(pid \d+\)"):
      IndexBuilder(realm, other)
  builder = IndexBuilder(realm, other)
  try:
    assert workdir_lib.job_holding(other, "builder") == str(os.getpid())
  finally:
    builder.close()
  assert workdir_lib.job_holding(other, "builder") is None


def test_a_ctrl_c_swallowed_in_a_gc_callback_stops_the_run_at_the_next_step(world_dir, tmp_path,
                                                                            monkeypatch):
  """Python ignores a KeyboardInterrupt raised inside a garbage collector's callback (JAX
  installs one): the Ctrl-C recorded by run_cli's handler is raised again before the next
  step, and run_cli gives the caller its SIGINT handler back."""
  import signal
  from realm_jax import errors
  from realm_jax.train.loop import train
  before = signal.signal(signal.SIGINT, signal.default_int_handler)   # as in a CLI
  try:
    assert errors.run_cli("prog", lambda: signal.getsignal(signal.SIGINT)) is errors._on_sigint
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    signal.signal(signal.SIGINT, before)
  monkeypatch.setattr(errors, "_INTERRUPTS", [signal.SIGINT])   # one was swallowed
  with pytest.raises(KeyboardInterrupt):
    train(tiny_config("ict", None, world_dir, train__steps=2), str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w" / "summary.json")
  import json                               # its seconds are counted (a demo's stage_seconds)
  assert json.load(open(tmp_path / "w" / "wall.json"))["runs"] == 1


def sigint_default() -> None:
  """In the child: SIGINT as a shell gives it (an xdist worker ignores it, and a process
  started with it ignored keeps ignoring it: Python installs no handler then)."""
  import signal
  signal.signal(signal.SIGINT, signal.SIG_DFL)


INTERRUPTED_IMPORT = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from realm_jax import errors
errors.take_interrupts()                 # as `python -m realm_jax.train.main` does
import interrupts_itself                 # a Ctrl-C lands inside this import
print("imported", flush=True)
errors.run_cli("prog", lambda: print("main ran", flush=True))
"""


def test_a_ctrl_c_inside_an_import_is_one_line_and_ends_the_job(tmp_path):
  """A Ctrl-C raised inside an import could break a C extension's initialisation (a 60-line
  ImportError traceback, exit code 1) or be lost in a gc callback: it is recorded there and
  raised by run_cli before the job's work, as one line, the process ending by SIGINT."""
  import signal
  (tmp_path / "interrupts_itself.py").write_text(
      "import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nx = [1] * 10\n")
  result = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60, preexec_fn=sigint_default)
  assert result.returncode == -signal.SIGINT, result.stderr
  assert result.stdout == "imported\n" and result.stderr == "\nprog: interrupted\n"


def test_a_ctrl_c_in_a_gc_callback_is_recorded_without_a_traceback(monkeypatch, capsys):
  import gc
  import signal
  import threading
  from realm_jax import errors
  monkeypatch.setattr(errors, "_INTERRUPTS", [])
  monkeypatch.setattr(errors, "_UNRAISED", threading.Event())   # this process's run_cli calls

  def _xla_gc_callback(phase, info):   # JAX's callback's name; two Ctrl-Cs as it starts
    if phase == "start":
      errors._on_sigint(signal.SIGINT, sys._getframe())
      errors._on_sigint(signal.SIGINT, sys._getframe())   # not raised either: it would be lost
  gc.callbacks.append(_xla_gc_callback)
  try:
    gc.collect()
  finally:
    gc.callbacks.remove(_xla_gc_callback)
  assert errors._INTERRUPTS and "Exception ignored" not in capsys.readouterr().err
  with pytest.raises(KeyboardInterrupt):
    errors.raise_if_interrupted()
  assert not errors.in_gc_callback(sys._getframe()) and not errors.in_import(sys._getframe())


def test_a_start_refused_after_the_checkpointer_opened_closes_it(world_dir, tmp_path,
                                                                  monkeypatch):
  """A bad init source is found once the run holds Orbax's checkpoint manager: it is closed
  before the error goes up (its cleanup thread printed a 40-line traceback at exit)."""
  from realm_jax.train import run as run_lib
  from realm_jax.train.loop import train
  closed, close = [], run_lib.Checkpointer.close
  monkeypatch.setattr(run_lib.Checkpointer, "close",
                      lambda self: (closed.append(self.directory), close(self)))
  config = tiny_config("realm", None, world_dir, init__from_workdir=str(tmp_path / "nowhere"))
  with pytest.raises(ConfigError, match="init.from_workdir"):
    train(config, str(tmp_path / "w"))
  assert len(closed) == 1, closed


@pytest.mark.parametrize("task", ["ict", "openqa"])
def test_export_best_outside_realm_is_refused(task):
  """It chose by REALM's retrieval utility; ICT and Open-QA ignored it without a word."""
  from realm_jax.config.validation import validate
  config = tiny_config("ict" if task == "ict" else "realm", eval__export_best=True)
  config.task = task
  with pytest.raises(ConfigError, match=rf"^config\.eval\.export_best: REALM's only .* task "
                     rf"'{task}' would ignore it"):
    validate(config)


CTRL_C_IN_A_JOB_IMPORT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from realm_jax import errors
def job():
  import interrupts_itself          # Ctrl-C lands inside this import (times: in its file)
  print("imported", flush=True)
  if sys.argv[2] == "polls":
    errors.raise_if_interrupted()   # as realm-train / realm-index / realm-eval / a sweep do
  time.sleep(0.5)                   # what a launcher does next (starting machines, say)
  print("launched", flush=True)
errors.run_cli("prog", job)
"""


@pytest.mark.parametrize("times, polls, printed", [
    (1, "polls", "imported\n"),               # raised where the job polls after its imports
    (2, "polls", ""),                         # the second one raised inside the import
    (1, "no", "imported\nlaunched\n")])       # raised when the job ends (it was exit 0)
def test_a_ctrl_c_inside_a_jobs_import_is_not_lost(tmp_path, times, polls, printed):
  """Recorded inside the import, the Ctrl-C is raised where the job polls for it, else at its
  end (it was lost: the job went on and exited 0); a second Ctrl-C raises at once (an import
  that hangs still stops)."""
  import signal
  (tmp_path / "interrupts_itself.py").write_text(
      "import os, signal, time\nfor _ in range(%d):\n  os.kill(os.getpid(), signal.SIGINT)\n"
      "  time.sleep(0.2)\n" % times)
  result = subprocess.run([sys.executable, "-c", CTRL_C_IN_A_JOB_IMPORT, str(tmp_path), polls],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          preexec_fn=sigint_default)
  assert result.returncode == -signal.SIGINT, result.stderr
  assert result.stdout == printed
  assert result.stderr == "\nprog: interrupted\n"


@pytest.mark.parametrize("overrides, option", [
    ({"retrieval__candidates": "mixed", "train__retriever_lr_scale": 0.0,
      "retrieval__loss": "distill"}, "retrieval.loss"),   # a KL of 0
    ({"retrieval__candidates": "null_only", "train__retriever_lr_scale": 0.0,
      "eval__export_best": True}, "eval.export_best"),    # utility 0: W/best never moves
])
def test_what_a_retriever_that_scores_nothing_would_ignore_is_refused_for_training(
    overrides, option):
  """Candidates the retriever does not score: a retriever loss or a best export would act on
  nothing. Refused for training only: realm-eval and realm-predict still read such a record."""
  from realm_jax.config.validation import validate, validate_training
  config = tiny_config("realm", **overrides)
  validate(config)
  with pytest.raises(ConfigError) as refused:
    validate_training(config)
  assert refused.value.option == option, str(refused.value)


def test_a_distillation_temperature_of_infinity_is_refused():
  from realm_jax.config.validation import validate
  with pytest.raises(ConfigError) as refused:   # a flat target; NaN at -inf
    validate(tiny_config("realm", retrieval__loss="distill",
                         retrieval__distill_temperature=float("inf")))
  assert refused.value.option == "retrieval.distill_temperature", str(refused.value)


@pytest.mark.parametrize("candidates", ["own_block", "mixed", "null_only"])
def test_a_retriever_learning_rate_with_candidates_it_does_not_score_is_warned_of(candidates):
  """p(z|x) is fixed: a retriever scale other than 0 only weight-decays the retriever and
  keeps Adam's moments for it. Warned at training, not refused (the scale decides which
  parameters a run's checkpoints hold optimizer state for: a run recorded so resumes and is
  evaluated as it was)."""
  from realm_jax.config.validation import training_warnings, validate, validate_training
  config = tiny_config("realm", retrieval__candidates=candidates,
                       train__retriever_lr_scale=0.15)
  validate(config)
  validate_training(config)
  [line] = training_warnings(config)
  assert line.startswith(f"config.train.retriever_lr_scale 0.15: retrieval.candidates "
                         f"{candidates!r} gives the retriever no gradient"), line
  config.train.retriever_lr_scale = 0.0
  assert training_warnings(config) == []


@pytest.mark.parametrize("candidates", ["own_block", "null_only"])
def test_ict_training_refuses_the_candidates_of_realms_warm_ups(candidates):
  """ICT's candidates are its batch's own blocks: retrieval.candidates 'own_block' or
  'null_only' (a config of REALM's warm-up run as task ict) was ignored without a word, where
  'mixed' was refused. Refused for training (realm-eval still reads a run recorded so)."""
  from realm_jax.config.validation import validate, validate_training
  config = apply_overrides(_task_config("ict"), {"retrieval__candidates": candidates})
  validate(config)
  with pytest.raises(ConfigError) as refused:
    validate_training(config)
  assert refused.value.option == "retrieval.candidates", str(refused.value)
  assert "task 'ict' would ignore it" in str(refused.value), str(refused.value)


@pytest.mark.parametrize("task, reader_len, says", [
    ("openqa", -1, "-1 cannot hold [CLS] question [SEP] (data.query_len 16), a body "
     "wordpiece and [SEP]: give >= 18, or 0 for query_len + block_len - 2"),
    ("openqa", 17, "17 cannot hold"),                  # query_len 16 + 2 at least
    ("openqa", 129, "129 > model.max_position 128, the reader's position embeddings"),
    ("realm", 320, "sets the Open-QA reader's length: task 'realm' would ignore it"),
])
def test_a_reader_length_it_cannot_read_is_refused(task, reader_len, says):
  """qa.reader_len: 0 (the whole pair) or from the question's row plus a body wordpiece and
  [SEP] up to the reader's positions (128 in the tiny model), on Open-QA only."""
  from realm_jax.config.validation import validate
  for good in (0, 18, 128):
    validate(apply_overrides(_task_config("openqa"), {"qa__reader_len": good}))
  config = _task_config(task)
  config.qa.reader_len = reader_len
  with pytest.raises(ConfigError) as refused:
    validate(config)
  assert refused.value.option == "qa.reader_len", str(refused.value)
  assert says in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


@pytest.mark.parametrize("task", ["ict", "realm", "openqa"])
@pytest.mark.parametrize("beams, option", [
    ({"qa__reader_beam": 0}, "qa.reader_beam"), ({"qa__reader_beam": -1}, "qa.reader_beam"),
    ({"qa__searcher_beam": 4}, "qa.searcher_beam"),   # < reader_beam 5
    ({"model__max_span_width": 0}, "model.max_span_width"),
    ({"model__span_hidden_size": 0}, "model.span_hidden_size")])
def test_beams_realm_eval_cannot_read_are_refused_for_every_task(task, beams, option):
  """realm-eval reads qa.reader_beam and qa.searcher_beam for a pre-training run too (its
  retrieval-only evaluation: answer_in_top_k, the blocks each prediction lists); they were
  checked for task openqa alone, so a reader_beam of 0 reported every question's answer
  missing from the top 0, and one of -1 read every block retrieved but the last. The span
  sizes alike (a max_span_width of 0: a ValueError traceback from its span candidates)."""
  from realm_jax.config.validation import validate
  with pytest.raises(ConfigError) as refused:
    validate(apply_overrides(_task_config(task), beams))
  assert refused.value.option == option, str(refused.value)


def _task_config(task: str):
  """The tiny config of `task` ('warmup': REALM's reader warm-up; 'openqa': on REALM's)."""
  config = tiny_config("ict") if task == "ict" else tiny_config(
      "realm", "warmup" if task == "warmup" else None)
  if task == "openqa":
    config.task = "openqa"
  return config


@pytest.mark.parametrize("task, overrides, says", [
    ("ict", {"train__retriever_lr_scale": 0.0}, "train.retriever_lr_scale is 0"),
    ("realm", {"train__retriever_lr_scale": 0.0, "train__reader_lr_scale": 0.0},
     "train.retriever_lr_scale and train.reader_lr_scale are both 0"),
    ("warmup", {"train__reader_lr_scale": 0.0}, "are both 0"),
    ("openqa", {"train__retriever_lr_scale": 0.0, "train__reader_lr_scale": 0.0},
     "are both 0"),
])
def test_a_training_run_that_would_train_nothing_is_refused(task, overrides, says):
  """Every trained half at learning rate scale 0: the run stepped without changing a
  parameter. Refused for training only: realm-eval still evaluates such a recorded run."""
  from realm_jax.config.validation import validate, validate_training
  config = _task_config(task)
  validate_training(config)
  config = apply_overrides(config, overrides)
  validate(config)
  with pytest.raises(ConfigError) as refused:
    validate_training(config)
  last_part = "retriever" if task == "ict" else "reader"
  assert refused.value.option == f"train.{last_part}_lr_scale", str(refused.value)
  assert says in str(refused.value), str(refused.value)


def test_an_ict_batch_of_one_query_is_refused_for_training():
  """ICT's softmax is over the batch's blocks (each query's negatives are the others'): a
  train.batch_size of 1 (a single device divides it) gave loss 0 and a zero gradient at every
  step, a run that trained nothing but reported ict_accuracy 1. REALM reads its candidates
  from the index and trains on one query a batch."""
  import jax
  import numpy as np
  from realm_jax.config.validation import validate, validate_training
  from realm_jax.models.losses import ict_loss
  query, block = np.ones((1, 4), np.float32), np.full((1, 4), 0.5, np.float32)
  loss, grads = jax.value_and_grad(lambda q, b: ict_loss(q, b)[0], (0, 1))(query, block)
  assert float(loss) == 0 and not any(np.asarray(g).any() for g in grads)
  config = apply_overrides(_task_config("ict"), {"train__batch_size": 1})
  validate(config)   # (realm-eval still reads such a recorded run)
  with pytest.raises(ConfigError) as refused:
    validate_training(config)
  assert refused.value.option == "train.batch_size", str(refused.value)
  for task in ("ict", "realm"):
    validate_training(apply_overrides(_task_config(task), {"train__batch_size": 2}))
  validate_training(apply_overrides(_task_config("realm"), {"train__batch_size": 1}))


def test_ict_without_block_gradients_is_refused_for_training():
  """retrieval.block_gradients False freezes REALM's block tower (its candidates scored with
  the index's embeddings); ICT embeds its in-batch blocks in the step and trains both towers
  whatever it says: the option was ignored without a word. realm-eval still reads a run
  recorded so; REALM's warm-ups freeze the tower with it."""
  from realm_jax.config.reading import frozen_paths
  from realm_jax.config.validation import validate, validate_training
  config = apply_overrides(_task_config("ict"), {"retrieval__block_gradients": False})
  assert frozen_paths(config) == (("reader",),)   # (the block tower trains)
  validate(config)
  with pytest.raises(ConfigError) as refused:
    validate_training(config)
  assert refused.value.option == "retrieval.block_gradients", str(refused.value)
  for task in ("realm", "warmup", "openqa"):
    validate_training(apply_overrides(_task_config(task), {"retrieval__block_gradients": False}))


def test_ict_with_a_reader_learning_rate_is_warned_of():
  """ICT's reader gets no gradient: a learning rate there only weight-decayed it and kept
  Adam's moments for it. Warned (a run recorded so resumes as it was), once, naming the option;
  the configs' ICT (reader scale 0) and REALM runs get no warning."""
  from realm_jax.config.validation import training_warnings, validate_training
  assert training_warnings(_task_config("ict")) == []
  assert training_warnings(_task_config("realm")) == []
  config = apply_overrides(_task_config("ict"), {"train__reader_lr_scale": 1.0})
  validate_training(config)
  [line] = training_warnings(config)
  assert line.startswith("config.train.reader_lr_scale 1.0: ICT gives the reader no gradient")

"""Cloud launchers: `launch/tpu_pod.py`, `launch/gke/render.py`, `sweep.py --launcher tpu_pod`.

No cloud, gcloud or kubectl is needed: the dry-run commands are checked line by line, the remote
start/stop scripts run in a local bash against a stand-in job, and a stand-in `gcloud` on PATH
records what the real runs call.
"""

import csv
import importlib.util
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap

import pytest
import yaml

from realm_jax.errors import ConfigError
from tests.helpers import CONFIGS, REPO

LAUNCH = os.path.join(REPO, "launch")
REALM_BASE = os.path.join(CONFIGS, "realm_base.py")
G = "gcloud compute tpus tpu-vm"
WHERE = ["--zone", "us-central2-b", "--project", "my-project"]
Z = " ".join(WHERE)
SLICES = ["--name", "realm", *WHERE]
# realm_base.py starts its retriever from the ICT run and its reader from BERT-base: in buckets
INIT = ["--set", "init.retriever=gs://my-bucket/realm/ict",
        "--set", "init.reader=gs://my-bucket/bert-base-uncased"]
RUN = ["--config", REALM_BASE, "--workdir", "gs://my-bucket/realm/realm",
       "--set", "data.dir=gs://my-bucket/realm/data", "--set", "retrieval.refresh=async",
       *INIT]
JOB_FLAGS = ("--config configs/realm_base.py --workdir /gcs/my-bucket/realm/realm "
             "--multihost=auto --config.data.dir=/gcs/my-bucket/realm/data "
             "--config.retrieval.refresh=async --config.init.retriever=/gcs/my-bucket/realm/ict "
             "--config.init.reader=/gcs/my-bucket/bert-base-uncased")
# --storage gcs (the default): the jobs get the gs:// paths as they are
GCS_FLAGS = ("--config configs/realm_base.py --workdir gs://my-bucket/realm/realm "
             "--multihost=auto --config.data.dir=gs://my-bucket/realm/data "
             "--config.retrieval.refresh=async --config.init.retriever=gs://my-bucket/realm/ict "
             "--config.init.reader=gs://my-bucket/bert-base-uncased")
FUSE = ["--storage", "gcsfuse"]
WHEEL = os.path.join(REPO, "build", "tpu_pod", "realm_jax-0.1.0-py3-none-any.whl")


def _load(name: str, path: str):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module             # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


tpu_pod = _load("_test_tpu_pod", os.path.join(LAUNCH, "tpu_pod.py"))
render = _load("_test_gke_render", os.path.join(LAUNCH, "gke", "render.py"))
sweep = _load("_test_sweep_cloud", os.path.join(LAUNCH, "sweep.py"))


def _dry_run(capsys, *argv: str) -> list[str]:
  assert tpu_pod.main([*argv, "--dry-run"]) == 0
  return capsys.readouterr().out.splitlines()


def _remote_script(line: str, name: str, worker: str = "all") -> str:
  """The --command of a `gcloud ... ssh NAME` line, after checking the rest of the line."""
  argv = shlex.split(line)
  assert argv[:12] == [*G.split(), "ssh", name, *WHERE, f"--worker={worker}", "--command"]
  assert len(argv) == 13
  return argv[12]


def test_up_dry_run_prints_create_install_and_start_for_both_slices(capsys):
  lines = _dry_run(capsys, "up", *SLICES, *RUN, *FUSE)
  create = ("--version=tpu-ubuntu2204-base --scopes=https://www.googleapis.com/auth/cloud-platform"
            "  # only if the describe finds no such TPU")
  here = tpu_pod.local_path
  # the wheel first: a checkout that does not build costs no slice (it was built after both
  # slices were created)
  assert lines[0] == shlex.join([here(sys.executable), "-m", "pip", "wheel", "--no-deps", "-q",
                                 "-w", here(os.path.dirname(WHEEL)), here(REPO)])
  assert lines[1:5] == [
      f"{G} describe realm-trainer {Z} --format 'value(state,acceleratorType)'",
      f"{G} create realm-trainer {Z} --accelerator-type=v4-32 {create}",
      f"{G} describe realm-builder {Z} --format 'value(state,acceleratorType)'",
      f"{G} create realm-builder {Z} --accelerator-type=v4-8 {create}"]
  for i, name in ((5, "realm-trainer"), (6, "realm-builder")):   # before anything is copied
    assert _remote_script(lines[i], name) == tpu_pod.idle_script()
  for i, name in ((7, "realm-trainer"), (9, "realm-builder")):
    assert lines[i] == (f"{G} scp {here(WHEEL)} {here(CONFIGS)} '{name}:~/' {Z} --worker=all "
                        "--recurse")
    install = _remote_script(lines[i + 1], name)
    assert "python3.11 -m venv $HOME/realm_env" in install
    assert '"$HOME/realm_jax-0.1.0-py3-none-any.whl[tpu]"' in install
    assert "gcsfuse --implicit-dirs my-bucket /gcs/my-bucket" in install
  trainer = _remote_script(lines[11], "realm-trainer")
  builder = _remote_script(lines[12], "realm-builder")
  assert (f"nohup $HOME/realm_env/bin/realm-train {JOB_FLAGS} >> $HOME/realm_logs/trainer.log "
          "2>&1 < /dev/null & echo $! > $HOME/realm_logs/trainer.pid") in trainer
  assert (f"nohup $HOME/realm_env/bin/realm-index {JOB_FLAGS} >> $HOME/realm_logs/builder.log "
          "2>&1 < /dev/null & echo $! > $HOME/realm_logs/builder.pid") in builder
  assert len(lines) == 13
  for line in lines:       # every line is one shell command, and every remote script parses
    argv = shlex.split(line, comments=True)
    if "--command" in argv:
      script = argv[argv.index("--command") + 1]
      assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0, script


def test_the_wheel_command_builds_the_wheel_install_copies(tmp_path):
  """install's `pip wheel` in this environment (whose setuptools may lack `wheel`): it builds
  the file that is copied to the workers, with the package in it."""
  import zipfile
  argv = tpu_pod.wheel_command(str(tmp_path))
  built = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
  if built.returncode != 0 and "bdist_wheel" not in built.stderr:
    pytest.skip(f"pip could not fetch the build backend: {built.stderr.strip()[-200:]}")
  assert built.returncode == 0, built.stderr
  with zipfile.ZipFile(tmp_path / tpu_pod.wheel_name()) as wheel:
    assert "realm_jax/__init__.py" in wheel.namelist()


def test_the_build_copy_of_the_package_holds_only_its_sources(tmp_path):
  """setup.py's build_py (which `pip wheel` of this checkout runs into build/lib): a module an
  earlier build left there, since removed from the sources, is not copied into the wheel."""
  stale = tmp_path / "realm_jax" / "removed_module.py"
  stale.parent.mkdir()
  stale.write_text("X = 1\n")
  built = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib",
                          str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=REPO)
  assert built.returncode == 0, built.stderr
  assert (tmp_path / "realm_jax" / "train" / "main.py").is_file()
  assert not stale.exists()


def test_an_image_of_the_checkout_leaves_out_what_git_leaves_out():
  """.dockerignore (the build context of docs/launch.md's image, `COPY . /src`) holds every
  line of .gitignore (.venv, runs/, build/ ...) and git's own folder."""
  def patterns(name):
    with open(os.path.join(REPO, name)) as f:
      return {line.strip() for line in f if line.strip() and not line.startswith("#")}
  assert patterns(".gitignore") <= patterns(".dockerignore"), (
      patterns(".gitignore") - patterns(".dockerignore"))
  assert ".git" in patterns(".dockerignore")


def test_with_native_gcs_the_jobs_get_the_urls_and_nothing_is_mounted(capsys, tmp_path):
  lines = _dry_run(capsys, "up", *SLICES, *RUN)
  assert len(lines) == 13
  for i, name in ((8, "realm-trainer"), (10, "realm-builder")):
    install = _remote_script(lines[i], name)
    assert '"$HOME/realm_jax-0.1.0-py3-none-any.whl[tpu]"' in install
    assert "gcsfuse" not in install and "mountpoint" not in install
  for line, (name, entry) in zip(lines[11:], (("realm-trainer", "realm-train"),
                                             ("realm-builder", "realm-index"))):
    start = _remote_script(line, name)
    assert f"nohup $HOME/realm_env/bin/{entry} {GCS_FLAGS} >>" in start
    assert "mountpoint" not in start and "/gcs/" not in start
  manifest = _render(tmp_path, *GKE_RUN)
  for job in manifest["spec"]["replicatedJobs"]:
    pod = job["template"]["spec"]["template"]
    assert "metadata" not in pod and "volumes" not in pod["spec"]
    (container,) = pod["spec"]["containers"]
    assert "volumeMounts" not in container
    assert shlex.join(container["command"]).endswith(GCS_FLAGS)


def test_each_slice_gets_the_image_of_its_family_unless_one_is_given(capsys):
  def versions(*argv):
    lines = _dry_run(capsys, "create", *SLICES, *RUN, *argv)
    return [re.search(r"--version=(\S+)", l).group(1) for l in lines if " create " in l]

  assert versions() == ["tpu-ubuntu2204-base", "tpu-ubuntu2204-base"]
  assert versions("--trainer_type", "v5litepod-16", "--builder_type", "v6e-4",
                  "--set", "mesh.shape=(-1, 1)") == ["v2-alpha-tpuv5-lite", "v2-alpha-tpuv6e"]
  assert versions("--trainer_type", "v5p-32", "--set", "mesh.shape=(-1, 1)") == [
      "v2-alpha-tpuv5", "tpu-ubuntu2204-base"]
  assert versions("--runtime_version", "my-image") == ["my-image", "my-image"]


def test_stop_sends_sigterm_tail_follows_worker_0_and_delete_is_quiet(capsys):
  stop = _dry_run(capsys, "stop", *SLICES)
  assert len(stop) == 2
  for line, job in zip(stop, ("trainer", "builder")):
    script = _remote_script(line, f"realm-{job}")
    assert f"p=$(cat $HOME/realm_logs/{job}.pid" in script
    assert 'kill -TERM "$p"' in script and "KILL" not in script and "-9" not in script
  assert _dry_run(capsys, "delete", *SLICES) == [
      f"{G} delete realm-trainer {Z} --quiet", f"{G} delete realm-builder {Z} --quiet"]
  tail = _dry_run(capsys, "tail", *SLICES, "--job", "builder")
  assert _remote_script(tail[0], "realm-builder", "0") == \
      "tail -n 100 -F $HOME/realm_logs/builder.log"
  # a trainer-only run (the trainer builds its own index) has one slice
  assert _dry_run(capsys, "delete", *SLICES, "--builder_type", "none") == [
      f"{G} delete realm-trainer {Z} --quiet"]


def test_stop_given_the_runs_config_waits_for_the_trainers_save(capsys):
  """--grace s after SIGTERM, or the trainer's preemption grace + the launchers' margin
  (processes.stop_grace) where the run's --config and --set make that longer."""
  def waits(*argv):
    return {int(re.search(r"\$\(seq (\d+)\)", _remote_script(line, f"realm-{job}")).group(1))
            for line, job in zip(_dry_run(capsys, "stop", *SLICES, *argv), ("trainer", "builder"))}

  assert waits() == {120}
  assert waits("--config", REALM_BASE) == {120}      # its grace (30) + 30 is shorter
  assert waits("--config", REALM_BASE, "--set", "train.preemption_grace_seconds=300") == {330}
  assert waits("--config", REALM_BASE, "--set", "train.preemption_grace_seconds=300",
               "--grace", "600") == {600}
  with pytest.raises(SystemExit) as exit_:
    tpu_pod.main(["stop", *SLICES, "--config", REALM_BASE, "--set", "train.gracee=1",
                  "--dry-run"])
  assert exit_.value.code == 2 and "train.gracee" in capsys.readouterr().err
  with pytest.raises(SystemExit) as exit_:   # not silently waiting 120 s
    tpu_pod.main(["stop", *SLICES, "--set", "train.preemption_grace_seconds=300", "--dry-run"])
  assert exit_.value.code == 2 and "--set needs the run's --config" in capsys.readouterr().err


def test_start_and_stop_scripts_run_the_job_in_the_background_and_sigterm_it(tmp_path):
  """The remote scripts in a local bash: a stand-in job records its argv and its SIGTERM."""
  plan = tpu_pod.plan_run(REALM_BASE, "gs://my-bucket/realm/realm",
                          ["data.dir=gs://my-bucket/realm/data", "retrieval.refresh=async",
                           *INIT[1::2]], storage="gcsfuse")
  bin_dir, home = tmp_path / "bin", tmp_path / "home"
  (home / "realm_env" / "bin").mkdir(parents=True)
  bin_dir.mkdir()
  job = home / "realm_env" / "bin" / "realm-train"
  job.write_text(textwrap.dedent("""\
      #!/bin/bash
      trap 'echo "got SIGTERM"; exit 0' TERM
      echo "args: $*"
      while true; do sleep 0.1; done
      """))
  (bin_dir / "mountpoint").write_text("#!/bin/sh\nexit 0\n")    # the bucket "is mounted"
  for path in (job, bin_dir / "mountpoint"):
    path.chmod(0o755)
  env = dict(os.environ, HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

  def bash(script):
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=30)

  pid_file, log = home / "realm_logs" / "trainer.pid", home / "realm_logs" / "trainer.log"
  assert bash(tpu_pod.start_script(plan, "trainer")).returncode == 0
  pid = int(pid_file.read_text())
  try:
    os.kill(pid, 0)                                       # running, after the ssh returned
    again = bash(tpu_pod.start_script(plan, "trainer"))
    assert again.returncode == 1 and f"trainer is already running (pid {pid})" in again.stderr
    stopped = bash(tpu_pod.stop_script("trainer", 10))
    assert stopped.returncode == 0 and "trainer: stopped (SIGTERM)" in stopped.stdout
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)
  finally:
    if pid_file.exists():
      try:
        os.kill(pid, signal.SIGKILL)                      # our own stand-in, if a check failed
      except ProcessLookupError:
        pass
  text = log.read_text()
  assert f"args: {JOB_FLAGS}" in text and text.rstrip().endswith("got SIGTERM")
  assert bash(tpu_pod.stop_script("trainer", 10)).stdout.strip() == "trainer: not running"


@pytest.mark.parametrize("change, message", [
    ({"--workdir": "runs/realm"}, "--workdir 'runs/realm': must be gs://BUCKET/PATH"),
    ({"--workdir": "gs://my-bucket"}, "--workdir 'gs://my-bucket': must be gs://BUCKET/PATH"),
    ({"--config": "configs/nope.py"}, "--config 'configs/nope.py': no such file"),
    ({"--config": REALM_BASE + ":huge"}, "unknown variant 'huge'"),
    ({"--trainer_type": "v4-30"}, "--trainer_type 'v4-30': not a TPU slice type; one of v4-8, "),
    ({"--builder_type": "v9-8"}, "--builder_type 'v9-8': not a TPU slice type"),
    ({"--name": "Realm_1"}, "--name 'Realm_1': lowercase letters"),
    ({"--set": "train.lrr=1e-3"}, "'train.lrr' is not a field of the config; the closest is "
                                  "'train.lr'"),
    ({"--set": "train.steps=1.5"}, "config.train.steps: '1.5' is not an integer"),
    ({"--set": "train.steps=nan"}, "config.train.steps: 'nan' is not an integer"),
    ({"--set": "mesh.shape=8"}, "config.mesh.shape: '8' is not a tuple literal"),
    ({"--set": "data.dir=/data/realm"}, "config.data.dir: '/data/realm' is not in a bucket, so "
                                        "the machines cannot read it: give --set data.dir=gs://"),
    ({"--set": "retrieval.refresh=in_process"}, "--builder_type v4-8: the config does not use "
                                                "the separate index builder"),
    # both jobs get one mesh.shape: it must fit the builder's 4 devices as well as the trainer's
    ({"--set": "mesh.shape=(16, 1)"}, "config.mesh.shape: (16, 1) needs 16 devices, but 4 are "
                                      "available on the builder's slice (--builder_type v4-8)"),
    ({"--set": "train.batch_size=12"}, "config.train.batch_size: 12 is not divisible by the data "
                                       "axis (16) on the trainer's slice (--trainer_type v4-32)"),
])
def test_bad_inputs_name_the_flag(change, message, capsys):
  argv = ["start", *SLICES, *RUN]
  for flag, value in change.items():
    if flag in argv and flag != "--set":
      argv[argv.index(flag) + 1] = value
    else:
      argv += [flag, value]
  with pytest.raises(SystemExit) as exit_:
    tpu_pod.main([*argv, "--dry-run"])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("tpu_pod.py: error: ") and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["stop", "--grace", "-5"], "--grace -5: must be 0 or more"),
    (["delete", "--zone", ""], "--zone is empty"),
    (["delete", "--project", " "], "--project is empty"),
    (["create", *RUN, "--runtime_version", ""], "--runtime_version is empty"),
])
def test_negative_seconds_and_empty_flags_are_refused(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    tpu_pod.main([argv[0], *SLICES, *argv[1:], "--dry-run"])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and err.startswith(f"tpu_pod.py: error: {message}"), err
  assert len(err.splitlines()) == 1, err


def test_only_the_builder_can_be_none(capsys):
  for action in ("up", "tail", "stop", "delete"):
    with pytest.raises(SystemExit) as exit_:
      tpu_pod.main([action, *SLICES, *RUN, "--trainer_type", "none", "--dry-run"])
    assert exit_.value.code == 2
    assert "--trainer_type 'none': not a TPU slice type" in capsys.readouterr().err


def test_question_files_reach_the_jobs_only_through_a_gcsfuse_mount():
  """The question readers open local files: a path of this machine is refused as data.dir's
  is, a gs:// one needs --storage gcsfuse (the jobs get its mount), tfds: and prepared: pass."""
  sets = [*RUN[5::2]]
  for spec, storage, message in (
      ("nq_open:/data/nq/train.jsonl", "gcsfuse", "config.qa.train: 'nq_open:/data/nq/train."
       "jsonl' is a file of this machine, which the machines cannot read: give qa.train=nq_open:"
       "gs://BUCKET/PATH with --storage gcsfuse"),
      ("squad:gs://my-bucket/squad.json", "gcs", "config.qa.train: 'squad:gs://my-bucket/squad"
       ".json': the question readers open local files, not gs://: give --storage gcsfuse")):
    with pytest.raises(ConfigError) as refused:
      tpu_pod.plan_run(REALM_BASE, "gs://my-bucket/realm/realm", [*sets, f"qa.train={spec}"],
                       storage)
    assert str(refused.value).startswith(message), str(refused.value)
  plan = tpu_pod.plan_run(REALM_BASE, "gs://my-bucket/realm/realm", [
      *sets, "qa.train=nq_open:gs://qa-bucket/nq/*.jsonl", "qa.dev=tfds:natural_questions_open",
      "qa.test=prepared:test"], "gcsfuse")
  assert "--config.qa.train=nq_open:/gcs/qa-bucket/nq/*.jsonl" in plan.overrides
  assert "--config.qa.dev=tfds:natural_questions_open" in plan.overrides
  assert "qa-bucket" in plan.mounts


def test_set_values_reach_the_workers_in_the_form_their_flag_parser_reads():
  """--set is typed as the field (1e3 for an int, yes for a bool); the jobs get the canonical
  spelling, which ml_collections' flags parse back to the same config; init.<part>=random
  needs no bucket."""
  from realm_jax.config.overrides import config_from_flags
  plan = tpu_pod.plan_run(REALM_BASE, "gs://my-bucket/realm/realm", [
      "data.dir=gs://my-bucket/realm/data", "retrieval.refresh=async",
      "init.retriever=gs://my-bucket/realm/ict", "init.reader=random", "train.steps=1e3",
      "train.async_checkpoints=no", "train.lr=1e-4", "mesh.shape=[16, 1]"], "gcs")
  given = [o for o in plan.overrides if o.split("=")[0] in (
      "--config.init.reader", "--config.train.steps", "--config.train.async_checkpoints",
      "--config.train.lr", "--config.mesh.shape")]
  assert given == ["--config.init.reader=random", "--config.train.steps=1000",
                   "--config.train.async_checkpoints=false", "--config.train.lr=0.0001",
                   "--config.mesh.shape=(16, 1)"]
  config = config_from_flags("realm-train", REALM_BASE, list(plan.overrides))
  assert (config.train.steps, config.train.async_checkpoints, config.train.lr,
          config.mesh.shape, config.init.reader) == (1000, False, 1e-4, (16, 1), "random")


def test_a_retriever_field_given_as_the_readers_reaches_the_jobs_as_given(tmp_path):
  """`--set model.retriever.num_layers=0` (-1, empty: "the same as the reader's") is read as
  None; the jobs get the text given, which their flag parser reads alike (it cannot read
  `=None`)."""
  from realm_jax.config.overrides import config_from_flags
  from realm_jax.config.validation import validate
  same = ["model.retriever.num_layers=0", "model.retriever.dropout_rate=-1"]
  plan = tpu_pod.plan_run(REALM_BASE, "gs://my-bucket/realm/realm", [*RUN[5::2], *same])
  assert [o for o in plan.overrides if "retriever." in o and "init." not in o] == [
      "--config.model.retriever.num_layers=0", "--config.model.retriever.dropout_rate=-1"]
  config = config_from_flags("realm-train", REALM_BASE, list(plan.overrides))
  validate(config)
  assert (config.model.retriever.num_layers, config.model.retriever.dropout_rate) == (None, None)
  manifest = _render(tmp_path, *GKE_RUN, *(t for s in same for t in ("--set", s)))
  for job in manifest["spec"]["replicatedJobs"]:
    (container,) = job["template"]["spec"]["template"]["spec"]["containers"]
    assert not any(a.endswith("=None") for a in container["command"]), container["command"]


def test_a_mesh_shape_with_minus_one_fits_both_slices_and_a_run_without_builder_is_not_checked(
    capsys):
  assert len(_dry_run(capsys, "start", *SLICES, *RUN, "--set", "mesh.shape=(-1, 2)")) == 2
  alone = ["start", *SLICES, *RUN, "--set", "retrieval.refresh=in_process", "--set",
           "mesh.shape=(16, 1)", "--builder_type", "none"]
  assert len(_dry_run(capsys, *alone)) == 1
  with pytest.raises(SystemExit) as exit_:                 # a trainer slice of 8 devices
    render.main([*GKE_RUN, "--set", "mesh.shape=(16, 1)", "--trainer_type", "v4-16"])
  assert exit_.value.code == 2
  assert "(16, 1) needs 16 devices, but 8 are available on the trainer's slice (--trainer_type "\
      "v4-16)" in capsys.readouterr().err


def test_missing_data_dir_and_a_config_outside_configs_are_refused(capsys, tmp_path):
  outside = tmp_path / "mine.py"
  outside.write_text("from realm_jax.config.defaults import base_config\n"
                     "def get_config(arg=None):\n  return base_config()\n")
  for argv, message in (
      (["--config", REALM_BASE, "--workdir", "gs://my-bucket/run"], "config.data.dir: is empty"),
      (["--config", str(outside), "--workdir", "gs://my-bucket/run"], "put the file in"),
      (["--workdir", "gs://my-bucket/run"], "start: --config and --workdir are required")):
    with pytest.raises(SystemExit):
      tpu_pod.main(["start", *SLICES, *argv, "--dry-run"])
    assert message in capsys.readouterr().err


def test_slice_shapes():
  def shape(accelerator_type):
    s = tpu_pod.tpu_slice(accelerator_type, "--trainer_type")
    return s.hosts, s.chips_per_host, s.gke_accelerator, s.topology

  assert shape("v4-32") == (4, 4, "tpu-v4-podslice", "2x2x4")
  assert shape("v4-8") == (1, 4, "tpu-v4-podslice", "2x2x1")
  assert shape("v4-128") == (16, 4, "tpu-v4-podslice", "4x4x4")
  assert shape("v5p-64") == (8, 4, "tpu-v5p-slice", "2x4x4")
  assert shape("v5litepod-8") == (1, 8, "tpu-v5-lite-podslice", "2x4")
  assert shape("v5litepod-16") == (4, 4, "tpu-v5-lite-podslice", "4x4")
  assert shape("v6e-256") == (64, 4, "tpu-v6e-slice", "16x16")


def _fake_gcloud(tmp_path, monkeypatch, mode: str):
  """`gcloud` on PATH: records its argv; describe says `mode` (or NOT_FOUND); ssh may fail.
  The wheel's build is a command that does nothing."""
  monkeypatch.setattr(tpu_pod, "wheel_command", lambda wheel_dir: [sys.executable, "-c", ""])
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir(exist_ok=True)
  fake = bin_dir / "gcloud"
  fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
      import json, os, sys
      with open(os.environ["GCLOUD_LOG"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
      verb, mode = sys.argv[4], os.environ["GCLOUD_MODE"]
      if verb == "describe" and mode == "missing":
        sys.exit("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource not found")
      if verb == "describe":   # state, type as value(state,acceleratorType) prints them
        kind = os.environ.get("GCLOUD_TYPE") or ("v4-32" if "trainer" in sys.argv[5] else "v4-8")
        print(f"{mode.split()[0]}\t{kind}")
      if verb == "ssh" and mode == "ssh_fails":
        sys.exit(3)
      if verb == "ssh" and mode == "READY running":   # a job of the run is alive there
        sys.exit("trainer is already running (pid 42): nothing is copied or installed under it")
      if verb == "ssh" and mode == "trainer running" and "trainer" in sys.argv[5]:
        sys.exit("trainer is already running (pid 42)")   # its builder is not
      """))
  fake.chmod(0o755)
  log = tmp_path / f"gcloud_{mode}.jsonl"
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  monkeypatch.setenv("GCLOUD_LOG", str(log))
  monkeypatch.setenv("GCLOUD_MODE", mode)
  return lambda: [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []


def test_real_runs_call_gcloud_as_the_dry_run_prints(tmp_path, monkeypatch, capsys):
  shown = [shlex.split(l, comments=True) for l in _dry_run(capsys, "create", *SLICES, *RUN)]
  calls = _fake_gcloud(tmp_path, monkeypatch, "missing")
  assert tpu_pod.main(["create", *SLICES, *RUN]) == 0
  assert [["gcloud", *c] for c in calls()] == shown        # describe, create; describe, create
  calls = _fake_gcloud(tmp_path, monkeypatch, "READY")
  assert tpu_pod.main(["create", *SLICES, *RUN]) == 0
  assert [c[3] for c in calls()] == ["describe", "describe"]   # both exist: reused
  assert "realm-trainer exists (READY, v4-32): reusing it" in capsys.readouterr().out
  for state, message in (
      ("PREEMPTED", "realm-trainer is PREEMPTED: run `tpu_pod.py delete`"),
      ("CREATING", "realm-trainer is CREATING, not READY: wait until it is READY"),
      # never READY again: it is created anew once it is gone
      ("DELETING", f"realm-trainer is DELETING: wait until it is gone ({G} describe "
                   f"realm-trainer {Z} says NOT_FOUND), then run this again"),
      ("STOPPED", f"realm-trainer is STOPPED: start it ({G} start realm-trainer {Z}) or delete "
                  f"it ({G} delete realm-trainer {Z} --quiet)"),
      # it cannot be started while it stops (it was told "start it")
      ("STOPPING", f"realm-trainer is STOPPING: wait until it is STOPPED ({G} describe "
                   f"realm-trainer {Z}), then start it ({G} start realm-trainer {Z}) or")):
    calls = _fake_gcloud(tmp_path, monkeypatch, state)
    assert tpu_pod.main(["create", *SLICES, *RUN]) == 1
    assert message in capsys.readouterr().err
    assert [c[3] for c in calls()][-1] == "describe"          # nothing created or started
  monkeypatch.setenv("GCLOUD_TYPE", "v4-16")
  calls = _fake_gcloud(tmp_path, monkeypatch, "READY")
  assert tpu_pod.main(["up", *SLICES, *RUN]) == 1
  assert ("realm-trainer exists as a v4-16, but --trainer_type is v4-32: delete it first "
          f"({G} delete realm-trainer {Z} --quiet), or give --trainer_type v4-16"
          ) in capsys.readouterr().err
  assert [c[3] for c in calls()][-1] == "describe"
  monkeypatch.delenv("GCLOUD_TYPE")
  calls = _fake_gcloud(tmp_path, monkeypatch, "ssh_fails")
  assert tpu_pod.main(["stop", *SLICES]) == 1
  # stop tries every slice (it stopped at the first failure: the builder ran on), one line each
  assert [c[4] for c in calls()] == ["realm-trainer", "realm-builder"]
  err = capsys.readouterr().err.splitlines()
  assert len(err) == 2 and all(line.startswith(
      f"tpu_pod.py: error: exit code 3: {G} ssh realm-{job} {Z} --worker=all --command ")
      for line, job in zip(err, ("trainer", "builder"))), err


def test_a_slice_whose_job_runs_exits_with_its_own_code(tmp_path, monkeypatch, capsys):
  """install / up refused by a live job: exit code 3 (RUNNING_EXIT), not a failure's 1."""
  monkeypatch.setenv("GCLOUD_MODE", "READY running")
  calls = _fake_gcloud(tmp_path, monkeypatch, "READY running")
  assert tpu_pod.main(["up", *SLICES, *RUN]) == tpu_pod.RUNNING_EXIT == 3
  assert [c[3] for c in calls()] == ["describe", "describe", "ssh"]   # nothing copied
  err = capsys.readouterr().err
  assert "trainer is already running (pid 42)" in err and "tpu_pod.py: error: exit code 1" in err


def test_start_starts_the_job_that_is_not_running_beside_one_that_is(tmp_path, monkeypatch,
                                                                    capsys):
  """A builder that ended while its trainer trains is started again by `start`: the live
  trainer is refused on its slice (exit code 3), the builder's slice still gets its start."""
  calls = _fake_gcloud(tmp_path, monkeypatch, "trainer running")
  assert tpu_pod.main(["start", *SLICES, *RUN]) == tpu_pod.RUNNING_EXIT
  starts = [c for c in calls() if c[3] == "ssh"]
  assert [c[4] for c in starts] == ["realm-trainer", "realm-builder"]
  assert "nohup $HOME/realm_env/bin/realm-index " in starts[1][-1]
  assert "trainer is already running (pid 42)" in capsys.readouterr().err


def test_a_sweep_shows_a_run_still_training_as_running_not_failed(gcs, monkeypatch, capsys):
  codes = iter([3, 0])
  monkeypatch.setattr(sweep, "subprocess", type("Recorder", (), {"run": staticmethod(
      lambda cmd, check: subprocess.CompletedProcess(cmd, next(codes)))}))
  argv = ["--config", REALM_BASE, "--root", f"{gcs}/sweep", "--grid", "train.lr=1e-5,3e-5",
          "--set", f"data.dir={gcs}/realm/data", "--set", "retrieval.refresh=async", *INIT,
          "--launcher", "tpu_pod", "--name", "realm-lr", "--", *WHERE]
  assert sweep.main(argv) == 0
  out = capsys.readouterr().out
  assert "train.lr-1e-05: running on realm-lr-" in out
  assert "1/2 runs started, 1 still running, 0 done before" in out


def test_a_tpu_sweep_writes_the_tables_in_the_bucket(gcs, monkeypatch, capsys):
  """results.csv / results.md from the summaries in the bucket: a finished run with its
  figures, the one just started as such."""
  from realm_jax import paths, workdir as workdir_lib
  monkeypatch.setattr(sweep, "subprocess", type("Recorder", (), {"run": staticmethod(
      lambda cmd, check: subprocess.CompletedProcess(cmd, 0))}))
  root = f"{gcs}/tables"
  argv = ["--config", REALM_BASE, "--root", root, "--grid", "train.lr=1e-5,3e-5",
          "--set", f"data.dir={gcs}/realm/data", "--set", "retrieval.refresh=async", *INIT,
          "--launcher", "tpu_pod", "--name", "realm-lr", "--", *WHERE]
  steps = tpu_pod.load_config(REALM_BASE).train.steps
  workdir_lib.write_summary(f"{root}/train.lr-3e-05", {"steps": steps, "eval_em": 0.25})
  assert sweep.main(argv) == 0
  table = paths.read_text(f"{root}/results.md")
  assert "| train.lr-3e-05 | 3e-05 | done | 0.25 |" in table
  assert "| train.lr-1e-05 | 1e-05 | started |" in table
  rows = list(csv.DictReader(io.StringIO(paths.read_text(f"{root}/results.csv"))))
  assert [(r["run"], r["status"], r["slices"][:9]) for r in rows] == [
      ("train.lr-3e-05", "done", "realm-lr-"), ("train.lr-1e-05", "started", "realm-lr-")]


def test_without_gcloud_the_error_says_so(tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("PATH", str(tmp_path))
  assert tpu_pod.main(["delete", *SLICES]) == 1
  assert "gcloud is not installed" in capsys.readouterr().err


def test_tpu_pod_runs_as_a_script():
  out = subprocess.run([sys.executable, os.path.join(LAUNCH, "tpu_pod.py"), "delete", *SLICES,
                        "--dry-run"], capture_output=True, text=True, timeout=60, cwd="/")
  assert out.returncode == 0, out.stderr
  assert out.stdout.splitlines()[0] == f"{G} delete realm-trainer {Z} --quiet"


GKE_RUN = [*RUN, "--image", "us-docker.pkg.dev/my-project/realm/realm-jax:latest"]


def _render(tmp_path, *argv: str) -> dict:
  out = tmp_path / "jobset.yaml"
  assert render.main([*argv, "--out", str(out)]) == 0
  return yaml.safe_load(out.read_text())


def test_gke_jobset_runs_trainer_and_builder_on_their_slices_with_one_workdir(tmp_path):
  manifest = _render(tmp_path, *GKE_RUN, *FUSE)
  assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
  assert manifest["spec"]["successPolicy"]["targetReplicatedJobs"] == ["trainer"]
  jobs = {j["name"]: j for j in manifest["spec"]["replicatedJobs"]}
  assert sorted(jobs) == ["builder", "trainer"]
  expected = {"trainer": (4, "2x2x4", "realm-train"), "builder": (1, "2x2x1", "realm-index")}
  mounts = {}
  for name, (hosts, topology, entry) in expected.items():
    job = jobs[name]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"], job["backoffLimit"]) \
        == (hosts, hosts, "Indexed", 0)
    pod = job["template"]
    assert pod["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    spec = pod["spec"]
    assert spec["terminationGracePeriodSeconds"] >= 60
    assert spec["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v4-podslice",
                                    "cloud.google.com/gke-tpu-topology": topology}
    (container,) = spec["containers"]
    assert container["image"] == "us-docker.pkg.dev/my-project/realm/realm-jax:latest"
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert shlex.join(container["command"]) == f"{entry} {JOB_FLAGS}"
    (volume,) = spec["volumes"]
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["volumeAttributes"]["bucketName"] == "my-bucket"
    mounts[name] = [(m["name"], m["mountPath"]) for m in container["volumeMounts"]]
    assert mounts[name] == [(volume["name"], "/gcs/my-bucket")]
  assert mounts["trainer"] == mounts["builder"]


def test_gke_slice_sizes_and_a_trainer_only_run(tmp_path):
  manifest = _render(tmp_path, *GKE_RUN, "--trainer_type", "v4-64", "--builder_type", "v4-16")
  specs = [j["template"]["spec"] for j in manifest["spec"]["replicatedJobs"]]
  assert [(s["parallelism"], s["template"]["spec"]["nodeSelector"][
      "cloud.google.com/gke-tpu-topology"]) for s in specs] == [(8, "2x4x4"), (2, "2x2x2")]
  only = _render(tmp_path, *RUN[:6], "--set", "retrieval.refresh=in_process", *INIT,
                 *GKE_RUN[-2:], "--builder_type", "none")
  assert [j["name"] for j in only["spec"]["replicatedJobs"]] == ["trainer"]


def test_gke_pods_get_the_trainers_save_grace_before_sigkill(tmp_path):
  """SIGKILL comes --grace s after SIGTERM, or the trainer's preemption grace + the margin of
  every launcher (processes.stop_grace) where that is longer: its save is not cut short."""
  def grace(*argv):
    manifest = _render(tmp_path, *GKE_RUN, *argv)
    return {job["name"]: job["template"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] for job in manifest["spec"]["replicatedJobs"]}

  assert grace() == {"trainer": 120, "builder": 120}
  assert grace("--set", "train.preemption_grace_seconds=300") == {"trainer": 330, "builder": 330}
  assert grace("--set", "train.preemption_grace_seconds=300", "--grace", "600") == {
      "trainer": 600, "builder": 600}


def _documented_commands(text: str, script: str) -> list[list[str]]:
  """The argv of each `python launch/SCRIPT ...` command in `text` that names a bucket, its
  optional `[...]` parts left out."""
  found = []
  for match in re.finditer(rf"python launch/{re.escape(script)} ((?:.*\\\n)*.*)", text):
    line = match.group(1).replace("\\\n", " ")
    if "gs://" in line:
      found.append(shlex.split(re.sub(r"\[[^]]*\]", "", line)))
  return found


def test_the_documented_cloud_commands_run_as_written(tmp_path, capsys, monkeypatch):
  """The commands of the launchers' docstrings and docs/launch.md, as written (--dry-run; the
  manifest to a temp file), and the tpu_pod.py commands the sweep's prints."""
  monkeypatch.chdir(REPO)
  with open(os.path.join(REPO, "docs", "launch.md")) as f:
    docs = f.read()
  counts = {}
  for module, script in ((tpu_pod, "tpu_pod.py"), (render, "gke/render.py"), (sweep, "sweep.py")):
    commands = _documented_commands(module.__doc__ + docs, script)
    counts[script] = len(commands)
    for argv in commands:
      if module is render:
        argv[argv.index("--out") + 1] = str(tmp_path / "jobset.yaml")
      assert module.main(argv if module is render else ["--dry-run", *argv]) == 0, argv
      printed = capsys.readouterr().out.splitlines()
      for line in printed if module is sweep else ():
        if not line.startswith("[sweep]"):
          assert tpu_pod.main(["--dry-run", *shlex.split(line)[2:]]) == 0, line
          capsys.readouterr()
  assert counts == {"tpu_pod.py": 2, "gke/render.py": 2, "sweep.py": 2}


def test_gke_bad_inputs_name_the_flag(capsys):
  for argv, message in ((RUN, "--image is required"),
                        ([*GKE_RUN, "--trainer_type", "none"], "--trainer_type 'none': not a "),
                        ([*GKE_RUN, "--trainer_type", "v4-33"], "--trainer_type 'v4-33'"),
                        ([*GKE_RUN, "--name", "REALM"], "--name 'REALM'"),
                        ([*GKE_RUN, "--max_restarts", "-1"], "--max_restarts -1: must be 0 "),
                        ([*GKE_RUN, "--grace", "-5"], "--grace -5: must be 0 or more"),
                        ([*GKE_RUN, "--out", "/nonexistent/dir/x.yaml"],
                         "render.py: error: --out '/nonexistent/dir/x.yaml': No such file or "
                         "directory\n")):
    with pytest.raises(SystemExit) as exit_:
      render.main(list(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1, err


def test_committed_gke_example_is_what_its_header_command_renders(tmp_path):
  path = os.path.join(LAUNCH, "gke", "realm_base.yaml")
  with open(path) as f:
    committed = f.read()
  command = committed.splitlines()[1].removeprefix("#   python launch/gke/render.py ")
  out = tmp_path / "fresh.yaml"
  cwd = os.getcwd()
  os.chdir(REPO)                         # the header's config path is relative to the repo
  try:
    assert render.main([*shlex.split(command), "--out", str(out)]) == 0
  finally:
    os.chdir(cwd)
  assert out.read_text() == committed, "render launch/gke/realm_base.yaml again (its header)"


def test_sweep_tpu_pod_launcher_prints_one_tpu_pod_command_per_run(capsys):
  argv = ["--config", REALM_BASE, "--root", "gs://my-bucket/sweep", "--grid", "train.lr=1e-5,3e-5",
          "--grid", "retrieval.k=4,8", "--set", "data.dir=gs://my-bucket/realm/data",
          "--set", "retrieval.refresh=async", *INIT, "--launcher", "tpu_pod", "--name", "realm-lr",
          "--dry-run", "--", *WHERE]
  assert sweep.main(argv) == 0
  lines = [shlex.split(l) for l in capsys.readouterr().out.splitlines()
           if not l.startswith("[sweep]")]
  assert len(lines) == 4
  tpu_pod_py = os.path.join(LAUNCH, "tpu_pod.py")
  assert all(l[:3] == [sys.executable, tpu_pod_py, "up"] and l[-4:] == WHERE for l in lines)
  names = [l[l.index("--name") + 1] for l in lines]
  assert all(re.fullmatch(r"realm-lr-[0-9a-f]{8}", n) for n in names) and len(set(names)) == 4
  assert lines[-1][lines[-1].index("--workdir") + 1] == \
      "gs://my-bucket/sweep/train.lr-3e-05_retrieval.k-8"
  # each printed command is a valid tpu_pod.py invocation: its start line has the run's values
  start = _dry_run(capsys, *lines[-1][2:])[-2]
  assert "--config.train.lr=3e-05 --config.retrieval.k=8 " in _remote_script(
      start, f"{names[-1]}-trainer")
  head = argv[:argv.index("--")]
  for bad, message in (([*argv[:3], "runs/sweep", *argv[4:]], "--launcher tpu_pod needs gs://"),
                       ([*head, "--", "--set", "x=1"], "after --: '--set' is set by the sweep"),
                       ([a for a in argv if a not in ("--name", "realm-lr")], "needs --name"),
                       ([*head[:-3], "--name", "r" * 32, "--dry-run"], "at most 31 characters"),
                       ([*head[:-3], "--name", "Realm", "--dry-run"], "--name 'Realm'")):
    with pytest.raises(SystemExit) as exit_:
      sweep.main(bad)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"--root": "gs://"}, "--root 'gs://': not a bucket name after gs://"),
    ({"--root": "gs://Bad_Bucket/x"}, "--root 'gs://Bad_Bucket/x': not a bucket name"),
    ({"after": [*WHERE, "--trainer_type", "v4-30"]}, "--trainer_type 'v4-30': not a TPU slice type"),
    ({"after": ["--zone", "us-central2-b"]}, "after --: the following arguments are required: "
                                            "--project (tpu_pod.py, run train.lr-1e-05)"),
    ({"after": [*WHERE, "--bogus"]}, "after --: unrecognized arguments: --bogus"),
    ({"after": [*WHERE, "--trainer_typ", "v4-8"]}, "after --: unrecognized arguments: "
     "--trainer_typ v4-8; did you mean --trainer_type? (tpu_pod.py, run train.lr-1e-05)"),
    ({"after": [*WHERE, "--dry-run"]}, "after --: '--dry-run' is the sweep's own flag"),
    ({"set": "data.dir=/local/data"}, "config.data.dir: '/local/data' is not in a bucket"),
    # the second run's mesh does not fit the trainer's slice: refused before the first starts
    ({"grid": "mesh.shape=(-1, 1),(32, 1)"}, "(32, 1) needs 32 devices, but 16 are available "
                                              "on the trainer's slice"),
])
def test_a_tpu_sweep_refuses_before_any_run_what_tpu_pod_would_refuse(change, message, capsys,
                                                                     monkeypatch):
  called = []
  monkeypatch.setattr(sweep, "subprocess", type("Recorder", (), {"run": staticmethod(
      lambda cmd, check: called.append(cmd) or subprocess.CompletedProcess(cmd, 0))}))
  monkeypatch.setattr(sweep, "check_started_runs", lambda *a: None)   # no bucket here
  monkeypatch.setattr(sweep, "_summary", lambda workdir: None)        # nor its summaries
  argv = ["--config", REALM_BASE, "--root", change.get("--root", "gs://my-bucket/sweep"),
          "--grid", change.get("grid", "train.lr=1e-5,3e-5"),
          "--set", change.get("set", "data.dir=gs://my-bucket/realm/data"),
          "--set", "retrieval.refresh=async", *INIT, "--launcher", "tpu_pod", "--name",
          "realm-lr", "--", *change.get("after", WHERE)]
  for dry_run in ([], ["--dry-run"]):
    with pytest.raises(SystemExit) as exit_:
      sweep.main([*dry_run, *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 1, err
  assert called == []


def test_a_tpu_pod_sweep_keeps_each_runs_slices_skips_finished_runs_and_refuses_changed_ones(
    gcs, capsys, monkeypatch):
  """Against the bucket stand-in, with tpu_pod.py recorded instead of run: a grown grid starts
  its old runs on the slices they had (where tpu_pod.py refuses a running one: next test), skips a
  finished one (whose paths were recorded through gcsfuse's /gcs/B mount, and as tpu_pod.py
  passes them, without the doubled and trailing slashes given here), and a run in the
  bucket that started under other values stops the sweep before any tpu_pod.py call."""
  from realm_jax import workdir as workdir_lib
  root, called = f"{gcs}/sweep", []
  monkeypatch.setattr(sweep, "subprocess", type("Recorder", (), {"run": staticmethod(
      lambda cmd, check: called.append(cmd[cmd.index("--name") + 1]) or
      subprocess.CompletedProcess(cmd, 0))}))

  def run_sweep(lrs: str) -> list[dict]:
    return sweep.sweep(sweep.parse_args(
        ["--config", REALM_BASE, "--root", root, "--grid", f"train.lr={lrs}",
         "--set", f"data.dir={gcs}/realm//data/", "--set", "retrieval.refresh=async", *INIT,
         "--launcher", "tpu_pod", "--name", "realm-lr", "--", *WHERE, *FUSE]))

  first = {r["run"]: r["slices"] for r in run_sweep("1e-5,3e-5")}
  assert called == list(first.values())
  config = sweep.run_config(tpu_pod.load_config(REALM_BASE), {
      "data.dir": "/gcs/" + gcs.removeprefix("gs://") + "/realm/data", "train.lr": 3e-5,
      "retrieval.refresh": "async", "init.retriever": "/gcs/my-bucket/realm/ict",
      "init.reader": "/gcs/my-bucket/bert-base-uncased"})
  done = f"{root}/train.lr-3e-05"
  workdir_lib.write_config(done, config)
  workdir_lib.write_summary(done, {"steps": config.train.steps})
  called.clear()
  rows = {r["run"]: r for r in run_sweep("1e-6,1e-5,3e-5")}
  assert rows["train.lr-1e-05"]["slices"] == first["train.lr-1e-05"]   # not moved by the grid
  assert rows["train.lr-3e-05"]["status"] == "done"
  assert called == [rows["train.lr-1e-06"]["slices"], first["train.lr-1e-05"]]
  config.retrieval.k = 4    # the run at 3e-5 started under another k than the sweep's
  workdir_lib.write_config(done, config)
  called.clear()
  with pytest.raises(ConfigError, match=r"train.lr-3e-05: retrieval.k: 4 \(recorded\)"):
    run_sweep("1e-5,3e-5")
  assert called == []


def test_install_is_refused_on_a_slice_whose_job_runs(tmp_path):
  """`install` (and so `up` again) never copies or installs anything on a slice while a job
  runs there: its first step stops at either job's live pid."""
  logs = tmp_path / "realm_logs"
  logs.mkdir()
  env = dict(os.environ, HOME=str(tmp_path), PATH="/usr/bin:/bin")

  def idle_check():
    return subprocess.run(["bash", "-c", tpu_pod.idle_script()], env=env, capture_output=True,
                          text=True, timeout=30)
  assert idle_check().returncode == 0                                # no job ever started
  for job in ("trainer", "builder"):
    running = subprocess.Popen(["sleep", "30"])
    try:
      (logs / f"{job}.pid").write_text(str(running.pid))
      refused = idle_check()
      assert refused.returncode == 1 and refused.stdout == ""
      assert (f"{job} is already running (pid {running.pid}): nothing is copied or installed "
              "under it" in refused.stderr)
    finally:
      running.kill()
      running.wait()
    assert idle_check().returncode == 0                              # its pid is gone


def test_a_config_file_with_a_field_of_its_own_is_refused_before_any_machine(tmp_path,
                                                                           monkeypatch):
  """A misspelt assignment in the config file (`c.train.stesp`), which the workers'
  realm-train refuses, stops tpu_pod.py / render.py's plan and sweep.py before anything runs."""
  configs = tmp_path / "configs"
  configs.mkdir()
  (configs / "typo.py").write_text(
      "from realm_jax.config.defaults import base_config\n\n"
      "def get_config(arg=None):\n  c = base_config()\n  c.train.stesp = 100\n  return c\n")
  monkeypatch.setattr(tpu_pod, "REPO", str(tmp_path))
  expected = "config.train.stesp: set by {}, but not an option; did you mean 'train.steps'?"
  with pytest.raises(ConfigError) as refused:
    tpu_pod.plan_run(str(configs / "typo.py"), "gs://my-bucket/realm/realm",
                     ["data.dir=gs://my-bucket/realm/data"])
  assert str(refused.value) == expected.format(configs / "typo.py")
  args = sweep.parse_args(["--config", str(configs / "typo.py"), "--root", str(tmp_path / "s"),
                           "--grid", "seed=0,1", "--launcher", "print"])
  with pytest.raises(ConfigError) as refused:
    sweep.sweep(args)
  assert str(refused.value) == expected.format(configs / "typo.py")


@pytest.mark.parametrize("returned", ["{'task': 'realm'}", "None"])
def test_a_config_file_that_returns_no_config_dict_is_one_line(returned, tmp_path, monkeypatch,
                                                              capsys):
  """get_config() returning a dict (or nothing) is refused as realm-train refuses it: one line
  naming the file, exit code 2, not a traceback from the checks that read it."""
  configs = tmp_path / "configs"
  configs.mkdir()
  path = configs / "plain.py"
  path.write_text(f"def get_config(arg=None):\n  return {returned}\n")
  monkeypatch.setattr(tpu_pod, "REPO", str(tmp_path))
  kind = type(eval(returned)).__name__
  for argv in (["start", *SLICES, "--config", str(path), "--workdir", "gs://my-bucket/run"],
               ["stop", *SLICES, "--config", str(path)]):
    with pytest.raises(SystemExit) as exit_:
      tpu_pod.main([*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == (
        f"tpu_pod.py: error: --config '{path}': TypeError: get_config() returned {kind}, not "
        "an ml_collections.ConfigDict\n"), err

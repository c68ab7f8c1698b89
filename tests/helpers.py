"""Shared helpers: the demo configs shrunk to a tiny model."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import subprocess

from realm_jax.config.reading import flat_options

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")
WORLD_ENTITIES = 60
VOCAB_SIZE = 904        # just below the 913 entries at which the world's vocab saturates, so
                        # exactly 904: divisible by the 8-way model axis of the tensor-parallel
                        # tests (the vocab trainer is deterministic)
# tiny_config overrides for a retriever smaller than its reader (hidden 32, 4 heads, 1 layer,
# ff 64): towers of their own sizes through checkpoints, resume, the index and the builder.
SMALL_RETRIEVER = dict(model__retriever__hidden_size=16, model__retriever__num_heads=2,
                       model__retriever__num_layers=1, model__retriever__intermediate_size=48)


def drawn(abstract, seed: int, initializer_range: float = 0.02):
  """NumPy draws in the shapes (and dtypes) of a params tree or its ShapeDtypeStructs, as the
  model's initializers draw them but for the biases and LayerNorm scales: kernels and
  embeddings N(0, initializer_range) (`model.initializer_range`); biases N(0, 0.02) and scales
  1 + N(0, 0.1) instead of zeros and ones, so that one left out of a computation shows. Tests
  whose assertions hold for any such params use these instead of compiling the random init
  (seconds per model on the slower CPU)."""
  import jax
  import numpy as np
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = getattr(path[-1], "key", None)
    std = {"scale": 0.1, "bias": 0.02}.get(name, initializer_range)
    return (rng.normal(0, std, leaf.shape) + (name == "scale")).astype(leaf.dtype)
  return jax.tree_util.tree_map_with_path(draw, abstract)


def drawn_params(model, seed: int, *args, initializer_range: float = 0.02, **kwargs):
  """`drawn` params (at `initializer_range`: the model's own, where it is not the default) in
  the tree of `model.init(rng, *args, **kwargs)["params"]` (unboxed), which is traced, not
  compiled or run."""
  import flax.linen as nn
  import jax
  abstract = jax.eval_shape(lambda: nn.meta.unbox(
      model.init(jax.random.PRNGKey(0), *args, **kwargs)["params"]))
  return drawn(abstract, seed, initializer_range)


def drawn_state(config, model, mesh, block_len: int, seed: int = 0):
  """`state_lib.create_train_state`'s (state, shardings, abstract state) with `drawn` params:
  the state built around them as a run restored whole builds it, no random init compiled."""
  import jax
  from realm_jax.runtime import state as state_lib
  make, abstract, shardings = state_lib.deferred_train_state(config, model, mesh, block_len,
                                                             jax.random.PRNGKey(seed))
  params = jax.device_put(drawn(abstract.params, seed, config.model.initializer_range),
                          shardings.params)
  return make(params), shardings, abstract


def xla_flags(devices: int) -> str:
  """This session's $XLA_FLAGS (tests/conftest.py) for a process of `devices` host devices."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
  return f"{flags.strip()} --xla_force_host_platform_device_count={devices}".strip()


def load_config_module(name: str):
  """Imports `configs/<name>.py` by path (configs/ is not a package)."""
  from realm_jax.config.loading import config_module
  return config_module(os.path.join(CONFIGS, f"{name}.py"))


def tiny_config(task: str = "realm", variant: str | None = None, data_dir: str = "", **overrides):
  """`configs/demo_ict.py` or `configs/demo_realm.py[:variant]` with a 1-layer d=32 BERT,
  batch 16, a few steps, small eval, frequent logs and checkpoints.

  `overrides` are dotted names with `__` for the dots: `train__steps=8`.
  """
  if task == "ict":
    assert variant is None
    config = load_config_module("demo_ict").get_config()
  else:
    config = load_config_module("demo_realm").get_config(variant)
  config.data.dir = data_dir
  config.data.prefetch = 2
  m = config.model
  # One layer: what the tests check is the same code in every layer (they run the last one,
  # which computes only the positions read), and tracing and compiling the steps is most of
  # their time. Tests of how layers stack build encoders of their own (test_model_execution,
  # the checkpoint imports).
  m.hidden_size, m.num_heads, m.intermediate_size, m.num_layers = 32, 4, 64, 1
  m.retrieval_dim = 32
  t = config.train
  t.batch_size, t.steps, t.log_every, t.checkpoint_every, t.keep_checkpoints = 16, 4, 1, 2, 3
  config.eval.num_examples = 32
  config.eval.batch_size = 32
  config.eval.every = 0
  config.retrieval.embed_batch_size = 256
  if config.retrieval.candidates == "index":
    config.retrieval.refresh_every = 3
  # The trainer alone rebuilds its index; tests of the separate builder ask for it.
  config.retrieval.refresh = "in_process"
  return apply_overrides(config, overrides)


def apply_overrides(config, overrides: dict):
  """Sets `a__b=v` (dotted names with `__` for the dots) on `config`; returns it."""
  from realm_jax.config.overrides import with_overrides
  return with_overrides(config, {key.replace("__", "."): v for key, v in overrides.items()})


def config_flags(config, config_file: str, arg: str | None = None) -> list[str]:
  """Command-line flags that turn `configs/<config_file>.py[:arg]` into `config`."""
  module = load_config_module(config_file)
  base = flat_options(module.get_config(arg))
  flags = [f"--config={os.path.join(CONFIGS, config_file + '.py')}" + (f":{arg}" if arg else "")]
  for key, value in flat_options(config).items():
    if base.get(key) != value:
      flags.append(f"--config.{key}={value}")
  return flags


def purge_step(events_file: str) -> int | None:
  """The step of the session start a TensorBoard event file records (tensorboardX writes one
  where its writer was given a purge step: TensorBoard hides the earlier files' events from
  that step on), None without one. The file is TFRecord: length (8 bytes), its CRC (4), the
  Event, its CRC (4)."""
  from tensorboardX.proto import event_pb2
  for event in tb_events(events_file):
    if event.HasField("session_log") and \
        event.session_log.status == event_pb2.SessionLog.START:
      return event.step
  return None


def tb_events(events_file: str) -> list:
  """The Events a TensorBoard event file holds on disk now (TFRecord: length (8 bytes), its
  CRC (4), the Event, its CRC (4))."""
  import struct
  from tensorboardX.proto import event_pb2
  with open(events_file, "rb") as f:
    data = f.read()
  events, at = [], 0
  while at < len(data):
    (length,) = struct.unpack("<Q", data[at:at + 8])
    events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
    at += 12 + length + 4
  return events


def examples_copy(data_dir, out, rows, split: str = "train") -> pathlib.Path:
  """A copy of prepared `data_dir` at `out` whose `split` holds only its example `rows`, in
  their order (another set of examples, or the same reordered)."""
  import numpy as np
  copy = pathlib.Path(shutil.copytree(data_dir, out))
  for path in (copy / "examples" / split).glob("*.npy"):
    np.save(path, np.load(path)[rows])
  return copy


def swapped_vocab_copy(data_dir, out) -> pathlib.Path:
  """A copy of prepared `data_dir` at `out` whose vocab.txt lists as many tokens, its last two
  swapped: the same size, ids that mean other words (what a vocab check must refuse)."""
  copy = pathlib.Path(shutil.copytree(data_dir, out))
  tokens = (copy / "vocab.txt").read_text().splitlines()
  (copy / "vocab.txt").write_text("\n".join(tokens[:-2] + tokens[:-3:-1]) + "\n")
  return copy


def dead_job_lock(workdir: str, job: str) -> int:
  """`W/<job>.lock` naming a process of this host that has ended (a job killed -9); its pid."""
  gone = subprocess.Popen(["true"])
  gone.wait()
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, f"{job}.lock"), "w") as f:
    f.write(f"{gone.pid} {socket.gethostname()}\n")
  return gone.pid

"""A checkpoint saved on mesh (1x8) (tensor-parallel over 8 devices) restores exactly onto mesh
(2x4), onto one device, and in a process with another device count, where training goes on."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from realm_jax.data.tokenizer import load_tokenizer
from realm_jax.runtime import partitioning, state as state_lib
from realm_jax.runtime.checkpoints import Checkpointer, run_config
from realm_jax.train.loop import train
from tests import helpers

pytestmark = pytest.mark.slow   # the slow tier: `make test` runs it, `make test-fast` does not

SAVED_STEPS = 2


def restore_state(workdir: str, mesh):
  """The latest train state of the run in `workdir`, by its own config, sharded for `mesh`."""
  config = run_config(workdir)
  vocab_size = load_tokenizer(os.path.join(config.data.dir, "vocab.txt")).vocab_size
  model = state_lib.build_model(config, vocab_size)
  abstract, shardings = state_lib.abstract_train_state(config, model, mesh, config.data.block_len)
  checkpointer = Checkpointer(workdir, keep=3)
  try:
    state, data, _ = checkpointer.restore(checkpointer.latest_step(), abstract,
                                          {"step": np.zeros((), np.int32)})
  finally:
    checkpointer.close()
  return state, shardings, data


def flat(state) -> dict[str, np.ndarray]:
  tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def dump(workdir: str, out: str) -> None:
  """Run in a process with another device count: restores onto all its devices, saves numpy."""
  mesh = partitioning.make_mesh((-1, 1))
  state, _, _ = restore_state(workdir, mesh)
  np.savez(out, device_count=jax.device_count(), **flat(state))


@pytest.fixture(scope="module")
def saved(world_dir, tmp_path_factory):
  """ICT trained 2 steps on mesh (1x8): every vocab / heads / mlp dim split 8 ways."""
  config = helpers.tiny_config("ict", data_dir=world_dir, train__steps=SAVED_STEPS,
                               train__checkpoint_every=SAVED_STEPS, model__num_heads=8,
                               mesh__shape=(1, 8))
  workdir = str(tmp_path_factory.mktemp("mesh_1x8"))
  train(config, workdir)
  state, _, _ = restore_state(workdir, partitioning.make_mesh((1, 8)))
  return config, workdir, flat(state)


@pytest.mark.parametrize("shape, devices", [((2, 4), 8), ((1, 1), 1)])
def test_restores_exactly_onto_another_mesh(saved, shape, devices):
  _, workdir, expected = saved
  mesh = partitioning.make_mesh(shape, jax.devices()[:devices])
  state, shardings, data = restore_state(workdir, mesh)
  assert data["next_step"] == SAVED_STEPS
  got = flat(state)
  assert got.keys() == expected.keys()
  moved = 0
  for key, value in expected.items():
    assert got[key].dtype == value.dtype, key
    np.testing.assert_array_equal(got[key], value, err_msg=key)
    moved += bool(np.any(value != 0))
  assert moved > len(expected) // 2   # Adam's moments and the params are real, not zeros
  # ... and each leaf lies in the target mesh's sharding.
  for leaf, sharding in zip(jax.tree.leaves(state.params), jax.tree.leaves(shardings.params)):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert leaf.sharding.mesh.devices.shape == shape


def test_restores_and_trains_on_in_a_process_with_two_devices(saved, tmp_path):
  config, workdir, expected = saved
  env = {**os.environ, "XLA_FLAGS": helpers.xla_flags(2)}
  out = str(tmp_path / "restored.npz")
  subprocess.run([sys.executable, "-c", "from tests.test_restore_topology import dump; "
                  f"dump({workdir!r}, {out!r})"], cwd=helpers.REPO, env=env, check=True,
                 timeout=300)
  got = np.load(out)
  assert int(got["device_count"]) == 2
  for key, value in expected.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  # Further training there: a copy of the run resumes at the saved step on mesh (2x1).
  workdir = shutil.copytree(workdir, str(tmp_path / "copy"))
  flags = helpers.config_flags(config, "demo_ict")
  flags = [f for f in flags if not f.startswith(("--config.mesh.shape", "--config.train.steps"))]
  proc = subprocess.run(
      [sys.executable, "-m", "realm_jax.train.main", *flags, f"--workdir={workdir}",
       "--config.mesh.shape=(-1, 1)", f"--config.train.steps={SAVED_STEPS + 1}"],
      cwd=helpers.REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert f"resumed from {workdir}/checkpoints/{SAVED_STEPS}" in proc.stdout
  assert "mesh {'data': 2, 'model': 1}" in proc.stdout
  assert f"step {SAVED_STEPS + 1}/{SAVED_STEPS + 1} loss" in proc.stdout

"""Orbax checkpoints: async saves of params, optimizer state, data-iterator state and the
retrieval snapshot as separate items; keep-N; params-only restore for the next stage."""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp

ITEMS = ("params", "opt", "data", "retrieval")


class Checkpointer:
  """`W/checkpoints/<step>/{params,opt,data,retrieval}` via one CheckpointManager."""

  def __init__(self, workdir: str, keep: int, async_saves: bool = True):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=async_saves),
        item_names=ITEMS)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state, data_state: dict, retrieval: dict) -> None:
    """Starts an async save; a failure of the previous one surfaces here or in `close`."""
    self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        opt=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
        data=ocp.args.JsonSave(data_state),
        retrieval=ocp.args.StandardSave(retrieval)), force=True)

  def restore(self, step: int, abstract_state, abstract_retrieval) -> tuple[Any, dict, dict]:
    """Restores straight into the shardings of the abstract targets (no host copy first)."""
    restored = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state.params),
        opt=ocp.args.StandardRestore({"step": abstract_state.step,
                                      "opt_state": abstract_state.opt_state}),
        data=ocp.args.JsonRestore(),
        retrieval=ocp.args.StandardRestore(abstract_retrieval)))
    state = abstract_state.replace(params=restored.params, step=restored.opt["step"],
                                   opt_state=restored.opt["opt_state"])
    return state, restored.data, restored.retrieval

  def close(self) -> None:
    """Waits for pending saves (re-raising their errors) and releases the manager."""
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(workdir: str, abstract_params, step: int | None = None):
  """Params of another run's checkpoint (latest unless `step`), onto sharded targets.

  Used to start one stage from the previous one (ICT -> reader warm-up -> REALM) and by
  downstream jobs that need no optimizer state.
  """
  directory = os.path.join(os.path.abspath(workdir), "checkpoints")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoints under {directory}")
  manager = ocp.CheckpointManager(directory, item_names=ITEMS,
                                  options=ocp.CheckpointManagerOptions(
                                      read_only=True, create=False, save_interval_steps=0))
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"no finished checkpoint under {directory}")
  restored = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_params)))
  manager.close()
  return restored.params, step


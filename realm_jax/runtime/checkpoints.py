"""Orbax checkpoints: async saves of params, optimizer state, data-iterator state and the
retrieval snapshot as separate items; keep-N; params-only restore for the next stage."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from realm_jax import paths
from realm_jax.errors import SELF_EXPLAINING, CheckpointError, ConfigError
from realm_jax.runtime import multihost

ITEMS = ("params", "opt", "data", "retrieval")
# How long a save may take, its cross-host barriers included, before it is an error.
SAVE_TIMEOUT_SECONDS = 1200
# What Orbax logs, as warnings, on every params-only restore of another run's checkpoint (the
# other items are left alone and the directory is opened read-only on purpose) and when the
# array handler is replaced (`_replica_parallel_writes_across_processes_only`).
_EXPECTED_WARNINGS = ("was found in the checkpoint, but could not be restored",
                      "Given directory is read only", "Type handler registry type")


class _ExpectedWarnings(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in _EXPECTED_WARNINGS)


logging.getLogger("absl").addFilter(_ExpectedWarnings())
logger = logging.getLogger(__name__)

# A restore that fails (a truncated file, a checkpoint deleted under the read) is reported once,
# naming the checkpoint. Orbax abandons its reads of the other arrays then: each is reported as
# it is collected (its exception never retrieved), and their TensorStore callbacks into the
# event loop Orbax has closed as well ("Event loop is closed"): thousands of tracebacks after
# that one line, by timing. Those two alone are dropped; any other goes to the hook as before.
_ABANDONED_READ = "_read_array_index_and_device_put"


def _abandoned_read(unraisable) -> bool:
  if getattr(unraisable.object, "__name__", None) == _ABANDONED_READ:
    return True
  return isinstance(unraisable.exc_value, RuntimeError) and \
      str(unraisable.exc_value) == "Event loop is closed" and any(
          frame.f_code.co_name == "call_soon_threadsafe"
          for frame, _ in traceback.walk_tb(unraisable.exc_traceback))


def _without_abandoned_reads(hook):
  def filtered(unraisable) -> None:
    if not _abandoned_read(unraisable):
      hook(unraisable)
  return filtered


sys.unraisablehook = _without_abandoned_reads(sys.unraisablehook)


def first_line(error: Exception, limit: int) -> str:
  """The error's first line, at most `limit` characters: a longer one keeps its start and its
  end (TensorStore puts the cause, e.g. "No space left on device", after long paths)."""
  text = str(error).splitlines()[0] if str(error) else ""
  if len(text) <= limit:
    return text
  half = (limit - 5) // 2
  return f"{text[:half]} ... {text[-half:]}"


def _replica_parallel_writes_across_processes_only() -> None:
  """Replica-parallel writes (Orbax's default off GPUs) split each replicated array among its
  replicas so that each host writes a part of it. In one process every part is this host's
  and the split only costs an eager slice per array and replica: the demo's REALM state on 8
  host devices blocked each save 0.70 s instead of 0.11 s, its first save 3.3 s instead of
  0.06 s (bench/checkpoint.py). So a one-process run writes each array whole, as Orbax does
  on GPUs; a job of several processes keeps the split."""
  wanted = jax.process_count() > 1
  current = ocp.type_handlers.get_type_handler(jax.Array)
  if getattr(current, "_use_replica_parallel", None) == wanted:
    return
  ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
      use_replica_parallel=wanted,
      array_metadata_store=getattr(current, "_array_metadata_store", None)), override=True)


class Checkpointer:
  """`W/checkpoints/<step>/{params,opt,data,retrieval}` via one CheckpointManager."""

  def __init__(self, workdir: str, keep: int, async_saves: bool = True):
    _replica_parallel_writes_across_processes_only()
    self.workdir, self.directory = workdir, checkpoint_dir(workdir)
    if paths.exists(self.directory) and not paths.isdir(self.directory):
      # found here, not by the first save after `checkpoint_every` steps of training
      raise FileExistsError(errno.EEXIST, "exists", self.directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_saves,
            # what a save cut short left (`<step>.orbax-checkpoint-tmp`) goes at start-up
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(timeout_secs=SAVE_TIMEOUT_SECONDS)),
        item_names=ITEMS)
    self._own_reader = None   # several processes: this process's manager for restores

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, state, data_state: dict, retrieval: dict) -> None:
    """Starts an async save; a failure of the previous one surfaces here or in `close`, as a
    CheckpointError naming the directory and the latest complete checkpoint."""
    try:
      self.manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(state.params),
          opt=ocp.args.StandardSave({"step": state.step, "opt_state": state.opt_state}),
          data=ocp.args.JsonSave(data_state),
          retrieval=ocp.args.StandardSave(retrieval)), force=True)
    except Exception as e:   # Orbax / TensorStore: ValueError, RuntimeError, OSError ...
      raise self._save_failed(e) from e

  def _save_failed(self, error: Exception) -> CheckpointError:
    """A save that failed (e.g. no space left): nothing of it is visible (Orbax writes under a
    tmp name and renames on commit); says which checkpoint a rerun resumes from."""
    try:
      self.manager.reload()
      latest = self.manager.latest_step()
    except Exception:  # noqa: BLE001  (the listing itself may fail on a sick disk)
      latest = None
    reason = first_line(error, 600) or type(error).__name__
    return CheckpointError(
        f"saving a checkpoint under {self.directory} failed: {reason}. Nothing of it is "
        f"visible; the latest complete checkpoint is "
        + (f"{self.directory}/{latest} (a rerun resumes from it)" if latest is not None
           else "none (a rerun starts over)"))

  def restore(self, step: int, abstract_state, abstract_retrieval) -> tuple[Any, dict, dict]:
    """Restores straight into the shardings of the abstract targets (no host copy first).
    Each process reads its own shards; with several, through a manager of this process
    alone (`_reader`), so a read that fails here leaves no other process waiting in Orbax's
    cross-process barrier: `restore_latest` agrees on the outcome afterwards."""
    restored = self._reader().restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state.params),
        opt=ocp.args.StandardRestore({"step": abstract_state.step,
                                      "opt_state": abstract_state.opt_state}),
        data=ocp.args.JsonRestore(),
        retrieval=ocp.args.StandardRestore(abstract_retrieval)))
    check_data_item(restored.data, step)
    state = abstract_state.replace(params=restored.params, step=restored.opt["step"],
                                   opt_state=restored.opt["opt_state"])
    return state, restored.data, restored.retrieval

  def _reader(self) -> ocp.CheckpointManager:
    """The manager restores go through: the run's own in one process, else one of this
    process alone, read-only: its Checkpointer's barriers then sync this process only, and
    (Orbax 0.12) the item handlers' restores and the arrays' reads of local shards sync none
    (tests/test_multihost.py fails if a read makes another process wait)."""
    if jax.process_count() == 1:
      return self.manager
    if self._own_reader is None:
      self._own_reader = read_only_manager(self.workdir, {jax.process_index()},
                                           item_names=ITEMS)
    return self._own_reader

  def restore_latest(self, abstract_state, abstract_retrieval, log=print):
    """(step, state, data item, retrieval item) of the newest checkpoint that restores, or
    None when there is none. A newer one that fails (a truncated or corrupt file) is named and
    the one before it tried. Once an older one has restored (the storage reads), the walk
    starts again from the newest: a checkpoint that failed once is tried a second time (an
    error that passed, e.g. a bucket's hiccup, must not cost the steps since), and one that
    fails twice is moved to `W/unreadable_checkpoints/<step>` (`<step>.2` where that step
    was moved there before; so that step can be saved again). The older one is then read
    twice, one state on the devices at a time. When none restores, CheckpointError names
    each: never step 0 silently. With several processes, every one walks process 0's list of
    steps and each try counts only where it restored on every process (a shard one host
    cannot read sends all to the one before, together)."""
    try:
      return self._walk(multihost.first_process_list(sorted(self.all_steps(), reverse=True)),
                        abstract_state, abstract_retrieval, log)
    finally:
      if self._own_reader is not None:
        self._own_reader.close()
        self._own_reader = None

  def _walk(self, steps: list[int], abstract_state, abstract_retrieval, log):
    """`restore_latest` over `steps` (newest first)."""
    failed: dict[int, str] = {}   # step -> why it did not restore (its latest try)
    for second_walk in (False, True):
      twice = []
      for step in steps:
        restored, why = self._try_restore(step, abstract_state, abstract_retrieval)
        if restored is None:
          if step in failed:
            twice.append(step)
          failed[step] = why
          log(f"checkpoint {self.directory}/{step} cannot be restored ({why})"
              + (", a second time" if step in twice else "") + "; trying the one before it")
          continue
        if second_walk and step in failed:
          log(f"checkpoint {self.directory}/{step} restored on a second try")
        if not failed or second_walk:
          for bad in twice:
            self._move_aside(bad, log)
          return (step, *restored)
        del restored   # read again in the second walk
        break
      else:
        break
    if failed:
      raise CheckpointError("no checkpoint of this run can be restored; not starting over "
                            "from step 0. Tried (newest first): " + "; ".join(
                                f"{self.directory}/{s} ({why})" for s, why in failed.items()))
    return None

  def _try_restore(self, step: int, abstract_state, abstract_retrieval):
    """(`restore(step)`, None), or (None, why it failed): failed on any process, on all."""
    try:
      restored, why = self.restore(step, abstract_state, abstract_retrieval), None
    except Exception as e:   # Orbax / TensorStore raise bare Exceptions for a bad file
      restored, why = None, f"{type(e).__name__}: {first_line(e, 400)}"
    others = [p for p in multihost.processes_where_not(restored is not None)
              if p != jax.process_index()]
    if others:
      where = f"process{'es' if len(others) > 1 else ''} " + ", ".join(map(str, others))
      restored, why = None, (f"{why}; it failed on {where} too" if why
                             else f"read here, failed on {where}")
    return restored, why

  def _move_aside(self, step: int, log) -> None:
    """`W/checkpoints/<step>` -> `W/unreadable_checkpoints/<step>` (process 0; all wait); where
    an earlier copy of that step is kept there already, `<step>.2`, `<step>.3`, ...: a step
    saved again and damaged again keeps both for the post-mortem."""
    from realm_jax.workdir import UNREADABLE_CHECKPOINTS
    aside = epath.Path(self.directory).parent / UNREADABLE_CHECKPOINTS
    if jax.process_index() == 0:
      target, copy = aside / str(step), 2
      while paths.exists(str(target)):
        target, copy = aside / f"{step}.{copy}", copy + 1
      source = epath.Path(self.directory) / str(step)
      try:
        paths.move_tree(str(source), str(target))
      except Exception as e:  # noqa: BLE001  (named, with what to do)
        raise CheckpointError(f"checkpoint {step} cannot be restored and could not be moved "
                              f"from {source} to {target} ({type(e).__name__}: {e}); move or "
                              "delete it, then resume") from e
      log(f"moved the unreadable checkpoint {step} to {target}")
    multihost.after_first_process(f"checkpoint-{step}-moved-aside",
                                  multihost.bulk_io_timeout())
    self.manager.reload()

  def saving(self) -> bool:
    """Whether a save is still being written (Orbax's tracker: also while older checkpoints
    are deleted after it, and False once a failed save ended). Read from the one-process
    watchdog's thread: a lock held only for an assignment there (with several processes the
    tracker's update waits on a barrier under that lock)."""
    return bool(self.manager.is_saving_in_progress())

  def wait(self) -> None:
    """Until every started save is finalised (its error as a CheckpointError)."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      raise self._save_failed(e) from e

  def close(self) -> None:
    """Waits for pending saves (their errors as CheckpointError) and releases the manager."""
    try:
      self.wait()
    finally:
      self.manager.close()


def checkpoint_dir(workdir: str) -> str:
  """`W/checkpoints`, absolute (a bucket URL as it is: Orbax writes to it directly)."""
  from realm_jax.workdir import CHECKPOINTS
  return paths.join(paths.absolute(workdir), CHECKPOINTS)


def read_only_manager(workdir: str, processes: set[int] | None = None,
                      **kwargs) -> ocp.CheckpointManager:
  """A manager that lists and reads `W/checkpoints` of a run another job writes; with
  `processes`, one that those processes of the job alone create and call (Orbax syncs them:
  `{jax.process_index()}` for one process's own listing), else every process."""
  directory = checkpoint_dir(workdir)
  if not paths.isdir(directory):
    raise FileNotFoundError(f"no checkpoints under {directory}")
  multiprocessing = ocp.options.MultiprocessingOptions() if processes is None else \
      ocp.options.MultiprocessingOptions(primary_host=min(processes),
                                         active_processes=set(processes))
  # (made again while a step deleted under it fails the listing it starts with)
  return again_while_deleted(lambda: ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(
          read_only=True, create=False, save_interval_steps=0,
          multiprocessing_options=multiprocessing), **kwargs))


def partial_params_restore(abstract_params) -> ocp.args.Composite:
  """Restore args for the `params` item reading only the paths of `abstract_params`, into
  their shardings (the rest of the saved tree is left on disk)."""
  return ocp.args.Composite(params=ocp.args.PyTreeRestore(
      item=abstract_params, partial_restore=True,
      restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_params)))


def write_params(workdir: str, params: dict, step: int = 0) -> str:
  """`W/checkpoints/<step>` with the `params` item only (an imported checkpoint: what
  `restore_params` reads); returns its dir."""
  manager = ocp.CheckpointManager(checkpoint_dir(workdir), item_names=ITEMS,
                                  options=ocp.CheckpointManagerOptions(
                                      create=True, enable_async_checkpointing=False))
  manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True)
  manager.wait_until_finished()
  manager.close()
  return paths.join(checkpoint_dir(workdir), str(step))


def saved_param_shapes(workdir: str, step: int | None = None
                       ) -> tuple[dict[tuple[str, ...], tuple[int, ...]], int]:
  """Path -> shape of every parameter a checkpoint holds (from its metadata; nothing is
  read), and its step (the latest unless `step`)."""
  manager = read_only_manager(workdir, item_handlers={"params": ocp.PyTreeCheckpointHandler()})
  try:
    step = _step_or_latest(manager, workdir, step)
    try:
      tree = manager.item_metadata(step)["params"]
    except Exception as e:   # noqa: BLE001 -- Orbax raises bare Exceptions for a bad file
      raise_unreadable(manager, workdir, step, e)
  finally:
    manager.close()
  tree = getattr(tree, "tree", tree)   # orbax's TreeMetadata wraps the nested dict
  leaves = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: not isinstance(x, dict))[0]
  return {tuple(str(getattr(k, "key", k)) for k in path): tuple(getattr(leaf, "shape", ()))
          for path, leaf in leaves}, step


# Orbax reads each step's metadata as it lists them: a step a run still writing W deletes
# (keep-N) meanwhile fails the listing (FileNotFoundError, or NotADirectoryError where the
# folder went between two of Orbax's looks at it). Listed again, this many times.
LIST_TRIES = 5


def listed_again(list_steps) -> list[int]:
  """`list_steps()` sorted, listed again (LIST_TRIES in all) while a step deleted under it
  fails Orbax's listing: every reader of a W another job still writes."""
  return again_while_deleted(lambda: sorted(list_steps()))


def again_while_deleted(fn):
  """`fn()`, a listing of W/checkpoints (or what starts with one: a manager made), tried again
  (LIST_TRIES in all) while a step deleted under it fails it."""
  for tries_left in reversed(range(LIST_TRIES)):
    try:
      return fn()
    except (FileNotFoundError, NotADirectoryError):
      if not tries_left:
        raise
      time.sleep(0.05)


def checkpoint_steps(workdir: str) -> list[int]:
  """The finished steps of `W/checkpoints` now (Orbax's listing), [] without the folder."""
  def steps() -> list[int]:
    if not paths.isdir(checkpoint_dir(workdir)):
      return []
    manager = read_only_manager(workdir)
    try:
      return manager.all_steps()
    finally:
      manager.close()
  return listed_again(steps)


def _step_or_latest(manager, workdir: str, step: int | None) -> int:
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"no finished checkpoint under {workdir}/checkpoints")
  elif step not in manager.all_steps():
    raise FileNotFoundError(f"{workdir}/checkpoints has no step {step} (it has "
                            f"{sorted(manager.all_steps())})")
  return step


def check_data_item(data, step: int) -> None:
  """A ValueError where checkpoint `step`'s data item is not the one a run writes there
  (train/batches.py `BatchStream.state`: `next_step` = the step, the input pipeline's
  `iterator` state): an edited or damaged `data/metadata` is a checkpoint that cannot be
  restored (the walk tries the one before it), not a KeyError once the run starts."""
  if not isinstance(data, dict) or data.get("next_step") != step or \
      not isinstance(data.get("iterator"), dict):
    text = json.dumps(data) if isinstance(data, (dict, list)) else repr(data)
    raise ValueError(f"its data item {text[:200]} is not the one a run writes at step {step} "
                     f"(next_step {step} and the input pipeline's iterator state)")


def raise_unreadable(manager, workdir: str, step: int, error: Exception):
  """Raises `_unreadable`'s error: `error` itself as it was (its own cause kept), or the
  CheckpointError from it."""
  unreadable = _unreadable(manager, workdir, step, error)
  if unreadable is error:
    raise error
  raise unreadable from error


def _unreadable(manager, workdir: str, step: int, error: Exception) -> Exception:
  """The error of a checkpoint that a reader of its params only (realm-eval, realm-predict,
  `init.from_workdir`, realm-index) cannot read, naming it, why, and the steps there are:
  none other is read in its place (realm-train's resume walks back; an evaluation of another
  step would not be the one asked for). `error` itself where it is not the checkpoint's
  (storage out of reach, memory exhausted, the project's own errors)."""
  if isinstance(error, (ConnectionError, TimeoutError, MemoryError, *SELF_EXPLAINING)) or \
      "RESOURCE_EXHAUSTED" in str(error):
    return error
  why = f"{type(error).__name__}: {first_line(error, 400)}"
  try:
    manager.reload()   # the listing now, not the one the read started from
  except Exception:  # noqa: BLE001  (the listing itself may fail on a sick disk)
    pass
  listed = set(manager.all_steps())
  others = sorted(listed - {step})
  if step not in listed:   # not damaged: the keep-N of a run still writing W
    return CheckpointError(f"checkpoint {checkpoint_dir(workdir)}/{step} was deleted while it "
                           f"was read (a run still writing {workdir} keeps only its newest "
                           f"checkpoints); read one it has now ({others})")
  return CheckpointError(f"checkpoint {checkpoint_dir(workdir)}/{step} cannot be restored "
                         f"({why}); restore it from a copy of the run" + (
                             f", or read another of its steps ({others})" if others else ""))


def shape_mismatches(saved: dict, ours: dict) -> list[str]:
  """`path: (saved) in the checkpoint, (ours) in this run` for every parameter path of `ours`
  (path -> shape) that `saved` (`saved_param_shapes`) holds with another shape."""
  return [f"{'/'.join(p)}: {tuple(saved[p])} in the checkpoint, {tuple(shape)} in this run"
          for p, shape in ours.items() if p in saved and tuple(saved[p]) != tuple(shape)]


def restore_params(workdir: str, abstract_params, step: int | None = None,
                   partial: bool = False, saved: dict | None = None):
  """Params of another run's checkpoint (latest unless `step`), onto sharded targets.

  Used to start one stage from the previous one (ICT -> reader warm-up -> REALM -> Open-QA)
  and by downstream jobs that need no optimizer state. With `partial`, parameters the
  checkpoint lacks (Open-QA's span scorer after pre-training) are left out of the result:
  returns (params restored, step, paths missing) and the caller keeps its own values for them
  (`saved`: the checkpoint's `saved_param_shapes`, where the caller has read them already).
  Without it returns (params, step) and a missing parameter is an error.
  """
  manager = read_only_manager(workdir, item_names=ITEMS)
  step = _step_or_latest(manager, workdir, step)
  missing: list[tuple[str, ...]] = []
  if partial:
    if saved is None:
      saved, _ = saved_param_shapes(workdir, step)
    flat = traverse_util.flatten_dict(abstract_params)
    missing = sorted(p for p in flat if p not in saved)
    abstract_params = traverse_util.unflatten_dict({p: v for p, v in flat.items()
                                                    if p in saved})
  try:
    restored = manager.restore(
        step, args=partial_params_restore(abstract_params) if partial else
        ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
  except Exception as e:   # noqa: BLE001 -- Orbax / TensorStore raise bare Exceptions
    raise_unreadable(manager, workdir, step, e)
  finally:
    manager.close()
  if partial:
    return restored.params, step, missing
  return restored.params, step


def run_config(workdir: str, config=None):
  """`config` if given, else the run's own resolved config (`W/config.json`)."""
  from realm_jax import workdir as workdir_lib
  return config if config is not None else workdir_lib.saved_config(workdir)


def fitted_mesh(config):
  """`config`, with `mesh.shape` (-1, 1) where its own does not fit this machine's devices (a
  run trained on a pod, evaluated on one host): a checkpoint restores onto any mesh, and
  evaluating with no `--config` (realm-eval, realm-predict) leaves no other way to say so.
  Logged."""
  import jax
  from realm_jax.runtime.partitioning import resolve_mesh_shape
  try:
    resolve_mesh_shape(config.mesh.shape, jax.device_count())
  except ConfigError as e:
    logger.info(f"[restore] the run's mesh.shape does not fit here ({e.message}): "
                f"(-1, 1) over {jax.device_count()} devices instead")
    config.mesh.shape = (-1, 1)
  return config


def _checked_shapes(workdir: str, step: int | None, abstract_params,
                    saved: dict | None = None) -> tuple[dict, int]:
  """The checkpoint's `saved_param_shapes` (read here unless given, at `step`), or a
  ConfigError naming the parameters whose shape there differs from the model's (a config or
  data dir other than the run's), before Orbax fails on them."""
  if saved is None:
    saved, step = saved_param_shapes(workdir, step)
  ours = {p: a.shape for p, a in traverse_util.flatten_dict(abstract_params).items()}
  wrong = shape_mismatches(saved, ours)
  if wrong:
    raise ConfigError("", f"{workdir} step {step}: {len(wrong)} parameters do not fit this "
                      f"config and data dir ({'; '.join(wrong[:3])}); the run's own are "
                      "in its W/config.json (realm-eval reads it without --config)")
  return saved, step


@dataclasses.dataclass
class RestoredRun:
  """A run's checkpoint loaded for evaluation: its model and params on `mesh`."""

  config: Any           # the config the model was built from
  model: Any
  mesh: Any
  abstract: Any         # the abstract train state (shapes and shardings)
  params: dict
  step: int             # the checkpoint's step
  missing: list         # with `partial`: parameter paths the checkpoint lacks


def abstract_run(config, vocab_size: int | None = None, block_len: int | None = None,
                 mesh_shape=None):
  """(model, mesh, abstract train state) of `config`, nothing materialised: what a run's
  checkpoint restores onto. Defaults as `restore_run`'s."""
  from realm_jax.data.tokenizer import load_tokenizer
  from realm_jax.runtime import partitioning, state as state_lib
  if vocab_size is None:
    vocab_size = config.model.vocab_size or load_tokenizer(
        os.path.join(paths.local_dir(config.data.dir), "vocab.txt")).vocab_size
  model = state_lib.build_model(config, vocab_size)
  mesh = partitioning.make_mesh(config.mesh.shape if mesh_shape is None else mesh_shape)
  abstract, _ = state_lib.abstract_train_state(config, model, mesh,
                                               block_len or config.data.block_len)
  return model, mesh, abstract


def restore_run(workdir: str, step: int | None = None, *, config=None,
                vocab_size: int | None = None, block_len: int | None = None,
                mesh_shape=None, partial: bool = False,
                saved: dict | None = None) -> RestoredRun:
  """The one way to load a run for evaluation (realm-eval, realm-predict, zero-shot recall,
  the HF import's parity check, benches, tests): the model of `config` (default: the run's
  own `W/config.json`), its abstract state on a `mesh_shape` mesh (default `config.mesh.shape`)
  and the params of a checkpoint, the latest unless `step`. `vocab_size` / `block_len` default
  to the config's (the vocab size read from its data dir when the config leaves it to the
  data). With `partial`, parameters the checkpoint lacks are left out (see restore_params).
  `saved`: the checkpoint's `saved_param_shapes` at `step`, where the caller has read them.
  """
  config = run_config(workdir, config)
  model, mesh, abstract = abstract_run(config, vocab_size, block_len, mesh_shape)
  saved, step = _checked_shapes(workdir, step, abstract.params, saved)
  missing = []
  if partial:
    params, step, missing = restore_params(workdir, abstract.params, step, partial=True,
                                           saved=saved)
  else:
    params, step = restore_params(workdir, abstract.params, step)
  return RestoredRun(config, model, mesh, abstract, params, step, missing)

"""A config file (`configs/X.py[:arg]`) -> its ConfigDict, old option names read as the new."""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from realm_jax.config.option_names import upgrade_config

def config_module(path: str):
  """Imports a config file (`configs/X.py`) by path, as ml_collections' `--config` does."""
  spec = importlib.util.spec_from_file_location(
      "_config_" + os.path.splitext(os.path.basename(path))[0], path)
  if spec is None:
    raise FileNotFoundError(f"config file {path!r} is not a .py file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def module_config(module, arg: str = "") -> ml_collections.ConfigDict:
  """A config module's get_config(arg) (get_config() without `arg`), or a TypeError where
  that is no ConfigDict, as the CLIs' `--config` refuses it."""
  config = module.get_config(arg) if arg else module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise TypeError(f"get_config() returned {type(config).__name__}, not an "
                    "ml_collections.ConfigDict")
  return config


def load_config(spec: str) -> ml_collections.ConfigDict:
  """`path/to/config.py[:arg]` -> its get_config(arg) (`module_config`), old option names
  read as the new."""
  path, _, arg = spec.partition(":")
  config = module_config(config_module(path), arg)
  upgrade_config(config)
  return config

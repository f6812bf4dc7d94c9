"""The run config of a command line: a recipe file, then gin files and bindings, then overrides.

`rljax train`, `rljax config show` and `rljax plan` all build their config here (`resolve_config`).
A recipe is a Python file with `get_config()` returning a ConfigDict, or a gin file (`.gin`) of
bindings onto `base_config()`.
"""
from __future__ import annotations

import importlib.util
import os
import traceback
from typing import Sequence

import ml_collections

from rljax.config.gin_bindings import apply_gin
from rljax.config.overrides import apply_overrides, split_config_args, split_gin_args
from rljax.config.schema import base_config
from rljax.config.validation import validate as validate_config
from rljax.errors import ConfigError

# The embedded default recipe: what `rljax train` runs without --config.
DEFAULT_RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "default.py")


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """The ConfigDict of a recipe: a Python file's `get_config()`, or a gin file's bindings onto
  `base_config()` (a `.gin` file is read as if passed with --gin_file)."""
  if os.path.isdir(path) or not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist; pass --config path/to/recipe.py "
                      "(see configs/ for the recipes).")
  if path.endswith(".gin"):
    return apply_gin(base_config(), files=[path])
  if not path.endswith(".py"):
    raise ConfigError(f"config file {path!r} is neither a Python recipe (.py, with get_config()) nor a gin file "
                      "(.gin); rename it or pass one of the recipes in configs/.")
  spec = importlib.util.spec_from_file_location(f"rljax_config_{abs(hash(path))}", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # A broken config file: say which file.
    raise ConfigError(f"config file {path!r} failed to load: {type(e).__name__}: {e}") from e
  if not hasattr(module, "get_config"):
    raise ConfigError(f"config file {path!r} has no get_config() function.")
  try:
    cfg = module.get_config()
  except Exception as e:  # A recipe whose get_config() raises: say which file and where, not a traceback.
    frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == os.path.abspath(path)]
    where = f" (line {frames[-1].lineno})" if frames else ""
    raise ConfigError(f"config file {path!r}: get_config() raised {type(e).__name__}: {e}{where}; fix the recipe.") \
        from e
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise ConfigError(f"config file {path!r}: get_config() returned a {type(cfg).__name__}; return the "
                      "ConfigDict of rljax.config.base_config() with your changes.")
  return cfg


def build_config(path: str | None, gin_files: Sequence[str] = (), gin_bindings: Sequence[str] = (),
                 overrides: Sequence[str] = (), validate: bool = True) -> ml_collections.ConfigDict:
  """The run config: the recipe at `path` (a .py or .gin file; None: the embedded default, or
  base_config() when gin files are given), then gin files, gin bindings and --config overrides."""
  if path is not None:
    cfg = load_config_file(path)
  elif gin_files:
    cfg = base_config()
  else:
    cfg = load_config_file(DEFAULT_RECIPE)
  apply_gin(cfg, gin_files, gin_bindings)
  apply_overrides(cfg, overrides)
  if validate:
    validate_config(cfg)
  return cfg


def resolve_config(argv: Sequence[str]) -> tuple[ml_collections.ConfigDict, list[str]]:
  """Loads --config (or the default recipe), applies --gin_file / --gin_bindings and --config.x=y
  overrides, validates. Returns (config, the other arguments)."""
  gin_files, gin_bindings, argv = split_gin_args(argv)
  path, overrides, rest = split_config_args(argv)
  return build_config(path, gin_files, gin_bindings, overrides), rest

"""Resolving "package.module:attribute" references from configs (verifiers, tools)."""
from __future__ import annotations

import importlib
from typing import Any

from rljax.errors import ConfigError


def import_object(ref: str, what: str) -> Any:
  """The callable named by `ref` = "package.module:attr[.attr...]"; `what` names it in errors.

  Raises ConfigError when the module does not import, an attribute is missing, or the object
  is not callable.
  """
  module_name, _, attr = ref.partition(":")
  try:
    obj: Any = importlib.import_module(module_name)
  except ImportError as e:
    where = ""
    if isinstance(e, ModuleNotFoundError) and e.name == module_name.split(".")[0]:
      import os
      where = (f" Modules are found on sys.path: the working directory ({os.getcwd()}), PYTHONPATH and the installed "
               f"packages; for a file elsewhere, run with PYTHONPATH=/its/directory.")
    raise ConfigError(f"{what} '{ref}': cannot import module '{module_name}' ({e}); check the path and that "
                      f"the module is importable (on sys.path).{where}") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ConfigError(f"{what} '{ref}': module '{module_name}' has no attribute '{attr}'.")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ConfigError(f"{what} '{ref}' is not callable.")
  return obj

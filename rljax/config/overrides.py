"""`--config.a.b=value` overrides (ml_collections style), and splitting them from the other arguments.

Overrides are parsed as Python literals (`0.28`, `True`, `"text"`, `[1, 2]`, `None`), falling back
to a plain string, and must match the type of the field they replace. gin bindings
(rljax/config/gin_bindings.py) set their values through the same `set_field`.
"""
from __future__ import annotations

import ast
import difflib
from typing import Any, Sequence

import ml_collections

from rljax.errors import ConfigError


def parse_value(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _coerce(path: str, old: Any, new: Any) -> Any:
  if old is None or new is None:
    return new
  if isinstance(old, bool):
    if isinstance(new, bool):
      return new
    if isinstance(new, str) and new.lower() in ("true", "false"):
      return new.lower() == "true"
    raise ConfigError(f"--config.{path}={new!r}: expected a bool (True/False).")
  if isinstance(old, int) and isinstance(new, int) and not isinstance(new, bool):
    return new
  if isinstance(old, int) and isinstance(new, float):
    raise ConfigError(f"--config.{path}={new!r}: the field holds a whole number ({old!r}); pass an integer, "
                      f"e.g. --config.{path}={max(int(new), 1)}.")
  if isinstance(old, float) and isinstance(new, (int, float)) and not isinstance(new, bool):
    return float(new)
  if isinstance(old, str) and isinstance(new, str):
    return new
  if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
    return type(old)(new)
  if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(new, bool):
    return new
  if isinstance(old, (dict, ml_collections.ConfigDict)) and not len(old) and isinstance(new, dict):
    return new   # a free-form mapping field (empty by default), e.g. tools.kwargs
  raise ConfigError(f"--config.{path}={new!r} has type {type(new).__name__}, but the field holds a "
                    f"{type(old).__name__} ({old!r}).")


def set_field(cfg: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """Sets `cfg.<path>`; unknown fields raise ConfigError with a suggestion."""
  parts = path.split(".")
  node = cfg
  for i, key in enumerate(parts):
    here = ".".join(parts[:i + 1])
    keys = list(node.keys()) if isinstance(node, (ml_collections.ConfigDict, dict)) else []
    if key not in keys:
      close = difflib.get_close_matches(key, keys, n=1)
      hint = f" Did you mean {'.'.join(parts[:i] + [close[0]])!r}?" if close else ""
      raise ConfigError(f"config field {here!r} does not exist.{hint}")
    if i == len(parts) - 1:
      new = _coerce(path, node[key], value)
      try:
        if isinstance(node, ml_collections.ConfigDict):
          with node.unlocked():
            node[key] = new
        else:
          node[key] = new
      except (TypeError, ValueError) as e:   # ml_collections' own type check
        raise ConfigError(f"--config.{path}={new!r} does not fit the field, which holds {node[key]!r} "
                          f"({type(e).__name__}: {e}); pass a value of the same type.") from None
    else:
      node = node[key]


def apply_overrides(cfg: ml_collections.ConfigDict, overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """Applies ["a.b=1", ...] (the text after `--config.`)."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"--config.{item}: expected --config.FIELD=VALUE.")
    key, text = item.split("=", 1)
    set_field(cfg, key, parse_value(text))
  return cfg


def split_config_args(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
  """Separates `--config PATH` / `--config=PATH` and `--config.x=y` from the other arguments."""
  path, overrides, rest = None, [], []
  i = 0
  while i < len(argv):
    a = argv[i]
    if a == "--config":
      if i + 1 >= len(argv):
        raise ConfigError("--config needs a path to a config file.")
      path = argv[i + 1]
      i += 2
      continue
    if a.startswith("--config="):
      path = a.split("=", 1)[1]
    elif a.startswith("--config."):
      body = a[len("--config."):]
      if "=" not in body and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
        body = f"{body}={argv[i + 1]}"
        i += 1
      overrides.append(body)
    else:
      rest.append(a)
    i += 1
  return path, overrides, rest


_GIN_FLAGS = {"--gin_file": "files", "--gin-file": "files", "--gin_bindings": "bindings", "--gin-bindings": "bindings"}


def split_gin_args(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
  """Separates `--gin_file PATH` and `--gin_bindings 'a.b = 1'` (each repeatable, `=` or a space
  before the value) from the other arguments. Returns (gin files, gin bindings, the rest)."""
  found: dict[str, list[str]] = {"files": [], "bindings": []}
  rest = []
  i = 0
  while i < len(argv):
    a = argv[i]
    flag, sep, value = a.partition("=")
    if flag in _GIN_FLAGS:
      if not sep:
        if i + 1 >= len(argv):
          raise ConfigError(f"{flag} needs a value: {flag}=path/to/file.gin or {flag}='train.steps = 5'.")
        value = argv[i + 1]
        i += 1
      found[_GIN_FLAGS[flag]].append(value)
    else:
      rest.append(a)
    i += 1
  return found["files"], found["bindings"], rest

"""gin bindings onto the run config: `--gin_file recipe.gin` and `--gin_bindings 'train.steps = 5'`.

The gin-config package parses the files and bindings (its syntax: `section.field = value` with
Python literals, `MACRO = value` / `%MACRO`, `include 'other.gin'`); every section of
`rljax.config.base_config()` is a gin configurable whose parameters are that section's fields:

  train.steps = 24                        # config.train.steps
  model.random.hidden_size = 32           # config.model.random.hidden_size
  config.tokenizer = "smollm2-135m-instruct"   # top-level fields live under `config`

The bound values are then set on the ConfigDict with the same type checks as `--config.FIELD=VALUE`
(rljax/config/overrides.py), and the result goes through the same `validate`. A gin file is a
whole recipe on top of base_config(), like a recipe .py file; `configs/default.gin` is the
embedded default written that way.
"""
from __future__ import annotations

import difflib
import os
import re
from typing import Sequence

import gin
import ml_collections

from rljax.config.overrides import set_field
from rljax.errors import ConfigError

_MODULE = "rljax"          # gin module of the configurables: selectors are rljax.train, rljax.model.random, ...
_ROOT = "config"           # the configurable holding the top-level fields (config.tokenizer)
_registered: dict[str, tuple[str, ...]] = {}


def schema(cfg: ml_collections.ConfigDict) -> dict[str, tuple[str, ...]]:
  """{section: field names} of a config: "" for the top level, "model", "model.random", ...

  A non-empty ConfigDict is a section; anything else (values, lists, empty free-form mappings
  such as tools.kwargs) is a field.
  """
  out: dict[str, tuple[str, ...]] = {}

  def walk(node, prefix):
    fields = []
    for key in node.keys():
      value = node[key]
      if isinstance(value, ml_collections.ConfigDict) and len(value):
        walk(value, f"{prefix}{key}.")
      else:
        fields.append(key)
    out[prefix[:-1]] = tuple(fields)

  walk(cfg, "")
  return out


def _configurable_name(section: str) -> str:
  return f"{_MODULE}.{section or _ROOT}"


def _register(sections: dict[str, tuple[str, ...]]) -> None:
  """Registers one gin configurable per section (once per process; gin's registry is global)."""
  for section, fields in sections.items():
    name = _configurable_name(section)
    if name in _registered:
      continue
    module, _, leaf = name.rpartition(".")

    def section_fn(**kwargs):
      return kwargs

    section_fn.__name__ = leaf
    gin.external_configurable(section_fn, name=leaf, module=module, allowlist=list(fields))
    _registered[name] = fields


def _selector_hint(selector: str, sections: dict[str, tuple[str, ...]]) -> str:
  names = [s or _ROOT for s in sections]
  close = difflib.get_close_matches(selector, names, n=1)
  return f" Did you mean {close[0]!r}?" if close else f" The sections are: {', '.join(sorted(names))}."


def _config_error(e: Exception, where: str, sections: dict[str, tuple[str, ...]]) -> ConfigError:
  """gin's parse error as a ConfigError naming the field, with a suggestion for a typo."""
  text = str(e)
  first, _, location = text.partition("\n")
  location = " ".join(location.split())
  m = re.search(r"Configurable '([^']+)' doesn't include kwarg '([^']+)'", first)
  if m:
    leaf, field = m.groups()
    section = next((s for s in sections if (s or _ROOT).split(".")[-1] == leaf), leaf)
    fields = sections.get(section, ())
    close = difflib.get_close_matches(field, fields, n=1)
    prefix = f"{section}." if section else f"{_ROOT}."
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else f" Its fields: {', '.join(fields)}."
    return ConfigError(f"{where}: config field '{prefix}{field}' does not exist.{hint} ({location})")
  m = re.search(r"No configurable matching '([^']+)'", first)
  if m:
    return ConfigError(f"{where}: {m.group(1)!r} is not a config section.{_selector_hint(m.group(1), sections)} "
                       f"({location})")
  return ConfigError(f"{where}: {first} {f'({location})' if location else ''}".rstrip() +
                     " Bindings look like `train.steps = 24` (see configs/default.gin).")


def apply_gin(cfg: ml_collections.ConfigDict, files: Sequence[str] = (),
              bindings: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Applies gin `files`, then `bindings`, to `cfg` (in place) and returns it.

  Raises:
    ConfigError: a missing file, a syntax error, an unknown section or field, or a value of the
      wrong type, named with the file (or binding) it came from.
  """
  files, bindings = list(files), list(bindings)
  if not files and not bindings:
    return cfg
  for path in files:
    if not os.path.isfile(path):
      raise ConfigError(f"gin file {path!r} does not exist; pass --gin_file path/to/recipe.gin "
                        "(configs/default.gin is an example).")
  sections = schema(cfg)
  _register(sections)
  where = " ".join([f"gin file {f!r}" for f in files] + [f"--gin_bindings {b!r}" for b in bindings])
  gin.clear_config()
  try:
    try:
      gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    except (ValueError, SyntaxError, IOError, TypeError) as e:
      raise _config_error(e, where, sections) from None
    for section, fields in sections.items():
      try:
        bound = gin.get_bindings(_configurable_name(section))
      except (ValueError, KeyError):
        continue
      for field, value in bound.items():
        path = f"{section}.{field}" if section else field
        try:
          set_field(cfg, path, value)
        except ConfigError as e:
          raise ConfigError(f"{where}: {str(e).replace('--config.', 'config.')}") from None
  finally:
    gin.clear_config()
  return cfg

"""The model families rljax supports, one module each, and the registry that finds them.

Every module of this package (other than `base` and names starting with "_") that defines
`FAMILIES` (a tuple of `Family` instances) is imported and registered when the package is first
imported: adding a family is adding its module (and its tests). Lookups:

    get("qwen2")                       # by ModelConfig.architecture
    for_model_type("qwen2", source)    # by config.json's model_type (WeightsError when unsupported)
    for_gguf("qwen2", source)          # by a GGUF file's general.architecture
    from_hf(config_json_dict, source)  # -> ModelConfig
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
from typing import Any, Iterator, Mapping

from rljax.errors import ConfigError, WeightsError
from rljax.models.families.base import Family

_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
  """Adds `family` (its name and model types must be new); returns it."""
  if family.name in _REGISTRY:
    raise ValueError(f"model family {family.name!r} is registered twice")
  taken = {t for f in _REGISTRY.values() for t in f.model_types}
  if taken & set(family.model_types):
    raise ValueError(f"model_type {sorted(taken & set(family.model_types))} of family {family.name!r} is "
                     "already registered")
  _REGISTRY[family.name] = family
  return family


def unregister(name: str) -> None:
  _REGISTRY.pop(name, None)


@contextlib.contextmanager
def registered(family: Family) -> Iterator[Family]:
  """`family` registered for the duration of a `with` block (tests of the extension point)."""
  register(family)
  try:
    yield family
  finally:
    unregister(family.name)


def names() -> tuple[str, ...]:
  """The registered architecture names, sorted."""
  return tuple(sorted(_REGISTRY))


def get(name: str) -> Family:
  """The family of ModelConfig.architecture `name`; ConfigError naming the field when unknown."""
  family = _REGISTRY.get(name)
  if family is None:
    raise ConfigError(f"model.architecture={name!r} is not supported; use one of {names()}.")
  return family


def for_model_type(model_type: Any, source: str) -> Family:
  """The family that reads config.json's `model_type`; WeightsError naming the file otherwise."""
  for family in _REGISTRY.values():
    if model_type in family.model_types:
      return family
  for family in _REGISTRY.values():
    if model_type in family.refused_model_types:
      raise WeightsError(f"{source}: model_type={model_type!r} {family.refused_model_types[model_type]}")
  supported = sorted(t for f in _REGISTRY.values() for t in f.model_types)
  raise WeightsError(f"{source}: model_type={model_type!r} is not supported; rljax supports {', '.join(supported)}.")


def for_gguf(architecture: Any, source: str) -> Family:
  """The family of a GGUF file's `general.architecture`; WeightsError naming the file otherwise."""
  for family in _REGISTRY.values():
    if architecture in family.gguf_architectures:
      return family
  supported = sorted(a for f in _REGISTRY.values() for a in f.gguf_architectures)
  raise WeightsError(f"{source}: GGUF architecture {architecture!r} is not supported; rljax supports "
                     f"{', '.join(supported)}.")


def from_hf(hf: Mapping[str, Any], source: str = "config.json"):
  """A transformers config.json dict -> ModelConfig, by its family."""
  return for_model_type(hf.get("model_type"), source).from_hf(hf, source)


def lora_target_names() -> tuple[str, ...]:
  """Every projection name some family can adapt (config validation before the model is known)."""
  out: list[str] = []
  for family in _REGISTRY.values():
    out += [t for t in family.lora_targets if t not in out]
  return tuple(out)


def _discover() -> None:
  for info in pkgutil.iter_modules(__path__):
    if info.name == "base" or info.name.startswith("_"):
      continue
    module = importlib.import_module(f"{__name__}.{info.name}")
    for family in getattr(module, "FAMILIES", ()):
      register(family)


_discover()

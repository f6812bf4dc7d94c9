"""Mapping between Hugging Face tensor names/layouts and rljax's parameter tree.

What the tensors are called and how they are laid out is the family's (`Family.tensors`, a list
of rljax/models/layouts.py `Tensor`s); this module moves whole tensors through that list.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from rljax.errors import WeightsError
from rljax.models import families, layouts
from rljax.models.config import ModelConfig


def tensors(c: ModelConfig) -> list[layouts.Tensor]:
  """Every parameter of `c`'s tree with its HF name and layout."""
  return families.get(c.architecture).tensors(c)


def expected_hf_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> shape, for every tensor a checkpoint of `c` holds."""
  out = {}
  for spec in tensors(c):
    for layer in (spec.layer_ids(c.num_layers) if spec.per_layer else (None,)):
      for name in spec.hf_names(layer):
        out[name] = spec.hf_shape
  return out


def tree_set(tree: dict, path, value) -> None:
  for p in path[:-1]:
    tree = tree.setdefault(p, {})
  tree[path[-1]] = value


def tree_get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def hf_to_params(c: ModelConfig, get: Callable[[str], np.ndarray], names: set[str], source: str = "weights"):
  """Builds the rljax param tree from HF-named tensors.

  `get(name)` returns a numpy array; `names` is the set of available tensor names.
  Raises WeightsError naming the file and the tensor on a missing tensor or shape mismatch.
  """
  def read(name):
    if name not in names:
      raise WeightsError(f"{source}: tensor {name!r} is missing; the weights do not match config "
                         f"(architecture={c.architecture}, layers={c.num_layers}).")
    w = np.asarray(get(name))
    if tuple(w.shape) != spec.hf_shape:
      raise WeightsError(f"{source}: tensor {name!r} has shape {tuple(w.shape)} but the config implies "
                         f"{spec.hf_shape}; config.json and the weights disagree.")
    return w.astype(np.float32) if w.dtype != np.float32 else w

  def fetch(spec, layer=None):
    ws = [read(name) for name in spec.hf_names(layer)]
    return layouts.to_rljax(spec, ws if spec.layout == "experts" else ws[0])

  dtype = np.dtype(c.storage_dtype)
  params: dict = {}
  for spec in tensors(c):
    if spec.per_layer:
      value = np.stack([fetch(spec, i) for i in spec.layer_ids(c.num_layers)])
    else:
      value = fetch(spec)
    tree_set(params, spec.tree_path, value.astype(dtype))
  return params


def params_to_hf(c: ModelConfig, params, dtype=np.float32) -> dict[str, np.ndarray]:
  """rljax params -> HF-named numpy tensors (contiguous, in `dtype`)."""
  out: dict[str, np.ndarray] = {}

  def put(name, w):
    out[name] = np.ascontiguousarray(np.asarray(w, dtype=np.float32).astype(dtype))

  for spec in tensors(c):
    value = np.asarray(tree_get(params, spec.tree_path), dtype=np.float32)
    if spec.per_layer:
      for j, i in enumerate(spec.layer_ids(c.num_layers)):
        for name, w in zip(spec.hf_names(i), layouts.to_hf_list(spec, value[j])):
          put(name, w)
    else:
      put(spec.hf_name(), layouts.to_hf(spec, value))
  return out


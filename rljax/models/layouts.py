"""How one rljax parameter is laid out in a Hugging Face checkpoint: a `Tensor` record per parameter.

HF stores linear weights as [out, in]; rljax stores kernels as [in, ..., out] with heads split
out, and stacks layers on a leading axis (for `nn.scan`). A family lists its parameters as
`Tensor`s (`Family.tensors`); everything that moves weights (convert.py: whole tensors; io.py:
per-device blocks of sharded loads; lora_io.py: adapter names) reads that list, so a family's
weight names and layouts are stated once.

Layouts (rljax shape <- HF shape): ident [X] <- [X]; t [in, out] <- [out, in];
qkv [D, H, Dh] <- [H*Dh, D]; o [H, Dh, D] <- [D, H*Dh]; bias [H, Dh] <- [H*Dh];
experts [E, in, out] <- E tensors [out, in], one per expert (HF's `mlp.experts.{e}.gate_proj.weight`:
the hub layout, which transformers 5.x reads and writes, fusing them only in memory).

Stacks: the layers of a model whose layers differ (a mixture of experts with dense layers mixed
in) are stacked by kind, each kind under its own key (`stack`, holding the model layers `layers`
in order; rljax/models/transformer.py runs them in model order); a model whose layers are all
alike has one stack, "layers", of every layer.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from rljax.errors import WeightsError

LAYOUTS = ("ident", "t", "qkv", "o", "bias", "experts")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One parameter: its path in the rljax tree, its HF name and layout, its rljax shape.

  path: within a layer's subtree when `per_layer` (the tree holds it under (stack, *path),
  stacked [len(layers), *shape]), else from the root. hf: the HF name, or for a per-layer tensor its
  suffix after `model.layers.{i}.` (with `{e}` for the expert index of an "experts" layout).
  shape: the rljax shape of one layer's tensor ([E, in, out] for "experts"). stack, layers: the
  stack key and the model layers it holds (None: every layer). required=False: read when present
  and ignored otherwise (a tied model's `lm_head.weight`); never written when absent.
  """
  path: tuple[str, ...]
  hf: str
  layout: str
  shape: tuple[int, ...]
  per_layer: bool = True
  required: bool = True
  stack: str = "layers"
  layers: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"layout {self.layout!r} is not one of {LAYOUTS}")

  def hf_name(self, layer: int | None = None, expert: int | None = None) -> str:
    name = self.hf if expert is None else self.hf.format(e=expert)
    return f"model.layers.{layer}.{name}" if self.per_layer else name

  def hf_names(self, layer: int | None = None) -> list[str]:
    """The HF tensors of one layer's parameter: one per expert for "experts", else one."""
    if self.layout == "experts":
      return [self.hf_name(layer, e) for e in range(self.shape[0])]
    return [self.hf_name(layer)]

  def layer_ids(self, num_layers: int) -> tuple[int, ...]:
    """The model layers this per-layer tensor is stacked over, in stack order."""
    return tuple(range(num_layers)) if self.layers is None else self.layers

  @property
  def tree_path(self) -> tuple[str, ...]:
    return (self.stack,) + self.path if self.per_layer else self.path

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """The shape of each HF tensor (one expert's for "experts")."""
    s = self.shape
    if self.layout == "ident":
      return s
    if self.layout == "t":
      return (s[1], s[0])
    if self.layout == "experts":
      return (s[2], s[1])
    if self.layout == "qkv":
      return (s[1] * s[2], s[0])
    if self.layout == "o":
      return (s[2], s[0] * s[1])
    return (s[0] * s[1],)   # bias


def to_rljax(spec: Tensor, w) -> np.ndarray:
  """One layer's HF tensor (for "experts": the list of the E experts' tensors) -> its rljax array."""
  s = spec.shape
  if spec.layout == "experts":
    return np.stack([np.asarray(x).T for x in w])
  if spec.layout == "ident":
    return w
  if spec.layout == "t":
    return w.T
  if spec.layout == "qkv":
    d, h, dh = s
    return w.reshape(h, dh, d).transpose(2, 0, 1)
  if spec.layout == "o":
    h, dh, d = s
    return w.reshape(d, h, dh).transpose(1, 2, 0)
  return w.reshape(s)


def to_hf_list(spec: Tensor, w: np.ndarray) -> list[np.ndarray]:
  """One rljax array (one layer's) -> its HF tensors, aligned with `spec.hf_names(layer)`."""
  if spec.layout == "experts":
    return [x.T for x in w]
  return [to_hf(spec, w)]


def to_hf(spec: Tensor, w: np.ndarray) -> np.ndarray:
  """One rljax array (one layer's) -> its HF tensor (not for "experts": `to_hf_list`)."""
  if spec.layout == "ident":
    return w
  if spec.layout == "t":
    return w.T
  if spec.layout == "qkv":
    return w.transpose(1, 2, 0).reshape(spec.hf_shape)
  if spec.layout == "o":
    return w.transpose(2, 0, 1).reshape(spec.hf_shape)
  return w.reshape(spec.hf_shape)


def _bounds(index: slice, n: int) -> tuple[int, int]:
  start, stop, step = index.indices(n)
  if step != 1:
    raise WeightsError(f"a strided shard index {index} is not supported by sharded loading.")
  return start, stop


def read_block(spec: Tensor, read, name, index: tuple) -> np.ndarray:
  """The block `index` (slices of one layer's rljax array) of HF tensor `name` (for "experts": the
  list of the experts' names), reading only the matching block of the file: read(name, hf_index)
  returns that block of the HF tensor."""
  if spec.layout == "experts":
    e, i, o = index
    return np.stack([read(name[j], (o, i)).T for j in range(len(name))[e]])
  if spec.layout == "ident":
    return read(name, index)
  if spec.layout == "t":
    i, o = index
    return read(name, (o, i)).T
  if spec.layout == "qkv":
    d, h, e = index
    dh = spec.shape[2]
    h0, h1 = _bounds(h, spec.shape[1])
    w = read(name, (slice(h0 * dh, h1 * dh), d))
    return w.reshape(h1 - h0, dh, -1).transpose(2, 0, 1)[:, :, e]
  if spec.layout == "o":
    h, e, d = index
    dh = spec.shape[1]
    h0, h1 = _bounds(h, spec.shape[0])
    w = read(name, (d, slice(h0 * dh, h1 * dh)))
    return w.reshape(w.shape[0], h1 - h0, dh).transpose(1, 2, 0)[:, e, :]
  h, e = index   # bias
  dh = spec.shape[1]
  h0, h1 = _bounds(h, spec.shape[0])
  return read(name, (slice(h0 * dh, h1 * dh),)).reshape(h1 - h0, dh)[:, e]

"""Metrics that carry how they combine: each value is declared with its reduction where it is made.

A step's loss metrics are computed per part of a batch (a micro-batch, a packed block) and per
optimizer update. How the parts combine is a property of the metric, declared when it is added:

- "sum": the part's value is already normalised by the step's global denominators, so the parts
  add up to the whole batch's value (token means, fractions, losses);
- "max" / "min": the batch's extreme is the extreme of the parts' (ratio_max, lengths).

Over the updates of a step (mini-batches x epochs), each a value in its own right, "sum" metrics
are averaged and "max" / "min" metrics keep their extreme (`reduce_stacked(..., over="updates")`).

`Metrics` is a read-only mapping name -> scalar array and a pytree (the reductions are static),
so it passes through `jax.lax.scan`, `fori_loop` and `value_and_grad(has_aux=True)` unchanged.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import jax
import jax.numpy as jnp

REDUCTIONS = ("sum", "max", "min")
_COMBINE = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}
_IDENTITY = {"sum": 0.0, "max": -jnp.inf, "min": jnp.inf}
_STACKED = {"micro_batches": {"sum": jnp.sum, "max": jnp.max, "min": jnp.min},
            "updates": {"sum": jnp.mean, "max": jnp.max, "min": jnp.min}}


@jax.tree_util.register_pytree_node_class
class Metrics(Mapping):
  """Named scalar metrics, each with its reduction ("sum", "max" or "min"; module doc)."""

  def __init__(self, values: Mapping[str, jax.Array] | None = None, reductions: Mapping[str, str] | None = None):
    self._values = dict(values or {})
    self._reductions = {k: (reductions or {}).get(k, "sum") for k in self._values}
    bad = {k: r for k, r in self._reductions.items() if r not in REDUCTIONS}
    if bad:
      raise ValueError(f"metric reductions {bad} must be one of {REDUCTIONS}.")

  # ---- building (inside a loss function, before the metrics are returned) ----

  def add(self, name: str, value, reduce: str = "sum") -> None:
    """Adds (or replaces) metric `name` with its reduction."""
    if reduce not in REDUCTIONS:
      raise ValueError(f"metric {name!r}: reduction {reduce!r} must be one of {REDUCTIONS}.")
    self._values[name] = value
    self._reductions[name] = reduce

  def with_values(self, **values) -> "Metrics":
    """A copy with these values set: existing metrics keep their reduction, new ones are "sum"."""
    out = Metrics(self._values, self._reductions)
    for name, value in values.items():
      out.add(name, value, self._reductions.get(name, "sum"))
    return out

  # ---- reading ----

  def __getitem__(self, name: str):
    return self._values[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._values)

  def __len__(self) -> int:
    return len(self._values)

  def __repr__(self) -> str:
    return f"Metrics({self._values!r}, reductions={self._reductions!r})"

  def reduction(self, name: str) -> str:
    return self._reductions[name]

  # ---- combining ----

  def combine(self, other: "Metrics") -> "Metrics":
    """Two parts of a batch combined metric by metric (metrics in one part only are kept)."""
    values, reductions = dict(self._values), dict(self._reductions)
    for name, value in other.items():
      r = other.reduction(name)
      values[name] = value if name not in values else _COMBINE[r](values[name], value)
      reductions[name] = r
    return Metrics(values, reductions)

  def identity(self) -> "Metrics":
    """Metrics of the same names, shapes and reductions holding each reduction's identity (the
    start of a combining loop); works on metrics of arrays or of ShapeDtypeStructs."""
    return Metrics({k: jnp.full(v.shape, _IDENTITY[self._reductions[k]], v.dtype) for k, v in self.items()},
                   self._reductions)

  def reduce_stacked(self, over: str) -> "Metrics":
    """Metrics stacked along axis 0 (a `lax.scan`'s outputs) reduced over it. over="micro_batches":
    the parts of one optimizer update (sum / max / min: the update's value); over="updates": the
    updates of a step (mean / max / min)."""
    ops = _STACKED[over]
    return Metrics({k: ops[self._reductions[k]](v, axis=0) for k, v in self.items()}, self._reductions)

  # ---- pytree ----

  def tree_flatten(self):
    names = tuple(self._values)
    return tuple(self._values[k] for k in names), tuple((k, self._reductions[k]) for k in names)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls({k: v for (k, _), v in zip(aux, children)}, dict(aux))


def combine_metrics(acc: Mapping, new: Metrics) -> Metrics:
  """Two parts' `policy_loss` metrics combined (acc may be empty: the first part)."""
  return new if not acc else acc.combine(new)

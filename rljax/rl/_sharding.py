"""Helpers that keep the rl maths valid under explicit sharding (`jax.make_mesh` defaults to
`AxisType.Explicit`, where a reshape across a sharded axis or a contraction over one must say
what the output sharding is)."""
from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def explicit_mesh(x: jax.Array):
  """The mesh of x's type if it has an explicit axis, else None (unsharded, Auto, or numpy)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty:
    return None
  return mesh if AxisType.Explicit in tuple(mesh.axis_types) else None


def replicated_sharding(x: jax.Array):
  """NamedSharding that replicates over x's explicit mesh, or None when x has none."""
  mesh = explicit_mesh(x)
  return None if mesh is None else NamedSharding(mesh, PartitionSpec())


def replicate(x: jax.Array) -> jax.Array:
  """x, all-gathered if it is sharded along an explicit mesh axis (for small arrays only)."""
  target = replicated_sharding(x)
  if target is None or all(s is None for s in jax.typeof(x).sharding.spec):
    return x
  return jax.sharding.reshard(x, target)

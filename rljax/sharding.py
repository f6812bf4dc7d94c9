"""Mesh construction and the logical-axis -> mesh-axis table.

Parameters and activations are annotated with logical axis names (`embed`,
`mlp`, `heads`, `kv_heads`, `vocab`, `batch`, ...). One table maps them to the
mesh axes `data`, `fsdp` and `tensor`. A dimension that the mapped mesh axes do
not divide evenly is replicated instead (SmolLM2 has 3 KV heads, for example),
so any model runs on any mesh.
"""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rljax.errors import ConfigError

MESH_AXES = ("data", "fsdp", "tensor")

# logical name -> mesh axis (or tuple of axes); None = replicated.
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("layers", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("length", None),
    ("norm", None),
)


def make_mesh(shape: Sequence[int] | None = None, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh. `shape=None` puts every device on `data`; -1 fills one axis."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if shape is None:
    shape = (n, 1, 1)
  shape = list(shape)
  if len(shape) != 3:
    raise ConfigError(f"mesh.shape={tuple(shape)} must have 3 entries (data, fsdp, tensor).")
  if shape.count(-1) > 1:
    raise ConfigError(f"mesh.shape={tuple(shape)} may contain at most one -1.")
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if n % known:
      raise ConfigError(f"mesh.shape={tuple(shape)}: {n} devices are not divisible by {known}.")
    shape[shape.index(-1)] = n // known
  if math.prod(shape) > n:
    raise ConfigError(f"mesh.shape={tuple(shape)} needs {math.prod(shape)} devices but {n} are available; "
                      "set mesh.shape so its product is at most the device count (or use -1 for one axis).")
  # A smaller mesh uses the first devices (handy to compare 1 vs 8 devices in one process).
  return Mesh(np.asarray(devices[:math.prod(shape)]).reshape(shape), MESH_AXES)


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules=DEFAULT_RULES) -> P:
  """Maps logical axis names to a PartitionSpec, replicating dims the mesh does not divide."""
  table = dict(rules)
  used: set[str] = set()
  out = []
  for name, dim in zip(logical, shape):
    axes = table.get(name) if name is not None else None
    if axes is None:
      out.append(None)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    if not axes or dim % size:
      # Try the largest prefix of the axes that divides the dimension.
      while axes and dim % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    if not axes:
      out.append(None)
      continue
    used.update(axes)
    out.append(axes[0] if len(axes) == 1 else axes)
  return P(*out)


def tree_shardings(logical_tree, shape_tree, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedShardings for a pytree given a matching tree of logical-axis tuples."""
  return jax.tree.map(
      lambda names, x: NamedSharding(mesh, logical_to_spec(names, x.shape, mesh, rules)),
      logical_tree, shape_tree, is_leaf=lambda t: isinstance(t, tuple) and all(
          isinstance(a, (str, type(None))) for a in t))


def batch_sharding(mesh: Mesh, ndim: int, batch_dim_size: int | None = None) -> NamedSharding:
  """Shards the leading (batch) dimension over data and fsdp; everything else replicated."""
  names = ("batch",) + (None,) * (ndim - 1)
  shape = (batch_dim_size or math.prod(mesh.shape[a] for a in ("data", "fsdp")),) + (1,) * (ndim - 1)
  return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def maybe_initialize_distributed(enabled: bool | None = None, **kwargs) -> bool:
  """Calls `jax.distributed.initialize()` when asked to, or when a cluster environment is detected.

  Detected: JAX_COORDINATOR_ADDRESS (explicit), SLURM jobs with more than one task, or TPU pods
  (where jax finds the coordinator itself). Returns whether it initialised.
  """
  env = os.environ
  if enabled is None:
    enabled = bool(env.get("JAX_COORDINATOR_ADDRESS")) or int(env.get("SLURM_NTASKS", "1")) > 1
  if not enabled:
    return False
  if "coordinator_address" not in kwargs and env.get("JAX_COORDINATOR_ADDRESS"):
    kwargs["coordinator_address"] = env["JAX_COORDINATOR_ADDRESS"]
    kwargs.setdefault("num_processes", int(env.get("JAX_NUM_PROCESSES", "1")))
    kwargs.setdefault("process_id", int(env.get("JAX_PROCESS_ID", "0")))
  jax.distributed.initialize(**kwargs)
  return True


def allgather_objects(obj: Any) -> list[Any]:
  """Every process's JSON-able `obj`, in process order (a host-side all-gather; [obj] on one process).

  Used to give the reward callback, which runs where the gathered rollout lands, the examples of
  every process's shard of the batch.
  """
  if jax.process_count() == 1:
    return [obj]
  import json
  from jax.experimental import multihost_utils
  blob = np.frombuffer(json.dumps(obj, default=str).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([blob.size], np.int64))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:blob.size] = blob
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  return [json.loads(row[:size].tobytes().decode()) for row, size in zip(gathered, sizes)]

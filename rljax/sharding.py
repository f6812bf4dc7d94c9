"""Mesh construction and the logical-axis -> mesh-axis table.

Parameters and activations are annotated with logical axis names (`embed`,
`mlp`, `heads`, `kv_heads`, `vocab`, `batch`, `expert`, ...). One table maps them to the
mesh axes `data`, `fsdp` and `tensor`. A dimension that the mapped mesh axes do
not divide evenly is replicated instead (SmolLM2 has 3 KV heads, for example),
so any model runs on any mesh.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
import os
import threading
import time
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
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
    # LoRA adapters: sharded like the weight they adapt on the axes they share, and over fsdp on
    # the rank where that axis is free (B's; A's input axis already takes fsdp): ZeRO-3 for adapters.
    ("lora_rank", "fsdp"),
    # Mixture-of-experts kernels [E, D, F]: whole experts split over fsdp (expert parallelism; the
    # embed dim, which would take fsdp next, stays whole). Also the sampler's layout (DECODE_RULES
    # keeps it), so decoding holds E / fsdp experts per chip and moves tokens, not weights.
    ("expert", "fsdp"),
)


def check_mesh_shape(shape: Sequence[int], name: str = "mesh.shape") -> list[int]:
  """`shape` as a list, if it is 3 axis sizes (data, fsdp, tensor), each positive or -1 (at most
  one); else a ConfigError naming `name`. Needs no devices (config validation calls it)."""
  shape = list(shape)
  if len(shape) != 3:
    raise ConfigError(f"{name}={tuple(shape)} must have 3 entries (data, fsdp, tensor).")
  if shape.count(-1) > 1:
    raise ConfigError(f"{name}={tuple(shape)} may contain at most one -1.")
  if any(not isinstance(s, (int, np.integer)) or s == 0 or s < -1 for s in shape):
    raise ConfigError(f"{name}={tuple(shape)}: every entry must be a positive size or -1.")
  return shape


def make_mesh(shape: Sequence[int] | None = None, devices=None, *, name: str = "mesh.shape") -> Mesh:
  """A (data, fsdp, tensor) mesh over every device given (default: all of `jax.devices()`).

  `shape=None` puts every device on `data`; -1 fills one axis. The shape's product must equal the
  number of devices: a mesh that would leave devices idle is a ConfigError naming `name` (the
  config field the shape came from; an explicit `devices` list, as the async mode's
  learner/generator split passes, is the way to use a subset).
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  shape = check_mesh_shape((n, 1, 1) if shape is None else shape, name)
  if -1 in shape:
    known = math.prod(s for s in shape if s != -1)
    if n % known:
      raise ConfigError(f"{name}={tuple(shape)}: {n} devices are not divisible by {known}; "
                        f"set {name} so its product is {n}.")
    shape[shape.index(-1)] = n // known
  if math.prod(shape) != n:
    raise ConfigError(f"{name}={tuple(shape)} uses {math.prod(shape)} devices but {n} are available; set "
                      f"{name} so its product is {n} (or use -1 for one axis, e.g. (-1, 1, 1)). To run on "
                      "fewer devices, expose fewer (CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS, or "
                      "XLA_FLAGS=--xla_force_host_platform_device_count on CPU).")
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("rljax_active_mesh", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh | None, rules=DEFAULT_RULES) -> Iterator[None]:
  """Puts `mesh` and the logical-axis rules in scope while a program is traced.

  Without them the model's activation constraints (`constrain`) are no-ops: XLA then follows
  the fsdp-sharded weights and every device ends up holding the whole batch's activations.
  Every compiled program (sampler, learner, fused step, evaluation) traces its body under this;
  it works inside `jit` (unlike `jax.sharding.set_mesh`). `mesh=None` is a no-op.
  """
  token = _ACTIVE.set(None if mesh is None else (mesh, rules))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active_mesh() -> Mesh | None:
  """The mesh `activate` put in scope, or None."""
  active = _ACTIVE.get()
  return None if active is None else active[0]


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """Constrains x's sharding by logical axis names under the active mesh (a no-op without one).

  Dimensions the mapped mesh axes do not divide are replicated (`logical_to_spec`), so any
  model and batch runs on any mesh.
  """
  active = _ACTIVE.get()
  if active is None:
    return x
  mesh, rules = active
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(logical, x.shape, mesh, rules)))


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
    axes = tuple(a for a in axes if a not in used and mesh.shape.get(a, 1) > 1)
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


def local_indices(sharding, shape: Sequence[int]) -> np.ndarray:
  """The global indices along dim 0 that this process's devices hold under `sharding`.

  shape: the global shape of the array (e.g. the prompt batch [P, Lp]). Returns int64 [n_local],
  sorted and unique: the order of the process-local data `jax.make_array_from_process_local_data`
  takes, so entry i is the global prompt index of this process's i-th example.
  """
  shape = tuple(int(s) for s in shape)
  held: set[int] = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    held.update(range(shape[0])[index[0]] if index else range(shape[0]))
  return np.asarray(sorted(held), np.int64)


# The sampler's parameter layout: weights in the compute dtype, tensor-parallel over heads, MLP
# and vocabulary, replicated over data and fsdp. Decoding with the learner's FSDP layout would
# all-gather every layer's weights for every token (about 13 GB per chip per token for 7B);
# this layout is made once per step, device to device, and needs no weight collective per token.
DECODE_RULES: tuple[tuple[str, Any], ...] = tuple(
    (name, None if name in ("embed", "lora_rank") else axes) for name, axes in DEFAULT_RULES)
# The last resort when even a tensor axis over every chip cannot hold the weights: `embed` over
# fsdp as well, so every decoded token all-gathers every layer's weights.
FALLBACK_DECODE_RULES: tuple[tuple[str, Any], ...] = tuple(
    (name, "fsdp" if name == "embed" else axes) for name, axes in DECODE_RULES)


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
  """Where the sampler keeps its weights on the devices of a learner mesh (data, fsdp, tensor).

  fold: the sampler decodes on the same devices reshaped to (data, fsdp / fold, tensor * fold)
    (`fold_mesh`; when fold exceeds fsdp, data gives the rest): the weights are split over the
    larger tensor axis (heads, KV heads, MLP and vocabulary, where it divides them) and
    replicated over the rest, and the rows are split over what remains of data x fsdp. fold 1
    keeps the learner's mesh. No weight moves per decoded token; per layer the attention and
    MLP outputs are all-reduced over the tensor axis ([rows, D] activations).
  fallback: not even a tensor axis over every chip fits the budget: `embed` is split over fsdp
    as well (`FALLBACK_DECODE_RULES`), and every decoded token all-gathers the weights.
  bytes_per_chip: the weights one chip holds in this layout (compute dtype); budget: what they
    were allowed (None: no limit known, e.g. a CPU device reports none).
  """
  fold: int = 1
  fallback: bool = False
  bytes_per_chip: int | None = dataclasses.field(default=None, compare=False)
  budget: int | None = dataclasses.field(default=None, compare=False)

  @property
  def rules(self):
    return FALLBACK_DECODE_RULES if self.fallback else DECODE_RULES

  def mesh(self, mesh: Mesh) -> Mesh:
    """The decode mesh on `mesh`'s devices (the same device order)."""
    return fold_mesh(mesh, self.fold)

  def shardings(self, logical_axes_tree, shapes, mesh: Mesh):
    """NamedShardings (on `self.mesh(mesh)`) of a parameter tree in this layout."""
    return tree_shardings(logical_axes_tree, shapes, self.mesh(mesh), self.rules)

  def kind(self, mesh: Mesh) -> str:
    """"replicated", "tensor-parallel" or "fallback" (see `describe`)."""
    if self.fallback:
      return "fallback"
    return "tensor-parallel" if self.mesh(mesh).shape["tensor"] > 1 else "replicated"

  def describe(self, mesh: Mesh) -> str:
    d = self.mesh(mesh).shape
    shape = f"decode mesh (data, fsdp, tensor) = ({d['data']}, {d['fsdp']}, {d['tensor']})"
    kind = self.kind(mesh)
    if kind == "fallback":
      return (f"fallback: weights split over fsdp={d['fsdp']} as well and all-gathered for every decoded token "
              f"({shape}); they do not fit tensor-parallel over every chip")
    if kind == "replicated":
      return f"replicated: every chip holds the whole model ({shape})"
    return f"tensor-parallel over {d['tensor']} chips ({shape})"

  def to_json(self, mesh: Mesh) -> dict:
    d = self.mesh(mesh).shape
    return {"kind": self.kind(mesh), "fold": self.fold, "mesh": [d["data"], d["fsdp"], d["tensor"]],
            "tensor": d["tensor"], "weights_bytes_per_chip": self.bytes_per_chip, "budget_bytes": self.budget,
            "description": self.describe(mesh)}


def fold_mesh(mesh: Mesh, fold: int) -> Mesh:
  """`mesh`'s devices, in the same order, as (data, fsdp / fold, tensor * fold); a fold beyond fsdp
  takes the rest from data: (data * fsdp / fold, 1, tensor * fold). fold must divide data x fsdp
  that way (`decode_folds`)."""
  if fold == 1:
    return mesh
  d, f, t = (mesh.shape[a] for a in MESH_AXES)
  if f % fold == 0:
    shape = (d, f // fold, t * fold)
  elif fold % f == 0 and d % (fold // f) == 0:
    shape = (d * f // fold, 1, t * fold)
  else:
    raise ConfigError(f"a decode fold of {fold} does not divide the mesh (data={d}, fsdp={f}).")
  return Mesh(mesh.devices.reshape(shape), MESH_AXES)


def decode_folds(mesh: Mesh) -> list[int]:
  """The folds `fold_mesh` accepts for `mesh`, smallest first: divisors of fsdp, then fsdp times
  the divisors of data."""
  d, f = mesh.shape["data"], mesh.shape["fsdp"]
  return [k for k in range(1, f + 1) if f % k == 0] + [f * k for k in range(2, d + 1) if d % k == 0]


def choose_decode_layout(logical_axes_tree, shapes, mesh: Mesh, budget: int | None = None,
                         dtype=None) -> DecodeLayout:
  """The sampler's layout for a parameter tree: the smallest fold whose weights fit `budget` bytes per
  chip (fold 1, the learner's tensor axis only, when they fit; None: no limit, fold 1), else the
  fallback. Decided from the shapes alone (no compile): `rljax plan` decides it at the model's full
  depth. shapes: arrays or ShapeDtypeStructs; dtype: the decode dtype (default each leaf's own)."""
  for fold in decode_folds(mesh):
    layout = DecodeLayout(fold)
    held = bytes_per_device(layout.shardings(logical_axes_tree, shapes, mesh), shapes, dtype)
    if budget is None or held <= budget:
      return DecodeLayout(fold, bytes_per_chip=held, budget=budget)
  fallback = DecodeLayout(1, fallback=True)
  held = bytes_per_device(fallback.shardings(logical_axes_tree, shapes, mesh), shapes, dtype)
  return DecodeLayout(1, fallback=True, bytes_per_chip=held, budget=budget)


def decode_param_shardings(logical_axes_tree, shapes, mesh: Mesh, *, max_bytes_per_device: int | None = None,
                           dtype=None):
  """NamedShardings of the sampler's parameter layout (`choose_decode_layout`) for a parameter tree.

  logical_axes_tree: `rljax.models.policy.param_logical_axes(config)`; shapes: a matching tree
  of arrays or ShapeDtypeStructs. Dimensions `tensor` does not divide stay replicated. With
  `max_bytes_per_device` (and `dtype`, the decode dtype; default each leaf's own), a layout that
  does not fit folds fsdp (then data) into the tensor axis, and as a last resort shards `embed`
  over fsdp (weights then gathered per token). The shardings are on the layout's decode mesh.
  """
  layout = choose_decode_layout(logical_axes_tree, shapes, mesh, max_bytes_per_device, dtype)
  return layout.shardings(logical_axes_tree, shapes, mesh)


def bytes_per_device(shardings, shapes, dtype=None) -> int:
  """Bytes one device holds of `shapes` laid out by `shardings`."""
  total = 0
  for sh, x in zip(jax.tree.leaves(shardings), jax.tree.leaves(shapes)):
    local = sh.shard_shape(tuple(x.shape))
    total += math.prod(local) * np.dtype(dtype or x.dtype).itemsize
  return total


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


def allgather_objects(obj: Any, timeout_s: float = 0.0) -> list[Any]:
  """Every process's JSON-able `obj`, in process order (a host-side all-gather; [obj] on one process).

  Small things only (it is one host collective per call, and every process must call it): the
  reward metrics of each process (`RewardFn.global_metrics`), a prompt width to agree on.
  timeout_s: how long to wait for the other processes (0: GATHER_TIMEOUT_S); past it, a
  `GatherTimeout` names the processes that had not arrived. Only the coordinator's key-value store
  can time out: without a coordination client the fallback device all-gather waits as long as it takes.
  """
  if jax.process_count() == 1:
    return [obj]
  client = _coordination_client()
  if client is not None:
    return _kv_allgather(client, json.dumps(obj, default=str), timeout_s or GATHER_TIMEOUT_S)
  blob = np.frombuffer(json.dumps(obj, default=str).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.asarray([blob.size], np.int64))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:blob.size] = blob
  gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
  return [json.loads(row[:size].tobytes().decode()) for row, size in zip(gathered, sizes)]


# Host all-gathers go through jax.distributed's key-value store (the coordination service), not a
# device program: a device all-gather waits for every device's queue, so in the async mode across
# processes each one would wait for the generation in flight on the generator devices.
GATHER_TIMEOUT_S = 3600
_gathers = {"count": 0, "lock": threading.Lock()}


class GatherTimeout(RuntimeError):
  """Some processes did not reach a host all-gather in time: `missing`, their process indices."""

  def __init__(self, message: str, missing: list[int]):
    super().__init__(message)
    self.missing = missing


def _coordination_client():
  from jax._src import distributed
  return getattr(distributed.global_state, "client", None)


def _kv_allgather(client, blob: str, timeout_s: float) -> list[Any]:
  """One round of `allgather_objects` through the key-value store: each process sets its key of
  this round and reads every other's, within `timeout_s` in all. Rounds are numbered by call order,
  which is the same on every process (every process calls in the same order, as for a device
  collective); a process deletes its key of two rounds back, which every process has read by the
  time this round starts."""
  with _gathers["lock"]:
    k = _gathers["count"]
    _gathers["count"] += 1
  me, n = jax.process_index(), jax.process_count()
  prefix = f"rljax/allgather/{k}/"
  client.key_value_set(prefix + str(me), blob)
  deadline = time.monotonic() + timeout_s
  out = []
  for p in range(n):
    try:
      out.append(json.loads(client.blocking_key_value_get(prefix + str(p),
                                                          max(int((deadline - time.monotonic()) * 1000), 1))))
    except Exception as e:  # noqa: BLE001 - the runtime's timeout error type varies by version
      arrived = {key.rsplit("/", 1)[-1] for key, _ in client.key_value_dir_get(prefix)}
      missing = [q for q in range(n) if str(q) not in arrived]
      if not missing:
        raise
      raise GatherTimeout(f"process(es) {missing} of {n} did not reach host all-gather {k} within {timeout_s:g} s "
                          f"(this is process {me}): they stopped or hang; see their logs.", missing) from e
  if k >= 2:
    try:
      client.key_value_delete(f"rljax/allgather/{k - 2}/{me}")
    except Exception:  # noqa: BLE001 - a key already gone is not worth failing a step for
      pass
  return out


def local_rows(x: jax.Array) -> np.ndarray:
  """The rows of a row-split array that this process's devices hold, in global row order (the
  whole array in a one-process run): the process-local data of `rows_from_processes`."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  blocks: dict[int, np.ndarray] = {}
  for shard in x.addressable_shards:
    start = (shard.index[0].start or 0) if shard.index else 0
    blocks.setdefault(start, np.asarray(shard.data))   # replicas of a block hold the same rows
  return np.concatenate([blocks[k] for k in sorted(blocks)])


def rows_from_processes(local: np.ndarray, sharding, n: int) -> jax.Array:
  """The global [n, ...] array whose rows each process holds locally (`local_rows`' inverse)."""
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  return jax.make_array_from_process_local_data(sharding, local, (n, *local.shape[1:]))


def local_value(x: jax.Array) -> np.ndarray:
  """A replicated array's value, read from this process's own copy (`jax.device_get` refuses an
  array that spans other processes' devices, even a replicated one)."""
  return np.asarray(x.addressable_shards[0].data) if not x.is_fully_addressable else np.asarray(jax.device_get(x))


def global_values(tree: Any) -> Any:
  """The values (numpy) of a tree of replicated arrays, on every process, also on a process that
  holds none of their devices (the generator process of an async run split by process: then one
  host all-gather from the processes that do, so every process must call this at the same point).
  """
  leaves, treedef = jax.tree.flatten(tree)
  if not all(isinstance(x, jax.Array) for x in leaves):
    return jax.tree.map(np.asarray, tree)
  everywhere = all({d.process_index for d in x.sharding.device_set} == set(range(jax.process_count()))
                   for x in leaves)
  if everywhere:
    return treedef.unflatten([np.asarray(jax.device_get(x)) for x in leaves])
  me = jax.process_index()
  holds = all(any(d.process_index == me for d in x.sharding.device_set) for x in leaves)
  mine = [np.asarray(jax.device_get(x)).tolist() for x in leaves] if holds else None
  held = next(v for v in allgather_objects(mine) if v is not None)
  return treedef.unflatten([np.asarray(v, x.dtype) for v, x in zip(held, leaves)])


class ProcessRows:
  """The host side of a computation over [B, ...] arrays whose rows may span processes.

  In a multi-process run (the rows' sharding spans other processes' devices) each process reads
  and writes only the rows its devices hold under `sharding` (`local`, `put`), whatever sharding
  the compiler gave an array it reads (a replicated [B] array included), and host decisions that
  start a compiled program on every process are agreed (`any`, `max`, `sum`: one host all-gather
  each). Otherwise the same calls are the plain one-process operations.
  """

  def __init__(self, sharding: NamedSharding | None, rows: int):
    """sharding: how the rows are split (a batch sharding of the mesh; None: one process, no mesh);
    rows: B, over all processes."""
    self.rows = int(rows)
    self.multi = sharding is not None and not sharding.is_fully_addressable
    if self.multi:
      self.sharding = NamedSharding(sharding.mesh, P(sharding.spec[0] if len(sharding.spec) else None))
      self.index = local_indices(self.sharding, (self.rows,))      # this process's rows, global order

  @classmethod
  def of_prompts(cls, prompt_ids, group: int) -> "ProcessRows":
    """For the P * group rows of prompts [P, Lp] (rows prompt-major, split as the prompts are)."""
    sharding = getattr(prompt_ids, "sharding", None)
    p = int(prompt_ids.shape[0])
    if not isinstance(sharding, NamedSharding) or sharding.is_fully_addressable:
      return cls(None, p * group)
    return cls(batch_sharding(sharding.mesh, 1, p * group), p * group)

  def local(self, *xs):
    """This process's rows of each [B, ...] array (all of them in a one-process run), fetched in
    one transfer; one array gives one host array, several a tuple."""
    out = tuple(np.asarray(v) for v in jax.device_get(xs)) if not self.multi else tuple(map(self._held, xs))
    return out[0] if len(xs) == 1 else out

  def _held(self, x) -> np.ndarray:
    held: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
      start = (shard.index[0].start or 0) if shard.index else 0
      data = np.asarray(shard.data)
      for i in range(data.shape[0]):
        held.setdefault(start + i, data[i])
    return np.stack([held[int(i)] for i in self.index])

  def put(self, local: np.ndarray):
    """This process's rows [b, ...] -> the global [B, ...] array (on one process, uncommitted:
    the program it feeds decides its placement)."""
    if not self.multi:
      return jax.numpy.asarray(local)
    return rows_from_processes(np.asarray(local), self.sharding, self.rows)

  def any(self, flag) -> bool:
    return any(allgather_objects(bool(flag))) if self.multi else bool(flag)

  def max(self, value: int) -> int:
    return max(allgather_objects(int(value))) if self.multi else int(value)

  def sum(self, values: dict) -> dict:
    """Each value summed over the processes."""
    if not self.multi:
      return dict(values)
    every = allgather_objects(values)
    return {k: sum(e[k] for e in every) for k in values}

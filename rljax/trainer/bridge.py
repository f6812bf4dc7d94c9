"""Moving arrays between the async mode's generator and learner devices when those live on
different processes (docs/rollouts.md, "async across processes").

Multi-controller JAX refuses `jax.device_put` between two different sets of devices that span
hosts ("input and target sharding should have the same set of devices"). Two equally sized
device sets can still exchange arrays through one compiled collective over a (2, n) mesh that
pairs device i of one side with device i of the other: the sending side contributes its shards,
the receiving side zeros, and a `ppermute` along the pair axis delivers the shards. Every
process runs the same `move` calls in the same order (they are collectives); a process whose
devices are on neither side of a move still takes part in the program (with no buffers).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rljax.errors import ConfigError

SIDES = ("generator", "learner")


class Bridge:
  """Moves pytrees of arrays between two disjoint device lists of equal length, the generators'
  and the learner's (device i of one is paired with device i of the other). An array crosses in the bridge's own layout:
  split over the n devices along its first dimension that n divides, else replicated (each of
  the n pairs then carries a whole copy). `move` returns the tree on the receiving side in that
  layout; the caller reshards it there (same devices, any sharding: an ordinary device_put).
  """

  def __init__(self, generator_devices, learner_devices):
    check_paired(generator_devices, learner_devices)
    self.n = len(generator_devices)
    self.pairs = Mesh(np.array([list(generator_devices), list(learner_devices)], dtype=object), ("side", "x"))
    self.side_mesh = {name: Mesh(np.array(list(devs), dtype=object), ("x",))
                      for name, devs in zip(SIDES, (generator_devices, learner_devices))}
    self._programs: dict = {}

  def layout(self, side: str, shape) -> NamedSharding:
    """The sharding an array of `shape` crosses in, on `side`'s devices."""
    return NamedSharding(self.side_mesh[side], self._spec(shape))

  def _spec(self, shape) -> P:
    for axis, size in enumerate(shape):
      if size % self.n == 0 and size > 0:
        return P(*([None] * axis), "x")
    return P()

  def _program(self, src: int, specs):
    key = (src, specs)
    if key not in self._programs:
      dst = 1 - src
      in_specs = jax.tree.map(lambda s: P("side", *s), specs, is_leaf=lambda s: isinstance(s, P))
      swap = functools.partial(jax.lax.ppermute, axis_name="side", perm=[(src, dst)])
      self._programs[key] = jax.jit(jax.shard_map(lambda t: jax.tree.map(swap, t), mesh=self.pairs,
                                                  in_specs=(in_specs,), out_specs=in_specs))
    return self._programs[key]

  def move(self, tree, shapes, src: str):
    """`tree` (arrays on side `src`, or anything on a process with none of that side's devices:
    only this process's shards are read) moved to the other side.

    shapes: the tree's `jax.ShapeDtypeStruct`s, the same on every process (a receiving process
      need not hold the arrays). Returns the tree on the other side, in `layout`, on every
      process (addressable only where that side's devices are)."""
    s = SIDES.index(src)
    dst = SIDES[1 - s]
    me = jax.process_index()
    flat_shapes, treedef = jax.tree.flatten(shapes)
    flat = treedef.flatten_up_to(tree) if tree is not None else [None] * len(flat_shapes)
    specs = tuple(self._spec(x.shape) for x in flat_shapes)
    pair_devices = np.asarray(self.pairs.devices)
    stacked = []
    for x, shape, spec in zip(flat, flat_shapes, specs):
      pair_sharding = NamedSharding(self.pairs, P("side", *spec))
      gshape = (2, *shape.shape)
      local = {}
      if any(d.process_index == me for d in pair_devices[s]):   # this process sends
        on_src = jax.device_put(x, self.layout(src, shape.shape))
        for shard in on_src.addressable_shards:
          local[shard.device] = shard.data[None]
      for d, index in pair_sharding.addressable_devices_indices_map(gshape).items():
        if d not in local:   # a receiving device (or, on the sender, nothing to send from it)
          local[d] = jnp.zeros(_block(gshape, index), shape.dtype, device=d)
      order = [d for d in pair_devices.flat if d in local]
      stacked.append(jax.make_array_from_single_device_arrays(gshape, pair_sharding, [local[d] for d in order],
                                                            dtype=shape.dtype))
    moved = self._program(s, specs)(tuple(stacked))
    out = []
    for y, shape in zip(moved, flat_shapes):
      target = self.layout(dst, shape.shape)
      mine = {d for d in target.addressable_devices}
      bufs = [shard.data[0] for shard in y.addressable_shards if shard.device in mine]
      out.append(jax.make_array_from_single_device_arrays(shape.shape, target, bufs, dtype=shape.dtype))
    return treedef.unflatten(out)


def check_paired(generator_devices, learner_devices) -> None:
  """ConfigError unless the two parts can be paired device for device (the bridge's layout)."""
  if len(generator_devices) != len(learner_devices):
    raise ConfigError(f"config.rollout.generator_devices: async across processes pairs each generator device "
                      f"with a learner device, so the two parts need the same number of devices "
                      f"({len(generator_devices)} generators, {len(learner_devices)} learner devices); set "
                      f"rollout.generator_devices to half the devices.")


def _block(shape, index) -> tuple[int, ...]:
  """The shape of the block `index` (a tuple of slices) selects from an array of `shape`."""
  return tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape))


def process_sides(generator_devices, learner_devices) -> dict[int, str]:
  """{process index: its side} when each process's devices are all on one side; ConfigError
  naming the mixed process otherwise (a process's devices split between the two parts would need
  cross-device transfers inside the process and across processes at once: not supported)."""
  sides: dict[int, str] = {}
  for side, devices in zip(SIDES, (generator_devices, learner_devices)):
    for d in devices:
      if sides.setdefault(d.process_index, side) != side:
        raise ConfigError(f"config.rollout.generator_devices: process {d.process_index}'s devices fall on both sides "
                          "of the async split; across processes the generators and the learner each take whole "
                          "processes. Set rollout.generator_devices to a multiple of the devices per process "
                          f"({jax.local_device_count()}).")
  return sides



def check_process_split(config, generator_devices, learner_devices) -> dict[int, str] | None:
  """The sides of the processes when the async mode's split spans processes (None in one
  process or without a split), after checking what such a run supports: whole processes per
  side, one generator process, equal device counts, no evaluation inside the run."""
  if jax.process_count() == 1 or not generator_devices:
    return None
  sides = process_sides(generator_devices, learner_devices)
  generators = sorted(p for p, side in sides.items() if side == "generator")
  if len(generators) != 1:
    raise ConfigError(f"config.rollout.generator_devices: async across processes runs the generators in one process "
                      f"for now (these settings put them on processes {generators}); give them one process's "
                      f"devices ({jax.local_device_count()}).")
  check_paired(generator_devices, learner_devices)
  if config.eval.every or config.eval.before_and_after:
    raise ConfigError("async across processes: the evaluation inside the run decodes on every process, and the "
                      "generator process holds none of the learner's parameters. Set eval.every=0 and "
                      "eval.before_and_after=False, then evaluate the export "
                      "(`rljax eval --model <output.dir>/hf ...`).")
  return sides

"""The async mode's bridge between generator and learner devices (rljax/trainer/bridge.py).

Across processes it is the only way arrays move between the two parts (tests/test_distributed.py
runs it on 2 processes); here its semantics are checked in one process on 8 simulated devices:
the two sides are devices 0-3 and 4-7.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.trainer.bridge import Bridge, process_sides


@pytest.fixture
def sides():
  devices = jax.devices()
  if len(devices) < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return devices[:4], devices[4:]


def test_move_delivers_every_leaf_to_the_other_side_in_its_layout(sides):
  gen, learner = sides
  bridge = Bridge(gen, learner)
  mesh = shd.make_mesh((2, 2, 1), devices=learner)
  tree = {"rows": jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3),     # split over the 4 pairs by rows
          "cols": jnp.arange(3 * 12, dtype=jnp.int32).reshape(3, 12),      # by its second axis (3 does not divide)
          "odd": jnp.arange(6, dtype=jnp.bfloat16)}                        # replicated: 4 does not divide 6
  tree = jax.device_put(tree, {"rows": NamedSharding(mesh, P(("data", "fsdp"))), "cols": NamedSharding(mesh, P()),
                               "odd": NamedSharding(mesh, P("fsdp"))})
  moved = bridge.move(tree, jax.eval_shape(lambda t: t, tree), "learner")
  for k, x in moved.items():
    assert x.sharding.device_set == set(gen), k
    assert x.dtype == tree[k].dtype and x.shape == tree[k].shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(tree[k]), err_msg=k)
  assert moved["rows"].sharding.spec == P("x") and moved["cols"].sharding.spec == P(None, "x")
  assert moved["odd"].sharding.spec == P()
  back = bridge.move(moved, jax.eval_shape(lambda t: t, moved), "generator")
  for k, x in back.items():
    assert x.sharding.device_set == set(learner)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(tree[k]), err_msg=k)


def test_unequal_sides_and_mixed_processes_are_refused_by_name(sides):
  gen, learner = sides
  with pytest.raises(ConfigError, match="same number of devices.*3 generators, 4 learner"):
    Bridge(gen[:3], learner)
  # In one process every device is process 0's, so any split puts that process on both sides.
  with pytest.raises(ConfigError, match="process 0's devices fall on both sides"):
    process_sides(gen, learner)

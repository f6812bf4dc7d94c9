"""The io_callback bridge: the pool called from inside a jitted function, on 1 and 8 devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from rljax.rewards import RewardPool, RewardSpec, make_reward_fn

VOCAB = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"


def encode(text, width):
  ids = [VOCAB.index(ch) for ch in text][:width]
  return ids + [0] * (width - len(ids)), len(ids)


def decode(batch):
  return ["".join(VOCAB[t] for t in ids) for ids in batch]


@pytest.fixture(scope="module")
def pool():
  spec = RewardSpec.from_dict({"components": [
      {"name": "correct", "verifier": "arithmetic", "weight": 1.0},
      {"name": "overlong", "verifier": "overlong", "kwargs": {"max_len": 12, "buffer": 4}},
  ], "num_workers": 2, "timeout_s": 5.0})
  with RewardPool(spec) as p:
    yield p


def _batch(n_prompts=8, g=2, width=16):
  examples = [{"answer": str(3 * i)} for i in range(n_prompts)]
  texts = []
  for i in range(n_prompts):
    texts.append(f"{i} + {2 * i} = {3 * i}")                     # right
    texts.extend(f"the answer is {3 * i + 1}" for _ in range(g - 1))  # wrong and long
  rows = [encode(t, width) for t in texts]
  tokens = np.asarray([r[0] for r in rows], np.int32)
  lengths = np.asarray([r[1] for r in rows], np.int32)
  return examples, texts, tokens, lengths


def _expected(pool, tokens, lengths, examples, g):
  """The same batch scored directly on the host."""
  texts = decode([tokens[i, :n].tolist() for i, n in enumerate(lengths)])
  return pool.score(texts, examples, num_tokens=lengths, group_size=g)


def test_io_callback_on_one_device(pool):
  examples, _, tokens, lengths = _batch()
  reward_fn = make_reward_fn(pool, decode, group_size=2)
  reward_fn.set_batch(examples, step=0)

  @jax.jit
  def step(tokens, lengths):
    rewards, components = reward_fn(tokens, lengths)
    return rewards * 1.0, components

  rewards, components = step(jnp.asarray(tokens), jnp.asarray(lengths))
  want = _expected(pool, tokens, lengths, examples, 2)
  np.testing.assert_allclose(np.asarray(rewards), want.rewards)
  np.testing.assert_allclose(np.asarray(components), want.components_matrix())
  assert np.asarray(components)[:, 0].tolist() == [1.0, 0.0] * 8
  assert reward_fn.last_metrics()["reward/accuracy"] == 0.5
  timing = reward_fn.last_timing()
  assert timing["end"] >= timing["start"]
  assert reward_fn.last_batch().answers[0] == "0"


def test_io_callback_on_eight_devices(pool):
  assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
  mesh = Mesh(np.asarray(jax.devices()), ("data",))
  batch_sharding = NamedSharding(mesh, P("data"))
  examples, _, tokens, lengths = _batch()
  want = _expected(pool, tokens, lengths, examples, 2)
  tokens = jax.device_put(jnp.asarray(tokens), NamedSharding(mesh, P("data", None)))
  lengths_d = jax.device_put(jnp.asarray(lengths), batch_sharding)

  # (a) out_shardings on the jit.
  reward_fn = make_reward_fn(pool, decode, group_size=2)
  reward_fn.set_batch(examples, step=1)
  step = jax.jit(lambda t, n: reward_fn(t, n),
                 out_shardings=(batch_sharding, NamedSharding(mesh, P("data", None))))
  rewards, components = step(tokens, lengths_d)
  assert rewards.sharding.is_equivalent_to(batch_sharding, 1)
  np.testing.assert_allclose(np.asarray(rewards), want.rewards)
  np.testing.assert_allclose(np.asarray(components), want.components_matrix())

  # (b) the bridge's own sharding constraint, used inside a larger computation.
  sharded_fn = make_reward_fn(pool, decode, group_size=2, sharding=batch_sharding)
  sharded_fn.set_batch(examples, step=2)

  @jax.jit
  def step2(t, n):
    r, c = sharded_fn(t, n)
    return r - r.reshape(-1, 2).mean(1).repeat(2), c

  adv, components = step2(tokens, lengths_d)
  assert adv.sharding.is_equivalent_to(batch_sharding, 1)
  r = want.rewards.reshape(-1, 2)
  np.testing.assert_allclose(np.asarray(adv), (r - r.mean(1, keepdims=True)).reshape(-1), rtol=1e-6)
  assert sharded_fn.last_metrics()["reward/correct_mean"] == 0.5


def test_set_batch_is_required(pool):
  reward_fn = make_reward_fn(pool, decode)
  with pytest.raises(RuntimeError, match="set_batch"):
    reward_fn.host_fn(np.zeros((2, 3), np.int32), np.zeros(2, np.int32))

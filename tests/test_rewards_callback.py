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
  ], "num_workers": 2, "timeout_s": 60.0})   # generous: a loaded machine must not time rows out
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
  sharded_fn = make_reward_fn(pool, decode, group_size=2, mesh=batch_sharding.mesh)
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


def _counting(pool, calls: list):
  """The pool, its score appending to `calls` how many texts each call scored."""
  def score(texts, *a, **k):
    calls.append(len(texts))
    return pool.score(texts, *a, **k)
  return type("Counting", (), {"score": staticmethod(score)})()


def _mesh(shape):
  from rljax.sharding import make_mesh
  return make_mesh(shape)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (2, 1, 4)])
def test_scored_per_shard_once_per_process(pool, shape):
  """With a mesh the callback runs per device on its rows; replicas over the other mesh axes are
  scored once, rewards come back sharded like the rows, equal to scoring the batch directly."""
  from jax.sharding import NamedSharding

  from rljax.rewards.callback import local_indices
  mesh = _mesh(shape)
  examples, _, tokens, lengths = _batch()
  want = _expected(pool, tokens, lengths, examples, 2)
  reward_fn = make_reward_fn(pool, decode, group_size=2, mesh=mesh)
  rows = NamedSharding(mesh, P(("data", "fsdp"), None))
  prompts = jax.device_put(np.zeros((8, 3), np.int32), rows)
  idx = local_indices(prompts.sharding, prompts.shape)
  assert idx.tolist() == list(range(8))                  # one process holds every prompt
  reward_fn.set_batch([examples[i] for i in idx], step=3, indices=idx)
  calls = []
  reward_fn.pool = _counting(pool, calls)
  step = jax.jit(lambda t, n: reward_fn(t, n))
  r, c = step(jax.device_put(tokens, rows), jax.device_put(lengths, NamedSharding(mesh, P(("data", "fsdp")))))
  jax.block_until_ready((r, c))                          # the step is dispatched asynchronously
  assert calls == [16]                                   # one pool call, every row once
  np.testing.assert_allclose(np.asarray(r), want.rewards)
  np.testing.assert_allclose(np.asarray(c), want.components_matrix())
  assert len(r.sharding.device_set) == 8 and not r.sharding.is_fully_replicated
  assert reward_fn.last_rows().tolist() == list(range(16))
  m = reward_fn.global_metrics()
  assert m["verifier/items"] == 16 and m["verifier/scoring_processes"] == 1
  assert m["reward/mean"] == pytest.approx(float(np.mean(want.rewards)))


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (2, 1, 4)])
def test_metrics_cover_every_round_of_a_step(pool, caplog, shape):
  """Devices that reach the callback more than gather_timeout_s apart are scored in several rounds
  (here every device alone: gather_timeout_s=0); the step's metrics, rows and batch cover all of
  them, equal to scoring the batch at once. A replica of a shard (a device on the tensor axis) in
  a later round takes the earlier round's results: every row is scored once. (Before, a replica's
  round rescored its rows and, as a repeat, restarted the step's metrics without the earlier rounds:
  on a loaded CI machine, mesh (2, 2, 2) logged a reward/mean over a quarter of the rows.)"""
  from jax.sharding import NamedSharding
  mesh = _mesh(shape)
  examples, _, tokens, lengths = _batch()
  want = _expected(pool, tokens, lengths, examples, 2)
  reward_fn = make_reward_fn(pool, decode, group_size=2, mesh=mesh, gather_timeout_s=0.0)
  scored = []
  reward_fn.pool = _counting(pool, scored)
  rows = NamedSharding(mesh, P(("data", "fsdp"), None))
  step = jax.jit(lambda t, n: reward_fn(t, n))
  for s in range(2):   # a second step starts afresh at set_batch
    scored.clear()
    reward_fn.set_batch(examples, step=s)
    r, _ = step(jax.device_put(tokens, rows), jax.device_put(lengths, NamedSharding(mesh, P(("data", "fsdp")))))
    jax.block_until_ready(r)
    assert reward_fn.last_rounds() > 1
    assert sum(scored) == 16                      # every row scored once, replicas included
    np.testing.assert_allclose(np.asarray(r), want.rewards)
    assert reward_fn.last_rows().tolist() == list(range(16))
    np.testing.assert_allclose(reward_fn.last_batch().rewards, want.rewards)
    np.testing.assert_allclose(reward_fn.last_batch().components_matrix(), want.components_matrix())
    m = reward_fn.global_metrics()
    assert m["verifier/items"] == 16 and m["verifier/scoring_processes"] == 1
    for key in ("reward/mean", "reward/std", "reward/min", "reward/max", "reward/accuracy", "reward/correct_mean",
                "reward/overlong_mean"):
      assert m[key] == pytest.approx(want.metrics[key], abs=1e-12), key
  assert "scoring those rows now" in caplog.text


def test_examples_are_found_by_global_index(pool):
  """A process holds only some prompts: set_batch(indices=) maps them; a held prompt without an
  example is an error that says how to pass the indices."""
  reward_fn = make_reward_fn(pool, decode, group_size=2)
  examples, _, tokens, lengths = _batch()
  reward_fn.set_batch(examples[4:], step=0, indices=range(4, 8))
  rows = np.arange(8, 16)
  r, _ = reward_fn.host_fn(tokens[8:], lengths[8:], rows, 16)
  np.testing.assert_allclose(r, _expected(pool, tokens, lengths, examples, 2).rewards[8:])
  with pytest.raises(RuntimeError, match="local_indices"):
    reward_fn.host_fn(tokens[:2], lengths[:2], np.arange(2), 16)


def test_large_callback_inputs_do_not_deadlock(pool):
  """128 KiB of tokens per device then a collective: the callback's input copy must not wait on
  the devices' thread pool (rewards/callback.py module doc); 8 devices, mesh (8, 1, 1)."""
  mesh = _mesh((8, 1, 1))
  width = 4096                                           # 8 rows x 4096 x 4 B = 128 KiB per device
  examples, _, tokens, lengths = _batch(n_prompts=32, g=2, width=width)
  reward_fn = make_reward_fn(pool, decode, group_size=2, mesh=mesh)
  reward_fn.set_batch(examples, step=0)
  rows = jax.sharding.NamedSharding(mesh, P("data", None))

  @jax.jit
  def step(t, n):
    r, _ = reward_fn(t, n)
    return r.sum() + t.sum()                              # collectives after the callback

  out = step(jax.device_put(tokens, rows), jax.device_put(lengths, jax.sharding.NamedSharding(mesh, P("data"))))
  want = _expected(pool, tokens, lengths, examples, 2).rewards.sum() + tokens.sum()
  assert float(out) == pytest.approx(float(want), rel=1e-6)


def test_process_metrics_combine_exactly():
  """global metrics from per-process summaries: exact mean/std/min/max, counts summed, means weighted."""
  from rljax.rewards.callback import combine_process_metrics
  rng = np.random.default_rng(0)
  r = rng.normal(size=24).astype(np.float32)
  split = [r[:10], r[10:]]
  parts = [{"n": len(x), "rewards": x.astype(np.float64).tolist(),
            "metrics": {"reward/accuracy": float((x > 0).mean()), "verifier/timeouts": 1.0, "verifier/seconds": s}}
           for x, s in zip(split, (0.5, 2.0))]
  m = combine_process_metrics(parts)
  whole = combine_process_metrics([{"n": 24, "rewards": r.astype(np.float64).tolist(), "metrics": {}}])
  for key in ("reward/mean", "reward/std", "reward/min", "reward/max"):
    assert m[key] == whole[key]
  assert m["reward/mean"] == pytest.approx(float(r.astype(np.float64).mean()), rel=1e-15)
  assert m["reward/std"] == pytest.approx(float(r.astype(np.float64).std()), rel=1e-12)
  assert m["reward/accuracy"] == pytest.approx(float((r > 0).mean()))
  assert m["verifier/timeouts"] == 2.0 and m["verifier/seconds"] == 2.0
  assert m["verifier/items"] == 24 and m["verifier/scoring_processes"] == 2
  assert combine_process_metrics([{"n": 0, "rewards": [], "metrics": {}}]) == {}

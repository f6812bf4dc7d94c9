"""One optimizer step's loss and gradients do not depend on how the batch is cut: 1, 2 or 4
micro-batches (split along prompts, denominators from the full step), or 1 vs 8 devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rljax.rl import LossConfig, chunked_logprobs, combine_metrics, compute_advantages, make_denominators, policy_loss

P, G, T = 4, 2, 8
B = P * G
D_IN, D, V = 6, 8, 40


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, B)
  lengths[3] = 0
  lengths[[0, 5]] = T
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  lp_old = rng.uniform(-3, -0.1, (B, T))
  rewards = rng.integers(0, 2, (P, G)).astype(np.float32)
  rewards[2] = 1.0
  rewards[0] = [0.0, 1.0]
  rewards[1] = [1.0, 0.0]
  return dict(
      mask=f32(np.arange(T)[None] < lengths[:, None]),
      lp=f32(lp_old + rng.normal(0, 0.3, (B, T))),
      lp_old=f32(lp_old),
      lp_ref=f32(lp_old + rng.normal(0, 0.3, (B, T))),
      lp_samp=f32(lp_old + rng.normal(0, 0.05, (B, T))),
      entropy=f32(rng.uniform(0.1, 3.0, (B, T))),
      truncated=jnp.asarray(lengths == T),
      rewards=f32(rewards),
      x=f32(rng.normal(0, 1, (B, T, D_IN))),
      targets=jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32))


# Every aggregation mode, the sequence-level ratio, CISPO, TIS, KL and entropy terms.
CONFIGS = [
    LossConfig.from_preset("grpo", entropy_coef=0.01, dual_clip=3.0),
    LossConfig.from_preset("dapo", tis_cap=1.5),
    LossConfig.from_preset("dr_grpo", agg_norm=32.0),
    LossConfig.from_preset("gspo", clip_low=0.2, clip_high=0.2, agg="seq-mean-token-sum"),
    LossConfig.from_preset("cispo", agg="prompt-mean"),
]


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _loss_close(split, full):
  """|split - full| <= 1e-6 relative to the summed terms' magnitude.

  The loss is a sum of signed terms; in fp32 regrouping it moves the result by about 1e-7 of
  the terms' size, which can exceed 1e-6 of a loss that nearly cancels. `split` is the list of
  micro-batch losses.
  """
  scale = max(abs(float(full)), sum(abs(float(x)) for x in split))
  return abs(float(sum(split)) - float(full)) <= 1e-6 * scale


def _step_over_lp(d, cfg, num_micro):
  """Per-micro-batch losses, concatenated gradients w.r.t. (lp, entropy), combined metrics.

  The denominators come from the full step; each micro-batch is a separate `policy_loss` call
  on whole prompt groups, as a trainer's gradient-accumulation loop makes them.
  """
  adv, _ = compute_advantages(d["rewards"], cfg)
  adv = adv.reshape(-1)
  den = make_denominators(d["mask"], G, cfg, truncated=d["truncated"])
  rows = B // num_micro
  losses, grads, metrics = [], [], {}
  for k in range(num_micro):
    s = slice(k * rows, (k + 1) * rows)
    mb = {key: v[s] for key, v in d.items() if key != "rewards"}

    def f(lp, ent, mb=mb, s=s):
      return policy_loss(lp, mb["lp_old"], adv[s], mb["mask"], den, cfg, lp_ref=mb["lp_ref"],
                         lp_samp=mb["lp_samp"], entropy=ent, truncated=mb["truncated"])

    (loss, m), g = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(mb["lp"], mb["entropy"])
    losses.append(loss)
    grads.append(g)
    metrics = combine_metrics(metrics, m)
  g_lp = jnp.concatenate([g[0] for g in grads])
  g_ent = jnp.concatenate([g[1] for g in grads])
  return losses, (g_lp, g_ent), metrics


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.agg}-{c.policy_loss}-{c.ratio_level}")
def test_microbatch_invariance_lp_level(cfg):
  d = _batch()
  (loss1,), (g1, e1), m1 = _step_over_lp(d, cfg, 1)
  assert float(jnp.max(jnp.abs(g1))) > 0
  for n in (2, 4):
    losses, (g_n, e_n), m_n = _step_over_lp(d, cfg, n)
    assert _loss_close(losses, loss1)
    assert _rel_err(g_n, g1) <= 1e-6
    assert _rel_err(e_n, e1) <= 1e-6
    assert m_n.keys() == m1.keys()
    for key in m1:
      assert _rel_err(m_n[key], m1[key]) <= 1e-6 or abs(float(m_n[key] - m1[key])) < 1e-7, key


def _init_params(seed=1):
  rng = np.random.default_rng(seed)
  return dict(w1=jnp.asarray(rng.normal(0, 0.5, (D_IN, D)), jnp.float32),
              w2=jnp.asarray(rng.normal(0, 0.5, (D, V)), jnp.float32))


def _model_loss(params, d, den, adv, cfg):
  hidden = jnp.tanh(d["x"] @ params["w1"])
  lp, ent = chunked_logprobs(hidden, params["w2"], d["targets"], temperature=0.8, chunk_size=16)
  return policy_loss(lp, d["lp_old"], adv, d["mask"], den, cfg, lp_ref=d["lp_ref"],
                     entropy=ent, truncated=d["truncated"])[0]


MODEL_CFG = LossConfig.from_preset("grpo", entropy_coef=0.01, dual_clip=3.0, agg="prompt-mean")


def _model_step(params, d, num_micro, cfg=MODEL_CFG):
  adv = compute_advantages(d["rewards"], cfg)[0].reshape(-1)
  den = make_denominators(d["mask"], G, cfg, truncated=d["truncated"])
  rows = B // num_micro
  losses, grads = [], None
  grad_fn = jax.jit(jax.value_and_grad(_model_loss), static_argnums=4)
  for k in range(num_micro):
    s = slice(k * rows, (k + 1) * rows)
    mb = {key: v[s] for key, v in d.items() if key != "rewards"}
    loss, g = grad_fn(params, mb, den, adv[s], cfg)
    losses.append(loss)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  return losses, grads


def test_microbatch_invariance_through_model():
  d = _batch(seed=2)
  d["lp_old"] = d["lp_old"] * 0.0 - 3.7  # near the model's log-probs so some tokens clip
  params = _init_params()
  (loss1,), g1 = _model_step(params, d, 1)
  for n in (2, 4):
    losses, g_n = _model_step(params, d, n)
    assert _loss_close(losses, loss1)
    for key in g1:
      assert _rel_err(g_n[key], g1[key]) <= 1e-6, key


def test_sharded_over_8_devices_matches_1():
  assert jax.device_count() == 8, "tests/conftest.py sets 8 simulated CPU devices"
  d = _batch(seed=3)
  d["lp_old"] = d["lp_old"] * 0.0 - 3.7
  params = _init_params()

  def step(params, d):
    adv = compute_advantages(d["rewards"], MODEL_CFG)[0].reshape(-1)
    den = make_denominators(d["mask"], G, MODEL_CFG, truncated=d["truncated"])
    return jax.value_and_grad(_model_loss)(params, d, den, adv, MODEL_CFG)

  loss1, g1 = jax.jit(step)(params, d)

  mesh = jax.make_mesh((8,), ("data",))
  rows = NamedSharding(mesh, PartitionSpec("data"))
  repl = NamedSharding(mesh, PartitionSpec())
  shard = {key: (repl if key == "rewards" else rows) for key in d}
  d8 = jax.device_put(d, shard)
  p8 = jax.device_put(params, repl)
  assert len(d8["x"].sharding.device_set) == 8
  loss8, g8 = jax.jit(step, in_shardings=(repl, shard))(p8, d8)
  assert abs(float(loss8 - loss1)) <= 1e-6 * abs(float(loss1))
  for key in g1:
    assert _rel_err(g8[key], g1[key]) <= 1e-6, key

"""An independent NumPy (float64, explicit loops) reference of advantages and loss, compared
with the JAX implementation on random inputs for every preset and the knobs no preset uses.

Gradients of the reference are central finite differences. Stop-gradient is expressed by
evaluating the detached quantities (CISPO's weight) at a fixed copy of lp, so the differences
give exactly the gradient the JAX loss should have.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.rl import PRESETS, LossConfig, compute_advantages, kl_penalty, make_denominators, policy_loss

P, G, T = 4, 2, 8  # the shapes of test_rl_losses, so eager-mode kernels are shared


def _std(xs, ddof):
  n = len(xs)
  if n == 0:
    return 0.0
  mean = sum(xs) / n
  return math.sqrt(sum((x - mean) ** 2 for x in xs) / max(n - ddof, 1))


def np_advantages(rewards, cfg, valid):
  ddof = 1 if cfg.std_unbiased else 0
  everything = [rewards[p, g] for p in range(P) for g in range(G) if valid[p, g]]
  adv = np.zeros((P, G))
  for p in range(P):
    members = [rewards[p, g] for g in range(G) if valid[p, g]]
    for g in range(G):
      if not valid[p, g]:
        continue
      r = rewards[p, g]
      if cfg.mean_scope == "group":
        mu = sum(members) / len(members)
      elif cfg.mean_scope == "batch":
        mu = sum(everything) / len(everything)
      elif cfg.mean_scope == "rloo":
        mu = (sum(members) - r) / max(len(members) - 1, 1)
      else:
        mu = 0.0
      a = r - mu
      if cfg.std_scope == "group":
        a /= _std(members, ddof) + cfg.adv_eps
      elif cfg.std_scope == "batch":
        a /= _std(everything, ddof) + cfg.adv_eps
      adv[p, g] = a
  if cfg.batch_whiten:
    vals = [adv[p, g] for p in range(P) for g in range(G) if valid[p, g]]
    mean, std = sum(vals) / len(vals), _std(vals, ddof)
    adv = np.where(valid, (adv - mean) / (std + cfg.adv_eps), 0.0)
  if cfg.mean_scope in ("group", "rloo") or cfg.std_scope == "group":
    for p in range(P):
      members = [rewards[p, g] for g in range(G) if valid[p, g]]
      scale = max([1.0] + [abs(x) for x in members])
      if members and max(members) - min(members) <= cfg.zero_std_tol * scale:
        adv[p] = 0.0
  return adv


def np_loss(lp, lp_fixed, d, adv, cfg):
  """The step loss by the formulas of docs/loss.md; lp is differentiated, lp_fixed is not."""
  mask = d["mask"].copy()
  if cfg.overlong_filter:
    mask[d["truncated"]] = 0
  lengths = mask.sum(1)
  n_tok = lengths.sum()
  n_seq = (lengths > 0).sum()
  group_tok = lengths.reshape(P, G).sum(1)
  n_prompt = (group_tok > 0).sum()
  norm = cfg.agg_norm or T
  total = 0.0
  for i in range(P * G):
    n = int(lengths[i])
    if n == 0:
      continue
    weight = {
        "token-mean": 1 / n_tok,
        "seq-mean-token-mean": 1 / (n_seq * n),
        "seq-mean-token-sum": 1 / n_seq,
        "seq-mean-token-sum-norm": 1 / (n_seq * norm),
        "prompt-mean": 1 / (n_prompt * group_tok[i // G]),
    }[cfg.agg]
    a = adv[i]
    toks = [t for t in range(T) if mask[i, t]]
    seq_ratio = math.exp(sum(lp[i, t] - d["lp_old"][i, t] for t in toks) / n)
    for t in toks:
      ratio = seq_ratio if cfg.ratio_level == "sequence" else math.exp(lp[i, t] - d["lp_old"][i, t])
      if cfg.policy_loss == "ppo":
        lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
        loss = max(-a * ratio, -a * min(max(ratio, lo), hi))
        if cfg.dual_clip is not None and a < 0:
          loss = min(loss, -a * cfg.dual_clip)
      elif cfg.policy_loss == "cispo":
        w = min(math.exp(lp_fixed[i, t] - d["lp_old"][i, t]), 1 + cfg.clip_high)
        if cfg.cispo_two_sided:
          w = max(w, 1 - cfg.clip_low)
        loss = -w * a * lp[i, t]
      else:
        loss = -a * lp[i, t]
      if a > 0:
        loss *= cfg.pos_weight
      elif a < 0:
        loss *= cfg.neg_weight
      if cfg.tis_cap is not None:
        loss *= min(math.exp(d["lp_old"][i, t] - d["lp_samp"][i, t]), cfg.tis_cap)
      total += weight * loss
      if cfg.kl_coef > 0 and not cfg.kl_in_reward:
        x = lp[i, t] - d["lp_ref"][i, t]
        kl = {"k1": x, "k2": x * x / 2, "k3": math.exp(-x) + x - 1}[cfg.kl_estimator]
        total += cfg.kl_coef * weight * kl
      total -= cfg.entropy_coef * weight * d["entropy"][i, t]
  return total


def np_grad(d, adv, cfg, h=1e-6):
  grad = np.zeros((P * G, T))
  for i in range(P * G):
    for t in range(T):
      if not d["mask"][i, t]:
        continue
      up, down = d["lp"].copy(), d["lp"].copy()
      up[i, t] += h
      down[i, t] -= h
      diff = np_loss(up, d["lp"], d, adv, cfg) - np_loss(down, d["lp"], d, adv, cfg)
      grad[i, t] = diff / (2 * h)
  return grad


def _random_batch(seed, noise):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, T + 1, P * G)
  lengths[5] = 0  # an empty row (e.g. a dropped completion)
  mask = (np.arange(T)[None, :] < lengths[:, None])
  rewards = rng.normal(0, 1, (P, G))
  rewards[0] = 1.0  # a zero-variance group
  lp_old = rng.uniform(-3, -0.1, (P * G, T))
  lp = lp_old + rng.normal(0, noise, (P * G, T))
  return dict(
      mask=mask, rewards=rewards, lp_old=lp_old, lp=lp,
      lp_ref=lp + rng.normal(0, 0.2, (P * G, T)),
      lp_samp=lp_old + rng.normal(0, 0.05, (P * G, T)),
      entropy=rng.uniform(0.1, 3.0, (P * G, T)),
      truncated=(lengths == T) & (rng.uniform(size=P * G) < 0.7))


CASES = [(name, {}) for name in PRESETS] + [
    ("grpo", dict(dual_clip=3.0, tis_cap=1.5, entropy_coef=0.01, agg="prompt-mean")),
    ("grpo", dict(kl_estimator="k1", agg="seq-mean-token-sum", std_unbiased=False)),
    ("cispo", dict(cispo_two_sided=True, clip_low=0.3, clip_high=0.5)),
    ("rloo", dict(pos_weight=0.1, neg_weight=1.0, agg="prompt-mean")),
    ("lite_ppo", dict(kl_coef=0.05, kl_estimator="k2", agg="seq-mean-token-mean")),
    ("gspo", dict(agg="token-mean", clip_low=2e-3, clip_high=3e-3)),
    ("dr_grpo", dict(agg_norm=16.0, mean_scope="batch")),
    ("reinforce_pp", dict(clip_high=0.28, entropy_coef=0.02)),
]


@pytest.mark.parametrize("name, overrides", CASES,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_matches_numpy_reference(name, overrides):
  cfg = LossConfig.from_preset(name, **overrides)
  d = _random_batch(seed=len(name) + 7 * len(overrides),
                    noise=2e-3 if cfg.ratio_level == "sequence" else 0.3)
  valid = np.ones((P, G), bool)
  ref_adv = np_advantages(d["rewards"], cfg, valid)
  adv, metrics = compute_advantages(jnp.asarray(d["rewards"], jnp.float32), cfg)
  np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=0, atol=2e-5)
  assert float(metrics["frac_reward_zero_std"]) == pytest.approx(1 / P)

  f32 = lambda k: jnp.asarray(d[k], jnp.float32)
  adv_flat = jnp.asarray(ref_adv.reshape(-1), jnp.float32)
  den = make_denominators(f32("mask"), G, cfg, truncated=jnp.asarray(d["truncated"]))

  def f(lp):
    return policy_loss(lp, f32("lp_old"), adv_flat, f32("mask"), den, cfg, lp_ref=f32("lp_ref"),
                       lp_samp=f32("lp_samp"), entropy=f32("entropy"),
                       truncated=jnp.asarray(d["truncated"]))

  (loss, _), grad = jax.value_and_grad(f, has_aux=True)(f32("lp"))
  ref_loss = np_loss(d["lp"], d["lp"], d, ref_adv.reshape(-1), cfg)
  ref_grad = np_grad(d, ref_adv.reshape(-1), cfg)
  assert float(loss) == pytest.approx(ref_loss, rel=2e-5, abs=2e-6)
  scale = max(np.abs(ref_grad).max(), 1e-3)
  np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=0, atol=2e-4 * scale)
  assert np.abs(ref_grad).max() > 0  # the case exercises a real gradient


@pytest.mark.parametrize("name", ["grpo", "rloo", "lite_ppo", "reinforce_pp", "dr_grpo"])
def test_advantages_with_invalid_rows(name):
  cfg = LossConfig.from_preset(name)
  d = _random_batch(seed=3, noise=0.3)
  valid = np.ones((P, G), bool)
  valid[0, 1] = valid[2, 1] = False
  ref = np_advantages(d["rewards"], cfg, valid)
  adv, _ = compute_advantages(jnp.asarray(d["rewards"], jnp.float32), cfg, valid=jnp.asarray(valid))
  np.testing.assert_allclose(np.asarray(adv), ref, rtol=0, atol=2e-5)
  assert adv[0, 1] == 0 and adv[2, 1] == 0


def test_kl_in_reward_flow():
  beta = 0.05
  cfg = LossConfig.from_preset("rloo", kl_coef=beta)
  d = _random_batch(seed=11, noise=0.3)
  kl = kl_penalty(jnp.asarray(d["lp_old"], jnp.float32), jnp.asarray(d["lp_ref"], jnp.float32),
                  jnp.asarray(d["mask"]), cfg.kl_estimator)
  shaped = jnp.asarray(d["rewards"], jnp.float32) - beta * kl.sum(-1).reshape(P, G)
  adv, _ = compute_advantages(shaped, cfg)
  ref_kl = np.where(d["mask"], d["lp_old"] - d["lp_ref"], 0).sum(-1).reshape(P, G)
  ref = np_advantages(d["rewards"] - beta * ref_kl, cfg, np.ones((P, G), bool))
  np.testing.assert_allclose(np.asarray(adv), ref, rtol=0, atol=2e-5)

"""Closed-form tests of the policy loss on a hand-built fixture (2 prompts x G=4, T=8).

Every expected value below is written from the formulas of docs/loss.md token by token:
PPO-clip tokens inside the trust region give d loss/d lp = -A r, clipped ones 0; CISPO and
REINFORCE give -stopgrad(w) A; GSPO gives -A s_i / L_i; all times the aggregation weight.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.rl import LossConfig, combine_metrics, compute_advantages, kl_penalty, make_denominators, policy_loss

P, G, T = 2, 4, 8
LENGTHS = [8, 3, 5, 1, 6, 2, 7, 4]
TRUNCATED = [True, False, False, False, False, False, False, False]
# Prompt 1 is a zero-variance group (the 1e-7 is float noise that must not become signal).
REWARDS = [[1.0, 0.0, 0.5, 0.0], [0.5, 0.5 + 1e-7, 0.5, 0.5]]
# Importance ratios per token. Prompt 0 advantages have signs (+, -, +, -).
RATIOS = [
    [1.0, 1.1, 1.5, 0.5, 1.25, 0.9, 1.3, 0.7],  # A > 0: 1.5 and 1.3 above 1 + eps_high
    [3.5, 0.5, 1.5],                            # A < 0: 3.5 > dual c = 3, 0.5 below 1 - eps
    [1.0, 0.79, 1.29, 1.19, 1.21],              # A > 0
    [0.81],                                     # A < 0
    [1.1, 0.6, 1.4, 1.0, 0.95, 1.05],
    [2.0, 0.5],
    [1.0, 1.0, 1.2, 0.8, 1.1, 0.9, 1.3],
    [0.7, 1.3, 1.0, 1.0],
]


def _fixture():
  rng = np.random.default_rng(0)
  mask = np.zeros((P * G, T), np.float32)
  ratio = np.ones((P * G, T))
  for i, (n, r) in enumerate(zip(LENGTHS, RATIOS)):
    mask[i, :n] = 1
    ratio[i, :n] = r
  lp_old = rng.uniform(-2.5, -0.2, (P * G, T))
  lp = lp_old + np.log(ratio)
  lp_ref = lp + rng.normal(0, 0.3, (P * G, T))
  entropy = rng.uniform(0.1, 2.0, (P * G, T))
  lp_samp = lp_old + rng.normal(0, 0.05, (P * G, T))
  # Padding holds garbage that must not leak into values or gradients.
  off = mask == 0
  lp[off], lp_old[off], lp_ref[off], entropy[off], lp_samp[off] = 1e3, -1e3, 5e2, 9e2, -7e2
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return dict(mask=f32(mask), lp=f32(lp), lp_old=f32(lp_old), lp_ref=f32(lp_ref),
              entropy=f32(entropy), lp_samp=f32(lp_samp), ratio=ratio,
              truncated=jnp.asarray(TRUNCATED), rewards=f32(REWARDS))


FX = _fixture()


def _hand_advantages(eps=1e-6):
  r = REWARDS[0]
  mean = sum(r) / 4
  std = math.sqrt(sum((x - mean) ** 2 for x in r) / 3)
  return [(x - mean) / (std + eps) for x in r] + [0.0] * 4


ADV = _hand_advantages()


def _hand_weights(agg, mask_rows=None, norm=T):
  """Per-token aggregation weights straight from the table of docs/loss.md."""
  lengths = list(mask_rows if mask_rows is not None else LENGTHS)
  n_tokens = sum(lengths)
  n_seqs = sum(1 for n in lengths if n > 0)
  groups = [sum(lengths[p * G:(p + 1) * G]) for p in range(P)]
  n_prompts = sum(1 for g in groups if g > 0)
  w = np.zeros((P * G, T))
  for i, n in enumerate(lengths):
    for t in range(n):
      w[i, t] = {
          "token-mean": 1 / n_tokens,
          "seq-mean-token-mean": 1 / (n_seqs * n),
          "seq-mean-token-sum": 1 / n_seqs,
          "seq-mean-token-sum-norm": 1 / (n_seqs * norm),
          "prompt-mean": 1 / (n_prompts * groups[i // G]),
      }[agg]
  return w


def _ppo_hand(eps_low, eps_high, dual=None, adv=ADV):
  """Per-token PPO-clip loss and d loss / d lp, case by case."""
  loss = np.zeros((P * G, T))
  grad = np.zeros((P * G, T))
  for i, n in enumerate(LENGTHS):
    a = adv[i]
    for t in range(n):
      r = FX["ratio"][i, t]
      if a > 0:
        clipped = r > 1 + eps_high
        loss[i, t] = -a * min(r, 1 + eps_high)
      elif a < 0:
        clipped = r < 1 - eps_low
        loss[i, t] = -a * max(r, 1 - eps_low)
        if dual is not None and r > dual:
          clipped = True
          loss[i, t] = -a * dual
      else:
        clipped = True
      grad[i, t] = 0.0 if clipped else -a * r
  return loss, grad


def _run(cfg, argnums=(0,), **kw):
  """Loss, metrics and gradients w.r.t. lp (and entropy) on the fixture."""
  adv, _ = compute_advantages(FX["rewards"], cfg)
  den = make_denominators(FX["mask"], G, cfg, truncated=kw.get("truncated"))

  def f(lp, entropy):
    return policy_loss(lp, FX["lp_old"], adv.reshape(-1), FX["mask"], den, cfg,
                       entropy=entropy, **kw)

  (loss, metrics), grads = jax.value_and_grad(f, argnums=argnums, has_aux=True)(
      FX["lp"], FX["entropy"])
  return float(loss), metrics, [np.asarray(g, np.float64) for g in grads]


def _close(actual, expected, tol=2e-6):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  scale = max(1.0, float(np.max(np.abs(expected))))
  np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * scale)


def test_advantages_closed_form_and_zero_variance_group():
  cfg = LossConfig.from_preset("grpo")
  adv, metrics = compute_advantages(FX["rewards"], cfg)
  _close(adv.reshape(-1), ADV)
  assert np.all(np.asarray(adv[1]) == 0.0)  # exactly zero, not merely small
  assert float(metrics["frac_reward_zero_std"]) == 0.5
  assert float(metrics["num_reward_zero_std"]) == 1.0
  # Without the tolerance, the 1e-7 noise would become a real advantage.
  noisy, _ = compute_advantages(FX["rewards"], cfg.replace(zero_std_tol=0.0))
  assert float(jnp.max(jnp.abs(noisy[1]))) > 0.01


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                 "seq-mean-token-sum-norm", "prompt-mean"])
def test_ppo_clip_every_aggregation(agg):
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, agg=agg)
  loss, metrics, (g,) = _run(cfg)
  per_tok, per_grad = _ppo_hand(0.2, 0.28)
  w = _hand_weights(agg)
  _close(loss, np.sum(w * per_tok))
  _close(g, w * per_grad)
  # The r = 3.5, A < 0 token is not clipped without dual clip: gradient -A r.
  assert g[1, 0] == pytest.approx(w[1, 0] * -ADV[1] * 3.5, rel=1e-5)


def test_ppo_clip_metrics():
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="token-mean")
  _, m, _ = _run(cfg)
  n = sum(LENGTHS)
  # high: A > 0 and r > 1.28 -> (0,2) 1.5, (0,6) 1.3, (2,2) 1.29; low: A < 0 and r < 0.8 -> (1,1).
  assert float(m["clip_frac_high"]) == pytest.approx(3 / n)
  assert float(m["clip_frac_low"]) == pytest.approx(1 / n)
  assert float(m["clip_frac_dual"]) == pytest.approx(1 / n)
  assert float(m["ratio_max"]) == pytest.approx(3.5, rel=1e-5)
  assert float(m["num_tokens"]) == n
  assert float(m["response_length_mean"]) == pytest.approx(n / 8)
  assert float(m["response_length_max"]) == 8 and float(m["response_length_min"]) == 1


def test_dual_clip():
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="seq-mean-token-sum")
  loss, _, (g,) = _run(cfg)
  per_tok, per_grad = _ppo_hand(0.2, 0.28, dual=3.0)
  w = _hand_weights("seq-mean-token-sum")
  _close(loss, np.sum(w * per_tok))
  _close(g, w * per_grad)
  assert g[1, 0] == 0.0 and per_tok[1, 0] == pytest.approx(-ADV[1] * 3.0)


@pytest.mark.parametrize("two_sided", [False, True])
def test_cispo(two_sided):
  cfg = LossConfig(policy_loss="cispo", clip_low=0.2, clip_high=0.28,
                   cispo_two_sided=two_sided, agg="token-mean")
  loss, m, (g,) = _run(cfg)
  w = _hand_weights("token-mean")
  lp = np.asarray(FX["lp"], np.float64)
  exp_loss, exp_grad = 0.0, np.zeros_like(w)
  for i, n in enumerate(LENGTHS):
    for t in range(n):
      r = FX["ratio"][i, t]
      weight = min(r, 1.28)
      if two_sided:
        weight = max(weight, 0.8)
      exp_loss += w[i, t] * -weight * ADV[i] * lp[i, t]
      exp_grad[i, t] = w[i, t] * -weight * ADV[i]  # flows through lp even where clipped
  _close(loss, exp_loss)
  _close(g, exp_grad)
  assert g[0, 2] != 0.0  # r = 1.5 > 1.28 with A > 0: PPO would give 0 here
  n_high = sum(1 for i, n in enumerate(LENGTHS) for t in range(n) if FX["ratio"][i, t] > 1.28)
  assert float(m["clip_frac_high"]) == pytest.approx(n_high / sum(LENGTHS))


def test_reinforce():
  cfg = LossConfig(policy_loss="reinforce", agg="seq-mean-token-sum")
  loss, _, (g,) = _run(cfg)
  w = _hand_weights("seq-mean-token-sum")
  lp = np.asarray(FX["lp"], np.float64)
  adv = np.asarray(ADV)[:, None]
  _close(loss, np.sum(w * -adv * lp))
  _close(g, w * -adv)


def test_gspo_sequence_ratio():
  cfg = LossConfig.from_preset("gspo")
  loss, _, (g,) = _run(cfg)
  b = len(LENGTHS)
  exp_loss, exp_grad = 0.0, np.zeros((P * G, T))
  for i, n in enumerate(LENGTHS):
    a = ADV[i]
    s = math.exp(sum(math.log(r) for r in RATIOS[i]) / n)
    lo, hi = 1 - 3e-4, 1 + 4e-4
    clipped = (a > 0 and s > hi) or (a < 0 and s < lo) or a == 0
    exp_loss += (-a * min(s, hi) if a > 0 else -a * max(s, lo)) / b
    if not clipped:
      exp_grad[i, :n] = -a * s / n / b
  # Row 0 (A > 0, s < 1) and row 1 (A < 0, s > 1) are unclipped; rows 2 and 3 are clipped.
  assert np.all(exp_grad[0, :8] != 0) and np.all(exp_grad[1, :3] != 0)
  assert np.all(exp_grad[2] == 0) and np.all(exp_grad[3] == 0)
  _close(loss, exp_loss)
  _close(g, exp_grad)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_loss(estimator):
  beta = 0.1
  cfg = LossConfig(policy_loss="reinforce", kl_coef=beta, kl_estimator=estimator,
                   agg="token-mean")
  loss, m, (g,) = _run(cfg, lp_ref=FX["lp_ref"])
  w = _hand_weights("token-mean")
  lp = np.asarray(FX["lp"], np.float64)
  x = lp - np.asarray(FX["lp_ref"], np.float64)
  kl, dkl = {"k1": (x, np.ones_like(x)), "k2": (x * x / 2, x),
             "k3": (np.exp(-x) + x - 1, 1 - np.exp(-x))}[estimator]
  on = w > 0
  adv = np.asarray(ADV)[:, None]
  _close(loss, np.sum(w * -adv * lp) + beta * np.sum(np.where(on, w * kl, 0)), tol=1e-5)
  _close(g, w * -adv + beta * np.where(on, w * dkl, 0), tol=1e-5)
  _close(m["kl_ref"], np.sum(np.where(on, w * kl, 0)), tol=1e-5)
  per_tok = kl_penalty(FX["lp"], FX["lp_ref"], FX["mask"], estimator)
  _close(np.asarray(per_tok), np.where(on, kl, 0), tol=1e-5)


def test_kl_in_reward_and_beta_zero_need_no_reference():
  base = LossConfig(policy_loss="reinforce", agg="token-mean")
  loss0, m0, (g0,) = _run(base)
  assert "kl_ref" not in m0 and "kl_loss" not in m0
  assert not base.needs_reference
  in_reward = base.replace(kl_coef=0.1, kl_in_reward=True)
  assert in_reward.needs_reference
  loss1, m1, (g1,) = _run(in_reward, lp_ref=FX["lp_ref"])
  assert loss1 == loss0 and np.array_equal(g0, g1) and "kl_ref" in m1
  with pytest.raises(ConfigError, match="lp_ref"):
    _run(base.replace(kl_coef=0.1))


def test_entropy_bonus():
  cfg = LossConfig(policy_loss="reinforce", entropy_coef=0.01, agg="seq-mean-token-mean")
  loss, m, (g_lp, g_ent) = _run(cfg, argnums=(0, 1))
  w = _hand_weights("seq-mean-token-mean")
  ent = np.where(w > 0, np.asarray(FX["entropy"], np.float64), 0)
  lp = np.asarray(FX["lp"], np.float64)
  adv = np.asarray(ADV)[:, None]
  _close(loss, np.sum(w * -adv * lp) - 0.01 * np.sum(w * ent))
  _close(g_ent, -0.01 * w)
  _close(m["entropy"], np.sum(ent) / sum(LENGTHS))


def test_positive_negative_weights():
  cfg = LossConfig(policy_loss="reinforce", pos_weight=0.1, neg_weight=1.0, agg="token-mean")
  _, _, (g,) = _run(cfg)
  w = _hand_weights("token-mean")
  scale = np.array([0.1 if a > 0 else 1.0 for a in ADV])[:, None]
  _close(g, w * -np.asarray(ADV)[:, None] * scale)


def test_truncated_importance_sampling():
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=1.02, agg="token-mean")
  loss, m, (g,) = _run(cfg, lp_samp=FX["lp_samp"])
  w = _hand_weights("token-mean")
  on = w > 0
  diff = np.asarray(FX["lp_old"], np.float64) - np.asarray(FX["lp_samp"], np.float64)
  tis = np.where(on, np.minimum(np.exp(np.where(on, diff, 0)), 1.02), 0)
  per_tok, per_grad = _ppo_hand(0.2, 0.28)
  _close(loss, np.sum(w * per_tok * tis))
  _close(g, w * per_grad * tis)
  _close(m["sampler_logprob_diff"], np.sum(np.where(on, np.abs(diff), 0)) / sum(LENGTHS))
  _close(m["sampler_logprob_diff_max"], np.max(np.where(on, np.abs(diff), 0)))
  assert 0 < float(m["tis_frac_capped"]) < 1
  with pytest.raises(ConfigError, match="tis_cap"):
    _run(cfg)


def test_overlong_filter_masks_truncated_rows():
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, agg="token-mean", overlong_filter=True)
  loss, m, (g,) = _run(cfg, truncated=FX["truncated"])
  kept = [0 if tr else n for n, tr in zip(LENGTHS, TRUNCATED)]
  w = _hand_weights("token-mean", mask_rows=kept)
  per_tok, per_grad = _ppo_hand(0.2, 0.28)
  _close(loss, np.sum(w * per_tok))
  _close(g, w * per_grad)
  assert np.all(g[0] == 0)
  assert float(m["num_tokens"]) == sum(kept)
  assert float(m["truncation_rate"]) == pytest.approx(1 / 8)
  with pytest.raises(ConfigError, match="truncated"):
    _run(cfg)


@pytest.mark.parametrize("agg_norm", [None, 1024.0])
def test_dr_grpo_sum_norm_constant(agg_norm):
  cfg = LossConfig.from_preset("dr_grpo", agg_norm=agg_norm)
  adv, _ = compute_advantages(FX["rewards"], cfg)
  dr_adv = [0.625, -0.375, 0.125, -0.375, 0.0, 0.0, 0.0, 0.0]  # R - group mean, no std
  _close(adv.reshape(-1), dr_adv)
  loss, _, (g,) = _run(cfg)
  per_tok, per_grad = _ppo_hand(0.2, 0.2, adv=dr_adv)
  w = _hand_weights("seq-mean-token-sum-norm", norm=agg_norm or T)  # default C = T
  _close(loss, np.sum(w * per_tok))
  _close(g, w * per_grad)


def test_gradients_finite_with_garbage_padding():
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01,
                   agg="prompt-mean")
  loss, _, grads = _run(cfg, argnums=(0, 1), lp_ref=FX["lp_ref"])
  assert math.isfinite(loss)
  off = np.asarray(FX["mask"]) == 0
  for g in grads:
    assert np.all(np.isfinite(g)) and np.all(g[off] == 0)


def test_metrics_combine_by_their_declared_reduction():
  """A metric combines by the reduction it was declared with, whatever its name; Metrics pass
  through jit and scan as pytrees; over updates, sums become means."""
  from rljax.rl import Metrics

  def part(x, hi, lo):
    m = Metrics({"x": jnp.float32(x)})
    m.add("hi", jnp.float32(hi), "max")
    m.add("lo", jnp.float32(lo), "min")
    return m

  out = combine_metrics(combine_metrics({}, part(1.0, 2.0, 3.0)), part(0.5, 5.0, 1.0))
  assert [float(out[k]) for k in ("x", "hi", "lo")] == [1.5, 5.0, 1.0]
  assert out.reduction("hi") == "max" and out.with_values(hi=jnp.float32(0.0)).reduction("hi") == "max"
  _, stacked = jax.lax.scan(lambda c, i: (c, part(i, i, -i)), 0.0, jnp.arange(3.0))
  micro, updates = stacked.reduce_stacked("micro_batches"), stacked.reduce_stacked("updates")
  assert [float(micro[k]) for k in ("x", "hi", "lo")] == [3.0, 2.0, -2.0]
  assert [float(updates[k]) for k in ("x", "hi", "lo")] == [1.0, 2.0, -2.0]
  ident = jax.jit(lambda m: m.identity())(part(1.0, 1.0, 1.0))
  assert [float(ident[k]) for k in ("x", "hi", "lo")] == [0.0, -np.inf, np.inf]
  with pytest.raises(ValueError, match="reduction"):
    Metrics({"x": 1.0}).add("y", 1.0, "median")

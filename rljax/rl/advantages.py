"""Group-relative advantages over a `[P, G]` reward table, and DAPO's soft overlong punishment.

Shapes: P prompts, G completions per prompt. All statistics are over the arrays passed in, so
call `compute_advantages` on the whole optimizer-step batch (inside `jit` a sharded array is
still the global batch).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.rl.config import LossConfig


def _masked_mean(x: jax.Array, valid: jax.Array, axis=None) -> jax.Array:
  count = jnp.sum(valid, axis=axis)
  return jnp.sum(x * valid, axis=axis) / jnp.maximum(count, 1.0)


def _masked_std(x: jax.Array, valid: jax.Array, ddof: int, axis=None) -> jax.Array:
  """Std of the entries where valid = 1; ddof = 1 is Bessel's correction. 0 if too few."""
  count = jnp.sum(valid, axis=axis, keepdims=True)
  mean = jnp.sum(x * valid, axis=axis, keepdims=True) / jnp.maximum(count, 1.0)
  sq = jnp.sum(jnp.square(x - mean) * valid, axis=axis, keepdims=True)
  var = sq / jnp.maximum(count - ddof, 1.0)
  std = jnp.sqrt(var)
  return std.reshape(()) if axis is None else jnp.squeeze(std, axis=axis)


def zero_std_groups(rewards: jax.Array, valid: jax.Array, tol: float) -> jax.Array:
  """Groups whose valid rewards are all equal up to `tol` (relative to max(1, max |R|)).

  Args:
    rewards: [P, G] float32.
    valid: [P, G] float32 in {0, 1}.
    tol: the tolerance of `LossConfig.zero_std_tol`.

  Returns:
    [P] bool; True for a group with at least one valid reward and no spread.
  """
  big = jnp.finfo(jnp.float32).max
  hi = jnp.max(jnp.where(valid > 0, rewards, -big), axis=1)
  lo = jnp.min(jnp.where(valid > 0, rewards, big), axis=1)
  scale = jnp.maximum(1.0, jnp.max(jnp.where(valid > 0, jnp.abs(rewards), 0.0), axis=1))
  has_any = jnp.sum(valid, axis=1) > 0
  return has_any & (hi - lo <= tol * scale)


def _baseline(rewards: jax.Array, valid: jax.Array, cfg: LossConfig) -> jax.Array:
  """mu: [P, G] (or broadcastable) baseline subtracted from the rewards."""
  if cfg.mean_scope == "none":
    return jnp.zeros((), jnp.float32)
  if cfg.mean_scope == "batch":
    return _masked_mean(rewards, valid)
  group_sum = jnp.sum(rewards * valid, axis=1, keepdims=True)
  group_n = jnp.sum(valid, axis=1, keepdims=True)
  if cfg.mean_scope == "group":
    return group_sum / jnp.maximum(group_n, 1.0)
  # "rloo": the mean of the other valid members of the group.
  return (group_sum - rewards * valid) / jnp.maximum(group_n - 1.0, 1.0)


def _scale(rewards: jax.Array, valid: jax.Array, ddof: int, cfg: LossConfig) -> jax.Array:
  """sigma + eps: [P, 1] or scalar divisor, or None for std_scope='none'."""
  if cfg.std_scope == "none":
    return None
  if cfg.std_scope == "batch":
    return _masked_std(rewards, valid, ddof) + cfg.adv_eps
  return _masked_std(rewards, valid, ddof, axis=1)[:, None] + cfg.adv_eps


def compute_advantages(rewards: jax.Array, cfg: LossConfig,
                       valid: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Per-completion advantages A_i = (R_i - mu) / (sigma + eps), then optional whitening.

  Under a group-relative scope (mean_scope 'group' or 'rloo', or std_scope 'group'), a
  zero-variance group (see `zero_std_groups`) gets advantage exactly 0. Invalid entries (valid
  = 0: padding rows, dropped groups) are left out of every statistic and get advantage 0.

  Args:
    rewards: [P, G] rewards, prompt-major (row p holds the G completions of prompt p).
    cfg: the loss config (mean_scope, std_scope, adv_eps, std_unbiased, batch_whiten,
      zero_std_tol are read).
    valid: optional [P, G] bool or {0, 1} mask of real completions.

  Returns:
    adv: [P, G] float32.
    metrics: dict of scalar float32 metrics: reward_mean, reward_std, reward_min, reward_max,
      frac_reward_zero_std, num_reward_zero_std, adv_mean, adv_std, adv_min, adv_max.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  if rewards.ndim != 2:
    raise ValueError(f"rewards must be [P, G], got shape {rewards.shape}.")
  cfg.validate(group_size=rewards.shape[1])
  if valid is None:
    valid = jnp.ones(rewards.shape, jnp.float32)
  else:
    valid = jnp.asarray(valid).astype(jnp.float32)
    if valid.shape != rewards.shape:
      raise ValueError(f"valid must match rewards {rewards.shape}, got {valid.shape}.")
  ddof = 1 if cfg.std_unbiased else 0

  adv = rewards - _baseline(rewards, valid, cfg)
  scale = _scale(rewards, valid, ddof, cfg)
  if scale is not None:
    adv = adv / scale
  if cfg.batch_whiten:
    adv = (adv - _masked_mean(adv, valid)) / (_masked_std(adv, valid, ddof) + cfg.adv_eps)

  zero = zero_std_groups(rewards, valid, cfg.zero_std_tol)
  group_relative = cfg.mean_scope in ("group", "rloo") or cfg.std_scope == "group"
  if group_relative:
    adv = jnp.where(zero[:, None], 0.0, adv)
  adv = adv * valid

  big = jnp.finfo(jnp.float32).max
  num_groups = jnp.sum(jnp.any(valid > 0, axis=1).astype(jnp.float32))
  num_zero = jnp.sum(zero.astype(jnp.float32))
  metrics = {
      "reward_mean": _masked_mean(rewards, valid),
      "reward_std": _masked_std(rewards, valid, ddof),
      "reward_min": jnp.min(jnp.where(valid > 0, rewards, big)),
      "reward_max": jnp.max(jnp.where(valid > 0, rewards, -big)),
      "frac_reward_zero_std": num_zero / jnp.maximum(num_groups, 1.0),
      "num_reward_zero_std": num_zero,
      "adv_mean": _masked_mean(adv, valid),
      "adv_std": _masked_std(adv, valid, ddof),
      "adv_min": jnp.min(jnp.where(valid > 0, adv, big)),
      "adv_max": jnp.max(jnp.where(valid > 0, adv, -big)),
  }
  return adv, metrics

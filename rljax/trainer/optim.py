"""The optax chain: clip by global norm, AdamW, warmup + constant / cosine / linear decay."""
from __future__ import annotations

import jax
import optax

from rljax.errors import ConfigError

SCHEDULES = ("constant", "cosine", "linear")   # config.optim.schedule


def learning_rate_schedule(optim_cfg, total_updates: int) -> optax.Schedule:
  """Warmup from 0 to the peak rate, then constant, cosine or linear decay to min_lr_ratio * peak."""
  peak = float(optim_cfg.learning_rate)
  warmup = int(optim_cfg.warmup_steps)
  floor = peak * float(optim_cfg.min_lr_ratio)
  decay_steps = max(total_updates - warmup, 1)
  if optim_cfg.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif optim_cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(peak, decay_steps, alpha=floor / peak if peak else 0.0)
  elif optim_cfg.schedule == "linear":
    after = optax.linear_schedule(peak, floor, decay_steps)
  else:
    raise ConfigError(f"config.optim.schedule={optim_cfg.schedule!r} is not one of {SCHEDULES}.")
  if warmup == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_optimizer(optim_cfg, total_updates: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(optim_cfg, total_updates)
  parts = []
  if optim_cfg.max_grad_norm is not None:
    parts.append(optax.clip_by_global_norm(float(optim_cfg.max_grad_norm)))
  parts.append(optax.adamw(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                           weight_decay=optim_cfg.weight_decay))
  # Non-finite gradients skip the update (parameters and moments unchanged) and are counted; the
  # loop stops the run after optim.max_consecutive_skips of them, so optax never applies one.
  return optax.apply_if_finite(optax.chain(*parts), max_consecutive_errors=_NEVER), schedule


_NEVER = 2**31 - 1


def skip_counts(opt_state) -> dict[str, jax.Array]:
  """Updates skipped for non-finite gradients: {"total", "consecutive"} int32 scalars."""
  return {"total": opt_state.total_notfinite, "consecutive": opt_state.notfinite_count}

"""The objectives' maths as pure functions: cross-entropy on target tokens (sft, rft), the rft row
filter, the distillation advantage (per-token reverse KL to a teacher).

Shapes: N rows, T completion tokens. Aggregation reuses the RL loss's global denominators
(`rljax.rl.make_denominators` / `token_weights`), so the cross-entropy of micro-batches or packed blocks
sums to the step's, as the policy loss does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from rljax.rl.config import LossConfig
from rljax.rl.losses import Denominators, token_weights
from rljax.rl.metrics import Metrics

_F32 = jnp.float32


def ce_loss(lp: jax.Array, mask: jax.Array, den: Denominators, cfg: LossConfig,
            entropy: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """Cross-entropy of the target tokens: loss = agg_t(-lp_t), agg the cfg.agg weights (token-mean: the
  mean over the step's target tokens; seq-mean-token-mean: the mean over rows of each row's mean).

  lp: [N, T] float32 log-probs of the targets at temperature 1 (differentiated); mask: [N, T] the
  trained tokens; den: `make_denominators` of the whole step; entropy: [N, T] (metrics only).
  Returns (loss [], Metrics: loss, nll (token mean), num_tokens, entropy, response lengths)."""
  m = jnp.asarray(mask).astype(_F32)
  on = m > 0
  lp = jnp.where(on, lp.astype(_F32), 0.0)
  loss = -jnp.sum(token_weights(m, den, cfg) * lp)
  sg = jax.lax.stop_gradient
  tok = sg(m / jnp.maximum(den.num_tokens, 1.0))
  lengths = jnp.sum(m, axis=-1)
  metrics = Metrics({"ce_loss": sg(loss), "nll": -jnp.sum(tok * sg(lp)), "num_tokens": jnp.sum(m),
                     "response_length_mean": jnp.sum(lengths) / den.num_rows})
  metrics.add("response_length_max", jnp.max(lengths), "max")
  metrics.add("response_length_min", jnp.min(lengths), "min")
  if entropy is not None:
    metrics.add("entropy", jnp.sum(tok * sg(jnp.where(on, entropy, 0.0))))
  metrics.add("loss", sg(loss))
  return loss, metrics


def rft_keep(rewards: jax.Array, min_reward: float) -> jax.Array:
  """[N] bool: the rows rejection sampling keeps, those whose reward is at least `min_reward`."""
  return rewards >= min_reward


def rft_metrics(keep: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """The kept share of rows and of tokens: rft/kept_fraction, rft/kept_rows, rft/kept_tokens."""
  keep_f = keep.astype(_F32)
  tokens = jnp.sum(mask, axis=-1).astype(_F32)
  return {"rft/kept_fraction": jnp.mean(keep_f), "rft/kept_rows": jnp.sum(keep_f),
          "rft/kept_tokens": jnp.sum(keep_f * tokens)}


def distill_advantages(lp_student: jax.Array, lp_teacher: jax.Array, mask: jax.Array,
                       clamp: float = 20.0) -> jax.Array:
  """[N, T] per-token advantage of on-policy distillation: minus the reverse KL estimate of each sampled
  token, A_t = lp_teacher_t - lp_student_t (clamped to +-clamp), 0 off the mask.

  With A_t in the policy-gradient loss (ratio r_t, gradient -A_t grad lp_t at r = 1), the expected
  gradient over tokens drawn from the student is that of KL(student || teacher) at each position:
  E_y[(log pi(y) - log q(y)) grad log pi(y)] = grad sum_y pi(y) (log pi(y) - log q(y)), since
  E_y[grad log pi(y)] = 0 (tests/test_objectives.py checks it on a toy vocabulary)."""
  a = jnp.clip(lp_teacher.astype(_F32) - lp_student.astype(_F32), -clamp, clamp)
  return jnp.where(mask > 0, jax.lax.stop_gradient(a), 0.0)


def distill_metrics(lp_student: jax.Array, lp_teacher: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
  """distill/reverse_kl: the token mean of lp_student - lp_teacher over the sampled tokens (a Monte
  Carlo estimate of the per-token KL(student || teacher)); distill/teacher_logprob: the teacher's mean."""
  m = mask.astype(_F32)
  n = jnp.maximum(jnp.sum(m), 1.0)
  return {"distill/reverse_kl": jnp.sum(m * (lp_student - lp_teacher)) / n,
          "distill/teacher_logprob": jnp.sum(m * lp_teacher) / n}

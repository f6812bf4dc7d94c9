"""The fused policy loss: ratio, clipping, CISPO/REINFORCE, TIS, KL, entropy and aggregation.

Shapes: B completions (rows, prompt-major: rows p*G .. p*G+G-1 are prompt p's group), T tokens.
Aggregation denominators are global over the optimizer step: build them once with
`make_denominators` from the step's full mask, then call `policy_loss` per micro-batch (split
along whole prompt groups); the micro-batch losses and gradients sum to the full-batch ones.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.rl._sharding import replicate
from rljax.rl.config import KL_ESTIMATORS, LossConfig
from rljax.rl.metrics import Metrics

_F32 = jnp.float32


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["num_tokens", "num_seqs", "num_prompts", "num_rows", "norm_const"],
    meta_fields=["group_size"])
@dataclasses.dataclass(frozen=True)
class Denominators:
  """Global counts of one optimizer step (scalar float32 arrays), a pytree.

  num_tokens: N, trained tokens (after overlong filtering).
  num_seqs: completions with at least one trained token.
  num_prompts: groups with at least one trained token.
  num_rows: all completion rows of the step (for length and truncation metrics).
  norm_const: C of agg='seq-mean-token-sum-norm'.
  group_size: G (static).
  """
  num_tokens: jax.Array
  num_seqs: jax.Array
  num_prompts: jax.Array
  num_rows: jax.Array
  norm_const: jax.Array
  group_size: int


def train_mask(mask: jax.Array, cfg: LossConfig, truncated: jax.Array | None = None) -> jax.Array:
  """The float32 [B, T] mask of trained tokens: `mask` without truncated rows if overlong_filter."""
  m = jnp.asarray(mask).astype(_F32)
  if cfg.overlong_filter:
    if truncated is None:
      raise ConfigError(
          "overlong_filter=True needs truncated=[B] bool (completions that hit max_new_tokens "
          "without a stop token): pass it, or set overlong_filter=False.")
    m = m * (1.0 - jnp.asarray(truncated).astype(_F32))[:, None]
  return m


def make_denominators(mask: jax.Array, group_size: int, cfg: LossConfig,
                      truncated: jax.Array | None = None) -> Denominators:
  """Global denominators from the FULL optimizer-step batch.

  Args:
    mask: [B, T] completion mask of the whole step (all micro-batches, all devices), B = P*G,
      prompt-major.
    group_size: G.
    cfg: the loss config (agg, agg_norm, overlong_filter are read).
    truncated: [B] bool; required when cfg.overlong_filter.

  Returns:
    Denominators.
  """
  if mask.ndim != 2:
    raise ValueError(f"mask must be [B, T], got shape {mask.shape}.")
  cfg.validate(group_size=group_size)
  if mask.shape[0] % group_size:
    raise ConfigError(
        f"group_size={group_size} does not divide the batch of {mask.shape[0]} rows: the step "
        "batch must hold whole groups (B = P * G).")
  m = train_mask(mask, cfg, truncated)
  lengths = jnp.sum(m, axis=-1)
  groups = jnp.sum(replicate(lengths).reshape(-1, group_size), axis=-1)
  norm = cfg.agg_norm if cfg.agg_norm is not None else mask.shape[1]
  return Denominators(
      num_tokens=jnp.sum(lengths),
      num_seqs=jnp.sum((lengths > 0).astype(_F32)),
      num_prompts=jnp.sum((groups > 0).astype(_F32)),
      num_rows=jnp.asarray(mask.shape[0], _F32),
      norm_const=jnp.asarray(norm, _F32),
      group_size=group_size)


def token_weights(m: jax.Array, den: Denominators, cfg: LossConfig) -> jax.Array:
  """Per-token weights w [B, T] such that the aggregated loss is sum(w * l).

  Args:
    m: [B, T] float32 trained-token mask of this micro-batch (whole groups).
    den: global denominators of the step.
    cfg: cfg.agg selects the mode.
  """
  lengths = jnp.sum(m, axis=-1)
  seqs = jnp.maximum(den.num_seqs, 1.0)
  if cfg.agg == "token-mean":
    row = jnp.broadcast_to(1.0 / jnp.maximum(den.num_tokens, 1.0), lengths.shape)
  elif cfg.agg == "seq-mean-token-mean":
    row = 1.0 / (seqs * jnp.maximum(lengths, 1.0))
  elif cfg.agg == "seq-mean-token-sum":
    row = jnp.broadcast_to(1.0 / seqs, lengths.shape)
  elif cfg.agg == "seq-mean-token-sum-norm":
    row = jnp.broadcast_to(1.0 / (seqs * den.norm_const), lengths.shape)
  else:  # "prompt-mean": the group's tokens are all in this micro-batch.
    g = den.group_size
    if m.shape[0] % g:
      raise ConfigError(
          f"agg='prompt-mean' needs micro-batches of whole groups: {m.shape[0]} rows is not a "
          f"multiple of group_size={g}; split the step batch along prompts.")
    # [B] floats: cheap to gather before regrouping rows that may sit on different devices.
    group_tokens = jnp.repeat(jnp.sum(replicate(lengths).reshape(-1, g), axis=-1), g)
    row = 1.0 / (jnp.maximum(den.num_prompts, 1.0) * jnp.maximum(group_tokens, 1.0))
  return m * row[:, None]


def kl_penalty(lp: jax.Array, lp_ref: jax.Array, mask: jax.Array | None = None,
               estimator: str = "k1", clamp: float = 20.0) -> jax.Array:
  """Per-token KL estimate to the reference, x = lp - lp_ref (clamped to +-clamp).

  k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1. For KL in the reward, the trainer subtracts
  beta * sum_t kl_penalty(lp_old, lp_ref, mask)[i, t] from R_i before `compute_advantages`.

  Args:
    lp, lp_ref: [B, T] log-probs of the policy and of the reference.
    mask: optional [B, T]; positions with mask 0 give 0.
    estimator: "k1", "k2" or "k3".

  Returns:
    [B, T] float32.
  """
  if estimator not in KL_ESTIMATORS:
    raise ConfigError(f"kl_estimator={estimator!r} is unknown: use one of {list(KL_ESTIMATORS)}.")
  x = jnp.clip(lp.astype(_F32) - lp_ref.astype(_F32), -clamp, clamp)
  if estimator == "k1":
    kl = x
  elif estimator == "k2":
    kl = 0.5 * jnp.square(x)
  else:
    kl = jnp.exp(-x) + x - 1.0
  if mask is not None:
    kl = jnp.where(mask > 0, kl, 0.0)
  return kl


def _surrogate(lp, ratio, adv, cfg: LossConfig):
  """Per-token policy loss [B, T] and (low, high, dual) clip indicators [B, T] bool."""
  none = jnp.zeros(ratio.shape, bool)
  if cfg.policy_loss == "reinforce":
    return -adv * lp, (none, none, none)
  hi = 1.0 + cfg.clip_high
  if cfg.policy_loss == "cispo":
    lo = 1.0 - cfg.clip_low if cfg.cispo_two_sided else 0.0
    weight = jax.lax.stop_gradient(jnp.clip(ratio, lo, hi))
    low_hit = ratio < lo if cfg.cispo_two_sided else none
    return -weight * adv * lp, (low_hit, ratio > hi, none)
  lo = 1.0 - cfg.clip_low
  loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, lo, hi))
  low_hit = (ratio < lo) & (adv < 0)
  high_hit = (ratio > hi) & (adv > 0)
  dual_hit = none
  if cfg.dual_clip is not None:
    dual_hit = (adv < 0) & (ratio > cfg.dual_clip)
    loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * cfg.dual_clip), loss)
  return loss, (low_hit, high_hit, dual_hit)


def _ratio(lp, lp_old, m, cfg: LossConfig):
  """Importance ratio [B, T]: per token, or GSPO's per-sequence exp(mean_t log-ratio)."""
  c = cfg.log_ratio_clamp
  if cfg.ratio_level == "sequence":
    lengths = jnp.maximum(jnp.sum(m, axis=-1), 1.0)
    seq = jnp.sum(m * (lp - lp_old), axis=-1) / lengths
    return jnp.broadcast_to(jnp.exp(jnp.clip(seq, -c, c))[:, None], lp.shape)
  return jnp.exp(jnp.clip(lp - lp_old, -c, c))


def policy_loss(lp: jax.Array, lp_old: jax.Array | None, adv: jax.Array, mask: jax.Array,
                den: Denominators, cfg: LossConfig, lp_ref: jax.Array | None = None,
                lp_samp: jax.Array | None = None, entropy: jax.Array | None = None,
                truncated: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
  """This micro-batch's contribution to the step loss, with global denominators.

  loss = agg(pg_t) + kl_coef * agg(KL_t) [unless kl_in_reward] - entropy_coef * agg(H_t),
  where agg(x) = sum(w * x) with `token_weights`. Summed over micro-batches that split the step
  along whole prompt groups, it equals the full-batch loss.

  Args:
    lp: [B, T] float32 log-probs of the current policy (differentiated).
    lp_old: [B, T] log-probs of the policy that produced the batch (no gradient); None means
      on-policy (stop_gradient(lp)).
    adv: [B] advantages (no gradient), e.g. compute_advantages(...)[0].reshape(-1), or [B, T] per-token
      advantages (on-policy distillation: rljax/objectives/losses.py).
    mask: [B, T] completion mask (1 = a generated token to train on).
    den: `make_denominators` of the whole step.
    cfg: the loss config (static under jit).
    lp_ref: [B, T] reference log-probs; required when kl_coef > 0 and not kl_in_reward.
    lp_samp: [B, T] sampler log-probs; required when tis_cap is set. If given, the
      sampler/learner difference is logged.
    entropy: [B, T] per-token entropy (differentiated); required when entropy_coef > 0.
    truncated: [B] bool; required when overlong_filter.

  Returns:
    loss: scalar float32.
    metrics: `Metrics` of scalar float32, each declared with how it combines across
      micro-batches (rljax/rl/metrics.py): max / min for the extremes, sum for the rest, which
      are already normalised by the global denominators, so the combined value is the step's.
  """
  if cfg.kl_coef > 0 and not cfg.kl_in_reward and lp_ref is None:
    raise ConfigError(
        f"kl_coef={cfg.kl_coef} puts a KL term in the loss and needs lp_ref: pass the reference "
        "log-probs, or set kl_coef=0.")
  if cfg.tis_cap is not None and lp_samp is None:
    raise ConfigError(
        f"tis_cap={cfg.tis_cap} needs lp_samp (the sampler's log-probs): pass it, or set "
        "tis_cap=None.")
  if cfg.entropy_coef > 0 and entropy is None:
    raise ConfigError(
        f"entropy_coef={cfg.entropy_coef} needs entropy=[B, T] (from chunked_logprobs): pass "
        "it, or set entropy_coef=0.")
  if adv.shape not in ((lp.shape[0],), lp.shape):
    raise ValueError(f"adv must be [B] = [{lp.shape[0]}] or [B, T] = {list(lp.shape)}, got shape {adv.shape}.")

  m = train_mask(mask, cfg, truncated)
  on = m > 0
  sg = jax.lax.stop_gradient
  # Padded positions may hold anything (even inf); zero them so no NaN leaks into gradients.
  clean = lambda x: jnp.where(on, x.astype(_F32), 0.0)
  lp = clean(lp)
  lp_old = sg(lp) if lp_old is None else sg(clean(lp_old))
  a = sg(adv.astype(_F32))
  a = a[:, None] if a.ndim == 1 else jnp.where(on, a, 0.0)
  w = token_weights(m, den, cfg)

  ratio = _ratio(lp, lp_old, m, cfg)
  per_token, (low_hit, high_hit, dual_hit) = _surrogate(lp, ratio, a, cfg)
  if cfg.pos_weight != 1.0 or cfg.neg_weight != 1.0:
    per_token = per_token * jnp.where(a > 0, cfg.pos_weight, jnp.where(a < 0, cfg.neg_weight, 1.0))
  if cfg.tis_cap is not None:
    tis = sg(jnp.minimum(jnp.exp(jnp.clip(lp_old - clean(lp_samp), -20.0, 20.0)), cfg.tis_cap))
    per_token = per_token * tis
  pg_loss = jnp.sum(w * per_token)
  loss = pg_loss

  tok = sg(m / jnp.maximum(den.num_tokens, 1.0))  # token-mean weights for the metrics
  frac = lambda hit: jnp.sum(tok * hit)
  log_ratio = jnp.clip(lp - lp_old, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
  metrics = Metrics({
      "pg_loss": sg(pg_loss),
      "clip_frac_low": frac(low_hit),
      "clip_frac_high": frac(high_hit),
      "clip_frac_dual": frac(dual_hit),
      "ratio_mean": jnp.sum(tok * sg(ratio)),
      "approx_kl_old": jnp.sum(tok * sg(jnp.exp(log_ratio) - 1.0 - log_ratio)),
      "num_tokens": jnp.sum(m),
  })
  metrics.add("ratio_max", jnp.max(jnp.where(on, sg(ratio), 0.0)), "max")

  if lp_ref is not None:
    kl = kl_penalty(lp, clean(lp_ref), m, cfg.kl_estimator, cfg.log_ratio_clamp)
    metrics.add("kl_ref", jnp.sum(tok * sg(kl)))
    if cfg.kl_coef > 0 and not cfg.kl_in_reward:
      kl_loss = jnp.sum(w * kl)
      loss = loss + cfg.kl_coef * kl_loss
      metrics.add("kl_loss", sg(kl_loss))
  if entropy is not None:
    entropy = clean(entropy)
    metrics.add("entropy", jnp.sum(tok * sg(entropy)))
    if cfg.entropy_coef > 0:
      ent_loss = jnp.sum(w * entropy)
      loss = loss - cfg.entropy_coef * ent_loss
      metrics.add("entropy_loss", sg(ent_loss))
  if lp_samp is not None:
    diff = jnp.abs(lp_old - clean(lp_samp))
    metrics.add("sampler_logprob_diff", jnp.sum(tok * diff))
    metrics.add("sampler_logprob_diff_max", jnp.max(diff), "max")
  if cfg.tis_cap is not None:
    metrics.add("tis_weight_mean", jnp.sum(tok * tis))
    metrics.add("tis_frac_capped", frac(tis >= cfg.tis_cap))

  raw_lengths = jnp.sum(jnp.asarray(mask).astype(_F32), axis=-1)
  metrics.add("response_length_mean", jnp.sum(raw_lengths) / den.num_rows)
  metrics.add("response_length_max", jnp.max(raw_lengths), "max")
  metrics.add("response_length_min", jnp.min(raw_lengths), "min")
  if truncated is not None:
    metrics.add("truncation_rate", jnp.sum(jnp.asarray(truncated).astype(_F32)) / den.num_rows)
  metrics.add("loss", sg(loss))
  return loss, metrics

"""Group-relative RL maths: advantages, policy losses, KL, entropy, aggregation, presets.

Semantics: docs/loss.md. Typical step::

  cfg = LossConfig.from_preset("dapo")
  adv, adv_metrics = compute_advantages(rewards, cfg)              # [P, G] -> [P, G]
  den = make_denominators(mask, group_size=G, cfg=cfg, truncated=truncated)   # whole step
  lp, ent = chunked_logprobs(hidden, lm_head, targets, temperature)           # per micro-batch
  loss, metrics = policy_loss(lp, lp_old, adv.reshape(-1), mask, den, cfg,
                              entropy=ent, truncated=truncated)
"""
from rljax.rl.advantages import compute_advantages, zero_std_groups
from rljax.rl.config import AGG_MODES, PRESETS, LossConfig
from rljax.rl.logprobs import chunked_logprobs, naive_logprobs
from rljax.rl.losses import Denominators, kl_penalty, make_denominators, policy_loss, token_weights, train_mask
from rljax.rl.metrics import Metrics, combine_metrics

__all__ = [
    "AGG_MODES",
    "PRESETS",
    "Denominators",
    "LossConfig",
    "Metrics",
    "chunked_logprobs",
    "combine_metrics",
    "compute_advantages",
    "kl_penalty",
    "make_denominators",
    "naive_logprobs",
    "policy_loss",
    "token_weights",
    "train_mask",
    "zero_std_groups",
]

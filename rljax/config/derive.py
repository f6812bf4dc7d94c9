"""Settings derived from the run config: what the trainer and `rljax plan` build from it.

Each is a pure function of the config, so the trainer, the plan and the validation read the
same answer (the staleness bound in effect, whether lp_old is recomputed, the LossConfig, the
LoraConfig, ...).
"""
from __future__ import annotations

import difflib

import ml_collections

from rljax.errors import ConfigError
from rljax.models.config import LoraConfig
from rljax.objectives import CE_OBJECTIVES
from rljax.rl.config import PRESETS, LossConfig
from rljax.trainer import modes

# Off-policy modes correct with truncated IS against the sampler; this cap is used unless rl.tis_cap is set.
DEFAULT_OFF_POLICY_TIS_CAP = 2.0


def dynamic_oversample(c: ml_collections.ConfigDict) -> int:
  """Prompts sampled per prompt trained: train.oversample (default 2) with dynamic sampling, else 1."""
  t = c.train
  if not t.dynamic_sampling:
    return 1
  return 2 if t.oversample is None else t.oversample


def max_staleness(c: ml_collections.ConfigDict) -> int:
  """The staleness bound in effect: 0 in an on-policy mode (fused), else the configured value or the
  mode's default (rljax/trainer/modes.py)."""
  return modes.get(c.rollout.mode).staleness(c.rollout.max_staleness)


def recompute_old_logprobs(c: ml_collections.ConfigDict) -> bool:
  """Whether the update recomputes lp_old: off-policy batches with rollout.proximal='recompute',
  and every run whose compute dtype is not float32. In bf16 the sampler's cached decode and the
  learner's forward round differently (SmolLM2-135M: mean |difference| 0.026, max 0.31), so the
  sampler's log-probs are not the learner's; the learner's own lp_old plus a truncated IS weight
  against the sampler is the verl/TRL practice. In float32 they agree to ~1e-6 and the sampler's
  log-probs serve as lp_old (no recompute forward)."""
  objective = c.train.objective
  if objective in CE_OBJECTIVES:   # cross-entropy: no ratio, no lp_old
    return False
  if objective == "distill":   # its advantage is lp_teacher - lp_old, lp_old the learner's own (0 at teacher = student)
    return True
  if c.rollout.proximal != "recompute":
    return False
  return max_staleness(c) > 0 or c.model.dtype != "float32"


def lora_config(c: ml_collections.ConfigDict) -> LoraConfig | None:
  """The LoraConfig of config.model.lora, or None when its rank is 0 (full fine-tuning)."""
  lc = c.model.lora
  if isinstance(lc.rank, bool) or not isinstance(lc.rank, int) or lc.rank < 0:
    raise ConfigError(f"config.model.lora.rank={lc.rank!r} must be a non-negative integer (0 = no LoRA, full "
                      "fine-tuning; 8-64 are usual).")
  if lc.rank == 0:
    return None
  targets = [lc.targets] if isinstance(lc.targets, str) else list(lc.targets)
  return LoraConfig(rank=lc.rank, alpha=float(lc.alpha), dropout=float(lc.dropout), targets=tuple(targets))


def loss_config(c: ml_collections.ConfigDict) -> LossConfig:
  """The LossConfig named by config.rl (a preset plus overrides).

  Under train.objective 'sft' / 'rft' only rl.agg (default token-mean) and rl.agg_norm apply.

  Whenever lp_old is recomputed (off-policy modes with rollout.proximal='recompute', and runs
  in a dtype other than float32) and rl.tis_cap is unset, the truncated IS weight against the
  sampler is on with cap DEFAULT_OFF_POLICY_TIS_CAP (decoupled PPO, verl/TRL's TIS). With
  proximal='sampler', lp_old is the sampler's and the IS weight would be 1.
  """
  fields = {k: v for k, v in c.rl.to_dict().items() if v is not None}
  if c.train.objective in CE_OBJECTIVES:
    # Cross-entropy: only the aggregation is read (token-mean unless rl.agg says otherwise); no group statistics.
    return LossConfig(mean_scope="none", std_scope="none", agg=fields.get("agg", "token-mean"),
                      agg_norm=fields.get("agg_norm"))
  preset = fields.pop("preset", "grpo")
  if preset not in PRESETS:
    close = difflib.get_close_matches(str(preset), list(PRESETS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"config.rl.preset={preset!r} is not a loss preset.{hint} The presets are: "
                      f"{', '.join(sorted(PRESETS))} (docs/loss.md describes each).")
  if recompute_old_logprobs(c):
    fields.setdefault("tis_cap", DEFAULT_OFF_POLICY_TIS_CAP)
  if c.train.objective == "distill" and not c.distill.reward_weight:
    # Pure distillation: the advantage is the per-token reverse KL alone; no reward group statistics
    # (a group of one, sampling.num_samples=1, is fine).
    fields.update(mean_scope="none", std_scope="none")
  try:
    return LossConfig.from_preset(preset, **fields)
  except ConfigError as e:
    msg = str(e)
    field = msg.split("=", 1)[0].split(" ", 1)[0]
    raise ConfigError(f"config.rl.{msg}" if field in c.rl else f"config.rl (preset {preset!r}): {msg}") from None

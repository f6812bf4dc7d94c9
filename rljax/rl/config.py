"""`LossConfig`: every knob of the group-relative policy update, and the named presets.

The semantics of each field are those of docs/loss.md and /work/shared/design/ALGORITHMS.md.
`LossConfig` is a frozen, hashable dataclass, so it can be a static argument of `jax.jit`.
Every instance is validated on construction; `validate(group_size=G)` adds the checks that need
the group size.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

from rljax.errors import ConfigError

MEAN_SCOPES = ("group", "batch", "none", "rloo")
STD_SCOPES = ("group", "batch", "none")
POLICY_LOSSES = ("ppo", "cispo", "reinforce")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "prompt-mean",
)


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Configuration of advantages, policy loss, regularisers and aggregation.

  The defaults are GRPO (DeepSeekMath) without the KL term; `LossConfig.from_preset` gives the
  named recipes. Fields:

  Advantages (`compute_advantages`, rewards `[P, G]`):
    mean_scope: baseline mu. "group" (group mean), "batch" (mean over the whole step batch),
      "none" (mu = 0), "rloo" (leave-one-out: mean of the other G-1 rewards of the group).
    std_scope: scale sigma. "group", "batch" (std of the raw rewards over the whole batch) or
      "none" (no division at all).
    adv_eps: A = (R - mu) / (sigma + adv_eps). Default 1e-6 (verl's; TRL uses 1e-4).
    std_unbiased: Bessel's correction (N - 1) in every std, as verl and TRL do.
    batch_whiten: after the step above, whiten A over the batch: (A - mean) / (std + adv_eps)
      (REINFORCE++-baseline).
    zero_std_tol: a group whose rewards span at most zero_std_tol * max(1, max |R|) is a
      zero-variance group: under group scopes its advantages are exactly 0 and it is counted.

  Policy loss (`policy_loss`, per token, ratio r = exp(lp - lp_old)):
    policy_loss: "ppo" (clipped surrogate), "cispo" (clipped, detached IS weight times lp) or
      "reinforce" (-A lp, no ratio).
    ratio_level: "token" (r_t) or "sequence" (GSPO: s_i = exp(mean_t(lp - lp_old)), the
      gradient flows through the mean).
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high] (eps_low,
      eps_high in the papers). For "cispo" the lower bound applies only with cispo_two_sided.
    dual_clip: c > 1 or None. For A < 0 the PPO loss is capped at -A c (dual-clip PPO).
    cispo_two_sided: CISPO clips the weight on both sides (verl) instead of only above (TRL,
      MiniMax-M1).
    pos_weight, neg_weight: per-token loss multiplied by pos_weight where A > 0 and by
      neg_weight where A < 0.
    tis_cap: truncated importance sampling against the sampler: the per-token loss is
      multiplied by min(exp(lp_old - lp_samp), tis_cap). None disables it.
    log_ratio_clamp: log-ratios are clamped to +-log_ratio_clamp before exp.

  Regularisers:
    kl_coef: beta. 0 means no KL at all and no reference model (`needs_reference` is False).
    kl_estimator: "k1" (x), "k2" (x^2 / 2) or "k3" (exp(-x) + x - 1), x = lp - lp_ref.
    kl_in_reward: subtract beta * sum_t KL_t from the reward (the trainer calls `kl_penalty`)
      instead of adding beta * agg(KL_t) to the loss.
    entropy_coef: loss -= entropy_coef * agg(H_t).

  Aggregation and length handling:
    agg: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
      or "prompt-mean". Denominators are global over the optimizer step (`make_denominators`).
    agg_norm: the constant C of "seq-mean-token-sum-norm" (set it to max_new_tokens). None
      uses the width T of the step's completion mask.
    overlong_filter: completions that were truncated (hit max_new_tokens without a stop
      token) get mask 0; pass `truncated` to `make_denominators` and `policy_loss`.
  """

  # Advantages.
  mean_scope: str = "group"
  std_scope: str = "group"
  adv_eps: float = 1e-6
  std_unbiased: bool = True
  batch_whiten: bool = False
  zero_std_tol: float = 1e-6
  # Policy loss.
  policy_loss: str = "ppo"
  ratio_level: str = "token"
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float | None = None
  cispo_two_sided: bool = False
  pos_weight: float = 1.0
  neg_weight: float = 1.0
  tis_cap: float | None = None
  log_ratio_clamp: float = 20.0
  # Regularisers.
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in_reward: bool = False
  entropy_coef: float = 0.0
  # Aggregation and length handling.
  agg: str = "seq-mean-token-mean"
  agg_norm: float | None = None
  overlong_filter: bool = False

  def __post_init__(self):
    _validate_fields(self)

  @classmethod
  def from_preset(cls, name: str, **overrides: Any) -> "LossConfig":
    """The named recipe `name` (see `PRESETS`), with `overrides` applied, validated.

    Raises:
      ConfigError: unknown preset, unknown field, or an invalid value.
    """
    if name not in PRESETS:
      raise ConfigError(
          f"LossConfig preset {name!r} is unknown: use one of {sorted(PRESETS)}"
          f"{_did_you_mean(name, PRESETS)}.")
    _check_field_names(overrides, f"LossConfig.from_preset({name!r})")
    return cls(**{**PRESETS[name], **overrides})

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> "LossConfig":
    """A config from a mapping of field names to values (unknown names raise ConfigError)."""
    _check_field_names(fields, "LossConfig")
    return cls(**fields)

  def replace(self, **overrides: Any) -> "LossConfig":
    """A copy with `overrides` applied, validated."""
    _check_field_names(overrides, "LossConfig.replace")
    return dataclasses.replace(self, **overrides)

  def validate(self, group_size: int | None = None) -> "LossConfig":
    """Checks the fields, and with `group_size` the settings that need G. Returns self."""
    _validate_fields(self)
    if group_size is None:
      return self
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
      raise ConfigError(f"group_size must be a positive int, got {group_size!r}.")
    if group_size < 2:
      if self.std_scope == "group":
        raise ConfigError(
            "std_scope='group' needs group_size >= 2 (a group of one has no spread): sample "
            "G >= 2 completions per prompt, or set std_scope='batch' or 'none'.")
      if self.mean_scope in ("group", "rloo"):
        raise ConfigError(
            f"mean_scope={self.mean_scope!r} needs group_size >= 2 (with G = 1 every "
            "advantage is 0): sample G >= 2 completions per prompt, or set "
            "mean_scope='batch' or 'none'.")
    return self

  @property
  def needs_reference(self) -> bool:
    """Whether a frozen reference policy (lp_ref) must be kept: only when kl_coef > 0."""
    return self.kl_coef > 0


# Each preset sets every field that defines the recipe; docs/loss.md has the sources.
PRESETS: dict[str, dict[str, Any]] = {
    # Shao et al. 2024, DeepSeekMath (arXiv 2402.03300): group mean/std, PPO clip 0.2,
    # per-sequence mean of per-token means, k3 KL to the reference in the loss, beta = 0.04.
    "grpo": dict(
        mean_scope="group", std_scope="group", policy_loss="ppo", ratio_level="token",
        clip_low=0.2, clip_high=0.2, agg="seq-mean-token-mean", kl_coef=0.04,
        kl_estimator="k3", kl_in_reward=False),
    # Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv 2503.20783): no std
    # division, no length normalisation (sum over tokens / constant), no KL.
    "dr_grpo": dict(
        mean_scope="group", std_scope="none", policy_loss="ppo", ratio_level="token",
        clip_low=0.2, clip_high=0.2, agg="seq-mean-token-sum-norm", kl_coef=0.0),
    # Yu et al. 2025, DAPO (arXiv 2503.14476): clip-higher 0.2/0.28, token-level mean,
    # overlong filtering, no KL (dynamic sampling is the trainer's job).
    "dapo": dict(
        mean_scope="group", std_scope="group", policy_loss="ppo", ratio_level="token",
        clip_low=0.2, clip_high=0.28, agg="token-mean", kl_coef=0.0, overlong_filter=True),
    # Zheng et al. 2025, GSPO (arXiv 2507.18071): sequence-level length-normalised ratio,
    # clip 3e-4 / 4e-4, per-sequence mean, no KL.
    "gspo": dict(
        mean_scope="group", std_scope="group", policy_loss="ppo", ratio_level="sequence",
        clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean", kl_coef=0.0),
    # MiniMax 2025, MiniMax-M1 (arXiv 2506.13585): clipped detached IS weight times lp, no lower
    # bound, token-level mean, no KL. The paper does not publish eps_high; 4.0 caps the weight
    # at 5.0, TRL's recommended CISPO cap (its epsilon_high=5.0 is the cap itself).
    "cispo": dict(
        mean_scope="group", std_scope="group", policy_loss="cispo", ratio_level="token",
        clip_high=4.0, cispo_two_sided=False, agg="token-mean", kl_coef=0.0),
    # Liu et al. 2025, "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning"
    # (arXiv 2508.08221): group mean, batch std, token-level mean, vanilla PPO clip, no KL.
    "lite_ppo": dict(
        mean_scope="group", std_scope="batch", policy_loss="ppo", ratio_level="token",
        clip_low=0.2, clip_high=0.2, agg="token-mean", kl_coef=0.0),
    # Ahmadian et al. 2024, "Back to Basics" (arXiv 2402.14740): leave-one-out baseline, no
    # std, REINFORCE on the whole sequence (sum of token log-probs), KL (k1) in the reward
    # when beta > 0.
    "rloo": dict(
        mean_scope="rloo", std_scope="none", policy_loss="reinforce", ratio_level="token",
        agg="seq-mean-token-sum", kl_coef=0.0, kl_estimator="k1", kl_in_reward=True),
    # Hu 2025, REINFORCE++ (arXiv 2501.03262), the "baseline" variant for group sampling:
    # group mean, then batch whitening; PPO clip 0.2; k2 KL in the loss, beta = 1e-3.
    "reinforce_pp": dict(
        mean_scope="group", std_scope="none", batch_whiten=True, policy_loss="ppo",
        ratio_level="token", clip_low=0.2, clip_high=0.2, agg="token-mean", kl_coef=1e-3,
        kl_estimator="k2", kl_in_reward=False),
}

_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(LossConfig))


def _did_you_mean(name: str, choices) -> str:
  close = difflib.get_close_matches(str(name), list(choices), n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _check_field_names(fields: dict[str, Any], where: str) -> None:
  for key in fields:
    if key not in _FIELD_NAMES:
      raise ConfigError(
          f"{where}: unknown field {key!r}{_did_you_mean(key, _FIELD_NAMES)}; the fields are "
          f"{list(_FIELD_NAMES)}.")


def _check_choice(cfg: LossConfig, name: str, choices) -> None:
  value = getattr(cfg, name)
  if value not in choices:
    raise ConfigError(
        f"{name}={value!r} is unknown: use one of {list(choices)}{_did_you_mean(value, choices)}.")


def _check_bool(cfg: LossConfig, name: str) -> None:
  value = getattr(cfg, name)
  if not isinstance(value, bool):
    raise ConfigError(f"{name} must be True or False, got {value!r}.")


def _check_number(cfg: LossConfig, name: str, *, low: float, low_inclusive: bool = True,
                  high: float = math.inf, optional: bool = False) -> None:
  value = getattr(cfg, name)
  if value is None and optional:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ConfigError(f"{name} must be a finite number, got {value!r}.")
  too_low = value < low if low_inclusive else value <= low
  if too_low or value > high:
    bound = f"{'>=' if low_inclusive else '>'} {low}"
    if high != math.inf:
      bound += f" and <= {high}"
    extra = " (or None to disable it)" if optional else ""
    alias = _ALIASES.get(name, "")
    raise ConfigError(f"{name}{alias}={value!r} is out of range: set it {bound}{extra}.")


_ALIASES = {"clip_low": " (eps_low)", "clip_high": " (eps_high)", "kl_coef": " (beta)"}


def _validate_fields(cfg: LossConfig) -> None:
  """Raises ConfigError for the first invalid or contradictory field of `cfg`."""
  _check_choice(cfg, "mean_scope", MEAN_SCOPES)
  _check_choice(cfg, "std_scope", STD_SCOPES)
  _check_choice(cfg, "policy_loss", POLICY_LOSSES)
  _check_choice(cfg, "ratio_level", RATIO_LEVELS)
  _check_choice(cfg, "kl_estimator", KL_ESTIMATORS)
  _check_choice(cfg, "agg", AGG_MODES)
  for name in ("std_unbiased", "batch_whiten", "cispo_two_sided", "kl_in_reward",
               "overlong_filter"):
    _check_bool(cfg, name)
  _check_number(cfg, "adv_eps", low=0.0)
  _check_number(cfg, "zero_std_tol", low=0.0)
  _check_number(cfg, "clip_low", low=0.0, high=1.0)
  _check_number(cfg, "clip_high", low=0.0)
  _check_number(cfg, "dual_clip", low=1.0, low_inclusive=False, optional=True)
  _check_number(cfg, "pos_weight", low=0.0)
  _check_number(cfg, "neg_weight", low=0.0)
  _check_number(cfg, "tis_cap", low=0.0, low_inclusive=False, optional=True)
  _check_number(cfg, "log_ratio_clamp", low=0.0, low_inclusive=False)
  _check_number(cfg, "kl_coef", low=0.0)
  _check_number(cfg, "entropy_coef", low=0.0)
  _check_number(cfg, "agg_norm", low=0.0, low_inclusive=False, optional=True)
  # A knob that is accepted must change behaviour: reject settings the mode ignores.
  if cfg.dual_clip is not None and cfg.policy_loss != "ppo":
    raise ConfigError(
        f"dual_clip={cfg.dual_clip} only applies to policy_loss='ppo' (got "
        f"{cfg.policy_loss!r}): set dual_clip=None.")
  if cfg.cispo_two_sided and cfg.policy_loss != "cispo":
    raise ConfigError(
        f"cispo_two_sided=True only applies to policy_loss='cispo' (got {cfg.policy_loss!r}): "
        "set cispo_two_sided=False.")
  if cfg.ratio_level == "sequence" and cfg.policy_loss == "reinforce":
    raise ConfigError(
        "ratio_level='sequence' has no effect with policy_loss='reinforce' (it uses no ratio): "
        "set ratio_level='token', or policy_loss='ppo' for GSPO.")
  if cfg.agg_norm is not None and cfg.agg != "seq-mean-token-sum-norm":
    raise ConfigError(
        f"agg_norm={cfg.agg_norm} only applies to agg='seq-mean-token-sum-norm' (got "
        f"{cfg.agg!r}): set agg_norm=None.")

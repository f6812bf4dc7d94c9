"""Combining component scores into rewards, and the metrics of a scored batch."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.rewards.spec import RewardSpec, weight_at


@dataclasses.dataclass
class RewardBatch:
  """The result of scoring one batch.

  Attributes:
    rewards: [N] float32 total reward, sum_k weight_k(step) * gate_k * components[k].
    components: name -> [N] float32 raw score of each component (after the fallback for
      failed items, before weights and gates).
    metrics: scalar metrics (see docs/rewards.md): reward/mean, reward/<name>_mean,
      reward/accuracy, verifier/timeouts, verifier/errors, verifier/crashes, ...
    errors: the error messages of this batch (at most 20).
    answers: the answer extracted by the accuracy component's verifier per item (None
      where it reported none), for majority voting.
    failed: name -> [N] bool, whether the verifier failed on the item.
    infos: name -> [N] the info dict each item's verifier returned (None where it returned
      none); a failed item gets {"failure": "timeout"|"error"|"crash"|"deadline",
      "message": str}.
  """
  rewards: np.ndarray
  components: dict[str, np.ndarray]
  metrics: dict[str, float]
  errors: list[str]
  answers: list[str | None] = dataclasses.field(default_factory=list)
  failed: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  infos: dict[str, list[dict | None]] = dataclasses.field(default_factory=dict)

  def components_matrix(self) -> np.ndarray:
    """[N, K] float32 raw component scores in spec order."""
    cols = list(self.components.values())
    if not cols:
      return np.zeros((self.rewards.shape[0], 0), np.float32)
    return np.stack(cols, axis=1).astype(np.float32)


def combine(spec: RewardSpec, scores: np.ndarray, failed: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
  """Weighted, gated sum of component scores.

  Args:
    scores: [K, N] raw scores (fallback already applied where failed).
    failed: [K, N] bool.
  Returns:
    rewards [N] float32 and passed [K, N] bool, where an item passes component k when
    its score is > 0, the verifier did not fail, and k's own gate (if any) passed.
  """
  k, n = scores.shape
  index = {c.name: i for i, c in enumerate(spec.components)}
  passed = np.zeros((k, n), bool)
  gated = np.zeros((k, n), np.float64)
  for i in spec.gate_order():
    c = spec.components[i]
    open_ = np.ones(n, bool) if c.gate is None else passed[index[c.gate]]
    passed[i] = (scores[i] > 0) & ~failed[i] & open_
    gated[i] = np.where(open_, scores[i], 0.0)
  weights = np.asarray([weight_at(c.weight, step) for c in spec.components], np.float64)
  rewards = (weights[:, None] * gated).sum(0) if k else np.zeros(n)
  return rewards.astype(np.float32), passed


def reward_summary(rewards) -> dict[str, float]:
  """reward/mean, /std (population), /min, /max of rewards [N], with exactly rounded sums
  (math.fsum in float64): the same figures however the rows are split (over processes, or
  scored in one call or several)."""
  r = np.asarray(rewards, np.float64).reshape(-1)
  mean = math.fsum(r.tolist()) / r.size
  return {"reward/mean": mean, "reward/std": math.sqrt(math.fsum(((r - mean) ** 2).tolist()) / r.size),
          "reward/min": float(r.min()), "reward/max": float(r.max())}


def batch_metrics(spec: RewardSpec, rewards: np.ndarray, scores: np.ndarray, passed: np.ndarray,
                  infos: Sequence[Sequence[Mapping[str, Any] | None]], step: int) -> dict[str, float]:
  """reward/* and info/* metrics of a batch (the pool adds verifier/*)."""
  m: dict[str, float] = {}
  n = rewards.shape[0]
  if n == 0:
    return m
  m.update(reward_summary(rewards))
  acc = spec.accuracy_index()
  if np.isin(scores[acc], (0.0, 1.0)).all():
    # A pass rate only means something for a pass/fail score; a continuous one (a fraction, a
    # similarity) would read as "accuracy" 1.0 whenever it is above 0.
    m["reward/accuracy"] = float(passed[acc].mean())
  for i, c in enumerate(spec.components):
    m[f"reward/{c.name}_mean"] = float(scores[i].mean())
    m[f"reward/{c.name}_pass"] = float(passed[i].mean())
    if not isinstance(c.weight, (int, float)):
      m[f"reward/{c.name}_weight"] = weight_at(c.weight, step)
    sums: dict[str, list[float]] = {}
    for info in infos[i]:
      if not info:
        continue
      for key, value in info.items():
        number = _metric_value(value)
        if number is not None:
          sums.setdefault(key, []).append(number)
    for key, values in sums.items():
      m[f"info/{c.name}/{key}"] = float(np.mean(values))
  return m


def _metric_value(value: Any) -> float | None:
  """A finite float from a numeric info value, else None (never raises: one item's
  metadata must not fail a training step)."""
  if not isinstance(value, (bool, int, float, np.number)) or isinstance(value, np.complexfloating):
    return None
  try:
    number = float(value)
  except (TypeError, ValueError, OverflowError):
    return None
  return number if math.isfinite(number) else None

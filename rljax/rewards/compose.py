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
    applies: name -> [N] bool, whether the component scores the item (its source is one the
      component covers; rljax/rewards/routing.py). Scores of items it does not score are 0.
    metric_rows: metric name -> the number of items its figure is a mean over (metrics not
      listed are over all N): how per-process figures combine (rewards/callback.py).
  """
  rewards: np.ndarray
  components: dict[str, np.ndarray]
  metrics: dict[str, float]
  errors: list[str]
  answers: list[str | None] = dataclasses.field(default_factory=list)
  failed: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  infos: dict[str, list[dict | None]] = dataclasses.field(default_factory=dict)
  applies: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
  metric_rows: dict[str, int] = dataclasses.field(default_factory=dict)

  def components_matrix(self) -> np.ndarray:
    """[N, K] float32 raw component scores in spec order."""
    cols = list(self.components.values())
    if not cols:
      return np.zeros((self.rewards.shape[0], 0), np.float32)
    return np.stack(cols, axis=1).astype(np.float32)


def combine(spec: RewardSpec, scores: np.ndarray, failed: np.ndarray, step: int,
            applies: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Weighted, gated sum of component scores.

  Args:
    scores: [K, N] raw scores (fallback already applied where failed).
    failed: [K, N] bool.
    applies: [K, N] bool, whether component k scores item n (default: all); an item a component
      does not score adds nothing to its reward and never passes it.
  Returns:
    rewards [N] float32 and passed [K, N] bool, where an item passes component k when k scores
    it, its score is > 0, the verifier did not fail, and k's own gate (if any) passed.
  """
  k, n = scores.shape
  applies = np.ones((k, n), bool) if applies is None else applies
  index = {c.name: i for i, c in enumerate(spec.components)}
  passed = np.zeros((k, n), bool)
  gated = np.zeros((k, n), np.float64)
  for i in spec.gate_order():
    c = spec.components[i]
    open_ = applies[i] if c.gate is None else applies[i] & passed[index[c.gate]]
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


def accuracy_components(spec: RewardSpec, applies: np.ndarray) -> np.ndarray:
  """[N] int: the component whose pass rate is each item's accuracy (-1: none scores the item).

  The component flagged `accuracy: True` where it scores the item, else the first component that
  does (without routing: the flagged one, or the first).
  """
  k, n = applies.shape
  flagged = [i for i, c in enumerate(spec.components) if c.accuracy]
  order = flagged + [i for i in range(k) if i not in flagged]
  out = np.full(n, -1, np.int64)
  for i in reversed(order):
    out = np.where(applies[i], i, out)
  return out


def _accuracy(scores: np.ndarray, passed: np.ndarray, acc: np.ndarray, rows: np.ndarray) -> tuple[float, int] | None:
  """(pass rate, items) of the items `rows` [N] bool under their accuracy components, or None when
  an accuracy score is not pass/fail: a continuous score (a fraction, a similarity) would read as
  "accuracy" 1.0 whenever it is above 0."""
  rows = rows & (acc >= 0)
  idx = np.nonzero(rows)[0]
  if not idx.size:
    return None
  if not np.isin(scores[acc[idx], idx], (0.0, 1.0)).all():
    return None
  return float(passed[acc[idx], idx].mean()), int(idx.size)


def batch_metrics(spec: RewardSpec, rewards: np.ndarray, scores: np.ndarray, passed: np.ndarray,
                  infos: Sequence[Sequence[Mapping[str, Any] | None]], step: int, applies: np.ndarray | None = None,
                  labels: Sequence[str | None] | None = None, rows: dict[str, int] | None = None) -> dict[str, float]:
  """reward/* and info/* metrics of a batch (the pool adds verifier/*).

  A component's figures are over the items it scores (`applies` [K, N]; it has none in a batch
  where it scores no item). With source `labels` [N], reward/source/<label>/mean and /accuracy
  are over each source's items. `rows`, when given, receives the number of items behind each mean
  that is not over all N (for combining processes' figures).
  """
  m: dict[str, float] = {}
  rows = {} if rows is None else rows
  n = rewards.shape[0]
  if n == 0:
    return m
  applies = np.ones(scores.shape, bool) if applies is None else applies
  m.update(reward_summary(rewards))
  acc = accuracy_components(spec, applies)
  everything = np.ones(n, bool)
  overall = _accuracy(scores, passed, acc, everything)
  if overall is not None:
    m["reward/accuracy"], rows["reward/accuracy"] = overall
  for i, c in enumerate(spec.components):
    mine = applies[i]
    count = int(mine.sum())
    if count:
      m[f"reward/{c.name}_mean"] = float(scores[i][mine].mean())
      m[f"reward/{c.name}_pass"] = float(passed[i][mine].mean())
      if count < n:
        rows[f"reward/{c.name}_mean"] = rows[f"reward/{c.name}_pass"] = count
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
      rows[f"info/{c.name}/{key}"] = len(values)
  if labels is not None:
    labels_arr = np.asarray([label if label is not None else "" for label in labels], object)
    for label in sorted({label for label in labels if label is not None}):
      mine = labels_arr == label
      key = f"reward/source/{label}/"
      m[key + "mean"] = float(math.fsum(rewards[mine].astype(np.float64).tolist()) / mine.sum())
      rows[key + "mean"] = int(mine.sum())
      per = _accuracy(scores, passed, acc, mine)
      if per is not None:
        m[key + "accuracy"], rows[key + "accuracy"] = per
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

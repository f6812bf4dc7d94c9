"""Reward metrics of rows scored in several calls: the rounds of one step on one process (a step's
device callbacks that reached the host at different times), and the processes of a run.

A summary is what one scoring call contributes, JSON-able: {"n": rows, "rewards": [n] floats,
"metrics": the pool's metrics, "rows": metric -> the rows its figure is a mean over (absent: n)}.
Combining summaries gives the figures one call over all their rows would give: reward/mean, /std,
/min, /max exact (math.fsum over every reward), counts summed, other means weighted by their rows.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.rewards.compose import RewardBatch, reward_summary

SUMMED = ("verifier/timeouts", "verifier/errors", "verifier/crashes", "verifier/deadline_misses",
          "verifier/restarts", "verifier/recycles", "verifier/info_errors", "verifier/import_timeouts",
          "verifier/failures")


def summary(batch: RewardBatch | None, rewards: np.ndarray | None) -> dict:
  """The summary of one scoring call (module doc); n = 0 without one."""
  if batch is None or rewards is None:
    return {"n": 0, "rewards": [], "metrics": {}, "rows": {}}
  r = np.asarray(rewards, np.float64).reshape(-1)
  return {"n": int(r.size), "rewards": r.tolist(), "metrics": {k: float(v) for k, v in batch.metrics.items()},
          "rows": {k: int(v) for k, v in batch.metric_rows.items()}}


def merge(parts: Sequence[Mapping[str, Any]], seconds: str = "sum") -> dict:
  """One summary of the rows of `parts` (module doc). verifier/seconds: the parts' sum (calls one
  after another: the rounds of a step) or their max (`seconds="max"`: processes side by side)."""
  parts = [p for p in parts if p.get("n", 0) > 0]
  if not parts:
    return {"n": 0, "rewards": [], "metrics": {}, "rows": {}}
  n = sum(p["n"] for p in parts)
  metrics: dict[str, float] = {}
  rows: dict[str, int] = {}
  for key in sorted({k for p in parts for k in p["metrics"]}):
    have = [p for p in parts if key in p["metrics"]]
    values = [p["metrics"][key] for p in have]
    if key in SUMMED:
      metrics[key] = float(sum(values))
    elif key == "verifier/seconds":
      metrics[key] = float(max(values) if seconds == "max" else sum(values))
    elif key == "verifier/items_per_s":
      continue   # from the merged seconds, below
    else:
      weights = [p.get("rows", {}).get(key, p["n"]) for p in have]
      metrics[key] = float(math.fsum(w * v for w, v in zip(weights, values)) / max(sum(weights), 1))
      if sum(weights) != n:
        rows[key] = int(sum(weights))
  if "verifier/seconds" in metrics:
    metrics["verifier/items_per_s"] = n / metrics["verifier/seconds"] if metrics["verifier/seconds"] > 0 else 0.0
  rewards = [r for p in parts for r in p["rewards"]]
  metrics.update(reward_summary(np.asarray(rewards, np.float64)))
  return {"n": n, "rewards": rewards, "metrics": metrics, "rows": rows}


def combine_process_metrics(parts: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """Global reward metrics from per-process summaries (module doc), plus verifier/items (rows
  scored, all processes) and verifier/scoring_processes (processes that scored a row)."""
  scoring = [p for p in parts if p.get("n", 0) > 0]
  if not scoring:
    return {}
  merged = merge(scoring, seconds="max")
  out = dict(merged["metrics"])
  out["verifier/items"] = float(merged["n"])
  out["verifier/scoring_processes"] = float(len(scoring))
  return out


def merge_batches(parts: Sequence[tuple[RewardBatch, np.ndarray, np.ndarray]]) -> tuple[RewardBatch, np.ndarray]:
  """(the RewardBatch of every row of `parts`, their global row indices), rows sorted, from the
  (batch, rows, rewards) of several scoring calls with disjoint rows; its metrics are `merge`'s."""
  if len(parts) == 1:
    return parts[0][0], parts[0][1]
  rows = np.concatenate([p[1] for p in parts])
  order = np.argsort(rows, kind="stable")
  cat = lambda xs: np.concatenate(xs)[order]   # noqa: E731
  pick = lambda xs: [x for part in xs for x in part]   # noqa: E731
  batches = [p[0] for p in parts]
  names = list(batches[0].components)
  flat = lambda get: [pick([get(b) for b in batches])[i] for i in order]   # noqa: E731
  merged = merge([summary(b, r) for b, _, r in parts])
  out = RewardBatch(
      rewards=cat([b.rewards for b in batches]).astype(np.float32),
      components={k: cat([b.components[k] for b in batches]) for k in names},
      metrics=merged["metrics"], errors=pick([b.errors for b in batches])[:20],
      answers=flat(lambda b: b.answers),
      failed={k: cat([b.failed[k] for b in batches]) for k in names if all(k in b.failed for b in batches)},
      infos={k: flat(lambda b, k=k: b.infos[k]) for k in names if all(k in b.infos for b in batches)},
      applies={k: cat([b.applies[k] for b in batches]) for k in names if all(k in b.applies for b in batches)},
      metric_rows=merged["rows"])
  return out, rows[order]

"""Metric sinks: a JSONL file (one object per step) and TensorBoard event files."""
from __future__ import annotations

import json
import math
import os
from typing import Mapping

import numpy as np


def to_floats(metrics: Mapping, prefix: str = "") -> dict[str, float]:
  """Flattens nested dicts and small arrays into {name: float}."""
  out: dict[str, float] = {}
  for k, v in metrics.items():
    name = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(to_floats(v, name + "/"))
      continue
    arr = np.asarray(v)
    if arr.ndim == 0:
      out[name] = float(arr)
    else:
      for i, x in enumerate(arr.reshape(-1)):
        out[f"{name}/{i}"] = float(x)
  return out


def _tensorboard_tag(name: str) -> str:
  """TensorBoard tags allow [A-Za-z0-9_./-]; `eval/pass@8` becomes `eval/pass_at_8`."""
  return name.replace("@", "_at_")


class MetricsWriter:
  """Appends each step's metrics to `metrics.jsonl` and (optionally) TensorBoard under `tb/`.

  Only the writing process (process 0 of a multi-process run) opens files; the others' writes
  are no-ops, since every process computes the same global metrics.

  `start_step`: the step the run starts from (0 fresh, N when resumed from the checkpoint of
  step N). The rows an earlier attempt wrote for steps this run writes again are dropped from
  metrics.jsonl, and TensorBoard is told to purge them (SummaryWriter's `purge_step`), so every
  step has one row. None (the default) appends without purging.
  """

  def __init__(self, directory: str, tensorboard: bool = True, writing: bool = True,
               start_step: int | None = None):
    self.path = os.path.join(directory, "metrics.jsonl")
    self._file = None
    self._tb = None
    if not writing:
      return
    os.makedirs(directory, exist_ok=True)
    purge_step = None
    if start_step is not None:
      from rljax.trainer.rundir import metrics_purge_step, purge_metrics
      purge_step = metrics_purge_step(start_step)
      purge_metrics(self.path, purge_step)
    self._file = open(self.path, "a", encoding="utf-8")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(directory, "tb"), purge_step=purge_step)

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if self._file is None:
      return
    clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
    self._file.write(json.dumps({"step": step, **clean}) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in metrics.items():
        if math.isfinite(v):
          self._tb.add_scalar(_tensorboard_tag(k), v, step)
      self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()

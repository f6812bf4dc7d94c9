"""Metric sinks: a JSONL file (one object per step), TensorBoard event files, and optionally
Weights & Biases (config.output.wandb; the `wandb` package is an optional extra)."""
from __future__ import annotations

import json
import math
import os
import uuid
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

  `wandb`: config.output.wandb as a dict (project, name, entity, mode); with a project, every
  row also goes to a W&B run kept under `<directory>/wandb`, whose id is saved in
  `<directory>/wandb_run_id` so that a resumed run continues the same W&B run. `config`: the
  run's config, recorded with it.
  """

  def __init__(self, directory: str, tensorboard: bool = True, writing: bool = True,
               start_step: int | None = None, wandb: dict | None = None, config: dict | None = None):
    self.path = os.path.join(directory, "metrics.jsonl")
    self._file = None
    self._tb = None
    self._wandb = None
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
    if wandb and wandb.get("project"):
      self._wandb = _wandb_run(directory, wandb, config)

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
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None


WANDB_ID_FILE = "wandb_run_id"


def _wandb_run(directory: str, settings: dict, config: dict | None):
  """A W&B run for `directory`: the one its earlier attempts logged to (same id), or a new one."""
  try:
    import wandb
  except ImportError:
    from rljax.errors import ConfigError
    raise ConfigError("config.output.wandb.project is set, but the wandb package is not installed: pip install "
                      "wandb (or 'rljax[wandb]'), or set output.wandb.project=''.") from None
  id_path = os.path.join(directory, WANDB_ID_FILE)
  try:
    with open(id_path, encoding="utf-8") as f:
      run_id = f.read().strip()
  except OSError:
    run_id = ""
  if not run_id:
    run_id = uuid.uuid4().hex[:12]
    with open(id_path, "w", encoding="utf-8") as f:
      f.write(run_id + "\n")
  return wandb.init(project=settings["project"], entity=settings.get("entity") or None,
                    name=settings.get("name") or os.path.basename(os.path.abspath(directory)),
                    mode=settings.get("mode", "online"), dir=directory, id=run_id, resume="allow", config=config)

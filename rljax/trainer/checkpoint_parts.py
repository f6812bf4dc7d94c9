"""The parts of rljax/trainer/checkpoint.py that are not the Checkpointer: its errors, the
retention policy (keep the last N and the best by a metric), the JSON hygiene of extras and
metrics, and pytree naming."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from rljax.errors import RljaxError


class CheckpointError(RljaxError):
  """A checkpoint directory is missing, empty, foreign, or does not match what is restored."""


class CheckpointUnreadable(CheckpointError):
  """A checkpoint's files cannot be read (truncated, corrupt): an earlier step may still be."""


# ---- retention -------------------------------------------------------------------------------


def metric_value(metrics: Any, name: str | None) -> float | None:
  """The finite numeric value of `metrics[name]`, or None (then the step is no candidate for best)."""
  if name is None or not isinstance(metrics, Mapping):
    return None
  value = metrics.get(name)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    return None
  value = float(value)
  return value if math.isfinite(value) else None


@dataclasses.dataclass
class KeepLastAndBest:
  """Orbax preservation policy: the `keep_last` highest steps, the `keep_best` best by a metric,
  and always the checkpoint just saved (orbax appends it last)."""
  keep_last: int
  keep_best: int
  best_metric: str | None
  best_mode: str

  def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
    del context
    n = len(checkpoints)
    keep = set(sorted(range(n), key=lambda i: checkpoints[i].step)[max(n - self.keep_last, 0):])
    if n:
      keep.add(n - 1)
    scored = [(v, checkpoints[i].step, i) for i in range(n)
              if (v := metric_value(checkpoints[i].metrics, self.best_metric)) is not None]
    if self.keep_best and scored:
      sign = 1.0 if self.best_mode == "max" else -1.0
      # Best first; ties go to the later step.
      scored.sort(key=lambda t: (sign * t[0], t[1]), reverse=True)
      keep.update(i for _, _, i in scored[:self.keep_best])
    return [i in keep for i in range(n)]

  def best_step(self, metrics_by_step: Mapping[int, Any]) -> int | None:
    scored = [(v, step) for step, m in metrics_by_step.items()
              if (v := metric_value(m, self.best_metric)) is not None]
    if not scored:
      return None
    sign = 1.0 if self.best_mode == "max" else -1.0
    return max(scored, key=lambda t: (sign * t[0], t[1]))[1]


# ---- JSON hygiene ----------------------------------------------------------------------------


def to_json(value: Any, where: str) -> Any:
  """A deep copy of `value` made of JSON types (numpy/jax scalars become Python numbers).

  Copying also means the caller may mutate its dicts while an async save is still writing.
  """
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic, jax.Array)) and np.ndim(value) == 0:
    return to_json(np.asarray(value).item(), where)
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      if not isinstance(k, str):
        raise CheckpointError(f"{where}: key {k!r} is a {type(k).__name__}; checkpoint extras and metrics are "
                              "stored as JSON, whose keys must be strings. Convert the key with str().")
      out[k] = to_json(v, f"{where}[{k!r}]")
    return out
  if isinstance(value, (list, tuple)):
    return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
  raise CheckpointError(f"{where} is a {type(value).__name__}, which JSON cannot store; checkpoint extras and "
                        "metrics must be dicts, lists, strings, numbers, booleans or None (arrays belong in the "
                        "TrainState).")


# ---- pytree helpers --------------------------------------------------------------------------


def _key_str(k) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def leaves_by_path(tree) -> dict[str, Any]:
  """{"params.layers.attn.q_kernel": leaf, ...} with the dotted names orbax uses on disk."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {".".join(_key_str(k) for k in path): leaf for path, leaf in flat}


def as_abstract(tree, default_sharding=None):
  """ShapeDtypeStructs (with a sharding) for every leaf of `tree` (arrays or ShapeDtypeStructs)."""
  def one(x):
    sharding = getattr(x, "sharding", None) or default_sharding
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
  return jax.tree.map(one, tree)


def first_line(e: BaseException, limit: int = 300) -> str:
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  return text[:limit] + ("..." if len(text) > limit else "")


def sample_names(names: Sequence[str], limit: int = 6) -> str:
  names = sorted(names)
  more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more

"""Reward configuration: components, weights and their schedules, runtime limits.

    RewardSpec.from_dict({
        "components": [
            {"name": "correct", "verifier": "math", "weight": 1.0},
            {"name": "short", "verifier": "my_pkg.rewards:brevity", "weight": 0.1, "gate": "correct"},
            {"name": "fmt", "verifier": "format",
             "weight": {"type": "linear", "init": 0.2, "end": 0.0, "end_step": 500}},
        ],
        "timeout_s": 5.0, "num_workers": 2})

The total reward of item i at step s is  sum_k weight_k(s) * gate_k[i] * score_k[i],
where gate_k[i] is 1 when component k has no gate, else whether the gate component
passed on item i (score > 0, and the verifier did not fail).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

from rljax.errors import ConfigError
from rljax.rewards import graph, routing

WeightLike = float | int | Mapping[str, Any] | Callable[[int], float]
SANDBOX_DEFAULTS = {"require_isolation": False}
_MAX_SECONDS = 86400.0  # time limits above a day are a mistake (and inf would overflow the pool's deadlines)

_SCHEDULE_FIELDS = {
    "constant": {"type", "value"},
    "linear": {"type", "init", "end", "begin_step", "end_step"},
    "piecewise": {"type", "boundaries", "values"},
}


def _check_schedule(weight: Any, where: str) -> None:
  if isinstance(weight, bool):
    raise ConfigError(f"{where}.weight must be a number or a schedule dict, got a bool.")
  if isinstance(weight, (int, float)):
    if not math.isfinite(weight):
      raise ConfigError(f"{where}.weight must be finite, got {weight}.")
    return
  if callable(weight):
    return
  if not isinstance(weight, Mapping):
    raise ConfigError(f"{where}.weight must be a number, a schedule dict or a callable step -> weight; "
                      f"got {type(weight).__name__}.")
  kind = weight.get("type")
  if kind not in _SCHEDULE_FIELDS:
    raise ConfigError(f"{where}.weight.type must be one of {sorted(_SCHEDULE_FIELDS)}, got {kind!r}.")
  unknown = set(weight) - _SCHEDULE_FIELDS[kind]
  if unknown:
    raise ConfigError(f"{where}.weight: unknown field(s) {sorted(unknown)} for a '{kind}' schedule; "
                      f"known fields are {sorted(_SCHEDULE_FIELDS[kind])}.")
  if kind == "constant" and "value" not in weight:
    raise ConfigError(f"{where}.weight: a constant schedule needs 'value'.")
  if kind == "linear":
    for key in ("init", "end", "end_step"):
      if key not in weight:
        raise ConfigError(f"{where}.weight: a linear schedule needs '{key}' "
                          "(fields: init, end, begin_step=0, end_step).")
    if weight["end_step"] <= weight.get("begin_step", 0):
      raise ConfigError(f"{where}.weight: linear schedule end_step must be > begin_step.")
  if kind == "piecewise":
    b, v = list(weight.get("boundaries", [])), list(weight.get("values", []))
    if len(v) != len(b) + 1:
      raise ConfigError(f"{where}.weight: a piecewise schedule needs len(values) == len(boundaries) + 1, "
                        f"got {len(v)} values and {len(b)} boundaries.")
    if b != sorted(b):
      raise ConfigError(f"{where}.weight: piecewise boundaries must be increasing, got {b}.")


def weight_at(weight: WeightLike, step: int) -> float:
  """The value of a weight (a number, a schedule dict or a callable) at `step`."""
  if isinstance(weight, (int, float)):
    return float(weight)
  if callable(weight):
    return float(weight(step))
  kind = weight["type"]
  if kind == "constant":
    return float(weight["value"])
  if kind == "linear":
    begin, end_step = weight.get("begin_step", 0), weight["end_step"]
    frac = min(max((step - begin) / (end_step - begin), 0.0), 1.0)
    return float(weight["init"] + frac * (weight["end"] - weight["init"]))
  # piecewise: values[i] applies for boundaries[i-1] <= step < boundaries[i]
  idx = sum(step >= b for b in weight["boundaries"])
  return float(weight["values"][idx])


@dataclasses.dataclass
class ComponentSpec:
  """One named reward component.

  Attributes:
    name: the key of its scores and metrics (reward/<name>_mean).
    verifier: a registered name, an import path 'module:function', or a callable.
    weight: a number, a schedule dict ({"type": "constant"|"linear"|"piecewise", ...})
      or a callable step -> weight.
    gate: the name of another component; this one counts only where that one passed.
    kwargs: keyword arguments passed to the verifier.
    fallback: the score when the verifier times out, raises or crashes (default: the
      spec's fallback).
    accuracy: marks the component whose pass rate is reported as reward/accuracy
      (default: the first component that scores the row's source).
    sources: the data source labels whose rows this component scores (None: every source);
      other rows are not applicable to it (rljax/rewards/routing.py).
    model: the path of a Hugging Face *ForSequenceClassification checkpoint: a reward model
      scored in the compiled step (rljax/rewards/graph.py); instead of `verifier`.
    judge: the path of a causal LM checkpoint: a generative judge scored in the compiled step
      (its probability of the `yes` tokens after `template`); instead of `verifier`.
    template: a judge's question (a format string with {completion}, and {prompt}, {answer} or
      other example fields), or a reward model's user message (default: the example's messages).
  """
  name: str
  verifier: Any = None
  weight: WeightLike = 1.0
  gate: str | None = None
  kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
  fallback: float | None = None
  accuracy: bool = False
  sources: list[str] | None = None
  model: str | None = None
  judge: str | None = None
  template: str | None = None

  @property
  def in_graph(self) -> bool:
    """Scored in the compiled step (a reward model or a judge), not by the verifier pool."""
    return self.model is not None or self.judge is not None

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], index: int = 0) -> ComponentSpec:
    known = {f.name for f in dataclasses.fields(cls)}
    where = f"rewards.components[{index}]"
    if not isinstance(d, Mapping):
      raise ConfigError(f"{where} must be a dict with at least 'name' and 'verifier', got {type(d).__name__}.")
    unknown = set(d) - known
    if unknown:
      raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known fields are {sorted(known)}.")
    if "name" not in d:
      raise ConfigError(f"{where} is missing 'name'.")
    if all(d.get(key) is None for key in ("verifier", "model", "judge")):
      raise ConfigError(f"{where} is missing 'verifier' (or 'model': a reward model, or 'judge': a generative "
                        "judge).")
    d = dict(d)
    d["kwargs"] = dict(d.get("kwargs") or {})
    if isinstance(d.get("sources"), (tuple, list)):
      d["sources"] = list(d["sources"])
    return cls(**d)


@dataclasses.dataclass
class RewardSpec:
  """The reward function of a run and the limits of its verifier runtime.

  Attributes:
    components: ComponentSpec objects or dicts (see ComponentSpec).
    timeout_s: per-item time limit of a verifier call (a group or batch call gets
      timeout_s times its number of items).
    batch_deadline_s: wall-clock limit of one `score` call; unfinished items get the fallback.
    fallback: score of a component whose verifier failed on an item.
    num_workers: worker processes; 0 runs verifiers in the calling process (no
      isolation, no timeouts: for debugging only).
    max_memory_mb: address-space limit of each worker process (RLIMIT_AS).
    max_logged_errors: error messages logged per pool (later ones are only counted).
    sandbox: options of the code sandbox (rljax/rewards/sandbox.py): require_isolation=True
      makes a pool whose verifiers run model code refuse to start where the sandbox cannot
      isolate it (no namespaces and no root); by default it only warns, once, loudly.
    source_verifiers: {source label: verifier} of the run's data sources, in order (from
      data.sources[i].verifier; not a rewards config field): what `by_source` components call and
      what the routing checks read (rljax/rewards/routing.py). Empty: no routing information.
  """
  components: list[Any] = dataclasses.field(default_factory=list)
  timeout_s: float = 5.0
  batch_deadline_s: float = 60.0
  fallback: float = 0.0
  num_workers: int = 2
  max_memory_mb: int = 2048
  max_logged_errors: int = 10
  sandbox: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(SANDBOX_DEFAULTS))
  source_verifiers: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if isinstance(self.components, Mapping) or not isinstance(self.components, Sequence):
      raise ConfigError("rewards.components must be a list of component dicts, got "
                        f"{type(self.components).__name__}.")
    self.components = [c if isinstance(c, ComponentSpec) else ComponentSpec.from_dict(c, i)
                       for i, c in enumerate(self.components)]
    if self.sandbox is None:
      self.sandbox = {}
    if isinstance(self.sandbox, Mapping):
      self.sandbox = {**SANDBOX_DEFAULTS, **self.sandbox}
    self.source_verifiers = dict(self.source_verifiers or {})

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], source_verifiers: Mapping[str, Any] | None = None) -> RewardSpec:
    """Builds and validates a spec from a plain dict (e.g. ConfigDict.to_dict()).

    source_verifiers: {label: verifier} of the data sources (`routing.source_verifiers_from_data`).
    """
    if not isinstance(d, Mapping):
      raise ConfigError(f"rewards config must be a dict, got {type(d).__name__}.")
    known = {f.name for f in dataclasses.fields(cls)} - {"source_verifiers"}
    unknown = set(d) - known
    if unknown:
      raise ConfigError(f"rewards: unknown field(s) {sorted(unknown)}; known fields are {sorted(known)}.")
    spec = cls(**dict(d), source_verifiers=dict(source_verifiers or {}))
    spec.validate()
    return spec

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["components"] = [dataclasses.asdict(c) for c in self.components]
    return out

  @property
  def component_names(self) -> list[str]:
    return [c.name for c in self.components]

  @property
  def graph_components(self) -> list[ComponentSpec]:
    """The components scored in the compiled step (reward models and judges), in spec order."""
    return [c for c in self.components if c.in_graph]

  def accuracy_index(self) -> int:
    flagged = [i for i, c in enumerate(self.components) if c.accuracy]
    return flagged[0] if flagged else 0

  def routes(self) -> list[routing.Route]:
    """The verifiers the components call and the rows each scores (rljax/rewards/routing.py);
    raises ConfigError for an unknown verifier."""
    return routing.routes(self)

  def validate(self) -> None:
    """Checks every field; raises ConfigError naming the field and the fix."""
    if not self.components:
      raise ConfigError("rewards.components is empty; add at least one, e.g. "
                        "{'name': 'correct', 'verifier': 'math', 'weight': 1.0}.")
    for key in ("timeout_s", "batch_deadline_s"):
      value = getattr(self, key)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < _MAX_SECONDS:
        raise ConfigError(f"rewards.{key} must be a positive, finite number of seconds (at most a day), got "
                          f"{value!r}.")
    if isinstance(self.fallback, bool) or not isinstance(self.fallback, (int, float)) or not math.isfinite(
        self.fallback):
      raise ConfigError(f"rewards.fallback must be a finite number, got {self.fallback!r}.")
    if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
      raise ConfigError(f"rewards.num_workers must be an int >= 0 (0 = in-process), got {self.num_workers!r}.")
    if isinstance(self.max_memory_mb, bool) or not isinstance(self.max_memory_mb, int) or self.max_memory_mb < 256:
      raise ConfigError(f"rewards.max_memory_mb must be an int >= 256, got {self.max_memory_mb!r}.")
    if not isinstance(self.sandbox, Mapping):
      raise ConfigError(f"rewards.sandbox must be a dict, got {type(self.sandbox).__name__}.")
    unknown = set(self.sandbox) - set(SANDBOX_DEFAULTS)
    if unknown:
      raise ConfigError(f"rewards.sandbox: unknown field(s) {sorted(unknown)}; known fields are "
                        f"{sorted(SANDBOX_DEFAULTS)}.")
    if not isinstance(self.sandbox["require_isolation"], bool):
      raise ConfigError(f"rewards.sandbox.require_isolation must be a bool, got "
                        f"{self.sandbox['require_isolation']!r}.")
    names = [c.name for c in self.components]
    for i, c in enumerate(self.components):
      where = f"rewards.components[{i}]"
      if not isinstance(c.name, str) or not c.name or "/" in c.name:
        raise ConfigError(f"{where}.name must be a non-empty string without '/', got {c.name!r}.")
      if names.count(c.name) > 1:
        raise ConfigError(f"{where}.name '{c.name}' is used by more than one component; names must be unique.")
      _check_schedule(c.weight, f"{where} ('{c.name}')")
      if c.gate is not None and c.gate not in names:
        raise ConfigError(f"{where}.gate '{c.gate}' is not a component name; use one of {names}.")
      if c.gate == c.name:
        raise ConfigError(f"{where}.gate: component '{c.name}' cannot gate itself.")
      if c.fallback is not None and (isinstance(c.fallback, bool) or not isinstance(c.fallback, (int, float))):
        raise ConfigError(f"{where}.fallback must be a number or None, got {c.fallback!r}.")
      if not isinstance(c.kwargs, Mapping):
        raise ConfigError(f"{where}.kwargs must be a dict, got {type(c.kwargs).__name__}.")
      if c.in_graph:
        graph.check_component(c, f"{where} ('{c.name}')")
      elif c.template is not None:
        raise ConfigError(f"{where} ('{c.name}').template is for reward models and judges (model= or judge=); a "
                          "verifier takes its options in kwargs.")
    self.gate_order()
    if sum(bool(c.accuracy) for c in self.components) > 1:
      raise ConfigError("rewards.components: more than one component has accuracy=True; flag at most one.")
    routing.check_spec(self)
    for r in self.routes():
      c = self.components[r.component]
      where = f"rewards.components[{r.component}] ('{c.name}')"
      if c.verifier == routing.BY_SOURCE:
        where += f" (verifier {r.verifier.name!r} of sources {sorted(r.labels)})"
      v = r.verifier
      v.check_kwargs(c.kwargs, f"{where}.kwargs")
      v.check_signature(c.kwargs, where)
      check = getattr(v.fn, "check_config", None)
      if callable(check):
        try:
          check(**c.kwargs)
        except (TypeError, ValueError) as e:
          raise ConfigError(f"{where}.kwargs: {e}") from None
    routing.check_sources_scored(self)

  def gate_order(self) -> list[int]:
    """Component indices with every gate before the components it gates (ConfigError on a cycle)."""
    index = {c.name: i for i, c in enumerate(self.components)}
    order: list[int] = []
    state: dict[int, int] = {}

    def visit(i: int, chain: list[str]) -> None:
      if state.get(i) == 2:
        return
      if state.get(i) == 1:
        raise ConfigError(f"rewards.components: gates form a cycle: {' -> '.join(chain)}; remove one gate.")
      state[i] = 1
      gate = self.components[i].gate
      if gate is not None:
        visit(index[gate], chain + [gate])
      state[i] = 2
      order.append(i)

    for i, c in enumerate(self.components):
      visit(i, [c.name])
    return order

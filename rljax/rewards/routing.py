"""Which component scores which rows: routing by data source.

A run's data sources each name a verifier (`data.sources[i].verifier`: a registered name, an
import path 'module:function', or "none"). A reward component either

  * names a verifier itself (`verifier: "math"`), and scores the rows of every source, or of the
    sources it lists (`sources: [label, ...]`); or
  * routes by source (`verifier: "by_source"`): each row is scored by the verifier its source names
    (rows of sources whose verifier is "none", or that the component's `sources` leaves out, are not
    scored by it).

A row a component does not score is *not applicable* to it: the component adds nothing to that
row's reward, and the row counts neither in the component's metrics nor in its pass rate.

`RewardSpec.routes()` expands the components into `Route`s, one per verifier a component calls
(a `by_source` component has one per distinct verifier of the sources it covers); the pool runs
each route on the rows its labels select (`route_rows`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.errors import ConfigError
from rljax.rewards.base import Verifier, get_verifier

BY_SOURCE = "by_source"     # component verifier: each row's source names its verifier
NO_VERIFIER = "none"        # source verifier: no by_source component scores this source's rows


@dataclasses.dataclass(frozen=True)
class Route:
  """One verifier a component calls: on the rows whose source label is in `labels` (None: every row)."""
  component: int
  verifier: Verifier
  kwargs: Mapping[str, Any]
  labels: frozenset[str] | None


def coverage(component) -> frozenset[str] | None:
  """The source labels a component scores (None: every source)."""
  return None if component.sources is None else frozenset(component.sources)


def source_index(source_verifiers: Mapping[str, str], label: str) -> int:
  return list(source_verifiers).index(label)


def where_source(source_verifiers: Mapping[str, str], label: str) -> str:
  """'data.sources[i] ('label')': how errors name a source."""
  return f"data.sources[{source_index(source_verifiers, label)}] ('{label}')"


def routes(spec) -> list[Route]:
  """The routes of every component of `spec` (validated), in component order."""
  out: list[Route] = []
  for k, c in enumerate(spec.components):
    if c.in_graph:   # a reward model or judge: scored in the compiled step
      continue
    cover = coverage(c)
    if c.verifier != BY_SOURCE:
      out.append(Route(k, _resolve(c.verifier, f"rewards.components[{k}] ('{c.name}')"), dict(c.kwargs), cover))
      continue
    by_verifier: dict[Any, set[str]] = {}
    for label, ref in spec.source_verifiers.items():
      if ref != NO_VERIFIER and (cover is None or label in cover):
        by_verifier.setdefault(ref, set()).add(label)
    for ref, labels in by_verifier.items():
      where = f"{where_source(spec.source_verifiers, sorted(labels)[0])}.verifier"
      out.append(Route(k, _resolve(ref, where), dict(c.kwargs), frozenset(labels)))
  return out


def _resolve(ref: Any, where: str) -> Verifier:
  try:
    return get_verifier(ref)
  except ConfigError as e:
    raise ConfigError(f"{where}: {e}") from None


def route_rows(labels: Sequence[str | None], allowed: frozenset[str] | None, name: str) -> np.ndarray:
  """[N] bool: the rows whose source label is in `allowed` (all rows when None).

  Raises ValueError when a row has no source label but the component scores only some sources.
  """
  n = len(labels)
  if allowed is None:
    return np.ones(n, bool)
  missing = [i for i, label in enumerate(labels) if label is None]
  if missing:
    raise ValueError(f"component '{name}' scores only the sources {sorted(allowed)}, but example {missing[0]} has no "
                     "'source' label; pass examples as the data pipeline makes them (Example['source'] is the "
                     "source's label).")
  return np.fromiter((label in allowed for label in labels), bool, n)


def row_labels(examples: Sequence[Any]) -> list[str | None]:
  """The source label of each example (None where it has none)."""
  out = []
  for ex in examples:
    label = ex.get("source") if isinstance(ex, Mapping) else None
    out.append(label if isinstance(label, str) else None)
  return out


# ---- validation ------------------------------------------------------------------------------------


def check_spec(spec) -> None:
  """Routing checks of a spec (ConfigError naming the field and the fix): component `sources`,
  `by_source` without source verifiers, gates that cover fewer sources than what they gate.
  `check_sources_scored` follows once the verifiers themselves are known to be valid."""
  sv = spec.source_verifiers
  if not isinstance(sv, Mapping):
    raise ConfigError(f"rewards source verifiers must be a mapping label -> verifier, got {type(sv).__name__}.")
  for label, ref in sv.items():
    if ref == BY_SOURCE:
      raise ConfigError(f"{where_source(sv, label)}.verifier='{BY_SOURCE}': a source names the verifier that scores "
                        f"it (a registered name, 'module:function', or '{NO_VERIFIER}'); '{BY_SOURCE}' is for "
                        "rewards.components.")
  for k, c in enumerate(spec.components):
    where = f"rewards.components[{k}] ('{c.name}')"
    if c.sources is not None:
      if isinstance(c.sources, str) or not isinstance(c.sources, Sequence) or not c.sources or \
          not all(isinstance(s, str) and s for s in c.sources):
        raise ConfigError(f"{where}.sources must be a non-empty list of data source labels, got {c.sources!r}.")
      if len(set(c.sources)) != len(c.sources):
        raise ConfigError(f"{where}.sources lists a label twice: {list(c.sources)}.")
      unknown = [s for s in c.sources if sv and s not in sv]
      if unknown:
        raise ConfigError(f"{where}.sources: {unknown[0]!r} is not a data source label; the labels are {list(sv)} "
                          "(data.sources[i].label, by default the source's kind).")
    if c.verifier == BY_SOURCE and not sv:
      raise ConfigError(f"{where}.verifier='{BY_SOURCE}' needs the data sources' verifiers: in a run they come from "
                        "data.sources[i].verifier; a RewardSpec built by hand takes "
                        "source_verifiers={'label': 'verifier', ...}.")
    if c.gate is not None:
      gate = next(g for g in spec.components if g.name == c.gate)
      mine, theirs = coverage(c), coverage(gate)
      if theirs is not None and (mine is None or not mine <= theirs):
        left = "every source" if mine is None else sorted(mine - theirs)
        raise ConfigError(f"{where}.gate '{c.gate}' scores only the sources {sorted(theirs)}, so it cannot gate "
                          f"{left}: restrict '{c.name}' with sources: {sorted(theirs)}, or widen '{c.gate}'.")


def _same_verifier(a: Any, b: Any) -> bool:
  if a == b:
    return True
  try:
    return get_verifier(a).fn is get_verifier(b).fn
  except ConfigError:
    return False


def check_sources_scored(spec) -> None:
  """Given the data's source verifiers: every source's verifier scores its rows (a `by_source`
  component, or a component with that verifier, covers the source), and no fixed verifier that is
  one source's verifier scores another source's rows."""
  sv = spec.source_verifiers
  if not sv:
    return
  for label, ref in sv.items():
    if ref != NO_VERIFIER:
      _resolve(ref, f"{where_source(sv, label)}.verifier")
  fixed = [(k, c) for k, c in enumerate(spec.components)
           if not c.in_graph and c.verifier != BY_SOURCE]
  for label, ref in sv.items():
    if ref == NO_VERIFIER:
      continue
    used = False
    for c in spec.components:
      cover = coverage(c)
      if cover is not None and label not in cover:
        continue
      if c.verifier == BY_SOURCE or (not c.in_graph and _same_verifier(c.verifier, ref)):
        used = True
    if not used:
      i = source_index(sv, label)
      names = [c.name for c in spec.components]
      raise ConfigError(
          f"data.sources[{i}].verifier={ref!r} (source '{label}') is not used by any reward component "
          f"(rewards.components: {names}), so no component would score this source's rows with it. Either score "
          f"every source with its own verifier: replace the correctness component by "
          f"{{'name': 'correct', 'verifier': '{BY_SOURCE}'}} in rewards.components; or add a component "
          f"{{'name': ..., 'verifier': {ref!r}, 'sources': [{label!r}]}} (and give the components meant for other "
          f"sources their 'sources'). A source scored only by reward models or judges sets "
          f"data.sources[{i}].verifier='{NO_VERIFIER}'.")
  # A fixed verifier that is some source's route, scoring rows of a source that names another verifier:
  # the silent cross-scoring of a math + code mixture.
  for k, c in fixed:
    owners = [label for label, ref in sv.items() if ref != NO_VERIFIER and _same_verifier(c.verifier, ref)]
    if not owners:
      continue   # format, overlong, ...: meant for every source
    cover = coverage(c)
    for label, ref in sv.items():
      if ref == NO_VERIFIER or label in owners or (cover is not None and label not in cover):
        continue
      raise ConfigError(
          f"rewards.components[{k}] ('{c.name}') scores the rows of {where_source(sv, label)} with verifier "
          f"{c.verifier!r}, the verifier of {where_source(sv, owners[0])}, but {where_source(sv, label)}.verifier="
          f"{ref!r}: those rows would be scored by the wrong verifier. Use verifier '{BY_SOURCE}' (each row scored "
          f"by its source's verifier), or restrict the component with sources: {owners}.")


def source_verifiers_from_data(data_cfg: Any) -> dict[str, str]:
  """{label: verifier} of a data config's sources, in order (rljax.data.config.normalize_config)."""
  from rljax.data.config import normalize_config  # noqa: PLC0415 - the data package is heavier than this module
  return {s["label"]: s["verifier"] for s in normalize_config(data_cfg)["sources"]}

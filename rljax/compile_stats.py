"""What the compiler did: how many programs a run compiled, and where its collectives sit.

    from rljax import compile_stats
    compile_stats.install()                      # once, before the first compile
    ...
    compile_stats.counts()                       # {"compiles": 3.0, "compile_seconds": 41.2}
    compile_stats.num_programs(jitted_step)      # distinct programs one jitted function holds
    compile_stats.loop_collectives(compiled.as_text())   # collectives inside while loops

A jitted function compiles once per distinct input signature (shapes, dtypes, shardings); a
prompt width that changes every step recompiles the whole fused step every step. Logging
`compile/programs` and `compile/total` per step shows that at once.
"""
from __future__ import annotations

import re
import threading
from typing import Any

_LOCK = threading.Lock()
_STATE = {"installed": False, "compiles": 0, "seconds": 0.0}
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast")


def _listener(event: str, duration: float, **kwargs: Any) -> None:
  if event == _COMPILE_EVENT:
    with _LOCK:
      _STATE["compiles"] += 1
      _STATE["seconds"] += float(duration)


def install() -> None:
  """Starts counting XLA compilations of this process (idempotent; a jax.monitoring listener)."""
  import jax
  with _LOCK:
    if _STATE["installed"]:
      return
    _STATE["installed"] = True
  jax.monitoring.register_event_duration_secs_listener(_listener)


def counts() -> dict[str, float]:
  """{"compiles": XLA compilations since install(), "compile_seconds": their total time}."""
  with _LOCK:
    return {"compiles": float(_STATE["compiles"]), "compile_seconds": float(_STATE["seconds"])}


def num_programs(jitted) -> int:
  """How many distinct programs a `jax.jit` function has compiled (its cache size); -1 if unknown."""
  size = getattr(jitted, "_cache_size", None)
  try:
    return int(size()) if callable(size) else -1
  except Exception:  # noqa: BLE001 - a private jax API: report "unknown" rather than fail a step
    return -1


def enable_persistent_cache(cache_dir: str, min_compile_seconds: float = 1.0) -> None:
  """Keeps compiled programs in `cache_dir` across runs (jax's persistent compilation cache).

  A restarted or resumed run with the same shapes then loads its programs instead of compiling
  them (config.compile.cache_dir). Programs that compile faster than `min_compile_seconds`
  are not stored.
  """
  import jax
  jax.config.update("jax_compilation_cache_dir", str(cache_dir))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def loop_collectives(hlo_text: str) -> list[str]:
  """The collective instructions that run inside a while loop of an HLO module (its text).

  `compiled.as_text()` of a jitted function gives the per-device program after partitioning.
  Returns one line per collective found in a while body or condition (directly or in a
  computation they call): "<computation>: <instruction name> <opcode>".
  """
  bodies: dict[str, list[str]] = {}
  name = None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m and not line.startswith(" "):
      name = m.group(1)
      bodies[name] = []
      continue
    if name is not None:
      bodies[name].append(line)
  in_loop: set[str] = set()

  def callees(comp: str) -> set[str]:
    out: set[str] = set()
    for line in bodies.get(comp, ()):
      out.update(_CALLS.findall(line))
      for group in _BRANCHES.findall(line):
        out.update(x.strip().lstrip("%") for x in group.split(","))
    return out

  todo = []
  for comp, lines in bodies.items():
    for line in lines:
      if " while(" in line:
        for key in ("body", "condition"):
          m = re.search(key + r"=%?([\w.\-]+)", line)
          if m:
            todo.append(m.group(1))
  while todo:
    comp = todo.pop()
    if comp in in_loop:
      continue
    in_loop.add(comp)
    todo.extend(callees(comp))
  found = []
  for comp in sorted(in_loop):
    for line in bodies.get(comp, ()):
      m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\S+.*?\s([a-z\-]+)\(", line)
      if m and any(m.group(2).startswith(c) for c in _COLLECTIVES):
        found.append(f"{comp}: {m.group(1)} {m.group(2)}")
  return found

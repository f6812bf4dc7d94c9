"""The registry of rollout modes (config.rollout.mode, docs/rollouts.md): what each mode's runner
can do, declared once. Config validation, the training loop and `rljax plan` read these
declarations instead of comparing mode names.

This module imports nothing heavy (config validation reads it); a mode names its runner class
by import path, loaded when a run starts (`Mode.runner_class`).
"""
from __future__ import annotations

import dataclasses

from rljax.errors import ConfigError
from rljax.imports import import_object


@dataclasses.dataclass(frozen=True)
class Mode:
  """One rollout mode and what its runner supports.

  name: config.rollout.mode.
  runner: "module:Class" of its runner (trainer/rollouts.py, trainer/async_rollouts.py).
  doc: one line for messages and `rljax config`.
  max_staleness: the most versions a trained batch may lag the learner (0: always on-policy;
    None: any bound the config sets).
  default_staleness: the bound when config.rollout.max_staleness = -1.
  exact_phases: time/sample and time/update are the phases' own durations (one program runs
    them in order); in the decoupled modes a phase's time is the wait for it.
  multi_process: runs with jax.process_count() > 1.
  tools: its generation can be multi-turn tool use (config.tools.enabled).
  own_fields: config.rollout fields that only this mode reads (others must leave them at their
    defaults).
  splits_devices: generators and the learner run on separate devices (rollout.generator_devices).
  draws_pool: its producer draws prompts a pool at a time (rollout.oversample x a step's prompts),
    so that in a multi-process run the processes' pools side by side are one process's pool.
  """
  name: str
  runner: str
  doc: str
  max_staleness: int | None
  default_staleness: int
  exact_phases: bool = False
  multi_process: bool = False
  tools: bool = False
  own_fields: tuple[str, ...] = ()
  splits_devices: bool = False
  draws_pool: bool = False

  @property
  def on_policy_only(self) -> bool:
    return self.max_staleness == 0

  def staleness(self, configured: int) -> int:
    """The staleness bound in effect for config.rollout.max_staleness = `configured` (-1: default)."""
    if self.on_policy_only:
      return 0
    return self.default_staleness if configured == -1 else configured

  def runner_class(self):
    """The runner class (imported now: runners import jax and the whole trainer)."""
    return import_object(self.runner, f"the runner of rollout.mode={self.name!r}")


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("fused", "rljax.trainer.rollouts:FusedRollouts",
         "one compiled program per step: sample -> io_callback rewards -> update (exact, on-policy)",
         max_staleness=0, default_staleness=0, exact_phases=True, multi_process=True),
    Mode("pipelined", "rljax.trainer.rollouts:PipelinedRollouts",
         "generation of batch k+1 overlaps scoring and updating batch k (at most one step off-policy)",
         max_staleness=1, default_staleness=1, tools=True, multi_process=True),
    Mode("async", "rljax.trainer.async_rollouts:AsyncRollouts",
         "generator and learner devices apart, batches streamed through bounded queues",
         max_staleness=None, default_staleness=1, own_fields=("generator_devices", "sync_every", "queue_size"),
         splits_devices=True, multi_process=True),
    Mode("partial", "rljax.trainer.rollouts:PartialRollouts",
         "a pool of groups decoded in segments; a step trains the first groups to finish, carries the rest",
         max_staleness=None, default_staleness=1, own_fields=("oversample",), multi_process=True,
         draws_pool=True),
)}


def get(name: str) -> Mode:
  """The mode called `name`; ConfigError naming the field and the choices otherwise."""
  if name not in MODES:
    raise ConfigError(f"config.rollout.mode={name!r} is not one of {tuple(MODES)}.")
  return MODES[name]

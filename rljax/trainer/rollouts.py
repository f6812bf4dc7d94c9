"""How a run schedules generation, scoring and updates: the runners of config.rollout.mode
(docs/rollouts.md; the modes and what each supports: trainer/modes.py).

    fused      one compiled program per step: sample -> io_callback rewards -> update. Exact.
    pipelined  two compiled halves. While the host scores batch k and the device updates on it,
               the device already generates batch k+1 with the parameters before update k
               (one step off-policy), or, with max_staleness=0, only after it (exact). Multi-turn
               tool runs use this mode: their generation alternates compiled decode segments with
               host tool calls, so it cannot live inside one compiled step.
    async      (trainer/async_rollouts.py) the device mesh is split into a generator part and a
               learner part; batches stream through threads and bounded queues.
    partial    the partial producer's pool of groups decoded in segments (rljax/rollout/partial.py);
               a step trains the first groups to finish and carries the rest.

A runner is `step(state, feed) -> (state, StepOutput)`: it takes the train state and the loop's
prompt feed and returns the new state; the loop owns the state, the data position and the
metrics. Every runner makes `Rollout`s with a producer (rljax/rollout: `producer(params, key,
feed) -> (Rollout, RolloutInfo)`), scores them on the host through the same retrying `Scorer`,
and trains them with the one update of trainer/step.py. A runner's `mode` declares what it can do
(trainer/modes.py).

Off-policy batches (staleness > 0) are corrected, not ignored: lp_old is recomputed with the
parameters before the update (decoupled PPO's proximal policy) and the sampler's log-probs,
the behaviour policy, enter through the truncated IS weight min(exp(lp_old - lp_samp), tis_cap).
Batch k is sampled with `rollout_key(state.rng, k)` in every mode, and batches are dealt in the
same order, so at staleness 0 every mode produces the same rollouts and updates.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np

from rljax import sharding as shd
from rljax.errors import ConfigError, RljaxError
from rljax.rewards import summaries
from rljax.rewards.callback import local_indices
from rljax.rollout.partial import PartialProducer
from rljax.rollout.sampler import SamplerProducer
from rljax.rollout.tools import ToolProducer, ToolRollout
from rljax.rollout.types import Rollout, RolloutInfo, by_rows
from rljax.trainer import modes
from rljax.trainer.setup import generate_program, train_step_program, update_program
from rljax.trainer.state import TrainState, rollout_key

log = logging.getLogger("rljax")

SCORE_ATTEMPTS = 3      # a batch is rescored on a fresh reward pool this many times before the run stops


class RolloutError(RljaxError):
  """A rollout thread failed; the message names the cause. The last good checkpoint is kept."""


@dataclasses.dataclass
class RunContext:
  """What a runner may use: the static step, its meshes and shardings, and the scorer.

  The loop builds it once; runners never see the Trainer. `setup` (rljax/trainer/setup.py) builds
  the jitted programs, the same ones `rljax plan` compiles. `tools` is the multi-turn engine
  (rljax/rollout/tools.py) when config.tools.enabled.
  """
  setup: Any                       # trainer/setup.py Setup
  spec: Any                        # trainer/step.py StepSpec
  optimizer: Any
  schedule: Callable
  mesh: jax.sharding.Mesh
  state_shardings: Any
  batch_rows: int                  # prompts sampled per step, all processes
  scorer: "Scorer"
  rollout_cfg: Any                 # config.rollout
  steps: int                       # config.train.steps
  max_staleness: int
  start_step: int
  generator_mesh: jax.sharding.Mesh | None = None
  tools: ToolRollout | None = None
  pad_id: int = 0
  max_prompt_tokens: int = 0


@dataclasses.dataclass
class StepOutput:
  """What a runner reports for one step; the loop turns it into the logged metrics."""
  metrics: dict                    # the update's device metrics, fetched to the host
  reward_metrics: dict             # the reward pool's (reward/*, verifier/*, info/*)
  seconds: float
  phases: dict[str, float]         # time/<phase>
  prompt_len: int
  data_state: dict                 # the data position after the batch trained on (what a checkpoint saves)
  extra: dict = dataclasses.field(default_factory=dict)   # scheduler / producer metrics (rollout/*, tools/*)
  info: RolloutInfo | None = None  # what the producer of the trained batch reported (trajectories, ...)


class Scorer:
  """The reward pool and its io_callback bridge, owned in one place.

  `score` rescores a batch on a fresh pool when the pool itself fails (up to SCORE_ATTEMPTS),
  so one broken pool does not lose the batch; `restart` replaces the pool for every user.
  """

  def __init__(self, reward_spec, make_pool, make_reward_fn):
    self.spec = reward_spec
    self._make_pool = make_pool
    self.pool = make_pool()
    self.reward_fn = make_reward_fn(self.pool)
    self._make_reward_fn = make_reward_fn
    # Combine each batch's reward metrics over the processes (each scored its own rows); off where
    # one process scores whole batches from a thread that must not start a collective (async
    # across processes, trainer/async_rollouts.py).
    self.combine_processes = True

  def restart(self) -> None:
    try:
      self.pool.close()
    except Exception:  # noqa: BLE001 - it has already failed
      pass
    self.pool = self._make_pool()
    self.reward_fn.pool = self.pool

  def score(self, tokens: np.ndarray, lengths: np.ndarray, examples: list, index: int, rollout=None):
    """(rewards [N], components [N, K], metrics) for host arrays; retries on a fresh pool. `rollout`
    (device arrays of the rows): what reward models and judges score on the mesh."""
    for attempt in range(1, SCORE_ATTEMPTS + 1):
      try:
        rewards, components, out = self.reward_fn.score(tokens, lengths, examples, step=index, rollout=rollout)
        break
      except Exception as e:  # noqa: BLE001 - the pool itself failed; rescore rather than lose the batch
        if attempt == SCORE_ATTEMPTS:
          raise RolloutError(f"scoring batch {index} failed {attempt} times, last: {e!r}; the run stops "
                             f"and keeps its last good checkpoint.") from e
        log.warning("reward pool failed on batch %d (%r); restarting it and rescoring (attempt %d of %d)",
                    index, e, attempt + 1, SCORE_ATTEMPTS)
        self.restart()
    # Each process scored its own rows: the logged figures cover every process's (a host all-gather
    # in a multi-process run, so every process scores each batch once, in the same order).
    summary = summaries.summary(out, rewards)
    metrics = summaries.combine_process_metrics(shd.allgather_objects(summary) if self.combine_processes else [summary])
    metrics["rollout/score_attempts"] = float(attempt)
    return rewards, components, metrics

  def close(self) -> None:
    self.pool.close()


@dataclasses.dataclass
class Batch:
  """One generated batch on its way to the learner (host-side bookkeeping plus device arrays)."""
  index: int                 # the rollout step it is for (0-based, counts from the start of the run)
  version: int               # parameter version (updates applied) of its oldest tokens
  rollout: Rollout           # device arrays
  info: RolloutInfo          # what its producer reported (examples, data position, metrics)
  tokens: np.ndarray | None = None
  lengths: np.ndarray | None = None
  rewards: np.ndarray | None = None
  components: np.ndarray | None = None
  reward_metrics: dict | None = None
  score_s: float = 0.0


def make_runner(ctx: RunContext, state: TrainState):
  """The runner of config.rollout.mode (trainer/modes.py)."""
  mode = modes.get(ctx.rollout_cfg.mode)
  if jax.process_count() > 1 and not mode.multi_process:
    multi = [m.name for m in modes.MODES.values() if m.multi_process]
    raise ConfigError(f"config.rollout.mode={mode.name!r} runs in one process for now; multi-process runs use "
                      f"rollout.mode in {multi}.")
  if ctx.tools is not None and not mode.tools:
    raise ConfigError(f"config.tools.enabled with rollout.mode={mode.name!r}: use one of "
                      f"{[m.name for m in modes.MODES.values() if m.tools]}.")
  return mode.runner_class()(ctx, state)


def split_devices(config, devices=None) -> tuple[list, list]:
  """(learner devices, generator devices) of `devices` (default: all of this run's) for
  config.rollout; generators empty unless the mode splits the devices (async). `rljax plan` splits
  a topology's devices the same way."""
  devices = list(jax.devices() if devices is None else devices)
  r = config.rollout
  if not modes.get(r.mode).splits_devices:
    return devices, []
  n_gen = r.generator_devices or len(devices) // 2
  if not 0 < n_gen < len(devices):
    raise ConfigError(
        f"config.rollout.generator_devices={r.generator_devices} leaves no devices for "
        f"{'the generators' if n_gen <= 0 else 'the learner'} ({len(devices)} devices); the {r.mode} mode needs "
        "at least 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8).")
  if jax.process_count() > 1:
    # Across processes the generators take the last devices (the last process's): process 0, which
    # writes the metrics, the checkpoints and the export, then holds the learner's parameters.
    return devices[:-n_gen], devices[-n_gen:]
  return devices[n_gen:], devices[:n_gen]


class FusedRollouts:
  """One jitted program per step; rewards through io_callback (trainer/step.py)."""
  mode = modes.MODES["fused"]

  def __init__(self, ctx: RunContext, state: TrainState):
    self.ctx = ctx
    self.index = ctx.start_step
    self.batch_sharding = shd.batch_sharding(ctx.mesh, 2, ctx.batch_rows)
    self.train_step = train_step_program(ctx.setup, ctx.mesh, ctx.state_shardings, ctx.scorer.reward_fn)
    self.graph_step = None     # with reward models or judges: the step that also takes their inputs
    self.counts = {"batches_generated": 0, "batches_trained": 0}

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    scorer = self.ctx.scorer
    t0 = time.perf_counter()
    prompts = feed.next(self.batch_sharding)
    # Each process scores the rows its own devices hold: it gets its own examples and their
    # global prompt indices (rljax/rewards/callback.py).
    scorer.reward_fn.set_batch(prompts.examples, step=self.index,
                               indices=local_indices(prompts.ids.sharding, prompts.ids.shape))
    inputs = scorer.reward_fn.graph_inputs(prompts.examples, prompts.ids.shape[0])
    if inputs is None:
      state, metrics = self.train_step(state, prompts.ids, prompts.mask)
    else:
      if self.graph_step is None:
        self.graph_step = train_step_program(self.ctx.setup, self.ctx.mesh, self.ctx.state_shardings,
                                             scorer.reward_fn, jax.tree.map(lambda x: x.sharding, inputs))
      state, metrics = self.graph_step(state, prompts.ids, prompts.mask, inputs)
    metrics = jax.device_get(metrics)
    t1 = time.perf_counter()
    self.index += 1
    self.counts["batches_generated"] += 1
    self.counts["batches_trained"] += 1
    timing = scorer.reward_fn.last_timing()
    phases = {}
    if timing:
      phases = {"sample": max(timing["start"] - t0, 0.0), "score": timing["end"] - timing["start"],
                "update": max(t1 - timing["end"], 0.0)}
    info = RolloutInfo(examples=list(prompts.examples), data_state=prompts.data_state, prompt_len=prompts.width)
    return state, StepOutput(metrics, scorer.reward_fn.global_metrics(), t1 - t0, phases, prompts.width,
                             prompts.data_state, info=info)

  def close(self) -> None:
    pass


class Decoupled:
  """What the pipelined, async and partial modes share: a producer, one jitted update, retrying
  host scoring, the staleness bound and the scheduler metrics."""

  def __init__(self, ctx: RunContext, state: TrainState, producer, generator_mesh=None):
    self.ctx = ctx
    self.producer = producer
    self.max_staleness = ctx.max_staleness
    self.steps = ctx.steps
    self.version = ctx.start_step      # parameter version of the learner's state (updates applied)
    self.next_index = ctx.start_step   # the next batch to generate
    self.base_rng = shd.global_values(state.rng)   # constant: batch k is sampled with rollout_key(., k)
    self.learner_mesh = ctx.mesh
    self.generator_mesh = generator_mesh or ctx.mesh
    self.update = update_program(ctx.setup, ctx.mesh, ctx.state_shardings)
    self.idle = {"generator": 0.0, "scorer": 0.0, "learner": 0.0}
    self._counts = {"batches_generated": 0, "batches_trained": 0}

  @property
  def counts(self) -> dict:
    """Batches generated / trained (and, at close, dropped), with the producer's own counts."""
    return {**self._counts, **getattr(self.producer, "counts", {})}

  def draw(self, feed, params, version: int) -> Batch:
    """Draws the next batch from the producer (returns before a compiled producer's generation
    finishes). `version`: the parameters' version."""
    rollout, info = self.producer(params, rollout_key(self.base_rng, self.next_index), feed)
    item = Batch(index=self.next_index, version=version - info.age, rollout=rollout, info=info)
    self.next_index += 1
    self._counts["batches_generated"] += 1
    return item

  @staticmethod
  def finish_generation(item: Batch) -> Batch:
    """Waits for the batch's tokens and brings this process's rows to the host (the scorer needs
    text; in a multi-process run each process scores the rows its devices hold)."""
    item.tokens, item.lengths = shd.local_rows(item.rollout.tokens), shd.local_rows(item.rollout.lengths)
    return item

  def score(self, item: Batch) -> Batch:
    """Scores on the host (the scorer rescoring on a fresh pool if the pool fails)."""
    start = time.perf_counter()
    item.rewards, item.components, item.reward_metrics = self.ctx.scorer.score(
        item.tokens, item.lengths, item.info.examples, item.index, rollout=item.rollout)
    item.score_s = time.perf_counter() - start
    return item

  def train(self, state: TrainState, item: Batch, rollout: Rollout) -> tuple[TrainState, dict, int]:
    """The update on one scored batch; returns (state, host metrics, its staleness)."""
    n = rollout.tokens.shape[0]
    rows = lambda x: shd.rows_from_processes(x, shd.batch_sharding(self.learner_mesh, x.ndim, n), n)
    return self.train_scored(state, item.index, item.version, rollout.with_rewards(rows(item.rewards),
                                                                                   rows(item.components)))

  def train_scored(self, state: TrainState, index: int, version: int, rollout: Rollout
                   ) -> tuple[TrainState, dict, int]:
    """The update on batch `index`, generated with parameter version `version`, its rewards in
    `rollout`; returns (state, host metrics, its staleness)."""
    staleness = self.version - version
    if not 0 <= staleness <= self.max_staleness:
      raise RolloutError(f"batch {index} is {staleness} versions old, outside max_staleness="
                         f"{self.max_staleness} (a bug in the scheduler).")
    state, metrics = self.update(state, rollout)
    self.version += 1
    self._counts["batches_trained"] += 1
    return state, shd.global_values(metrics), staleness

  def rollout_metrics(self, staleness: int, queue_depth: int) -> dict[str, float]:
    """Per-step scheduler metrics; idle times are seconds spent waiting since the previous step."""
    idle, self.idle = self.idle, {"generator": 0.0, "scorer": 0.0, "learner": 0.0}
    out = {"rollout/staleness": float(staleness), "rollout/queue_depth": float(queue_depth),
           "rollout/batches_in_flight": float(self._counts["batches_generated"] - self._counts["batches_trained"])}
    out.update({f"rollout/{who}_idle_s": s for who, s in idle.items()})
    # One-hot per step: summed over a run's steps it is the run's staleness histogram.
    for s in range(self.max_staleness + 1):
      out[f"rollout/staleness_{s}"] = float(staleness == s)
    return out

  def output(self, item: Batch, metrics: dict, seconds: float, phases: dict, staleness: int,
             queue_depth: int) -> StepOutput:
    extra = dict(item.info.metrics)
    extra.update(self.rollout_metrics(staleness, queue_depth))
    return StepOutput(metrics, item.reward_metrics, seconds, phases, item.info.prompt_len, item.info.data_state, extra,
                      info=item.info)

  def close(self) -> None:
    self._counts["batches_dropped"] = self._counts["batches_generated"] - self._counts["batches_trained"]


class PipelinedRollouts(Decoupled):
  """Generation of batch k+1 overlaps scoring and updating batch k (one thread, async dispatch).

  JAX dispatch returns before the device finishes, so generating k+1 is queued on the device
  before the host starts scoring k; the update of k is queued behind it. The producer is the
  single-turn sampler, or multi-turn tool use when config.tools.enabled.
  """
  mode = modes.MODES["pipelined"]

  def __init__(self, ctx: RunContext, state: TrainState):
    if ctx.tools is not None:
      producer = ToolProducer(ctx.tools, ctx.mesh, ctx.batch_rows)
    else:
      producer = SamplerProducer(generate_program(ctx.setup, ctx.mesh), ctx.mesh, ctx.batch_rows)
    super().__init__(ctx, state, producer)
    self.pending: Batch | None = None

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    t0 = time.perf_counter()
    item = self.pending or self.draw(feed, state.model_params(), self.version)
    self.pending = None
    self.finish_generation(item)
    t1 = time.perf_counter()
    if self.max_staleness >= 1 and self.next_index < self.steps:
      self.pending = self.draw(feed, state.model_params(), self.version)   # before this update: one version behind
    self.score(item)
    t2 = time.perf_counter()
    state, metrics, staleness = self.train(state, item, item.rollout)
    t3 = time.perf_counter()
    self.idle["learner"] += t1 - t0
    phases = {"sample": t1 - t0, "score": t2 - t1, "update": t3 - t2}
    return state, self.output(item, metrics, t3 - t0, phases, staleness, int(self.pending is not None))

  def close(self) -> None:
    self.pending = None
    super().close()


class PartialRollouts(Decoupled):
  """The partial pool (rljax/rollout/partial.py) as a step: its call generates until P groups are
  complete and returns them; they are scored and trained at once (no overlap). A batch is as old
  as its oldest group: that is the staleness the bound checks."""
  mode = modes.MODES["partial"]

  def __init__(self, ctx: RunContext, state: TrainState):
    producer = PartialProducer(ctx.spec, ctx.mesh, oversample=ctx.rollout_cfg.oversample, width=ctx.max_prompt_tokens,
                               max_staleness=ctx.max_staleness, pad_id=ctx.pad_id)
    super().__init__(ctx, state, producer)

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    t0 = time.perf_counter()
    item = self.finish_generation(self.draw(feed, state.model_params(), self.version))
    t1 = time.perf_counter()
    self.score(item)
    t2 = time.perf_counter()
    state, metrics, staleness = self.train(state, item, item.rollout)
    t3 = time.perf_counter()
    phases = {"sample": t1 - t0, "score": t2 - t1, "update": t3 - t2}
    waiting = int(item.info.metrics["rollout/groups_waiting"])
    return state, self.output(item, metrics, t3 - t0, phases, staleness, waiting)


def rows_on(mesh, rollout: Rollout) -> Rollout:
  """The rollout's arrays moved to `mesh`, split by rows (device to device)."""
  return jax.device_put(rollout, by_rows(mesh, rollout))

"""How a run schedules generation, scoring and updates: config.rollout.mode (docs/rollouts.md).

    fused      one compiled program per step: sample -> io_callback rewards -> update. Exact.
    pipelined  two compiled halves. While the host scores batch k and the device updates on it,
               the device already generates batch k+1 with the parameters before update k
               (one step off-policy), or, with max_staleness=0, only after it (exact). Multi-turn
               tool runs use this mode: their generation alternates compiled decode segments with
               host tool calls, so it cannot live inside one compiled step.
    async      the device mesh is split into a generator part and a learner part. A generator
               thread streams rollouts through a scorer thread into a bounded queue; the learner
               (the caller's thread) takes whole batches and publishes parameters to the
               generators every sync_every updates by a device-to-device reshard.
    partial    (trainer/partial.py) a pool of groups decoded in segments; a step trains the first
               groups to finish and carries the rest.

A runner is `step(state, feed) -> (state, StepOutput)`: it takes the train state and the loop's
prompt feed and returns the new state; the loop owns the state, the data position and the
metrics. Every runner makes `Rollout`s with a producer, scores them on the host through the same
retrying `Scorer`, and trains them with the one update of trainer/step.py.

Off-policy batches (staleness > 0) are corrected, not ignored: lp_old is recomputed with the
parameters before the update (decoupled PPO's proximal policy) and the sampler's log-probs,
the behaviour policy, enter through the truncated IS weight min(exp(lp_old - lp_samp), tis_cap).
Every mode draws the k-th sampling key by the same split of `state.rng` and deals batches in the
same order, so at staleness 0 they produce the same rollouts and updates.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from rljax import sharding as shd
from rljax.errors import ConfigError, RljaxError
from rljax.models import lora
from rljax.rewards.callback import local_indices
from rljax.rollout import Rollout
from rljax.trainer.setup import by_rows, generate_program, train_step_program, update_program
from rljax.trainer.state import TrainState

log = logging.getLogger("rljax")

SCORE_ATTEMPTS = 3      # a batch is rescored on a fresh reward pool this many times before the run stops
_POLL_S = 0.1           # how often a blocked thread checks for shutdown


class RolloutError(RljaxError):
  """A rollout thread failed; the message names the cause. The last good checkpoint is kept."""


@dataclasses.dataclass
class RunContext:
  """What a runner may use: the static step, its meshes and shardings, and the scorer.

  The loop builds it once; runners never see the Trainer. `setup` (rljax/trainer/setup.py) builds
  the jitted programs, the same ones `rljax plan` compiles. `tool_engine` is the multi-turn
  producer (rljax/multiturn.py) when config.tools.enabled.
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
  tool_engine: Any = None
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
  extra: dict = dataclasses.field(default_factory=dict)   # scheduler / tool metrics (rollout/*, tools/*)


@dataclasses.dataclass
class Prompts:
  """One prompt batch drawn from the feed: host examples and device arrays [P*O, Lp]."""
  examples: list
  ids: jax.Array
  mask: jax.Array
  data_state: dict

  @property
  def width(self) -> int:
    return self.ids.shape[1]


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

  def restart(self) -> None:
    try:
      self.pool.close()
    except Exception:  # noqa: BLE001 - it has already failed
      pass
    self.pool = self._make_pool()
    self.reward_fn.pool = self.pool

  def score(self, tokens: np.ndarray, lengths: np.ndarray, examples: list, index: int):
    """(rewards [N], components [N, K], metrics) for host arrays; retries on a fresh pool."""
    for attempt in range(1, SCORE_ATTEMPTS + 1):
      try:
        rewards, components, out = self.reward_fn.score(tokens, lengths, examples, step=index)
        break
      except Exception as e:  # noqa: BLE001 - the pool itself failed; rescore rather than lose the batch
        if attempt == SCORE_ATTEMPTS:
          raise RolloutError(f"scoring batch {index} failed {attempt} times, last: {e!r}; the run stops "
                             f"and keeps its last good checkpoint.") from e
        log.warning("reward pool failed on batch %d (%r); restarting it and rescoring (attempt %d of %d)",
                    index, e, attempt + 1, SCORE_ATTEMPTS)
        self.restart()
    metrics = dict(out.metrics)
    metrics["rollout/score_attempts"] = float(attempt)
    return rewards, components, metrics

  def close(self) -> None:
    self.pool.close()


@dataclasses.dataclass
class Batch:
  """One generated batch on its way to the learner (host-side bookkeeping plus device arrays)."""
  index: int                 # the rollout step it is for (0-based, counts from the start of the run)
  version: int               # parameter version (updates applied) that generated it
  examples: list
  data_state: dict           # the data position just after this batch was drawn
  prompt_len: int
  rollout: Rollout           # device arrays
  tokens: np.ndarray | None = None
  lengths: np.ndarray | None = None
  rewards: np.ndarray | None = None
  components: np.ndarray | None = None
  reward_metrics: dict | None = None
  score_s: float = 0.0
  extra: dict = dataclasses.field(default_factory=dict)


def split_key(rng):
  """The split `TrainState.next_rng` makes: (new raw key data, the key for this rollout)."""
  key, sub = jax.random.split(jax.random.wrap_key_data(rng))
  return jax.random.key_data(key), sub


def make_runner(ctx: RunContext, state: TrainState):
  """The runner of config.rollout.mode (see the module doc)."""
  mode = ctx.rollout_cfg.mode
  if mode == "partial":
    from rljax.trainer.partial import PartialRollouts
    return PartialRollouts(ctx, state)
  if ctx.tool_engine is not None:
    return PipelinedRollouts(ctx, state, producer=ToolProducer(ctx))
  return {"fused": FusedRollouts, "pipelined": PipelinedRollouts, "async": AsyncRollouts}[mode](ctx, state)


def split_devices(config) -> tuple[list, list]:
  """(learner devices, generator devices) for config.rollout; generators empty unless async."""
  devices = list(jax.devices())
  r = config.rollout
  if r.mode != "async":
    return devices, []
  n_gen = r.generator_devices or len(devices) // 2
  if not 0 < n_gen < len(devices):
    raise ConfigError(
        f"config.rollout.generator_devices={r.generator_devices} leaves no devices for "
        f"{'the generators' if n_gen <= 0 else 'the learner'} ({len(devices)} devices); the async mode needs "
        "at least 2 devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8).")
  return devices[n_gen:], devices[:n_gen]


class FusedRollouts:
  """One jitted program per step; rewards through io_callback (trainer/step.py)."""

  def __init__(self, ctx: RunContext, state: TrainState):
    self.ctx = ctx
    self.index = ctx.start_step
    self.batch_sharding = shd.batch_sharding(ctx.mesh, 2, ctx.batch_rows)
    self.train_step = train_step_program(ctx.setup, ctx.mesh, ctx.state_shardings, ctx.scorer.reward_fn)

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    scorer = self.ctx.scorer
    t0 = time.perf_counter()
    prompts = feed.next(self.batch_sharding)
    # Each process scores the rows its own devices hold: it gets its own examples and their
    # global prompt indices (rljax/rewards/callback.py).
    scorer.reward_fn.set_batch(prompts.examples, step=self.index,
                               indices=local_indices(prompts.ids.sharding, prompts.ids.shape))
    state, metrics = self.train_step(state, prompts.ids, prompts.mask)
    metrics = jax.device_get(metrics)
    t1 = time.perf_counter()
    self.index += 1
    timing = scorer.reward_fn.last_timing()
    phases = {}
    if timing:
      phases = {"sample": max(timing["start"] - t0, 0.0), "score": timing["end"] - timing["start"],
                "update": max(t1 - timing["end"], 0.0)}
    return state, StepOutput(metrics, scorer.reward_fn.global_metrics(), t1 - t0, phases, prompts.width,
                             prompts.data_state)

  def close(self) -> None:
    pass


class CompiledProducer:
  """The single-turn sampler as a producer: one jitted program, rows sharded on `mesh`."""

  def __init__(self, ctx: RunContext, mesh):
    self._generate = generate_program(ctx.setup, mesh)

  def __call__(self, params, key, prompt_ids, prompt_mask) -> Rollout:
    return self._generate(params, key, prompt_ids, prompt_mask)

  def annotate(self, examples: list, rollout: Rollout) -> tuple[list, dict]:
    """The examples to score each row against, and per-batch metrics (none here)."""
    return examples, {}


class ToolProducer:
  """Multi-turn tool use (rljax/multiturn.py, docs/tools.md) as a producer of Rollouts.

  Generation alternates compiled decode segments with host tool calls; the update's log-probs
  attend to model and tool tokens (`context_mask`) and train on the model's tokens (`mask`).
  """

  def __init__(self, ctx: RunContext):
    self.ctx = ctx
    self.engine = ctx.tool_engine
    self.last = None

  def __call__(self, params, key, prompt_ids, prompt_mask) -> Rollout:
    traj = self.last = self.engine.run(params, prompt_ids, prompt_mask, key)
    return jax.device_put(traj.rollout, by_rows(self.ctx.mesh, traj.rollout))

  def annotate(self, examples: list, rollout: Rollout) -> tuple[list, dict]:
    """Each trajectory's example gains its `tool_calls` and `tool_errors` (for per-trajectory
    reward components such as the `tool_use` verifier)."""
    traj, g = self.last, self.ctx.spec.group
    per_row = [dict(examples[r // g], tool_calls=int(traj.turns[r]), tool_errors=int(traj.tool_errors[r]))
               for r in range(len(traj.turns))]
    return per_row, dict(traj.metrics)


class Decoupled:
  """What the pipelined, async and partial modes share: one jitted update, retrying host
  scoring, the staleness bound and the scheduler metrics."""

  def __init__(self, ctx: RunContext, state: TrainState, generator_mesh=None):
    self.ctx = ctx
    self.max_staleness = ctx.max_staleness
    self.steps = ctx.steps
    self.version = ctx.start_step      # parameter version of the learner's state (updates applied)
    self.next_index = ctx.start_step   # the next batch to generate
    # Raw key data on the host: the generator advances its own copy of the key chain.
    self.rng = np.asarray(jax.device_get(state.rng))
    self.learner_mesh = ctx.mesh
    self.generator_mesh = generator_mesh or ctx.mesh
    self.update = update_program(ctx.setup, ctx.mesh, ctx.state_shardings)
    self.idle = {"generator": 0.0, "scorer": 0.0, "learner": 0.0}
    self.counts = {"batches_generated": 0, "batches_trained": 0}

  def score(self, item: Batch) -> Batch:
    """Scores on the host (the scorer rescoring on a fresh pool if the pool fails)."""
    start = time.perf_counter()
    item.rewards, item.components, item.reward_metrics = self.ctx.scorer.score(
        item.tokens, item.lengths, item.examples, item.index)
    item.score_s = time.perf_counter() - start
    return item

  def train(self, state: TrainState, item: Batch, rollout: Rollout) -> tuple[TrainState, dict, int]:
    """The update on one scored batch; returns (state, device metrics, its staleness)."""
    staleness = self.version - item.version
    if not 0 <= staleness <= self.max_staleness:
      raise RolloutError(f"batch {item.index} is {staleness} versions old, outside max_staleness="
                         f"{self.max_staleness} (a bug in the scheduler).")
    n = item.rewards.shape[0]
    rollout = rollout.with_rewards(jax.device_put(item.rewards, shd.batch_sharding(self.learner_mesh, 1, n)),
                                   jax.device_put(item.components, shd.batch_sharding(self.learner_mesh, 2, n)))
    state, metrics = self.update(state, rollout)
    self.version += 1
    self.counts["batches_trained"] += 1
    return state, jax.device_get(metrics), staleness

  def rollout_metrics(self, staleness: int, queue_depth: int) -> dict[str, float]:
    """Per-step scheduler metrics; idle times are seconds spent waiting since the previous step."""
    idle, self.idle = self.idle, {"generator": 0.0, "scorer": 0.0, "learner": 0.0}
    out = {"rollout/staleness": float(staleness), "rollout/queue_depth": float(queue_depth),
           "rollout/batches_in_flight": float(self.counts["batches_generated"] - self.counts["batches_trained"])}
    out.update({f"rollout/{who}_idle_s": s for who, s in idle.items()})
    # One-hot per step: summed over a run's steps it is the run's staleness histogram.
    for s in range(self.max_staleness + 1):
      out[f"rollout/staleness_{s}"] = float(staleness == s)
    return out

  def output(self, item: Batch, metrics: dict, seconds: float, phases: dict, staleness: int,
             queue_depth: int) -> StepOutput:
    extra = dict(item.extra)
    extra.update(self.rollout_metrics(staleness, queue_depth))
    return StepOutput(metrics, item.reward_metrics, seconds, phases, item.prompt_len, item.data_state, extra)


class _Streaming(Decoupled):
  """Decoupled modes whose batches come straight from the feed through a producer."""

  def __init__(self, ctx: RunContext, state: TrainState, producer=None, generator_mesh=None):
    super().__init__(ctx, state, generator_mesh)
    self.gen_batch_sharding = shd.batch_sharding(self.generator_mesh, 2, ctx.batch_rows)
    self.producer = producer or CompiledProducer(ctx, self.generator_mesh)

  def draw(self, feed, params, version: int) -> Batch:
    """Draws the next prompts and dispatches their generation (returns before it finishes for
    compiled producers)."""
    prompts = feed.next(self.gen_batch_sharding)
    self.rng, key = split_key(self.rng)
    rollout = self.producer(params, key, prompts.ids, prompts.mask)
    examples, extra = self.producer.annotate(list(prompts.examples), rollout)
    item = Batch(index=self.next_index, version=version, examples=examples, data_state=prompts.data_state,
                 prompt_len=prompts.width, rollout=rollout, extra=extra)
    self.next_index += 1
    self.counts["batches_generated"] += 1
    return item

  @staticmethod
  def finish_generation(item: Batch) -> Batch:
    """Waits for the batch's tokens and brings them to the host (the scorer needs text)."""
    item.tokens, item.lengths = (np.asarray(x) for x in jax.device_get((item.rollout.tokens, item.rollout.lengths)))
    return item


class PipelinedRollouts(_Streaming):
  """Generation of batch k+1 overlaps scoring and updating batch k (one thread, async dispatch).

  JAX dispatch returns before the device finishes, so generating k+1 is queued on the device
  before the host starts scoring k; the update of k is queued behind it.
  """

  def __init__(self, ctx: RunContext, state: TrainState, producer=None):
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
    self.counts["batches_dropped"] = self.counts["batches_generated"] - self.counts["batches_trained"]


class AsyncRollouts(_Streaming):
  """A generator thread and a scorer thread feed the learner through bounded queues (module doc)."""

  def __init__(self, ctx: RunContext, state: TrainState):
    super().__init__(ctx, state, generator_mesh=ctx.generator_mesh)
    r = ctx.rollout_cfg
    self.sync_every = r.sync_every
    from rljax.models.policy import param_shardings
    self.gen_param_shardings = param_shardings(ctx.spec.model, self.generator_mesh)
    self.cond = threading.Condition()
    self._gen_base = None
    self.published = (self.publish_params(state), self.version)
    self.to_score: queue.Queue = queue.Queue(maxsize=1)
    self.ready: queue.Queue = queue.Queue(maxsize=r.queue_size)
    self.stopping = threading.Event()
    self.error: tuple[str, BaseException] | None = None
    self.threads: list[threading.Thread] = []
    self.feed = None

  def publish_params(self, state: TrainState):
    """The learner's parameters resharded onto the generator devices (device to device). Under
    LoRA the frozen base is copied once and only the adapters at each sync."""
    if state.frozen is None:
      params = jax.device_put(state.params, self.gen_param_shardings)
    else:
      base_sh, adapter_sh = lora.split(self.gen_param_shardings)
      if self._gen_base is None:
        self._gen_base = jax.block_until_ready(jax.device_put(state.frozen, base_sh))
      params = lora.join(self._gen_base, jax.device_put(state.params, adapter_sh))
    return jax.block_until_ready(params)   # the learner's next update donates the source buffers

  def _start(self, feed) -> None:
    self.feed = feed
    for name, fn in (("generator", self._generate_loop), ("scorer", self._score_loop)):
      th = threading.Thread(target=self._guard, args=(name, fn), name=f"rljax-{name}", daemon=True)
      th.start()
      self.threads.append(th)

  def _guard(self, name: str, fn) -> None:
    try:
      fn()
    except BaseException as e:  # noqa: BLE001 - handed to the learner's thread, which raises it
      self.error = (name, e)
      self.stopping.set()
      with self.cond:
        self.cond.notify_all()

  def _put(self, q: queue.Queue, item, who: str) -> bool:
    start = time.perf_counter()
    while not self.stopping.is_set():
      try:
        q.put(item, timeout=_POLL_S)
        self.idle[who] += time.perf_counter() - start
        return True
      except queue.Full:
        continue
    return False

  def _get(self, q: queue.Queue, who: str):
    start = time.perf_counter()
    while not self.stopping.is_set():
      try:
        item = q.get(timeout=_POLL_S)
        self.idle[who] += time.perf_counter() - start
        return item
      except queue.Empty:
        continue
    return None

  def _generate_loop(self) -> None:
    while self.next_index < self.steps and not self.stopping.is_set():
      need = self.next_index - self.max_staleness
      start = time.perf_counter()
      with self.cond:
        self.cond.wait_for(lambda: self.stopping.is_set() or self.published[1] >= need)
        params, version = self.published
      self.idle["generator"] += time.perf_counter() - start
      if self.stopping.is_set():
        return
      item = self.finish_generation(self.draw(self.feed, params, version))
      if not self._put(self.to_score, item, "generator"):
        return

  def _score_loop(self) -> None:
    while not self.stopping.is_set():
      item = self._get(self.to_score, "scorer")
      if item is None or not self._put(self.ready, self.score(item), "scorer"):
        return

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    if not self.threads:
      self._start(feed)
    t0 = time.perf_counter()
    item = None
    while item is None:
      if self.error is not None:
        name, err = self.error
        if isinstance(err, RljaxError):
          raise err
        raise RolloutError(f"the {name} thread failed: {err!r}; the run stops and keeps its last good "
                           "checkpoint.") from err
      try:
        item = self.ready.get(timeout=_POLL_S)
      except queue.Empty:
        if self.stopping.is_set() and self.error is None:
          raise RolloutError("the rollout threads stopped before the run finished.")
    t1 = time.perf_counter()
    self.idle["learner"] += t1 - t0
    depth = self.ready.qsize()
    # Device to device: the rollout moves from the generator devices to the learner's.
    rollout = jax.device_put(item.rollout, by_rows(self.learner_mesh, item.rollout))
    state, metrics, staleness = self.train(state, item, rollout)
    if self.version % self.sync_every == 0:
      params = self.publish_params(state)
      with self.cond:
        self.published = (params, self.version)
        self.cond.notify_all()
    t2 = time.perf_counter()
    phases = {"sample": t1 - t0, "score": item.score_s, "update": t2 - t1}
    return state, self.output(item, metrics, t2 - t0, phases, staleness, depth)

  def close(self) -> None:
    """Stops the threads; batches generated but never trained are counted in counts['batches_dropped']."""
    self.stopping.set()
    with self.cond:
      self.cond.notify_all()
    for th in self.threads:
      th.join(timeout=60)
    self.counts["batches_dropped"] = self.counts["batches_generated"] - self.counts["batches_trained"]

"""How a run schedules generation, scoring and updates: config.rollout.mode (docs/rollouts.md).

    fused      one compiled program per step: sample -> io_callback rewards -> update. Exact.
    pipelined  two compiled halves. While the host scores batch k and the device updates on it,
               the device already generates batch k+1 with the parameters before update k
               (one step off-policy), or, with max_staleness=0, only after it (exact).
    async      the device mesh is split into a generator part and a learner part. A generator
               thread streams rollouts through a scorer thread into a bounded queue; the learner
               (the caller's thread) takes whole batches and publishes parameters to the
               generators every sync_every updates by a device-to-device reshard. A batch is
               generated with parameters at most max_staleness versions older than the update
               that consumes it: the generator waits rather than overshoot.

Off-policy batches (staleness > 0) are corrected, not ignored: lp_old is recomputed with the
parameters before the update (decoupled PPO's proximal policy) and the sampler's log-probs,
the behaviour policy, enter through the truncated IS weight min(exp(lp_old - lp_samp), tis_cap).

Every mode shares `make_generate_fn` / `make_update_fn` (trainer/step.py), draws the k-th
sampling key by the same split of `state.rng`, and deals batches in the same order, so at
staleness 0 all three produce the same rollouts and updates.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from rljax import config as config_lib
from rljax import sharding as shd
from rljax.errors import ConfigError, RljaxError
from rljax.trainer.step import jit_train_step, make_generate_fn, make_train_step, make_update_fn

log = logging.getLogger("rljax")

SCORE_ATTEMPTS = 3      # a batch is rescored on a fresh reward pool this many times before the run stops
_POLL_S = 0.1           # how often a blocked thread checks for shutdown


class RolloutError(RljaxError):
  """A rollout thread failed; the message names the cause. The last good checkpoint is kept."""


@dataclasses.dataclass
class Batch:
  """One generated batch on its way to the learner (host-side bookkeeping plus device arrays)."""
  index: int                 # the rollout step it is for (0-based, counts from the start of the run)
  version: int               # parameter version (updates applied) that generated it
  examples: list
  data_state: dict           # batcher.state() just after this batch was drawn (for checkpoints)
  prompt_len: int
  rollout: dict              # device arrays (trainer/step.py make_generate_fn)
  tokens: np.ndarray | None = None
  lengths: np.ndarray | None = None
  rewards: np.ndarray | None = None
  components: np.ndarray | None = None
  reward_metrics: dict | None = None
  score_s: float = 0.0


def _split_key(rng):
  """The split `TrainState.next_rng` makes: (new raw key data, the key for this rollout)."""
  key, sub = jax.random.split(jax.random.wrap_key_data(rng))
  return jax.random.key_data(key), sub


def by_rows(mesh, tree):
  """NamedShardings that split every array of `tree` (arrays or ShapeDtypeStructs) by its rows."""
  return jax.tree.map(lambda x: shd.batch_sharding(mesh, x.ndim, x.shape[0]), tree)


def make_rollouts(trainer):
  """The runner of config.rollout.mode for `trainer` (see the module doc)."""
  if trainer.config.tools.enabled:
    return ToolRollouts(trainer)
  mode = trainer.config.rollout.mode
  if mode == "partial":
    from rljax.trainer.partial import PartialRollouts
    return PartialRollouts(trainer)
  return {"fused": FusedRollouts, "pipelined": PipelinedRollouts, "async": AsyncRollouts}[mode](trainer)


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

  def __init__(self, trainer):
    self.t = trainer
    step_fn = make_train_step(trainer.spec, trainer.optimizer, trainer.reward_fn, trainer.schedule)
    self.train_step = jit_train_step(step_fn, trainer.state_shardings, trainer.batch_sharding)

  def step(self) -> dict[str, float]:
    t = self.t
    step = int(t.state.step)
    t0 = time.perf_counter()
    batch, ids, mask = t.next_batch()
    t.data_state = t.batcher.state()
    # The callback scores the whole gathered batch, so it needs every process's examples.
    examples = [e for part in shd.allgather_objects(batch.examples) for e in part]
    t.reward_fn.set_batch(examples, step=step)
    t.state, metrics = self.train_step(t.state, ids, mask)
    metrics = jax.device_get(metrics)
    t1 = time.perf_counter()
    timing = t.reward_fn.last_timing()
    phases = {}
    if timing:
      phases = {"sample": max(timing["start"] - t0, 0.0), "score": timing["end"] - timing["start"],
                "update": max(t1 - timing["end"], 0.0)}
    return t.host_metrics(metrics, t.reward_fn.last_metrics(), t1 - t0, phases, prompt_len=ids.shape[1])

  def close(self) -> None:
    pass


class _Decoupled:
  """What the pipelined and async modes share: the two jitted halves and host-side scoring."""

  def __init__(self, trainer, generator_mesh=None, generate=None):
    self.t = trainer
    c = trainer.config
    self.max_staleness = config_lib.max_staleness(c)
    self.steps = c.train.steps
    self.version = trainer.start_step      # parameter version of trainer.state (updates applied)
    self.next_index = trainer.start_step   # the next batch to generate
    # Raw key data on the host: the generator advances its own copy of the key chain.
    self.rng = np.asarray(jax.device_get(trainer.state.rng))
    self.learner_mesh = trainer.mesh
    self.generator_mesh = generator_mesh or trainer.mesh
    self.gen_batch_sharding = shd.batch_sharding(self.generator_mesh, 2, trainer.batch_rows)
    # Every rollout array is sharded by rows; unconstrained, XLA may leave them (and the work
    # producing them) on one device. `generate` replaces the compiled sampler (multi-turn rollouts).
    self.generate = generate
    if generate is None:
      generate = make_generate_fn(trainer.spec)
      prompts = lambda dtype: jax.ShapeDtypeStruct((trainer.batch_rows, 1), dtype)   # any width: same ranks
      shapes = jax.eval_shape(generate, trainer.state.params, jax.random.key(0), prompts(np.int32), prompts(bool))
      self.generate = jax.jit(generate, out_shardings=by_rows(self.generator_mesh, shapes))
    update = make_update_fn(trainer.spec, trainer.optimizer, trainer.schedule, advance_rng=True)
    self.update = jax.jit(update, donate_argnums=(0,), out_shardings=(trainer.state_shardings, None))
    self.idle = {"generator": 0.0, "scorer": 0.0, "learner": 0.0}
    self.counts = {"batches_generated": 0, "batches_trained": 0}

  def draw(self, params, version: int) -> Batch:
    """Draws the next data batch and dispatches its generation (returns before it finishes)."""
    t = self.t
    batch, ids, mask = t.next_batch(self.gen_batch_sharding)
    self.rng, key = _split_key(self.rng)
    rollout = self.generate(params, key, ids, mask)
    item = Batch(index=self.next_index, version=version, examples=list(batch.examples),
                 data_state=t.batcher.state(), prompt_len=ids.shape[1], rollout=rollout)
    self.next_index += 1
    self.counts["batches_generated"] += 1
    return item

  @staticmethod
  def finish_generation(item: Batch) -> Batch:
    """Waits for the batch's tokens and brings them to the host (the scorer needs text)."""
    item.tokens, item.lengths = (np.asarray(x) for x in jax.device_get(
        (item.rollout["tokens"], item.rollout["lengths"])))
    return item

  def score(self, item: Batch) -> Batch:
    """Scores on the host; a pool that fails outright is restarted and the batch rescored."""
    t = self.t
    start = time.perf_counter()
    for attempt in range(1, SCORE_ATTEMPTS + 1):
      try:
        item.rewards, item.components, out = t.reward_fn.score(
            item.tokens, item.lengths, item.examples, step=item.index)
        break
      except Exception as e:  # noqa: BLE001 - the pool itself failed; rescore rather than lose the batch
        if attempt == SCORE_ATTEMPTS:
          raise RolloutError(f"scoring batch {item.index} failed {attempt} times, last: {e!r}; the run stops "
                             f"and keeps its last good checkpoint.") from e
        log.warning("reward pool failed on batch %d (%r); restarting it and rescoring (attempt %d of %d)",
                    item.index, e, attempt + 1, SCORE_ATTEMPTS)
        t.restart_reward_pool()
    item.reward_metrics = dict(out.metrics)
    item.reward_metrics["rollout/score_attempts"] = float(attempt)
    item.score_s = time.perf_counter() - start
    return item

  def train(self, item: Batch, rollout: dict) -> tuple[dict, int]:
    """The update on one scored batch; returns (device metrics, its staleness)."""
    t = self.t
    staleness = self.version - item.version
    if not 0 <= staleness <= self.max_staleness:
      raise RolloutError(f"batch {item.index} is {staleness} versions old, outside max_staleness="
                         f"{self.max_staleness} (a bug in the scheduler).")
    rewards = jax.device_put(item.rewards, shd.batch_sharding(self.learner_mesh, 1, item.rewards.shape[0]))
    comps = jax.device_put(item.components, shd.batch_sharding(self.learner_mesh, 2, item.rewards.shape[0]))
    t.state, metrics = self.update(t.state, rollout, rewards, comps)
    self.version += 1
    self.counts["batches_trained"] += 1
    t.data_state = item.data_state
    return metrics, staleness

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


class PipelinedRollouts(_Decoupled):
  """Generation of batch k+1 overlaps scoring and updating batch k (one thread, async dispatch).

  JAX dispatch returns before the device finishes, so generating k+1 is queued on the device
  before the host starts scoring k; the update of k is queued behind it.
  """

  def __init__(self, trainer, generate=None):
    super().__init__(trainer, generate=generate)
    self.pending: Batch | None = None

  def step(self) -> dict[str, float]:
    t = self.t
    t0 = time.perf_counter()
    item = self.pending or self.draw(t.state.params, self.version)
    self.pending = None
    self.finish_generation(item)
    t1 = time.perf_counter()
    if self.max_staleness >= 1 and self.next_index < self.steps:
      self.pending = self.draw(t.state.params, self.version)   # before this update: one version behind
    self.score(item)
    t2 = time.perf_counter()
    metrics, staleness = self.train(item, item.rollout)
    metrics = jax.device_get(metrics)
    t3 = time.perf_counter()
    self.idle["learner"] += t1 - t0
    out = t.host_metrics(metrics, item.reward_metrics, t3 - t0,
                         {"sample": t1 - t0, "score": t2 - t1, "update": t3 - t2}, prompt_len=item.prompt_len)
    out.update(self.rollout_metrics(staleness, int(self.pending is not None)))
    return out

  def close(self) -> None:
    self.pending = None
    self.counts["batches_dropped"] = self.counts["batches_generated"] - self.counts["batches_trained"]


class AsyncRollouts(_Decoupled):
  """A generator thread and a scorer thread feed the learner through bounded queues (module doc)."""

  def __init__(self, trainer):
    super().__init__(trainer, generator_mesh=trainer.generator_mesh)
    r = trainer.config.rollout
    self.sync_every = r.sync_every
    from rljax.models.policy import param_shardings
    self.gen_param_shardings = param_shardings(trainer.spec.model, self.generator_mesh)
    self.cond = threading.Condition()
    self.published = (self.publish_params(), self.version)
    self.to_score: queue.Queue = queue.Queue(maxsize=1)
    self.ready: queue.Queue = queue.Queue(maxsize=r.queue_size)
    self.stopping = threading.Event()
    self.error: tuple[str, BaseException] | None = None
    self.threads: list[threading.Thread] = []

  def publish_params(self):
    """The learner's parameters resharded onto the generator devices (device to device)."""
    params = jax.device_put(self.t.state.params, self.gen_param_shardings)
    return jax.block_until_ready(params)   # the learner's next update donates the source buffers

  def _start(self) -> None:
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
      item = self.finish_generation(self.draw(params, version))
      if not self._put(self.to_score, item, "generator"):
        return

  def _score_loop(self) -> None:
    while not self.stopping.is_set():
      item = self._get(self.to_score, "scorer")
      if item is None or not self._put(self.ready, self.score(item), "scorer"):
        return

  def step(self) -> dict[str, float]:
    t = self.t
    if not self.threads:
      self._start()
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
    metrics, staleness = self.train(item, rollout)
    metrics = jax.device_get(metrics)
    if self.version % self.sync_every == 0:
      params = self.publish_params()
      with self.cond:
        self.published = (params, self.version)
        self.cond.notify_all()
    t2 = time.perf_counter()
    out = t.host_metrics(metrics, item.reward_metrics, t2 - t0,
                         {"sample": t1 - t0, "score": item.score_s, "update": t2 - t1}, prompt_len=item.prompt_len)
    out.update(self.rollout_metrics(staleness, depth))
    return out

  def close(self) -> None:
    """Stops the threads; batches generated but never trained are counted in counts['batches_dropped']."""
    self.stopping.set()
    with self.cond:
      self.cond.notify_all()
    for th in self.threads:
      th.join(timeout=60)
    self.counts["batches_dropped"] = self.counts["batches_generated"] - self.counts["batches_trained"]


class ToolRollouts(PipelinedRollouts):
  """Multi-turn tool use (rljax/multiturn.py, docs/tools.md): on-policy, like the fused mode.

  Generation alternates compiled decode segments with host tool calls, so it cannot live inside
  one compiled step: each step runs the multi-turn rollout, scores the final trajectories on the
  host, then runs the compiled update, whose log-probs attend to model and tool tokens
  (`context_mask`) and train on the model's tokens only (`mask`).
  """

  def __init__(self, trainer):
    # max_staleness is 0 (config: tools need rollout.mode='fused')
    super().__init__(trainer, generate=self._generate)
    self.engine = trainer.tool_rollout(trainer.sp)
    self.tool_metrics: dict[str, float] = {}

  def draw(self, params, version: int) -> Batch:
    """Generates a batch; each trajectory's example gains its `tool_calls` and `tool_errors`
    (for per-trajectory reward components such as the `tool_use` verifier)."""
    item = super().draw(params, version)
    traj, g = self.last_traj, self.t.sp.num_samples
    item.examples = [dict(item.examples[r // g], tool_calls=int(traj.turns[r]), tool_errors=int(traj.tool_errors[r]))
                     for r in range(len(traj.turns))]
    return item

  def _generate(self, params, key, prompt_ids, prompt_mask) -> dict:
    traj = self.last_traj = self.engine.run(params, prompt_ids, prompt_mask, key)
    self.tool_metrics = dict(traj.metrics)
    fan = lambda x: jax.numpy.repeat(x, self.t.sp.num_samples, axis=0)
    rollout = dict(traj.device, prompt_ids=fan(prompt_ids), prompt_mask=fan(prompt_mask))
    return jax.device_put(rollout, by_rows(self.learner_mesh, rollout))

  def step(self) -> dict[str, float]:
    out = super().step()
    out.update(self.tool_metrics)
    return out

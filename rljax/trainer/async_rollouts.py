"""The async rollout mode (config.rollout.mode='async', docs/rollouts.md): the device mesh is split
into a generator part and a learner part. A generator thread streams rollouts through a scorer
thread into a bounded queue; the learner (the caller's thread) takes whole batches and publishes
parameters to the generators every sync_every updates by a device-to-device reshard. The
generators run at most max_staleness versions ahead of the learner.

Across processes (one generator process, the learner on the others: trainer/bridge.py) the
generator and scorer threads run on the generator process only, and neither starts a collective:
every collective (the batch's metadata, the batch itself and each publish, through the bridge)
is the learner thread's, which runs on every process in the same order, so the processes meet
once per step.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time

import jax
import numpy as np

from rljax import sharding as shd
from rljax.errors import RljaxError
from rljax.models import lora
from rljax.models.policy import param_logical_axes
from rljax.rollout.sampler import SamplerProducer, decode_cast, decode_layout_for
from rljax.rollout.types import Rollout, RolloutInfo
from rljax.trainer import modes
from rljax.trainer.bridge import Bridge, process_sides
from rljax.trainer.rollouts import Batch, Decoupled, RolloutError, RunContext, StepOutput, rows_on
from rljax.trainer.setup import generate_program
from rljax.trainer.state import TrainState

_POLL_S = 0.1           # how often a blocked thread checks for shutdown


class AsyncRollouts(Decoupled):
  """A generator thread and a scorer thread feed the learner through bounded queues (module doc)."""

  mode = modes.MODES["async"]

  def __init__(self, ctx: RunContext, state: TrainState):
    # The generators' copy of the parameters: the sampler's (compute dtype, its decode layout on the
    # generator devices), so the generate program reads it as it is and no float32 copy is kept there.
    model, mesh = ctx.spec.model, ctx.generator_mesh
    self.gen_layout = decode_layout_for(model, state.model_params(), mesh)
    shapes = jax.eval_shape(lambda p: decode_cast(model, p), state.model_params())
    self.gen_param_shardings = self.gen_layout.shardings(param_logical_axes(model), shapes, mesh)
    # Bytes a publish writes over the generator devices (a replicated leaf once per device): under
    # LoRA the base once, then the adapters at each publish.
    written = lambda sh, x: float(mesh.devices.size * shd.bytes_per_device(sh, x))   # noqa: E731
    if state.frozen is None:
      self._base_bytes, self._sync_bytes = 0.0, written(self.gen_param_shardings, shapes)
    else:
      (base_sh, adapter_sh), (base, adapters) = lora.split(self.gen_param_shardings), lora.split(shapes)
      self._base_bytes, self._sync_bytes = written(base_sh, base), written(adapter_sh, adapters)
    self._cast = jax.jit(lambda p: decode_cast(model, p))
    # Across processes: the bridge between the two parts, and this process's part.
    self.bridge, self.side = None, "generator"
    if jax.process_count() > 1:
      generators, learner = list(mesh.devices.flat), list(ctx.mesh.devices.flat)
      self.side = process_sides(generators, learner)[jax.process_index()]
      self.bridge = Bridge(generators, learner)
      if ctx.scorer.spec.graph_components:
        raise RolloutError("config.rewards: reward models and judges score on the learner's devices, which the "
                           "generator process of an async run across processes does not hold; use rollout.mode="
                           "'pipelined', or run async in one process.")
      ctx.scorer.combine_processes = False   # one process scores every row, in a thread: no collective there
    producer = SamplerProducer(generate_program(ctx.setup, mesh, decode_layout=self.gen_layout), mesh,
                               ctx.batch_rows)
    super().__init__(ctx, state, producer, generator_mesh=mesh)
    r = ctx.rollout_cfg
    self.sync_every = r.sync_every
    self.cond = threading.Condition()
    self._gen_base = None
    self._publish_s = self._publish_bytes = 0.0   # publishes since the last step (rollout/publish_s, _bytes)
    self.published = (self.publish_params(state), self.version)
    self.to_score: queue.Queue = queue.Queue(maxsize=1)
    self.ready: queue.Queue = queue.Queue(maxsize=r.queue_size)
    self.stopping = threading.Event()
    self.error: tuple[str, BaseException] | None = None
    self.threads: list[threading.Thread] = []
    self.feed = None

  def publish_params(self, state: TrainState):
    """The learner's parameters, cast to the compute dtype where they are, then resharded onto the
    generator devices in the generators' decode layout (device to device). Under LoRA the frozen
    base is copied once and only the adapters at each sync. Adds its wall seconds and the bytes it
    wrote to the generator devices to the figures the next step reports."""
    start = time.perf_counter()
    if state.frozen is None:
      params = self._to_generators(self._cast(state.params), self.gen_param_shardings)
    else:
      base_sh, adapter_sh = lora.split(self.gen_param_shardings)
      if self._gen_base is None:
        self._gen_base = jax.block_until_ready(self._to_generators(self._cast(state.frozen), base_sh))
        self._publish_bytes += self._base_bytes
      params = lora.join(self._gen_base, self._to_generators(self._cast(state.params), adapter_sh))
    jax.block_until_ready(params)   # the learner's next update donates the source buffers
    self._publish_s += time.perf_counter() - start
    self._publish_bytes += self._sync_bytes
    return params

  def _to_generators(self, tree, shardings):
    """`tree` (on the learner's devices) on the generator devices with `shardings`: a reshard in one
    process; across processes through the bridge, then resharded on the generator process (the
    learner processes keep the bridge's handles, which they never read)."""
    if self.bridge is None:
      return jax.device_put(tree, shardings)
    moved = self.bridge.move(tree, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree), "learner")
    return jax.device_put(moved, shardings) if self.side == "generator" else moved

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

  def _next_ready(self) -> Batch:
    """The next scored batch from the queue; raises what a rollout thread failed with."""
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
    return item

  def step(self, state: TrainState, feed) -> tuple[TrainState, StepOutput]:
    if not self.threads and self.side == "generator":
      self._start(feed)
    t0 = time.perf_counter()
    if self.bridge is not None:
      item, rollout, depth = self._receive(feed)
      t1 = time.perf_counter()
      state, metrics, staleness = self.train_scored(state, item.index, item.version, rollout)
    else:
      item = self._next_ready()
      t1 = time.perf_counter()
      depth = self.ready.qsize()
      # Device to device: the rollout moves from the generator devices to the learner's.
      rollout = rows_on(self.learner_mesh, item.rollout)
      state, metrics, staleness = self.train(state, item, rollout)
    self.idle["learner"] += t1 - t0
    if self.version % self.sync_every == 0:
      params = self.publish_params(state)
      with self.cond:
        self.published = (params, self.version)
        self.cond.notify_all()
    t2 = time.perf_counter()
    phases = {"sample": t1 - t0, "score": item.score_s, "update": t2 - t1}
    out = self.output(item, metrics, t2 - t0, phases, staleness, depth)
    out.extra.update({"rollout/publish_s": self._publish_s, "rollout/publish_bytes": self._publish_bytes})
    self._publish_s = self._publish_bytes = 0.0
    return state, out

  def _receive(self, feed) -> tuple[Batch, Rollout, int]:
    """Across processes: the next scored batch, brought to the learner's devices on every process.

    The generator process sends the batch's host figures (one all-gather, which also carries a
    rollout thread's failure to every process) and then its arrays, rewards included, through the
    bridge. Returns (the batch's host side, the rollout on the learner mesh, queue depth)."""
    meta, payload = None, None
    if self.side == "generator":
      try:
        item = self._next_ready()
      except RolloutError as e:
        meta = {"error": str(e)}
      else:
        r, n = item.rollout, item.rollout.tokens.shape[0]
        on_gen = lambda x: shd.rows_from_processes(x, shd.batch_sharding(self.generator_mesh, x.ndim, n), n)  # noqa: E731
        payload = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)
                   if f.name not in ("rewards", "components", "group_size") and getattr(r, f.name) is not None}
        payload["rewards"] = on_gen(np.asarray(item.rewards, np.float32))
        payload["components"] = on_gen(np.asarray(item.components, np.float32))
        meta = {"index": item.index, "version": item.version, "group_size": r.group_size,
                "shapes": {k: [list(v.shape), str(v.dtype)] for k, v in payload.items()},
                "prompt_len": item.info.prompt_len, "metrics": _floats(item.info.metrics),
                "reward_metrics": _floats(item.reward_metrics), "score_s": item.score_s,
                "depth": self.ready.qsize()}
    meta = next(m for m in shd.allgather_objects(meta) if m is not None)
    if "error" in meta:
      raise RolloutError(f"the generator process: {meta['error']}")
    shapes = {k: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in meta["shapes"].items()}
    moved = self.bridge.move(payload, shapes, "generator")
    rollout = rows_on(self.learner_mesh, Rollout(**moved, group_size=meta["group_size"]))
    if self.side == "generator":
      item.rollout = None   # its arrays have crossed; the generator devices' copy is not needed
    else:                   # the learner processes' view of the batch: its host figures, their own data position
      info = RolloutInfo(data_state=feed.batcher.state(), prompt_len=meta["prompt_len"], metrics=meta["metrics"])
      item = Batch(index=meta["index"], version=meta["version"], rollout=None, info=info,
                   reward_metrics=meta["reward_metrics"], score_s=meta["score_s"])
    return item, rollout, int(meta["depth"])

  def close(self) -> None:
    """Stops the threads; batches generated but never trained are counted in counts['batches_dropped']."""
    self.stopping.set()
    with self.cond:
      self.cond.notify_all()
    for th in self.threads:
      th.join(timeout=60)
    super().close()


def _floats(metrics: dict) -> dict[str, float]:
  """A metrics dict with plain floats (it crosses processes as JSON)."""
  return {k: float(v) for k, v in metrics.items()}

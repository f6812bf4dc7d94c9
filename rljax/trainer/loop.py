"""The outer training loop: set up, resume, step, log, evaluate, checkpoint, export."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from typing import Any

import jax
import ml_collections
import numpy as np

from rljax import compile_stats, config as config_lib, sharding as shd
from rljax.config.validation import check_batch_mesh
from rljax.data import PromptBatcher, build_dataset
from rljax.errors import ConfigError, RljaxError
from rljax.models import lora
from rljax.objectives.sft import SftRunner
from rljax.objectives.sft_data import SftBatcher
from rljax.rewards import RewardPool, RewardSpec, make_reward_fn
from rljax.rewards.routing import source_verifiers_from_data
from rljax.rollout.tools import ToolRollout, TurnParams
from rljax.tools import ToolRunner
from rljax.trainer import modes, rundir, setup as setup_lib
from rljax.trainer.bridge import check_process_split
from rljax.trainer.checkpoint import Checkpointer
from rljax.trainer.feed import DataExhausted, PromptFeed, TrainingStopped
from rljax.trainer.hooks import StepInfo, default_hooks
from rljax.trainer.metrics import MetricsWriter, to_floats
from rljax.trainer.rollouts import RunContext, Scorer, make_runner, split_devices
from rljax.trainer.setup import load_policy, sampling_params

__all__ = ["DataExhausted", "PromptFeed", "Trainer", "TrainingStopped", "load_policy", "sampling_params"]

log = logging.getLogger("rljax")

EXTRAS_BASE_FINGERPRINT = "lora_base_fingerprint"   # checkpoint extras of a LoRA run: its base's checksum
EXTRAS_DATA_BY_PROCESS = "data_by_process"           # multi-process runs: every process's data position


def _own_data_state(extras: dict) -> dict:
  """This process's data position in a checkpoint's extras: its entry of `data_by_process` (a
  multi-process run's), else `data` (process 0's, all a one-process run has)."""
  by_process = extras.get(EXTRAS_DATA_BY_PROCESS)
  if by_process is None:
    return extras["data"]
  if len(by_process) != jax.process_count():
    raise ConfigError(f"the checkpoint was saved by {len(by_process)} processes and this run has "
                      f"{jax.process_count()}: its data positions are per process; resume with "
                      f"{len(by_process)} processes.")
  return by_process[jax.process_index()]


class Interrupted(TrainingStopped):
  """A stop signal (config.train.stop_signals) stopped the run; a checkpoint of its last step is saved.

  `signum`: the signal (None: stopped otherwise); `step`: the step saved (0: nothing was trained)."""

  def __init__(self, message: str, *, signum: int | None = None, step: int = 0):
    super().__init__(message)
    self.signum, self.step = signum, step


# Namespaces of the metrics the host adds to the update's device metrics; a name in both is a bug.
HOST_NAMESPACES = ("reward/", "verifier/", "info/", "time/", "throughput/", "perf/", "data/", "rollout/", "tools/",
                   "compile/")


def _host_copy(x: jax.Array) -> np.ndarray:
  """`x` on the host where this process holds it whole; elsewhere a zero-stride stand-in of its
  shape (orbax writes host arrays from process 0 only)."""
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.broadcast_to(np.zeros((), x.dtype), x.shape)


class Trainer:
  """Owns a run: its train state, data position and metrics. `Trainer(config).run()` trains.

  The loop is one path per step: the runner of config.rollout.mode takes the state and the prompt
  feed and returns the new state and what the step measured (trainer/rollouts.py); the loop keeps
  the state, the data position and the metrics, and runs its hooks (log, evaluate, checkpoint)
  every so many steps.
  """

  def __init__(self, config: ml_collections.ConfigDict):
    config_lib.validate(config)
    self.config = config
    self.out_dir = config.output.dir
    self._setup_process()
    learner_devices, generator_devices = split_devices(config)
    # async across processes: {process: "generator" | "learner"} (trainer/bridge.py), else None
    self.process_sides = check_process_split(config, generator_devices, learner_devices)
    self.mesh = shd.make_mesh(tuple(config.mesh.shape), devices=learner_devices)
    check_batch_mesh(config, self.mesh, jax.process_count())
    self.generator_mesh = (shd.make_mesh(tuple(config.rollout.generator_mesh), devices=generator_devices,
                                         name="config.rollout.generator_mesh") if generator_devices else None)
    policy = setup_lib.load_policy(config.model, config.tokenizer, mesh=self.mesh)
    self.tokenizer = policy.tokenizer
    # train.objective='distill': the frozen teacher, sharded on the mesh like the reference model.
    teacher = setup_lib.load_teacher(config, policy.config, self.tokenizer, mesh=self.mesh)
    # The model, the StepSpec (stop ids from the tokenizer) and the optimizer, as `rljax plan` builds them.
    self.setup = setup_lib.build(config, policy.config, self.tokenizer,
                                 teacher=None if teacher is None else teacher.config)
    self._peak_flops: float | None = None
    self._setup_tools()
    self._setup_data()
    self._setup_rewards()
    self._setup_state(policy.params, None if teacher is None else teacher.params)
    del policy, teacher   # the state holds the parameters now; no second copy is kept for the run
    self.runner = self._setup_runner()
    self.hooks = default_hooks(self)

  # ---- setup ------------------------------------------------------------------------------

  def _setup_process(self):
    """Checks the run directory (a run with another config is refused here, before anything is
    written), joins a multi-process run and turns on compile statistics and the compile cache."""
    config = self.config
    rundir.check_resume(config, self.out_dir, overwrite=not config.checkpoint.resume, allow_finished=True)
    os.makedirs(self.out_dir, exist_ok=True)
    shd.maybe_initialize_distributed(config.mesh.distributed or None)
    compile_stats.install()
    if config.compile.cache_dir:
      compile_stats.enable_persistent_cache(config.compile.cache_dir)

  def _setup_runner(self):
    """The runner of config.rollout.mode (trainer/rollouts.py), its programs from the setup."""
    c = self.config
    ctx = RunContext(
        setup=self.setup, spec=self.spec, optimizer=self.optimizer, schedule=self.schedule, mesh=self.mesh,
        state_shardings=self.state_shardings, batch_rows=self.batch_rows, scorer=self.scorer,
        rollout_cfg=c.rollout, steps=c.train.steps, max_staleness=config_lib.max_staleness(c),
        start_step=self.start_step, generator_mesh=self.generator_mesh,
        tools=self.tool_rollout(self.sp) if c.tools.enabled else None,
        pad_id=int(self.tokenizer.pad_id or 0), max_prompt_tokens=c.data.max_prompt_tokens)
    if c.train.objective == "sft":   # the targets come from the data: no producer, the same update
      return SftRunner(ctx, self.state)
    return make_runner(ctx, self.state)

  def _setup_tools(self):
    """The tool pool and the prompts' tool schemas, when config.tools.enabled (docs/tools.md)."""
    self.tool_runner, self.prompt_tools = None, None
    tl = self.config.tools
    if not tl.enabled:
      return
    self.tool_runner = ToolRunner(list(tl.names), timeout_s=tl.timeout_s, num_workers=tl.num_workers,
                                  max_memory_mb=tl.max_memory_mb,
                                  tool_kwargs=tl.kwargs.to_dict() if hasattr(tl.kwargs, "to_dict") else dict(tl.kwargs))
    if tl.format == "hermes":
      self.prompt_tools = self.tool_runner.schemas()

  def tool_rollout(self, sp):
    """The multi-turn rollout engine (rljax/rollout/tools.py) with sampling params `sp`."""
    tl = self.config.tools
    tp = TurnParams(max_turns=tl.max_turns, segment_tokens=tl.segment_tokens, slots=tl.slots,
                    max_response_tokens=tl.max_response_tokens)
    return ToolRollout(self.model_config, self.tokenizer, self.tool_runner, sp, tp, fmt=tl.format,
                       eos_ids=sp.stop_token_ids)

  def _setup_data(self):
    c = self.config
    pi, pc = jax.process_index(), jax.process_count()
    if self.process_sides is not None:   # async across processes: the generator process reads every prompt
      pi, pc = 0, 1
    if (c.train.prompts_per_step * self.oversample) % pc:
      raise ConfigError(f"config.train.prompts_per_step={c.train.prompts_per_step} must be divisible by the "
                        f"number of processes ({pc}).")
    data_cfg = c.data.to_dict()
    local_prompts = c.train.prompts_per_step * self.oversample // pc
    if modes.get(c.rollout.mode).draws_pool and c.train.objective != "sft":
      local_prompts *= c.rollout.oversample   # a whole pool per draw (trainer/modes.py)
    self.train_data = build_dataset(data_cfg, split="train", process_index=pi, process_count=pc,
                                    shard_block=local_prompts)
    if c.train.objective == "sft":   # prompts with their target responses (rljax/objectives/sft_data.py)
      self.batcher = SftBatcher(self.train_data, self.tokenizer, prompts_per_batch=local_prompts,
                                max_prompt_tokens=c.data.max_prompt_tokens, max_target_tokens=c.sampling.max_new_tokens,
                                response_template=c.sft.response_template)
    else:
      self.batcher = PromptBatcher(self.train_data, self.tokenizer,
                                   prompts_per_batch=local_prompts,
                                   max_prompt_tokens=c.data.max_prompt_tokens, tools=self.prompt_tools)
    self.feed = PromptFeed(self.batcher, pad_id=int(self.tokenizer.pad_id or 0),
                           agree_width=jax.process_count() > 1 and self.process_sides is None)
    self.data_state = self.batcher.state()   # of the last batch trained on: what a checkpoint saves
    self.eval_data = None
    if c.eval.every or c.eval.before_and_after:
      self.eval_data = build_dataset(data_cfg, split="test", process_index=0, process_count=1)

  def _setup_rewards(self):
    spec = RewardSpec.from_dict(self.config.rewards.to_dict(),
                                source_verifiers=source_verifiers_from_data(self.config.data))
    self.component_names = [comp.name for comp in spec.components]
    # Rewards come back sharded like the batch (per device shard of `mesh`): left on one device,
    # they pulled the fused step off the mesh (6x slower on 8 simulated devices, measured).
    graph = None
    if spec.graph_components:   # reward models and judges: loaded onto the mesh, scored in the step
      from rljax.rewards.reward_models import GraphScorer
      graph = GraphScorer(spec, self.tokenizer, self.mesh, dtype=self.config.model.dtype,
                          stop_ids=sorted(set(self.tokenizer.stop_ids) | set(self.sp.stop_token_ids)))
    self.scorer = Scorer(spec, lambda: RewardPool(spec), lambda pool: make_reward_fn(
        pool, self.tokenizer.batch_decode, group_size=self.sp.num_samples, mesh=self.mesh, graph=graph))

  # The static parts of the run (rljax/trainer/setup.py), under the names the loop and hooks use.
  model_config = property(lambda self: self.setup.model)
  spec = property(lambda self: self.setup.spec)
  sp = property(lambda self: self.setup.sampling)   # rollouts honour sampling.ignore_eos; evaluation stops
  loss_cfg = property(lambda self: self.setup.loss)
  oversample = property(lambda self: self.setup.oversample)
  batch_rows = property(lambda self: self.setup.batch_rows)   # prompts sampled per step, all processes
  total_updates = property(lambda self: self.setup.total_updates)
  optimizer = property(lambda self: self.setup.optimizer)
  schedule = property(lambda self: self.setup.schedule)

  def _setup_state(self, params, teacher=None):
    """The train state from the loaded parameters (setup.init_state; `teacher`: the distillation
    teacher's), then the latest checkpoint's when the run resumes."""
    c = self.config
    self.state, self.state_shardings = setup_lib.init_state(self.setup, params, self.mesh, teacher=teacher)
    # LoRA: the adapters go with the base they were trained on; its checksum is saved with them.
    self.base_fingerprint = lora.fingerprint(self.state.frozen) if self.state.frozen is not None else None
    self.ckpt = Checkpointer(os.path.join(self.out_dir, "checkpoints"), keep_last=c.checkpoint.keep_last,
                             keep_best=c.checkpoint.keep_best, best_metric=c.checkpoint.best_metric,
                             async_save=c.checkpoint.async_save)
    self.history: list[dict] = []
    self.start_step = 0
    if c.checkpoint.resume and self.ckpt.latest_step() is not None:
      # The frozen base and the teacher are not in a checkpoint: they were loaded above.
      self._check_base(self.ckpt.restore_extras())
      saved = self.state.saved()
      abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), saved,
                              self.state_shardings.saved())
      if self.process_sides is None:
        restored, extras = self.ckpt.restore(abstract_state=abstract)
      else:   # async across processes: host arrays (saved by process 0, a learner), placed on the learner
        restored, extras = self.ckpt.restore(abstract_state=abstract, as_numpy=True)
        restored = jax.device_put(restored, self.state_shardings.saved())
      self.state = restored.replace(frozen=self.state.frozen, teacher=self.state.teacher)
      self.feed.restore(_own_data_state(extras))
      self.data_state = self.batcher.state()
      self.history = extras.get("metrics", [])
      self.start_step = int(shd.global_values(self.state.step))
      log.info("resumed from %s at step %d", self.ckpt.directory, self.start_step)

  def _check_base(self, extras: dict) -> None:
    """A LoRA checkpoint's adapters only make sense on the base they were trained on."""
    saved = extras.get(EXTRAS_BASE_FINGERPRINT)
    # The run dir's config check (rundir.check_resume) already refused another config.model; this
    # catches other weights at the same model.path. Float32 sums in another order agree to ~1e-6.
    if saved is not None and self.base_fingerprint is not None and \
        abs(saved - self.base_fingerprint) > 1e-4 * max(abs(saved), 1.0):
      raise ConfigError(f"{self.ckpt.directory}: its LoRA adapters were trained on another base model than "
                        f"config.model.path={self.config.model.path!r} (weight checksum {saved:.6g} saved, "
                        f"{self.base_fingerprint:.6g} now); point config.model.path at the run's base model.")

  # ---- the loop ---------------------------------------------------------------------------

  def run_step(self) -> dict[str, float]:
    """One rollout step (in config.rollout.mode): the runner's new state is kept, and so is the
    data position after the batch it trained on. Returns the step's host-side metrics."""
    self.state, out = self.runner.step(self.state, self.feed)
    self.data_state = out.data_state
    return self.host_metrics(out)

  def host_metrics(self, out) -> dict[str, float]:
    """A step's device metrics plus the reward pool's, the runner's, timings and FLOP/s."""
    m = to_floats(out.metrics)
    host = dict(out.reward_metrics)
    host.update(out.extra)
    host["time/step"] = out.seconds
    host.update({f"time/{phase}": s for phase, s in out.phases.items()})
    host["throughput/tokens_per_s"] = m["sampler/tokens"] / max(out.seconds, 1e-9)
    stats = self.batcher.stats()
    host["data/filtered_too_long"] = float(stats.get("filtered_too_long", 0))
    if "response_too_long" in stats:   # sft: targets longer than sampling.max_new_tokens, skipped
      host["data/response_too_long"] = float(stats["response_too_long"])
    compiled = compile_stats.counts()   # every XLA compilation of the process: a few per prompt-width bucket
    host["compile/count"], host["compile/seconds"] = compiled["compiles"], compiled["compile_seconds"]
    clash = sorted(set(m) & set(host))
    if clash or any(k.startswith(HOST_NAMESPACES) for k in m):
      raise RljaxError(f"metrics {clash or [k for k in m if k.startswith(HOST_NAMESPACES)]} are computed on both "
                       "the device and the host (a bug): device metrics must stay out of the host namespaces "
                       f"{HOST_NAMESPACES}.")
    m.update({k: float(v) for k, v in host.items()})
    m.update(self._perf_metrics(m, prompt_len=out.prompt_len))
    return m

  def close(self) -> None:
    """Stops the rollout threads and the reward pool (run() does this itself)."""
    self.runner.close()
    self.scorer.close()
    if self.tool_runner is not None:
      self.tool_runner.close()

  def _perf_metrics(self, m: dict[str, float], prompt_len: int) -> dict[str, float]:
    """Achieved FLOP/s per phase and as a fraction of the devices' peak (rljax/flops.py)."""
    from rljax import flops
    from rljax.rollout.slots import decode_slots
    if self._peak_flops is None:
      self._peak_flops, source = flops.device_peak_flops(self.config.model.dtype)
      log.info("peak for perf/mfu: %.3g FLOP/s (%s)", self._peak_flops, source)
    t, spec = self.config.train, self.spec
    extra = int(self.loss_cfg.needs_reference) + int(spec.recompute_old_logprobs)
    if spec.teacher is not None:   # distill: the teacher's forward, at its own size
      extra += flops.forward_flops(spec.teacher, 1, 1) / max(flops.forward_flops(spec.model, 1, 1), 1e-9)
    sampled = t.prompts_per_step * self.oversample if t.objective != "sft" else 0   # sft samples nothing
    rows = sampled * spec.group
    steps, decode_rows = int(m["response_length_max"]), None
    if "sampler/decode_steps" in m:   # the sampler's own count; its decode slots (sampling.slots) did the work
      steps, decode_rows = int(m["sampler/decode_steps"]) + 1, decode_slots(spec.sampling, rows)
    # A packed / shared-prefix update computes packed_tokens positions, not the padded rows' (its
    # reference and old log-prob forwards run packed too when pack_tokens is set).
    packed = m.get("packed_tokens", 0.0) / m["padded_tokens"] if m.get("padded_tokens") else 1.0
    packed = packed if 0.0 < packed < 1.0 else 1.0
    work = flops.rollout_step_flops(
        spec.model, sample_prompts=sampled, update_prompts=t.prompts_per_step,
        group=spec.group, prompt_len=prompt_len, decode_steps=steps,
        completion_len=spec.sampling.max_new_tokens, epochs=t.epochs, extra_forwards=extra, decode_rows=decode_rows,
        update_fraction=packed, extra_fraction=packed if spec.pack_tokens else 1.0)
    out = {"perf/flops_per_s": (work["sample"] + work["update"]) / max(m["time/step"], 1e-9)}
    out["perf/mfu"] = flops.utilization(out["perf/flops_per_s"], self._peak_flops)
    # In the decoupled modes a phase's time is the wait for it, not its duration: no per-phase MFU.
    for phase in ("sample", "update") if self.runner.mode.exact_phases else ():
      if m.get(f"time/{phase}", 0.0) > 0:
        out[f"perf/{phase}_mfu"] = flops.utilization(work[phase] / m[f"time/{phase}"], self._peak_flops)
    return out

  def run(self) -> dict[str, Any]:
    """Trains to config.train.steps and does what follows the last step (the evaluation after
    training, the final checkpoint, the export), then writes `summary.json`. A run resumed at its
    last step (stopped after its last checkpoint) only does what follows.

    Holds the run directory's lock throughout (a second run into it stops at once). The first of
    config.train.stop_signals stops the run after the step it is in, with a checkpoint, and raises
    `Interrupted`; a second one exits at once (trainer/stopping.py)."""
    from rljax.trainer.runlock import RunLock
    writing = jax.process_index() == 0
    with RunLock(self.out_dir) if writing else contextlib.nullcontext(), self._stop_signals() as stop:
      self._stop = stop
      try:
        return self._run(stop, writing)
      finally:
        self._stop = None

  def _stop_signals(self):
    from rljax.trainer.stopping import StopSignals, any_process_requested
    multi = jax.process_count() > 1
    agree = functools.partial(any_process_requested, deadline_s=float(self.config.train.process_deadline_s))
    return StopSignals(self.config.train.stop_signals, multi_process=multi,
                       agree=agree if multi else None, on_first=self._stop_message)

  def _stop_message(self, signum: int) -> str:
    import signal
    name = signal.Signals(signum).name
    return (f"rljax: {name} received: the run stops after the step in progress and saves a checkpoint "
            f"(send it again{' (Ctrl-C)' if name == 'SIGINT' else ''} to exit at once, losing the steps since the "
            "last checkpoint).")

  def _interrupted(self, stop, step: int, what: str) -> "Interrupted":
    """The Interrupted error after a stop at `step` (a checkpoint of it saved, unless step is 0)."""
    import signal
    name = (signal.Signals(stop.signum).name if stop.signum else
            "a stop signal to another process of the run" if stop.multi_process else "a stop request")
    saved = (f"checkpoint of step {step} in {self.ckpt.directory}" if step else
             "no checkpoint (no step had been trained)")
    return Interrupted(f"stopped by {name} {what}; {saved}. Run the same command again to "
                       f"{'resume' if step else 'start'}.", signum=stop.signum, step=step)

  def _run(self, stop, writing: bool) -> dict[str, Any]:
    from rljax import progress
    from rljax.trainer import rundir
    from rljax.trainer.stopping import StopRequested
    c = self.config
    if writing:   # the run dir's record of its config: written when training starts, never by a dry run
      rundir.write_config(c, self.out_dir)
    finishing = self.start_step >= c.train.steps
    writer = MetricsWriter(self.out_dir, tensorboard=c.output.tensorboard, writing=writing,
                           start_step=self.start_step, wandb=c.output.wandb.to_dict(),
                           config=json.loads(config_lib.to_json(c)))
    if finishing and writing:   # an earlier attempt may have logged the evaluation after training
      rundir.drop_eval_rows(writer.path, c.train.steps)
    summary: dict[str, Any] = {"output_dir": self.out_dir}
    evaluating = c.eval.before_and_after and self.eval_data is not None
    try:
      if evaluating and self.start_step == 0:
        try:
          summary["eval_before"] = self.evaluate("before")
        except StopRequested:
          raise self._interrupted(stop, 0, "during the evaluation before training") from None
        writer.write(0, {f"eval/{k}": v for k, v in summary["eval_before"].items() if isinstance(v, float)})
      elif evaluating and writing:
        before = rundir.logged_eval(writer.path, 0)
        if before is not None:
          summary["eval_before"] = before
      for hook in self.hooks:
        hook.start(self, writer)
      for step in range(self.start_step, c.train.steps):
        what = f"step {step + 1} of {c.train.steps}"
        if step == self.start_step:
          what += ": the first step compiles its programs"
        try:
          with progress.phase(what):
            m = self.run_step()
        except DataExhausted:
          self.save(force=True)   # keep everything trained so far, then stop
          raise
        self.history.append({k: m[k] for k in ("reward/mean", "loss", "time/step") if k in m})
        if m.get("skipped_consecutive", 0) >= c.optim.max_consecutive_skips:
          raise TrainingStopped(
              f"{int(m['skipped_consecutive'])} consecutive updates had non-finite gradients "
              f"(config.optim.max_consecutive_skips={c.optim.max_consecutive_skips}); the run stopped. The last "
              f"good checkpoint is in {self.ckpt.directory}. Lower optim.learning_rate or check the rewards.")
        info = StepInfo(step=step + 1, metrics=m, last=step + 1 == c.train.steps)
        try:
          for hook in self.hooks:
            if hook.every and info.step % hook.every == 0:
              hook.fn(self, info)
        except StopRequested:
          pass   # an evaluation ended early; the step itself is complete and is saved below
        if stop.stop_after(info.step):
          self.save()   # a no-op when the checkpoint hook has just saved this step
          raise self._interrupted(stop, info.step, f"after step {info.step} of {c.train.steps}")
      for hook in self.hooks:
        hook.finish(self)
      if evaluating:
        try:
          summary["eval_after"] = self.evaluate("after")
        except StopRequested:
          self.save(force=True)
          raise self._interrupted(stop, c.train.steps, "during the evaluation after training") from None
        writer.write(c.train.steps, {f"eval/{k}": v for k, v in summary["eval_after"].items()
                                     if isinstance(v, float)})
      with progress.phase("saving the final checkpoint"):
        self.save(summary.get("eval_after"), force=True)
        self.ckpt.wait()
      summary["checkpoint_dir"] = self.ckpt.directory
      if stop.stop_after(c.train.steps):   # every process decides together (an all-gather)
        raise self._interrupted(stop, c.train.steps, "before the export")
      if c.output.export_hf and writing:
        with progress.phase(f"exporting to {os.path.join(self.out_dir, 'hf')}"):
          summary["hf_dir"] = self.export()
    finally:
      self.close()
      writer.close()
      self.ckpt.wait()
    summary["rollout"] = dict(self.runner.counts)
    summary["metrics_file"] = writer.path
    if c.output.tensorboard:
      summary["tensorboard_dir"] = os.path.join(self.out_dir, "tb")
    if c.output.wandb.project:
      summary["wandb_dir"] = os.path.join(self.out_dir, "wandb")
    if writing:   # last of all: a run with summary.json has done everything (rundir.check_resume)
      rundir.write_summary(self.out_dir, c.train.steps, summary)
    return summary

  # ---- evaluation, checkpoints, export -------------------------------------------------------

  def evaluate(self, tag: str) -> dict[str, Any]:
    from rljax.trainer.evaluate import evaluate_policy, prompts_per_batch
    c = self.config
    # eval.batch_size completions at once; 0: as many as a training step samples, at least 128 (the
    # default run's 128 examples in one batch: 2/3 of the CPU time of 8 at a time, and both cores busy).
    rows = c.eval.batch_size or max(128, self.batch_rows * self.sp.num_samples)
    stop = getattr(self, "_stop", None)
    return evaluate_policy(
        self.model_config, self.state.model_params(), self.tokenizer, self.eval_data, self.scorer.pool,
        num_examples=c.eval.num_examples, samples=c.eval.samples,
        sampling=sampling_params(c, self.tokenizer, num_samples=c.eval.samples, temperature=c.eval.temperature,
                                 max_new_tokens=c.eval.max_new_tokens or None),
        tool_rollout=self.tool_rollout if c.tools.enabled else None, prompt_tools=self.prompt_tools,
        max_prompt_tokens=c.data.max_prompt_tokens,
        batch_prompts=prompts_per_batch(rows, c.eval.samples, c.eval.num_examples),
        out_path=os.path.join(self.out_dir, f"eval_{tag}.jsonl"), seed=c.train.seed,
        label={"before": "eval before training", "after": "eval after training"}.get(
            tag, "eval at " + tag.replace("step", "step ")),
        progress=c.output.progress and jax.process_index() == 0, stop=stop.check if stop is not None else None,
        shared_prefix=c.eval.shared_prefix)

  def save(self, eval_metrics=None, force=False):
    # Only process 0 writes the extras, but each process reads its own shard of the data: keep all.
    data_by_process = shd.allgather_objects(self.data_state) if jax.process_count() > 1 else None
    extras = {"data": self.data_state, "config": json.loads(config_lib.to_json(self.config)),
              "metrics": self.history, "model_config": self.model_config.to_hf(),
              "tokenizer": self.config.tokenizer or self.config.model.path}
    if self.base_fingerprint is not None:   # LoRA: the adapters and the base they go on (config.model)
      extras[EXTRAS_BASE_FINGERPRINT] = self.base_fingerprint
    if data_by_process is not None:
      extras[EXTRAS_DATA_BY_PROCESS] = data_by_process
    metrics = None
    if eval_metrics:
      metrics = {f"eval/{k}": v for k, v in eval_metrics.items() if isinstance(v, float)}
    # Under LoRA only the adapters and their optimizer state are saved; the base is config.model's.
    saved = self.state.saved()
    if self.process_sides is not None:
      # Async across processes: orbax saves a jax.Array only when every process holds part of it, and
      # the generator process holds none of the learner's. Process 0, a learner, saves host copies.
      saved = jax.tree.map(_host_copy, saved)
    self.ckpt.save(int(shd.global_values(self.state.step)), saved, extras=extras, metrics=metrics, force=force)

  def export(self) -> str:
    """The trained model as a Hugging Face directory, `<output.dir>/hf`; under LoRA the adapters
    merged into the base there, and the adapters alone in PEFT's layout in `<output.dir>/peft`."""
    from rljax.models.io import save_pretrained
    from rljax.models.policy import Policy
    out = os.path.join(self.out_dir, "hf")
    dtype = self.config.output.export_dtype
    if self.model_config.lora is None:
      params = jax.device_get(self.state.params)
      save_pretrained(Policy(self.model_config, params, tokenizer=self.tokenizer), out, dtype=dtype)
      return out
    from rljax.models.builtin import peft_base_name
    from rljax.models.lora_io import save_peft_adapter
    base, adapters = jax.device_get((self.state.frozen, self.state.params))
    merged = lora.merge(self.model_config, base, adapters)
    save_pretrained(Policy(self.model_config.replace(lora=None), merged, tokenizer=self.tokenizer), out, dtype=dtype)
    save_peft_adapter(self.model_config, adapters, os.path.join(self.out_dir, "peft"),
                      base_model_name_or_path=peft_base_name(self.config.model.path))
    return out


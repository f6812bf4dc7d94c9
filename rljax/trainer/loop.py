"""The outer training loop: set up, resume, step, log, evaluate, checkpoint, export."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rljax import config as config_lib
from rljax import sharding as shd
from rljax.errors import ConfigError, RljaxError
from rljax.models.policy import Policy, init_params, param_shardings
from rljax.trainer.metrics import MetricsWriter, to_floats
from rljax.trainer.optim import make_optimizer
from rljax.trainer.state import TrainState
from rljax.trainer.step import StepSpec

log = logging.getLogger("rljax")


class TrainingStopped(RljaxError):
  """The run stopped on purpose (e.g. too many non-finite updates); the last good checkpoint is kept."""


class DataExhausted(TrainingStopped):
  """The training data ran out before train.steps; a checkpoint of the last step is saved first."""


def load_policy(model_cfg, tokenizer_path: str = "") -> Policy:
  """The policy named by config.model: pretrained weights, or a random model for tests."""
  from rljax.models.config import ModelConfig
  if model_cfg.path == "random":
    from rljax.tokenizer import load_tokenizer
    tok = load_tokenizer(tokenizer_path) if tokenizer_path else None
    r = model_cfg.random
    vocab = r.vocab_size or (tok.vocab_size if tok is not None else 0)
    if not vocab:
      raise ConfigError("config.model.random.vocab_size=0 needs config.tokenizer to be set (or give a vocab size).")
    mc = ModelConfig(vocab_size=vocab, hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
                     num_layers=r.num_layers, num_heads=r.num_heads, num_kv_heads=r.num_kv_heads,
                     head_dim=r.head_dim, architecture=r.architecture, tie_word_embeddings=r.tie_word_embeddings,
                     eos_token_ids=(tok.eos_id,) if tok is not None and tok.eos_id is not None else (),
                     dtype=model_cfg.dtype, remat=model_cfg.remat, max_position_embeddings=4096)
    return Policy(mc, init_params(mc, jax.random.key(r.seed)), tokenizer=tok, source="random")
  from rljax.models.io import load_pretrained
  policy = load_pretrained(model_cfg.path)
  policy = dataclasses.replace(policy, config=policy.config.replace(dtype=model_cfg.dtype, remat=model_cfg.remat))
  if tokenizer_path:
    from rljax.tokenizer import load_tokenizer
    policy = dataclasses.replace(policy, tokenizer=load_tokenizer(tokenizer_path))
  if policy.tokenizer is None:
    raise ConfigError(f"config.model.path={model_cfg.path!r} has no tokenizer; set config.tokenizer.")
  return policy


def sampling_params(cfg, tokenizer, *, greedy=False, max_new_tokens=None, num_samples=None, temperature=None,
                    stops=True):
  """SamplingParams from config.sampling; `stops=False` drops the stop tokens (sampling.ignore_eos)."""
  from rljax.sampling import SamplingParams
  s = cfg.sampling
  temp = s.temperature if temperature is None else temperature
  return SamplingParams(
      num_samples=num_samples or s.num_samples, max_new_tokens=max_new_tokens or s.max_new_tokens,
      temperature=temp if temp > 0 else 1.0, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
      greedy=greedy or temp == 0,
      stop_token_ids=tuple(sorted(set(tokenizer.stop_ids) | {int(i) for i in s.stop_token_ids})) if stops else ())


class Trainer:
  """Owns the pieces of a run. `Trainer(config).run()` trains and returns a summary dict."""

  def __init__(self, config: ml_collections.ConfigDict):
    config_lib.validate(config)
    self.config = config
    self.out_dir = config.output.dir
    os.makedirs(self.out_dir, exist_ok=True)
    shd.maybe_initialize_distributed(config.mesh.distributed or None)
    if config.rollout.mode != "fused" and jax.process_count() > 1:
      raise ConfigError(f"config.rollout.mode={config.rollout.mode!r} runs in one process for now; multi-process "
                        "runs use rollout.mode='fused'.")
    from rljax.trainer.rollouts import make_rollouts, split_devices
    learner_devices, generator_devices = split_devices(config)
    self.mesh = shd.make_mesh(tuple(config.mesh.shape), devices=learner_devices)
    self.generator_mesh = shd.make_mesh((-1, 1, 1), devices=generator_devices) if generator_devices else None
    self.policy = load_policy(config.model, config.tokenizer)
    self.tokenizer = self.policy.tokenizer
    config_lib.check_model_fits(config, self.policy.config.max_position_embeddings)
    self.loss_cfg = config_lib.loss_config(config)
    t = config.train
    self.oversample = t.oversample if t.dynamic_sampling else 1
    self._peak_flops: float | None = None
    # Rollouts honour sampling.ignore_eos; evaluation always stops at the tokenizer's stop tokens.
    self.sp = sampling_params(config, self.tokenizer, stops=not config.sampling.ignore_eos)
    self.spec = StepSpec(
        model=self.policy.config, sampling=self.sp, loss=self.loss_cfg, prompts=t.prompts_per_step,
        mini_batches=t.mini_batches, epochs=t.epochs, micro_batches=t.micro_batches,
        eos_ids=self.sp.stop_token_ids, oversample=self.oversample,
        recompute_old_logprobs=config_lib.recompute_old_logprobs(config))
    self.batch_rows = t.prompts_per_step * self.oversample    # prompts sampled per step, all processes
    self.total_updates = max(t.steps * t.mini_batches * t.epochs, 1)
    self.optimizer, self.schedule = make_optimizer(config.optim, self.total_updates)
    if jax.process_index() == 0:
      with open(os.path.join(self.out_dir, "config.json"), "w") as f:
        f.write(config_lib.to_json(config))
    self._setup_tools()
    self._setup_data()
    self._setup_rewards()
    self._setup_state()
    self.rollouts = make_rollouts(self)

  # ---- setup ------------------------------------------------------------------------------

  def _setup_tools(self):
    """The tool pool and the prompts' tool schemas, when config.tools.enabled (docs/tools.md)."""
    self.tool_runner, self.prompt_tools = None, None
    tl = self.config.tools
    if not tl.enabled:
      return
    from rljax.tools import ToolRunner
    self.tool_runner = ToolRunner(list(tl.names), timeout_s=tl.timeout_s, num_workers=tl.num_workers,
                                  max_memory_mb=tl.max_memory_mb,
                                  tool_kwargs=tl.kwargs.to_dict() if hasattr(tl.kwargs, "to_dict") else dict(tl.kwargs))
    if tl.format == "hermes":
      self.prompt_tools = self.tool_runner.schemas()

  def tool_rollout(self, sp):
    """A multi-turn rollout engine (rljax/multiturn.py) with sampling params `sp`."""
    from rljax.multiturn import ToolRollout, TurnParams
    tl = self.config.tools
    tp = TurnParams(max_turns=tl.max_turns, segment_tokens=tl.segment_tokens, slots=tl.slots,
                    max_response_tokens=tl.max_response_tokens)
    return ToolRollout(self.policy.config, self.tokenizer, self.tool_runner, sp, tp, fmt=tl.format,
                       eos_ids=sp.stop_token_ids)

  def _setup_data(self):
    from rljax.data import PromptBatcher, build_dataset
    c = self.config
    pi, pc = jax.process_index(), jax.process_count()
    if (c.train.prompts_per_step * self.oversample) % pc:
      raise ConfigError(f"config.train.prompts_per_step={c.train.prompts_per_step} must be divisible by the "
                        f"number of processes ({pc}).")
    data_cfg = c.data.to_dict()
    local_prompts = c.train.prompts_per_step * self.oversample // pc
    self.train_data = build_dataset(data_cfg, split="train", process_index=pi, process_count=pc,
                                    shard_block=local_prompts)
    self.batcher = PromptBatcher(self.train_data, self.tokenizer,
                                 prompts_per_batch=local_prompts,
                                 max_prompt_tokens=c.data.max_prompt_tokens, tools=self.prompt_tools)
    self._batches = iter(self.batcher)
    self.data_state = self.batcher.state()   # of the last batch trained on: what a checkpoint saves
    self.eval_data = None
    if c.eval.every or c.eval.before_and_after:
      self.eval_data = build_dataset(data_cfg, split="test", process_index=0, process_count=1)

  def _setup_rewards(self):
    from rljax.rewards import RewardPool, RewardSpec, make_reward_fn
    spec = RewardSpec.from_dict(self.config.rewards.to_dict())
    self.reward_spec = spec
    self.pool = RewardPool(spec)
    self.component_names = [comp["name"] for comp in spec.to_dict()["components"]] if hasattr(
        spec, "to_dict") else [comp.name for comp in spec.components]
    # Rewards come back sharded like the batch: left on one device, they pulled the fused step
    # off the mesh (6x slower on 8 simulated devices, measured).
    rows = self.batch_rows * self.sp.num_samples
    self.reward_fn = make_reward_fn(self.pool, self.tokenizer.batch_decode, group_size=self.sp.num_samples,
                                    sharding=shd.batch_sharding(self.mesh, 1, rows))

  def _setup_state(self):
    c = self.config
    mc = self.policy.config
    self.param_shardings = param_shardings(mc, self.mesh)
    params = jax.device_put(self.policy.params, self.param_shardings)
    ref = params if self.loss_cfg.needs_reference else None
    if ref is not None:
      ref = jax.tree.map(jnp.copy, ref)
    state = TrainState.create(params, self.optimizer, c.train.seed, ref_params=ref)
    self.state_shardings = _state_shardings(state, self.mesh, self.param_shardings)
    self.state = jax.device_put(state, self.state_shardings)
    self.batch_sharding = shd.batch_sharding(self.mesh, 2, self.batch_rows)
    from rljax.trainer.checkpoint import Checkpointer
    self.ckpt = Checkpointer(os.path.join(self.out_dir, "checkpoints"), keep_last=c.checkpoint.keep_last,
                             keep_best=c.checkpoint.keep_best, best_metric=c.checkpoint.best_metric,
                             async_save=c.checkpoint.async_save)
    self.history: list[dict] = []
    self.start_step = 0
    if c.checkpoint.resume and self.ckpt.latest_step() is not None:
      abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state,
                              self.state_shardings)
      self.state, extras = self.ckpt.restore(abstract_state=abstract)
      self.batcher.restore(extras["data"])
      self._batches = iter(self.batcher)
      self.data_state = self.batcher.state()
      self.history = extras.get("metrics", [])
      self.start_step = int(self.state.step)
      log.info("resumed from %s at step %d", self.ckpt.directory, self.start_step)
  # ---- the loop ---------------------------------------------------------------------------

  def next_prompts(self):
    """The next host-side PromptBatch; DataExhausted at the end of a finite dataset."""
    try:
      return next(self._batches)
    except StopIteration:
      raise DataExhausted("the dataset ran out (config.data.num_epochs reached); "
                          "raise num_epochs or set it to None to cycle forever.") from None

  def next_batch(self, sharding=None):
    """The next prompt batch, as (PromptBatch, ids, mask) with ids/mask [P*O, Lp] on `sharding`."""
    sharding = sharding or self.batch_sharding
    batch = self.next_prompts()
    ids = jax.make_array_from_process_local_data(sharding, np.asarray(batch.prompt_ids, np.int32))
    mask = jax.make_array_from_process_local_data(sharding, np.asarray(batch.prompt_mask, bool))
    return batch, ids, mask

  def run_step(self) -> dict[str, float]:
    """One rollout step (in config.rollout.mode); returns its host-side metrics."""
    return self.rollouts.step()

  def host_metrics(self, metrics: dict, reward_metrics: dict, step_s: float, phases: dict[str, float],
                   prompt_len: int) -> dict[str, float]:
    """A step's device metrics plus the reward pool's, timings (time/step, time/<phase>) and FLOP/s."""
    out = to_floats({k: v for k, v in metrics.items() if k != "reward/components"})
    for name, value in zip(self.component_names, np.asarray(metrics["reward/components"]).reshape(-1)):
      out[f"reward/{name}"] = float(value)
    out.update({k: float(v) for k, v in reward_metrics.items()})
    out["time/step"] = step_s
    out.update({f"time/{phase}": s for phase, s in phases.items()})
    out["throughput/tokens_per_s"] = out["response/tokens"] / max(step_s, 1e-9)
    out.update(self._perf_metrics(out, prompt_len=prompt_len))
    out["data/" + "filtered_too_long"] = float(self.batcher.stats().get("filtered_too_long", 0))
    return out

  def restart_reward_pool(self) -> None:
    """Replaces a failed reward pool with a fresh one (the rollout modes rescore on it)."""
    from rljax.rewards import RewardPool
    try:
      self.pool.close()
    except Exception:  # noqa: BLE001 - it has already failed
      pass
    self.pool = RewardPool(self.reward_spec)
    self.reward_fn.pool = self.pool

  def close(self) -> None:
    """Stops the rollout threads and the reward pool (run() does this itself)."""
    self.rollouts.close()
    self.pool.close()
    if self.tool_runner is not None:
      self.tool_runner.close()

  def _perf_metrics(self, m: dict[str, float], prompt_len: int) -> dict[str, float]:
    """Achieved FLOP/s per phase and as a fraction of the devices' peak (rljax/flops.py)."""
    from rljax import flops
    if self._peak_flops is None:
      self._peak_flops, source = flops.device_peak_flops(self.config.model.dtype)
      log.info("peak for perf/mfu: %.3g FLOP/s (%s)", self._peak_flops, source)
    t, spec = self.config.train, self.spec
    extra = int(self.loss_cfg.needs_reference) + int(spec.recompute_old_logprobs)
    work = flops.rollout_step_flops(
        spec.model, sample_prompts=t.prompts_per_step * self.oversample, update_prompts=t.prompts_per_step,
        group=spec.group, prompt_len=prompt_len, decode_steps=int(m["response_length_max"]),
        completion_len=spec.sampling.max_new_tokens, epochs=t.epochs, extra_forwards=extra)
    out = {"perf/flops_per_s": (work["sample"] + work["update"]) / max(m["time/step"], 1e-9)}
    out["perf/mfu"] = out["perf/flops_per_s"] / self._peak_flops
    # In the decoupled modes a phase's time is the wait for it, not its duration: no per-phase MFU.
    for phase in ("sample", "update") if self.config.rollout.mode == "fused" else ():
      if m.get(f"time/{phase}", 0.0) > 0:
        out[f"perf/{phase}_mfu"] = work[phase] / m[f"time/{phase}"] / self._peak_flops
    return out

  def run(self) -> dict[str, Any]:
    c = self.config
    writer = MetricsWriter(self.out_dir, tensorboard=c.output.tensorboard, writing=jax.process_index() == 0)
    summary: dict[str, Any] = {"output_dir": self.out_dir}
    try:
      if c.eval.before_and_after and self.eval_data is not None and self.start_step == 0:
        summary["eval_before"] = self.evaluate("before")
        writer.write(0, {f"eval/{k}": v for k, v in summary["eval_before"].items() if isinstance(v, float)})
      progress = _progress(c.train.steps, self.start_step, c.output.progress and jax.process_index() == 0)
      for step in range(self.start_step, c.train.steps):
        try:
          m = self.run_step()
        except DataExhausted:
          self.save(force=True)   # keep everything trained so far, then stop
          raise
        self.history.append({k: m[k] for k in ("reward/mean", "loss", "time/step") if k in m})
        writer.write(step + 1, m)
        progress.update(1)
        progress.set_postfix({"reward": f"{m.get('reward/mean', 0):.3f}", "loss": f"{m.get('loss', 0):.4f}",
                              "len": f"{m.get('response_length_mean', 0):.0f}", "s": f"{m['time/step']:.1f}",
                              "mfu": f"{m.get('perf/mfu', 0):.1%}"})
        if m.get("skipped_consecutive", 0) >= c.optim.max_consecutive_skips:
          raise TrainingStopped(
              f"{int(m['skipped_consecutive'])} consecutive updates had non-finite gradients "
              f"(config.optim.max_consecutive_skips={c.optim.max_consecutive_skips}); the run stopped. The last "
              f"good checkpoint is in {self.ckpt.directory}. Lower optim.learning_rate or check the rewards.")
        eval_metrics = None
        if c.eval.every and (step + 1) % c.eval.every == 0 and step + 1 < c.train.steps:
          eval_metrics = self.evaluate(f"step{step + 1}")
          writer.write(step + 1, {f"eval/{k}": v for k, v in eval_metrics.items() if isinstance(v, float)})
        # Only a step whose update went through is a "good" checkpoint.
        if c.checkpoint.every and (step + 1) % c.checkpoint.every == 0 and m.get("skipped_consecutive", 0) == 0:
          self.save(eval_metrics)
      progress.close()
      if c.eval.before_and_after and self.eval_data is not None:
        summary["eval_after"] = self.evaluate("after")
        writer.write(c.train.steps, {f"eval/{k}": v for k, v in summary["eval_after"].items()
                                     if isinstance(v, float)})
      self.save(summary.get("eval_after"), force=True)
      self.ckpt.wait()
      summary["checkpoint_dir"] = self.ckpt.directory
      if c.output.export_hf and jax.process_index() == 0:
        summary["hf_dir"] = self.export()
    finally:
      self.rollouts.close()
      writer.close()
      self.ckpt.wait()
      self.pool.close()
      if self.tool_runner is not None:
        self.tool_runner.close()
    if self.config.rollout.mode != "fused":
      summary["rollout"] = dict(self.rollouts.counts)
    summary["metrics_file"] = writer.path
    if c.output.tensorboard:
      summary["tensorboard_dir"] = os.path.join(self.out_dir, "tb")
    return summary

  # ---- evaluation, checkpoints, export -------------------------------------------------------

  def evaluate(self, tag: str) -> dict[str, Any]:
    from rljax.trainer.evaluate import evaluate_policy
    c = self.config
    return evaluate_policy(
        self.policy.config, self.state.params, self.tokenizer, self.eval_data, self.pool,
        num_examples=c.eval.num_examples, samples=c.eval.samples,
        sampling=sampling_params(c, self.tokenizer, num_samples=c.eval.samples, temperature=c.eval.temperature,
                                 max_new_tokens=c.eval.max_new_tokens or None),
        tool_rollout=self.tool_rollout if c.tools.enabled else None, prompt_tools=self.prompt_tools,
        max_prompt_tokens=c.data.max_prompt_tokens, batch_prompts=max(c.train.prompts_per_step, 8),
        out_path=os.path.join(self.out_dir, f"eval_{tag}.jsonl"), seed=c.train.seed)

  def save(self, eval_metrics=None, force=False):
    extras = {"data": self.data_state, "config": json.loads(config_lib.to_json(self.config)),
              "metrics": self.history, "model_config": self.policy.config.to_hf(),
              "tokenizer": self.config.tokenizer or self.config.model.path}
    metrics = None
    if eval_metrics:
      metrics = {f"eval/{k}": v for k, v in eval_metrics.items() if isinstance(v, float)}
    self.ckpt.save(int(self.state.step), self.state, extras=extras, metrics=metrics, force=force)

  def export(self) -> str:
    from rljax.models.io import save_pretrained
    out = os.path.join(self.out_dir, "hf")
    params = jax.device_get(self.state.params)
    save_pretrained(self.policy.with_params(params), out, dtype=self.config.output.export_dtype)
    return out


def _state_shardings(state: TrainState, mesh, param_sh):
  """Params, ref params and param-shaped optimizer moments by logical axes; everything else replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  param_struct = jax.tree.structure(state.params)
  is_param_tree = lambda n: jax.tree.structure(n) == param_struct
  opt_sh = jax.tree.map(lambda n: param_sh if is_param_tree(n) else replicated, state.opt_state,
                        is_leaf=is_param_tree)
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                    skipped_total=replicated, skipped_consecutive=replicated,
                    ref_params=None if state.ref_params is None else param_sh)


def _progress(total: int, start: int, enabled: bool):
  from tqdm.auto import tqdm
  return tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)

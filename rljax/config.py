"""The run configuration: one ml_collections ConfigDict, validated before anything heavy starts.

Every recipe under `configs/` starts from `base_config()` and changes fields; the CLI
applies `--config.a.b=value` overrides on top. The dict is locked, so a typo in a
field name is an error, not a silently ignored setting.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections

from rljax.errors import ConfigError

SCHEDULES = ("constant", "cosine", "linear")
ROLLOUT_MODES = ("fused", "pipelined", "async", "partial")
PROXIMAL = ("recompute", "sampler")   # the off-policy modes' lp_old (docs/rollouts.md)
ASYNC_ONLY = ("generator_devices", "sync_every", "queue_size")   # rollout fields only the async mode reads
PARTIAL_ONLY = ("oversample",)                                    # rollout fields only the partial mode reads


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by every recipe (the embedded default changes a few)."""
  c = ml_collections.ConfigDict()

  c.model = ml_collections.ConfigDict(dict(
      path="smollm2-135m-instruct",   # HF dir, .gguf file, or built-in name; "random" builds model.random
      dtype="float32",                # compute dtype of activations
      remat=False,                    # recompute layer activations in the backward pass
      random=ml_collections.ConfigDict(dict(   # used when path == "random" (tests, smoke runs)
          vocab_size=0, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
          num_kv_heads=2, head_dim=16, architecture="llama", tie_word_embeddings=True, seed=0)),
  ))
  c.tokenizer = ""                    # defaults to model.path
  c.data = ml_collections.ConfigDict(dict(   # the data pipeline's fields: see docs/data.md
      sources=[dict(kind="arithmetic", weight=1.0, verifier="arithmetic", difficulty=1)],
      system_prompt="",
      prompt_template="{prompt}",
      max_prompt_tokens=128,
      on_malformed="skip",
      shuffle=True,
      seed=0,
      num_epochs=None,
      chat_template=True,
  ), type_safe=False)
  c.sampling = ml_collections.ConfigDict(dict(
      num_samples=8,                  # G: completions per prompt
      max_new_tokens=128,
      temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
      ignore_eos=False,               # generate max_new_tokens in every row (benchmarks; vLLM's ignore_eos)
      stop_token_ids=[],              # extra ids that end a completion, besides the tokenizer's stop tokens
  ), type_safe=False)
  # A preset plus every LossConfig field; None keeps the preset's value (docs/loss.md).
  from rljax.rl.config import LossConfig
  c.rl = ml_collections.ConfigDict(
      dict(preset="grpo", **{f.name: None for f in dataclasses.fields(LossConfig)}), type_safe=False)
  c.rewards = ml_collections.ConfigDict(dict(
      components=[dict(name="correct", verifier="arithmetic", weight=1.0)],
      timeout_s=5.0, batch_deadline_s=120.0, fallback=0.0, num_workers=2, max_memory_mb=2048,
  ), type_safe=False)
  c.optim = ml_collections.ConfigDict(dict(
      learning_rate=1e-6, schedule="constant", warmup_steps=0, min_lr_ratio=0.0,
      weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, max_grad_norm=1.0,
      max_consecutive_skips=5,        # stop the run after this many non-finite updates in a row
  ))
  c.train = ml_collections.ConfigDict(dict(
      steps=10,                       # rollout steps (each: sample, score, 1+ optimizer updates)
      prompts_per_step=8,             # prompts sampled per step; completions = prompts * num_samples
      mini_batches=1,                 # optimizer updates per rollout batch per epoch
      epochs=1,                       # passes over each rollout batch
      micro_batches=1,                # gradient accumulation: splits each mini-batch (by whole groups)
      seed=0,
      dynamic_sampling=False,         # DAPO: drop zero-variance groups, refill from oversampled prompts
      oversample=2,                   # with dynamic_sampling: prompts sampled = prompts_per_step * oversample
  ))
  # How generation, scoring and updates are scheduled (docs/rollouts.md).
  c.rollout = ml_collections.ConfigDict(dict(
      mode="fused",                   # fused | pipelined | async
      max_staleness=-1,               # policy versions a sample may lag; -1 = the mode's default (1)
      proximal="recompute",           # off-policy lp_old: recompute (decoupled PPO) | sampler (PPO on behaviour)
      generator_devices=0,            # async: devices of the generator part of the mesh (0 = half)
      sync_every=1,                   # async: publish parameters to the generators every N updates
      queue_size=2,                   # async: scored batches waiting for the learner
      oversample=2,                   # partial: prompt groups in generation per group trained
  ))
  # Multi-turn tool use (docs/tools.md): the model calls tools mid-generation, the host answers.
  c.tools = ml_collections.ConfigDict(dict(
      enabled=False,
      names=["python"],               # tool refs: python, calculator, search, or "pkg.module:function"
      format="hermes",                # hermes (<tool_call>{json}</tool_call>) | python (```python blocks)
      max_turns=4,                    # tool calls per trajectory
      segment_tokens=64,              # decode steps per compiled segment
      slots=0,                        # KV-cache slots after the prompt (0 = 2 * sampling.max_new_tokens)
      max_response_tokens=256,        # tool-response tokens kept per call
      timeout_s=10.0, num_workers=2, max_memory_mb=2048,   # the tool pool (like config.rewards)
      kwargs={},                      # per-tool keyword arguments, e.g. {"search": {"corpus_path": "docs.jsonl"}}
  ), type_safe=False)
  c.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1, 1), distributed=False))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every=0, keep_last=2, keep_best=1, best_metric="eval/accuracy", async_save=True, resume=True))
  c.eval = ml_collections.ConfigDict(dict(
      every=0, num_examples=64, samples=1, temperature=0.0, max_new_tokens=0, before_and_after=True))
  c.output = ml_collections.ConfigDict(dict(
      dir="runs/default", export_hf=True, export_dtype="bfloat16", tensorboard=True, progress=True))
  return c


def lock(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  c.lock()
  return c


def _positive(c, path: str, value, allow_zero=False):
  if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
    raise ConfigError(f"config.{path}={value!r} must be an integer {'>= 0' if allow_zero else '>= 1'}.")


def validate(c: ml_collections.ConfigDict) -> None:
  """Checks types, ranges and contradictions; raises ConfigError naming the field and the fix."""
  s, t, o = c.sampling, c.train, c.optim
  _positive(c, "sampling.num_samples", s.num_samples)
  _positive(c, "sampling.max_new_tokens", s.max_new_tokens)
  _positive(c, "train.steps", t.steps, allow_zero=True)
  _positive(c, "train.prompts_per_step", t.prompts_per_step)
  _positive(c, "train.mini_batches", t.mini_batches)
  _positive(c, "train.epochs", t.epochs)
  _positive(c, "train.micro_batches", t.micro_batches)
  _positive(c, "data.max_prompt_tokens", c.data.max_prompt_tokens)
  if t.prompts_per_step % (t.mini_batches * t.micro_batches):
    raise ConfigError(
        f"config.train.prompts_per_step={t.prompts_per_step} must be divisible by train.mini_batches * "
        f"train.micro_batches = {t.mini_batches * t.micro_batches} (batches are split by whole prompt groups).")
  ids = s.stop_token_ids
  if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                   for i in ids):
    raise ConfigError(f"config.sampling.stop_token_ids={ids!r} must be a list of non-negative token ids.")
  if s.temperature < 0:
    raise ConfigError(f"config.sampling.temperature={s.temperature} must be >= 0 (0 means greedy).")
  if not 0.0 < s.top_p <= 1.0:
    raise ConfigError(f"config.sampling.top_p={s.top_p} must be in (0, 1].")
  if o.learning_rate <= 0:
    raise ConfigError(f"config.optim.learning_rate={o.learning_rate} must be > 0.")
  if o.schedule not in SCHEDULES:
    raise ConfigError(f"config.optim.schedule={o.schedule!r} is not one of {SCHEDULES}.")
  if o.warmup_steps < 0 or (t.steps and o.warmup_steps > t.steps * t.mini_batches * t.epochs):
    raise ConfigError(f"config.optim.warmup_steps={o.warmup_steps} must be between 0 and the number of "
                      f"optimizer updates ({t.steps * t.mini_batches * t.epochs}).")
  if o.max_grad_norm is not None and o.max_grad_norm <= 0:
    raise ConfigError(f"config.optim.max_grad_norm={o.max_grad_norm} must be > 0 (or None to disable clipping).")
  if c.model.dtype not in ("float32", "bfloat16"):
    raise ConfigError(f"config.model.dtype={c.model.dtype!r} must be 'float32' or 'bfloat16'.")
  if t.dynamic_sampling and t.oversample < 1:
    raise ConfigError(f"config.train.oversample={t.oversample} must be >= 1.")
  if len(c.mesh.shape) != 3:
    raise ConfigError(f"config.mesh.shape={tuple(c.mesh.shape)} must have 3 entries (data, fsdp, tensor).")
  loss_config(c).validate(group_size=s.num_samples)
  _validate_rollout(c)
  _validate_tools(c)
  if c.eval.samples < 1:
    raise ConfigError(f"config.eval.samples={c.eval.samples} must be >= 1.")


def _validate_rollout(c: ml_collections.ConfigDict) -> None:
  r = c.rollout
  if r.mode not in ROLLOUT_MODES:
    raise ConfigError(f"config.rollout.mode={r.mode!r} is not one of {ROLLOUT_MODES}.")
  if not isinstance(r.max_staleness, int) or r.max_staleness < -1:
    raise ConfigError(f"config.rollout.max_staleness={r.max_staleness!r} must be an integer >= 0 "
                      "(or -1 for the mode's default).")
  if r.mode == "fused" and r.max_staleness not in (-1, 0):
    raise ConfigError(f"config.rollout.max_staleness={r.max_staleness} has no effect in rollout.mode='fused' "
                      "(always on-policy): set rollout.mode='pipelined' or 'async', or leave max_staleness=-1.")
  if r.proximal not in PROXIMAL:
    raise ConfigError(f"config.rollout.proximal={r.proximal!r} is not one of {PROXIMAL}.")
  if r.mode == "fused" and r.proximal != "recompute":
    raise ConfigError(f"config.rollout.proximal={r.proximal!r} has no effect in rollout.mode='fused' (lp_old is "
                      "always the sampler's there): set rollout.mode='pipelined' or 'async', or leave it.")
  if r.mode == "pipelined" and r.max_staleness > 1:
    raise ConfigError(f"config.rollout.max_staleness={r.max_staleness}: the pipelined mode runs at most one "
                      "step off-policy (0 or 1); use rollout.mode='async' for more.")
  defaults = base_config().rollout
  if r.mode != "partial":
    for name in PARTIAL_ONLY:
      if r[name] != defaults[name]:
        raise ConfigError(f"config.rollout.{name}={r[name]!r} only applies to rollout.mode='partial' "
                          f"(got {r.mode!r}): set rollout.mode='partial' or leave it at {defaults[name]}.")
  else:
    _positive(c, "rollout.oversample", r.oversample)
    if r.oversample < 2:
      raise ConfigError(f"config.rollout.oversample={r.oversample}: the partial mode generates more groups than it "
                        "trains on (>= 2); with 1 use rollout.mode='pipelined'.")
    if c.train.dynamic_sampling:
      raise ConfigError("config.train.dynamic_sampling with rollout.mode='partial': both choose which groups to "
                        "train on; use one of them.")
    if c.sampling.ignore_eos:
      raise ConfigError("config.sampling.ignore_eos with rollout.mode='partial': every completion would run to "
                        "max_new_tokens, so there is nothing to carry over; set ignore_eos=False.")
  if r.mode != "async":
    for name in ASYNC_ONLY:
      if r[name] != defaults[name]:
        raise ConfigError(f"config.rollout.{name}={r[name]!r} only applies to rollout.mode='async' "
                          f"(got {r.mode!r}): set rollout.mode='async' or leave it at {defaults[name]}.")
    return
  _positive(c, "rollout.sync_every", r.sync_every)
  _positive(c, "rollout.queue_size", r.queue_size)
  _positive(c, "rollout.generator_devices", r.generator_devices, allow_zero=True)
  if r.sync_every > max_staleness(c) + 1:
    raise ConfigError(
        f"config.rollout.sync_every={r.sync_every} with max_staleness={max_staleness(c)} would stall: a "
        "generator waits for parameters no older than max_staleness versions, which arrive every sync_every "
        "updates. Set sync_every <= max_staleness + 1.")


TOOL_FORMATS = ("hermes", "python")


def _validate_tools(c: ml_collections.ConfigDict) -> None:
  tl = c.tools
  if not tl.enabled:
    return
  if tl.format not in TOOL_FORMATS:
    raise ConfigError(f"config.tools.format={tl.format!r} is not one of {TOOL_FORMATS}.")
  names = list(tl.names or [])
  if not names or not all(isinstance(n, str) and n for n in names):
    raise ConfigError(f"config.tools.names={tl.names!r}: list at least one tool (python, calculator, search, "
                      "or 'pkg.module:function').")
  if tl.format == "python" and names != ["python"]:
    raise ConfigError(f"config.tools.format='python' runs ```python blocks in the interpreter; it takes "
                      f"tools.names=['python'], got {names}. Use format='hermes' for named tools.")
  for name in ("max_turns", "segment_tokens", "max_response_tokens", "max_memory_mb"):
    _positive(c, f"tools.{name}", tl[name])
  _positive(c, "tools.slots", tl.slots, allow_zero=True)
  _positive(c, "tools.num_workers", tl.num_workers, allow_zero=True)
  if not tl.timeout_s > 0:
    raise ConfigError(f"config.tools.timeout_s={tl.timeout_s!r} must be > 0.")
  if c.rollout.mode != "fused":
    raise ConfigError(f"config.tools.enabled with rollout.mode={c.rollout.mode!r}: multi-turn rollouts alternate "
                      "compiled decode segments with host tool calls and run on-policy; set rollout.mode='fused'.")
  if c.sampling.ignore_eos:
    raise ConfigError("config.tools.enabled with sampling.ignore_eos=True: a trajectory must be able to end; "
                      "set sampling.ignore_eos=False.")


def max_staleness(c: ml_collections.ConfigDict) -> int:
  """The staleness bound in effect: 0 in fused mode, the configured value or 1 otherwise."""
  r = c.rollout
  if r.mode == "fused":
    return 0
  return 1 if r.max_staleness == -1 else r.max_staleness


def recompute_old_logprobs(c: ml_collections.ConfigDict) -> bool:
  """Whether the update recomputes lp_old (off-policy batches with rollout.proximal='recompute')."""
  return max_staleness(c) > 0 and c.rollout.proximal == "recompute"


# Off-policy modes correct with truncated IS against the sampler; this cap is used unless rl.tis_cap is set.
DEFAULT_OFF_POLICY_TIS_CAP = 2.0


def loss_config(c: ml_collections.ConfigDict):
  """The LossConfig named by config.rl (a preset plus overrides).

  In an off-policy rollout mode (max_staleness > 0) with rl.tis_cap unset and lp_old
  recomputed (rollout.proximal='recompute'), the truncated IS weight against the sampler is on
  with cap DEFAULT_OFF_POLICY_TIS_CAP (decoupled PPO). With proximal='sampler', lp_old is the
  sampler's and the IS weight would be 1.
  """
  from rljax.rl import LossConfig
  fields = {k: v for k, v in c.rl.to_dict().items() if v is not None}
  preset = fields.pop("preset", "grpo")
  if recompute_old_logprobs(c):
    fields.setdefault("tis_cap", DEFAULT_OFF_POLICY_TIS_CAP)
  return LossConfig.from_preset(preset, **fields)


def check_model_fits(c: ml_collections.ConfigDict, max_position_embeddings: int) -> None:
  """Contradiction between the data/sampling lengths and the model's context."""
  need = c.data.max_prompt_tokens + c.sampling.max_new_tokens
  if need > max_position_embeddings:
    raise ConfigError(
        f"config.data.max_prompt_tokens + config.sampling.max_new_tokens = {need} exceeds the model's context "
        f"of {max_position_embeddings} tokens; lower one of them.")


def to_json(c: ml_collections.ConfigDict) -> str:
  return json.dumps(c.to_dict(), indent=2, sort_keys=True, default=str)

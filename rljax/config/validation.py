"""Validation of the run config: types, ranges and contradictions, before anything heavy starts.

Every check raises ConfigError naming the field (`config.train.steps=...`) and the fix. The
lists of allowed values come from their owners (attention backends from rljax.models.config,
tool formats from rljax.tools, schedules from rljax.trainer.optim, rollout modes and what each
supports from the registry rljax.trainer.modes).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import ml_collections

from rljax import sharding as shd
from rljax.config.derive import dynamic_oversample, lora_config, loss_config, max_staleness
from rljax.config.schema import base_config
from rljax.data.config import eval_reads_training_data
from rljax.errors import ConfigError
from rljax.models.config import ATTENTION_IMPLS, MOE_DISPATCH, MOE_KERNELS
from rljax.objectives import CE_OBJECTIVES, OBJECTIVES
from rljax.rewards.routing import source_verifiers_from_data
from rljax.rewards.spec import RewardSpec
from rljax.rl.config import LossConfig
from rljax.tools.parsing import FORMATS as TOOL_FORMATS
from rljax.trainer import modes
from rljax.trainer.optim import SCHEDULES

ROLLOUT_MODES = tuple(modes.MODES)
PROXIMAL = ("recompute", "sampler")   # the off-policy modes' lp_old (docs/rollouts.md)
# The compute dtypes a run trains in (ModelConfig also takes float16, for inference).
MODEL_DTYPES = ("float32", "bfloat16")
WANDB_MODES = ("online", "offline")


def _positive(c, path: str, value, allow_zero=False):
  if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
    raise ConfigError(f"config.{path}={value!r} must be an integer {'>= 0' if allow_zero else '>= 1'}.")


def validate(c: ml_collections.ConfigDict) -> None:
  """Checks types, ranges and contradictions; raises ConfigError naming the field and the fix."""
  _validate_finite(c)
  s, t, o = c.sampling, c.train, c.optim
  _positive(c, "sampling.num_samples", s.num_samples)
  _positive(c, "sampling.max_new_tokens", s.max_new_tokens)
  _positive(c, "train.steps", t.steps, allow_zero=True)
  _positive(c, "train.prompts_per_step", t.prompts_per_step)
  _positive(c, "train.mini_batches", t.mini_batches)
  _positive(c, "train.epochs", t.epochs)
  _positive(c, "train.micro_batches", t.micro_batches)
  _validate_packing(c)
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
  _validate_slots(c)
  if o.learning_rate <= 0:
    raise ConfigError(f"config.optim.learning_rate={o.learning_rate} must be > 0.")
  if o.schedule not in SCHEDULES:
    raise ConfigError(f"config.optim.schedule={o.schedule!r} is not one of {SCHEDULES}.")
  if o.warmup_steps < 0 or (t.steps and o.warmup_steps > t.steps * t.mini_batches * t.epochs):
    raise ConfigError(f"config.optim.warmup_steps={o.warmup_steps} must be between 0 and the number of "
                      f"optimizer updates ({t.steps * t.mini_batches * t.epochs}).")
  if o.max_grad_norm is not None and o.max_grad_norm <= 0:
    raise ConfigError(f"config.optim.max_grad_norm={o.max_grad_norm} must be > 0 (or None to disable clipping).")
  if c.model.dtype not in MODEL_DTYPES:
    raise ConfigError(f"config.model.dtype={c.model.dtype!r} must be 'float32' or 'bfloat16'.")
  if c.model.attention not in ATTENTION_IMPLS:
    raise ConfigError(f"config.model.attention={c.model.attention!r} is not one of {ATTENTION_IMPLS}.")
  lora_config(c)   # raises on a bad rank, alpha, dropout or target
  _validate_moe(c)
  if not t.dynamic_sampling and t.oversample is not None:
    raise ConfigError(f"config.train.oversample={t.oversample} only applies with config.train.dynamic_sampling=True "
                      "(it would be ignored): set train.dynamic_sampling=True or drop train.oversample.")
  if dynamic_oversample(c) < 1:
    raise ConfigError(f"config.train.oversample={t.oversample} must be >= 1.")
  shd.check_mesh_shape(c.mesh.shape, "config.mesh.shape")
  _validate_objective(c)
  _validate_group_size(c)
  _validate_rollout(c)
  _validate_tools(c)
  if c.eval.samples < 1:
    raise ConfigError(f"config.eval.samples={c.eval.samples} must be >= 1.")
  _positive(c, "eval.batch_size", c.eval.batch_size, allow_zero=True)
  _validate_eval_data(c)
  _validate_lora_rank(c)
  _validate_batch_axes(c)
  _validate_rewards(c)
  _validate_run_control(c)


def _validate_moe(c: ml_collections.ConfigDict) -> None:
  """config.model.moe: values only (whether the model is a mixture of experts is known once its
  config is read: rljax.trainer.setup.run_model_config refuses these fields for a dense model)."""
  m = c.model.moe
  if m.routing_replay not in (True, False, "auto"):
    raise ConfigError(f"config.model.moe.routing_replay={m.routing_replay!r} must be True, False or 'auto' (on "
                      "unless model.dtype is float32).")
  for name in ("aux_loss_coef", "z_loss_coef"):
    v = m[name]
    if v is None and name == "aux_loss_coef":
      continue
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
      raise ConfigError(f"config.model.moe.{name}={v!r} must be a finite number >= 0 (0 = off).")
  if m.kernel not in MOE_KERNELS:
    raise ConfigError(f"config.model.moe.kernel={m.kernel!r} is not one of {MOE_KERNELS}.")
  if m.dispatch not in MOE_DISPATCH:
    raise ConfigError(f"config.model.moe.dispatch={m.dispatch!r} is not one of {MOE_DISPATCH}.")


def _validate_run_control(c: ml_collections.ConfigDict) -> None:
  """Stop signals, and the optional Weights & Biases logging."""
  from rljax.trainer.stopping import parse_signals
  signals = c.train.stop_signals
  if not isinstance(signals, (list, tuple)):
    raise ConfigError(f"config.train.stop_signals={signals!r} must be a list of signal names, e.g. "
                      "['SIGINT', 'SIGTERM'] (or [] for the default behaviour).")
  parse_signals(signals)
  d = c.train.process_deadline_s
  if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d < float("inf"):
    raise ConfigError(f"config.train.process_deadline_s={d!r} must be a number of seconds >= 0 (0 = no deadline: "
                      "the end-of-step agreement then waits up to an hour for the other processes).")
  w = c.output.wandb
  if w.mode not in WANDB_MODES:
    raise ConfigError(f"config.output.wandb.mode={w.mode!r} is not one of {WANDB_MODES}.")
  if w.project:
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
      raise ConfigError(f"config.output.wandb.project={w.project!r} logs to Weights & Biases, which is not "
                        "installed: pip install wandb (or 'rljax[wandb]'), or set output.wandb.project=''.")
  elif w.name or w.entity:
    raise ConfigError("config.output.wandb.name / entity are set but output.wandb.project is empty, so nothing "
                      "would be logged to Weights & Biases: set output.wandb.project too, or leave them empty.")


def _validate_objective(c: ml_collections.ConfigDict) -> None:
  """train.objective and its own sections (sft, rft, distill): a section's field set under another objective
  would be ignored, so it is refused; so are the RL settings the cross-entropy objectives do not read."""
  objective = c.train.objective
  if objective not in OBJECTIVES:
    raise ConfigError(f"config.train.objective={objective!r} is not one of {OBJECTIVES}.")
  defaults = base_config()
  for section, owner in (("sft", "sft"), ("rft", "rft"), ("distill", "distill")):
    if objective == owner:
      continue
    for name, value in c[section].items():
      if value != defaults[section][name]:
        raise ConfigError(f"config.{section}.{name}={value!r} only applies to train.objective={owner!r} (got "
                          f"{objective!r}): set train.objective={owner!r} or leave it at {defaults[section][name]!r}.")
  if objective in CE_OBJECTIVES:
    used = ("agg", "agg_norm")
    preset = dataclasses.asdict(LossConfig.from_preset(defaults.rl.preset))   # what an untouched rl section means
    for name, value in c.rl.items():
      off = name in ("kl_coef", "entropy_coef") and value == 0   # a regulariser turned off: nothing to ignore
      if name not in used and value is not None and not off and value != preset.get(name, defaults.rl[name]):
        raise ConfigError(f"config.rl.{name}={value!r} has no effect with train.objective={objective!r} (a "
                          f"cross-entropy loss: only rl.agg, default 'token-mean', and rl.agg_norm apply): leave it "
                          "unset, or use train.objective='rl'.")
    if c.train.dynamic_sampling:
      raise ConfigError(f"config.train.dynamic_sampling with train.objective={objective!r}: it selects groups by "
                        "reward spread, which a cross-entropy step does not use; set train.dynamic_sampling=False.")
    if not isinstance(c.rft.min_reward, (int, float)) or isinstance(c.rft.min_reward, bool):
      raise ConfigError(f"config.rft.min_reward={c.rft.min_reward!r} must be a number.")
  if objective == "sft":
    if c.rollout.mode != defaults.rollout.mode or c.tools.enabled:
      what = f"rollout.mode={c.rollout.mode!r}" if c.rollout.mode != defaults.rollout.mode else "tools.enabled"
      raise ConfigError(f"config.{what} with train.objective='sft': supervised fine-tuning samples nothing (its "
                        "targets come from the data); leave rollout.mode='fused' and tools.enabled=False.")
    template = c.sft.response_template
    if not isinstance(template, str) or not template.strip():
      raise ConfigError(f"config.sft.response_template={template!r} must be a non-empty format string such as "
                        "'{response}' or '{answer}'.")
    from rljax.data.config import template_fields
    template_fields(template, "config.sft.response_template")
  if objective == "distill":
    if not c.distill.teacher:
      raise ConfigError("config.distill.teacher is empty: train.objective='distill' needs a teacher model (an HF "
                        "directory, .gguf file or built-in name with the student's vocabulary), e.g. the export of "
                        "an RL run: --config.distill.teacher=runs/default/hf.")
    if c.model.lora.rank and c.distill.teacher == c.model.path:
      raise ConfigError("config.distill.teacher is the LoRA student's own base model (model.path): the student "
                        "starts as the teacher, so the reverse KL and every advantage start at 0 and the run learns "
                        "nothing; distil from a stronger model.")


def _validate_group_size(c: ml_collections.ConfigDict) -> None:
  """The loss's group statistics against G = sampling.num_samples, named as run-config fields."""
  if c.train.objective in CE_OBJECTIVES:
    return
  lc = loss_config(c)
  try:
    lc.validate(group_size=c.sampling.num_samples)
  except ConfigError:
    g = c.sampling.num_samples
    if g >= 2:
      raise
    needs = [f"rl.std_scope={lc.std_scope!r}"] if lc.std_scope == "group" else []
    needs += [f"rl.mean_scope={lc.mean_scope!r}"] if lc.mean_scope in ("group", "rloo") else []
    raise ConfigError(
        f"config.sampling.num_samples={g}: rl.preset={c.rl.preset!r} uses {' and '.join(needs)}, which compare "
        "the completions of one prompt with each other, and a group of one has no spread (every advantage "
        "would be 0). Set sampling.num_samples >= 2 (G completions per prompt), or use batch statistics: "
        "rl.std_scope='batch' (or 'none') and rl.mean_scope='batch' (or 'none').") from None


def _validate_eval_data(c: ml_collections.ConfigDict) -> None:
  """Refuses an evaluation whose test split would read the training data (docs/data.md)."""
  if not (c.eval.every or c.eval.before_and_after) or c.eval.allow_training_data:
    return
  overlaps = eval_reads_training_data(c.data.to_dict())
  if overlaps:
    raise ConfigError(
        f"config.{overlaps[0]}: the held-out evaluation (eval.every, eval.before_and_after) reads its 'test' "
        "split from the same place as training, so eval/accuracy and the best checkpoint would be measured on "
        "training prompts. Give the source one path per split, e.g. path={'train': '/data/train.jsonl', "
        "'test': '/data/test.jsonl'}; or turn evaluation off (eval.every=0, eval.before_and_after=False); or "
        "set eval.allow_training_data=True to evaluate on training data on purpose.")


def _validate_slots(c: ml_collections.ConfigDict) -> None:
  """sampling.slots: the single-turn sampler's decode slots (docs/sampling.md). Whether the mesh's
  batch shards divide it is checked once the mesh exists (rljax.rollout.slots.check_blocks)."""
  s = c.sampling
  _positive(c, "sampling.slots", s.slots, allow_zero=True)
  if not s.slots:
    return
  prompts = c.train.prompts_per_step * dynamic_oversample(c)
  rows = prompts * s.num_samples
  if s.slots > rows:
    raise ConfigError(f"config.sampling.slots={s.slots} is more than the rows sampled per step ({prompts} prompts x "
                      f"{s.num_samples} samples = {rows}); every row already has a slot: set at most {rows}, or 0.")
  if c.tools.enabled:
    raise ConfigError(
        "config.sampling.slots with tools.enabled: decode slots are the single-turn sampler's; the multi-turn "
        "engine decodes every trajectory in its own row while others wait for tools (its tools.slots is the "
        "cache length of each row, another thing). Leave sampling.slots=0.")
  if c.rollout.mode == "partial":
    raise ConfigError(
        "config.sampling.slots with rollout.mode='partial': the partial mode already refills its decode batch "
        "between rounds (finished groups leave the pool, fresh ones join) and decodes every row of its pool from "
        "its own history; size that batch with rollout.oversample. Leave sampling.slots=0.")


def _names(names) -> str:
  return " or ".join(repr(n) for n in names)


def _validate_rollout(c: ml_collections.ConfigDict) -> None:
  """config.rollout against what its mode declares it supports (rljax/trainer/modes.py)."""
  r = c.rollout
  mode = modes.get(r.mode)
  off_policy = [m.name for m in modes.MODES.values() if not m.on_policy_only]
  if not isinstance(r.max_staleness, int) or r.max_staleness < -1:
    raise ConfigError(f"config.rollout.max_staleness={r.max_staleness!r} must be an integer >= 0 "
                      "(or -1 for the mode's default).")
  if mode.on_policy_only and r.max_staleness not in (-1, 0):
    raise ConfigError(f"config.rollout.max_staleness={r.max_staleness} has no effect in rollout.mode={mode.name!r} "
                      f"(always on-policy): set rollout.mode={_names(off_policy)}, or leave max_staleness=-1.")
  if r.proximal not in PROXIMAL:
    raise ConfigError(f"config.rollout.proximal={r.proximal!r} is not one of {PROXIMAL}.")
  if mode.on_policy_only and r.proximal != "recompute" and c.model.dtype == "float32":
    raise ConfigError(f"config.rollout.proximal={r.proximal!r} has no effect in rollout.mode={mode.name!r} with "
                      f"model.dtype='float32' (lp_old is the sampler's there): set rollout.mode={_names(off_policy)}, "
                      f"or leave it. (In bfloat16 the {mode.name} mode recomputes lp_old; 'sampler' turns that off.)")
  if mode.max_staleness is not None and r.max_staleness > mode.max_staleness:
    further = [m.name for m in modes.MODES.values() if m.max_staleness is None]
    raise ConfigError(f"config.rollout.max_staleness={r.max_staleness}: the {mode.name} mode runs at most "
                      f"{'one step' if mode.max_staleness == 1 else f'{mode.max_staleness} steps'} off-policy "
                      f"(0 to {mode.max_staleness}); use rollout.mode={_names(further)} for more.")
  # A field that only other modes read must stay at its default: set, it would be ignored.
  defaults = base_config().rollout
  for other in modes.MODES.values():
    for name in other.own_fields:
      if name not in mode.own_fields and r[name] != defaults[name]:
        raise ConfigError(f"config.rollout.{name}={r[name]!r} only applies to rollout.mode={other.name!r} "
                          f"(got {r.mode!r}): set rollout.mode={other.name!r} or leave it at {defaults[name]}.")
  if mode.name == "partial":
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
  if mode.splits_devices:
    _positive(c, "rollout.sync_every", r.sync_every)
    _positive(c, "rollout.queue_size", r.queue_size)
    _positive(c, "rollout.generator_devices", r.generator_devices, allow_zero=True)
    shd.check_mesh_shape(r.generator_mesh, "config.rollout.generator_mesh")
    if r.sync_every > max_staleness(c) + 1:
      raise ConfigError(
          f"config.rollout.sync_every={r.sync_every} with max_staleness={max_staleness(c)} would stall: a "
          "generator waits for parameters no older than max_staleness versions, which arrive every sync_every "
          "updates. Set sync_every <= max_staleness + 1.")


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
  from rljax.tools.executor import resolve_tools
  try:
    resolve_tools(names)
  except ConfigError as e:
    raise ConfigError(f"config.tools.names={names}: {e}") from None
  for name in ("max_turns", "segment_tokens", "max_response_tokens", "max_memory_mb"):
    _positive(c, f"tools.{name}", tl[name])
  _positive(c, "tools.slots", tl.slots, allow_zero=True)
  _positive(c, "tools.num_workers", tl.num_workers, allow_zero=True)
  if not tl.timeout_s > 0:
    raise ConfigError(f"config.tools.timeout_s={tl.timeout_s!r} must be > 0.")
  if not modes.get(c.rollout.mode).tools:
    able = [m.name for m in modes.MODES.values() if m.tools]
    raise ConfigError(f"config.tools.enabled with rollout.mode={c.rollout.mode!r}: multi-turn rollouts alternate "
                      "compiled decode segments with host tool calls, which that mode's runner does not do; "
                      f"set rollout.mode={_names(able)} (with rollout.max_staleness=0 for on-policy updates).")
  if c.sampling.ignore_eos:
    raise ConfigError("config.tools.enabled with sampling.ignore_eos=True: a trajectory must be able to end; "
                      "set sampling.ignore_eos=False.")


def _validate_packing(c: ml_collections.ConfigDict) -> None:
  t = c.train
  if not isinstance(t.pack_tokens, int) or t.pack_tokens < 0:
    raise ConfigError(f"config.train.pack_tokens={t.pack_tokens!r} must be an integer >= 0 (0 = no packing).")
  if not isinstance(t.shared_prefix, bool):
    raise ConfigError(f"config.train.shared_prefix={t.shared_prefix!r} must be True or False.")
  if t.shared_prefix and c.model.attention == "splash":
    raise ConfigError("config.train.shared_prefix=True with model.attention='splash': splash attention cannot "
                      "attend to a shared prefix; set model.attention='auto' (chunked) or train.shared_prefix=False.")
  if not t.pack_tokens:
    if t.pack_width:
      raise ConfigError(f"config.train.pack_width={t.pack_width} needs train.pack_tokens (the packed update); "
                        "set train.pack_tokens or leave pack_width=0.")
    return
  width = c.data.max_prompt_tokens + c.sampling.max_new_tokens
  if t.pack_tokens < width:
    raise ConfigError(f"config.train.pack_tokens={t.pack_tokens} is smaller than one row (data.max_prompt_tokens + "
                      f"sampling.max_new_tokens = {width}); set it to at least {width}, e.g. {4 * width}.")
  if not isinstance(t.pack_width, int) or t.pack_width < 0:
    raise ConfigError(f"config.train.pack_width={t.pack_width!r} must be an integer >= 0 (0 = one row's width).")
  if t.pack_width and not width <= t.pack_width <= t.pack_tokens:
    raise ConfigError(f"config.train.pack_width={t.pack_width} must be between one row ({width} tokens: "
                      f"data.max_prompt_tokens + sampling.max_new_tokens) and train.pack_tokens={t.pack_tokens}; "
                      "or 0 for one row's width.")
  if t.micro_batches != 1:
    raise ConfigError(f"config.train.micro_batches={t.micro_batches} with train.pack_tokens: packing decides the "
                      "micro-batches (blocks of pack_tokens real tokens); leave micro_batches=1.")
  if loss_config(c).agg == "prompt-mean":
    raise ConfigError("config.rl.agg='prompt-mean' with train.pack_tokens: a packed block may hold part of a "
                      "group, and prompt-mean needs whole groups; set train.pack_tokens=0 or another rl.agg.")


# ---- limits that would fail late (issue 37): non-finite numbers, LoRA rank, the reward spec ----------


def _leaves(value, path: str):
  if isinstance(value, dict):
    for k, v in value.items():
      yield from _leaves(v, f"{path}.{k}" if path else str(k))
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      yield from _leaves(v, f"{path}[{i}]")
  else:
    yield path, value


def _validate_finite(c: ml_collections.ConfigDict) -> None:
  """No field may be inf or NaN (e.g. optim.learning_rate=1e999 parses as inf): no setting means
  "unlimited" that way, and each one would fail or poison the run later."""
  for path, value in _leaves(c.to_dict(), ""):
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"config.{path}={value!r} must be a finite number (a literal such as 1e999 overflows to "
                        "inf); give a real value.")


def _model_hidden_size(c: ml_collections.ConfigDict) -> tuple[int, str] | None:
  """The model's hidden size and where it comes from, when known without loading anything heavy."""
  if c.model.path == "random":
    return int(c.model.random.hidden_size), "config.model.random.hidden_size"
  path = os.path.join(os.path.expanduser(str(c.model.path)), "config.json")
  try:
    with open(path) as f:
      hf = json.load(f)
  except (OSError, ValueError):
    return None  # a hub name, a GGUF file, ...: the model load checks its own shapes
  hf = hf.get("text_config", hf) if isinstance(hf, dict) else {}
  size = hf.get("hidden_size") if isinstance(hf, dict) else None
  return (int(size), path) if isinstance(size, int) else None


def _validate_lora_rank(c: ml_collections.ConfigDict) -> None:
  lc = lora_config(c)
  known = _model_hidden_size(c) if lc is not None else None
  if known is not None and lc.rank > known[0]:
    raise ConfigError(f"config.model.lora.rank={lc.rank} is larger than the model's hidden size ({known[0]}, from "
                      f"{known[1]}): the adapted projections are at most that wide, so a larger rank only adds "
                      "parameters. Use a rank below it (8-64 are usual).")


def _validate_batch_axes(c: ml_collections.ConfigDict) -> None:
  """An explicit data axis must divide the prompts of a step (else every data slice samples every
  prompt; across processes the reward callback would get rows whose examples live elsewhere)."""
  data = tuple(c.mesh.shape)[0]
  if isinstance(data, int) and data > 1 and c.train.prompts_per_step % data:
    raise ConfigError(f"config.train.prompts_per_step={c.train.prompts_per_step} is not divisible by the data axis "
                      f"of config.mesh.shape={tuple(c.mesh.shape)} ({data}): the prompts cannot be split over it. "
                      f"Make prompts_per_step a multiple of {data}, or change mesh.shape.")


def check_batch_mesh(c: ml_collections.ConfigDict, mesh, process_count: int) -> None:
  """Once the mesh exists (its -1 resolved): with several processes, the prompts of a step must
  split over the data and fsdp axes, so that each process's devices hold exactly the prompts its
  data shard reads (the reward callback scores them against that shard's examples)."""
  batch = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
  if process_count > 1 and c.train.prompts_per_step % batch:
    raise ConfigError(f"config.train.prompts_per_step={c.train.prompts_per_step} is not divisible by the mesh's data "
                      f"x fsdp size ({batch}, mesh.shape={tuple(c.mesh.shape)} on {mesh.devices.size} devices) in a "
                      f"run of {process_count} processes: make it a multiple of {batch}.")


def _validate_rewards(c: ml_collections.ConfigDict) -> None:
  """The reward spec as the pool will read it (rljax.rewards.RewardSpec): fields, verifiers, their
  kwargs and signatures, time limits, and its routing against data.sources[i].verifier (every
  source's verifier scores its rows, no fixed verifier scores another source's rows; see
  rljax/rewards/routing.py); no worker is started."""
  try:
    RewardSpec.from_dict(c.rewards.to_dict(), source_verifiers=source_verifiers_from_data(c.data))
  except ConfigError as e:
    raise ConfigError(f"config.{e}") from None

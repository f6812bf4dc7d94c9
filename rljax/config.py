"""The run configuration: one ml_collections ConfigDict, validated before anything heavy starts.

Every recipe under `configs/` starts from `base_config()` and changes fields; the CLI
applies `--config.a.b=value` overrides on top. The dict is locked, so a typo in a
field name is an error, not a silently ignored setting.
"""
from __future__ import annotations

import dataclasses
import difflib
import json

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
      attention="auto",               # learner attention: auto | xla | chunked | cudnn | splash (docs/models.md)
      lora=ml_collections.ConfigDict(dict(   # low-rank adapters (README "LoRA"; docs/models.md#lora)
          rank=0,                     # adapter rank; 0 = full fine-tuning. > 0: the base is frozen in model.dtype
          alpha=16.0,                 # the adapter's output is scaled by alpha / rank
          dropout=0.0,                # dropout on the adapter input, in the learner's loss forward only
          targets=["q", "k", "v", "o", "gate", "up", "down"],   # projections adapted (attention and MLP)
      ), type_safe=False),
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
      sandbox=dict(require_isolation=False),  # True: refuse to run model code unisolated (docs/rewards.md)
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
      pack_tokens=0,                  # > 0: packed update: blocks of this many real tokens (trainer/packing.py)
      seed=0,
      dynamic_sampling=False,         # DAPO: drop zero-variance groups, refill from oversampled prompts
      oversample=ml_collections.config_dict.placeholder(int),   # with dynamic_sampling: prompts sampled =
                                      # prompts_per_step * oversample (default 2); refused without it
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
  c.compile = ml_collections.ConfigDict(dict(
      cache_dir="",                   # jax's persistent compilation cache: programs kept across runs ("" = off)
  ))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every=0, keep_last=2, keep_best=1, best_metric="eval/accuracy", async_save=True, resume=True))
  c.eval = ml_collections.ConfigDict(dict(
      every=0, num_examples=64, samples=1, temperature=0.0, max_new_tokens=0, before_and_after=True,
      allow_training_data=False,      # evaluate even where the test split reads the training file (on purpose)
  ))
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
  attention_impls = ("auto", "xla", "chunked", "cudnn", "splash")   # = rljax.models.config.ATTENTION_IMPLS
  if c.model.attention not in attention_impls:
    raise ConfigError(f"config.model.attention={c.model.attention!r} is not one of {attention_impls}.")
  lora_config(c)   # raises on a bad rank, alpha, dropout or target
  if not t.dynamic_sampling and t.oversample is not None:
    raise ConfigError(f"config.train.oversample={t.oversample} only applies with config.train.dynamic_sampling=True "
                      "(it would be ignored): set train.dynamic_sampling=True or drop train.oversample.")
  if dynamic_oversample(c) < 1:
    raise ConfigError(f"config.train.oversample={t.oversample} must be >= 1.")
  if len(c.mesh.shape) != 3:
    raise ConfigError(f"config.mesh.shape={tuple(c.mesh.shape)} must have 3 entries (data, fsdp, tensor).")
  _validate_group_size(c)
  _validate_rollout(c)
  _validate_tools(c)
  if c.eval.samples < 1:
    raise ConfigError(f"config.eval.samples={c.eval.samples} must be >= 1.")
  _validate_eval_data(c)


def _validate_group_size(c: ml_collections.ConfigDict) -> None:
  """The loss's group statistics against G = sampling.num_samples, named as run-config fields."""
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
  from rljax.data.config import eval_reads_training_data
  overlaps = eval_reads_training_data(c.data.to_dict())
  if overlaps:
    raise ConfigError(
        f"config.{overlaps[0]}: the held-out evaluation (eval.every, eval.before_and_after) reads its 'test' "
        "split from the same place as training, so eval/accuracy and the best checkpoint would be measured on "
        "training prompts. Give the source one path per split, e.g. path={'train': '/data/train.jsonl', "
        "'test': '/data/test.jsonl'}; or turn evaluation off (eval.every=0, eval.before_and_after=False); or "
        "set eval.allow_training_data=True to evaluate on training data on purpose.")


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
  if r.mode == "fused" and r.proximal != "recompute" and c.model.dtype == "float32":
    raise ConfigError(f"config.rollout.proximal={r.proximal!r} has no effect in rollout.mode='fused' with "
                      "model.dtype='float32' (lp_old is the sampler's there): set rollout.mode='pipelined' or "
                      "'async', or leave it. (In bfloat16 the fused mode recomputes lp_old; 'sampler' turns that off.)")
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
  if c.rollout.mode != "pipelined":
    raise ConfigError(f"config.tools.enabled with rollout.mode={c.rollout.mode!r}: multi-turn rollouts alternate "
                      "compiled decode segments with host tool calls, so they run as the pipelined mode's producer; "
                      "set rollout.mode='pipelined' (with rollout.max_staleness=0 for on-policy updates).")
  if c.sampling.ignore_eos:
    raise ConfigError("config.tools.enabled with sampling.ignore_eos=True: a trajectory must be able to end; "
                      "set sampling.ignore_eos=False.")


def _validate_packing(c: ml_collections.ConfigDict) -> None:
  t = c.train
  if not isinstance(t.pack_tokens, int) or t.pack_tokens < 0:
    raise ConfigError(f"config.train.pack_tokens={t.pack_tokens!r} must be an integer >= 0 (0 = no packing).")
  if not t.pack_tokens:
    return
  width = c.data.max_prompt_tokens + c.sampling.max_new_tokens
  if t.pack_tokens < width:
    raise ConfigError(f"config.train.pack_tokens={t.pack_tokens} is smaller than one row (data.max_prompt_tokens + "
                      f"sampling.max_new_tokens = {width}); set it to at least {width}, e.g. {4 * width}.")
  if t.micro_batches != 1:
    raise ConfigError(f"config.train.micro_batches={t.micro_batches} with train.pack_tokens: packing decides the "
                      "micro-batches (blocks of pack_tokens real tokens); leave micro_batches=1.")
  if loss_config(c).agg == "prompt-mean":
    raise ConfigError("config.rl.agg='prompt-mean' with train.pack_tokens: a packed block may hold part of a "
                      "group, and prompt-mean needs whole groups; set train.pack_tokens=0 or another rl.agg.")


def dynamic_oversample(c: ml_collections.ConfigDict) -> int:
  """Prompts sampled per prompt trained: train.oversample (default 2) with dynamic sampling, else 1."""
  t = c.train
  if not t.dynamic_sampling:
    return 1
  return 2 if t.oversample is None else t.oversample


def max_staleness(c: ml_collections.ConfigDict) -> int:
  """The staleness bound in effect: 0 in fused mode, the configured value or 1 otherwise."""
  r = c.rollout
  if r.mode == "fused":
    return 0
  return 1 if r.max_staleness == -1 else r.max_staleness


def recompute_old_logprobs(c: ml_collections.ConfigDict) -> bool:
  """Whether the update recomputes lp_old: off-policy batches with rollout.proximal='recompute',
  and every run whose compute dtype is not float32. In bf16 the sampler's cached decode and the
  learner's forward round differently (SmolLM2-135M: mean |difference| 0.026, max 0.31), so the
  sampler's log-probs are not the learner's; the learner's own lp_old plus a truncated IS weight
  against the sampler is the verl/TRL practice. In float32 they agree to ~1e-6 and the sampler's
  log-probs serve as lp_old (no recompute forward)."""
  if c.rollout.proximal != "recompute":
    return False
  return max_staleness(c) > 0 or c.model.dtype != "float32"


# Off-policy modes correct with truncated IS against the sampler; this cap is used unless rl.tis_cap is set.
DEFAULT_OFF_POLICY_TIS_CAP = 2.0


def lora_config(c: ml_collections.ConfigDict):
  """The LoraConfig of config.model.lora, or None when its rank is 0 (full fine-tuning)."""
  from rljax.models.config import LoraConfig
  lc = c.model.lora
  if isinstance(lc.rank, bool) or not isinstance(lc.rank, int) or lc.rank < 0:
    raise ConfigError(f"config.model.lora.rank={lc.rank!r} must be a non-negative integer (0 = no LoRA, full "
                      "fine-tuning; 8-64 are usual).")
  if lc.rank == 0:
    return None
  targets = [lc.targets] if isinstance(lc.targets, str) else list(lc.targets)
  return LoraConfig(rank=lc.rank, alpha=float(lc.alpha), dropout=float(lc.dropout), targets=tuple(targets))


def loss_config(c: ml_collections.ConfigDict):
  """The LossConfig named by config.rl (a preset plus overrides).

  Whenever lp_old is recomputed (off-policy modes with rollout.proximal='recompute', and runs
  in a dtype other than float32) and rl.tis_cap is unset, the truncated IS weight against the
  sampler is on with cap DEFAULT_OFF_POLICY_TIS_CAP (decoupled PPO, verl/TRL's TIS). With proximal='sampler', lp_old is the
  sampler's and the IS weight would be 1.
  """
  from rljax.rl import LossConfig
  from rljax.rl.config import PRESETS
  fields = {k: v for k, v in c.rl.to_dict().items() if v is not None}
  preset = fields.pop("preset", "grpo")
  if preset not in PRESETS:
    close = difflib.get_close_matches(str(preset), list(PRESETS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"config.rl.preset={preset!r} is not a loss preset.{hint} The presets are: "
                      f"{', '.join(sorted(PRESETS))} (docs/loss.md describes each).")
  if recompute_old_logprobs(c):
    fields.setdefault("tis_cap", DEFAULT_OFF_POLICY_TIS_CAP)
  try:
    return LossConfig.from_preset(preset, **fields)
  except ConfigError as e:
    msg = str(e)
    field = msg.split("=", 1)[0].split(" ", 1)[0]
    raise ConfigError(f"config.rl.{msg}" if field in c.rl else f"config.rl (preset {preset!r}): {msg}") from None


def check_model_fits(c: ml_collections.ConfigDict, max_position_embeddings: int, model: str = "") -> None:
  """Contradiction between the data/sampling lengths and the model's context."""
  need = c.data.max_prompt_tokens + c.sampling.max_new_tokens
  if need > max_position_embeddings:
    raise ConfigError(
        f"config.data.max_prompt_tokens + config.sampling.max_new_tokens = {c.data.max_prompt_tokens} + "
        f"{c.sampling.max_new_tokens} = {need} exceeds the context of {model or 'the model'} "
        f"({max_position_embeddings} tokens); lower one of them.")


# The context `load_policy` gives a random model (model.path="random").
RANDOM_MODEL_CONTEXT = 4096


def model_context_length(model_cfg) -> int | None:
  """The model's context (`ModelConfig.context_length`: max_position_embeddings, or YaRN's scaled
  context) read without loading its weights, or None.

  An HF directory's config.json, a GGUF file's (or built-in name's) `<arch>.context_length`
  header entry, RANDOM_MODEL_CONTEXT for "random". It lets the CLI refuse a prompt + completion
  longer than the context in a second instead of after the weights have loaded; anything it
  cannot read cheaply is left to the check after loading.
  """
  import os
  path = model_cfg.path
  if path == "random":
    return RANDOM_MODEL_CONTEXT
  try:
    if os.path.isdir(path):
      with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
      from rljax.models.rope import hf_context_length
      return hf_context_length(hf)   # RoPE scaling (YaRN) included
    if not os.path.isfile(path):
      from rljax.models import builtin
      if not builtin.is_builtin(path):
        return None
      path = builtin.resolve_builtin(path)
    return _gguf_context_length(path)
  except Exception:  # noqa: BLE001 - unreadable here; loading the model reports it properly
    return None


def _gguf_context_length(path: str) -> int | None:
  """`<general.architecture>.context_length` from a GGUF header, reading only the key-value
  entries up to it (the tokenizer's arrays, which usually follow, are skipped, not parsed)."""
  import struct
  scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
  with open(path, "rb") as f:
    def read(fmt):
      size = struct.calcsize("<" + fmt)
      return struct.unpack("<" + fmt, f.read(size))[0]

    def string():
      return f.read(read("Q")).decode("utf-8", "replace")

    def value(kind):
      if kind in scalar:
        return read(scalar[kind])
      if kind == 8:
        return string()
      if kind == 9:
        elem, count = read("I"), read("Q")
        if elem in scalar:
          f.seek(count * struct.calcsize("<" + scalar[elem]), 1)
        else:
          for _ in range(count):
            value(elem)
        return None
      raise ValueError(f"unknown GGUF value type {kind}")

    if f.read(4) != b"GGUF":
      return None
    version = read("I")
    count_fmt = "I" if version == 1 else "Q"
    read(count_fmt)                     # tensor count
    entries = read(count_fmt)
    arch, lengths = None, {}
    for _ in range(entries):
      key = string()
      v = value(read("I"))
      if key == "general.architecture":
        arch = v
      elif key.endswith(".context_length"):
        lengths[key] = v
      if arch is not None and f"{arch}.context_length" in lengths:
        return int(lengths[f"{arch}.context_length"])
  return 2048 if arch is not None else None   # the loader's default when the entry is absent


def check_model_fits_early(c: ml_collections.ConfigDict) -> None:
  """`check_model_fits` against the context read from the model's files (no weights loaded)."""
  context = model_context_length(c.model)
  if context is not None:
    check_model_fits(c, context, model=f"model.path={c.model.path!r}")


def to_json(c: ml_collections.ConfigDict) -> str:
  return json.dumps(c.to_dict(), indent=2, sort_keys=True, default=str)


# ---- field documentation (`rljax config show`) ---------------------------------------------------


def field_help() -> dict[str, str]:
  """{"train.steps": "rollout steps (...)", "model": "<section comment>", ...}: the comments next to
  the fields in `base_config()`'s source (one source of truth), and LossConfig's docstring for rl.*."""
  import ast
  import inspect
  import io
  import re
  import textwrap
  import tokenize
  source = textwrap.dedent(inspect.getsource(base_config))
  comments: dict[int, tuple[int, str, bool]] = {}   # line -> (column, text, comment-only line)
  code_lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip(), False)
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
      code_lines.add(tok.start[0])
  comments = {line: (col, text, line not in code_lines) for line, (col, text, _) in comments.items()}

  def trailing(line: int) -> str:
    parts = [comments[line][1]] if line in comments and not comments[line][2] else []
    nxt = line + 1
    while nxt in comments and comments[nxt][2] and comments[nxt][0] > 10:   # a wrapped comment
      parts.append(comments[nxt][1])
      nxt += 1
    return " ".join(parts)

  def above(line: int) -> str:
    parts, prev = [], line - 1
    while prev in comments and comments[prev][2]:
      parts.insert(0, comments[prev][1])
      prev -= 1
    return " ".join(parts)

  out: dict[str, str] = {}

  def dict_call(node):
    """The dict(...) call inside ConfigDict(dict(...)) (or the call itself)."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
      return node
    if isinstance(node, ast.Call) and node.args:
      return dict_call(node.args[0])
    return None

  def walk(call, prefix):
    for kw in call.keywords:
      if kw.arg is None:
        continue
      name = f"{prefix}{kw.arg}"
      out[name] = trailing(kw.value.end_lineno)
      inner = dict_call(kw.value) if isinstance(kw.value, ast.Call) and getattr(kw.value.func, "attr", "") == \
          "ConfigDict" else None
      if inner is not None:
        out[name] = trailing(kw.value.lineno)
        walk(inner, name + ".")

  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
      name = node.targets[0].attr
      inner = dict_call(node.value)
      out[name] = " ".join(x for x in (above(node.lineno), trailing(node.lineno)) if x)
      if inner is not None:
        walk(inner, name + ".")
  from rljax.rl.config import LossConfig
  doc, current = {}, None
  for line in (LossConfig.__doc__ or "").splitlines():
    m = re.match(r"^    ([a-z_][a-z_0-9, ]*): (.*)$", line)
    if m:
      current = [n.strip() for n in m.group(1).split(",")]
      for n in current:
        doc[n] = m.group(2).strip()
    elif current and re.match(r"^      \S", line):
      for n in current:
        doc[n] += " " + line.strip()
    else:
      current = None
  for f in dataclasses.fields(LossConfig):
    out[f"rl.{f.name}"] = (doc.get(f.name, "") + " (None: the preset's value)").strip()
  out["rl.preset"] = "the loss recipe: " + ", ".join(sorted(_presets())) + " (docs/loss.md)"
  return out


def _presets():
  from rljax.rl.config import PRESETS
  return PRESETS


def describe_fields(c: ml_collections.ConfigDict) -> str:
  """Every field of `c` as `name = value  # help`, sections in order; a value that differs from
  base_config()'s default shows that default."""
  from rljax.trainer.rundir import flatten_config
  helps = field_help()
  as_json = lambda cfg: json.loads(json.dumps(cfg.to_dict(), default=str))   # base_config()'s field order
  values = flatten_config(as_json(c))
  defaults = flatten_config(as_json(base_config()))
  lines, section = [], None
  for name, value in values.items():
    top = name.split(".")[0] if "." in name else ""
    if top != section:
      section = top
      head = helps.get(top, "") if top else "top-level fields"
      lines.append(f"\n[{top or 'config'}]" + (f"  # {head}" if head else ""))
    text = f"{name} = {json.dumps(value, default=str)}"
    if name in defaults and defaults[name] != value:
      text += f"   (default {json.dumps(defaults[name], default=str)})"
    help_text = helps.get(name) or helps.get(name.rsplit(".", 1)[0] if name.count(".") > 1 else "", "")
    lines.append(f"{text:<60}  # {help_text}" if help_text else text)
  return "\n".join(lines).lstrip("\n") + "\n"

"""The programs `rljax plan` compiles, built from the run config with abstract inputs only.

Everything here is shapes: parameters, optimizer state and rollouts are `jax.ShapeDtypeStruct`s
with the shardings the trainer gives them (`jax.eval_shape`), so planning a 32B model allocates
nothing of its size. Each program is lowered with the mesh and the logical-axis rules in scope
(`rljax.sharding.activate`) and compiled for the target devices; the compiled program's memory
analysis and per-chip HLO are the figures.

Programs (rows N = P * O * G: prompts x oversample x samples per prompt):
  sampler: generate(params, key, prompt_ids [P*O, Lp], prompt_mask) -> Rollout, the parameters as
           the train state holds them
  learner: update(state, Rollout with rewards) -> (state, metrics), the state donated
  fused:   both in one program (state -> sample -> stand-in rewards -> update), the state donated.
           The rewards are a function of the sampled tokens in place of the reward callback,
           which a deviceless compile cannot run.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import config as config_lib
from rljax import sharding as shd
from rljax.errors import ConfigError, RljaxError
from rljax.models.config import ModelConfig, family_switches
from rljax.plan import hlo

PROGRAMS = ("sampler", "learner", "fused")


@dataclasses.dataclass
class Run:
  """The static shape of a configured run: what every program is built from.

  prompts: P * O prompts sampled per step (O = oversample with dynamic sampling); group: G;
  rows: prompts * G; prompt_len: Lp (data.max_prompt_tokens); completion_len: T
  (sampling.max_new_tokens); components: K reward components; updates: optimizer updates per
  step (epochs x mini-batches).
  """
  config: ml_collections.ConfigDict
  model: ModelConfig
  model_source: str
  spec: Any
  optimizer: Any
  schedule: Any
  prompts: int
  group: int
  prompt_len: int
  completion_len: int
  components: int
  needs_reference: bool
  updates: int
  notes: list[str]
  decode_budget_bytes: int | None = None   # the sampler's weight-layout budget (half a chip's HBM); None: ask the device

  @property
  def rows(self) -> int:
    return self.prompts * self.group

  @property
  def lora(self):
    """The run's LoraConfig (config.model.lora.rank > 0), or None for full fine-tuning."""
    return self.model.lora

  @property
  def reference_copy(self) -> bool:
    """Whether the state keeps a second copy of the model as the KL reference: full fine-tuning with
    a KL term only; under LoRA the reference is the frozen base itself."""
    return self.needs_reference and self.lora is None

  def with_layers(self, layers: int) -> "Run":
    """The same run on a model with `layers` layers (for depth extrapolation)."""
    model = self.model.with_num_layers(layers)
    return dataclasses.replace(self, model=model, spec=dataclasses.replace(self.spec, model=model))


# ---- the model and the run ----------------------------------------------------------------------


def model_config(config: ml_collections.ConfigDict) -> tuple[ModelConfig, str]:
  """ModelConfig of config.model, from its config alone (no weights are read).

  config.model.path: a directory holding config.json (the weights need not be there), a
  config.json file, a .gguf file or built-in name (metadata only), or "random" (model.random).
  Fields of config.model that ModelConfig also has (dtype, remat, ...) override the file's.
  """
  m = config.model
  path = m.path
  if path == "random":
    r = m.random
    vocab = r.vocab_size
    if not vocab and config.tokenizer:
      from rljax.tokenizer import load_tokenizer
      vocab = load_tokenizer(config.tokenizer).vocab_size
    if not vocab:
      raise ConfigError("config.model.random.vocab_size=0: rljax plan builds no tokenizer for a random model; "
                        "set --config.model.random.vocab_size=N (or config.tokenizer).")
    mc = ModelConfig(vocab_size=vocab, hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
                     num_layers=r.num_layers, num_heads=r.num_heads, num_kv_heads=r.num_kv_heads,
                     head_dim=r.head_dim, architecture=r.architecture, tie_word_embeddings=r.tie_word_embeddings,
                     **family_switches(r.architecture, r.num_layers, r.head_dim),
                     max_position_embeddings=4096)
    source = "random model (config.model.random)"
  else:
    hf_json = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if os.path.isfile(hf_json) and hf_json.endswith(".json"):
      try:
        with open(hf_json, encoding="utf-8") as f:
          hf = json.load(f)
      except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config.model.path={path!r}: {hf_json} is not a readable JSON model config ({e}).") from None
      mc = ModelConfig.from_hf(hf, source=hf_json)
      source = hf_json
    else:
      from rljax.models.io import resolve
      kind, file = resolve(path)
      if kind != "gguf":
        raise ConfigError(f"config.model.path={path!r}: no config.json there; rljax plan needs only the model's "
                          "config.json (a directory holding it is enough).")
      from rljax.models.gguf_io import open_gguf
      mc = open_gguf(file).config
      source = file
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  # config.model.lora is a sub-config, turned into the LoraConfig by `apply_lora`.
  overrides = {k: m[k] for k in m.keys() if k in fields and k not in ("path", "random", "lora")}
  return apply_lora(config, mc.replace(**overrides)), source


def apply_lora(config: ml_collections.ConfigDict, mc: ModelConfig) -> ModelConfig:
  """The ModelConfig the trainer runs under config.model.lora (trainer/loop.py `load_policy`): with
  rank > 0 it carries the LoraConfig (the traced model has the adapter matmuls) and the frozen base
  is stored in the compute dtype (model.dtype), not float32; with rank 0 it is unchanged."""
  lc = config_lib.lora_config(config)
  if lc is None:
    return mc
  return mc.replace(lora=lc, param_dtype=mc.dtype)


def build_run(config: ml_collections.ConfigDict) -> Run:
  """The Run of a validated config, as the Trainer would set it up (trainer/loop.py)."""
  from rljax.rollout.draw import SamplingParams
  from rljax.trainer.optim import make_optimizer
  from rljax.trainer.step import StepSpec
  mc, source = model_config(config)
  config_lib.check_model_fits(config, mc.max_position_embeddings)
  t, s = config.train, config.sampling
  loss = config_lib.loss_config(config)
  oversample = config_lib.dynamic_oversample(config)
  temp = s.temperature
  stops = () if s.ignore_eos else tuple(sorted(set(mc.eos_token_ids) | {int(i) for i in s.stop_token_ids}))
  sp = SamplingParams(num_samples=s.num_samples, max_new_tokens=s.max_new_tokens,
                      temperature=temp if temp > 0 else 1.0, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                      greedy=temp == 0, stop_token_ids=stops)
  recompute = config_lib.recompute_old_logprobs(config)
  extra = {}   # fields of newer StepSpecs, set as the Trainer sets them
  spec_fields = {f.name for f in dataclasses.fields(StepSpec)}
  if "gap_rows" in spec_fields:
    extra["gap_rows"] = 0 if recompute else s.num_samples
  if "pack_tokens" in spec_fields and "pack_tokens" in t:
    extra["pack_tokens"] = t.pack_tokens
  spec = StepSpec(model=mc, sampling=sp, loss=loss, prompts=t.prompts_per_step, mini_batches=t.mini_batches,
                  epochs=t.epochs, micro_batches=t.micro_batches, eos_ids=stops, oversample=oversample,
                  recompute_old_logprobs=recompute, **extra)
  total_updates = max(t.steps * t.mini_batches * t.epochs, 1)
  optimizer, schedule = make_optimizer(config.optim, total_updates)
  notes = []
  if config.tools.enabled:
    notes.append("tools.enabled: the plan compiles the single-turn sampler; multi-turn segments are smaller.")
  if config.rollout.mode == "async":
    notes.append("rollout.mode='async': the plan compiles sampler and learner on the whole mesh; the async mode "
                 "splits it (rollout.generator_devices).")
  return Run(config=config, model=mc, model_source=source, spec=spec, optimizer=optimizer, schedule=schedule,
             prompts=t.prompts_per_step * oversample, group=s.num_samples, prompt_len=config.data.max_prompt_tokens,
             completion_len=s.max_new_tokens, components=max(len(config.rewards.components), 1),
             needs_reference=loss.needs_reference, updates=t.epochs * t.mini_batches, notes=notes)


# ---- shardings and abstract inputs --------------------------------------------------------------


def abstract(tree, shardings):
  """ShapeDtypeStructs of `tree` carrying `shardings` (a matching tree, or one sharding for all)."""
  if isinstance(shardings, jax.sharding.Sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def bytes_per_chip(tree) -> int:
  """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (its shard of each leaf)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def state_shardings(state, mesh, param_sh, frozen_sh=None):
  """Params, reference params and param-shaped optimizer moments by logical axes; the rest replicated.
  Under LoRA `param_sh` is the adapters' and `frozen_sh` the frozen base's (trainer/loop.py
  `_state_shardings`)."""
  replicated = NamedSharding(mesh, P())
  param_struct = jax.tree.structure(state.params)
  is_param_tree = lambda n: jax.tree.structure(n) == param_struct
  opt_sh = jax.tree.map(lambda n: param_sh if is_param_tree(n) else replicated, state.opt_state,
                        is_leaf=is_param_tree)
  out = jax.tree.map(lambda _: replicated, state).replace(params=param_sh, opt_state=opt_sh)
  if state.ref_params is not None:
    out = out.replace(ref_params=param_sh)
  if state.frozen is not None:
    out = out.replace(frozen=frozen_sh)
  return out


def kv_cache_bytes(mc: ModelConfig, mesh, prompts: int, rows: int, prompt_len: int, completion_len: int) -> int:
  """Per-chip bytes of the sampler's KV caches: the prompt cache [P, K, Dh, Lp] shared by a prompt's
  G rows, and each row's completion cache [N, K, Dh, T], keys and values, every layer, in the
  compute dtype, split like the sampler splits them (rows over data x fsdp, KV heads over tensor)."""
  itemsize = jnp.dtype(mc.compute_dtype).itemsize

  def per_chip(batch, slots):
    shape = (batch, mc.num_kv_heads, mc.head_dim, slots)
    spec = shd.logical_to_spec(("batch", "kv_heads", "head_dim", "length"), shape, mesh)
    return math.prod(NamedSharding(mesh, spec).shard_shape(shape))

  return 2 * mc.num_layers * (per_chip(prompts, prompt_len) + per_chip(rows, completion_len)) * itemsize


def rows_per_chip(mesh, rows: int) -> int:
  """Rows of an [N, ...] batch one chip holds under the batch sharding."""
  return shd.batch_sharding(mesh, 1, rows).shard_shape((rows,))[0]


@dataclasses.dataclass
class Inputs:
  """Abstract inputs and shardings of the programs on one mesh."""
  state: Any
  state_sh: Any
  sampler_params: Any
  key: Any
  prompt_ids: Any
  prompt_mask: Any
  rollout: Any          # scored Rollout [N, ...]
  rollout_sh: Any       # the sampler's output shardings: every row-major leaf split by rows
  param_bytes: int          # the trained parameters (under LoRA: the adapters)
  opt_bytes: int
  ref_bytes: int
  sampler_param_bytes: int  # what the sampler is given: `param_bytes + frozen_bytes`
  frozen_bytes: int = 0     # LoRA: the frozen base, in the storage dtype (model.dtype)
  trainable_params: int = 0  # parameter count the optimizer updates (the whole model, or the adapters)


def build_inputs(run: Run, mesh) -> Inputs:
  from rljax.models import lora
  from rljax.models.policy import init_params, param_shardings
  from rljax.trainer.state import TrainState
  mc = run.model
  params = jax.eval_shape(lambda: init_params(mc, jax.random.key(0)))
  psh = param_shardings(mc, mesh)
  seed = run.config.train.seed
  if run.lora is None:
    state = jax.eval_shape(lambda p: TrainState.create(p, run.optimizer, seed,
                                                       ref_params=p if run.needs_reference else None), params)
    state_sh = state_shardings(state, mesh, psh)
  else:
    # As Trainer._setup_state builds it: the base frozen in its storage dtype, the adapters and
    # their AdamW moments as params / opt_state, no reference copy (the base is the reference).
    base, adapters = lora.split(params)
    base_sh, adapter_sh = lora.split(psh)
    state = jax.eval_shape(lambda a, b: TrainState.create(a, run.optimizer, seed, frozen=b), adapters, base)
    state_sh = state_shardings(state, mesh, adapter_sh, frozen_sh=base_sh)
  state = abstract(state, state_sh)
  # The sampler reads the train state's parameters, as the fused step passes them (fp32, the
  # learner's layout; under LoRA the frozen base joined with the adapters, `model_params`); a
  # decode layout (rljax.sharding.DECODE_RULES) is made inside the program.
  sampler_params = state.model_params()
  replicated = NamedSharding(mesh, P())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated)
  prompts = shd.batch_sharding(mesh, 2, run.prompts)
  prompt_ids = jax.ShapeDtypeStruct((run.prompts, run.prompt_len), jnp.int32, sharding=prompts)
  prompt_mask = jax.ShapeDtypeStruct((run.prompts, run.prompt_len), jnp.bool_, sharding=prompts)
  generate = make_generate(run, None)
  rows = lambda x: shd.batch_sharding(mesh, x.ndim, x.shape[0])
  unscored = jax.eval_shape(generate, sampler_params, key, prompt_ids, prompt_mask)
  k = run.components
  rollout = jax.eval_shape(lambda r: r.with_rewards(jnp.zeros((run.rows,)), jnp.zeros((run.rows, k))), unscored)
  rollout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows(x)), rollout)
  opt_bytes = bytes_per_chip(state.opt_state)
  return Inputs(state=state, state_sh=state_sh, sampler_params=sampler_params, key=key, prompt_ids=prompt_ids,
                prompt_mask=prompt_mask, rollout=rollout, rollout_sh=jax.tree.map(rows, unscored),
                param_bytes=bytes_per_chip(state.params),
                opt_bytes=opt_bytes, ref_bytes=bytes_per_chip(state.ref_params) if state.ref_params is not None else 0,
                sampler_param_bytes=bytes_per_chip(sampler_params),
                frozen_bytes=bytes_per_chip(state.frozen) if state.frozen is not None else 0,
                trainable_params=sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)))


# ---- the step functions (the lead's step API) ---------------------------------------------------


def make_generate(run: Run, mesh):
  from rljax.rollout.sampler import make_generate_fn
  return make_generate_fn(run.spec, mesh, decode_budget_bytes=run.decode_budget_bytes)


def make_update(run: Run, mesh):
  from rljax.trainer.step import make_update_fn
  return make_update_fn(run.spec, run.optimizer, run.schedule, mesh=mesh)


def stand_in_rewards(rollout, components: int):
  """Rewards [N] and components [N, K] computed from the sampled tokens: they stand in for the reward
  callback in the fused program and, unlike constants, cannot be folded away by the compiler."""
  r = (rollout.tokens[:, 0] % 2).astype(jnp.float32)
  return r, jnp.broadcast_to(r[:, None], (r.shape[0], components))


# ---- compiling ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
  """What one compile gives: memory analysis (per chip), per-chip HLO figures, compile time, or the
  compiler's out-of-memory verdict."""
  program: str
  layers: int
  compile_s: float
  argument_bytes: int | None = None
  output_bytes: int | None = None
  alias_bytes: int | None = None
  temp_bytes: int | None = None
  compiler_peak_bytes: int | None = None  # the TPU compiler's live-range peak (peak_memory_in_bytes)
  oom_needs_bytes: int | None = None     # the compiler refused: the memory it said the program needs
  oom_available_bytes: int | None = None
  error: str | None = None
  hlo: dict | None = None

  @property
  def sum_bytes(self) -> int | None:
    """argument + output - alias + temp: every buffer counted as live at once (an upper bound)."""
    if self.temp_bytes is None:
      return None
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def peak_source(self) -> str | None:
    """"refused" (the compiler's "needs" figure), "compiler" (its peak) or "sum" (`sum_bytes`)."""
    if self.oom_needs_bytes is not None:
      return "refused"
    if self.compiler_peak_bytes:
      return "compiler"
    return None if self.temp_bytes is None else "sum"

  @property
  def peak_bytes(self) -> int | None:
    source = self.peak_source
    return {"refused": self.oom_needs_bytes, "compiler": self.compiler_peak_bytes, "sum": self.sum_bytes,
            None: None}[source]


_SIZE = r"([0-9.]+)\s*([KMGT]?)i?B?"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(number: str, unit: str) -> int:
  return int(float(number) * _UNITS[unit])


def parse_oom(message: str) -> tuple[int | None, int | None]:
  """(needed, available) bytes from a TPU compiler out-of-memory message, None where absent.

  Two forms are known: "... required for ... (240.00G) exceeds available HBM (95.74G)" and
  "Used 120.50G of 95.74G hbm. Exceeded hbm capacity by 24.76G."
  """
  m = re.search(r"\(" + _SIZE + r"\)\s*exceeds available HBM\s*\(" + _SIZE + r"\)", message)
  if m:
    return _size(m.group(1), m.group(2)), _size(m.group(3), m.group(4))
  m = re.search(r"Used\s+" + _SIZE + r"\s+of\s+" + _SIZE + r"\s+hbm", message)
  if m:
    return _size(m.group(1), m.group(2)), _size(m.group(3), m.group(4))
  m = re.search(r"needs?\s+" + _SIZE, message)
  if m:
    return _size(m.group(1), m.group(2)), None
  return None, None


def _is_oom(e: Exception) -> bool:
  text = str(e)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Ran out of memory" in text


def compile_program(program: str, run: Run, mesh, inputs: Inputs, dump_dir: str | None = None) -> Compiled:
  """Lowers and compiles one program for `mesh`'s devices; never runs it. `dump_dir`: also write the
  per-chip HLO there, as `<program>.L<layers>.hlo.txt`."""
  fn, args, kwargs = _program(program, run, mesh, inputs)
  t0 = time.perf_counter()
  try:
    with shd.activate(mesh):
      compiled = jax.jit(fn, **kwargs).lower(*args).compile()
  except RljaxError:
    raise
  except Exception as e:  # noqa: BLE001 - the compiler's verdict is a result, other failures are re-raised
    if not _is_oom(e):
      raise
    needs, available = parse_oom(str(e))
    first = next((line for line in str(e).splitlines() if line.strip()), str(e))
    return Compiled(program, run.model.num_layers, time.perf_counter() - t0, oom_needs_bytes=needs,
                    oom_available_bytes=available, error=first[:400])
  seconds = time.perf_counter() - t0
  text = compiled.as_text()
  if dump_dir:
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, f"{program}.L{run.model.num_layers}.hlo.txt"), "w") as f:
      f.write(text)
  m = compiled.memory_analysis()
  updates = run.updates if program in ("learner", "fused") else 1
  # The TPU compiler's peak comes from its buffer assignment's live ranges: below the sum when
  # temporaries reuse memory that arguments or outputs also occupy, and it is what it checks
  # against HBM. The CPU compiler's figure leaves temporaries out, so the sum is used there.
  tpu = mesh.devices.flat[0].platform == "tpu"
  peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0) if tpu else None
  return Compiled(program, run.model.num_layers, seconds, argument_bytes=int(m.argument_size_in_bytes),
                  output_bytes=int(m.output_size_in_bytes), alias_bytes=int(m.alias_size_in_bytes),
                  temp_bytes=int(m.temp_size_in_bytes), compiler_peak_bytes=peak or None,
                  hlo=hlo.summarize(text, updates=updates))


def _program(program: str, run: Run, mesh, inputs: Inputs) -> tuple[Callable, tuple, dict]:
  """(function, abstract args, jit kwargs) of a program."""
  replicated = NamedSharding(mesh, P())
  if program == "sampler":
    generate = make_generate(run, mesh)
    return generate, (inputs.sampler_params, inputs.key, inputs.prompt_ids, inputs.prompt_mask), dict(
        out_shardings=inputs.rollout_sh)
  update = make_update(run, mesh)
  donate = dict(donate_argnums=(0,), out_shardings=(inputs.state_sh, replicated))
  if program == "learner":
    return update, (inputs.state, inputs.rollout), donate
  if program == "fused":
    generate = make_generate(run, mesh)

    def step(state, prompt_ids, prompt_mask):
      from rljax.trainer.state import rollout_key
      rollout = generate(state.model_params(), rollout_key(state.rng, state.step), prompt_ids, prompt_mask)
      return update(state, rollout.with_rewards(*stand_in_rewards(rollout, run.components)))

    return step, (inputs.state, inputs.prompt_ids, inputs.prompt_mask), donate
  raise ConfigError(f"--program={program!r} is not one of {PROGRAMS + ('all',)}.")

"""The programs `rljax plan` compiles: the trainer's own (rljax/trainer/setup.py), with abstract inputs.

Everything here is shapes: parameters, optimizer state and rollouts are `jax.ShapeDtypeStruct`s
with the shardings the trainer gives them (`setup.abstract_state`: `jax.eval_shape` of the
trainer's state construction), so planning a 32B model allocates nothing of its size. Each
program is the jitted function the trainer's runners call, lowered and compiled for the target
devices; the compiled program's memory analysis and per-chip HLO are the figures.

Programs (rows N = P * O * G: prompts x oversample x samples per prompt):
  sampler: `setup.generate_program`: generate(params, key, prompt_ids [P*O, Lp], prompt_mask) ->
           Rollout, the parameters as the train state holds them
  learner: `setup.update_program`: update(state, Rollout with rewards) -> (state, metrics), the
           state donated (the pipelined, async and partial modes' update)
  fused:   `setup.train_step_program`: state -> sample -> rewards -> update in one program, the
           state donated (rollout.mode='fused'). The rewards are a function of the sampled tokens
           (`setup.stand_in_reward_fn`) in place of the reward callback, which a deviceless compile
           cannot run.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding, PartitionSpec as P

from rljax import sharding as shd
from rljax.errors import ConfigError, RljaxError
from rljax.models.config import ModelConfig
from rljax.models.policy import param_logical_axes
from rljax.plan import hlo
from rljax.rewards import reward_models
from rljax.rewards.spec import RewardSpec
from rljax.rollout.sampler import decode_cast, decode_layout_for, make_generate_fn
from rljax.trainer import setup as setup_lib

PROGRAMS = ("sampler", "learner", "fused")


@dataclasses.dataclass
class Run:
  """The static shape of a configured run: the trainer's own setup (rljax/trainer/setup.py), plus
  where the model was read and the plan's notes.

  prompts: P * O prompts sampled per step (O = oversample with dynamic sampling); group: G;
  rows: prompts * G; prompt_len: Lp (data.max_prompt_tokens); completion_len: T
  (sampling.max_new_tokens); components: K reward components; updates: optimizer updates per
  step (epochs x mini-batches).
  """
  setup: setup_lib.Setup
  model_source: str
  notes: list[str]
  # The sampler's weight-layout budget (half a chip's HBM); None: ask the device.
  decode_budget_bytes: int | None = None
  # The sampler's weight layout, decided at the model's full depth (`decode_layout`); None: when traced.
  decode_layout: shd.DecodeLayout | None = None

  config = property(lambda self: self.setup.config)
  model = property(lambda self: self.setup.model)
  spec = property(lambda self: self.setup.spec)
  optimizer = property(lambda self: self.setup.optimizer)
  schedule = property(lambda self: self.setup.schedule)
  prompts = property(lambda self: self.setup.batch_rows)
  group = property(lambda self: self.spec.group)
  rows = property(lambda self: self.setup.rows)
  prompt_len = property(lambda self: self.config.data.max_prompt_tokens)
  completion_len = property(lambda self: self.spec.sampling.max_new_tokens)
  components = property(lambda self: setup_lib.reward_components(self.config))
  needs_reference = property(lambda self: self.setup.loss.needs_reference)
  updates = property(lambda self: self.spec.epochs * self.spec.mini_batches)

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
    return dataclasses.replace(self, setup=setup_lib.with_model(self.setup, self.model.with_num_layers(layers)))


def build_run(config: ml_collections.ConfigDict) -> Run:
  """The Run of a validated config, set up as the Trainer sets it up, from the model's config
  alone (`setup.read_model_config`: no weights are read)."""
  model, source, tokenizer = setup_lib.read_model_config(config)
  notes = []
  if tokenizer is None:
    notes.append(f"no tokenizer at {source}: the sampler stops at the model config's EOS "
                 f"{list(model.eos_token_ids)}; the trainer adds its tokenizer's end-of-turn tokens (same program "
                 "size).")
  setup = setup_lib.build(config, model, tokenizer if tokenizer is not None else model.eos_token_ids,
                          teacher=setup_lib.read_teacher_config(config))
  if config.train.objective == "sft":
    notes.append("train.objective='sft': the trainer runs only the learner program (its targets come from the data).")
  if config.tools.enabled:
    notes.append("tools.enabled: the plan compiles the single-turn sampler; multi-turn segments are smaller.")
  return Run(setup=setup, model_source=source, notes=notes)


# ---- shardings and abstract inputs --------------------------------------------------------------


def bytes_per_chip(tree) -> int:
  """Bytes one chip holds of a tree of sharded ShapeDtypeStructs (its shard of each leaf)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return total


def expert_bytes_per_chip(tree) -> int:
  """Bytes one chip holds of the routed experts' kernels in a tree shaped like the parameters (the
  parameters, or optimizer state that mirrors them): leaves under a `moe` block named
  gate/up/down_kernel ([E, ...] per layer). 0 for a dense model."""
  total = 0
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if "moe" in keys and keys[-1] in ("gate_kernel", "up_kernel", "down_kernel"):
      total += bytes_per_chip([x])
  return total


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


def decode_layout(run: Run, mesh, inputs: Inputs) -> shd.DecodeLayout:
  """The sampler's weight layout at the model's full depth, from its parameters' bytes against the
  budget (`rljax.rollout.sampler.decode_layout_for`): never from a shallow compile, whose smaller
  model could fit where the real one does not. `inputs`: the full-depth inputs."""
  return decode_layout_for(run.model, inputs.sampler_params, mesh, run.decode_budget_bytes)


def with_decode_copy(run: Run, inputs: Inputs, mesh, layout: shd.DecodeLayout) -> Inputs:
  """`inputs` whose sampler parameters are the decode copy (compute dtype, in `layout` on `mesh`):
  what the async mode's generators hold and their generate program reads (no float32 state
  there; trainer/async_rollouts.py)."""
  shapes = jax.eval_shape(lambda p: decode_cast(run.model, p), inputs.sampler_params)
  shardings = layout.shardings(param_logical_axes(run.model), shapes, mesh)
  copy = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
  return dataclasses.replace(inputs, sampler_params=copy, sampler_param_bytes=bytes_per_chip(copy), frozen_bytes=0)


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
  rollout: Any          # scored Rollout [N, ...], rows split over the devices
  param_bytes: int          # the trained parameters (under LoRA: the adapters)
  opt_bytes: int
  ref_bytes: int
  sampler_param_bytes: int  # what the sampler is given: `param_bytes + frozen_bytes`
  frozen_bytes: int = 0     # LoRA: the frozen base, in the storage dtype (model.dtype)
  trainable_params: int = 0  # parameter count the optimizer updates (the whole model, or the adapters)
  expert_param_bytes: int = 0  # of param_bytes, the routed experts' kernels (mixture of experts)
  expert_opt_bytes: int = 0    # of opt_bytes, the optimizer state of those kernels
  expert_sampler_bytes: int = 0  # of sampler_param_bytes, the experts' kernels the sampler is given


def build_inputs(run: Run, mesh) -> Inputs:
  """The programs' inputs as the trainer passes them, as sharded ShapeDtypeStructs: the train state
  (`setup.abstract_state`), the parameters the sampler reads (the state's, as the fused step passes
  them: fp32 in the learner's layout, under LoRA the frozen base joined with the adapters; the
  decode layout is made inside the program), a key, the prompts, and a scored rollout."""
  state, state_sh = setup_lib.abstract_state(run.setup, mesh)
  sampler_params = state.model_params()
  replicated = NamedSharding(mesh, P())
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated)
  prompts = setup_lib.prompt_sharding(run.setup, mesh)
  prompt_ids = jax.ShapeDtypeStruct((run.prompts, run.prompt_len), jnp.int32, sharding=prompts)
  prompt_mask = jax.ShapeDtypeStruct((run.prompts, run.prompt_len), jnp.bool_, sharding=prompts)
  unscored = jax.eval_shape(make_generate_fn(run.spec, None), sampler_params, key, prompt_ids, prompt_mask)
  k = run.components
  rollout = jax.eval_shape(lambda r: r.with_rewards(jnp.zeros((run.rows,)), jnp.zeros((run.rows, k))), unscored)
  rollout = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), rollout,
                         setup_lib.by_rows(mesh, rollout))
  return Inputs(state=state, state_sh=state_sh, sampler_params=sampler_params, key=key, prompt_ids=prompt_ids,
                prompt_mask=prompt_mask, rollout=rollout, param_bytes=bytes_per_chip(state.params),
                opt_bytes=bytes_per_chip(state.opt_state),
                ref_bytes=bytes_per_chip(state.ref_params) if state.ref_params is not None else 0,
                sampler_param_bytes=bytes_per_chip(sampler_params),
                frozen_bytes=bytes_per_chip(state.frozen) if state.frozen is not None else 0,
                trainable_params=sum(math.prod(x.shape) for x in jax.tree.leaves(state.params)),
                expert_param_bytes=expert_bytes_per_chip(state.params),
                expert_opt_bytes=expert_bytes_per_chip(state.opt_state),
                expert_sampler_bytes=expert_bytes_per_chip(sampler_params))


def program_of(name: str, run: Run, mesh, inputs: Inputs, reward_fn=None) -> tuple[Callable, tuple]:
  """(the jitted function, its abstract arguments) of program `name`: the trainer's program from
  rljax/trainer/setup.py. The fused step scores with `reward_fn` (default: a stand-in computed from
  the sampled tokens, since a deviceless compile cannot call the reward pool)."""
  if name == "sampler":
    return (setup_lib.generate_program(run.setup, mesh, decode_budget_bytes=run.decode_budget_bytes,
                                       decode_layout=run.decode_layout),
            (inputs.sampler_params, inputs.key, inputs.prompt_ids, inputs.prompt_mask))
  if name == "learner":
    return setup_lib.update_program(run.setup, mesh, inputs.state_sh), (inputs.state, inputs.rollout)
  if name == "fused":
    reward_fn = reward_fn or setup_lib.stand_in_reward_fn(run.components)
    graph = reward_models.abstract_scorer(RewardSpec(components=run.config.rewards.to_dict()["components"]), mesh,
                                          dtype=run.model.dtype)
    if graph is None:
      return (setup_lib.train_step_program(run.setup, mesh, inputs.state_sh, reward_fn,
                                           decode_layout=run.decode_layout),
              (inputs.state, inputs.prompt_ids, inputs.prompt_mask))
    # Reward models and judges: their parameters and forward are part of the step (and of its memory).
    graph_inputs = reward_models.abstract_inputs(graph, run.prompts, run.prompt_len)
    stand_in = reward_fn

    def reward_fn(tokens, lengths, graph_inputs):
      rewards, components = stand_in(tokens, lengths)
      return rewards + graph.scores(graph_inputs, tokens, lengths).sum(1), components

    shardings = jax.tree.map(lambda x: x.sharding, graph_inputs)
    return (setup_lib.train_step_program(run.setup, mesh, inputs.state_sh, reward_fn, shardings,
                                         decode_layout=run.decode_layout),
            (inputs.state, inputs.prompt_ids, inputs.prompt_mask, graph_inputs))
  raise ConfigError(f"--program={name!r} is not one of {PROGRAMS + ('all',)}.")


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
  fn, args = program_of(program, run, mesh, inputs)
  t0 = time.perf_counter()
  try:
    compiled = fn.lower(*args).compile()
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

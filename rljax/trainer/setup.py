"""The run's setup: what the Trainer and `rljax plan` build from the config, one path for both.

    config --model--> ModelConfig: `load_policy` loads the weights (the trainer); `read_model_config`
                      reads only config.json or a GGUF header (the plan); both apply the run's
                      settings the same way (`random_model_config`, `run_model_config`)
           --build--> `Setup`: SamplingParams with the tokenizer's stop ids, the StepSpec, the
                      optimizer and its schedule
           --state--> the TrainState and its shardings: `init_state` from weights, or
                      `abstract_state` (shapes and shardings only, nothing allocated)
           --programs--> the jitted programs the runners call: `generate_program`,
                      `update_program`, `train_step_program`

`rljax plan` calls the same functions with abstract inputs and a stand-in reward function, so it
compiles the programs the trainer runs (tests/test_setup.py compares their lowered HLO).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rljax import config as config_lib, sharding as shd
from rljax.data.batching import check_bos
from rljax.errors import ConfigError
from rljax.models import lora
from rljax.models.config import ModelConfig, family_switches
from rljax.models.gguf_io import open_gguf
from rljax.models.io import CONFIG_FILE, TOKENIZER_FILES, load_pretrained, resolve
from rljax.models.policy import Policy, init_params, param_shardings
from rljax.rl import LossConfig
from rljax.rollout.draw import SamplingParams
from rljax.rollout.sampler import make_generate_fn
from rljax.tokenizer import Tokenizer, load_tokenizer
from rljax.trainer.optim import make_optimizer
from rljax.trainer.state import TrainState
from rljax.trainer.step import StepSpec, jit_train_step, make_train_step, make_update_fn

# ---- the model ----------------------------------------------------------------------------------


def random_model_config(model_cfg, tokenizer: Tokenizer | None) -> ModelConfig:
  """The ModelConfig of config.model.random (model.path="random"): its sizes, the tokenizer's
  vocabulary when random.vocab_size is 0, the tokenizer's EOS, a RANDOM_MODEL_CONTEXT context."""
  r = model_cfg.random
  vocab = r.vocab_size or (tokenizer.vocab_size if tokenizer is not None else 0)
  if not vocab:
    raise ConfigError("config.model.random.vocab_size=0 needs config.tokenizer to be set (or give a vocab size).")
  return ModelConfig(vocab_size=vocab, hidden_size=r.hidden_size, intermediate_size=r.intermediate_size,
                     num_layers=r.num_layers, num_heads=r.num_heads, num_kv_heads=r.num_kv_heads,
                     head_dim=r.head_dim, architecture=r.architecture, tie_word_embeddings=r.tie_word_embeddings,
                     **family_switches(r.architecture, r.num_layers, r.head_dim),
                     eos_token_ids=(tokenizer.eos_id,) if tokenizer is not None and tokenizer.eos_id is not None
                     else (), max_position_embeddings=config_lib.RANDOM_MODEL_CONTEXT)


def _lora_config(model_cfg):
  return config_lib.lora_config(ml_collections.ConfigDict({"model": model_cfg}))


def param_dtype(model_cfg) -> str:
  """The parameters' storage dtype: float32 master weights, or under LoRA the frozen base in the
  compute dtype (model.dtype): it is never updated, so no float32 copy is kept."""
  return model_cfg.dtype if _lora_config(model_cfg) is not None else "float32"


def run_model_config(mc: ModelConfig, model_cfg) -> ModelConfig:
  """The model's own config with the run's settings from config.model: the compute dtype, remat,
  the attention backend, the LoRA adapters, the parameters' storage dtype (`param_dtype`) and, for
  a mixture of experts, config.model.moe (`moe_config`)."""
  return mc.replace(dtype=model_cfg.dtype, remat=model_cfg.remat, attention=model_cfg.attention,
                    lora=_lora_config(model_cfg), param_dtype=param_dtype(model_cfg), moe=moe_config(mc, model_cfg))


_MOE_DEFAULTS = dict(routing_replay="auto", aux_loss_coef=None, z_loss_coef=0.0, kernel="auto", dispatch="auto")


def moe_config(mc: ModelConfig, model_cfg):
  """The model's MoeConfig with config.model.moe's settings (routing replay "auto": on unless the
  compute dtype is float32); None for a dense model, which must leave config.model.moe at its defaults."""
  m = model_cfg.get("moe")
  if m is None:
    return mc.moe
  if mc.moe is None:
    bad = [f"model.moe.{k}={m[k]!r}" for k, v in _MOE_DEFAULTS.items() if k in m and m[k] != v]
    if bad:
      raise ConfigError(f"config.{', config.'.join(bad)}: the model ({mc.architecture}) is dense, not a mixture of "
                        "experts; drop the model.moe settings.")
    return None
  replay = m.routing_replay if m.routing_replay != "auto" else model_cfg.dtype != "float32"
  aux = mc.moe.aux_loss_coef if m.aux_loss_coef is None else float(m.aux_loss_coef)
  return mc.moe.replace(routing_replay=bool(replay), aux_loss_coef=aux, z_loss_coef=float(m.z_loss_coef),
                        kernel=m.kernel, dispatch=m.dispatch)


def load_policy(model_cfg, tokenizer_path: str = "", mesh=None) -> Policy:
  """The policy named by config.model: pretrained weights, or a random model for tests.

  With `mesh` the parameters are created sharded: each process reads only the checkpoint slices
  its devices hold (rljax/models/io.py), and no device ever holds the whole model.

  With config.model.lora.rank > 0 the config carries the LoraConfig and the (base) parameters are
  stored in the compute dtype, model.dtype. The adapters are made with the state (`init_state`)."""
  if model_cfg.path == "random":
    tok = load_tokenizer(tokenizer_path) if tokenizer_path else None
    mc = run_model_config(random_model_config(model_cfg, tok), model_cfg)
    base = mc.replace(lora=None)
    init = init_params if mesh is None else jax.jit(init_params, static_argnums=0,
                                                    out_shardings=param_shardings(base, mesh))
    return Policy(mc, init(base, jax.random.key(model_cfg.random.seed)), tokenizer=tok, source="random")
  policy = load_pretrained(model_cfg.path, mesh=mesh, param_dtype=param_dtype(model_cfg))
  policy = dataclasses.replace(policy, config=run_model_config(policy.config, model_cfg))
  if tokenizer_path:
    policy = dataclasses.replace(policy, tokenizer=load_tokenizer(tokenizer_path))
  if policy.tokenizer is None:
    raise ConfigError(f"config.model.path={model_cfg.path!r} has no tokenizer; set config.tokenizer.")
  return policy


def teacher_model_config(mc: ModelConfig, model_cfg) -> ModelConfig:
  """The distillation teacher's config with the run's compute settings: model.dtype for compute and
  storage (it is never updated: no float32 copy), remat and attention as the student's, no adapters."""
  return mc.replace(dtype=model_cfg.dtype, remat=model_cfg.remat, attention=model_cfg.attention, lora=None,
                    param_dtype=model_cfg.dtype)


def load_teacher(config: ml_collections.ConfigDict, student: ModelConfig, tokenizer: Tokenizer | None,
                 mesh=None) -> Policy | None:
  """The frozen teacher of train.objective='distill' (config.distill.teacher: any model rljax loads), its
  parameters sharded by its own logical axes on `mesh`; None for the other objectives. Raises ConfigError
  naming distill.teacher when its vocabulary is not the student's (the teacher scores the student's token ids)."""
  if config.train.objective != "distill":
    return None
  path = config.distill.teacher
  teacher = load_pretrained(path, mesh=mesh, param_dtype=config.model.dtype)
  check_same_vocabulary(path, teacher.config, teacher.tokenizer, student, tokenizer)
  return dataclasses.replace(teacher, config=teacher_model_config(teacher.config, config.model))


def check_same_vocabulary(path: str, teacher: ModelConfig, teacher_tok: Tokenizer | None, student: ModelConfig,
                          student_tok: Tokenizer | None) -> None:
  """The teacher must give a log-prob to every token id the student samples, meaning the same token."""
  if teacher.vocab_size < student.vocab_size:
    raise ConfigError(f"config.distill.teacher={path!r}: its vocabulary has {teacher.vocab_size} entries, fewer than "
                      f"the student's {student.vocab_size}; the teacher must score every token the student can "
                      "sample: use a teacher with the student's tokenizer.")
  if teacher_tok is None or student_tok is None:
    return
  a, b = (t.backend.get_vocab(with_added_tokens=True) for t in (student_tok, teacher_tok))
  differ = [tok for tok, i in a.items() if b.get(tok) != i]
  if differ:
    tok = differ[0]
    raise ConfigError(f"config.distill.teacher={path!r}: its tokenizer is not the student's ({len(differ)} of {len(a)} "
                      f"tokens differ, e.g. {tok!r} is id {a[tok]} for the student and {b.get(tok)} for the teacher); "
                      "on-policy distillation scores the student's token ids with the teacher, so both must share "
                      "one vocabulary.")


def read_teacher_config(config: ml_collections.ConfigDict) -> ModelConfig | None:
  """The distillation teacher's ModelConfig (as `load_teacher` makes it) from its config.json or GGUF header
  alone, for `rljax plan`; None unless train.objective='distill'."""
  if config.train.objective != "distill":
    return None
  mc, _, _ = read_model_config(config, path=config.distill.teacher)
  return teacher_model_config(mc, config.model)


def read_model_config(config: ml_collections.ConfigDict, path: str | None = None
                      ) -> tuple[ModelConfig, str, Tokenizer | None]:
  """(ModelConfig, where it was read, the tokenizer or None) of config.model without its weights.

  config.model.path: a directory holding config.json (the weights need not be there), a
  config.json file, a .gguf file or built-in name (metadata only), or "random". The tokenizer is
  the one the trainer would load (config.tokenizer, else the model's own) when its files are
  there; a directory with only config.json has none (`rljax plan` needs no more). `path`: read that
  model instead (the distillation teacher; its tokenizer is not loaded).
  """
  m = config.model
  teacher, path = path is not None, m.path if path is None else path
  if path == "random":
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    return run_model_config(random_model_config(m, tokenizer), m), "random model (config.model.random)", tokenizer
  hf_json = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
  if os.path.isfile(hf_json) and hf_json.endswith(".json"):
    try:
      mc = ModelConfig.from_hf(_read_json(hf_json), source=hf_json)
    except (OSError, UnicodeDecodeError, ValueError) as e:
      raise ConfigError(f"config.model.path={path!r}: {hf_json} is not a readable JSON model config ({e}).") from None
    source, directory = hf_json, os.path.dirname(hf_json) or "."
    has_tokenizer = any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)
  else:
    kind, file = resolve(path)
    if kind != "gguf":
      raise ConfigError(f"config.model.path={path!r}: no config.json there; rljax plan needs only the model's "
                        "config.json (a directory holding it is enough).")
    ckpt = open_gguf(file)
    mc, source, directory, has_tokenizer = ckpt.config, file, file, ckpt.has("tokenizer.ggml.tokens")
  if teacher:
    tokenizer = None
  elif config.tokenizer:
    tokenizer = load_tokenizer(config.tokenizer)
  else:
    tokenizer = load_tokenizer(directory) if has_tokenizer else None
  return run_model_config(mc, m), source, tokenizer


def _read_json(path: str) -> dict:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# ---- the static step ----------------------------------------------------------------------------


def sampling_params(cfg, tokenizer: Tokenizer | Sequence[int], *, greedy=False, max_new_tokens=None,
                    num_samples=None, temperature=None, stops=True, slots=0) -> SamplingParams:
  """SamplingParams from config.sampling. tokenizer: its `stop_ids` end a completion, with
  config.sampling.stop_token_ids (or pass the stop ids themselves); `stops=False` drops them all
  (sampling.ignore_eos). slots: the decode slots (the rollouts pass sampling.slots; evaluation,
  whose batches are other sizes, decodes every row)."""
  s = cfg.sampling
  temp = s.temperature if temperature is None else temperature
  ids = getattr(tokenizer, "stop_ids", tokenizer)
  return SamplingParams(
      num_samples=num_samples or s.num_samples, max_new_tokens=max_new_tokens or s.max_new_tokens,
      temperature=temp if temp > 0 else 1.0, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
      greedy=greedy or temp == 0,
      stop_token_ids=tuple(sorted(set(ids) | {int(i) for i in s.stop_token_ids})) if stops else (),
      slots=slots)


@dataclasses.dataclass(frozen=True)
class Setup:
  """The static parts of a run, derived from its config and its model.

  spec: the StepSpec every program is traced with; sampling: its SamplingParams (rollouts honour
  sampling.ignore_eos); optimizer, schedule: the optax chain over `total_updates` updates.
  """
  config: ml_collections.ConfigDict
  model: ModelConfig
  spec: StepSpec
  optimizer: optax.GradientTransformation
  schedule: Callable
  total_updates: int

  @property
  def loss(self) -> LossConfig:
    return self.spec.loss

  @property
  def sampling(self) -> SamplingParams:
    return self.spec.sampling

  @property
  def oversample(self) -> int:
    return self.spec.oversample

  @property
  def batch_rows(self) -> int:
    """Prompts sampled per step, all processes: P * O."""
    return self.spec.prompts * self.spec.oversample

  @property
  def rows(self) -> int:
    """Completions sampled per step: P * O * G."""
    return self.batch_rows * self.spec.group


def build(config: ml_collections.ConfigDict, model: ModelConfig, tokenizer: Tokenizer | Sequence[int],
          teacher: ModelConfig | None = None) -> Setup:
  """The Setup of a validated config for `model` (its run settings applied), with the stop ids of
  `tokenizer` (or the ids themselves where there is no tokenizer). Raises ConfigError when prompt +
  completion exceed the model's context, or the prompts would lack a BOS the model needs.
  teacher: train.objective='distill': the teacher's config (`load_teacher`)."""
  config_lib.check_model_fits(config, model.context_length)   # with YaRN the scaled context
  if config.model.path != "random" and isinstance(tokenizer, Tokenizer):
    check_bos(model.architecture, tokenizer, config.data.chat_template)   # pretrained Gemma: <bos> first
  t = config.train
  sp = sampling_params(config, tokenizer, stops=not config.sampling.ignore_eos, slots=config.sampling.slots)
  recompute = config_lib.recompute_old_logprobs(config)
  if t.objective == "sft":   # one target per prompt, from the data: rows are prompts
    sp = dataclasses.replace(sp, num_samples=1)
  if t.objective == "distill" and teacher is None:
    raise ConfigError("train.objective='distill' needs the teacher's model config (setup.build(..., teacher=)).")
  spec = StepSpec(model=model, sampling=sp, loss=config_lib.loss_config(config), prompts=t.prompts_per_step,
                  mini_batches=t.mini_batches, epochs=t.epochs, micro_batches=t.micro_batches,
                  eos_ids=sp.stop_token_ids, oversample=config_lib.dynamic_oversample(config),
                  recompute_old_logprobs=recompute,
                  gap_rows=0 if t.objective != "rl" else _gap_rows(config, recompute, sp.num_samples),
                  pack_tokens=t.pack_tokens, shared_prefix=bool(t.shared_prefix),
                  pack_width=t.pack_width, objective=t.objective, min_reward=float(config.rft.min_reward),
                  teacher=teacher if t.objective == "distill" else None,
                  reward_weight=float(config.distill.reward_weight))
  total_updates = max(t.steps * t.mini_batches * t.epochs, 1)
  optimizer, schedule = make_optimizer(config.optim, total_updates)
  return Setup(config=config, model=model, spec=spec, optimizer=optimizer, schedule=schedule,
               total_updates=total_updates)


def _gap_rows(config, recompute: bool, group: int) -> int:
  """Rows (one group) whose learner log-probs are compared with the sampler's (`sampler/logprob_gap_*`):
  a forward of its own when lp_old is the sampler's (or, with one optimizer update per step, the
  update's own forward over every row: `make_update_fn`); free when an on-policy run recomputes lp_old
  (bf16), which is then the learner's forward on the sampler's parameters; none off-policy."""
  if not recompute:
    return group
  return group if config_lib.max_staleness(config) == 0 else 0


def with_model(setup: Setup, model: ModelConfig) -> Setup:
  """The same run on another ModelConfig (the plan's depth extrapolation)."""
  return dataclasses.replace(setup, model=model, spec=dataclasses.replace(setup.spec, model=model))


# ---- the train state ----------------------------------------------------------------------------


def state_shardings(state: TrainState, mesh, param_sh, frozen_sh=None, teacher_sh=None) -> TrainState:
  """Params, ref params and param-shaped optimizer moments by logical axes (under LoRA `param_sh`
  is the adapters' and `frozen_sh` the base's; `teacher_sh` the distillation teacher's); everything
  else replicated."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  param_struct = jax.tree.structure(state.params)
  is_param_tree = lambda n: jax.tree.structure(n) == param_struct
  opt_sh = jax.tree.map(lambda n: param_sh if is_param_tree(n) else replicated, state.opt_state,
                        is_leaf=is_param_tree)
  return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                    ref_params=None if state.ref_params is None else param_sh, frozen=frozen_sh,
                    teacher=None if state.teacher is None else teacher_sh)


def _new_state(setup: Setup, params, adapter_sh=None, teacher=None) -> TrainState:
  """The state at step 0 from the model's parameters (under LoRA the frozen base, and fresh
  adapters trained in its place; the base with the adapters off is the KL reference, no copy).
  teacher: the distillation teacher's parameters (train.objective='distill'), else None."""
  seed = setup.config.train.seed
  if setup.model.lora is not None:
    adapters = lora.init_adapters(setup.model, jax.random.fold_in(jax.random.key(seed), 1), adapter_sh)
    return TrainState.create(adapters, setup.optimizer, seed, frozen=params, teacher=teacher)
  ref = jax.tree.map(jnp.copy, params) if setup.loss.needs_reference else None
  return TrainState.create(params, setup.optimizer, seed, ref_params=ref, teacher=teacher)


def _teacher_shardings(setup: Setup, mesh):
  return None if setup.spec.teacher is None else param_shardings(setup.spec.teacher, mesh)


def _split_shardings(setup: Setup, mesh):
  """(trained parameters' shardings, frozen base's or None)."""
  psh = param_shardings(setup.model, mesh)
  if setup.model.lora is None:
    return psh, None
  base_sh, adapter_sh = lora.split(psh)
  return adapter_sh, base_sh


def init_state(setup: Setup, params, mesh, teacher=None) -> tuple[TrainState, TrainState]:
  """(state, its shardings) from the model's parameters (and the distillation teacher's), placed on `mesh`."""
  trained_sh, frozen_sh = _split_shardings(setup, mesh)
  teacher_sh = _teacher_shardings(setup, mesh)
  if teacher is not None:
    teacher = jax.device_put(teacher, teacher_sh)
  if frozen_sh is not None:
    state = _new_state(setup, jax.device_put(params, frozen_sh), adapter_sh=trained_sh, teacher=teacher)
  else:
    state = _new_state(setup, jax.device_put(params, trained_sh), teacher=teacher)
  shardings = state_shardings(state, mesh, trained_sh, frozen_sh=frozen_sh, teacher_sh=teacher_sh)
  return jax.device_put(state, shardings), shardings


def abstract_state(setup: Setup, mesh) -> tuple[TrainState, TrainState]:
  """(state, its shardings) as `init_state` builds them, the state as jax.ShapeDtypeStructs that
  carry their shardings: nothing of the model's size is allocated."""
  params = jax.eval_shape(lambda: init_params(setup.model, jax.random.key(0)))
  if setup.model.lora is not None:
    params = lora.split(params)[0]
  teacher = None if setup.spec.teacher is None else \
      jax.eval_shape(lambda: init_params(setup.spec.teacher, jax.random.key(0)))
  state = jax.eval_shape(lambda p, t: _new_state(setup, p, teacher=t), params, teacher)
  trained_sh, frozen_sh = _split_shardings(setup, mesh)
  shardings = state_shardings(state, mesh, trained_sh, frozen_sh=frozen_sh, teacher_sh=_teacher_shardings(setup, mesh))
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings), shardings


# ---- the programs -------------------------------------------------------------------------------


def by_rows(mesh, tree):
  """NamedShardings that split every array of `tree` (arrays or ShapeDtypeStructs) by its rows."""
  return jax.tree.map(lambda x: shd.batch_sharding(mesh, x.ndim, x.shape[0]), tree)


def prompt_sharding(setup: Setup, mesh):
  """The sharding of a step's prompts [P*O, Lp]: rows over (data, fsdp)."""
  return shd.batch_sharding(mesh, 2, setup.batch_rows)


def generate_program(setup: Setup, mesh, *, decode_budget_bytes: int | None = None, decode_layout=None):
  """The single-turn sampler, jitted: `(params, key, prompt_ids [P*O, Lp], prompt_mask) -> Rollout`,
  every rollout array split by rows (unconstrained, XLA may leave them, and the work producing
  them, on one device). decode_budget_bytes: the sampler's weight-layout budget (None: half the
  device's memory, as it reports it; the plan passes it for deviceless chips). decode_layout: the
  weights' layout (`make_generate_fn`; the plan passes the one it decided at full depth)."""
  generate = make_generate_fn(setup.spec, mesh, decode_budget_bytes=decode_budget_bytes, decode_layout=decode_layout)
  prompts = lambda dtype: jax.ShapeDtypeStruct((setup.batch_rows, 1), dtype)   # any width: same ranks
  params = jax.eval_shape(lambda: init_params(setup.model, jax.random.key(0)))
  shapes = jax.eval_shape(generate, params, jax.random.key(0), prompts(np.int32), prompts(bool))
  return jax.jit(generate, out_shardings=by_rows(mesh, shapes))


def update_program(setup: Setup, mesh, shardings: TrainState):
  """The update of the decoupled modes, jitted with the state donated:
  `(state, scored Rollout) -> (state, metrics)`."""
  update = make_update_fn(setup.spec, setup.optimizer, setup.schedule, mesh=mesh)
  return jax.jit(update, donate_argnums=(0,), out_shardings=(shardings, None))


def train_step_program(setup: Setup, mesh, shardings: TrainState,
                       reward_fn: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]], inputs_shardings=None,
                       decode_layout=None):
  """The fused step (sample -> rewards -> update), jitted with the state donated:
  `(state, prompt_ids [P*O, Lp], prompt_mask[, reward_inputs]) -> (state, metrics)`. reward_fn: the
  reward pool's io_callback bridge, or the plan's `stand_in_reward_fn`. inputs_shardings: those of
  the reward inputs of in-graph reward models and judges (`RewardFn.graph_inputs`), which the
  step then takes as its fourth argument. decode_layout: the sampler's weight layout (`rljax plan`
  passes the one it decided at the model's full depth; default: chosen when traced)."""
  step = make_train_step(setup.spec, setup.optimizer, reward_fn, setup.schedule, mesh=mesh, decode_layout=decode_layout)
  return jit_train_step(step, shardings, prompt_sharding(setup, mesh), inputs_shardings)


def stand_in_reward_fn(components: int):
  """A reward function for a program compiled without a reward pool (`rljax plan`): rewards [N]
  and components [N, K] computed from the sampled tokens, which, unlike constants, the compiler
  cannot fold away."""

  def reward_fn(tokens, lengths):
    del lengths
    r = (tokens[:, 0] % 2).astype(jnp.float32)
    return r, jnp.broadcast_to(r[:, None], (r.shape[0], components))

  return reward_fn


def reward_components(config: ml_collections.ConfigDict) -> int:
  """K: the reward components config.rewards declares (at least 1)."""
  return max(len(config.rewards.components), 1)


__all__ = [
    "Setup", "abstract_state", "build", "by_rows", "check_same_vocabulary", "generate_program", "init_state",
    "load_policy", "load_teacher", "param_dtype", "read_teacher_config", "teacher_model_config",
    "prompt_sharding", "random_model_config", "read_model_config", "reward_components", "run_model_config",
    "sampling_params", "stand_in_reward_fn", "state_shardings", "train_step_program", "update_program",
    "with_model",
]

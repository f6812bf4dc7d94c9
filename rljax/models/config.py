"""Model configuration: one dataclass for every family's decoder (and the LoRA settings).

One decoder covers every family (rljax/models/families/): the differences are switches (qkv
bias, q/k norm, tied embeddings, RoPE scaling; for Gemma: (1 + w) norms, sandwich norms, scaled
embeddings, GeGLU, soft-capping, sliding-window layers with their own RoPE base,
`query_pre_attn_scalar`), not separate classes. Every switch defaults to off, which is the Llama /
Qwen decoder. What a family's checkpoints look like (config.json fields, weight names, which
switches it fixes) is its module's business; `ModelConfig.from_hf` / `to_hf` / `num_params`
ask the family of `architecture`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from rljax.errors import ConfigError
from rljax.models.rope import LinearRopeScaling, RopeScaling, Scaling, YarnRopeScaling  # noqa: F401 (re-exported)

ACTIVATIONS = ("silu", "gelu_tanh")   # the MLP's gate activation: SwiGLU, or GeGLU with tanh-approximated GELU
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")   # the backends of rljax.models.attention
MOE_KERNELS = ("auto", "ragged_dot", "megablox")   # the grouped matmul of the experts (rljax.models.moe)
MOE_DISPATCH = ("auto", "gather", "all_to_all")     # how tokens reach their experts' chips (rljax.models.moe)
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _families():
  # Function-local: the family modules import this one (config <-> families cycle).
  from rljax.models import families
  return families


def family_switches(architecture: str, num_layers: int, head_dim: int) -> dict[str, Any]:
  """The ModelConfig fields a random model of `architecture` has beyond its shape (its family's
  fixed switches and transformers' defaults of its other hyper-parameters): what
  `model.path="random"` builds for `model.random.architecture`."""
  return _families().get(architecture).random_defaults(num_layers, head_dim)


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")   # the dense decoder's projections (default targets)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the named projections (rljax/models/lora.py): W x + (alpha / rank) B A x.

  targets: projections of the model's family (`Family.lora_targets`; for the dense families
  LORA_TARGETS: attention q, k, v, o; MLP gate, up, down). dropout: on the
  adapter's input in the learner's loss forward only (the sampler and every log-prob recompute run
  without it, PEFT's convention); 0 keeps the sampler-equals-learner property exact in fp32.
  """
  rank: int
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = LORA_TARGETS

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(str(t) for t in self.targets))
    if int(self.rank) < 1:
      raise ConfigError(f"model.lora.rank={self.rank!r} must be a positive integer (0 turns LoRA off).")
    known = _families().lora_target_names()
    bad = [t for t in self.targets if t not in known]
    if bad or not self.targets:
      raise ConfigError(f"model.lora.targets={list(self.targets)!r}: each must be one of {list(known)} "
                        "(the embedding and the output head take no adapter), and at least one is needed.")
    if not 0.0 <= float(self.dropout) < 1.0:
      raise ConfigError(f"model.lora.dropout={self.dropout!r} must be in [0, 1).")
    if not float(self.alpha) > 0:
      raise ConfigError(f"model.lora.alpha={self.alpha!r} must be positive.")

  @property
  def scale(self) -> float:
    """The factor on the adapter's output: alpha / rank (PEFT's `scaling`)."""
    return float(self.alpha) / int(self.rank)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """A mixture of experts in place of the dense MLP (rljax/models/moe.py): a router picks the top
  `experts_per_token` of `num_experts` SwiGLU experts for each token, dropless.

  num_experts: E routed experts per MoE layer. experts_per_token: k, the experts a token goes to.
  intermediate_size: each expert's SwiGLU width (HF `moe_intermediate_size`; the dense layers'
    width is ModelConfig.intermediate_size).
  norm_topk_prob: the k gates are renormalised to sum to 1 (else they are the router's softmax
    probabilities of the chosen experts, as they are).
  sparse_step, dense_layers: HF's `decoder_sparse_step` and `mlp_only_layers`: layer i is a MoE
    layer unless i is in dense_layers or (i + 1) % sparse_step != 0 (`ModelConfig.moe_layers`).
  aux_loss_coef: weight of the load-balancing loss (Switch Transformer's E * sum_e f_e P_e per
    layer, averaged over the MoE layers, as transformers computes it); 0 = off (the RL default,
    as in verl). z_loss_coef: weight of the router z-loss (mean over tokens of logsumexp(logits)^2,
    averaged over the MoE layers); 0 = off. Both are over real tokens only.
  routing_replay: the learner computes with the experts the sampler chose for each token
    (recorded in the Rollout) instead of choosing again; the gates are recomputed from the
    learner's router at those experts, so the router still gets gradients.
  kernel: the grouped matmul of the experts: "ragged_dot" (`jax.lax.ragged_dot`: XLA's native
    kernel on TPU and GPU, a masked dense loop on CPU), "megablox" (the Pallas TPU kernel; TPU
    only), "auto" (ragged_dot everywhere: see docs/models.md for why megablox is not the default).
  dispatch: how tokens reach the chips holding their experts when the experts are split over the
    mesh's fsdp axis: "gather" (all-gather the tokens over fsdp, each chip computes its experts,
    reduce-scatter the outputs), "all_to_all" (ragged all-to-all of each token's copies to its
    experts' chips and back), "auto" (all_to_all when the fsdp axis is wider than k, else gather:
    the cheaper in bytes; docs/models.md).
  """
  num_experts: int
  experts_per_token: int
  intermediate_size: int
  norm_topk_prob: bool = False
  sparse_step: int = 1
  dense_layers: tuple[int, ...] = ()
  aux_loss_coef: float = 0.0
  z_loss_coef: float = 0.0
  routing_replay: bool = False
  kernel: str = "auto"
  dispatch: str = "auto"

  def __post_init__(self):
    object.__setattr__(self, "dense_layers", tuple(sorted({int(i) for i in self.dense_layers})))
    for name in ("num_experts", "experts_per_token", "intermediate_size", "sparse_step"):
      if int(getattr(self, name)) < 1:
        raise ConfigError(f"model.moe.{name}={getattr(self, name)!r} must be a positive integer.")
    if self.experts_per_token > self.num_experts:
      raise ConfigError(f"model.moe.experts_per_token={self.experts_per_token} exceeds model.moe.num_experts="
                        f"{self.num_experts}.")
    if any(i < 0 for i in self.dense_layers):
      raise ConfigError(f"model.moe.dense_layers={list(self.dense_layers)} must hold layer indices >= 0.")
    for name in ("aux_loss_coef", "z_loss_coef"):
      v = float(getattr(self, name))
      if not (v >= 0 and v < float("inf")):
        raise ConfigError(f"model.moe.{name}={getattr(self, name)!r} must be a finite number >= 0 (0 = off).")
    if self.kernel not in MOE_KERNELS:
      raise ConfigError(f"model.moe.kernel={self.kernel!r} is not supported; use one of {MOE_KERNELS}.")
    if self.dispatch not in MOE_DISPATCH:
      raise ConfigError(f"model.moe.dispatch={self.dispatch!r} is not supported; use one of {MOE_DISPATCH}.")

  def is_moe_layer(self, i: int) -> bool:
    return i not in self.dense_layers and (i + 1) % self.sparse_step == 0

  def replace(self, **kw) -> "MoeConfig":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer.

  `dtype` is the compute dtype of activations and matmuls; `param_dtype` the
  storage dtype of parameters. Logits can always be produced in float32.

  The Gemma switches (all off by default):
    norm_offset: RMSNorms scale by (1 + weight); the stored weight is the offset (zero-initialised).
    sandwich_norms: an extra RMSNorm on the attention output and on the MLP output, before each
      residual add (HF's post_attention_layernorm / post_feedforward_layernorm).
    embed_scale: embeddings are multiplied by sqrt(hidden_size), in the compute dtype.
    hidden_act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated GELU).
    attn_logit_softcap / final_logit_softcap: c * tanh(x / c) on the attention scores (after
      scaling, before masking) / on the output logits; None = off.
    query_pre_attn_scalar: attention scores are scaled by its -1/2 power instead of head_dim's.
    sliding_window: W; the layers flagged in `sliding_layers` let a query at position p see keys at
      positions > p - W only. sliding_layers: one bool per layer (() = none).
    rope_local_theta: the RoPE base of the sliding layers (None = rope_theta for all layers).

  rope_scaling: None, or the scaling of the (global layers') RoPE frequencies: RopeScaling (Llama 3),
  LinearRopeScaling or YarnRopeScaling (rljax/models/rope.py). max_position_embeddings is
  config.json's; `context_length` is the context the model is configured for (YaRN's scaled one).

  moe: None (a dense model), or the mixture of experts of the MoE layers (`MoeConfig`; a MoE
  family's models always have one). `moe_layers` says which layers are MoE layers.

  lora: low-rank adapters on the projections (None = off). The parameter tree then holds
  `<name>_lora_a` / `<name>_lora_b` leaves beside each adapted `<name>_kernel`, always float32;
  a tree without them runs the base model (rljax/models/lora.py).
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  architecture: str = "llama"
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: Scaling | None = None
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  attention_bias: bool = False
  qk_norm: bool = False
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  attention: str = "auto"   # runtime choice of the no-cache attention backend (rljax.models.attention)
  norm_offset: bool = False
  sandwich_norms: bool = False
  embed_scale: bool = False
  hidden_act: str = "silu"
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  query_pre_attn_scalar: float | None = None
  sliding_window: int | None = None
  sliding_layers: tuple[bool, ...] = ()
  rope_local_theta: float | None = None
  lora: LoraConfig | None = None
  moe: MoeConfig | None = None

  def __post_init__(self):
    family = _families().get(self.architecture)   # ConfigError naming model.architecture when unknown
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim"):
      if int(getattr(self, name)) < 1:
        raise ConfigError(f"model.{name}={getattr(self, name)!r} must be a positive integer.")
    if self.head_dim % 2:
      raise ConfigError(f"model.head_dim={self.head_dim} must be even: RoPE rotates pairs of dimensions.")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"model.num_heads={self.num_heads} must be a multiple of "
                        f"model.num_kv_heads={self.num_kv_heads}.")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ConfigError(f"model.{name}={getattr(self, name)!r} is not supported; use one of {tuple(_DTYPES)}.")
    if self.attention not in ATTENTION_IMPLS:
      raise ConfigError(f"model.attention={self.attention!r} is not supported; use one of {ATTENTION_IMPLS}.")
    if self.hidden_act not in ACTIVATIONS:
      raise ConfigError(f"model.hidden_act={self.hidden_act!r} is not supported; use one of {ACTIVATIONS}.")
    for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar", "rope_local_theta"):
      v = getattr(self, name)
      if v is not None and not float(v) > 0:
        raise ConfigError(f"model.{name}={v!r} must be a positive number or None (off).")
    object.__setattr__(self, "sliding_layers", tuple(bool(x) for x in self.sliding_layers))
    if self.sliding_layers:
      if len(self.sliding_layers) != self.num_layers:
        raise ConfigError(f"model.sliding_layers has {len(self.sliding_layers)} entries but model.num_layers="
                          f"{self.num_layers}; give one bool per layer (or () for no sliding-window layer).")
      if any(self.sliding_layers) and (self.sliding_window is None or int(self.sliding_window) < 1):
        raise ConfigError(f"model.sliding_layers flags sliding-window layers but model.sliding_window="
                          f"{self.sliding_window!r}; set it to the window size (a positive integer).")
    if self.lora is not None and not set(self.lora.targets) <= set(family.lora_targets):
      raise ConfigError(f"model.lora.targets={list(self.lora.targets)!r}: {self.architecture} models take adapters "
                        f"on {list(family.lora_targets)} only{family.lora_note}.")
    if (self.moe is not None) != family.mixture_of_experts:
      raise ConfigError(f"model.architecture={self.architecture!r} is a "
                        f"{'mixture-of-experts' if family.mixture_of_experts else 'dense'} family but model.moe is "
                        f"{'None' if self.moe is None else 'set'}; "
                        f"{'give it a MoeConfig' if self.moe is None else 'drop model.moe or use a MoE family'}.")
    if self.moe is not None and any(i >= self.num_layers for i in self.moe.dense_layers):
      raise ConfigError(f"model.moe.dense_layers={list(self.moe.dense_layers)} names layers past model.num_layers="
                        f"{self.num_layers}.")

  @property
  def has_sliding_layers(self) -> bool:
    """Whether some layer attends within a sliding window (static: picks code paths)."""
    return self.sliding_window is not None and any(self.sliding_layers)

  @property
  def moe_layers(self) -> tuple[bool, ...]:
    """One bool per layer: a MoE layer (all False for a dense model)."""
    if self.moe is None:
      return (False,) * self.num_layers
    return tuple(self.moe.is_moe_layer(i) for i in range(self.num_layers))

  @property
  def attention_scale(self) -> float | None:
    """The factor on q.k: query_pre_attn_scalar ** -0.5 when set (Gemma), else None, which the
    attention code reads as a division by sqrt(head_dim)."""
    return None if self.query_pre_attn_scalar is None else float(self.query_pre_attn_scalar) ** -0.5

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def storage_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied), as the family counts it."""
    return _families().get(self.architecture).num_params(self)

  @property
  def context_length(self) -> int:
    """The longest sequence (prompt + completion) the model is configured for: max_position_embeddings,
    or with YaRN the scaled context original_max_position_embeddings * factor when longer."""
    if self.rope_scaling is None:
      return self.max_position_embeddings
    return self.rope_scaling.context_length(self.max_position_embeddings)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def with_num_layers(self, n: int) -> "ModelConfig":
    """The same model at depth n, its per-layer sliding pattern repeated or cut to n layers
    (`rljax plan --layers` compiles shallower copies and extrapolates)."""
    pattern = self.sliding_layers
    moe = self.moe
    if moe is not None:   # the dense layers that remain (the sparse step applies at any depth)
      moe = moe.replace(dense_layers=tuple(i for i in moe.dense_layers if i < n))
    return self.replace(num_layers=n, sliding_layers=tuple(pattern[i % len(pattern)] for i in range(n)) if pattern
                        else (), moe=moe)

  # ---- Hugging Face config.json <-> ModelConfig (the family's work) --------------------------

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
    """Reads a transformers 4.x or 5.x `config.json` dict, by its model_type's family."""
    return _families().from_hf(hf, source)

  def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
    """A transformers-loadable `config.json` dict (written with both 4.x and 5.x field names)."""
    return _families().get(self.architecture).to_hf(self, dtype)

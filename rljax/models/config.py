"""Model configuration shared by the Llama, Qwen2, Qwen3, Gemma 2 and Gemma 3 families.

One decoder covers all five: the differences are switches (qkv bias, q/k norm, tied embeddings,
Llama 3 RoPE scaling; for Gemma: (1 + w) norms, sandwich norms, scaled embeddings, GeGLU,
soft-capping, sliding-window layers with their own RoPE base, `query_pre_attn_scalar`), not
separate classes. Every switch defaults to off, which is the Llama / Qwen decoder.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from rljax.errors import ConfigError, WeightsError

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh")   # the MLP's gate activation: SwiGLU, or GeGLU with tanh-approximated GELU
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")   # the backends of rljax.models.attention
_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
_HF_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
_HF_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency scaling of RoPE (`rope_type: llama3` in HF configs)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


def family_switches(architecture: str, num_layers: int, head_dim: int) -> dict[str, Any]:
  """The ModelConfig switches a Gemma model has by transformers' defaults ({} for the other families,
  whose random models keep every switch off): what `model.path="random"` builds for
  `model.random.architecture` gemma2 / gemma3."""
  if architecture == "gemma2":
    return dict(norm_offset=True, sandwich_norms=True, embed_scale=True, hidden_act="gelu_tanh",
                attn_logit_softcap=50.0, final_logit_softcap=30.0, query_pre_attn_scalar=float(head_dim),
                sliding_window=4096, sliding_layers=tuple(bool((i + 1) % 2) for i in range(num_layers)))
  if architecture == "gemma3":
    return dict(norm_offset=True, sandwich_norms=True, embed_scale=True, hidden_act="gelu_tanh", qk_norm=True,
                query_pre_attn_scalar=float(head_dim), sliding_window=4096, rope_theta=1_000_000.0,
                rope_local_theta=10_000.0, sliding_layers=tuple(bool((i + 1) % 6) for i in range(num_layers)))
  return {}


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")   # the projections an adapter can sit on


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the named projections (rljax/models/lora.py): W x + (alpha / rank) B A x.

  targets: a subset of LORA_TARGETS (attention q, k, v, o; MLP gate, up, down). dropout: on the
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
    bad = [t for t in self.targets if t not in LORA_TARGETS]
    if bad or not self.targets:
      raise ConfigError(f"model.lora.targets={list(self.targets)!r}: each must be one of {list(LORA_TARGETS)} "
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
  rope_scaling: RopeScaling | None = None
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

  def __post_init__(self):
    if self.architecture not in ARCHITECTURES:
      raise ConfigError(f"model.architecture={self.architecture!r} is not supported; use one of {ARCHITECTURES}.")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
      if int(getattr(self, name)) < 1:
        raise ConfigError(f"model.{name}={getattr(self, name)!r} must be a positive integer.")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}.")
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

  @property
  def has_sliding_layers(self) -> bool:
    """Whether some layer attends within a sliding window (static: picks code paths)."""
    return self.sliding_window is not None and any(self.sliding_layers)

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
    """Parameter count (embeddings counted once when tied)."""
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    hd = self.head_dim
    attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.attention_bias:
      attn += hd * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * hd
    layer = attn + 3 * d * f + (4 if self.sandwich_norms else 2) * d
    return self.num_layers * layer + v * d * (1 if self.tie_word_embeddings else 2) + d

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def with_num_layers(self, n: int) -> "ModelConfig":
    """The same model at depth n, its per-layer sliding pattern repeated or cut to n layers
    (`rljax plan --layers` compiles shallower copies and extrapolates)."""
    pattern = self.sliding_layers
    return self.replace(num_layers=n, sliding_layers=tuple(pattern[i % len(pattern)] for i in range(n)) if pattern
                        else ())

  # ---- Hugging Face config.json <-> ModelConfig -------------------------------------------

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
    """Reads a transformers 4.x or 5.x `config.json` dict (`rope_theta` or `rope_parameters`)."""
    model_type = hf.get("model_type")
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
            "gemma3_text": "gemma3"}.get(model_type)
    if model_type == "gemma3":
      raise WeightsError(f"{source}: model_type='gemma3' is the multimodal Gemma 3 (Gemma3ForConditionalGeneration); "
                         "rljax supports the text-only Gemma3ForCausalLM (model_type 'gemma3_text', e.g. "
                         "google/gemma-3-1b-it).")
    if arch is None:
      raise WeightsError(f"{source}: model_type={model_type!r} is not supported; rljax supports llama, qwen2, qwen3, "
                         "gemma2 and gemma3_text.")
    if arch in ("gemma2", "gemma3"):
      return cls._from_hf_gemma(hf, arch, source)
    try:
      num_heads = int(hf["num_attention_heads"])
      hidden = int(hf["hidden_size"])
      rope = dict(hf.get("rope_parameters") or {})
      legacy = hf.get("rope_scaling") or {}
      if legacy and not rope.get("rope_type"):
        rope.update(legacy)
      rope_theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
      rope_type = rope.get("rope_type", rope.get("type", "default"))
      scaling = None
      if rope_type == "llama3":
        scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                              int(rope["original_max_position_embeddings"]))
      elif rope_type not in (None, "default"):
        raise WeightsError(f"{source}: rope_type={rope_type!r} is not supported; rljax supports default and llama3.")
      if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise WeightsError(f"{source}: use_sliding_window=true is not supported; rljax uses full attention "
                           "in every layer.")
      eos = hf.get("eos_token_id")
      eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
      return cls(
          architecture=arch,
          vocab_size=int(hf["vocab_size"]),
          hidden_size=hidden,
          intermediate_size=int(hf["intermediate_size"]),
          num_layers=int(hf["num_hidden_layers"]),
          num_heads=num_heads,
          num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
          head_dim=int(hf.get("head_dim") or hidden // num_heads),
          rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
          rope_theta=rope_theta,
          rope_scaling=scaling,
          max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
          tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default for all three
          attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
          qk_norm=arch == "qwen3",
          bos_token_id=hf.get("bos_token_id"),
          eos_token_ids=eos_ids,
          pad_token_id=hf.get("pad_token_id"),
      )
    except KeyError as e:
      raise WeightsError(f"{source}: required field {e.args[0]!r} is missing from the model config.") from None

  @classmethod
  def _from_hf_gemma(cls, hf: Mapping[str, Any], arch: str, source: str) -> "ModelConfig":
    """Gemma 2 / Gemma 3 text configs of transformers 4.x (rope_theta, rope_local_base_freq,
    sliding_window_pattern) or 5.x (rope_parameters, per layer type for Gemma 3; layer_types)."""
    try:
      num_heads = int(hf["num_attention_heads"])
      hidden = int(hf["hidden_size"])
      layers = int(hf["num_hidden_layers"])
      rope = dict(hf.get("rope_parameters") or {})
      if arch == "gemma3":
        full = dict(rope.get("full_attention") or {})
        local = dict(rope.get("sliding_attention") or {})
        legacy = hf.get("rope_scaling") or {}
        if legacy and not full.get("rope_type"):
          full.update(legacy)
        theta = float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0)))
        local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)))
        kinds = {"full_attention": full, "sliding_attention": local}
      else:
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        local_theta = None
        kinds = {"rope_parameters": rope}
      for where, params in kinds.items():
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in (None, "default"):
          raise WeightsError(f"{source}: rope_type={kind!r} ({where}) is not supported for {arch}; rljax supports "
                             "default RoPE for Gemma (e.g. gemma-3-1b; the 4B+ models' linear scaling is not "
                             "implemented).")
      layer_types = hf.get("layer_types")
      if layer_types is None:
        pattern = 2 if arch == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
      if len(layer_types) != layers or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise WeightsError(f"{source}: layer_types={layer_types!r} must list 'sliding_attention' or "
                           f"'full_attention' for each of the {layers} layers.")
      if hf.get("use_bidirectional_attention"):
        raise WeightsError(f"{source}: use_bidirectional_attention=true is not supported; rljax decodes causally.")
      act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
      if act not in _HF_GELU_TANH:
        raise WeightsError(f"{source}: hidden_activation={act!r} is not supported for {arch}; rljax implements "
                           "gelu_pytorch_tanh (GeGLU).")
      window = hf.get("sliding_window")
      sliding = tuple(t == "sliding_attention" for t in layer_types)
      if window is None:
        sliding = ()
      opt = lambda name: None if hf.get(name) is None else float(hf[name])
      eos = hf.get("eos_token_id")
      eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
      return cls(
          architecture=arch,
          vocab_size=int(hf["vocab_size"]),
          hidden_size=hidden,
          intermediate_size=int(hf["intermediate_size"]),
          num_layers=layers,
          num_heads=num_heads,
          num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
          head_dim=int(hf.get("head_dim") or 256),
          rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
          rope_theta=theta,
          max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
          tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),  # transformers' Gemma default
          attention_bias=bool(hf.get("attention_bias", False)),
          qk_norm=arch == "gemma3",
          bos_token_id=hf.get("bos_token_id"),
          eos_token_ids=eos_ids,
          pad_token_id=hf.get("pad_token_id"),
          norm_offset=True,
          sandwich_norms=True,
          embed_scale=True,
          hidden_act="gelu_tanh",
          attn_logit_softcap=opt("attn_logit_softcapping"),
          final_logit_softcap=opt("final_logit_softcapping"),
          query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
          sliding_window=None if window is None else int(window),
          sliding_layers=sliding,
          rope_local_theta=local_theta,
      )
    except KeyError as e:
      raise WeightsError(f"{source}: required field {e.args[0]!r} is missing from the model config.") from None

  def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
    """A transformers-loadable `config.json` dict (written with both 4.x and 5.x field names)."""
    if self.architecture in ("gemma2", "gemma3"):
      return self._to_hf_gemma(dtype)
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope_parameters = {"rope_type": "llama3", "rope_theta": self.rope_theta, **dataclasses.asdict(self.rope_scaling)}
    out = {
        **self._hf_common(dtype, model_type=self.architecture),
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rope_parameters": rope_parameters,
        "rope_scaling": None if self.rope_scaling is None else dict(rope_parameters),
    }
    if self.architecture == "llama":
      out["mlp_bias"] = False
    if self.architecture in ("qwen2", "qwen3"):
      out["use_sliding_window"] = False
      out["sliding_window"] = None
      out["max_window_layers"] = self.num_layers
    return out

  def _hf_common(self, dtype: str, model_type: str) -> dict[str, Any]:
    """The `config.json` fields every family writes the same way."""
    eos = list(self.eos_token_ids)
    return {
        "architectures": [_HF_ARCH[self.architecture]],
        "model_type": model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "rms_norm_eps": self.rms_norm_eps,
        "max_position_embeddings": self.max_position_embeddings,
        "tie_word_embeddings": self.tie_word_embeddings,
        "attention_bias": self.attention_bias,
        "attention_dropout": 0.0,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": self.pad_token_id,
        "dtype": dtype,
        "torch_dtype": dtype,
        "use_cache": True,
    }

  def _to_hf_gemma(self, dtype: str) -> dict[str, Any]:
    """A Gemma2ForCausalLM / Gemma3ForCausalLM `config.json` (4.x and 5.x field names)."""
    if not (self.norm_offset and self.sandwich_norms and self.embed_scale and self.hidden_act == "gelu_tanh"):
      raise WeightsError(f"model.architecture={self.architecture!r} with norm_offset={self.norm_offset}, "
                         f"sandwich_norms={self.sandwich_norms}, embed_scale={self.embed_scale}, "
                         f"hidden_act={self.hidden_act!r} is not a transformers Gemma model; Gemma needs all three "
                         "switches on and hidden_act='gelu_tanh'.")
    if self.rope_scaling is not None:
      raise WeightsError("model.rope_scaling (Llama 3) has no Gemma equivalent in transformers; set it to None.")
    if (self.architecture == "gemma3") != self.qk_norm:
      raise WeightsError(f"model.qk_norm={self.qk_norm} does not match transformers' {self.architecture} "
                         "(Gemma 3 has q/k norms, Gemma 2 does not).")
    sliding = self.sliding_layers or (False,) * self.num_layers
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    local = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
    if self.architecture == "gemma2" and local != self.rope_theta:
      raise WeightsError("model.rope_local_theta differs from model.rope_theta, which Gemma 2 cannot express; "
                         "set model.rope_local_theta=None.")
    out = {
        **self._hf_common(dtype, model_type=_HF_MODEL_TYPE[self.architecture]),
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _int_if_whole(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None
                                               else self.head_dim),   # transformers types it int
        "sliding_window": self.sliding_window,
        "layer_types": layer_types,
        "attn_logit_softcapping": self.attn_logit_softcap,
        "final_logit_softcapping": self.final_logit_softcap,
    }
    if self.architecture == "gemma2":
      out["rope_theta"] = self.rope_theta
      out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
    else:
      out["rope_theta"] = self.rope_theta
      out["rope_local_base_freq"] = local
      out["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": self.rope_theta},
                                "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return out


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else float(x)

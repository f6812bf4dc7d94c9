"""Model configuration shared by the Llama, Qwen2 and Qwen3 families.

One decoder covers all three: the differences are switches (qkv bias, q/k norm,
tied embeddings, Llama 3 RoPE scaling), not separate classes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from rljax.errors import ConfigError, WeightsError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ATTENTION_IMPLS = ("auto", "xla", "chunked", "cudnn", "splash")   # the backends of rljax.models.attention
_HF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency scaling of RoPE (`rope_type: llama3` in HF configs)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer.

  `dtype` is the compute dtype of activations and matmuls; `param_dtype` the
  storage dtype of parameters. Logits can always be produced in float32.
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
    layer = attn + 3 * d * f + 2 * d
    return self.num_layers * layer + v * d * (1 if self.tie_word_embeddings else 2) + d

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  # ---- Hugging Face config.json <-> ModelConfig -------------------------------------------

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
    """Reads a transformers 4.x or 5.x `config.json` dict (`rope_theta` or `rope_parameters`)."""
    model_type = hf.get("model_type")
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(model_type)
    if arch is None:
      raise WeightsError(f"{source}: model_type={model_type!r} is not supported; rljax supports llama, qwen2 and qwen3.")
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

  def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
    """A transformers-loadable `config.json` dict (written with both 4.x and 5.x field names)."""
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
    if self.rope_scaling is not None:
      rope_parameters = {"rope_type": "llama3", "rope_theta": self.rope_theta, **dataclasses.asdict(self.rope_scaling)}
    eos = list(self.eos_token_ids)
    out = {
        "architectures": [_HF_ARCH[self.architecture]],
        "model_type": self.architecture,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": rope_parameters,
        "rope_scaling": None if self.rope_scaling is None else dict(rope_parameters),
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
    if self.architecture == "llama":
      out["mlp_bias"] = False
    if self.architecture in ("qwen2", "qwen3"):
      out["use_sliding_window"] = False
      out["sliding_window"] = None
      out["max_window_layers"] = self.num_layers
    return out

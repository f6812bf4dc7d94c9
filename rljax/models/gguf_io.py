"""Reading llama.cpp GGUF checkpoints (Llama, Qwen2, Qwen3 architectures).

A GGUF file holds metadata (`llama.block_count`, `tokenizer.ggml.tokens`, ...) and
tensors named the llama.cpp way (`token_embd.weight`, `blk.N.attn_q.weight`, ...),
possibly quantized. `open_gguf` turns one into what `convert.hf_to_params` consumes:
a ModelConfig, the set of Hugging Face tensor names, and a getter returning float32
numpy arrays in HF layout ([out, in] for linear weights).

Three llama.cpp conventions are undone here:

- quantized tensors are dequantized with `gguf.quants.dequantize` (float32);
- for the `llama` architecture, llama.cpp's converter permutes the rows of q/k
  projections (and biases) so its interleaved-pair RoPE matches HF's half-split
  RoPE; `unpermute_qk` inverts that. Qwen2/Qwen3 use NeoX-style RoPE in llama.cpp
  and are stored unpermuted;
- Llama 3 RoPE scaling is stored as a `rope_freqs.weight` tensor of per-frequency
  divisors rather than as metadata; `rope_scaling_from_freqs` recovers the
  equivalent `RopeScaling` (and checks that it reproduces the tensor).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from rljax import gguf_file
from rljax.errors import WeightsError
from rljax.models.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_ROPE_FREQS = "rope_freqs.weight"


def gguf_to_hf_name(name: str) -> str | None:
  """llama.cpp tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
  if name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[name]
  m = _BLOCK.match(name)
  if m and m.group(2) in _LAYER_NAMES:
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
  return None


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverts llama.cpp's q/k row permutation.

  w: [num_heads * Dh, ...] (a weight [rows, in] or a bias [rows]). llama.cpp stores, for
  each head, rows in the order (0, Dh/2, 1, Dh/2+1, ...); HF's order is (0, 1, ..., Dh-1).
  """
  rows = w.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(f"{rows} rows cannot be split into {num_heads} heads of even size")
  half = rows // num_heads // 2
  return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(head_dim: int, theta: float, rs: RopeScaling) -> np.ndarray:
  """[Dh/2] per-frequency divisors llama.cpp stores for Llama 3 RoPE scaling."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * math.pi / inv
  smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
      rs.high_freq_factor - rs.low_freq_factor)
  smooth = np.clip(smooth, 0.0, 1.0)
  return 1.0 / ((1 - smooth) / rs.factor + smooth)


def rope_scaling_from_freqs(freqs: np.ndarray, head_dim: int, theta: float, source: str,
                            original_max_position_embeddings: int = 8192) -> RopeScaling | None:
  """Recovers Llama 3 scaling from llama.cpp's `rope_freqs` tensor ([Dh/2] divisors).

  The Llama 3 rule only depends on original_max / low_freq_factor and
  original_max / high_freq_factor, so `original_max_position_embeddings` is fixed and
  the two factors are fitted on the frequencies between the two regimes.
  Returns None when every divisor is 1 (no scaling).
  """
  f = np.asarray(freqs, np.float64).reshape(-1)
  if f.shape[0] != head_dim // 2:
    raise WeightsError(f"{source}: {_ROPE_FREQS} has {f.shape[0]} entries, expected head_dim/2 = {head_dim // 2}.")
  factor = float(f.max())
  if np.allclose(f, 1.0, rtol=0, atol=1e-6):
    return None
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  x = original_max_position_embeddings * inv / (2 * math.pi)  # = original_max / wavelen
  mid = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
  if mid.sum() >= 2:
    # smooth = (x - lo) / (hi - lo) on the middle frequencies, with 1/f = (1 - smooth)/factor + smooth.
    smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(x[mid], smooth, 1)
    lo = -intercept / slope
    hi = lo + 1 / slope
  else:
    # No (or one) frequency in between: put the regime boundaries between the observed classes.
    unscaled = x[f <= 1 + 1e-4]
    scaled = x[f >= factor * (1 - 1e-4)]
    lo = float(scaled.max()) * 1.0001 if scaled.size else float(x.min()) * 0.5
    hi = float(unscaled.min()) * 0.9999 if unscaled.size else float(x.max()) * 2.0
    if mid.sum() == 1:
      # Keep `lo` and solve for `hi` so the single middle frequency is reproduced too.
      s = float((1 / f[mid][0] - 1 / factor) / (1 - 1 / factor))
      hi = lo + (float(x[mid][0]) - lo) / s
  rs = RopeScaling(factor=factor, low_freq_factor=float(lo), high_freq_factor=float(hi),
                   original_max_position_embeddings=int(original_max_position_embeddings))
  if not (0 < lo < hi) or not np.allclose(llama3_rope_freqs(head_dim, theta, rs), f, rtol=1e-4, atol=1e-5):
    raise WeightsError(f"{source}: {_ROPE_FREQS} does not follow the Llama 3 RoPE scaling rule; this kind "
                       "of RoPE scaling is not supported.")
  return rs


# GGUFReader over a plain ndarray view of the memory map (one place: rljax/gguf_file.py).
_reader_class = gguf_file.plain_reader_class


class GGUFCheckpoint:
  """An opened GGUF file: `config`, HF tensor `names`, and `get(hf_name)` -> float32 [HF layout].

  Tensors are memory-mapped and dequantized one at a time, on `get`.
  """

  def __init__(self, path: str):
    self.path = str(path)
    if not os.path.isfile(self.path):
      raise WeightsError(f"{self.path}: GGUF file not found.")
    try:
      reader_class = _reader_class()
    except ImportError:
      raise WeightsError(f"{self.path}: reading GGUF files needs the `gguf` package; run: pip install gguf") from None
    try:
      self._reader = reader_class(self.path, "r")
      self._meta = gguf_file.read_metadata(self.path)
    except Exception as e:  # the reader raises ValueError, struct/numpy errors, etc. on corrupt files
      raise WeightsError(f"{self.path}: not a valid GGUF file ({type(e).__name__}: {e}).") from None
    self.architecture = self._string("general.architecture")
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise WeightsError(f"{self.path}: GGUF architecture {self.architecture!r} is not supported; rljax supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}.")
    self._tensors: dict[str, Any] = {}
    rope_freqs = None
    for t in self._reader.tensors:
      if t.name == _ROPE_FREQS:
        rope_freqs = t
        continue
      hf = gguf_to_hf_name(t.name)
      if hf is None:
        raise WeightsError(f"{self.path}: unexpected tensor {t.name!r} for architecture {self.architecture!r}; "
                           "this GGUF variant is not supported.")
      self._tensors[hf] = t
    self.names = set(self._tensors)
    self.config = self._build_config(rope_freqs)

  # ---- metadata ---------------------------------------------------------------------------

  def has(self, key: str) -> bool:
    return key in self._meta

  def value(self, key: str, default: Any = None) -> Any:
    """A metadata value (`default` when absent)."""
    return self._meta.get(key, default)

  def _string(self, key: str) -> str:
    v = self.value(key)
    if not isinstance(v, str):
      raise WeightsError(f"{self.path}: metadata {key!r} is missing; not a model GGUF file.")
    return v

  def _int(self, key: str, default: int | None = None) -> int:
    v = self.value(key, default)
    if v is None:
      raise WeightsError(f"{self.path}: required metadata {key!r} is missing.")
    if isinstance(v, list):
      if len(set(v)) != 1:
        raise WeightsError(f"{self.path}: metadata {key!r} varies per layer ({v[:4]}...); not supported.")
      v = v[0]
    return int(v)

  def _build_config(self, rope_freqs) -> ModelConfig:
    a = self.architecture
    hidden = self._int(f"{a}.embedding_length")
    heads = self._int(f"{a}.attention.head_count")
    kv_heads = self._int(f"{a}.attention.head_count_kv", heads)
    head_dim = self._int(f"{a}.attention.key_length",
                         self.value(f"{a}.rope.dimension_count", hidden // heads if heads else 0))
    theta = float(self.value(f"{a}.rope.freq_base", 10000.0))
    scaling_type = self.value(f"{a}.rope.scaling.type", "none")
    if scaling_type not in ("none", None):
      raise WeightsError(f"{self.path}: RoPE scaling type {scaling_type!r} is not supported "
                         "(rljax supports none and Llama 3 rope_freqs).")
    scaling = None
    if rope_freqs is not None:
      scaling = rope_scaling_from_freqs(self._dequantize(rope_freqs), head_dim, theta, self.path)
    tokens = self.value("tokenizer.ggml.tokens")
    if tokens is not None:
      vocab = len(tokens)
    elif self.has(f"{a}.vocab_size"):
      vocab = self._int(f"{a}.vocab_size")
    elif "model.embed_tokens.weight" in self._tensors:
      vocab = int(self._tensors["model.embed_tokens.weight"].shape[-1])
    else:
      raise WeightsError(f"{self.path}: cannot tell the vocabulary size (no tokenizer.ggml.tokens, "
                         f"{a}.vocab_size or token_embd.weight).")
    eos = self.value("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=a,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=self._int(f"{a}.feed_forward_length"),
        num_layers=self._int(f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(self.value(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=self._int(f"{a}.context_length", 2048),
        tie_word_embeddings="lm_head.weight" not in self._tensors,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in self._tensors,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in self._tensors,
        bos_token_id=self.value("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=self.value("tokenizer.ggml.padding_token_id"),
    )

  # ---- tensors ----------------------------------------------------------------------------

  def _dequantize(self, t) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    try:
      if t.tensor_type == GGMLQuantizationType.F32:
        w = np.asarray(t.data, np.float32)
      else:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    except NotImplementedError:
      raise WeightsError(f"{self.path}: tensor {t.name!r} uses quantization {t.tensor_type.name}, which the "
                         "`gguf` package cannot dequantize; re-quantize the model (e.g. Q8_0, Q4_K).") from None
    except Exception as e:
      raise WeightsError(f"{self.path}: tensor {t.name!r} is unreadable ({type(e).__name__}: {e}).") from None
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    if w.size != math.prod(shape):
      raise WeightsError(f"{self.path}: tensor {t.name!r} holds {w.size} values but declares shape {shape}.")
    return w.reshape(shape)

  def get(self, hf_name: str) -> np.ndarray:
    """The tensor under its HF name, float32, HF layout (q/k un-permuted for llama)."""
    t = self._tensors.get(hf_name)
    if t is None:
      raise WeightsError(f"{self.path}: tensor {hf_name!r} is missing.")
    w = self._dequantize(t)
    if self.architecture == "llama":
      c = self.config
      try:
        if ".self_attn.q_proj." in hf_name:
          w = unpermute_qk(w, c.num_heads)
        elif ".self_attn.k_proj." in hf_name:
          w = unpermute_qk(w, c.num_kv_heads)
      except ValueError as e:
        raise WeightsError(f"{self.path}: tensor {t.name!r} has shape {w.shape}, which does not match the "
                           f"metadata ({e}).") from None
    return w

  def shape(self, hf_name: str) -> tuple[int, ...]:
    """HF-layout shape of a tensor without reading it."""
    return tuple(int(s) for s in reversed(self._tensors[hf_name].shape.tolist()))


def open_gguf(path: str) -> GGUFCheckpoint:
  """Opens a GGUF checkpoint; raises WeightsError naming the file on any problem."""
  return GGUFCheckpoint(path)

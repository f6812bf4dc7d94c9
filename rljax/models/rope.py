"""Rotary position embeddings: the frequency tables, their scalings, and HF's rope fields.

A scaling changes the [Dh/2] inverse frequencies (and, for YaRN, multiplies cos and sin by an
attention factor, which scales q.k by its square). Supported, as transformers computes them
(`transformers.modeling_rope_utils`, 5.x):

- `linear`: every frequency divided by `factor` (position interpolation);
- `llama3`: Llama 3.1's piecewise rule (low frequencies divided by `factor`, high ones kept, a
  smooth ramp between);
- `yarn`: NTK-by-parts interpolation with a linear ramp between `beta_fast` and `beta_slow`
  rotations over `original_max_position_embeddings`, and the attention factor
  0.1 * ln(factor) + 1 (or `attention_factor`, or DeepSeek's mscale / mscale_all_dim ratio).

Any other `rope_type` (dynamic, longrope, ...) is refused by name (`scaling_from_hf`).
With a separate base for sliding-window layers (Gemma 3) the scaling applies to the global
layers only, as in Gemma 3's configs (`rope_parameters.full_attention`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import jax
import jax.numpy as jnp

from rljax.errors import WeightsError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency scaling of RoPE (`rope_type: llama3` in HF configs)."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  rope_type: ClassVar[str] = "llama3"

  def scale(self, inv: jax.Array, head_dim: int, theta: float) -> jax.Array:
    low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
    high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > low_wavelen, inv / self.factor, inv)
    smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
        self.high_freq_factor - self.low_freq_factor)
    mid = (1 - smooth) * scaled / self.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_mid, mid, scaled)

  @property
  def attention_factor(self) -> float:
    return 1.0

  def context_length(self, max_position_embeddings: int) -> int:
    return max_position_embeddings   # Llama 3.1 states its extended context there (131072)

  def to_hf(self) -> dict[str, Any]:
    return {"rope_type": self.rope_type, **dataclasses.asdict(self)}


Llama3RopeScaling = RopeScaling


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Position interpolation (`rope_type: linear`): every frequency divided by `factor`."""
  factor: float
  rope_type: ClassVar[str] = "linear"

  def scale(self, inv: jax.Array, head_dim: int, theta: float) -> jax.Array:
    return inv / self.factor

  @property
  def attention_factor(self) -> float:
    return 1.0

  def context_length(self, max_position_embeddings: int) -> int:
    return max_position_embeddings   # e.g. Gemma 3 4B+: 131072 with factor 8

  def to_hf(self) -> dict[str, Any]:
    return {"rope_type": self.rope_type, "factor": self.factor}


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
  """YaRN (`rope_type: yarn`; Qwen2.5 / Qwen3 long context): the fields of HF's rope_parameters.

  attention_factor None = computed (`attention_factor` property); mscale / mscale_all_dim: DeepSeek's
  variant of that computation; truncate: round the ramp's ends to whole dimensions (HF's default).
  """
  factor: float
  original_max_position_embeddings: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor_override: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  truncate: bool = True
  rope_type: ClassVar[str] = "yarn"

  def scale(self, inv: jax.Array, head_dim: int, theta: float) -> jax.Array:
    def correction_dim(rotations):
      return head_dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
          2 * math.log(theta))

    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
      high += 0.001   # HF's guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp   # 1: keep the frequency (high frequencies), 0: interpolate (divide by factor)
    return (inv / self.factor) * (1 - extrapolation) + inv * extrapolation

  @property
  def attention_factor(self) -> float:
    """The factor on cos and sin (q.k scales by its square): 0.1 * ln(factor) + 1 unless given."""
    if self.attention_factor_override is not None:
      return float(self.attention_factor_override)

    def mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if self.mscale and self.mscale_all_dim:
      return float(mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim))
    return mscale(self.factor)

  def context_length(self, max_position_embeddings: int) -> int:
    """The scaled context: original_max_position_embeddings * factor (transformers' "post-yarn context
    length"), or max_position_embeddings when that is longer."""
    return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))

  def to_hf(self) -> dict[str, Any]:
    out = {"rope_type": self.rope_type, "factor": self.factor,
           "original_max_position_embeddings": self.original_max_position_embeddings,
           "beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
    for key, value in (("attention_factor", self.attention_factor_override), ("mscale", self.mscale),
                       ("mscale_all_dim", self.mscale_all_dim)):
      if value is not None:
        out[key] = value
    return out


Scaling = RopeScaling | LinearRopeScaling | YarnRopeScaling


def rope_dict(hf: Mapping[str, Any]) -> dict[str, Any]:
  """One flat rope dict from a transformers 4.x (`rope_theta` + `rope_scaling`) or 5.x
  (`rope_parameters`) config; `rope_type` (or 4.x's `type`) absent means default."""
  rope = dict(hf.get("rope_parameters") or {})
  legacy = hf.get("rope_scaling") or {}
  if legacy and not rope.get("rope_type"):
    rope.update(legacy)
  if "rope_theta" not in rope and hf.get("rope_theta") is not None:
    rope["rope_theta"] = hf["rope_theta"]
  return rope


def scaling_from_hf(rope: Mapping[str, Any], max_position_embeddings: int, source: str,
                    where: str = "rope_parameters") -> Scaling | None:
  """The scaling an HF rope dict describes (None for default RoPE); unknown types and fields that
  change the computation (partial_rotary_factor) are refused by name."""
  kind = rope.get("rope_type", rope.get("type")) or "default"
  if kind not in ROPE_TYPES:
    raise WeightsError(f"{source}: {where}.rope_type={kind!r} is not supported; rljax implements "
                       f"{', '.join(ROPE_TYPES)} RoPE.")
  if float(rope.get("partial_rotary_factor") or 1.0) != 1.0:
    raise WeightsError(f"{source}: {where}.partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
                       "supported; rljax rotates the whole head dimension.")
  try:
    if kind == "default":
      return None
    if kind == "linear":
      return LinearRopeScaling(float(rope["factor"]))
    if kind == "llama3":
      return RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                         int(rope["original_max_position_embeddings"]))
    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = rope.get("factor")
    factor = float(max_position_embeddings / original if factor is None else factor)
    opt = lambda key: None if rope.get(key) is None else float(rope[key])
    return YarnRopeScaling(factor=factor, original_max_position_embeddings=original,
                           beta_fast=float(rope.get("beta_fast") or 32.0), beta_slow=float(rope.get("beta_slow") or 1.0),
                           attention_factor_override=opt("attention_factor"), mscale=opt("mscale"),
                           mscale_all_dim=opt("mscale_all_dim"), truncate=bool(rope.get("truncate", True)))
  except KeyError as e:
    raise WeightsError(f"{source}: {where} (rope_type {kind!r}) lacks the field {e.args[0]!r}.") from None


def hf_context_length(hf: Mapping[str, Any], default: int = 2048) -> int:
  """The context a config.json dict configures, read without building the model: its
  max_position_embeddings, or YaRN's scaled context when longer (`YarnRopeScaling.context_length`).
  Rope fields this module cannot read leave max_position_embeddings (loading reports them)."""
  context = int(hf.get("max_position_embeddings") or default)
  rope = rope_dict(hf)
  rope = rope.get("full_attention") or rope   # Gemma 3's per-layer-type dicts: the global layers'
  try:
    scaling = scaling_from_hf(rope, context, "config.json")
  except WeightsError:
    return context
  return context if scaling is None else scaling.context_length(context)


def inv_freq(head_dim: int, theta: float, scaling: Scaling | None = None) -> jax.Array:
  """[Dh/2] float32 inverse frequencies for base `theta`, scaled when `scaling` is given."""
  inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  return inv if scaling is None else scaling.scale(inv, head_dim, theta)


def tables(positions: jax.Array, head_dim: int, theta: float, scaling: Scaling | None = None):
  """cos, sin: [B, T, Dh] float32 for positions [B, T] (HF's half-split layout), times the
  scaling's attention factor (YaRN)."""
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq(head_dim, theta, scaling)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  factor = 1.0 if scaling is None else scaling.attention_factor
  if factor != 1.0:
    cos, sin = cos * factor, sin * factor
  return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x: [B, T, heads, Dh]; rotation computed in float32 like the reference implementation."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)

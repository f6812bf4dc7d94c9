"""The decoder's building blocks other than attention: parameters with logical axes, LoRA deltas,
RMSNorm, the token embedding and the dense (gated) MLP.

Shapes: B = batch, T = tokens, D = hidden, F = MLP width, r = LoRA rank.

A feed-forward block (`MLP` here; a family may supply others, e.g. a mixture of experts in
rljax/models/moe.py, through `Family.block`) is called as `block(config, name=...)(h [B, T, D],
token_mask [B, T] bool or None)` (a routed block also takes `replay`, expert ids to use) and
returns `(y [B, T, D], stats)`, stats being `rljax.models.outputs.no_stats()` or its filled-in
form: auxiliary losses (scalars, already weighted by the config's coefficients) and router
statistics, which the layers stack and the model returns in its `ModelOutput`.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig
from rljax.models.outputs import no_stats


def param(module: nn.Module, name: str, init, shape, axes, dtype):
  """A parameter annotated with its logical axes (rljax.sharding maps them to the mesh)."""
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def lora_delta(module: nn.Module, name: str, x, in_axes: tuple, out_shape: tuple, out_axes: tuple):
  """The LoRA term (alpha / r) * (x A) B of projection `name`, or None (no adapter on it, or a
  parameter tree without adapters: the base model, e.g. the KL reference).

  x: [B, T, *in] (or [B*T, *in]) with in the kernel's input axes (named `in_axes`); A: [*in, r] float32,
  initialised like PEFT's (uniform, bound 1 / sqrt(fan_in)); B: [r, *out] float32, zeros, so a
  fresh adapter leaves the model unchanged. Both run in the compute dtype, like the kernels.
  With dropout, the input of A is dropped when a "dropout" rng is given (the learner's loss).
  """
  lora = module.config.lora
  a_name, b_name = f"{name}_lora_a", f"{name}_lora_b"
  if lora is None or name not in lora.targets:
    return None
  if not (module.is_initializing() or module.has_variable("params", a_name)):
    return None
  lead = x.ndim - len(in_axes)                                       # token dims: [B, T] or [B*T]
  in_shape = x.shape[lead:]
  fan_in_axes = tuple(range(len(in_shape)))
  a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in_axes, out_axis=-1)
  a = param(module, a_name, a_init, in_shape + (lora.rank,), in_axes + ("lora_rank",), jnp.float32)
  b = param(module, b_name, nn.initializers.zeros, (lora.rank,) + out_shape, ("lora_rank",) + out_axes,
            jnp.float32)
  dt = module.config.compute_dtype
  if lora.dropout > 0 and module.has_rng("dropout"):
    keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - lora.dropout, x.shape)
    x = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
  h = jnp.tensordot(x, a.astype(dt), axes=len(in_shape))             # [B, T, r]
  return jnp.tensordot(h, b.astype(dt), axes=1) * jnp.asarray(lora.scale, dt)   # [B, T, *out]


class RMSNorm(nn.Module):
  """RMSNorm over the last axis, computed in float32. With `offset` (Gemma) the scale is
  (1 + weight) and the weight starts at zero; otherwise the scale is the weight, starting at one."""
  eps: float
  axis_name: str = "norm"
  param_dtype: Any = jnp.float32
  offset: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.offset else nn.initializers.ones
    scale = param(self, "scale", init, (x.shape[-1],), (self.axis_name,), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale32 = scale.astype(jnp.float32)
    if self.offset:
      scale32 = 1.0 + scale32
    return (scale32 * x32).astype(x.dtype)


def make_norm(config: ModelConfig, axis_name: str = "norm", name: str | None = None) -> RMSNorm:
  """The model's RMSNorm (eps, storage dtype, Gemma's (1 + w) offset) for one norm."""
  return RMSNorm(config.rms_norm_eps, axis_name, config.storage_dtype, config.norm_offset, name=name)


def embed_tokens(config: ModelConfig, embedding: jax.Array, tokens: jax.Array) -> jax.Array:
  """tokens [B, T] -> [B, T, D] in the compute dtype; times sqrt(D) (rounded to the compute dtype,
  as transformers does) when `config.embed_scale` (Gemma)."""
  x = jnp.take(embedding, tokens, axis=0).astype(config.compute_dtype)
  if config.embed_scale:
    x = x * jnp.asarray(math.sqrt(config.hidden_size), config.compute_dtype)
  return x


def activation(config: ModelConfig):
  """The MLP's gate activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""
  return jax.nn.silu if config.hidden_act == "silu" else functools.partial(jax.nn.gelu, approximate=True)


def gated_mlp(module: nn.Module, x: jax.Array, width: int | None = None) -> jax.Array:
  """down(act(x gate) * (x up)) with the kernels `gate_kernel` / `up_kernel` [D, F] and `down_kernel`
  [F, D] (F = width, default config.intermediate_size) created on `module`, and their LoRA
  adapters. x: [B, T, D] -> [B, T, D]."""
  c = module.config
  dt, pdt = c.compute_dtype, c.storage_dtype
  f = c.intermediate_size if width is None else width
  init = nn.initializers.normal(0.02)
  gate = param(module, "gate_kernel", init, (c.hidden_size, f), ("embed", "mlp"), pdt)
  up = param(module, "up_kernel", init, (c.hidden_size, f), ("embed", "mlp"), pdt)
  down = param(module, "down_kernel", init, (f, c.hidden_size), ("mlp", "embed"), pdt)

  def project(name, inp, w, in_axis, out_axis):
    y = inp @ w.astype(dt)
    delta = lora_delta(module, name, inp, (in_axis,), (w.shape[-1],), (out_axis,))
    return y if delta is None else y + delta

  # The projections (and their adapters) multiply the flattened tokens [B*T, D]: the same products,
  # but a weight gradient is then a dot over one token axis. Over [B, T] it contracts two axes, and
  # XLA:CPU computed it from a transposed copy of the output gradient fused into the SiLU backward's
  # loop (1.5 s of an 11.5 s default-recipe step; a LoRA B's gradient the same). Compiled for TPUs
  # the peaks and collectives are unchanged (README: Performance).
  tokens = x.reshape(-1, x.shape[-1])
  hidden = activation(c)(project("gate", tokens, gate, "embed", "mlp")) * project("up", tokens, up, "embed", "mlp")
  return project("down", hidden, down, "mlp", "embed").reshape(x.shape)


class MLP(nn.Module):
  """The dense feed-forward block: `gated_mlp`, no statistics."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, token_mask=None):
    return gated_mlp(self, x), no_stats()

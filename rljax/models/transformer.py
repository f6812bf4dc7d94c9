"""The decoder-only transformer (Llama / Qwen2 / Qwen3 / Gemma 2 / Gemma 3), written with Flax linen.

Shapes: B = batch, T = new tokens in this call, S = KV-cache slots, D = hidden,
H / K = query / key-value heads, Dh = head dim, F = MLP width, V = vocab, L = layers.

One forward serves training, prefill and decode:

- without a cache, token t attends to tokens s <= t of the same row whose
  `token_mask` is set (ragged batches, left or right padding) and, when
  `segment_ids` are given, of the same segment (packed rows); the backend is
  `config.attention` (rljax.models.attention: xla, chunked, cudnn, splash, auto);
- with a cache, the T new tokens are written at slots [index, index + T) and
  attend to every earlier slot whose `kv_mask` is set.

Positions are explicit ([B, T] int32) so left-padded prompts get the same RoPE
phases as unpadded ones. Layers are stacked and run with `nn.scan`, so compile
time does not grow with depth.

Per-layer differences (Gemma's sliding-window layers and their RoPE base) are data, not
code: a [L] bool array of sliding flags is scanned with the layers, and a layer selects its
mask, window and RoPE tables with `jnp.where` on its flag. A sliding layer lets a query at
position p see keys at positions > p - W (`config.sliding_window`), HF's window; with a cache,
a key's position is the number of real tokens before it in its row (prefix included), which is
how every caller numbers positions (`positions_from_mask`, the decode loops).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from rljax import sharding as shd
from rljax.models.attention import attend, soft_cap
from rljax.models.cache import DecodeCache, KVCache, LayerCache, PrefixCache, PrefixView, cached_attention
from rljax.models.config import ModelConfig


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


def _lora_delta(module: nn.Module, name: str, x, in_axes: tuple, out_shape: tuple, out_axes: tuple):
  """The LoRA term (alpha / r) * (x A) B of projection `name`, or None (no adapter on it, or a
  parameter tree without adapters: the base model, e.g. the KL reference).

  x: [B, T, *in] with in the kernel's input axes (named `in_axes`); A: [*in, r] float32,
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
  in_shape = x.shape[2:]
  fan_in_axes = tuple(range(len(in_shape)))
  a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=fan_in_axes, out_axis=-1)
  a = _param(module, a_name, a_init, in_shape + (lora.rank,), in_axes + ("lora_rank",), jnp.float32)
  b = _param(module, b_name, nn.initializers.zeros, (lora.rank,) + out_shape, ("lora_rank",) + out_axes,
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
    scale = _param(self, "scale", init, (x.shape[-1],), (self.axis_name,), self.param_dtype)
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


def sliding_flags(config: ModelConfig) -> jax.Array:
  """[L] bool: which layers attend within the sliding window (all False without one)."""
  flags = config.sliding_layers if config.has_sliding_layers else (False,) * config.num_layers
  return jnp.asarray(flags, bool)


def rope_inv_freq(config: ModelConfig, theta: float | None = None) -> jax.Array:
  """[Dh/2] inverse frequencies for base `theta` (default config.rope_theta), with Llama 3 scaling
  when configured."""
  dh = config.head_dim
  theta = config.rope_theta if theta is None else theta
  inv = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  rs = config.rope_scaling
  if rs is None:
    return inv
  low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
  high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = jnp.where(wavelen > low_wavelen, inv / rs.factor, inv)
  smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
      rs.high_freq_factor - rs.low_freq_factor)
  mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
  is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(is_mid, mid, scaled)


def rope_tables(positions: jax.Array, config: ModelConfig, theta: float | None = None) -> tuple[jax.Array, jax.Array]:
  """cos, sin: [B, T, Dh] float32 for positions [B, T] (HF half-split layout), base `theta`
  (default config.rope_theta)."""
  freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(config, theta)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def layer_rope(positions: jax.Array, config: ModelConfig):
  """The RoPE tables the layers take: (cos, sin) [B, T, Dh], or, with a separate base for the
  sliding layers (Gemma 3), ((cos, sin) global, (cos, sin) local), selected per layer."""
  glob = rope_tables(positions, config)
  if config.rope_local_theta is None or not config.has_sliding_layers:
    return glob
  return glob, rope_tables(positions, config, config.rope_local_theta)


def _select_rope(config: ModelConfig, rope, sliding):
  """(cos, sin) of one layer from `layer_rope`'s tables and its sliding flag ([] bool)."""
  if config.rope_local_theta is None or not config.has_sliding_layers:
    return rope
  (gc, gs), (lc, ls) = rope
  return jnp.where(sliding, lc, gc), jnp.where(sliding, ls, gs)


def cache_key_positions(kv_mask: jax.Array, before=None) -> jax.Array:
  """[B, S] int32 position of the token in each cache slot: the real tokens before it in the row
  (`before` [B] int32 more of them ahead of the cache, e.g. a shared prompt cache)."""
  pos = jnp.cumsum(kv_mask.astype(jnp.int32), axis=-1) - 1
  return pos if before is None else pos + before[:, None]


def window_mask(config: ModelConfig, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
  """[B, T, S] bool: key within the sliding window of the query, q_positions [B, T], k_positions [B, S]."""
  return (q_positions[:, :, None] - k_positions[:, None, :]) < config.sliding_window


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x: [B, T, heads, Dh]; rotation computed in float32 like the reference implementation."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, cos, sin, mask, cache: LayerCache | None, index=None, prefix: PrefixView | None = None,
               sliding=None):
    """x: [B, T, D]; cache: this layer's keys and values (rljax.models.cache), the T new tokens
    written at slots [index, index + T); or None (no cache).

    mask: with a cache, [B, T, S] bool, or (global, local) [B, T, S] bool pairs when the model has
    sliding layers; without, (token_mask [B, T] bool, segment_ids [B, T] int32 or None,
    positions [B, T] int32), which `attend` turns into causal, padding, segment and window
    masking block by block.

    prefix (with a cache only): a read-only cache shared by groups of B / P consecutive rows,
    attended before the row's own cache; with sliding layers its `window` holds each row's
    queries' window over it.

    sliding: [] bool, this layer attends within `config.sliding_window` (None = no sliding layers).
    """
    c = self.config
    dt, pdt = c.compute_dtype, c.storage_dtype
    init = nn.initializers.normal(0.02)
    d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

    def proj(name, heads, axis):
      w = _param(self, f"{name}_kernel", init, (d, heads, dh), ("embed", axis, "head_dim"), pdt)
      y = jnp.einsum("btd,dhk->bthk", x, w.astype(dt))
      delta = _lora_delta(self, name, x, ("embed",), (heads, dh), (axis, "head_dim"))
      if delta is not None:
        y = y + delta
      if c.attention_bias:
        b = _param(self, f"{name}_bias", nn.initializers.zeros, (heads, dh), (axis, "head_dim"), pdt)
        y = y + b.astype(dt)
      return y

    q, key, val = proj("q", h, "heads"), proj("k", k, "kv_heads"), proj("v", k, "kv_heads")
    if c.qk_norm:
      q = make_norm(c, "head_dim", name="q_norm")(q)
      key = make_norm(c, "head_dim", name="k_norm")(key)
    q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)

    b, t = x.shape[:2]
    qg = q.reshape(b, t, k, h // k, dh)
    new_cache = None
    if cache is None:
      token_mask, segment_ids, positions = mask
      window = None
      if sliding is not None:   # the global layers' window is larger than any distance
        window = jnp.where(sliding, jnp.int32(c.sliding_window), jnp.iinfo(jnp.int32).max)
      out = attend(qg, key, val, token_mask=token_mask, segment_ids=segment_ids, impl=c.attention,
                   positions=positions, window=window, scale=c.attention_scale, softcap=c.attn_logit_softcap)
    else:
      new_cache = cache.write(key, val, index)
      prefix_rows = None
      if sliding is not None:
        mask = jnp.where(sliding, mask[1], mask[0])
        if prefix is not None:
          prefix_rows = prefix.window | ~sliding
      read = LayerCache(new_cache.k.astype(dt), new_cache.v.astype(dt))
      out = cached_attention(qg, read, mask, prefix, scale=c.attention_scale, softcap=c.attn_logit_softcap,
                             prefix_rows=prefix_rows)
    out = out.reshape(b, t, h, dh)
    wo = _param(self, "o_kernel", init, (h, dh, d), ("heads", "head_dim", "embed"), pdt)
    y = jnp.einsum("bthk,hkd->btd", out, wo.astype(dt))
    delta = _lora_delta(self, "o", out, ("heads", "head_dim"), (d,), ("embed",))
    return (y if delta is None else y + delta), new_cache


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    dt, pdt = c.compute_dtype, c.storage_dtype
    init = nn.initializers.normal(0.02)
    gate = _param(self, "gate_kernel", init, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pdt)
    up = _param(self, "up_kernel", init, (c.hidden_size, c.intermediate_size), ("embed", "mlp"), pdt)
    down = _param(self, "down_kernel", init, (c.intermediate_size, c.hidden_size), ("mlp", "embed"), pdt)
    act = jax.nn.silu if c.hidden_act == "silu" else functools.partial(jax.nn.gelu, approximate=True)

    def project(name, inp, w, in_axis, out_axis):
      y = inp @ w.astype(dt)
      delta = _lora_delta(self, name, inp, (in_axis,), (w.shape[-1],), (out_axis,))
      return y if delta is None else y + delta

    hidden = act(project("gate", x, gate, "embed", "mlp")) * project("up", x, up, "embed", "mlp")
    return project("down", hidden, down, "mlp", "embed")


class DecoderLayer(nn.Module):
  """One block. `sliding` is this layer's [] bool flag (scanned from `sliding_flags`); `rope` the
  tables of `layer_rope`. Norms: input_norm before attention, post_attn_norm before the MLP (HF's
  post_attention_layernorm for Llama / Qwen, pre_feedforward_layernorm for Gemma) and, with
  `sandwich_norms`, attn_out_norm / mlp_out_norm on each branch's output before its residual add."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, cache: LayerCache | None, sliding, rope, mask, index, prefix: PrefixView | None = None):
    c = self.config
    if not c.has_sliding_layers:
      sliding = None
    cos, sin = _select_rope(c, rope, sliding)
    h = make_norm(c, name="input_norm")(x)
    attn, new_cache = Attention(c, name="attn")(h, cos, sin, mask, cache, index, prefix, sliding)
    if c.sandwich_norms:
      attn = make_norm(c, name="attn_out_norm")(attn)
    x = x + attn
    h = make_norm(c, name="post_attn_norm")(x)
    out = MLP(c, name="mlp")(h)
    if c.sandwich_norms:
      out = make_norm(c, name="mlp_out_norm")(out)
    x = x + out
    x = shd.constrain(x, ("batch", "length", "embed"))
    return x, new_cache


class Transformer(nn.Module):
  """Decoder-only LM. Call returns (logits or hidden, new cache or None)."""
  config: ModelConfig

  def setup(self):
    c = self.config
    self.embed = _param(self, "embedding", nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size),
                        ("vocab", "embed"), c.storage_dtype)
    layer = DecoderLayer
    if c.remat:
      layer = nn.remat(DecoderLayer, prevent_cse=False, static_argnums=())
    self.layers = nn.scan(
        layer,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast),
        length=c.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(c, name="layers")
    self.final_norm = make_norm(c, name="final_norm")
    if not c.tie_word_embeddings:
      self.lm_head = _param(self, "lm_head", nn.initializers.normal(0.02), (c.hidden_size, c.vocab_size),
                            ("embed", "vocab"), c.storage_dtype)

  def output_kernel(self) -> jax.Array:
    """[D, V] projection from final hidden states to logits (the transposed embedding when tied),
    in the compute dtype, as the logits use it: the learner's chunked log-probs take this kernel
    too, so they match the sampler's matmul; on a mesh the all-gathered kernel is then the compute
    dtype rather than the float32 parameter (half the bytes in bf16)."""
    kernel = self.embed.T if self.config.tie_word_embeddings else self.lm_head
    return kernel.astype(self.config.compute_dtype)

  def __call__(self, tokens, positions, token_mask=None, cache: KVCache | None = None, *, segment_ids=None,
               return_hidden=False):
    """tokens, positions: [B, T] int32; token_mask: [B, T] bool (default all valid).

    segment_ids (without a cache only): [B, T] int32, packed rows whose tokens attend only within
    their segment (default None: one segment per row); give each segment its own positions.

    Returns (out, new_cache): out is [B, T, V] float32 logits (soft-capped when
    `final_logit_softcap`), or the final-normed hidden states [B, T, D] in the compute dtype
    when `return_hidden` (for chunked log-probs); new_cache is None when no cache was given.
    """
    c = self.config
    b, t = tokens.shape
    if token_mask is None:
      token_mask = jnp.ones((b, t), bool)
    x = embed_tokens(c, self.embed, tokens)
    x = shd.constrain(x, ("batch", "length", "embed"))
    rope = layer_rope(positions, c)

    if cache is None:
      mask = (token_mask, segment_ids, positions)  # O(B * T): no [B, T, T] mask (rljax.models.attention)
      layer_caches, index = None, jnp.zeros((), jnp.int32)
    else:
      if segment_ids is not None:
        raise ValueError("segment_ids are for the forward without a cache (packed training rows).")
      s = cache.kv_mask.shape[1]
      index = cache.index
      kv_mask = jax.lax.dynamic_update_slice_in_dim(cache.kv_mask, token_mask, index, axis=1)
      slots = jnp.arange(s)[None, :]
      query_slots = index + jnp.arange(t)[:, None]
      mask = (slots <= query_slots)[None] & kv_mask[:, None, :]
      if c.has_sliding_layers:
        mask = (mask, mask & window_mask(c, positions, cache_key_positions(kv_mask)))
      layer_caches = cache.layers

    x, new_layers = self.layers(x, layer_caches, sliding_flags(c), rope, mask, index)
    x = self.final_norm(x)
    new_cache = None
    if cache is not None:
      new_cache = KVCache(new_layers, kv_mask, index + t)
    if return_hidden:
      return x, new_cache
    logits = jnp.einsum("btd,dv->btv", x, self.output_kernel(), preferred_element_type=jnp.float32)
    return soft_cap(logits, c.final_logit_softcap), new_cache

  def hidden_to_logits(self, hidden):
    """[..., D] -> [..., V] float32 logits (soft-capped when `final_logit_softcap`)."""
    logits = jnp.einsum("...d,dv->...v", hidden, self.output_kernel(), preferred_element_type=jnp.float32)
    return soft_cap(logits, self.config.final_logit_softcap)

  def decode(self, layers: tuple, tokens, positions, token_mask, cache: DecodeCache, prefix: PrefixCache | None = None):
    """W new tokens per row through the model over per-layer caches, written at slots
    [cache.index, cache.index + W): the forward of `__call__` with a cache, the layers unrolled.

    layers: the L per-layer parameter trees (`layer_params`, sliced once, outside any decode
    loop); tokens, positions: [B, W] int32; token_mask: [B, W] bool; cache: the rows' caches;
    prefix: None, or the prompt cache that each group of B / P consecutive rows attends before
    its own slots. Token w of a row attends to its prefix, then to the slots <= index + w whose
    mask is set. Returns the final-normed hidden states [B, W, D] (compute dtype) and the cache
    with the new tokens (index advanced by W).

    One cache array and one parameter tree per layer instead of the scanned [L, ...] stacks:
    slicing a layer out of a stack inside a decode loop copies its cache and weights on every
    step, and decoding is bound by reading exactly those (2-3x slower per step, measured).

    Sliding-window layers (Gemma) see the keys whose position is within the window of the
    query's; a key's position is the number of real tokens before it in its row, prefix first
    (`cache_key_positions`), as the callers number positions.
    """
    c = self.config
    b, w = tokens.shape
    x = embed_tokens(c, self.embed, tokens)  # [B, W, D]
    rope = layer_rope(positions, c)
    index = cache.index
    kv_mask = jax.lax.dynamic_update_slice_in_dim(cache.mask, token_mask, index, axis=1)
    causal = jnp.arange(kv_mask.shape[1])[None, :] <= index + jnp.arange(w)[:, None]  # [W, S]
    mask = causal[None] & kv_mask[:, None, :]  # [B, W, S]
    window = None
    if c.has_sliding_layers:
      before = None
      if prefix is not None:  # each row's queries against its group's prompt cache: [B, W, Sp]
        rows = lambda a: jnp.repeat(a, b // prefix.mask.shape[0], axis=0, total_repeat_length=b)
        before = rows(jnp.sum(prefix.mask, axis=-1, dtype=jnp.int32))
        window = rows(prefix.mask)[:, None, :] & window_mask(c, positions, rows(cache_key_positions(prefix.mask)))
      mask = (mask, mask & window_mask(c, positions, cache_key_positions(kv_mask, before)))
    flags = c.sliding_layers if c.has_sliding_layers else (False,) * c.num_layers
    layer = DecoderLayer(c, parent=None)
    new = []
    for i, (p, layer_cache) in enumerate(zip(layers, cache.layers)):
      view = None if prefix is None else PrefixView(prefix.layers[i], prefix.mask, window)
      x, layer_cache = layer.apply({"params": p}, x, layer_cache, jnp.asarray(flags[i]), rope, mask, index, view)
      new.append(layer_cache)
    x = self.final_norm(x)
    return x, DecodeCache(tuple(new), kv_mask, index + w)


def layer_params(config: ModelConfig, params) -> tuple:
  """The [L, ...] stacked layer parameters as L per-layer trees (for `Transformer.decode`), sliced
  once: call it outside a decode loop."""
  return tuple(jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(config.num_layers))


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
  """[B, T] bool -> [B, T] int32 positions counting only real tokens (0 on leading pads)."""
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=-1) - 1, 0)

"""The decoder-only transformer (Llama / Qwen2 / Qwen3), written with Flax linen.

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
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from rljax import sharding as shd
from rljax.models.attention import attend
from rljax.models.config import ModelConfig

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


class KVCache(NamedTuple):
  """Preallocated keys and values of every layer.

  k: [L, B, K, Dh, S] (keys stored transposed), v: [L, B, K, S, Dh], both in the compute
  dtype; kv_mask: [B, S] bool (slot holds a real token); index: [] int32, the next slot to
  write. Memory: 2 * L * B * S * K * Dh * bytes.

  Decode reads the whole cache every token, so its layout is chosen for that read: with (row,
  KV head) leading and slots contiguous, one-token attention is a pair of reductions that
  stream the cache once, with no transposed copy of it (the [L, B, S, K, Dh] layout made XLA
  transpose every layer's cache on every step, several times slower on CPU).
  """
  k: jax.Array
  v: jax.Array
  kv_mask: jax.Array
  index: jax.Array

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, slots: int) -> "KVCache":
    k_shape = (config.num_layers, batch, config.num_kv_heads, config.head_dim, slots)
    v_shape = (config.num_layers, batch, config.num_kv_heads, slots, config.head_dim)
    return cls(jnp.zeros(k_shape, config.compute_dtype), jnp.zeros(v_shape, config.compute_dtype),
               jnp.zeros((batch, slots), bool), jnp.zeros((), jnp.int32))


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
  return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
  eps: float
  axis_name: str = "norm"
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis_name,), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (scale.astype(jnp.float32) * x32).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
  """[Dh/2] inverse frequencies, with Llama 3 scaling when configured."""
  dh = config.head_dim
  inv = 1.0 / (config.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
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


def rope_tables(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """cos, sin: [B, T, Dh] float32 for positions [B, T] (HF half-split layout)."""
  freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(config)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x: [B, T, heads, Dh]; rotation computed in float32 like the reference implementation."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, cos, sin, mask, layer_cache, prefix=None):
    """x: [B, T, D]; layer_cache: (k [B, K, Dh, S], v [B, K, S, Dh], index) or None.

    mask: with a cache, [B, T, S] bool; without, (token_mask [B, T] bool, segment_ids [B, T] int32
    or None), which `attend` turns into causal, padding and segment masking block by block.

    prefix (with a cache only): a read-only cache shared by groups of B / P consecutive rows,
    (k [P, K, Dh, Sp], v [P, K, Sp, Dh], mask [P, Sp] bool), attended before the row's own cache.
    """
    c = self.config
    dt, pdt = c.compute_dtype, c.storage_dtype
    init = nn.initializers.normal(0.02)
    d, h, k, dh = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim

    def proj(name, heads, axis):
      w = _param(self, f"{name}_kernel", init, (d, heads, dh), ("embed", axis, "head_dim"), pdt)
      y = jnp.einsum("btd,dhk->bthk", x, w.astype(dt))
      if c.attention_bias:
        b = _param(self, f"{name}_bias", nn.initializers.zeros, (heads, dh), (axis, "head_dim"), pdt)
        y = y + b.astype(dt)
      return y

    q, key, val = proj("q", h, "heads"), proj("k", k, "kv_heads"), proj("v", k, "kv_heads")
    if c.qk_norm:
      q = RMSNorm(c.rms_norm_eps, "head_dim", pdt, name="q_norm")(q)
      key = RMSNorm(c.rms_norm_eps, "head_dim", pdt, name="k_norm")(key)
    q, key = apply_rope(q, cos, sin), apply_rope(key, cos, sin)

    b, t = x.shape[:2]
    qg = q.reshape(b, t, k, h // k, dh)
    new_cache = None
    if layer_cache is None:
      token_mask, segment_ids = mask
      out = attend(qg, key, val, token_mask=token_mask, segment_ids=segment_ids, impl=c.attention)
    else:
      ck, cv, index = layer_cache
      ck = jax.lax.dynamic_update_slice_in_dim(ck, key.transpose(0, 2, 3, 1).astype(ck.dtype), index, axis=3)
      cv = jax.lax.dynamic_update_slice_in_dim(cv, val.transpose(0, 2, 1, 3).astype(cv.dtype), index, axis=2)
      new_cache = (ck, cv)
      out = _cached_attention(qg, ck.astype(dt), cv.astype(dt), mask, prefix)
    out = out.reshape(b, t, h, dh)
    wo = _param(self, "o_kernel", init, (h, dh, d), ("heads", "head_dim", "embed"), pdt)
    return jnp.einsum("bthk,hkd->btd", out, wo.astype(dt)), new_cache


def _cached_attention(q, k, v, mask, prefix=None):
  """Attention of T new tokens per row over the row's cache and, optionally, a shared prefix.

  q: [B, T, K, R, Dh] (R = query heads per KV head); k: [B, K, Dh, S]; v: [B, K, S, Dh];
  mask: [B, T, S] bool; prefix: None or (k [P, K, Dh, Sp], v [P, K, Sp, Dh], mask [P, Sp]), a
  read-only cache shared by each group of B / P consecutive rows and attended before the row's
  own slots. Returns [B, T, K, R, Dh].

  For one token (decode) a row's cache is read with products summed in place: one pass over the
  cache, where batched matmuls with R-row operands run far below memory speed on CPU. The shared
  prefix is read once per group, by one matmul whose rows are the group's G * T * R queries,
  instead of once per row.
  """
  b, t, kh, r, dh = q.shape
  if t == 1:
    q1 = q[:, 0].astype(jnp.float32)  # [B, K, R, Dh]
    scores = jnp.sum(q1[..., None] * k[:, :, None].astype(jnp.float32), axis=3)[:, :, None]  # [B, K, 1, R, S]
  else:
    scores = jnp.einsum("btkrd,bkds->bktrs", q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(mask[:, None, :, None, :], scores / math.sqrt(dh), _MASK_VALUE)
  if prefix is not None:
    pk, pv, pmask = prefix
    p, n = pk.shape[0], pk.shape[-1]
    g, rows = b // p, t * r
    # [B, K, T, R, X] <-> [P, K, G * T * R, X]: a group's queries as the rows of one matmul.
    grouped = lambda x: x.reshape(p, g, kh, rows, -1).transpose(0, 2, 1, 3, 4).reshape(p, kh, g * rows, x.shape[-1])
    ungrouped = lambda x: x.reshape(p, kh, g, t, r, -1).transpose(0, 2, 1, 3, 4, 5).reshape(b, kh, t, r, x.shape[-1])
    qk = q.transpose(0, 2, 1, 3, 4).astype(jnp.float32)  # [B, K, T, R, Dh]
    pscores = jnp.einsum("pkqd,pkds->pkqs", grouped(qk), pk.astype(jnp.float32)) / math.sqrt(dh)
    pscores = jnp.where(pmask[:, None, None, :], pscores, _MASK_VALUE)
    scores = jnp.concatenate([ungrouped(pscores), scores], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, T, R, (Sp +) S]
  if prefix is not None:
    shared = ungrouped(jnp.einsum("pkqs,pksd->pkqd", grouped(probs[..., :n]), pv.astype(v.dtype)))
    probs = probs[..., n:]
  if t == 1:
    out = jnp.sum(probs[:, :, 0, :, :, None] * v[:, :, None], axis=3)[:, None]  # [B, 1, K, R, Dh]
  else:
    out = jnp.einsum("bktrs,bksd->btkrd", probs, v)
  if prefix is not None:
    out = out + shared.transpose(0, 2, 1, 3, 4)
  return out


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
    hidden = jax.nn.silu(x @ gate.astype(dt)) * (x @ up.astype(dt))
    return hidden @ down.astype(dt)


class DecoderLayer(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, layer_cache, cos, sin, mask, index, prefix=None):
    c = self.config
    cache_in = None if layer_cache is None else (layer_cache[0], layer_cache[1], index)
    h = RMSNorm(c.rms_norm_eps, param_dtype=c.storage_dtype, name="input_norm")(x)
    attn, new_cache = Attention(c, name="attn")(h, cos, sin, mask, cache_in, prefix)
    x = x + attn
    h = RMSNorm(c.rms_norm_eps, param_dtype=c.storage_dtype, name="post_attn_norm")(x)
    x = x + MLP(c, name="mlp")(h)
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
        split_rngs={"params": True},
        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        length=c.num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(c, name="layers")
    self.final_norm = RMSNorm(c.rms_norm_eps, param_dtype=c.storage_dtype, name="final_norm")
    if not c.tie_word_embeddings:
      self.lm_head = _param(self, "lm_head", nn.initializers.normal(0.02), (c.hidden_size, c.vocab_size),
                            ("embed", "vocab"), c.storage_dtype)

  def output_kernel(self) -> jax.Array:
    """[D, V] projection from final hidden states to logits."""
    return self.embed.T if self.config.tie_word_embeddings else self.lm_head

  def __call__(self, tokens, positions, token_mask=None, cache: KVCache | None = None, *, segment_ids=None,
               return_hidden=False):
    """tokens, positions: [B, T] int32; token_mask: [B, T] bool (default all valid).

    segment_ids (without a cache only): [B, T] int32, packed rows whose tokens attend only within
    their segment (default None: one segment per row); give each segment its own positions.

    Returns (out, new_cache): out is [B, T, V] float32 logits, or the final-normed
    hidden states [B, T, D] in the compute dtype when `return_hidden` (for chunked
    log-probs); new_cache is None when no cache was given.
    """
    c = self.config
    b, t = tokens.shape
    if token_mask is None:
      token_mask = jnp.ones((b, t), bool)
    x = jnp.take(self.embed, tokens, axis=0).astype(c.compute_dtype)
    x = shd.constrain(x, ("batch", "length", "embed"))
    cos, sin = rope_tables(positions, c)

    if cache is None:
      mask = (token_mask, segment_ids)  # O(B * T): no [B, T, T] mask (rljax.models.attention)
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
      layer_caches = (cache.k, cache.v)

    x, new_layers = self.layers(x, layer_caches, cos, sin, mask, index)
    x = self.final_norm(x)
    new_cache = None
    if cache is not None:
      new_cache = KVCache(new_layers[0], new_layers[1], kv_mask, index + t)
    if return_hidden:
      return x, new_cache
    logits = jnp.einsum("btd,dv->btv", x, self.output_kernel().astype(c.compute_dtype),
                        preferred_element_type=jnp.float32)
    return logits, new_cache

  def hidden_to_logits(self, hidden):
    """[..., D] -> [..., V] float32 logits."""
    return jnp.einsum("...d,dv->...v", hidden, self.output_kernel().astype(self.config.compute_dtype),
                      preferred_element_type=jnp.float32)


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
  """[B, T] bool -> [B, T] int32 positions counting only real tokens (0 on leading pads)."""
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=-1) - 1, 0)

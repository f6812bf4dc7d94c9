"""KV caches, typed: one cache per layer, the rows' caches, a shared prefix cache, and the
attention of new tokens over them.

Shapes: L layers, B rows, P prompts (groups of B / P consecutive rows share a prefix), K KV
heads, Dh head dim, S cache slots, Sp prefix slots, T new tokens per row, R query heads per KV
head.

Keys are stored transposed ([.., K, Dh, S]) and values as [.., K, S, Dh]: decode reads the whole
cache every token, so the layout is chosen for that read. With (row, KV head) leading and slots
contiguous, one-token attention is a pair of reductions that stream the cache once, with no
transposed copy of it (an [L, B, S, K, Dh] layout made XLA transpose every layer's cache on
every step, several times slower on CPU).

- `LayerCache`: one layer's keys and values, [B, ...] (or [L, B, ...] stacked, as the scanned
  forward carries them).
- `KVCache`: every layer stacked ([L, ...]), the rows' slot mask and the next slot: what the
  learner's scanned forward fills when it prefills prompts.
- `DecodeCache`: L per-layer caches of the rows, their slot mask and the next slot: what the
  decode loops carry (one array per layer, so a step never slices a layer out of a stack).
- `PrefixCache`: a read-only cache of P prompts that each group of B / P rows attends before its
  own slots (the prompt cache of a group, never copied per row), or, once `point`ed, that each
  row attends at its own prompt (continuous batching: any decode slot may run any prompt's row).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from rljax.models.attention import scale_scores, soft_cap
from rljax.models.config import ModelConfig

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@struct.dataclass
class LayerCache:
  """One layer's keys k [B, K, Dh, S] and values v [B, K, S, Dh] in the compute dtype (with a
  leading [L] axis when the layers are stacked)."""
  k: jax.Array
  v: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, slots: int, layers: int | None = None) -> "LayerCache":
    """Zeros for `batch` rows of `slots` slots (stacked over `layers` when given)."""
    lead = () if layers is None else (layers,)
    kh, dh, dtype = config.num_kv_heads, config.head_dim, config.compute_dtype
    return cls(jnp.zeros(lead + (batch, kh, dh, slots), dtype), jnp.zeros(lead + (batch, kh, slots, dh), dtype))

  @property
  def slots(self) -> int:
    return self.k.shape[-1]

  def write(self, key: jax.Array, value: jax.Array, index) -> "LayerCache":
    """key, value: [B, T, K, Dh] written at slots [index, index + T); index: [] int32, or [B]
    int32, each row's own."""
    key, value = key.transpose(0, 2, 3, 1).astype(self.k.dtype), value.transpose(0, 2, 1, 3).astype(self.v.dtype)
    if jnp.ndim(index) == 0:
      k = jax.lax.dynamic_update_slice_in_dim(self.k, key, index, axis=3)
      v = jax.lax.dynamic_update_slice_in_dim(self.v, value, index, axis=2)
    else:
      k = put_rows(self.k, key, index, axis=3)
      v = put_rows(self.v, value, index, axis=2)
    return LayerCache(k, v)

  def grow(self, extra: int) -> "LayerCache":
    """The same cache with `extra` more (empty) slots at the end."""
    pad = lambda x, axis: jnp.pad(x, [(0, extra) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)])
    return LayerCache(pad(self.k, -1), pad(self.v, -2))

  def constrain(self, constrain) -> "LayerCache":
    """`constrain(x, logical_axes)` applied to k and v (sharding constraints of a decode loop)."""
    return LayerCache(constrain(self.k, ("batch", "kv_heads", "head_dim", "length")),
                      constrain(self.v, ("batch", "kv_heads", "length", "head_dim")))


@struct.dataclass
class KVCache:
  """Every layer's cache stacked ([L, B, ...] in `layers`), as the scanned forward fills it.

  kv_mask: [B, S] bool, the slots that hold a real token; index: [] int32, the next slot to
  write. Memory: 2 * L * B * S * K * Dh elements of the compute dtype.
  """
  layers: LayerCache
  kv_mask: jax.Array
  index: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, slots: int) -> "KVCache":
    return cls(LayerCache.init(config, batch, slots, layers=config.num_layers), jnp.zeros((batch, slots), bool),
               jnp.zeros((), jnp.int32))

  def unstacked(self) -> tuple[LayerCache, ...]:
    """The L per-layer caches (sliced once)."""
    n = self.layers.k.shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], self.layers) for i in range(n))


@struct.dataclass
class DecodeCache:
  """The rows' own caches as a decode loop carries them: one `LayerCache` per layer.

  layers: L caches [B, ...]; mask: [B, S] bool, the slots that hold a real token; index: [] int32,
  the next slot to write (all rows write the same slot: a decode step takes one slot of every
  row, a feed of W tokens takes W; slots a row does not use stay masked), or [B] int32, each
  row's own next slot (the sampler's decode slots, each at its own sample's length).
  """
  layers: tuple[LayerCache, ...]
  mask: jax.Array
  index: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, slots: int) -> "DecodeCache":
    return cls(tuple(LayerCache.init(config, batch, slots) for _ in range(config.num_layers)),
               jnp.zeros((batch, slots), bool), jnp.zeros((), jnp.int32))

  @classmethod
  def from_kv(cls, cache: KVCache) -> "DecodeCache":
    """A stacked cache (a prefill of every row's own history) as per-layer caches."""
    return cls(cache.unstacked(), cache.kv_mask, cache.index)

  @property
  def slots(self) -> int:
    return self.mask.shape[1]

  def grow(self, extra: int) -> "DecodeCache":
    """The same cache with `extra` more (empty, masked) slots at the end."""
    return DecodeCache(tuple(c.grow(extra) for c in self.layers), jnp.pad(self.mask, ((0, 0), (0, extra))), self.index)

  def constrain(self, constrain) -> "DecodeCache":
    """`constrain(x, logical_axes)` applied to every array (rows split like the batch)."""
    index = self.index if jnp.ndim(self.index) == 0 else constrain(self.index, ("batch",))
    return DecodeCache(tuple(c.constrain(constrain) for c in self.layers), constrain(self.mask, ("batch", None)),
                       index)


@struct.dataclass
class PrefixCache:
  """A read-only cache of P prompts: layers L caches [P, K, Dh, Sp] / [P, K, Sp, Dh], mask [P, Sp]
  bool. Each group of B / P consecutive rows attends its prompt's slots before its own; or, with
  `index` ([B] int32, set by `point`), row b attends the prompt `index[b]` of its block: the rows
  and the prompts are cut into `blocks` equal blocks (a batch shard each) and a row reads only
  prompts of its own block, so a sharded batch never gathers another shard's prompts."""
  layers: tuple[LayerCache, ...]
  mask: jax.Array
  index: Any = None
  blocks: int = struct.field(pytree_node=False, default=1)

  @classmethod
  def from_kv(cls, cache: KVCache) -> "PrefixCache":
    """The prompt cache a prefill left (its index is not needed: nothing more is written)."""
    return cls(cache.unstacked(), cache.kv_mask)

  def point(self, index: jax.Array, blocks: int = 1) -> "PrefixCache":
    """The same prompts, row b attending prompt index[b] (within its block of B / blocks rows and
    P / blocks prompts)."""
    return self.replace(index=index, blocks=blocks)

  def rows(self, x: jax.Array, b: int) -> jax.Array:
    """A per-prompt array x [P, ...] as the B rows see it: [B, ...]."""
    return prefix_rows_of(x, b, self.index, self.blocks)

  def constrain(self, constrain) -> "PrefixCache":
    index = None if self.index is None else constrain(self.index, ("batch",))
    return PrefixCache(tuple(c.constrain(constrain) for c in self.layers), constrain(self.mask, ("batch", None)),
                       index, self.blocks)


@struct.dataclass
class PrefixView:
  """What one layer's attention reads of a `PrefixCache`: its keys and values (`cache`), the
  prefix mask [P, Sp], with sliding-window layers `window` [B, T, Sp] bool, the prefix slots
  within each row's queries' window (None without sliding layers), and the rows' prompts
  (`index`, `blocks`: see `PrefixCache`; None: groups of B / P consecutive rows)."""
  cache: LayerCache
  mask: jax.Array
  window: Any = None
  index: Any = None
  blocks: int = struct.field(pytree_node=False, default=1)


def prefix_rows_of(x: jax.Array, b: int, index=None, blocks: int = 1) -> jax.Array:
  """x [P, ...] per prompt -> [B, ...] per row: each prompt repeated for its B / P consecutive rows
  (index None), or row b reading prompt index[b] of its block (B / blocks rows, P / blocks
  prompts per block; a gather within each block, so a block sharded onto one device reads only
  that device's prompts)."""
  if index is None:
    return jnp.repeat(x, b // x.shape[0], axis=0, total_repeat_length=b)
  p = x.shape[0]
  xb = x.reshape((blocks, p // blocks) + x.shape[1:])
  return jax.vmap(lambda a, i: a[i])(xb, index.reshape(blocks, b // blocks)).reshape((b,) + x.shape[1:])


def put_rows(buf: jax.Array, values: jax.Array, index: jax.Array, axis: int) -> jax.Array:
  """buf [B, ...] with values [B, ...] written at index[b] along `axis` of each row b (a
  dynamic_update_slice per row, one scatter)."""
  return jax.vmap(lambda x, y, i: jax.lax.dynamic_update_slice_in_dim(x, y, i, axis=axis - 1))(buf, values, index)


def cached_attention(q, cache: LayerCache, mask, prefix: PrefixView | None = None, scale=None, softcap=None,
                     prefix_rows=None):
  """Attention of T new tokens per row over the row's cache and, optionally, a shared prefix.

  q: [B, T, K, R, Dh]; cache: k [B, K, Dh, S], v [B, K, S, Dh]; mask: [B, T, S] bool; prefix:
  keys and values [P, ...] with mask [P, Sp], read-only, shared by each group of B / P
  consecutive rows (or, with `prefix.index`, row b reading its own prompt) and attended before
  the row's own slots; prefix_rows: None or [B, T, Sp] bool, a further per-query mask of the
  prefix (a sliding window). Scores are q.k * scale (default: q.k / sqrt(Dh)), then soft-capped
  (cap * tanh(s / cap)) when `softcap` is set, then masked. Returns [B, T, K, R, Dh].

  For one token (decode) a row's cache is read with products summed in place: one pass over the
  cache, where batched matmuls with R-row operands run far below memory speed on CPU. The shared
  prefix is read once per group, by one matmul whose rows are the group's G * T * R queries,
  instead of once per row. A pointed prefix (`prefix.index`) is read per row like the row's own
  cache, through a gather of its prompt's keys and values.
  """
  k, v = cache.k, cache.v
  b, t, kh, r, dh = q.shape
  scores = _row_scores(q, k)
  scores = jnp.where(mask[:, None, :, None, :], soft_cap(scale_scores(scores, scale, dh), softcap), MASK_VALUE)
  pointed = prefix is not None and prefix.index is not None
  if pointed:
    per_row = lambda x: prefix_rows_of(x, b, prefix.index, prefix.blocks)
    pk, pv, pmask = per_row(prefix.cache.k), per_row(prefix.cache.v), per_row(prefix.mask)
    n = pk.shape[-1]
    pscores = soft_cap(scale_scores(_row_scores(q, pk), scale, dh), softcap)
    pscores = jnp.where(pmask[:, None, None, None, :], pscores, MASK_VALUE)  # [B, K, T, R, Sp]
    if prefix_rows is not None:
      pscores = jnp.where(prefix_rows[:, None, :, None, :], pscores, MASK_VALUE)
    scores = jnp.concatenate([pscores, scores], axis=-1)
  elif prefix is not None:
    pk, pv, pmask = prefix.cache.k, prefix.cache.v, prefix.mask
    p, n = pk.shape[0], pk.shape[-1]
    g, rows = b // p, t * r
    # [B, K, T, R, X] <-> [P, K, G * T * R, X]: a group's queries as the rows of one matmul.
    grouped = lambda x: x.reshape(p, g, kh, rows, -1).transpose(0, 2, 1, 3, 4).reshape(p, kh, g * rows, x.shape[-1])
    ungrouped = lambda x: x.reshape(p, kh, g, t, r, -1).transpose(0, 2, 1, 3, 4, 5).reshape(b, kh, t, r, x.shape[-1])
    qk = q.transpose(0, 2, 1, 3, 4).astype(jnp.float32)  # [B, K, T, R, Dh]
    pscores = jnp.einsum("pkqd,pkds->pkqs", grouped(qk), pk.astype(jnp.float32))
    pscores = soft_cap(scale_scores(pscores, scale, dh), softcap)
    pscores = ungrouped(jnp.where(pmask[:, None, None, :], pscores, MASK_VALUE))  # [B, K, T, R, Sp]
    if prefix_rows is not None:
      pscores = jnp.where(prefix_rows[:, None, :, None, :], pscores, MASK_VALUE)
    scores = jnp.concatenate([pscores, scores], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, T, R, (Sp +) S]
  if pointed:
    shared = _row_values(probs[..., :n], pv.astype(v.dtype))
    probs = probs[..., n:]
  elif prefix is not None:
    shared = ungrouped(jnp.einsum("pkqs,pksd->pkqd", grouped(probs[..., :n]), pv.astype(v.dtype)))
    shared = shared.transpose(0, 2, 1, 3, 4)
    probs = probs[..., n:]
  out = _row_values(probs, v)
  if prefix is not None:
    out = out + shared
  return out


def _row_scores(q, k):
  """q [B, T, K, R, Dh] against each row's keys k [B, K, Dh, S]: scores [B, K, T, R, S] float32."""
  if q.shape[1] == 1:
    q1 = q[:, 0].astype(jnp.float32)  # [B, K, R, Dh]
    return jnp.sum(q1[..., None] * k[:, :, None].astype(jnp.float32), axis=3)[:, :, None]  # [B, K, 1, R, S]
  return jnp.einsum("btkrd,bkds->bktrs", q, k, preferred_element_type=jnp.float32)


def _row_values(probs, v):
  """probs [B, K, T, R, S] over each row's values v [B, K, S, Dh]: [B, T, K, R, Dh]."""
  if probs.shape[2] == 1:
    return jnp.sum(probs[:, :, 0, :, :, None] * v[:, :, None], axis=3)[:, None]  # [B, 1, K, R, Dh]
  return jnp.einsum("bktrs,bksd->btkrd", probs, v)

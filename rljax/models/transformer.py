"""The decoder-only transformer every family runs (rljax/models/families/), written with Flax linen.

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

Layers of different kinds (a mixture of experts with dense layers mixed in: the family's
`layer_kinds`) cannot share one scan: each kind has its own stack ("layers" for the family's main
kind, "<kind>_layers" for the others; `Family.stack_names`), and the forward runs the model's
runs of same-kind layers in order, each a scan over its slice of its kind's stack
(`LayerPlan`). A model of one kind (every dense family, a MoE model without dense layers) is one
stack and one scan, as before; a model with a few dense layers first is two scans; an
alternating pattern (decoder_sparse_step 2) is one scan per layer, so its compile time grows
with depth.

Per-layer differences (Gemma's sliding-window layers and their RoPE base) are data, not
code: a [L] bool array of sliding flags is scanned with the layers, and a layer selects its
mask, window and RoPE tables with `jnp.where` on its flag. A sliding layer lets a query at
position p see keys at positions > p - W (`config.sliding_window`), HF's window; with a cache,
a key's position is the number of real tokens before it in its row (prefix included), which is
how every caller numbers positions (`positions_from_mask`, the decode loops).

The forward returns a `ModelOutput` (rljax/models/outputs.py); RoPE and its scalings live in
rljax/models/rope.py, norms, embedding and the dense MLP in rljax/models/layers.py.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from rljax import sharding as shd
from rljax.models import families, rope as rope_lib
from rljax.models.attention import attend, soft_cap
from rljax.models.cache import DecodeCache, KVCache, LayerCache, PrefixCache, PrefixView, cached_attention, put_rows
from rljax.models.config import ModelConfig
from rljax.models.layers import embed_tokens, lora_delta, make_norm, param
from rljax.models.outputs import ModelOutput, collect_stats
from rljax.models.rope import apply_rope


def sliding_flags(config: ModelConfig) -> jax.Array:
  """[L] bool: which layers attend within the sliding window (all False without one)."""
  flags = config.sliding_layers if config.has_sliding_layers else (False,) * config.num_layers
  return jnp.asarray(flags, bool)


def rope_inv_freq(config: ModelConfig, theta: float | None = None) -> jax.Array:
  """[Dh/2] inverse frequencies of the global layers (base config.rope_theta and config.rope_scaling),
  or, given `theta`, of an unscaled base `theta` (the sliding layers' local base)."""
  if theta is None:
    return rope_lib.inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
  return rope_lib.inv_freq(config.head_dim, theta)


def rope_tables(positions: jax.Array, config: ModelConfig, theta: float | None = None) -> tuple[jax.Array, jax.Array]:
  """cos, sin: [B, T, Dh] float32 for positions [B, T] (HF half-split layout): the global layers'
  (config.rope_theta, scaled by config.rope_scaling, YaRN's attention factor included), or, given
  `theta`, those of an unscaled base `theta`."""
  if theta is None:
    return rope_lib.tables(positions, config.head_dim, config.rope_theta, config.rope_scaling)
  return rope_lib.tables(positions, config.head_dim, theta)


def layer_rope(positions: jax.Array, config: ModelConfig):
  """The RoPE tables the layers take: (cos, sin) [B, T, Dh], or, with a separate base for the
  sliding layers (Gemma 3), ((cos, sin) global, (cos, sin) local), selected per layer. RoPE
  scaling applies to the global tables only (Gemma 3's linear scaling is on its full-attention layers)."""
  glob = rope_tables(positions, config)
  if config.rope_local_theta is None or not config.has_sliding_layers:
    return glob
  return glob, rope_tables(positions, config, config.rope_local_theta)


def _select_rope(config: ModelConfig, tables, sliding):
  """(cos, sin) of one layer from `layer_rope`'s tables and its sliding flag ([] bool)."""
  if config.rope_local_theta is None or not config.has_sliding_layers:
    return tables
  (gc, gs), (lc, ls) = tables
  return jnp.where(sliding, lc, gc), jnp.where(sliding, ls, gs)


def cache_key_positions(kv_mask: jax.Array, before=None) -> jax.Array:
  """[B, S] int32 position of the token in each cache slot: the real tokens before it in the row
  (`before` [B] int32 more of them ahead of the cache, e.g. a shared prompt cache)."""
  pos = jnp.cumsum(kv_mask.astype(jnp.int32), axis=-1) - 1
  return pos if before is None else pos + before[:, None]


def window_mask(config: ModelConfig, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
  """[B, T, S] bool: key within the sliding window of the query, q_positions [B, T], k_positions [B, S]."""
  return (q_positions[:, :, None] - k_positions[:, None, :]) < config.sliding_window


class Attention(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x, cos, sin, mask, cache: LayerCache | None, index=None, prefix: PrefixView | None = None,
               sliding=None):
    """x: [B, T, D]; cache: this layer's keys and values (rljax.models.cache), the T new tokens
    written at slots [index, index + T); or None (no cache).

    mask: with a cache, [B, T, S] bool, or (global, local) [B, T, S] bool pairs when the model has
    sliding layers; without, (token_mask [B, T] bool, segment_ids [B, T] int32 or None,
    prefix_ids [B, T] int32 or None, positions [B, T] int32), which `attend` turns into causal,
    padding, segment (and shared-prefix) and window masking block by block.

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
      w = param(self, f"{name}_kernel", init, (d, heads, dh), ("embed", axis, "head_dim"), pdt)
      y = jnp.einsum("btd,dhk->bthk", x, w.astype(dt))
      delta = lora_delta(self, name, x, ("embed",), (heads, dh), (axis, "head_dim"))
      if delta is not None:
        y = y + delta
      if c.attention_bias:
        b = param(self, f"{name}_bias", nn.initializers.zeros, (heads, dh), (axis, "head_dim"), pdt)
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
      token_mask, segment_ids, prefix_ids, positions = mask
      window = None
      if sliding is not None:   # the global layers' window is larger than any distance
        window = jnp.where(sliding, jnp.int32(c.sliding_window), jnp.iinfo(jnp.int32).max)
      out = attend(qg, key, val, token_mask=token_mask, segment_ids=segment_ids, prefix_ids=prefix_ids,
                   impl=c.attention, positions=positions, window=window, scale=c.attention_scale,
                   softcap=c.attn_logit_softcap)
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
    wo = param(self, "o_kernel", init, (h, dh, d), ("heads", "head_dim", "embed"), pdt)
    y = jnp.einsum("bthk,hkd->btd", out, wo.astype(dt))
    delta = lora_delta(self, "o", out, ("heads", "head_dim"), (d,), ("embed",))
    return (y if delta is None else y + delta), new_cache


class DecoderLayer(nn.Module):
  """One block. `sliding` is this layer's [] bool flag (scanned from `sliding_flags`); `rope` the
  tables of `layer_rope`. Norms: input_norm before attention, post_attn_norm before the feed-forward
  block (HF's post_attention_layernorm for Llama / Qwen, pre_feedforward_layernorm for Gemma) and,
  with `sandwich_norms`, attn_out_norm / mlp_out_norm on each branch's output before its residual add.
  The feed-forward block is the family's block of this layer's `kind` (`Family.block`: the dense
  MLP, or a mixture of experts).

  Returns (x, (new_cache, stats)): stats the block's auxiliary losses and router statistics
  (`rljax.models.outputs.no_stats()` for a dense MLP); token_mask [B, T] bool (None: all real)
  tells the block which tokens are real; replay (routed blocks only): [B, T, k] expert ids to use
  instead of the router's choice (routing replay), or None."""
  config: ModelConfig
  kind: str = "dense"

  @nn.compact
  def __call__(self, x, cache: LayerCache | None, sliding, rope, mask, index, prefix: PrefixView | None = None,
               token_mask=None, replay=None):
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
    name, block = families.get(c.architecture).block(c, self.kind)
    out, stats = block(c, name=name)(h, token_mask, *(() if replay is None else (replay,)))
    if c.sandwich_norms:
      out = make_norm(c, name="mlp_out_norm")(out)
    x = x + out
    x = shd.constrain(x, ("batch", "length", "embed"))
    return x, (new_cache, stats)


def routed(kind: str) -> bool:
  """Whether layers of `kind` route tokens to experts (record and replay expert ids)."""
  return kind == "moe"


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """How a model's layers are stacked and run.

  kinds: each layer's kind, in model order; stacks: kind -> its stack's key in the parameter tree;
  index: each layer's position in its kind's stack; route_index: each layer's position among the
  routed (mixture-of-experts) layers, or -1; segments: the runs of consecutive same-kind layers,
  (kind, first layer, end layer, first stack index), run in order.
  """
  kinds: tuple[str, ...]
  stacks: dict
  index: tuple[int, ...]
  route_index: tuple[int, ...]
  segments: tuple[tuple[str, int, int, int], ...]

  @property
  def routed_layers(self) -> int:
    return sum(i >= 0 for i in self.route_index)

  def count(self, kind: str) -> int:
    return sum(k == kind for k in self.kinds)


def layer_plan(config: ModelConfig) -> LayerPlan:
  family = families.get(config.architecture)
  kinds = family.layer_kinds(config)
  seen: dict[str, int] = {}
  index, route_index, segments = [], [], []
  routes = 0
  for i, kind in enumerate(kinds):
    index.append(seen.get(kind, 0))
    seen[kind] = index[-1] + 1
    route_index.append(routes if routed(kind) else -1)
    routes += routed(kind)
    if segments and segments[-1][0] == kind:
      segments[-1][2] = i + 1
    else:
      segments.append([kind, i, i + 1, index[-1]])
  return LayerPlan(tuple(kinds), family.stack_names(config), tuple(index), tuple(route_index),
                   tuple(tuple(x) for x in segments))


_UNSET = object()


def _stack_module(config: ModelConfig, kind: str, length: int, name: str | None = None, parent=_UNSET):
  """The scanned stack of `length` layers of `kind` (remat when config.remat); parent=None makes
  it unbound (applied to a slice of a stack's parameters)."""
  layer = DecoderLayer
  if config.remat:
    layer = nn.remat(DecoderLayer, prevent_cse=False, static_argnums=())
  scanned = nn.scan(
      layer,
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      in_axes=(0, 0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
      length=length,
      metadata_params={nn.PARTITION_NAME: "layers"},
  )
  kw = {} if parent is _UNSET else {"parent": parent}
  return scanned(config, kind=kind, name=name, **kw) if name is not None else scanned(config, kind=kind, **kw)


class Transformer(nn.Module):
  """Decoder-only LM. Call returns a `ModelOutput` (logits or hidden states, cache, auxiliary losses,
  router statistics)."""
  config: ModelConfig

  def setup(self):
    c = self.config
    self.embed = param(self, "embedding", nn.initializers.normal(0.02), (c.vocab_size, c.hidden_size),
                        ("vocab", "embed"), c.storage_dtype)
    plan = layer_plan(c)
    self.stacks = {kind: _stack_module(c, kind, plan.count(kind), name=name) for kind, name in plan.stacks.items()}
    self.final_norm = make_norm(c, name="final_norm")
    if not c.tie_word_embeddings:
      self.lm_head = param(self, "lm_head", nn.initializers.normal(0.02), (c.hidden_size, c.vocab_size),
                            ("embed", "vocab"), c.storage_dtype)

  def output_kernel(self) -> jax.Array:
    """[D, V] projection from final hidden states to logits (the transposed embedding when tied),
    in the compute dtype, as the logits use it: the learner's chunked log-probs take this kernel
    too, so they match the sampler's matmul; on a mesh the all-gathered kernel is then the compute
    dtype rather than the float32 parameter (half the bytes in bf16)."""
    kernel = self.embed.T if self.config.tie_word_embeddings else self.lm_head
    return kernel.astype(self.config.compute_dtype)

  def __call__(self, tokens, positions, token_mask=None, cache: KVCache | None = None, *, segment_ids=None,
               prefix_ids=None, return_hidden=False, routes=None):
    """tokens, positions: [B, T] int32; token_mask: [B, T] bool (default all valid).

    segment_ids (without a cache only): [B, T] int32, packed rows whose tokens attend only within
    their segment (default None: one segment per row); give each segment its own positions.
    prefix_ids (with segment_ids): [B, T] int32, a segment each token also sees (a shared prompt
    that packed completions continue; rljax.models.attention), or None.

    routes (mixture-of-experts models): None, or [B, T, L_moe, k] expert ids to replay in the
    L_moe routed layers (routing replay; ids >= E: the layer routes that token itself).

    Returns a `ModelOutput`: `logits` [B, T, V] float32 (soft-capped when `final_logit_softcap`),
    or, with `return_hidden`, `hidden`, the final-normed hidden states [B, T, D] in the compute
    dtype (for chunked log-probs); `cache` the updated cache (None when none was given);
    `aux_losses` and `router` from the feed-forward blocks (empty for dense models; `router`'s
    statistics are stacked over the routed layers, e.g. `experts` [L_moe, B, T, k]).
    """
    c = self.config
    b, t = tokens.shape
    if token_mask is None:
      token_mask = jnp.ones((b, t), bool)
    x = embed_tokens(c, self.embed, tokens)
    x = shd.constrain(x, ("batch", "length", "embed"))
    rope = layer_rope(positions, c)

    if cache is None:
      mask = (token_mask, segment_ids, prefix_ids, positions)  # O(B * T): no [B, T, T] mask (models.attention)
      layer_caches, index = None, jnp.zeros((), jnp.int32)
    else:
      if segment_ids is not None or prefix_ids is not None:
        raise ValueError("segment_ids and prefix_ids are for the forward without a cache (packed training rows).")
      s = cache.kv_mask.shape[1]
      index = cache.index
      kv_mask = jax.lax.dynamic_update_slice_in_dim(cache.kv_mask, token_mask, index, axis=1)
      slots = jnp.arange(s)[None, :]
      query_slots = index + jnp.arange(t)[:, None]
      mask = (slots <= query_slots)[None] & kv_mask[:, None, :]
      if c.has_sliding_layers:
        mask = (mask, mask & window_mask(c, positions, cache_key_positions(kv_mask)))
      layer_caches = cache.layers

    replay = None if routes is None else jnp.moveaxis(routes, 2, 0)   # [L_moe, B, T, k]
    x, new_layers, stats = self._run_layers(x, layer_caches, rope, mask, index, token_mask, replay)
    x = self.final_norm(x)
    new_cache = None
    if cache is not None:
      new_cache = KVCache(new_layers, kv_mask, index + t)
    aux_losses, router = collect_stats(stats)
    if return_hidden:
      return ModelOutput(hidden=x, cache=new_cache, aux_losses=aux_losses, router=router)
    logits = jnp.einsum("btd,dv->btv", x, self.output_kernel(), preferred_element_type=jnp.float32)
    return ModelOutput(logits=soft_cap(logits, c.final_logit_softcap), cache=new_cache, aux_losses=aux_losses,
                       router=router)

  def _run_layers(self, x, caches, rope, mask, index, token_mask, replay):
    """Every layer in model order: one scan per run of same-kind layers (module doc). Returns
    (x, the new stacked caches or None, the runs' stacked statistics in order)."""
    c = self.config
    plan = layer_plan(c)
    flags = sliding_flags(c)
    if len(plan.segments) == 1:   # one kind: the whole stack, one scan
      x, (new, stats) = self.stacks[plan.kinds[0]](x, caches, flags, rope, mask, index, None, token_mask, replay)
      return x, new, [stats]
    if self.is_initializing():   # make every stack's parameters (the forward's value is not used)
      for kind in plan.stacks:
        x, _ = self.stacks[kind](x, None, flags[:plan.count(kind)], rope, mask, index, None, token_mask, None)
      return x, caches, []
    params = self.variables["params"]
    dropout = self.make_rng("dropout") if self.has_rng("dropout") else None
    new_caches, all_stats = [], []
    for kind, first, end, at in plan.segments:
      n = end - first
      take = lambda a, lo=at, n=n: jax.lax.slice_in_dim(a, lo, lo + n, axis=0)
      layer_caches = None if caches is None else jax.tree.map(lambda a: a[first:end], caches)
      seg_replay = None
      if replay is not None and routed(kind):
        r0 = plan.route_index[first]
        seg_replay = replay[r0:r0 + n]
      stack = _stack_module(c, kind, n, parent=None)
      rngs = None if dropout is None else {"dropout": jax.random.fold_in(dropout, first)}
      x, (new, stats) = stack.apply({"params": jax.tree.map(take, params[plan.stacks[kind]])}, x, layer_caches,
                                    flags[first:end], rope, mask, index, None, token_mask, seg_replay, rngs=rngs)
      new_caches.append(new)
      all_stats.append(stats)
    new_layers = None
    if caches is not None:
      new_layers = jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *new_caches)
    return x, new_layers, all_stats

  def hidden_to_logits(self, hidden):
    """[..., D] -> [..., V] float32 logits (soft-capped when `final_logit_softcap`)."""
    logits = jnp.einsum("...d,dv->...v", hidden, self.output_kernel(), preferred_element_type=jnp.float32)
    return soft_cap(logits, self.config.final_logit_softcap)

  def decode(self, layers: tuple, tokens, positions, token_mask, cache: DecodeCache, prefix: PrefixCache | None = None):
    """W new tokens per row through the model over per-layer caches, written at slots
    [cache.index, cache.index + W) (cache.index: [] int32, or [B] int32, each row's own): the
    forward of `__call__` with a cache, the layers unrolled.

    layers: the L per-layer parameter trees (`layer_params`, sliced once, outside any decode
    loop); tokens, positions: [B, W] int32; token_mask: [B, W] bool; cache: the rows' caches;
    prefix: None, or the prompt cache that each group of B / P consecutive rows (or, pointed,
    each row its own prompt: `PrefixCache.point`) attends before its own slots. Token w of a row
    attends to its prefix, then to the slots <= index + w whose mask is set. Returns the
    final-normed hidden states [B, W, D] (compute dtype), the cache with the new tokens (index
    advanced by W) and, for a mixture of experts, the experts each new token was routed to in each
    routed layer, [B, W, L_moe, k] int32 (None for dense models).

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
    if jnp.ndim(index) == 0:
      kv_mask = jax.lax.dynamic_update_slice_in_dim(cache.mask, token_mask, index, axis=1)
      causal = jnp.arange(kv_mask.shape[1])[None, :] <= index + jnp.arange(w)[:, None]  # [W, S]
      mask = causal[None] & kv_mask[:, None, :]  # [B, W, S]
    else:   # each row at its own slot
      kv_mask = put_rows(cache.mask, token_mask, index, axis=1)
      causal = jnp.arange(kv_mask.shape[1])[None, None, :] <= (index[:, None] + jnp.arange(w)[None, :])[..., None]
      mask = causal & kv_mask[:, None, :]  # [B, W, S]
    window = None
    if c.has_sliding_layers:
      before = None
      if prefix is not None:  # each row's queries against its prompt's cache: [B, W, Sp]
        rows = lambda a: prefix.rows(a, b)
        before = rows(jnp.sum(prefix.mask, axis=-1, dtype=jnp.int32))
        window = rows(prefix.mask)[:, None, :] & window_mask(c, positions, rows(cache_key_positions(prefix.mask)))
      mask = (mask, mask & window_mask(c, positions, cache_key_positions(kv_mask, before)))
    flags = c.sliding_layers if c.has_sliding_layers else (False,) * c.num_layers
    plan = layer_plan(c)
    new, routes = [], []
    for i, (p, layer_cache) in enumerate(zip(layers, cache.layers)):
      view = None if prefix is None else PrefixView(prefix.layers[i], prefix.mask, window, prefix.index, prefix.blocks)
      layer = DecoderLayer(c, kind=plan.kinds[i], parent=None)
      x, (layer_cache, stats) = layer.apply({"params": p}, x, layer_cache, jnp.asarray(flags[i]), rope, mask, index,
                                            view, token_mask)
      new.append(layer_cache)
      if routed(plan.kinds[i]):
        routes.append(stats["router"]["experts"])
    x = self.final_norm(x)
    return x, DecodeCache(tuple(new), kv_mask, index + w), (jnp.stack(routes, axis=2) if routes else None)


def layer_params(config: ModelConfig, params) -> tuple:
  """The stacked layer parameters as L per-layer trees in model order (for `Transformer.decode`),
  sliced once: call it outside a decode loop."""
  plan = layer_plan(config)
  return tuple(jax.tree.map(lambda a, j=plan.index[i]: a[j], params[plan.stacks[kind]])
               for i, kind in enumerate(plan.kinds))


def positions_from_mask(token_mask: jax.Array) -> jax.Array:
  """[B, T] bool -> [B, T] int32 positions counting only real tokens (0 on leading pads)."""
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=-1) - 1, 0)

"""The decode core of every producer: the state a decode loop carries, how the next tokens are
chosen and written into it, and the model over typed KV caches.

Shapes: B rows, T completion (trajectory) columns, V vocab, W tokens fed per row at once,
P prompts when a prompt cache is shared by groups of rows, S cache slots.

- `DecodeState` and `choose`: the tokens, masks, log-probs and stop flags of B rows, and the one
  function that picks the rows' next tokens (`rljax.rollout.draw.sample_logits`) and writes them
  in. The single-turn sampler and the segment engine both call `choose`, so a row's tokens and
  log-probs depend on its logits and the step's key, not on the engine.
- `CachedModel`: the model as the decode loops call it. Prompts are prefilled through the
  learner's own forward (`Transformer.__call__`, layers scanned); new tokens run through
  `Transformer.decode` over one `LayerCache` per layer, optionally behind a read-only
  `PrefixCache` shared by each group of rows. Build it once per traced program, outside the
  loops: it slices the stacked layer weights into per-layer trees there, once.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from rljax.models.cache import DecodeCache, KVCache, LayerCache, PrefixCache
from rljax.models.config import ModelConfig
from rljax.models.policy import apply_model
from rljax.models.transformer import Transformer, layer_params, positions_from_mask
from rljax.rollout.draw import SamplingParams, sample_logits

# A token draw: (state, logits [B, V], sp, key) -> (tokens [B] int32, logprobs [B] f32, entropy [B] f32).
Draw = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


# ---- the decode state and the token choice --------------------------------------------------


@struct.dataclass
class DecodeState:
  """What a decode loop knows about B rows of up to T tokens.

  tokens: [B, T] int32, the chosen ids (the pad id where none was chosen).
  mask: [B, T] bool, the tokens the model chose (what the learner trains on).
  logprobs, entropy: [B, T] float32, recorded by `sample_logits` for those tokens (0 elsewhere).
  done: [B] bool, the row takes no more tokens.
  stopped: [B] bool, the row chose a stop id.

  The segment engine extends it (`rljax.rollout.segments.SegmentState`) with its bookkeeping
  and caches.
  """
  tokens: jax.Array
  mask: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  done: jax.Array
  stopped: jax.Array

  @classmethod
  def empty(cls, rows: int, width: int, pad_id: int, done=None, **extra) -> "DecodeState":
    """No tokens yet: [rows, width] buffers of pad / False / 0; `done` [rows] (default none);
    `extra` fills the fields of a subclass."""
    zeros = lambda dtype: jnp.zeros((rows, width), dtype)
    return cls(tokens=jnp.full((rows, width), pad_id, jnp.int32), mask=zeros(bool), logprobs=zeros(jnp.float32),
               entropy=zeros(jnp.float32), done=jnp.zeros((rows,), bool) if done is None else done,
               stopped=jnp.zeros((rows,), bool), **extra)


def draw_tokens(state: DecodeState, logits: jax.Array, sp: SamplingParams, key: jax.Array):
  """The default `Draw`: `sample_logits(logits, sp, key)` (the state is not read)."""
  del state
  return sample_logits(logits, sp, key)


def choose(state: DecodeState, logits: jax.Array, column, sp: SamplingParams, key: jax.Array,
           stop_ids: tuple[int, ...], pad_id: int, live=None, draw: Draw | None = None):
  """Chooses the next token of every live row, writes it at `column` and flags the rows that stop.

  logits: [B, V]. column: [] int32, the column every row writes (the single-turn loop), or [B]
  int32, each row's own (columns past T are dropped). key: this step's PRNG key. stop_ids: a
  static tuple. live: [B] bool, the rows that take a token (default ~state.done); the others
  keep their entries. draw: how the tokens are drawn and what is recorded (default
  `draw_tokens`, i.e. `sample_logits`).
  Returns (state, tok): tokens / mask / logprobs / entropy written for the live rows, done and
  stopped set where a live row chose a stop id; tok [B] int32, the pad id for rows not live.
  Works on any DecodeState subclass (the extra fields pass through).
  """
  live = ~state.done if live is None else live
  tok, lp, ent = (draw or draw_tokens)(state, logits, sp, key)
  tok = jnp.where(live, tok, pad_id)
  put = _put_column if jnp.ndim(column) == 0 else _put_rows
  hit = live & isin(tok, stop_ids)
  state = state.replace(tokens=put(state.tokens, column, tok, live), mask=put(state.mask, column, live, live),
                        logprobs=put(state.logprobs, column, lp, live), entropy=put(state.entropy, column, ent, live),
                        done=state.done | hit, stopped=state.stopped | hit)
  return state, tok


def _put_column(buf, col, values, where):
  """buf[b, col] = values[b] where `where[b]`; col is one column for all rows (an in-place slice update)."""
  old = jax.lax.dynamic_slice_in_dim(buf, col, 1, axis=1)[:, 0]
  new = jnp.where(where, values.astype(buf.dtype), old)
  return jax.lax.dynamic_update_slice_in_dim(buf, new[:, None], col, axis=1)


def _put_rows(buf, col, values, where):
  """buf[b, col[b]] = values[b] where `where[b]` (out-of-range columns are dropped)."""
  col = jnp.where(where, col, buf.shape[1])
  return buf.at[jnp.arange(buf.shape[0]), col].set(values.astype(buf.dtype), mode="drop")


def pad_token_id(config: ModelConfig) -> int:
  """The id written where no token was chosen: config.pad_token_id, else 0."""
  return 0 if config.pad_token_id is None else int(config.pad_token_id)


def isin(tok, ids: tuple[int, ...]):
  """[B] whether each token of tok [B] is one of the static `ids`."""
  if not ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.any(tok[:, None] == jnp.asarray(ids, jnp.int32)[None, :], axis=-1)


# ---- the model over KV caches -----------------------------------------------------------------


class CachedModel:
  """The model as the decode loops call it: prefill, then new tokens over per-layer caches.

  Construct it inside the traced program, before the decode loops: the stacked layer weights are
  sliced into per-layer trees here, once (`layer_params`), and the loops read those.
  """

  def __init__(self, config: ModelConfig, params):
    self.config, self.params = config, params
    self.module = Transformer(config)
    self.layers = layer_params(config, params)

  def prefill(self, prompt_ids, prompt_mask, slots: int, constrain=lambda x, logical: x):
    """Runs prompts [P, Lp] (mask [P, Lp]) through the learner's forward into a fresh cache of
    `slots` slots.

    Returns (cache, logits): the stacked KVCache ([L, P, ...], index Lp) and the float32 logits
    [P, V] that predict each prompt's next token (from its last real token). `constrain(x,
    logical_axes)` places sharding constraints (identity by default). `prefill_with_routes` also
    returns the prompts' routes (mixture of experts).
    """
    cache, logits, _ = self.prefill_with_routes(prompt_ids, prompt_mask, slots, constrain)
    return cache, logits

  def prefill_with_routes(self, prompt_ids, prompt_mask, slots: int, constrain=lambda x, logical: x):
    """`prefill`, and the experts each prompt token was routed to, [P, Lp, L_moe, k] int32 (None
    for a dense model)."""
    cache = KVCache.init(self.config, prompt_ids.shape[0], slots)
    layers = LayerCache(constrain(cache.layers.k, ("layers", "batch", "kv_heads", "head_dim", "length")),
                        constrain(cache.layers.v, ("layers", "batch", "kv_heads", "length", "head_dim")))
    out = apply_model(self.config, self.params, prompt_ids, positions_from_mask(prompt_mask), prompt_mask,
                      cache.replace(layers=layers), return_hidden=True)
    last = _last_true(prompt_mask)
    h_last = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]  # [P, D]
    experts = out.router.get("experts")
    routes = None if experts is None else jnp.moveaxis(experts, 0, 2)
    return out.cache, self.logits(h_last), routes

  def prefill_shared(self, prompt_ids, prompt_mask, s: int, constrain=lambda x, logical: x):
    """`prefill` of prompts [P, Lp] whose first s columns are the same real tokens in every prompt
    (a system prompt, few-shot examples): those s columns run once, as one prompt; then every
    prompt's other Lp - s columns run over a cache that starts with them. Returns (cache, logits)
    as `prefill` does (slots = Lp), equal up to float32 reordering, for P * (Lp - s) + s prefill
    positions instead of P * Lp."""
    p, width = prompt_ids.shape
    if not 0 < s < width:
      raise ValueError(f"shared prefix of {s} tokens: it must be between 1 and the prompt width - 1 ({width - 1}).")
    shared, _ = self.prefill(prompt_ids[:1, :s], prompt_mask[:1, :s], s, constrain)
    fan = lambda x, axis: jnp.pad(jnp.broadcast_to(x, x.shape[:1] + (p,) + x.shape[2:]),
                                  [(0, width - s) if a == axis % x.ndim else (0, 0) for a in range(x.ndim)])
    k = constrain(fan(shared.layers.k, -1), ("layers", "batch", "kv_heads", "head_dim", "length"))
    v = constrain(fan(shared.layers.v, -2), ("layers", "batch", "kv_heads", "length", "head_dim"))
    kv_mask = jnp.zeros((p, width), bool).at[:, :s].set(True)
    cache = KVCache(LayerCache(k, v), kv_mask, jnp.int32(s))
    ids, mask = prompt_ids[:, s:], prompt_mask[:, s:]
    positions = s + positions_from_mask(mask)
    out = apply_model(self.config, self.params, ids, positions, mask, cache, return_hidden=True)
    last = _last_true(mask)
    h_last = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]  # [P, D]
    return out.cache, self.logits(h_last)

  def forward(self, tokens, positions, token_mask, cache: DecodeCache, prefix: PrefixCache | None = None):
    """W new tokens per row: tokens, positions [B, W] int32, token_mask [B, W] bool, written at
    slots [cache.index, cache.index + W). Returns the final-normed hidden states [B, W, D], the
    cache and the new tokens' routes [B, W, L_moe, k] (None for dense models; `Transformer.decode`)."""
    return self.module.apply({"params": self.params}, self.layers, tokens, positions, token_mask, cache, prefix,
                             method=Transformer.decode)

  def step(self, tokens, positions, token_mask, cache: DecodeCache, prefix: PrefixCache | None = None):
    """One new token per row: tokens, positions [B] int32, token_mask [B] bool. Returns logits
    [B, V] float32, the cache and the tokens' routes [B, L_moe, k] (None for dense models)."""
    hidden, cache, routes = self.forward(tokens[:, None], positions[:, None], token_mask[:, None], cache, prefix)
    return self.logits(hidden[:, 0]), cache, (None if routes is None else routes[:, 0])

  def logits(self, hidden):
    """[..., D] -> [..., V] float32 logits (`Transformer.hidden_to_logits`)."""
    return self.module.apply({"params": self.params}, hidden, method=Transformer.hidden_to_logits)


def _last_true(x):
  """[B, N] bool -> [B] index of the last True (0 when none)."""
  n = x.shape[-1]
  return (n - 1 - jnp.argmax(x[:, ::-1], axis=-1)).astype(jnp.int32)

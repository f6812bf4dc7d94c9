"""Decoding in segments: compiled pieces that pause rows, feed them tokens and resume them from
their caches. The engine of multi-turn tool use (rljax/rollout/tools.py) and of partial
rollouts (rljax/rollout/partial.py).

Shapes: P prompts, G rows per prompt, B = P * G rows (prompt-major), Lp prompt width, Lh history
width, T = sp.max_new_tokens, the trajectory width (sampled and fed tokens together), S cache
slots per row, W the widest feed of a round, V vocab.

A trajectory is a row's tokens after its prompt, in order: sampled tokens, tokens fed in from
outside (tool responses), sampled tokens, ... The pieces, each jitted, on a `SegmentState`:

- `start`: every prompt is prefilled once (as in `rljax.rollout.sampler.sample`); its G rows
  share that prompt cache (`PrefixCache`), read-only, and each row gets its own cache of S slots;
  each row samples its first token.
- `restart`: every row's whole history (prompt and trajectory so far, left-padded) is prefilled
  into a fresh cache of its own, and each live row samples its next token: how a trajectory
  resumes under new parameters (partial rollouts).
- `segment` (a `lax.while_loop`): one token per live row per step. A row pauses when its
  trajectory ends with a pause marker (`SegmentParams`), stops on a stop id, or is done when its
  trajectory is T tokens long. A segment ends when no row is still decoding, when the slots run
  out, or after `segment_tokens` steps.
- `feed`: every live row feeds its pending token (sampled, not yet in the cache) and tokens from
  the host, if any, at slots [index, index + W) of the existing cache, and samples its next
  token. The history is never prefilled again.

Every token is chosen by `rljax.rollout.decode.choose`, as in the sampler: the k-th choice of a
call (counted over segments and feeds, `SegmentState.count`) is drawn with key fold_in(rng, k).
Feeding a row nothing but its pending token gives it exactly the token the next decode step
would, so the schedule of pieces does not change any row's distribution.

The rows' cache is a timeline they share: a decode step takes one slot of every row and a feed
takes W; slots a row does not use (it was paused or done, or what it was fed was shorter than W)
are masked. Positions count only a row's real tokens, so a trajectory's tokens see the same
positions and the same keys and values as the learner's teacher-forced forward over
[prompt, trajectory].
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from rljax.models.cache import DecodeCache, PrefixCache
from rljax.models.config import ModelConfig
from rljax.rollout.decode import CachedModel, DecodeState, Draw, choose, isin, pad_token_id
from rljax.rollout.draw import SamplingParams

FEED_BUCKET = 16          # feed and history widths are rounded up to a multiple of this (fewer compiled shapes)


@dataclasses.dataclass(frozen=True)
class SegmentParams:
  """How segments run and when a row pauses. Frozen: a static argument of the compiled pieces.

  segment_tokens: decode steps per segment (the most a paused row waits for others).
  end_ids: token-id sequences; a row pauses when its trajectory ends with one of them (a tool
    call's end marker, in each of its tokenizations).
  fence_ids: for markers that open and close a block alike (``` for python): the ids of every
    token whose text contains the fence. A row then pauses on the token that closes a fence
    pair, however the fences were merged with their neighbours ("```python", "\\n```").
  Without end_ids and fence_ids no row ever pauses (partial rollouts).
  """
  segment_tokens: int = 64
  end_ids: tuple[tuple[int, ...], ...] = ()
  fence_ids: tuple[int, ...] = ()


@struct.dataclass
class SegmentState(DecodeState):
  """B trajectories ([B, T] `DecodeState` fields: `mask` marks the sampled tokens), the segment
  bookkeeping and the caches.

  fed: [B, T] bool, tokens fed in from the host (tool responses): context the model reads, not
    trained on.
  n: [B] int32, trajectory lengths (the column of the next token).
  paused: [B] bool, the row hit a pause marker and waits for the host.
  fences: [B] int32, fences seen (`SegmentParams.fence_ids`).
  count: [] int32, choices made; the k-th is drawn with key fold_in(rng, k).
  cache: the rows' own caches (`DecodeCache`), None before `start` / `restart`.
  pos: [B] int32, each row's next position (None before `start` / `restart`).
  prefix: the prompt cache that the G rows of each prompt read, never copy; None once `restart`
    put each row's history into its own cache.
  """
  fed: jax.Array
  n: jax.Array
  paused: jax.Array
  fences: jax.Array
  count: jax.Array
  cache: Any = None
  pos: Any = None
  prefix: Any = None

  @property
  def context_mask(self) -> jax.Array:
    """[B, T] bool, every trajectory token (sampled and fed)."""
    return self.mask | self.fed

  @classmethod
  def init(cls, config: ModelConfig, b: int, width: int) -> "SegmentState":
    """B empty trajectories of `width` columns, without caches (`start` or `restart` adds them).
    A caller resuming trajectories replaces tokens / mask / logprobs / entropy / n / done /
    stopped, then calls `restart`."""
    return cls.empty(b, width, pad_token_id(config), fed=jnp.zeros((b, width), bool), n=jnp.zeros((b,), jnp.int32),
                     paused=jnp.zeros((b,), bool), fences=jnp.zeros((b,), jnp.int32),
                     count=jnp.zeros((), jnp.int32))


def _suffix_match(buf, n, variants):
  """[B] whether a row's trajectory buf[:n] ends with any of the token sequences `variants`."""
  t = buf.shape[1]
  hit = jnp.zeros(buf.shape[:1], bool)
  for ids in variants:
    idx = n[:, None] - len(ids) + jnp.arange(len(ids))[None, :]
    vals = jnp.take_along_axis(buf, jnp.clip(idx, 0, t - 1), axis=1)
    hit = hit | jnp.all((idx >= 0) & (vals == jnp.asarray(ids, jnp.int32)[None, :]), axis=1)
  return hit


def choose_next(config: ModelConfig, sp: SamplingParams, seg: SegmentParams, stop_ids, state: SegmentState, logits,
                live, rng, draw: Draw | None = None) -> SegmentState:
  """`rljax.rollout.decode.choose` for the `live` rows at their trajectory ends, with key
  fold_in(rng, state.count), then the segment flags: a row pauses on a pause marker and is done
  when its trajectory is full."""
  t_max = state.tokens.shape[1]
  before = state.stopped
  key = jax.random.fold_in(rng, state.count)
  state, tok = choose(state, logits, state.n, sp, key, stop_ids, pad_token_id(config), live=live, draw=draw)
  stop = state.stopped & ~before
  n = state.n + live
  fences = state.fences
  if seg.fence_ids:
    fence = live & isin(tok, seg.fence_ids)
    fences = fences + fence
    end = fence & (fences % 2 == 0)
  elif seg.end_ids:
    end = live & _suffix_match(state.tokens, n, seg.end_ids)
  else:
    end = jnp.zeros_like(live)
  full = live & (n >= t_max)
  return state.replace(n=n, count=state.count + 1, done=state.done | full, paused=state.paused | (end & ~stop & ~full),
                       fences=fences)


_STATIC = ("config", "sp", "seg", "stop_ids", "draw")


@functools.partial(jax.jit, static_argnames=_STATIC + ("slots",))
def start(config: ModelConfig, sp: SamplingParams, seg: SegmentParams, stop_ids, params, prompt_ids, prompt_mask, rng,
          slots: int, draw: Draw | None = None) -> SegmentState:
  """Prefills P prompts [P, Lp] once, shares each prompt's cache with its G rows, gives every row
  a cache of `slots` slots and samples its first token. Returns the state of B = P * G rows."""
  g = sp.num_samples
  fan = lambda x: jnp.repeat(x, g, axis=0, total_repeat_length=x.shape[0] * g)
  cache, logits = CachedModel(config, params).prefill(prompt_ids, prompt_mask, prompt_ids.shape[1])
  b = prompt_ids.shape[0] * g
  pos = fan(jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32))
  live = pos > 0
  state = SegmentState.init(config, b, sp.max_new_tokens).replace(
      cache=DecodeCache.init(config, b, slots), pos=pos, prefix=PrefixCache.from_kv(cache), done=~live)
  return choose_next(config, sp, seg, stop_ids, state, fan(logits), live, rng, draw)


@functools.partial(jax.jit, static_argnames=_STATIC + ("slots",))
def restart(config: ModelConfig, sp: SamplingParams, seg: SegmentParams, stop_ids, params, state: SegmentState, rng,
            history, history_mask, slots: int, draw: Draw | None = None) -> SegmentState:
  """Prefills every row's history [B, Lh] (prompt and trajectory so far, left-padded, mask
  [B, Lh]) into a fresh cache of Lh + `slots` slots of its own; every live row samples its next
  token from the prefill's logits. The trajectories in `state` are kept."""
  cache, logits = CachedModel(config, params).prefill(history, history_mask, history.shape[1] + slots)
  live = ~state.done
  state = state.replace(cache=DecodeCache.from_kv(cache), pos=jnp.sum(history_mask, axis=-1, dtype=jnp.int32),
                        paused=jnp.zeros_like(live), prefix=None)
  return choose_next(config, sp, seg, stop_ids, state, logits, live, rng, draw)


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def segment(config: ModelConfig, sp: SamplingParams, seg: SegmentParams, stop_ids, params, state: SegmentState, rng,
            draw: Draw | None = None) -> SegmentState:
  """Decodes at most seg.segment_tokens steps, until no row is live and unpaused or slots run out."""
  model = CachedModel(config, params)
  slots = state.cache.slots
  decoding = lambda s: ~s.done & ~s.paused

  def cond(carry):
    step, s = carry
    return (step < seg.segment_tokens) & jnp.any(decoding(s)) & (s.cache.index < slots)

  def body(carry):
    step, s = carry
    live = decoding(s)
    pending = jnp.take_along_axis(s.tokens, jnp.maximum(s.n - 1, 0)[:, None], axis=1)[:, 0]
    logits, cache, _ = model.step(pending, s.pos, live, s.cache, s.prefix)
    s = s.replace(cache=cache, pos=s.pos + live)
    return step + 1, choose_next(config, sp, seg, stop_ids, s, logits, live, rng, draw)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


@functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state",))
def feed(config: ModelConfig, sp: SamplingParams, seg: SegmentParams, stop_ids, params, state: SegmentState, rng,
         tokens, lengths, finish, draw: Draw | None = None) -> SegmentState:
  """Feeds every live row its pending token and the host's tokens, then samples its next token.

  tokens: [B, W] int32, row b = [pending_b, fed_b..., pad]; lengths: [B] int32, tokens fed
  (1 + the host's; 0 for rows not live); finish: [B] bool, rows the host ends (e.g. a turn
  limit). The host's tokens are appended to the trajectories as fed (context) tokens.
  """
  model = CachedModel(config, params)
  b, w = tokens.shape
  t_max = state.tokens.shape[1]
  done = state.done | finish
  feeding = ~done & (lengths > 0)
  lengths = jnp.where(feeding, lengths, 0)
  # Fed tokens (columns 1..) go into the trajectory after the pending token.
  n = state.n
  resp = jnp.arange(1, w)[None, :] < lengths[:, None]                # [B, W-1]
  cols = jnp.where(resp, n[:, None] + jnp.arange(w - 1)[None, :], t_max)
  rows = jnp.arange(b)[:, None]
  tok = state.tokens.at[rows, cols].set(tokens[:, 1:], mode="drop")
  fed = state.fed.at[rows, cols].set(True, mode="drop")
  n = n + jnp.maximum(lengths - 1, 0)
  mask = jnp.arange(w)[None, :] < lengths[:, None]
  positions = state.pos[:, None] + jnp.arange(w)[None, :]
  hidden, cache, _ = model.forward(tokens, positions, mask, state.cache, state.prefix)
  last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  logits = model.logits(last)
  full = feeding & (n >= t_max)
  state = state.replace(tokens=tok, fed=fed, n=n, cache=cache, pos=state.pos + lengths, done=done | full,
                        paused=jnp.zeros_like(done))
  return choose_next(config, sp, seg, stop_ids, state, logits, feeding & ~full, rng, draw)

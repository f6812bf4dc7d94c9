"""Continuous batching in the single-turn sampler: a fixed number of decode slots, refilled in graph.

Shapes: B = P * G rows (samples, prompt-major), S decode slots, T = max_new_tokens, V vocab,
D blocks (the batch shards: rows, prompts and slots are each cut into D equal blocks, block d
on the devices of batch shard d), Bl = B / D rows, Sl = S / D slots per block.

`decode` runs the sampler's decode loop with S < B slots instead of one per row. Each slot runs
one row at a time; when the row stops (a stop id, or T tokens), the slot takes the next pending
row of its block: the row's first token was already drawn from its prompt's prefill, so the
refill is bookkeeping, not a prefill: the slot's completion cache is reset (its slot mask
cleared, its write slot set to 0), its position set to the prompt's length, and the slot
pointed at the row's prompt in the shared prompt cache (`PrefixCache.point`). Everything is a
masked update of static shapes inside the `while_loop`; no row leaves its block, so on a mesh
each device refills from its own rows and nothing crosses devices per refill. The loop ends when
every row is done. The KV cache holds S rows, not B, and each decode step computes S rows.

Exact: a row's token t is drawn from the same logits (its prompt, its tokens so far, its
positions) and the same noise as in the fixed-shape loop, whatever slot runs it and whenever:
the noise is keyed by the row's id and the token index (`rljax.rollout.draw.row_gumbel`: the
key fold_in(rng, t) at the row's own counters), which is bit for bit what the fixed-shape loop
draws for that row. Only the summation order of the attention over the prompt (a gather per row
instead of one matmul per prompt group) differs, in the last bits of the logits.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.models.cache import DecodeCache, PrefixCache
from rljax.rollout.decode import CachedModel, DecodeState, isin
from rljax.rollout.draw import SamplingParams, sample_logits


def decode_slots(sp: SamplingParams, rows: int) -> int:
  """The decode slots of a batch of `rows` rows: sp.slots when 0 < sp.slots < rows, else rows."""
  return sp.slots if 0 < sp.slots < rows else rows


def batch_blocks(mesh: jax.sharding.Mesh | None, rows: int, rules=shd.DEFAULT_RULES) -> int:
  """How many shards the batch axis of `rows` rows is split into on `mesh` (1 without a mesh)."""
  if mesh is None:
    return 1
  axes = shd.logical_to_spec(("batch",), (rows,), mesh, rules)[0]
  if axes is None:
    return 1
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def check_blocks(slots: int, prompts: int, rows: int, blocks: int) -> None:
  """Slots and prompts must split like the rows (each block holds whole prompt groups and its own
  slots); ConfigError naming the fields otherwise."""
  if slots % blocks or prompts % blocks:
    raise ConfigError(
        f"sampling.slots={slots} with {prompts} prompts x {rows // prompts} samples: the rows are split over "
        f"{blocks} batch shards (the mesh's data x fsdp axes) and each shard refills its own slots from its own "
        f"prompts, so sampling.slots and the prompts per step (train.prompts_per_step, times train.oversample "
        f"with dynamic sampling) must both be divisible by {blocks}.")


@struct.dataclass
class Slots:
  """The decode slots, [D, Sl] per block.

  row: int32, the block-local row the slot runs. t: int32, the column of the slot's next token.
  tok: int32, the slot's pending token (chosen, not yet fed to the model). live: bool, the slot
  runs a row. next: [D] int32, the block's next pending row, as a position in `order`.
  """
  row: jax.Array
  t: jax.Array
  tok: jax.Array
  live: jax.Array
  next: jax.Array


def decode(model: CachedModel, state: DecodeState, prefix: PrefixCache, prompt_len: jax.Array, rng: jax.Array,
           sp: SamplingParams, stop_ids: tuple[int, ...], pad_id: int, slots: int, blocks: int, ends: tuple[int, ...],
           constrain=lambda x, logical: x, vocab=None, routes=None
           ) -> tuple[DecodeState, jax.Array, jax.Array | None]:
  """Decodes every row of `state` through `slots` decode slots (module doc).

  state: [B, T] after the first token of every row was chosen (column 0, from the prefill's
  logits, with key fold_in(rng, 0)); rows already done there take no slot. prefix: the prompt
  cache [P, ...]; prompt_len: [B] int32, each row's prompt length. ends: the cache stages
  (`rljax.rollout.sampler.stage_ends`). constrain: sharding constraints, as in `sample`. vocab: the
  logits' split over the vocabulary (`rljax.rollout.draw.vocab_shards`), drawn where they lie.
  routes: None, or [B, T, L_moe, k] expert ids (mixture of experts, routing replay): the step
  that feeds a row's token t - 1 writes its experts there.
  Returns the state with every row decoded, decode_step [B] int32: the decode step (1-based)
  that chose the row's last token (0 for rows done at their first token), and the routes.
  """
  b, t_new = state.tokens.shape
  p = prefix.mask.shape[0]
  g, bl, sl = b // p, b // blocks, slots // blocks
  blk = lambda x: constrain(x.reshape((blocks, -1) + x.shape[1:]), ("batch",) + (None,) * x.ndim)
  flat = lambda x: constrain(x.reshape((-1,) + x.shape[2:]), ("batch",) + (None,) * (x.ndim - 2))
  take = jax.vmap(lambda x, i: x[i])                     # [D, Bl, ...] at [D, Sl] -> [D, Sl, ...]
  offset = (jnp.arange(blocks, dtype=jnp.int32) * bl)[:, None]

  # The block's rows to decode, in row order; rows done at their first token are skipped.
  waiting = blk(~state.done) if t_new > 1 else blk(jnp.zeros((b,), bool))
  order = jnp.argsort(~waiting, axis=1, stable=True).astype(jnp.int32)    # [D, Bl]
  pending = jnp.sum(waiting, axis=1, dtype=jnp.int32)                     # [D]
  first = blk(state.tokens[:, 0])
  live = jnp.arange(sl)[None, :] < pending[:, None]
  row = order[:, :sl]
  slot = Slots(row=row, t=jnp.ones_like(row), tok=take(first, row), live=live, next=jnp.minimum(sl, pending))
  plen = blk(prompt_len)

  def put(buf, values, s: Slots, where, column=None):
    """buf [B] or [B, T, ...] with values [S, ...] written at each slot's row (and column, default
    its next token's) where `where` [D, Sl]."""
    r = jnp.where(where, s.row, bl)   # out of range: dropped
    if buf.ndim == 1:
      out = jax.vmap(lambda x, i, v: x.at[i].set(v, mode="drop"))(blk(buf), r, blk(values))
    else:
      col = s.t if column is None else column
      out = jax.vmap(lambda x, i, c, v: x.at[i, c].set(v, mode="drop"))(blk(buf), r, col, blk(values))
    return flat(out)

  def cond(carry):
    furthest = jnp.max(jnp.where(carry[1].live, carry[1].t, 0))   # 0: no slot is live
    return (furthest > 0) & (furthest < end)

  def body(carry):
    k, s, cache, state, finish, routes = carry
    live = flat(s.live)
    pointed = prefix.point(flat(s.row // g), blocks)
    logits, cache, step_routes = model.step(flat(s.tok), flat(take(plen, s.row) + s.t - 1), live, cache, pointed)
    if routes is not None:   # the experts of the token just fed, column t - 1
      routes = put(routes, step_routes.astype(routes.dtype), s, s.live, s.t - 1)
    keys = jax.vmap(lambda t: jax.random.fold_in(rng, t))(flat(s.t))
    logits = constrain(logits, ("batch", None if vocab is None else "vocab"))
    tok, lp, ent = sample_logits(logits, sp, keys, rows=flat(s.row + offset), vocab=vocab)
    tok = jnp.where(live, tok, pad_id)
    hit = live & isin(tok, stop_ids)
    done = hit | (live & (flat(s.t) >= t_new - 1))
    state = state.replace(tokens=put(state.tokens, tok, s, s.live), mask=put(state.mask, live, s, s.live),
                          logprobs=put(state.logprobs, lp, s, s.live), entropy=put(state.entropy, ent, s, s.live),
                          done=put(state.done, done, s, s.live), stopped=put(state.stopped, hit, s, s.live))
    finish = put(finish, jnp.full((slots,), k, jnp.int32), s, blk(done))
    # Refill: the block's finished slots, in slot order, take its next pending rows.
    freed = blk(done)
    cand = s.next[:, None] + jnp.cumsum(freed, axis=1, dtype=jnp.int32) - 1
    ok = freed & (cand < pending[:, None])
    new_row = jnp.take_along_axis(order, jnp.minimum(cand, bl - 1), axis=1)
    row = jnp.where(ok, new_row, s.row)
    t = jnp.where(ok, 1, s.t + 1)
    s = Slots(row=row, t=t, tok=jnp.where(ok, take(first, new_row), blk(tok)), live=(s.live & ~freed) | ok,
              next=jnp.minimum(s.next + jnp.sum(freed, axis=1, dtype=jnp.int32), pending))
    reset = flat(ok)
    cache = DecodeCache(cache.layers, cache.mask & ~reset[:, None], flat(t) - 1).constrain(constrain)
    return k + 1, s, cache, state, finish, routes

  cache = DecodeCache.init(model.config, slots, ends[0])
  cache = cache.replace(index=jnp.zeros((slots,), jnp.int32)).constrain(constrain)
  carry = (jnp.int32(1), slot, cache, state, jnp.zeros((b,), jnp.int32), routes)
  for i, end in enumerate(ends):
    if i:   # grow the completion caches to this stage's slots (a copy per stage, not per step)
      k, s, cache, state, finish, routes = carry
      carry = (k, s, cache.grow(end - ends[i - 1]).constrain(constrain), state, finish, routes)
    carry = jax.lax.while_loop(cond, body, carry)
  return carry[3], carry[4], carry[5]

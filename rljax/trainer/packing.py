"""Packed learner batches: the update computes the rollout's real tokens, not its padding.

A row of the update is `[prompt | completion]`, Lp + T wide, and mostly padding when completions
are short (the benchmark's completions average 32-43 of 128 tokens). Packing lays the rows' real
tokens (the prompt's, then the completion's context tokens) end to end in bins of
W = Lp + T tokens, so any one sequence fits a bin: segment ids keep each sequence's attention to
itself and positions restart per sequence, so a packed forward computes exactly what the padded
one does. The update then runs its micro-batches over R bins at a time (`train.pack_tokens` = R x W
tokens), as many as the real tokens need: a `fori_loop` with a data-dependent trip count over
fixed-shape blocks, so the compiled program is one block's forward + backward whatever the
lengths.

Bins are filled first-fit decreasing (`first_fit_decreasing`): longest sequence first, each into
the lowest-numbered bin with room, so a sequence is never split and short ones fill the gaps long
ones leave (next-fit in row order, the earlier rule, left every gap a row did not fit; FFD needs at
most 11/9 of the fewest possible bins, plus one). A block's rows need not be adjacent rows.
Per-token inputs of the loss stay in row layout [N, T]; the packed log-probs are gathered back to
it, and `policy_loss` sees the rows of the current block (the others masked out), so every
aggregation mode and metric is the padded computation's.

Shapes: N rows, Lp prompt width, T completion width, W = Lp + T, R bins per block.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PackLayout:
  """Where each row's sequence sits in the packed bins.

  start: [N] int32 flat index (bin * W + offset) of the row's first real token.
  prompt_len: [N] int32 real prompt tokens; block: [N] int32 block (bins // R) holding the row.
  num_blocks: [] int32 blocks that hold any row. tokens, segment_ids, positions: [N, W] int32
  packed bins (segment id = row + 1, 0 on unused slots); at most N bins are ever needed.
  """
  start: jax.Array
  prompt_len: jax.Array
  block: jax.Array
  num_blocks: jax.Array
  tokens: jax.Array
  segment_ids: jax.Array
  positions: jax.Array


def first_fit_decreasing(seq_len: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  """Places sequences of `seq_len` [N] int32 tokens (each <= width) in bins of `width`: longest
  first (ties in row order), each into the lowest-numbered bin it fits. Bins are opened in order, so
  the used ones are 0 .. num_bins - 1. Returns (start [N] int32: bin * width + offset of each
  row's first token, num_bins [] int32)."""
  n = seq_len.shape[0]
  order = jnp.argsort(-seq_len, stable=True)

  def place(used, row):
    length = seq_len[row]
    b = jnp.argmax(used + length <= width)   # the first bin with room; an empty one always exists
    return used.at[b].add(length), b * width + used[b]

  used, start_sorted = jax.lax.scan(place, jnp.zeros((n,), jnp.int32), order)
  start = jnp.zeros((n,), jnp.int32).at[order].set(start_sorted)
  return start, jnp.sum(used > 0).astype(jnp.int32)


def pack(prompt_ids, prompt_mask, tokens, context_mask, bins_per_block: int) -> PackLayout:
  """Packs rows into bins of W = Lp + T tokens.

  prompt_ids, prompt_mask: [N, Lp]; tokens, context_mask: [N, T]. A row's real tokens are its
  masked prompt tokens followed by its first `context_mask.sum()` completion tokens (context
  tokens are a prefix of the completion: generation and tool responses stop at the same place).
  """
  n, lp_w = prompt_ids.shape
  width = lp_w + tokens.shape[1]
  plen = prompt_mask.sum(-1).astype(jnp.int32)
  seq_len = plen + context_mask.sum(-1).astype(jnp.int32)

  start, num_bins = first_fit_decreasing(seq_len, width)
  block = (start // width) // bins_per_block

  seq = jnp.concatenate([prompt_ids, tokens], axis=1)
  real = jnp.concatenate([prompt_mask, jnp.arange(tokens.shape[1])[None, :] < (seq_len - plen)[:, None]], axis=1)
  index_in_seq = jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1                     # [N, W]
  target = jnp.where(real, start[:, None] + index_in_seq, n * width)               # n * width: dropped
  scatter = lambda values: jnp.zeros((n * width,), jnp.int32).at[target.reshape(-1)].set(
      values.reshape(-1).astype(jnp.int32), mode="drop").reshape(n, width)
  rows = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], seq.shape)
  num_blocks = jnp.maximum(num_bins - 1, 0) // bins_per_block + 1
  return PackLayout(start=start, prompt_len=plen, block=block, num_blocks=num_blocks,
                    tokens=scatter(seq), segment_ids=scatter(rows), positions=scatter(index_in_seq))


def block_inputs(layout: PackLayout, k, bins_per_block: int):
  """Block k's packed tokens, segment ids and positions: [R, W] each."""
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, k * bins_per_block, bins_per_block, axis=0)
  return take(layout.tokens), take(layout.segment_ids), take(layout.positions)


def pack_values(layout: PackLayout, prompt_mask, context_mask, values: jax.Array, fill) -> jax.Array:
  """Per-token values of the rows' [prompt | completion] ([N, W, ...], e.g. the experts to replay)
  laid out like `layout.tokens`: [N, W, ...], `fill` on unused slots."""
  n, width = values.shape[:2]
  plen = prompt_mask.sum(-1).astype(jnp.int32)
  seq_len = plen + context_mask.sum(-1).astype(jnp.int32)
  t = context_mask.shape[1]
  real = jnp.concatenate([prompt_mask, jnp.arange(t)[None, :] < (seq_len - plen)[:, None]], axis=1)
  index_in_seq = jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1
  target = jnp.where(real, layout.start[:, None] + index_in_seq, n * width).reshape(-1)
  rest = values.shape[2:]
  out = jnp.full((n * width,) + rest, fill, values.dtype)
  return out.at[target].set(values.reshape((-1,) + rest), mode="drop").reshape((n, width) + rest)


def block_values(packed: jax.Array, k, bins_per_block: int) -> jax.Array:
  """Block k's rows of packed values ([N, W, ...] -> [R, W, ...]), as `block_inputs`."""
  return jax.lax.dynamic_slice_in_dim(packed, k * bins_per_block, bins_per_block, axis=0)


def gather_completion(packed: jax.Array, layout: PackLayout, k, bins_per_block: int, t: int) -> jax.Array:
  """Block k's per-position values back in row layout.

  packed: [R, W] with packed[r, p] the value for the token after position p (log-prob of the next
  token, computed from the hidden state at p). Returns [N, T]: completion token t of row i takes
  the value at its predecessor's packed position; rows outside block k get 0.
  """
  width = packed.shape[1]
  flat = packed.reshape(-1)
  pred = layout.start[:, None] + layout.prompt_len[:, None] + jnp.arange(t)[None, :] - 1   # [N, T]
  local = pred - k * bins_per_block * width
  inside = (layout.block == k)[:, None] & (local >= 0) & (local < flat.shape[0])
  return jnp.where(inside, flat[jnp.clip(local, 0, flat.shape[0] - 1)], 0.0)

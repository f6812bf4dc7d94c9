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

Shared prefix (`pack_shared`, `train.shared_prefix`): the G completions of a prompt continue the
same prompt, so the prompt need not be computed G times. A *chunk* is one copy of the prompt
followed by as many of its group's completions as fit in W (in row order; a new chunk, with a new
copy, when the next does not fit); chunks are then packed first-fit decreasing like rows. A
completion's tokens have their own segment and see, besides themselves, the segment of their
chunk's prompt copy (`prefix_ids`; attention's shared-prefix masking) at positions continuing from
the prompt, so each completion token's hidden state is the padded forward's. Gradients reach the
prompt copy from every completion that sees it (summed, as the G padded copies' would be). Only
the first completion token differs in where it is read: from the prompt copy's last position,
which predicts G different first tokens (`PackLayout.source`). Without packing (`pack_shared` with
`fit=False`) a chunk is a whole group in a bin of Lp + G * T, and blocks are micro-batches of groups.

Shapes: N rows, Lp prompt width, T completion width, W = Lp + T, R bins per block.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PackLayout:
  """Where each row's tokens sit in the packed bins (flat index = bin * width + offset).

  first: [N] int32 flat index of the row's first completion token (completion token j at first + j).
  source: [N] int32 flat index of the token whose hidden state predicts that first token (the last
    token of the prompt copy the row continues).
  block: [N] int32 block (bins // R) holding the row. num_blocks: [] int32 blocks that hold any row.
  tokens, segment_ids, positions: [bins, width] int32 packed tokens (segment id 0 on unused slots).
  prefix_ids: [bins, width] int32, the prompt-copy segment each token also sees (shared-prefix
    layouts), or None (each row carries its own prompt).
  owns_prompt: [N] bool, the row's prompt tokens are placed (at source - plen + 1); in a shared
    layout only one row per chunk, the chunk's first.
  """
  first: jax.Array
  source: jax.Array
  block: jax.Array
  num_blocks: jax.Array
  tokens: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  owns_prompt: jax.Array
  prefix_ids: jax.Array | None = None

  @property
  def shared(self) -> bool:
    return self.prefix_ids is not None

  def block_inputs(self, k, bins_per_block: int):
    """Block k's packed tokens, segment ids, prefix ids (None unless shared) and positions: [R, W] each."""
    take = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, k * bins_per_block, bins_per_block, 0)
    return take(self.tokens), take(self.segment_ids), take(self.prefix_ids), take(self.positions)


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


def _real(prompt_mask, context_mask):
  """(plen [N], ctx_len [N]) int32: real prompt tokens and context (seen completion) tokens per row."""
  return prompt_mask.sum(-1).astype(jnp.int32), context_mask.sum(-1).astype(jnp.int32)


def _targets(layout_first, layout_source, owns_prompt, prompt_mask, context_mask, size: int) -> jax.Array:
  """[N, Lp + T] flat packed index of each token of the rows' [prompt | completion], `size` (dropped)
  for padding, for completion tokens past the context and for prompts a row does not own."""
  plen, ctx = _real(prompt_mask, context_mask)
  t = context_mask.shape[1]
  index_in_prompt = jnp.cumsum(prompt_mask, axis=1, dtype=jnp.int32) - 1                       # [N, Lp]
  prompt_start = layout_source - plen + 1
  at_prompt = jnp.where(prompt_mask & owns_prompt[:, None], prompt_start[:, None] + index_in_prompt, size)
  j = jnp.arange(t, dtype=jnp.int32)[None, :]
  at_completion = jnp.where(j < ctx[:, None], layout_first[:, None] + j, size)
  return jnp.concatenate([at_prompt, at_completion], axis=1)


def _scatter(target, values, size: int, width: int, fill=0):
  """values [N, Lp + T, ...] placed at flat `target` [N, Lp + T]: [size // width, width, ...]."""
  rest = values.shape[2:]
  out = jnp.full((size,) + rest, fill, values.dtype)
  out = out.at[target.reshape(-1)].set(values.reshape((-1,) + rest), mode="drop")
  return out.reshape((size // width, width) + rest)


def _layout(prompt_ids, prompt_mask, tokens, context_mask, *, first, source, owns_prompt, chunk_start, num_bins,
            width: int, bins: int, bins_per_block: int, prefix_segment=None) -> PackLayout:
  """The packed arrays of a placement (first, source, owns_prompt [N]; chunk_start [N]: the flat start
  of the bin region holding the row, for its block). prefix_segment: [N] segment id of the prompt copy
  each row continues (shared layouts), or None (the row's own segment holds its prompt)."""
  n = prompt_ids.shape[0]
  plen, _ = _real(prompt_mask, context_mask)
  size = bins * width
  target = _targets(first, source, owns_prompt, prompt_mask, context_mask, size)
  seq = jnp.concatenate([prompt_ids, tokens], axis=1)
  lp_w = prompt_ids.shape[1]
  index_in_prompt = jnp.cumsum(prompt_mask, axis=1, dtype=jnp.int32) - 1
  positions = jnp.concatenate(
      [index_in_prompt, plen[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]], axis=1)
  row_seg = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], seq.shape)
  prefix_ids = None
  if prefix_segment is None:
    segments = row_seg
  else:
    in_prompt = jnp.arange(seq.shape[1])[None, :] < lp_w
    segments = jnp.where(in_prompt, prefix_segment[:, None], row_seg)
    prefix_ids = _scatter(target, jnp.broadcast_to(prefix_segment[:, None], seq.shape), size, width)
  block = (chunk_start // width) // bins_per_block
  return PackLayout(first=first, source=source, block=block,
                    num_blocks=jnp.maximum(num_bins - 1, 0) // bins_per_block + 1,
                    tokens=_scatter(target, seq.astype(jnp.int32), size, width),
                    segment_ids=_scatter(target, segments, size, width),
                    positions=_scatter(target, positions, size, width), owns_prompt=owns_prompt,
                    prefix_ids=prefix_ids)


def pack(prompt_ids, prompt_mask, tokens, context_mask, bins_per_block: int, width: int | None = None) -> PackLayout:
  """Packs rows into bins of `width` tokens (default W = Lp + T; at least that), each row with its own prompt.

  prompt_ids, prompt_mask: [N, Lp]; tokens, context_mask: [N, T]. A row's real tokens are its
  masked prompt tokens followed by its first `context_mask.sum()` completion tokens (context
  tokens are a prefix of the completion: generation and tool responses stop at the same place).
  """
  n, lp_w = prompt_ids.shape
  width = width or lp_w + tokens.shape[1]
  plen, ctx = _real(prompt_mask, context_mask)
  start, num_bins = first_fit_decreasing(plen + ctx, width)
  return _layout(prompt_ids, prompt_mask, tokens, context_mask, first=start + plen, source=start + plen - 1,
                 owns_prompt=jnp.ones((n,), bool), chunk_start=start, num_bins=num_bins, width=width, bins=n,
                 bins_per_block=bins_per_block)


def chunk_groups(ctx_len: jax.Array, prompt_len: jax.Array, group: int, width: int) -> tuple[jax.Array, jax.Array]:
  """Splits each group of `group` consecutive rows into chunks: one prompt copy, then the rows'
  completions in order while they fit in `width` (a row that does not opens a new chunk).

  ctx_len, prompt_len: [N] int32 (prompt_len equal within a group; prompt + one completion <= width).
  Returns (head [N] int32: the first row of the row's chunk, offset [N] int32: where the row's
  completion starts from its chunk's start, after the prompt and the chunk's earlier completions).
  """
  n = ctx_len.shape[0]

  def step(carry, i):
    head, used = carry
    new = (i % group == 0) | (used + ctx_len[i] > width)
    head = jnp.where(new, i, head)
    offset = jnp.where(new, prompt_len[i], used)
    return (head, offset + ctx_len[i]), (head, offset)

  _, (head, offset) = jax.lax.scan(step, (jnp.int32(0), jnp.int32(0)), jnp.arange(n, dtype=jnp.int32))
  return head, offset


def pack_shared(prompt_ids, prompt_mask, tokens, context_mask, group: int, bins_per_block: int,
                fit: bool = True, width: int | None = None) -> PackLayout:
  """Packs rows with one prompt copy per chunk of a group's completions (module docstring).

  fit=True: chunks of at most `width` tokens (default W = Lp + T; at least that), packed first-fit
  decreasing into bins of `width` (the packed update; wider bins let a copy serve more completions).
  fit=False: one chunk per group in bin p of width Lp + G * T (the unpacked update:
  `bins_per_block` groups per micro-batch).
  """
  n, lp_w = prompt_ids.shape
  t = tokens.shape[1]
  width = (width or lp_w + t) if fit else lp_w + group * t
  plen, ctx = _real(prompt_mask, context_mask)
  head, offset = chunk_groups(ctx, plen, group, width)
  rows = jnp.arange(n, dtype=jnp.int32)
  is_head = head == rows
  if fit:
    chunk_len = jnp.zeros((n,), jnp.int32).at[head].max(offset + ctx)
    start, num_bins = first_fit_decreasing(jnp.where(is_head, chunk_len, 0), width)
    bins = n
  else:
    start = (rows // group) * width
    num_bins, bins = jnp.int32(n // group), n // group
  chunk_start = start[head]
  return _layout(prompt_ids, prompt_mask, tokens, context_mask, first=chunk_start + offset,
                 source=chunk_start + plen - 1, owns_prompt=is_head, chunk_start=chunk_start, num_bins=num_bins,
                 width=width, bins=bins, bins_per_block=bins_per_block, prefix_segment=n + 1 + head)


def pack_values(layout: PackLayout, prompt_mask, context_mask, values: jax.Array, fill) -> jax.Array:
  """Per-token values of the rows' [prompt | completion] ([N, Lp + T, ...], e.g. the experts to
  replay) laid out like `layout.tokens`: [bins, width, ...], `fill` on unused slots."""
  bins, width = layout.tokens.shape
  target = _targets(layout.first, layout.source, layout.owns_prompt, prompt_mask, context_mask, bins * width)
  return _scatter(target, values, bins * width, width, fill)


def block_values(packed: jax.Array, k, bins_per_block: int) -> jax.Array:
  """Block k's rows of packed values ([bins, W, ...] -> [R, W, ...]), as `block_inputs`."""
  return jax.lax.dynamic_slice_in_dim(packed, k * bins_per_block, bins_per_block, axis=0)


def gather_completion(packed: jax.Array, layout: PackLayout, k, bins_per_block: int, t: int,
                      first_values: jax.Array | None = None) -> jax.Array:
  """Block k's per-position values back in row layout.

  packed: [R, W] with packed[r, p] the value for the token after position p (log-prob of the next
  token, computed from the hidden state at p). Returns [N, T]: completion token j > 0 of row i takes
  the value at its predecessor's packed position, token 0 `first_values` [N] (the shared layouts'
  first tokens, computed from `source`) or the value at `source`; rows outside block k get 0.
  """
  width = packed.shape[1]
  flat = packed.reshape(-1)
  base = k * bins_per_block * width
  pred = layout.first[:, None] + jnp.arange(t)[None, :] - 1                               # [N, T]
  pred = pred.at[:, 0].set(layout.source)
  local = pred - base
  inside = (layout.block == k)[:, None] & (local >= 0) & (local < flat.shape[0])
  values = flat[jnp.clip(local, 0, flat.shape[0] - 1)]
  if first_values is not None:
    values = values.at[:, 0].set(first_values)
  return jnp.where(inside, values, 0.0)


def gather_sources(hidden: jax.Array, layout: PackLayout, k, bins_per_block: int) -> jax.Array:
  """[N, D] block k's hidden states ([R, W, D]) at each row's `source` (garbage for rows outside block k)."""
  r, width, d = hidden.shape
  local = jnp.clip(layout.source - k * bins_per_block * width, 0, r * width - 1)
  return hidden.reshape(r * width, d)[local]

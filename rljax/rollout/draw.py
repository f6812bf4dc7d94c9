"""The token draw: how a row's next token is chosen from its logits, and what is recorded.

Shapes: B rows, V vocab.

- `SamplingParams`: how completions are drawn (temperature, top-k, top-p, min-p, greedy, stops).
- `sample_logits`: one token per row, and the log-prob and entropy of the un-truncated
  distribution log_softmax(logits / tau) that are recorded (docs/sampling.md). Every decode loop
  draws through it (`rljax.rollout.decode.choose`), so a row's tokens and log-probs depend on its
  logits and the step's key, not on the loop.
- `row_gumbel`: the Gumbel noise a batch draw gives one row, computed for that row alone, so a
  row's draw can be made wherever (in whichever slot, at whichever step) the row is decoded.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p
from jax.sharding import PartitionSpec as P

from rljax import sharding as shd
from rljax.errors import ConfigError

# top-p first looks for its nucleus among this many best tokens; rows whose nucleus is wider fall
# back to an exact bisection over the whole vocabulary (a full sort of V is far slower on CPU).
_TOP_P_CANDIDATES = 256
# Token draws pick a block of this many vocabulary entries first, then a token inside it.
_DRAW_BLOCK = 256


def effective_temperature(temperature: float) -> float:
  """The tau of the recorded distribution log_softmax(logits / tau) for a sampling temperature:
  the temperature itself, and 1 for temperature 0 (greedy). The learner divides by it too."""
  return 1.0 if temperature == 0 else float(temperature)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How completions are drawn. Frozen and hashable: a static argument of `jax.jit`.

  num_samples: G, completions per prompt (>= 1).
  max_new_tokens: T, the most tokens generated per completion (>= 1).
  temperature: logits are divided by it before sampling and before recording log-probs.
    0 means greedy (log-probs then recorded at temperature 1).
  top_k: sample among the k most likely tokens (0 = off).
  top_p: sample from the smallest set of most likely tokens whose probability (after top-k,
    renormalised) reaches top_p (1.0 = off).
  min_p: drop tokens whose probability is below min_p times the most likely one's (0 = off).
  greedy: take the argmax; temperature then only sets the recorded distribution.
  stop_token_ids: extra ids that end a completion, on top of the model's EOS ids.
  slots: decode slots of the single-turn sampler (continuous batching, docs/sampling.md): 0, or
    at least the batch's rows, decodes every row at once; fewer decode that many rows at a time,
    a finished row's slot starting the next pending one. The samples do not depend on it.

  Truncations apply in the order temperature, top-k, top-p, min-p (as in transformers).
  """
  num_samples: int
  max_new_tokens: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  greedy: bool = False
  stop_token_ids: tuple[int, ...] = ()
  slots: int = 0

  def __post_init__(self):
    ids = self.stop_token_ids
    if isinstance(ids, (int, np.integer)):
      ids = (ids,)
    if isinstance(ids, (list, tuple, np.ndarray)):
      object.__setattr__(self, "stop_token_ids", tuple(int(i) if is_int(i) else i for i in ids))
    self.validate()

  def validate(self) -> "SamplingParams":
    """Raises ConfigError naming the offending field and the fix; returns self."""
    for name in ("num_samples", "max_new_tokens"):
      v = getattr(self, name)
      if not is_int(v) or v < 1:
        raise ConfigError(f"SamplingParams.{name}={v!r} must be an integer >= 1.")
    t = self.temperature
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
      raise ConfigError(f"SamplingParams.temperature={t!r} must be a finite number >= 0 (0 means greedy).")
    if not is_int(self.top_k) or self.top_k < 0:
      raise ConfigError(f"SamplingParams.top_k={self.top_k!r} must be an integer >= 0 (0 disables top-k).")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f"SamplingParams.top_p={self.top_p!r} must be in (0, 1] (1.0 disables top-p).")
    if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p < 1.0:
      raise ConfigError(f"SamplingParams.min_p={self.min_p!r} must be in [0, 1) (0 disables min-p).")
    if not isinstance(self.greedy, (bool, np.bool_)):
      raise ConfigError(f"SamplingParams.greedy={self.greedy!r} must be True or False.")
    ids = self.stop_token_ids
    if not isinstance(ids, tuple) or not all(is_int(i) and i >= 0 for i in ids):
      raise ConfigError(f"SamplingParams.stop_token_ids={ids!r} must be a tuple of non-negative token ids.")
    if not is_int(self.slots) or self.slots < 0:
      raise ConfigError(f"SamplingParams.slots={self.slots!r} must be an integer >= 0 (0 = one slot per row).")
    return self

  @property
  def is_greedy(self) -> bool:
    return bool(self.greedy) or self.temperature == 0

  @property
  def logprob_temperature(self) -> float:
    """The tau of the recorded distribution log_softmax(logits / tau); the learner must use it too."""
    return effective_temperature(self.temperature)


def is_int(v) -> bool:
  """An integer that is not a bool (Python or numpy)."""
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


# ---- token draw ------------------------------------------------------------------------------


def sample_logits(logits: jax.Array, sp: SamplingParams, key: jax.Array, rows: jax.Array | None = None,
                  vocab: "VocabShards | None" = None):
  """Chooses one token per row and records its log-prob and the entropy.

  logits: [B, V] float32. key: the step's PRNG key; or, with `rows` [B] int32, one key per row
  [B]: logits row b then draws exactly what row rows[b] of a batch draw with key[b] would (its
  noise is `row_gumbel`'s), wherever it sits in this batch. Returns tokens [B] int32, logprobs
  [B] f32 and entropy [B] f32 of the un-truncated distribution log_softmax(logits /
  sp.logprob_temperature). Only the draw is restricted by top-k / top-p / min-p. The draw is
  Gumbel-max in two levels (`_gumbel_draw`): a block of the vocabulary by its kept mass, then a
  token in it, each the argmax of log-weights
  plus Gumbel(0, 1) noise from `key` (threefry is partitionable, so the noise, and the token, do
  not depend on how the batch is sharded). Unlike an inverse-CDF draw, whose boundaries sit 1/V
  apart on a flat distribution, an argmax changes under last-bit logit differences (another
  mesh, another matmul blocking) only when two perturbed scores nearly tie.

  vocab: the logits are split over the vocabulary (`vocab_shards`): each device draws from its
  own shard (`_sample_sharded`) and only per-row figures cross devices, never the [B, V] logits
  or the output projection that made them.
  """
  if vocab is not None:
    return _sample_sharded(logits, sp, key, rows, vocab)
  if rows is None:
    k_block, k_token = jax.random.split(key)
    noise = lambda k, n: jax.random.gumbel(k, (logits.shape[0], n), jnp.float32)
  else:
    k_block, k_token = jnp.moveaxis(jax.vmap(jax.random.split)(key), 1, 0)
    noise = lambda k, n: row_gumbel(k, rows, n)
  ops = _Vocab(logits.shape[-1])
  return _sample(logits, sp, ops, lambda lw, w: _gumbel_draw(lw, w, lambda n: noise(k_block, n),
                                                               lambda n: noise(k_token, n)))


def _sample(logits, sp: SamplingParams, ops: "_Vocab", draw):
  """`sample_logits` over a whole vocabulary or one shard of it: every reduction over V goes through
  `ops`, so the figures are those of the whole vocabulary. draw(log_weights, weights) -> tokens."""
  logits = logits.astype(jnp.float32)
  scaled = logits / sp.logprob_temperature if sp.logprob_temperature != 1.0 else logits
  top = ops.max(scaled)[:, None]
  shifted = scaled - top
  weights = jnp.exp(shifted)  # unnormalised probabilities, also the sampling weights
  z = ops.sum(weights)
  log_z = jnp.log(z)
  # -sum p log p with log p = shifted - log z; both terms are >= 0, so no cancellation. When no draw
  # reads the weights (greedy), the sum recomputes them from a materialised `shifted`: XLA:CPU does
  # not fuse one [B, V] exp into two reductions, and sharing it made the greedy draw 5x slower
  # (B = 128, V = 49152: 35 ms, a fifth of a SmolLM2 decode step, against 7 ms this way).
  if sp.is_greedy:
    again = jax.lax.optimization_barrier(shifted)
    entropy = log_z - ops.sum(jnp.exp(again) * again) / z
    tokens = ops.argmax(logits)
  else:
    entropy = log_z - ops.sum(weights * shifted) / z
    threshold = _truncation_threshold(scaled, shifted, log_z, sp, ops)
    if threshold is not None:
      keep = scaled >= threshold[:, None]
      shifted_kept, weights = jnp.where(keep, shifted, -jnp.inf), jnp.where(keep, weights, 0.0)
    else:
      shifted_kept = shifted
    tokens = draw(shifted_kept, weights)
  return tokens, ops.take(shifted, tokens) - log_z, entropy


class _Vocab:
  """Reductions over the vocabulary of [B, V] rows (the whole vocabulary on this device)."""

  def __init__(self, size: int):
    self.size = size   # V, the whole vocabulary

  def max(self, x):
    return jnp.max(x, axis=-1)

  def min(self, x):
    return jnp.min(x, axis=-1)

  def sum(self, x):
    return jnp.sum(x, axis=-1)

  def top_k(self, x, k: int):
    """[B, k] the k largest values, descending. Behind an optimisation barrier: without it
    XLA:CPU turns the top-k that feeds the nucleus arithmetic into a full sort of the row (0.97 s
    against 0.02 s for 128 x 49152)."""
    return jax.lax.optimization_barrier(jax.lax.top_k(x, k)[0])

  def argmax(self, x):
    return first_argmax(x)

  def take(self, x, tokens):
    """x[b, tokens[b]]."""
    return jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]

  def all(self, pred):
    """Whether `pred` holds for every row (of every device that runs this draw)."""
    return jnp.all(pred)


def first_argmax(x, block: int = _DRAW_BLOCK):
  """[B] int32: the first index of each row's maximum of x [B, N], as `jnp.argmax(x, -1)` (a row
  with NaN: unspecified), found in two levels: the first block of `block` columns holding the
  row's maximum, then the first maximum inside it. XLA:CPU's argmax over a long row is a scalar
  loop (14 ms for 128 x 49152, against 0.5 ms this way); a max over blocks is vectorised."""
  b, n = x.shape
  if n <= 2 * block:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  nb = -(-n // block)
  blocks = jnp.pad(x, ((0, 0), (0, nb * block - n)), constant_values=-jnp.inf).reshape(b, nb, block)
  j = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
  inner = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]          # [B, block]
  return (j * block + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def _gumbel_draw(log_weights, weights, block_noise, token_noise):
  """[B] token ids drawn with probability proportional to `weights` [B, V] (= exp(log_weights)).
  block_noise(n), token_noise(n): [B, n] Gumbel noise of the two levels (see `sample_logits`).

  Two Gumbel-max draws: a block of _DRAW_BLOCK tokens by its total weight, then a token inside
  it. That is exactly the categorical distribution (P(block) * P(token | block) = w / sum w) with
  B * (V / _DRAW_BLOCK + _DRAW_BLOCK) noise samples instead of B * V: the noise was the largest
  single cost of a decode step on CPU (34 of 245 ms for SmolLM2, B = 64, V = 49152).
  """
  b, v = log_weights.shape
  block = _DRAW_BLOCK
  if v <= 2 * block:
    return jnp.argmax(log_weights + token_noise(v), axis=-1).astype(jnp.int32)
  nb = -(-v // block)
  pad = ((0, 0), (0, nb * block - v))
  log_weights = jnp.pad(log_weights, pad, constant_values=-jnp.inf).reshape(b, nb, block)
  mass = jnp.pad(weights, pad).reshape(b, nb, block).sum(-1)                 # [B, nb]
  j = jnp.argmax(jnp.log(mass) + block_noise(nb), axis=-1)
  inner = jnp.take_along_axis(log_weights, j[:, None, None], axis=1)[:, 0]   # [B, block]
  i = jnp.argmax(inner + token_noise(block), axis=-1)
  return (j * block + i).astype(jnp.int32)


# ---- the draw over vocabulary shards ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VocabShards:
  """Logits [B, V] split over the vocabulary on mesh axis `axis` (V / n columns per device) and
  by rows over `rows` (a PartitionSpec entry: None, an axis or a tuple of axes)."""
  mesh: Any
  rows: Any
  axis: str

  @property
  def spec(self) -> P:
    return P(self.rows, self.axis)


def vocab_shards(mesh, rules, shape) -> VocabShards | None:
  """How logits of `shape` [B, V] are split by the logical axes ("batch", "vocab") under `rules`
  on `mesh`, or None when the vocabulary is not split (no mesh, or V not divisible)."""
  if mesh is None:
    return None
  spec = shd.logical_to_spec(("batch", "vocab"), shape, mesh, rules)
  axis = spec[1]
  if isinstance(axis, tuple):
    if len(axis) != 1:
      return None
    axis = axis[0]
  return None if axis is None else VocabShards(mesh, spec[0], axis)


def _sample_sharded(logits, sp: SamplingParams, key, rows, vocab: VocabShards):
  """`sample_logits` with the vocabulary split over `vocab.axis`, as one `shard_map`.

  Each device holds [B_local, V / n] logits. The max, the partition function, the entropy and the
  truncation thresholds combine per-shard figures ([B] or [B, k] per row, psum / pmax / top-k of
  the shards' top-k); the draw is the two-level Gumbel draw of the whole vocabulary with the same
  noise (`row_gumbel` at the rows' global indices): the blocks' masses are summed where they lie
  (a [B, V / 256] psum) and the chosen block's 256 log-weights are combined by a pmax (each entry
  lies on one device). So the token is the one the unsplit draw picks from the same logits, but
  for a block that straddles two shards (V / n not a multiple of 256), whose mass is summed in two
  parts (last-bit differences); log-probs and entropy differ from the unsplit ones in the last bits
  (their sums run in another order).
  """
  b, v = logits.shape
  if rows is None:
    k_block, k_token = jax.random.split(key)
    keys = [jnp.broadcast_to(_key_bits(k), (b, 2)) for k in (k_block, k_token)]
    rows = jnp.arange(b, dtype=jnp.int32)
  else:
    k_block, k_token = jnp.moveaxis(jax.vmap(jax.random.split)(key), 1, 0)
    keys = [_key_bits(k) for k in (k_block, k_token)]
  row_spec = P(vocab.rows)
  all_axes = tuple(vocab.mesh.axis_names)

  def shard(logits, kb, kt, rows):
    ops = _ShardedVocab(v, vocab.axis, logits.shape[1], all_axes)
    draw = lambda lw, w: _gumbel_draw_sharded(lw, w, lambda n_: row_gumbel(kb, rows, n_),
                                               lambda n_: row_gumbel(kt, rows, n_), ops)
    return _sample(logits, sp, ops, draw)

  key_spec = P(vocab.rows, None)
  return jax.shard_map(shard, mesh=vocab.mesh, in_specs=(vocab.spec, key_spec, key_spec, row_spec),
                       out_specs=(row_spec, row_spec, row_spec), check_vma=False)(
                           logits.astype(jnp.float32), keys[0], keys[1], rows.astype(jnp.int32))


def _key_bits(key):
  """The uint32 words of a PRNG key (typed or raw), [..., 2]."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key).astype(jnp.uint32)
  return key.astype(jnp.uint32)


class _ShardedVocab(_Vocab):
  """Reductions over a vocabulary split over mesh axis `axis` (inside `shard_map`): this device
  holds columns [offset, offset + local) of V; results are those of the whole vocabulary."""

  def __init__(self, size: int, axis: str, local: int, all_axes: tuple[str, ...]):
    super().__init__(size)
    self.axis, self.local, self.all_axes = axis, local, all_axes
    self.offset = jax.lax.axis_index(axis) * local

  def max(self, x):
    return jax.lax.pmax(jnp.max(x, axis=-1), self.axis)

  def min(self, x):
    return jax.lax.pmin(jnp.min(x, axis=-1), self.axis)

  def sum(self, x):
    return jax.lax.psum(jnp.sum(x, axis=-1), self.axis)

  def top_k(self, x, k: int):
    best = super().top_k(x, min(k, self.local))
    return super().top_k(jax.lax.all_gather(best, self.axis, axis=1, tiled=True), k)

  def argmax(self, x):
    """The first index of the row max over the whole vocabulary (as jnp.argmax)."""
    local = first_argmax(x)
    m, i = jnp.take_along_axis(x, local[:, None], axis=-1)[:, 0], local + self.offset   # this shard's max
    ms, is_ = jax.lax.all_gather(m, self.axis), jax.lax.all_gather(i, self.axis)   # [n, B]
    return jnp.take_along_axis(is_, jnp.argmax(ms, axis=0)[None], axis=0)[0].astype(jnp.int32)

  def take(self, x, tokens):
    local = tokens - self.offset
    inside = (local >= 0) & (local < self.local)
    got = jnp.take_along_axis(x, jnp.clip(local, 0, self.local - 1)[:, None], axis=-1)[:, 0]
    return jax.lax.psum(jnp.where(inside, got, 0.0), self.axis)

  def all(self, pred):
    return jax.lax.pmin(jnp.all(pred).astype(jnp.int32), self.all_axes) > 0


def _gumbel_draw_sharded(log_weights, weights, block_noise, token_noise, ops: _ShardedVocab):
  """`_gumbel_draw` of the whole vocabulary from this device's columns (see `_sample_sharded`)."""
  b, vl = log_weights.shape
  v, block, axis = ops.size, _DRAW_BLOCK, ops.axis
  if v <= 2 * block:
    full = jax.lax.all_gather(log_weights, axis, axis=1, tiled=True)      # [B, V], V <= 512
    return jnp.argmax(full + token_noise(v), axis=-1).astype(jnp.int32)
  nb = -(-v // block)
  # This device's columns placed at their offset within the blocks they touch (nbl of them).
  nbl = -(-vl // block) + 1
  first, lead = ops.offset // block, ops.offset % block
  place = lambda x, fill: jax.lax.dynamic_update_slice(jnp.full((b, nbl * block), fill, x.dtype), x, (0, lead))
  local_lw = place(log_weights, -jnp.inf).reshape(b, nbl, block)
  local_mass = place(weights, 0.0).reshape(b, nbl, block).sum(-1)                           # [B, nbl]
  mass = jax.lax.dynamic_update_slice(jnp.zeros((b, nb + nbl), jnp.float32), local_mass, (0, first))
  mass = jax.lax.psum(mass[:, :nb], axis)                                                    # [B, nb]
  j = jnp.argmax(jnp.log(mass) + block_noise(nb), axis=-1)
  jl = j - first
  mine = (jl >= 0) & (jl < nbl)
  inner = jnp.take_along_axis(local_lw, jnp.clip(jl, 0, nbl - 1)[:, None, None], axis=1)[:, 0]   # [B, block]
  inner = jax.lax.pmax(jnp.where(mine[:, None], inner, -jnp.inf), axis)
  i = jnp.argmax(inner + token_noise(block), axis=-1)
  return (j * block + i).astype(jnp.int32)


def row_gumbel(keys: jax.Array, rows: jax.Array, n: int) -> jax.Array:
  """[B, n] float32: row b is row rows[b] of `jax.random.gumbel(keys[b], (R, n), jnp.float32)`,
  bit for bit, for any R > rows[b], computed without the other rows.

  keys: [B] threefry PRNG keys; rows: [B] int32. JAX's partitionable threefry (the default since
  0.5) makes element (r, j) of a random array the hash of the key and its flat index r * n + j;
  this evaluates that hash at row rows[b]'s indices and maps the bits to Gumbel noise the way
  `jax.random.gumbel` does ('low' mode: -log(-log(u)), u uniform in [tiny, 1)).
  tests/test_slots.py checks the equality, so a JAX release that changes either step fails there.
  """
  if not jax.config.jax_threefry_partitionable or jax.config.jax_high_dynamic_range_gumbel:
    raise ConfigError("per-row draws (SamplingParams.slots below the rows) need JAX's defaults "
                      "jax_threefry_partitionable=True and jax_high_dynamic_range_gumbel=False.")
  if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
    if "threefry" not in str(jax.random.key_impl(keys)):
      raise ConfigError(f"per-row draws need threefry PRNG keys, got {jax.random.key_impl(keys)}.")
    keys = jax.random.key_data(keys)
  keys = keys.astype(jnp.uint32)                                            # [B, 2]
  lo = rows.astype(jnp.uint32)[:, None] * jnp.uint32(n) + jnp.arange(n, dtype=jnp.uint32)[None, :]
  # Flat indices beyond 2**32 would need the high word; a batch of 2**32 / n rows is far off.
  bits1, bits2 = threefry2x32_p.bind(jnp.broadcast_to(keys[:, :1], lo.shape), jnp.broadcast_to(keys[:, 1:], lo.shape),
                                     jnp.zeros_like(lo), lo)
  bits = bits1 ^ bits2
  one = np.array(1.0, np.float32).view(np.uint32)
  floats = jax.lax.bitcast_convert_type((bits >> jnp.uint32(9)) | jnp.uint32(one), jnp.float32) - jnp.float32(1.0)
  tiny = jnp.float32(np.finfo(np.float32).tiny)
  return -jnp.log(-jnp.log(jnp.maximum(tiny, floats * (jnp.float32(1.0) - tiny) + tiny)))


def _truncation_threshold(scaled, shifted, log_z, sp: SamplingParams, ops: _Vocab | None = None):
  """[B] scaled-logit threshold (keep tokens >= it) for top-k, top-p, min-p; None if all are off.
  ops: the reductions over the vocabulary (default: all of it on this device)."""
  ops = ops or _Vocab(scaled.shape[-1])
  v = ops.size
  thresholds = []
  use_k = 0 < sp.top_k < v
  if use_k:
    top_vals = ops.top_k(scaled, sp.top_k)  # [B, k], descending
    thresholds.append(top_vals[:, -1])
  if sp.top_p < 1.0:
    if use_k:
      # Nucleus of the renormalised top-k distribution, exactly as a sorted cumsum.
      probs = jax.nn.softmax(top_vals, axis=-1)
      thresholds.append(_nucleus_threshold(top_vals, probs, sp.top_p))
    else:
      thresholds.append(_top_p_threshold(scaled, shifted, log_z, sp.top_p, ops))
  if sp.min_p > 0.0:
    # p >= min_p * p_max  <=>  scaled >= max(scaled) + log(min_p).
    thresholds.append(ops.max(scaled) + math.log(sp.min_p))
  if not thresholds:
    return None
  return functools.reduce(jnp.maximum, thresholds)


def _nucleus_threshold(sorted_vals, sorted_probs, top_p):
  """sorted_vals/probs: [B, C] descending. Keeps token j iff the mass before it is < top_p."""
  before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1), 1)
  return jnp.take_along_axis(sorted_vals, (n_keep - 1)[:, None], axis=-1)[:, 0]


def _top_p_threshold(scaled, shifted, log_z, top_p, ops: _Vocab):
  """Top-p over the full distribution: the best C candidates, or a bisection when wider."""
  v = ops.size
  c = min(v, _TOP_P_CANDIDATES)
  vals = ops.top_k(scaled, c)
  probs = jnp.exp(vals - vals[:, :1] - log_z[:, None])  # vals[:, 0] is the row max
  thr = _nucleus_threshold(vals, probs, top_p)
  if c == v:
    return thr
  # The candidates decide a row when the first c - 1 of them already hold top_p of the mass.
  resolved = jnp.sum(probs[:, :-1], axis=-1) >= top_p
  return jax.lax.cond(ops.all(resolved), lambda: thr,
                      lambda: jnp.where(resolved, thr, _bisect_top_p(scaled, shifted, log_z, top_p, ops)))


def _bisect_top_p(scaled, shifted, log_z, top_p, ops: _Vocab):
  """Exact nucleus threshold by bisection over float bit patterns, O(32 V) per row.

  Mass above tau, m(tau) = sum p_i [scaled_i > tau], decreases in tau; the threshold is the
  smallest tau with m(tau) < top_p, which is always one of the scaled logits.
  """
  probs = jnp.exp(shifted - log_z[:, None])

  def flip(i):  # float32 bits <-> int32 keys with the same order as the floats (an involution)
    return i ^ ((i >> 31) & jnp.int32(0x7FFFFFFF))

  to_key = lambda x: flip(jax.lax.bitcast_convert_type(x, jnp.int32))
  from_key = lambda k: jax.lax.bitcast_convert_type(flip(k), jnp.float32)

  lo = to_key(ops.min(scaled))
  hi = to_key(ops.max(scaled))  # m(max) = 0 < top_p, so hi always qualifies

  def body(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
    mass = ops.sum(jnp.where(scaled > from_key(mid)[:, None], probs, 0.0))
    ok = mass < top_p
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
  return from_key(hi)

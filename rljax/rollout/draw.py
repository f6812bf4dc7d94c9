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

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

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


def sample_logits(logits: jax.Array, sp: SamplingParams, key: jax.Array, rows: jax.Array | None = None):
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
  """
  logits = logits.astype(jnp.float32)
  scaled = logits / sp.logprob_temperature if sp.logprob_temperature != 1.0 else logits
  top = jnp.max(scaled, axis=-1, keepdims=True)
  shifted = scaled - top
  weights = jnp.exp(shifted)  # unnormalised probabilities, also the sampling weights
  z = jnp.sum(weights, axis=-1)
  log_z = jnp.log(z)
  # -sum p log p with log p = shifted - log z; both terms are >= 0, so no cancellation.
  entropy = log_z - jnp.sum(weights * shifted, axis=-1) / z

  if sp.is_greedy:
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    threshold = _truncation_threshold(scaled, shifted, log_z, sp)
    if threshold is not None:
      keep = scaled >= threshold[:, None]
      shifted_kept, weights = jnp.where(keep, shifted, -jnp.inf), jnp.where(keep, weights, 0.0)
    else:
      shifted_kept = shifted
    tokens = _gumbel_draw(shifted_kept, weights, key, rows)
  chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0]
  return tokens, chosen - log_z, entropy


def _gumbel_draw(log_weights, weights, key, rows=None):
  """[B] token ids drawn with probability proportional to `weights` [B, V] (= exp(log_weights)).
  key: one key, or per-row keys [B] with `rows` (see `sample_logits`).

  Two Gumbel-max draws: a block of _DRAW_BLOCK tokens by its total weight, then a token inside
  it. That is exactly the categorical distribution (P(block) * P(token | block) = w / sum w) with
  B * (V / _DRAW_BLOCK + _DRAW_BLOCK) noise samples instead of B * V: the noise was the largest
  single cost of a decode step on CPU (34 of 245 ms for SmolLM2, B = 64, V = 49152).
  """
  b, v = log_weights.shape
  block = _DRAW_BLOCK
  if rows is None:
    k_block, k_token = jax.random.split(key)
    noise = lambda k, n: jax.random.gumbel(k, (b, n), jnp.float32)
  else:
    k_block, k_token = jnp.moveaxis(jax.vmap(jax.random.split)(key), 1, 0)
    noise = lambda k, n: row_gumbel(k, rows, n)
  if v <= 2 * block:
    return jnp.argmax(log_weights + noise(k_token, v), axis=-1).astype(jnp.int32)
  nb = -(-v // block)
  pad = ((0, 0), (0, nb * block - v))
  log_weights = jnp.pad(log_weights, pad, constant_values=-jnp.inf).reshape(b, nb, block)
  mass = jnp.pad(weights, pad).reshape(b, nb, block).sum(-1)                 # [B, nb]
  j = jnp.argmax(jnp.log(mass) + noise(k_block, nb), axis=-1)
  inner = jnp.take_along_axis(log_weights, j[:, None, None], axis=1)[:, 0]   # [B, block]
  i = jnp.argmax(inner + noise(k_token, block), axis=-1)
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


def _truncation_threshold(scaled, shifted, log_z, sp: SamplingParams):
  """[B] scaled-logit threshold (keep tokens >= it) for top-k, top-p, min-p; None if all are off."""
  v = scaled.shape[-1]
  thresholds = []
  use_k = 0 < sp.top_k < v
  if use_k:
    top_vals, _ = jax.lax.top_k(scaled, sp.top_k)  # [B, k], descending
    thresholds.append(top_vals[:, -1])
  if sp.top_p < 1.0:
    if use_k:
      # Nucleus of the renormalised top-k distribution, exactly as a sorted cumsum.
      probs = jax.nn.softmax(top_vals, axis=-1)
      thresholds.append(_nucleus_threshold(top_vals, probs, sp.top_p))
    else:
      thresholds.append(_top_p_threshold(scaled, shifted, log_z, sp.top_p))
  if sp.min_p > 0.0:
    # p >= min_p * p_max  <=>  scaled >= max(scaled) + log(min_p).
    thresholds.append(jnp.max(scaled, axis=-1) + math.log(sp.min_p))
  if not thresholds:
    return None
  return functools.reduce(jnp.maximum, thresholds)


def _nucleus_threshold(sorted_vals, sorted_probs, top_p):
  """sorted_vals/probs: [B, C] descending. Keeps token j iff the mass before it is < top_p."""
  before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  n_keep = jnp.maximum(jnp.sum(before < top_p, axis=-1), 1)
  return jnp.take_along_axis(sorted_vals, (n_keep - 1)[:, None], axis=-1)[:, 0]


def _top_p_threshold(scaled, shifted, log_z, top_p):
  """Top-p over the full distribution: the best C candidates, or a bisection when wider."""
  b, v = scaled.shape
  c = min(v, _TOP_P_CANDIDATES)
  vals, _ = jax.lax.top_k(scaled, c)
  probs = jnp.exp(vals - vals[:, :1] - log_z[:, None])  # vals[:, 0] is the row max
  thr = _nucleus_threshold(vals, probs, top_p)
  if c == v:
    return thr
  # The candidates decide a row when the first c - 1 of them already hold top_p of the mass.
  resolved = jnp.sum(probs[:, :-1], axis=-1) >= top_p
  return jax.lax.cond(jnp.all(resolved), lambda: thr,
                      lambda: jnp.where(resolved, thr, _bisect_top_p(scaled, shifted, log_z, top_p)))


def _bisect_top_p(scaled, shifted, log_z, top_p):
  """Exact nucleus threshold by bisection over float bit patterns, O(32 V) per row.

  Mass above tau, m(tau) = sum p_i [scaled_i > tau], decreases in tau; the threshold is the
  smallest tau with m(tau) < top_p, which is always one of the scaled logits.
  """
  probs = jnp.exp(shifted - log_z[:, None])

  def flip(i):  # float32 bits <-> int32 keys with the same order as the floats (an involution)
    return i ^ ((i >> 31) & jnp.int32(0x7FFFFFFF))

  to_key = lambda x: flip(jax.lax.bitcast_convert_type(x, jnp.int32))
  from_key = lambda k: jax.lax.bitcast_convert_type(flip(k), jnp.float32)

  lo = to_key(jnp.min(scaled, axis=-1))
  hi = to_key(jnp.max(scaled, axis=-1))  # m(max) = 0 < top_p, so hi always qualifies

  def body(_, bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow
    mass = jnp.sum(jnp.where(scaled > from_key(mid)[:, None], probs, 0.0), axis=-1)
    ok = mass < top_p
    return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

  _, hi = jax.lax.fori_loop(0, 32, body, (lo, hi))
  return from_key(hi)

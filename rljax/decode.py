"""The decode core of the single-turn sampler (`rljax.sampling`) and the multi-turn tool engine
(`rljax.multiturn`): how a token is chosen, the state a decode loop carries, the model over a cache.

Shapes: B rows, T completion (trajectory) columns, V vocab, L layers, K KV heads, Dh head dim,
S cache slots, P prompts when a prompt cache is shared by groups of rows.

- `SamplingParams` and `sample_logits`: the draw (temperature, top-k, top-p, min-p, greedy) and
  the log-prob and entropy of the un-truncated distribution that are recorded (docs/sampling.md).
- `DecodeState` and `choose`: the tokens, masks, log-probs and stop flags of B rows, and the one
  function that picks the rows' next tokens and writes them in. Both engines call `choose`, so a
  row's tokens and log-probs depend on its logits and the step's key, not on the engine.
- `prefill`, `decode_step`, `forward_cached` and the cache helpers: the model over per-layer KV
  caches, optionally behind a read-only prompt cache shared by each group of rows.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.models.policy import apply_model
from rljax.models.transformer import (DecoderLayer, KVCache, Transformer, cache_key_positions, embed_tokens, layer_rope,
                                      make_norm, positions_from_mask, window_mask)

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


def sample_logits(logits: jax.Array, sp: SamplingParams, key: jax.Array):
  """Chooses one token per row and records its log-prob and the entropy.

  logits: [B, V] float32. Returns tokens [B] int32, logprobs [B] f32 and entropy [B] f32 of the
  un-truncated distribution log_softmax(logits / sp.logprob_temperature). Only the draw is
  restricted by top-k / top-p / min-p. The draw is Gumbel-max in two levels (`_gumbel_draw`): a
  block of the vocabulary by its kept mass, then a token in it, each the argmax of log-weights
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
    tokens = _gumbel_draw(shifted_kept, weights, key)
  chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0]
  return tokens, chosen - log_z, entropy


def _gumbel_draw(log_weights, weights, key):
  """[B] token ids drawn with probability proportional to `weights` [B, V] (= exp(log_weights)).

  Two Gumbel-max draws: a block of _DRAW_BLOCK tokens by its total weight, then a token inside
  it. That is exactly the categorical distribution (P(block) * P(token | block) = w / sum w) with
  B * (V / _DRAW_BLOCK + _DRAW_BLOCK) noise samples instead of B * V: the noise was the largest
  single cost of a decode step on CPU (34 of 245 ms for SmolLM2, B = 64, V = 49152).
  """
  b, v = log_weights.shape
  block = _DRAW_BLOCK
  k_block, k_token = jax.random.split(key)
  if v <= 2 * block:
    return jnp.argmax(log_weights + jax.random.gumbel(k_token, (b, v), jnp.float32), axis=-1).astype(jnp.int32)
  nb = -(-v // block)
  pad = ((0, 0), (0, nb * block - v))
  log_weights = jnp.pad(log_weights, pad, constant_values=-jnp.inf).reshape(b, nb, block)
  mass = jnp.pad(weights, pad).reshape(b, nb, block).sum(-1)                 # [B, nb]
  j = jnp.argmax(jnp.log(mass) + jax.random.gumbel(k_block, (b, nb), jnp.float32), axis=-1)
  inner = jnp.take_along_axis(log_weights, j[:, None, None], axis=1)[:, 0]   # [B, block]
  i = jnp.argmax(inner + jax.random.gumbel(k_token, (b, block), jnp.float32), axis=-1)
  return (j * block + i).astype(jnp.int32)


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


# ---- the decode state and the token choice --------------------------------------------------


@struct.dataclass
class DecodeState:
  """What a decode loop knows about B rows of up to T tokens.

  tokens: [B, T] int32, the chosen ids (the pad id where none was chosen).
  mask: [B, T] bool, the tokens the model chose (what the learner trains on).
  logprobs, entropy: [B, T] float32, recorded by `sample_logits` for those tokens (0 elsewhere).
  done: [B] bool, the row takes no more tokens.
  stopped: [B] bool, the row chose a stop id.

  The multi-turn engine extends it (`multiturn.TurnState`) with its turn bookkeeping and caches.
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


def choose(state: DecodeState, logits: jax.Array, column, sp: SamplingParams, key: jax.Array,
           stop_ids: tuple[int, ...], pad_id: int, live=None, forced=None):
  """Chooses the next token of every live row, writes it at `column` and flags the rows that stop.

  logits: [B, V]. column: [] int32, the column every row writes (the single-turn loop), or [B]
  int32, each row's own (columns past T are dropped). key: this step's PRNG key. stop_ids: a
  static tuple. live: [B] bool, the rows that take a token (default ~state.done); the others
  keep their entries. forced: None, or (use [B] bool, tokens [B] int32): rows in `use` take the
  given token instead of a drawn one, with the model's log-prob of it (scripted turns).
  Returns (state, tok): tokens / mask / logprobs / entropy written for the live rows, done and
  stopped set where a live row chose a stop id; tok [B] int32, the pad id for rows not live.
  Works on any DecodeState subclass (the extra fields pass through).
  """
  live = ~state.done if live is None else live
  tok, lp, ent = sample_logits(logits, sp, key)
  if forced is not None:
    use, ftok = forced
    scaled = logits.astype(jnp.float32) / sp.logprob_temperature
    flp = jnp.take_along_axis(scaled, ftok[:, None], axis=1)[:, 0] - jax.nn.logsumexp(scaled, axis=-1)
    tok, lp = jnp.where(use, ftok, tok), jnp.where(use, flp, lp)
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


# ---- the model over a KV cache --------------------------------------------------------------


def prefill(config: ModelConfig, params, prompt_ids, prompt_mask, slots: int, constrain=lambda x, logical: x):
  """Runs prompts [P, Lp] (mask [P, Lp]) through the model into a fresh cache of `slots` slots.

  Returns (cache, logits): the KVCache ([L, P, ...], index Lp) and the float32 logits [P, V] that
  predict each prompt's next token (from its last real token). `constrain(x, logical_axes)`
  places sharding constraints (identity by default).
  """
  p = prompt_ids.shape[0]
  cache = KVCache.zeros(config, p, slots)
  cache = cache._replace(k=constrain(cache.k, ("layers", "batch", "kv_heads", "head_dim", "length")),
                         v=constrain(cache.v, ("layers", "batch", "kv_heads", "length", "head_dim")))
  out = apply_model(config, params, prompt_ids, positions_from_mask(prompt_mask), prompt_mask, cache,
                    return_hidden=True)
  last = _last_true(prompt_mask)
  h_last = jnp.take_along_axis(out.hidden, last[:, None, None], axis=1)[:, 0]  # [P, D]
  return out.cache, Transformer(config).apply({"params": params}, h_last, method=Transformer.hidden_to_logits)


def _last_true(x):
  """[B, N] bool -> [B] index of the last True (0 when none)."""
  n = x.shape[-1]
  return (n - 1 - jnp.argmax(x[:, ::-1], axis=-1)).astype(jnp.int32)


def split_cache(config: ModelConfig, cache: KVCache) -> tuple[tuple, tuple]:
  """A stacked KVCache's keys and values as L per-layer arrays (ks, vs), as `decode_step` takes them."""
  return tuple(cache.k[i] for i in range(config.num_layers)), tuple(cache.v[i] for i in range(config.num_layers))


def empty_caches(config: ModelConfig, batch: int, slots: int) -> tuple[tuple, tuple, jax.Array]:
  """Zeroed per-layer caches (ks [B, K, Dh, S] x L, vs [B, K, S, Dh] x L, kv_mask [B, S])."""
  kh, dh, dtype = config.num_kv_heads, config.head_dim, config.compute_dtype
  return (tuple(jnp.zeros((batch, kh, dh, slots), dtype) for _ in range(config.num_layers)),
          tuple(jnp.zeros((batch, kh, slots, dh), dtype) for _ in range(config.num_layers)),
          jnp.zeros((batch, slots), bool))


def split_layers(stacked, num_layers: int) -> list:
  """The [L, ...] stacked layer parameters as L per-layer trees (sliced once, outside the loop)."""
  return [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(num_layers)]


def decode_step(config: ModelConfig, params, layer_params, tokens, positions, token_mask, ks, vs, kv_mask, index,
                prefix=None):
  """One new token per row through the model, the layers unrolled over per-layer caches.

  tokens, positions: [B] int32; token_mask: [B] bool; ks: L arrays [B, K, Dh, S]; vs: L arrays
  [B, K, S, Dh]; kv_mask: [B, S] bool; index: [] int32, the slot to write. prefix: None, or a
  read-only cache shared by each group of B / P consecutive rows and attended before their own:
  (L arrays [P, K, Dh, Sp], L arrays [P, K, Sp, Dh], mask [P, Sp] bool). Returns logits [B, V]
  float32 and the updated ks, vs, kv_mask.

  This is `Transformer.__call__` with a cache for T = 1, running the same `DecoderLayer` code,
  but with one cache array and one parameter tree per layer instead of the scanned [L, ...]
  stacks: slicing a layer out of a stack inside the loop copies its cache and weights on every
  step, and decoding is bound by reading exactly those (2-3x slower per step, measured).
  """
  hidden, ks, vs, kv_mask = forward_cached(config, params, layer_params, tokens[:, None], positions[:, None],
                                           token_mask[:, None], ks, vs, kv_mask, index, prefix)
  logits = Transformer(config).apply({"params": params}, hidden[:, 0], method=Transformer.hidden_to_logits)
  return logits, ks, vs, kv_mask


def forward_cached(config: ModelConfig, params, layer_params, tokens, positions, token_mask, ks, vs, kv_mask, index,
                   prefix=None):
  """W new tokens per row written at slots [index, index + W) of per-layer caches.

  tokens, positions: [B, W] int32; token_mask: [B, W] bool; ks, vs, kv_mask, prefix as in
  `decode_step`. Token w of a row attends to its prefix (if any), then to the slots
  <= index + w whose kv_mask is set. Returns the
  final-normed hidden states [B, W, D] (compute dtype) and the updated ks, vs, kv_mask.

  Sliding-window layers (Gemma) see the keys whose position is within the window of the query's;
  a key's position is the number of real tokens before it in its row, prefix first
  (`cache_key_positions`), as the callers number positions.
  """
  c = config
  b, w = tokens.shape
  x = embed_tokens(c, params["embedding"], tokens)  # [B, W, D]
  rope = layer_rope(positions, c)
  kv_mask = jax.lax.dynamic_update_slice_in_dim(kv_mask, token_mask, index, axis=1)
  causal = jnp.arange(kv_mask.shape[1])[None, :] <= index + jnp.arange(w)[:, None]  # [W, S]
  mask = causal[None] & kv_mask[:, None, :]  # [B, W, S]
  prefix_window = None
  if c.has_sliding_layers:
    before = None
    if prefix is not None:  # each row's queries against its group's prompt cache: [B, W, Sp]
      pmask = prefix[2]
      rows = lambda a: jnp.repeat(a, b // pmask.shape[0], axis=0, total_repeat_length=b)
      before = rows(jnp.sum(pmask, axis=-1, dtype=jnp.int32))
      prefix_window = rows(pmask)[:, None, :] & window_mask(c, positions, rows(cache_key_positions(pmask)))
    mask = (mask, mask & window_mask(c, positions, cache_key_positions(kv_mask, before)))
  flags = c.sliding_layers if c.has_sliding_layers else (False,) * c.num_layers
  layer = DecoderLayer(c)
  new_ks, new_vs = [], []
  for i, (p, k, v) in enumerate(zip(layer_params, ks, vs)):
    shared = None
    if prefix is not None:
      shared = (prefix[0][i], prefix[1][i], prefix[2]) + (() if prefix_window is None else (prefix_window,))
    x, ((k, v), _) = layer.apply({"params": p}, x, (k, v), jnp.asarray(flags[i]), rope, mask, index, shared)
    new_ks.append(k)
    new_vs.append(v)
  x = make_norm(c).apply({"params": params["final_norm"]}, x)
  return x, tuple(new_ks), tuple(new_vs), kv_mask

"""In-graph sampler: one prefill per prompt, G completions per prompt, KV cache, exact log-probs.

Shapes: P = prompts, G = completions per prompt (`num_samples`), B = P * G rows,
Lp = prompt width, T = `max_new_tokens`, V = vocab.

`sample` is a pure function of arrays (jit it with `config` and `sp` static; the trainer calls it
inside its step); `generate` is the convenience entry point for a `Policy`. The algorithm:

1. Prefill: every prompt runs once through the model, filling a prompt cache of Lp slots
   ([P, ...]). Prompts may be left-padded (the house convention), right-padded, or have holes:
   a row's tokens are the entries whose `prompt_mask` is set, positions count only those
   tokens, and the first new token is predicted from the last real one.
2. Share: the G rows of a prompt (rows are prompt-major: row r belongs to prompt r // G) read
   that prompt cache, read-only, while decoding; it is never copied per row. Each row gets its
   own completion cache, and the first-token logits are repeated G times. Prompts are never
   repeated before prefill.
3. Decode: `lax.while_loop`, one token per iteration for all B rows ([B, 1, V] logits), token t
   written at completion slot t - 1. A row attends to its prompt's slots, then its own. A row
   stops after emitting any stop id (the EOS ids plus `stop_token_ids`); the loop ends when every
   row has stopped or T tokens were made. The loop runs the model's own `DecoderLayer` once per
   layer (`decode_step`) on one cache array per layer, with the stacked layer weights sliced
   once before the loop. Decoding runs in up to 4 segments (one `while_loop` each); the
   completion cache is grown between them, so a step reads its segment's end slots rather than
   all T: at T = 128, 5/8 of them on average.

The recorded distribution (what the learner recomputes, verl/TRL convention): with
`tau = sp.logprob_temperature`, `logp = log_softmax(logits / tau)` over the full vocabulary.
`logprobs[r, t]` is `logp` of the sampled token and `entropy[r, t] = -sum(exp(logp) * logp)`.
Top-k / top-p / min-p only restrict which token is drawn; they never change the recorded
log-prob, which is the un-truncated log-prob. Greedy decoding takes the argmax of the logits;
its log-probs are recorded at `tau = temperature`, where temperature 0 means tau = 1.

Memory: the caches (compute dtype) hold 2 (k and v) * L * K * Dh * (P * Lp + P * G * T) elements:
the prompt cache once per prompt, the completion cache per row. SmolLM2-135M (L=30, K=3, Dh=64)
in float32 with P=8, G=8, Lp=64, T=128: 2 * 30 * 3 * 64 * (512 + 8192) * 4 B = 401 MB (a cache of
Lp + T slots per row would be 566 MB). The per-layer weight slices are a second copy of the layer
weights for the duration of the call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.models.policy import apply_model
from rljax.models.transformer import DecoderLayer, KVCache, RMSNorm, Transformer, positions_from_mask, rope_tables

# top-p first looks for its nucleus among this many best tokens; rows whose nucleus is wider fall
# back to an exact bisection over the whole vocabulary (a full sort of V is far slower on CPU).
_TOP_P_CANDIDATES = 256
# The decode cache grows in up to this many segments of at least _MIN_SEGMENT tokens each.
_SEGMENTS = 4
_MIN_SEGMENT = 32
# Token draws pick a block of this many vocabulary entries first, then a token inside it.
_DRAW_BLOCK = 256


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
      object.__setattr__(self, "stop_token_ids", tuple(int(i) if _is_int(i) else i for i in ids))
    self.validate()

  def validate(self) -> "SamplingParams":
    """Raises ConfigError naming the offending field and the fix; returns self."""
    for name in ("num_samples", "max_new_tokens"):
      v = getattr(self, name)
      if not _is_int(v) or v < 1:
        raise ConfigError(f"SamplingParams.{name}={v!r} must be an integer >= 1.")
    t = self.temperature
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
      raise ConfigError(f"SamplingParams.temperature={t!r} must be a finite number >= 0 (0 means greedy).")
    if not _is_int(self.top_k) or self.top_k < 0:
      raise ConfigError(f"SamplingParams.top_k={self.top_k!r} must be an integer >= 0 (0 disables top-k).")
    if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
      raise ConfigError(f"SamplingParams.top_p={self.top_p!r} must be in (0, 1] (1.0 disables top-p).")
    if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p < 1.0:
      raise ConfigError(f"SamplingParams.min_p={self.min_p!r} must be in [0, 1) (0 disables min-p).")
    if not isinstance(self.greedy, (bool, np.bool_)):
      raise ConfigError(f"SamplingParams.greedy={self.greedy!r} must be True or False.")
    ids = self.stop_token_ids
    if not isinstance(ids, tuple) or not all(_is_int(i) and i >= 0 for i in ids):
      raise ConfigError(f"SamplingParams.stop_token_ids={ids!r} must be a tuple of non-negative token ids.")
    return self

  @property
  def is_greedy(self) -> bool:
    return bool(self.greedy) or self.temperature == 0

  @property
  def logprob_temperature(self) -> float:
    """The tau of the recorded distribution log_softmax(logits / tau); the learner must use it too."""
    return 1.0 if self.temperature == 0 else float(self.temperature)


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


@struct.dataclass
class SampleOutput:
  """Completions of P prompts, G each, in B = P * G prompt-major rows (row r is prompt r // G).

  tokens: [B, T] int32, generated ids; after the stop token (and in rows that stopped early)
    the pad id (config.pad_token_id, else 0).
  mask: [B, T] bool, generated tokens including the stop token.
  lengths: [B] int32, mask.sum(-1).
  truncated: [B] bool, hit max_new_tokens without emitting a stop token.
  logprobs: [B, T] float32, log-prob of each token under log_softmax(logits / tau) (0 where masked).
  entropy: [B, T] float32, entropy of that distribution (0 where masked).
  prompt_ids, prompt_mask: [B, Lp] the prompts, repeated G times.
  num_samples: G (static).

  `grouped()` returns the same fields reshaped to [P, G, ...].
  """
  tokens: jax.Array
  mask: jax.Array
  lengths: jax.Array
  truncated: jax.Array
  logprobs: jax.Array
  entropy: jax.Array
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  num_samples: int = struct.field(pytree_node=False, default=1)

  @property
  def num_prompts(self) -> int:
    return self.tokens.shape[0] // self.num_samples

  def grouped(self) -> "SampleOutput":
    """Every array reshaped from [P * G, ...] to [P, G, ...] (a view; no copy under jit)."""
    g = self.num_samples
    return jax.tree.map(lambda x: x.reshape((x.shape[0] // g, g) + x.shape[1:]), self)


# ---- token choice ---------------------------------------------------------------------------


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


def _last_true(x):
  """[B, N] bool -> [B] index of the last True (0 when none)."""
  n = x.shape[-1]
  return (n - 1 - jnp.argmax(x[:, ::-1], axis=-1)).astype(jnp.int32)


# ---- the sampler ----------------------------------------------------------------------------


def check_lengths(config: ModelConfig, sp: SamplingParams, prompt_len: int) -> None:
  """Static checks of a prompt width against the model's context; ConfigError naming the fix."""
  ctx = config.max_position_embeddings
  if prompt_len < 1:
    raise ConfigError("prompt_ids has width 0: every prompt needs at least one token "
                      "(for example a BOS token or a chat template).")
  if prompt_len > ctx:
    raise ConfigError(f"prompt_ids has {prompt_len} tokens per row, longer than the model's context "
                      f"(model.max_position_embeddings={ctx}); truncate the prompts "
                      "(data.max_prompt_tokens).")
  if prompt_len + sp.max_new_tokens > ctx:
    raise ConfigError(f"prompt width {prompt_len} + SamplingParams.max_new_tokens={sp.max_new_tokens} exceeds "
                      f"the model's context (model.max_position_embeddings={ctx}); lower max_new_tokens "
                      "or the prompt length.")


def sample(config: ModelConfig, params, prompt_ids: jax.Array, prompt_mask: jax.Array, sp: SamplingParams,
           rng: jax.Array, eos_ids: Sequence[int] = (), *, mesh: jax.sharding.Mesh | None = None,
           rules=shd.DEFAULT_RULES) -> SampleOutput:
  """Draws G completions for each of P prompts. Pure; jit with config, sp, eos_ids, mesh static.

  prompt_ids: [P, Lp] int32, left-padded by convention (right padding works too);
  prompt_mask: [P, Lp] bool, the real prompt tokens. rng: a PRNG key; the same key gives the same
  output. eos_ids: ids that stop a row (with sp.stop_token_ids). mesh: when given, the batch
  axis of the cache and of every per-row array is constrained to ("data", "fsdp") and the KV
  heads to "tensor" (dimensions the mesh does not divide are replicated); the parameters keep
  the sharding they come with.

  A row whose prompt_mask is all False (an empty prompt) yields an empty completion
  (length 0); `generate` rejects such prompts instead.

  Memory: the KV caches are 2 * L * K * Dh * (P * Lp + P * G * T) elements of config.dtype: each
  prompt's cache is shared by its G rows, each row caches only its completion.
  Returns a SampleOutput with [P * G, ...] rows, prompt-major.
  """
  sp.validate()
  p, width = prompt_ids.shape
  if prompt_mask.shape != prompt_ids.shape:
    raise ConfigError(f"prompt_mask has shape {prompt_mask.shape} but prompt_ids has {prompt_ids.shape}; "
                      "pass one mask entry per prompt token.")
  check_lengths(config, sp, width)
  g, t_new = sp.num_samples, sp.max_new_tokens
  b = p * g
  pad_id = 0 if config.pad_token_id is None else int(config.pad_token_id)
  stop_ids = tuple(sorted({int(i) for i in eos_ids} | set(sp.stop_token_ids)))

  def constrain(x, logical):
    if mesh is None:
      return x
    spec = shd.logical_to_spec(logical, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))

  rows = lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1))
  layer_k = lambda x: constrain(x, ("batch", "kv_heads", "head_dim", "length"))
  layer_v = lambda x: constrain(x, ("batch", "kv_heads", "length", "head_dim"))

  prompt_ids = rows(jnp.asarray(prompt_ids, jnp.int32))
  prompt_mask = rows(jnp.asarray(prompt_mask, bool))
  prompt_len = jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32)  # [P]

  # 1. Prefill, once per prompt, through the learner's forward. Its cache is the prompt cache
  # that the G rows of the prompt share (read-only) while decoding.
  cache, logits = prefill(config, params, prompt_ids, prompt_mask, width, constrain)
  pks, pvs = split_cache(config, cache)
  prefix = (tuple(map(layer_k, pks)), tuple(map(layer_v, pvs)), rows(cache.kv_mask))

  # 2. Fan out the first-token logits to G rows per prompt; each row gets its own completion
  # cache (one array per layer), sized to the first segment.
  fan = lambda x, axis=0: jnp.repeat(x, g, axis=axis, total_repeat_length=x.shape[axis] * g)
  ks, vs, kv_mask = empty_caches(config, b, segment_ends(t_new)[0])
  ks, vs, kv_mask = tuple(map(layer_k, ks)), tuple(map(layer_v, vs)), rows(kv_mask)
  logits = rows(fan(logits))
  prompt_len = fan(prompt_len)
  active = rows(prompt_len > 0)
  layer_params = _split_layers(params["layers"], config.num_layers)

  keys = lambda t: jax.random.fold_in(rng, t)

  def choose(state, logits, t):
    """Samples column t for the rows still active and updates the bookkeeping."""
    tokens, mask, logprobs, entropy, done, stopped = state
    tok, lp_t, ent_t = sample_logits(logits, sp, keys(t))
    live = ~done
    tok = jnp.where(live, tok, pad_id)
    put = lambda buf, col: jax.lax.dynamic_update_slice_in_dim(buf, col[:, None].astype(buf.dtype), t, axis=1)
    tokens, mask = put(tokens, tok), put(mask, live)
    logprobs, entropy = put(logprobs, jnp.where(live, lp_t, 0.0)), put(entropy, jnp.where(live, ent_t, 0.0))
    hit = live & _isin(tok, stop_ids)
    return (rows(tokens), rows(mask), rows(logprobs), rows(entropy), rows(done | hit), rows(stopped | hit)), tok

  zeros = lambda dtype, fill=0: rows(jnp.full((b, t_new), fill, dtype))
  state = (zeros(jnp.int32, pad_id), zeros(bool), zeros(jnp.float32), zeros(jnp.float32), ~active,
           jnp.zeros((b,), bool))
  state, tok = choose(state, logits, 0)

  # 3. Decode: one token per iteration, until every row is done. The completion cache grows by
  # segments, so a step attends over the slots written so far (rounded up to its segment), not all T.
  def cond(carry):
    t, _, _, _, _, state = carry
    return (t < end) & ~jnp.all(state[4])

  def body(carry):
    t, tok, ks, vs, kv_mask, state = carry
    done = state[4]
    logits, ks, vs, kv_mask = decode_step(config, params, layer_params, tok, prompt_len + t - 1, ~done, ks, vs,
                                          kv_mask, t - 1, prefix)
    state, tok = choose(state, rows(logits), t)
    return (t + 1, tok, tuple(map(layer_k, ks)), tuple(map(layer_v, vs)), rows(kv_mask), state)

  carry = (jnp.int32(1), tok, ks, vs, kv_mask, state)
  ends = segment_ends(t_new)
  for k, end in enumerate(ends):
    if k:   # grow the cache to this segment's slots (a copy per segment, not per step)
      grow = end - ends[k - 1]
      t, tok, ks, vs, kv_mask, state = carry
      ks = tuple(layer_k(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow)))) for x in ks)
      vs = tuple(layer_v(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0)))) for x in vs)
      carry = (t, tok, ks, vs, rows(jnp.pad(kv_mask, ((0, 0), (0, grow)))), state)
    carry = jax.lax.while_loop(cond, body, carry)
  state = carry[-1]
  tokens, mask, logprobs, entropy, _, stopped = state
  lengths = jnp.sum(mask, axis=-1, dtype=jnp.int32)
  return SampleOutput(
      tokens=tokens, mask=mask, lengths=lengths, truncated=(lengths == t_new) & ~stopped,
      logprobs=logprobs, entropy=entropy, prompt_ids=rows(fan(prompt_ids)), prompt_mask=rows(fan(prompt_mask)),
      num_samples=g)


def segment_ends(t_new: int) -> tuple[int, ...]:
  """Token counts at which the decode cache grows: up to _SEGMENTS equal parts of at least
  _MIN_SEGMENT tokens. The completion cache of the segment ending at `end` has `end` slots
  (token t is written at slot t - 1)."""
  n = max(1, min(_SEGMENTS, t_new // _MIN_SEGMENT))
  return tuple(-(-t_new * (k + 1) // n) for k in range(n))


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
  hidden, cache = apply_model(config, params, prompt_ids, positions_from_mask(prompt_mask), prompt_mask, cache,
                              return_hidden=True)
  last = _last_true(prompt_mask)
  h_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [P, D]
  return cache, Transformer(config).apply({"params": params}, h_last, method=Transformer.hidden_to_logits)


def split_cache(config: ModelConfig, cache: KVCache) -> tuple[tuple, tuple]:
  """A stacked KVCache's keys and values as L per-layer arrays (ks, vs), as `decode_step` takes them."""
  return tuple(cache.k[i] for i in range(config.num_layers)), tuple(cache.v[i] for i in range(config.num_layers))


def empty_caches(config: ModelConfig, batch: int, slots: int) -> tuple[tuple, tuple, jax.Array]:
  """Zeroed per-layer caches (ks [B, K, Dh, S] x L, vs [B, K, S, Dh] x L, kv_mask [B, S])."""
  kh, dh, dtype = config.num_kv_heads, config.head_dim, config.compute_dtype
  return (tuple(jnp.zeros((batch, kh, dh, slots), dtype) for _ in range(config.num_layers)),
          tuple(jnp.zeros((batch, kh, slots, dh), dtype) for _ in range(config.num_layers)),
          jnp.zeros((batch, slots), bool))


def _split_layers(stacked, num_layers: int) -> list:
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
  """
  c = config
  w = tokens.shape[1]
  x = jnp.take(params["embedding"], tokens, axis=0).astype(c.compute_dtype)  # [B, W, D]
  cos, sin = rope_tables(positions, c)
  kv_mask = jax.lax.dynamic_update_slice_in_dim(kv_mask, token_mask, index, axis=1)
  causal = jnp.arange(kv_mask.shape[1])[None, :] <= index + jnp.arange(w)[:, None]  # [W, S]
  mask = causal[None] & kv_mask[:, None, :]  # [B, W, S]
  layer = DecoderLayer(c)
  new_ks, new_vs = [], []
  for i, (p, k, v) in enumerate(zip(layer_params, ks, vs)):
    shared = None if prefix is None else (prefix[0][i], prefix[1][i], prefix[2])
    x, (k, v) = layer.apply({"params": p}, x, (k, v), cos, sin, mask, index, shared)
    new_ks.append(k)
    new_vs.append(v)
  x = RMSNorm(c.rms_norm_eps, param_dtype=c.storage_dtype).apply({"params": params["final_norm"]}, x)
  return x, tuple(new_ks), tuple(new_vs), kv_mask


def _isin(tok, ids: tuple[int, ...]):
  if not ids:
    return jnp.zeros(tok.shape, bool)
  return jnp.any(tok[:, None] == jnp.asarray(ids, jnp.int32)[None, :], axis=-1)


_sample_jit = jax.jit(sample, static_argnames=("config", "sp", "eos_ids", "mesh", "rules"))

# ---- convenience entry point ----------------------------------------------------------------

_BUCKET = 16


def generate(policy, prompt_ids, sp: SamplingParams, rng, prompt_mask=None, *, eos_ids: Sequence[int] | None = None,
             mesh: jax.sharding.Mesh | None = None) -> SampleOutput:
  """Samples `sp.num_samples` completions per prompt with a `Policy`.

  prompt_ids: [P, Lp] ints with `prompt_mask` [P, Lp] (None = every entry is a token), or a list
  of P token-id lists of any lengths (left-padded here). rng: a PRNG key or an int seed.
  eos_ids: default `default_stop_ids(policy)`: the model's EOS ids and the tokenizer's stop ids.
  mesh: default the mesh the parameters are sharded on, if any.

  Prompt widths are left-padded up to a multiple of 16 so nearby lengths share one compiled
  program (compiled once per config, sampling params, shapes and mesh). Returns a SampleOutput
  with [P * G, ...] rows; `out.grouped()` gives [P, G, ...] views, e.g. `out.grouped().tokens`.
  Raises ConfigError on empty prompts, out-of-vocabulary ids, or prompts too long for the context.
  """
  config: ModelConfig = policy.config
  if not isinstance(sp, SamplingParams):
    raise ConfigError(f"sp must be a SamplingParams, got {type(sp).__name__}.")
  sp.validate()
  ids, mask = _host_prompts(prompt_ids, prompt_mask, config.pad_token_id)
  n_real = mask.sum(-1)
  empty = np.flatnonzero(n_real == 0)
  if empty.size:
    raise ConfigError(f"prompt {int(empty[0])} is empty (no token has prompt_mask set); every prompt needs at "
                      "least one token, for example a BOS token or a chat template.")
  ctx = config.max_position_embeddings
  longest = int(n_real.max())
  if longest > ctx:
    raise ConfigError(f"prompt {int(n_real.argmax())} has {longest} tokens, longer than the model's context "
                      f"(model.max_position_embeddings={ctx}); truncate it.")
  bad = (ids < 0) | (ids >= config.vocab_size)
  if np.any(bad & mask):
    r, c = np.argwhere(bad & mask)[0]
    raise ConfigError(f"prompt {r} has token id {ids[r, c]} outside the vocabulary [0, {config.vocab_size}).")
  # Compact to the real width (left-padded), then pad up to the bucket without passing the context.
  ids, mask = _left_align(ids, mask, longest, config.pad_token_id)
  width = min(-(-longest // _BUCKET) * _BUCKET, max(longest, ctx - sp.max_new_tokens))
  if width > longest:
    ids = np.pad(ids, ((0, 0), (width - longest, 0)), constant_values=config.pad_token_id or 0)
    mask = np.pad(mask, ((0, 0), (width - longest, 0)))
  check_lengths(config, sp, ids.shape[1])

  if eos_ids is None:
    eos_ids = default_stop_ids(policy)
  if mesh is None:
    mesh = _params_mesh(policy.params)
  if not isinstance(rng, jax.Array):
    rng = jax.random.key(int(rng))
  ids_j, mask_j = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)
  if mesh is not None:
    ids_j = jax.device_put(ids_j, shd.batch_sharding(mesh, 2, ids.shape[0]))
    mask_j = jax.device_put(mask_j, shd.batch_sharding(mesh, 2, ids.shape[0]))
  return _sample_jit(config, policy.params, ids_j, mask_j, sp, rng, tuple(int(i) for i in eos_ids), mesh=mesh)


def default_stop_ids(policy) -> tuple[int, ...]:
  """The model's `eos_token_ids` plus the tokenizer's stop ids (EOS and end-of-turn tokens)."""
  ids = set(policy.config.eos_token_ids)
  tok = policy.tokenizer
  if tok is not None:
    extra = getattr(tok, "stop_ids", None)
    if extra is None:
      extra = [getattr(tok, "eos_id", None), getattr(tok, "eos_token_id", None)]
    ids.update(int(i) for i in extra if _is_int(i))
  return tuple(sorted(ids))


def _host_prompts(prompt_ids, prompt_mask, pad_id):
  """numpy ids [P, Lp] int64 and mask [P, Lp] bool from an array (+ mask) or ragged lists."""
  if isinstance(prompt_ids, (list, tuple)) and prompt_ids and not np.isscalar(prompt_ids[0]):
    rows = [np.asarray(r, np.int64).reshape(-1) for r in prompt_ids]
    if prompt_mask is None and len({len(r) for r in rows}) > 1:
      width = max(len(r) for r in rows)
      ids = np.full((len(rows), width), pad_id or 0, np.int64)
      mask = np.zeros((len(rows), width), bool)
      for i, r in enumerate(rows):
        if len(r):
          ids[i, width - len(r):], mask[i, width - len(r):] = r, True
      return ids, mask
  ids = np.asarray(prompt_ids)
  if ids.ndim == 1:
    ids = ids[None]
  if ids.ndim != 2 or ids.shape[0] < 1:
    raise ConfigError(f"prompt_ids has shape {ids.shape}; pass [P, Lp] token ids (P >= 1) or a list of lists.")
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ConfigError(f"prompt_ids has dtype {ids.dtype}; pass integer token ids.")
  ids = ids.astype(np.int64)
  mask = np.ones(ids.shape, bool) if prompt_mask is None else np.asarray(prompt_mask).astype(bool).reshape(ids.shape[0], -1)
  if mask.shape != ids.shape:
    raise ConfigError(f"prompt_mask has shape {mask.shape} but prompt_ids has {ids.shape}.")
  return ids, mask


def _left_align(ids, mask, width, pad_id):
  """Moves each row's real tokens to the right end of a [P, width] array."""
  out_ids = np.full((ids.shape[0], width), pad_id or 0, np.int64)
  out_mask = np.zeros((ids.shape[0], width), bool)
  for i in range(ids.shape[0]):
    r = ids[i][mask[i]]
    if len(r):
      out_ids[i, width - len(r):], out_mask[i, width - len(r):] = r, True
  return out_ids, out_mask


def _params_mesh(params) -> jax.sharding.Mesh | None:
  for leaf in jax.tree.leaves(params):
    s = getattr(leaf, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1:
      return s.mesh
  return None

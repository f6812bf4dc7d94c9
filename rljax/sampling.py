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
   once before the loop. Decoding runs in up to 4 cache stages (one `while_loop` each,
   `stage_ends`); the completion cache is grown between them, so a step reads its stage's end
   slots rather than all T: at T = 128, 5/8 of them on average. Each token is chosen and
   recorded by `rljax.decode.choose`, the choice the multi-turn engine makes too.

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

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rljax import sharding as shd
from rljax.decode import (DecodeState, SamplingParams, choose, decode_step, effective_temperature, empty_caches,
                          is_int, pad_token_id, prefill, sample_logits, split_cache, split_layers)
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.padding import left_pad

__all__ = ["SampleOutput", "SamplingParams", "check_lengths", "default_stop_ids", "effective_temperature", "generate",
           "sample", "sample_logits", "stage_ends"]

# The completion cache grows in up to this many stages of at least _MIN_STAGE tokens each.
_STAGES = 4
_MIN_STAGE = 32


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


# ---- the sampler ----------------------------------------------------------------------------


def check_lengths(config: ModelConfig, sp: SamplingParams, prompt_len: int) -> None:
  """Static checks of a prompt width against the model's context; ConfigError naming the fix."""
  ctx = config.context_length
  if prompt_len < 1:
    raise ConfigError("prompt_ids has width 0: every prompt needs at least one token "
                      "(for example a BOS token or a chat template).")
  if prompt_len > ctx:
    raise ConfigError(f"prompt_ids has {prompt_len} tokens per row, longer than the model's context "
                      f"(model.context_length={ctx}); truncate the prompts "
                      "(data.max_prompt_tokens).")
  if prompt_len + sp.max_new_tokens > ctx:
    raise ConfigError(f"prompt width {prompt_len} + SamplingParams.max_new_tokens={sp.max_new_tokens} exceeds "
                      f"the model's context (model.context_length={ctx}); lower max_new_tokens "
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
  pad_id = pad_token_id(config)
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
  # cache (one array per layer), sized to the first cache stage.
  fan = lambda x, axis=0: jnp.repeat(x, g, axis=axis, total_repeat_length=x.shape[axis] * g)
  ends = stage_ends(t_new)
  ks, vs, kv_mask = empty_caches(config, b, ends[0])
  ks, vs, kv_mask = tuple(map(layer_k, ks)), tuple(map(layer_v, vs)), rows(kv_mask)
  logits = rows(fan(logits))
  prompt_len = fan(prompt_len)
  active = rows(prompt_len > 0)
  layer_params = split_layers(params["layers"], config.num_layers)

  def choose_column(state, logits, t):
    """Column t of the rows not done, with key fold_in(rng, t)."""
    state, tok = choose(state, logits, t, sp, jax.random.fold_in(rng, t), stop_ids, pad_id)
    return jax.tree.map(rows, state), tok

  state = jax.tree.map(rows, DecodeState.empty(b, t_new, pad_id, done=~active))
  state, tok = choose_column(state, logits, 0)

  # 3. Decode: one token per iteration, until every row is done. The completion cache grows in
  # stages, so a step attends over the slots written so far (rounded up to its stage), not all T.
  def cond(carry):
    t, _, _, _, _, state = carry
    return (t < end) & ~jnp.all(state.done)

  def body(carry):
    t, tok, ks, vs, kv_mask, state = carry
    logits, ks, vs, kv_mask = decode_step(config, params, layer_params, tok, prompt_len + t - 1, ~state.done, ks,
                                          vs, kv_mask, t - 1, prefix)
    state, tok = choose_column(state, rows(logits), t)
    return (t + 1, tok, tuple(map(layer_k, ks)), tuple(map(layer_v, vs)), rows(kv_mask), state)

  carry = (jnp.int32(1), tok, ks, vs, kv_mask, state)
  for k, end in enumerate(ends):
    if k:   # grow the cache to this stage's slots (a copy per stage, not per step)
      grow = end - ends[k - 1]
      t, tok, ks, vs, kv_mask, state = carry
      ks = tuple(layer_k(jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, grow)))) for x in ks)
      vs = tuple(layer_v(jnp.pad(x, ((0, 0), (0, 0), (0, grow), (0, 0)))) for x in vs)
      carry = (t, tok, ks, vs, rows(jnp.pad(kv_mask, ((0, 0), (0, grow)))), state)
    carry = jax.lax.while_loop(cond, body, carry)
  state = carry[-1]
  lengths = jnp.sum(state.mask, axis=-1, dtype=jnp.int32)
  return SampleOutput(
      tokens=state.tokens, mask=state.mask, lengths=lengths, truncated=(lengths == t_new) & ~state.stopped,
      logprobs=state.logprobs, entropy=state.entropy, prompt_ids=rows(fan(prompt_ids)),
      prompt_mask=rows(fan(prompt_mask)), num_samples=g)


def stage_ends(t_new: int) -> tuple[int, ...]:
  """Token counts at which the completion cache grows (the cache stages): up to _STAGES equal
  parts of at least _MIN_STAGE tokens. The stage ending at `end` has a completion cache of
  `end` slots (token t is written at slot t - 1)."""
  n = max(1, min(_STAGES, t_new // _MIN_STAGE))
  return tuple(-(-t_new * (k + 1) // n) for k in range(n))


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
  ctx = config.context_length
  longest = int(n_real.max())
  if longest > ctx:
    raise ConfigError(f"prompt {int(n_real.argmax())} has {longest} tokens, longer than the model's context "
                      f"(model.context_length={ctx}); truncate it.")
  bad = (ids < 0) | (ids >= config.vocab_size)
  if np.any(bad & mask):
    r, c = np.argwhere(bad & mask)[0]
    raise ConfigError(f"prompt {r} has token id {ids[r, c]} outside the vocabulary [0, {config.vocab_size}).")
  # Left-pad the real tokens to the bucket width, without passing the context.
  width = min(-(-longest // _BUCKET) * _BUCKET, max(longest, ctx - sp.max_new_tokens))
  ids, mask = left_pad([r[m] for r, m in zip(ids, mask)], config.pad_token_id, width, dtype=np.int64)
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
    ids.update(int(i) for i in extra if is_int(i))
  return tuple(sorted(ids))


def _host_prompts(prompt_ids, prompt_mask, pad_id):
  """numpy ids [P, Lp] int64 and mask [P, Lp] bool from an array (+ mask) or ragged lists."""
  if isinstance(prompt_ids, (list, tuple)) and prompt_ids and not np.isscalar(prompt_ids[0]):
    rows = [np.asarray(r, np.int64).reshape(-1) for r in prompt_ids]
    if prompt_mask is None and len({len(r) for r in rows}) > 1:
      return left_pad(rows, pad_id, dtype=np.int64)
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


def _params_mesh(params) -> jax.sharding.Mesh | None:
  for leaf in jax.tree.leaves(params):
    s = getattr(leaf, "sharding", None)
    if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1:
      return s.mesh
  return None

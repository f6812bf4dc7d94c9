"""The single-turn sampler: one prefill per prompt, G completions per prompt, KV cache, exact log-probs.

Shapes: P = prompts, G = completions per prompt (`num_samples`), B = P * G rows,
Lp = prompt width, T = `max_new_tokens`, V = vocab.

`sample` is a pure function of arrays (jit it with `config` and `sp` static; the trainer calls it
inside its step); `rljax.generate` (rljax/rollout/generation.py) is the convenience entry point for a
`Policy`; `SamplerProducer` is the trainer's producer around it. The algorithm:

1. Prefill: every prompt runs once through the model, filling a prompt cache of Lp slots
   ([P, ...]). Prompts may be left-padded (the house convention), right-padded, or have holes:
   a row's tokens are the entries whose `prompt_mask` is set, positions count only those
   tokens, and the first new token is predicted from the last real one.
2. Share: the G rows of a prompt (rows are prompt-major: row r belongs to prompt r // G) read
   that prompt cache (`PrefixCache`), read-only, while decoding; it is never copied per row.
   Each row gets its own completion cache (`DecodeCache`), and the first-token logits are
   repeated G times. Prompts are never repeated before prefill.
3. Decode: `lax.while_loop`, one token per iteration for all B rows ([B, 1, V] logits), token t
   written at completion slot t - 1. A row attends to its prompt's slots, then its own. A row
   stops after emitting any stop id (the EOS ids plus `stop_token_ids`); the loop ends when every
   row has stopped or T tokens were made. The loop runs the model's `Transformer.decode` on one
   cache per layer, with the stacked layer weights sliced once before the loop (`CachedModel`).
   Decoding runs in up to 4 cache stages (one `while_loop` each, `stage_ends`); the completion
   cache is grown between them, so a step reads its stage's end slots rather than all T: at
   T = 128, 5/8 of them on average. Each token is chosen and recorded by
   `rljax.rollout.decode.choose`, the choice the segment engine makes too.

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
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.models.cache import DecodeCache, PrefixCache
from rljax.models.config import ModelConfig
from rljax.models.moe import expert_id_dtype
from rljax.models.policy import param_logical_axes
from rljax.rollout import slots
from rljax.rollout.decode import CachedModel, DecodeState, choose, pad_token_id
from rljax.rollout.draw import SamplingParams, sample_logits, vocab_shards
from rljax.rollout.slots import batch_blocks, check_blocks, decode_slots
from rljax.rollout.types import Rollout, RolloutInfo

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
  decode_step: [B] int32, the decode step (1-based loop iteration) that chose the row's last
    token; 0 for rows done at their first token (drawn from the prefill). Its max is the steps
    the decode loop ran.
  routes: mixture-of-experts models with routing replay on (`MoeConfig.routing_replay`): the
    experts each token of [prompt | completion] was routed to in each routed layer, [B, Lp + T,
    L_moe, k] (`rljax.models.moe.expert_id_dtype`; E where not recorded: a completion's last
    token, which no step feeds back); else None.
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
  decode_step: jax.Array
  routes: jax.Array | None = None
  num_samples: int = struct.field(pytree_node=False, default=1)

  @property
  def num_prompts(self) -> int:
    return self.tokens.shape[0] // self.num_samples

  def grouped(self) -> "SampleOutput":
    """Every array reshaped from [P * G, ...] to [P, G, ...] (a view; no copy under jit)."""
    g = self.num_samples
    return jax.tree.map(lambda x: x.reshape((x.shape[0] // g, g) + x.shape[1:]), self)

  def rollout(self) -> Rollout:
    """The samples as the learner's `Rollout` (every completion token is the model's)."""
    return Rollout.single_turn(prompt_ids=self.prompt_ids, prompt_mask=self.prompt_mask, tokens=self.tokens,
                               mask=self.mask, logprobs=self.logprobs, entropy=self.entropy, lengths=self.lengths,
                               truncated=self.truncated, group_size=self.num_samples, decode_step=self.decode_step,
                               routes=self.routes)


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
           rules=shd.DEFAULT_RULES, shared_prefix: int = 0) -> SampleOutput:
  """Draws G completions for each of P prompts. Pure; jit with config, sp, eos_ids, mesh static.

  prompt_ids: [P, Lp] int32, left-padded by convention (right padding works too);
  prompt_mask: [P, Lp] bool, the real prompt tokens. rng: a PRNG key; the same key gives the same
  output. eos_ids: ids that stop a row (with sp.stop_token_ids). mesh: when given, the batch
  axis of the cache and of every per-row array is constrained to ("data", "fsdp") and the KV
  heads to "tensor" (dimensions the mesh does not divide are replicated); the parameters keep
  the sharding they come with. shared_prefix: s > 0 when the first s columns of every prompt are
  the same real tokens (a system prompt, few-shot examples; `shared_prefix_layout` lays prompts
  out so): the prefill computes them once instead of once per prompt (`prefill_shared`); the
  samples are those of the plain prefill up to float32 reordering (tested). Not with routing
  replay (the prompts' routes are not recorded then).

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

  prompt_ids = rows(jnp.asarray(prompt_ids, jnp.int32))
  prompt_mask = rows(jnp.asarray(prompt_mask, bool))
  prompt_len = jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32)  # [P]

  # 1. Prefill, once per prompt, through the learner's forward. Its cache is the prompt cache
  # that the G rows of the prompt share (read-only) while decoding.
  model = CachedModel(config, params)
  record = records_routes(config)
  if shared_prefix:
    if record:
      raise ConfigError("sample(shared_prefix=...) does not record the prompts' expert routes; sample with "
                        "shared_prefix=0 when routing replay is on.")
    cache, logits = model.prefill_shared(prompt_ids, prompt_mask, shared_prefix, constrain)
    prompt_routes = None
  else:
    cache, logits, prompt_routes = model.prefill_with_routes(prompt_ids, prompt_mask, width, constrain)
  prefix = PrefixCache.from_kv(cache).constrain(constrain)

  # 2. Fan out the first-token logits to G rows per prompt and choose every row's first token.
  fan = lambda x, axis=0: jnp.repeat(x, g, axis=axis, total_repeat_length=x.shape[axis] * g)
  ends = stage_ends(t_new)
  logits = fan(logits)
  prompt_len = fan(prompt_len)
  active = rows(prompt_len > 0)

  # Logits split over the vocabulary (the decode layout splits the output projection over
  # tensor) are drawn from where they lie: only per-row figures cross devices.
  vocab = vocab_shards(mesh, rules, (b, config.vocab_size))
  draw = None if vocab is None else (lambda state, logits, sp, key: sample_logits(logits, sp, key, vocab=vocab))

  def choose_column(state, logits, t):
    """Column t of the rows not done, with key fold_in(rng, t)."""
    logits = rows(logits) if vocab is None else constrain(logits, ("batch", "vocab"))
    state, tok = choose(state, logits, t, sp, jax.random.fold_in(rng, t), stop_ids, pad_id, draw=draw)
    return jax.tree.map(rows, state), tok

  state = jax.tree.map(rows, DecodeState.empty(b, t_new, pad_id, done=~active))
  state, tok = choose_column(state, logits, 0)

  # The experts of each completion token, written by the decode step that feeds it to the model.
  routes = rows(empty_routes(config, b, t_new)) if record else None
  n_slots = decode_slots(sp, b)
  if n_slots < b:   # 3'. continuous batching: n_slots rows at a time (rljax/rollout/slots.py)
    blocks = batch_blocks(mesh, b, rules)
    check_blocks(n_slots, p, b, blocks)
    state, decode_step, routes = slots.decode(model, state, prefix, prompt_len, rng, sp, stop_ids, pad_id, n_slots,
                                              blocks, ends, constrain,
                                              vocab=vocab_shards(mesh, rules, (n_slots, config.vocab_size)),
                                              routes=routes)
    lengths = jnp.sum(state.mask, axis=-1, dtype=jnp.int32)
  else:
    state, lengths, routes = _decode_rows(model, state, tok, prefix, prompt_len, choose_column, ends, b, constrain,
                                          routes)
    decode_step = jnp.maximum(lengths - 1, 0)
  # Split by the decode mesh's rows, as in the loop: a caller's other layout (the learner's rows) is
  # then reached after the loop, not carried into it (which would gather the state every token).
  state, lengths, decode_step = jax.tree.map(rows, (state, lengths, decode_step))
  if record:
    routes = rows(jnp.concatenate([fan(prompt_routes.astype(routes.dtype)), routes], axis=1))
  return SampleOutput(
      tokens=state.tokens, mask=state.mask, lengths=lengths, truncated=(lengths == t_new) & ~state.stopped,
      logprobs=state.logprobs, entropy=state.entropy, prompt_ids=rows(fan(prompt_ids)),
      prompt_mask=rows(fan(prompt_mask)), decode_step=decode_step, routes=routes, num_samples=g)


def shared_prefix_layout(prompt_ids, prompt_mask, min_shared: int = 1, length: int | None = None):
  """Host-side: (ids, mask, s) with the prompts' longest common run of leading real tokens (s of
  them) moved to the first s columns and each prompt's remaining tokens left-padded after them,
  for `sample(..., shared_prefix=s)`. s = 0 (the prompts as given) for a single prompt, or when they
  share fewer than `min_shared` tokens, or a prompt has no token after the shared ones. `length`: exactly that many
  shared tokens (one compiled program for every batch), or s = 0 when the prompts share fewer.
  prompt_ids, prompt_mask: [P, Lp] numpy arrays, real tokens where the mask is set."""
  import numpy as np
  ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask, bool)
  real = [row[m] for row, m in zip(ids, mask)]
  shortest = min(len(r) for r in real)
  s = 0
  while s < shortest and all(r[s] == real[0][s] for r in real):
    s += 1
  s = min(s, shortest - 1)             # every prompt keeps a token after the prefix (its logits)
  if len(real) < 2:
    s = 0                              # one prompt: nothing to share
  if length is not None:
    s = length if s >= length else 0
  if s < max(min_shared, 1):
    return ids, mask, 0
  width = ids.shape[1]
  out_ids = np.full_like(ids, ids[~mask][0] if (~mask).any() else 0)
  out_mask = np.zeros_like(mask)
  out_ids[:, :s], out_mask[:, :s] = real[0][:s], True
  for i, r in enumerate(real):
    tail = r[s:]
    out_ids[i, width - len(tail):], out_mask[i, width - len(tail):] = tail, True
  return out_ids, out_mask, s


def records_routes(config: ModelConfig) -> bool:
  """Whether the sampler records each token's experts (a mixture of experts with routing replay on)."""
  return config.moe is not None and config.moe.routing_replay


def empty_routes(config: ModelConfig, rows: int, width: int) -> jax.Array:
  """[rows, width, L_moe, k] expert ids, all E ("not recorded": the learner routes those tokens itself)."""
  m = config.moe
  shape = (rows, width, sum(config.moe_layers), m.experts_per_token)
  return jnp.full(shape, m.num_experts, expert_id_dtype(m.num_experts))


def _decode_rows(model: CachedModel, state: DecodeState, tok, prefix: PrefixCache, prompt_len, choose_column, ends,
                 b: int, constrain, routes=None):
  """3. Decode every row at once: one token per iteration for all B rows, until every row is done.
  The completion cache (one per row) grows in stages, so a step attends over the slots written so
  far (rounded up to its stage), not all T. Token t is written at slot t - 1: the cache's index
  follows t. routes: None, or [B, T, L_moe, k], where the step feeding token t - 1 writes its
  experts. Returns the state, the rows' lengths [B] and the routes."""
  rows_cache = DecodeCache.init(model.config, b, ends[0]).constrain(constrain)

  def cond(carry):
    t, _, _, state, _ = carry
    return (t < end) & ~jnp.all(state.done)

  def body(carry):
    t, tok, cache, state, routes = carry
    logits, cache, step_routes = model.step(tok, prompt_len + t - 1, ~state.done, cache, prefix)
    if routes is not None:
      routes = jax.lax.dynamic_update_slice_in_dim(routes, step_routes[:, None].astype(routes.dtype), t - 1, axis=1)
      routes = constrain(routes, ("batch",) + (None,) * (routes.ndim - 1))
    state, tok = choose_column(state, logits, t)
    return (t + 1, tok, cache.constrain(constrain), state, routes)

  carry = (jnp.int32(1), tok, rows_cache, state, routes)
  for k, end in enumerate(ends):
    if k:   # grow the cache to this stage's slots (a copy per stage, not per step)
      t, tok, cache, state, routes = carry
      carry = (t, tok, cache.grow(end - ends[k - 1]).constrain(constrain), state, routes)
    carry = jax.lax.while_loop(cond, body, carry)
  state, routes = carry[-2], carry[-1]
  return state, jnp.sum(state.mask, axis=-1, dtype=jnp.int32), routes


def stage_ends(t_new: int) -> tuple[int, ...]:
  """Token counts at which the completion cache grows (the cache stages): up to _STAGES equal
  parts of at least _MIN_STAGE tokens. The stage ending at `end` has a completion cache of
  `end` slots (token t is written at slot t - 1)."""
  n = max(1, min(_STAGES, t_new // _MIN_STAGE))
  return tuple(-(-t_new * (k + 1) // n) for k in range(n))


def sampler_metrics(rollout: Rollout, sp: SamplingParams) -> dict[str, jax.Array]:
  """The decode loop's figures, from a rollout of the sampler (`rollout.decode_step` set).

  sampler/decode_steps: the steps the decode loop ran (each computes every decode slot).
  sampler/slot_utilisation: tokens the loop chose (every token after a row's first, which comes
    from the prefill) / (decode slots x decode steps): the share of the decode compute that made
    a real token. 1 when no slot ever idles; with one slot per row, the mean completion length
    over the longest (roughly).
  """
  steps = jnp.max(rollout.decode_step).astype(jnp.float32)
  decoded = jnp.sum(jnp.maximum(rollout.lengths - 1, 0)).astype(jnp.float32)
  slot_steps = decode_slots(sp, rollout.num_rows) * steps
  return {"sampler/decode_steps": steps, "sampler/slot_utilisation": decoded / jnp.maximum(slot_steps, 1.0)}


# ---- the trainer's single-turn producer ---------------------------------------------------------


def make_generate_fn(spec, mesh: jax.sharding.Mesh | None = None, *, decode_budget_bytes: int | None = None,
                     decode_layout: shd.DecodeLayout | None = None):
  """The single-turn sampler of a train step (`spec`: trainer/step.py StepSpec), as a pure function
  `generate(params, key, prompt_ids [P*O, Lp], prompt_mask) -> Rollout` of P*O*G rows.

  Traced with the decode mesh (`decode_layout`'s reshaping of `mesh`) and the logical-axis rules
  in scope, so every per-row array and the KV cache are split by rows over (data, fsdp) of that
  mesh. decode_budget_bytes: see `decode_params` (None: half the device's memory, as it reports
  it). decode_layout: the weights' layout (default: `decode_layout(spec.model, params, mesh,
  decode_budget_bytes)`, decided from the parameters' shapes when traced; `rljax plan` passes the
  one it decided at the model's full depth). Raises ConfigError when `spec.sampling.slots` does
  not split over the mesh's batch shards like the rows.
  """
  prompts = spec.prompts * spec.oversample
  rows = prompts * spec.group

  def generate(params, key, prompt_ids, prompt_mask) -> Rollout:
    layout = decode_layout or decode_layout_for(spec.model, params, mesh, decode_budget_bytes)
    dmesh = None if mesh is None else layout.mesh(mesh)
    if decode_slots(spec.sampling, rows) < rows:
      check_blocks(spec.sampling.slots, prompts, rows, batch_blocks(dmesh, rows))
    with shd.activate(dmesh):
      out = sample(spec.model, decode_params(spec.model, params, mesh, layout=layout), prompt_ids,
                   prompt_mask, spec.sampling, key, eos_ids=spec.eos_ids, mesh=dmesh)
    return out.rollout()

  if mesh is not None and decode_layout is not None and decode_slots(spec.sampling, rows) < rows:
    check_blocks(spec.sampling.slots, prompts, rows, batch_blocks(decode_layout.mesh(mesh), rows))
  return generate


def device_budget(mesh) -> int | None:
  """Half the memory of `mesh`'s first device as it reports it (None when it reports none: CPU,
  deviceless chips)."""
  try:
    stats = mesh.devices.flat[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 - deviceless (ahead-of-time) devices have no memory stats
    stats = {}
  return stats.get("bytes_limit", 0) // 2 or None


def decode_layout_for(model: ModelConfig, params, mesh, budget_bytes: int | None = None) -> shd.DecodeLayout:
  """The sampler's weight layout (`shd.choose_decode_layout`) for `params` (arrays or
  ShapeDtypeStructs, as the learner stores them) on `mesh`: the compute-dtype copy fits in
  `budget_bytes` per chip (default: half a device's memory, `device_budget`) replicated over data
  and fsdp, or else tensor-parallel over as few chips as fit, or else the fallback."""
  if mesh is None:
    return shd.DecodeLayout()
  budget = device_budget(mesh) if budget_bytes is None else budget_bytes
  shapes = jax.eval_shape(lambda p: decode_cast(model, p), params)
  return shd.choose_decode_layout(param_logical_axes(model), shapes, mesh, budget)


def decode_params(model: ModelConfig, params, mesh, budget_bytes: int | None = None, *,
                  layout: shd.DecodeLayout | None = None):
  """The sampler's copy of the parameters, made once per step device to device: matrices in the
  compute dtype (vectors such as norm scales stay as stored: the learner applies them in float32
  too), laid out by `layout` (default `decode_layout_for(model, params, mesh, budget_bytes)`):
  replicated over data and fsdp and split over tensor (of the decode mesh, which may fold fsdp
  into tensor when the replicated copy does not fit), so a decoded token all-gathers no weights
  (the learner's fsdp layout would gather every layer's weights for every token)."""
  if mesh is None:
    return params
  layout = layout or decode_layout_for(model, params, mesh, budget_bytes)
  cast = decode_cast(model, params)
  axes = param_logical_axes(model)
  if layout.fold > 1:
    # Through the fallback layout on the decode mesh first (embed still split): the learner's
    # split of embed becomes a split of embed and tensor by exchanges within groups of `fold`
    # chips, then an all-gather over fsdp, without a full copy of any weight on a chip.
    staged = dataclasses.replace(layout, fallback=True)
    cast = jax.lax.with_sharding_constraint(cast, staged.shardings(axes, cast, mesh))
  return jax.lax.with_sharding_constraint(cast, layout.shardings(axes, cast, mesh))


class SegmentCopy:
  """`params -> the sampler's copy` (`decode_params`, jitted) for the producers that run the segment
  engine (multi-turn tools, partial rollouts): compute dtype, the decode layout on `mesh`, so a
  decoded token all-gathers no weights. The segment engine constrains nothing to a folded mesh, so
  a layout that would fold is replaced by the fallback. The layout is decided at the first call."""

  def __init__(self, model: ModelConfig, mesh):
    self.model, self.mesh, self._fn = model, mesh, None

  def __call__(self, params):
    if self.mesh is None:
      return params
    if self._fn is None:
      layout = decode_layout_for(self.model, params, self.mesh)
      if layout.fold > 1:
        layout = dataclasses.replace(layout, fold=1, fallback=True)
      self._fn = jax.jit(lambda p: decode_params(self.model, p, self.mesh, layout=layout))
    return self._fn(params)


def decode_cast(model: ModelConfig, params):
  """The parameters as the sampler reads them: matrices in the compute dtype, vectors as stored."""
  return jax.tree.map(lambda p: p.astype(model.compute_dtype) if p.ndim >= 2 else p, params)


class SamplerProducer:
  """The single-turn sampler as a producer (`rljax.rollout.types.Producer`): one jitted program,
  prompts drawn onto `mesh` by rows."""

  def __init__(self, generate, mesh: jax.sharding.Mesh, prompts: int):
    """generate: the jitted `make_generate_fn` program, every rollout array split by rows on `mesh`
    (the trainer's is rljax/trainer/setup.py `generate_program`, which `rljax plan` compiles);
    prompts: P*O, the prompts of one call (all processes)."""
    self.sharding = shd.batch_sharding(mesh, 2, prompts)
    self._generate = generate

  def __call__(self, params, key, prompts) -> tuple[Rollout, RolloutInfo]:
    """Returns as soon as the generation is dispatched (the arrays are not waited for)."""
    batch = prompts.next(self.sharding)
    rollout = self._generate(params, key, batch.ids, batch.mask)
    return rollout, RolloutInfo(examples=list(batch.examples), data_state=batch.data_state, prompt_len=batch.width)

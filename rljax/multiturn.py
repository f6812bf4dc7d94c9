"""Multi-turn tool use: compiled decode segments, tool calls on the host, decoding resumed from the cache.

Shapes: P prompts, G completions per prompt, B = P * G rows (prompt-major), Lp prompt width,
T = sp.max_new_tokens, the trajectory width (model and tool tokens together), S = `slots`
trajectory cache slots per row, W = the widest feed of a round, V vocab.

A trajectory is the row's tokens after its prompt, in order: model turns, tool responses,
model turns, ... `ToolRollout.run` builds B of them:

1. start: every prompt is prefilled once (`decode.prefill`, as in `sampling.sample`); its G
   rows share that prompt cache, read-only, and each row gets its own trajectory cache; each
   row samples its first token. Every token is chosen by `decode.choose`, as in the sampler;
   the state (`TurnState`) is the sampler's `DecodeState` plus the turn bookkeeping.
2. segment (compiled `lax.while_loop`): one token per live row per step. A row pauses when it
   completes a tool call (the format's end marker, or the fence closing a ```python block), stops on a stop
   id, or is done when its trajectory is T tokens long. A segment ends when no row is still
   decoding, or after `segment_tokens` steps, so a row waiting for a tool waits at most one
   segment for the others.
3. host: each paused row's turn is decoded and parsed (`rljax.tools.parse_tool_call`); the
   calls run together in the tool pool (worker processes with timeouts, crash recovery and
   memory limits, `rljax.tools.ToolRunner`); every failure becomes an "Error: ..." observation.
   Observations are wrapped by the chat template (`response_template`) and tokenized.
4. feed (compiled): every live row feeds its pending token (sampled, not yet in the cache) and
   its tool response, if any, at slots [index, index + W) of the existing cache, and samples
   its next token. The history is never prefilled again. Back to 2.

Sampling key k (the k-th segment step or feed, counted over the whole call) is
fold_in(rng, k); feeding a row nothing but its pending token gives it exactly the token the
next decode step would, so the schedule of rounds does not change any row's distribution.
`ToolRollout.run` returns `Trajectories`: host arrays, and on device the `rljax.rollout.Rollout`
the learner trains on.

The trajectory cache is a timeline shared by the rows: a decode step takes one slot of every
row and a feed takes W; slots a row does not use (it was paused or done, or its response was
shorter than W) are masked. Positions count only a row's real tokens, so a trajectory's tokens see
the same positions and the same keys and values as the learner's teacher-forced forward
over [prompt, trajectory]. When the slots run out, the rows still live end truncated.

Memory: the caches are 2 * L * (P * Lp + B * slots) * K * Dh elements of the compute dtype;
slots defaults to 2 * T. (`reprefill`, the baseline and partial rollouts' resume, gives every
row a cache of its whole history instead.)
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from rljax.decode import (DecodeState, SamplingParams, choose, decode_step, empty_caches, forward_cached, isin,
                          pad_token_id, prefill, split_cache, split_layers)
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.models.transformer import Transformer
from rljax.padding import left_pad
from rljax.rollout import Rollout
from rljax.sampling import check_lengths

FEED_BUCKET = 16          # feed widths are rounded up to a multiple of this (fewer compiled shapes)


@dataclasses.dataclass(frozen=True)
class TurnParams:
  """How a multi-turn rollout is bounded. Frozen: a static argument of the compiled pieces.

  max_turns: tool calls per trajectory; a row that asks for one more is ended (`turn_limited`).
  segment_tokens: decode steps per compiled segment (the most a paused row waits for others).
  slots: cache slots after the prompt (0 = 2 * sp.max_new_tokens); see the module doc.
  max_response_tokens: tool-response tokens kept per call (the rest is cut, with a marker).
  end_ids: token-id sequences of the tool call's end marker (its tokenizations, see
    `marker_variants`); a row pauses when its trajectory ends with one.
  fence_ids: for formats whose end marker also opens a call (``` for python): the ids of every
    token whose text contains the fence. A row then pauses on the token that closes a fence
    pair, however the fences were merged with their neighbours ("```python", "\n```").
  forced_width: columns of the per-turn forced-token buffer (0 = no forcing; see `run`).
  """
  max_turns: int = 4
  segment_tokens: int = 64
  slots: int = 0
  max_response_tokens: int = 256
  end_ids: tuple[tuple[int, ...], ...] = ()
  fence_ids: tuple[int, ...] = ()
  forced_width: int = 0

  def validate(self) -> "TurnParams":
    for name in ("max_turns", "segment_tokens", "max_response_tokens"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"tools.{name}={v!r} must be an integer >= 1.")
    if not isinstance(self.slots, int) or self.slots < 0:
      raise ConfigError(f"tools.slots={self.slots!r} must be an integer >= 0 (0 = twice max_new_tokens).")
    if not (self.end_ids and all(self.end_ids)) and not self.fence_ids:
      raise ConfigError("the tool format's end marker tokenized to nothing; check the tokenizer.")
    return self

  def cache_slots(self, sp: SamplingParams) -> int:
    return self.slots or 2 * sp.max_new_tokens


# ---- device side ------------------------------------------------------------------------------


def _suffix_match(buf, n, variants):
  """[B] whether a row's trajectory buf[:n] ends with any of the token sequences `variants`."""
  t = buf.shape[1]
  hit = jnp.zeros(buf.shape[:1], bool)
  for ids in variants:
    idx = n[:, None] - len(ids) + jnp.arange(len(ids))[None, :]
    vals = jnp.take_along_axis(buf, jnp.clip(idx, 0, t - 1), axis=1)
    hit = hit | jnp.all((idx >= 0) & (vals == jnp.asarray(ids, jnp.int32)[None, :]), axis=1)
  return hit


@struct.dataclass
class TurnState(DecodeState):
  """The rollout state: the trajectories ([B, T] `DecodeState` fields: `mask` marks the model's
  tokens), the turn bookkeeping and the caches.

  tool_mask: [B, T] bool, tool-response tokens (context the model reads, not trained on).
  n: [B] int32, trajectory lengths (the column of the next token).
  paused: [B] bool, the row completed a tool call and waits for the host.
  fences: [B] int32, ``` fences seen (formats whose call opens and closes with one marker).
  count: [] int32, choices made; the k-th is drawn with key fold_in(rng, k).
  forced, forced_len, forced_pos: [B, F] int32 / [B] / [B], this turn's forced tokens and how many
    were taken (None without tp.forced_width).
  ks, vs, kv_mask, index, pos: the trajectory caches (L arrays [B, K, Dh, S] / [B, K, S, Dh],
    mask [B, S]), the next slot [] int32 and each row's next position [B] (None before a prefill).
  prefix: the prompt cache (ks [P, ...], vs [P, ...], mask [P, Lp]) that the G rows of each
    prompt read, never copy; None once `reprefill` put each row's prompt into its own cache.
  """
  tool_mask: jax.Array
  n: jax.Array
  paused: jax.Array
  fences: jax.Array
  count: jax.Array
  forced: Any = None
  forced_len: Any = None
  forced_pos: Any = None
  ks: Any = None
  vs: Any = None
  kv_mask: Any = None
  index: Any = None
  pos: Any = None
  prefix: Any = None

  @property
  def context_mask(self) -> jax.Array:
    """[B, T] bool, every trajectory token (the model's and the tools')."""
    return self.mask | self.tool_mask


def new_state(config: ModelConfig, sp: SamplingParams, tp: TurnParams, b: int, forced=None,
              forced_len=None) -> TurnState:
  """B empty trajectories of sp.max_new_tokens columns, without caches (`start` or `reprefill` adds them).

  A caller resuming trajectories (partial rollouts) replaces tokens / mask / logprobs / entropy /
  n / done / stopped, then calls `reprefill`.
  """
  t = sp.max_new_tokens
  forcing = {}
  if tp.forced_width:
    forcing = dict(forced=forced, forced_len=forced_len, forced_pos=jnp.zeros((b,), jnp.int32))
  return TurnState.empty(b, t, pad_token_id(config), tool_mask=jnp.zeros((b, t), bool),
                         n=jnp.zeros((b,), jnp.int32), paused=jnp.zeros((b,), bool),
                         fences=jnp.zeros((b,), jnp.int32), count=jnp.zeros((), jnp.int32), **forcing)


def _choose(config: ModelConfig, sp: SamplingParams, tp: TurnParams, stop_ids, state: TurnState, logits, live, rng):
  """`decode.choose` for the `live` rows at their trajectory ends, then the turn flags: a row
  pauses on a completed tool call and is done when its trajectory is full."""
  t_max = state.tokens.shape[1]
  forced = None
  if tp.forced_width:
    fpos = state.forced_pos
    use = live & (fpos < state.forced_len)
    ftok = jnp.take_along_axis(state.forced, jnp.minimum(fpos, tp.forced_width - 1)[:, None], axis=1)[:, 0]
    forced = (use, ftok)
    state = state.replace(forced_pos=fpos + use)
  before = state.stopped
  key = jax.random.fold_in(rng, state.count)
  state, tok = choose(state, logits, state.n, sp, key, stop_ids, pad_token_id(config), live=live, forced=forced)
  stop = state.stopped & ~before
  n = state.n + live
  fences = state.fences
  if tp.fence_ids:
    fence = live & isin(tok, tp.fence_ids)
    fences = fences + fence
    end = fence & (fences % 2 == 0)
  else:
    end = live & _suffix_match(state.tokens, n, tp.end_ids)
  full = live & (n >= t_max)
  return state.replace(n=n, count=state.count + 1, done=state.done | full, paused=state.paused | (end & ~stop & ~full),
                       fences=fences)


@functools.partial(jax.jit, static_argnames=("config", "sp", "tp", "stop_ids"))
def start(config: ModelConfig, sp: SamplingParams, tp: TurnParams, stop_ids, params, prompt_ids, prompt_mask, rng,
          forced=None, forced_len=None):
  """Prefills P prompts once, shares each prompt's cache with its G rows, samples every row's
  first token.

  prompt_ids, prompt_mask: [P, Lp]; forced [B, F] int32 / forced_len [B] when tp.forced_width.
  Returns the rollout state, a `TurnState` with its trajectory caches and the prompt cache.
  """
  g = sp.num_samples
  fan = lambda x: jnp.repeat(x, g, axis=0, total_repeat_length=x.shape[0] * g)
  cache, logits = prefill(config, params, prompt_ids, prompt_mask, prompt_ids.shape[1])
  b, slots = prompt_ids.shape[0] * g, tp.cache_slots(sp)
  pos = fan(jnp.sum(prompt_mask, axis=-1, dtype=jnp.int32))
  ks, vs, kv_mask = empty_caches(config, b, slots)
  live = pos > 0
  state = new_state(config, sp, tp, b, forced, forced_len).replace(
      ks=ks, vs=vs, kv_mask=kv_mask, index=jnp.zeros((), jnp.int32), pos=pos,
      prefix=(*split_cache(config, cache), cache.kv_mask), done=~live)
  return _choose(config, sp, tp, stop_ids, state, fan(logits), live, rng)


@functools.partial(jax.jit, static_argnames=("config", "sp", "tp", "stop_ids"), donate_argnames=("state",))
def segment(config: ModelConfig, sp: SamplingParams, tp: TurnParams, stop_ids, params, state, rng):
  """Decodes at most tp.segment_tokens steps, until no row is live and unpaused or slots run out."""
  layer_params = split_layers(params["layers"], config.num_layers)
  slots = state.kv_mask.shape[1]
  decoding = lambda s: ~s.done & ~s.paused

  def cond(carry):
    step, s = carry
    return (step < tp.segment_tokens) & jnp.any(decoding(s)) & (s.index < slots)

  def body(carry):
    step, s = carry
    live = decoding(s)
    pending = jnp.take_along_axis(s.tokens, jnp.maximum(s.n - 1, 0)[:, None], axis=1)[:, 0]
    logits, ks, vs, kv_mask = decode_step(config, params, layer_params, pending, s.pos, live, s.ks, s.vs, s.kv_mask,
                                          s.index, s.prefix)
    s = s.replace(ks=ks, vs=vs, kv_mask=kv_mask, index=s.index + 1, pos=s.pos + live)
    return step + 1, _choose(config, sp, tp, stop_ids, s, logits, live, rng)

  return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


@functools.partial(jax.jit, static_argnames=("config", "sp", "tp", "stop_ids"), donate_argnames=("state",))
def feed(config: ModelConfig, sp: SamplingParams, tp: TurnParams, stop_ids, params, state, rng, tokens, lengths,
         finish, forced=None, forced_len=None, new_turn=None):
  """Feeds every live row its pending token and tool response, then samples its next token.

  tokens: [B, W] int32, row b = [pending_b, response_b..., pad]; lengths: [B] int32, tokens fed
  (1 + response length; 0 for rows not live); finish: [B] bool, rows the host ends (turn
  limit). The responses are appended to the trajectories as context (not model) tokens. With
  tp.forced_width, rows in new_turn [B] bool get the forced tokens forced [B, F] / forced_len [B].
  """
  layer_params = split_layers(params["layers"], config.num_layers)
  b, w = tokens.shape
  t_max = state.tokens.shape[1]
  done = state.done | finish
  feeding = ~done & (lengths > 0)
  lengths = jnp.where(feeding, lengths, 0)
  # Response tokens (columns 1..) go into the trajectory after the pending token.
  n = state.n
  resp = jnp.arange(1, w)[None, :] < lengths[:, None]                # [B, W-1]
  cols = jnp.where(resp, n[:, None] + jnp.arange(w - 1)[None, :], t_max)
  rows = jnp.arange(b)[:, None]
  tok = state.tokens.at[rows, cols].set(tokens[:, 1:], mode="drop")
  tool_mask = state.tool_mask.at[rows, cols].set(True, mode="drop")
  n = n + jnp.maximum(lengths - 1, 0)
  mask = jnp.arange(w)[None, :] < lengths[:, None]
  positions = state.pos[:, None] + jnp.arange(w)[None, :]
  hidden, ks, vs, kv_mask = forward_cached(config, params, layer_params, tokens, positions, mask, state.ks, state.vs,
                                           state.kv_mask, state.index, state.prefix)
  last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
  logits = Transformer(config).apply({"params": params}, last, method=Transformer.hidden_to_logits)
  full = feeding & (n >= t_max)
  state = state.replace(tokens=tok, tool_mask=tool_mask, n=n, ks=ks, vs=vs, kv_mask=kv_mask, index=state.index + w,
                        pos=state.pos + lengths, done=done | full, paused=jnp.zeros_like(done))
  if tp.forced_width:
    state = _new_turn_forcing(state, forced, forced_len, new_turn)
  return _choose(config, sp, tp, stop_ids, state, logits, feeding & ~full, rng)


def _new_turn_forcing(state, forced, forced_len, new_turn):
  """Rows starting a new model turn take their forced tokens; the others keep their own."""
  return state.replace(forced=jnp.where(new_turn[:, None], forced, state.forced),
                       forced_len=jnp.where(new_turn, forced_len, state.forced_len),
                       forced_pos=jnp.where(new_turn, 0, state.forced_pos))


@functools.partial(jax.jit, static_argnames=("config", "sp", "tp", "stop_ids", "slots"))
def reprefill(config: ModelConfig, sp: SamplingParams, tp: TurnParams, stop_ids, params, state, rng, history,
              history_mask, slots: int):
  """The baseline `feed` avoids: a fresh cache from prefilling every row's whole history.

  history, history_mask: [B, Lh] the prompt and trajectory so far, left-padded. Every live
  row samples its next token from the prefill's logits; the trajectory state is kept.
  """
  cache, logits = prefill(config, params, history, history_mask, history.shape[1] + slots)
  ks, vs = split_cache(config, cache)
  live = ~state.done
  # Each row's cache now holds its prompt: no shared prefix.
  state = state.replace(ks=ks, vs=vs, kv_mask=cache.kv_mask, index=jnp.asarray(history.shape[1], jnp.int32),
                        pos=jnp.sum(history_mask, axis=-1, dtype=jnp.int32), paused=jnp.zeros_like(live), prefix=None)
  return _choose(config, sp, tp, stop_ids, state, logits, live, rng)


# ---- host side --------------------------------------------------------------------------------


def marker_variants(tokenizer, marker: str) -> tuple[tuple[int, ...], ...]:
  """Token sequences that end a text with `marker`, as the tokenizer writes it after common contexts.

  BPE merges a marker with the characters around it ("\\n```" may be one token), so the marker
  is tokenized after "", " ", "\\n", ".\\n", "\\n\\n" and before "" and "\\n", and each time the
  shortest tail that still decodes to text containing the marker is kept. A single special token (Qwen's </tool_call>) gives one variant.
  """
  out = []
  for before in ("", " ", "\n", ".\n", "\n\n", "}", "}}"):
    for after in ("", "\n"):   # a newline may merge into the marker's last token
      ids = list(tokenizer.encode(before + marker + after))
      for k in range(len(ids) - 1, -1, -1):
        if marker in tokenizer.decode(ids[k:], skip_special_tokens=False):
          tail = tuple(int(i) for i in ids[k:])
          if tail not in out:
            out.append(tail)
          break
  return tuple(out)


def tokens_containing(tokenizer, text: str) -> tuple[int, ...]:
  """Ids of every vocabulary token whose decoded text contains `text`."""
  return tuple(i for i in range(tokenizer.vocab_size) if text in tokenizer.decode([i], skip_special_tokens=False))


def response_template(tokenizer, fmt: str) -> tuple[str, str]:
  """(prefix, suffix) text around a tool observation, as the chat template renders a tool turn.

  For "hermes" the model's turn ends right after its </tool_call>; what follows until the model
  speaks again is the template's own rendering of a tool message (for Qwen: "<|im_end|>\\n
  <|im_start|>user\\n<tool_response>\\n", the observation, "\\n</tool_response><|im_end|>\\n
  <|im_start|>assistant\\n"). Templates without a tool role fall back to an inline
  <tool_response> block. "python" observations go inline in an <interpreter> block (ReTool).
  """
  if fmt == "python":
    return "\n<interpreter>\n", "\n</interpreter>\n"
  fallback = ("\n<tool_response>\n", "\n</tool_response>\n")
  apply = getattr(tokenizer, "apply_chat_template", None)
  if apply is None:
    return fallback
  turn, obs = "\x00TURN\x00", "\x00OBS\x00"
  messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": turn},
              {"role": "tool", "content": obs}]
  try:
    text = apply(messages, add_generation_prompt=True, tokenize=False)
  except Exception:  # noqa: BLE001 - a template without a tool role
    return fallback
  if not isinstance(text, str) or text.count(turn) != 1 or text.count(obs) != 1 or text.index(turn) > text.index(obs):
    return fallback
  between = text[text.index(turn) + len(turn):]
  prefix, suffix = between.split(obs)
  return prefix, suffix


@dataclasses.dataclass
class Trajectories:
  """B trajectories of a multi-turn rollout (numpy, rows prompt-major).

  tokens: [B, T] int32, the trajectory after the prompt (pad after `lengths`).
  model_mask: [B, T] bool, tokens the model generated (trained); context_mask: [B, T] bool,
    every trajectory token (model and tool); logprobs / entropy: [B, T] f32 on model tokens.
  lengths: [B] trajectory lengths; truncated: [B] ran out of tokens or slots without stopping;
  turn_limited: [B] ended for asking more than max_turns tool calls.
  turns: [B] tool calls made; tool_errors: [B] calls that returned an error observation.
  rollout: the trajectories on device as the learner's `Rollout` (prompts repeated for their G
    rows; `lengths` are trajectory lengths, model and tool tokens, as the verifiers read them).
  """
  tokens: np.ndarray
  model_mask: np.ndarray
  context_mask: np.ndarray
  logprobs: np.ndarray
  entropy: np.ndarray
  lengths: np.ndarray
  truncated: np.ndarray
  turn_limited: np.ndarray
  turns: np.ndarray
  tool_errors: np.ndarray
  metrics: dict[str, float]
  rollout: Rollout | None = None      # on device, prompts fanned out to the G rows: what the learner trains on


class ToolRollout:
  """Runs multi-turn rollouts of one model with a `ToolRunner` (see the module doc).

      runner = ToolRunner(["python"], timeout_s=5)
      rollout = ToolRollout(policy.config, tokenizer, runner, sp, TurnParams(...), fmt="python")
      traj = rollout.run(params, prompt_ids, prompt_mask, jax.random.key(0))

  resume="cache" feeds only the new tokens each round; "reprefill" rebuilds the cache from the
  whole history each round (the slower baseline, for benchmarks and tests).
  """

  def __init__(self, config: ModelConfig, tokenizer, runner, sp: SamplingParams, tp: TurnParams | None = None, *,
               fmt: str = "hermes", eos_ids: Sequence[int] = (), resume: str = "cache"):
    from rljax.tools import FORMATS, end_markers
    if fmt not in FORMATS:
      raise ConfigError(f"tools.format={fmt!r} is not one of {FORMATS}.")
    if resume not in ("cache", "reprefill"):
      raise ConfigError(f"resume={resume!r} must be 'cache' or 'reprefill'.")
    tp = tp or TurnParams()
    if not tp.end_ids and not tp.fence_ids:
      start_marker, end_marker = end_markers(fmt)
      if start_marker.startswith(end_marker):   # ``` opens and closes a block: count fences
        tp = dataclasses.replace(tp, fence_ids=tokens_containing(tokenizer, end_marker))
      else:
        tp = dataclasses.replace(tp, end_ids=marker_variants(tokenizer, end_marker))
    self.config, self.tokenizer, self.runner, self.sp, self.tp = config, tokenizer, runner, sp, tp.validate()
    self.fmt, self.resume = fmt, resume
    self.stop_ids = tuple(sorted({int(i) for i in eos_ids} | set(sp.stop_token_ids)))
    self.wrap = response_template(tokenizer, fmt)

  def _response_ids(self, text: str) -> list[int]:
    prefix, suffix = self.wrap
    return list(self.tokenizer.encode(prefix + text + suffix))

  def _forced(self, script, rows: Sequence[int], turn: np.ndarray):
    f = self.tp.forced_width
    forced = np.zeros((len(turn), f), np.int32)
    forced_len = np.zeros((len(turn),), np.int32)
    for r in rows:
      ids = script(r, int(turn[r])) if script is not None else None
      if ids:
        if len(ids) > f:
          raise ConfigError(f"script gave {len(ids)} forced tokens for row {r}, more than forced_width={f}.")
        forced[r, :len(ids)], forced_len[r] = ids, len(ids)
    return jnp.asarray(forced), jnp.asarray(forced_len)

  def run(self, params, prompt_ids, prompt_mask, rng, *,
          script: Callable[[int, int], Sequence[int] | None] | None = None) -> Trajectories:
    """B = P * G trajectories for prompts [P, Lp] (left-padded, mask [P, Lp]); rng a PRNG key.

    script(row, turn) -> token ids or None: tokens the row must emit at the start of model turn
    `turn` (0 = the first), instead of sampling; their log-probs are still the model's (replay
    of a transcript, an assistant prefix, or scripted tool calls in tests). Needs
    tp.forced_width >= the longest script.
    """
    c, sp, tp = self.config, self.sp, self.tp
    prompt_ids, prompt_mask = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, bool)
    check_lengths(c, sp, prompt_ids.shape[1])
    t0 = time.perf_counter()
    p = prompt_ids.shape[0]
    b = p * sp.num_samples
    turn = np.zeros(b, np.int64)
    errors = np.zeros(b, np.int64)
    ended = np.zeros(b, bool)
    history: list[list[str]] = [[] for _ in range(b)]
    turn_start = np.zeros(b, np.int64)
    forced = self._forced(script, range(b), turn) if tp.forced_width else (None, None)
    state = start(c, sp, tp, self.stop_ids, params, prompt_ids, prompt_mask, rng, *forced)
    counts = {"segments": 0, "feeds": 0, "tool_calls": 0, "tool_errors": 0, "false_triggers": 0}
    tool_s = 0.0
    while True:
      state = segment(c, sp, tp, self.stop_ids, params, state, rng)
      counts["segments"] += 1
      n, done, paused, index = jax.device_get((state.n, state.done, state.paused, state.index))
      live = ~done
      if not live.any() or index >= state.kv_mask.shape[1]:
        break
      if not paused.any():
        continue          # the segment hit its step limit: decode on
      tok = np.asarray(jax.device_get(state.tokens))   # the host needs the paused rows' text
      # Parse and run the calls of the paused rows.
      from rljax.tools import parse_tool_call
      finish = np.zeros(b, bool)
      calls: list[tuple[int, Any]] = []
      for r in np.flatnonzero(paused & live):
        text = self.tokenizer.decode(tok[r, turn_start[r]:n[r]].tolist(), skip_special_tokens=False)
        call = parse_tool_call(text, self.fmt)
        if call is None:
          counts["false_triggers"] += 1
          continue
        if turn[r] >= tp.max_turns:
          finish[r], ended[r] = True, True
          continue
        calls.append((r, call))
      responses: dict[int, list[int]] = {}   # rows starting a new model turn -> their tool response
      if calls:
        ts = time.perf_counter()
        obs = self.runner.run([call for _, call in calls], [history[r] for r, _ in calls])
        tool_s += time.perf_counter() - ts
        for (r, call), o in zip(calls, obs):
          turn[r] += 1
          errors[r] += bool(o.error)
          counts["tool_calls"] += 1
          counts["tool_errors"] += bool(o.error)
          if call.name == "python" and not call.error and not o.error:   # a cell that timed out is not replayed
            history[r].append(call.arguments.get("code", ""))
          room = sp.max_new_tokens - int(n[r]) - 1        # keep a token for the model to answer
          responses[r] = self._response_ids(self._clip(o.text))[:max(room, 0)]
      # Feed: every live row its pending token, and the rows with a response that too.
      fed = np.flatnonzero(live & ~finish)
      lengths = np.zeros(b, np.int32)
      lengths[fed] = 1
      for r, resp in responses.items():
        lengths[r] += len(resp)
      width = -(-max(int(lengths.max()), 1) // FEED_BUCKET) * FEED_BUCKET
      feed_tok = np.zeros((b, width), np.int32)
      feed_tok[fed, 0] = tok[fed, n[fed] - 1]
      for r, resp in responses.items():
        feed_tok[r, 1:1 + len(resp)] = resp
        turn_start[r] = n[r] + len(resp)
      next_forced = (None, None, None)
      if tp.forced_width:
        new_turn = np.zeros(b, bool)
        new_turn[list(responses)] = True
        next_forced = self._forced(script, list(responses), turn) + (jnp.asarray(new_turn),)
      if self.resume == "cache":
        state = feed(c, sp, tp, self.stop_ids, params, state, rng, jnp.asarray(feed_tok), jnp.asarray(lengths),
                     jnp.asarray(finish), *next_forced)
      else:
        state = self._reprefill(params, state, rng, prompt_ids, prompt_mask, feed_tok, lengths, finish,
                                next_forced)
      counts["feeds"] += 1
    return self._finish(state, prompt_ids, prompt_mask, turn, errors, ended, counts, tool_s, time.perf_counter() - t0)

  def _clip(self, text: str) -> str:
    ids = self.tokenizer.encode(text)
    if len(ids) <= self.tp.max_response_tokens:
      return text
    return self.tokenizer.decode(ids[:self.tp.max_response_tokens]) + "\n... (truncated)"

  def _reprefill(self, params, state, rng, prompt_ids, prompt_mask, feed_tok, lengths, finish, forced):
    """The baseline round: append the responses on the host, prefill every row's history afresh."""
    g = self.sp.num_samples
    tok, n, done = (np.asarray(x) for x in jax.device_get((state.tokens, state.n, state.done)))
    pids, pmask = np.repeat(np.asarray(prompt_ids), g, 0), np.repeat(np.asarray(prompt_mask), g, 0)
    done = done | finish
    rows = []
    for r in range(tok.shape[0]):
      resp = feed_tok[r, 1:lengths[r]] if lengths[r] else []
      rows.append(list(pids[r][pmask[r]]) + list(tok[r, :n[r]]) + list(resp))
    hist, hmask = left_pad(rows, 0, multiple=FEED_BUCKET)
    # The trajectory gets the responses as tool tokens, as `feed` does.
    t_max = tok.shape[1]
    new_tok, tool = tok.copy(), np.asarray(jax.device_get(state.tool_mask)).copy()
    new_n = n.copy()
    for r in range(tok.shape[0]):
      resp = feed_tok[r, 1:lengths[r]] if lengths[r] and not done[r] else []
      new_tok[r, n[r]:n[r] + len(resp)], tool[r, n[r]:n[r] + len(resp)] = resp, True
      new_n[r] = n[r] + len(resp)
    done = done | (new_n >= t_max)
    state = state.replace(tokens=jnp.asarray(new_tok), tool_mask=jnp.asarray(tool), n=jnp.asarray(new_n, jnp.int32),
                          done=jnp.asarray(done))
    if forced[0] is not None:
      state = _new_turn_forcing(state, *forced)
    slots = self.tp.cache_slots(self.sp)
    return reprefill(self.config, self.sp, self.tp, self.stop_ids, params, state, rng, jnp.asarray(hist),
                     jnp.asarray(hmask), slots=slots)

  def _finish(self, state: TurnState, prompt_ids, prompt_mask, turn, errors, ended, counts, tool_s,
              seconds) -> Trajectories:
    context = state.context_mask
    tok, model, ctx, lp, ent, n, stopped = (np.asarray(x) for x in jax.device_get(
        (state.tokens, state.mask, context, state.logprobs, state.entropy, state.n, state.stopped)))
    truncated = ~stopped & ~ended
    b = tok.shape[0]
    metrics = {
        "tools/turns_mean": float(turn.mean()) if b else 0.0,
        "tools/calls": float(counts["tool_calls"]),
        "tools/errors": float(counts["tool_errors"]),
        "tools/error_rate": counts["tool_errors"] / max(counts["tool_calls"], 1),
        "tools/seconds": tool_s,
        "tools/latency_s": tool_s / max(counts["tool_calls"], 1),
        "tools/segments": float(counts["segments"]),
        "tools/feeds": float(counts["feeds"]),
        "tools/false_triggers": float(counts["false_triggers"]),
        "tools/turn_limited": float(ended.sum()),
        "tools/tool_token_fraction": float((ctx & ~model).sum() / max(ctx.sum(), 1)),
        "tools/rollout_seconds": seconds,
    }
    g = self.sp.num_samples
    fan = lambda x: jnp.repeat(x, g, axis=0, total_repeat_length=x.shape[0] * g)
    rollout = Rollout(prompt_ids=fan(prompt_ids), prompt_mask=fan(prompt_mask), tokens=state.tokens, mask=state.mask,
                      context_mask=context, logprobs=state.logprobs, entropy=state.entropy, lengths=state.n,
                      truncated=jnp.asarray(truncated), group_size=g)
    return Trajectories(tokens=tok, model_mask=model, context_mask=ctx, logprobs=lp, entropy=ent, lengths=n,
                        truncated=truncated, turn_limited=ended, turns=turn, tool_errors=errors, metrics=metrics,
                        rollout=rollout)

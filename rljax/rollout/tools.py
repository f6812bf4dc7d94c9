"""Multi-turn tool use: decode segments on the device, tool calls on the host, decoding resumed
from the cache (docs/tools.md).

Shapes: P prompts, G completions per prompt, B = P * G rows (prompt-major), Lp prompt width,
T = sp.max_new_tokens, the trajectory width (model and tool tokens together), V vocab.

A trajectory is the row's tokens after its prompt: model turns, tool responses, model turns, ...
`ToolRollout.run` builds B of them with the segment engine (rljax/rollout/segments.py):

1. start: every prompt is prefilled once, its G rows share that prompt cache; every row samples
   its first token.
2. segment: decoding until no row is still decoding (each has paused on a completed tool call,
   the format's end marker or the fence closing a ```python block, stopped, or filled its
   trajectory), or after `segment_tokens` steps, so a row waiting for a tool waits at most one
   segment for the others.
3. host: each paused row's turn is decoded and parsed (`rljax.tools.parse_tool_call`); the calls
   run together in the tool pool (worker processes with timeouts, crash recovery and memory
   limits, `rljax.tools.ToolRunner`); every failure becomes an "Error: ..." observation.
   Observations are wrapped by the chat template (`response_template`) and tokenized.
4. feed: every live row feeds its pending token and its tool response, if any, into its existing
   cache, and samples its next token. The history is never prefilled again. Back to 2.

When the cache slots run out, the rows still live end truncated. Memory: the caches are
2 * L * (P * Lp + B * slots) * K * Dh elements of the compute dtype; slots defaults to 2 * T.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding as shd
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.rollout import segments
from rljax.rollout.decode import Draw
from rljax.rollout.draw import SamplingParams
from rljax.rollout.sampler import SegmentCopy, check_lengths
from rljax.rollout.types import Rollout, RolloutInfo, by_rows
from rljax.tools import FORMATS, end_markers, parse_tool_call


@dataclasses.dataclass(frozen=True)
class TurnParams:
  """How a multi-turn rollout is bounded (config.tools).

  max_turns: tool calls per trajectory; a row that asks for one more is ended (`turn_limited`).
  segment_tokens: decode steps per compiled segment (the most a paused row waits for others).
  slots: cache slots after the prompt (0 = 2 * sp.max_new_tokens); see the module doc.
  max_response_tokens: tool-response tokens kept per call (the rest is cut, with a marker).
  end_ids / fence_ids: the tool call's end marker as the segment engine looks for it
    (`rljax.rollout.segments.SegmentParams`); empty: derived from the format and the tokenizer
    (`marker_variants`, `tokens_containing`).
  """
  max_turns: int = 4
  segment_tokens: int = 64
  slots: int = 0
  max_response_tokens: int = 256
  end_ids: tuple[tuple[int, ...], ...] = ()
  fence_ids: tuple[int, ...] = ()

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

  @property
  def segments(self) -> segments.SegmentParams:
    """The segment engine's parameters: a row pauses on the end marker."""
    return segments.SegmentParams(self.segment_tokens, self.end_ids, self.fence_ids)


# ---- markers and templates ---------------------------------------------------------------------


def marker_variants(tokenizer, marker: str) -> tuple[tuple[int, ...], ...]:
  """Token sequences that end a text with `marker`, as the tokenizer writes it after common contexts.

  BPE merges a marker with the characters around it ("\\n```" may be one token), so the marker
  is tokenized after "", " ", "\\n", ".\\n", "\\n\\n" and before "" and "\\n", and each time the
  shortest tail that still decodes to text containing the marker is kept. A single special token
  (Qwen's </tool_call>) gives one variant.
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


# ---- the rollout -------------------------------------------------------------------------------


@dataclasses.dataclass
class Trajectories:
  """B trajectories of a multi-turn rollout (numpy, rows prompt-major).

  tokens: [B, T] int32, the trajectory after the prompt (pad after `lengths`).
  model_mask: [B, T] bool, tokens the model generated (trained); context_mask: [B, T] bool,
    every trajectory token (model and tool); logprobs / entropy: [B, T] f32 on model tokens.
  lengths: [B] trajectory lengths; truncated: [B] ran out of tokens or slots without stopping;
  turn_limited: [B] ended for asking more than max_turns tool calls.
  turns: [B] tool calls made; tool_errors: [B] calls that returned an error observation.
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


class ToolRollout:
  """Runs multi-turn rollouts of one model with a `ToolRunner` (see the module doc).

      runner = ToolRunner(["python"], timeout_s=5)
      tools = ToolRollout(policy.config, tokenizer, runner, sp, TurnParams(...), fmt="python")
      rollout, info = tools.run(params, prompt_ids, prompt_mask, jax.random.key(0))
      info.trajectories.turns     # [B] tool calls per trajectory

  draw: how tokens are drawn (`rljax.rollout.decode.Draw`; default `sample_logits`). A hashable
  static value: the tests force scripted tool calls into a random model's turns with it.
  """

  def __init__(self, config: ModelConfig, tokenizer, runner, sp: SamplingParams, tp: TurnParams | None = None, *,
               fmt: str = "hermes", eos_ids: Sequence[int] = (), draw: Draw | None = None):
    if fmt not in FORMATS:
      raise ConfigError(f"tools.format={fmt!r} is not one of {FORMATS}.")
    tp = tp or TurnParams()
    if not tp.end_ids and not tp.fence_ids:
      start_marker, end_marker = end_markers(fmt)
      if start_marker.startswith(end_marker):   # ``` opens and closes a block: count fences
        tp = dataclasses.replace(tp, fence_ids=tokens_containing(tokenizer, end_marker))
      else:
        tp = dataclasses.replace(tp, end_ids=marker_variants(tokenizer, end_marker))
    self.config, self.tokenizer, self.runner, self.sp, self.tp = config, tokenizer, runner, sp, tp.validate()
    self.fmt, self.draw = fmt, draw
    self.stop_ids = tuple(sorted({int(i) for i in eos_ids} | set(sp.stop_token_ids)))
    self.wrap = response_template(tokenizer, fmt)

  def _response_ids(self, text: str) -> list[int]:
    prefix, suffix = self.wrap
    return list(self.tokenizer.encode(prefix + text + suffix))

  def _static(self):
    return self.config, self.sp, self.tp.segments, self.stop_ids

  def run(self, params, prompt_ids, prompt_mask, rng) -> tuple[Rollout, RolloutInfo]:
    """B = P * G trajectories for prompts [P, Lp] (left-padded, mask [P, Lp]); rng a PRNG key.

    Returns the `Rollout` the learner trains on (on device; prompts repeated for their G rows;
    `lengths` are trajectory lengths, model and tool tokens, as the verifiers read them) and a
    `RolloutInfo` with the host `Trajectories` and the tools/* metrics.

    Multi-process (prompts a global array whose rows span processes): each process parses and
    runs the tool calls of the rows its devices hold and its `Trajectories` are those rows; the
    decisions that start a program on every process (decode on, feed a round) are agreed, so the
    trajectories are those of one process running all rows. The metrics cover every process.
    """
    sp, tp = self.sp, self.tp
    rows = shd.ProcessRows.of_prompts(prompt_ids, sp.num_samples)
    prompt_ids, prompt_mask = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, bool)
    check_lengths(self.config, sp, prompt_ids.shape[1])
    t0 = time.perf_counter()
    state = segments.start(*self._static(), params, prompt_ids, prompt_mask, rng, slots=tp.cache_slots(sp),
                           draw=self.draw)
    b = len(rows.index) if rows.multi else rows.rows     # this process's rows (all B in one process)
    turn = np.zeros(b, np.int64)
    errors = np.zeros(b, np.int64)
    ended = np.zeros(b, bool)
    history: list[list[str]] = [[] for _ in range(b)]
    turn_start = np.zeros(b, np.int64)
    counts = {"segments": 0, "feeds": 0, "tool_calls": 0, "tool_errors": 0, "false_triggers": 0}
    tool_s = 0.0
    while True:
      state = segments.segment(*self._static(), params, state, rng, draw=self.draw)
      counts["segments"] += 1
      n, done, paused = rows.local(state.n, state.done, state.paused)
      live = ~done
      if not rows.any(live.any()) or shd.local_value(state.cache.index) >= state.cache.slots:
        break
      if not rows.any(paused.any()):
        continue          # the segment hit its step limit: decode on
      tok = rows.local(state.tokens)   # the host needs the paused rows' text
      # Parse and run the calls of the paused rows.
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
      width = rows.max(max(int(lengths.max(initial=0)), 1))
      width = -(-width // segments.FEED_BUCKET) * segments.FEED_BUCKET
      feed_tok = np.zeros((b, width), np.int32)
      feed_tok[fed, 0] = tok[fed, n[fed] - 1]
      for r, resp in responses.items():
        feed_tok[r, 1:1 + len(resp)] = resp
        turn_start[r] = n[r] + len(resp)
      state = self.resume(params, state, rng, rows.put(feed_tok), rows.put(lengths), rows.put(finish), prompt_ids,
                          prompt_mask)
      counts["feeds"] += 1
    return self._finish(state, rows, prompt_ids, prompt_mask, turn, errors, ended, counts, tool_s,
                        time.perf_counter() - t0)

  def resume(self, params, state: segments.SegmentState, rng, feed_tok, lengths, finish, prompt_ids, prompt_mask):
    """Resumes decoding after a round of tool calls: feed_tok [B, W] (each live row's pending
    token, then its response), lengths [B], finish [B] (rows the host ends), fed into the cache;
    arrays of all B rows (global arrays in a multi-process run: `sharding.ProcessRows.put`)."""
    del prompt_ids, prompt_mask   # the cache holds them
    return segments.feed(*self._static(), params, state, rng, jnp.asarray(feed_tok), jnp.asarray(lengths),
                         jnp.asarray(finish), draw=self.draw)

  def _clip(self, text: str) -> str:
    ids = self.tokenizer.encode(text)
    if len(ids) <= self.tp.max_response_tokens:
      return text
    return self.tokenizer.decode(ids[:self.tp.max_response_tokens]) + "\n... (truncated)"

  def _finish(self, state: segments.SegmentState, rows: shd.ProcessRows, prompt_ids, prompt_mask, turn, errors,
              ended, counts, tool_s, seconds) -> tuple[Rollout, RolloutInfo]:
    context = state.context_mask
    tok, model, ctx, lp, ent, n, stopped = rows.local(
        state.tokens, state.mask, context, state.logprobs, state.entropy, state.n, state.stopped)
    truncated = ~stopped & ~ended
    # Per-process figures summed over processes (the same numbers in a one-process run).
    every = rows.sum({"tool_calls": counts["tool_calls"], "tool_errors": counts["tool_errors"],
                      "false_triggers": counts["false_triggers"], "turns": int(turn.sum()), "rows": len(turn),
                      "turn_limited": int(ended.sum()), "tool_tokens": int((ctx & ~model).sum()),
                      "context_tokens": int(ctx.sum()), "tool_s": tool_s})
    calls = every["tool_calls"]
    metrics = {
        "tools/turns_mean": every["turns"] / every["rows"] if every["rows"] else 0.0,
        "tools/calls": float(calls),
        "tools/errors": float(every["tool_errors"]),
        "tools/error_rate": every["tool_errors"] / max(calls, 1),
        "tools/seconds": every["tool_s"],
        "tools/latency_s": every["tool_s"] / max(calls, 1),
        "tools/segments": float(counts["segments"]),
        "tools/feeds": float(counts["feeds"]),
        "tools/false_triggers": float(every["false_triggers"]),
        "tools/turn_limited": float(every["turn_limited"]),
        "tools/tool_token_fraction": every["tool_tokens"] / max(every["context_tokens"], 1),
        "tools/rollout_seconds": seconds,
    }
    g = self.sp.num_samples
    fan = lambda x: jnp.repeat(x, g, axis=0, total_repeat_length=x.shape[0] * g)
    rollout = Rollout(prompt_ids=fan(prompt_ids), prompt_mask=fan(prompt_mask), tokens=state.tokens, mask=state.mask,
                      context_mask=context, logprobs=state.logprobs, entropy=state.entropy, lengths=state.n,
                      truncated=rows.put(truncated), group_size=g)
    traj = Trajectories(tokens=tok, model_mask=model, context_mask=ctx, logprobs=lp, entropy=ent, lengths=n,
                        truncated=truncated, turn_limited=ended, turns=turn, tool_errors=errors)
    return rollout, RolloutInfo(prompt_len=int(prompt_ids.shape[1]), metrics=metrics, trajectories=traj)


class ToolProducer:
  """Multi-turn tool use as a producer (`rljax.rollout.types.Producer`; docs/tools.md).

  Generation alternates compiled decode segments with host tool calls; the update's log-probs
  attend to model and tool tokens (`context_mask`) and train on the model's tokens (`mask`). Each
  trajectory's example gains its `tool_calls` and `tool_errors` (for per-trajectory reward
  components such as the `tool_use` verifier).
  """

  def __init__(self, tools: ToolRollout, mesh: jax.sharding.Mesh, prompts: int):
    """tools: the engine; prompts: P, the prompts of one call (all processes)."""
    self.tools, self.mesh = tools, mesh
    self.sharding = shd.batch_sharding(mesh, 2, prompts)
    self.decode_copy = SegmentCopy(tools.config, mesh)   # the sampler's copy, made once per call

  def __call__(self, params, key, prompts) -> tuple[Rollout, RolloutInfo]:
    batch = prompts.next(self.sharding)
    rollout, info = self.tools.run(self.decode_copy(params), batch.ids, batch.mask, key)
    traj, g = info.trajectories, self.tools.sp.num_samples
    per_row = [dict(batch.examples[r // g], tool_calls=int(traj.turns[r]), tool_errors=int(traj.tool_errors[r]))
               for r in range(len(traj.turns))]
    rollout = jax.device_put(rollout, by_rows(self.mesh, rollout))
    return rollout, dataclasses.replace(info, examples=per_row, data_state=batch.data_state, prompt_len=batch.width)

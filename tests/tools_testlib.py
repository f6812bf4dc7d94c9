"""Test (and benchmark) helpers for multi-turn rollouts.

- `ScriptedDraw`: a token draw (`rljax.rollout.decode.Draw`) that makes rows open given model
  turns with given tokens (a tool call a random model would never write), with the model's own
  log-probs of them recorded; every other token is sampled as usual.
- `PrefillingToolRollout`: the baseline that resuming from the cache avoids: after each round of
  tool calls every row's whole history is prefilled afresh (`rljax.rollout.segments.restart`).
  Used to show that feeding only the new tokens gives the same trajectories, and by
  scripts/bench_multiturn.py to measure what the cache saves.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rljax.padding import left_pad
from rljax.rollout import segments
from rljax.rollout.draw import sample_logits
from rljax.rollout.tools import ToolRollout, TurnParams


@dataclasses.dataclass(frozen=True)
class ScriptedDraw:
  """Forces `script[(row, turn)]` (token ids) at the start of model turn `turn` of row `row`
  (turn 0 = the first; a row's turn is the number of tool responses in its trajectory so far).

  The forced tokens' log-probs are the model's (log_softmax(logits / tau) of the token), as if
  it had sampled them: a replayed transcript, exactly what the learner recomputes.
  """
  script: tuple[tuple[tuple[int, int], tuple[int, ...]], ...]

  @classmethod
  def of(cls, script: dict) -> "ScriptedDraw":
    return cls(tuple(sorted((k, tuple(int(i) for i in v)) for k, v in script.items() if v)))

  def __call__(self, state, logits, sp, key):
    tok, lp, ent = sample_logits(logits, sp, key)
    if not self.script:
      return tok, lp, ent
    rows = 1 + max(r for (r, _), _ in self.script)
    turns = 1 + max(t for (_, t), _ in self.script)
    width = max(len(ids) for _, ids in self.script)
    table, lens = np.zeros((rows, turns, width), np.int32), np.zeros((rows, turns), np.int32)
    for (r, t), ids in self.script:
      table[r, t, :len(ids)], lens[r, t] = ids, len(ids)
    b, t_max = state.tokens.shape
    cols = jnp.arange(t_max)[None, :]
    fed = state.fed & (cols < state.n[:, None])
    starts = fed & ~jnp.pad(fed, ((0, 0), (1, 0)))[:, :-1]            # first token of each response
    turn = jnp.sum(starts, axis=-1)
    pos = state.n - jnp.max(jnp.where(fed, cols + 1, 0), axis=-1)      # tokens since the last response
    row = jnp.arange(b)
    r, u = jnp.minimum(row, rows - 1), jnp.minimum(turn, turns - 1)
    use = (row < rows) & (turn < turns) & (pos < jnp.asarray(lens)[r, u])
    ftok = jnp.asarray(table)[r, u, jnp.clip(pos, 0, width - 1)]
    scaled = logits.astype(jnp.float32) / sp.logprob_temperature
    flp = jnp.take_along_axis(scaled, ftok[:, None], axis=1)[:, 0] - jax.nn.logsumexp(scaled, axis=-1)
    return jnp.where(use, ftok, tok), jnp.where(use, flp, lp), ent


class PrefillingToolRollout(ToolRollout):
  """`ToolRollout` whose rounds rebuild every row's cache from its whole history (module doc)."""

  def resume(self, params, state, rng, feed_tok, lengths, finish, prompt_ids, prompt_mask):
    g = self.sp.num_samples
    tok, n, done = (np.asarray(x) for x in jax.device_get((state.tokens, state.n, state.done)))
    pids, pmask = np.repeat(np.asarray(prompt_ids), g, 0), np.repeat(np.asarray(prompt_mask), g, 0)
    done = done | finish
    rows = []
    for r in range(tok.shape[0]):
      resp = feed_tok[r, 1:lengths[r]] if lengths[r] else []
      rows.append(list(pids[r][pmask[r]]) + list(tok[r, :n[r]]) + list(resp))
    hist, hmask = left_pad(rows, 0, multiple=segments.FEED_BUCKET)
    # The trajectory gets the responses as fed tokens, as `segments.feed` does.
    t_max = tok.shape[1]
    new_tok, fed = tok.copy(), np.asarray(jax.device_get(state.fed)).copy()
    new_n = n.copy()
    for r in range(tok.shape[0]):
      resp = feed_tok[r, 1:lengths[r]] if lengths[r] and not done[r] else []
      new_tok[r, n[r]:n[r] + len(resp)], fed[r, n[r]:n[r] + len(resp)] = resp, True
      new_n[r] = n[r] + len(resp)
    done = done | (new_n >= t_max)
    state = state.replace(tokens=jnp.asarray(new_tok), fed=jnp.asarray(fed), n=jnp.asarray(new_n, jnp.int32),
                          done=jnp.asarray(done))
    return segments.restart(*self._static(), params, state, rng, jnp.asarray(hist), jnp.asarray(hmask),
                            slots=self.tp.cache_slots(self.sp), draw=self.draw)


def scripted_tool_rollout(config, tokenizer, runner, sp, script: dict, *, fmt="hermes", prefill=False, **turn):
  """A tool rollout whose rows open model turns with `script[(row, turn)]` (`ScriptedDraw`), the
  rest sampled; with `prefill`, the re-prefilling baseline. `turn` fields go to TurnParams."""
  cls = PrefillingToolRollout if prefill else ToolRollout
  return cls(config, tokenizer, runner, sp, TurnParams(**turn), fmt=fmt, eos_ids=sp.stop_token_ids,
             draw=ScriptedDraw.of(script))

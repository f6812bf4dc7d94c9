"""Test helpers for multi-turn rollouts: tool calls forced into a random model's turns."""
from __future__ import annotations

from rljax.multiturn import ToolRollout, TurnParams


def scripted_tool_rollout(config, tokenizer, runner, sp, script, *, fmt="hermes", **turn):
  """A tool rollout whose rows open model turn `turn` with the tokens `script[(row, turn)]`
  (a dict, or a callable (row, turn) -> ids or None), the rest sampled."""
  lookup = script if callable(script) else (lambda r, t: script.get((r, t)))
  width = max([len(v) for v in script.values()] if isinstance(script, dict) else [64])
  engine = ToolRollout(config, tokenizer, runner, sp, TurnParams(forced_width=width, **turn), fmt=fmt,
                       eos_ids=sp.stop_token_ids)

  class _Run:
    def run(self, params, ids, mask, key):
      return engine.run(params, ids, mask, key, script=lookup)

  return _Run()

"""`tool_use`: a per-trajectory component from the tool calls of a multi-turn rollout.

The multi-turn trainer (docs/tools.md) adds `tool_calls` and `tool_errors` to each trajectory's
example, so reward components can see how the tools were used, not just the final text.
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.rewards.base import RewardResult, register_verifier


def tool_use_verifier(completion: str, example: Mapping[str, Any], *, per_call: float = 0.0,
                      per_error: float = -1.0, max_calls: int = 0) -> RewardResult:
  """per_call * calls + per_error * failed calls (calls capped at max_calls when > 0).

  E.g. {"name": "tool_errors", "verifier": "tool_use", "weight": 0.1} penalises each call that
  returned an error observation; kwargs={"per_call": 1, "per_error": 0, "max_calls": 1} rewards
  using a tool at all. Examples without the fields (single-turn runs) score 0.
  """
  calls = int(example.get("tool_calls", 0) or 0)
  errors = int(example.get("tool_errors", 0) or 0)
  counted = min(calls, max_calls) if max_calls > 0 else calls
  return RewardResult(per_call * counted + per_error * errors, {"calls": calls, "errors": errors})


register_verifier("tool_use", tool_use_verifier, inline=True)

"""`majority`: a group-aware, label-free consensus reward (test-time RL style).

A completion scores 1.0 when its final answer (extracted as `math` does) agrees with the
most common answer among the G completions of its prompt; completions without an answer
score 0. Answers are compared after normalisation (exact numbers, whitespace).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

from rljax.rewards.base import RewardResult, register_verifier
from rljax.rewards.verifiers._answers import final_answer, to_fraction


def _key(answer: str | None) -> str | None:
  if answer is None:
    return None
  num = to_fraction(answer)
  if num is not None:
    return str(num)
  return "".join(answer.split()).replace("\\dfrac", "\\frac").rstrip(".")


@register_verifier("majority", kind="group")
def majority_verifier(completions: Sequence[str], example: Mapping[str, Any], *,
                      min_agreement: float = 0.0) -> list[RewardResult]:
  """1.0 for completions that agree with the group's majority answer.

  `min_agreement`: if the majority answer's share of the group is below it, everyone scores 0.
  """
  answers = [final_answer(c) for c in completions]
  keys = [_key(a) for a in answers]
  counts = Counter(k for k in keys if k is not None)
  if not counts:
    return [RewardResult(0.0, {"answer": None}) for _ in completions]
  top, votes = counts.most_common(1)[0]
  ok = votes / len(completions) >= min_agreement
  return [RewardResult(float(ok and k == top), {"answer": a}) for a, k in zip(answers, keys)]

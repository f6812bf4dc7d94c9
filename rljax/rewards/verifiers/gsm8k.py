"""`gsm8k`: the numeric answer after `####` (else \\boxed{}, "the answer is", the last number),
compared exactly as a fraction; commas, `$`, `%`, units and trailing periods are ignored."""
from __future__ import annotations

from typing import Any, Mapping

from rljax.rewards.base import RewardResult, register_verifier
from rljax.rewards.verifiers._answers import (
  answer_phrase,
  answer_tag,
  first_number,
  last_boxed,
  last_number,
  to_fraction,
)


def extract_number(text: str) -> str | None:
  """The final numeric answer of a GSM8K-style solution, as written (e.g. '1,234.50')."""
  if "####" in text:
    span = text.rsplit("####", 1)[1]
    found = first_number(span)
    if found:
      return found
  for find in (last_boxed, answer_tag, answer_phrase):
    span = find(text)
    if span:
      found = first_number(span.replace("\\$", "$").replace("\\!", ""))
      if found:
        return found
  return last_number(text)


@register_verifier("gsm8k")
def gsm8k_verifier(completion: str, example: Mapping[str, Any], *, answer_key: str = "answer",
                   tolerance: float = 0.0) -> RewardResult:
  """1.0 when the completion's final number equals the reference number, else 0.0.

  `tolerance` > 0 accepts |pred - gold| <= tolerance * max(1, |gold|).
  """
  if answer_key not in example:
    raise KeyError(f"example has no '{answer_key}' field (fields: {sorted(example)})")
  gold_text = str(example[answer_key])
  gold_num = extract_number(gold_text) if "####" in gold_text else gold_text
  gold = to_fraction(gold_num or "")
  if gold is None:
    found = last_number(gold_text)
    gold = to_fraction(found) if found else None
  if gold is None:
    raise ValueError(f"reference answer {gold_text[:80]!r} is not a number")
  pred_text = extract_number(completion)
  pred = to_fraction(pred_text) if pred_text else None
  if pred is None:
    return RewardResult(0.0, {"answer": pred_text, "extracted": 0.0})
  ok = pred == gold or (tolerance > 0 and abs(pred - gold) <= tolerance * max(1, abs(gold)))
  return RewardResult(float(ok), {"answer": pred_text, "extracted": 1.0})

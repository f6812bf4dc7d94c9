"""`math`: the final answer of a completion checked for equivalence with math-verify.

Extraction: the last \\boxed{}, else <answer>...</answer>, else "the answer is ...",
else the last number. Equivalence (math-verify + sympy): fractions vs decimals,
\\frac / \\dfrac, percentages, intervals, sets, units in \\text{}, equations (x=3 vs 3).

math-verify's own timeouts use signal.alarm (main thread only); they are disabled here
and the pool's per-item timeout bounds a parser that hangs.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Mapping

from rljax.rewards.base import RewardResult, register_verifier
from rljax.rewards.verifiers._answers import final_answer, strip_math_delimiters, to_fraction

_MAX_ANSWER_CHARS = 2000


def _quiet_math_verify() -> None:
  # The "timeout is disabled" warning is expected: the pool enforces timeouts.
  import math_verify.grader
  import math_verify.parser
  math_verify.parser.TIMEOUT_WARNING_SHOWN = True
  math_verify.grader.TIMEOUT_WARNING_SHOWN = True
  logging.getLogger("math_verify").setLevel(logging.ERROR)


def _wrap(s: str) -> str:
  s = s.strip()
  if s.startswith("$") or s.startswith("\\(") or s.startswith("\\[") or "\\boxed" in s:
    return s
  return f"${s}$"


@functools.lru_cache(maxsize=4096)
def _parse(text: str):
  from math_verify import parse
  return parse(_wrap(text), parsing_timeout=None)


def gold_answer(value: Any) -> str:
  """The reference answer as text: a GSM8K '#### x' or a \\boxed{} solution is reduced to x."""
  text = str(value).strip()
  if "####" in text:
    return text.rsplit("####", 1)[1].strip()
  if "\\boxed" in text or "\\fbox" in text:
    return final_answer(text) or text
  return strip_math_delimiters(text)


def math_equal(gold: str, pred: str, *, float_rounding: int = 6) -> bool:
  """Whether `pred` is mathematically equivalent to `gold` (both answer strings)."""
  from math_verify import verify
  g, p = gold.strip(), pred.strip()
  if not p:
    return False
  if g == p:
    return True
  gf, pf = to_fraction(g), to_fraction(p)
  if gf is not None and pf is not None and gf == pf:
    return True
  gold_parsed = _parse(g)
  if not gold_parsed:
    return _norm(g) == _norm(p)
  pred_parsed = _parse(p)
  if not pred_parsed:
    return False
  return bool(verify(gold_parsed, pred_parsed, float_rounding=float_rounding, timeout_seconds=None))


def _norm(s: str) -> str:
  return "".join(s.lower().split()).rstrip(".")


def _warmup() -> None:
  _quiet_math_verify()
  math_equal("\\frac{1}{2}", "0.5")
  math_equal("(1, 2]", "(1,2]")


@register_verifier("math", preload=("math_verify",), warmup=_warmup)
def math_verifier(completion: str, example: Mapping[str, Any], *, answer_key: str = "answer",
                  float_rounding: int = 6) -> RewardResult:
  """1.0 when the completion's final answer equals example[answer_key], else 0.0."""
  _quiet_math_verify()
  if answer_key not in example:
    raise KeyError(f"example has no '{answer_key}' field (fields: {sorted(example)})")
  pred = final_answer(completion)
  if pred is None or len(pred) > _MAX_ANSWER_CHARS:
    return RewardResult(0.0, {"answer": pred, "extracted": 0.0})
  ok = math_equal(gold_answer(example[answer_key]), pred, float_rounding=float_rounding)
  return RewardResult(float(ok), {"answer": pred, "extracted": 1.0})

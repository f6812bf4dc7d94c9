"""`arithmetic` and `countdown`: exact checking of arithmetic expressions.

Expressions are parsed with `ast` and evaluated with Fractions; only numbers, + - * /,
unary +/- and parentheses are allowed (no names, calls, powers or eval), so neither a
malicious nor a huge input can run code or blow up.

  arithmetic  the final answer (a number, e.g. "4", "7 - 3 = 4" or "\boxed{8/2}") must
              equal example["answer"] (or example["target"]) exactly; a final expression
              ("9 - 8 = 9 - 8") scores 0. If the example lists "numbers", the completion is
              checked as countdown does.
  countdown   the expression must use example["numbers"] (each exactly once, or at most
              once with use_all=False) and reach example["target"].
"""
from __future__ import annotations

import ast
import math
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Mapping, Sequence

from rljax.rewards.base import RewardResult, register_verifier
from rljax.rewards.verifiers._answers import answer_phrase, answer_tag, last_boxed, last_number, to_fraction

_MAX_EXPR_CHARS = 400
_MAX_DEPTH = 64
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


class ExpressionError(ValueError):
  """The text is not an allowed arithmetic expression."""


def _clean(expr: str) -> str:
  s = expr.strip().strip("$").strip()
  for a, b in (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("·", "*"), ("÷", "/"),
               ("−", "-"), ("–", "-"), ("\\left", ""), ("\\right", ""), ("\\(", ""), ("\\)", ""),
               ("{", "("), ("}", ")"), ("[", "("), ("]", ")")):
    s = s.replace(a, b)
  s = re.sub(r"\\frac\s*\(([^()]*)\)\s*\(([^()]*)\)", r"((\1)/(\2))", s)
  s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
  return s.strip().rstrip(".").strip()


def evaluate(expr: str) -> tuple[Fraction, list[Fraction]]:
  """Exact value of an arithmetic expression and the number literals it uses.

  Raises:
    ExpressionError: anything but numbers, + - * /, unary +/- and parentheses; division by
      zero; too long or too deeply nested input.
  """
  s = _clean(expr)
  if not s or len(s) > _MAX_EXPR_CHARS:
    raise ExpressionError(f"expression is empty or longer than {_MAX_EXPR_CHARS} characters")
  if s.count("(") > _MAX_DEPTH:
    raise ExpressionError("expression is nested too deeply")
  try:
    tree = ast.parse(s, mode="eval")
  except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
    raise ExpressionError(f"not an expression: {type(e).__name__}") from None
  literals: list[Fraction] = []

  def ev(node: ast.AST, depth: int) -> Fraction:
    if depth > _MAX_DEPTH:
      raise ExpressionError("expression is nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      if isinstance(node.value, float) and not math.isfinite(node.value):
        raise ExpressionError("not a finite number")
      value = Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
      literals.append(value)
      return value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      left, right = ev(node.left, depth + 1), ev(node.right, depth + 1)
      if isinstance(node.op, ast.Div) and right == 0:
        raise ExpressionError("division by zero")
      return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      value = ev(node.operand, depth + 1)
      return -value if isinstance(node.op, ast.USub) else value
    raise ExpressionError(f"'{type(node).__name__}' is not allowed (only numbers, + - * / and parentheses)")

  return ev(tree.body, 0), literals


_RUN = re.compile(r"[-+*/().\d\s]*\d[-+*/().\d\s]*")


def _evaluate_loose(part: str) -> tuple[Fraction, list[Fraction]]:
  """evaluate(), else evaluate the last run of arithmetic characters ("I get: 3 * 5" -> "3 * 5")."""
  try:
    return evaluate(part)
  except ExpressionError:
    runs = [r.strip() for r in _RUN.findall(_clean(part)) if r.strip()]
    if not runs:
      raise
    return evaluate(runs[-1])


def candidate_text(completion: str) -> str | None:
  """Where the final expression is: <answer>, \\boxed{}, "the answer is", else the last line with a digit."""
  for find in (answer_tag, last_boxed, answer_phrase):
    found = find(completion)
    if found:
      return found
  lines = [ln for ln in completion.strip().splitlines() if re.search(r"\d", ln)]
  return lines[-1] if lines else None


def _parts(text: str) -> list[str]:
  return [p for p in re.split(r"(?<![<>!=])=(?!=)", text) if p.strip()]


def _uses_numbers(literals: Sequence[Fraction], numbers: Sequence[Any], use_all: bool) -> str | None:
  """None if the literals use `numbers` correctly, else why not."""
  have, want = Counter(literals), Counter(Fraction(str(n)) for n in numbers)
  extra = have - want
  if extra:
    return f"uses numbers not given (or too often): {sorted(map(str, extra.elements()))}"
  if use_all and want - have:
    return f"does not use every number: missing {sorted(map(str, (want - have).elements()))}"
  return None


def _value(x: Any) -> Fraction:
  if isinstance(x, (int, Fraction)):
    return Fraction(x)
  frac = to_fraction(str(x))
  if frac is not None:
    return frac
  return evaluate(str(x))[0]


def check_countdown(completion: str, numbers: Sequence[Any], target: Any, *, use_all: bool = True) -> RewardResult:
  """Whether the completion's expression uses `numbers` and equals `target`."""
  text = candidate_text(completion)
  if text is None:
    return RewardResult(0.0, {"answer": None, "valid": 0.0})
  goal = _value(target)
  best_error = "no expression found"
  parts = _parts(text)
  # The expression is the part that uses the most numbers (e.g. the left of "... = 24").
  scored = []
  for part in parts:
    try:
      value, literals = _evaluate_loose(part)
    except ExpressionError as e:
      best_error = str(e)
      continue
    scored.append((len(literals), part, value, literals))
  if not scored:
    return RewardResult(0.0, {"answer": text.strip()[:200], "valid": 0.0, "error": best_error})
  _, part, value, literals = max(scored, key=lambda s: s[0])
  if any(v != goal for _, p, v, _ in scored if p is not part):
    return RewardResult(0.0, {"answer": part.strip(), "valid": 1.0})
  why = _uses_numbers(literals, numbers, use_all)
  if why is not None:
    return RewardResult(0.0, {"answer": part.strip(), "valid": 0.0, "error": why})
  return RewardResult(float(value == goal), {"answer": part.strip(), "valid": 1.0})


@register_verifier("countdown")
def countdown_verifier(completion: str, example: Mapping[str, Any], *, use_all: bool = True) -> RewardResult:
  """1.0 when the expression uses example['numbers'] once each and equals example['target']."""
  for key in ("numbers", "target"):
    if key not in example:
      raise KeyError(f"countdown example has no '{key}' field (fields: {sorted(example)})")
  return check_countdown(completion, example["numbers"], example["target"], use_all=use_all)


@register_verifier("arithmetic")
def arithmetic_verifier(completion: str, example: Mapping[str, Any], *, answer_key: str = "answer",
                        use_all: bool = True) -> RewardResult:
  """1.0 when the completion's final value equals example[answer_key] (or 'target') exactly."""
  if "numbers" in example and "target" in example:
    return check_countdown(completion, example["numbers"], example["target"], use_all=use_all)
  key = answer_key if answer_key in example else "target"
  if key not in example:
    raise KeyError(f"arithmetic example has no '{answer_key}' or 'target' field (fields: {sorted(example)})")
  goal = _value(example[key])
  text = candidate_text(completion)
  if text is None:
    return RewardResult(0.0, {"answer": None})
  parts = _parts(text)
  final = parts[-1] if parts else text
  # The answer must be a number (a fraction such as 8/2 counts): an expression after the last
  # "=" would let a policy score by restating the question ("9 - 8 = 9 - 8").
  value = to_fraction(_clean(final))
  if value is None:
    try:
      is_expression = len(evaluate(final)[1]) > 1
    except ExpressionError:
      is_expression = False
    number = None if is_expression else last_number(final)
    if number is None:
      why = "the final answer is an expression, not a number" if is_expression else "no number found"
      return RewardResult(0.0, {"answer": final.strip()[:200], "error": why})
    value, final = to_fraction(number), number
  if value is None:
    return RewardResult(0.0, {"answer": final.strip()[:200]})
  return RewardResult(float(value == goal), {"answer": _canonical(value)})


def _canonical(x: Fraction) -> str:
  return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"

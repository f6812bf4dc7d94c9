"""`choice`: multiple-choice letter matching."""
from __future__ import annotations

import re
import string
from typing import Any, Mapping

from rljax.rewards.base import RewardResult, register_verifier
from rljax.rewards.verifiers._answers import answer_phrase, answer_tag, last_boxed


def _letters(example: Mapping[str, Any], letters: str | None) -> str:
  if letters:
    return letters.upper()
  for key in ("choices", "options"):
    if key in example and not isinstance(example[key], (str, bytes)):
      return string.ascii_uppercase[:max(1, len(example[key]))]
  return "ABCD"


def gold_letter(example: Mapping[str, Any], answer_key: str, letters: str) -> str:
  """The reference letter: 'B', '(B)', 'b', an index (1 -> 'B') or the text of an option."""
  gold = example[answer_key]
  if isinstance(gold, int) and not isinstance(gold, bool):
    return letters[gold]
  text = str(gold).strip()
  m = re.fullmatch(r"\(?([A-Za-z])[).:]?", text)
  if m and m.group(1).upper() in letters:
    return m.group(1).upper()
  for key in ("choices", "options"):
    options = example.get(key)
    if isinstance(options, (list, tuple)):
      for i, opt in enumerate(options):
        if str(opt).strip().lower() == text.lower():
          return letters[i]
  raise ValueError(f"reference answer {text[:40]!r} is not one of the letters {letters}")


def extract_letter(completion: str, letters: str) -> str | None:
  """The chosen letter: the first option letter in \\boxed{}, <answer> or "the answer is ...",
  else a last line that is only a letter ("B", "(B)", "B."). None when there is none.
  """
  cls = re.escape(letters) + re.escape(letters.lower())
  token = re.compile(rf"(?<![A-Za-z])\(?([{cls}])\)?(?![A-Za-z])")
  for find in (last_boxed, answer_tag, answer_phrase):
    span = find(completion)
    if span:
      span = re.sub(r"\\text\{([^}]*)\}", r"\1", span)
      found = token.findall(span.strip()[:40])
      if found:
        upper = [f.upper() for f in found if f.upper() in letters and (f.isupper() or len(span.strip()) <= 3)]
        if upper:
          return upper[0]
  lines = [ln.strip() for ln in completion.strip().splitlines() if ln.strip()]
  if lines:
    m = re.fullmatch(rf"\**\(?([{re.escape(letters)}])[).:]?\**", lines[-1])
    if m:
      return m.group(1)
  return None


@register_verifier("choice")
def choice_verifier(completion: str, example: Mapping[str, Any], *, answer_key: str = "answer",
                    letters: str | None = None) -> RewardResult:
  """1.0 when the chosen letter equals the reference letter, else 0.0.

  `letters` defaults to one per example['choices'] (or 'options'), else 'ABCD'.
  """
  if answer_key not in example:
    raise KeyError(f"example has no '{answer_key}' field (fields: {sorted(example)})")
  letters = _letters(example, letters)
  gold = gold_letter(example, answer_key, letters)
  pred = extract_letter(completion, letters)
  return RewardResult(float(pred == gold), {"answer": pred, "extracted": float(pred is not None)})

"""Finding the final answer in a completion: \\boxed{}, <answer> tags, "the answer is", last number."""
from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# "The final answer is X", "answer: X", "**Answer:** X" (the last one wins).
_ANSWER_PHRASE = re.compile(
    r"\banswer\b(?:\s+(?:to|for|of)\s+[^.\n:]{0,40}?\s+is\b|\s*(?:is\b|:|=))?\s*(?:\*\*)?\s*:?\s*(.+)",
    re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d])|(?<![\w.])-?\d+(?:\.\d+)?(?:/\d+)?|"
                     r"(?<![\w.\d])-?\.\d+")


def last_boxed(text: str) -> str | None:
  """The content of the last \\boxed{...} (or \\fbox{...}, or `\\boxed 5`), braces balanced."""
  matches = list(_BOXED.finditer(text))
  for m in reversed(matches):
    i = m.end()
    if i < len(text) and text[i] == "{":
      depth, j = 0, i
      while j < len(text):
        ch = text[j]
        if ch == "\\":
          j += 2
          continue
        if ch == "{":
          depth += 1
        elif ch == "}":
          depth -= 1
          if depth == 0:
            return text[i + 1:j].strip()
        j += 1
      continue  # unbalanced: try an earlier one
    rest = re.match(r"([^\s$]+)", text[i:])
    if rest:
      return rest.group(1).strip()
  return None


def answer_tag(text: str) -> str | None:
  """The content of the last <answer>...</answer>."""
  found = _ANSWER_TAG.findall(text)
  return found[-1].strip() if found else None


def answer_phrase(text: str) -> str | None:
  """What follows the last "the answer is" / "Answer:", to the end of its line or sentence."""
  found = list(_ANSWER_PHRASE.finditer(text))
  for m in reversed(found):
    rest = m.group(1).strip()
    rest = re.split(r"(?<=[^\d\\])\.\s|\.$|\n", rest, maxsplit=1)[0]
    rest = rest.strip().strip("*").strip()
    if rest:
      return rest
  return None


def last_number(text: str) -> str | None:
  """The last number in the text (integers, decimals, 1,234, fractions a/b, negatives)."""
  found = _NUMBER.findall(text)
  return found[-1] if found else None


def first_number(text: str) -> str | None:
  found = _NUMBER.findall(text)
  return found[0] if found else None


def strip_math_delimiters(s: str) -> str:
  """'$x$' / '\\(x\\)' / '\\[x\\]' -> 'x'; drops a trailing period."""
  s = s.strip()
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
      s = s[len(left):len(s) - len(right)].strip()
  return s.rstrip(".").strip()


def final_answer(text: str) -> str | None:
  """The final answer of a solution: \\boxed{} first, then <answer>, "the answer is", the last number."""
  for find in (last_boxed, answer_tag, answer_phrase):
    found = find(text)
    if found:
      inner = last_boxed(found) if find is not last_boxed else None
      return strip_math_delimiters(inner or found)
  return last_number(text)


def to_fraction(s: str) -> Fraction | None:
  """Exact value of a plain number string ('1,234.50', '-3/4', '$5', '50%' -> 50), else None."""
  s = s.strip().replace("$", "").replace("\\$", "").replace("\\!", "").replace(" ", "")
  s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
  s = s.replace("\\%", "%").rstrip(".").rstrip("%")
  if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?", s):
    return None
  try:
    return Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None

"""`format`: the completion has a required structure (a regex or a sequence of tags)."""
from __future__ import annotations

import functools
import re
from typing import Any, Mapping, Sequence

from rljax.rewards.base import RewardResult, register_verifier

DEFAULT_TAGS = ("think", "answer")


@functools.lru_cache(maxsize=64)
def _compile(pattern: str) -> re.Pattern:
  return re.compile(pattern, re.DOTALL)


@functools.lru_cache(maxsize=64)
def _structure(tags: tuple[str, ...]) -> re.Pattern:
  body = r"\s*".join(rf"<{re.escape(t)}>(?:(?!</?{re.escape(t)}>).)*</{re.escape(t)}>" for t in tags)
  return re.compile(rf"\s*{body}\s*", re.DOTALL)


def _tag_ok(text: str, tag: str) -> bool:
  opens, closes = text.count(f"<{tag}>"), text.count(f"</{tag}>")
  return opens == 1 and closes == 1 and text.index(f"<{tag}>") < text.index(f"</{tag}>")


def format_verifier(completion: str, example: Mapping[str, Any], *, pattern: str | None = None,
                    tags: Sequence[str] = DEFAULT_TAGS, partial_credit: bool = False,
                    prefix: str = "") -> RewardResult:
  """1.0 when `prefix + completion` has the required structure, else 0.0.

  Args:
    pattern: a regex that must match the whole text (re.DOTALL). Overrides `tags`.
    tags: tag names that must appear once each, in order, with only whitespace
      between and around them: <think>...</think><answer>...</answer> by default.
    partial_credit: with tags, score = (tags well-formed + 1 if the whole structure
      is right) / (len(tags) + 1) instead of all-or-nothing.
    prefix: text the prompt already ends with (e.g. "<think>").
  """
  text = prefix + completion
  if pattern is not None:
    return RewardResult(float(_compile(pattern).fullmatch(text) is not None))
  tags = tuple(tags)
  strict = _structure(tags).fullmatch(text) is not None
  if not partial_credit:
    return RewardResult(float(strict))
  good = sum(_tag_ok(text, t) for t in tags)
  return RewardResult((good + strict) / (len(tags) + 1), {"strict": float(strict)})


def _check(pattern: str | None = None, tags: Sequence[str] = DEFAULT_TAGS, partial_credit: bool = False,
           prefix: str = "") -> None:
  if pattern is not None:
    try:
      re.compile(pattern)
    except re.error as e:
      raise ValueError(f"pattern {pattern!r} is not a valid regex: {e}") from None
  elif not tags or not all(isinstance(t, str) and re.fullmatch(r"[\w\-:.]+", t) for t in tags):
    raise ValueError(f"tags must be a non-empty list of tag names, got {tags!r}")


format_verifier.check_config = _check
register_verifier("format", format_verifier)

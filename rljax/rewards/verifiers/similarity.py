"""`similarity`: a normalised string similarity to the reference (e.g. for function calls)."""
from __future__ import annotations

import difflib
import json
import re
from typing import Any, Mapping

from rljax.rewards.base import RewardResult, register_verifier
from rljax.rewards.verifiers._answers import answer_tag

_MAX_CHARS = 4000


def normalize(text: str, *, json_aware: bool = True) -> str:
  """Lower-cased, whitespace-collapsed text; JSON is re-serialised with sorted keys, so
  key order and spacing of a function call do not matter."""
  text = text.strip()
  if json_aware and text[:1] in "{[":
    try:
      return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
      pass
  return re.sub(r"\s+", " ", text.lower())


def similarity(a: str, b: str) -> float:
  """difflib ratio in [0, 1] of two normalised strings (1.0 = identical)."""
  if a == b:
    return 1.0
  return difflib.SequenceMatcher(None, a[:_MAX_CHARS], b[:_MAX_CHARS], autojunk=False).ratio()


@register_verifier("similarity")
def similarity_verifier(completion: str, example: Mapping[str, Any], *, answer_key: str = "answer",
                        extract: str = "answer_tag", threshold: float = 0.0, json_aware: bool = True) -> RewardResult:
  """Similarity of the completion (or its <answer> content) to example[answer_key].

  Args:
    extract: 'answer_tag' (use <answer>...</answer> when present) or 'none' (whole completion).
    threshold: scores below it become 0 (e.g. 1.0 for exact match only).
    json_aware: compare JSON values regardless of key order and spacing.
  """
  if answer_key not in example:
    raise KeyError(f"example has no '{answer_key}' field (fields: {sorted(example)})")
  ref = example[answer_key]
  ref = ref if isinstance(ref, str) else json.dumps(ref)
  text = completion
  if extract == "answer_tag":
    tagged = answer_tag(completion)
    text = tagged if tagged is not None else completion
  score = similarity(normalize(text, json_aware=json_aware), normalize(ref, json_aware=json_aware))
  return RewardResult(score if score >= threshold else 0.0, {"similarity": score})


def _check(answer_key: str = "answer", extract: str = "answer_tag", threshold: float = 0.0,
           json_aware: bool = True) -> None:
  if extract not in ("answer_tag", "none"):
    raise ValueError(f"extract must be 'answer_tag' or 'none', got {extract!r}")
  if not 0.0 <= threshold <= 1.0:
    raise ValueError(f"threshold must be in [0, 1], got {threshold}")


similarity_verifier.check_config = _check

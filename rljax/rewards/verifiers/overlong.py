"""`overlong`: DAPO's soft overlong punishment, from completion token counts.

With L = num_tokens, L_max = max_len and L_buf = buffer:
    0                                  if L <= L_max - L_buf
    -(L - (L_max - L_buf)) / L_buf     if L_max - L_buf < L <= L_max
    -1                                 if L > L_max
"""
from __future__ import annotations

from typing import Any, Mapping

from rljax.rewards.base import register_verifier


def overlong_penalty(num_tokens: int, max_len: int, buffer: int) -> float:
  """The soft overlong penalty in [-1, 0] (see the module doc)."""
  free = max_len - buffer
  if num_tokens <= free:
    return 0.0
  return -min((num_tokens - free) / buffer, 1.0)


def overlong_verifier(completion: str, example: Mapping[str, Any], *, num_tokens: int | None, max_len: int,
                      buffer: int) -> float:
  """Soft overlong punishment of one completion; needs score(..., num_tokens=...)."""
  if num_tokens is None:
    raise ValueError("the overlong component needs completion token counts: pass num_tokens= to score()")
  return overlong_penalty(int(num_tokens), int(max_len), int(buffer))


def _check(max_len: int = 0, buffer: int = 0) -> None:
  if not (isinstance(max_len, int) and isinstance(buffer, int) and 0 < buffer <= max_len):
    raise ValueError(f"overlong needs integers 0 < buffer <= max_len, got max_len={max_len!r}, buffer={buffer!r}")


overlong_verifier.check_config = _check
register_verifier("overlong", overlong_verifier, inline=True)

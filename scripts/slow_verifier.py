"""A verifier with latency, for scripts/bench_rollouts.py: the smoke recipe's vowel reward after
`delay_s` seconds of waiting (a remote judge, a test run). Reward workers import it by path
("slow_verifier:slow_vowel_fraction"), so the benchmark puts scripts/ on PYTHONPATH."""
from __future__ import annotations

import time

from rljax.configs.smoke import vowel_fraction


def slow_vowel_fraction(completion: str, example, delay_s: float = 0.0) -> float:
  """vowel_fraction after `delay_s` seconds."""
  time.sleep(delay_s)
  return vowel_fraction(completion, example)

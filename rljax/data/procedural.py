"""Procedural tasks generated in-process: arithmetic and countdown.

Example `i` of a task is a pure function of (seed, split stream, i): random
draws come from a counter-based hash (BLAKE2b), so they do not depend on the
NumPy version or on which examples were generated before.

Held-out split. Every problem has a bucket, a hash of its canonical form
(independent of the seed), in 0..HELD_OUT_BUCKETS-1. The first
`held_out_fraction * HELD_OUT_BUCKETS` buckets (by default bucket 0 only)
belong to the held-out split and the rest to train; each split rejects
candidates from the other's buckets, so train and held-out problems never
coincide, for any seeds. Small problem spaces need a larger share: difficulty 1
arithmetic has 300 distinct problems, so the default 1/16 holds out about 19. Any split name
other than "train" reads the held-out stream.

Difficulty:
  arithmetic  d -> operands drawn uniformly from [0, 10**d), ceil(d / 2)
              operators from {+, -, *}, evaluated with the usual precedence.
              d = 1 is "What is 7 - 3?"; d = 3 is "What is 512 * 88 + 903?".
  countdown   d -> d + 2 numbers from [1, 99]; the target (1..999) is built by
              combining all numbers with +, -, *, / (exact, positive
              intermediates), so it is reachable by construction. The
              reference expression is the `answer`.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

from rljax.data.sources import RowReader

HELD_OUT_BUCKETS = 16
_MAX_ATTEMPTS = 10_000
INFINITE = 2**62  # Length reported by an unbounded task (fits grain's index arithmetic).


class HashRng:
  """Counter-based random draws: draw k of key K is BLAKE2b(K, k)."""

  def __init__(self, *key: Any):
    self._key = hashlib.blake2b(repr(key).encode(), digest_size=32).digest()
    self._counter = 0

  def _next64(self) -> int:
    digest = hashlib.blake2b(self._counter.to_bytes(8, "little"), key=self._key, digest_size=8).digest()
    self._counter += 1
    return int.from_bytes(digest, "little")

  def integers(self, low: int, high: int) -> int:
    """Uniform integer in [low, high); the modulo bias is below 2**-40 for spans < 2**24."""
    return low + self._next64() % (high - low)

  def choice(self, options: Any) -> Any:
    return options[self.integers(0, len(options))]


def bucket_of(canonical: str) -> int:
  """The held-out bucket of a problem, from its canonical string (seed-free)."""
  digest = hashlib.blake2b(canonical.encode(), digest_size=8, person=b"rljax-split").digest()
  return int.from_bytes(digest, "little") % HELD_OUT_BUCKETS


def is_held_out(canonical: str, held_out_fraction: float = 1 / HELD_OUT_BUCKETS) -> bool:
  return bucket_of(canonical) < round(held_out_fraction * HELD_OUT_BUCKETS)


def _evaluate(operands: list[int], operators: list[str]) -> int:
  """Evaluates `a0 op0 a1 op1 a2 ...` with * binding tighter than + and -."""
  terms, signs = [operands[0]], []
  for op, value in zip(operators, operands[1:]):
    if op == "*":
      terms[-1] *= value
    else:
      terms.append(value)
      signs.append(op)
  total = terms[0]
  for op, value in zip(signs, terms[1:]):
    total = total + value if op == "+" else total - value
  return total


class ProceduralTask(RowReader):
  """Base class: index -> row, deterministic, with train/held-out separation."""

  kind = ""

  def __init__(self, *, seed: int, difficulty: int, split: str, num_examples: int | None,
               held_out_fraction: float = 1 / HELD_OUT_BUCKETS):
    self.seed = seed
    self.held_out_fraction = held_out_fraction
    self.difficulty = difficulty
    self.held_out = split != "train"
    self.num_examples = num_examples

  def __len__(self) -> int:
    return INFINITE if self.num_examples is None else self.num_examples

  def where(self, index: int) -> str:
    stream = "held-out" if self.held_out else "train"
    return f"{self.kind} (seed {self.seed}, difficulty {self.difficulty}, {stream}) example {index}"

  def read(self, index: int) -> dict[str, Any]:
    if not 0 <= index < len(self):
      raise IndexError(index)
    rng = HashRng(self.kind, self.seed, self.difficulty, "held-out" if self.held_out else "train", index)
    for _ in range(_MAX_ATTEMPTS):
      row = self._candidate(rng)
      if row is not None and is_held_out(row["canonical"], self.held_out_fraction) == self.held_out:
        return row
    raise RuntimeError(f"{self.where(index)}: no problem found in this split's buckets after {_MAX_ATTEMPTS} tries.")

  def _candidate(self, rng: HashRng) -> dict[str, Any] | None:
    """One candidate problem, or None to draw again."""
    raise NotImplementedError


class ArithmeticTask(ProceduralTask):
  """'What is 37 + 58?' with the integer result as the answer."""

  kind = "arithmetic"

  def _candidate(self, rng: HashRng) -> dict[str, Any]:
    d = self.difficulty
    num_ops = math.ceil(d / 2)
    operands = [rng.integers(0, 10**d) for _ in range(num_ops + 1)]
    operators = [rng.choice("+-*") for _ in range(num_ops)]
    expression = str(operands[0]) + "".join(f" {op} {v}" for op, v in zip(operators, operands[1:]))
    return {
        "question": f"What is {expression}?",
        "answer": str(_evaluate(operands, operators)),
        "expression": expression,
        "canonical": expression,
    }


class CountdownTask(ProceduralTask):
  """Reach `target` from `numbers` with + - * /, each number used once."""

  kind = "countdown"
  max_target = 999

  def _candidate(self, rng: HashRng) -> dict[str, Any] | None:
    count = self.difficulty + 2
    numbers = [rng.integers(1, 100) for _ in range(count)]
    # Combine random pairs until one value is left; keep every intermediate a
    # positive integer so the target is reachable with exact arithmetic.
    items = [(n, str(n)) for n in numbers]
    while len(items) > 1:
      a = items.pop(rng.integers(0, len(items)))
      b = items.pop(rng.integers(0, len(items)))
      if a[0] < b[0]:
        a, b = b, a
      options = [("+", a[0] + b[0]), ("*", a[0] * b[0])]
      if a[0] > b[0]:
        options.append(("-", a[0] - b[0]))
      if b[0] > 1 and a[0] % b[0] == 0:
        options.append(("/", a[0] // b[0]))
      op, value = rng.choice(options)
      items.append((value, f"({a[1]} {op} {b[1]})"))
    target, expression = items[0]
    if len(numbers) > 1:
      expression = expression[1:-1]
    if not 1 <= target <= self.max_target:
      return None
    return {
        "question": (f"Using the numbers {numbers}, create an equation that equals {target}. "
                     "You may use +, -, * and /, and each number exactly once."),
        "answer": expression,
        "numbers": numbers,
        "target": target,
        "canonical": f"{sorted(numbers)}={target}",
    }


TASKS = {"arithmetic": ArithmeticTask, "countdown": CountdownTask}


def make_task(kind: str, *, seed: int, difficulty: int, split: str, num_examples: int | None,
              held_out_fraction: float = 1 / HELD_OUT_BUCKETS) -> ProceduralTask:
  return TASKS[kind](seed=seed, difficulty=difficulty, split=split, num_examples=num_examples,
                     held_out_fraction=held_out_fraction)

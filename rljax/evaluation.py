"""Evaluation metrics over sampled completions (pure NumPy functions).

Each metric scores every problem in [0, 1] and reports the mean over problems
with its standard error (`Estimate`). The standard error is the sample standard
deviation of the per-problem scores (ddof=1) over sqrt(number of problems): it
measures the uncertainty from which problems are in the set, and is NaN for
fewer than two problems.

Per problem (n samples, c of them correct):
  pass_at_k(n, c, k)         P(at least one of k samples is correct), estimated
                             without bias from n >= k samples (Chen et al.
                             2021): 1 - C(n-c, k) / C(n, k).
  mean_at_k(n, c, k)         expected fraction of k samples that are correct;
                             its unbiased estimate from n >= k samples is c / n.
  maj_at_k(answers, correct, k=None)  correctness of the majority answer among
                             the first k samples (ties: see `maj_at_k`).
Over problems (mean and standard error):
  accuracy(correct)          greedy accuracy, one boolean per problem.
  pass_at_k_estimate(correct, k), mean_at_k_estimate(correct, k),
  maj_at_k_estimate(answers, correct, k)
                             where `correct` is a [problems, n] boolean array,
                             or a list of per-problem lists when problems have
                             different numbers of samples.
"""
from __future__ import annotations

import collections
from typing import Any, Hashable, NamedTuple, Sequence

import numpy as np


class Estimate(NamedTuple):
  """A mean over problems, its standard error, and the number of problems."""
  mean: float
  stderr: float
  num_problems: int

  def as_dict(self) -> dict[str, float]:
    return {"mean": self.mean, "stderr": self.stderr, "num_problems": self.num_problems}


def mean_and_stderr(scores: Any) -> Estimate:
  """Mean of per-problem scores and its standard error (NaN below two problems)."""
  scores = np.asarray(scores, np.float64).reshape(-1)
  if scores.size == 0:
    raise ValueError("no problems to average: pass at least one score.")
  stderr = float(scores.std(ddof=1) / np.sqrt(scores.size)) if scores.size > 1 else float("nan")
  return Estimate(float(scores.mean()), stderr, int(scores.size))


def _rows(correct: Any) -> list[np.ndarray]:
  """Per-problem boolean vectors from a 2-D array or a ragged list."""
  if isinstance(correct, np.ndarray) and correct.ndim == 2:
    return [row.astype(bool) for row in correct]
  rows = [np.asarray(row, bool).reshape(-1) for row in correct]
  if not rows:
    raise ValueError("no problems: pass one row of per-sample correctness per problem.")
  return rows


def _check_k(k: int, n: int, problem: int | None = None) -> None:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k={k!r}: expected an integer >= 1.")
  if n < k:
    which = "a problem" if problem is None else f"problem {problem}"
    raise ValueError(f"{which} has {n} samples, fewer than k={k}; sample at least k per problem.")


def pass_at_k(n: Any, c: Any, k: int) -> Any:
  """Unbiased pass@k of a problem with n samples, c correct: 1 - C(n-c, k) / C(n, k).

  Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the huge
  binomial coefficients. Exactly 1 when n - c < k (every k-subset holds a
  correct sample). Scalars give a float; arrays of n and c broadcast and give
  an array.
  """
  scalar = np.ndim(n) == 0 and np.ndim(c) == 0
  n, c = np.broadcast_arrays(np.asarray(n, np.int64), np.asarray(c, np.int64))
  if np.any(c < 0) or np.any(c > n):
    raise ValueError("need 0 <= c <= n for every problem.")
  _check_k(k, int(n.min()) if n.size else k)
  out = np.empty(n.shape, np.float64)
  for idx in np.ndindex(n.shape):
    ni, ci = int(n[idx]), int(c[idx])
    if ni - ci < k:
      out[idx] = 1.0
    else:
      out[idx] = 1.0 - np.prod(1.0 - k / np.arange(ni - ci + 1, ni + 1, dtype=np.float64))
  return float(out) if scalar else out


def mean_at_k(n: int, c: int, k: int) -> float:
  """Mean@k of a problem: the expected fraction correct among k samples, estimated as c / n.

  c / n equals the average, over all k-subsets of the n samples, of the
  fraction correct in the subset, so using all n samples is unbiased and has
  lower variance than using only the first k.
  """
  _check_k(k, n)
  if not 0 <= c <= n:
    raise ValueError(f"need 0 <= c <= n (c={c}, n={n}).")
  return c / n


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int | None = None,
             tie_break: str = "first") -> float:
  """Majority-vote score of one problem over its first k samples (all when k is None).

  `answers` are the extracted, normalized answers of the samples (None when no
  answer could be extracted; those never win the vote) and `correct` their
  verdicts; samples with equal answers must have equal verdicts. Ties between
  the most frequent answers are broken by:
    "first":    the tied answer that appears earliest among the samples wins
                (what a deployed majority vote that keeps sample order returns);
    "expected": the score averaged over the tied answers, i.e. the expected
                score of a uniformly random tie-break (may be fractional).
  A problem whose samples all have answer None scores 0.
  """
  if len(answers) != len(correct):
    raise ValueError(f"{len(answers)} answers but {len(correct)} correctness values; pass one of each per sample.")
  if k is not None:
    _check_k(k, len(answers))
    answers, correct = list(answers)[:k], list(correct)[:k]
  if tie_break not in ("first", "expected"):
    raise ValueError(f"tie_break={tie_break!r}: expected 'first' or 'expected'.")
  counts: dict[Hashable, int] = collections.Counter(a for a in answers if a is not None)
  if not counts:
    return 0.0
  verdict: dict[Hashable, bool] = {}
  for answer, ok in zip(answers, correct):
    if answer is None:
      continue
    if verdict.setdefault(answer, bool(ok)) != bool(ok):
      raise ValueError(f"answer {answer!r} is marked both correct and incorrect; normalize answers so that equal "
                       "answers get the same verdict.")
  top = max(counts.values())
  tied = [a for a in counts if counts[a] == top]  # Counter keeps first-appearance order.
  if tie_break == "first":
    return float(verdict[tied[0]])
  return float(np.mean([verdict[a] for a in tied]))


def accuracy(correct: Any) -> Estimate:
  """Greedy accuracy: `correct` holds one boolean per problem."""
  correct = np.asarray(correct, bool).reshape(-1)
  return mean_and_stderr(correct.astype(np.float64))


def pass_at_k_estimate(correct: Any, k: int) -> Estimate:
  """pass@k averaged over problems, each with n >= k samples."""
  rows = _rows(correct)
  for i, row in enumerate(rows):
    _check_k(k, row.size, i)
  return mean_and_stderr([pass_at_k(row.size, int(row.sum()), k) for row in rows])


def mean_at_k_estimate(correct: Any, k: int) -> Estimate:
  """mean@k averaged over problems, each with n >= k samples."""
  rows = _rows(correct)
  for i, row in enumerate(rows):
    _check_k(k, row.size, i)
  return mean_and_stderr([row.mean() for row in rows])


def maj_at_k_estimate(answers: Sequence[Sequence[Hashable | None]], correct: Any, k: int,
                      tie_break: str = "first") -> Estimate:
  """maj@k averaged over problems (see `maj_at_k`)."""
  rows = _rows(correct)
  if len(answers) != len(rows):
    raise ValueError(f"{len(answers)} problems in answers but {len(rows)} in correct.")
  scores = []
  for i, (ans, row) in enumerate(zip(answers, rows)):
    _check_k(k, min(len(ans), row.size), i)
    scores.append(maj_at_k(list(ans), row.tolist(), k, tie_break))
  return mean_and_stderr(scores)

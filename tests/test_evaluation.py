"""Evaluation metrics checked against exact enumeration on small cases."""
import itertools
import math

import numpy as np
import pytest

from rljax import evaluation


def _samples(n, c):
  return [True] * c + [False] * (n - c)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration_of_k_subsets(n):
  for c in range(n + 1):
    samples = _samples(n, c)
    for k in range(1, n + 1):
      subsets = list(itertools.combinations(samples, k))
      exact = sum(any(s) for s in subsets) / len(subsets)
      got = evaluation.pass_at_k(n, c, k)
      assert isinstance(got, float)
      assert got == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_for_large_n():
  # C(1000, 500) overflows float64; the product form does not.
  n, c, k = 1000, 3, 500
  exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # exact big-integer arithmetic
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
  assert evaluation.pass_at_k(10_000, 0, 100) == 0.0
  assert evaluation.pass_at_k(10_000, 9_950, 100) == 1.0


def test_pass_at_k_vectorised():
  got = evaluation.pass_at_k(np.array([4, 4, 5]), np.array([0, 1, 5]), 2)
  np.testing.assert_allclose(got, [0.0, 0.5, 1.0])


def test_pass_at_k_estimate_aggregates_ragged_problems():
  correct = [[True, False, False, False], [False, False], [True, True, True]]
  est = evaluation.pass_at_k_estimate(correct, 2)
  expected = [1 - math.comb(3, 2) / math.comb(4, 2), 0.0, 1.0]
  assert est.mean == pytest.approx(np.mean(expected))
  assert est.stderr == pytest.approx(np.std(expected, ddof=1) / np.sqrt(3))
  assert est.num_problems == 3
  # pass@1 is the plain mean correctness.
  assert evaluation.pass_at_k_estimate(correct, 1).mean == pytest.approx(np.mean([0.25, 0.0, 1.0]))


def test_k_above_samples_is_rejected():
  with pytest.raises(ValueError, match="fewer than k=3"):
    evaluation.pass_at_k_estimate(np.ones((2, 2), bool), 3)
  with pytest.raises(ValueError, match="fewer than k=3"):
    evaluation.pass_at_k(2, 1, 3)
  with pytest.raises(ValueError, match="k=0"):
    evaluation.mean_at_k(2, 1, 0)


@pytest.mark.parametrize("n,c,k", [(4, 1, 2), (5, 3, 3), (6, 2, 4), (3, 3, 1)])
def test_mean_at_k_equals_average_over_k_subsets(n, c, k):
  samples = _samples(n, c)
  subsets = list(itertools.combinations(samples, k))
  exact = sum(sum(s) / k for s in subsets) / len(subsets)
  assert evaluation.mean_at_k(n, c, k) == pytest.approx(exact)
  assert evaluation.mean_at_k_estimate([samples], k).mean == pytest.approx(exact)


def test_accuracy_and_stderr():
  est = evaluation.accuracy([True, False, True, True])
  assert est.mean == 0.75
  assert est.stderr == pytest.approx(np.std([1, 0, 1, 1], ddof=1) / 2)
  assert math.isnan(evaluation.accuracy([True]).stderr)
  assert est.as_dict()["num_problems"] == 4


def test_maj_at_k_plain_majority():
  assert evaluation.maj_at_k(["4", "5", "4", "4"], [True, False, True, True]) == 1.0
  assert evaluation.maj_at_k(["7", "8", "8", None], [True, False, False, False]) == 0.0
  # Only the first k samples vote.
  assert evaluation.maj_at_k(["7", "8", "8", None], [True, False, False, False], k=1) == 1.0
  answers = [["4", "5", "4", "4"], ["7", "8", "8", None]]
  correct = [[True, False, True, True], [True, False, False, False]]
  assert evaluation.maj_at_k_estimate(answers, correct, 4).mean == 0.5


def test_maj_at_k_ties_first_appearance_wins():
  # "5" and "4" are tied at 2 votes; the one that appeared first wins.
  assert evaluation.maj_at_k(["5", "4", "4", "5"], [False, True, True, False]) == 0.0
  assert evaluation.maj_at_k(["4", "5", "4", "5"], [True, False, True, False]) == 1.0


def test_maj_at_k_ties_expected_equals_random_tie_break_enumeration():
  answers = ["a", "b", "c", "a", "b", "c"]
  correct = [False, True, False, False, True, False]
  verdict = dict(zip(answers, correct))
  # Enumerate every uniformly random tie-break: each tied answer wins once.
  exact = np.mean([verdict[winner] for winner in ("a", "b", "c")])
  assert evaluation.maj_at_k(answers, correct, tie_break="expected") == pytest.approx(exact) == pytest.approx(1 / 3)


def test_maj_at_k_none_answers_never_win_and_all_none_scores_zero():
  assert evaluation.maj_at_k([None, None, "3"], [False, False, True]) == 1.0
  assert evaluation.maj_at_k([None, None], [False, False]) == 0.0


def test_maj_at_k_rejects_inconsistent_verdicts():
  with pytest.raises(ValueError, match="both correct and incorrect"):
    evaluation.maj_at_k(["3", "3"], [True, False])

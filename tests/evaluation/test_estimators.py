"""The evaluation arithmetic (opd.evaluation.estimators): pass@k against brute force, avg@k, gap recovery."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from opd.evaluation import avg_at_k, gap_recovery, mean_pass_at_k, pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    draws = list(combinations(range(n), k))
    return sum(any(samples[i] for i in d) for d in draws) / len(draws)


@pytest.mark.parametrize(
    "n, c, k",
    [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (6, 1, 6), (7, 3, 2), (8, 0, 4), (8, 5, 4), (10, 1, 3), (10, 9, 5)],
)
def test_pass_at_k_matches_brute_force(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_avg_at_k():
    assert avg_at_k([[True, False], [True, True]]) == pytest.approx(0.75)
    assert avg_at_k([[False] * 4]) == 0.0
    # Each prompt weighs the same, whatever its number of samples.
    assert avg_at_k([[True], [False, False, False, True]]) == pytest.approx((1 + 0.25) / 2)
    for bad in ([], [[True], []]):
        with pytest.raises(ValueError):
            avg_at_k(bad)


def test_mean_pass_at_1_is_avg_at_k():
    matrix = [[True, False, False], [True, True, False], [False] * 3]
    assert mean_pass_at_k(matrix, 1) == pytest.approx(avg_at_k(matrix))
    assert mean_pass_at_k(matrix, 3) == pytest.approx(2 / 3)


def test_gap_recovery():
    assert gap_recovery(0.2, 0.5, 0.8) == pytest.approx(0.5)
    assert gap_recovery(0.2, 0.8, 0.8) == pytest.approx(1.0)
    assert gap_recovery(0.2, 0.2, 0.8) == 0.0
    assert gap_recovery(0.4, 0.3, 0.6) == pytest.approx(-0.5)
    assert gap_recovery(0.2, 0.9, 0.8) == pytest.approx(7 / 6)  # student passed its teacher
    assert math.isnan(gap_recovery(0.5, 0.7, 0.5))  # no gap to recover: nan, not a crash

"""The estimators behind evaluation figures: pass@k, avg@k and the share of the teacher gap recovered.

Usage::

    from opd.evaluation.estimators import pass_at_k, avg_at_k, gap_recovery   # also from opd.evaluation
    pass_at_k(n=16, c=4, k=8)                     # P(at least one of 8 draws is correct)
    avg_at_k([[True, False], [True, True]])       # 0.75
    gap_recovery(acc_before=0.2, acc_after=0.5, acc_teacher=0.8)   # 0.5

``pass_at_k`` is the unbiased estimator of Chen et al. (2021): with ``n`` samples of which
``c`` are correct, the chance that ``k`` drawn without replacement include a correct one.

Plain Python with no opd import: the report reads its figures with them without loading a model
library, and the game and prompt evaluations share them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["pass_at_k", "mean_pass_at_k", "avg_at_k", "maj_at_k", "gap_recovery"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: ``1 - C(n-c, k) / C(n, k)`` for n samples, c correct, 1 <= k <= n."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}: draw more samples")
    # Exact integer binomials: the float product form drifts for large n.
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(correct_matrix: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; row i holds the correctness of prompt i's samples."""
    _check_matrix(correct_matrix)
    return sum(pass_at_k(len(row), sum(map(bool, row)), k) for row in correct_matrix) / len(correct_matrix)


def avg_at_k(correct_matrix: Sequence[Sequence[bool]]) -> float:
    """Mean accuracy over the k samples of each prompt, then over prompts.

    Rows may have different lengths; each prompt weighs the same whatever its sample count.
    """
    _check_matrix(correct_matrix)
    return sum(sum(map(bool, row)) / len(row) for row in correct_matrix) / len(correct_matrix)


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]], k: int) -> float:
    """maj@k averaged over prompts: the verdict of the most frequent answer among each prompt's first ``k``
    samples (answers compared as written, whitespace ignored; a tie goes to the answer seen first; a
    sample without an answer does not vote, and a prompt with no answer at all counts as wrong).

    ``answers[i][s]`` is sample s's extracted answer for prompt i, ``correct[i][s]`` its verdict: one
    answer has one verdict, so the majority answer's verdict is that of any sample that gave it."""
    _check_matrix(correct)
    total = 0
    for i, (row_answers, row_correct) in enumerate(zip(answers, correct, strict=True)):
        if not 1 <= k <= len(row_correct):
            raise ValueError(f"maj@{k} needs at least {k} samples; prompt {i} has {len(row_correct)}")
        votes: dict[str, list[int]] = {}
        for s in range(k):
            if row_answers[s] is not None:
                votes.setdefault(" ".join(str(row_answers[s]).split()), []).append(s)
        if votes:  # max keeps the first of equal counts: dicts keep the order answers were first seen
            total += bool(row_correct[max(votes.values(), key=len)[0]])
    return total / len(correct)


def gap_recovery(acc_before: float, acc_after: float, acc_teacher: float) -> float:
    """Fraction of the student-teacher gap closed: ``(after - before) / (teacher - before)``.

    1.0 means the student reached the teacher, 0.0 no change, negative a regression, and
    values above 1.0 a student that passed its teacher. When the teacher is no better than the
    starting student (``teacher == before``) there is no gap to recover and the ratio is
    undefined: returns ``float('nan')`` instead of raising, so a sweep keeps running.
    """
    gap = acc_teacher - acc_before
    if gap == 0:
        return float("nan")
    return (acc_after - acc_before) / gap


def _check_matrix(correct_matrix: Sequence[Sequence[bool]]) -> None:
    if len(correct_matrix) == 0:
        raise ValueError("need at least one prompt's results, got an empty list")
    for i, row in enumerate(correct_matrix):
        if len(row) == 0:
            raise ValueError(f"prompt {i} has no samples: every prompt needs k >= 1 results")

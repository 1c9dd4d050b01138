"""Statistics for the experiments: means with 95% t-intervals over seeds, AUROC, power-law fits, verdicts.

Pure Python (no scipy: it is not a dependency of opd). The Student-t quantiles are a table of
t_{0.975, df}; between tabulated degrees of freedom the next smaller df is used, which makes the
interval slightly wider (conservative), never narrower.

Verdicts follow one stated rule everywhere (:func:`verdict`): a claim "A > B" is *reproduced*
when the 95% interval of the mean paired difference (A - B, same seed) lies entirely above 0,
*not reproduced* when it lies entirely below 0 (the opposite holds), and *inconclusive* when it
contains 0 or fewer than 2 seeds were run.

Each verdict also carries its p-value (:attr:`Interval.p`): the smallest alpha at which the
(1 - alpha) t-interval still gives that verdict, so a decided verdict has p < 0.05. Over many claims,
:func:`benjamini_hochberg` says which decided verdicts survive a false-discovery-rate correction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"

# two-sided 95% quantiles t_{0.975, df}
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    21: 2.080,
    22: 2.074,
    23: 2.069,
    24: 2.064,
    25: 2.060,
    26: 2.056,
    27: 2.052,
    28: 2.048,
    29: 2.045,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


def t975(df: int) -> float:
    """Two-sided 95% Student-t quantile for ``df`` degrees of freedom (conservative between rows)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if df > 120:
        return _T975[120]  # the last row: slightly wide, never narrower
    return _T975[max(d for d in _T975 if d <= df)]


def t_sf(t: float, df: int) -> float:
    """P(T > t) for Student's t with ``df`` (a positive integer) degrees of freedom, exactly: the finite
    series of Abramowitz & Stegun 26.7.3-4 for A(t | df) = P(|T| < t)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    theta = math.atan(abs(t) / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), the sum empty at df 1
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for i in range(1, (df - 1) // 2):
            term *= c2 * (2 * i) / (2 * i + 1)
            total += term
        inside = 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= c2 * (2 * i - 1) / (2 * i)
            total += term
        inside = math.sin(theta) * total
    tail = max(0.0, (1.0 - inside) / 2)
    return tail if t >= 0 else 1.0 - tail


@dataclass
class Interval:
    """Mean of n values with its 95% t-interval (lo = hi = nan when n < 2); ``p`` the p-value of the
    verdict read from it (nan where none was: plain :func:`mean_ci`)."""

    mean: float
    lo: float
    hi: float
    n: int
    p: float = math.nan

    def fmt(self, digits: int = 3, scale: float = 1.0) -> str:
        if self.n == 0 or math.isnan(self.mean):
            return "-"
        m = f"{self.mean * scale:.{digits}f}"
        if self.n < 2:
            return f"{m} (n=1)"
        return f"{m} [{self.lo * scale:.{digits}f}, {self.hi * scale:.{digits}f}]"

    def as_dict(self) -> dict:
        return {"mean": self.mean, "lo": self.lo, "hi": self.hi, "n": self.n}


def mean_ci(values: Sequence[float]) -> Interval:
    """Mean and 95% t-interval; NaN values are dropped (a run that produced no number)."""
    xs = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    m = sum(xs) / n
    if n < 2:
        return Interval(m, math.nan, math.nan, 1)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return Interval(m, m - half, m + half, n)


def with_p(ci: Interval, bounds: Sequence[float]) -> Interval:
    """``ci`` with the p-value of a verdict that is decided where the interval leaves out each of
    ``bounds`` (0 for "A > B"; -margin, +margin for an equivalence): the smallest alpha at which the
    (1 - alpha) t-interval leaves out the bound nearest the mean, 2 P(T > distance / standard error).
    p < 0.05 exactly when the 95% interval decides (up to the 3-digit quantile table); 1 with fewer
    than 2 values."""
    if ci.n < 2:
        return replace(ci, p=1.0)
    se = (ci.hi - ci.mean) / t975(ci.n - 1)
    distance = min(abs(ci.mean - b) for b in bounds)
    if se <= 0:  # every value the same
        return replace(ci, p=0.0 if distance > 0 else 1.0)
    return replace(ci, p=min(1.0, 2 * t_sf(distance / se, ci.n - 1)))


def worst_p(cis: Sequence[Interval], verdicts: Sequence[str]) -> float:
    """The p-value of a verdict combined from parts ("reproduced" when every part is, "not reproduced"
    when one is): the largest part's p when all are reproduced (an intersection-union test), else the
    smallest not-reproduced part's, else (inconclusive) the largest."""
    if all(v == REPRODUCED for v in verdicts):
        return max(ci.p for ci in cis)
    against = [ci.p for ci, v in zip(cis, verdicts, strict=True) if v == NOT_REPRODUCED]
    return min(against) if against else max(ci.p for ci in cis)


def benjamini_hochberg(ps: Sequence[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values of a family of tests (same order as ``ps``): a test survives
    the false-discovery-rate correction at a rate q when its adjusted p is at most q, that is when its
    p is at most rank * q / m for some rank at or above its own (m tests, ranked by p)."""
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    adjusted = [1.0] * m
    running = 1.0
    for rank in range(m, 0, -1):  # step-up: the smallest m p / rank from this rank on
        i = order[rank - 1]
        running = min(running, ps[i] * m / rank)
        adjusted[i] = running
    return adjusted


def verdict(diffs: Sequence[float]) -> tuple[str, Interval]:
    """Verdict on "A > B" from paired differences A - B (one per seed); see the module docstring."""
    ci = with_p(mean_ci(diffs), (0.0,))
    if ci.n < 2:
        return INCONCLUSIVE, ci
    if ci.lo > 0:
        return REPRODUCED, ci
    if ci.hi < 0:
        return NOT_REPRODUCED, ci
    return INCONCLUSIVE, ci


def auroc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Area under the ROC curve of ``scores`` for the positive ``labels`` (Mann-Whitney U / n+ n-).

    Ties count one half (mid-ranks); NaN scores are dropped (they would break the sort). NaN when
    either class is empty."""
    pairs = sorted((s, y) for s, y in zip(map(float, scores), map(bool, labels)) if not math.isnan(s))
    n_pos = sum(1 for _, y in pairs if y)
    n_neg = len(pairs) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    rank_sum, i = 0.0, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        mid = (i + 1 + j) / 2  # ranks i+1..j share their mean
        rank_sum += mid * sum(1 for _, y in pairs[i:j] if y)
        i = j
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def fit_power_law(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of log y = a + b log x; returns (exponent b, prefactor e^a)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("need at least two (x, y) points of equal count")
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sxx
    return b, math.exp(my - b * mx)


def equivalence(diffs: Sequence[float], margin: float) -> tuple[str, Interval]:
    """Verdict on "A and B perform the same" within ``margin``: reproduced when the 95% interval of the
    paired difference lies inside (-margin, margin), not reproduced when it lies entirely outside it,
    inconclusive otherwise."""
    ci = with_p(mean_ci(diffs), (-margin, margin))
    if ci.n < 2:
        return INCONCLUSIVE, ci
    if -margin < ci.lo and ci.hi < margin:
        return REPRODUCED, ci
    if ci.lo >= margin or ci.hi <= -margin:
        return NOT_REPRODUCED, ci
    return INCONCLUSIVE, ci


def noninferior(diffs: Sequence[float], margin: float) -> tuple[str, Interval]:
    """Verdict on "A is at least as good as B" within ``margin`` (from paired differences A - B):
    reproduced when the 95% interval lies above -margin, not reproduced when it lies entirely below
    it, inconclusive otherwise."""
    ci = with_p(mean_ci(diffs), (-margin,))
    if ci.n < 2:
        return INCONCLUSIVE, ci
    if ci.lo > -margin:
        return REPRODUCED, ci
    if ci.hi < -margin:
        return NOT_REPRODUCED, ci
    return INCONCLUSIVE, ci

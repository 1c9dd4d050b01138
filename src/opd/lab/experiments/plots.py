"""Curves for the experiments (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def line_plot(
    path: Path,
    series: dict,
    xlabel: str,
    ylabel: str,
    title: str,
    logy: bool = False,
    logx: bool = False,
    bounds: tuple[float, float] | None = None,
) -> None:
    """One line per series; ``series[label] = (xs, mean, lo, hi)``, the band drawn when lo/hi are finite.

    ``bounds``: the range the quantity can take (a rate: 0 to 1); bands are cut to it, since a
    t-interval over three seeds easily reaches past what any run could score."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, (xs, mean, lo, hi) in series.items():
        (line,) = ax.plot(xs, mean, label=label, marker="o" if len(xs) <= 12 else None, markersize=3)
        if lo is not None and all(v == v for v in lo):  # NaN bands (one seed) are not drawn
            if bounds is not None:
                lo, hi = [[min(max(v, bounds[0]), bounds[1]) for v in band] for band in (lo, hi)]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

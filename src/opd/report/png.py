"""PNG files of the report's charts (matplotlib, Agg backend: no display needed).

Draws the same chart specs as the page (:mod:`opd.report.charts`), one file per chart, for papers
and chat. Usage: ``write_pngs(build_charts(runs), out_dir)`` returns the paths written.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.colors import TwoSlopeNorm  # noqa: E402

from opd.report.charts import NEGATIVE, PALETTE, POSITIVE  # noqa: E402
from opd.runs.progress import progress_bar  # noqa: E402


def _line(ax, chart: dict) -> None:
    for s in chart["series"]:
        color = PALETTE[s["color"] % len(PALETTE)]
        style = "--" if s["dashed"] else "-"
        smooth = s.get("smooth")
        ax.plot(
            s["x"],
            s["y"],
            style,
            color=color,
            alpha=0.3 if smooth else 1.0,
            lw=1,
            label=None if smooth else s["label"],
            marker="o" if len(s["x"]) < 20 else None,
            ms=3,
        )
        if smooth:
            ax.plot(s["x"], smooth, style, color=color, lw=1.8, label=s["label"])
        if s.get("marks"):
            ys = dict(zip(s["x"], s["y"]))
            ax.plot(s["marks"], [ys[m] for m in s["marks"]], "x", color=color, ms=4, alpha=0.8)
    _hlines(ax, chart)
    _share_axis(ax, chart)
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.25)


def _hlines(ax, chart: dict) -> None:
    for h in chart["hlines"]:
        ax.axhline(h["y"], color="#888", lw=1, ls=":")
        ax.annotate(
            h["label"],
            (1, h["y"]),
            xycoords=("axes fraction", "data"),
            ha="right",
            va="bottom",
            fontsize=8,
            color="#555",
        )


def _share_axis(ax, chart: dict) -> None:
    """A share's axis from 0; "none" written across a share that was 0 throughout (charts.share_axis)."""
    if "ymin" in chart:
        ax.set_ylim(bottom=chart["ymin"])
    if "ymax" in chart:
        ax.set_ylim(top=max(chart["ymax"], ax.get_ylim()[1]))
    if chart.get("none"):
        ax.text(0.5, 0.5, chart["none"], transform=ax.transAxes, ha="center", va="center", color="#555")


def _bars(ax, chart: dict) -> None:
    """Each run's one evaluation as a bar with its value (avg@k hatched), the references as lines."""
    bars = chart["bars"]
    drawn = ax.bar(
        range(len(bars)),
        [b["value"] for b in bars],
        color=[PALETTE[b["color"] % len(PALETTE)] for b in bars],
        alpha=0.85,
        edgecolor="white",
    )
    for patch, b in zip(drawn, bars, strict=True):
        if b["dashed"]:
            patch.set_hatch("//")
    ax.bar_label(drawn, labels=[f"{b['value']:.3g}" for b in bars], fontsize=8)
    ax.set_xticks(range(len(bars)), [b["label"] for b in bars], fontsize=8, rotation=15, ha="right")
    _hlines(ax, chart)
    ax.set_ylim(0, max([1.0, *(b["value"] for b in bars), *(h["y"] for h in chart["hlines"])]) * 1.05)
    ax.grid(alpha=0.25, axis="y")


def _heatmap(fig, ax, chart: dict) -> None:
    z = [list(row) for row in zip(*chart["z"])]  # buckets x steps
    bound, x = chart["bound"], chart["x"]
    # Bucket 0 (the start of the response) on top, as in the page: depth grows downward.
    im = ax.imshow(
        z,
        aspect="auto",
        origin="upper",
        cmap="RdBu" if chart["sign"] > 0 else "RdBu_r",
        norm=TwoSlopeNorm(0.0, -bound, bound),
        extent=(x[0] - 0.5, x[-1] + 0.5, chart["buckets"] - 0.5, -0.5),
        interpolation="nearest",
    )
    fig.colorbar(im, ax=ax, label=chart["zlabel"])


def _scatter(ax, chart: dict) -> None:
    for pts, color, label in (
        (chart["negative"], NEGATIVE, "negative reward (student > teacher)"),
        (chart["positive"], POSITIVE, "positive reward (teacher > student)"),
    ):
        if pts:
            ax.scatter(
                [p[0] for p in pts],
                [p[1] for p in pts],
                s=6,
                alpha=0.45,
                color=color,
                label=f"{label}: {len(pts)}",
                edgecolors="none",
            )
    ax.plot([0, 1], [0, 1], color="#444", lw=1, ls="--", label="y = x")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_aspect("equal")
    ax.legend(fontsize=7, frameon=False, loc="upper left")


def draw(chart: dict, path: Path) -> Path:
    square = chart["kind"] == "scatter"
    fig, ax = plt.subplots(figsize=(5, 5) if square else (6.4, 3.6), dpi=120)
    if chart["kind"] == "line":
        _line(ax, chart)
    elif chart["kind"] == "bar":
        _bars(ax, chart)
    elif chart["kind"] == "heatmap":
        _heatmap(fig, ax, chart)
    else:
        _scatter(ax, chart)
    ax.set_title(chart["title"], fontsize=11)
    ax.set_xlabel(chart["xlabel"])
    ax.set_ylabel(chart["ylabel"])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_pngs(charts: list[dict], out_dir: Path, show_progress: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with progress_bar("report charts (PNG)", total=len(charts), enabled=show_progress) as bar:
        for chart in charts:
            paths.append(draw(chart, out_dir / f"{chart['id']}.png"))
            bar.advance()
    return paths

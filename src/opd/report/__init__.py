"""The run report (``opd report RUN_DIR ... --out DIR``): one self-contained HTML page and PNGs.

Reads run directories only (never the trainer): :mod:`.load` reads them, tolerant of runs in
progress and damaged lines; :mod:`.charts` turns them into chart specs; :mod:`.png` draws the
specs with matplotlib; :mod:`.inspector` packs logged rollouts for the token inspector;
:mod:`.samples` picks the evaluation records (wrong, truncated, flipped);
:mod:`.page` writes the page (inline SVG drawn by ``report.js``; it opens offline).

Usage::

    from opd.report import write_report
    html_path = write_report([Path("runs/demo/sampled"), Path("runs/demo/lsm")], Path("runs/demo/report"))
"""

from __future__ import annotations

import os
from pathlib import Path

from opd.errors import UserError
from opd.report.charts import PALETTE, build_charts, summary_rows
from opd.report.inspector import inspector_data
from opd.report.load import load_runs
from opd.report.page import render_page
from opd.report.png import write_pngs
from opd.report.samples import samples_data

__all__ = ["write_report", "default_out"]

PNG_DIR = "charts"


def default_out(run_dirs: list[Path]) -> Path:
    """``RUN_DIR/report`` for one run; ``<common parent>/report`` for several (``runs/demo/report``)."""
    paths = [Path(p).resolve() for p in run_dirs]
    if len(paths) == 1:
        return paths[0] / "report"
    return Path(os.path.commonpath(paths)) / "report"


def write_report(run_dirs: list[Path], out: Path, inspector_steps: int = 24, show_progress: bool = True) -> Path:
    """Write ``out/report.html`` and ``out/charts/*.png`` for ``run_dirs``; returns the page's path."""
    if inspector_steps < 1:
        raise UserError(
            f"inspector_steps={inspector_steps}: the token inspector needs at least 1 step; pass "
            "--inspector-steps 1 or more"
        )
    runs = load_runs(run_dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    charts = build_charts(runs)
    write_pngs(charts, out / PNG_DIR, show_progress=show_progress)
    inspectors = [inspector_data(r, inspector_steps) for r in runs]
    page = render_page(runs, charts, summary_rows(runs), inspectors, PALETTE, PNG_DIR, samples_data(runs))
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return path

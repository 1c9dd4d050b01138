"""``opd results``: build ``docs/RESULTS.md`` from the experiments' outputs (never written by hand).

For each experiment it takes ``DIR/NAME/results.json`` from the given output directories, then
from the copy kept beside the document (``docs/results/NAME/results.json``), preferring a
full-size result over a ``--quick`` one (a quick result is labelled as such); copies the plots,
the results.json and the run data (``data.json``) to ``docs/results/NAME/`` and writes one
document: a summary of every claim's verdict, then each experiment's tables, plots, wall time,
machine and the command that made it. The summary also gives each verdict's p-value and says which
decided verdicts survive a Benjamini-Hochberg false-discovery-rate correction over all claims
(:data:`FDR_Q`). Where the run data is there, the tables, claims and notes are not copied from
results.json but recomputed: the experiment's analysis runs again on the data
(:mod:`opd.lab.experiments.rundata`), so every interval and verdict follows from committed numbers.
An experiment with no results.json anywhere (or only a quick one, where the document holds a full
result) keeps its summary rows and section from the document as it was (documents written before
the copies were kept), so a rerun of one experiment never drops the others.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import cast

from opd.errors import UserError
from opd.lab.experiments import NAMES, get_experiment
from opd.lab.experiments.core import (
    DATA,
    Settings,
    claim_text,
    machine_words,
    md_cell,
    render_markdown,
    verdict_cell,
)
from opd.lab.experiments.rundata import RunData
from opd.lab.experiments.stats import INCONCLUSIVE, benjamini_hochberg

FDR_Q = 0.05  # the false-discovery rate the summary's correction controls
SUMMARY_HEAD = f"| experiment | size | seeds | source | claim | verdict | numbers | p | after BH (q = {FDR_Q:g}) |"


def _pick(dirs: list[Path], name: str) -> dict | None:
    found = []
    for d in dirs:
        p = Path(d) / name / "results.json"
        if p.is_file():
            try:
                res = json.loads(p.read_text())
                quick = bool(res["quick"])
            except (ValueError, KeyError, TypeError) as exc:
                raise UserError(
                    f"{p} is not a results.json written by `opd experiment` ({type(exc).__name__}: "
                    f"{exc}); delete it and rerun `opd experiment {name}`"
                ) from exc
            res["_dir"], res["quick"] = str(p.parent), quick
            found.append(res)
    full = [r for r in found if not r["quick"]]
    return (full or found or [None])[0]


def _kept(doc: Path) -> dict[str, tuple[list[str], str]]:
    """Each experiment's (summary rows, section) in the document as it is now."""
    if not doc.is_file():
        return {}
    text = doc.read_text()
    kept = {}
    for name in NAMES:
        rows = [line for line in text.splitlines() if line.startswith(f"| {name} |")]
        match = re.search(rf"^## {re.escape(name)}: .*?(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
        if rows and match:
            kept[name] = rows, match.group(0).rstrip("\n") + "\n"
    return kept


def _p_cell(p: float | None) -> str:
    return "-" if p is None else ("<0.001" if p < 0.001 else f"{p:.3f}")


def _summary(rows: list[dict]) -> list[str]:
    """The summary table: each claim's row, its p and whether a decided verdict survives the
    Benjamini-Hochberg correction over every full-size claim with a p (the family), then what that says.

    A row is {"cells": the first seven cells, "p": float or None, "decided": bool, "quick": bool,
    "by_construction": bool}."""
    family = [i for i, r in enumerate(rows) if r["p"] is not None and not r["quick"]]
    adjusted = dict(zip(family, benjamini_hochberg([rows[i]["p"] for i in family]), strict=True))
    lines = [SUMMARY_HEAD, "|" + "---|" * 9]
    for i, r in enumerate(rows):
        if i not in adjusted or not r["decided"]:
            after = "-"
        else:
            after = f"{'survives' if adjusted[i] <= FDR_Q else 'does not survive'} (adjusted p {_p_cell(adjusted[i])})"
        lines.append("| " + " | ".join(map(md_cell, [*r["cells"], _p_cell(r["p"]), after])) + " |")
    decided = [i for i in family if rows[i]["decided"]]
    survive = sum(adjusted[i] <= FDR_Q for i in decided)
    by_construction = sum(r["by_construction"] for r in rows)
    return [
        *lines,
        "",
        f"**Many claims at once.** Each verdict above reads its own 95% interval; with {len(rows)} claims some "
        "decided verdicts are expected by chance alone. *p* is a verdict's p-value: the smallest alpha at which "
        "the (1 - alpha) t-interval still gives that verdict (a decided verdict has p < 0.05; a verdict combined "
        "from several intervals takes the weakest needed part's). *After BH* applies the Benjamini-Hochberg "
        f"false-discovery-rate correction at q = {FDR_Q:g} over all {len(family)} full-size claims with a p "
        "(inconclusive ones and those true by construction included): rank the p-values, find the largest rank i "
        f"with p_(i) <= i q / {len(family)}, and the decided verdicts ranked at or before it survive (adjusted p <= "
        f"q). {survive} of the {len(decided)} decided verdicts survive; the other {len(decided) - survive} hold at "
        f"95% on their own but not once the number of claims is allowed for. {by_construction} claims are *true "
        "by construction* (marked in the claim): they hold whatever the runs do and test nothing.",
        "",
    ]


def _kept_row(line: str) -> dict:
    """A summary row kept from the document, its p read back (rows written before the p column have none)."""
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    p = None
    if len(cells) == 9 and cells[7] not in ("-", ""):
        p = 0.0 if cells[7] == "<0.001" else float(cells[7])
    return {
        "cells": cells[:7],
        "p": p,
        "decided": INCONCLUSIVE not in cells[5],
        "quick": "quick" in cells[1],
        "by_construction": "*true by construction*" in cells[4],
    }


def _section_wall_and_machine(section: str) -> tuple[float, str]:
    wall = re.search(r"wall time ([0-9.]+) min of runs", section)
    machine = re.search(r"machine: (\d+ CPU cores, torch [^,]+)", section)
    return (float(wall.group(1)) if wall else 0.0), (machine.group(1) if machine else "")


def _store(res: dict, target: Path) -> None:
    """The plots and results.json beside the document, so the next ``opd results`` finds them."""
    target.mkdir(parents=True, exist_ok=True)
    source = Path(res["_dir"])
    for file in [*res["plots"], *([DATA] if (source / DATA).is_file() else [])]:
        if (source / file).resolve() != (target / file).resolve():
            shutil.copy(source / file, target / file)
    (target / "results.json").write_text(json.dumps({k: v for k, v in res.items() if k != "_dir"}, indent=1) + "\n")


def recompute(name: str, res: dict, data: Path) -> dict:
    """``res`` with its tables, plots, notes and claims made again by the experiment's analysis from the
    run data recorded when it ran (its plots are drawn into a scratch folder: the kept PNGs stay)."""
    exp = get_experiment(name)
    with tempfile.TemporaryDirectory() as tmp:
        s = Settings(Path(tmp) / name, res["seeds"], res["quick"], reads=RunData.load(data))
        s.out.mkdir(parents=True)
        analysis = exp.analyze(s, exp.plan(s))
    claims = [dataclasses.asdict(c) for c in analysis.claims]
    return {**res, "tables": analysis.tables, "plots": analysis.plots, "notes": analysis.notes, "claims": claims}


def build_results_md(dirs: list[Path], doc: Path, log=print) -> Path:
    """Write ``doc`` (and its plots beside it under ``results/``) from the results found in ``dirs``."""
    doc = Path(doc)
    plots_root = doc.parent / "results"
    picked = {n: _pick([*dirs, plots_root], n) for n in NAMES}
    # A section kept from the document gives way to a results.json, unless that one is quick and the section full.
    kept = {
        n: v
        for n, v in _kept(doc).items()
        if picked[n] is None or (cast(dict, picked[n])["quick"] and "Size: full size" in v[1])
    }
    if not any(picked.values()) and not kept:
        raise UserError(f"no experiment results under {', '.join(map(str, dirs))}; run `opd experiment NAME` first")
    summary: list[dict] = []
    sections, wall, machines = [], 0.0, set()
    for name, res in picked.items():
        if name in kept:
            rows, section = kept[name]
            summary += [_kept_row(row) for row in rows]
            sections.append(section)
            minutes, machine = _section_wall_and_machine(section)
            wall += minutes
            machines |= {machine} if machine else set()
            continue
        if res is None:
            sections.append(f"## {name}\n\nNot run yet: `opd experiment {name}`.\n")
            continue
        size = "quick (smoke test)" if res["quick"] else "full"
        _store(res, plots_root / name)
        if (plots_root / name / DATA).is_file():
            res = recompute(name, res, plots_root / name / DATA)
            log(f"{name}: tables and verdicts recomputed from {plots_root / name / DATA}")
        else:
            log(f"{name}: no {DATA} (run before run data was kept): tables as its results.json holds them")
        for c in res["claims"]:
            cells = [name, size, res["seeds"], c["source"], claim_text(c), verdict_cell(res, c), c["evidence"]]
            summary.append(
                {
                    "cells": cells,
                    "p": c.get("p"),
                    "decided": c["verdict"] != INCONCLUSIVE,
                    "quick": bool(res["quick"]),
                    "by_construction": bool(c.get("by_construction")),
                }
            )
        sections.append(
            f"## {res['title']}\n\nMade with `{res['command']}`.\n\n"
            + render_markdown(res, plot_prefix=f"results/{name}/")
        )
        wall += res["wall_s"] / 60
        machines.add(machine_words(res["machine"]))
    head = [
        "# Results: the papers' claims at small scale",
        "",
        f"Runs behind this document: {wall:.1f} min of wall time in all, on {'; '.join(sorted(machines))}.",
        "",
        "Generated by `opd results` from the experiments' `results.json` files and, where kept, their run data "
        "(`docs/results/NAME/data.json`: the values each analysis read of its runs, from which `opd results` "
        "recomputes the tables, intervals and verdicts); do not edit by hand (rerun the experiments and "
        "`opd results`). Every verdict follows a "
        "rule stated next to it; intervals are 95% Student-t intervals over seeds. Results marked *quick* come from "
        "`--quick` smoke runs (a few steps) and say nothing about the claims: they only show the pipeline runs.",
        "",
        "## Summary of verdicts",
        "",
        *_summary(summary),
    ]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(head) + "\n" + "\n".join(sections))
    return doc

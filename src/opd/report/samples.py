"""The report's view of evaluation records: what the model wrote, the answer read, the verdict.

A run's evaluations write ``RUN/eval_samples/step_NNNNNNN.jsonl`` (``opd eval``: ``OUT/eval_samples.jsonl``;
a multi-task run: each task's in ``RUN/tasks/NAME/eval_samples/``; the layout and fields are in
:mod:`opd.evaluation.records`). The page shows the last evaluation's records of each run (of each task),
filterable by wrong, truncated, and **flipped**: prompts whose verdict changed since the run's (the task's)
previous evaluation, or between this last evaluation and the first run's (of the same task). A prompt's
verdict is its headline response's (greedy, else its first sample).

Usage::

    from opd.report.samples import samples_data, flips
    data = samples_data(runs)   # per run, one view per task evaluated ("" for a run's own), for the page
    flips(read_samples(a), read_samples(b))   # [{"item", "prompt", "before", "after"}, ...]
"""

from __future__ import annotations

import re
from pathlib import Path

from opd.report.load import RunData, read_jsonl

# The page carries at most this many records per run, each text cut to TEXT characters (the files keep more).
MAX_RECORDS = 600
TEXT = 2000
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


def eval_files(run_dir: Path) -> list[tuple[int | None, Path]]:
    """A run's records files in step order (``opd eval``'s one file: step None)."""
    found = []
    for p in (Path(run_dir) / "eval_samples").glob("step_*.jsonl"):
        m = _STEP_FILE.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), p))
    single = Path(run_dir) / "eval_samples.jsonl"
    return sorted(found) or ([(None, single)] if single.is_file() else [])


def read_samples(path: Path, skipped: list[str] | None = None) -> list[dict]:
    """The records of one file (malformed lines noted in ``skipped``)."""
    return read_jsonl(path, [] if skipped is None else skipped, need_step=False)


def headline(records: list[dict]) -> dict[tuple, dict]:
    """Each prompt's headline record (greedy, else its lowest sample), keyed by (item, prompt)."""
    out: dict[tuple, dict] = {}
    for r in records:
        key = (r.get("item"), r.get("prompt"))
        if key not in out or r.get("sample", 0) < out[key].get("sample", 0):
            out[key] = r
    return out


def flips(before: list[dict], after: list[dict]) -> list[dict]:
    """The prompts of both evaluations whose headline verdict differs, in item order."""
    a, b = headline(before), headline(after)
    changed = [k for k in b if k in a and bool(a[k].get("correct")) != bool(b[k].get("correct"))]
    return [
        {"item": k[0], "prompt": k[1], "before": bool(a[k].get("correct")), "after": bool(b[k].get("correct"))}
        for k in sorted(changed, key=lambda k: (k[0] is None, k[0]))
    ]


def _shown(r: dict) -> dict:
    keys = ("item", "sample", "prompt", "response", "answer", "reference", "correct", "tokens", "truncated", "end")
    return {k: (v[:TEXT] + " [...]" if isinstance(v, str) and len(v) > TEXT else v) for k, v in r.items() if k in keys}


def eval_sources(run_dir: Path) -> list[tuple[str, Path]]:
    """A run's folders of evaluation records, as (task, folder): its own ("") where it has records, then each
    task's of a multi-task run (``tasks/NAME``), by name."""
    run_dir = Path(run_dir)
    found = [("", run_dir)] if eval_files(run_dir) else []
    tasks = run_dir / "tasks"
    if tasks.is_dir():
        found += [(p.name, p) for p in sorted(tasks.iterdir()) if p.is_dir() and eval_files(p)]
    return found


def samples_data(runs: list[RunData]) -> list[list[dict]]:
    """Per run, one view per folder of records (:func:`eval_sources`): its task, its evaluations' steps, the last
    one's records (at most MAX_RECORDS), and the items that flipped since its previous evaluation and against
    the last evaluation of the same task in the first run that has one."""
    first: dict[str, tuple[int, list[dict]]] = {}  # task -> (the run, its last records): flips' reference
    out = []
    for i, run in enumerate(runs):
        views = []
        for task, folder in eval_sources(run.path):
            files = eval_files(folder)
            records = read_samples(files[-1][1], run.skipped)
            previous = read_samples(files[-2][1], run.skipped) if len(files) > 1 else []
            ref_run, reference = first.setdefault(task, (i, records))
            views.append(
                {
                    "task": task,
                    "steps": [s for s, _ in files],
                    "records": [_shown(r) for r in records[:MAX_RECORDS]],
                    "total": len(records),
                    "since": files[-2][0] if len(files) > 1 else None,
                    "flipped_since": [f["item"] for f in flips(previous, records)] if previous else [],
                    "flipped_vs_first": [f["item"] for f in flips(reference, records)] if ref_run != i else [],
                }
            )
        out.append(views)
    return out

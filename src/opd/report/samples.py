"""The report's view of evaluation records: what the model wrote, the answer read, the verdict.

A run's evaluations write ``RUN/eval_samples/step_NNNNNNN.jsonl`` (``opd eval``: ``OUT/eval_samples.jsonl``;
the layout and fields are in :mod:`opd.evaluation.records`). The page shows the last evaluation's
records of each run, filterable by wrong, truncated, and **flipped**: prompts whose verdict changed
since the run's previous evaluation, or between this run's last evaluation and the first run's. A
prompt's verdict is its headline response's (greedy, else its first sample).

Usage::

    from opd.report.samples import samples_data, flips
    data = samples_data(runs)   # one entry per run, for the page
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


def samples_data(runs: list[RunData]) -> list[dict]:
    """Per run, for the page: its evaluations' steps, the last one's records (at most MAX_RECORDS), and the
    items that flipped since its previous evaluation and against the first run's last evaluation."""
    last_of: list[list[dict]] = []
    out = []
    for run in runs:
        files = eval_files(run.path)
        records = read_samples(files[-1][1], run.skipped) if files else []
        previous = read_samples(files[-2][1], run.skipped) if len(files) > 1 else []
        last_of.append(records)
        entry = {
            "steps": [s for s, _ in files],
            "records": [_shown(r) for r in records[:MAX_RECORDS]],
            "total": len(records),
            "since": files[-2][0] if len(files) > 1 else None,
            "flipped_since": [f["item"] for f in flips(previous, records)] if previous else [],
            "flipped_vs_first": [f["item"] for f in flips(last_of[0], records)] if len(last_of) > 1 else [],
        }
        out.append(entry)
    return out

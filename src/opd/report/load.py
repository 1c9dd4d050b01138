"""Read run directories for the report, tolerant of what a live or damaged run leaves behind.

A run directory (written by ``opd train``, see :mod:`opd.runs.rundir`) holds ``config.json``,
``metrics.jsonl`` (step records and ``eval/`` records), ``rollouts.jsonl`` (per-token detail of a
few rollouts per step) and, once finished, ``final/``. The demo writes ``summary.json`` (teacher
and starting-student accuracy) next to its run directories; a run directory of its own may hold
one too. This module only reads files: it never imports the trainer. Missing files, malformed or
cut-off lines and values of the wrong type are skipped and described in ``RunData.skipped``, so a
run still in progress (or a damaged one) still gets a report that says what was left out.

Usage::

    from opd.report.load import load_runs
    runs = load_runs([Path("runs/demo/sampled"), Path("runs/demo/lsm")])
    runs[0].steps[-1]["train/loss"], runs[0].skipped
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd.errors import UserError
from opd.runs.records import MAPPING_OPTIONS, PER_TOKEN_FIELDS, ROLLOUT_FIELDS


@dataclass
class RunData:
    """One run directory as read: records sorted by step, and notes on what was skipped."""

    path: Path
    name: str
    config: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    rollouts: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    vocab: dict[int, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    @property
    def planned_steps(self) -> int | None:
        steps = self.config.get("steps")
        return steps if isinstance(steps, int) else None

    @property
    def in_progress(self) -> bool:
        """No final model yet, or fewer step records than the config asks for."""
        done = len(self.steps) >= (self.planned_steps or 0)
        return not ((self.path / "final").is_dir() and done)


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _clean_record(rec: dict) -> tuple[dict, list[str]]:
    """Keep numbers, booleans and lists of numbers; name the keys dropped for a wrong type or NaN."""
    out, bad = {}, []
    for k, v in rec.items():
        if isinstance(v, bool) or _finite_number(v):
            out[k] = v
        elif isinstance(v, list) and v and all(_finite_number(x) for x in v):
            out[k] = v
        else:
            bad.append(k)
    return out, bad


def read_jsonl(path: Path, skipped: list[str], need_step: bool = True) -> list[dict]:
    """Objects of a JSONL file, one per line; malformed lines are counted into ``skipped``."""
    if not path.is_file():
        skipped.append(f"{path.name} is missing")
        return []
    records, bad_lines = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad_lines.append(i)
                continue
            if not isinstance(rec, dict) or (
                need_step and not (isinstance(rec.get("step"), int) and not isinstance(rec.get("step"), bool))
            ):
                bad_lines.append(i)
                continue
            records.append(rec)
    if bad_lines:
        shown = ", ".join(map(str, bad_lines[:5])) + (" ..." if len(bad_lines) > 5 else "")
        skipped.append(f"{path.name}: {len(bad_lines)} malformed line(s) skipped (line {shown})")
    return records


def _read_json(path: Path, skipped: list[str]) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as exc:
        skipped.append(f"{path.name} is not valid JSON ({exc.msg}, line {exc.lineno}); ignored")
        return {}
    if not isinstance(data, dict):
        skipped.append(f"{path.name} does not hold a JSON object; ignored")
        return {}
    return data


def _options(config: dict) -> dict:
    """config.json's options by name. opd writes them nested by section (``{"eval": {"eval_every": 50}}``,
    opd.config.sections), runs made before sections flat; an option's name is unique across sections and
    only the options of MAPPING_OPTIONS hold a mapping, so merging the others' gives the flat options either way."""
    flat: dict = {}
    for key, value in config.items():
        flat.update(value if isinstance(value, dict) and key not in MAPPING_OPTIONS else {key: value})
    return flat


def _split_metrics(records: list[dict], skipped: list[str]) -> tuple[list[dict], list[dict]]:
    """Step records and eval records, sorted by step; a repeated step keeps its last record."""
    steps: dict[Any, dict] = {}
    evals: dict[Any, dict] = {}
    dropped: set[str] = set()
    for rec in records:
        clean, bad = _clean_record(rec)
        dropped.update(bad)
        target = evals if any(k.startswith("eval/") for k in clean) else steps
        target[clean["step"]] = clean
    if dropped:
        skipped.append(f"metrics.jsonl: non-numeric or NaN values skipped for {', '.join(sorted(dropped))}")
    return [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)]


def _valid_rollout(r: dict) -> bool:
    if any(k not in r for k in ROLLOUT_FIELDS):
        return False
    n = len(r["tokens"]) if isinstance(r["tokens"], list) else -1
    # An episode's record (``action`` flags) holds the environment's tokens too, null in the model's fields.
    episode = ("action",) if "action" in r else ()
    return n > 0 and all(isinstance(r[k], list) and len(r[k]) == n for k in PER_TOKEN_FIELDS + episode)


def _summary_for(run_dir: Path, skipped: list[str]) -> dict:
    """Teacher/starting-student accuracy from ``summary.json`` in the run directory or its parent.

    The demo's summary (in the parent) keys its runs by directory name under ``objectives``.
    """
    for path in (run_dir / "summary.json", run_dir.parent / "summary.json"):
        data = _read_json(path, skipped)
        if not data:
            continue
        out = {
            k: data[k]
            for k in ("teacher_acc", "teacher_avg_at_k", "student_init_acc", "student_init_avg_at_k", "eval_size", "k")
            if _finite_number(data.get(k))
        }
        entry = (data.get("objectives") or {}).get(run_dir.name)
        if isinstance(entry, dict):
            out.update({k: v for k, v in entry.items() if _finite_number(v)})
        if out:
            out["source"] = str(path)
            return out
    return {}


def _vocab(run_dir: Path, rollouts: list[dict], skipped: list[str]) -> dict[int, str]:
    """Token strings by id, for labelling the inspector's bars without the trainer.

    From the rollouts themselves (sampled tokens, and ``topk_tokens`` where logged), then the
    final model's ``tokenizer.json`` when the run has finished.
    """
    vocab: dict[int, str] = {}
    for r in rollouts:
        vocab.update(zip(r["token_ids"], r["tokens"]))
        for k, v in (r.get("topk_tokens") or {}).items():
            if str(k).isdigit():
                vocab[int(k)] = str(v)
    tok_file = run_dir / "final" / "tokenizer.json"
    if tok_file.is_file():
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tok_file))
            wanted = {i for r in rollouts for row in r["teacher_topk_ids"] if row for i in row} - vocab.keys()
            vocab.update({i: s for i in wanted if (s := tok.id_to_token(i)) is not None})
        except Exception as exc:  # a damaged tokenizer file only costs labels
            skipped.append(f"final/tokenizer.json could not be read ({type(exc).__name__}); some tokens shown by id")
    return vocab


def load_run(run_dir: Path | str, name: str | None = None) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory; pass run directories written by `opd train` or `opd demo`")
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "config.json").is_file():
        inside = sorted(p for p in run_dir.iterdir() if (p / "metrics.jsonl").is_file())
        hint = (
            f"it holds run directories: pass them, e.g. `opd report {' '.join(str(p) for p in inside)}`"
            if inside
            else "pass a directory written by `opd train`, e.g. runs/demo/lsm"
        )
        raise UserError(f"{run_dir} is not a run directory (no metrics.jsonl or config.json); {hint}")
    run = RunData(path=run_dir, name=name or run_dir.name)
    run.config = _options(_read_json(run_dir / "config.json", run.skipped))
    if not run.config and not any("config.json" in s for s in run.skipped):
        run.skipped.append("config.json is missing: settings unknown")
    run.steps, run.evals = _split_metrics(read_jsonl(run_dir / "metrics.jsonl", run.skipped), run.skipped)
    raw = read_jsonl(run_dir / "rollouts.jsonl", run.skipped)
    run.rollouts = [r for r in raw if _valid_rollout(r)]
    if len(run.rollouts) < len(raw):
        run.skipped.append(
            f"rollouts.jsonl: {len(raw) - len(run.rollouts)} record(s) with missing or "
            "mismatched per-token fields skipped"
        )
    run.summary = _summary_for(run_dir, run.skipped)
    run.vocab = _vocab(run_dir, run.rollouts, run.skipped)
    if run.in_progress:
        planned = run.planned_steps
        run.skipped.append(
            f"run in progress or stopped early: {len(run.steps)} of {planned or '?'} steps logged"
            + ("" if (run_dir / "final").is_dir() else ", no final model yet")
        )
    return run


def load_runs(run_dirs: Sequence[Path | str]) -> list[RunData]:
    """Load several runs; names are directory names, widened with the parent where two collide."""
    if not run_dirs:
        raise UserError("no run directory given; pass one or more, e.g. `opd report runs/demo/sampled runs/demo/lsm`")
    paths = [Path(p) for p in run_dirs]
    names = [p.name for p in paths]
    names = [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]
    return [load_run(p, n) for p, n in zip(paths, names)]

"""What an OPD run keeps (``--keep-checkpoints``, ``--keep-best``, ``--final-best``; the rules are
checked in :mod:`opd.config.checkpoints`): each evaluated checkpoint's score, the weights ``final/``
is written from, and ``summary.json``, which names the best checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from opd.config import TrainConfig
from opd.config.checkpoints import parse_keep_best
from opd.runs.rundir import RunDir


def best_rule(cfg: TrainConfig) -> tuple[str, str] | None:
    """(metric, "max" or "min") of ``--keep-best``, or None."""
    return parse_keep_best(cfg.run.keep_best) if cfg.run.keep_best else None


def checkpoint_score(cfg: TrainConfig, record: dict) -> float | None:
    """The ``--keep-best`` figure of an evaluation record (None: no rule, not evaluated, or not finite)."""
    rule = best_rule(cfg)
    value = record.get(rule[0]) if rule else None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_weights(cfg: TrainConfig, rundir: RunDir) -> dict[str, torch.Tensor] | None:
    """The best checkpoint's weights, for ``final/`` under ``--final-best`` (None: keep the last step's)."""
    best = rundir.best_checkpoint() if cfg.run.final_best else None
    if best is None:
        return None
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(best["model"]).glob("*.safetensors")):
        state.update(load_file(f))
    return state


def write_summary(cfg: TrainConfig, rundir: RunDir, steps: int, last_eval: dict) -> None:
    """``summary.json`` of a run with ``--keep-best``: the best checkpoint (path, step, figure) and what
    ``final/`` holds. Not written otherwise: the report then reads the demo's summary beside the run."""
    if not cfg.run.keep_best:
        return
    best = rundir.best_checkpoint()
    rundir.write_json(
        "summary.json",
        {
            "steps": steps,
            "best_checkpoint": best,
            "final": "best checkpoint" if cfg.run.final_best and best else "last step",
            "last_eval": {k: v for k, v in last_eval.items() if k != "step"},
        },
    )


def final_evaluation(cfg: TrainConfig, rundir: RunDir, last_eval: dict) -> dict:
    """The evaluation record of the weights in ``final/``: under ``--final-best`` the best checkpoint's
    step's (from ``metrics.jsonl``), else the last evaluation; what its model card reports."""
    best = rundir.best_checkpoint() if cfg.run.final_best else None
    metrics = rundir.path / "metrics.jsonl"
    if best is None or not metrics.is_file():
        return last_eval
    for line in metrics.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("step") == best["step"] and best["metric"] in record:
            return record
    return last_eval

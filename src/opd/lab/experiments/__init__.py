"""Experiments that check the papers' claims at small scale: ``opd experiment NAME``.

Each experiment (a module here exposing ``EXPERIMENT``) is a plan of runs over seeds plus an
analysis of the run directories; :mod:`opd.lab.experiments.core` runs, resumes and writes them, and
:mod:`opd.lab.experiments.results_md` gathers every experiment's results into ``docs/RESULTS.md``.
"""

from __future__ import annotations

import importlib

from opd.errors import UserError

# Each experiment is the module of its name (dashes as underscores), imported lazily so that
# `opd experiment variance` does not load transformers.
NAMES = (
    "variance",
    "objectives",
    "tokenizer-mismatch",
    "teacher-choice",
    "depth",
    "new-knowledge",
    "agentic",
    "cross-tokenizer",
    "gold-bytelevel",
    "multitask",
    "multitask-tail",
    "multitask-game",
    "vllm-rollouts",
    "async-rollouts",
    "collapse",
)
_MODULES = {name: f"opd.lab.experiments.{name.replace('-', '_')}" for name in NAMES}


def get_experiment(name: str):
    if name not in _MODULES:
        raise UserError(f"unknown experiment {name!r}; choose one of: {', '.join(NAMES)}")
    return importlib.import_module(_MODULES[name]).EXPERIMENT


def run(
    name: str,
    out,
    seeds: int = 3,
    quick: bool = False,
    show_progress: bool = True,
    workers: int = 1,
    adopt: bool = False,
    recorded=None,
) -> dict:
    from opd.lab.experiments.core import run_experiment

    return run_experiment(get_experiment(name), out, seeds, quick, show_progress, workers, adopt, recorded)

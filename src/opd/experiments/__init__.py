"""Experiments that check the papers' claims at small scale: ``opd experiment NAME``.

Each experiment (a module here exposing ``EXPERIMENT``) is a plan of runs over seeds plus an
analysis of the run directories; :mod:`opd.experiments.core` runs, resumes and writes them, and
:mod:`opd.experiments.results_md` gathers every experiment's results into ``docs/RESULTS.md``.
"""

from __future__ import annotations

import importlib

from opd.errors import UserError

# name -> module; imported lazily so `opd experiment variance` does not load transformers.
_MODULES = {
    "variance": "opd.experiments.variance",
    "objectives": "opd.experiments.objectives",
    "tokenizer-mismatch": "opd.experiments.mismatch",
    "teacher-choice": "opd.experiments.teacher_choice",
    "depth": "opd.experiments.depth",
    "agentic": "opd.experiments.agentic",
    "cross-tokenizer": "opd.experiments.cross_tokenizer",
    "gold-bytelevel": "opd.experiments.gold_bytelevel",
    "multitask": "opd.experiments.multitask",
    "multitask-tail": "opd.experiments.tail",
    "vllm-rollouts": "opd.experiments.vllm_rollouts",
}
NAMES = tuple(_MODULES)


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
) -> dict:
    from opd.experiments.core import run_experiment

    return run_experiment(get_experiment(name), out, seeds, quick, show_progress, workers, adopt)

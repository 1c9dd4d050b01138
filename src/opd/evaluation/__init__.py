"""Evaluation: a model on prompts (:mod:`~opd.evaluation.model_eval`, ``opd eval``) or on an
environment's held-out games (:mod:`~opd.evaluation.game_eval`), and the estimators behind the figures
(:mod:`~opd.evaluation.estimators`: plain Python, no opd import, importable from here)."""

from opd.evaluation.estimators import avg_at_k, gap_recovery, mean_pass_at_k, pass_at_k

__all__ = ["avg_at_k", "gap_recovery", "mean_pass_at_k", "pass_at_k"]

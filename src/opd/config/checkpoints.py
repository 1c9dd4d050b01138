"""Which checkpoints an OPD run keeps (``--keep-checkpoints N``, ``--keep-best METRIC``) and whether
``final/`` is the best one (``--final-best``), with the checks that refuse a rule the run can never meet
before it starts.

``--keep-best`` names an evaluation figure as ``metrics.jsonl`` logs it (``eval/accuracy``; a
multi-task run's ``eval/<task>/accuracy`` too), optionally ``:max`` (the default) or ``:min``. Every
evaluation then writes a checkpoint scored by that figure; the best scored one is kept beside the N
newest (NeMo-RL's keep_top_k with metric_name, TRL's save_total_limit with load_best_model_at_end).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.config.fields import Section, opt

# The figures an in-training evaluation logs (opd.evaluation.core: prompts and games), the ones a rule may
# name (tests/training/test_keep_checkpoints.py holds them to what the evaluation returns). SAMPLED need
# --eval-samples > 0, MAJORITY --maj-k > 0 on prompts with answers; GAMES come from --env tasks only.
GREEDY = ("accuracy", "response_tokens_mean", "response_tokens_max", "truncation_rate")
SAMPLED = ("avg_at_k", "pass_at_k")
MAJORITY = ("maj_at_k",)
GAMES = ("success_rate", "mean_turns_to_success", "invalid_action_rate", "env_errors")
MODES = ("max", "min")


@dataclass(frozen=True)
class CheckpointOptions(Section):
    """The checkpoint options of section "run" (opd train)."""

    keep_checkpoints: int = opt(
        2,
        "Keep the N newest checkpoints (older ones are deleted as new ones are written; resume reads the newest).",
    )
    keep_best: str = opt(
        "",
        "Also keep the best checkpoint by an evaluation figure, METRIC or METRIC:max / METRIC:min (default max), "
        "e.g. eval/accuracy or eval/pass_at_k: every evaluation then writes a checkpoint scored by it; its path "
        "is in checkpoints/best and summary.json. Refused when the run never evaluates that figure.",
    )
    final_best: bool = opt(
        False, "With --keep-best: final/ holds the best checkpoint's weights instead of the last step's."
    )


def parse_keep_best(spec: str) -> tuple[str, str]:
    """``"eval/accuracy:min"`` -> ("eval/accuracy", "min"); a bare figure name gets its ``eval/`` prefix."""
    metric, _, mode = spec.partition(":")
    metric = metric.strip()
    return (metric if metric.startswith("eval/") else f"eval/{metric}"), (mode.strip() or "max")

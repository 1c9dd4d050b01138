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
from typing import Any

from opd.config.fields import opt, require

# The figures an in-training evaluation logs (opd.evaluation.core: prompts and games), the ones a rule may
# name (tests/training/test_keep_checkpoints.py holds them to what the evaluation returns). SAMPLED need
# --eval-samples > 0, MAJORITY --maj-k > 0 on prompts with answers; GAMES come from --env tasks only.
GREEDY = ("accuracy", "response_tokens_mean", "response_tokens_max", "truncation_rate")
SAMPLED = ("avg_at_k", "pass_at_k")
MAJORITY = ("maj_at_k",)
GAMES = ("success_rate", "mean_turns_to_success", "invalid_action_rate", "env_errors")
MODES = ("max", "min")


@dataclass(frozen=True)
class CheckpointOptions:
    """Options of section "checkpoints"."""

    keep_checkpoints: int = opt(
        2,
        "Keep the N newest checkpoints (older ones are deleted as new ones are written; resume reads the newest).",
        section="run",
    )
    keep_best: str = opt(
        "",
        "Also keep the best checkpoint by an evaluation figure, METRIC or METRIC:max / METRIC:min (default max), "
        "e.g. eval/accuracy or eval/pass_at_k: every evaluation then writes a checkpoint scored by it; its path "
        "is in checkpoints/best and summary.json. Refused when the run never evaluates that figure.",
        section="run",
    )
    final_best: bool = opt(
        False, "With --keep-best: final/ holds the best checkpoint's weights instead of the last step's.", section="run"
    )


def parse_keep_best(spec: str) -> tuple[str, str]:
    """``"eval/accuracy:min"`` -> ("eval/accuracy", "min"); a bare figure name gets its ``eval/`` prefix."""
    metric, _, mode = spec.partition(":")
    metric = metric.strip()
    return (metric if metric.startswith("eval/") else f"eval/{metric}"), (mode.strip() or "max")


def check_checkpoint_options(cfg: Any) -> None:
    """The keep rules of a TrainConfig (its tasks resolved): counts, and a --keep-best the run can meet."""
    require(cfg.keep_checkpoints >= 1, f"keep_checkpoints={cfg.keep_checkpoints} must be >= 1 (resume needs one)")
    require(not cfg.final_best or bool(cfg.keep_best), "final_best needs --keep-best METRIC (which checkpoint is best)")
    require(
        not (cfg.final_best and cfg.lora_r),
        "final_best with --lora-r is not supported yet; drop --final-best and merge checkpoints/best's adapter "
        "with opd merge-lora",
    )
    if not cfg.keep_best:
        return
    metric, mode = parse_keep_best(cfg.keep_best)
    require(mode in MODES, f"keep_best={cfg.keep_best!r}: end it in :max or :min (or neither: max)")
    require(
        cfg.eval,
        f"keep_best={cfg.keep_best!r} with evaluation off (--no-eval): the run never evaluates {metric}; "
        "drop one of them",
    )
    figures = evaluated_figures(cfg)
    require(
        metric in figures,
        f"keep_best={cfg.keep_best!r}: this run never evaluates {metric}; it logs {', '.join(sorted(figures))}",
    )


def evaluated_figures(cfg: Any) -> set[str]:
    """The ``eval/`` names a run's evaluations log (by its tasks, environments and --eval-samples); a
    multi-task run logs each task's under ``eval/<task>/`` and the means of accuracy and avg_at_k."""
    from opd.config.tasks import resolve_tasks

    def own(c: Any) -> tuple[str, ...]:
        sampled = SAMPLED if c.eval_samples > 0 else ()
        majority = MAJORITY if c.maj_k > 0 and not c.env else ()
        return (*GREEDY, *sampled, *majority, *(GAMES if c.env else ()))

    specs = resolve_tasks(cfg)
    out = {f"eval/{s.name}/{f}" if s.name else f"eval/{f}" for s in specs for f in own(s.cfg)}
    if specs[0].name:
        out |= {f"eval/{f}" for f in ("accuracy", "avg_at_k") if all(f in own(s.cfg) for s in specs)}
    return out

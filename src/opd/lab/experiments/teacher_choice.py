"""``opd experiment teacher-choice``: thinking-pattern consistency and its recoveries (2604.13016).

Two teachers of similar accuracy: the packaged one, whose chain of thought matches the student's
(``<think>12 + 7 = 19.</think> The answer is \\boxed{19}``), and a *different-pattern* teacher
fine-tuned from it on the same problems written in words (``Step 1: 12 plus 7 makes 19. So the
answer is \\boxed{19}``, :func:`opd.tasks.arithmetic.reformat_solution`) on a subset of the
training prompts -- that subset is its "post-training data". From the same student and seeds,
OPD (LSM) runs with each teacher; the overlap ratio, entropy gap and overlap-token advantage are
logged every step (``diag/*`` in metrics.jsonl). The two recoveries of the paper, with the
different-pattern teacher: the off-policy cold start (``opd sft --teacher``: SFT on the teacher's
rollouts, then OPD) and teacher-aligned prompts (OPD on the prompts of its fine-tune only).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

from opd.lab.demos.demo import TASK_LEVEL
from opd.lab.experiments.common import (
    TEACHER,
    avg_at_k_claim,
    diagnostics_plots,
    final_eval_spec,
    final_scores,
    opd_config,
    read_metrics,
    series,
    sft_config,
    with_eval,
)
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings, read_done
from opd.lab.experiments.stats import mean_ci, verdict
from opd.rollout.prompt_set import load_task
from opd.tasks.arithmetic import reformat_solution

ALIGNED_PROMPTS, TEACHER_SFT_STEPS, COLD_START_STEPS, OPD_STEPS = 4000, 400, 50, 100
# The words format is longer than the default one: at the demo's 48 new tokens 10 of the 13 errors
# of the different-pattern teacher (200 test prompts) were cut-off answers, so every sampling step
# here (OPD, cold start, evaluation) gets room for it.
MAX_NEW = 64
DIAGS = {
    "diag/overlap": "top-K overlap ratio",
    "diag/entropy_gap": "entropy gap |H(q) - H(p)|",
    "diag/overlap_advantage": "overlap-token advantage",
}
CONDITIONS = ("compatible", "different", "cold-start", "aligned-prompts")


def write_data(p: dict, run_dir: Path) -> dict:
    """The different-pattern teacher's fine-tuning data and the same prompts as an OPD task file."""
    examples = load_task("arithmetic", TASK_LEVEL, 0).examples("train")[: p["n"]]
    with open(run_dir / "sft.jsonl", "w") as f:
        for e in examples:
            f.write(
                json.dumps(
                    {
                        "prompt": e.prompt,
                        "answer": e.answer,
                        "solution": reformat_solution(cast(str, e.solution), "words"),
                    }
                )
                + "\n"
            )
    with open(run_dir / "aligned_prompts.jsonl", "w") as f:
        for e in examples:
            f.write(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n")
    return {"examples": len(examples)}


def plan(s: Settings) -> list[RunSpec]:
    q = s.quick
    data = s.run_dir("teacher/data")
    alt = str(s.run_dir("teacher/different") / "final")
    specs = [
        RunSpec(
            "teacher/data",
            "python",
            {"n": 64 if q else ALIGNED_PROMPTS},
            write_data,
            "write the words-format fine-tuning data and the aligned prompt file",
        ),
        RunSpec(
            "teacher/different",
            "sft",
            sft_config(
                s,
                "teacher/different",
                0,
                init=TEACHER,
                data=str(data / "sft.jsonl"),
                steps=TEACHER_SFT_STEPS,
                batch=32,
                lr=5e-4,
                schedule="cosine",
            ),
        ),
        final_eval_spec(s, "teacher/different", 0, max_new_tokens=MAX_NEW),
        final_eval_spec(
            s, "teacher/compatible", 0, model=TEACHER, max_new_tokens=MAX_NEW
        ),  # the packaged teacher, evaluated the same way
    ]
    for seed in range(s.seeds):
        cold = f"cold-start-sft/seed{seed}"
        common: dict[str, Any] = dict(steps=OPD_STEPS, max_new_tokens=MAX_NEW)
        runs = {
            "compatible": opd_config(s, f"compatible/seed{seed}", seed, teacher=TEACHER, **common),
            "different": opd_config(s, f"different/seed{seed}", seed, teacher=alt, **common),
            "cold-start": opd_config(
                s, f"cold-start/seed{seed}", seed, teacher=alt, student=str(s.run_dir(cold) / "final"), **common
            ),
            "aligned-prompts": opd_config(
                s, f"aligned-prompts/seed{seed}", seed, teacher=alt, task=str(data / "aligned_prompts.jsonl"), **common
            ),
        }
        specs.append(
            RunSpec(
                cold,
                "sft",
                sft_config(
                    s, cold, seed, teacher=alt, steps=COLD_START_STEPS, batch=32, lr=5e-4, max_new_tokens=MAX_NEW
                ),
            )
        )
        for cond, cfg in runs.items():
            specs += with_eval(s, RunSpec(f"{cond}/seed{seed}", "train", cfg), seed)
    return specs


def _window(records: list[dict], key: str, last: bool, frac: float = 0.1) -> float:
    _, vals = series(records, key)
    if not vals:
        return math.nan
    n = max(1, int(len(vals) * frac))
    part = vals[-n:] if last else vals[:n]
    return sum(part) / len(part)


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    seeds = range(s.seeds)
    t_rows = []
    for name in ("compatible", "different"):
        res = read_done(s, f"teacher/{name}/eval")["result"]
        t_rows.append(
            [name, f"{100 * res['accuracy']:.1f}", f"{100 * res.get('avg_at_k', math.nan):.1f}", str(res["n"])]
        )
    a.table("Teachers (greedy accuracy and avg@k, %)", ["teacher", "greedy acc", "avg@k", "prompts"], t_rows)
    recs = {(c, k): read_metrics(s, f"{c}/seed{k}") for c in CONDITIONS for k in seeds}
    rows = []
    for c in CONDITIONS:
        sc = [final_scores(s, f"{c}/seed{k}") for k in seeds]
        row = [c, mean_ci([x["accuracy"] for x in sc]).fmt(1, 100), mean_ci([x["avg_at_k"] for x in sc]).fmt(1, 100)]
        for key in DIAGS:
            row += [
                mean_ci([_window(recs[(c, k)], key, False) for k in seeds]).fmt(3),
                mean_ci([_window(recs[(c, k)], key, True) for k in seeds]).fmt(3),
            ]
        rows.append(row)
    a.table(
        "OPD (LSM) from the same student: final accuracy (%) and the diagnostics over the first and last 10% of "
        "steps, mean [95% CI] over seeds",
        ["condition", "greedy acc", "avg@k"]
        + [f"{short} {w}" for short in ("overlap", "entropy gap", "overlap adv.") for w in ("first", "last")],
        rows,
    )
    diagnostics_plots(a, s, {c: [f"{c}/seed{k}" for k in seeds] for c in CONDITIONS}, DIAGS, "teacher_choice")
    _claims(a, s, recs)
    return a


OVERLAP_MASS = 0.97  # 2604.13016: the overlap tokens carry 97-99% of the mass of both models


def _overlap_mass_claim(a: Analysis, last) -> None:
    """Both models' mass on the overlap tokens over the last 10% of steps of the succeeding run, at
    the student's own positions (diag/overlap_mass_*, at the logged K): at least OVERLAP_MASS?"""
    student, teacher = (last("compatible", f"diag/overlap_mass_{side}") for side in ("student", "teacher"))
    v, ci = verdict([min(x, y) - OVERLAP_MASS for x, y in zip(student, teacher)])
    a.claims.append(
        Claim(
            "2604.13016",
            f"in the succeeding run the overlap tokens carry at least {OVERLAP_MASS:.0%} of both models' probability mass",
            f"CI of min(student, teacher) overlap-token mass minus {OVERLAP_MASS} over the last 10% of steps, "
            "compatible teacher, above 0 (below 0: not reproduced)",
            v,
            f"student {mean_ci(student).fmt(3)}, teacher {mean_ci(teacher).fmt(3)}; min - {OVERLAP_MASS}: {ci.fmt(3)}",
            ci.p,
        )
    )


def _claims(a: Analysis, s: Settings, recs: dict) -> None:
    seeds = range(s.seeds)
    first = lambda c, key: [_window(recs[(c, k)], key, False) for k in seeds]
    last = lambda c, key: [_window(recs[(c, k)], key, True) for k in seeds]

    def claim(text: str, rule: str, diffs: list[float]) -> None:
        v, ci = verdict(diffs)
        a.claims.append(Claim("2604.13016", text, rule, v, ci.fmt(3), ci.p))

    runs = lambda c: [f"{c}/seed{k}" for k in seeds]
    avg_at_k_claim(
        a,
        s,
        "2604.13016",
        "a teacher with a compatible thinking pattern distils better than one of "
        "similar accuracy with a different pattern",
        "compatible",
        "different",
        runs("compatible"),
        runs("different"),
    )
    claim(
        "in the succeeding run the overlap ratio rises",
        "CI of (last - first 10% of steps) of diag/overlap, compatible teacher, above 0",
        [y - x for x, y in zip(first("compatible", "diag/overlap"), last("compatible", "diag/overlap"))],
    )
    claim(
        "in the succeeding run the entropy gap narrows",
        "CI of (first - last) of diag/entropy_gap, compatible teacher, above 0",
        [x - y for x, y in zip(first("compatible", "diag/entropy_gap"), last("compatible", "diag/entropy_gap"))],
    )
    claim(
        "in the succeeding run the overlap-token advantage moves toward zero",
        "CI of |first| - |last| of diag/overlap_advantage, compatible teacher, above 0",
        [
            abs(x) - abs(y)
            for x, y in zip(first("compatible", "diag/overlap_advantage"), last("compatible", "diag/overlap_advantage"))
        ],
    )
    _overlap_mass_claim(a, last)
    mean_over = lambda c: [
        sum(series(recs[(c, k)], "diag/overlap")[1]) / max(len(series(recs[(c, k)], "diag/overlap")[1]), 1)
        for k in seeds
    ]
    claim(
        "the failing run (different pattern) has a lower overlap ratio",
        "CI of the paired difference in mean overlap over training (compatible - different) above 0",
        [x - y for x, y in zip(mean_over("compatible"), mean_over("different"))],
    )
    avg_at_k_claim(
        a,
        s,
        "2604.13016",
        "an off-policy cold start recovers OPD with the different-pattern teacher",
        "cold-start",
        "different",
        runs("cold-start"),
        runs("different"),
    )
    claim(
        "the cold start begins OPD with a higher overlap ratio",
        "CI of the paired difference in the first 10% of steps (cold-start - different) above 0",
        [x - y for x, y in zip(first("cold-start", "diag/overlap"), first("different", "diag/overlap"))],
    )
    avg_at_k_claim(
        a,
        s,
        "2604.13016",
        "teacher-aligned prompts improve OPD with the different-pattern teacher",
        "aligned-prompts",
        "different",
        runs("aligned-prompts"),
        runs("different"),
    )


EXPERIMENT = Experiment(
    name="teacher-choice",
    title="teacher-choice: thinking-pattern consistency, cold start and aligned prompts (2604.13016)",
    about=__doc__.split("\n\n", 1)[1].strip()
    + (
        f"\n\nFull size: the different-pattern teacher's fine-tune ({TEACHER_SFT_STEPS} steps of 32 on "
        f"{ALIGNED_PROMPTS} prompts, once), then per seed a {COLD_START_STEPS}-step cold start and 4 OPD runs of "
        f"{OPD_STEPS} steps x 32: about 20-25 minutes for 3 seeds on 2 CPU cores. `--quick`: 3-step fine-tunes (too "
        "short for the new pattern to take: a smoke test only) and 3-step OPD runs."
    ),
    plan=plan,
    analyze=analyze,
)

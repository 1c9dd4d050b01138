"""``opd experiment multitask-tail``: teacher top-K LSM's blind spot, and the tail bucket that closes it (issue 30).

Teacher top-K LSM renormalises both models over the teacher's top-K, so whatever mass the student
puts outside it carries no loss. In the multi-task demo that is where the student's game actions
pick up the math task's ``<think>``: the game teacher never ranks it, so nothing pushes it down,
and special-token masking drops the very positions where it was written. ``--tail`` adds one
category to the KL for each model's mass outside the support (TRL's ``loss_add_tail``), so that
mass is no longer free.

From the multi-task demo's models and its settings before issue 45 (:mod:`opd.lab.demos.multitask`:
96 steps, math and ALFWorld games alternating, two math steps per game step, a teacher per task;
math steps at lr 3e-4, game steps at 1e-4), with the same seeds:
the student before OPD, and two-task runs with sampled-token OPD, teacher top-K LSM, LSM with the
tail, and LSM with the tail but no special-token masking. Every run is evaluated at its end by the
training loop's own evaluation (math: 300 held-out prompts, greedy and avg@4; the game: 50 held-out
games, greedy success and avg@2; top-p 0.9); the student with the same evaluation and seeds.

Beside them, the question a single task asks of the tail: does it cost accuracy? From the
arithmetic demo's student and teacher, with ``opd experiment objectives``' settings (100 steps of 32
prompts, lr 5e-4, K = 32, its held-out evaluation), LSM with and without the tail. And the game
alone: from the agentic demo's teacher and student, with ``opd experiment agentic``'s settings (200
steps of 16 episodes, lr 3e-4, special-token masking, 50 held-out games, greedy and avg@2), LSM with
and without the tail.

The claims: (e) with the tail, the format token in game actions ends at or below its share at the
start (within 1 point; without the tail, it rises); (f) LSM with the tail keeps game success no more
than 5 points below the student's before OPD; (g) it keeps LSM's math gain over sampled-token OPD;
and the masking rule: with the tail, masked and unmasked LSM end within 5 points of each other, on
the game and on math; (h) in a single task the tail changes accuracy by less than 3 points; (i) on
the game alone it costs LSM less than 5 points. Claims compare final avg@k, paired over seeds.

Cost at full size, measured on 2 CPU cores with ``--workers 2`` (one thread a run): about an hour
(the runs' own times are in the results' size line). ``--quick`` plays a handful of steps (its numbers decide nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opd.lab.demos.multitask import ASSETS, GAME, GAME_LR, LR, MATH, evaluate, held_out_sets, opd_config
from opd.lab.experiments import agentic, common
from opd.lab.experiments.common import demo_models, diagnostics_plots, final_eval_spec, final_scores
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings
from opd.lab.experiments.multitask import (
    MARGIN,
    MEASURED_SHARE,
    MEASURED_STEPS,
    QUICK_STEPS,
    better,
    close,
    diffs,
    format_shares,
    format_table,
    make_models,
    run_name,
    scores,
)
from opd.lab.experiments.stats import equivalence, mean_ci, noninferior, verdict
from opd.models.loading import load_tokenizer

VARIANTS: dict[str, dict[str, Any]] = {
    "sampled": dict(objective="sampled", mask_special=False),
    "lsm": dict(objective="lsm", mask_special=True),
    "lsm-tail": dict(objective="lsm", tail=True, mask_special=True),
    "lsm-tail-no-mask": dict(objective="lsm", tail=True, mask_special=False),
}
STUDENT = "student"  # the student before OPD, evaluated with each seed (its avg@k samples differ)
EVAL_KEYS = {"accuracy": "final_acc", "avg_at_k": "avg_at_k"}  # a run's eval/TASK/KEY <- the demo's
FORMAT_MARGIN = 0.01  # "at or below its share at the start": within 1 point
# One task (the arithmetic demo's models, opd experiment objectives' settings): name -> changes
SINGLE_TASK: dict[str, dict[str, Any]] = {
    "single-task/lsm": dict(objective="lsm"),
    "single-task/lsm-tail": dict(objective="lsm", tail=True),
}
SINGLE_MARGIN = 0.03  # objectives' margin for "performs the same": 3 accuracy points
# The game alone (the agentic demo's models, opd experiment agentic's settings): name -> changes
AGENTIC: dict[str, dict[str, Any]] = {
    "agentic/lsm": agentic.VARIANTS["lsm"],
    "agentic/lsm-tail": dict(agentic.VARIANTS["lsm"], tail=True),
}


def evaluate_student(p: dict, run_dir: Path) -> dict:
    """The student before OPD on both tasks' held-out sets, as a run's final evaluation measures them."""
    base = opd_config(Path(p["models"]), run_dir / "base", 1, p["quick"], p["seed"])
    tok = load_tokenizer(Path(p["models"]) / "student")
    got = evaluate(Path(p["models"]) / "student", tok, held_out_sets(base, tok), (MATH, GAME), p["seed"])
    return {f"eval/{task}/{key}": r[src] for task, r in got.items() for key, src in EVAL_KEYS.items()}


def plan(s: Settings) -> list[RunSpec]:
    root, specs = demo_models(s, ASSETS, "student", "multi-task demo", "--multitask", make_models)
    steps = QUICK_STEPS if s.quick else MEASURED_STEPS  # the multitask experiment's recipe, as measured
    models = tuple(spec.name for spec in specs)  # all the runs need: --workers runs them side by side
    game_root, game_models = agentic.models_specs(s)
    specs += game_models
    for seed in range(s.seeds):
        params = {"models": str(root), "seed": seed, "quick": s.quick}
        name = run_name(STUDENT, seed)
        specs.append(RunSpec(name, "python", params, evaluate_student, "evaluate the student", needs=models))
        for variant, change in VARIANTS.items():
            name = run_name(variant, seed)
            cfg = opd_config(root, s.run_dir(name), steps, s.quick, seed, math_share=MEASURED_SHARE, **change)
            specs.append(RunSpec(name, "train", cfg, needs=models))
        for variant, change in SINGLE_TASK.items():
            name = run_name(variant, seed)
            cfg = common.opd_config(s, name, seed, lr=5e-4, steps=100, batch=32, **change)
            evaluation = final_eval_spec(s, name, seed, max_new_tokens=cfg.rollout.max_new_tokens)
            evaluation.needs = (name,)
            specs += [RunSpec(name, "train", cfg, needs=()), evaluation]
        for variant, change in AGENTIC.items():
            needs = tuple(spec.name for spec in game_models)
            specs += agentic.run_specs(s, game_root, run_name(variant, seed), seed, change, needs)
    return specs


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    two_task_table(
        a,
        s,
        [STUDENT, *VARIANTS],
        f"Held-out math accuracy and game success (%) before and after OPD (two tasks; math steps at lr {LR:g}, "
        f"game steps at {GAME_LR:g}), mean [95% CI] over seeds",
    )
    single = _arm_table(
        a,
        s,
        SINGLE_TASK,
        "One task (the arithmetic demo's student and teacher, 100 steps of 32 prompts, lr 5e-4): held-out "
        "accuracy (%) after OPD",
        "avg@k",
    )
    game = _arm_table(
        a,
        s,
        AGENTIC,
        "The game alone (the agentic demo's teacher and student, 200 steps of 16 episodes, lr 3e-4, masking): "
        "held-out success (%) after OPD",
        "avg@2",
    )
    format_table(a, s, list(VARIANTS))
    groups = {v: [run_name(v, k) for k in range(s.seeds)] for v in VARIANTS}
    curves = {
        f"{GAME}/rollout/accuracy": "training game success rate",
        f"{GAME}/rollout/format_token_rate": "game actions with a format token",
        f"{GAME}/diag/student_tail_mass": "student mass outside the game teacher's top-K",
        f"{MATH}/diag/student_tail_mass": "student mass outside the math teacher's top-K",
        f"{MATH}/rollout/accuracy": "training math accuracy",
    }
    rates = (f"{GAME}/rollout/accuracy", f"{GAME}/rollout/format_token_rate", f"{MATH}/rollout/accuracy")
    diagnostics_plots(a, s, groups, curves, "multitask_tail", rates=rates)
    _claims(a, s)
    for claim, arm, margin, judge in (
        (
            f"(h) in a single task LSM with the tail ends within +-{SINGLE_MARGIN * 100:g} points of LSM without",
            single,
            SINGLE_MARGIN,
            equivalence,
        ),
        (f"(i) on the game alone the tail costs LSM less than {MARGIN * 100:g} points", game, MARGIN, noninferior),
    ):
        hi, lo = list(arm)[1], list(arm)[0]
        paired = [x["avg_at_k"] - y["avg_at_k"] for x, y in zip(arm[hi], arm[lo])]
        v, ci = judge(paired, margin)
        bound = f"inside +-{margin * 100:g}" if judge is equivalence else f"above -{margin * 100:g}"
        rule = f"CI of paired avg@k difference ({hi} - {lo}) {bound} points"
        a.claims.append(Claim("issue 30 (tail bucket)", claim, rule, v, f"{ci.fmt(1, 100)} points", ci.p))
    a.notes.append(
        "The student's row is its evaluation before any OPD with each seed's sampling; every other row is a "
        "run's own final evaluation on the same held-out prompts and games."
    )
    return a


def two_task_table(a: Analysis, s: Settings, variants: list[str], title: str) -> None:
    """Greedy and avg@k on both tasks of each variant's runs (the student's evaluation too), over seeds."""
    rows = []
    for variant in variants:
        got = {task: scores(s, variant, task) for task in (MATH, GAME)}
        cells = [
            mean_ci([r[key] for r in got[t]]).fmt(1, 100) for t in (MATH, GAME) for key in ("accuracy", "avg_at_k")
        ]
        rows.append([variant, *cells])
    a.table(
        f"{title}; avg@k at temperature 1, top-p 0.9 (math k=4, game k=2)",
        ["run", "math greedy", "math avg@k", "game greedy", "game avg@k"],
        rows,
    )


def _arm_table(a: Analysis, s: Settings, arm: dict, title: str, k: str) -> dict[str, list[dict]]:
    """One arm's table (greedy and avg@k of each run's final model over seeds); each run's scores."""
    got = {v: [final_scores(s, run_name(v, seed)) for seed in range(s.seeds)] for v in arm}
    rows = [
        [v, *(mean_ci([r[key] for r in runs]).fmt(1, 100) for key in ("accuracy", "avg_at_k"))]
        for v, runs in got.items()
    ]
    a.table(f"{title}, mean [95% CI] over seeds; {k} at temperature 1, top-p 0.9", ["run", "greedy", k], rows)
    return got


def _claims(a: Analysis, s: Settings) -> None:
    src = "issue 30 (tail bucket)"
    for variant, claim, judge in (
        ("lsm-tail", "(e) with the tail, the format token in game actions ends at or below its start", noninferior),
        ("lsm", "(e) without the tail, teacher top-K LSM lets it rise (the blind spot)", None),
    ):
        shares = [format_shares(s, run_name(variant, k)) for k in range(s.seeds)]
        if judge is None:
            v, ci = verdict([end - start for start, end, _ in shares])
            rule = f"CI of paired (end - start) share of game actions with a format token ({variant}) above 0"
        else:
            v, ci = judge([start - end for start, end, _ in shares], FORMAT_MARGIN)
            rule = (
                f"CI of paired (start - end) share of game actions with a format token ({variant}) above "
                f"-{FORMAT_MARGIN * 100:g} points"
            )
        a.claims.append(Claim(src, claim, rule, v, f"{ci.fmt(1, 100)} points", ci.p))
    v, ci = noninferior(diffs(s, GAME, "lsm-tail", STUDENT), MARGIN)
    a.claims.append(
        Claim(
            src,
            f"(f) teacher top-K LSM with the tail keeps game success no more than {MARGIN * 100:g} points below the "
            "student's before OPD",
            f"CI of paired {GAME} avg@k difference (lsm-tail - student) above -{MARGIN * 100:g} points",
            v,
            f"{ci.fmt(1, 100)} points",
            ci.p,
        )
    )
    better(a, s, src, "(f) on the game, LSM with the tail beats LSM without", GAME, "lsm-tail", "lsm")
    better(a, s, src, "(g) with the tail, LSM still beats sampled-token OPD on math", MATH, "lsm-tail", "sampled")
    close(
        a,
        s,
        src,
        f"(mask) with the tail, masked and unmasked LSM end within +-{MARGIN * 100:g} points on the game",
        GAME,
        "lsm-tail",
        "lsm-tail-no-mask",
    )
    close(
        a,
        s,
        src,
        f"(mask) with the tail, masked and unmasked LSM end within +-{MARGIN * 100:g} points on math",
        MATH,
        "lsm-tail",
        "lsm-tail-no-mask",
    )


EXPERIMENT = Experiment(
    name="multitask-tail",
    title="The tail bucket: teacher top-K LSM's blind spot in multi-task OPD",
    about=__doc__.split("\n\n", 1)[1],
    plan=plan,
    analyze=analyze,
)

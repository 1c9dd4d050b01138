"""``opd experiment new-knowledge``: a teacher with new knowledge against a same-pipeline one (2604.13016).

2604.13016 distils R1-Distill-1.5B from R1-Distill-7B (the student's own pipeline at a larger scale)
and from Skywork-OR1-Math-7B (that 7B after further RL): the one with new knowledge gives the larger
gain and the higher gap recovery rate, (after - before) / (teacher - before), though both teachers
score above the student. The game of the agentic demo (:mod:`opd.lab.demos.agentic`) has that
structure. Its student (2 layers) clones the expert's play on 100 games. The **same-pipeline
teacher** is the first stage of the packaged game teacher's recipe, made again here: 4 layers
cloning the expert's play on 4,000 games (the student's kind of data, more of it, a larger model;
600 steps, chosen on the held-out games as the packaged stages were). The **teacher with new
knowledge** is the packaged game teacher: that first stage trained further on the expert's
recoveries from mistakes and on the states its own and the student's sampled play reach, labelled
by the expert (DAgger), which a clone of flawless play never sees.

From the same student and seeds, LSM with each teacher at ``opd experiment agentic``'s settings
(200 steps of 16 episodes, lr 3e-4, special-token masking, K = 32); every final model, both
teachers and the student play the same 50 held-out games (greedy success and avg@2, top-p 0.9; the
teachers and the student once, with seed 0). The claims, tested only where both teachers score
above the student (the paper's setting: there are gaps to recover): (1) the teacher with new
knowledge distils better (paired avg@2); (2) its gap recovery rate on avg@2 is higher.

Cost at full size on 2 CPU cores: the same-pipeline teacher's 600 steps of 32 episodes (about 45
minutes on one core) and 6 OPD runs of 200 steps (about 7 minutes each with its evaluation): about an
hour with ``--workers 2``. ``--quick`` plays a handful of steps from the shortened recipe's models.
"""

from __future__ import annotations

from opd.lab.demos.agentic import EVAL_SAMPLES, teacher_sft_configs
from opd.lab.experiments.agentic import VARIANTS, eval_spec, models_specs, run_specs
from opd.lab.experiments.common import avg_at_k_claim, diagnostics_plots, final_scores
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings
from opd.lab.experiments.stats import mean_ci, verdict

SAME, NEW = "same-pipeline", "new-knowledge"
SOURCE = "2604.13016 (new knowledge, not scale)"


def teacher_name(arm: str) -> str:
    return f"teacher/{arm}"


def runs(s: Settings, arm: str) -> list[str]:
    return [f"{arm}/seed{k}" for k in range(s.seeds)]


def plan(s: Settings) -> list[RunSpec]:
    root, specs = models_specs(s)
    models = tuple(spec.name for spec in specs)
    first_stage = teacher_sft_configs(root, s.quick)[0]
    specs.append(RunSpec(teacher_name(SAME), "sft", first_stage, needs=models))
    teachers = {SAME: str(s.run_dir(teacher_name(SAME)) / "final"), NEW: str(root / "teacher")}
    needs = {SAME: (*models, teacher_name(SAME)), NEW: models}
    specs.append(eval_spec(s, "student", str(root / "student"), 0, needs=models))
    for arm, model in teachers.items():
        specs.append(eval_spec(s, teacher_name(arm), model, 0, needs=needs[arm]))
    for seed in range(s.seeds):
        for arm, model in teachers.items():
            change = {**VARIANTS["lsm"], "teacher": model}
            specs += run_specs(s, root, runs(s, arm)[seed], seed, change, needs=needs[arm])
    return specs


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    before = final_scores(s, "student")  # the models before OPD: evaluated as runs are
    teacher = {arm: final_scores(s, teacher_name(arm)) for arm in (SAME, NEW)}
    a.table(
        f"The student and the two teachers before OPD: held-out success (%), greedy and avg@{EVAL_SAMPLES}",
        ["model", "greedy success", f"avg@{EVAL_SAMPLES}"],
        [
            [name, f"{100 * r['accuracy']:.1f}", f"{100 * r['avg_at_k']:.1f}"]
            for name, r in (("student", before), (f"{SAME} teacher", teacher[SAME]), (f"{NEW} teacher", teacher[NEW]))
        ],
    )
    rows = []
    for arm in (SAME, NEW):
        final = [final_scores(s, r) for r in runs(s, arm)]
        rows.append(
            [
                f"LSM from the {arm} teacher",
                mean_ci([r["accuracy"] for r in final]).fmt(1, 100),
                mean_ci([r["avg_at_k"] for r in final]).fmt(1, 100),
                mean_ci(_recovery(s, arm, before, teacher)).fmt(2),
            ]
        )
    a.table(
        f"Held-out success (%) after OPD, mean [95% CI] over seeds; gap recovery on avg@{EVAL_SAMPLES}: "
        "(after - before) / (teacher - before)",
        ["run", "greedy success", f"avg@{EVAL_SAMPLES}", "gap recovery"],
        rows,
    )
    diagnostics_plots(
        a,
        s,
        {arm: runs(s, arm) for arm in (SAME, NEW)},
        {
            "rollout/accuracy": "training success rate",
            "diag/overlap": "top-K overlap ratio",
            "diag/out_of_support": "out-of-support share",
        },
        "new_knowledge",
        rates=("rollout/accuracy", "diag/overlap", "diag/out_of_support"),
    )
    _claims(a, s, before, teacher)
    return a


def _recovery(s: Settings, arm: str, before: dict, teacher: dict) -> list[float]:
    """Each seed's gap recovery rate on avg@k: how much of the teacher's lead over the student OPD closed."""
    gap = teacher[arm]["avg_at_k"] - before["avg_at_k"]
    return [
        (final_scores(s, r)["avg_at_k"] - before["avg_at_k"]) / gap if gap > 0 else float("nan") for r in runs(s, arm)
    ]


def _claims(a: Analysis, s: Settings, before: dict, teacher: dict) -> None:
    behind = [arm for arm in (SAME, NEW) if teacher[arm]["avg_at_k"] <= before["avg_at_k"]]
    if behind:
        scores = ", ".join(f"{100 * teacher[arm]['avg_at_k']:.1f}%" for arm in behind)
        a.notes.append(
            f"New knowledge, not scale: not tested. The {' and '.join(behind)} teacher's avg@{EVAL_SAMPLES} "
            f"({scores}) is not above the student's "
            f"({100 * before['avg_at_k']:.1f}%): there is no gap to recover, so this is not the paper's setting."
        )
        return
    avg_at_k_claim(
        a,
        s,
        SOURCE,
        "a teacher with new knowledge distils better than a same-pipeline teacher (the student's kind of data at "
        "a larger scale)",
        NEW,
        SAME,
        runs(s, NEW),
        runs(s, SAME),
    )
    new, same = (_recovery(s, arm, before, teacher) for arm in (NEW, SAME))
    v, ci = verdict([x - y for x, y in zip(new, same)])
    a.claims.append(
        Claim(
            SOURCE,
            "the teacher with new knowledge has the higher gap recovery rate",
            f"CI of the paired difference in gap recovery on avg@{EVAL_SAMPLES} ({NEW} - {SAME}) above 0",
            v,
            f"{ci.fmt(2)} ({NEW} {mean_ci(new).fmt(2)}, {SAME} {mean_ci(same).fmt(2)})",
            ci.p,
        )
    )


EXPERIMENT = Experiment(
    name="new-knowledge",
    title="New knowledge, not scale: a teacher trained further against a same-pipeline teacher (2604.13016)",
    about=__doc__.split("\n\n", 1)[1],
    plan=plan,
    analyze=analyze,
)

"""``opd experiment async-rollouts``: does LSM train as well with rollouts one step stale?

Not a paper's claim: a check of ``--max-staleness 1`` (opd.training.ahead), where step t's rollouts
come from the policy of step t - 1, generated in a worker process while the trainer scores and updates.
Two settings, each from the same student with the same seeds at S = 0 (on-policy, today's runs) and S = 1:
the demo's LSM run (:func:`opd.lab.demos.demo.opd_config`: 200 steps of 64 prompts, lr 5e-4,
evaluated by the training loop on 300 held-out prompts, greedy and avg@4) and the agentic experiment's
LSM run (the agentic demo's models, 200 steps of 16 episodes, lr 3e-4; greedy success and avg@2 on the
50 held-out games). The claims are non-inferiority with a 5-point margin: the 95% interval of the
paired difference (S = 1 minus S = 0) lies above -5 points. Beside them, each arm's median step time as
these runs measured it (with ``--workers 2`` two runs share the 2 cores, so these times are not the
benchmark's: benchmarks/bench_async.py is).

Cost at full size on 2 CPU cores, measured at 52c74ba with ``--workers 2`` beside a CI run: 140 minutes
of runs for 3 seeds, 71 minutes of wall time. ``--quick`` runs a few steps of each (its numbers decide
nothing).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from opd.lab.demos.demo import ASSETS, EVAL_SAMPLES, opd_config
from opd.lab.experiments.agentic import models_specs, run_specs
from opd.lab.experiments.common import final_scores, loop_scores
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings, read_metrics
from opd.lab.experiments.stats import mean_ci, noninferior

STALENESS = (0, 1)
MARGIN = 0.05  # S = 1 may end at most 5 points below S = 0 (greedy accuracy or success)
LSM: dict[str, Any] = dict(objective="lsm", mask_special=True)


def demo_run(S: int, seed: int) -> str:
    return f"demo-s{S}/seed{seed}"


def agentic_run(S: int, seed: int) -> str:
    return f"agentic-s{S}/seed{seed}"


def plan(s: Settings) -> list[RunSpec]:
    root, specs = models_specs(s)
    needs = tuple(m.name for m in specs)
    for seed in range(s.seeds):  # the longer runs first: with --workers 2 the demo runs fill in beside them
        for S in STALENESS:
            specs += run_specs(s, root, agentic_run(S, seed), seed, dict(LSM, max_staleness=S), needs)
    for seed in range(s.seeds):
        for S in STALENESS:
            name = demo_run(S, seed)
            cfg = opd_config(ASSETS, seed, quick=s.quick, out=str(s.run_dir(name)), max_staleness=S, **LSM)
            specs.append(RunSpec(name, "train", cfg, needs=()))
    return specs


def demo_scores(s: Settings, S: int) -> list[dict]:
    """Each seed's final evaluation of the demo run at staleness ``S`` (the loop's own, at its last step)."""
    return loop_scores(s, [demo_run(S, k) for k in range(s.seeds)])


def step_time(s: Settings, name: str) -> float:
    """The run's median step time (s), its first two steps (warm-up, the worker starting) left out."""
    times = [r["time/step"] for r in read_metrics(s, name) if "time/step" in r][2:]
    return statistics.median(times) if times else math.nan


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    settings = {
        "demo": ({S: demo_scores(s, S) for S in STALENESS}, demo_run, "greedy accuracy", EVAL_SAMPLES),
        "agentic": (
            {S: [final_scores(s, agentic_run(S, k)) for k in range(s.seeds)] for S in STALENESS},
            agentic_run,
            "greedy success",
            2,
        ),
    }
    for where, (scores, name, metric, k) in settings.items():
        rows = [
            [
                f"S = {S}",
                *(mean_ci([x[key] for x in scores[S]]).fmt(1, 100) for key in ("accuracy", "avg_at_k")),
                f"{statistics.median(step_time(s, name(S, seed)) for seed in range(s.seeds)):.2f}",
            ]
            for S in STALENESS
        ]
        a.table(
            f"The {where} LSM run on-policy (S = 0) and one step stale (S = 1): final {metric} and avg@{k} (%), "
            f"mean [95% CI] over {s.seeds} seeds, and the median step time (s) of these runs",
            ["staleness", metric, f"avg@{k}", "step (s)"],
            rows,
        )
        a.table(
            f"The {where} runs per seed: {metric} (%)",
            ["seed", *(f"S = {S}" for S in STALENESS)],
            [[seed, *(f"{100 * scores[S][seed]['accuracy']:.1f}" for S in STALENESS)] for seed in range(s.seeds)],
        )
        diffs = [one["accuracy"] - zero["accuracy"] for one, zero in zip(scores[1], scores[0], strict=True)]
        verdict, ci = noninferior(diffs, MARGIN)
        a.claims.append(
            Claim(
                "opd (async rollouts)",
                f"In the {where} setting, LSM with rollouts one step stale (--max-staleness 1) ends no more than "
                f"5 points below on-policy LSM ({metric})",
                f"CI of the paired {metric} difference (S = 1 - S = 0) above -{100 * MARGIN:.0f} points",
                verdict,
                f"{ci.fmt(1, 100)} points",
                ci.p,
            )
        )
    return a


EXPERIMENT = Experiment(
    name="async-rollouts",
    title="LSM with rollouts one step stale against on-policy LSM",
    about=__doc__.split("\n\n", 1)[1],
    plan=plan,
    analyze=analyze,
)

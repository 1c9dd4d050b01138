"""``opd experiment vllm-rollouts``: does LSM train the same with rollouts from vLLM as from opd's own loop?

Not a paper's claim: a check of opd's vLLM rollout engine (``--rollout-engine vllm``, vLLM's CPU build
here, float32 like the trainer). The demo's LSM run (:func:`opd.lab.demos.demo.opd_config`: 200 steps of
64 prompts, lr 5e-4, top-p 0.9, K 32) from the same student with the same seeds, once with each engine,
each final model evaluated by the training loop (300 held-out prompts, greedy and avg@4). The claim:
the two engines end within ±5 points of greedy accuracy (paired over seeds; an equivalence
test, so 3 seeds decide it only if the interval is narrow). The samples cannot be equal token for
token (vLLM's sampler and batch are its own), so this is the comparison that matters to a user: does
the same recipe end within the margin. Beside it, the agentic demo's LSM run for its full 400 steps of 16
episodes with each engine (seed 0 only, multi-turn turns from vLLM's prefix cache): its greedy success on
the 50 held-out games, reported, not decided.

Cost at full size on 2 CPU cores with ``--workers 2``, measured on a machine that ran other work too
(its CI): 209 minutes of runs, about 2.5 hours of wall time; a demo run 5-8 minutes with opd's loop
and about 30 with vLLM (its engine is slower than opd's loop here: docs/benchmarks.md), the agentic
runs 53 and 62. It needs vLLM (``opd vllm-setup``). ``--quick`` runs a few steps of each (its numbers
decide nothing).
"""

from __future__ import annotations

import math
from typing import Any

from opd.lab.demos.agentic import DEMO_STEPS
from opd.lab.demos.demo import ASSETS, EVAL_SAMPLES, opd_config
from opd.lab.experiments.agentic import models_specs, run_specs
from opd.lab.experiments.common import final_scores, loop_scores
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings
from opd.lab.experiments.stats import equivalence, mean_ci

ENGINES = ("hf", "vllm")
MARGIN = 0.05  # "the same": the paired greedy-accuracy difference within 5 points
LSM: dict[str, Any] = dict(objective="lsm", mask_special=True)


def demo_run(engine: str, seed: int) -> str:
    return f"demo-{engine}/seed{seed}"


def agentic_run(engine: str) -> str:
    return f"agentic-{engine}/seed0"


def plan(s: Settings) -> list[RunSpec]:
    root, specs = models_specs(s)
    needs = tuple(m.name for m in specs)
    for engine in ENGINES:  # the longest runs first: with --workers 2 the demo runs fill in beside them
        change = dict(LSM, rollout_engine=engine)
        specs += run_specs(s, root, agentic_run(engine), 0, change, needs, steps=DEMO_STEPS)
    for seed in range(s.seeds):
        for engine in ENGINES:
            name = demo_run(engine, seed)
            cfg = opd_config(ASSETS, seed, quick=s.quick, out=str(s.run_dir(name)), rollout_engine=engine, **LSM)
            specs.append(RunSpec(name, "train", cfg, needs=()))
    return specs


def demo_scores(s: Settings, engine: str) -> list[dict]:
    """Each seed's final evaluation of the demo run with ``engine`` (the loop's own, at its last step)."""
    return loop_scores(s, [demo_run(engine, k) for k in range(s.seeds)])


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    scores = {e: demo_scores(s, e) for e in ENGINES}
    rows = [
        [engine, *(mean_ci([x[key] for x in scores[engine]]).fmt(1, 100) for key in ("accuracy", "avg_at_k"))]
        for engine in ENGINES
    ]
    a.table(
        f"The demo's LSM run with each rollout engine: final greedy accuracy and avg@{EVAL_SAMPLES} (%), "
        f"mean [95% CI] over {s.seeds} seeds",
        ["engine", "greedy", f"avg@{EVAL_SAMPLES}"],
        rows,
    )
    per_seed = [
        [k, *(f"{100 * scores[e][k][key]:.1f}" for e in ENGINES for key in ("accuracy", "avg_at_k"))]
        for k in range(s.seeds)
    ]
    a.table(
        "Per seed (%)",
        ["seed", "hf greedy", f"hf avg@{EVAL_SAMPLES}", "vllm greedy", f"vllm avg@{EVAL_SAMPLES}"],
        per_seed,
    )
    diffs = [v["accuracy"] - h["accuracy"] for v, h in zip(scores["vllm"], scores["hf"], strict=True)]
    verdict, ci = equivalence(diffs, MARGIN)
    a.claims.append(
        Claim(
            "opd (vLLM rollouts)",
            "LSM with rollouts from vLLM ends within ±5 points of LSM with opd's own sampling loop (greedy accuracy)",
            f"CI of the paired greedy-accuracy difference (vllm - hf) inside ±{100 * MARGIN:.0f} points",
            verdict,
            f"{ci.fmt(1, 100)} points",
            ci.p,
        )
    )
    games = {e: final_scores(s, agentic_run(e)) for e in ENGINES}
    gaps = [r["rollout/engine_logprob_gap"] for r in _steps(s, agentic_run("vllm"))]
    a.table(
        f"The agentic demo's LSM run ({'3' if s.quick else DEMO_STEPS} steps, seed 0) with each engine: held-out "
        "greedy success and avg@2 (%)",
        ["engine", "greedy success", "avg@2"],
        [[e, f"{100 * games[e]['accuracy']:.1f}", f"{100 * games[e]['avg_at_k']:.1f}"] for e in ENGINES],
        note=f"The vLLM run's policy check: largest mean log-prob gap of a step {max(gaps, default=math.nan):.2g} nats.",
    )
    return a


def _steps(s: Settings, name: str) -> list[dict]:
    from opd.lab.experiments.core import read_metrics

    return [r for r in read_metrics(s, name) if "rollout/engine_logprob_gap" in r]


EXPERIMENT = Experiment(
    name="vllm-rollouts",
    title="LSM with rollouts from vLLM against opd's own loop",
    about=__doc__.split("\n\n", 1)[1],
    plan=plan,
    analyze=analyze,
)

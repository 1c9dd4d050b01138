"""``opd experiment agentic``: OPD objectives on multi-turn ALFWorld games (2603.25562, agentic setting).

From the agentic demo's game teacher and student (:mod:`opd.lab.demos.agentic`: ALFWorld level 1,
generated games), with the same seeds: sampled-token OPD, LSM without special-token masking, LSM
with it (the paper's ALFWorld column: 90.6 / 95.3 / 97.7 success), and full-vocabulary reverse KL
as the truncation ablation the reviewers asked for (does restoring the full support help?). Each
final model plays the same held-out games (greedy success rate and avg@2 at top-p 0.9). The
out-of-support share -- the student's action tokens that fall outside the teacher's top-K, logged
at every step as ``diag/out_of_support`` -- is reported per objective: the reviewers asked the
paper for it, and its authors answered ">92% coverage at k=20".

Cost at full size: 4 objectives x 5 seeds of 200 OPD steps (half the demo's 400) of 16 episodes
at lr 3e-4 (about 1.8 s a step on one core), and an evaluation of each (greedy and 2 samples on 50
games, under a minute): 126 minutes of runs, about 65 minutes with ``--workers 2`` on 2 cores. A
table of the game's first words (``go``, ``take``, ``move``) reads the logged episodes for why
some runs end at 0%. ``--quick`` plays a handful of steps; where the packaged
agentic models are missing it first makes the shortened recipe's (its numbers decide nothing).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from opd.config import EvalConfig, TrainConfig
from opd.lab.demos.agentic import (
    ASSETS,
    DEMO_BATCH,
    DEMO_LR,
    ENV,
    EVAL_SAMPLES,
    LEVEL,
    LIMITS,
    TOP_P,
    env_args,
)
from opd.lab.experiments.common import (
    avg_at_k_claim,
    demo_models,
    diagnostics_plots,
    final_scores,
    read_metrics,
    series,
    stability,
)
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings, derived
from opd.lab.experiments.stats import mean_ci, verdict
from opd.report.load import read_jsonl

VARIANTS: dict[str, dict[str, Any]] = {
    "sampled": dict(objective="sampled", mask_special=False),
    "lsm-no-mask": dict(objective="lsm", mask_special=False),
    "lsm": dict(objective="lsm", mask_special=True),
    "full-kl": dict(objective="full_kl", kl_direction="reverse"),
}
# The demo's length when these results were measured (the demo now runs 400 steps: docs/demos.md)
STEPS = 200
COVERAGE = 0.08  # the paper's authors: ">92% coverage" of the student's tokens by the teacher's top-K
# The first-word table: steps a window; the teacher sure of a word, doubting it; a word the student lost
WORD_WINDOW, SURE, DOUBT, LOST = 10, 0.5, 0.1, 0.05


def make_quick_models(p: dict, run_dir: Path) -> dict:
    from opd.lab.demos.agentic import make_agentic_models

    return make_agentic_models(Path(p["out"]), quick=True)


def eval_games(quick: bool) -> int:
    return 8 if quick else 50  # the held-out games each final model plays


def run_name(variant: str, seed: int) -> str:
    return f"{variant}/seed{seed}"


def plan(s: Settings) -> list[RunSpec]:
    root, specs = models_specs(s)
    models = tuple(spec.name for spec in specs)
    for seed in range(s.seeds):
        for variant, change in VARIANTS.items():
            specs += run_specs(s, root, run_name(variant, seed), seed, change, needs=models)
    return specs


def models_specs(s: Settings) -> tuple[Path, list[RunSpec]]:
    """The agentic demo's models (packaged, or with --quick made first under OUT/agentic-quick-models)."""
    return demo_models(s, ASSETS, "teacher", "agentic demo", "--agentic", make_quick_models, "agentic-quick-models")


def run_specs(
    s: Settings, root: Path, name: str, seed: int, change: dict, needs: tuple[str, ...], steps: int = STEPS
) -> list[RunSpec]:
    """One OPD run from the agentic demo's models at its settings (``change`` on top), and its final
    evaluation: greedy success and avg@2 on the held-out games."""
    base: dict[str, Any] = dict(
        student=str(root / "student"),
        teacher=str(root / "teacher"),
        env=ENV,
        env_level=LEVEL,
        env_args=env_args(s.quick),
        seed=seed,
        out=str(s.run_dir(name)),
        steps=3 if s.quick else steps,
        batch_size=8 if s.quick else DEMO_BATCH,
        lr=DEMO_LR,
        warmup_steps=2 if s.quick else 5,
        eval_every=0,  # the final model's evaluation is the run after it
        eval_size=eval_games(s.quick),
        eval_samples=0,
        ckpt_every=2 if s.quick else steps // 2,
        log_rollouts=2 if s.quick else 4,
        top_p=TOP_P,
        k=32,
        **LIMITS,
    )
    cfg = TrainConfig.from_flat(**{**base, **change})  # ``change`` may override any of them (a longer warm-up, say)
    return [RunSpec(name, "train", cfg, needs=needs), eval_spec(s, name, str(s.run_dir(name) / "final"), seed)]


def eval_spec(s: Settings, name: str, model: str, seed: int, needs: tuple[str, ...] | None = None) -> RunSpec:
    """``NAME/eval``: ``model``'s greedy success and avg@2 on the held-out games (after ``needs``;
    by default the run ``name``)."""
    evaluation = EvalConfig.from_flat(
        student=model,
        env=ENV,
        env_level=LEVEL,
        env_args=env_args(s.quick),
        seed=seed,
        out=str(s.run_dir(name + "/eval")),
        eval_size=eval_games(s.quick),
        samples=EVAL_SAMPLES,
        top_p=TOP_P,
        **LIMITS,
    )
    return RunSpec(name + "/eval", "eval", evaluation, needs=(name,) if needs is None else needs)


def _out_of_support(s: Settings, variant: str) -> list[float]:
    """Each seed's mean share of action tokens outside the teacher's top-K over its steps."""
    shares = []
    for k in range(s.seeds):
        _, v = series(read_metrics(s, run_name(variant, k)), "diag/out_of_support")
        shares.append(sum(v) / len(v))
    return shares


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    rows = []
    for variant in VARIANTS:
        final = [final_scores(s, run_name(variant, k)) for k in range(s.seeds)]  # accuracy: greedy success
        st = [stability(read_metrics(s, run_name(variant, k))) for k in range(s.seeds)]
        rows.append(
            [
                variant,
                mean_ci([r["accuracy"] for r in final]).fmt(1, 100),
                mean_ci([r["avg_at_k"] for r in final]).fmt(1, 100),
                mean_ci(_out_of_support(s, variant)).fmt(1, 100),
                mean_ci([x["grad_norm_cv"] for x in st]).fmt(2),
            ]
        )
    a.table(
        "Held-out success (%) after OPD, mean [95% CI] over seeds; avg@k at temperature 1, top-p 0.9; "
        "out-of-support = share of the student's action tokens outside the teacher's top-K (%)",
        ["objective", "greedy success", f"avg@{EVAL_SAMPLES}", "out-of-support", "grad-norm CV"],
        rows,
    )
    groups = {v: [run_name(v, k) for k in range(s.seeds)] for v in VARIANTS}
    diagnostics_plots(
        a,
        s,
        groups,
        {
            "rollout/accuracy": "training success rate",
            "diag/out_of_support": "out-of-support share",
            "rollout/invalid_action_rate": "invalid-action rate",
            "train/grad_norm": "gradient norm",
        },
        "agentic",
        rates=("rollout/accuracy", "diag/out_of_support", "rollout/invalid_action_rate"),
    )
    first_word_table(a, s)
    _claims(a, s)
    return a


def first_word_windows(rollouts: Path) -> dict[str, dict[str, dict[int, float]]]:
    """From a run's logged episodes, by the first word of an action and WORD_WINDOW-step window:
    ``kept``, where the teacher gives its top token over SURE, the student's mean probability of it;
    ``doubted``, where the student wrote the word, the share the teacher gives under DOUBT. A verb
    the student overuses gets pushed down everywhere, and one it loses shows here before success falls."""
    kept: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    doubted: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    # A missing file or a killed run's cut line reads as no episodes there, as in the report.
    for r in read_jsonl(rollouts, [], need_step=True):
        window = r["step"] // WORD_WINDOW
        for turn in r.get("turns", []):
            i = turn["start"]
            doubted[r["tokens"][i]][window].append(float(r["teacher_logprobs"][i] < math.log(DOUBT)))
            if r["teacher_topk_logprobs"][i][0] > math.log(SURE):
                word = r["topk_tokens"][str(r["teacher_topk_ids"][i][0])]
                kept[word][window].append(math.exp(r["student_topk_logprobs"][i][0]))
    return {
        name: {w: {k: sum(v) / len(v) for k, v in by.items()} for w, by in d.items()}
        for name, d in (("kept", kept), ("doubted", doubted))
    }


def _first_words(s: Settings, run: str) -> dict:
    return derived(s, f"first_word_windows:{run}", lambda runs: first_word_windows(runs / run / "rollouts.jsonl"))


def first_word_table(a: Analysis, s: Settings) -> None:
    """Why a run fails where others of its objective do not: for each of the game's first words, how
    often the student's early uses were ones the teacher doubts, and whether the student keeps giving
    the teacher's word its probability (first window, lowest, last)."""
    rows = []
    for variant in VARIANTS:
        per_seed = [_first_words(s, run_name(variant, k)) for k in range(s.seeds)]
        for word in sorted({w for seed in per_seed for w in seed["kept"]}):
            windows = [seed["kept"][word] for seed in per_seed if seed["kept"].get(word)]
            early = [seed["doubted"][word][0] for seed in per_seed if 0 in seed["doubted"].get(word, {})]
            first, lowest, last = ([pick(w) for w in windows] for pick in (_first, _lowest, _last))
            rows.append(
                [variant, word, _pct(early), *(_pct(x) for x in (first, lowest, last))]
                + [f"{sum(x < LOST for x in last)} of {len(windows)}"]
            )
    a.table(
        f"The game's first words (the logged episodes, `log_rollouts` a step), mean over the seeds that met the "
        f"word: of the student's uses of it in the first {WORD_WINDOW} steps, the share (%) the teacher gives "
        f"under {100 * DOUBT:g}%; where the teacher gives it over {100 * SURE:g}%, the student's probability "
        f"of it (%) over the first {WORD_WINDOW}-step window, the lowest and the last; the seeds whose last "
        f"window is below {100 * LOST:g}%",
        ["objective", "word", "early uses doubted", "first", "lowest", "last", f"seeds ending below {100 * LOST:g}%"],
        rows,
    )


def _pct(values: list[float]) -> str:
    return f"{100 * sum(values) / len(values):.0f}" if values else "-"


def _first(windows: dict[int, float]) -> float:
    return windows[min(windows)]


def _lowest(windows: dict[int, float]) -> float:
    return min(windows.values())


def _last(windows: dict[int, float]) -> float:
    return windows[max(windows)]


def _better(a: Analysis, s: Settings, claim: str, hi: str, lo: str, source: str = "2603.25562 (ALFWorld)") -> None:
    runs = ([run_name(v, k) for k in range(s.seeds)] for v in (hi, lo))
    avg_at_k_claim(a, s, source, claim, hi, lo, *runs)


def _claims(a: Analysis, s: Settings) -> None:
    _better(a, s, "LSM with masking beats sampled-token OPD on the game", "lsm", "sampled")
    _better(a, s, "LSM without masking beats sampled-token OPD on the game", "lsm-no-mask", "sampled")
    _better(a, s, "special-token masking improves LSM on the game", "lsm", "lsm-no-mask")
    # not the paper's claim: its reviewers asked whether restoring the full support helps (their hypothesis)
    _better(
        a,
        s,
        "restoring the full support (full_kl) improves on truncated LSM",
        "full-kl",
        "lsm",
        source="2603.25562 reviewers' hypothesis (truncation ablation)",
    )
    shares = _out_of_support(s, "lsm")
    ci = mean_ci(shares)
    v, tested = verdict([COVERAGE - x for x in shares])
    a.claims.append(
        Claim(
            "2603.25562 (authors' reply to review)",
            f"the teacher's top-K covers over {100 * (1 - COVERAGE):g}% of the student's action tokens",
            f"CI of LSM's mean out-of-support share below {100 * COVERAGE:g}%",
            v,
            f"{ci.fmt(1, 100)}% out of support",
            tested.p,
        )
    )


EXPERIMENT = Experiment(
    name="agentic",
    title="Agentic OPD on ALFWorld games: objectives, masking, truncation",
    about=__doc__.split("\n\n", 1)[1],
    plan=plan,
    analyze=analyze,
)

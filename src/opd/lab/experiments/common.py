"""Shared pieces of the model experiments: demo-model run configs, uniform final evaluation, readers.

Every model experiment starts from the packaged demo models (``opd/assets/demo``: a 4-layer,
256-wide Qwen2 teacher and a 2-layer, 128-wide student on arithmetic level 2) with the demo's
settings (48 new tokens, top-p 0.9, K=32). Each trained model gets the same final evaluation
(an ``opd eval`` step: greedy accuracy and avg@k at temperature 1, top-p 0.9, same prompts and
seeds), so objectives that roll out without top-p are still compared on equal terms.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from opd.config import EvalConfig, SFTConfig, TrainConfig
from opd.errors import UserError
from opd.lab.demos.demo import ASSETS, EVAL_SAMPLES, MAX_NEW_TOKENS, TASK_LEVEL, TOP_P
from opd.lab.experiments.core import Analysis, Claim, RunSpec, Settings, read_done, read_metrics
from opd.lab.experiments.plots import line_plot
from opd.lab.experiments.stats import mean_ci, verdict

STUDENT, TEACHER = str(ASSETS / "student"), str(ASSETS / "teacher")
SPIKE = 3.0  # a gradient-norm spike: a step whose (pre-clipping) norm exceeds 3x its run's median


def sizes(quick: bool, steps: int = 100, batch: int = 32) -> dict:
    """OPD run sizes: full (``steps`` x ``batch``) or a smoke-test size for ``--quick``."""
    if quick:
        return dict(steps=3, batch_size=8, eval_every=0, eval_size=16, ckpt_every=2, log_rollouts=2, diag_positions=64)
    return dict(
        steps=steps,
        batch_size=batch,
        eval_every=max(steps // 2, 1),
        eval_size=200,
        ckpt_every=max(steps // 2, 1),
        log_rollouts=4,
        diag_positions=256,
    )


def eval_size(quick: bool) -> int:
    return 16 if quick else 200


def opd_config(
    s: Settings, name: str, seed: int, student: str = STUDENT, teacher: str = TEACHER, **over
) -> TrainConfig:
    """A TrainConfig with the demo's settings; ``over`` changes the objective, lr, top-p, ..."""
    size = sizes(s.quick, **{k: over.pop(k) for k in ("steps", "batch") if k in over})
    base = dict(
        student=student,
        teacher=teacher,
        task="arithmetic",
        task_level=TASK_LEVEL,
        seed=seed,
        out=str(s.run_dir(name)),
        max_new_tokens=MAX_NEW_TOKENS,
        top_p=TOP_P,
        k=32,
        lr=5e-4,
        warmup_steps=2 if s.quick else 10,
        eval_samples=0,
        **size,
    )
    base.update(over)
    return TrainConfig.from_flat(**base)


def sft_config(
    s: Settings, name: str, seed: int, init: str = STUDENT, steps: int = 100, batch: int = 32, **over
) -> SFTConfig:
    """An SFTConfig that keeps the *last* model (one evaluation at the end: no test-set model selection)."""
    base: dict[str, Any] = dict(
        init=init,
        task="arithmetic",
        task_level=TASK_LEVEL,
        seed=seed,
        out=str(s.run_dir(name)),
        max_new_tokens=MAX_NEW_TOKENS,
        steps=3 if s.quick else steps,
        batch_size=8 if s.quick else batch,
        warmup_steps=2 if s.quick else 10,
        eval_every=0,
        eval_size=eval_size(s.quick),
        validation_size=0,  # the last model is kept: nothing to choose
        schedule="constant",
    )
    base.update(over)
    return SFTConfig.from_flat(**base)


def final_eval_spec(
    s: Settings, run_name: str, seed: int, model: str = "", max_new_tokens: int = MAX_NEW_TOKENS, tokenizer: str = ""
) -> RunSpec:
    """``opd eval`` of ``model`` (default ``run_name/final``; ``tokenizer``: its tokenizer directory when
    not beside it): greedy and avg@k at top-p 0.9 on the test prompts."""
    cfg = EvalConfig.from_flat(
        student=model or str(s.run_dir(run_name) / "final"),
        tokenizer=tokenizer,
        task="arithmetic",
        task_level=TASK_LEVEL,
        seed=seed,
        out=str(s.run_dir(run_name + "/eval")),
        max_new_tokens=max_new_tokens,
        eval_size=eval_size(s.quick),
        samples=2 if s.quick else EVAL_SAMPLES,
        top_p=TOP_P,
    )
    return RunSpec(run_name + "/eval", "eval", cfg)


def with_eval(s: Settings, spec: RunSpec, seed: int) -> list[RunSpec]:
    return [spec, final_eval_spec(s, spec.name, seed, max_new_tokens=spec.config.rollout.max_new_tokens)]


def final_scores(s: Settings, run_name: str) -> dict:
    """Greedy accuracy and avg@k of a run's final model (from its eval step)."""
    res = read_done(s, run_name + "/eval")["result"]
    return {"accuracy": res["accuracy"], "avg_at_k": res.get("avg_at_k", math.nan)}


def loop_scores(s: Settings, run_names: list[str]) -> list[dict]:
    """Each run's final evaluation by the training loop itself (at its last step): greedy accuracy, avg@k."""
    res = [read_done(s, name)["result"] for name in run_names]
    return [{"accuracy": r["eval/accuracy"], "avg_at_k": r.get("eval/avg_at_k", math.nan)} for r in res]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def stability(records: list[dict]) -> dict:
    """Grad-norm spread (std / mean), spike share (steps above SPIKE x the run's median norm),
    clipped-step share, student entropy first -> last and its minimum ratio."""
    _, g = series(records, "train/grad_norm")
    _, clipped = series(records, "train/clipped")
    _, ent = series(records, "diag/student_entropy")
    mean_g = sum(g) / len(g) if g else math.nan
    sd_g = math.sqrt(sum((x - mean_g) ** 2 for x in g) / max(len(g) - 1, 1)) if g else math.nan
    head = ent[: max(1, len(ent) // 10)]
    e0 = sum(head) / len(head) if head else math.nan
    median_g = sorted(g)[len(g) // 2] if g else math.nan
    return {
        "grad_norm_mean": mean_g,
        "grad_norm_cv": sd_g / mean_g if mean_g else math.nan,
        "spike_share": sum(x > SPIKE * median_g for x in g) / len(g) if g else math.nan,
        "clipped_share": sum(clipped) / len(clipped) if clipped else math.nan,
        "entropy_start": e0,
        "entropy_end": ent[-1] if ent else math.nan,
        "entropy_min_ratio": min(ent) / e0 if ent and e0 else math.nan,
    }


def mean_curve(
    s: Settings, names: list[str], key: str, by_count: bool = False
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean and 95% CI over runs (seeds) of a logged metric, step by step (steps present in every run).
    ``by_count``: by the metric's own count of logged values instead (the k-th game step of a
    multi-task run, whose task order, and so the steps a task trains on, the seed decides)."""
    per = [
        dict(enumerate(series(read_metrics(s, n), key)[1])) if by_count else dict(zip(*series(read_metrics(s, n), key)))
        for n in names
    ]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    cis = [mean_ci([p[t] for p in per]) for t in steps]
    return steps, [c.mean for c in cis], [c.lo for c in cis], [c.hi for c in cis]


def diagnostics_plots(
    a: Analysis,
    s: Settings,
    groups: dict[str, list[str]],
    keys: dict[str, str],
    prefix: str,
    rates: tuple[str, ...] = (),
    by_count: bool = False,
) -> None:
    """One PNG per diagnostic: a curve (mean and CI over seeds) per group of runs; the bands of
    ``rates`` (keys whose values are shares) are kept within 0 and 1; ``by_count``: see :func:`mean_curve`."""
    for key, label in keys.items():
        curves = {g: mean_curve(s, names, key, by_count) for g, names in groups.items()}
        curves = {g: c for g, c in curves.items() if c[0]}
        if not curves:
            continue
        fname = f"{prefix}_{key.replace('/', '_')}.png"
        bounds = (0.0, 1.0) if key in rates else None
        x = f"{key.split('/')[0]} step" if by_count else "OPD step"
        line_plot(s.out / fname, curves, x, label, f"{label} over training", bounds=bounds)
        a.plots.append(fname)


def generate_batches(engine, prompt_ids: list[list[int]], seeds: list[int], batch: int = 128) -> list:
    """Sample (temperature 1, the demo's top-p) in batches of ``batch`` prompts; a list of RolloutBatch."""
    return [
        engine.generate(
            prompt_ids[i : i + batch], seeds[i : i + batch], max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, top_p=TOP_P
        )
        for i in range(0, len(prompt_ids), batch)
    ]


def avg_at_k_claim(
    a: Analysis,
    s: Settings,
    source: str,
    claim: str,
    hi: str,
    lo: str,
    hi_runs: list[str],
    lo_runs: list[str],
    *,
    by_construction: str = "",
) -> None:
    """Claim "hi beats lo": the verdict on the paired (same seed) differences of final avg@k."""
    diffs = [final_scores(s, hi)["avg_at_k"] - final_scores(s, lo)["avg_at_k"] for hi, lo in zip(hi_runs, lo_runs)]
    v, ci = verdict(diffs)
    rule = f"CI of paired avg@k difference ({hi} - {lo}) above 0"
    a.claims.append(Claim(source, claim, rule, v, f"{ci.fmt(1, 100)} points", ci.p, by_construction))


def demo_models(
    s: Settings, assets: Path, probe: str, demo: str, flag: str, make, name: str = "quick-models"
) -> tuple[Path, list[RunSpec]]:
    """An experiment's starting models and the runs that make them: the packaged ones in ``assets``
    (``probe`` present), else, with ``--quick``, ``OUT/name`` made first by ``make`` (the shortened
    recipe, a python RunSpec); a full run without them is an error naming the command."""
    if (assets / probe / "config.json").is_file():
        return assets, []
    if not s.quick:
        raise UserError(
            f"the {s.out.name} experiment starts from the {demo}'s models, "
            f"missing in {assets}; make them with `opd make-demo-models {flag} --out {assets}`"
        )
    root = s.out / name
    return root, [RunSpec(name, "python", {"out": str(root)}, make, f"opd make-demo-models {flag} --quick")]

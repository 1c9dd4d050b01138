"""``opd experiment tokenizer-mismatch``: failure mode 3 of 2603.25562, reproduced on purpose.

A teacher is fine-tuned from the packaged one with a different segmentation convention for
``<think>`` and ``</think>``: during its fine-tune those strings are *not* single tokens (their
added-token entries are removed from its tokenizer, so the same text is spelled with the
ordinary pieces ``<``, ``think``, ``>``). Afterwards the original tokenizer is put back, so the
teacher has exactly the student's vocabulary and passes opd's vocabulary check -- same
vocabulary, different tokens for the same text, as with two tokenizer conventions.

The student still writes the single ``<think>`` / ``</think>`` tokens, which the teacher now
finds unlikely: sampled-token OPD receives spurious negative rewards exactly there. A probe on
fixed student rollouts measures the reward per position class (special vs other tokens) under
the matched and the mismatched teacher; then, from the same student and seeds, OPD with the
mismatched teacher runs with and without special-token masking (sampled-token and LSM), with
sampled-token OPD from the matched teacher as the control.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from opd.config import DEFAULT_SPECIAL_TOKENS
from opd.lab.demos.demo import TASK_LEVEL
from opd.lab.experiments.common import (
    STUDENT,
    TEACHER,
    avg_at_k_claim,
    final_eval_spec,
    final_scores,
    generate_batches,
    mean_curve,
    opd_config,
    sft_config,
    sizes,
    with_eval,
)
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings, derived, read_done, read_run_file
from opd.lab.experiments.plots import line_plot
from opd.lab.experiments.stats import mean_ci, verdict
from opd.report.load import read_jsonl
from opd.rollout.prompt_set import PromptSet, load_task

SPLIT_TOKENS = ("<think>", "</think>")  # re-segmented in the mismatched teacher's fine-tune
VARIANTS: dict[str, dict[str, Any]] = {
    "matched/sampled": dict(teacher="matched", objective="sampled", mask_special=False),
    "mismatched/sampled": dict(teacher="mismatched", objective="sampled", mask_special=False),
    "mismatched/sampled+mask": dict(teacher="mismatched", objective="sampled", mask_special=True),
    "mismatched/lsm": dict(teacher="mismatched", objective="lsm", mask_special=True),
    "mismatched/lsm-no-mask": dict(teacher="mismatched", objective="lsm", mask_special=False),
}
TEACHER_SFT_STEPS, OPD_STEPS = 300, 100


def make_init(p: dict, run_dir: Path) -> dict:
    """The packaged teacher with a tokenizer in which <think> and </think> are ordinary text."""
    init = run_dir / "model"
    shutil.copytree(TEACHER, init, dirs_exist_ok=True)
    tj = json.loads((init / "tokenizer.json").read_text())
    tj["added_tokens"] = [t for t in tj["added_tokens"] if t["content"] not in SPLIT_TOKENS]
    (init / "tokenizer.json").write_text(json.dumps(tj))
    from opd.models.loading import load_tokenizer

    pieces = load_tokenizer(init).tokenize("<think>1 + 2 = 3.</think>")
    return {"segmentation": pieces}


def restore_vocab(p: dict, run_dir: Path) -> dict:
    """The fine-tuned teacher with the original tokenizer files: one vocabulary with the student."""
    src, dst = Path(p["sft_final"]), run_dir / "model"
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(TEACHER) / name).exists():
            shutil.copy(Path(TEACHER) / name, dst / name)
    return {"teacher": str(dst)}


def probe(p: dict, run_dir: Path) -> dict:
    """Sampled-token rewards of both teachers on the same student rollouts, by position class."""
    from opd.models.loading import load_model, load_tokenizer
    from opd.rollout.sampling import HFRollout
    from opd.teachers.scoring import HFTeacher

    tok = load_tokenizer(STUDENT, "student")
    student = load_model(STUDENT, "student")
    teachers = {name: HFTeacher(load_model(path, name)) for name, path in p["teachers"].items()}
    examples = load_task("arithmetic", TASK_LEVEL, 0).examples("test")[: p["prompts"]]
    prompts = PromptSet.build(examples, tok, 256, "test prompts")
    special = {tok.convert_tokens_to_ids(t) for t in DEFAULT_SPECIAL_TOKENS}
    engine = HFRollout(student, tok.eos_token_id, tok.pad_token_id)
    sums: dict[str, dict[str, list[float]]] = {name: {"special": [], "other": []} for name in teachers}
    for batch in generate_batches(engine, prompts.prompt_ids, [p["seed"] * 7919 + i for i in range(len(prompts))]):
        is_special = torch.isin(batch.response_ids_NT, torch.tensor(sorted(special))) & batch.response_mask_NT
        other = batch.response_mask_NT & ~is_special
        for name, teacher in teachers.items():
            r = teacher.score(batch, 1).sampled_logprobs_NT - batch.logprobs_NT
            sums[name]["special"] += r[is_special].tolist()
            sums[name]["other"] += r[other].tolist()
    out = {
        name: {
            cls: {
                "mean": sum(v) / max(len(v), 1),
                "negative_share": sum(x < 0 for x in v) / max(len(v), 1),
                "n": len(v),
            }
            for cls, v in d.items()
        }
        for name, d in sums.items()
    }
    (run_dir / "probe.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def plan(s: Settings) -> list[RunSpec]:
    sft_steps = 3 if s.quick else TEACHER_SFT_STEPS
    init = s.run_dir("teacher/init") / "model"
    specs = [
        RunSpec("teacher/init", "python", {}, make_init, "copy the teacher; drop <think>, </think> from its tokenizer"),
        RunSpec(
            "teacher/sft",
            "sft",
            sft_config(s, "teacher/sft", 0, init=str(init), steps=sft_steps, batch=32, lr=5e-4, schedule="cosine"),
        ),
        RunSpec(
            "teacher/mismatched",
            "python",
            {"sft_final": str(s.run_dir("teacher/sft") / "final")},
            restore_vocab,
            "put the original tokenizer files back next to the fine-tuned teacher",
        ),
        final_eval_spec(s, "teacher/mismatched", 0, model=str(s.run_dir("teacher/mismatched") / "model")),
    ]
    teachers = {"matched": TEACHER, "mismatched": str(s.run_dir("teacher/mismatched") / "model")}
    for seed in range(s.seeds):
        specs.append(
            RunSpec(
                f"probe/seed{seed}",
                "python",
                {"teachers": teachers, "prompts": 16 if s.quick else 128, "seed": seed},
                probe,
                "student rollouts; sampled-token rewards of both teachers by position class",
            )
        )
        for variant, over in VARIANTS.items():
            over = dict(over, teacher=teachers[over["teacher"]])
            name = f"{variant}/seed{seed}"
            specs += with_eval(
                s, RunSpec(name, "train", opd_config(s, name, seed, steps=OPD_STEPS, log_rollouts=8, **over)), seed
            )
    return specs


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    seeds = range(s.seeds)
    probes = [read_run_file(s, f"probe/seed{k}", "probe.json") for k in seeds]
    seg = read_done(s, "teacher/init")["result"]["segmentation"]
    t_acc = read_done(s, "teacher/mismatched/eval")["result"]
    a.notes.append(
        f"Mismatched teacher's fine-tuning segmentation of '<think>1 + 2 = 3.</think>': {seg}; its greedy "
        f"accuracy after the fine-tune: {100 * t_acc['accuracy']:.1f}% on {t_acc['n']} test prompts."
    )
    rows = []
    for name in ("matched", "mismatched"):
        for cls in ("special", "other"):
            rows.append(
                [
                    name,
                    cls,
                    mean_ci([pr[name][cls]["mean"] for pr in probes]).fmt(3),
                    mean_ci([pr[name][cls]["negative_share"] for pr in probes]).fmt(2, 100),
                    str(min(pr[name][cls]["n"] for pr in probes)),
                ]
            )
    a.table(
        "Sampled-token reward log q - log p on the same student rollouts (before training), by position class "
        "(special = <think>, </think>, EOS), mean [95% CI] over seeds",
        ["teacher", "positions", "mean reward", "negative share (%)", "positions (min over seeds)"],
        rows,
    )
    rows = []
    for variant in VARIANTS:
        sc = [final_scores(s, f"{variant}/seed{k}") for k in seeds]
        rows.append(
            [
                variant,
                mean_ci([x["accuracy"] for x in sc]).fmt(1, 100),
                mean_ci([x["avg_at_k"] for x in sc]).fmt(1, 100),
            ]
        )
    a.table(
        "Final accuracy (%) after OPD, mean [95% CI] over seeds (greedy; avg@k at temperature 1, top-p 0.9)",
        ["run", "greedy acc", "avg@k"],
        rows,
    )
    _reasoning_end_table(a, s)
    curves = {v: mean_curve(s, [f"{v}/seed{k}" for k in seeds], "diag/reward_mean") for v in VARIANTS}
    line_plot(
        s.out / "mismatch_reward.png",
        {v: c for v, c in curves.items() if c[0]},
        "OPD step",
        "mean sampled-token reward",
        "Mean sampled-token reward over training",
    )
    a.plots.append("mismatch_reward.png")
    _claims(a, s, probes)
    return a


def _reasoning_end_shares(run_dir: Path, lo: int, hi: int) -> dict:
    """Shares of the logged rollouts of steps [lo, hi) that close their reasoning the student's way (the single
    ``</think>`` token), that contain ``<`` (the first piece of the teacher's spelling), and that are correct."""
    rows = [r for r in read_jsonl(run_dir / "rollouts.jsonl", [], need_step=True) if lo <= r["step"] < hi]
    if not rows:  # nothing logged in the window: unknown, not 0%
        return {"single": math.nan, "pieces": math.nan, "correct": math.nan}
    return {
        "single": sum("</think>" in r["tokens"] for r in rows) / len(rows),
        "pieces": sum("<" in r["tokens"] for r in rows) / len(rows),
        "correct": sum(bool(r.get("correct")) for r in rows) / len(rows),
    }


def _shares(run: str, lo: int, hi: int):
    return lambda runs: _reasoning_end_shares(runs / run, lo, hi)


def _reasoning_end_table(a: Analysis, s: Settings) -> None:
    """How the student ends its reasoning early and late in training: masking hides the mismatched positions from
    the loss, but nothing then anchors the student's own convention, since the teacher's top-K never contains it."""
    steps = sizes(s.quick, OPD_STEPS)["steps"]
    window = max(steps // 5, 1)
    rows = []
    for variant in VARIANTS:
        for label, lo, hi in (("first", 0, window), ("last", steps - window, steps)):
            sh = [
                derived(s, f"reasoning_end:{variant}/seed{k}:{lo}-{hi}", _shares(f"{variant}/seed{k}", lo, hi))
                for k in range(s.seeds)
            ]
            rows.append(
                [variant, f"{label} {hi - lo} steps"]
                + [mean_ci([x[key] for x in sh]).fmt(1, 100) for key in ("single", "pieces", "correct")]
            )
    a.table(
        "How the student ends its reasoning: logged training rollouts (%) early and late in OPD, mean [95% CI] "
        "over seeds",
        ["run", "steps", "with the single </think> token", "with '<' (the teacher's spelling)", "correct"],
        rows,
        note="The mismatched teacher was fine-tuned to spell </think> in ordinary pieces (its segmentation is in "
        "the notes below) and gives the single token little probability (the reward at special positions "
        "above), so the token is rarely in the teacher's top-K support; with masking, the positions where "
        "the student writes it get no loss at all.",
    )


def _claims(a: Analysis, s: Settings, probes: list[dict]) -> None:
    v, ci = verdict([pr["matched"]["special"]["mean"] - pr["mismatched"]["special"]["mean"] for pr in probes])
    a.claims.append(
        Claim(
            "2603.25562 failure mode 3",
            "a segmentation mismatch gives spurious negative rewards on the "
            "special-token positions of correct student output",
            "CI of the paired drop in mean reward at special positions (matched - mismatched teacher) above 0",
            v,
            ci.fmt(3),
            ci.p,
        )
    )
    v, ci = verdict(
        [
            (pr["matched"]["special"]["mean"] - pr["mismatched"]["special"]["mean"])
            - (pr["matched"]["other"]["mean"] - pr["mismatched"]["other"]["mean"])
            for pr in probes
        ]
    )
    a.claims.append(
        Claim(
            "2603.25562 failure mode 3",
            "the drop is concentrated on the special tokens (larger than on other positions)",
            "CI of (drop at special) - (drop at other positions) above 0",
            v,
            ci.fmt(3),
            ci.p,
        )
    )
    for hi, lo, text in (
        (
            "mismatched/sampled+mask",
            "mismatched/sampled",
            "special-token masking recovers sampled-token OPD under the mismatch",
        ),
        ("matched/sampled", "mismatched/sampled", "the mismatch hurts sampled-token OPD"),
        ("mismatched/lsm", "mismatched/lsm-no-mask", "masking helps LSM under the mismatch"),
    ):
        avg_at_k_claim(
            a,
            s,
            "2603.25562 failure mode 3",
            text,
            hi,
            lo,
            *([f"{v}/seed{k}" for k in range(s.seeds)] for v in (hi, lo)),
        )


EXPERIMENT = Experiment(
    name="tokenizer-mismatch",
    title="tokenizer-mismatch: a teacher with another <think> segmentation (2603.25562, failure mode 3)",
    about=__doc__.split("\n\n", 1)[1].strip()
    + (
        f"\n\nFull size: the teacher fine-tune ({TEACHER_SFT_STEPS} steps of 32, once), a probe of 128 rollouts and 5 "
        f"OPD runs of {OPD_STEPS} steps x 32 per seed: about 20 minutes for 3 seeds on 2 CPU cores. `--quick`: a 3-step "
        "teacher fine-tune (too short to learn the new segmentation: a smoke test only) and 3-step OPD runs."
    ),
    plan=plan,
    analyze=analyze,
)

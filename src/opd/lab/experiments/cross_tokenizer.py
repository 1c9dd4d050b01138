"""``opd experiment cross-tokenizer``: OPD from a teacher that tokenizes differently, against GOLD.

The experiment makes its own teacher with a clearly different tokenizer
(:func:`opd.models.tokenizer.train_sentencepiece_tokenizer`: SentencePiece-style ``▁`` spellings, digits
split one by one, ``<0xNN>`` byte fallback, half the student's vocabulary, ``<s>``/``</s>``, no
``<think>`` token, a ``[INST] ... [/INST]`` template) and trains it with the demo teacher's recipe
(:func:`opd.lab.demos.demo.teacher_sft_config`) on the task. The tokenizer lives in a directory of its own,
passed as ``--teacher-tokenizer``: saved next to a Qwen2 model, transformers 5 would rebuild it as
a byte-level tokenizer on reload. From the packaged demo student and the same seeds: LSM with the
packaged demo teacher (same tokenizer: the upper bound), cross-tokenizer LSM, cross-tokenizer
sampled-token OPD (span reward), cross-tokenizer LSM with ``--cross-pairing one_to_one`` (the
ablation: no group-start positions inside many-to-many groups), and TRL's GOLD (ULD and hybrid,
:mod:`opd.lab.experiments.gold`) with the same student, prompts, steps and sizes. Every final model
gets the same ``opd eval``; the alignment diagnostics ``cross/*`` are averaged over each run.
GOLD runs untuned, at opd's learning rate (5e-4): with a byte-level teacher ``opd experiment
gold-bytelevel`` finds GOLD's defaults collapse at that rate and its best at 5e-5, so the claims
here are against GOLD as run here, not GOLD at its best.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import cast

from opd.lab.demos.demo import MAX_NEW_TOKENS, TASK_LEVEL, TOP_P, teacher_sft_config
from opd.lab.experiments.common import (
    STUDENT,
    TEACHER,
    avg_at_k_claim,
    diagnostics_plots,
    final_eval_spec,
    final_scores,
    opd_config,
    read_metrics,
    series,
    sizes,
    with_eval,
)
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings, read_done
from opd.lab.experiments.gold import probe_extended_uld, run_gold
from opd.lab.experiments.stats import mean_ci, verdict

TEACHER_VOCAB = 1024  # the student's is 2048
OPD_STEPS, BATCH = 100, 32
RECOVERY_GOAL = 0.7  # the goal: cross-tokenizer LSM recovers >= 70% of same-tokenizer LSM's gain
CROSS_KEYS = {
    "cross/one_to_one": "one-to-one share",
    "cross/mapped_mass": "mapped top-K mass",
    "cross/dropped": "dropped positions",
}
OPD_VARIANTS = {  # name -> (teacher kind, TrainConfig changes)
    "same-lsm": ("same", dict(objective="lsm")),
    "cross-lsm": ("cross", dict(objective="lsm")),
    "cross-sampled": ("cross", dict(objective="sampled")),
    "cross-lsm-one-to-one": ("cross", dict(objective="lsm", cross_pairing="one_to_one")),
}
GOLD_VARIANTS = {"gold-uld": False, "gold-hybrid": True}  # name -> uld_use_hybrid_loss
VARIANTS = (*OPD_VARIANTS, *GOLD_VARIANTS)


def make_tokenizer(p: dict, run_dir: Path) -> dict:
    """The teacher's tokenizer, trained on the task's prompts and solutions, in ``run_dir/tokenizer``."""
    from opd import crosstok
    from opd.models.loading import load_tokenizer
    from opd.models.tokenizer import train_sentencepiece_tokenizer
    from opd.rollout.prompt_set import load_task

    train = load_task("arithmetic", TASK_LEVEL, 0).examples("train")
    solutions = cast(list[str], [e.solution for e in train])  # the arithmetic task writes every solution
    texts = [e.prompt for e in train] + solutions + ["[INST] [/INST]"] * 100
    train_sentencepiece_tokenizer(texts, TEACHER_VOCAB).save_pretrained(run_dir / "tokenizer")
    teacher, student = load_tokenizer(run_dir / "tokenizer", "teacher"), load_tokenizer(STUDENT, "student")
    vmap = crosstok.build_vocab_map(
        crosstok.VocabBytes.from_tokenizer(student), crosstok.VocabBytes.from_tokenizer(teacher)
    )
    sample = solutions[1]
    return {
        "teacher_vocab": len(teacher),
        "student_vocab": len(student),
        "mapped": vmap.n_mapped,
        "teacher_text_tokens": vmap.n_teacher_text,
        "sample": sample,
        "teacher_pieces": teacher.tokenize(sample),
        "student_pieces": student.tokenize(sample),
    }


def keep_weights(p: dict, run_dir: Path) -> dict:
    """The fine-tuned teacher's config and weights without the tokenizer files that ``opd sft`` saved
    beside them (they would reload as a byte-level Qwen2 tokenizer): its tokenizer is its own directory."""
    src, dst = Path(p["sft_final"]), run_dir / "model"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, dst / f.name)
    return {"teacher": str(dst)}


def gold_params(s: Settings, seed: int, teacher: str, tokenizer: str, **knobs) -> dict:
    """A GOLD run's parameters (:func:`opd.lab.experiments.gold.run_gold`) at opd's sizes and settings;
    ``knobs`` (hybrid, lr, GOLD's own) on top."""
    size = sizes(s.quick, OPD_STEPS, BATCH)
    return {
        "student": STUDENT,
        "teacher": teacher,
        "teacher_tokenizer": tokenizer,
        "steps": size["steps"],
        "batch_size": size["batch_size"],
        "lr": 5e-4,  # opd_config's
        "warmup_steps": 2 if s.quick else 10,
        "top_p": TOP_P,
        "max_new_tokens": MAX_NEW_TOKENS,
        "seed": seed,
        "task_level": TASK_LEVEL,
        "prompts": 256 if s.quick else 20000,
        **knobs,
    }


def teacher_specs(s: Settings, vocab: int, make) -> tuple[list[RunSpec], str, str]:
    """A teacher with a tokenizer of its own: ``make`` trains the tokenizer (a python run step), the
    demo teacher's recipe fine-tunes a new model on it, its weights are kept apart from the
    tokenizer files ``opd sft`` saves beside them, and it is evaluated. Returns the specs, the
    tokenizer's directory and the teacher's."""
    tok_dir = str(s.run_dir("teacher/tokenizer") / "tokenizer")
    teacher = str(s.run_dir("teacher/model") / "model")
    sft = teacher_sft_config(s.run_dir("teacher/sft"), tok_dir, s.quick)
    specs = [
        RunSpec("teacher/tokenizer", "python", {"vocab": vocab}, make, "train the teacher tokenizer"),
        RunSpec("teacher/sft", "sft", sft),
        RunSpec(
            "teacher/model",
            "python",
            {"sft_final": str(s.run_dir("teacher/sft") / "final")},
            keep_weights,
            "the teacher's weights without the tokenizer files opd sft saved beside them",
        ),
        final_eval_spec(s, "teacher/model", 0, model=teacher, tokenizer=tok_dir),
    ]
    return specs, tok_dir, teacher


def plan(s: Settings) -> list[RunSpec]:
    specs, tok_dir, x_teacher = teacher_specs(s, TEACHER_VOCAB, make_tokenizer)
    specs += [
        final_eval_spec(s, "teacher/same", 0, model=TEACHER),
        RunSpec(
            "gold/extended-probe",
            "python",
            gold_params(s, 0, x_teacher, tok_dir, hybrid=False),
            probe_extended_uld,
            "one step of GOLD's default byte-offset alignment: records TRL's error, if any",
        ),
    ]
    teachers = {"same": {"teacher": TEACHER}, "cross": {"teacher": x_teacher, "teacher_tokenizer": tok_dir}}
    for seed in range(s.seeds):
        specs.append(final_eval_spec(s, f"student/seed{seed}", seed, model=STUDENT))
        for variant, (kind, over) in OPD_VARIANTS.items():
            name = f"{variant}/seed{seed}"
            extra = dict(cross_tokenizer="on") if kind == "cross" else {}
            cfg = opd_config(s, name, seed, steps=OPD_STEPS, batch=BATCH, **teachers[kind], **extra, **over)
            specs += with_eval(s, RunSpec(name, "train", cfg), seed)
        for variant, hybrid in GOLD_VARIANTS.items():
            name = f"{variant}/seed{seed}"
            params = gold_params(s, seed, x_teacher, tok_dir, hybrid=hybrid)
            specs += [
                RunSpec(name, "python", params, run_gold, f"TRL GOLDTrainer, {'hybrid' if hybrid else 'ULD'} loss"),
                final_eval_spec(s, name, seed),
            ]
    return specs


def _run_mean(s: Settings, name: str, key: str) -> float:
    _, vals = series(read_metrics(s, name), key)
    return sum(vals) / len(vals) if vals else math.nan


def _s_per_step(s: Settings, name: str) -> float:
    """Seconds per training step of a run (its whole wall time, evaluations included, over its steps)."""
    done = read_done(s, name)
    steps = sizes(s.quick, OPD_STEPS, BATCH)["steps"]
    return done["wall_s"] / steps


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    seeds = range(s.seeds)
    _teacher_table(a, s)
    rows = []
    for variant in VARIANTS:
        sc = [final_scores(s, f"{variant}/seed{k}") for k in seeds]
        row = [
            variant,
            mean_ci([x["accuracy"] for x in sc]).fmt(1, 100),
            mean_ci([x["avg_at_k"] for x in sc]).fmt(1, 100),
        ]
        for key in CROSS_KEYS:
            vals = [_run_mean(s, f"{variant}/seed{k}", key) for k in seeds]
            row.append(mean_ci(vals).fmt(3) if variant.startswith("cross") else "n/a")
        row.append(f"{sum(_s_per_step(s, f'{variant}/seed{k}') for k in seeds) / s.seeds:.2f}")
        rows.append(row)
    student = [final_scores(s, f"student/seed{k}") for k in seeds]
    rows.append(
        ["student (before)", mean_ci([x["accuracy"] for x in student]).fmt(1, 100)]
        + [mean_ci([x["avg_at_k"] for x in student]).fmt(1, 100), "", "", "", ""]
    )
    a.table(
        "Final accuracy (%) from the same student, mean [95% CI] over seeds (greedy; avg@k at temperature 1, top-p "
        f"{TOP_P}); the alignment diagnostics averaged over each run's steps; wall seconds per step (run wall time, "
        "its evaluations included, over its steps)",
        ["run", "greedy acc", "avg@k", *CROSS_KEYS.values(), "s/step"],
        rows,
        note="cross/one_to_one: share of response positions aligned one-to-one; cross/mapped_mass: share of the "
        "teacher's top-K mass that maps into the student vocabulary; cross/dropped: share of response positions "
        "left out of the loss (inside a many-to-many group, a special token without a partner, bytes that read "
        "differently for the teacher). GOLD has no such diagnostics.",
    )
    _claims(a, s)
    groups = {v: [f"{v}/seed{k}" for k in seeds] for v in OPD_VARIANTS}  # GOLD logs no opd metrics
    diagnostics_plots(
        a,
        s,
        groups,
        {
            "eval/accuracy": "greedy accuracy",
            "rollout/response_len": "response length (tokens)",
            "rollout/eos_rate": "share of rollouts ending with EOS",
            "cross/one_to_one": "one-to-one share",
        },
        "cross",
    )
    probe = read_done(s, "gold/extended-probe")["result"]["error"]
    a.notes.append(
        "GOLD's default extended (byte-offset) alignment with this teacher tokenizer: "
        + (
            f"refused by TRL itself -- `{probe}`; the GOLD runs therefore use ULD's positional alignment "
            "(`use_extended_uld=False`, both sequences cut to the shorter), as TRL's documentation says to for "
            "SentencePiece tokenizers."
            if probe
            else "ran (the GOLD runs still use the positional alignment)."
        )
    )
    a.notes.append(
        "GOLD hands the teacher the student's chat-template text re-tokenized (`<|im_start|>user ...`, and the "
        "student's EOS spelled out as text), never the teacher's own `[INST]` template; opd re-renders the "
        "messages in the teacher's template. GOLD draws the same training prompts in its own shuffled order."
    )
    return a


def _teacher_table(a: Analysis, s: Settings) -> None:
    tok = read_done(s, "teacher/tokenizer")["result"]
    rows = []
    for name, label in (("teacher/same", "demo teacher (student's tokenizer)"), ("teacher/model", "cross teacher")):
        res = read_done(s, name + "/eval")["result"]
        rows.append(
            [label, f"{100 * res['accuracy']:.1f}", f"{100 * res.get('avg_at_k', math.nan):.1f}", str(res["n"])]
        )
    a.table("Teachers (greedy accuracy and avg@k, %)", ["teacher", "greedy acc", "avg@k", "prompts"], rows)
    a.notes.append(
        f"Teacher tokenizer: {tok['teacher_vocab']} ids (student: {tok['student_vocab']}); {tok['mapped']} of its "
        f"{tok['teacher_text_tokens']} text tokens have a student token with the same bytes. {tok['sample']!r} is "
        f"{len(tok['teacher_pieces'])} teacher pieces {tok['teacher_pieces']} and {len(tok['student_pieces'])} "
        f"student pieces {tok['student_pieces']}."
    )


def _claims(a: Analysis, s: Settings) -> None:
    seeds = range(s.seeds)
    avg = lambda name: final_scores(s, name)["avg_at_k"]
    ratios = []
    for k in seeds:
        gain = avg(f"same-lsm/seed{k}") - avg(f"student/seed{k}")
        ratios.append((avg(f"cross-lsm/seed{k}") - avg(f"student/seed{k}")) / gain if gain > 0 else math.nan)
    v, ci = verdict([r - RECOVERY_GOAL for r in ratios])
    a.claims.append(
        Claim(
            "issue 16 goal",
            f"cross-tokenizer LSM recovers at least {100 * RECOVERY_GOAL:.0f}% of what same-tokenizer LSM gains "
            "over the student",
            f"CI of the per-seed avg@k gain ratio (cross-lsm - student) / (same-lsm - student) minus "
            f"{RECOVERY_GOAL} above 0 (a seed where same-lsm gains nothing gives no ratio)",
            v,
            f"ratio {mean_ci(ratios).fmt(2)}",
            ci.p,
        )
    )
    runs = lambda v: [f"{v}/seed{k}" for k in seeds]
    for gold in GOLD_VARIANTS:
        avg_at_k_claim(
            a,
            s,
            "issue 16 goal",
            f"cross-tokenizer LSM beats GOLD untuned at lr 5e-4 ({gold})",
            "cross-lsm",
            gold,
            runs("cross-lsm"),
            runs(gold),
        )


EXPERIMENT = Experiment(
    name="cross-tokenizer",
    title="cross-tokenizer: OPD from a teacher with another tokenizer, against TRL's GOLD (issue 16)",
    about=__doc__.split("\n\n", 1)[1].strip()
    + (
        "\n\nFull size: the teacher's tokenizer and fine-tune (the demo teacher's recipe, 1200 steps of 64, once), "
        f"then per seed 4 opd runs and 2 GOLD runs of {OPD_STEPS} steps x {BATCH} and an evaluation of each. "
        "Measured here a few steps at a time (one thread, on a machine busy with another training): teacher "
        "fine-tune 2.3 s/step (about 48 minutes with its evaluations; the demo teacher's took 32 minutes), opd "
        "runs 0.56 (same-tokenizer LSM) to 0.64 s/step (cross-tokenizer sampled), GOLD 1.2 (ULD) to 1.3 s/step "
        "(hybrid), an evaluation 5 s: about 10 minutes per seed, so about 80 minutes for 3 seeds. `--quick`: a "
        "10-step teacher fine-tune (a teacher that has learned nothing: a smoke test only) and 3-step runs, "
        "about 40 seconds."
    ),
    plan=plan,
    analyze=analyze,
)

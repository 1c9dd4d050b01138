"""``opd experiment gold-bytelevel``: TRL's GOLD at its best against cross-tokenizer LSM.

``opd experiment cross-tokenizer`` compares against GOLD with a SentencePiece-style teacher,
where GOLD's default alignment (extended ULD: tokens grouped by byte offsets) refuses to run and
GOLD falls back to positional ULD, reaching almost nothing. Here the teacher's tokenizer is one
GOLD is built for: a byte-level BPE with another vocabulary
(:func:`opd.models.tokenizer.train_bytelevel_tokenizer`: Llama-3's digit runs, 1536 ids to the
student's 2048, other merges and ids) and the student's chat markup, since GOLD hands the teacher
the student's chat text. The teacher is trained with the demo teacher's recipe
(:func:`opd.lab.demos.demo.teacher_sft_config`), as in ``cross-tokenizer``.

GOLD gets its documented knobs within a tuning budget of twelve runs on seed 0: its defaults
(extended ULD, ``lmbda`` 0.5: half the batches are the dataset's solutions, ``beta`` 0.5,
temperature 0.9, top-p 0.95) at opd's learning rate (GOLD's own default, 1e-7, is a placeholder
for large models); the learning rate from 5e-5 to 1e-3, with ULD and with the hybrid loss (JSD on
tokens both vocabularies spell alike, ULD on the rest); the hybrid with ``beta`` 1; fully
on-policy (``lmbda`` 1); opd's sampling (temperature 1, top-p 0.9). The configuration with the
best avg@k on seed 0 (chosen on the test prompts, which favours GOLD) is GOLD's best and runs on
the other seeds, as do GOLD's defaults. opd's cross-tokenizer LSM runs at the other experiments'
settings (learning rate, steps, K: not tuned here): with its defaults, with ``--cross-unmapped
prefix`` alone, and with the three options for a teacher whose tokens run longer than the
student's (``--cross-unmapped prefix --cross-pairing within_group --cross-joinable drop``;
docs/cross-tokenizer.md). Those options were developed in probes on seed 0 with this teacher,
scored on the same test prompts, which favours them as the choice of GOLD's best favours GOLD. Two checks of the harness itself, GOLD's trainer with the demo teacher
(the student's own tokenizer) with GKD's JSD and with ULD, tell GOLD's losses from the way it is
run here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, cast

from opd.lab.demos.demo import TASK_LEVEL, TOP_P
from opd.lab.experiments.common import (
    STUDENT,
    TEACHER,
    avg_at_k_claim,
    diagnostics_plots,
    final_eval_spec,
    final_scores,
    opd_config,
    with_eval,
)
from opd.lab.experiments.core import DONE, Analysis, Experiment, RunSpec, Settings, derived, read_done, read_metrics
from opd.lab.experiments.cross_tokenizer import BATCH, OPD_STEPS, gold_params, teacher_specs
from opd.lab.experiments.gold import run_gold
from opd.lab.experiments.stats import mean_ci

TEACHER_VOCAB = 1536
GOLD_DEFAULTS: dict[str, Any] = dict(
    extended=True, hybrid=False, lmbda=0.5, beta=0.5, temperature=0.9, top_p=0.95, lr=5e-4
)
SWEEP: dict[str, dict[str, Any]] = {  # name -> what moves from GOLD's defaults (seed 0)
    "default": {},
    "lr5e-5": dict(lr=5e-5),
    "lr1e-4": dict(lr=1e-4),
    "lr2e-4": dict(lr=2e-4),
    "lr1e-3": dict(lr=1e-3),
    "hybrid": dict(hybrid=True),
    "hybrid-lr5e-5": dict(hybrid=True, lr=5e-5),
    "hybrid-lr1e-4": dict(hybrid=True, lr=1e-4),
    "hybrid-lr2e-4": dict(hybrid=True, lr=2e-4),
    "hybrid-beta1": dict(hybrid=True, beta=1.0),
    "on-policy": dict(lmbda=1.0),
    "opd-sampling": dict(temperature=1.0, top_p=TOP_P),
}
# opd's cross-tokenizer LSM: name -> (its options, how a claim or table names them)
OPD_VARIANTS = {
    "cross-lsm": ({}, ""),
    "cross-lsm-prefix": (dict(cross_unmapped="prefix"), " with --cross-unmapped prefix"),
    "cross-lsm-groups": (
        dict(cross_unmapped="prefix", cross_pairing="within_group", cross_joinable="drop"),
        " with prefix, within_group and joinable drop",
    ),
}
# Checks of the harness, not of GOLD at its best: GOLD's trainer with the demo teacher (the
# student's own tokenizer) and GKD's JSD (token identities known), and with ULD.
SAME_TOKENIZER = {"same-gkd": dict(uld=False, extended=False), "same-uld": {}}


def make_tokenizer(p: dict, run_dir: Path) -> dict:
    """The teacher's byte-level tokenizer, trained on the task's text and the chat markup, in ``run_dir/tokenizer``."""
    from trl.experimental.utils import is_byte_level_tokenizer

    from opd import crosstok
    from opd.models.loading import load_tokenizer
    from opd.models.tokenizer import train_bytelevel_tokenizer
    from opd.rollout.prompt_set import load_task

    train = load_task("arithmetic", TASK_LEVEL, 0).examples("train")
    markup = ["<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"] * 100
    solutions = cast(list[str], [e.solution for e in train])  # the arithmetic task writes every solution
    texts = [e.prompt for e in train] + solutions + markup
    train_bytelevel_tokenizer(texts, p["vocab"]).save_pretrained(run_dir / "tokenizer")
    teacher, student = load_tokenizer(run_dir / "tokenizer", "teacher"), load_tokenizer(STUDENT, "student")
    vmap = crosstok.build_vocab_map(
        crosstok.VocabBytes.from_tokenizer(student), crosstok.VocabBytes.from_tokenizer(teacher)
    )
    same_id = sum(student.get_vocab().get(t) == i for t, i in teacher.get_vocab().items())
    sample = solutions[1]
    return {
        "teacher_vocab": len(teacher),
        "student_vocab": len(student),
        "byte_level": is_byte_level_tokenizer(teacher.backend_tokenizer),  # what GOLD's extended ULD requires
        "mapped": vmap.n_mapped,
        "same_id": same_id,
        "sample": sample,
        "teacher_pieces": teacher.tokenize(sample),
        "student_pieces": student.tokenize(sample),
    }


def _best(scores: dict[str, float]) -> str:
    """The sweep's configuration with the highest final avg@k on seed 0 (ties: the first in SWEEP's order)."""
    return max(scores, key=lambda name: (scores[name], -list(SWEEP).index(name)))


def run_gold_best(p: dict, run_dir: Path) -> dict:
    """GOLD with the sweep's best configuration, read from the sweep's evaluations (``p["sweep"]``:
    name -> eval result file) on top of ``p["base"]`` (GOLD's defaults for this seed)."""
    scores = {name: json.loads(Path(f).read_text())["result"]["avg_at_k"] for name, f in p["sweep"].items()}
    best = _best(scores)
    return {**run_gold({**p["base"], **SWEEP[best]}, run_dir), "chosen": best, "sweep_avg_at_k": scores}


def plan(s: Settings) -> list[RunSpec]:
    specs, tok_dir, teacher = teacher_specs(s, TEACHER_VOCAB, make_tokenizer)
    teacher_runs = tuple(x.name for x in specs)
    for name, knobs in SWEEP.items():
        params = gold_params(s, 0, teacher, tok_dir, **{**GOLD_DEFAULTS, **knobs})
        specs += [
            RunSpec(f"gold-{name}/seed0", "python", params, run_gold, f"TRL GOLDTrainer ({name})", needs=teacher_runs),
            final_eval_spec(s, f"gold-{name}/seed0", 0),
        ]
    for name, knobs in SAME_TOKENIZER.items():
        params = gold_params(s, 0, TEACHER, TEACHER, **{**GOLD_DEFAULTS, **knobs})
        specs += [
            RunSpec(f"check/{name}", "python", params, run_gold, f"TRL GOLDTrainer, demo teacher ({name})", needs=()),
            final_eval_spec(s, f"check/{name}", 0),
        ]
    sweep = {name: str(s.run_dir(f"gold-{name}/seed0/eval") / DONE) for name in SWEEP}
    for seed in range(s.seeds):
        specs.append(final_eval_spec(s, f"student/seed{seed}", seed, model=STUDENT))
        for variant, (over, _) in OPD_VARIANTS.items():
            name = f"{variant}/seed{seed}"
            cfg = opd_config(
                s,
                name,
                seed,
                steps=OPD_STEPS,
                batch=BATCH,
                teacher=teacher,
                teacher_tokenizer=tok_dir,
                cross_tokenizer="on",
                **over,
            )
            specs += with_eval(s, RunSpec(name, "train", cfg, needs=teacher_runs), seed)
        if seed == 0:
            continue  # seed 0's GOLD runs are the sweep's
        base = gold_params(s, seed, teacher, tok_dir, **GOLD_DEFAULTS)
        specs += [
            RunSpec(
                f"gold-default/seed{seed}", "python", base, run_gold, "TRL GOLDTrainer (defaults)", needs=teacher_runs
            ),
            final_eval_spec(s, f"gold-default/seed{seed}", seed),
            RunSpec(
                f"gold-best/seed{seed}",
                "python",
                {"base": base, "sweep": sweep},
                run_gold_best,
                "TRL GOLDTrainer with the sweep's best configuration",
                needs=tuple(f"gold-{n}/seed0/eval" for n in SWEEP),
            ),
            final_eval_spec(s, f"gold-best/seed{seed}", seed),
        ]
    return specs


def _chosen(s: Settings) -> str:
    if s.seeds > 1:
        return read_done(s, "gold-best/seed1")["result"]["chosen"]
    return _best({n: final_scores(s, f"gold-{n}/seed0")["avg_at_k"] for n in SWEEP})


def _runs(s: Settings, variant: str, best: str) -> list[str]:
    """A variant's run per seed: seed 0's GOLD runs are the sweep's."""
    first = {"gold-default": "gold-default/seed0", "gold-best": f"gold-{best}/seed0"}.get(variant, f"{variant}/seed0")
    return [first] + [f"{variant}/seed{k}" for k in range(1, s.seeds)]


def _numbers_and_alignment(s: Settings, run: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """(multi-digit share of the numbers in the logged rollouts, cross/one_to_one) at a run's first and last logged steps."""
    shares = derived(s, f"multi_digit_shares:{run}", lambda runs: _multi_digit_shares(runs / run / "rollouts.jsonl"))
    metrics = [r for r in read_metrics(s, run) if "cross/one_to_one" in r]
    return (shares[0], metrics[0]["cross/one_to_one"]), (shares[1], metrics[-1]["cross/one_to_one"])


def _multi_digit_shares(path: Path) -> tuple[float, float]:
    """The multi-digit share of the numbers in a run's logged rollouts at its first and last logged steps."""
    rollouts = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    out = []
    for step in (min(r["step"] for r in rollouts), max(r["step"] for r in rollouts)):
        numbers = [n for r in rollouts if r["step"] == step for n in re.findall(r"\d+", r["response"])]
        out.append(sum(len(n) > 1 for n in numbers) / max(len(numbers), 1))
    return out[0], out[1]


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    tok = read_done(s, "teacher/tokenizer")["result"]
    teacher = read_done(s, "teacher/model/eval")["result"]
    a.notes.append(
        f"Teacher tokenizer: byte-level BPE ({'byte-level' if tok['byte_level'] else 'NOT byte-level'} by TRL's own "
        f"check), {tok['teacher_vocab']} ids (student: {tok['student_vocab']}); {tok['mapped']} teacher tokens have a "
        f"student token with the same bytes, {tok['same_id']} of them with the same id. {tok['sample']!r} is "
        f"{len(tok['teacher_pieces'])} teacher pieces {tok['teacher_pieces']} and {len(tok['student_pieces'])} "
        f"student pieces. The teacher (demo teacher's recipe): greedy {100 * teacher['accuracy']:.1f}%, avg@k "
        f"{100 * teacher.get('avg_at_k', math.nan):.1f}% on {teacher['n']} test prompts."
    )
    rows = []
    for name, knobs in SWEEP.items():
        sc, done = final_scores(s, f"gold-{name}/seed0"), read_done(s, f"gold-{name}/seed0")["result"]
        what = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "GOLD's defaults, lr 5e-4"
        rows.append(
            [name, what, f"{100 * sc['accuracy']:.1f}", f"{100 * sc['avg_at_k']:.1f}", f"{done['s_per_step']:.2f}"]
        )
    a.table(
        "GOLD's tuning sweep on seed 0 (final greedy accuracy and avg@k, %; seconds per step): from GOLD's defaults "
        "(extended ULD, lmbda 0.5, beta 0.5, temperature 0.9, top-p 0.95) at lr 5e-4, the learning rate with ULD and "
        "with the hybrid loss, and one other knob at a time",
        ["config", "moved", "greedy acc", "avg@k", "s/step"],
        rows,
    )
    rows = []
    for name, label in (("same-gkd", "GKD's JSD (use_uld_loss=False)"), ("same-uld", "ULD, GOLD's defaults")):
        sc = final_scores(s, f"check/{name}")
        rows.append([label, f"{100 * sc['accuracy']:.1f}", f"{100 * sc['avg_at_k']:.1f}"])
    a.table(
        "Checks of the harness on seed 0: GOLD's trainer with the demo teacher, which has the student's tokenizer "
        "(final greedy accuracy and avg@k, %; lr 5e-4, GOLD's other defaults)",
        ["GOLD loss", "greedy acc", "avg@k"],
        rows,
    )
    best = _chosen(s)
    seeds = range(s.seeds)
    rows = []
    labels = {v: f"opd cross-tokenizer LSM{how}" for v, (_, how) in OPD_VARIANTS.items()}
    labels |= {"gold-default": "GOLD, defaults", "gold-best": f"GOLD, best of the sweep ({best})"}
    for variant, label in labels.items():
        scs = [final_scores(s, r) for r in _runs(s, variant, best)]
        rows.append(
            [
                label,
                mean_ci([x["accuracy"] for x in scs]).fmt(1, 100),
                mean_ci([x["avg_at_k"] for x in scs]).fmt(1, 100),
            ]
        )
    student = [final_scores(s, f"student/seed{k}") for k in seeds]
    rows.append(
        [
            "student (before)",
            mean_ci([x["accuracy"] for x in student]).fmt(1, 100),
            mean_ci([x["avg_at_k"] for x in student]).fmt(1, 100),
        ]
    )
    a.table(
        f"Final accuracy (%) from the same student with the byte-level teacher, mean [95% CI] over {s.seeds} seeds "
        f"(greedy; avg@k at temperature 1, top-p {TOP_P}); GOLD's seed 0 runs are the sweep's",
        ["run", "greedy acc", "avg@k"],
        rows,
    )
    for ours, (_, how) in OPD_VARIANTS.items():
        for variant in ("gold-default", "gold-best"):
            avg_at_k_claim(
                a,
                s,
                "issue 31 goal",
                f"cross-tokenizer LSM{how} beats GOLD at its {'defaults' if variant == 'gold-default' else 'best'} "
                "with a byte-level teacher",
                ours,
                variant,
                _runs(s, ours, best),
                _runs(s, variant, best),
            )
    for ours in OPD_VARIANTS:
        avg_at_k_claim(
            a,
            s,
            "issue 31",
            f"{ours} improves on the student",
            ours,
            "student",
            _runs(s, ours, best),
            [f"student/seed{k}" for k in seeds],
        )
    rows = []
    for variant in OPD_VARIANTS:
        first, last = zip(*(_numbers_and_alignment(s, f"{variant}/seed{k}") for k in seeds))
        rows.append(
            [variant, *(mean_ci(list(x)).fmt(2) for x in zip(*first)), *(mean_ci(list(x)).fmt(2) for x in zip(*last))]
        )
    a.table(
        "What cross-tokenizer LSM's student writes, at its first and last logged steps (mean [95% CI] over seeds): "
        "the share of the numbers in its logged rollouts that have two digits or more, and cross/one_to_one",
        ["run", "multi-digit, first step", "one-to-one, first step", "multi-digit, last step", "one-to-one, last step"],
        rows,
        note="With opd's default map the student learns to write numbers of one digit (its arithmetic then "
        "wrong), where its text aligns one to one with the teacher's. Two things let it: a number's later digits "
        "sit inside a group with one teacher token (the teacher's '15' for the student's '1', '5'), where the "
        "default pairing has no teacher position and no loss; and after a one-digit teacher token the teacher "
        "reads the number as ended (its tokenizer would have joined a second digit), so a digit in its top-K "
        "there carries almost none of its mass and LSM pulls the student's digits down. cross-lsm-groups gives "
        "the later digits the teacher's distribution at the group's start (within_group) and leaves such "
        "digits out of the support (joinable drop).",
    )
    keys = {"cross/one_to_one": "one-to-one share", "eval/accuracy": "greedy accuracy"}
    groups = {v: [f"{v}/seed{k}" for k in seeds] for v in OPD_VARIANTS}  # GOLD logs no opd metrics
    diagnostics_plots(a, s, groups, keys, "gold", rates=tuple(keys))
    a.notes.append(
        "GOLD's best is chosen on seed 0's test-prompt avg@k and that run is one of its seeds: both favour GOLD. "
        "opd's three options for longer teacher tokens (cross-lsm-groups) were developed in probes on seed 0 with "
        "this teacher, scored on the same test prompts: that favours cross-lsm-groups in the same way. "
        "With lmbda < 1 GOLD also trains on the dataset's worked solutions (its off-policy half), which opd's "
        "runs never see."
    )
    return a


EXPERIMENT = Experiment(
    name="gold-bytelevel",
    title="gold-bytelevel: TRL's GOLD at its best, with a byte-level teacher its default alignment runs on (issue 31)",
    about=__doc__.split("\n\n", 1)[1].strip()
    + (
        "\n\nFull size: the teacher's tokenizer and fine-tune (1200 steps of 64, once), 12 GOLD runs and 2 checks on "
        "seed 0, then "
        f"per seed cross-tokenizer LSM with both maps ({OPD_STEPS} steps x {BATCH}), and on seeds 1+ GOLD's defaults "
        "and its best, "
        "each evaluated. `--quick`: a 10-step teacher and 3-step runs (a smoke test only)."
    ),
    plan=plan,
    analyze=analyze,
)

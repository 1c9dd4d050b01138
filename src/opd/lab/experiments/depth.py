"""``opd experiment depth``: reward quality against depth (2604.13016, "the cost of dense supervision").

On rollouts of the packaged demo student (test prompts, top-p 0.9), per seed a different slice
of prompts and different sampling seeds:

* the teacher's per-token reward r_t = log q(y_t) - log p(y_t) by prefix length (buckets of
  4 tokens), and its *quality* at that depth: the AUROC of the rollout's mean reward inside the
  bucket against the rollout's correctness;
* the continuation accuracy advantage: from the student's own prefix of d tokens, sample
  continuations with the teacher and with the student; advantage(d) = accuracy of teacher
  continuations - accuracy of student continuations (how much the teacher can still fix after
  d student tokens);
* the AUROC of the summed teacher reward sum_t r_t against rollout correctness (global
  informativeness), with the AUROC computed as a Mann-Whitney statistic (:func:`stats.auroc`).

Departure from the paper: its horizons are thousands of tokens; here responses are about 30
tokens, so "depth" means a few dozen positions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from opd.evaluation.model_eval import decode_responses
from opd.lab.demos.demo import TASK_LEVEL
from opd.lab.experiments.common import STUDENT, TEACHER, generate_batches
from opd.lab.experiments.core import Analysis, Claim, Experiment, RunSpec, Settings, read_run_file
from opd.lab.experiments.plots import line_plot
from opd.lab.experiments.stats import auroc, mean_ci, verdict
from opd.rollout.prompt_set import PromptSet, load_task
from opd.runs.progress import progress_bar
from opd.tasks.grading import grade
from opd.tasks.task import reference_of
from opd.teachers.scoring import HFTeacher

BUCKET = 4  # tokens per depth bucket
FULL: dict[str, Any] = dict(prompts=160, continuations=4, depths=[0, 4, 8, 12, 16, 20, 24, 28])
QUICK: dict[str, Any] = dict(prompts=16, continuations=1, depths=[0, 8])


def _continuation_accuracy(engine, tok, jobs, seed: int) -> list[bool]:
    """jobs: (prompt ids, prefix ids, answer); continue each prefix once and grade prefix + continuation."""
    if not jobs:
        return []
    ok = []
    seeds = [seed * 100_003 + i for i in range(len(jobs))]
    for start, b in zip(range(0, len(jobs), 128), generate_batches(engine, [p + x for p, x, _ in jobs], seeds)):
        conts = b.response_ids_NT.tolist()
        masks = b.response_mask_NT.tolist()
        for (_, prefix, answer), c, m in zip(jobs[start : start + 128], conts, masks):
            text = tok.decode(prefix + [t for t, keep in zip(c, m) if keep], skip_special_tokens=True)
            ok.append(grade(text, answer))
    return ok


def measure(p: dict, run_dir: Path) -> dict:
    from opd.models.loading import load_model, load_tokenizer
    from opd.rollout.sampling import HFRollout

    seed = p["seed"]
    tok = load_tokenizer(STUDENT, "student")
    student, teacher = load_model(STUDENT, "student"), load_model(TEACHER, "teacher")
    task = load_task("arithmetic", TASK_LEVEL, 0)
    examples = task.examples("test")[seed * p["prompts"] : (seed + 1) * p["prompts"]]
    prompts = PromptSet.build(examples, tok, 256, "test prompts")
    s_engine = HFRollout(student, tok.eos_token_id, tok.pad_token_id)
    t_engine = HFRollout(teacher, tok.eos_token_id, tok.pad_token_id)
    rows = []
    for b_i, batch in enumerate(
        generate_batches(s_engine, prompts.prompt_ids, [seed * 7919 + i for i in range(len(prompts))])
    ):
        q = HFTeacher(teacher).score(batch, 1).sampled_logprobs_NT
        texts = decode_responses(tok, batch.response_ids_NT, batch.response_mask_NT)
        for r in range(batch.num_rollouts):
            ex_i = b_i * 128 + r
            n = int(batch.response_mask_NT[r].sum())
            rows.append(
                {
                    "prompt": ex_i,
                    "correct": grade(texts[r], reference_of(examples[ex_i])),
                    "ids": batch.response_ids_NT[r, :n].tolist(),
                    "reward": (q[r, :n] - batch.logprobs_NT[r, :n]).tolist(),
                }
            )
    cont = []
    with progress_bar("depth: continuations", total=len(p["depths"])) as bar:
        for d in p["depths"]:
            jobs = [
                (prompts.prompt_ids[r["prompt"]], r["ids"][:d], reference_of(examples[r["prompt"]]))
                for r in rows
                if len(r["ids"]) > d
                for _ in range(p["continuations"])
            ]
            acc_t = _continuation_accuracy(t_engine, tok, jobs, seed * 31 + d)
            acc_s = _continuation_accuracy(s_engine, tok, jobs, seed * 31 + d)
            cont.append(
                {
                    "depth": d,
                    "n": len(jobs),
                    "teacher_acc": sum(acc_t) / max(len(jobs), 1),
                    "student_acc": sum(acc_s) / max(len(jobs), 1),
                }
            )
            bar.advance(1)
    (run_dir / "rollouts.json").write_text(json.dumps(rows) + "\n")
    (run_dir / "continuations.json").write_text(json.dumps(cont, indent=1) + "\n")
    return {"rollouts": len(rows), "accuracy": sum(r["correct"] for r in rows) / len(rows)}


def plan(s: Settings) -> list[RunSpec]:
    base = QUICK if s.quick else FULL
    return [
        RunSpec(
            f"seed{k}",
            "python",
            {**base, "seed": k},
            measure,
            "student rollouts scored by the teacher; continuations by teacher and student from student prefixes",
        )
        for k in range(s.seeds)
    ]


# ----------------------------------------------------------------------------- analysis


def bucket_stats(rows: list[dict]) -> list[dict]:
    """Per depth bucket: mean reward over tokens, and AUROC of the per-rollout bucket mean vs correctness."""
    n_b = max(math.ceil(len(r["reward"]) / BUCKET) for r in rows)
    out = []
    for b in range(n_b):
        per_rollout = [
            (
                sum(r["reward"][b * BUCKET : (b + 1) * BUCKET]) / len(r["reward"][b * BUCKET : (b + 1) * BUCKET]),
                r["correct"],
            )
            for r in rows
            if len(r["reward"]) > b * BUCKET
        ]
        tokens = [x for r in rows for x in r["reward"][b * BUCKET : (b + 1) * BUCKET]]
        out.append(
            {
                "bucket": b,
                "start": b * BUCKET,
                "rollouts": len(per_rollout),
                "mean_reward": sum(tokens) / len(tokens),
                "auroc": auroc([v for v, _ in per_rollout], [c for _, c in per_rollout]),
            }
        )
    return out


def _load(s: Settings, k: int) -> tuple[list[dict], list[dict]]:
    return read_run_file(s, f"seed{k}", "rollouts.json"), read_run_file(s, f"seed{k}", "continuations.json")


def _slope(xs, ys) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def analyze(s: Settings, specs: list[RunSpec]) -> Analysis:
    a = Analysis()
    data = [_load(s, k) for k in range(s.seeds)]
    buckets = [bucket_stats(rows) for rows, _ in data]
    # Buckets that every seed reaches with enough rollouts for an AUROC (a tenth of the prompts, at least 4).
    need = max(4, (QUICK if s.quick else FULL)["prompts"] // 10)
    n_b = min(len(b) for b in buckets)
    n_b = next((i for i in range(n_b) if any(bs[i]["rollouts"] < need for bs in buckets)), n_b)
    rows_t, starts = [], [b["start"] for b in buckets[0][:n_b]]
    for b in range(n_b):
        rew = mean_ci([bs[b]["mean_reward"] for bs in buckets])
        au = mean_ci([bs[b]["auroc"] for bs in buckets])
        rows_t.append(
            [
                f"{starts[b]}-{starts[b] + BUCKET - 1}",
                str(min(bs[b]["rollouts"] for bs in buckets)),
                rew.fmt(3),
                au.fmt(3),
            ]
        )
    a.table(
        "Teacher per-token reward log q - log p by depth (response position), mean [95% CI] over seeds; "
        "quality = AUROC of the rollout's mean reward in the bucket against correctness",
        ["positions", "rollouts (min over seeds)", "mean reward", "AUROC vs correctness"],
        rows_t,
    )
    depths = [c["depth"] for c in data[0][1]]
    adv = [[c["teacher_acc"] - c["student_acc"] for c in cont] for _, cont in data]
    rows_c = []
    for j, d in enumerate(depths):
        rows_c.append(
            [
                str(d),
                str(min(cont[j]["n"] for _, cont in data)),
                mean_ci([cont[j]["teacher_acc"] for _, cont in data]).fmt(1, 100),
                mean_ci([cont[j]["student_acc"] for _, cont in data]).fmt(1, 100),
                mean_ci([x[j] for x in adv]).fmt(1, 100),
            ]
        )
    a.table(
        "Continuation accuracy (%) from the student's prefix of d tokens: teacher vs student continuations",
        ["prefix d", "continuations", "teacher", "student", "advantage (teacher - student)"],
        rows_c,
    )
    summed = [auroc([sum(r["reward"]) for r in rows], [r["correct"] for r in rows]) for rows, _ in data]
    acc = [sum(r["correct"] for r in rows) / len(rows) for rows, _ in data]
    a.table(
        "Global informativeness",
        ["measure", "mean [95% CI] over seeds"],
        [
            ["student rollout accuracy (%)", mean_ci(acc).fmt(1, 100)],
            ["AUROC of summed teacher reward vs correctness", mean_ci(summed).fmt(3)],
        ],
    )
    _plots(a, s, buckets, n_b, starts, depths, adv)
    _claims(a, s, buckets, n_b, depths, adv, summed)
    a.notes.append(
        "Reading the depth curves: a response here is a few equations, then 'The answer is \\boxed{N}'. Once "
        "the equations are written the answer is fixed, so late prefixes leave neither model anything to "
        "change and the continuation advantage falls to zero by construction; the paper's decline comes "
        "from drift over thousands of tokens, a different mechanism."
    )
    return a


def _plots(a, s, buckets, n_b, starts, depths, adv) -> None:
    def band(vals):
        cis = [mean_ci(v) for v in vals]
        return [c.mean for c in cis], [c.lo for c in cis], [c.hi for c in cis]

    line_plot(
        s.out / "depth_reward.png",
        {"mean teacher reward": (starts, *band([[bs[b]["mean_reward"] for bs in buckets] for b in range(n_b)]))},
        "response position (bucket start)",
        "log q - log p",
        "Teacher per-token reward by depth",
    )
    line_plot(
        s.out / "depth_auroc.png",
        {"AUROC": (starts, *band([[bs[b]["auroc"] for bs in buckets] for b in range(n_b)]))},
        "response position (bucket start)",
        "AUROC vs correctness",
        "Reward quality by depth",
    )
    line_plot(
        s.out / "depth_continuation.png",
        {"teacher - student": (depths, *band([[x[j] for x in adv] for j in range(len(depths))]))},
        "student prefix length d",
        "continuation accuracy advantage",
        "Continuation accuracy advantage by depth",
    )
    a.plots += ["depth_reward.png", "depth_auroc.png", "depth_continuation.png"]


def _claims(a, s, buckets, n_b, depths, adv, summed) -> None:
    half = n_b // 2
    early_late = []
    for bs in buckets:
        early = [b["auroc"] for b in bs[:half] if not math.isnan(b["auroc"])]
        late = [b["auroc"] for b in bs[half:n_b] if not math.isnan(b["auroc"])]
        early_late.append(sum(early) / len(early) - sum(late) / len(late) if early and late else math.nan)
    v, ci = verdict(early_late)
    a.claims.append(
        Claim(
            "2604.13016 Sec. 4 (reward vs depth)",
            "teacher reward quality degrades with depth",
            f"CI of (mean AUROC of the first {half} buckets - mean AUROC of the rest), paired by seed, above 0",
            v,
            ci.fmt(3),
            ci.p,
        )
    )
    if len(depths) >= 2:
        v, ci = verdict([-_slope(depths, x) for x in adv])
        a.claims.append(
            Claim(
                "2604.13016 Sec. 4 (reward vs depth)",
                "the continuation accuracy advantage decreases with prefix length",
                "CI of minus the least-squares slope of advantage against d above 0",
                v,
                f"slope {(-ci.mean):.4f} per token (CI of minus slope {ci.fmt(4)})",
                ci.p,
            )
        )
    v, ci = verdict([x - 0.5 for x in summed])
    a.claims.append(
        Claim(
            "2604.13016 Sec. 4 (global informativeness)",
            "the summed teacher reward is informative of rollout correctness",
            "CI of AUROC - 0.5 above 0",
            v,
            f"AUROC {mean_ci(summed).fmt(3)}",
            ci.p,
        )
    )


EXPERIMENT = Experiment(
    name="depth",
    title="depth: reward quality against depth on student rollouts (2604.13016)",
    about=__doc__.split("\n\n", 1)[1].strip()
    + (
        "\n\nFull size: 160 test prompts per seed, continuations of 4 samples each at 8 prefix lengths, by teacher "
        "and student (about 10,000 generations per seed): about 2 CPU-minutes per seed; 21 minutes of wall time for "
        "3 seeds here, on 2 cores shared with other jobs. `--quick`: 16 prompts, "
        "one continuation, 2 prefix lengths."
    ),
    plan=plan,
    analyze=analyze,
)

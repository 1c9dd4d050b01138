"""Real runs for the report's tests: what report/test_report.py, report/test_report_agentic.py and
report/test_report_browser.py load, chart and show. Each trains the session's tiny random models (the
``tiny_models`` fixture) for 3 steps. Evaluation records are written by hand (:func:`records_run`).
"""

from __future__ import annotations

import json

from opd.config import TrainConfig

# ---------------------------------------------------------------- two single-turn runs, laid out like the demo's

STEPS, LOG_ROLLOUTS, K = 3, 2, 8
SUMMARY = {
    "teacher_acc": 0.9,
    "teacher_avg_at_k": 0.85,
    "student_init_acc": 0.1,
    "student_init_avg_at_k": 0.12,
    "eval_size": 4,
    "k": 2,
    "objectives": {"sampled": {"final_acc": 0.25, "avg_at_k": 0.2, "steps": STEPS, "wall_s": 12.0}},
}


def make_report_runs(models, root):
    """demo/sampled and demo/lsm (3 steps, evals after steps 1 and 2) and demo/summary.json under ``root``."""
    from opd.training.loop import train

    student, teacher = models
    demo = root / "demo"
    for objective in ("sampled", "lsm"):
        train(
            TrainConfig.from_flat(
                student=str(student),
                teacher=str(teacher),
                out=str(demo / objective),
                objective=objective,
                steps=STEPS,
                batch_size=4,
                max_new_tokens=8,
                eval_size=4,
                eval_samples=2,
                k=K,
                warmup_steps=1,
                log_rollouts=LOG_ROLLOUTS,
                diag_positions=16,
                eval_every=2,
                ckpt_every=0,
            ),
            show_progress=False,
        )
    (demo / "summary.json").write_text(json.dumps(SUMMARY))
    return demo / "sampled", demo / "lsm"


# ---------------------------------------------------------------- an agentic run (the toy game)

BATCH, MAX_TURNS = 4, 4


def make_agentic_run(models, root):
    """``root/agent``: 3 steps of the toy game, all rollouts logged, evaluations after steps 1 and 2."""
    from opd.training.loop import train

    student, teacher = models
    out = root / "agent"
    train(
        TrainConfig.from_flat(
            student=str(student),
            teacher=str(teacher),
            out=str(out),
            device="cpu",
            env="toy",
            env_level=1,
            steps=3,
            batch_size=BATCH,
            max_new_tokens=96,
            max_action_tokens=8,
            max_turns=MAX_TURNS,
            k=8,
            warmup_steps=1,
            diag_positions=16,
            eval_size=2,
            eval_samples=2,
            eval_every=2,
            ckpt_every=0,
            log_rollouts=BATCH,
        ),
        show_progress=False,
    )
    return out


# ---------------------------------------------------------------- evaluation records, written by hand


def eval_record(item, correct, sample=-1, truncated=False) -> dict:
    """One response's record as opd.evaluation.records writes it."""
    return {
        "item": item,
        "sample": sample,
        "prompt": f"q{item}",
        "response": f"r{item}",
        "answer": "1",
        "reference": "1",
        "correct": correct,
        "tokens": 3,
        "truncated": truncated,
    }


def write_records(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def records_run(root, name, evaluations, tasks=None):
    """A run folder with one metrics line and ``evaluations`` ({step: records}) in ``eval_samples/``, and per
    task of ``tasks`` ({name: {step: records}}) in ``tasks/NAME/eval_samples/``."""
    run = root / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "train/loss": 1.0}) + "\n")
    (run / "config.json").write_text(json.dumps({"steps": 1}))
    for folder, evals in [(run, evaluations), *((run / "tasks" / t, e) for t, e in (tasks or {}).items())]:
        for step, records in evals.items():
            write_records(folder / "eval_samples" / f"step_{step:07d}.jsonl", records)
    return run

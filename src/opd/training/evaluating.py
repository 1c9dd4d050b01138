"""The evaluation stage of a training step (``--eval-every``, and after the last step): every task with
held-out data evaluated through the run's engine, its figures logged to ``metrics.jsonl``, its per-sample
records written beside them and sent to the trackers (:mod:`opd.evaluation.core` does the evaluating)."""

from __future__ import annotations

import json
from typing import cast

from opd.evaluation.records import step_records, write_records
from opd.evaluation.sharing import Share
from opd.rollout.registry import local_engine
from opd.training.setup import Run, TaskRun
from opd.training.sources import Source, eval_plan


def evaluated_tasks(run: Run) -> list[tuple[TaskRun, Source]]:
    """The tasks with held-out data to evaluate, and that data (none: --no-eval, or nothing to grade)."""
    return [(t, t.test) for t in run.tasks if t.test is not None]


def eval_stage(run: Run, step: int) -> dict:
    """Every task with held-out data evaluated on its prompts (accuracy, avg@k) or games (success rate),
    every rank a share of them (with FSDP, on weights all ranks gathered), the outcomes gathered: the
    figures of one process (:mod:`opd.evaluation.sharing`), which rank 0 logs. Nothing to evaluate:
    nothing logged.

    A multi-task run logs ``eval/<name>/...`` per task and, as ``eval/accuracy`` and
    ``eval/avg_at_k``, the unweighted mean over its evaluated tasks."""
    tasks = evaluated_tasks(run)
    if not tasks:
        return {}
    share = Share(run.dist.rank, run.dist.world, run.dist.gather)
    # Through the run's engine (opd's loop, its static cache, vLLM), which has this step's weights; with rollouts
    # ahead (--max-staleness) a worker may load older weights into a shared engine between two batches, so the
    # trainer's own model is evaluated with opd's loop instead.
    plans = [eval_plan(t.cfg, run.cfg.run.seed, share) for t, _ in tasks]
    engine_of = lambda s, t: local_engine(s, run.tokenizer) if run.cfg.rollout.max_staleness else t.engine
    evaluate = lambda s: [
        test.evaluate(engine_of(s, t), run.tokenizer, t.cfg, p) for (t, test), p in zip(tasks, plans, strict=True)
    ]
    done = run.dist.full_call(evaluate)
    results = [d.figures for d in done]
    run.student.train()
    if not run.dist.is_main:
        return {}
    record: dict = {"step": step}
    for (t, test), d in zip(tasks, done, strict=True):
        res = d.figures
        if not (run.rundir.path / t.files / "eval.jsonl").is_file():  # listed once played (once)
            listed = cast(list[dict], test.listing(run.rundir.path / t.files, played=True))  # played: listed
            run.rundir.write_jsonl(f"{t.files}eval.jsonl", listed)
        if t.cfg.eval.eval_record_chars and run.rundir.enabled:
            write_records(step_records(run.rundir.path / t.files, step), d.records)
            run.rundir.log_samples(f"eval/{t.name}/samples" if t.name else "eval/samples", d.records, step)
        # The decoding used (--eval-sampling model: what the generation config said) is a setting, not a metric.
        res = dict(res)
        sampling = res.pop("sampling", None)
        if sampling is not None and run.rundir.enabled:
            (run.rundir.path / t.files).mkdir(parents=True, exist_ok=True)
            (run.rundir.path / t.files / "eval_sampling.json").write_text(json.dumps(sampling, indent=2) + "\n")
        record.update({(f"eval/{t.name}/{k}" if t.name else f"eval/{k}"): v for k, v in res.items()})
    if run.tasks[0].name:
        for key in ("accuracy", "avg_at_k"):
            if all(key in r for r in results):
                record[f"eval/{key}"] = sum(r[key] for r in results) / len(results)
    run.rundir.log_metrics(record)
    return record

"""The rollout producer: what each step of the loop (:mod:`opd.training.loop`) trains on.

``producer.take(step)`` returns the step's parts -- per task of the step, its rollouts scored by its
teacher (:class:`StepPart`) -- and the metrics of making them (``time/generate``, ``time/score``, the
engine's policy check and weight sync, ...). Two producers stand behind that one call:

* :class:`OnPolicy` (``--max-staleness 0``): the rollouts generated here, by the run's engine, with the
  weights the step starts from, then scored by each task's teacher;
* :class:`Ahead` (``--max-staleness S``): the rollouts asked S steps ago of the worker process
  (:mod:`opd.training.ahead`), which makes them with the weights of that step while the trainer works; a
  served teacher scores them in a thread while the trainer updates on the step before (exact: see
  :meth:`Ahead._score_ahead`). The worker, its requests in flight and the scoring thread are its own.

A service that stays down (the rollout engine, a served teacher) on any rank stops the step's making on
every rank together, after the stage it happened in (so the stages' collectives stay in step): each
rank raises :class:`ServiceDown`, which the loop turns into a checkpoint of step - 1 and a clean stop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from opd.errors import ServiceUnavailable, UserError
from opd.models.export import merged_weights
from opd.rollout.engine import EngineReport, EngineUnavailable, RolloutBatch
from opd.rollout.episodes import EpisodeRecord
from opd.rollout.prompt_set import sample_seed
from opd.teachers.factory import is_served
from opd.teachers.scoring import TeacherScores, TeacherUnavailable
from opd.training.ahead import AheadRollouts, rank_share, saved_in_flight, split_threads
from opd.training.loss import loss_mask, needs_student_topk, scored_loss_mask, student_topk_ids
from opd.training.schedule import for_task
from opd.training.setup import Run, TaskRun

Rollout = tuple[RolloutBatch, list[int], list[EpisodeRecord] | None]  # a part's batch, items and episode records


@dataclass(frozen=True)
class Assignment:
    """A task's place in a step: its batch number among its own steps and its first global slot."""

    task: TaskRun
    visit: int  # how many earlier steps trained on this task: its data walks its own prompt order
    slot0: int  # where its rollouts start in the step's global batch (sampling seeds)


@dataclass
class StepPart:
    """One task's share of a step once scored (the whole step when it has one task): its rollouts,
    loss mask, diagnostic positions, teacher scores and the scoring's own metrics."""

    task: TaskRun
    batch: RolloutBatch
    rows: list[int]
    records: list[EpisodeRecord] | None
    mask_NT: torch.Tensor  # the loss mask, without the positions the teacher did not score
    diag_M: torch.Tensor  # the flat positions of the full-vocabulary diagnostics
    scores: TeacherScores
    student_ids: torch.Tensor | None  # the student's top-K, for student-side supports
    score_metrics: dict[str, float]  # logged with the step (cross/dropped)


class ServiceDown(Exception):
    """A service stayed down on some rank while a step was made: every rank raises it, together. ``kind``:
    the error the run stops with; ``service``: what to bring up; ``why``: what happened (or on which rank)."""

    def __init__(self, kind: type[ServiceUnavailable], service: str, why: str):
        super().__init__(why)
        self.kind, self.service, self.why = kind, service, why


class Producer(Protocol):
    """What the loop asks of a producer (see the module docstring)."""

    def take(self, step: int) -> tuple[list[StepPart], dict[str, float]]:
        """The step's parts, scored, and the metrics of making them; ServiceDown on every rank together."""

    def in_flight(self, after: int) -> dict[str, Any]:
        """What a checkpoint of step ``after`` holds of the rollouts asked for past it (entries of its state)."""

    def close(self) -> None: ...


def make_producer(run: Run) -> Producer:
    """The run's producer: on-policy, or ahead of the trainer with --max-staleness."""
    return Ahead(run) if run.cfg.rollout.max_staleness else OnPolicy(run)


# ----------------------------------------------------------------------------- rollout


def step_tasks(run: Run, step: int) -> list[Assignment]:
    """The tasks ``step`` trains on: the single task; the scheduled one (alternate); every task (mix),
    their rollouts numbered one after the other in the step's global batch."""
    if run.cfg.multitask.task_mode == "alternate":
        i, visit = run.schedule[step]
        return [Assignment(run.tasks[i], visit, 0)]
    out, slot0 = [], 0
    for t in run.tasks:
        out.append(Assignment(t, step, slot0))
        slot0 += t.cfg.optimizer.batch_size * t.cfg.rollout.samples_per_prompt * run.dist.world
    return out


def rollout_request(run: Run, step: int, at: Assignment) -> tuple[list[int], list[int]]:
    """This rank's share of one task of the step (``at``, from :func:`step_tasks`): its contiguous
    block of the task's global batch (the items, a rollout per sample), each seeded by its global slot."""
    task, cfg = at.task, at.task.cfg
    idx = task.source.batch_indices(at.visit, cfg.optimizer.batch_size * run.dist.world, cfg.run.seed)
    global_rows = [i for i in idx for _ in range(cfg.rollout.samples_per_prompt)]
    slots = run.dist.shard(list(range(len(global_rows))))
    return [global_rows[s] for s in slots], [sample_seed(cfg.run.seed, step, at.slot0 + s) for s in slots]


def rollout_stage(run: Run, step: int, at: Assignment) -> Rollout:
    """This rank's rollouts of one task of the step, generated here: with --env, episodes of the
    step's games and what happened in each (the source's records; None for prompts)."""
    task = at.task
    rows, seeds = rollout_request(run, step, at)
    batch, records = run.dist.full_call(lambda _: task.source.rollout(task.engine, rows, seeds, task.cfg))
    return batch, rows, records


def engine_metrics(reports: list[EngineReport]) -> dict[str, float]:
    """What the engine reported of the step's batches: the largest policy gap over its tasks' and the
    time its weight sync took (where it has either)."""
    gaps = [r.policy_gap for r in reports if r.policy_gap is not None]
    syncs = [r.sync_seconds for r in reports if r.sync_seconds is not None]
    return {
        **({"rollout/engine_logprob_gap": max(gaps)} if gaps else {}),
        **({"time/weight_sync": sum(syncs)} if syncs else {}),
    }


# ----------------------------------------------------------------------------- score


def diag_index(mask_NT: torch.Tensor, n: int, step: int, seed: int) -> torch.Tensor:
    """A seeded sample of flat response positions for the full-vocabulary diagnostics."""
    flat = mask_NT.reshape(-1).nonzero().squeeze(-1)
    if flat.numel() <= n:
        return flat
    g = torch.Generator().manual_seed(seed * 31 + step)
    pick = torch.randperm(flat.numel(), generator=g, device="cpu")[:n].to(flat.device)
    return flat[pick].sort().values


def score_stage(run: Run, batch: RolloutBatch, diag_M: torch.Tensor, task: TaskRun):
    """The teacher's scores of one task's rollouts, by that task's teacher."""
    cfg = run.cfg
    needs_student = needs_student_topk(cfg)
    student_ids = run.dist.full_call(lambda s: student_topk_ids(s, batch, cfg.objective.k)) if needs_student else None
    # a served teacher that stays down stops the run at this step, naming its task
    scores = for_task(
        task.name, task.teacher.score, batch, cfg.objective.k, query_ids_NTQ=student_ids, diag_index_M=diag_M
    )
    return scores, student_ids


def scored_positions(run: Run, step: int, task: TaskRun, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss mask of one task's rollouts and the positions of its full-vocabulary diagnostics."""
    mask_NT = loss_mask(batch, run.special_ids, task.cfg.objective.mask_special)
    return mask_NT, diag_index(mask_NT, run.cfg.run.diag_positions, step, run.cfg.run.seed)


def scored_part(
    run: Run, step: int, task: TaskRun, batch: RolloutBatch, rows: list[int], records, early=None
) -> StepPart:
    """One task's rollouts, scored: the loss mask, the diagnostic positions, the teacher's scores
    (``early``: scores made ahead, see :meth:`Ahead._score_ahead`), and the mask without what the teacher
    did not score (a cross-tokenizer teacher's unaligned positions)."""
    mask_NT, diag_M = scored_positions(run, step, task, batch)
    scores, student_ids = early or score_stage(run, batch, diag_M, task)
    kept_NT, metrics = scored_loss_mask(mask_NT, scores)
    return StepPart(task, batch, rows, records, kept_NT, diag_M, scores, student_ids, metrics)


def score_parts(run: Run, step: int, tasks: list[Assignment], rollouts: list[Rollout], made=None) -> list[StepPart]:
    """Every part of the step, scored by its teacher (``made``: per part, scores made ahead, or None); a
    served teacher that stays down stops the step on every rank (each part's scoring on its own: a
    scoring may gather the student's weights, which every rank must do together)."""
    parts = []
    for i, (at, (batch, rows, records)) in enumerate(zip(tasks, rollouts, strict=True)):
        with on_every_rank(run, TeacherUnavailable, "the teacher"):
            parts.append(scored_part(run, step, at.task, batch, rows, records, None if made is None else made[i]))
    return parts


@contextmanager
def on_every_rank(run: Run, kind: type[ServiceUnavailable], service: str) -> Iterator[None]:
    """Around a stage of a step's making: a service this rank found down (a ServiceUnavailable, or a task's
    error caused by one) is every rank's, raised by all together as :class:`ServiceDown` once the stage is
    over on each (``kind``: the error the run stops with; ``service``: what to bring up)."""
    down = None
    try:
        yield
    except UserError as exc:  # a multi-task run's teacher error names its task, caused by the client's
        if not (isinstance(exc, ServiceUnavailable) or isinstance(exc.__cause__, ServiceUnavailable)):
            raise
        down = exc
    if run.dist.all_sum([float(down is not None)])[0]:
        raise ServiceDown(
            kind, service, str(down) if down is not None else f"{service} of another rank stayed unreachable"
        )


# ----------------------------------------------------------------------------- producers


class OnPolicy:
    """``--max-staleness 0``: each step's rollouts generated here, then scored, in turn."""

    def __init__(self, run: Run):
        self.run = run

    def take(self, step: int) -> tuple[list[StepPart], dict[str, float]]:
        run, t0 = self.run, time.perf_counter()
        tasks = step_tasks(run, step)
        rollouts = []
        for at in tasks:  # one agreement per task, as scoring: a task's rollout may gather weights on every rank
            with on_every_rank(run, EngineUnavailable, "the rollout engine"):
                rollouts.append(rollout_stage(run, step, at))
        t1 = time.perf_counter()
        parts = score_parts(run, step, tasks, rollouts)
        made = {"time/generate": t1 - t0, "time/score": time.perf_counter() - t1}
        return parts, {**made, **engine_metrics([b.report for b, _, _ in rollouts])}

    def in_flight(self, after: int) -> dict[str, Any]:
        return {}  # nothing is asked for before its step

    def close(self) -> None:
        return None


class Ahead:
    """``--max-staleness S``: the worker's rollouts (:mod:`opd.training.ahead`), asked for S steps ahead,
    and a served teacher's scores of them made while the trainer updates on the step before."""

    def __init__(self, run: Run):
        cfg, engine = run.cfg, run.tasks[0].engine  # the tasks share the run's one engine
        if cfg.rollout.rollout_worker_threads:
            threads = cfg.rollout.rollout_worker_threads
        else:  # the worker takes its share of the cores' torch threads; the trainer keeps the rest
            trainer, threads = split_threads(torch.get_num_threads())
            torch.set_num_threads(trainer)
        self.run, self.rollouts = run, AheadRollouts(cfg, threads, engine)
        saved, run.in_flight = run.in_flight, None  # the run keeps no copy (held weights among them)
        if saved is not None:  # resuming: the rollouts the checkpoint held in flight
            try:
                self.rollouts.load(rank_share(saved, run.dist.rank))
            except BaseException:
                self.rollouts.close()
                raise
        served = any(is_served(t.teacher) for t in run.tasks)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="opd-score-ahead") if served else None
        self.early: Future | None = None  # the next step's scores, made while this step updates

    def take(self, step: int) -> tuple[list[StepPart], dict[str, float]]:
        run, t0 = self.run, time.perf_counter()
        tasks = step_tasks(run, step)
        with on_every_rank(run, EngineUnavailable, "the rollout engine"):
            rollouts, stats = self._rollouts(step)
        t1 = time.perf_counter()
        early, self.early = self.early, None
        scored = None  # (per part: scores, student ids; seconds), or None: score in turn
        if early is not None:  # its errors are the step's, as if it scored now
            with on_every_rank(run, TeacherUnavailable, "the teacher"):
                scored = early.result()  # None where the worker died making the rollouts: they were made again
        parts = score_parts(run, step, tasks, rollouts, scored[0] if scored else None)
        t2 = time.perf_counter()
        self.early = self._score_ahead(step + 1)  # while this step updates
        made = {"time/generate": t1 - t0, "time/score": t2 - t1, **stats}
        return parts, {**made, **({"time/score_ahead": scored[1]} if scored else {})}

    def _rollouts(self, step: int) -> tuple[list[Rollout], dict[str, float]]:
        """The worker is asked for the steps up to ``step`` + S not yet asked for, with the weights this
        step starts from, and step ``step``'s rollouts (asked for S steps ago) are taken."""
        run, ahead = self.run, self.rollouts
        weights = None
        for later in range(ahead.last + 1, min(step + run.cfg.rollout.max_staleness, run.cfg.optimizer.steps - 1) + 1):
            weights = weights or run.dist.full_call(merged_weights)
            parts = [(run.tasks.index(at.task), *rollout_request(run, later, at)) for at in step_tasks(run, later)]
            ahead.submit(later, step, parts, weights)
        t0 = time.perf_counter()
        rollouts, policy_step, worker = ahead.take(step)
        waited = time.perf_counter() - t0
        stats = {"rollout/staleness": float(step - policy_step), "rollout/worker_restarts": float(ahead.restarts)}
        return rollouts, {**stats, **worker, "time/rollout_wait": waited}

    def _score_ahead(self, step: int) -> Future | None:
        """With a served teacher: step ``step``'s rollouts, once the worker has made them, scored in a
        thread while the trainer updates on the step before. Exact: the scores depend on the rollouts
        alone (a served teacher's weights never change) and the positions asked for on the rollouts and
        the step, so the run is the one that scores in turn. Not done where the scores need the student's
        present weights (student-side supports) or a teacher is in this process (it would score on the
        trainer's own cores): None then, and the step scores in turn."""
        run = self.run
        if self.pool is None or step >= run.cfg.optimizer.steps or needs_student_topk(run.cfg):
            return None
        req = self.rollouts.pending.get(step)
        tasks = step_tasks(run, step)
        if req is None or not all(is_served(at.task.teacher) for at in tasks):
            return None

        def scores():
            made = req.made()
            if made is None:
                return None
            t0 = time.perf_counter()
            out = []
            for at, (batch, _, _) in zip(tasks, made[0], strict=True):
                diag_M = scored_positions(run, step, at.task, batch)[1]
                out.append(score_stage(run, batch, diag_M, at.task))
            return out, time.perf_counter() - t0

        return self.pool.submit(scores)

    def in_flight(self, after: int) -> dict[str, Any]:
        """Every rank's rollouts asked for with the weights a checkpoint of ``after`` has seen (collective)."""
        return {"ahead": saved_in_flight(self.run.dist, self.rollouts.in_flight(after))}

    def close(self) -> None:
        self.rollouts.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

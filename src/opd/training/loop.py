"""On-policy distillation: the training loop (``opd train``).

Each step reads top to bottom:

    prompts -> rollout (student samples, top-p) -> score (teacher top-K and log-probs)
            -> update (objective loss, AdamW, clipping) -> log (metrics.jsonl, rollouts.jsonl)
            -> eval / checkpoint

Departures from the paper (arXiv:2603.25562) worth knowing: the loss is reduced as a token mean
over the whole rollout batch (micro-batches add up to exactly that); the diagnostics that need
the student's full distribution are computed on a random sample of ``diag_positions`` response
positions per step, without gradients. Sampling is seeded per prompt, so a resumed run repeats
the uninterrupted one step for step.

Under ``torchrun``/``accelerate launch`` each rank takes its shard of the step's global batch
(``--batch-size`` prompts per rank) and the student is wrapped with DDP, or FSDP with ``--fsdp``
(see :mod:`opd.training.distributed`); the loss is normalised by the global batch's counts, so N ranks of
batch b follow the trajectory of one process of batch N*b. With ``--lora-r`` only a LoRA adapter
is trained (:mod:`opd.models.lora`).

Multi-task runs (``tasks:`` in the config, :mod:`opd.training.schedule`) give every task its own teacher,
prompts or games and settings. A step holds one part per task it trains on: one part in a
single-task run or an alternating step, every task's part in ``--task-mode mix``. Each part is
rolled out and scored by its own task's teacher; the update runs the micro-batches of all parts
into one optimizer step, with the loss normalised by the counts of all parts together (a token
mean over all tasks' loss tokens; see :func:`global_totals`). Metrics are logged for the whole
step and, prefixed with the task's name, for each part.

A served teacher that stays down past ``--teacher-wait`` stops the run at a step's scoring, after
checkpointing the last completed step: ``--resume`` redoes the step cut short and loses nothing.

Run: ``opd train --student DIR --teacher DIR --objective lsm --k 32 --out runs/x``.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedTokenizerBase

from opd import metrics as M
from opd.config import TEACHER_SCORING, TaskSpec, TrainConfig, config_record, resolve_tasks
from opd.errors import ServiceUnavailable, UserError
from opd.models.loading import disable_dropout, head_weight, load_model, load_tokenizer, resolve_device
from opd.models.lora import apply_lora, load_weights
from opd.rollout.episodes import EpisodeRecord
from opd.rollout.prompt_set import sample_seed
from opd.rollout.sampling import RolloutBatch
from opd.rollout.vllm_engine import EngineUnavailable
from opd.runs.progress import progress_bar
from opd.runs.rundir import RunDir, save_final_model
from opd.teachers.factory import make_teacher
from opd.teachers.scoring import TeacherScorer, TeacherScores, TeacherUnavailable
from opd.training.distributed import Dist, init_distributed, merge_metrics, shutdown
from opd.training.loss import (
    LossTotals,
    loss_mask,
    needs_student_topk,
    objective_loss,
    reduce_loss,
    scored_loss_mask,
    student_topk_ids,
)
from opd.training.optim import make_optimizer, make_scheduler, rng_state, set_rng_state
from opd.training.schedule import for_task, prefixed, task_schedule
from opd.training.sources import Source, make_sources, task_data
from opd.training.stepstats import StepUpdate, metric_weights, rollout_records, step_metrics


@dataclass
class TaskRun:
    """One task of a run: its settings, teacher, rollout engine and data (a single-task run has one, named "")."""

    name: str  # prefixes its metrics and files; "" in a single-task run (no prefix anywhere)
    cfg: TrainConfig  # the run's config with this task's overrides (a single-task run: the run's own)
    share: float  # its normalised share of the steps (alternate) or of the batch (mix)
    teacher: TeacherScorer
    source: Source  # its training prompts, or an environment's games (--env)
    test: Source  # held out: what evaluation measures (--eval-task's test prompts, or held-out games)
    engine: Any  # the source's engine on the student: single-turn sampling, or episodes

    @property
    def files(self) -> str:
        """Where its evaluation set is listed, relative to the run directory."""
        return f"tasks/{self.name}/" if self.name else ""


@dataclass
class Run:
    """Everything the loop's stages share; built once by :func:`setup`."""

    cfg: TrainConfig
    student: torch.nn.Module  # a transformers causal LM, or peft's wrapper of one (--lora-r)
    tokenizer: PreTrainedTokenizerBase
    tasks: list[TaskRun]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    rundir: RunDir
    special_ids: list[int]
    dist: Dist = field(default_factory=Dist)  # ranks, and the student as DDP/FSDP wrap it (dist.model)
    start_step: int = 0
    schedule: list[tuple[int, int]] = field(default_factory=list)  # alternate: (task, its batch number) per step


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


# ----------------------------------------------------------------------------- setup


def setup(cfg: TrainConfig) -> Run:
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    dist = init_distributed(cfg.fsdp, device)
    rundir = RunDir(cfg.out, report_to=cfg.report_to)
    rundir.require_fresh(cfg.resume)
    specs = resolve_tasks(cfg)
    # before the models: a data problem shows at once
    data = [for_task(s.name, task_data, s.cfg) for s in specs]
    tok = load_tokenizer(cfg.student, "student")
    student = load_model(cfg.student, "student", cfg.dtype, device)
    tasks = build_tasks(specs, data, student, tok)
    V = head_weight(student).shape[0]
    if cfg.k > V:
        raise UserError(f"k={cfg.k} is larger than the vocabulary ({V} tokens); choose --k <= {V}")
    special_ids = special_token_ids(tok, cfg.special_tokens)
    if not cfg.keep_dropout:  # before LoRA, so --lora-dropout still applies to the adapter
        disable_dropout(student)
    if cfg.lora_r:
        student = apply_lora(student, cfg.lora_r, cfg.lora_alpha, cfg.lora_targets, cfg.lora_dropout, cfg.student)
    ckpt = rundir.latest_checkpoint() if cfg.resume else None
    if ckpt is not None:
        load_weights(student, ckpt / "model")  # before wrapping: FSDP shards the weights it is given
    student.train()
    optimizer = make_optimizer(dist.wrap(student), cfg.lr, cfg.weight_decay)
    if cfg.rollout_engine == "vllm":
        use_vllm(cfg, tasks, student, tok, rundir, dist, optimizer)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.steps * cfg.updates_per_batch, cfg.schedule)
    schedule = task_schedule(cfg.steps, [t.share for t in tasks], cfg.seed) if cfg.task_mode == "alternate" else []
    run = Run(cfg, student, tok, tasks, optimizer, scheduler, rundir, special_ids, dist, schedule=schedule)
    if ckpt is not None:
        resume(run, ckpt)
    elif cfg.resume:  # killed before its first checkpoint: it starts over, so must its logs
        rundir.truncate_logs_after(-1)
    rundir.write_config(cfg)
    for t in tasks:  # an environment's games are listed once played (eval_stage)
        listed = t.test.listing(rundir.path / t.files, played=False)
        if listed is not None:
            rundir.write_jsonl(f"{t.files}eval.jsonl", listed)
    return run


def use_vllm(cfg: TrainConfig, tasks: list[TaskRun], student, tok, rundir: RunDir, dist: Dist, optimizer) -> None:
    """``--rollout-engine vllm``: every task rolls out from one vLLM server that is given the student's
    weights (LoRA's wrapper included) after each optimizer step; under torchrun/accelerate, one server
    per rank (its own folder), as each rank rolls out its own share of the batch."""
    from opd.rollout.vllm_engine import start_engine

    if dist.world > 1 and cfg.vllm_url:
        raise UserError(
            "--vllm-url names one engine, and each of the launch's ranks needs its own: leave --vllm-url out "
            "and opd starts one per rank, or run in one process"
        )
    folder = rundir.path / "vllm" / (f"rank{dist.rank}" if dist.world > 1 else "")
    key = os.environ.get("OPD_VLLM_API_KEY", "")
    engine = start_engine(student, tok, cfg.student, folder, cfg, [t.cfg for t in tasks], api_key=key)
    engine.watch(optimizer)
    for t in tasks:
        t.engine = t.source.on_vllm(engine, tok)


def _teacher_key(c: TrainConfig) -> tuple:
    """Where a task's teacher is and how it scores (:data:`opd.config.tasks.TEACHER_SCORING`): the
    same model read with another dtype or tokenizer setting scores differently, so is not shared."""
    where = ("url", c.teacher_url) if c.teacher_url else ("dir", str(Path(c.teacher).resolve()))
    values = (c.dtype if f == "teacher_dtype" and not c.teacher_dtype else getattr(c, f) for f in TEACHER_SCORING)
    return (*where, *(tuple(v) if isinstance(v, list) else v for v in values))


def build_tasks(specs: list[TaskSpec], data: list[tuple], student, tok) -> list[TaskRun]:
    """Each task's teacher, sources and engine. A teacher that several tasks name (the
    same directory or URL, with the same dtype and tokenizer settings) is loaded once and shared."""
    teachers: dict[tuple, TeacherScorer] = {}
    out = []
    for spec, (task, eval_task) in zip(specs, data, strict=True):
        c = spec.cfg
        key = _teacher_key(c)
        if key not in teachers:  # every teacher's vocabulary is checked against the student's here
            teachers[key] = for_task(spec.name, make_teacher, c, student, tok)
        source, test = for_task(spec.name, make_sources, c, tok, task, eval_task)
        for_task(spec.name, source.check_model, student, c)
        out.append(TaskRun(spec.name, c, spec.share, teachers[key], source, test, source.engine(student, tok)))
    return out


def special_token_ids(tok, tokens: list[str]) -> list[int]:
    ids = []
    for t in tokens:
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id:
            raise UserError(f"special token {t!r} is not in the student's vocabulary; fix --special-tokens")
        ids.append(tid)
    return ids


def resume(run: Run, ckpt: Path) -> None:
    """Optimizer, schedule, RNG and step from ``ckpt`` (the weights were loaded before wrapping)."""
    state = run.rundir.load_state(ckpt)
    if state.get("fsdp", False) != run.dist.fsdp:  # the two keep the optimizer state in different layouts
        was = "with" if state.get("fsdp") else "without"
        raise UserError(f"checkpoint {ckpt} was written {was} --fsdp; resume {was} --fsdp as well")
    saved_world = len(state["rng"]) if isinstance(state["rng"], list) else 1
    if saved_world != run.dist.world:  # the global batch, and so each step's prompts, would change
        raise UserError(
            f"checkpoint {ckpt} was written by {saved_world} process(es), this launch has "
            f"{run.dist.world}; resume with the same number of processes"
        )
    run.dist.load_optimizer_state(run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], run.dist.rank, run.dist.world, run.dist.device)
    run.start_step = state["step"] + 1
    run.rundir.truncate_logs_after(state["step"])


# ----------------------------------------------------------------------------- stages


def step_tasks(run: Run, step: int) -> list[Assignment]:
    """The tasks ``step`` trains on: the single task; the scheduled one (alternate); every task (mix),
    their rollouts numbered one after the other in the step's global batch."""
    if run.cfg.task_mode == "alternate":
        i, visit = run.schedule[step]
        return [Assignment(run.tasks[i], visit, 0)]
    out, slot0 = [], 0
    for t in run.tasks:
        out.append(Assignment(t, step, slot0))
        slot0 += t.cfg.batch_size * t.cfg.samples_per_prompt * run.dist.world
    return out


def rollout_stage(run: Run, step: int, at: Assignment) -> tuple[RolloutBatch, list[int], list[EpisodeRecord] | None]:
    """This rank's rollouts of one task of the step (``at``, from :func:`step_tasks`): its
    contiguous block of the task's global batch, seeded by global slot; with --env, episodes of the
    step's games and what happened in each (the source's records; None for prompts)."""
    task, cfg = at.task, at.task.cfg
    idx = task.source.batch_indices(at.visit, cfg.batch_size * run.dist.world, cfg.seed)
    global_rows = [i for i in idx for _ in range(cfg.samples_per_prompt)]
    slots = run.dist.shard(list(range(len(global_rows))))
    rows = [global_rows[s] for s in slots]
    seeds = [sample_seed(cfg.seed, step, at.slot0 + s) for s in slots]
    batch, records = run.dist.full_call(lambda _: task.source.rollout(task.engine, rows, seeds, cfg))
    return batch, rows, records


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
    student_ids = run.dist.full_call(lambda s: student_topk_ids(s, batch, cfg.k)) if needs_student else None
    # a served teacher that stays down stops the run here, naming its task (see stop_if_service_down)
    scores = for_task(task.name, task.teacher.score, batch, cfg.k, query_ids_NTQ=student_ids, diag_index_M=diag_M)
    return scores, student_ids


def scored_part(
    run: Run, step: int, rng: dict, task: TaskRun, batch: RolloutBatch, rows: list[int], records
) -> StepPart:
    """One task's rollouts, scored: the loss mask, the diagnostic positions, the teacher's scores
    (a teacher that stays down checkpoints step - 1 first: --resume loses nothing), and the mask
    without what the teacher did not score (a cross-tokenizer teacher's unaligned positions)."""
    mask_NT = loss_mask(batch, run.special_ids, task.cfg.mask_special)
    diag_M = diag_index(mask_NT, run.cfg.diag_positions, step, run.cfg.seed)
    with stop_if_service_down(run, step, rng, TeacherUnavailable, "the teacher"):
        scores, student_ids = score_stage(run, batch, diag_M, task)
    kept_NT, metrics = scored_loss_mask(mask_NT, scores)
    return StepPart(task, batch, rows, records, kept_NT, diag_M, scores, student_ids, metrics)


@contextmanager
def stop_if_service_down(run: Run, step: int, rng: dict, kind: type[ServiceUnavailable], service: str):
    """Around a step's rollouts or scoring: a served teacher (or vLLM rollout engine) that stayed
    unreachable stops the run, every rank together (the checkpoint is collective), once step - 1 is
    checkpointed. Nothing of this step has reached the weights, so --resume redoes it from its rollouts
    on and loses nothing. ``rng``: the generators' state as the step began, which is the one a
    checkpoint of step - 1 holds. ``kind`` is the error raised, ``service`` what to bring up."""
    down = None
    try:
        yield
    except UserError as exc:  # a multi-task run's teacher error names its task, caused by the client's
        if not (isinstance(exc, ServiceUnavailable) or isinstance(exc.__cause__, ServiceUnavailable)):
            raise
        down = exc
    if not run.dist.all_sum([float(down is not None)])[0]:
        return
    why = down or f"{service} of another rank stayed unreachable"
    if step > run.start_step and not (run.cfg.ckpt_every and step % run.cfg.ckpt_every == 0):
        checkpoint_stage(run, step - 1, rng)  # else the loop wrote it, or the run resumed from it (or none ran)
    then = (
        f"checkpoint of step {step - 1} written in {run.rundir.ckpt_root}; resume with --resume"
        if step
        else "no step had finished, so nothing was checkpointed; run the same command"
    )
    raise kind(f"{why}; {then} once {service} is up") from None


def global_totals(run: Run, masks: list[torch.Tensor], horizons: list[int]) -> LossTotals:
    """The loss normalisers of the step's global batch (all ranks, and all tasks' parts in mix mode),
    so every rank's and every part's share adds up to it. ``horizons``: each part's max_new_tokens
    (constant_sum divides by the sum over parts of rollouts x horizon)."""
    tokens, seqs, rollouts, budget = run.dist.all_sum(
        [
            sum(float(m.sum()) for m in masks),
            sum(float((m.sum(-1) > 0).sum()) for m in masks),
            sum(float(m.shape[0]) for m in masks),
            sum(float(m.shape[0] * h) for m, h in zip(masks, horizons, strict=True)),
        ]
    )
    return LossTotals(int(tokens), int(seqs), int(rollouts), run.cfg.max_new_tokens, run.dist.world, int(budget))


def _objective(student, run: Run, teacher: TeacherScorer, *args):
    return objective_loss(run.cfg, student, teacher, *args)


def _micro_batches(parts: list[StepPart], grad_accum: int) -> list[tuple[int, slice]]:
    """(part, rows) of every micro-batch of the step: each part split into ``grad_accum`` pieces."""
    out = []
    for i, p in enumerate(parts):
        N = p.mask_NT.shape[0]
        out += [(i, slice(start, start + N // grad_accum)) for start in range(0, N, N // grad_accum)]
    return out


def update_stage(run: Run, step: int, parts: list[StepPart]) -> list[StepUpdate]:
    """Objective loss over the micro-batches of every part, clipping, optimizer step(s); each part's
    by-products of the first update (the loss, gradient norm and lr are the step's, shared).

    With ``--updates-per-batch`` > 1 the later updates reuse the batch: the sampled-token loss
    corrects with importance ratios, the analytic losses (lsm, full_kl) need none but see states
    an older policy visited. Only the first update's loss is logged (the on-policy one).
    """
    cfg = run.cfg
    masks = [p.mask_NT for p in parts]
    totals = global_totals(run, masks, [p.task.cfg.max_new_tokens for p in parts])
    micro = _micro_batches(parts, cfg.grad_accum)
    scale = task_lr_scale(run, parts)
    first: list[StepUpdate] = []
    for update in range(cfg.updates_per_batch):
        run.optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        loss_rows: list[list[torch.Tensor]] = [[] for _ in parts]
        hidden_rows: list[list[torch.Tensor]] = [[] for _ in parts]
        for j, (i, rows) in enumerate(micro):
            p, mask_NT = parts[i], masks[i]
            old = p.batch.logprobs_NT[rows] if cfg.updates_per_batch > 1 else None
            ids_rows = None if p.student_ids is None else p.student_ids[rows]
            with run.dist.sync_gradients(j == len(micro) - 1):  # reduce across ranks once, after the last micro-batch
                args = (p.batch.select(rows), p.scores.select(rows), mask_NT[rows], ids_rows, old)
                loss_NT, h = run.dist.train_call(_objective, run, p.task.teacher, *args)
                loss = reduce_loss(cfg.reduction, loss_NT, mask_NT[rows], totals)
                loss.backward()
            loss_value += float(loss.detach())
            if update == 0:
                loss_rows[i].append(loss_NT.detach())
                hidden_rows[i].append(h.detach())
        loss_value = run.dist.all_sum([loss_value])[0] / run.dist.world  # see reduce_loss
        norm_t = torch.nn.utils.clip_grad_norm_(run.dist.module.parameters(), cfg.max_grad_norm or float("inf"))
        norm = float(norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t)  # FSDP: a DTensor
        check_finite(run, step, loss=loss_value, gradient_norm=norm)
        for group in run.optimizer.param_groups:  # the scheduler's next step resets it from the base lr
            group["lr"] *= scale
        run.optimizer.step()
        run.scheduler.step()
        if update == 0:
            clipped = bool(cfg.max_grad_norm and norm > cfg.max_grad_norm)
            first = [
                _first_update(p, torch.cat(ls), torch.cat(hs), loss_value, norm, clipped, cfg.log_rollouts)
                for p, ls, hs in zip(parts, loss_rows, hidden_rows, strict=True)
            ]
    for u in first:
        u.lr = cast(float, run.scheduler.get_last_lr()[0]) * scale  # our schedules' lrs are floats
    return first


def task_lr_scale(run: Run, parts: list[StepPart]) -> float:
    """The step's task lr over the run's (1 but for an alternate-mode step whose task sets its own lr)."""
    return parts[0].task.cfg.lr / run.cfg.lr if len(parts) == 1 else 1.0


def _first_update(p: StepPart, loss_NT, h_all, loss: float, norm: float, clipped: bool, log_rollouts: int):
    return StepUpdate(
        loss=loss,
        grad_norm=norm,
        clipped=clipped,
        lr=0.0,
        loss_NT=loss_NT,
        diag_hidden_MD=h_all.reshape(-1, h_all.shape[-1])[p.diag_M],
        log_hidden_LTD=h_all[:log_rollouts],
    )


def check_finite(run: Run, step: int, **values: float) -> None:
    """Stop before a non-finite loss or gradient reaches the weights; the last checkpoint stays."""
    for name, value in values.items():
        if not math.isfinite(value):
            raise UserError(
                f"the {name.replace('_', ' ')} became {value} at step {step}; training stopped before the update "
                f"and the last good checkpoint in {run.rundir.ckpt_root} is kept. Lower --lr, raise "
                "--warmup-steps, or check the teacher's outputs"
            )


STEP_KEYS = ("train/loss", "train/grad_norm", "train/clipped", "train/lr")  # the step's, never a part's


def part_metrics(run: Run, step: int, p: StepPart, upd: StepUpdate, W: torch.Tensor) -> tuple[dict, dict, list]:
    """One rank's metrics of one part, what each is a mean over, and (rank 0) its sample rollouts."""
    cfg, c = run.cfg, p.task.cfg
    mask_NT, scores = p.mask_NT, p.scores
    examples = [p.task.source.examples[i] for i in p.rows]
    texts, correct, episodes = p.task.source.grade(run.tokenizer, examples, p.batch, p.records)
    horizon = c.max_new_tokens
    format_ids = [i for i in run.special_ids if i != run.tokenizer.eos_token_id]
    stats = step_metrics(p.batch, correct, scores, upd, mask_NT, W, k=cfg.k, horizon=horizon, format_ids=format_ids)
    metrics = {**stats, **p.score_metrics, **episodes}
    weights = metric_weights(p.batch, mask_NT, upd.diag_hidden_MD.shape[0], horizon)
    if p.task.name:  # a task's own loss: the token mean of its per-token loss (the step's loss is global)
        metrics["train/loss"] = M.masked_mean(upd.loss_NT, mask_NT)
        weights["train/loss"] = int(mask_NT.sum())
    if not (cfg.log_rollouts and run.dist.is_main):
        return metrics, weights, []
    records = rollout_records(
        run.tokenizer, W, step, p.batch, examples, texts, correct, scores, upd, mask_NT, p.records
    )
    return metrics, weights, [{"task": p.task.name, **r} if p.task.name else r for r in records]


def log_stage(run: Run, step: int, parts: list[StepPart], upds: list[StepUpdate], timings: dict) -> dict:
    """Metrics of the whole step batch (ranks' and parts' records merged), each task's under its
    name in a multi-task run, and rank 0's sample rollouts."""

    def local(student):
        W = head_weight(student).detach()
        return [part_metrics(run, step, p, u, W) for p, u in zip(parts, upds, strict=True)]

    mine = run.dist.full_call(local)
    ranks = run.dist.gather([(m, w) for m, w, _ in mine])  # [rank][part] -> (metrics, weights)
    slowest = {k: max(t[k] for t in run.dist.gather(timings)) for k in timings}
    every = [mw for rank in ranks for mw in rank]
    record = {"step": step, **merge_metrics([m for m, _ in every], [w for _, w in every]), **slowest}
    record.update({k: getattr(upds[0], k.split("/")[1]) for k in STEP_KEYS})
    gaps = [p.task.engine.last_gap for p in parts if hasattr(p.task.engine, "last_gap")]
    if gaps:  # the vLLM engine's policy check, over the step's tasks: the largest of the ranks'
        record["rollout/engine_logprob_gap"] = max(run.dist.gather(max(gaps)))
    for i, p in enumerate(parts):
        if p.task.name:
            own = merge_metrics([r[i][0] for r in ranks], [r[i][1] for r in ranks])
            record.update(prefixed({k: v for k, v in own.items() if k not in STEP_KEYS[1:]}, p.task.name))
    run.rundir.log_metrics(record)
    rollouts = [r for _, _, recs in mine for r in recs]
    if rollouts:
        run.rundir.log_rollouts(rollouts)
    return record


def evaluate_task(student, tok, task: TaskRun, seed: int) -> dict:
    """One task's evaluation on its held-out prompts (accuracy, avg@k) or games (success rate)."""
    return task.test.evaluate(student, tok, task.cfg, seed)


def eval_stage(run: Run, step: int) -> dict:
    """Rank 0 evaluates every task (with FSDP, on weights all ranks gathered); the others wait for it.

    A multi-task run logs ``eval/<name>/...`` per task and, as ``eval/accuracy`` and
    ``eval/avg_at_k``, the unweighted mean over its tasks."""
    evaluate = lambda s: [evaluate_task(s, run.tokenizer, t, run.cfg.seed) for t in run.tasks]
    results = run.dist.full_call(lambda s: evaluate(s) if run.dist.is_main else None)
    run.student.train()
    if results is None:
        return {}
    record: dict = {"step": step}
    for t, res in zip(run.tasks, results, strict=True):
        if not (run.rundir.path / t.files / "eval.jsonl").is_file():  # listed once played (once)
            listed = cast(list[dict], t.test.listing(run.rundir.path / t.files, played=True))  # played: listed
            run.rundir.write_jsonl(f"{t.files}eval.jsonl", listed)
        record.update({(f"eval/{t.name}/{k}" if t.name else f"eval/{k}"): v for k, v in res.items()})
    if run.tasks[0].name:
        for key in ("accuracy", "avg_at_k"):
            if all(key in r for r in results):
                record[f"eval/{key}"] = sum(r[key] for r in results) / len(results)
    run.rundir.log_metrics(record)
    return record


def checkpoint_stage(run: Run, step: int, rng: dict | None = None) -> None:
    """Rank 0 writes; every rank takes part in gathering sharded weights and per-rank RNG states
    (``rng``: this rank's, when not the generators' state now)."""
    rngs = run.dist.gather(rng_state(run.dist.device) if rng is None else rng)
    state = {
        "step": step,
        "optimizer": run.dist.optimizer_state(run.optimizer),
        "scheduler": run.scheduler.state_dict(),
        "rng": rngs if run.dist.active else rngs[0],
        "fsdp": run.dist.fsdp,
        "config": config_record(run.cfg),
    }
    run.rundir.save_checkpoint(step, run.student, state, model_state=run.dist.full_state_dict(run.student))
    run.dist.barrier()


# ----------------------------------------------------------------------------- loop


def train_steps(run: Run, show_progress: bool) -> dict:
    """The steps from ``run.start_step`` on; the last evaluation's record."""
    cfg = run.cfg
    last_eval: dict = {}
    with run.rundir, progress_bar(f"OPD {cfg.objective}", total=cfg.steps, enabled=show_progress) as bar:
        bar.advance(run.start_step)
        for step in range(run.start_step, cfg.steps):
            t0, rng = time.perf_counter(), rng_state(run.dist.device)
            tasks = step_tasks(run, step)
            with stop_if_service_down(run, step, rng, EngineUnavailable, "the vLLM engine"):
                rollouts = [rollout_stage(run, step, at) for at in tasks]
            t1 = time.perf_counter()
            parts = [scored_part(run, step, rng, at.task, *r) for at, r in zip(tasks, rollouts, strict=True)]
            t2 = time.perf_counter()
            upds = update_stage(run, step, parts)
            t3 = time.perf_counter()
            timings = {"time/generate": t1 - t0, "time/score": t2 - t1, "time/update": t3 - t2, "time/step": t3 - t0}
            record = log_stage(run, step, parts, upds, timings)
            bar.advance(1)
            bar.describe(f"loss {record['train/loss']:.4f}  acc {record['rollout/accuracy']:.2f}")
            last = step == cfg.steps - 1
            if last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0):
                last_eval = eval_stage(run, step)
            if last or (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0):
                checkpoint_stage(run, step)
    return last_eval


def train(cfg: TrainConfig, show_progress: bool = True) -> dict:
    """Train; returns the last evaluation's record (a multi-task run: each task's under eval/<name>/)."""
    run = setup(cfg)
    try:
        last_eval = train_steps(run, show_progress)
    finally:
        for t in run.tasks:  # an environment's worker processes, a vLLM server
            t.source.close()
            t.test.close()
            getattr(t.engine, "close", lambda: None)()
    save_final_model(
        run.rundir.path / "final",
        run.student,
        run.tokenizer,
        run.rundir.enabled,
        model_state=run.dist.full_state_dict(run.student),
    )
    shutdown(run.dist)
    return last_eval

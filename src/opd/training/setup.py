"""What a run is built from (:func:`setup`): the student, each task's teacher, data and engine, the
optimizer, the run directory, and, resuming, the state of the checkpoint it resumes from.

The loop's stages (:mod:`opd.training.loop`) read everything from the :class:`Run` built here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from opd.config import TEACHER_SCORING, TaskSpec, TrainConfig, resolve_tasks
from opd.errors import UserError
from opd.models.loading import disable_dropout, head_weight, load_model, load_tokenizer, resolve_device
from opd.models.lora import apply_lora, load_weights
from opd.runs.rundir import RunDir
from opd.teachers.factory import is_served, make_teacher
from opd.teachers.scoring import TeacherScorer
from opd.training.ahead import AheadRollouts, split_threads
from opd.training.distributed import Dist, init_distributed
from opd.training.optim import make_optimizer, make_scheduler, set_rng_state
from opd.training.schedule import for_task, task_schedule
from opd.training.sources import Source, make_sources, task_data


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
    ahead: AheadRollouts | None = None  # --max-staleness > 0: the worker generating ahead of the trainer
    score_pool: ThreadPoolExecutor | None = (
        None  # and a served teacher: its scoring of the next step (loop.score_ahead)
    )


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
    engine = use_vllm(cfg, tasks, student, tok, rundir, dist, optimizer) if cfg.rollout_engine == "vllm" else None
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.steps * cfg.updates_per_batch, cfg.schedule)
    schedule = task_schedule(cfg.steps, [t.share for t in tasks], cfg.seed) if cfg.task_mode == "alternate" else []
    run = Run(cfg, student, tok, tasks, optimizer, scheduler, rundir, special_ids, dist, schedule=schedule)
    if cfg.max_staleness:
        run.ahead = start_ahead(cfg, engine)
        if any(is_served(t.teacher) for t in tasks):
            run.score_pool = ThreadPoolExecutor(1, thread_name_prefix="opd-score-ahead")
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


def use_vllm(cfg: TrainConfig, tasks: list[TaskRun], student, tok, rundir: RunDir, dist: Dist, optimizer):
    """``--rollout-engine vllm``: every task rolls out from one vLLM server that is given the student's
    weights (LoRA's wrapper included) after each optimizer step; under torchrun/accelerate, one server
    per rank (its own folder), as each rank rolls out its own share of the batch. With --max-staleness
    the rollout worker syncs and samples it instead (opd.training.ahead): the tasks keep their own engines."""
    from opd.rollout.vllm_engine import start_engine

    if dist.world > 1 and cfg.vllm_url:
        raise UserError(
            "--vllm-url names one engine, and each of the launch's ranks needs its own: leave --vllm-url out "
            "and opd starts one per rank, or run in one process"
        )
    folder = rundir.path / "vllm" / (f"rank{dist.rank}" if dist.world > 1 else "")
    key = os.environ.get("OPD_VLLM_API_KEY", "")
    engine = start_engine(student, tok, cfg.student, folder, cfg, [t.cfg for t in tasks], api_key=key)
    if cfg.max_staleness:
        return engine
    engine.watch(optimizer)
    for t in tasks:
        t.engine = t.source.on_vllm(engine, tok)
    return engine


def start_ahead(cfg: TrainConfig, vllm=None) -> AheadRollouts:
    """The rollout worker of --max-staleness (sampling from ``vllm``, the trainer's vLLM engine, if any) with
    --rollout-worker-threads, or with its share of the cores' torch threads (the rest are the trainer's)."""
    if cfg.rollout_worker_threads:
        return AheadRollouts(cfg, cfg.rollout_worker_threads, vllm)
    trainer, worker = split_threads(torch.get_num_threads())
    torch.set_num_threads(trainer)
    return AheadRollouts(cfg, worker, vllm)


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
    written = state.get("max_staleness", 0)
    if written != run.cfg.max_staleness:  # the rollouts in flight, and each step's policy, would change
        raise UserError(
            f"checkpoint {ckpt} was written with --max-staleness {written}, this run has {run.cfg.max_staleness}; "
            f"resume with --max-staleness {written} (a run's rollouts depend on it)"
        )
    if run.ahead is not None:
        run.ahead.load(state["ahead"])
    run.dist.load_optimizer_state(run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], run.dist.rank, run.dist.world, run.dist.device)
    run.start_step = state["step"] + 1
    run.rundir.truncate_logs_after(state["step"])

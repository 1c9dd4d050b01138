"""What a run is built from (:func:`setup`): the student, each task's teacher, data and engine, the
optimizer, the run directory, and, resuming, the state of the checkpoint it resumes from.

The loop's stages (:mod:`opd.training.loop`) read everything from the :class:`Run` built here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from opd.chat import set_chat_options, tool_call_marker_ids
from opd.config import TEACHER_SCORING, TaskSpec, TrainConfig, resolve_tasks
from opd.errors import UserError
from opd.evaluation.records import check_writable, step_records
from opd.hub import resolve_model
from opd.models.loading import (
    checkpoint_layers,
    disable_dropout,
    head_weight,
    load_model,
    load_tokenizer,
    resolve_device,
)
from opd.models.lora import apply_lora, load_weights
from opd.models.precision import compute_in, configure_device_math, trained_weights_dtype
from opd.rollout.engine import EngineContext, RolloutEngine
from opd.rollout.prompt_set import say_grading_notes
from opd.rollout.registry import check_engine, make_engine
from opd.runs.rundir import RunDir
from opd.service import check_url
from opd.teachers.crosstok import CrossTokenizerTeacher
from opd.teachers.factory import make_teacher
from opd.teachers.scoring import TeacherScorer
from opd.training.distributed import Dist, init_distributed
from opd.training.optim import make_optimizer, make_scheduler, set_rng_state
from opd.training.resuming import (
    check_optimizer_state,
    check_same_run,
    named_optimizer_state,
    rebatch,
    trained_parameters,
)
from opd.training.schedule import for_task, task_schedule
from opd.training.sources import PromptSource, Source, make_sources, task_data


@dataclass
class TaskRun:
    """One task of a run: its settings, teacher, rollout engine and data (a single-task run has one, named "")."""

    name: str  # prefixes its metrics and files; "" in a single-task run (no prefix anywhere)
    cfg: TrainConfig  # the run's config with this task's overrides (a single-task run: the run's own)
    share: float  # its normalised share of the steps (alternate) or of the batch (mix)
    teacher: TeacherScorer
    source: Source  # its training prompts, or an environment's games (--env)
    test: Source | None  # held out: what evaluation measures (--eval-task's test prompts, held-out games), or None
    # what rolls its source out: the run's engine (--rollout-engine), set by setup once the student is final
    engine: RolloutEngine = field(init=False)

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
    # resuming with --max-staleness: the checkpoint's rollouts in flight (every rank's; opd.training.ahead),
    # which the run's rollout producer (opd.training.producer) takes back
    in_flight: list[dict] | dict | None = None
    said: set[str] = field(default_factory=set)  # the notes a run gives once, given


def setup(cfg: TrainConfig) -> Run:
    torch.manual_seed(cfg.run.seed)
    device = resolve_device(cfg.model.device)
    configure_device_math(device, cfg.model.dtype, cfg.model.tf32, "opd train")
    dist = init_distributed(cfg.run.fsdp, device, cfg.model.dtype, cfg.run.dist_timeout)
    models = {
        "student": cfg.model.student,
        "teacher": cfg.teacher.teacher,
        "teacher-tokenizer": cfg.teacher.teacher_tokenizer,
    }
    rundir = RunDir(cfg.run.out, report_to=cfg.run.report_to, command="train", resume=cfg.run.resume, models=models)
    ckpt = rundir.latest_checkpoint() if cfg.run.resume else None
    state = rundir.load_state(ckpt) if ckpt is not None else None
    specs = resolve_tasks(cfg)
    if ckpt is not None and state is not None:  # before the models: what cannot resume shows at once
        check_same_run(state, cfg, ckpt, dist.world)
        cfg, specs = rebatch(cfg, specs, state, dist.world, ckpt)
    check_engine(cfg.rollout.rollout_engine)
    # before the models: a data problem shows at once
    data = [for_task(s.name, task_data, s.cfg) for s in specs]
    say_grading_notes("train", specs, data)
    student, tok = load_student(cfg, device, check=cfg.data.check_chat_template_kwargs)
    tasks = build_tasks(specs, data, student, tok)
    V = head_weight(student).shape[0]
    if cfg.objective.k > V:
        raise UserError(f"k={cfg.objective.k} is larger than the vocabulary ({V} tokens); choose --k <= {V}")
    special_ids = list(
        dict.fromkeys(special_token_ids(tok, cfg.objective.special_tokens) + tool_marker_ids(tok, tasks))
    )
    if not cfg.optimizer.keep_dropout:  # before LoRA, so --lora-dropout still applies to the adapter
        disable_dropout(student)
    if cfg.optimizer.gradient_checkpointing:
        checkpoint_layers(student)
    if cfg.lora.lora_r:
        student = apply_lora(
            student,
            cfg.lora.lora_r,
            cfg.lora.lora_alpha,
            cfg.lora.lora_targets,
            cfg.lora.lora_dropout,
            cfg.model.student,
            cfg.model.student_revision,
        )
    if ckpt is not None:
        load_weights(student, ckpt / "model")  # before wrapping: FSDP shards the weights it is given
    student.train()
    optimizer = make_optimizer(dist.wrap(student), cfg.optimizer.lr, cfg.optimizer.weight_decay)
    engine = start_engine(cfg, specs, student, tok, rundir, dist)
    for t in tasks:
        t.engine = engine
    scheduler = make_scheduler(
        optimizer,
        cfg.optimizer.warmup_steps,
        cfg.optimizer.steps * cfg.optimizer.updates_per_batch,
        cfg.optimizer.schedule,
    )
    schedule = (
        task_schedule(cfg.optimizer.steps, [t.share for t in tasks], cfg.run.seed)
        if cfg.multitask.task_mode == "alternate"
        else []
    )
    run = Run(cfg, student, tok, tasks, optimizer, scheduler, rundir, special_ids, dist, schedule=schedule)
    if ckpt is not None and state is not None:
        resume(run, ckpt, state)
    elif cfg.run.resume:  # killed before its first checkpoint: it starts over, so must its logs
        rundir.truncate_logs_after(-1)
    rundir.write_config(cfg)
    for t in tasks:  # an environment's games are listed once played (eval_stage)
        if t.test is not None and t.cfg.eval.eval_record_chars and rundir.enabled:
            check_writable(step_records(rundir.path / t.files, 0))  # before any step: a read-only place shows now
        listed = t.test.listing(rundir.path / t.files, played=False) if t.test is not None else None
        if listed is not None:
            rundir.write_jsonl(f"{t.files}eval.jsonl", listed)
    return run


def load_student(
    cfg: TrainConfig, device: torch.device, check: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The student as a run trains it (float32 masters, its body computing in --dtype) and its tokenizer
    with the chat options (``check``: refuse options its template ignores). The trainer's, and the
    --max-staleness worker's copy (opd.training.ahead), so a rollout there computes what the trainer would."""
    rev = cfg.model.student_revision
    tok = set_chat_options(
        load_tokenizer(cfg.model.student, "student", revision=rev), cfg.data.chat_template_kwargs, check=check
    )
    weights_dtype = trained_weights_dtype(cfg.model.dtype, bool(cfg.lora.lora_r))
    student = compute_in(load_model(cfg.model.student, "student", weights_dtype, device, revision=rev), cfg.model.dtype)
    return student, tok


def start_engine(
    cfg: TrainConfig, specs: list[TaskSpec[TrainConfig]], student, tok, rundir: RunDir, dist: Dist
) -> RolloutEngine:
    """``--rollout-engine``: the one engine every task rolls out from (:mod:`opd.rollout.registry`; opd's own
    sampling loop by default), on the student (LoRA's wrapper included); one with weights of its own is
    told after each update (the loop's update stage calls its ``weights_changed``). Under torchrun/accelerate
    each rank has its own (its files in a folder of its own), or reaches one that all share (``--vllm-url``),
    and rolls out its share of the batch. Under FSDP it is given the weights gathered for the rollout. With
    --max-staleness the rollout worker samples instead, reaching the engine (opd.training.ahead)."""
    folder = rundir.path / cfg.rollout.rollout_engine / (f"rank{dist.rank}" if dist.world > 1 else "")
    # an engine of its own (vLLM) reads the folder a Hub name resolved to: the same files as the trainer
    model_dir = str(resolve_model(cfg.model.student, cfg.model.student_revision))
    ctx = EngineContext(student, tok, cfg, model_dir, [s.cfg for s in specs], folder, dist.world)
    return make_engine(cfg.rollout.rollout_engine, ctx)


def _teacher_key(c: TrainConfig) -> tuple:
    """Where a task's teacher is and how it scores (:data:`opd.config.tasks.TEACHER_SCORING`): the
    same model read with another dtype or tokenizer setting scores differently, so is not shared. Served:
    the set of its servers (in any order, each as :func:`~opd.service.check_url` writes it), one pool."""
    flat = c.flat()
    urls = (
        c.teacher.teacher_url.split(",") if isinstance(c.teacher.teacher_url, str) else c.teacher.teacher_url
    )  # joined, once checked
    servers = sorted({check_url(u, "--teacher-url") for u in urls if u})
    where = (
        ("url", tuple(servers))
        if servers
        else ("dir", str(Path(c.teacher.teacher).resolve()), c.teacher.teacher_revision)
    )
    values = (
        c.model.dtype if f == "teacher_dtype" and not c.teacher.teacher_dtype else flat[f] for f in TEACHER_SCORING
    )
    return (*where, *(tuple(v) if isinstance(v, list) else v for v in values))


def build_tasks(specs: list[TaskSpec[TrainConfig]], data: list[tuple], student, tok) -> list[TaskRun]:
    """Each task's teacher and sources. A teacher that several tasks name (the
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
        if test is not None and test is not source:  # held-out prompts too: refused now, not at the first evaluation
            for_task(spec.name, test.check_model, student, c)
        teacher = teachers[key]
        if isinstance(teacher, CrossTokenizerTeacher) and isinstance(source, PromptSource):
            teacher.read_prompts(source.prompts)  # conversations and tools reach it whole
        out.append(TaskRun(spec.name, c, spec.share, teachers[key], source, test))
    return out


def tool_marker_ids(tok, tasks: list[TaskRun]) -> list[int]:
    """The template's tool-call markers, masked with the special tokens, when a task's prompts offer tools."""
    return tool_call_marker_ids(tok) if any(e.uses_tools for t in tasks for e in t.source.examples) else []


def special_token_ids(tok, tokens: list[str]) -> list[int]:
    ids = []
    for t in tokens:
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id:
            raise UserError(f"special token {t!r} is not in the student's vocabulary; fix --special-tokens")
        ids.append(tid)
    return ids


def resume(run: Run, ckpt: Path, state: dict) -> None:
    """Optimizer, schedule, RNG and step from ``ckpt``'s ``state`` (checked against the run by
    :func:`opd.training.resuming.check_same_run`; the weights were loaded before wrapping), written by any
    number of processes, with or without FSDP (:mod:`opd.training.resuming`)."""
    run.in_flight = state.get("ahead")  # --max-staleness: taken back by the producer (opd.training.producer)
    trained = trained_parameters(run.dist.module)
    optimizer_state = named_optimizer_state(state["optimizer"], list(trained))
    check_optimizer_state(optimizer_state, trained, ckpt)
    run.dist.load_optimizer_state(run.optimizer, optimizer_state)
    run.scheduler.load_state_dict(state["scheduler"])
    # another number of processes keeps the seeded generators: sampling and data order are drawn from seeds
    set_rng_state(state["rng"], run.dist.rank, run.dist.world, run.dist.device)
    run.start_step = state["step"] + 1
    run.rundir.truncate_logs_after(state["step"])

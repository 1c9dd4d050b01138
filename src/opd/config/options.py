"""Typed run configurations: one frozen dataclass per command, made of sections (:class:`Section`), validated
on construction, loadable from YAML/JSON, settable from the CLI.

Each option is a field of one section with its help text in ``metadata["help"]``; :mod:`opd.cli` turns every
option into a flat command-line flag, so a setting exists in exactly one place, and code reads it in its
section (``cfg.rollout.top_p``). Precedence, lowest first: the option's default, a ``--config`` file (YAML or
JSON, flat or nested by section), then options given on the command line. The resolved configuration is
written to ``config.json`` in every run directory, nested by section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opd.config.checkpoints import GAMES, GREEDY, MAJORITY, MODES, SAMPLED, parse_keep_best
from opd.config.engines import EngineOptions, check_engine_options, resolve_vllm
from opd.config.evaluation import EvalCommandOptions, SFTEvalOptions, TrainEvalOptions
from opd.config.fields import CommandConfig, check_report_to, opt, require, section
from opd.config.sft import SFTData, SFTEnv, SFTModel, SFTOptimizer, SFTRun, SFTTasks, SFTTeacher
from opd.config.sources import (
    DataOptions,
    EnvOptions,
    GenerationOptions,
    ModelOptions,
    RunOptions,
    check_trainable_dtype,
    out_option,
    resolve_data,
)
from opd.config.tasks import read_task_list, resolve_tasks
from opd.config.teachers import CrossTokenizerOptions, TeacherOptions, resolve_teacher
from opd.config.train import MAX_STALENESS, LoraOptions, TrainData, TrainOptimizer, TrainRollout, TrainRun, TrainTasks
from opd.objectives import CROSS_TOKENIZER_GIVES, REGISTRY, ObjectiveOptions, refusal, usable_with

__all__ = ["MAX_STALENESS", "EvalConfig", "SFTConfig", "TrainConfig", "check_cross_tokenizer"]


@dataclass(frozen=True)
class TrainConfig(CommandConfig):
    """On-policy distillation: the student samples, the teacher scores, the student moves toward it."""

    model: ModelOptions = section(ModelOptions)
    data: TrainData = section(TrainData)
    env: EnvOptions = section(EnvOptions)
    teacher: TeacherOptions = section(TeacherOptions)
    cross_tokenizer: CrossTokenizerOptions = section(CrossTokenizerOptions)
    objective: ObjectiveOptions = section(ObjectiveOptions)
    rollout: TrainRollout = section(TrainRollout)
    optimizer: TrainOptimizer = section(TrainOptimizer)
    eval: TrainEvalOptions = section(TrainEvalOptions)
    lora: LoraOptions = section(LoraOptions)
    multitask: TrainTasks = section(TrainTasks)
    run: TrainRun = section(TrainRun)

    @classmethod
    def resolve(cls, values: dict[str, Any]) -> dict[str, Any]:
        values = resolve_teacher(resolve_data(super().resolve(values)))
        if values["mask_special"] is None and values["objective"] in REGISTRY:  # else the objective's check refuses it
            values["mask_special"] = REGISTRY[values["objective"]].mask_special
        return _resolve_run(resolve_vllm(values, trains=True))

    def teacher_chat_options(self) -> dict[str, Any]:
        """The teacher's chat template options: its own, or the student's when unset."""
        if self.teacher.teacher_chat_template_kwargs is None:
            return self.data.chat_template_kwargs
        return self.teacher.teacher_chat_template_kwargs

    def __post_init__(self) -> None:
        self.check_resolved()
        check_trainable_dtype(self.model)  # before the sections' own checks: the likelier mistake
        self.check_sections()
        problem = self.objective.problem()  # the objective's options check themselves (opd.objectives)
        require(problem is None, str(problem))
        optimizer, rollout = self.optimizer, self.rollout
        rollouts = optimizer.batch_size * rollout.samples_per_prompt
        require(
            optimizer.grad_accum >= 1 and rollouts % optimizer.grad_accum == 0,
            f"grad_accum={optimizer.grad_accum} must divide batch_size*samples_per_prompt={rollouts}",
        )
        require(
            not (rollout.max_staleness and self.run.fsdp),
            "--max-staleness > 0 does not run with --fsdp yet (the worker is given whole weights): use DDP "
            "(torchrun without --fsdp) or --max-staleness 0",
        )
        check_engine_options(rollout, lora=bool(self.lora.lora_r), fsdp=self.run.fsdp, staleness=rollout.max_staleness)
        if self.cross_tokenizer.cross_tokenizer == "on":  # "auto" is decided, and checked, when the teachers load
            check_cross_tokenizer(self)
        _check_tasks(self)
        check_checkpoint_options(self)


def check_cross_tokenizer(cfg: TrainConfig) -> None:
    """Refuse what a teacher with another tokenizer cannot score (``--cross-tokenizer on``, or auto on detection).

    full_kl and the student-side supports need the teacher's log-probs of arbitrary student tokens,
    i.e. its whole distribution over the student's vocabulary, which has no counterpart for most
    tokens; teacher_topk_plus_sampled needs the teacher's log-prob of the student's token at a
    position inside a many-to-many group; an episode's environment turns would need re-rendering.
    """
    objective = cfg.objective
    why = refusal(objective, CROSS_TOKENIZER_GIVES, "a teacher with another tokenizer (cross_tokenizer) does not give")
    fix = f"use {usable_with(CROSS_TOKENIZER_GIVES)}, or a teacher with the student's tokenizer"
    require(why is None, f"{why}; {fix}")
    require(
        not objective.forward_kl_share,
        "forward_kl_share with a teacher of another tokenizer (cross_tokenizer) is not supported yet; drop it, "
        "or use a teacher with the student's tokenizer",
    )
    require(
        not cfg.env.env,
        "env: multi-turn episodes with a teacher of another tokenizer (cross_tokenizer) are not supported yet; "
        "use a teacher with the student's tokenizer",
    )


def check_checkpoint_options(cfg: TrainConfig) -> None:
    """The keep rules of a TrainConfig (its tasks resolved): a --keep-best the run can meet."""
    run = cfg.run
    require(not run.final_best or bool(run.keep_best), "final_best needs --keep-best METRIC (which checkpoint is best)")
    require(
        not (run.final_best and cfg.lora.lora_r),
        "final_best with --lora-r is not supported yet; drop --final-best and merge checkpoints/best's adapter "
        "with opd merge-lora",
    )
    if not run.keep_best:
        return
    metric, mode = parse_keep_best(run.keep_best)
    require(mode in MODES, f"keep_best={run.keep_best!r}: end it in :max or :min (or neither: max)")
    require(
        cfg.eval.eval,
        f"keep_best={run.keep_best!r} with evaluation off (--no-eval): the run never evaluates {metric}; "
        "drop one of them",
    )
    figures = evaluated_figures(cfg)
    require(
        metric in figures,
        f"keep_best={run.keep_best!r}: this run never evaluates {metric}; it logs {', '.join(sorted(figures))}",
    )


def evaluated_figures(cfg: TrainConfig) -> set[str]:
    """The ``eval/`` names a run's evaluations log (by its tasks, environments and --eval-samples); a
    multi-task run logs each task's under ``eval/<task>/`` and the means of accuracy and avg_at_k."""

    def own(c: TrainConfig) -> tuple[str, ...]:
        sampled = SAMPLED if c.eval.eval_samples > 0 else ()
        majority = MAJORITY if c.eval.maj_k > 0 and not c.env.env else ()
        return (*GREEDY, *sampled, *majority, *(GAMES if c.env.env else ()))

    specs = resolve_tasks(cfg)
    out = {f"eval/{s.name}/{f}" if s.name else f"eval/{f}" for s in specs for f in own(s.cfg)}
    if specs[0].name:
        out |= {f"eval/{f}" for f in ("accuracy", "avg_at_k") if all(f in own(s.cfg) for s in specs)}
    return out


def _check_tasks(cfg: TrainConfig | SFTConfig) -> None:
    """A multi-task run's task list, read from its file if given one, and every task's settings,
    checked here before any work."""
    require(
        cfg.multitask.task_mode in ("alternate", "mix"),
        f"task_mode={cfg.multitask.task_mode!r}: alternate (one task per step) or mix (every task at every step)",
    )
    if cfg.multitask.tasks is not None:
        resolve_tasks(cfg)


def _resolve_run(values: dict[str, Any]) -> dict[str, Any]:
    """What a training run's options (train and sft) hold resolved: the trackers' names normalised, and the
    task list read from its file (or from one mapping per --tasks option)."""
    values["report_to"] = check_report_to(values["report_to"])
    if values["tasks"] is not None:
        values["tasks"] = read_task_list(values["tasks"])
    return values


@dataclass(frozen=True)
class SFTConfig(CommandConfig):
    """Supervised fine-tuning on (prompt, solution) pairs: makes teachers/students, off-policy cold start."""

    model: SFTModel = section(SFTModel)
    data: SFTData = section(SFTData)
    env: SFTEnv = section(SFTEnv)
    teacher: SFTTeacher = section(SFTTeacher)
    rollout: GenerationOptions = section(GenerationOptions)
    optimizer: SFTOptimizer = section(SFTOptimizer)
    eval: SFTEvalOptions = section(SFTEvalOptions)
    multitask: SFTTasks = section(SFTTasks)
    run: SFTRun = section(SFTRun)

    @classmethod
    def resolve(cls, values: dict[str, Any]) -> dict[str, Any]:
        return _resolve_run(resolve_data(super().resolve(values)))

    def __post_init__(self) -> None:
        self.check_resolved()
        check_trainable_dtype(self.model)  # before the sections' own checks: the likelier mistake
        self.check_sections()
        env, tasks = self.env, self.multitask.tasks
        require(
            not env.expert_mistakes or bool(env.env) or bool(tasks),
            "expert_mistakes needs --env (it plays the environment's expert episodes with mistakes)",
        )
        require(
            not env.dagger_from or bool(env.env) or bool(tasks),
            "dagger_from needs --env (its models play the environment's training games)",
        )
        _check_tasks(self)


@dataclass(frozen=True)
class EvalModel(ModelOptions):
    """Section "model" of opd eval: the model, and a tokenizer saved apart from it."""

    tokenizer: str = opt(
        "",
        "Tokenizer directory (default: the --student directory), for a model whose tokenizer is saved apart "
        "(a SentencePiece-style tokenizer cannot live next to a Qwen2 config in transformers 5).",
    )


@dataclass(frozen=True)
class EvalRollout(EngineOptions):
    """Section "rollout" of opd eval: the engine, and how the samples are drawn."""

    temperature: float = opt(1.0, "Sampling temperature of the samples (--eval-sampling greedy or explicit).")
    top_p: float = opt(1.0, "Top-p of the samples (--eval-sampling greedy or explicit).")

    def check(self) -> None:
        super().check()
        require(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must lie in (0, 1]")
        require(
            self.temperature > 0,
            f"temperature={self.temperature} must be > 0 (greedy decoding: --eval-sampling greedy)",
        )


@dataclass(frozen=True)
class EvalRun(RunOptions):
    """Section "run" of opd eval."""

    out: str = out_option("eval")


@dataclass(frozen=True)
class EvalConfig(CommandConfig):
    """Accuracy, avg@k and pass@k of a model; gap recovery when the before/teacher accuracies are given."""

    model: EvalModel = section(EvalModel)
    data: DataOptions = section(DataOptions)
    env: EnvOptions = section(EnvOptions)
    rollout: EvalRollout = section(EvalRollout)
    eval: EvalCommandOptions = section(EvalCommandOptions)
    run: EvalRun = section(EvalRun)

    @classmethod
    def resolve(cls, values: dict[str, Any]) -> dict[str, Any]:
        return resolve_vllm(resolve_data(super().resolve(values)), trains=False)

    def __post_init__(self) -> None:
        self.check_resolved()
        self.check_sections()
        check_engine_options(self.rollout, trains=False)

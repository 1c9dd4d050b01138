"""The sections ``opd sft`` has with options of its own: the model it starts from or builds, its targets
(solutions, a teacher's samples, an environment's expert episodes), its optimizer, task list and run folder;
:class:`opd.config.options.SFTConfig` holds them with the shared ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opd.config.fields import REPORT_TO_HELP, Section, check_counts, opt, require
from opd.config.sources import (
    DataOptions,
    EnvOptions,
    ModelOptions,
    RunOptions,
    out_option,
    teacher_revision_option,
)
from opd.config.train import SCHEDULES


@dataclass(frozen=True)
class SFTModel(ModelOptions):
    """Section "model" of opd sft: the student, or the model it starts from, or a new one."""

    init: str = opt("", "Model to start from (a directory or a Hub name); empty with --arch builds a new model.")
    arch: str = opt("", "New tiny model 'qwen2:LAYERS:WIDTH' (e.g. qwen2:4:256) when --init is empty.")
    tokenizer: str = opt("", "Tokenizer directory for a new model (the demo trains one).")

    def check(self) -> None:
        super().check()
        require(
            bool(self.init) != bool(self.arch),
            "give exactly one of --init (a model directory) or --arch (qwen2:LAYERS:WIDTH)",
        )


@dataclass(frozen=True)
class SFTData(DataOptions):
    """Section "data" of opd sft: the shared options, and its own (prompt, solution) pairs."""

    data: str = opt(
        "",
        "JSONL with prompt and solution (or completion); empty: the task's own solutions.",
        per_task=True,
    )
    train_size: int = opt(
        0,
        "Train on only the first N examples (0: all); a small labelled set, as the demo's student.",
        per_task=True,
    )

    def check(self) -> None:
        super().check()
        require(self.train_size >= 0, f"train_size={self.train_size} must be >= 0 (0 uses every example)")


@dataclass(frozen=True)
class SFTEnv(EnvOptions):
    """Section "env" of opd sft: the games, and how the expert's episodes are made."""

    expert_mistakes: float = opt(
        0.0,
        "With --env: before each expert action, with this probability, play a command the game rejects first "
        "(not trained on), so the model learns to go on after a mistake (a game teacher for on-policy students).",
        per_task=True,
    )
    dagger_from: list[Any] = opt(
        [],
        "With --env: models that each play every training game once (sampling, top-p 0.9); the environment's "
        "expert labels the states they reached, and those sequences join the expert's episodes (DAgger's data, "
        "one round): a game teacher learns what to do after a student's own mistakes. Repeat for several.",
        per_task=True,
    )
    dagger_branches: int = opt(
        2,
        "With --dagger-from: sequences per played episode, each ending, at a turn where the player left the "
        "expert's path, with the expert's command from there.",
        per_task=True,
    )

    def check(self) -> None:
        super().check()
        require(0.0 <= self.expert_mistakes < 1.0, f"expert_mistakes={self.expert_mistakes} must be in [0, 1)")
        require(self.dagger_branches >= 1, f"dagger_branches={self.dagger_branches} must be >= 1")


@dataclass(frozen=True)
class SFTTeacher(Section):
    """Section "teacher" of opd sft: a model that samples the targets."""

    teacher: str = opt(
        "",
        "Sample the targets from this teacher model (off-policy cold start) instead of using solutions.",
        per_task=True,
    )
    teacher_revision: str = teacher_revision_option()


@dataclass(frozen=True)
class SFTOptimizer(Section):
    """Section "optimizer" of opd sft."""

    steps: int = opt(2000, "Optimizer steps.")
    batch_size: int = opt(64, "Examples per step.", per_task=True)
    lr: float = opt(1e-3, "Peak learning rate (AdamW).")
    warmup_steps: int = opt(100, "Linear warm-up steps.")
    schedule: str = opt("cosine", "Learning-rate schedule: constant, linear or cosine.")
    max_grad_norm: float = opt(1.0, "Gradient clipping norm.")
    gradient_checkpointing: bool = opt(
        False,
        "Activation checkpointing per decoder layer: each layer's activations are recomputed in the backward "
        "instead of kept, for long solutions or episodes (docs/training.md, 'Long responses'). The teacher "
        "that samples the targets is untouched.",
    )

    def check(self) -> None:
        check_counts(self, steps=1, batch_size=1, warmup_steps=0)
        require(self.lr > 0, f"lr={self.lr} must be > 0")
        require(self.schedule in SCHEDULES, f"schedule={self.schedule!r}: constant, linear or cosine")


@dataclass(frozen=True)
class SFTTasks(Section):
    """Section "multitask" of opd sft."""

    tasks: list[Any] | None = opt(
        None,
        "Several tasks in one SFT run (e.g. math solutions and a game's expert episodes), each with its own "
        "data or environment, train_size and batch_size (a list in the --config file, or a YAML/JSON file "
        "holding it; see opd.training.schedule). The kept model is the one with the best mean accuracy over tasks.",
    )
    task_mode: str = opt(
        "mix",
        "With tasks: mix (every step holds every task's batch, one token-mean loss over all) or alternate "
        "(each step trains on one task, chosen by share, seed and step).",
    )


@dataclass(frozen=True)
class SFTRun(RunOptions):
    """Section "run" of opd sft."""

    out: str = out_option("sft")
    report_to: list[Any] = opt(["none"], REPORT_TO_HELP)

"""The sections only ``opd train`` has, or has with options of its own: its data (``--long-prompts``), its
rollouts (samples, temperature, top-p, rollouts ahead), its optimizer, LoRA, its task list and its run folder;
:class:`opd.config.options.TrainConfig` holds them with the shared ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opd.config.checkpoints import CheckpointOptions
from opd.config.engines import EngineOptions
from opd.config.fields import REPORT_TO_HELP, Section, check_counts, opt, require
from opd.config.sources import DataOptions, RunOptions, out_option

# Rollouts run at most this many steps ahead of the trainer (--max-staleness): each step in flight holds a
# copy of the weights, and a policy older than this is no longer distillation from the student's own samples.
MAX_STALENESS = 4
# --dist-timeout's bound: torch accepted 1e12 s here and garbled 8e13 s (an overflowed timer); inf raised
MAX_DIST_TIMEOUT = 1e9
SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class TrainData(DataOptions):
    """Section "data" of opd train: the shared options, and what to do with a prompt that is too long."""

    long_prompts: str = opt(
        "skip",
        "Training prompts longer than --max-prompt-tokens: skip (left out, counted in data/prompts_skipped, "
        "one warning per task with the count and the longest) or error (the run stops before it starts).",
    )

    def check(self) -> None:
        super().check()
        require(self.long_prompts in ("skip", "error"), f"long_prompts={self.long_prompts!r}: skip or error")


@dataclass(frozen=True)
class TrainRollout(EngineOptions):
    """Section "rollout" of opd train: the engine, and how the student samples its rollouts."""

    samples_per_prompt: int = opt(1, "Rollouts per prompt.")
    temperature: float = opt(1.0, "Rollout sampling temperature.", per_task=True)
    top_p: float = opt(0.9, "Rollout nucleus (top-p) sampling, in (0, 1].", per_task=True)
    max_staleness: int = opt(
        0,
        "Rollouts generated ahead: step t's rollouts come from the policy of step t - S, generated in a "
        "worker process while the trainer scores and updates (0: on-policy in this process, as always). "
        f"At most {MAX_STALENESS}; with --rollout-engine vllm the worker syncs and samples the vLLM server.",
    )
    rollout_worker_threads: int = opt(
        0,
        "With --max-staleness > 0: the rollout worker's torch threads; the trainer then keeps its own "
        "(OMP_NUM_THREADS). 0: the cores' threads are split, half to the worker (benchmarks/bench_async.py "
        "measures the splits).",
    )

    def check(self) -> None:
        super().check()
        check_counts(self, samples_per_prompt=1)
        require(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must lie in (0, 1] (0.9 is the paper's setting)")
        require(self.temperature > 0, f"temperature={self.temperature} must be > 0")
        require(
            0 <= self.max_staleness <= MAX_STALENESS,
            f"max_staleness={self.max_staleness} must lie in [0, {MAX_STALENESS}] (0: on-policy; 1 overlaps "
            "the next step's generation with this step's scoring and update)",
        )
        require(self.rollout_worker_threads >= 0, f"rollout_worker_threads={self.rollout_worker_threads} must be >= 0")


@dataclass(frozen=True)
class TrainOptimizer(Section):
    """Section "optimizer" of opd train: steps, batches, the learning rate and the update's knobs."""

    steps: int = opt(200, "Number of rollout batches (training steps).")
    batch_size: int = opt(
        64,
        "Prompts per step and process (one rollout each unless samples_per_prompt > 1); "
        "N processes under torchrun/accelerate train on N x this per step; a --resume on another number of "
        "processes keeps the checkpoint's global batch (this is rescaled).",
        per_task=True,
    )
    grad_accum: int = opt(1, "Micro-batches per optimizer step; the batch is split evenly.")
    micro_batch_tokens: int = opt(
        0,
        "Micro-batches by token budget instead of --grad-accum: the step's sequences (long and short responses "
        "together, longest first) packed so each micro-batch's rows x its longest sequence (prompt and response "
        "tokens) stays within N; a longer sequence goes alone. The step's loss and gradient are the unsplit "
        "step's. 0: off. Not with --grad-accum > 1.",
    )
    gradient_checkpointing: bool = opt(
        False,
        "Activation checkpointing per decoder layer in the student's update: each layer's activations are "
        "recomputed in the backward instead of kept, for long responses (docs/training.md, 'Long responses'). "
        "The rollout and the teacher are untouched.",
    )
    updates_per_batch: int = opt(
        1,
        "Optimizer steps per rollout batch. > 1 reuses the batch: sampled corrects with "
        "PPO-clipped importance ratios; lsm and full_kl are computed exactly at each "
        "visited state and need no ratio, but those states then come from an older "
        "policy (mildly off-policy). Only the first update's loss is logged.",
    )
    clip_eps: float = opt(0.2, "PPO clip for the importance ratio when updates_per_batch > 1.")
    stale_weight_cap: float = opt(
        2.0,
        "With --max-staleness > 0 and --objective sampled: the cap C of the truncated importance weight "
        "min(pi/mu, C) against the older policy mu that sampled (inf: no truncation).",
    )
    lr: float = opt(5e-4, "Peak learning rate (AdamW).", per_task=True)
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    warmup_steps: int = opt(10, "Linear warm-up steps.")
    schedule: str = opt("constant", "Learning-rate schedule after warm-up: constant, linear or cosine.")
    max_grad_norm: float = opt(1.0, "Gradient clipping norm (0 disables).")
    keep_dropout: bool = opt(
        False,
        "Keep the student's dropout during OPD. Off by default, as RL and distillation "
        "trainers do: with dropout on, rollouts, loss and diagnostics each see a different "
        "random network. --lora-dropout is not affected.",
    )

    def check(self) -> None:
        check_counts(self, steps=1, batch_size=1, updates_per_batch=1, warmup_steps=0)
        require(self.micro_batch_tokens >= 0, f"micro_batch_tokens={self.micro_batch_tokens} must be >= 1 (0: off)")
        require(
            not (self.micro_batch_tokens and self.grad_accum > 1),
            f"micro_batch_tokens={self.micro_batch_tokens} and grad_accum={self.grad_accum} both split the step; "
            "keep one (--grad-accum 1 with a token budget)",
        )
        require(self.lr > 0, f"lr={self.lr} must be > 0")
        require(self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0 (0: none)")
        require(self.clip_eps > 0, f"clip_eps={self.clip_eps} must be > 0 (0.2 is PPO's usual clip)")
        require(self.schedule in SCHEDULES, f"schedule={self.schedule!r}: constant, linear or cosine")
        require(self.max_grad_norm >= 0, f"max_grad_norm={self.max_grad_norm} must be >= 0 (0 disables clipping)")
        require(self.stale_weight_cap >= 1, f"stale_weight_cap={self.stale_weight_cap} must be >= 1 (2 is usual)")


@dataclass(frozen=True)
class LoraOptions(Section):
    """Section "lora": a peft LoRA adapter trained instead of every weight."""

    lora_r: int = opt(0, "LoRA rank: > 0 trains a peft LoRA adapter on the student instead of all its weights.")
    lora_alpha: float = opt(16.0, "LoRA scaling alpha (the update is scaled by alpha / r).")
    lora_targets: list[Any] = opt(
        ["all-linear"],
        "Linear layers given a LoRA adapter, by name, comma-separated "
        "(e.g. q_proj,v_proj); all-linear: every linear layer of the blocks.",
    )
    lora_dropout: float = opt(0.0, "Dropout on the LoRA branch's input.")

    def check(self) -> None:
        require(self.lora_r >= 0, f"lora_r={self.lora_r} must be >= 0 (0 trains every weight)")
        require(
            self.lora_alpha > 0 and 0.0 <= self.lora_dropout < 1.0, "lora_alpha must be > 0 and lora_dropout in [0, 1)"
        )
        require(
            bool(self.lora_targets), "lora_targets is empty; name linear layers (e.g. q_proj v_proj) or use all-linear"
        )


@dataclass(frozen=True)
class TrainTasks(Section):
    """Section "multitask" of opd train: several tasks in one run (opd.training.schedule)."""

    tasks: list[Any] | None = opt(
        None,
        "Multi-task OPD: the run's tasks, each with its own teacher, data or environment and settings "
        "(a list in the --config file, or a YAML/JSON file holding it); see opd.training.schedule. Unset: one "
        "task, given by the options above.",
    )
    task_mode: str = opt(
        "alternate",
        "With tasks: alternate (each step trains on one task, chosen by share, seed and step) or mix "
        "(every step holds every task's sub-batch, each scored by its own teacher, one optimizer step).",
    )


@dataclass(frozen=True)
class TrainRun(RunOptions, CheckpointOptions):
    """Section "run" of opd train: its folder, logging, checkpoints and processes."""

    out: str = out_option("train")
    ckpt_every: int = opt(50, "Checkpoint every N steps.")
    log_rollouts: int = opt(4, "Rollouts per step written to rollouts.jsonl.")
    report_to: list[Any] = opt(["none"], REPORT_TO_HELP)
    diag_positions: int = opt(256, "Positions sampled per step for the full-vocabulary diagnostics.")
    resume: bool = opt(False, "Resume from the latest checkpoint in the run directory.")
    fsdp: bool = opt(
        False,
        "Shard the student with FSDP across the launched processes (torchrun/accelerate) instead of DDP.",
    )
    dist_timeout: float = opt(
        1800.0,
        "Seconds a rank waits for the others at a collective (the process group's timeout) before the run fails "
        "(torchrun/accelerate). Default 30 minutes, for nccl and gloo alike (torch's own: 10 and 30); at most 1e9.",
    )

    def check(self) -> None:
        check_counts(self, ckpt_every=0, log_rollouts=0, diag_positions=0)
        require(
            0 < self.dist_timeout <= MAX_DIST_TIMEOUT,  # NaN and inf fail too: torch's timedelta cannot hold them
            f"dist_timeout={self.dist_timeout} must be > 0 and at most {MAX_DIST_TIMEOUT:.0e} seconds (about 31 "
            "years: a larger wait overflows torch's process-group timers)",
        )
        require(self.keep_checkpoints >= 1, f"keep_checkpoints={self.keep_checkpoints} must be >= 1 (resume needs one)")

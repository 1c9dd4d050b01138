"""Typed run configurations: validated on construction, loadable from YAML/JSON, settable from the CLI.

Each field carries its help text in ``metadata["help"]``; :mod:`opd.cli` turns every field into a
command-line option, so a setting exists in exactly one place. Precedence, lowest first: the
dataclass default, a ``--config`` file (YAML or JSON), then options given on the command line.
The resolved configuration is written to ``config.json`` in every run directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opd.config.checkpoints import CheckpointOptions, check_checkpoint_options
from opd.config.engines import EngineOptions, check_engine_options, resolve_vllm
from opd.config.evaluation import EvalOptions, TrainEvalOptions, check_eval_options
from opd.config.fields import REPORT_TO_HELP, check_report_to, opt, require
from opd.config.sources import EnvSource, ModelSource, TrainingSource, check_eval_schedule, out_option
from opd.config.tasks import read_task_list, resolve_tasks
from opd.config.teachers import (
    TeacherOptions,
    check_cross_tokenizer_options,
    check_teacher_options,
    resolve_teacher,
)
from opd.objectives import (
    CROSS_TOKENIZER_GIVES,
    REGISTRY,
    ObjectiveOptions,
    refusal,
    usable_with,
)

# Rollouts run at most this many steps ahead of the trainer (--max-staleness): each step in flight holds a
# copy of the weights, and a policy older than this is no longer distillation from the student's own samples.
MAX_STALENESS = 4
# --dist-timeout's bound: torch accepted 1e12 s here and garbled 8e13 s (an overflowed timer); inf raised
MAX_DIST_TIMEOUT = 1e9


@dataclass(frozen=True)
class TrainConfig(
    EnvSource, TrainingSource, EngineOptions, CheckpointOptions, TrainEvalOptions, TeacherOptions, ObjectiveOptions
):
    """On-policy distillation: the student samples, the teacher scores, the student moves toward it."""

    out: str = out_option("train")

    long_prompts: str = opt(
        "skip",
        "Training prompts longer than --max-prompt-tokens: skip (left out, counted in data/prompts_skipped, "
        "one warning per task with the count and the longest) or error (the run stops before it starts).",
        section="data",
    )
    steps: int = opt(200, "Number of rollout batches (training steps).", section="optimizer")
    batch_size: int = opt(
        64,
        "Prompts per step and process (one rollout each unless samples_per_prompt > 1); "
        "N processes under torchrun/accelerate train on N x this per step; a --resume on another number of "
        "processes keeps the checkpoint's global batch (this is rescaled).",
        section="optimizer",
        per_task=True,
    )
    samples_per_prompt: int = opt(1, "Rollouts per prompt.", section="rollout")
    grad_accum: int = opt(1, "Micro-batches per optimizer step; the batch is split evenly.", section="optimizer")
    micro_batch_tokens: int = opt(
        0,
        "Micro-batches by token budget instead of --grad-accum: the step's sequences (long and short responses "
        "together, longest first) packed so each micro-batch's rows x its longest sequence (prompt and response "
        "tokens) stays within N; a longer sequence goes alone. The step's loss and gradient are the unsplit "
        "step's. 0: off. Not with --grad-accum > 1.",
        section="optimizer",
    )
    gradient_checkpointing: bool = opt(
        False,
        "Activation checkpointing per decoder layer in the student's update: each layer's activations are "
        "recomputed in the backward instead of kept, for long responses (docs/training.md, 'Long responses'). "
        "The rollout and the teacher are untouched.",
        section="optimizer",
    )
    updates_per_batch: int = opt(
        1,
        "Optimizer steps per rollout batch. > 1 reuses the batch: sampled corrects with "
        "PPO-clipped importance ratios; lsm and full_kl are computed exactly at each "
        "visited state and need no ratio, but those states then come from an older "
        "policy (mildly off-policy). Only the first update's loss is logged.",
        section="optimizer",
    )
    clip_eps: float = opt(0.2, "PPO clip for the importance ratio when updates_per_batch > 1.", section="optimizer")
    stale_weight_cap: float = opt(
        2.0,
        "With --max-staleness > 0 and --objective sampled: the cap C of the truncated importance weight "
        "min(pi/mu, C) against the older policy mu that sampled (inf: no truncation).",
        section="optimizer",
    )
    lr: float = opt(5e-4, "Peak learning rate (AdamW).", section="optimizer", per_task=True)
    weight_decay: float = opt(0.0, "AdamW weight decay.", section="optimizer")
    warmup_steps: int = opt(10, "Linear warm-up steps.", section="optimizer")
    schedule: str = opt(
        "constant", "Learning-rate schedule after warm-up: constant, linear or cosine.", section="optimizer"
    )
    max_grad_norm: float = opt(1.0, "Gradient clipping norm (0 disables).", section="optimizer")
    temperature: float = opt(1.0, "Rollout sampling temperature.", section="rollout", per_task=True)
    top_p: float = opt(0.9, "Rollout nucleus (top-p) sampling, in (0, 1].", section="rollout", per_task=True)
    keep_dropout: bool = opt(
        False,
        "Keep the student's dropout during OPD. Off by default, as RL and distillation "
        "trainers do: with dropout on, rollouts, loss and diagnostics each see a different "
        "random network. --lora-dropout is not affected.",
        section="optimizer",
    )
    eval_every: int = opt(50, "Evaluate every N steps (0: only at the end).", section="eval")
    eval_size: int = opt(200, "Number of test prompts for evaluation.", section="eval", per_task=True)
    eval_samples: int = opt(
        4, "Samples per prompt for avg@k / pass@k at evaluation (0: greedy only).", section="eval", per_task=True
    )
    ckpt_every: int = opt(50, "Checkpoint every N steps.", section="run")
    log_rollouts: int = opt(4, "Rollouts per step written to rollouts.jsonl.", section="run")
    report_to: list[Any] = opt(["none"], REPORT_TO_HELP, section="run")
    diag_positions: int = opt(256, "Positions sampled per step for the full-vocabulary diagnostics.", section="run")
    resume: bool = opt(False, "Resume from the latest checkpoint in the run directory.", section="run")
    max_staleness: int = opt(
        0,
        "Rollouts generated ahead: step t's rollouts come from the policy of step t - S, generated in a "
        "worker process while the trainer scores and updates (0: on-policy in this process, as always). "
        f"At most {MAX_STALENESS}; with --rollout-engine vllm the worker syncs and samples the vLLM server.",
        section="rollout",
    )
    rollout_worker_threads: int = opt(
        0,
        "With --max-staleness > 0: the rollout worker's torch threads; the trainer then keeps its own "
        "(OMP_NUM_THREADS). 0: the cores' threads are split, half to the worker (benchmarks/bench_async.py "
        "measures the splits).",
        section="rollout",
    )
    fsdp: bool = opt(
        False,
        "Shard the student with FSDP across the launched processes (torchrun/accelerate) instead of DDP.",
        section="run",
    )
    dist_timeout: float = opt(
        1800.0,
        "Seconds a rank waits for the others at a collective (the process group's timeout) before the run fails "
        "(torchrun/accelerate). Default 30 minutes, for nccl and gloo alike (torch's own: 10 and 30); at most 1e9.",
        section="run",
    )
    lora_r: int = opt(
        0, "LoRA rank: > 0 trains a peft LoRA adapter on the student instead of all its weights.", section="lora"
    )
    lora_alpha: float = opt(16.0, "LoRA scaling alpha (the update is scaled by alpha / r).", section="lora")
    lora_targets: list[Any] = opt(
        ["all-linear"],
        "Linear layers given a LoRA adapter, by name, comma-separated "
        "(e.g. q_proj,v_proj); all-linear: every linear layer of the blocks.",
        section="lora",
    )
    lora_dropout: float = opt(0.0, "Dropout on the LoRA branch's input.", section="lora")
    tasks: list[Any] | None = opt(
        None,
        "Multi-task OPD: the run's tasks, each with its own teacher, data or environment and settings "
        "(a list in the --config file, or a YAML/JSON file holding it); see opd.training.schedule. Unset: one "
        "task, given by the options above.",
        section="multitask",
    )
    task_mode: str = opt(
        "alternate",
        "With tasks: alternate (each step trains on one task, chosen by share, seed and step) or mix "
        "(every step holds every task's sub-batch, each scored by its own teacher, one optimizer step).",
        section="multitask",
    )

    @classmethod
    def resolve(cls, values: dict[str, Any]) -> dict[str, Any]:
        values = super().resolve(values)
        values = resolve_teacher(values)
        if values["mask_special"] is None and values["objective"] in REGISTRY:  # else _check_objective refuses it
            values["mask_special"] = REGISTRY[values["objective"]].mask_special
        return _resolve_run(resolve_vllm(values, trains=True))

    def teacher_chat_options(self) -> dict[str, Any]:
        """The teacher's chat template options: its own, or the student's when unset."""
        if self.teacher_chat_template_kwargs is None:
            return self.chat_template_kwargs
        return self.teacher_chat_template_kwargs

    def __post_init__(self) -> None:
        self.check_resolved()
        self._check_common()
        self._check_env()
        for check in (
            _check_objective,
            _check_optimizer,
            _check_rollout,
            check_teacher_options,
            _check_cross_tokenizer_options,
        ):
            check(self)
        _check_counts(self, eval_every=0, eval_size=1, eval_samples=0, ckpt_every=0, log_rollouts=0, diag_positions=0)
        check_eval_options(self, self.eval_samples, "--eval-samples")
        check_eval_schedule(self, self.eval_every)
        require(
            0 < self.dist_timeout <= MAX_DIST_TIMEOUT,  # NaN and inf fail too: torch's timedelta cannot hold them
            f"dist_timeout={self.dist_timeout} must be > 0 and at most {MAX_DIST_TIMEOUT:.0e} seconds (about 31 "
            "years: a larger wait overflows torch's process-group timers)",
        )
        _check_lora(self)
        _check_tasks(self)
        check_checkpoint_options(self)


# One check per section of TrainConfig (opd.config.sections), each naming the option and the fix.


def _check_objective(cfg: TrainConfig) -> None:
    problem = cfg.problem()  # the objective's options check themselves (opd.objectives.ObjectiveOptions)
    require(problem is None, str(problem))


def _check_optimizer(cfg: TrainConfig) -> None:
    _check_counts(cfg, steps=1, batch_size=1, samples_per_prompt=1)
    require(
        cfg.grad_accum >= 1 and (cfg.batch_size * cfg.samples_per_prompt) % cfg.grad_accum == 0,
        f"grad_accum={cfg.grad_accum} must divide batch_size*samples_per_prompt={cfg.batch_size * cfg.samples_per_prompt}",
    )
    _check_counts(cfg, updates_per_batch=1, warmup_steps=0)
    require(cfg.micro_batch_tokens >= 0, f"micro_batch_tokens={cfg.micro_batch_tokens} must be >= 1 (0: off)")
    require(
        not (cfg.micro_batch_tokens and cfg.grad_accum > 1),
        f"micro_batch_tokens={cfg.micro_batch_tokens} and grad_accum={cfg.grad_accum} both split the step; "
        "keep one (--grad-accum 1 with a token budget)",
    )
    require(cfg.lr > 0, f"lr={cfg.lr} must be > 0")
    require(cfg.weight_decay >= 0, f"weight_decay={cfg.weight_decay} must be >= 0 (0: none)")
    require(cfg.clip_eps > 0, f"clip_eps={cfg.clip_eps} must be > 0 (0.2 is PPO's usual clip)")
    require(cfg.schedule in ("constant", "linear", "cosine"), f"schedule={cfg.schedule!r}: constant, linear or cosine")
    require(cfg.max_grad_norm >= 0, f"max_grad_norm={cfg.max_grad_norm} must be >= 0 (0 disables clipping)")


def _check_rollout(cfg: TrainConfig) -> None:
    require(cfg.long_prompts in ("skip", "error"), f"long_prompts={cfg.long_prompts!r}: skip or error")
    require(0.0 < cfg.top_p <= 1.0, f"top_p={cfg.top_p} must lie in (0, 1] (0.9 is the paper's setting)")
    _check_staleness(cfg)
    require(cfg.temperature > 0, f"temperature={cfg.temperature} must be > 0")
    check_engine_options(cfg, lora=bool(cfg.lora_r), fsdp=cfg.fsdp, staleness=cfg.max_staleness)


def _check_staleness(cfg: TrainConfig) -> None:
    require(
        0 <= cfg.max_staleness <= MAX_STALENESS,
        f"max_staleness={cfg.max_staleness} must lie in [0, {MAX_STALENESS}] (0: on-policy; 1 overlaps "
        "the next step's generation with this step's scoring and update)",
    )
    require(cfg.rollout_worker_threads >= 0, f"rollout_worker_threads={cfg.rollout_worker_threads} must be >= 0")
    require(cfg.stale_weight_cap >= 1, f"stale_weight_cap={cfg.stale_weight_cap} must be >= 1 (2 is usual)")
    if not cfg.max_staleness:
        return
    require(
        not cfg.fsdp,
        "--max-staleness > 0 does not run with --fsdp yet (the worker is given whole weights): use DDP "
        "(torchrun without --fsdp) or --max-staleness 0",
    )


def _check_cross_tokenizer_options(cfg: TrainConfig) -> None:
    check_cross_tokenizer_options(cfg)
    if cfg.cross_tokenizer == "on":  # "auto" is decided, and checked, when the teachers load (teachers.factory)
        check_cross_tokenizer(cfg)


def _check_lora(cfg: TrainConfig) -> None:
    require(cfg.lora_r >= 0, f"lora_r={cfg.lora_r} must be >= 0 (0 trains every weight)")
    require(cfg.lora_alpha > 0 and 0.0 <= cfg.lora_dropout < 1.0, "lora_alpha must be > 0 and lora_dropout in [0, 1)")
    require(bool(cfg.lora_targets), "lora_targets is empty; name linear layers (e.g. q_proj v_proj) or use all-linear")


def _check_counts(cfg: object, **least: int) -> None:
    """Each named count is at least its bound: a negative one would otherwise slice its list from the end
    (``eval_size=-3`` evaluating all but three prompts) or divide by zero, instead of failing."""
    for name, bound in least.items():
        value = getattr(cfg, name)
        require(value >= bound, f"{name}={value} must be >= {bound}; set --{name.replace('_', '-')} to {bound} or more")


def check_cross_tokenizer(cfg: TrainConfig) -> None:
    """Refuse what a teacher with another tokenizer cannot score (``--cross-tokenizer on``, or auto on detection).

    full_kl and the student-side supports need the teacher's log-probs of arbitrary student tokens,
    i.e. its whole distribution over the student's vocabulary, which has no counterpart for most
    tokens; teacher_topk_plus_sampled needs the teacher's log-prob of the student's token at a
    position inside a many-to-many group; an episode's environment turns would need re-rendering.
    """
    why = refusal(cfg, CROSS_TOKENIZER_GIVES, "a teacher with another tokenizer (cross_tokenizer) does not give")
    fix = f"use {usable_with(CROSS_TOKENIZER_GIVES)}, or a teacher with the student's tokenizer"
    require(why is None, f"{why}; {fix}")
    require(
        not cfg.forward_kl_share,
        "forward_kl_share with a teacher of another tokenizer (cross_tokenizer) is not supported yet; drop it, "
        "or use a teacher with the student's tokenizer",
    )
    require(
        not cfg.env,
        "env: multi-turn episodes with a teacher of another tokenizer (cross_tokenizer) are not supported yet; "
        "use a teacher with the student's tokenizer",
    )


def _check_tasks(cfg: TrainConfig | SFTConfig) -> None:
    """A multi-task run's task list, read from its file if given one, and every task's settings,
    checked here before any work."""
    require(
        cfg.task_mode in ("alternate", "mix"),
        f"task_mode={cfg.task_mode!r}: alternate (one task per step) or mix (every task at every step)",
    )
    if cfg.tasks is not None:
        resolve_tasks(cfg)


def _resolve_run(values: dict[str, Any]) -> dict[str, Any]:
    """What a training run's options (train and sft) hold resolved: the trackers' names normalised, and the
    task list read from its file (or from one mapping per --tasks option)."""
    values["report_to"] = check_report_to(values["report_to"])
    if values["tasks"] is not None:
        values["tasks"] = read_task_list(values["tasks"])
    return values


@dataclass(frozen=True)
class SFTConfig(EnvSource, TrainingSource):
    """Supervised fine-tuning on (prompt, solution) pairs: makes teachers/students, off-policy cold start."""

    out: str = out_option("sft")

    data: str = opt(
        "",
        "JSONL with prompt and solution (or completion); empty: the task's own solutions.",
        section="data",
        per_task=True,
    )
    init: str = opt(
        "", "Model to start from (a directory or a Hub name); empty with --arch builds a new model.", section="model"
    )
    arch: str = opt("", "New tiny model 'qwen2:LAYERS:WIDTH' (e.g. qwen2:4:256) when --init is empty.", section="model")
    tokenizer: str = opt("", "Tokenizer directory for a new model (the demo trains one).", section="model")
    teacher: str = opt(
        "",
        "Sample the targets from this teacher model (off-policy cold start) instead of using solutions.",
        section="teacher",
        per_task=True,
    )
    train_size: int = opt(
        0,
        "Train on only the first N examples (0: all); a small labelled set, as the demo's student.",
        section="data",
        per_task=True,
    )
    expert_mistakes: float = opt(
        0.0,
        "With --env: before each expert action, with this probability, play a command the game rejects first "
        "(not trained on), so the model learns to go on after a mistake (a game teacher for on-policy students).",
        section="env",
        per_task=True,
    )
    dagger_from: list[Any] = opt(
        [],
        "With --env: models that each play every training game once (sampling, top-p 0.9); the environment's "
        "expert labels the states they reached, and those sequences join the expert's episodes (DAgger's data, "
        "one round): a game teacher learns what to do after a student's own mistakes. Repeat for several.",
        section="env",
        per_task=True,
    )
    dagger_branches: int = opt(
        2,
        "With --dagger-from: sequences per played episode, each ending, at a turn where the player left the "
        "expert's path, with the expert's command from there.",
        section="env",
        per_task=True,
    )
    steps: int = opt(2000, "Optimizer steps.", section="optimizer")
    batch_size: int = opt(64, "Examples per step.", section="optimizer", per_task=True)
    lr: float = opt(1e-3, "Peak learning rate (AdamW).", section="optimizer")
    warmup_steps: int = opt(100, "Linear warm-up steps.", section="optimizer")
    schedule: str = opt("cosine", "Learning-rate schedule: constant, linear or cosine.", section="optimizer")
    eval_every: int = opt(250, "Evaluate greedy accuracy every N steps (0: only at the end).", section="eval")
    eval_size: int = opt(200, "Test prompts for evaluation.", section="eval", per_task=True)
    patience: int = opt(0, "Stop after this many evaluations without improvement (0: never).", section="eval")
    validation_size: int = opt(
        200,
        "Training examples (or games) held out of training, the last ones: the kept checkpoint is the best on "
        "them, and the test set only reports the kept model's accuracy (0: choose on the test set).",
        section="eval",
    )
    max_grad_norm: float = opt(1.0, "Gradient clipping norm.", section="optimizer")
    gradient_checkpointing: bool = opt(
        False,
        "Activation checkpointing per decoder layer: each layer's activations are recomputed in the backward "
        "instead of kept, for long solutions or episodes (docs/training.md, 'Long responses'). The teacher "
        "that samples the targets is untouched.",
        section="optimizer",
    )
    report_to: list[Any] = opt(["none"], REPORT_TO_HELP, section="run")
    tasks: list[Any] | None = opt(
        None,
        "Several tasks in one SFT run (e.g. math solutions and a game's expert episodes), each with its own "
        "data or environment, train_size and batch_size (a list in the --config file, or a YAML/JSON file "
        "holding it; see opd.training.schedule). The kept model is the one with the best mean accuracy over tasks.",
        section="multitask",
    )
    task_mode: str = opt(
        "mix",
        "With tasks: mix (every step holds every task's batch, one token-mean loss over all) or alternate "
        "(each step trains on one task, chosen by share, seed and step).",
        section="multitask",
    )

    @classmethod
    def resolve(cls, values: dict[str, Any]) -> dict[str, Any]:
        return _resolve_run(super().resolve(values))

    def __post_init__(self) -> None:
        self.check_resolved()
        self._check_common()
        self._check_env()
        _check_counts(
            self, steps=1, batch_size=1, warmup_steps=0, eval_every=0, eval_size=1, patience=0, validation_size=0
        )
        check_eval_schedule(self, self.eval_every)
        require(self.lr > 0, f"lr={self.lr} must be > 0")
        require(self.train_size >= 0, f"train_size={self.train_size} must be >= 0 (0 uses every example)")
        require(0.0 <= self.expert_mistakes < 1.0, f"expert_mistakes={self.expert_mistakes} must be in [0, 1)")
        require(
            not self.expert_mistakes or bool(self.env) or bool(self.tasks),
            "expert_mistakes needs --env (it plays the environment's expert episodes with mistakes)",
        )
        require(
            not self.dagger_from or bool(self.env) or bool(self.tasks),
            "dagger_from needs --env (its models play the environment's training games)",
        )
        require(self.dagger_branches >= 1, f"dagger_branches={self.dagger_branches} must be >= 1")
        require(
            bool(self.init) != bool(self.arch),
            "give exactly one of --init (a model directory) or --arch (qwen2:LAYERS:WIDTH)",
        )
        require(
            self.schedule in ("constant", "linear", "cosine"), f"schedule={self.schedule!r}: constant, linear or cosine"
        )
        _check_tasks(self)


@dataclass(frozen=True)
class EvalConfig(EnvSource, ModelSource, EngineOptions, EvalOptions):
    """Accuracy, avg@k and pass@k of a model; gap recovery when the before/teacher accuracies are given."""

    out: str = out_option("eval")

    eval_size: int = opt(500, "Test prompts.", section="eval")
    samples: int = opt(8, "Samples per prompt for avg@k / pass@k / maj@k (0: greedy only).", section="eval")
    temperature: float = opt(
        1.0, "Sampling temperature of the samples (--eval-sampling greedy or explicit).", section="rollout"
    )
    top_p: float = opt(1.0, "Top-p of the samples (--eval-sampling greedy or explicit).", section="rollout")
    batch_size: int = opt(
        128, "Rollouts per generation batch at most (--eval-batch-tokens bounds it too).", section="eval"
    )
    acc_before: float = opt(-1.0, "Student accuracy before OPD (for gap recovery; -1: not given).", section="eval")
    acc_teacher: float = opt(-1.0, "Teacher accuracy (for gap recovery; -1: not given).", section="eval")
    tokenizer: str = opt(
        "",
        "Tokenizer directory (default: the --student directory), for a model whose tokenizer is saved apart "
        "(a SentencePiece-style tokenizer cannot live next to a Qwen2 config in transformers 5).",
        section="model",
    )

    @classmethod
    def resolve(cls, values: dict[str, Any]) -> dict[str, Any]:
        return resolve_vllm(super().resolve(values), trains=False)

    def __post_init__(self) -> None:
        self.check_resolved()
        self._check_common()
        self._check_env()
        require(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must lie in (0, 1]")
        _check_counts(self, samples=0, eval_size=1, batch_size=1)
        check_eval_options(self, self.samples, "--samples")
        check_engine_options(self, trains=False)
        require(
            self.temperature > 0,
            f"temperature={self.temperature} must be > 0 (greedy decoding: --eval-sampling greedy)",
        )

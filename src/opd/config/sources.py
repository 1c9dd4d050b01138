"""Where a run's models, prompts and games come from: the options every command shares
(:class:`ModelSource`), an environment's games (:class:`EnvSource`) and a training run's own
evaluation data (:class:`TrainingSource`); the command configs in :mod:`opd.config.options` extend them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from opd.chat import template_kwargs
from opd.config.fields import DTYPES, ConfigError, Section, check_device, opt, require
from opd.envs.workers import AUTO_WORKERS, MAX_WORKERS
from opd.errors import UserError
from opd.tasks.arithmetic import LEVELS
from opd.tasks.dataset import parse_split
from opd.tasks.grading import check_answer_format

OUT_HELP = {
    "train": "Run folder (config.json, metrics.jsonl, rollouts.jsonl, checkpoints, final/): a new or empty folder, "
    "or with --resume an opd train run's (docs/training.md, 'Run folders and --resume').",
    "sft": "Run folder (config.json, metrics.jsonl, final/): a new or empty folder (opd sft has no --resume).",
    "eval": "Folder for eval.json: a new or empty folder, or an earlier opd eval's (its eval.json is replaced).",
}


def out_option(command: str) -> Any:
    """The ``out`` field of ``command``'s config: a default of its own, runs/COMMAND, so that one command's
    run never lands in another's folder."""
    return opt(f"runs/{command}", OUT_HELP[command])


@dataclass(frozen=True)
class ModelOptions(Section):
    """Section "model": the student (every command)."""

    student: str = opt(
        "",
        "Student model: a local Hugging Face causal-LM directory, or a Hub name (ORG/NAME) read from the Hugging Face "
        "cache (downloaded where the network allows; HF_HOME, HF_HUB_OFFLINE honoured).",
    )
    student_revision: str = opt(
        "",
        "Hub revision (branch, tag or commit) of --student given by name (opd sft: of --init). Default: main.",
    )
    dtype: str = opt(
        "float32",
        "The dtype the student computes in: float32, bfloat16 or float16 (opd eval only). Training in bfloat16 "
        "is mixed precision: float32 master weights, gradients and AdamW state, the transformer blocks under "
        "bfloat16 autocast, the head and losses in float32 (with --lora-r the frozen base in bfloat16). It pays off on "
        "GPUs and on CPUs with bfloat16 matrix instructions (AVX512-BF16, AMX). The final model is saved in it.",
    )
    tf32: bool | None = opt(
        None,
        "TF32 for the float32 matmuls on NVIDIA GPUs (the head, the losses; every matmul of a float32 run). "
        "Unset: on (Ampere and later run them several times faster); --no-tf32 keeps them exact. The CPU has "
        "no TF32: ignored there, with a note.",
    )
    device: str = opt(
        "auto",
        "Where models compute: auto (this process's GPU if torch sees one, else the CPU), "
        "cpu, cuda (this process's GPU: LOCAL_RANK under torchrun/accelerate) or cuda:N.",
    )

    def check(self) -> None:
        require(self.dtype in DTYPES, f"dtype={self.dtype!r}: use {', '.join(DTYPES)}")
        check_device(self.device)


@dataclass(frozen=True)
class DataOptions(Section):
    """Section "data": the prompts and their answers (every command)."""

    task: str = opt(
        "arithmetic",
        "Prompts and answers, resolved in this order: a local path (a save_to_disk directory, a folder of data "
        "files, parquet, arrow, JSON/JSONL or CSV files or a glob 'data/*.parquet'), 'arithmetic' (the built-in "
        "task), a benchmark preset (gsm8k, math500, aime24, aime25), or a Hub dataset name (ORG/NAME, or "
        "ORG/NAME:CONFIG) read with datasets.load_dataset (HF_HUB_OFFLINE: from the Hugging Face cache).",
        per_task=True,
    )
    task_revision: str = opt(
        "",
        "Hub revision (branch, tag or commit) of a --task given by Hub name. Default: main.",
        per_task=True,
    )
    split: str = opt(
        "",
        "Which part of --task data trains and which is evaluated: TRAIN,TEST (two split names, e.g. "
        "train,validation) or a fraction held out at random, seeded by --seed (e.g. 0.1). Default: the "
        "train and test splits when the data has both, else 0.1 of its one split held out.",
        per_task=True,
    )
    prompt_field: str = opt(
        "prompt",
        "Column of prompts: strings, or chat messages (a conversation, kept whole up to its last user turn: "
        "system, user, assistant and tool turns). A 'messages' column is used when there is no 'prompt' column; "
        "a 'tools' column (a JSON list of tool schemas per row) is passed to the chat template.",
        per_task=True,
    )
    answer_field: str = opt(
        "answer",
        "Column of reference answers, read with --answer-format; a row without one takes its solution's final "
        "answer (--solution-field, or a chat's assistant turn), and a row with neither trains without being "
        "graded. Data without an 'answer' column is prompts only.",
        per_task=True,
    )
    solution_field: str = opt(
        "solution",
        "Column of worked solutions (optional; opd sft trains on them). A chat's assistant turn after "
        "the question serves when there is no such column.",
        per_task=True,
    )
    system_prompt: str = opt(
        "", "System turn before every prompt (replaces a system turn of chat messages).", per_task=True
    )
    chat_template_kwargs: dict[str, Any] = opt(
        {},
        "Options for the student's chat template, a JSON object (e.g. '{\"enable_thinking\": false}' for "
        "Qwen3's thinking switch): passed wherever opd renders a chat (prompts, SFT pairs, episodes, evaluation).",
    )
    check_chat_template_kwargs: bool = opt(
        True,
        "Refuse a --chat-template-kwargs (or --teacher-chat-template-kwargs) key that the template never reads "
        "(found with jinja2's parser; a typo would leave the template's default on). --no-check-chat-template-kwargs: "
        "for a template that reads its options indirectly.",
    )
    answer_format: str = opt(
        "boxed",
        "How the final answer is read, from reference answers and model outputs alike: boxed (the "
        "last \\boxed{}; a reference without one is the bare answer), gsm8k (after the last '####'), "
        "last_number, exact (compared as strings; the others with math-verify) or regex:PATTERN "
        "(the last match, its group 1 if it has a group).",
        per_task=True,
    )
    task_level: int = opt(
        2,
        f"Difficulty level of the built-in arithmetic task ({min(LEVELS)}-{max(LEVELS)}; see ArithmeticTask.from_level).",
        per_task=True,
    )
    max_prompt_tokens: int = opt(
        256,
        "Longest prompt, in tokens: opd train skips longer training prompts (--long-prompts); longer evaluation "
        "and SFT prompts are an error.",
        per_task=True,
    )

    def check(self) -> None:
        check_answer_format(self.answer_format)
        parse_split(self.split)
        require(self.max_prompt_tokens >= 1, f"max_prompt_tokens={self.max_prompt_tokens} must be >= 1")
        require(self.task_level in LEVELS, f"task_level={self.task_level} must be one of {sorted(LEVELS)}")


def resolve_data(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a command's options) with the chat template's options read from their JSON."""
    values["chat_template_kwargs"] = chat_options(values["chat_template_kwargs"], "chat_template_kwargs")
    return values


def chat_options(value: Any, option: str) -> dict[str, Any]:
    """A chat-template options value (a mapping, or its JSON text from the command line), checked."""
    try:
        return template_kwargs(value, option)
    except UserError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class GenerationOptions(Section):
    """Section "rollout" of every command: how long a response may be."""

    max_new_tokens: int = opt(
        64,
        "Maximum number of generated tokens per response (with --env: per episode, actions and replies).",
        per_task=True,
    )

    def check(self) -> None:
        require(self.max_new_tokens >= 1, f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass(frozen=True)
class EnvOptions(Section):
    """Section "env": an environment's games instead of prompts (every command)."""

    env: str = opt(
        "",
        "Agentic environment whose games the student plays, multi-turn, instead of --task's prompts: "
        "alfworld, textworld, toy (or one you registered). Empty: single-turn prompts.",
        per_task=True,
    )
    env_level: int = opt(
        1,
        "Difficulty level of the environment's games (its own scale; toy: level + 1 rooms).",
        per_task=True,
    )
    env_args: list[Any] = opt(
        [],
        "More arguments for the environment, KEY=VALUE comma-separated (e.g. n_train=256,max_turns=10).",
        per_task=True,
    )
    max_turns: int = opt(0, "Actions per episode before it ends unwon (0: the environment's own limit).", per_task=True)
    max_action_tokens: int = opt(
        32,
        "Tokens the model may write in one turn (with --env; --max-new-tokens bounds the whole episode).",
        per_task=True,
    )
    env_workers: int | None = opt(
        None,
        "Processes that run the games of --env: episodes' games step there, several at once, while this "
        "process generates (results do not depend on it). 0: in this process. Unset: one per CPU core the "
        "trainer leaves free (its torch threads when the model is on the CPU, one core on a GPU; the cores "
        f"shared among torchrun's ranks on the machine), at most {AUTO_WORKERS}.",
    )
    env_step_timeout: float = opt(
        60.0,
        "With env workers: seconds a game may take to answer one action (or to start); a game that takes longer "
        "ends its episode as an environment error, counted, and its worker is replaced (0: no limit).",
    )

    def check(self) -> None:
        require(self.env_level >= 1, f"env_level={self.env_level} must be >= 1")
        require(self.max_turns >= 0, f"max_turns={self.max_turns} must be >= 0 (0: the environment's limit)")
        require(self.max_action_tokens >= 1, f"max_action_tokens={self.max_action_tokens} must be >= 1")
        require(
            self.env_workers is None or 0 <= self.env_workers <= MAX_WORKERS,
            f"env_workers={self.env_workers}: use 0 (games in this process) to {MAX_WORKERS} worker processes, "
            "or leave it unset for one per free CPU core",
        )
        require(self.env_step_timeout >= 0, f"env_step_timeout={self.env_step_timeout} must be >= 0 (0: no limit)")


def episode_limits(env: EnvOptions, data: DataOptions, rollout: GenerationOptions) -> dict[str, Any]:
    """What bounds an episode, as keyword arguments of EpisodeRollout.play and evaluate_agent."""
    return dict(
        max_new_tokens=rollout.max_new_tokens,
        max_action_tokens=env.max_action_tokens,
        max_turns=env.max_turns or None,
        max_prompt_tokens=data.max_prompt_tokens,
    )


@dataclass(frozen=True)
class EvalSource(Section):
    """Section "eval" of a command that trains (train and sft): what the model is evaluated on."""

    eval: bool = opt(
        True,
        "Evaluate the model (--no-eval: never; data is then not held out for it unless --split says so). "
        "Evaluation needs reference answers: without any in the held-out prompts it is off, with a note.",
        per_task=True,
    )
    eval_task: str = opt(
        "",
        "Evaluate on other data than --task (the same kinds of source; it must have reference answers): its "
        "test split, or every row when it has one split. Default: the held-out part of --task.",
        per_task=True,
    )
    eval_split: str = opt("", "Split of --eval-task to evaluate on (default: test, or its only split).", per_task=True)
    eval_revision: str = opt("", "Hub revision of an --eval-task given by Hub name (default: main).", per_task=True)
    eval_prompt_field: str = opt("", "--prompt-field of --eval-task (default: --prompt-field).", per_task=True)
    eval_answer_field: str = opt("", "--answer-field of --eval-task (default: --answer-field).", per_task=True)
    eval_solution_field: str = opt("", "--solution-field of --eval-task (default: --solution-field).", per_task=True)
    eval_answer_format: str = opt(
        "",
        "--answer-format for --eval-task, its references and the model's outputs (default: --answer-format).",
        per_task=True,
    )

    def check(self) -> None:
        if self.eval_answer_format:
            check_answer_format(self.eval_answer_format)
        given = [f.name for f in dataclasses.fields(EvalSource) if f.name.startswith("eval_") and f.name != "eval_task"]
        given = [n for n in given if getattr(self, n)]
        require(
            bool(self.eval_task) or not given,
            f"{', '.join(given)} set without eval_task; give --eval-task DATA, or drop the eval options",
        )
        require("," not in self.eval_split, f"eval_split={self.eval_split!r}: name one split, e.g. test")
        require(
            self.eval or not self.eval_task,
            f"eval_task={self.eval_task!r} is set with evaluation off (--no-eval); drop one of them",
        )


def check_eval_schedule(section: EvalSource, every: int, default: int) -> None:
    """A schedule of evaluations (``every``: the command's ``eval_every``, ``default`` its default) with
    evaluation off is a contradiction; its default and 0 ("at the end") are not."""
    require(
        section.eval or every in (0, default),
        f"eval_every={every} is set with evaluation off (--no-eval); drop one of them",
    )


def check_trainable_dtype(model: ModelOptions) -> None:
    """A run that trains refuses float16 (it would need loss scaling)."""
    require(
        model.dtype != "float16",
        "dtype=float16: training in float16 needs loss scaling, which opd does not do; use bfloat16 (NVIDIA "
        "GPUs from Ampere on, recent CPUs) or float32 (float16 still serves --teacher-dtype and opd eval)",
    )


def teacher_revision_option() -> Any:
    """``--teacher-revision``, in the teacher section of train and sft (declared here, once, so that each
    section lists it after its ``--teacher``)."""
    return opt("", "Hub revision (branch, tag or commit) of --teacher given by name (default: main).", per_task=True)


@dataclass(frozen=True)
class RunOptions(Section):
    """Section "run" of every command: the part they share."""

    seed: int = opt(0, "Seed for data order, sampling and initialisation.")

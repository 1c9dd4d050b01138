"""The sections of opd's configurations: which options belong together, in files and in ``--help``.

A config class stays one flat dataclass (``cfg.eval_every``; the flat command-line flags are its
fields), and every option has one name everywhere: its flag (``--eval-every``), its attribute and its
key in a YAML/JSON file and in a run's ``config.json`` (``eval_every``). What sections add is where
an option sits: ``config.json`` is written nested by section (``{"eval": {"eval_every": 50, ...}}``)
and ``--help`` shows one panel per section. A file may give its options nested, flat (every
``config.json`` written before sections), or both; an option in a section it does not belong to is an
error naming its section, so a nested file cannot silently set nothing.

A mapping under a section's name is that section. Six sections share their name with an option
(``data``, ``env``, ``teacher``, ``cross_tokenizer``, ``objective``, ``eval``); the option holds a
string (``eval``: true or false), never a mapping, so ``teacher: /models/t`` is the option and
``teacher: {teacher: /models/t}`` the section.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from opd.config.fields import ConfigError

# (section, its title in --help, its options in order). One table for every command's config: an
# option name means the same thing in train, sft and eval (EVAL_ONLY below: eval's own batch).
LAYOUT: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("model", "Student model", ("student", "student_revision", "init", "arch", "tokenizer", "dtype", "tf32", "device")),
    (
        "data",
        "Data: prompts and answers",
        (
            "task",
            "task_revision",
            "split",
            "prompt_field",
            "answer_field",
            "solution_field",
            "system_prompt",
            "chat_template_kwargs",
            "check_chat_template_kwargs",
            "answer_format",
            "task_level",
            "max_prompt_tokens",
            "long_prompts",
            "data",
            "train_size",
        ),
    ),
    (
        "env",
        "Environment: multi-turn games",
        (
            "env",
            "env_level",
            "env_args",
            "max_turns",
            "max_action_tokens",
            "env_workers",
            "env_step_timeout",
            "expert_mistakes",
            "dagger_from",
            "dagger_branches",
        ),
    ),
    (
        "teacher",
        "Teacher: in-process or served",
        (
            "teacher",
            "teacher_revision",
            "teacher_tokenizer",
            "teacher_chat_template_kwargs",
            "teacher_dtype",
            "teacher_url",
            "teacher_timeout",
            "teacher_wait",
            "teacher_retries",
            "teacher_api_key",
        ),
    ),
    (
        "cross_tokenizer",
        "Cross-tokenizer: a teacher with another tokenizer",
        ("cross_tokenizer", "cross_pairing", "cross_unmapped", "cross_joinable", "teacher_special_map"),
    ),
    (
        "objective",
        "Objective: the loss",
        (
            "objective",
            "k",
            "support",
            "renormalize",
            "tail",
            "forward_kl_share",
            "gamma",
            "kl_direction",
            "mask_special",
            "special_tokens",
            "reduction",
        ),
    ),
    (
        "rollout",
        "Rollouts: what the student samples, and with what engine",
        (
            "max_new_tokens",
            "temperature",
            "top_p",
            "samples_per_prompt",
            "rollout_engine",
            "static_cache",
            "max_staleness",
            "rollout_worker_threads",
            "vllm_url",
            "vllm_args",
            "vllm_sync",
            "vllm_sleep",
            "vllm_max_gap",
            "vllm_start_timeout",
            "vllm_wait",
        ),
    ),
    (
        "optimizer",
        "Optimizer: steps, batches, learning rate",
        (
            "steps",
            "batch_size",
            "grad_accum",
            "micro_batch_tokens",
            "gradient_checkpointing",
            "updates_per_batch",
            "clip_eps",
            "stale_weight_cap",
            "lr",
            "weight_decay",
            "warmup_steps",
            "schedule",
            "max_grad_norm",
            "keep_dropout",
        ),
    ),
    (
        "eval",
        "Evaluation",
        (
            "eval",
            "eval_task",
            "eval_split",
            "eval_revision",
            "eval_prompt_field",
            "eval_answer_field",
            "eval_solution_field",
            "eval_answer_format",
            "eval_every",
            "eval_size",
            "eval_samples",
            "samples",
            "eval_sampling",
            "eval_temperature",
            "eval_top_p",
            "maj_k",
            "eval_batch_tokens",
            "eval_record_chars",
            "patience",
            "validation_size",
            "acc_before",
            "acc_teacher",
        ),
    ),
    ("lora", "LoRA", ("lora_r", "lora_alpha", "lora_targets", "lora_dropout")),
    ("multitask", "Multi-task: several tasks in one run", ("tasks", "task_mode")),
    (
        "run",
        "Run directory, logging, checkpoints, processes",
        (
            "out",
            "seed",
            "resume",
            "ckpt_every",
            "keep_checkpoints",
            "keep_best",
            "final_best",
            "log_rollouts",
            "report_to",
            "diag_positions",
            "fsdp",
            "dist_timeout",
        ),
    ),
)
SECTION_NAMES = tuple(name for name, _, _ in LAYOUT)
TITLES = {name: title for name, title, _ in LAYOUT}
_SECTION_OF = {option: name for name, _, options in LAYOUT for option in options}
# `opd eval`'s batch is its generation batch, not a training step's prompts.
EVAL_ONLY = {"batch_size": "eval"}


def section_of(cls: type, option: str) -> str:
    """The section ``option`` of config class ``cls`` sits in."""
    if cls.__name__ == "EvalConfig" and option in EVAL_ONLY:
        return EVAL_ONLY[option]
    try:
        return _SECTION_OF[option]
    except KeyError:
        raise KeyError(f"{cls.__name__}.{option} has no section; add it to opd.config.sections.LAYOUT") from None


def nest(cls: type, flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``flat`` (option -> value) as {section: {option: value}}, sections and options in LAYOUT's order."""
    order = {option: i for i, (_, _, options) in enumerate(LAYOUT) for option in options}
    out: dict[str, dict[str, Any]] = {name: {} for name in SECTION_NAMES}
    for option in sorted(flat, key=lambda o: order.get(o, len(order))):
        out[section_of(cls, option)][option] = flat[option]
    return {name: values for name, values in out.items() if values}


def flatten(cls: type, data: dict[str, Any], source: str) -> dict[str, Any]:
    """A file's mapping, nested by section, flat or both, as option -> value (keys as written, dashes kept).

    Refused: an option inside a section it does not belong to, and one given twice (flat and nested)."""
    options = {f.name for f in dataclasses.fields(cls)}
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key, value in data.items():
        if key in SECTION_NAMES and isinstance(value, dict):
            items = [(str(k), v, key) for k, v in value.items()]
        else:
            items = [(key, value, "")]
        for option, v, section in items:
            name = option.replace("-", "_")
            if section and name in options and section_of(cls, name) != section:
                raise ConfigError(
                    f"{option} is in the {section_of(cls, name)} section, not {section}, of the {source}; "
                    f"move it under {section_of(cls, name)}: (or to the top level)"
                )
            if section and name not in options:
                raise ConfigError(
                    f"unknown option {option!r} in the {section} section of the {source} for {cls.__name__}; "
                    "rename or remove it (the command's --help lists its options by section)"
                )
            if name in where:
                raise ConfigError(
                    f"{option} is given twice in the {source} ({where[name] or 'top level'} and "
                    f"{section or 'top level'}); keep one"
                )
            where[name] = section
            flat[option] = v
    return flat

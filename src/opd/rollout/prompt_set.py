"""Prompt sets: task examples tokenized once, visited in a seeded order that depends only on the step.

The batch of step s is a pure function of (seed, s): a resumed run needs no saved data state
beyond the step, and every prompt carries its own sampling seed, so a prompt produces the same
rollout in any batch or process (see :mod:`opd.rollout.sampling`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from opd.config import SFTConfig, TrainConfig
from opd.config.sources import DataOptions, EvalSource
from opd.errors import UserError
from opd.hub import looks_like_repo_id, split_config
from opd.models.tokenizer import format_prompt
from opd.tasks import Example, Task, get_task
from opd.tasks.presets import PRESETS, preset_options


def load_task(task: str, level: int = 2, seed: int = 0, **options: Any) -> Task:
    """A task by name, in one order: data on disk (a file, glob or directory), ``arithmetic`` (built in,
    at difficulty ``level``), a benchmark preset (:mod:`opd.tasks.presets`), a Hub dataset name
    (``ORG/NAME[:CONFIG]``, at ``options["revision"]``). Data is read with Hugging Face ``datasets``
    (:class:`opd.tasks.dataset.DatasetTask`, which takes ``options``: split, prompt_field, answer_field,
    solution_field, answer_format, system_prompt, evaluation, flag_prefix, revision). The arithmetic
    task reads only answer_format and system_prompt."""
    local = Path(task).exists() or any(c in task for c in "*?[")
    if task == "arithmetic" and not local:
        if options.get("split"):
            flag = options.get("flag_prefix", "")
            raise UserError(
                f"--{flag}split applies to data on disk; the arithmetic task has its own train and test sets"
            )
        keep = {k: options[k] for k in ("answer_format", "system_prompt") if k in options}
        return get_task("arithmetic", level=level, seed=seed, **keep)
    if not local and task in PRESETS:
        preset = PRESETS[task]
        return get_task("dataset", source=preset.source, seed=seed, **preset_options(preset, options))
    if not local and not looks_like_repo_id(split_config(task)[0]):
        flag = options.get("flag_prefix", "")
        raise UserError(
            f"--{flag}task {task!r} is neither an existing file, glob or directory (read relative to {Path.cwd()}), "
            f"nor 'arithmetic', a preset ({', '.join(PRESETS)}) or a Hub dataset name (ORG/NAME); check the path"
        )
    return get_task("dataset", source=task, seed=seed, **options)


def data_options(data: DataOptions) -> dict[str, str]:
    """The data section's options a task is loaded with: its columns, how its answers read, its system turn
    and revision."""
    return {
        "prompt_field": data.prompt_field,
        "answer_field": data.answer_field,
        "solution_field": data.solution_field,
        "answer_format": data.answer_format,
        "system_prompt": data.system_prompt,
        "revision": data.task_revision,
    }


def eval_data_options(data: DataOptions, source: EvalSource) -> dict[str, str]:
    """The data options of ``--eval-task``: its own, each defaulting to the training data's (but its
    revision, which is the evaluation data's)."""
    own = {
        "prompt_field": source.eval_prompt_field,
        "answer_field": source.eval_answer_field,
        "solution_field": source.eval_solution_field,
        "answer_format": source.eval_answer_format,
    }
    return {**data_options(data), **{k: v for k, v in own.items() if v}, "revision": source.eval_revision}


def load_tasks(cfg: TrainConfig | SFTConfig) -> tuple[Task, Task | None]:
    """``(training task, evaluation task)`` of a config; the evaluation task is the training task
    (its test split) unless ``--eval-task`` names other data, whose test split (or, with one
    split, every row) is then evaluated, and nothing is held out of the training data unless ``--split``
    says so. None: no evaluation, by ``--no-eval`` (then nothing is held out either) or because no held-out prompt has a reference
    answer (:func:`grading_notes` says so). ``--eval-task`` data without answers is an error."""
    data, source, seed = cfg.data, cfg.eval, cfg.run.seed
    evaluate = source.eval
    holds_out = evaluate and not source.eval_task  # --eval-task: evaluation has its own data
    split = data.split or ("" if holds_out or data.task == "arithmetic" else "0")
    task = load_task(data.task, data.task_level, seed, split=split, **data_options(data))
    if not evaluate:
        return task, None
    if not source.eval_task:
        held_out = task.examples("test")
        return task, (task if not held_out or any(e.answer is not None for e in held_out) else None)
    evaluation = load_task(
        source.eval_task,
        data.task_level,
        seed,
        split=source.eval_split,
        evaluation=True,
        flag_prefix="eval-",
        **eval_data_options(data, source),
    )
    if not any(e.answer is not None for e in evaluation.examples("test")):
        raise UserError(
            f"--eval-task {source.eval_task} has no reference answers to grade (looked for {answer_source(evaluation)}); "
            "give evaluation data with answers (--eval-answer-field names its column), or drop --eval-task"
        )
    return task, evaluation


def graded(examples: list[Example]) -> list[Example]:
    """The examples with a reference answer: what an evaluation grades."""
    return [e for e in examples if e.answer is not None]


def answer_source(task: Task) -> str:
    """Where ``task``'s reference answers come from, for a note or an error about their absence."""
    source = getattr(task, "answer_source", None)
    return source() if source else "reference answers"


def say_grading_notes(command: str, specs: list, data: list) -> None:
    """Once per launch (rank 0), each task's :func:`grading_notes`; ``specs``: the run's TaskSpecs,
    ``data``: each one's (training task, evaluation task), or None for an environment."""
    if os.environ.get("RANK", "0") != "0":
        return
    for spec, tasks in zip(specs, data, strict=True):
        task, evaluation = tasks or (None, None)
        for line in grading_notes(spec.cfg, task, evaluation, rollouts=command == "train") if task else []:
            where = f"task {spec.name}: " if spec.name else ""
            print(f"opd {command}: note: {where}{line}", file=sys.stderr, flush=True)


def grading_notes(
    cfg: TrainConfig | SFTConfig, task: Task, evaluation: Task | None, rollouts: bool = True
) -> list[str]:
    """What a run says once, before training, about prompts without reference answers: that training
    logs no rollout accuracy (or one over the graded prompts; ``rollouts``: an OPD run, which grades
    its rollouts), and that evaluation is off (nothing to grade) or over the graded held-out prompts."""
    notes = []
    train = task.examples("train")
    n_graded = len(graded(train))
    if rollouts and n_graded < len(train):
        what = (
            "none has a reference answer: they train, and no rollout accuracy is logged"
            if not n_graded
            else f"{len(train) - n_graded} have no reference answer: rollout accuracy is over the "
            f"{n_graded} graded ones (rollout/ungraded counts the others in a step)"
        )
        notes.append(f"of the {len(train)} training prompts of {cfg.data.task}, {what}")
    if evaluation is None and cfg.eval.eval:
        notes.append(
            f"none of the held-out prompts of {cfg.data.task} has a reference answer (looked for {answer_source(task)}), "
            "so there is nothing to grade and evaluation is off; give --eval-task DATA with answers to evaluate, "
            "or --no-eval to train on every row"
        )
    elif evaluation is not None:
        held_out = evaluation.examples("test")
        n = len(graded(held_out))
        if n < len(held_out):
            notes.append(
                f"{len(held_out) - n} of the {len(held_out)} held-out prompts have no reference answer: evaluation "
                f"grades the {n} others (at most --eval-size {cfg.eval.eval_size})"
            )
    return notes


def eval_prompts(task: Task, eval_size: int) -> list[Example]:
    """What an evaluation of ``task`` grades: its first ``eval_size`` test examples with a reference answer."""
    return graded(task.examples("test"))[:eval_size]


LONG_PROMPTS = ("skip", "error")


@dataclass
class PromptSet:
    """Examples and their chat-formatted prompt ids; ``skipped``: prompts over the length limit left out
    (``longest_skipped``: the longest of them, in tokens)."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    skipped: int = 0
    longest_skipped: int = 0

    @classmethod
    def build(
        cls,
        examples: list[Example],
        tokenizer: PreTrainedTokenizerBase,
        max_prompt_tokens: int,
        name: str = "prompts",
        long_prompts: str = "error",
    ) -> PromptSet:
        """The prompts of ``examples``; those longer than ``max_prompt_tokens`` stop the run
        (``long_prompts="error"``) or are left out (``"skip"``: counted, said once on rank 0)."""
        if not examples:
            raise UserError(
                f"there are no {name}: give data with at least one (evaluation prompts come from the data's "
                "test split, the share --split holds out, or --eval-task; --no-eval: none)"
            )
        ids = [
            tokenizer(format_prompt(tokenizer, ex.chat(), tools=ex.tools), add_special_tokens=False)["input_ids"]
            for ex in examples
        ]
        too_long = [i for i, p in enumerate(ids) if len(p) > max_prompt_tokens]
        if not too_long:
            return cls(examples, ids)
        longest = max(len(ids[i]) for i in too_long)
        what = f"{len(too_long)} of {len(ids)} {name} are longer than max_prompt_tokens={max_prompt_tokens} (longest: {longest} tokens"
        if long_prompts == "error" or len(too_long) == len(ids):
            fix = "or drop those prompts" if long_prompts == "error" else "(skipping them would leave none)"
            raise UserError(
                f"{what}, e.g. #{too_long[0]}: {examples[too_long[0]].prompt[:60]!r}...); "
                f"raise --max-prompt-tokens (within the model's context) {fix}"
            )
        if os.environ.get("RANK", "0") == "0":
            print(
                f"opd: warning: {what}): skipped, counted in data/prompts_skipped; --long-prompts error stops instead",
                file=sys.stderr,
                flush=True,
            )
        out = set(too_long)
        kept = [i for i in range(len(ids)) if i not in out]
        return cls([examples[i] for i in kept], [ids[i] for i in kept], len(too_long), longest)

    def __len__(self) -> int:
        return len(self.examples)

    def batch_indices(self, step: int, batch_size: int, seed: int) -> list[int]:
        return batch_indices(len(self), step, batch_size, seed)


def batch_indices(n: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Indices of ``step``'s batch among ``n`` items: consecutive slices of per-epoch seeded permutations."""
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, n)
        out.append(int(_epoch_order(n, seed, epoch)[pos]))
    return out


@lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch), device="cpu")


def sample_seed(seed: int, step: int, slot: int) -> int:
    """The sampling seed of the rollout in ``slot`` of ``step``'s global batch."""
    return (seed * 1_000_003 + step * 65_537 + slot) % (2**62)

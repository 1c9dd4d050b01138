"""Prompt sets: task examples tokenized once, visited in a seeded order that depends only on the step.

The batch of step s is a pure function of (seed, s): a resumed run needs no saved data state
beyond the step, and every prompt carries its own sampling seed, so a prompt produces the same
rollout in any batch or process (see :mod:`opd.rollout.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from opd.errors import UserError
from opd.models.tokenizer import format_prompt
from opd.tasks import Example, Task, get_task


def load_task(task: str, level: int = 2, seed: int = 0, **options: Any) -> Task:
    """``arithmetic`` (built in, at difficulty ``level``), or data on disk read with Hugging Face
    ``datasets`` (a file, glob or directory: :class:`opd.tasks.dataset.DatasetTask`, which takes
    ``options``: split, prompt_field, answer_field, solution_field, answer_format, system_prompt,
    evaluation, flag_prefix). The arithmetic task reads only answer_format and system_prompt."""
    if task == "arithmetic":
        if options.get("split"):
            flag = options.get("flag_prefix", "")
            raise UserError(
                f"--{flag}split applies to data on disk; the arithmetic task has its own train and test sets"
            )
        keep = {k: options[k] for k in ("answer_format", "system_prompt") if k in options}
        return get_task("arithmetic", level=level, seed=seed, **keep)
    if not Path(task).exists() and not any(c in task for c in "*?["):
        flag = options.get("flag_prefix", "")
        raise UserError(
            f"--{flag}task {task!r} is neither 'arithmetic' nor an existing file, glob or directory; "
            f"check the path (it is read relative to {Path.cwd()})"
        )
    return get_task("dataset", source=task, seed=seed, **options)


def data_options(cfg: Any, prefix: str = "") -> dict[str, str]:
    """The data options of ``cfg`` (``prefix="eval_"``: the evaluation set's, each defaulting to
    the training set's)."""
    names = ("prompt_field", "answer_field", "solution_field", "answer_format")
    options = {n: getattr(cfg, prefix + n, "") or getattr(cfg, n) for n in names}
    return {**options, "system_prompt": cfg.system_prompt}


def load_tasks(cfg: Any) -> tuple[Task, Task]:
    """``(training task, evaluation task)`` of a config; the evaluation task is the training task
    (its test split) unless ``cfg.eval_task`` names other data, whose test split (or, with one
    split, every row) is then evaluated."""
    task = load_task(cfg.task, cfg.task_level, cfg.seed, split=cfg.split, **data_options(cfg))
    if not getattr(cfg, "eval_task", ""):
        return task, task
    evaluation = load_task(
        cfg.eval_task,
        cfg.task_level,
        cfg.seed,
        split=cfg.eval_split,
        evaluation=True,
        flag_prefix="eval-",
        **data_options(cfg, "eval_"),
    )
    return task, evaluation


@dataclass
class PromptSet:
    examples: list[Example]
    prompt_ids: list[list[int]]

    @classmethod
    def build(
        cls, examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int, name: str = "prompts"
    ) -> PromptSet:
        if not examples:
            raise UserError(
                f"there are no {name}: give data with at least one (evaluation prompts come from the data's "
                "test split, the share --split holds out, or --eval-task)"
            )
        ids = [
            tokenizer(format_prompt(tokenizer, ex.prompt, ex.system), add_special_tokens=False)["input_ids"]
            for ex in examples
        ]
        too_long = [i for i, p in enumerate(ids) if len(p) > max_prompt_tokens]
        if too_long:
            longest = max(len(ids[i]) for i in too_long)
            raise UserError(
                f"{len(too_long)} of {len(ids)} {name} are longer than max_prompt_tokens={max_prompt_tokens} "
                f"(longest: {longest} tokens, e.g. #{too_long[0]}: {examples[too_long[0]].prompt[:60]!r}...); "
                "raise --max-prompt-tokens (within the model's context) or drop those prompts"
            )
        return cls(examples, ids)

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

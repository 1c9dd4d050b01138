"""Prompt sets: task examples tokenized once, visited in a seeded order that depends only on the step.

The batch of step s is a pure function of (seed, s): a resumed run needs no saved data state
beyond the step, and every prompt carries its own sampling seed, so a prompt produces the same
rollout in any batch or process (see :mod:`opd.rollout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from opd.errors import UserError
from opd.tasks import Example, Task, get_task
from opd.tokenizer import format_prompt


def load_task(task: str, level: int, seed: int) -> Task:
    """``arithmetic`` (built in) or a path to a JSONL file of prompt/answer lines."""
    if task == "arithmetic":
        return get_task("arithmetic", level=level, seed=seed)
    if task.endswith(".jsonl") or Path(task).exists():
        return get_task("jsonl", path=task, seed=seed)
    raise UserError(f"--task {task!r} is neither 'arithmetic' nor an existing JSONL file; check the path")


@dataclass
class PromptSet:
    examples: list[Example]
    prompt_ids: list[list[int]]

    @classmethod
    def build(
        cls, examples: list[Example], tokenizer: PreTrainedTokenizerBase, max_prompt_tokens: int, name: str = "prompts"
    ) -> PromptSet:
        if not examples:
            raise UserError(f"the {name} set is empty; give a task or JSONL file with at least one prompt")
        ids = [tokenizer(format_prompt(tokenizer, ex.prompt), add_special_tokens=False)["input_ids"] for ex in examples]
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

"""The task interface: a task is a set of prompts with reference answers plus a reward.

Usage::

    from opd.tasks import get_task
    task = get_task("arithmetic", level=2)
    ex = task.examples("train")[0]          # Example(prompt=..., answer=..., solution=...)
    task.reward(completion_text, ex)        # 1.0 if the last \\boxed{} matches ex.answer

Anything with ``name``, ``examples(split)`` and ``reward(completion, example)`` is a Task;
there is no base class to inherit. Rewards go through ``opd.grading`` so that every task
grades answers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from opd.errors import UserError

__all__ = ["Example", "Task", "SPLITS", "check_split", "get_task", "TASK_NAMES"]

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Example:
    """One prompt. ``answer`` is the reference final answer; ``solution`` an optional worked
    completion (used for supervised warm-up and tokenizer training, never for reward)."""

    prompt: str
    answer: str
    task: str = "default"
    solution: str | None = None


@runtime_checkable
class Task(Protocol):
    name: str

    def examples(self, split: str) -> list[Example]:
        """All examples of ``split`` ("train" or "test"), in a fixed order."""
        ...

    def reward(self, completion: str, example: Example) -> float:
        """1.0 if ``completion`` answers ``example`` correctly, else 0.0."""
        ...


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}: use one of {SPLITS}")


def _make_arithmetic(**kwargs: Any) -> Task:
    from opd.tasks.arithmetic import ArithmeticTask

    if "level" in kwargs:
        return ArithmeticTask.from_level(**kwargs)
    return ArithmeticTask(**kwargs)


def _make_jsonl(**kwargs: Any) -> Task:
    from opd.tasks.jsonl import JsonlTask

    return JsonlTask(**kwargs)


# Imports inside the factories: the task modules import this one.
_REGISTRY = {"arithmetic": _make_arithmetic, "jsonl": _make_jsonl}
TASK_NAMES = tuple(_REGISTRY)


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name: ``get_task("arithmetic", level=3)``, ``get_task("jsonl", path=p)``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown task {name!r}: use one of {', '.join(TASK_NAMES)}") from None
    return factory(**kwargs)

"""The task interface: a task is a set of prompts, with reference answers or without, plus a reward.

Usage::

    from opd.tasks import get_task  # opd.tasks.registry
    task = get_task("arithmetic", level=2)
    ex = task.examples("train")[0]          # Example(prompt=..., answer=..., solution=...)
    task.reward(completion_text, ex)        # 1.0 if the last \\boxed{} matches ex.answer

Anything with ``name``, ``examples(split)`` and ``reward(completion, example)`` is a Task;
there is no base class to inherit. Rewards go through ``opd.tasks.grading`` so that every task
grades answers the same way. A prompt without a reference answer (``answer`` None) trains but is
not graded: :func:`reward_of` gives None for it, and accuracies are over the graded ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from opd.errors import UserError

__all__ = ["Example", "Task", "SPLITS", "check_split", "hold_out", "reference_of", "reward_of"]

SPLITS = ("train", "test")
T = TypeVar("T")


@dataclass(frozen=True)
class Example:
    """One prompt. ``answer`` is the reference final answer, None for a prompt without one (it
    trains, and is not graded: see :func:`reward_of`); ``solution`` an optional worked completion
    (used for supervised warm-up and tokenizer training, never for reward); ``system`` an optional
    system turn put before the prompt in the chat template.

    ``messages``, for a conversation: its whole history up to and including its last user turn
    (system, user, assistant and tool turns, as the chat template takes them), rendered in place of
    ``system`` and ``prompt`` (then the last user turn's text, for logs); ``tools``: the JSON schemas
    of the tools the template lists for the model. Both are tuples, so an example stays immutable."""

    prompt: str
    answer: str | None = None
    task: str = "default"
    solution: str | None = None
    system: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None

    def chat(self) -> list[dict[str, Any]]:
        """The messages the prompt is rendered from (the generation prompt follows them)."""
        if self.messages:
            return [dict(m) for m in self.messages]
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.prompt}]

    @property
    def uses_tools(self) -> bool:
        """Tools are listed for the model, or tool calls are in its history: it may write one."""
        return bool(self.tools) or any(m.get("tool_calls") for m in self.messages or ())


@runtime_checkable
class Task(Protocol):
    name: str

    def examples(self, split: str) -> list[Example]:
        """All examples of ``split`` ("train" or "test"), in a fixed order."""
        ...

    def reward(self, completion: str, example: Example) -> float:
        """1.0 if ``completion`` answers ``example`` correctly, else 0.0 (an example with an answer:
        callers go through :func:`reward_of`)."""
        ...


def reward_of(task: Task, completion: str, example: Example) -> float | None:
    """``task``'s reward of ``completion``, or None for an example without a reference answer:
    nothing to grade, so it counts toward no accuracy (rather than as wrong)."""
    return None if example.answer is None else task.reward(completion, example)


def reference_of(example: Example) -> str:
    """The reference answer a reward grades against; a ValueError for an example without one
    (:func:`reward_of` never asks a task to reward those)."""
    if example.answer is None:
        raise ValueError(f"{example.prompt[:40]!r} has no reference answer to grade against; reward it with reward_of")
    return example.answer


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}: use one of {SPLITS}")


def hold_out(items: list[T], test_fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """A seeded held-out split ``(train, test)`` of ``items``; both keep the input order, so that
    a split is easy to inspect. ``round(n * test_fraction)`` items are held out, at least one
    and at most ``n - 1`` when the fraction is positive and there are two items or more."""
    if not 0.0 <= test_fraction < 1.0:
        raise UserError(f"test_fraction must be in [0, 1), got {test_fraction}")
    order = list(range(len(items)))
    # The seed string predates other data sources: kept so that earlier JSONL runs split alike.
    random.Random(f"opd-jsonl/{seed}").shuffle(order)
    n_test = round(len(items) * test_fraction)
    if test_fraction > 0 and len(items) >= 2:
        n_test = min(max(n_test, 1), len(items) - 1)
    test_idx = set(order[:n_test])
    return [e for i, e in enumerate(items) if i not in test_idx], [e for i, e in enumerate(items) if i in test_idx]

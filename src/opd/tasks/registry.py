"""Tasks by name: ``get_task("arithmetic", level=2)``, ``get_task("jsonl", path=p)``, ``get_task("dataset", ...)``.

Apart from :mod:`opd.tasks.task` (the interface every task module imports), so that this module
can import the tasks it builds and none of them imports it back.
"""

from __future__ import annotations

from typing import Any

from opd.errors import UserError
from opd.tasks.arithmetic import ArithmeticTask
from opd.tasks.dataset import DatasetTask
from opd.tasks.jsonl import JsonlTask
from opd.tasks.task import Task


def _make_arithmetic(**kwargs: Any) -> Task:
    if "level" in kwargs:
        return ArithmeticTask.from_level(**kwargs)
    return ArithmeticTask(**kwargs)


def _make_jsonl(**kwargs: Any) -> Task:
    return JsonlTask(**kwargs)


def _make_dataset(**kwargs: Any) -> Task:
    return DatasetTask(**kwargs)


_REGISTRY = {"arithmetic": _make_arithmetic, "jsonl": _make_jsonl, "dataset": _make_dataset}
TASK_NAMES = tuple(_REGISTRY)


def get_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name: ``get_task("arithmetic", level=3)``, ``get_task("jsonl", path=p)``,
    ``get_task("dataset", source="gsm8k.parquet", prompt_field="question", answer_format="gsm8k")``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown task {name!r}: use one of {', '.join(TASK_NAMES)}") from None
    return factory(**kwargs)

"""Tasks: prompts, with reference answers or without, and a reward (see ``opd.tasks.task``).

``get_task("arithmetic", level=2)`` builds the synthetic default; ``get_task("jsonl",
path="data.jsonl")`` loads your own prompts, and ``get_task("dataset", source=...)`` any data
set on disk that Hugging Face ``datasets`` reads (``opd.tasks.dataset``).
"""

from opd.tasks.arithmetic import ArithmeticTask
from opd.tasks.dataset import DatasetTask
from opd.tasks.jsonl import JsonlTask
from opd.tasks.registry import TASK_NAMES, get_task
from opd.tasks.task import SPLITS, Example, Task, reward_of

__all__ = [
    "Example",
    "Task",
    "get_task",
    "reward_of",
    "SPLITS",
    "TASK_NAMES",
    "ArithmeticTask",
    "DatasetTask",
    "JsonlTask",
]

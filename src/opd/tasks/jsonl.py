"""Your own prompts from a JSONL file: one JSON object per line.

Each line needs a string field ``prompt`` (or chat ``messages``); ``answer`` (the reference, for
grading), ``task`` (a label, e.g. a subject) and ``solution`` (a worked completion) are optional
strings, and ``tools`` a list of tool schemas. A line without an answer trains and is not graded.
Blank lines are skipped::

    {"prompt": "What is 1/2 + 1/4?", "answer": "3/4"}
    {"prompt": "Compute 12 + 7.", "answer": "19", "task": "arith", "solution": "... \\boxed{19}"}
    {"prompt": "Write a haiku about the sea."}

Usage::

    task = JsonlTask("data/train.jsonl")                       # 10% held out, seeded
    task = JsonlTask("train.jsonl", test_path="test.jsonl")   # explicit test file
    task.examples("test"); task.reward(completion, example)

A JSONL file is read like any other data file, by :class:`opd.tasks.dataset.DatasetTask` (other
field names, answer formats and chat messages work the same way); what the ``datasets`` JSON
reader cannot say, which line of a file is bad, comes from :func:`opd.tasks.rows.find_bad_line`
(named here too), used whenever a JSON file fails to load or fails the row checks. Completions are graded by their last
``\\boxed{...}`` against ``answer`` (``opd.tasks.grading``). Problems raise ``opd.errors.UserError``
naming the file, the line and the fix.
"""

from __future__ import annotations

from pathlib import Path

from opd.errors import UserError
from opd.tasks.dataset import DatasetTask
from opd.tasks.rows import check_not_empty, find_bad_line  # where they live; named here too

__all__ = ["JsonlTask", "check_not_empty", "find_bad_line"]


class JsonlTask(DatasetTask):
    """Prompts (and answers) from JSONL; see the module docstring."""

    def __init__(
        self,
        path: str | Path,
        name: str = "jsonl",
        test_path: str | Path | None = None,
        test_fraction: float = 0.1,
        seed: int = 0,
    ):
        if not 0.0 <= test_fraction < 1.0:
            raise UserError(f"test_fraction must be in [0, 1), got {test_fraction}")
        self.path, self.test_path = Path(path), test_path
        super().__init__(path, name=name, split=test_fraction, test_source=test_path, seed=seed)

"""Your own prompts from a JSONL file: one JSON object per line.

Each line needs string fields ``prompt`` and ``answer``; ``task`` (a label, e.g. a subject)
and ``solution`` (a worked completion) are optional strings. Blank lines are skipped::

    {"prompt": "What is 1/2 + 1/4?", "answer": "3/4"}
    {"prompt": "Compute 12 + 7.", "answer": "19", "task": "arith", "solution": "... \\boxed{19}"}

Usage::

    task = JsonlTask("data/train.jsonl")                       # 10% held out, seeded
    task = JsonlTask("train.jsonl", test_path="test.jsonl")   # explicit test file
    task.examples("test"); task.reward(completion, example)

A JSONL file is read like any other data file, by :class:`opd.tasks.dataset.DatasetTask` (other
field names, answer formats and chat messages work the same way). This module adds what the
``datasets`` JSON reader cannot say: which line of a file is bad (:func:`find_bad_line`), used
whenever a JSON file fails to load or fails the row checks. Completions are graded by their last
``\\boxed{...}`` against ``answer`` (``opd.grading``). Problems raise ``opd.errors.UserError``
naming the file, the line and the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from opd.errors import UserError
from opd.tasks.dataset import DatasetTask

__all__ = ["JsonlTask", "check_not_empty", "find_bad_line"]


def check_not_empty(path: Path) -> None:
    with path.open(encoding="utf-8") as f:
        if any(line.strip() for line in f):
            return
    raise UserError(f'JSONL file {path} is empty: add one {{"prompt": "...", "answer": "..."}} object per line')


def _check_value(key: str, value, where: str, chat: bool = False) -> None:
    if isinstance(value, str):
        return
    if chat and isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        from opd.tasks.rows import from_messages

        try:
            from_messages(value)
        except ValueError as e:
            raise UserError(
                f'field "{key}" in {where} {e}; give every chat a user turn, with string "role" and "content"'
            ) from None
        return
    fix = f'quote it: "{key}": "{value}"' if isinstance(value, (int, float)) else "write it as one JSON string"
    raise UserError(f'field "{key}" in {where} is a {type(value).__name__}, not a string: {fix}')


def find_bad_line(path: Path, required: tuple = (), optional: tuple = ()) -> None:
    """Raise UserError naming the first line of ``path`` that is not a JSON object whose
    ``required`` fields are strings (or chat messages) and whose ``optional`` fields are strings
    or null. Returns when every line is fine. None entries of ``required``/``optional`` are skipped."""
    required = tuple(k for k in required if k)
    optional = tuple(k for k in optional if k)
    needs = " and ".join(f'"{k}"' for k in required)
    with path.open(encoding="utf-8") as f:
        if f.read(4096).lstrip().startswith("["):  # one JSON array, not JSON Lines: rows are named instead
            return
        f.seek(0)
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"invalid JSON in {where}: {e.msg} (column {e.colno}); each line must be one complete JSON object"
                ) from None
            if not isinstance(record, dict):
                example = ", ".join(f'"{k}": "..."' for k in required or ("prompt", "answer"))
                raise UserError(f"{where} is a JSON {type(record).__name__}, not an object: write {{{example}}}")
            for key in required:
                if key not in record or record[key] is None:
                    raise UserError(f'{where} has no "{key}" field: every line needs {needs}')
                _check_value(key, record[key], where, chat=key == required[0])  # the prompt may be a chat
            for key in optional:
                if record.get(key) is not None:
                    _check_value(key, record[key], where)


class JsonlTask(DatasetTask):
    """Prompts and answers from JSONL; see the module docstring."""

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

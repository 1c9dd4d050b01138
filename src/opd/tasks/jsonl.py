"""Your own prompts from a JSONL file: one JSON object per line.

Each line needs string fields ``prompt`` and ``answer``; ``task`` (a label, e.g. a subject)
and ``solution`` (a worked completion) are optional strings. Blank lines are skipped::

    {"prompt": "What is 1/2 + 1/4?", "answer": "3/4"}
    {"prompt": "Compute 12 + 7.", "answer": "19", "task": "arith", "solution": "... \\boxed{19}"}

Usage::

    task = JsonlTask("data/train.jsonl")                       # 10% held out, seeded
    task = JsonlTask("train.jsonl", test_path="test.jsonl")   # explicit test file
    task.examples("test"); task.reward(completion, example)

Completions are graded by their last ``\\boxed{...}`` against ``answer`` (``opd.grading``).
Problems in the file raise ``opd.errors.UserError`` naming the file, the line and the fix.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from opd.errors import UserError
from opd.grading import grade
from opd.tasks.base import Example, check_split

__all__ = ["JsonlTask", "load_jsonl_examples"]

_REQUIRED = ("prompt", "answer")
_OPTIONAL = ("task", "solution")


def _parse_line(raw: str, lineno: int, path: Path, default_task: str) -> Example:
    where = f"{path}, line {lineno}"
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise UserError(
            f"invalid JSON in {where}: {e.msg} (column {e.colno}); each line must be one complete JSON object"
        ) from None
    if not isinstance(record, dict):
        raise UserError(
            f'{where} is a JSON {type(record).__name__}, not an object: write {{"prompt": "...", "answer": "..."}}'
        )
    for key in _REQUIRED:
        if key not in record:
            raise UserError(f'{where} has no "{key}" field: every line needs "prompt" and "answer"')
    for key in _REQUIRED + _OPTIONAL:
        value = record.get(key)
        if key in _OPTIONAL and value is None:
            continue
        if not isinstance(value, str):
            fix = f'quote it: "{key}": "{value}"' if isinstance(value, (int, float)) else "write it as one JSON string"
            raise UserError(f'field "{key}" in {where} is a {type(value).__name__}, not a string: {fix}')
    return Example(
        prompt=record["prompt"],
        answer=record["answer"],
        task=record.get("task") or default_task,
        solution=record.get("solution"),
    )


def load_jsonl_examples(path: str | Path, default_task: str = "jsonl") -> list[Example]:
    """Read and validate every line of ``path``; raises UserError on the first bad line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"JSONL file not found: {path} (check the path; it is read relative to {Path.cwd()})")
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                examples.append(_parse_line(raw, lineno, path, default_task))
    if not examples:
        raise UserError(f'JSONL file {path} is empty: add one {{"prompt": "...", "answer": "..."}} object per line')
    return examples


class JsonlTask:
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
        self.name, self.path, self.test_path = name, Path(path), test_path
        examples = load_jsonl_examples(path, default_task=name)
        if test_path is not None:
            self._splits = {"train": examples, "test": load_jsonl_examples(test_path, default_task=name)}
            return
        # Seeded held-out split; kept in file order so that a split is easy to inspect.
        order = list(range(len(examples)))
        random.Random(f"opd-jsonl/{seed}").shuffle(order)
        n_test = round(len(examples) * test_fraction)
        if test_fraction > 0 and len(examples) >= 2:
            n_test = min(max(n_test, 1), len(examples) - 1)
        test_idx = set(order[:n_test])
        self._splits = {
            "train": [e for i, e in enumerate(examples) if i not in test_idx],
            "test": [e for i, e in enumerate(examples) if i in test_idx],
        }

    def examples(self, split: str) -> list[Example]:
        check_split(split)
        return list(self._splits[split])

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if grade(completion, example.answer) else 0.0

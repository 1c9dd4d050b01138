"""Rows of a ``datasets.Dataset`` to :class:`opd.tasks.Example`: the columns a
:class:`opd.tasks.dataset.DatasetTask` names, chat messages, and the checks with their messages.

Usage: ``convert_rows(ds, "data.parquet", task, json_files=[])`` (``task`` gives ``fields``,
``name``, ``system_prompt``, ``answer_format`` and ``reference``). Each kind of problem is counted
over the whole split and reported once, with its first row and the option that fixes it; for
JSON files the first bad line is named instead (:func:`find_bad_line`, also used when a JSON file fails to load).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd.errors import UserError
from opd.tasks.task import Example

__all__ = ["check_not_empty", "convert_rows", "find_bad_line", "from_messages"]

MESSAGES = "messages"
LABEL = "task"


@dataclass
class _Problems:
    """Rows with one kind of problem: how many, the first one, and what fixes it."""

    what: str
    fix: str
    rows: list[tuple[int, str]] = field(default_factory=list)

    def add(self, row: int, detail: str) -> None:
        self.rows.append((row, detail))


def from_messages(messages: Any) -> tuple[str, str | None, str | None]:
    """``(question, system, solution)`` of a chat: the last user turn, the system turn before it,
    and the assistant turn right after it. Raises ValueError (a message for the user) otherwise."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError("is not a list of {role, content} messages with string values")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError(f"has no user turn (roles: {', '.join(m['role'] for m in messages) or 'none'})")
    last = users[-1]
    systems = [m["content"] for m in messages[:last] if m["role"] == "system"]
    after = messages[last + 1 : last + 2]
    solution = after[0]["content"] if after and after[0]["role"] == "assistant" else None
    return messages[last]["content"], (systems[-1] if systems else None), solution


def _columns(columns: list[str], fields: dict[str, str], where: str, flag: str) -> tuple[str, str | None, str | None]:
    listed = ", ".join(columns)
    prompt = fields["prompt"]
    if prompt not in columns:
        if prompt != "prompt" or MESSAGES not in columns:
            raise UserError(
                f"{where} has no column {prompt!r} (its columns: {listed}); name the column of prompts with "
                f"--{flag}prompt-field (a chat {MESSAGES!r} column is used when there is no 'prompt' column)"
            )
        prompt = MESSAGES
    answer = fields["answer"] if fields["answer"] in columns else None
    solution = fields["solution"] if fields["solution"] in columns else None
    return prompt, answer, solution


def _text(value: Any, row: int, column: str | None, problems: dict[str, _Problems]) -> str | None:
    """A string cell, or None (recorded as a problem unless the cell is empty/absent)."""
    if value is None or isinstance(value, str):
        return value
    problems["type"].add(row, f"{column!r} is a {type(value).__name__} ({str(value)[:40]!r})")
    return None


def _problem_kinds(flag: str, fmt: str) -> dict[str, _Problems]:
    return {
        "prompt": _Problems(
            "prompts are not usable",
            f"--{flag}prompt-field must name a column of non-empty strings or of chat messages with a user turn",
        ),
        "type": _Problems("values are not strings", "store that column as text (e.g. cast it to string)"),
        "missing": _Problems(
            "rows have no reference answer",
            f"fill or drop those rows, or name another column with --{flag}answer-field",
        ),
        "format": _Problems(
            f"reference answers cannot be read as --{flag}answer-format {fmt}",
            f"choose the --{flag}answer-format that matches (gsm8k for '#### 42', boxed for \\boxed{{}}, "
            f"last_number, exact, regex:PATTERN) or another --{flag}answer-field",
        ),
    }


def _read_prompt(value: Any) -> tuple[str, str | None, str | None]:
    """``(question, system, solution)`` of a prompt cell: a string, or chat messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is empty")
        return value, None, None
    if isinstance(value, list):
        return from_messages(value)
    if value is None:
        raise ValueError("is missing (null)")
    raise ValueError(f"is a {type(value).__name__}, neither a string nor chat messages")


def convert_rows(ds: Any, where: str, task: Any, json_files: list[Path]) -> list[Example]:
    flag = task.flag_prefix
    prompt_col, answer_col, solution_col = _columns(ds.column_names, task.fields, where, flag)
    label_col = LABEL if LABEL in ds.column_names and LABEL not in (prompt_col, answer_col, solution_col) else None
    problems = _problem_kinds(flag, task.answer_format)
    if answer_col is None and solution_col is None and prompt_col != MESSAGES:
        raise UserError(
            f"{where} has no column {task.fields['answer']!r} (its columns: {', '.join(ds.column_names)}); name the "
            f"column of reference answers with --{flag}answer-field, or of worked solutions with "
            f"--{flag}solution-field (their final answer is then read with --{flag}answer-format)"
        )
    used = [c for c in dict.fromkeys((prompt_col, answer_col, solution_col, label_col)) if c]
    examples = []
    for row, record in enumerate(ds.select_columns(used).to_list(), start=1):
        try:
            prompt, chat_system, chat_solution = _read_prompt(record[prompt_col])
        except ValueError as e:
            problems["prompt"].add(row, f"{prompt_col!r} {e}")
            continue
        system = task.system_prompt or chat_system
        solution = _text(record.get(solution_col), row, solution_col, problems) or chat_solution
        raw = record[answer_col] if answer_col else None
        ref_text = _text(raw, row, answer_col, problems)
        if raw is not None and ref_text is None:  # a type problem, already recorded
            continue
        from_solution = ref_text is None  # a row without an answer reads it from its solution
        ref_text = solution if from_solution else ref_text
        if ref_text is None:
            problems["missing"].add(row, f"no {answer_col or task.fields['answer']!r} value and no solution")
            continue
        answer = task.reference(ref_text, from_solution=from_solution)
        if answer is None:
            problems["format"].add(row, f"{ref_text[-80:]!r}")
            continue
        label = _text(record.get(label_col), row, LABEL, problems) if label_col else None
        examples.append(Example(prompt, answer, label or task.name, solution, system))
    _raise_first(problems, where, ds.num_rows, json_files, (prompt_col, answer_col, solution_col, label_col))
    return examples


def _raise_first(problems: dict[str, _Problems], where: str, n: int, json_files: list[Path], columns: tuple) -> None:
    """Raise the first kind of problem found; ``columns``: (prompt, answer, solution, label), None if unused."""
    found = [p for p in problems.values() if p.rows]
    if not found:
        return
    if json_files and any(p is not problems["format"] for p in found):
        # datasets merges JSON columns of mixed types (reading the string "1" as the number 1)
        # and rows lose their line numbers; the line reader names the exact line instead.
        for f in json_files:
            find_bad_line(f, columns[:2], optional=columns[2:])
    p = found[0]
    row, detail = p.rows[0]
    raise UserError(f"{len(p.rows)} of {n} {p.what} in {where}, e.g. row {row}: {detail}; {p.fix}")


# ----------------------------------------------------------------------------- JSON Lines files


def check_not_empty(path: Path) -> None:
    with path.open(encoding="utf-8") as f:
        if any(line.strip() for line in f):
            return
    raise UserError(f'JSONL file {path} is empty: add one {{"prompt": "...", "answer": "..."}} object per line')


def _check_value(key: str, value, where: str, chat: bool = False) -> None:
    if isinstance(value, str):
        return
    if chat and isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
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

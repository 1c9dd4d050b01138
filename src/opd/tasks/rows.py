"""Rows of a ``datasets.Dataset`` to :class:`opd.tasks.Example`: the columns a
:class:`opd.tasks.dataset.DatasetTask` names, chat messages, and the checks with their messages.

Usage: ``convert_rows(ds, "data.parquet", task, json_files=[])`` (``task`` gives ``fields``,
``name``, ``system_prompt``, ``answer_format`` and ``reference``). Each kind of problem is counted
over the whole split and reported once, with its first row and the option that fixes it; for
JSON files the first bad line is named instead (:func:`find_bad_line`, also used when a JSON file fails to load).

Answers are optional: a row with neither an answer nor a solution whose final answer reads in the
answer format is a prompt without a reference (``Example.answer`` None): it trains, and is not
graded. A conversation is kept whole up to its last user turn (:func:`from_messages`); a ``tools``
column holds each row's tool schemas (:func:`read_tools`), which the chat template lists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opd.errors import UserError
from opd.tasks.task import Example

__all__ = ["check_not_empty", "check_utf8", "convert_rows", "find_bad_line", "from_messages", "read_tools"]

MESSAGES = "messages"
LABEL = "task"
TOOLS = "tools"
DEFAULT_ANSWER = "answer"  # a column by this name is optional: without it, prompts are not graded


@dataclass
class _Problems:
    """Rows with one kind of problem: how many, the first one, and what fixes it."""

    what: str
    fix: str
    rows: list[tuple[int, str]] = field(default_factory=list)

    def add(self, row: int, detail: str) -> None:
        self.rows.append((row, detail))


def _clean(value: Any) -> Any:
    """``value`` without null entries: ``datasets`` gives every struct in a column all the fields any row
    has, the missing ones null (a plain message would get ``tool_calls: None``, a schema every property)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def read_tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    """A ``tools`` cell as the JSON schemas the chat template lists: a list of objects, or its JSON text;
    None for no tools (null, empty). Raises ValueError (a message for the user) otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        kind = "list" if isinstance(value, list) else type(value).__name__
        raise ValueError(f"is a {kind}{' holding non-objects' if kind == 'list' else ''}, not a list of objects")
    return tuple(_clean(t) for t in value) or None


def _check_turn(m: Any) -> dict[str, Any]:
    """One message, cleaned; its content a string ("" for an assistant turn that only calls tools)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError("is not a list of {role, content} messages with string roles")
    m = _clean(m)
    if m.get("content") is None and m.get("tool_calls"):
        m["content"] = ""
    if not isinstance(m.get("content"), str):
        raise ValueError(f"has a {m['role']!r} turn whose content is not a string (text content only)")
    return m


def from_messages(messages: Any) -> tuple[list[dict[str, Any]], str, str | None]:
    """``(history, question, solution)`` of a chat: every turn up to and including the last user
    turn (system, user, assistant and tool turns alike), that turn's text, and the text of the
    assistant turn right after it. A chat that goes on after its last user turn (the assistant's
    answer, tool calls) is cut there: what follows is not the prompt. Raises ValueError (a message
    for the user) when it is not a list of messages with a user turn."""
    if not isinstance(messages, list):
        raise ValueError("is not a list of {role, content} messages")
    turns = [_check_turn(m) for m in messages]
    users = [i for i, m in enumerate(turns) if m["role"] == "user"]
    if not users:
        raise ValueError(f"has no user turn (roles: {', '.join(m['role'] for m in turns) or 'none'})")
    last = users[-1]
    after = turns[last + 1 : last + 2]
    solution = after[0]["content"] if after and after[0]["role"] == "assistant" else None
    return turns[: last + 1], turns[last]["content"], solution or None


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
    if fields["answer"] not in columns and fields["answer"] != DEFAULT_ANSWER:
        raise UserError(
            f"{where} has no column {fields['answer']!r} (its columns: {listed}); fix --{flag}answer-field, or leave "
            "it out for prompts without reference answers (they train, and are not graded)"
        )
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
        "tools": _Problems(
            f"{TOOLS!r} values are not lists of tool schemas",
            'give each row a JSON list of objects (e.g. [{"type": "function", "function": {"name": ...}}]), '
            "as a list or its JSON text, or null for none",
        ),
        "format": _Problems(
            f"reference answers cannot be read as --{flag}answer-format {fmt}",
            f"choose the --{flag}answer-format that matches (gsm8k for '#### 42', boxed for \\boxed{{}}, "
            f"last_number, exact, regex:PATTERN) or another --{flag}answer-field",
        ),
    }


def _read_prompt(value: Any) -> tuple[str, list[dict[str, Any]] | None, str | None]:
    """``(question, history, solution)`` of a prompt cell: a string (no history), or chat messages."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("is empty")
        return value, None, None
    if isinstance(value, list):
        history, question, solution = from_messages(value)
        return question, history, solution
    if value is None:
        raise ValueError("is missing (null)")
    raise ValueError(f"is a {type(value).__name__}, neither a string nor chat messages")


def _plain(history: list[dict[str, Any]] | None, system_prompt: str) -> tuple[tuple[dict, ...] | None, str | None]:
    """``(messages, system)`` of an example: a history of one user turn (after a system turn or not) is
    the plain prompt and its system text, as a string prompt is; a longer one stays whole. A
    ``system_prompt`` takes the place of the conversation's system turns."""
    if history is None:
        return None, system_prompt or None
    if system_prompt:
        history = [{"role": "system", "content": system_prompt}, *(m for m in history if m["role"] != "system")]
    roles = [m["role"] for m in history]
    simple = roles in (["user"], ["system", "user"]) and all(set(m) == {"role", "content"} for m in history)
    if simple:
        return None, history[0]["content"] if len(history) == 2 else None
    return tuple(history), None


@dataclass
class _Columns:
    prompt: str
    answer: str | None
    solution: str | None
    label: str | None
    tools: str | None


def _row_example(record: dict, row: int, cols: _Columns, task: Any, problems: dict[str, _Problems]) -> Example | None:
    """One row as an Example, or None with its problem recorded."""
    try:
        prompt, history, chat_solution = _read_prompt(record[cols.prompt])
    except ValueError as e:
        problems["prompt"].add(row, f"{cols.prompt!r} {e}")
        return None
    try:
        tools = read_tools(record.get(cols.tools)) if cols.tools else None
    except ValueError as e:
        problems["tools"].add(row, f"{TOOLS!r} {e}")
        return None
    messages, system = _plain(history, task.system_prompt)
    template = getattr(task, "prompt_template", "")
    if template and history is None:  # a preset's wording around a plain question (str.replace: \boxed{} has braces)
        prompt = template.replace("{prompt}", prompt)
    solution = _text(record.get(cols.solution), row, cols.solution, problems) or chat_solution
    raw = record[cols.answer] if cols.answer else None
    ref_text = _text(raw, row, cols.answer, problems)
    if raw is not None and ref_text is None:  # a type problem, already recorded
        return None
    answer = None
    if ref_text is not None:
        answer = task.reference(ref_text, from_solution=False)
        if answer is None:
            problems["format"].add(row, f"{ref_text[-80:]!r}")
            return None
    elif solution is not None:  # without a reference: the solution's final answer, if it has one
        answer = task.reference(solution, from_solution=True)
    label = _text(record.get(cols.label), row, LABEL, problems) if cols.label else None
    return Example(prompt, answer, label or task.name, solution, system, messages, tools)


def convert_rows(ds: Any, where: str, task: Any, json_files: list[Path]) -> list[Example]:
    flag = task.flag_prefix
    prompt_col, answer_col, solution_col = _columns(ds.column_names, task.fields, where, flag)
    named = (prompt_col, answer_col, solution_col)
    label_col = LABEL if LABEL in ds.column_names and LABEL not in named else None
    tools_col = TOOLS if TOOLS in ds.column_names and TOOLS not in named else None
    cols = _Columns(prompt_col, answer_col, solution_col, label_col, tools_col)
    problems = _problem_kinds(flag, task.answer_format)
    used = [c for c in dict.fromkeys((*named, label_col, tools_col)) if c]
    examples = []
    for row, record in enumerate(ds.select_columns(used).to_list(), start=1):
        example = _row_example(record, row, cols, task, problems)
        if example is not None:
            examples.append(example)
    _raise_first(problems, where, ds.num_rows, json_files, cols)
    return examples


def _raise_first(problems: dict[str, _Problems], where: str, n: int, json_files: list[Path], cols: _Columns) -> None:
    """Raise the first kind of problem found (``cols``: the columns read, None where unused)."""
    found = [p for p in problems.values() if p.rows]
    if not found:
        return
    if json_files and any(p is not problems["format"] for p in found):
        # datasets merges JSON columns of mixed types (reading the string "1" as the number 1)
        # and rows lose their line numbers; the line reader names the exact line instead.
        for f in json_files:
            find_bad_line(f, (cols.prompt,), optional=(cols.answer, cols.solution, cols.label), tools=cols.tools)
    p = found[0]
    row, detail = p.rows[0]
    raise UserError(f"{len(p.rows)} of {n} {p.what} in {where}, e.g. row {row}: {detail}; {p.fix}")


# ----------------------------------------------------------------------------- JSON Lines files


def check_utf8(path: Path) -> None:
    """UserError naming the first byte of the text file ``path`` that is not UTF-8 (its line, column and
    value) and the fix; a reader would otherwise stop at it with a UnicodeDecodeError, or a vague message."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):  # a UTF-8 character never spans a newline byte
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{path}, line {lineno}, column {e.start + 1}: byte 0x{raw[e.start]:02x} is not UTF-8 (the file "
                    "is in another encoding, e.g. latin-1 or cp1252); re-save it as UTF-8"
                ) from None


def check_not_empty(path: Path) -> None:
    check_utf8(path)
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


def find_bad_line(path: Path, required: tuple = (), optional: tuple = (), tools: str | None = None) -> None:
    """Raise UserError naming the first line of ``path`` that is not a JSON object whose
    ``required`` fields are strings (or chat messages), whose ``optional`` fields are strings
    or null and whose ``tools`` field (if named) is tool schemas (:func:`read_tools`). Returns when every
    line is fine. None entries of ``required``/``optional`` are skipped."""
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
            if tools:
                _check_tools(tools, record.get(tools), where)


def _check_tools(key: str, value: Any, where: str) -> None:
    try:
        read_tools(value)
    except ValueError as e:
        raise UserError(
            f'field "{key}" in {where} {e}; write a JSON list of tool schemas, e.g. '
            '[{"type": "function", "function": {"name": "add", "parameters": {...}}}], or null'
        ) from None

"""Per-sample evaluation records: what the model wrote for every evaluated prompt, the answer read from
it, the reference and the verdict, so that a grader's mistake can be seen (a figure alone hides it).

Where they are written (JSON Lines, one record per response):

* ``opd eval``: ``OUT/eval_samples.jsonl``;
* each evaluation of a training run: ``RUN/eval_samples/step_0000049.jsonl``, named by the ``step`` its
  ``eval/`` line in metrics.jsonl has (and its checkpoint folder), a multi-task run's task under
  ``RUN/tasks/NAME/eval_samples/``.

Fields: ``item`` (the prompt's or game's index in the held-out list), ``sample`` (-1: the greedy
response; 0, 1, ...: the samples), ``prompt``, ``response``, ``answer`` (extracted in the task's answer
format; None: none found, or a game), ``reference``, ``correct``, ``tokens`` (the response's length),
``truncated`` (it ran out of tokens: no EOS; a game: cut by its limits); games add ``end``, ``turns``,
``error``.

Size rule: a prompt or response longer than ``--eval-record-chars`` (default 8000) characters keeps its
first quarter and last three quarters around a marker saying how many characters were cut, so one file
is at most about items x (1 + samples) x 2 x that many characters (200 prompts, 4 samples: about 16 MB);
``--eval-record-chars 0`` writes none. The place is checked writable before the evaluation runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from opd.errors import UserError

__all__ = ["check_writable", "read_records", "step_records", "write_records"]


def step_records(folder: Path, step: int) -> Path:
    """The records file of the evaluation at ``step`` (as metrics.jsonl counts it) in a run's (or task's) folder."""
    return folder / "eval_samples" / f"step_{step:07d}.jsonl"


def check_writable(path: Path) -> None:
    """A UserError naming ``path`` when its folder cannot be made or written: found before an evaluation
    spends its time."""
    folder = path.parent
    if path.exists() and not path.is_file():
        raise UserError(
            f"cannot write the evaluation records {path}: it is a folder; remove it or choose another --out"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".opd-write-check-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(
            f"cannot write the evaluation records {path} ({e.strerror or e}); choose a writable --out, "
            "or --eval-record-chars 0 to keep no records"
        ) from None


def write_records(path: Path, records: list[dict]) -> None:
    """``records`` as JSON Lines at ``path`` (replaced whole: written beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_records(path: Path) -> list[dict]:
    """The records of one file (a line that does not parse, e.g. a file cut by a crash, is skipped)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out

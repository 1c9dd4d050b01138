"""Progress display for long work (rich), silenced on non-zero ranks and when disabled."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def is_main_process() -> bool:
    """Rank 0 of a torchrun/accelerate launch (``RANK`` unset means a single process)."""
    return int(os.environ.get("RANK", "0")) == 0


class _Bar:
    def __init__(self, progress: Progress | None, task_id):
        self._progress, self._task = progress, task_id

    def advance(self, n: int = 1, **fields) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=n, **fields)

    def describe(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, info=text)


@contextmanager
def progress_bar(label: str, total: int, enabled: bool = True) -> Iterator[_Bar]:
    if not (enabled and is_main_process()):
        yield _Bar(None, None)
        return
    columns = (
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
    )
    with Progress(*columns, transient=False) as progress:
        yield _Bar(progress, progress.add_task(label, total=total, info=""))

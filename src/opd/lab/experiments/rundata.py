"""What an experiment's analysis reads from its runs, kept so that the analysis can run again without them.

``opd experiment NAME`` records: every read of a run's files goes through :class:`RunData`, which
keeps only the parts the analysis looked at (of each metrics record, the keys it read; of a
``DONE.json``, the fields it read), and the recording is written as ``OUT/NAME/data.json``.
``opd results`` replays it: the same analysis runs on that file instead of the run folders, so every
table, interval and verdict of ``docs/RESULTS.md`` is recomputed from data committed beside it
(``docs/results/NAME/data.json``). Floats survive the JSON round trip exactly (``repr``), so a
replay gives the numbers the recording run gave.

What a record holds, per run and file: the values read, at the positions they were read from; a
record of which nothing was read stays as ``{}`` (so counts and positions hold); a file the analysis
found missing is ``null``. Values an analysis derives from large files (the logged rollouts) go
through :meth:`RunData.derived`, which keeps the derived value, not the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from opd.errors import UserError


class _Tracked(dict):
    """A dict that remembers which of its keys were read (a nested dict or list is tracked in turn)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._seen: set = set()

    def _child(self, key):
        value = dict.__getitem__(self, key)
        wrapped = _track(value)
        if wrapped is not value:
            dict.__setitem__(self, key, wrapped)
        self._seen.add(key)
        return wrapped

    def __getitem__(self, key):
        return self._child(key)

    def get(self, key, default=None):
        return self._child(key) if dict.__contains__(self, key) else default

    def __contains__(self, key) -> bool:
        present = dict.__contains__(self, key)
        if present:  # "key in r" decides what an analysis keeps: the value goes with it
            self._child(key)
        return present

    # Iterating reads every key (dict(), **, items() and json.dumps come through these).
    def keys(self):
        keys = list(dict.keys(self))
        for k in keys:
            self._child(k)
        return keys

    def __iter__(self):
        return iter(self.keys())

    def items(self):
        return [(k, self._child(k)) for k in list(dict.keys(self))]

    def values(self):
        return [v for _, v in self.items()]

    def pruned(self) -> dict:
        return {k: _prune(dict.__getitem__(self, k)) for k in dict.keys(self) if k in self._seen}


def _track(value):
    if isinstance(value, _Tracked) or not isinstance(value, dict | list):
        return value
    if isinstance(value, dict):
        return _Tracked(value)
    tracked = [_track(v) for v in value]
    value[:] = tracked  # in place: the list read again later is the same, tracked list
    return value


def _prune(value):
    if isinstance(value, _Tracked):
        return value.pruned()
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def _encode(value):
    """JSON for a derived value, keeping what JSON alone would change: non-string keys and tuples."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: _encode(v) for k, v in value.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, dict):
        if set(value) == {"__items__"}:
            return {_decode(k): _decode(v) for k, v in value["__items__"]}
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


class RunData:
    """Reads of an experiment's run files: from the run folders (recording) or from a recording (replay);
    with both, the runs named in ``kept`` are read from the recording and the others from their folders
    (``opd experiment --recorded``: runs recorded earlier and not made again)."""

    def __init__(self, runs: Path | None, recorded: dict | None = None, kept: Iterable[str] = ()) -> None:
        self.runs, self.replay, self.kept = runs, runs is None, frozenset(kept)
        recorded = recorded or {}
        # what was read (the recording to write); in a replay, everything recorded
        self._files: dict[str, Any] = dict(recorded.get("files", {})) if self.replay else {}
        self._derived: dict[str, Any] = dict(recorded.get("derived", {})) if self.replay else {}
        # where the kept runs' reads come from
        self._kept_files, self._kept_derived = recorded.get("files", {}), recorded.get("derived", {})

    def _kept_key(self, key: str) -> bool:
        """A derived value of a kept run: its key names the run between colons (``name:RUN[:...]``)."""
        return any(part in self.kept for part in key.split(":"))

    @staticmethod
    def load_recording(path: Path) -> dict:
        """The content of a ``data.json``; an error naming the file when it is not one."""
        try:
            found = json.loads(Path(path).read_text())
            if not isinstance(found, dict) or not isinstance(found.get("files"), dict):
                raise ValueError("no 'files' mapping")
            return found
        except (OSError, ValueError) as exc:
            raise UserError(
                f"{path} is not run data written by `opd experiment` ({exc}); rerun the experiment"
            ) from exc

    @classmethod
    def load(cls, path: Path) -> RunData:
        return cls(None, cls.load_recording(path))

    def read(self, run: str, file: str) -> Any:
        """A run's JSON file (a ``.jsonl`` one as a list of records, blank lines skipped); None when missing."""
        key = f"{run}/{file}"
        if self.replay or run in self.kept:
            if key not in self._files and key in self._kept_files:
                self._files[key] = self._kept_files[key]
            if key not in self._files:
                raise UserError(
                    f"the recorded run data has no {key}: the analysis now reads more than it did when the data was "
                    "recorded; rerun the experiment (opd experiment NAME) to record it again"
                )
            return self._files[key]
        if key not in self._files:
            path = cast(Path, self.runs) / run / file  # None only when replaying
            if not path.is_file():
                self._files[key] = None
            else:
                text = path.read_text()
                parsed = [json.loads(x) for x in text.splitlines() if x.strip()] if file.endswith(".jsonl") else None
                self._files[key] = _track(parsed if parsed is not None else json.loads(text))
        return self._files[key]

    def derived(self, key: str, compute: Callable[[Path], Any]) -> Any:
        """``compute(runs folder)``, kept under ``key``: for values drawn from files too large to keep."""
        if self.replay or self._kept_key(key):
            if key not in self._derived and key in self._kept_derived:
                self._derived[key] = self._kept_derived[key]
            if key not in self._derived:
                raise UserError(f"the recorded run data has no derived value {key!r}; rerun the experiment")
            return _decode(self._derived[key])
        if key not in self._derived:
            self._derived[key] = _encode(compute(cast(Path, self.runs)))  # None only when replaying
        return _decode(self._derived[key])

    def recording(self) -> dict:
        """What was read, pruned to what the analysis looked at (the content of ``data.json``)."""
        return {"files": {k: _prune(v) for k, v in self._files.items()}, "derived": self._derived}

    def write(self, path: Path) -> None:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.recording(), separators=(",", ":")) + "\n")
        tmp.replace(path)

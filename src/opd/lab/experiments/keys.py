"""What an experiment's run depends on, as one key: reuse a finished run only when nothing it read changed.

A run's key is a SHA-256 over its command line (:func:`opd.lab.experiments.core.command_line`: every
setting that differs from its default) and over each file or folder its settings name (a model
folder, a data file, a tasks file): a path inside another run of the plan (its directory, or the
folder a python step writes, its ``out`` parameter) contributes that run's key, so keys chain; any
other path contributes a digest of its bytes (names and contents of every file under it). So a
teacher replaced at the same path, or an earlier run of the plan made again with other settings,
changes the key of every run that reads it, and those runs are made again.

Not in the key: opd's own code (a changed loss with the same command reuses the run), and what a run
reads without naming it (a built-in task's generator, the environment's installed games).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def path_digest(path: Path, memo: dict[Path, str]) -> str:
    """SHA-256 over the names and bytes of ``path`` (a file, or every file under a folder, in order)."""
    path = path.resolve()
    if path not in memo:
        h = hashlib.sha256()
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            h.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0")
            with f.open("rb") as fh:
                while chunk := fh.read(_CHUNK):
                    h.update(chunk)
        memo[path] = h.hexdigest()
    return memo[path]


def named_paths(config: Any) -> Iterator[Path]:
    """The absolute or relative paths a run's settings name (values with a ``/``), its own output left out."""
    if dataclasses.is_dataclass(config):
        items = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    elif isinstance(config, dict):
        items = list(config.items())
    else:
        items = [("", config)]
    for name, value in items:
        if name == "out":  # what the run writes, not what it reads
            continue
        if isinstance(value, str) and "/" in value:
            yield Path(value)
        elif isinstance(value, (list, tuple, dict)) or dataclasses.is_dataclass(value):
            yield from named_paths(value if not isinstance(value, (list, tuple)) else dict(enumerate(value)))


def outputs(spec, run_dir: Path) -> list[Path]:
    """Where a run writes: its directory, and a python step's ``out`` folder."""
    where = [run_dir.resolve()]
    if spec.kind == "python" and isinstance(spec.config, dict) and "out" in spec.config:
        where.append(Path(spec.config["out"]).resolve())
    return where


class Keys:
    """The keys of a plan's runs, computed once (before any run starts) and chained through outputs."""

    def __init__(self, specs: list, run_dir, command_line):
        self.specs = {s.name: s for s in specs}
        self.run_dir, self.command_line = run_dir, command_line
        self.keys: dict[str, str] = {}
        self.digests: dict[Path, str] = {}
        self.owners = [(where, s.name) for s in specs for where in outputs(s, run_dir(s.name))]

    def __getitem__(self, name: str) -> str:
        if name not in self.keys:
            spec = self.specs[name]
            h = hashlib.sha256(self.command_line(spec, self.run_dir(name)).encode())
            for path in sorted({p.resolve() for p in named_paths(spec.config)}):
                owner = self._owner(path, name)
                if owner is not None:
                    h.update(f"\n{path} <- run {owner} {self[owner]}".encode())
                elif path.exists():
                    h.update(f"\n{path} {path_digest(path, self.digests)}".encode())
            self.keys[name] = h.hexdigest()
        return self.keys[name]

    def inputs(self, name: str) -> set[str]:
        """The runs of the plan whose outputs run ``name`` reads."""
        paths = {p.resolve() for p in named_paths(self.specs[name].config)}
        return {owner for p in paths if (owner := self._owner(p, name)) is not None}

    def _owner(self, path: Path, reader: str) -> str | None:
        """The run of the plan that writes ``path`` (the deepest such folder), if any."""
        found = [(len(w.parts), n) for w, n in self.owners if n != reader and path.is_relative_to(w)]
        return max(found)[1] if found else None

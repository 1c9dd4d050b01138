"""Which code made a file: the opd version and the source commit, for run records and model cards."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def source_commit() -> str:
    """The commit of the opd source running now (``-dirty`` when its tracked files differ from it), or
    "unknown" outside a git checkout: each run and result names the code that made it. ``OPD_COMMIT``,
    where set, names it instead: a copy of the tree sent to another machine may travel without its
    .git, or with one that is not the tree's (a lent GPU machine's copy had the session's first commit)."""
    if os.environ.get("OPD_COMMIT"):
        return os.environ["OPD_COMMIT"]
    src = Path(__file__).resolve().parents[1]  # the opd package
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno", "--", "."], cwd=src, capture_output=True)
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")

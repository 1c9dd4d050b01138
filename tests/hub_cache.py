"""huggingface_hub's cache, laid out by the tests (no network): ``HUB/models--ORG--NAME/refs/<revision>``
holds a commit hash and ``snapshots/<hash>/`` the files, as ``hf download`` leaves them; datasets the same
under ``datasets--ORG--NAME``. The ``hub`` fixture points huggingface_hub at an empty cache, offline."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty Hub cache under ``tmp_path/hf/hub`` (HF_HOME=tmp_path/hf), offline, for this test only."""
    from huggingface_hub import constants

    from opd import hub as opd_hub

    home = tmp_path / "hf"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the environment once, at import: its constants are what it uses
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    opd_hub.snapshot.cache_clear()
    yield cache
    opd_hub.snapshot.cache_clear()


def commit_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def cache_repo(cache: Path, repo_id: str, files: Path | dict, repo_type: str = "model", revision: str = "main") -> Path:
    """Put ``files`` (a folder to copy, or {relative path: text}) in the cache as ``repo_id`` at the branch or
    tag ``revision``; returns the snapshot folder (its name is the commit hash)."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = commit_of(f"{repo_id}@{revision}")
    snap = repo / "snapshots" / commit
    if isinstance(files, dict):
        for rel, text in files.items():
            (snap / rel).parent.mkdir(parents=True, exist_ok=True)
            (snap / rel).write_text(text)
    else:
        shutil.copytree(files, snap, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snap

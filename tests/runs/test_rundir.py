"""Run directories: files written atomically end up with ordinary permissions, ranks > 0 write nothing."""

from __future__ import annotations

import os
import stat

import pytest

from opd.models.loading import load_model, load_tokenizer
from opd.runs.rundir import RunDir, save_final_model


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(p):
    return stat.S_IMODE(p.stat().st_mode)


def test_atomic_writes_get_the_usual_permissions(tiny_models, tmp_path, umask_022):
    student, _ = tiny_models
    run = RunDir(tmp_path / "run", enabled=True)
    run.write_json("summary.json", {"a": 1})
    run.write_jsonl("eval.jsonl", [{"prompt": "p", "answer": "1"}])
    model, tok = load_model(student), load_tokenizer(student)
    ckpt = run.save_checkpoint(3, model, {"step": 3})
    save_final_model(tmp_path / "run" / "final", model, tok)
    files = [
        tmp_path / "run" / "summary.json",
        tmp_path / "run" / "eval.jsonl",
        *[p for p in ckpt.rglob("*") if p.is_file()],
        *[p for p in (tmp_path / "run" / "final").rglob("*")],
    ]
    assert any(p.name == "model.safetensors" for p in files)
    for p in files:
        assert mode(p) == 0o644, f"{p} has mode {oct(mode(p))}"
    for d in (ckpt, ckpt / "model", tmp_path / "run" / "final"):
        assert mode(d) == 0o755, f"{d} has mode {oct(mode(d))}"


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    run = RunDir(tmp_path / "run")
    run.write_json("summary.json", {"a": 1})
    run.log_metrics({"step": 0})
    assert not (tmp_path / "run").exists()

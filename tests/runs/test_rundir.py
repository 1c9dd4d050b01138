"""Run directories: files written atomically end up with ordinary permissions, ranks > 0 write nothing; a
folder is claimed for one command (its marker, or its layout for folders written before the marker)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from helpers import cfg_for

from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.report.load import load_run
from opd.runs.rundir import MARKER, RunDir, claim, run_owner, save_final_model
from opd.training import loop as train_mod

ASSETS = Path(__file__).parents[2] / "src" / "opd" / "assets"


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


# ----------------------------------------------------------------------------- ownership


@pytest.mark.parametrize("run", sorted(ASSETS.glob("*/runs/*")), ids=lambda p: f"{p.parts[-3]}/{p.name}")
def test_the_packaged_runs_from_before_the_marker_are_known_as_sft_runs(run):
    assert not (run / MARKER).exists()  # written before the marker existed: known by their layout
    assert run_owner(run) == "sft"


def test_owners_by_marker_and_by_layout(tiny_models, tmp_path):
    (tmp_path / "model").mkdir()
    for f in tiny_models[0].iterdir():
        (tmp_path / "model" / f.name).write_bytes(f.read_bytes())
    assert run_owner(tmp_path / "model") is None  # a Hugging Face model folder is no run
    train_run = tmp_path / "train"
    (train_run / "checkpoints").mkdir(parents=True)
    (train_run / "config.json").write_text(json.dumps({"objective": {"objective": "lsm", "k": 32}}))  # sections
    assert run_owner(train_run) == "train"
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "eval.json").write_text("{}")
    assert run_owner(tmp_path / "eval") == "eval"
    (tmp_path / "begun").mkdir()  # opd experiment began a train run there, killed before its config
    (tmp_path / "begun" / "STARTED.json").write_text('{"command": "x", "key": "y"}')
    assert run_owner(tmp_path / "begun") == "train"
    (tmp_path / "begun" / MARKER).write_text('{"command": "sft"}')
    assert run_owner(tmp_path / "begun") == "sft"  # the marker wins over the layout


def test_a_command_takes_a_new_or_empty_folder_or_its_own(tmp_path):
    claim(tmp_path / "new" / "run", "eval")
    assert json.loads((tmp_path / "new" / "run" / MARKER).read_text()) == {"command": "eval"}
    (tmp_path / "new" / "run" / "eval.json").write_text("{}")
    claim(tmp_path / "new" / "run", "eval")  # an earlier evaluation's folder: its eval.json is replaced
    (tmp_path / "empty").mkdir()
    claim(tmp_path / "empty", "sft")
    with pytest.raises(UserError, match="holds an opd sft run; opd train writes its own"):
        claim(tmp_path / "empty", "train")


def test_resuming_a_run_stopped_before_its_first_checkpoint_starts_it_over(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKER).write_text('{"command": "train"}')
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    claim(run, "train", resume=True)
    assert "has no checkpoint yet (the run stopped before its first); starting it over" in capsys.readouterr().out


def test_a_train_run_from_before_the_marker_resumes_and_reports(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, steps=2, ckpt_every=1)
    train_mod.train(cfg, show_progress=False)
    (tmp_path / "run" / MARKER).unlink()  # as a run written before the marker existed
    assert run_owner(tmp_path / "run") == "train"
    train_mod.train(cfg.replace(steps=3, resume=True), show_progress=False)
    assert json.loads((tmp_path / "run" / MARKER).read_text()) == {"command": "train"}
    steps = [r["step"] for r in load_run(tmp_path / "run").steps]
    assert steps == [0, 1, 2]

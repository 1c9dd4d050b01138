"""`opd sft`: which examples it trains on, its targets, and its bad-input errors (tiny models)."""

from __future__ import annotations

import json

import pytest

from opd.config import ConfigError, SFTConfig
from opd.errors import UserError
from opd.rollout.prompts import load_task
from opd.training import sft as sft_mod

SMALL = dict(steps=3, batch_size=4, max_new_tokens=4, eval_size=2, eval_every=0, warmup_steps=1)


def record_targets(monkeypatch):
    """Capture the (prompt, target) pairs every step trains on."""
    seen = []
    real = sft_mod.encode_pairs

    def spy(tok, prompts, completions, *systems):
        seen.extend(zip(prompts, completions))
        return real(tok, prompts, completions, *systems)

    monkeypatch.setattr(sft_mod, "encode_pairs", spy)
    return seen


def test_train_size_keeps_only_the_first_examples(tiny_models, tmp_path, monkeypatch):
    student, _ = tiny_models
    seen = record_targets(monkeypatch)
    cfg = SFTConfig(init=str(student), out=str(tmp_path / "run"), train_size=2, **SMALL)
    summary = sft_mod.sft(cfg, show_progress=False)
    first = load_task(cfg.task, cfg.task_level, cfg.seed).examples("train")[:2]
    assert len(seen) == 3 * 4
    assert {p for p, _ in seen} == {e.prompt for e in first}
    assert all(t == next(e.solution for e in first if e.prompt == p) for p, t in seen)
    assert summary["steps"] == 3 and (tmp_path / "run" / "final" / "config.json").is_file()


def test_cold_start_targets_come_from_the_teacher(tiny_models, tmp_path, monkeypatch):
    student, teacher = tiny_models
    seen = record_targets(monkeypatch)
    cfg = SFTConfig(init=str(student), teacher=str(teacher), out=str(tmp_path / "run"), **SMALL)
    sft_mod.sft(cfg, show_progress=False)
    solutions = {e.solution for e in load_task(cfg.task, cfg.task_level, cfg.seed).examples("train")}
    assert seen and not any(t in solutions for _, t in seen), "targets must be teacher samples"


def test_data_file_and_its_errors(tiny_models, tmp_path, monkeypatch):
    student, _ = tiny_models
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1 + 1?", "solution": "The answer is \\boxed{2}"}) + "\n")
    seen = record_targets(monkeypatch)
    sft_mod.sft(SFTConfig(init=str(student), data=str(data), out=str(tmp_path / "a"), **SMALL), show_progress=False)
    assert set(seen) == {("What is 1 + 1?", "The answer is \\boxed{2}")}
    with pytest.raises(UserError, match="--train-size 5 is more than the 1 training examples"):
        sft_mod.sft(SFTConfig(init=str(student), data=str(data), train_size=5, out=str(tmp_path / "b"), **SMALL))
    data.write_text(json.dumps({"prompt": "no target"}) + "\n")
    with pytest.raises(UserError, match=r"sft.jsonl:1 needs a 'prompt' and a 'solution'"):
        sft_mod.sft(SFTConfig(init=str(student), data=str(data), out=str(tmp_path / "c"), **SMALL))
    with pytest.raises(ConfigError, match="train_size"):
        SFTConfig(init=str(student), train_size=-1)


TOY_GAME = dict(env="toy", env_level=1, env_args=["n_train=4", "n_test=2"], max_new_tokens=96, max_action_tokens=8)


def test_one_model_learns_math_solutions_and_expert_episodes_together(tiny_models, tmp_path, monkeypatch):
    """Mixed behaviour cloning (the multi-task demo's student): every step holds both tasks' batches,
    the loss is the token mean over both tasks' label tokens, each task is evaluated on its own."""
    student, _ = tiny_models
    seen = record_targets(monkeypatch)
    parts = []
    real_loss = sft_mod.parts_loss
    monkeypatch.setattr(sft_mod, "parts_loss", lambda m, p, s: parts.append([i for i, _ in p]) or real_loss(m, p, s))
    tasks = [
        {"name": "math", "train_size": 2, "batch_size": 3},
        {"name": "game", **TOY_GAME, "train_size": 3, "batch_size": 2, "eval_size": 2},
    ]
    cfg = SFTConfig(init=str(student), out=str(tmp_path / "run"), tasks=tasks, **SMALL)
    summary = sft_mod.sft(cfg, show_progress=False)
    assert parts == [[0, 1]] * 3 and len(seen) == 3 * 3  # mix: both tasks at every step, math 3 a step
    first = load_task(cfg.task, cfg.task_level, cfg.seed).examples("train")[:2]
    assert {p for p, _ in seen} == {e.prompt for e in first}
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert all({"math/train/loss", "game/train/loss"} <= set(r) for r in steps)
    assert all(min(r["math/train/loss"], r["game/train/loss"]) <= r["train/loss"] for r in steps)
    assert all(r["train/loss"] <= max(r["math/train/loss"], r["game/train/loss"]) for r in steps)
    last = [r for r in records if "eval/accuracy" in r][-1]
    assert last["eval/accuracy"] == (last["eval/math/accuracy"] + last["eval/game/accuracy"]) / 2
    assert set(summary["best_by_task"]) == {"math", "game"}

    parts.clear()
    alt = SFTConfig(init=str(student), out=str(tmp_path / "alt"), tasks=tasks, task_mode="alternate", **SMALL)
    sft_mod.sft(alt, show_progress=False)
    assert parts == [[0], [1], [0]]  # one task a step, by the schedule


@pytest.mark.parametrize(
    ("tasks", "match"),
    [
        ([{"name": "math", "lr": 0.1}], "'lr' is a global setting"),
        ([{"name": "math", "teacher_url": "http://x"}], "a task may set"),
        ([{"name": "a"}, {"name": "a"}], "listed twice"),
        ([{"name": "game", "env": "toy", "data": "x.jsonl"}], "task 'game': --env trains on the environment's"),
    ],
)
def test_multi_task_sft_errors_name_the_task(tiny_models, tmp_path, tasks, match):
    student, _ = tiny_models
    with pytest.raises(UserError, match=match):
        sft_mod.sft(SFTConfig(init=str(student), out=str(tmp_path / "r"), tasks=tasks, **SMALL), show_progress=False)


def test_dagger_from_adds_the_players_states_to_the_expert_episodes(tiny_models, tmp_path, monkeypatch, capsys):
    """``--dagger-from``: the player plays every training game, the expert labels where it went; those
    sequences join the expert's episodes in the batches."""
    student, _ = tiny_models
    made, trained = [], []
    real_dagger, real_pad = sft_mod.dagger_data, sft_mod.pad_right
    monkeypatch.setattr(sft_mod, "dagger_data", lambda *a: made.append(real_dagger(*a)) or made[-1])
    monkeypatch.setattr(sft_mod, "pad_right", lambda s, lab, pad: trained.extend(s) or real_pad(s, lab, pad))
    small = {**SMALL, "max_new_tokens": TOY_GAME["max_new_tokens"], "steps": 4}
    cfg = SFTConfig(init=str(student), out=str(tmp_path / "run"), dagger_from=[str(student)], **{**TOY_GAME, **small})
    sft_mod.sft(cfg, show_progress=False)
    seqs, _ = made[0]
    # The random tiny student never plays the expert's command: one or two branches per game.
    assert 4 <= len(seqs) <= 8 and any(s in trained for s in seqs)
    assert f"{student} won 0 of 4 training games; {len(seqs)} sequences from the states" in capsys.readouterr().out

"""`opd sft`: which examples it trains on, its targets, and its bad-input errors (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch

from opd.config import ConfigError, SFTConfig
from opd.errors import UserError
from opd.rollout.prompt_set import load_task
from opd.training import sft as sft_mod

# validation_size 0: these tests train on a handful of examples (test_validation_* holds some out)
SMALL = dict(steps=3, batch_size=4, max_new_tokens=4, eval_size=2, eval_every=0, warmup_steps=1, validation_size=0)


def record_targets(monkeypatch):
    """Capture the (prompt, target) pairs every step trains on."""
    seen = []
    real = sft_mod.encode_pairs

    def spy(tok, prompts, completions, *systems, **tools):
        # a prompt is a user turn's text or a chat's messages: its question is the last user turn's text
        questions = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
        seen.extend(zip(questions, completions))
        return real(tok, prompts, completions, *systems, **tools)

    monkeypatch.setattr(sft_mod, "encode_pairs", spy)
    return seen


def test_train_size_keeps_only_the_first_examples(tiny_models, tmp_path, monkeypatch):
    student, _ = tiny_models
    seen = record_targets(monkeypatch)
    cfg = SFTConfig.from_flat(init=str(student), out=str(tmp_path / "run"), train_size=2, **SMALL)
    summary = sft_mod.sft(cfg, show_progress=False)
    first = load_task(cfg.data.task, cfg.data.task_level, cfg.run.seed).examples("train")[:2]
    assert len(seen) == 3 * 4
    assert {p for p, _ in seen} == {e.prompt for e in first}
    assert all(t == next(e.solution for e in first if e.prompt == p) for p, t in seen)
    assert summary["steps"] == 3 and (tmp_path / "run" / "final" / "config.json").is_file()


def test_cold_start_targets_come_from_the_teacher(tiny_models, tmp_path, monkeypatch):
    student, teacher = tiny_models
    seen = record_targets(monkeypatch)
    cfg = SFTConfig.from_flat(init=str(student), teacher=str(teacher), out=str(tmp_path / "run"), **SMALL)
    sft_mod.sft(cfg, show_progress=False)
    solutions = {e.solution for e in load_task(cfg.data.task, cfg.data.task_level, cfg.run.seed).examples("train")}
    assert seen and not any(t in solutions for _, t in seen), "targets must be teacher samples"


def test_data_file_and_its_errors(tiny_models, tmp_path, monkeypatch):
    student, _ = tiny_models
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1 + 1?", "solution": "The answer is \\boxed{2}"}) + "\n")
    seen = record_targets(monkeypatch)
    sft_mod.sft(
        SFTConfig.from_flat(init=str(student), data=str(data), out=str(tmp_path / "a"), **SMALL), show_progress=False
    )
    assert set(seen) == {("What is 1 + 1?", "The answer is \\boxed{2}")}
    with pytest.raises(UserError, match="--train-size 5 is more than the 1 training examples"):
        sft_mod.sft(
            SFTConfig.from_flat(init=str(student), data=str(data), train_size=5, out=str(tmp_path / "b"), **SMALL)
        )
    data.write_text(json.dumps({"prompt": "no target"}) + "\n")
    with pytest.raises(
        UserError, match=r"sft\.jsonl: 1 of 1 rows have no solution, e\.g\. row 1; give each a 'solution'"
    ):
        sft_mod.sft(SFTConfig.from_flat(init=str(student), data=str(data), out=str(tmp_path / "c"), **SMALL))
    data.write_text(json.dumps({"prompt": "What is 2 + 2?", "completion": "\\boxed{4}"}) + "\n")
    seen.clear()
    sft_mod.sft(
        SFTConfig.from_flat(init=str(student), data=str(data), out=str(tmp_path / "d"), **SMALL), show_progress=False
    )
    assert set(seen) == {("What is 2 + 2?", "\\boxed{4}")}  # a 'completion' column serves without 'solution'

    with pytest.raises(ConfigError, match="train_size"):
        SFTConfig.from_flat(init=str(student), train_size=-1)


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
    cfg = SFTConfig.from_flat(init=str(student), out=str(tmp_path / "run"), tasks=tasks, **SMALL)
    summary = sft_mod.sft(cfg, show_progress=False)
    assert parts == [[0, 1]] * 3 and len(seen) == 3 * 3  # mix: both tasks at every step, math 3 a step
    first = load_task(cfg.data.task, cfg.data.task_level, cfg.run.seed).examples("train")[:2]
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
    alt = SFTConfig.from_flat(init=str(student), out=str(tmp_path / "alt"), tasks=tasks, task_mode="alternate", **SMALL)
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
        sft_mod.sft(
            SFTConfig.from_flat(init=str(student), out=str(tmp_path / "r"), tasks=tasks, **SMALL), show_progress=False
        )


def test_dagger_from_adds_the_players_states_to_the_expert_episodes(tiny_models, tmp_path, monkeypatch, capsys):
    """``--dagger-from``: the player plays every training game, the expert labels where it went; those
    sequences join the expert's episodes in the batches."""
    student, _ = tiny_models
    made, trained = [], []
    real_dagger, real_pad = sft_mod.dagger_data, sft_mod.pad_right
    monkeypatch.setattr(sft_mod, "dagger_data", lambda *a: made.append(real_dagger(*a)) or made[-1])
    monkeypatch.setattr(sft_mod, "pad_right", lambda s, lab, pad: trained.extend(s) or real_pad(s, lab, pad))
    small = {**SMALL, "max_new_tokens": TOY_GAME["max_new_tokens"], "steps": 4}
    cfg = SFTConfig.from_flat(
        init=str(student), out=str(tmp_path / "run"), dagger_from=[str(student)], **{**TOY_GAME, **small}
    )
    sft_mod.sft(cfg, show_progress=False)
    seqs, _ = made[0]
    # The random tiny student never plays the expert's command: one or two branches per game.
    assert 4 <= len(seqs) <= 8 and any(s in trained for s in seqs)
    assert f"{student} won 0 of 4 training games; {len(seqs)} sequences from the states" in capsys.readouterr().out


def test_the_kept_model_is_chosen_on_validation_data_and_reported_on_test(tiny_models, tmp_path, monkeypatch):
    """--validation-size N: the last N training examples are never trained on; the checkpoint is chosen
    on them; the test prompts are evaluated once, on the kept model."""
    student, _ = tiny_models
    pool = load_task("arithmetic", 1, 0).examples("train")
    validation = {e.prompt for e in pool[-3:]}
    scripted = {"validation": [0.5, 0.2], "test": [0.7]}  # a later checkpoint is worse on validation
    asked, saved = [], []

    def fake_eval(model, tok, prompts, task, **kw):
        split = "validation" if prompts.examples[0].prompt in validation else "test"
        asked.append(split)
        return {"accuracy": scripted[split][asked.count(split) - 1]}

    monkeypatch.setattr(sft_mod, "evaluate_model", fake_eval)
    real_save = sft_mod.save_final_model
    monkeypatch.setattr(sft_mod, "save_final_model", lambda *a, **k: (saved.append(1), real_save(*a, **k)))
    seen = record_targets(monkeypatch)
    run = tmp_path / "run"
    cfg = SFTConfig.from_flat(init=str(student), out=str(run), task_level=1, **{**SMALL, "steps": 4, "eval_every": 2})
    summary = sft_mod.sft(cfg.replace(validation_size=3), show_progress=False)
    assert seen and not {p for p, _ in seen} & validation  # never trained on
    assert asked == ["validation", "validation", "test"] and len(saved) == 1  # kept: the first checkpoint
    assert summary["best_accuracy"] == 0.5 and summary["test_accuracy"] == 0.7
    assert summary["chosen_on"] == "validation"
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/" in line]
    assert [sorted(k for k in r if k.startswith("eval/")) for r in evals] == [
        ["eval/validation/accuracy"],
        ["eval/validation/accuracy"],
        ["eval/accuracy"],
    ]
    assert evals[-1] == {"step": 3, "eval/accuracy": 0.7}
    card = (run / "final" / "README.md").read_text()  # the kept model's card: its figures, as chosen
    assert (
        "| best_accuracy | 0.5 |" in card and "| test_accuracy | 0.7 |" in card and "| chosen_on | validation |" in card
    )
    data = tmp_path / "four.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{n} + 1?", "solution": f"\\boxed{{{n + 1}}}"}) + "\n" for n in range(4))
    )
    with pytest.raises(UserError, match=r"--validation-size 9 leaves none of the 4 training examples"):
        sft_mod.sft(cfg.replace(data=str(data), validation_size=9, out=str(tmp_path / "b")))


def test_gradient_checkpointing_gives_the_plain_sft_step(tiny_models, tmp_path):
    """--gradient-checkpointing in opd sft: each decoder layer recomputes its forward in the backward, and the
    step's loss and gradient are the plain step's (float64, so that only a real difference shows)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    student, _ = tiny_models
    tok = sft_mod.load_tokenizer(str(student))
    cfg = SFTConfig.from_flat(init=str(student), out=str(tmp_path))
    examples = load_task(cfg.data.task, cfg.data.task_level, cfg.run.seed).examples("train")[:3]
    ids, att, lab = sft_mod.encode_pairs(tok, [e.prompt for e in examples], [e.solution for e in examples])
    got = {}
    for ckpt in (False, True):
        model, _ = sft_mod.build_model(cfg.replace(gradient_checkpointing=ckpt))
        model = model.double().train()
        layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
        assert bool(layers) == ckpt
        calls: list[int] = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *a, seen=calls: seen.append(1))
        loss, _ = sft_mod.parts_loss(model, [(0, (ids, att, lab))], 0)
        assert len(calls) == (2 if ckpt else 1)  # the forward, and with checkpointing its recomputation
        got[ckpt] = loss, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert got[True][0] == pytest.approx(got[False][0], rel=1e-12)
    assert got[True][1].keys() == got[False][1].keys()
    for name, grad in got[False][1].items():
        assert torch.allclose(got[True][1][name], grad, rtol=1e-10, atol=1e-14), name

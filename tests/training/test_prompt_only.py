"""Training on data as users have it (issue 64): a JSONL of prompts only trains with every objective and
writes a report that says there is no accuracy; prompts with and without answers are graded over the
graded ones; the chat-template options reach the prompts a run trains on; tools reach the template and
its tool-call markers are masked; SFT on conversations without answers keeps its last model."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch
from chat_templates import ADD, TOOL_MARKERS, with_tools_template
from helpers import cfg_for, read_metrics, run_options, step_records
from typer.testing import CliRunner

from opd.cli import app
from opd.config import SFTConfig, TrainConfig
from opd.models.loading import load_tokenizer, tiny_qwen2
from opd.report import write_report
from opd.tasks import ArithmeticTask
from opd.training import loop as train_mod
from opd.training.sft import sft

EXAMPLES = ArithmeticTask(n_train=12, n_test=4).examples("train")  # prompts the tiny tokenizer reads


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rollouts(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def chat_models(tiny_tokenizer, tmp_path_factory):
    """(student_dir, teacher_dir) whose tokenizer has tests/chat_templates.py's template (thinking switch,
    tools) and the tool-call markers as tokens of their own."""
    root = tmp_path_factory.mktemp("chat_models")
    tok = with_tools_template(load_tokenizer(tiny_tokenizer, "tokenizer"))
    dirs = []
    for name, width, seed in (("student", 32, 1), ("teacher", 64, 2)):
        torch.manual_seed(seed)
        tiny_qwen2(len(tok), 1, width, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        dirs.append(root / name)
    return tuple(dirs)


@pytest.mark.parametrize("objective", ["lsm", "sampled", "full_kl"])
def test_a_prompt_only_file_trains_with_each_objective(tiny_models, tmp_path, objective, monkeypatch, capsys):
    said = []

    @contextmanager
    def bar(label, total, enabled=True):
        class Bar:
            advance = staticmethod(lambda n=1, **kw: None)
            describe = staticmethod(said.append)

        yield Bar()

    monkeypatch.setattr(train_mod, "progress_bar", bar)
    data = jsonl(tmp_path / "prompts.jsonl", [{"prompt": e.prompt} for e in EXAMPLES])
    out = tmp_path / "run"
    train_mod.train(cfg_for(tiny_models, tmp_path, task=data, objective=objective, log_rollouts=4))
    steps = step_records(out)
    assert [r["step"] for r in steps] == [0, 1]
    assert all("rollout/accuracy" not in r and r["rollout/ungraded"] == 4 for r in steps)  # absent, not zero
    assert not [r for r in read_metrics(out) if any(k.startswith("eval/") for k in r)]  # nothing to grade
    assert not (out / "eval.jsonl").exists() and (out / "final").is_dir()
    assert {(r["answer"], r["correct"]) for r in rollouts(out)} == {(None, None)}
    assert said and all(text.startswith("loss ") and "acc" not in text for text in said)
    err = capsys.readouterr().err
    assert "opd train: note: of the 11 training prompts of" in err and "evaluation is off" in err
    page = write_report([out], tmp_path / "report", show_progress=False).read_text()
    assert "no accuracy to show: its prompts have no reference answers" in page
    assert "none: no reference answers" in page  # the summary's accuracy cell


def test_mixed_answers_thinking_off_and_an_eval_task(chat_models, tmp_path):
    """Half the prompts have answers; --chat-template-kwargs from the command line; --eval-task graded."""
    rows = [{"prompt": e.prompt, **({"answer": e.answer} if i % 2 else {})} for i, e in enumerate(EXAMPLES)]
    graded = jsonl(tmp_path / "graded.jsonl", [{"prompt": e.prompt, "answer": e.answer} for e in EXAMPLES[:3]])
    student, teacher = chat_models
    out = tmp_path / "run"
    cli = ["train", "--student", str(student), "--teacher", str(teacher), "--out", str(out), "--device", "cpu"]
    cli += ["--task", jsonl(tmp_path / "mixed.jsonl", rows), "--split", "0", "--eval-task", graded]
    cli += ["--chat-template-kwargs", '{"enable_thinking": false}', "--steps", "2", "--batch-size", "4"]
    cli += ["--max-new-tokens", "6", "--k", "8", "--eval-samples", "0", "--log-rollouts", "4", "--warmup-steps", "1"]
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert run_options(out)["chat_template_kwargs"] == {"enable_thinking": False}
    for r in step_records(out):
        mine = [x for x in rollouts(out) if x["step"] == r["step"]]
        scored = [x["correct"] for x in mine if x["correct"] is not None]
        assert r.get("rollout/ungraded", 0) == len(mine) - len(scored) == sum(x["answer"] is None for x in mine)
        assert r.get("rollout/accuracy") == (sum(scored) / len(scored) if scored else None)
    evals = [r for r in read_metrics(out) if "eval/accuracy" in r]
    assert len(evals) == 1 and evals[0]["eval/n"] == 3
    assert any("rollout/ungraded" in r for r in step_records(out))  # 6 of the 12 prompts have no answer
    page = write_report([out], tmp_path / "report", show_progress=False).read_text()
    assert "rollout accuracy is over the graded rollouts only" in page
    # the options reached the prompts the run trained on: thinking off after the generation prompt
    cfg = run_options(out) | {"out": str(tmp_path / "again")}
    run = train_mod.setup(TrainConfig.from_flat(**cfg))
    text = run.tokenizer.decode(run.tasks[0].source.prompts.prompt_ids[0])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tools_reach_the_prompts_and_their_markers_are_masked(chat_models, tmp_path):
    rows = [{"prompt": e.prompt, "tools": [ADD]} for e in EXAMPLES]
    cfg = cfg_for(chat_models, tmp_path, task=jsonl(tmp_path / "tools.jsonl", rows), eval=False)
    run = train_mod.setup(cfg)
    assert len(run.tasks[0].source.prompts) == len(EXAMPLES)  # --no-eval: nothing held out
    assert '<tools>{"type": "function", "function": {"name": "add"' in run.tokenizer.decode(
        run.tasks[0].source.prompts.prompt_ids[0]
    )
    markers = run.tokenizer.convert_tokens_to_ids(list(TOOL_MARKERS))
    assert set(markers) <= set(run.special_ids)
    plain_rows = [{"prompt": e.prompt} for e in EXAMPLES]
    plain = train_mod.setup(
        cfg_for(chat_models, tmp_path / "plain", task=jsonl(tmp_path / "p.jsonl", plain_rows), eval=False)
    )
    assert not set(markers) & set(plain.special_ids)  # no tools offered: nothing more is masked


def test_sft_on_conversations_without_answers_keeps_the_last_model(tiny_models, tmp_path, capsys):
    chats = [
        {
            "messages": [
                {"role": "user", "content": e.prompt},
                {"role": "assistant", "content": e.solution.split("\\boxed")[0]},
            ]
        }
        for e in EXAMPLES
    ]
    cfg = SFTConfig.from_flat(
        init=str(tiny_models[0]),
        task=jsonl(tmp_path / "chats.jsonl", chats),
        out=str(tmp_path / "sft"),
        device="cpu",
        steps=2,
        batch_size=4,
        max_new_tokens=4,
        eval_size=2,
        eval_every=0,
        warmup_steps=1,
    )
    summary = sft(cfg, show_progress=False)
    assert summary["chosen_on"] == "last step" and "best_accuracy" not in summary
    assert (tmp_path / "sft" / "final").is_dir()
    assert "opd sft: note: none of the held-out prompts" in capsys.readouterr().err
    assert not [r for r in read_metrics(tmp_path / "sft") if any(k.startswith("eval/") for k in r)]

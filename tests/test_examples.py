"""The example configs in examples/: each names its run command in its header, loads as a valid
config holding what it says, and the single-task ones train a step with their own options (their
model and data paths swapped for tiny local ones)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from opd.config import TrainConfig, build_config, read_config_file
from opd.config.sections import flatten
from opd.errors import UserError
from opd.training.loop import train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def test_the_examples_the_issue_asked_for_are_there():
    assert {p.stem for p in FILES} >= {"lsm_math", "served_teacher", "lora", "multitask", "agentic_alfworld"}
    assert "prompt_only_chat" in {p.stem for p in FILES}  # issue 64: prompts without answers, thinking off
    assert "qwen3_thinking" in {p.stem for p in FILES}  # issue 71: a real reasoning-model run


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_an_example_names_its_command_and_loads_as_written(path):
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(re.search(rf"opd train --config examples/{path.name}\b", line) for line in header), header
    written = flatten(TrainConfig, read_config_file(path), str(path))
    cfg = build_config(TrainConfig, read_config_file(path))
    for option, value in written.items():
        if option == "tasks":  # resolved into one full config per task
            assert [t["name"] for t in cfg.multitask.tasks] == [t["name"] for t in value]
            continue
        assert cfg.flat()[option] == value, option


def _gsm8k_like(path: Path) -> Path:
    rows = [
        {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
        for a in range(6)
        for b in range(6)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompts_only(path: Path) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {a} plus {b}?"}) + "\n" for a in range(6) for b in range(6))
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lsm_math", "lora", "prompt_only_chat"])
def test_a_single_task_example_trains_a_step_with_its_options(name, tiny_models, tmp_path):
    student, teacher = tiny_models
    data = _prompts_only(tmp_path / "p.jsonl") if name == "prompt_only_chat" else _gsm8k_like(tmp_path / "g.jsonl")
    small = dict(student=str(student), teacher=str(teacher), task=str(data))
    small |= dict(split="0.25", out=str(tmp_path / "run"), dtype="float32", teacher_dtype="", device="cpu")
    small |= dict(steps=1, batch_size=4, grad_accum=2, max_new_tokens=8, max_prompt_tokens=64, k=8)
    small |= dict(eval_every=0, eval_size=4, eval_samples=0, report_to=["none"])
    # the stand-ins have the demo's template, which reads no option such as Qwen3's enable_thinking
    small["check_chat_template_kwargs"] = False
    cfg = build_config(TrainConfig, read_config_file(EXAMPLES / f"{name}.yaml"), small)
    train(cfg, show_progress=False)
    assert (tmp_path / "run" / "final").is_dir()
    if name == "lora":
        assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()


def _problems(path: Path, n: int) -> Path:
    rows = [{"problem": f"What is {a} plus 1?", "answer": str(a + 1)} for a in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("context", [16_384, 8_192])
def test_the_qwen3_thinking_example_sets_up_against_narrow_stand_ins(tmp_path, context):
    """examples/qwen3_thinking.yaml as written but for its paths: narrow Qwen3 stand-ins (2 layers, 64 wide) of
    the given context. At 16k its 8k responses fit: the run sets up with every layer checkpointed and the
    training data whole (--eval-task); at 8k, 1,024 prompt tokens plus 8,192 new ones do not: refused at start."""
    from opd.lab.real_shape import narrow_pair
    from opd.training.setup import setup

    student, teacher = narrow_pair(tmp_path / "models", 2048, max_len=context)
    paths = dict(student=str(student), teacher=str(teacher), out=str(tmp_path / "run"), device="cpu")
    paths["check_chat_template_kwargs"] = False  # the stand-ins have the demo's template: no thinking switch
    paths |= dict(task=str(_problems(tmp_path / "train.jsonl", 12)), eval_task=str(_problems(tmp_path / "t.jsonl", 4)))
    cfg = build_config(TrainConfig, read_config_file(EXAMPLES / "qwen3_thinking.yaml"), paths | {"report_to": ["none"]})
    if context < cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens:
        with pytest.raises(UserError, match=rf"plus max_new_tokens=8192 exceeds the model's context of {context}"):
            setup(cfg)
        return
    run = setup(cfg)
    assert (cfg.rollout.max_new_tokens, cfg.optimizer.micro_batch_tokens, cfg.model.dtype) == (8192, 16384, "bfloat16")
    assert run.student.model.layers[0].gradient_checkpointing
    assert len(run.tasks[0].source) == 12  # --eval-task: nothing held out of the training data

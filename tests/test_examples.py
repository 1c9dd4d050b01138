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
from opd.training.loop import train

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def test_the_examples_the_issue_asked_for_are_there():
    assert {p.stem for p in FILES} >= {"lsm_math", "served_teacher", "lora", "multitask", "agentic_alfworld"}
    assert "prompt_only_chat" in {p.stem for p in FILES}  # issue 64: prompts without answers, thinking off


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_an_example_names_its_command_and_loads_as_written(path):
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(re.search(rf"opd train --config examples/{path.name}\b", line) for line in header), header
    written = flatten(TrainConfig, read_config_file(path), str(path))
    cfg = build_config(TrainConfig, read_config_file(path))
    for option, value in written.items():
        if option == "tasks":  # resolved into one full config per task
            assert [t["name"] for t in cfg.tasks] == [t["name"] for t in value]
            continue
        assert getattr(cfg, option) == value, option


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
    cfg = build_config(TrainConfig, read_config_file(EXAMPLES / f"{name}.yaml"), small)
    train(cfg, show_progress=False)
    assert (tmp_path / "run" / "final").is_dir()
    if name == "lora":
        assert (tmp_path / "run" / "final" / "adapter_config.json").is_file()

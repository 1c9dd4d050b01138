"""Training prompts over --max-prompt-tokens: skipped and counted (or an error); --eval-task keeps the
training data whole."""

from __future__ import annotations

import json

import pytest
from helpers import cfg_for, step_records

from opd.errors import UserError
from opd.models.loading import load_tokenizer
from opd.rollout.prompt_set import PromptSet, load_tasks
from opd.tasks import Example
from opd.training import loop

SHORT = [Example("What is 1 + 1?", "2"), Example("What is 2 + 3?", "5")]
LONG = [Example("What is " + " + ".join(["1"] * 60) + "?", "60"), Example("Add " + "2 " * 40, "80")]


def _lengths(tok, examples):
    return [len(ids) for ids in PromptSet.build(examples, tok, 10_000).prompt_ids]


def test_long_training_prompts_are_skipped_counted_and_said_once(tiny_tokenizer, capsys):
    tok = load_tokenizer(tiny_tokenizer)
    limit = max(_lengths(tok, SHORT))
    longest = max(_lengths(tok, LONG))
    got = PromptSet.build([LONG[0], *SHORT, LONG[1]], tok, limit, "training prompts", long_prompts="skip")
    assert got.examples == SHORT and (got.skipped, got.longest_skipped) == (2, longest)
    assert got.prompt_ids == PromptSet.build(SHORT, tok, limit).prompt_ids
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    assert f"2 of 4 training prompts are longer than max_prompt_tokens={limit} (longest: {longest} tokens)" in err


def test_long_prompts_as_an_error_or_when_none_would_be_left(tiny_tokenizer):
    tok = load_tokenizer(tiny_tokenizer)
    limit = max(_lengths(tok, SHORT))
    with pytest.raises(UserError, match="2 of 4 training prompts are longer.*or drop those prompts"):
        PromptSet.build([*LONG, *SHORT], tok, limit, "training prompts", long_prompts="error")
    with pytest.raises(UserError, match="2 of 2 training prompts are longer.*would leave none"):
        PromptSet.build(LONG, tok, limit, "training prompts", long_prompts="skip")


def test_a_run_logs_how_many_prompts_it_skipped(tiny_models, tmp_path, tiny_tokenizer):
    tok = load_tokenizer(tiny_tokenizer)
    data = tmp_path / "mixed.jsonl"
    rows = [*SHORT * 3, LONG[0]]
    data.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in rows))
    limit = max(_lengths(tok, SHORT))
    cfg = cfg_for(tiny_models, tmp_path, task=str(data), split="0", max_prompt_tokens=limit, steps=1, eval=False)
    loop.train(cfg, show_progress=False)
    (step,) = step_records(tmp_path / "run")
    assert step["data/prompts_skipped"] == 1


def test_eval_task_leaves_the_training_data_whole_unless_split_says(tiny_models, tmp_path):
    data = tmp_path / "one_split.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(20))
    )
    whole = load_tasks(cfg_for(tiny_models, tmp_path, task=str(data), eval_task=str(data)))[0]
    assert len(whole.examples("train")) == 20
    held = load_tasks(cfg_for(tiny_models, tmp_path, task=str(data), eval_task=str(data), split="0.25"))[0]
    assert len(held.examples("train")) == 15
    alone = load_tasks(cfg_for(tiny_models, tmp_path, task=str(data)))[0]  # no --eval-task: 10% held out
    assert len(alone.examples("train")) == 18

"""Data as users have it: prompts without answers (alone, or mixed with graded ones), whole conversations
kept up to their last user turn, a ``tools`` column, what a run then evaluates, and the errors."""

from __future__ import annotations

import json

import pytest
from chat_templates import ADD, CONVERSATION
from datasets import Dataset

from opd.config import SFTConfig, TrainConfig
from opd.errors import UserError
from opd.rollout.prompt_set import eval_prompts, grading_notes, load_tasks
from opd.tasks import DatasetTask, Example, reward_of

PROMPTS = [f"Write a line about the number {i}." for i in range(10)]


def jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompts_without_answers_train_and_are_not_graded(tmp_path):
    task = DatasetTask(jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS]))
    train, test = task.examples("train"), task.examples("test")
    assert len(train) == 9 and len(test) == 1 and all(e.answer is None for e in train + test)
    assert train[0] == Example(train[0].prompt, None, "p")
    assert reward_of(task, "anything", train[0]) is None
    with pytest.raises(ValueError, match="has no reference answer to grade against; reward it with reward_of"):
        task.reward("anything", train[0])


def test_mixed_rows_grade_the_ones_with_an_answer(tmp_path):
    rows = [{"prompt": p, **({"answer": str(i)} if i % 2 else {})} for i, p in enumerate(PROMPTS)]
    cfg = TrainConfig.from_flat(task=jsonl(tmp_path / "m.jsonl", rows), split="0.5", eval_size=3)
    task, evaluation = load_tasks(cfg)
    assert evaluation is task
    graded = [e for e in task.examples("test") if e.answer is not None]
    assert eval_prompts(task, 3) == graded[:3] and 0 < len(graded) < len(task.examples("test"))
    assert reward_of(task, "so \\boxed{3}", Example("q", "3")) == 1.0
    notes = grading_notes(cfg, task, evaluation)
    assert any("training prompts" in n and "rollout accuracy is over the" in n for n in notes), notes
    assert any("held-out prompts have no reference answer: evaluation grades the" in n for n in notes), notes


def test_a_conversation_is_kept_whole_up_to_its_last_user_turn(tmp_path):
    # the assistant's answer after the last user turn is cut off (the solution), and the tools go with it
    chat = [*CONVERSATION, {"role": "assistant", "content": "That is \\boxed{8}"}]
    for path, tools in ((tmp_path / "c.parquet", [ADD]), (tmp_path / "c.jsonl", json.dumps([ADD]))):  # or its text
        rows = [{"messages": chat, "tools": tools}, {"messages": chat[:2], "tools": tools}]
        if path.suffix == ".parquet":
            Dataset.from_list(rows).to_parquet(path)
        else:
            jsonl(path, rows)
        whole, plain = DatasetTask(path, split="0").examples("train")
        assert whole.chat() == CONVERSATION  # no null fields added by datasets' struct columns
        assert (whole.prompt, whole.answer, whole.solution) == ("And 4 + 4?", "8", "That is \\boxed{8}")
        assert whole.tools == plain.tools == (ADD,) and whole.uses_tools
        # one user turn after a system turn: the plain prompt and system text, as a string prompt is
        assert (plain.messages, plain.system, plain.prompt, plain.answer) == (
            None,
            "You add numbers.",
            "What is 2 + 3?",
            None,
        )
        assert plain.chat() == CONVERSATION[:2]
    # --system-prompt takes the place of a conversation's system turn
    replaced = DatasetTask(tmp_path / "c.jsonl", split="0", system_prompt="Be brief.").examples("train")[0]
    assert replaced.chat() == [{"role": "system", "content": "Be brief."}, *CONVERSATION[1:]]


@pytest.mark.parametrize(
    "tools, detail",
    [
        ({"name": "add"}, r"'tools' is a dict, not a list of objects"),
        ('[{"name": "add"}', r"'tools' is not JSON \(Expecting"),
        ('["add"]', r"'tools' is a list holding non-objects"),
    ],
)
def test_tools_that_are_not_a_list_of_objects_name_the_row(tmp_path, tools, detail):
    rows = [
        {"prompt": "p", "tools": json.dumps([ADD])},
        {"prompt": "q", "tools": tools if isinstance(tools, str) else json.dumps(tools)},
    ]
    Dataset.from_list(rows).to_parquet(tmp_path / "t.parquet")
    pattern = rf"1 of 2 'tools' values are not lists of tool schemas in .*t\.parquet, e\.g\. row 2: {detail}.*; give each row a JSON list of objects"
    with pytest.raises(UserError, match=pattern):
        DatasetTask(tmp_path / "t.parquet")


def test_a_turn_that_is_not_text_is_named(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q"}]}, {"messages": [{"role": "user", "content": None}]}]
    Dataset.from_list(rows).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=r"'messages' has a 'user' turn whose content is not a string"):
        DatasetTask(tmp_path / "bad.parquet")


def test_no_eval_trains_on_every_row_and_evaluates_nothing(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": p, "answer": "1"} for p in PROMPTS])
    task, evaluation = load_tasks(TrainConfig.from_flat(task=path, eval=False))
    assert evaluation is None and len(task.examples("train")) == len(PROMPTS)
    task, evaluation = load_tasks(
        SFTConfig.from_flat(task=path, init="m", eval=False, split="0.5")
    )  # --split still holds out
    assert evaluation is None and len(task.examples("train")) == 5


def test_nothing_to_grade_turns_evaluation_off_with_a_note(tmp_path):
    cfg = TrainConfig.from_flat(task=jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS]))
    task, evaluation = load_tasks(cfg)
    assert evaluation is None
    notes = grading_notes(cfg, task, evaluation)
    assert (
        notes[0]
        == f"of the 9 training prompts of {cfg.data.task}, none has a reference answer: they train, and no rollout accuracy is logged"
    )
    assert notes[1].startswith(
        f"none of the held-out prompts of {cfg.data.task} has a reference answer (looked for an 'answer' column"
    )
    assert notes[1].endswith(
        "so there is nothing to grade and evaluation is off; give --eval-task DATA with answers to evaluate, or --no-eval to train on every row"
    )
    assert grading_notes(cfg, task, evaluation, rollouts=False) == notes[1:]  # SFT grades no rollouts


def test_an_eval_task_needs_answers(tmp_path):
    prompts = jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
    graded = jsonl(tmp_path / "g.jsonl", [{"prompt": p, "answer": "1"} for p in PROMPTS])
    task, evaluation = load_tasks(TrainConfig.from_flat(task=prompts, eval_task=graded))
    assert evaluation is not None and len(eval_prompts(evaluation, 200)) == len(PROMPTS)
    with pytest.raises(
        UserError, match=r"--eval-task .*p\.jsonl has no reference answers to grade \(looked for an 'answer' column"
    ):
        load_tasks(TrainConfig.from_flat(task=graded, eval_task=prompts))

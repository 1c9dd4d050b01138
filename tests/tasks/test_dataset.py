"""Bring your own data: files, globs and save_to_disk directories read with Hugging Face datasets,
field names, chat messages, splits, answer formats, an evaluation set of its own, and the errors.

The data sets are made here from the built-in arithmetic task: a GSM8K-style parquet
(``question``, ``answer`` ending in ``#### N``) and a chat ``messages`` DatasetDict. Both hold the
arithmetic task's prompts in its order, so a short ``opd train`` on them must follow the built-in
task's run step for step.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from datasets import Dataset, DatasetDict
from helpers import assert_same_trajectory, read_metrics, run_options, step_records
from typer.testing import CliRunner

from opd.cli import app
from opd.config import ConfigError, EvalConfig, SFTConfig, TrainConfig
from opd.errors import UserError
from opd.lab.demos.demo import ASSETS
from opd.models.loading import load_tokenizer
from opd.models.tokenizer import format_prompt
from opd.rollout.prompt_set import PromptSet, load_task, load_tasks
from opd.tasks import ArithmeticTask, DatasetTask, Example, JsonlTask
from opd.training import loop as train_mod

LEVEL = 2  # the demo models' arithmetic level


def gsm8k_row(e: Example) -> dict:
    """GSM8K's shape: the worked solution, then ``#### answer``."""
    return {"question": e.prompt, "answer": re.sub(r"\\boxed\{(\d+)\}", r"\1", e.solution) + f"\n#### {e.answer}"}


def chat_row(e: Example) -> dict:
    return {"messages": [{"role": "user", "content": e.prompt}, {"role": "assistant", "content": e.solution}]}


@pytest.fixture(scope="module")
def arithmetic():
    return ArithmeticTask.from_level(LEVEL, seed=0)


@pytest.fixture(scope="module")
def byo_data(arithmetic, tmp_path_factory):
    """The arithmetic task as GSM8K-style parquet files and as a chat save_to_disk directory."""
    root = tmp_path_factory.mktemp("data")
    train, test = arithmetic.examples("train"), arithmetic.examples("test")
    Dataset.from_list([gsm8k_row(e) for e in train]).to_parquet(root / "gsm8k_train.parquet")
    Dataset.from_list([gsm8k_row(e) for e in test]).to_parquet(root / "gsm8k_test.parquet")
    DatasetDict(
        train=Dataset.from_list([chat_row(e) for e in train]), test=Dataset.from_list([chat_row(e) for e in test])
    ).save_to_disk(root / "chat")
    return root


# ----------------------------------------------------------------------------- short training runs

RUN = dict(
    student=str(ASSETS / "student"),
    teacher=str(ASSETS / "teacher"),
    device="cpu",
    steps=2,
    batch_size=8,
    max_new_tokens=40,
    eval_size=16,
    eval_samples=0,
    eval_every=0,
    ckpt_every=0,
    log_rollouts=0,
    diag_positions=16,
    warmup_steps=1,
)


@pytest.fixture(scope="module")
def arithmetic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith") / "run"
    train_mod.train(TrainConfig.from_flat(out=str(out), **RUN), show_progress=False)
    return out


def final_eval(run_dir) -> dict:
    return [r for r in read_metrics(run_dir) if "eval/accuracy" in r][-1]


def test_train_on_a_gsm8k_parquet_through_the_cli(byo_data, arithmetic_run, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--task", str(byo_data / "gsm8k_train.parquet"), "--split", "0"]
    args += ["--prompt-field", "question", "--answer-field", "answer", "--answer-format", "gsm8k"]
    args += ["--eval-task", str(byo_data / "chat"), "--eval-prompt-field", "messages", "--eval-answer-format", "boxed"]
    for key, value in RUN.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    want, got = step_records(arithmetic_run), step_records(out)
    # The same prompts in the same order: the same rollouts, losses and updates...
    for key in ("train/loss", "train/grad_norm", "rollout/response_len", "train/loss_tokens"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-6), key
    # ...but graded as GSM8K: the demo student writes \boxed{N}, never "#### N".
    assert [r["rollout/accuracy"] for r in got] == [0.0, 0.0]
    assert min(r["rollout/accuracy"] for r in want) >= 0.25
    # Evaluated on the other data set (the chat test split, boxed): the built-in run's figure.
    assert final_eval(out)["eval/accuracy"] == final_eval(arithmetic_run)["eval/accuracy"]
    assert final_eval(out)["eval/n"] == 16
    config = run_options(out)
    assert (config["answer_format"], config["eval_answer_format"], config["prompt_field"]) == (
        "gsm8k",
        "boxed",
        "question",
    )


def test_train_on_a_chat_save_to_disk_directory(byo_data, arithmetic_run, arithmetic, tmp_path):
    out = tmp_path / "run"
    train_mod.train(TrainConfig.from_flat(out=str(out), task=str(byo_data / "chat"), **RUN), show_progress=False)
    # train/test splits of the DatasetDict, answers read from the assistant turns' \boxed{}
    assert_same_trajectory(step_records(out), step_records(arithmetic_run), rel=1e-6)
    assert final_eval(out)["eval/accuracy"] == final_eval(arithmetic_run)["eval/accuracy"] >= 0.25
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert evals == [{"prompt": e.prompt, "answer": e.answer} for e in arithmetic.examples("test")[:16]]


def test_opd_eval_and_sft_take_the_data_options(byo_data, arithmetic, tmp_path):
    from opd.evaluation.model_eval import run_eval
    from opd.training.sft import sft

    common = dict(student=RUN["student"], device="cpu", max_new_tokens=40, eval_size=16, samples=0)
    builtin = run_eval(EvalConfig.from_flat(out=str(tmp_path / "a"), **common))
    chat = run_eval(EvalConfig.from_flat(out=str(tmp_path / "b"), task=str(byo_data / "chat"), **common))
    assert chat["accuracy"] == builtin["accuracy"] and chat["n"] == 16
    assert builtin["accuracy"] >= 0.25  # the demo student gets about half right: the equality says something
    # a one-split file is evaluated whole; --split evaluates the part training holds out
    Dataset.from_list([gsm8k_row(e) for e in arithmetic.examples("test")[:10]]).to_parquet(tmp_path / "ten.parquet")
    ten = dict(common, task=str(tmp_path / "ten.parquet"), prompt_field="question", answer_format="last_number")
    assert run_eval(EvalConfig.from_flat(out=str(tmp_path / "c"), **ten))["n"] == 10
    assert run_eval(EvalConfig.from_flat(out=str(tmp_path / "d"), split="0.3", **ten))["n"] == 3
    # sft trains on the assistant turns, as on the built-in solutions
    runs = {}
    for name, task in (("builtin", "arithmetic"), ("chat", str(byo_data / "chat"))):
        out = str(tmp_path / name)
        cfg = SFTConfig.from_flat(
            init=RUN["student"], task=task, out=out, steps=2, batch_size=4, eval_size=4, device="cpu"
        )
        sft(cfg, show_progress=False)
        runs[name] = [r["train/loss"] for r in read_metrics(tmp_path / name) if "train/loss" in r]
    assert runs["chat"] == pytest.approx(runs["builtin"], rel=1e-6) and len(runs["chat"]) == 2


# ----------------------------------------------------------------------------- reading data


def write_all_formats(rows: list[dict], root) -> list[str]:
    ds = Dataset.from_list(rows)
    ds.to_parquet(root / "d.parquet")
    ds.to_csv(root / "d.csv", index=False)
    ds.to_json(root / "d.jsonl")
    (root / "d.json").write_text(json.dumps(rows))
    ds.save_to_disk(root / "disk")
    ds.select(range(3)).to_parquet(root / "shard-0.parquet")
    ds.select(range(3, len(rows))).to_parquet(root / "shard-1.parquet")
    (root / "folder").mkdir()
    ds.to_parquet(root / "folder" / "train.parquet")
    return ["d.parquet", "d.csv", "d.jsonl", "d.json", "disk", "disk/*.arrow", "shard-*.parquet", "folder"]


def test_every_format_reads_the_same_examples(arithmetic, tmp_path):
    rows = [gsm8k_row(e) for e in arithmetic.examples("test")[:10]]
    sources = write_all_formats(rows, tmp_path)
    want = [(e.prompt, e.answer) for e in arithmetic.examples("test")[:10]]
    for source in sources:
        task = DatasetTask(tmp_path / source, prompt_field="question", answer_format="gsm8k", split="0")
        assert [(e.prompt, e.answer) for e in task.examples("train")] == want, source
        assert task.examples("test") == []


def test_held_out_split_is_the_jsonl_tasks(tmp_path):
    # one seeded held-out mechanism for every source
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    Dataset.from_list(rows).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = DatasetTask(tmp_path / "d.parquet", split="0.2", seed=3)
    jsonl = JsonlTask(tmp_path / "d.jsonl", test_fraction=0.2, seed=3)
    assert [e.prompt for e in parquet.examples("test")] == [e.prompt for e in jsonl.examples("test")]
    assert len(parquet.examples("test")) == 4 and len(parquet.examples("train")) == 16
    default = DatasetTask(tmp_path / "d.parquet", seed=3)  # one split: 10% held out
    assert len(default.examples("test")) == 2


def test_named_splits_and_evaluation_sets(tmp_path):
    def ds(prefix, n):
        return Dataset.from_list([{"prompt": f"{prefix}{i}", "answer": str(i)} for i in range(n)])

    DatasetDict(train=ds("a", 5), validation=ds("v", 3), test=ds("t", 2)).save_to_disk(tmp_path / "dd")
    task = DatasetTask(tmp_path / "dd")  # train and test exist: used as they are
    assert [e.prompt for e in task.examples("test")] == ["t0", "t1"] and len(task.examples("train")) == 5
    task = DatasetTask(tmp_path / "dd", split="train,validation")
    assert [e.prompt for e in task.examples("test")] == ["v0", "v1", "v2"]
    evaluation = DatasetTask(tmp_path / "dd", evaluation=True)
    assert [e.prompt for e in evaluation.examples("test")] == ["t0", "t1"] and evaluation.examples("train") == []
    assert len(DatasetTask(tmp_path / "dd", evaluation=True, split="validation").examples("test")) == 3
    ds("w", 7).to_parquet(tmp_path / "one.parquet")  # one split: every row is evaluated
    assert len(DatasetTask(tmp_path / "one.parquet", evaluation=True).examples("test")) == 7
    DatasetDict(train=ds("a", 5), validation=ds("v", 3)).save_to_disk(tmp_path / "tv")
    with pytest.raises(UserError, match=r"splits train, validation and none is called test; .*--eval-split NAME"):
        DatasetTask(tmp_path / "tv", evaluation=True, flag_prefix="eval-")
    with pytest.raises(UserError, match=r"no split 'dev' \(its splits: train, validation, test\); fix --split"):
        DatasetTask(tmp_path / "dd", split="train,dev")


def test_load_tasks_reads_the_eval_options(byo_data):
    cfg = TrainConfig.from_flat(
        task=str(byo_data / "chat"),
        eval_task=str(byo_data / "gsm8k_test.parquet"),
        eval_prompt_field="question",
        eval_answer_format="gsm8k",
    )
    task, evaluation = load_tasks(cfg)
    assert (task.answer_format, evaluation.answer_format) == ("boxed", "gsm8k")
    assert len(evaluation.examples("test")) == 500  # the whole file: it has one split
    assert task.examples("test") == []  # with --eval-task the training data keeps no test split
    same, same_eval = load_tasks(TrainConfig.from_flat(task=str(byo_data / "chat")))
    assert same is same_eval
    # the chat data's own test split holds the same problems, its answers read alike in both formats
    assert evaluation.examples("test")[0].answer == same.examples("test")[0].answer


def test_chat_messages_and_system_prompts(tmp_path):
    chats = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "It is \\boxed{4}"},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "That is \\boxed{6}"},
        ],
        [{"role": "user", "content": "What is 5 - 1?"}],
    ]
    Dataset.from_list([{"messages": chats[0], "answer": None}, {"messages": chats[1], "answer": "4"}]).to_parquet(
        tmp_path / "c.parquet"
    )
    # the first chat is kept whole up to its last user turn; the assistant turn after it is the solution.
    # The second has no assistant turn: its answer comes from the answer column
    got = DatasetTask(tmp_path / "c.parquet", split="0").examples("train")
    assert got == [
        Example("And 3 + 3?", "6", "c", "That is \\boxed{6}", None, tuple(chats[0][:4])),
        Example("What is 5 - 1?", "4", "c", None, None),
    ]
    # --system-prompt replaces a chat's system turn, and reaches the prompt the model reads
    got = DatasetTask(tmp_path / "c.parquet", split="0", system_prompt="Answer in a box.").examples("train")
    assert [e.chat()[0] for e in got] == [{"role": "system", "content": "Answer in a box."}] * 2
    assert got[0].chat()[1:] == chats[0][1:4] and got[1].system == "Answer in a box."
    tok = load_tokenizer(ASSETS / "student")
    ids = PromptSet.build(got, tok, 256).prompt_ids[1]
    text = "<|im_start|>system\nAnswer in a box.<|im_end|>\n<|im_start|>user\nWhat is 5 - 1?<|im_end|>\n"
    assert tok.decode(ids) == text + "<|im_start|>assistant\n" == format_prompt(tok, got[1].prompt, got[1].system)
    arithmetic = load_task("arithmetic", 1, 0, system_prompt="Be brief.")
    assert {e.system for e in arithmetic.examples("test")} == {"Be brief."}


# ----------------------------------------------------------------------------- bad input


def parquet(tmp_path, rows, name="bad.parquet"):
    path = tmp_path / name
    Dataset.from_list(rows).to_parquet(path)
    return path


def test_missing_column_names_the_columns_and_the_option(tmp_path):
    path = parquet(tmp_path, [{"question": "q", "final": "1"}])
    with pytest.raises(UserError, match=r"no column 'prompt' \(its columns: question, final\); .*--prompt-field"):
        DatasetTask(path)
    # no 'answer' column: prompts without reference answers; a column named otherwise must be there
    assert DatasetTask(path, prompt_field="question", split="0").examples("train")[0].answer is None
    with pytest.raises(UserError, match=r"no column 'answers' \(its columns: question, final\); fix --answer-field"):
        DatasetTask(path, prompt_field="question", answer_field="answers")
    assert (
        DatasetTask(path, prompt_field="question", answer_field="final", split="0").examples("train")[0].answer == "1"
    )


def test_empty_split(tmp_path):
    row = {"prompt": "p", "answer": "1"}
    empty = Dataset.from_dict({"prompt": [], "answer": []})
    DatasetDict(train=Dataset.from_list([row]), test=empty).save_to_disk(tmp_path / "saved")
    with pytest.raises(UserError, match=r"split 'test' of .*saved is empty \(0 rows\)"):
        DatasetTask(tmp_path / "saved")
    (tmp_path / "files").mkdir()
    Dataset.from_list([row]).to_parquet(tmp_path / "files" / "train.parquet")
    empty.to_parquet(tmp_path / "files" / "test.parquet")
    with pytest.raises(UserError, match=r"split 'test' of .*files is empty \(0 rows\)"):
        DatasetTask(tmp_path / "files")
    empty.to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(UserError, match=r"split 'train' of .*empty.parquet is empty \(0 rows\)"):
        DatasetTask(tmp_path / "empty.parquet")


def test_non_string_prompts_and_answers(tmp_path):
    with pytest.raises(
        UserError, match=r"3 of 3 prompts are not usable in .*row 1: 'prompt' is a int, neither a string"
    ):
        DatasetTask(parquet(tmp_path, [{"prompt": i, "answer": "1"} for i in range(3)]))
    with pytest.raises(UserError, match=r"3 of 3 values are not strings .*row 1: 'answer' is a int \('7'\)"):
        DatasetTask(parquet(tmp_path, [{"prompt": "p", "answer": 7}] * 3, "ints.parquet"))
    with pytest.raises(UserError, match=r"1 of 1 prompts .*'messages' has no user turn \(roles: assistant\)"):
        DatasetTask(parquet(tmp_path, [{"messages": [{"role": "assistant", "content": "x"}]}], "chat.parquet"))


def test_bad_chats_and_empty_sets(tmp_path):
    good = {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "\\boxed{2}"}]}
    bad = {"messages": [{"role": "system", "content": "Be brief."}]}
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, good, bad)))
    with pytest.raises(
        UserError, match=r'field "messages" in .*chats.jsonl, line 3 has no user turn \(roles: system\)'
    ):
        DatasetTask(path)
    cfg = TrainConfig.from_flat(task=str(tmp_path / "one.parquet"), split="0", student="s", teacher="t")
    parquet(tmp_path, [{"prompt": "p", "answer": "1"}], "one.parquet")
    _, evaluation = load_tasks(cfg)
    with pytest.raises(UserError, match=r"there are no test prompts: .*--split holds out, or --eval-task"):
        PromptSet.build(evaluation.examples("test"), load_tokenizer(ASSETS / "student"), 256, "test prompts")


def test_a_json_array_file_names_rows_not_lines(tmp_path):
    path = tmp_path / "array.json"
    path.write_text(json.dumps([{"prompt": "p", "answer": "1"}, {"prompt": None, "answer": "2"}], indent=1))
    with pytest.raises(
        UserError, match=r"1 of 2 prompts are not usable in .*array.json, e.g. row 2: 'prompt' is missing"
    ):
        DatasetTask(path)


def test_unparseable_answers_are_counted_and_one_is_shown(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": f"so {i}\n#### {i}" if i % 2 else f"it is {i}"} for i in range(6)]
    with pytest.raises(
        UserError, match=r"3 of 6 reference answers cannot be read as --answer-format gsm8k in .*row 1: 'it is 0'"
    ):
        DatasetTask(parquet(tmp_path, rows), answer_format="gsm8k")
    # a GSM8K answer read as boxed is neither boxed nor a bare answer: the error says which format fits
    with pytest.raises(
        UserError, match=r"6 of 6 reference answers cannot be read as --answer-format boxed.*gsm8k for '#### 42'"
    ):
        DatasetTask(parquet(tmp_path, rows[1::2] * 2, "g.parquet"))


def test_glob_without_match_and_missing_paths(tmp_path):
    with pytest.raises(UserError, match=r"'.*nothing-\*\.parquet' matches no file"):
        DatasetTask(str(tmp_path / "nothing-*.parquet"))
    with pytest.raises(UserError, match="data file not found"):
        DatasetTask(tmp_path / "missing.parquet")
    with pytest.raises(
        UserError,
        match=r"--task 'arithmetik' is no local path, 'arithmetic' or a preset \(gsm8k, .*hf download arithmetik",
    ):
        load_task("arithmetik")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        UserError, match=r"found \.txt files; opd reads \.parquet, \.arrow, \.json, \.jsonl, \.csv files"
    ):
        DatasetTask(tmp_path / "notes.txt")


def test_unknown_answer_format_and_stray_eval_options(tmp_path):
    with pytest.raises(UserError, match=r"unknown answer format 'boxd': use one of boxed, gsm8k, last_number"):
        TrainConfig.from_flat(answer_format="boxd")
    with pytest.raises(UserError, match=r"not a valid Python regex"):
        SFTConfig.from_flat(arch="qwen2:1:8", eval_task="x", eval_answer_format="regex:(")
    with pytest.raises(ConfigError, match="eval_prompt_field set without eval_task"):
        TrainConfig.from_flat(eval_prompt_field="question")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--answer-format", "boxd"], "unknown answer format 'boxd': use one of boxed, gsm8k, last_number"),
        (["--task", "{data}/gsm8k_test.parquet"], "has no column 'prompt' (its columns: question, answer)"),
    ],
)
def test_the_cli_prints_data_errors_as_one_line(byo_data, tmp_path, args, message):
    # the data is read before the models: the student path is never looked at
    cmd = ["eval", "--student", str(tmp_path / "no-model"), *(a.format(data=byo_data) for a in args)]
    proc = subprocess.run([sys.executable, "-m", "opd", *cmd], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr

"""Tasks: the synthetic arithmetic generator, the JSONL loader and the registry."""

from __future__ import annotations

import json
import re

import pytest

from opd.errors import UserError
from opd.tasks import ArithmeticTask, Example, JsonlTask, Task, get_task
from opd.tasks.arithmetic import MAX_ANSWER, solve_chain

EQUATION = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)\.")
SOLUTION = re.compile(
    r"<think>((?:\d+ [-+*] \d+ = \d+\.(?: |(?=<)))+)</think> The answer is "
    r"\\boxed\{(\d+)\}"
)


def small(**kw) -> ArithmeticTask:
    kw.setdefault("n_train", 2000)
    kw.setdefault("n_test", 200)
    return ArithmeticTask(**kw)


def parse_solution(solution: str) -> tuple[list[tuple[int, str, int, int]], int]:
    m = SOLUTION.fullmatch(solution)
    assert m, f"solution not in the fixed format: {solution!r}"
    eqs = [(int(a), op, int(b), int(c)) for a, op, b, c in EQUATION.findall(m.group(1))]
    return eqs, int(m.group(2))


# ---------------------------------------------------------------- arithmetic


def test_deterministic_and_seeded():
    a, b = small(), small()
    assert a.examples("train") == b.examples("train")
    assert a.examples("test") == b.examples("test")
    other = small(seed=1)
    assert other.examples("test") != a.examples("test")


@pytest.mark.parametrize("level", [1, 2])
def test_split_sizes_and_disjoint(level):
    # Level 1 has few distinct short prompts, so train/test collisions happen unless excluded.
    task = ArithmeticTask.from_level(level, n_train=2000, n_test=200)
    train, test = task.examples("train"), task.examples("test")
    assert len(train) == 2000 and len(test) == 200
    train_prompts, test_prompts = {e.prompt for e in train}, {e.prompt for e in test}
    assert len(train_prompts) == len(train) and len(test_prompts) == len(test)
    assert not train_prompts & test_prompts
    # The test split must not depend on how much training data was asked for.
    assert ArithmeticTask.from_level(level, n_train=500, n_test=200).examples("test") == test


def test_unknown_split_rejected():
    with pytest.raises(UserError, match="unknown split"):
        small().examples("validation")


@pytest.mark.parametrize("ops", [("+", "-"), ("+", "-", "*")])
def test_solutions_are_correct_chains_of_the_prompt_numbers(ops):
    task = small(ops=ops, num_ops=(1, 4), n_train=1500, n_test=100)
    sym = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}
    for ex in task.examples("train") + task.examples("test"):
        eqs, boxed = parse_solution(ex.solution)
        assert 1 <= len(eqs) <= 4
        for i, (a, op, b, c) in enumerate(eqs):
            assert op in ops and sym[op](a, b) == c
            assert 0 <= c < MAX_ANSWER
            if i:
                assert a == eqs[i - 1][3], "each equation starts from the previous result"
        assert boxed == eqs[-1][3] and ex.answer == str(boxed)
        # The prompt states exactly the chain's numbers, in order, and nothing else numeric.
        numbers = [eqs[0][0]] + [b for _, _, b, _ in eqs]
        assert [int(x) for x in re.findall(r"\d+", ex.prompt)] == numbers, ex.prompt
        assert task.reward(ex.solution, ex) == 1.0


def test_expression_prompts_with_multiplication_read_conventionally():
    task = small(ops=("+", "-", "*"), num_ops=(2, 4), n_train=3000)
    checked = 0
    for ex in task.examples("train"):
        m = re.fullmatch(r"Compute (.*)\.", ex.prompt)
        if m and "*" in m.group(1):
            assert eval(m.group(1)) == int(ex.answer), ex.prompt  # noqa: S307 - digits and ops only
            checked += 1
    assert checked > 10


def test_wrong_or_missing_answer_gets_zero_reward():
    task = small()
    ex = task.examples("test")[0]
    wrong = ex.solution.replace(f"\\boxed{{{ex.answer}}}", f"\\boxed{{{int(ex.answer) + 1}}}")
    assert wrong != ex.solution
    assert task.reward(wrong, ex) == 0.0
    assert task.reward(f"The answer is {ex.answer}", ex) == 0.0  # no \boxed{}
    assert task.reward(f"\\boxed{{{ex.answer}}}", ex) == 1.0


def test_levels_change_op_count_and_operand_size():
    def stats(task):
        chains = [parse_solution(e.solution)[0] for e in task.examples("train")]
        n_ops = {len(c) for c in chains}
        operands = [x for c in chains for x in [c[0][0]] + [b for _, _, b, _ in c]]
        return n_ops, max(operands)

    ops1, max1 = stats(ArithmeticTask.from_level(1, n_train=1000, n_test=50))
    ops4, max4 = stats(ArithmeticTask.from_level(5, n_train=1000, n_test=50))
    assert ops1 == {1} and max1 <= 9
    assert ops4 == {3, 4} and 99 < max4 <= 999
    assert get_task("arithmetic", level=4, n_train=100, n_test=10).num_ops == (2, 3)
    with pytest.raises(UserError, match="level"):
        ArithmeticTask.from_level(9)


def test_prompts_vary_in_wording():
    prompts = [e.prompt for e in small(n_train=5000).examples("train")]
    words = {w for p in prompts for w in re.findall(r"[A-Za-z']+", p)}
    assert len(words) >= 1000  # 1289 measured
    # Many different sentence shapes, not one template with numbers swapped.
    shapes = {re.sub(r"\d+", "N", p.split(".")[0].split("?")[0])[:25] for p in prompts}
    assert len(shapes) >= 100


@pytest.mark.parametrize(
    "kwargs", [dict(num_ops=(0, 2)), dict(num_ops=(3, 2)), dict(max_operand=0), dict(ops=("/",)), dict(n_train=-1)]
)
def test_bad_arithmetic_settings(kwargs):
    with pytest.raises(UserError):
        ArithmeticTask(**kwargs)


def test_solve_chain_format():
    assert solve_chain(12, [("+", 7), ("-", 3)]) == (
        16,
        "<think>12 + 7 = 19. 19 - 3 = 16.</think> The answer is \\boxed{16}",
    )


def test_registry_and_protocol(tmp_path):
    task = get_task("arithmetic", n_train=10, n_test=5)
    assert isinstance(task, Task) and task.name == "arithmetic"
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "p", "answer": "1"}\n')
    assert isinstance(get_task("jsonl", path=path, test_fraction=0.0), Task)
    with pytest.raises(UserError, match="arithmetic, jsonl"):
        get_task("nope")


# ---------------------------------------------------------------- jsonl


def write(tmp_path, text: str, name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_loads_and_splits(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(10)]
    lines[3] = json.dumps({"prompt": "q3", "answer": "3", "task": "geo", "solution": "s"})
    path = write(tmp_path, "\n".join(lines[:5]) + "\n\n   \n" + "\n".join(lines[5:]) + "\n")
    task = JsonlTask(path, test_fraction=0.2, seed=0)
    train, test = task.examples("train"), task.examples("test")
    assert len(train) == 8 and len(test) == 2
    assert {e.prompt for e in train} | {e.prompt for e in test} == {f"q{i}" for i in range(10)}
    assert not {e.prompt for e in train} & {e.prompt for e in test}
    assert JsonlTask(path, test_fraction=0.2, seed=0).examples("test") == test
    every = {e.prompt: e for e in train + test}
    assert every["q3"] == Example("q3", "3", "geo", "s")
    assert every["q4"] == Example("q4", "4", "jsonl", None)


def test_jsonl_test_path_and_reward(tmp_path):
    train = write(tmp_path, '{"prompt": "half?", "answer": "1/2"}\n')
    test = write(tmp_path, '{"prompt": "two?", "answer": "2"}\n', "test.jsonl")
    task = JsonlTask(train, test_path=test, name="mine")
    assert [e.prompt for e in task.examples("test")] == ["two?"]
    ex = task.examples("train")[0]
    assert ex.task == "mine"
    assert task.reward("so \\boxed{0.5}", ex) == 1.0
    assert task.reward("so \\boxed{0.4}", ex) == 0.0


def test_jsonl_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match="not found") as e:
        JsonlTask(missing)
    assert str(missing) in str(e.value)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_jsonl_empty_file(tmp_path, text):
    with pytest.raises(UserError, match="is empty"):
        JsonlTask(write(tmp_path, text))


@pytest.mark.parametrize(
    "bad_line, pattern",
    [
        ('{"prompt": "x", "answer": ', r"invalid JSON .*line 3"),
        ('{"answer": "1"}', r'line 3 has no "prompt" field'),
        ('{"prompt": "x", "answer": "1", "tools": {"name": "add"}}', r'field "tools" .*line 3 is a dict, not a list'),
        ('{"prompt": "x", "tools": "[1, 2]"}', r'field "tools" .*line 3 is a list holding non-objects'),
        ('{"prompt": "x", "answer": 16}', r'field "answer" .*line 3 is a int, not a string'),
        ('{"prompt": ["x"], "answer": "1"}', r'field "prompt" .*line 3 is a list, not a string'),
        ('{"prompt": "x", "answer": "1", "task": 5}', r'field "task" .*line 3 is a int'),
        ('["x", "1"]', r"line 3 is a JSON list, not an object"),
    ],
)
def test_jsonl_bad_line_is_named(tmp_path, bad_line, pattern):
    good = '{"prompt": "ok", "answer": "1"}\n'
    path = write(tmp_path, good + good + bad_line + "\n" + good)
    with pytest.raises(UserError, match=pattern):
        JsonlTask(path)


def test_jsonl_bad_test_fraction(tmp_path):
    path = write(tmp_path, '{"prompt": "ok", "answer": "1"}\n')
    with pytest.raises(UserError, match="test_fraction"):
        JsonlTask(path, test_fraction=1.0)

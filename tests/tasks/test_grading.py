"""Grading (boxed extraction, math equivalence, threads, answer formats); the evaluation arithmetic
(pass@k and the others) is in evaluation/test_estimators.py."""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from opd.errors import UserError
from opd.tasks.grading import (
    MAX_SYMBOLIC_CHARS,
    answers_match,
    check_answer_format,
    extract_answer,
    extract_boxed,
    grade,
    reference_answer,
)

# ---------------------------------------------------------------- extract_boxed


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"The answer is \boxed{16}", "16"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\sqrt{\frac{a}{b}} + {c}}", r"\sqrt{\frac{a}{b}} + {c}"),
        (r"first \boxed{1}, then \boxed{2}, finally \boxed{3}.", "3"),
        (r"\boxed {7}", "7"),
        (r"\boxed{ 42 }", "42"),
        ("no box here", None),
        ("", None),
        (r"cut off \boxed{12", None),  # truncated generation: no partial answer
        (r"\boxed{5} and the word \boxed without braces", "5"),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# ---------------------------------------------------------------- answers_match


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("16", "16"),
        (" 16 ", "16"),
        ("1/2", "0.5"),
        ("0.5", "1/2"),
        ("16.0", "16"),
        ("16", "16.0"),
        (r"\frac{1}{2}", "0.5"),
        ("1,000", "1000"),
        ("x+1", "1+x"),
    ],
)
def test_answers_match_equivalent(pred, ref):
    assert answers_match(pred, ref)


@pytest.mark.parametrize(
    "pred, ref",
    [
        ("17", "16"),
        ("0.51", "0.5"),
        ("", "16"),
        ("16", ""),
        ("   ", "1"),
        ("1/3", "0.5"),
    ],
)
def test_answers_match_different(pred, ref):
    assert not answers_match(pred, ref)


def test_overlong_answers_skip_symbolic_path():
    # "16.0" vs "16" only matches through sympy; padded past the bound it is refused.
    long = "16.0" + " " * 3 + "+ 0" * MAX_SYMBOLIC_CHARS
    assert not answers_match(long, "16")
    assert answers_match("16.0 + 0", "16")


def test_grade():
    assert grade(r"<think>3 + 4 = 7.</think> The answer is \boxed{7}", "7")
    assert grade(r"\boxed{0.5}", "1/2")
    assert not grade(r"\boxed{8}", "7")
    assert not grade("The answer is 7", "7")


def test_grading_from_worker_threads():
    # math-verify's own timeouts use signal.alarm, which raises off the main thread; these
    # cases need the symbolic path, so they only pass if grading handles that.
    cases = [(r"\boxed{0.5}", "1/2", True), (r"\boxed{16.0}", "16", True), (r"\boxed{0.4}", "1/2", False)]
    results, errors = [], []

    def work():
        try:
            results.extend(grade(c, r) for c, r, _ in cases)
        except Exception as e:  # pragma: no cover - recorded for the assertion below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors
    assert results == [want for _, _, want in cases]
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(lambda c: grade(c[0], c[1]), cases * 4)) == [w for *_, w in cases] * 4


# ---------------------------------------------------------------- answer formats


@pytest.mark.parametrize(
    "text, fmt, expected",
    [
        (r"so \boxed{12}", "boxed", "12"),
        ("3 + 4 = 7.\n#### 7", "gsm8k", "7"),
        ("#### 1,200\nthat is all", "gsm8k", "1200"),
        ("#### 5 then #### 6", "gsm8k", "6"),
        ("no mark, 7", "gsm8k", None),
        ("####   ", "gsm8k", None),
        ("she had 1,200, then 35.5 apples", "last_number", "35.5"),
        ("left with -3.", "last_number", "-3"),
        ("no digits", "last_number", None),
        ("  Paris \n", "exact", "Paris"),
        ("  ", "exact", None),
        ("Answer: (B), no, Answer: (C)", r"regex:Answer: \((\w)\)", "C"),
        ("x = 5 and y = 6", r"regex:\d+", "6"),
        ("nothing", r"regex:Answer: (\w)", None),
    ],
)
def test_extract_answer(text, fmt, expected):
    assert extract_answer(text, fmt) == expected


def test_reference_answers():
    assert reference_answer("3/4") == "3/4"  # a bare answer, as JSONL files have always held
    assert reference_answer(r"so it is \boxed{\frac{3}{4}}.") == r"\frac{3}{4}"
    assert reference_answer("step 1\n#### 4") is None  # a solution in another format, not an answer
    assert reference_answer("step 1\n#### 4", "gsm8k") == "4"
    assert reference_answer("no number", "last_number") is None


def test_grade_in_each_format():
    assert grade("half of it: #### 0.5", "1/2", "gsm8k")  # still math-verify
    assert not grade(r"\boxed{7}", "7", "gsm8k")  # the format reads the model's output too
    assert grade("The farm has 1,000 cows.", "1000", "last_number")
    assert grade(" Paris ", "Paris", "exact")
    assert not grade("paris", "Paris", "exact") and not grade("0.5", "1/2", "exact")  # strings, no math
    assert grade("Answer: 16.0", "16", r"regex:Answer: (\S+)")
    assert not grade("", "16", r"regex:Answer: (\S+)")


@pytest.mark.parametrize(
    "fmt, message",
    [
        ("boxd", "unknown answer format 'boxd': use one of boxed, gsm8k"),
        ("regex:", "has no pattern"),
        ("regex:(", "not a valid Python regex"),
    ],
)
def test_bad_answer_formats(fmt, message):
    with pytest.raises(UserError, match=re.escape(message)):
        check_answer_format(fmt)

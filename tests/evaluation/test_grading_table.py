"""The grading table: how opd, math-verify's default and math-verify as open-r1 applies it read the same
responses, and what a reader would say. Each row's three verdicts are computed here and must equal the
table; docs/training.md prints the same table (checked below), so a change of grader shows in both.

opd follows math-verify's default (its parse and verify of the box's content) except where a row says
why not: it takes the last box (a model that corrects itself boxes its final answer last; math-verify's
default reads all boxes as a set), reads LaTeX's own ``\\fbox`` and a full stop after the answer, and
reads nothing outside a box (math-verify's default also reads a bare final number, so a response that
names a number and gives up is graded correct: the "Let me try 7" row).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from latex2sympy2_extended import NormalizationConfig
from math_verify import LatexExtractionConfig, parse, verify

from opd.tasks.grading import grade

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"

# (response, reference, a reader's verdict, opd, math-verify default, open-r1)
CASES = [
    (r"The answer is \boxed{7}.", "7", 1, 1, 1, 1),
    (r"The answer is \boxed 7", "7", 1, 1, 1, 0),
    (r"The answer is \boxed 12.", "12", 1, 1, 1, 0),
    (r"The answer is \fbox{7}", "7", 1, 1, 0, 0),
    (r"First \boxed{3}, then corrected: \boxed{7}", "7", 1, 1, 0, 0),
    (r"\boxed{7} is wrong, the answer is \boxed{3}", "7", 0, 0, 0, 0),
    (r"\boxed{7} \boxed{7}", "7", 1, 1, 1, 1),
    (r"<think>maybe 5</think> \boxed{7}", "7", 1, 1, 1, 1),
    (r"<think>\boxed{7}</think> so \boxed{5}", "7", 0, 0, 0, 0),
    (r"\boxed{5} and the word \boxed without braces", "5", 1, 1, 1, 1),
    (r"\boxed{\frac{1}{2}}", "0.5", 1, 1, 1, 1),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1, 1, 1, 1),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", 1, 1, 1, 1),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1, 1, 1, 1),
    (r"\boxed{\frac{6}{4}}", r"\frac{3}{2}", 1, 1, 1, 1),
    (r"\boxed{1\frac{1}{2}}", r"\frac{3}{2}", 1, 1, 1, 1),
    (r"\boxed{0.333}", r"\frac{1}{3}", 0, 0, 0, 0),
    (r"\boxed{16.0}", "16", 1, 1, 1, 1),
    (r"\boxed{0.50}", "0.5", 1, 1, 1, 1),
    (r"\boxed{.5}", "0.5", 1, 1, 1, 1),
    (r"\boxed{7.}", "7", 1, 1, 0, 0),
    (r"\boxed{1,200}", "1200", 1, 1, 1, 1),
    (r"\boxed{1200}", "1,200", 1, 1, 1, 1),
    (r"\boxed{10^{3}}", "1000", 1, 1, 1, 1),
    (r"\boxed{1e3}", "1000", 1, 0, 0, 0),
    (r"\boxed{-3}", "3", 0, 0, 0, 0),
    (r"\[\boxed{-3}\]", "-3", 1, 1, 1, 1),
    (r"\boxed{5\text{ cm}}", "5", 1, 1, 1, 1),
    (r"\boxed{5 \mathrm{cm}}", "5", 1, 1, 1, 1),
    (r"\boxed{\$18}", "18", 1, 1, 1, 1),
    (r"\boxed{90^\circ}", "90", 1, 1, 1, 1),
    (r"\boxed{\frac{\pi}{2}}", r"90^\circ", 0, 0, 0, 0),
    (r"\boxed{50\%}", "50", 1, 1, 1, 1),
    (r"\boxed{50\%}", "0.5", 1, 1, 1, 1),
    (r"\boxed{[1, 3)}", "[1,3)", 1, 1, 1, 1),
    (r"\boxed{(1, 3)}", "[1,3]", 0, 0, 0, 0),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", 1, 1, 1, 1),
    (r"\boxed{x \in [0, 1]}", "[0,1]", 1, 1, 1, 1),
    (r"\boxed{x = 5}", "5", 1, 1, 1, 1),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}", 1, 1, 1, 1),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1, 1, 1, 1),
    (r"\boxed{\pi}", r"\pi", 1, 1, 1, 1),
    (r"\boxed{3.14}", r"\pi", 0, 0, 0, 0),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1, 1, 1, 1),
    (r"\boxed{2, 3}", "3, 2", 1, 1, 1, 1),
    (r"\boxed{\{1, 2\}}", r"\{2,1\}", 1, 1, 1, 1),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", 1, 1, 1, 1),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1, 1, 1, 1),
    (r"\boxed{\text{B}}", "B", 1, 1, 1, 1),
    (r"\boxed{\textbf{(C)}}", "C", 1, 1, 1, 1),
    (r"\boxed{B}", "C", 0, 0, 0, 0),
    (r"\boxed{yes}", "yes", 1, 1, 1, 1),
    (r"\boxed{7", "7", 0, 0, 0, 0),
    (r"The answer is 7.", "7", 1, 0, 1, 0),
    (r"So x = 7.", "7", 1, 0, 1, 0),
    (r"$7$", "7", 1, 0, 1, 0),
    (r"**Answer:** 7", "7", 1, 0, 1, 0),
    (r"The final answer is $\frac{1}{2}$.", "0.5", 1, 0, 1, 1),
    (r"Let me try 7. Hmm, that fails; I am not sure.", "7", 0, 0, 1, 0),
    (r"I cannot solve this.", "7", 0, 0, 0, 0),
]

# open-r1's accuracy reward (src/open_r1/rewards.py): boxed answers first, nothing read without an anchor.
OPEN_R1 = [
    LatexExtractionConfig(
        normalization_config=NormalizationConfig(
            nits=False, malformed_operators=False, basic_latex=True, equations=True, boxed="all", units=True
        ),
        boxed_match_priority=0,
        try_extract_without_anchor=False,
    )
]


def _gold(reference: str):
    return parse(f"\\boxed{{{reference}}}")  # the reference is a bare answer: one box reads it whole


def math_verify_default(response: str, reference: str) -> bool:
    return bool(verify(_gold(reference), parse(response)))


def open_r1(response: str, reference: str) -> bool:
    return bool(verify(_gold(reference), parse(response, extraction_config=OPEN_R1, extraction_mode="first_match")))


def table() -> str:
    """The table as docs/training.md prints it."""
    lines = [
        "| Response | Reference | A reader | opd | math-verify default | open-r1 |",
        "|---|---|---|---|---|---|",
    ]
    mark = {0: "no", 1: "yes"}
    for response, reference, reader, ours, default, r1 in CASES:
        cells = [f"`{response}`", f"`{reference}`", *(mark[v] for v in (reader, ours, default, r1))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def _quiet_math_verify():
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)


def test_the_table_has_the_cases_the_issue_asks_for():
    assert len(CASES) >= 50
    assert len({(r, ref) for r, ref, *_ in CASES}) == len(CASES)  # no row twice


@pytest.mark.parametrize("response, reference, reader, ours, default, r1", CASES)
def test_each_grader_gives_its_column(response, reference, reader, ours, default, r1):
    got = (grade(response, reference), math_verify_default(response, reference), open_r1(response, reference))
    assert got == (bool(ours), bool(default), bool(r1))


def test_opd_departs_from_math_verify_only_where_the_reader_agrees_with_opd():
    """The rule the table keeps: where opd and math-verify's default differ, opd is the one a reader agrees
    with (else opd should follow math-verify)."""
    departures = [(r, ref, reader, ours) for r, ref, reader, ours, default, _ in CASES if ours != default]
    assert departures  # the table shows where and why
    wrong = [(r, ref) for r, ref, reader, ours in departures if ours != reader]
    # A bare answer with no box: math-verify's default reads it, opd's boxed format does not, on purpose
    # (the "Let me try 7" row is why): the one kind of departure where a reader sides with math-verify.
    assert all("boxed" not in r and "fbox" not in r for r, _ in wrong), wrong


def test_the_docs_print_this_table():
    assert table() in DOCS.read_text(), "docs/training.md's grading table differs: paste\n" + table()

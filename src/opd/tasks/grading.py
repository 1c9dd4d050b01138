"""Answer grading shared by every task: pull the final answer out of a completion (by default
its last ``\\boxed{...}``) and decide whether it matches the reference answer.

Usage::

    from opd.tasks.grading import grade, extract_boxed, extract_answer, answers_match
    grade(r"<think>3 + 4 = 7.</think> The answer is \\boxed{7}", "7")   # True
    grade("3 + 4 = 7.\\n#### 7", "7", "gsm8k")                          # True
    extract_boxed(r"\\boxed{\\frac{1}{2}}")                             # "\\frac{1}{2}"
    extract_answer("so 1,200 apples", "last_number")                    # "1200"
    answers_match("0.5", "1/2")                                         # True

Answer formats (``--answer-format``; the same format reads the reference and the model's output):
``boxed`` (the last ``\\boxed{}``), ``gsm8k`` (the text after the last ``####``, GSM8K's
convention), ``last_number`` (the last integer or decimal, thousands separators dropped),
``exact`` (the whole text, compared as a string without math-verify) and ``regex:PATTERN``
(the last match of PATTERN, its first group if it has one).

``answers_match`` first compares whitespace-normalised strings (the common case for the
synthetic tasks, and about 1000x cheaper than sympy), then falls back to math-verify, which
knows that ``1/2 == 0.5`` and ``16 == 16.0``.

Threads: math-verify bounds each parse/verify with ``signal.alarm``, which only works on the
main thread (elsewhere it raises ValueError). Off the main thread we call it with its timeouts
disabled (``parsing_timeout=None``, ``timeout_seconds=None``) and bound the work ourselves by
refusing answers longer than ``MAX_SYMBOLIC_CHARS`` before they reach sympy.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

from math_verify import parse, verify

from opd.errors import UserError

__all__ = [
    "ANSWER_FORMATS",
    "MAX_SYMBOLIC_CHARS",
    "answers_match",
    "check_answer_format",
    "extract_answer",
    "extract_boxed",
    "grade",
    "reference_answer",
]

ANSWER_FORMATS = ("boxed", "gsm8k", "last_number", "exact", "regex:PATTERN")

# Final answers are short; a long "answer" is almost always a model rambling inside \boxed{},
# and sympy on long input is where math-verify can hang when its alarm is off.
MAX_SYMBOLIC_CHARS = 200
_MAIN_THREAD_TIMEOUT_S = 5


def _drop_timeout_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


# math-verify warns the first time its timeouts are off; we bound the input length instead,
# so in a worker thread that warning is noise. Other math-verify messages pass through.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_warning)

_BOXED = "\\boxed"
# A box: \boxed or \fbox (LaTeX's own box, which math-verify does not read), then braces or one bare token.
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# \boxed 7: the bare form math-verify's default parse reads; a number or a single letter, so that prose
# naming \boxed ("put it in \boxed form") is not read as an answer.
_BARE = re.compile(r"\s+(-?\d[\d,]*(?:\.\d+)?|[A-Za-z](?![A-Za-z]))")


def extract_boxed(text: str) -> str | None:
    """Return the content of the LAST box in ``text``: ``\\boxed{...}`` (nested braces kept), ``\\fbox{...}``
    or ``\\boxed 7`` (a bare number or letter), or None.

    The last box, as MATH's reference code and most reasoning evaluations take it: a model that corrects
    itself boxes its final answer last (math-verify's default reads every box as a set instead). An
    unclosed last box (a truncated generation) returns None rather than a partial answer.
    """
    for box in reversed(list(_BOX.finditer(text))):
        i = box.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j].strip()
            return None
        bare = _BARE.match(text, box.end())
        if bare:
            return bare.group(1)
        # "\boxed" followed by neither (prose mentioning \boxed): look further left.
    return None


def _normalize(s: str) -> str:
    return " ".join(s.split())


def _symbolic_match(predicted: str, reference: str) -> bool:
    on_main = threading.current_thread() is threading.main_thread()
    timeout = _MAIN_THREAD_TIMEOUT_S if on_main else None
    # Wrapping in \boxed{} makes math-verify read the whole string as one LaTeX answer;
    # bare strings go through its plain-expression extractor, which misses e.g. "x+1".
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def answers_match(predicted: str, reference: str) -> bool:
    """True if ``predicted`` equals ``reference`` as a math answer ("1/2" == "0.5"); a sentence's full stop
    after the answer ("7.") is not part of it (math-verify reads "7." as no number)."""
    p, r = _normalize(predicted).removesuffix("."), _normalize(reference)
    if not p or not r:
        return False
    if p == r:
        return True
    if len(p) > MAX_SYMBOLIC_CHARS or len(r) > MAX_SYMBOLIC_CHARS:
        return False
    try:
        return _symbolic_match(p, r)
    except Exception:  # noqa: BLE001 - a grader must never crash a training loop
        return False


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_MARK = "####"


def check_answer_format(fmt: str) -> re.Pattern | None:
    """Raise UserError for an unknown format or a bad regex; return the compiled regex of ``regex:``."""
    if fmt.startswith("regex:"):
        pattern = fmt[len("regex:") :]
        if not pattern:
            raise UserError("answer format 'regex:' has no pattern: write e.g. regex:Answer: (\\S+)")
        try:
            return _compile(pattern)
        except re.error as e:
            raise UserError(f"answer format {fmt!r}: the pattern is not a valid Python regex ({e})") from None
    if fmt not in ANSWER_FORMATS:
        raise UserError(f"unknown answer format {fmt!r}: use one of {', '.join(ANSWER_FORMATS)}")
    return None


@functools.lru_cache(maxsize=16)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(pattern)


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_answer(text: str, fmt: str = "boxed") -> str | None:
    """The final answer of ``text`` in answer format ``fmt``, or None when it has none."""
    if fmt == "boxed":
        return extract_boxed(text)
    if fmt == "gsm8k":
        cut = text.rfind(_GSM8K_MARK)
        if cut == -1:
            return None
        # GSM8K writes "#### 1,200"; the first line after the mark is the answer.
        lines = text[cut + len(_GSM8K_MARK) :].strip().splitlines()
        answer = lines[0].strip().replace(",", "") if lines else ""
        return answer or None
    if fmt == "last_number":
        return _last_number(text)
    if fmt == "exact":
        return text.strip() or None
    regex = check_answer_format(fmt)
    matches = list(regex.finditer(text)) if regex is not None else []
    if not matches or regex is None:  # no matches without a regex
        return None
    last = matches[-1]
    answer = last.group(1) if regex.groups else last.group(0)
    return answer.strip() if answer and answer.strip() else None


def reference_answer(text: str, fmt: str = "boxed") -> str | None:
    """A dataset's reference answer in format ``fmt``: as :func:`extract_answer`, except that with
    ``boxed`` a reference without any ``\\boxed`` is already the bare answer ("3/4") if it is one
    line of at most ``MAX_SYMBOLIC_CHARS`` (a longer text is a solution in another format)."""
    if fmt == "boxed" and _BOXED not in text:
        bare = text.strip()
        return bare if bare and "\n" not in bare and len(bare) <= MAX_SYMBOLIC_CHARS else None
    return extract_answer(text, fmt)


def grade(completion: str, reference: str, fmt: str = "boxed") -> bool:
    """Extract the final answer of ``completion`` in format ``fmt`` and compare it to ``reference``
    (a final answer: math-equivalent for every format but ``exact``, which compares strings)."""
    predicted = extract_answer(completion, fmt)
    if predicted is None:
        return False
    if fmt == "exact":
        return _normalize(predicted) == _normalize(reference)
    return answers_match(predicted, reference)

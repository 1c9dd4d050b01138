"""Answer grading shared by every task: pull the final ``\\boxed{...}`` out of a completion
and decide whether it matches the reference answer.

Usage::

    from opd.grading import grade, extract_boxed, answers_match
    grade(r"<think>3 + 4 = 7.</think> The answer is \\boxed{7}", "7")   # True
    extract_boxed(r"\\boxed{\\frac{1}{2}}")                             # "\\frac{1}{2}"
    answers_match("0.5", "1/2")                                         # True

``answers_match`` first compares whitespace-normalised strings (the common case for the
synthetic tasks, and about 1000x cheaper than sympy), then falls back to math-verify, which
knows that ``1/2 == 0.5`` and ``16 == 16.0``.

Threads: math-verify bounds each parse/verify with ``signal.alarm``, which only works on the
main thread (elsewhere it raises ValueError). Off the main thread we call it with its timeouts
disabled (``parsing_timeout=None``, ``timeout_seconds=None``) and bound the work ourselves by
refusing answers longer than ``MAX_SYMBOLIC_CHARS`` before they reach sympy.
"""

from __future__ import annotations

import logging
import threading

from math_verify import parse, verify

__all__ = ["MAX_SYMBOLIC_CHARS", "extract_boxed", "answers_match", "grade"]

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


def extract_boxed(text: str) -> str | None:
    """Return the content of the LAST ``\\boxed{...}`` in ``text`` (nested braces kept), or None.

    An unclosed last box (a truncated generation) returns None rather than a partial answer.
    """
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
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
        # "\boxed" not followed by "{" (e.g. prose mentioning \boxed): look further left.
        start = text.rfind(_BOXED, 0, start)
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
    """True if ``predicted`` equals ``reference`` as a math answer ("1/2" == "0.5")."""
    p, r = _normalize(predicted), _normalize(reference)
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


def grade(completion: str, reference: str) -> bool:
    """Extract the last ``\\boxed{}`` answer of ``completion`` and compare it to ``reference``."""
    predicted = extract_boxed(completion)
    if predicted is None:
        return False
    return answers_match(predicted, reference)

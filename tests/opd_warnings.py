"""A pytest plugin: a FutureWarning or DeprecationWarning that opd's own code causes fails the test.

Libraries announce an API's removal with these warnings a few releases ahead; a user sees them
on every step of a run, and then the release that removes the API breaks it. Failing here turns
the next deprecation into a red CI instead of a user's broken run.

pytest's ``filterwarnings`` cannot say "caused by opd": it matches the module a warning is
attributed to, and a deprecated keyword of a model's ``forward`` is attributed to torch's module
call machinery (``Module._call_impl`` stands between opd's ``model(...)`` line and the forward).
So every ``warnings.warn`` is looked at: the warning is opd's when the frame it blames (its
``stacklevel``), after skipping those pass-through frames, is in opd's source. A library that
calls its own deprecated API inside a call opd made is that library's business, not opd's. A
warning with stacklevel 1 blames the library's own line (``TrainingArguments.__post_init__`` on a
deprecated field): then the blame goes to the first caller outside that library.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch.nn.modules.module

import opd

OPD_SOURCE = str(Path(opd.__file__).resolve().parent) + os.sep
CATEGORIES = (FutureWarning, DeprecationWarning)
# Frames between a caller and the API it calls that belong to neither.
PASS_THROUGH = tuple(str(Path(m.__file__).resolve()) for m in (torch.nn.modules.module, functools))

_caught: list[str] = []


def blamed_opd_line(frame) -> str | None:
    """``file:line`` of the opd frame a warning blames (``frame`` is the one at its stacklevel), or None."""
    while frame is not None and _path(frame) in PASS_THROUGH:
        frame = frame.f_back
    if frame is None:
        return None
    path = _path(frame)
    return f"{path.removeprefix(OPD_SOURCE)}:{frame.f_lineno}" if path.startswith(OPD_SOURCE) else None


def _path(frame) -> str:
    return str(Path(frame.f_code.co_filename).resolve())


def _package(frame) -> str:
    return frame.f_globals.get("__name__", "").partition(".")[0]


def _first_caller_outside(frame):
    """The first frame out of ``frame``'s package (and of dataclasses' generated ``__init__``)."""
    package = _package(frame)
    while frame is not None and (_package(frame) == package or frame.f_code.co_filename == "<string>"):
        frame = frame.f_back
    return frame


def _checked_warn(message, category=None, stacklevel=1, source=None, **kwargs):
    cat = category or (type(message) if isinstance(message, Warning) else UserWarning)
    if issubclass(cat, CATEGORIES):
        try:
            blamed = sys._getframe(max(stacklevel, 1))  # 0 is this wrapper, 1 the caller of warn
        except ValueError:  # a stacklevel beyond the stack: the warning blames nobody here
            blamed = None
        if blamed is not None and stacklevel <= 1:
            blamed = _first_caller_outside(blamed)
        line = blamed_opd_line(blamed)
        if line is not None:
            _caught.append(f"{cat.__name__} caused by opd/{line}: {message}")
    return _real_warn(message, cat, stacklevel + 1, source, **kwargs)


_real_warn = warnings.warn


def pytest_configure(config):
    warnings.warn = _checked_warn


def pytest_unconfigure(config):
    warnings.warn = _real_warn


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _caught.clear()
    result = yield
    if _caught:
        found, _caught[:] = list(_caught), []
        pytest.fail(
            "opd's own code caused a deprecation warning (move to the new API; see tests/opd_warnings.py):\n"
            + "\n".join(dict.fromkeys(found)),
            pytrace=False,
        )
    return result

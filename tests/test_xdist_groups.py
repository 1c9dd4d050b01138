"""The suite's ``xdist_group`` marks hold under ``--dist loadgroup`` (tests/xdist_groups.py): a group's tests
run on one worker, so a module fixture they share (a vLLM server) starts once."""

from __future__ import annotations

from pathlib import Path

INNER = """
import os

import pytest


@pytest.fixture(scope="module")
def started():
    with open("starts.txt", "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")


@pytest.mark.xdist_group("server")
@pytest.mark.parametrize("i", range(6))
def test_grouped(started, i):
    pass


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    pass
"""


def test_a_groups_tests_run_on_one_worker(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent), prepend=":")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "xdist_groups", "-n", "2", "--dist", "loadgroup", "-v")
    result.assert_outcomes(passed=12)
    workers = {line.split("]")[0] for line in result.outlines if "PASSED" in line and "test_grouped" in line}
    assert len(workers) == 1, result.outlines  # without the plugin: both, the grouped ids without "@server"
    assert len((pytester.path / "starts.txt").read_text().split()) == 1  # the module fixture started once

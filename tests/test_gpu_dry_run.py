"""The gpu tests (tests/gpu) and their runner, benchmarks/gpu_check.py: who runs them, and their CPU dry run.

The dry run (slow: CI's second step) runs every gpu test's code once on the CPU at small shapes, through the
runner, so that the one try a lent GPU gets is spent on opd, not on an error in a test or in the card."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def pytest_run(*args: str, dry_run: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OPD_GPU_DRY_RUN"}
    env.update({"OPD_GPU_DRY_RUN": "1"} if dry_run else {}, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    return done.stdout


def test_gpu_tests_run_only_when_asked_for_and_skip_without_cuda():
    env_tests = str(ROOT / "tests" / "gpu" / "test_env.py")
    assert "2 deselected" in pytest_run("-m", "not slow", env_tests)  # the README's command leaves them out
    assert "2 skipped" in pytest_run("-m", "gpu", "-rs", env_tests)  # asked for, no CUDA: skipped, saying why


def test_the_runner_runs_every_gpu_test_file():
    on_disk = {p.stem.removeprefix("test_") for p in (ROOT / "tests" / "gpu").glob("test_*.py")}
    assert set(gpu_check.FILES) == on_disk


def test_the_card_records_outcomes_figures_and_failures(pytester, tmp_path):
    pytester.makepyfile(
        test_card="""
        import pytest

        def test_ok(record_property):
            record_property("tokens_per_s", 1234.5678)
            record_property("losses", [(0.5, 0.25)])

        def test_bad():
            assert 1 == 2, "the check failed"

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass
        """
    )
    out = tmp_path / "card.json"
    meta = {"card": "t", "commit": "abc1234", "machine": {"gpu": "G"}, "device": "cuda", "dry_run": False}
    card = gpu_check.Card(out, {**meta, "started": "now", "pytest_args": ["-m", "gpu"]})
    pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[card]).assert_outcomes(
        passed=1, failed=1, skipped=1
    )
    got = json.loads(out.read_text())
    tests = {k.split("::")[-1]: t for k, t in got["tests"].items()}
    assert got["counts"] == {"passed": 1, "failed": 1, "skipped": 1} and got["commit"] == "abc1234"
    assert tests["test_ok"]["recorded"] == {"tokens_per_s": 1234.5678, "losses": [[0.5, 0.25]]}
    assert "the check failed" in tests["test_bad"]["error"] and tests["test_skipped"]["why"] == "not here"
    md = out.with_suffix(".md").read_text()
    assert "| test_ok | passed |" in md and "tokens_per_s 1235; losses [[0.5, 0.25]]" in md
    assert "## Failures" in md and "test_card.py::test_bad** failed" in md


@pytest.mark.slow
def test_gpu_tests_dry_run(tmp_path):
    out = tmp_path / "card.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    card = json.loads(out.read_text())
    assert card["commit"] and card["machine"] and card["dry_run"] and card["card"] == "card"
    tests = card["tests"]
    files = {nodeid.split("::")[0].split("/")[-1] for nodeid in tests}
    assert files == {f"test_{name}.py" for name in gpu_check.FILES}
    skipped = {k: t["why"] for k, t in tests.items() if t["outcome"] == "skipped"}
    assert {k for k, t in tests.items() if t["outcome"] not in ("passed", "skipped")} == set()
    # a skip in the dry run is a parametrization whose code another one ran, or vLLM's GPU-only sleep mode
    assert all("same test code" in why or "CUDA GPUs only" in why for why in skipped.values()), skipped
    assert sum(t["outcome"] == "passed" for t in tests.values()) >= 60
    assert tests["tests/gpu/test_speed.py::test_loss_step[lsm_hidden-float32]"]["recorded"]["median_ms"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| test_resume_equals_uninterrupted | passed |" in md and "## tests/gpu/test_decode.py" in md

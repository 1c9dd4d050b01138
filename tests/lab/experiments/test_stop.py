"""Stopping cleanly: ``opd experiment --workers 2`` sent SIGTERM (as a scheduler or ``kill`` sends it) ends
with every worker process it started within seconds, each run's last checkpoint valid, and the same
command run again resumes the training runs from there."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from opd.runs.rundir import RunDir

# An experiment of two short training runs side by side, registered under a test name and run through
# opd's real command line (its SIGTERM handling lives in opd.cli.main).
EXPERIMENT = """
from opd.config import TrainConfig
from opd.lab.experiments.core import Analysis, Experiment, RunSpec

STUDENT, TEACHER = {student!r}, {teacher!r}


def plan(s):
    cfg = dict(student=STUDENT, teacher=TEACHER, steps={steps}, batch_size=2, max_new_tokens=8, eval_every=0,
               eval_size=2, eval_samples=0, ckpt_every=1, log_rollouts=1, diag_positions=8, warmup_steps=1)
    return [RunSpec(f"run{{i}}", "train", TrainConfig.from_flat(out=str(s.run_dir(f"run{{i}}")), seed=i, **cfg), needs=())
            for i in range(2)]


EXPERIMENT = Experiment("stop-test", "stop test", "two runs", plan, lambda s, specs: Analysis())
"""
MAIN = """
import sys
sys.path.insert(0, {folder!r})
import opd.lab.experiments
opd.lab.experiments._MODULES["stop-test"] = "stop_experiment"
from opd.cli import main
sys.argv = ["opd", "experiment", "stop-test", "--seeds", "1", "--out", {out!r}, "--workers", "2"]
main()
"""


# Enough steps that neither run ends before the other's first checkpoint: a busy machine once started
# one run's process late enough that the other finished all of 30 before the stop (CI pre-check at caecc1f).
STEPS = 80


def _steps(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "train/loss" in line]


@pytest.mark.slow
def test_sigterm_stops_an_experiments_workers_and_a_rerun_resumes(tiny_models, tmp_path):
    student, teacher = tiny_models
    (tmp_path / "stop_experiment.py").write_text(
        EXPERIMENT.format(student=str(student), teacher=str(teacher), steps=STEPS)
    )
    out = tmp_path / "out"
    script = MAIN.format(folder=str(tmp_path), out=str(out))
    runs = [out / "stop-test" / "runs" / f"run{i}" for i in range(2)]

    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not all(RunDir(r).latest_checkpoint() for r in runs):  # both runs past a checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.5)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 2  # the two workers (and the pool's own helpers)
        proc.send_signal(signal.SIGTERM)  # to the parent alone, as `kill PID` does
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            import os

            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert (
        "opd: stopped by SIGTERM; what it started has ended. Rerun the same command to go on (opd experiment resumes"
        in err
    )
    time.sleep(0.5)
    alive = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive and stopped_in < 30, (alive, stopped_in)
    before = {r: _steps(r) for r in runs}
    checkpoints = {r: RunDir(r).latest_checkpoint() for r in runs}
    for r in runs:  # stopped midway, the last checkpoint whole
        assert 0 < len(before[r]) < STEPS and (checkpoints[r] / "COMPLETE").is_file(), r

    rerun = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    for r in runs:
        after = _steps(r)
        assert [x["step"] for x in after] == list(range(STEPS)), r
        kept = int(checkpoints[r].name.split("_")[-1]) + 1  # steps up to the checkpoint: kept, not redone
        assert after[:kept] == before[r][:kept]

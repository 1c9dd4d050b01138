"""The real-shape GPU check (benchmarks/gpu_real_shape.py), dry-run on the CPU at small shapes: every item
runs, so the one try a lent GPU gets is not spent on a script error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_real_shape_check_dry_run(tmp_path):
    out = tmp_path / "real_shape.json"
    script = ROOT / "benchmarks" / "gpu_real_shape.py"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--small", "--budget", "600", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert {name: r["status"] for name, r in got.items()} == dict.fromkeys(
        ["env", "sdpa", "nan_cause", "replay_lsm", "step_split", "replay_sampled", "replay_full_kl", "demo_speed"],
        "ok",
    ), {k: r.get("error", "") for k, r in got.items()}
    assert got["sdpa"]["grad_nonfinite"]["L192_math"] == {"q": 0, "k": 0, "v": 0}  # the CPU's kernel, finite
    assert all(got["nan_cause"][k]["finite"] for k in ("cudnn_allowed", "cudnn_off"))  # no cuDNN on a CPU
    for objective in ("lsm", "sampled", "full_kl"):
        r = got[f"replay_{objective}"]
        assert r["finite"] and r["within_tolerance"] is (None if objective == "sampled" else True), r["summary"]
    assert got["step_split"]["rollout_tokens_per_s"] > 0
    assert "| replay_lsm | ok |" in out.with_suffix(".md").read_text()

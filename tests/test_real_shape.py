"""The real-shape harness (benchmarks/real_shape.py) in its quick mode: every stage of both cells runs at both
vocabularies and lands in the JSON and the table, so the long run is not spent on a script error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEP = ["rollout", "score", "update", "log", "eval", "checkpoint"]
STAGES = [
    "rollout (static cache)",
    "score (in-process)",
    "score (served)",
    "cross-tokenizer setup",
    "score (cross-tokenizer)",
    "policy check (served engine)",
    "loss lsm",
    "loss lsm --tail",
    "loss lsm --forward-kl-share 0.5",
    "loss lsm --no-renormalize",
    "loss full_kl",
    "loss sampled",
]


@pytest.mark.slow
def test_real_shape_quick_mode(tmp_path):
    out = tmp_path / "real_shape.json"
    script = ROOT / "benchmarks" / "real_shape.py"
    args = ["--quick", "--models", str(tmp_path / "models"), "--out", str(out), "--sampling", "0.05,0.95"]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert [(c["kind"], c["vocab"]) for c in got["cells"]] == [
        ("step", 2048),
        ("stages", 2048),
        ("step", 151936),
        ("stages", 151936),
    ]
    for c in got["cells"]:
        assert "error" not in c, c["error"]
        assert [r["stage"] for r in c["stages"]] == (STEP if c["kind"] == "step" else STAGES)
        assert all(r["peak"] > 0 and r["seconds"] >= 0 for r in c["stages"])
    assert got["commit"] and got["machine"]["cpu_cores"]
    assert len(got["summary"]) == 2  # the step's and the final evaluation's peaks, V = 151,936 over 2,048
    assert "| step | 151,936 | 64 | eval |" in out.with_suffix(".md").read_text()
    # runs of one length each join into one table, each cell with its run's commit
    joined = tmp_path / "joined.json"
    args = ["--merge", f"{out},{out}", "--note", "Shared machine.", "--out", str(joined)]
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    both = json.loads(joined.read_text())
    assert len(both["cells"]) == 8 and {c["commit"] for c in both["cells"]} == {got["commit"]}
    assert "Shared machine." in joined.with_suffix(".md").read_text()

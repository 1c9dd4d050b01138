"""The decode benchmark (benchmarks/bench_decode.py), dry-run on the CPU at tiny shapes: every row runs, so the
one try a lent GPU gets is not spent on a script error, and the static cache's rows are the dynamic cache's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_decode_benchmark_dry_run(tmp_path):
    out = tmp_path / "decode.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), "--small", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    rows = [r for r in got["rows"] if "engine" in r]
    assert not [r for r in rows if r.get("status")], rows
    kinds = {(r["precision"], r["batch"], r["engine"]) for r in rows}
    for batch in (4, 8):
        for precision in ("float32", "bf16-mixed"):
            assert {(precision, batch, "opd dynamic"), (precision, batch, "opd static")} <= kinds
        assert {("bf16-pure", batch, "opd static"), ("float32", batch, "HF static")} <= kinds
    assert ("float32", 8, "opd static, no graph") in kinds
    assert all(r["tokens_per_s"] > 0 and r["tokens"] == r["batch"] * got["settings"]["new"] for r in rows)
    for r in rows:
        if r["engine"] == "opd static" and r["precision"] != "bf16-pure":
            assert r["same_tokens"] == 1.0, r  # the CPU: the dynamic cache's tokens, row for row
        if r["engine"].startswith("opd") and r["precision"] == "float32":
            assert r["logp_gap"] < 1e-4, r
    checks = {r["precision"]: r for r in got["rows"] if r.get("check") == "in-place update"}
    assert set(checks) == {"float32", "bf16-mixed"} and all(c["new_captures"] == 0 for c in checks.values())
    assert checks["float32"]["logp_gap"] < 1e-4
    assert got["commit"] and got["machine"]["cpu_capability"]
    assert "| float32 | 8 | opd static |" in out.with_suffix(".md").read_text()

"""Two-rank runs in a loop, counting the ones that hang at exit: the rank shutdown race's stress test.

Each launch is ``torchrun --nproc_per_node 2 -m opd train`` (gloo, CPU) of the demo models for a few
steps, DDP or FSDP, given ``--timeout`` seconds; one still running then is a hang (its process group
is killed). Not part of the test suite: a hang is rare per launch (the race needs a gloo worker
thread to be freeing its last work at the moment the main thread frees the process group), so it
takes dozens of launches to show.

    python benchmarks/stress_shutdown.py --ddp 25 --fsdp 25 --label after
    PYTHONPATH=/path/to/other/checkout/src python benchmarks/stress_shutdown.py --label before
    python benchmarks/stress_shutdown.py --parallel 3 --label after-loaded   # launches side by side

Prints a table and merges ``{label: {...}}`` into ``benchmarks/results/stress_shutdown.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "opd" / "assets" / "demo"
RESULTS = ROOT / "benchmarks" / "results" / "stress_shutdown.json"


def launch(kind: str, out: Path, timeout: float) -> tuple[str, float, str]:
    """One two-rank run: ("ok" | "hang" | "failed", seconds, the end of its stderr when not ok)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "opd"]
    cmd += ["train", "--student", str(DEMO / "student"), "--teacher", str(DEMO / "teacher"), "--out", str(out)]
    cmd += ["--device", "cpu", "--steps", "2", "--batch-size", "2", "--max-new-tokens", "8", "--eval-every", "0"]
    cmd += ["--eval-size", "2", "--eval-samples", "0", "--ckpt-every", "0", "--k", "8", "--diag-positions", "8"]
    cmd += ["--fsdp"] if kind == "fsdp" else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "hang", time.monotonic() - t0, ""
    status = "ok" if proc.returncode == 0 else "failed"
    return status, time.monotonic() - t0, "" if status == "ok" else err[-800:]


def commit(src: Path) -> str:
    """The checked-out commit of the opd source that ran (``-dirty`` when its files differ from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=src, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "-uno", "--", "."], cwd=src, capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ddp", type=int, default=25, help="DDP launches")
    ap.add_argument("--fsdp", type=int, default=25, help="FSDP launches")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a launch counts as hung")
    ap.add_argument("--label", default="run", help="the key of this run in the results file")
    ap.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="launches at once: CPU contention like CI's (xdist workers beside the ranks), where the hang was seen",
    )
    args = ap.parse_args()
    import torch

    import opd

    counts: dict[str, dict[str, int]] = {}
    failures, seconds = [], []
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        for kind, n in (("ddp", args.ddp), ("fsdp", args.fsdp)):
            counts[kind] = {"ok": 0, "hang": 0, "failed": 0}
            jobs = [pool.submit(launch, kind, Path(tmp) / f"{kind}{i}", args.timeout) for i in range(n)]
            for i, job in enumerate(jobs):
                status, took, err = job.result()
                counts[kind][status] += 1
                seconds.append(took)
                if err:
                    failures.append({"kind": kind, "launch": i, "stderr_tail": err})
                print(f"{kind} {i + 1}/{n}: {status} ({took:.0f} s)", flush=True)
    print(f"\n{'':6}{'launches':>10}{'ok':>6}{'hang':>6}{'failed':>8}")
    for kind, c in counts.items():
        print(f"{kind:6}{sum(c.values()):>10}{c['ok']:>6}{c['hang']:>6}{c['failed']:>8}")
    record = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "opd_source": str(Path(opd.__file__).parent),
        "torch": torch.__version__,
        "commit": commit(Path(opd.__file__).parent),
        "timeout_s": args.timeout,
        "parallel": args.parallel,
        "counts": counts,
        "median_launch_s": sorted(seconds)[len(seconds) // 2] if seconds else None,
        "failures": failures,
    }
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[args.label] = record
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS} [{args.label}]")


if __name__ == "__main__":
    main()

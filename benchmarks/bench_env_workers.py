#!/usr/bin/env python
"""What one ``--env-workers`` game process costs: its memory, its start-up time, and whether it imported torch.

Each measurement runs in a fresh process whose main module is shaped like the ``opd`` console
script (``from opd.cli import main`` at the top: the trainer's imports, torch among them), since a
spawned worker may re-run its parent's main module. That process starts :class:`~opd.envs.workers.EnvWorkers`
with ``--workers`` processes (default 2) on the ``toy`` environment and on level-1 generated
``alfworld`` games (generated once, before the clock starts), and records:

* ``start_s``: ``EnvWorkers(env, N)`` from the call to its return (the workers start in parallel
  and each has unpickled the environment);
* ``first_answer_s``: from the same start until every worker has answered its first game's
  opening (one game a worker; for alfworld this includes loading the engine);
* per worker, once its first game is open: RSS and USS (memory private to it) in MB, and whether
  ``torch`` / ``transformers`` are in its ``sys.modules`` (asked after the memory was read).

Each row is the median of ``--repeats`` fresh processes. The machine may be shared: the load
average is recorded with the results.

Run (from the repository root; about a minute)::

    python benchmarks/bench_env_workers.py --label before
    python benchmarks/bench_env_workers.py --label after      # merged into the same JSON file
    python benchmarks/bench_env_workers.py --envs toy --repeats 1 --label dry-run --json /tmp/x.json

Writes ``benchmarks/results/env_workers.json`` (``--json``; one entry per ``--label``, others kept)
and prints a table of every label in it.
"""

from __future__ import annotations

# Only the standard library at the top: a worker imports this module to run probe().
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "env_workers.json"
HEAVY = ("torch", "transformers")

# The measuring process's main module: the same imports, in the same order, as the `opd` console
# script that pip writes for `opd = "opd.cli:main"` (plus this module, which imports no more).
LAUNCHER = """\
import re
import sys
from opd.cli import main
from bench_env_workers import measure_one

if __name__ == "__main__":
    measure_one(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
"""


def probe() -> dict:
    """Runs in a worker: which heavy modules it holds."""
    return {name: name in sys.modules for name in HEAVY} | {"modules": len(sys.modules)}


def make_env(name: str, games_dir: str):
    from opd.envs import get_env

    if name == "toy":
        return get_env("toy")
    if name == "alfworld":
        return get_env("alfworld", level=1, num_train=4, games_dir=games_dir, generated=True)
    raise SystemExit(f"unknown env {name!r}: use toy or alfworld")


def measure_one(env_name: str, workers: int, games_dir: str, out: str) -> None:
    """In the launcher process: start the workers, open one game on each, measure them."""
    import psutil

    from opd.envs.workers import EnvWorkers

    env = make_env(env_name, games_dir)
    games = env.games("train")[:workers]  # generated here (alfworld), before the clock starts
    t0 = time.perf_counter()
    pool = EnvWorkers(env, workers)
    start_s = time.perf_counter() - t0
    batch = pool.batch()
    for i, game in enumerate(games):
        batch.open(i, game)
    answers = batch.results()
    first_answer_s = time.perf_counter() - t0
    assert all(isinstance(a, str) for a in answers.values()), answers
    per_worker = []
    for w in pool.workers:
        mem = psutil.Process(w.pid).memory_full_info()
        row = {"rss_mb": mem.rss / 2**20, "uss_mb": mem.uss / 2**20}
        row |= w.submit(probe).result(timeout=60)
        per_worker.append(row)
    batch.close()
    pool.close()
    parent = {"torch": "torch" in sys.modules, "rss_mb": psutil.Process().memory_info().rss / 2**20}
    Path(out).write_text(
        json.dumps({"start_s": start_s, "first_answer_s": first_answer_s, "workers": per_worker, "parent": parent})
    )


def run_env(env_name: str, workers: int, repeats: int, tmp: Path) -> dict:
    launcher = tmp / "opd"  # named like the console script, run by path as it is
    launcher.write_text(LAUNCHER)
    games_dir = tmp / f"games-{env_name}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"), env.get("PYTHONPATH", "")])
    runs = []
    for r in range(repeats):
        out = tmp / f"{env_name}-{r}.json"
        cmd = [sys.executable, str(launcher), env_name, str(workers), str(games_dir), str(out)]
        subprocess.run(cmd, check=True, env=env, cwd=tmp)
        runs.append(json.loads(out.read_text()))
    ws = [w for run in runs for w in run["workers"]]
    med = statistics.median
    return {
        "workers": workers,
        "repeats": repeats,
        "start_s": med(r["start_s"] for r in runs),
        "first_answer_s": med(r["first_answer_s"] for r in runs),
        "rss_mb_per_worker": med(w["rss_mb"] for w in ws),
        "uss_mb_per_worker": med(w["uss_mb"] for w in ws),
        "modules_per_worker": med(w["modules"] for w in ws),
        **{f"{name}_in_worker": any(w[name] for w in ws) for name in HEAVY},
        "parent_torch": runs[0]["parent"]["torch"],
        "runs": runs,
    }


def table(results: dict) -> str:
    head = (
        f"{'label':<10} {'env':<9} {'N':>2} {'RSS MB/worker':>13} {'USS MB/worker':>13} {'start s':>8} "
        f"{'1st answer s':>12} {'modules':>7} {'torch':>5} {'transformers':>12}"
    )
    lines = [head, "-" * len(head)]
    for label, entry in results.items():
        for env_name, r in entry["envs"].items():
            lines.append(
                f"{label:<10} {env_name:<9} {r['workers']:>2} {r['rss_mb_per_worker']:>13.1f} "
                f"{r['uss_mb_per_worker']:>13.1f} {r['start_s']:>8.2f} {r['first_answer_s']:>12.2f} "
                f"{r['modules_per_worker']:>7.0f} {'yes' if r['torch_in_worker'] else 'no':>5} "
                f"{'yes' if r['transformers_in_worker'] else 'no':>12}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="run", help="key of this run in the JSON file (e.g. before, after)")
    ap.add_argument("--envs", default="toy,alfworld", help="comma-separated: toy, alfworld")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args()

    from importlib.metadata import version

    load_start = os.getloadavg()
    entry = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "envs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for env_name in args.envs.split(","):
            entry["envs"][env_name] = run_env(env_name, args.workers, args.repeats, Path(tmp))
    entry |= {
        "loadavg_start_end": [load_start[0], os.getloadavg()[0]],
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "start_method": "spawn",
    }
    from opd.lab.experiments.core import machine_info, source_commit  # after the timings: this parent stays as it was

    entry |= {"commit": source_commit(), "machine": machine_info()}
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    results[args.label] = entry
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

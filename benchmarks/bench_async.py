#!/usr/bin/env python
"""Rollouts generated ahead (``--max-staleness S``) against on-policy steps, side by side in one run.

For the demo (arithmetic, LSM, batch 64, 48 new tokens) and the agentic demo (ALFWorld level 1, LSM,
batch 16 episodes), each from its packaged models, it runs ``opd train`` at S = 0 (generation in the
trainer's process: today's runs), 1 and 2 (opd's sampling loop in a worker process given the weights),
and reports medians over the timed steps (the first max(S + 1, 4) steps warm up and are left out).

A game is about 3x slower to play the first time a process plays it (ALFWorld's engine parses it;
opd.envs._pddl_cache keeps the parse), and a long run mostly replays games (the agentic demo: 400
training games, 3,200 episodes). So the agentic workload here plays the demo's first 32 training games
(``num_train=32``), every run starts with the parse caches empty (a rollout worker is a new process,
so the S = 0 runs must not inherit the caches of the runs before them), and the timed steps replay
games the process that plays them has seen, as a long run's do. Each row's time is then:

* ``step``: the step's wall time; ``rollouts/s``: the step's rollouts over it; ``speedup``: S = 0's
  step time over this row's (the same workload, measured in this run);
* ``generate`` (S = 0: generating in the trainer; S > 0: the trainer waiting for the worker), ``score``
  and ``update``: the trainer's stages; ``worker``: the worker's seconds on the step's rollouts
  (S > 0), from which the two sides' idle times: the trainer's is its wait, the worker's is the
  step's time minus its own;
* ``bound``: max(generation, scoring + update) from the S = 0 row, what the step would take if the
  two sides never contended (their own cores or devices) and overlapped perfectly; ``vs bound``:
  the step over it.

On this machine both sides share 2 cores: by default the worker takes one torch thread and the trainer
the other (``threads T/W``); two more S = 1 rows give one side both threads (``--rollout-worker-threads``
and the trainer's OMP_NUM_THREADS), 3 threads on 2 cores. What the contention costs shows as ``worker``
against S = 0's ``generate``, and the trainer's stages against S = 0's. The projection for a GPU
host with generation and training on separate devices is ``bound`` (plus the weight transfer, which
here is a few milliseconds): written as a projection, not measured.

With ``--vllm`` the same workloads run with ``--rollout-engine vllm`` at S = 0, 1, 2 (opd starts a vLLM
server per run; its start is not timed): at S = 0 the trainer syncs and samples the server, at S > 0
the rollout worker does, while the trainer scores and updates. With ``--served`` they run with the
teacher served (``opd serve-teacher`` in a process of its own, ``--teacher-url``) at S = 0 and 1: at
S = 1 the teacher scores step t + 1's rollouts while the trainer updates on step t, so ``score`` is
the trainer's wait for those scores (``score ahead``: the scoring's own seconds).

Run (from the repository root; about 8 minutes on a quiet machine, 20 more with --vllm, 5 with --served):
  python benchmarks/bench_async.py --vllm --served
  python benchmarks/bench_async.py --quick   # 6 steps, small batches (a dry run)
Writes benchmarks/results/async_rollouts.json (``--json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import torch

from opd.envs import _pddl_cache
from opd.lab.demos import agentic, demo
from opd.training import loop as train_mod
from opd.training.ahead import split_threads

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "opd" / "assets"
STAGES = ("step", "generate", "score", "update", "worker_generate", "rollout_wait", "score_ahead")


def workloads(quick: bool, steps: int) -> dict:
    """Each workload's config maker: (S, out) -> the run's config (no evaluation, no checkpoints)."""
    common = dict(eval_every=0, eval_samples=0, eval_size=8, ckpt_every=0, objective="lsm")
    small = {"demo": dict(batch_size=16), "agentic": dict(batch_size=8)} if quick else {"demo": {}, "agentic": {}}
    return {
        "demo": lambda S, out: demo.opd_config(
            ASSETS / "demo", steps=steps, max_staleness=S, out=str(out), **common, **small["demo"]
        ),
        "agentic": lambda S, out: agentic.opd_config(
            ASSETS / "agentic",
            steps=steps,
            max_staleness=S,
            out=str(out),
            env_args=WARM_GAMES,
            **common,
            **small["agentic"],
        ),
    }


WARM_STEPS = 4  # left out of the medians at least: the games' first plays, the worker's start
WARM_GAMES = ["num_train=32", "num_test=50"]  # games the timed steps replay (2 steps of 16 see most of them)


def measure(cfg, S: int) -> dict:
    _pddl_cache.clear()  # this process's game parses: every run starts as cold as a new worker
    train_mod.train(cfg, show_progress=False)
    records = [json.loads(x) for x in (Path(cfg.run.out) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "time/step" in r][max(S + 1, WARM_STEPS) :]
    row = {"steps_timed": len(timed), "rollouts": cfg.optimizer.batch_size * cfg.rollout.samples_per_prompt}
    row["per_step"] = {}  # the values behind each median, so a row can be checked
    for stage in STAGES:
        values = [r[f"time/{stage}"] for r in timed if f"time/{stage}" in r]
        row[stage] = statistics.median(values) if values else None
        if values:
            row["per_step"][stage] = [round(v, 4) for v in values]
    row["rollouts_per_s"] = row["rollouts"] / row["step"]
    return row


# (engine, teacher, S, the trainer's torch threads, the worker's): None = opd's default (S = 0: every
# core's; S > 0: half each)
SETTINGS = [
    ("hf", "local", 0, None, None),
    ("hf", "local", 1, None, None),
    ("hf", "local", 2, None, None),
    ("hf", "local", 1, 1, 2),
    ("hf", "local", 1, 2, 1),
]
VLLM_SETTINGS = [("vllm", "local", S, None, None) for S in (0, 1, 2)]
SERVED_SETTINGS = [("hf", "served", S, None, None) for S in (0, 1)]


@contextmanager
def served_teacher(model_dir: str, log: Path):
    """``opd serve-teacher`` on a free port, in a process of its own (its output in ``log``, a file, as a
    pipe nobody reads would stall it once full): its URL, once it answers."""
    cmd = [sys.executable, "-m", "opd", "serve-teacher", model_dir, "--port", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(1200):
            said = log.read_text()
            if "train with --teacher-url " in said:
                url = said.split("train with --teacher-url ")[1].split()[0]
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"opd serve-teacher {model_dir} stopped: {said[-2000:]}")
            time.sleep(0.1)
        else:
            raise RuntimeError(f"opd serve-teacher {model_dir} did not start in 120 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(quick: bool, steps: int, settings: list) -> list[dict]:
    cores = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in workloads(quick, steps).items():
            base: dict = {}
            for engine, teacher, S, trainer, worker in settings:
                torch.set_num_threads(trainer or cores)  # a stale run's default split changes it
                cfg = make(S, Path(tmp) / f"{name}-{engine}-{teacher}-{S}-{trainer}-{worker}").replace(
                    rollout_worker_threads=worker or 0,
                    rollout_engine=engine,  # vllm: its policy check's bound resolved again
                )
                if teacher == "served":
                    with served_teacher(cfg.teacher.teacher, Path(tmp) / f"{name}-teacher.log") as url:
                        measured = measure(cfg.replace(teacher="", teacher_url=url), S)
                else:
                    measured = measure(cfg, S)
                row = {"workload": name, "engine": engine, "teacher": teacher, "S": S, **measured}
                split = (trainer or cores, worker) if worker else split_threads(cores) if S else (cores, 0)
                row["threads"] = f"{split[0]}/{split[1]}"
                torch.set_num_threads(cores)
                if S == 0:
                    base[engine, teacher] = row
                if (engine, teacher) in base:  # against the same engine's and teacher's on-policy row
                    b = base[engine, teacher]
                    row["speedup"] = b["step"] / row["step"]
                    row["bound"] = max(b["generate"], b["score"] + b["update"])
                    row["vs_bound"] = row["step"] / row["bound"]
                if S > 0:
                    row["trainer_idle"] = row["rollout_wait"]
                    row["worker_idle"] = max(0.0, row["step"] - row["worker_generate"])
                rows.append(row)
                print(table([row], header=len(rows) == 1), flush=True)
    return rows


def fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict], header: bool = True) -> str:
    cols = [
        "workload",
        "engine",
        "teacher",
        "S",
        "threads T/W",
        "step",
        "rollouts/s",
        "speedup",
        "generate",
        "score",
        "update",
        "score ahead",
        "worker",
        "idle T/W",
        "bound",
        "vs bound",
    ]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)] if header else []
    for r in rows:
        idle = f"{fmt(r.get('trainer_idle'))}/{fmt(r.get('worker_idle'))}" if r["S"] else "-"
        lines.append(
            " | ".join(
                [
                    r["workload"],
                    r["engine"],
                    r.get("teacher", "local"),
                    str(r["S"]),
                    r["threads"],
                    fmt(r["step"]),
                    fmt(r["rollouts_per_s"], 1),
                    fmt(r.get("speedup")),
                    fmt(r["generate"]),
                    fmt(r["score"]),
                    fmt(r["update"]),
                    fmt(r.get("score_ahead")),
                    fmt(r["worker_generate"]),
                    idle,
                    fmt(r.get("bound")),
                    fmt(r.get("vs_bound")),
                ]
            )
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="6 steps of small batches: a dry run")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default 12; --quick 6)")
    ap.add_argument("--vllm", action="store_true", help="add vLLM rows (S = 0, 1, 2; needs opd vllm-setup)")
    ap.add_argument("--served", action="store_true", help="add served-teacher rows (S = 0, 1)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "async_rollouts.json"))
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 12)
    extra = (VLLM_SETTINGS if args.vllm else []) + (SERVED_SETTINGS if args.served else [])
    rows = run(args.quick, steps, SETTINGS + extra)
    print()
    print(table(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out = {
        "commit": commit.stdout.strip(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "quick": args.quick,
        "steps": steps,
        "rows": rows,
        "note": "medians over the steps after the first max(S + 1, 4), the agentic runs replaying 32 games from "
        "empty parse caches; bound = max(generate, score + update) of S = 0, "
        "the step with the two sides on their own devices and perfect overlap: a projection, not measured",
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

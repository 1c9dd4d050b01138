#!/usr/bin/env python
"""Real lengths and vocabularies on the CPU: each stage of an OPD step's peak memory and time, at Qwen3's
151,936-token vocabulary and at the demo's 2,048, for responses of 1k, 4k and 8k tokens.

The models are narrow Qwen3s (student 2 x 64, teacher 2 x 128, tied heads; random weights) over the demo's
BPE tokenizer padded with plain vocabulary entries to the vocabulary measured (:mod:`opd.lab.real_shape`):
a head of the real size on a body that costs nothing, so what grows with vocabulary x length shows.
Random weights sample EOS about once in V tokens, so every response runs to its length. Each cell runs
in a fresh subprocess:

  step    one ``opd train`` step of 4 rollouts (the arithmetic prompts), then the final evaluation (8 test
          prompts, greedy and one sample) and checkpoint, opd's own loop with the dynamic cache, teacher top-K
          LSM; at 4k tokens and more with --gradient-checkpointing and --micro-batch-tokens (2 rows). The
          stages are opd.training.loop's: rollout, score (in-process teacher), update, log (diagnostics and
          rollout logging), eval, checkpoint.
  stages  the same shapes, stage by stage outside the loop, on one rollout batch: rollout with the static
          cache, teacher scoring in-process, served (opd serve-teacher's app in this process, over HTTP) and
          cross-tokenizer (opd's wrapper with the student's own tokenizer forced on: its setup, the
          vocabulary map, apart; see opd.lab.real_shape.cross_tokenizer_teacher), the served engine's
          policy check, and each objective's loss and backward (opd.lab.real_shape.OBJECTIVES: lsm, lsm
          --tail, lsm --forward-kl-share 0.5, lsm --no-renormalize, full_kl, sampled; every lsm from the
          student's hidden states, as the trainer computes it).

Memory is the process's peak resident set (VmHWM, reset through /proc/self/clear_refs as each stage
starts): ``peak`` is the most the process held during the stage, ``rise`` that peak minus the resident
set when the stage began. Resident memory counts what the allocator kept from earlier stages, so read
the rise with the peak. Not measured: a cross-tokenizer teacher's re-tokenization of the response (a
second tokenizer of 151,936 real entries needs a large corpus).

Writes JSON (--out) and a Markdown table beside it, with the commit and the machine.

Run (repository root):  python benchmarks/real_shape.py [--quick] [--lengths 1024,4096,8192] [--kinds step,stages]
Runs of one length or vocabulary each (side by side, or so that a long one's partial result is kept) join into one
table with --merge A.json,B.json --out C.json; each cell keeps its run's commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from opd.lab.experiments.core import cell_in_process, machine_info, source_commit  # noqa: E402

VOCABS = (2048, 151_936)
LENGTHS = (1024, 4096, 8192)
QUICK_LENGTHS = (64,)
ROWS, K, EVAL_SIZE = 4, 32, 8
STEP_STAGES = ["rollout_stage", "score_stage", "update_stage", "log_stage", "eval_stage", "checkpoint_stage"]


def status(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024


class Meter:
    """Each stage's peak resident set, its rise over the stage's start, and its seconds."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.open: dict[str, tuple[int, float]] = {}

    def enter(self, name: str) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current resident set
        self.open[name] = (status("VmRSS"), time.perf_counter())

    def leave(self, name: str) -> None:
        start, t0 = self.open.pop(name)
        peak = status("VmHWM")
        self.rows.append(
            {
                "stage": name.removesuffix("_stage"),
                "peak": peak,
                "rise": peak - start,
                "seconds": time.perf_counter() - t0,
            }
        )

    def measure(self, name: str, fn, *args, **kwargs):
        self.enter(name)
        try:
            return fn(*args, **kwargs)
        finally:
            self.leave(name)


def step_cell(spec: dict) -> list[dict]:
    """One opd train step, its final evaluation and checkpoint, each stage measured."""
    from opd.config import TrainConfig
    from opd.lab.real_shape import stages
    from opd.training import loop, producer

    T, long = spec["length"], spec["length"] >= 4096
    cfg = TrainConfig.from_flat(
        student=spec["student"],
        teacher=spec["teacher"],
        out=str(Path(spec["tmp"]) / "run"),
        device="cpu",
        steps=1,
        batch_size=ROWS,
        max_new_tokens=T,
        k=K,
        log_rollouts=spec["log_rollouts"],
        diag_positions=256,
        eval_size=EVAL_SIZE,
        eval_samples=1,
        eval_every=0,
        ckpt_every=0,
        gradient_checkpointing=long,
        micro_batch_tokens=2 * (T + 64) if long else 0,
        report_to=["none"],
        temperature=spec["temperature"],
        top_p=spec["top_p"],
    )
    meter = Meter()
    with stages((producer, loop), STEP_STAGES, meter.enter, meter.leave):
        loop.train(cfg, show_progress=False)
    return meter.rows


def stages_cell(spec: dict) -> list[dict]:
    """The stages outside the loop on one rollout batch (see the module docstring)."""
    import types

    import torch

    from opd.lab.real_shape import OBJECTIVES, cross_tokenizer_teacher, loss_and_backward, prompts, rollout_engine
    from opd.models.loading import checkpoint_layers, head_weight, load_model, load_tokenizer
    from opd.rollout.served import ServerEngine
    from opd.teachers.client import HTTPTeacher
    from opd.teachers.scoring import HFTeacher
    from opd.teachers.server import Limits, TeacherApp, start_server, stop_server

    T, meter = spec["length"], Meter()
    tok = load_tokenizer(spec["student"])
    student, teacher_model = load_model(spec["student"]), load_model(spec["teacher"], "teacher")
    engine = rollout_engine(student, tok, static_cache="on")
    how = dict(max_new_tokens=T, temperature=spec["temperature"], top_p=spec["top_p"])
    batch = meter.measure("rollout (static cache)", engine.generate, prompts(tok, ROWS), list(range(ROWS)), **how)
    teacher = HFTeacher(teacher_model)
    scores = meter.measure("score (in-process)", teacher.score, batch, K)
    app = TeacherApp(teacher_model, tok, "teacher", Limits(max_prompt_tokens=T + 512))
    server = start_server(app)
    try:
        url = "http://{}:{}".format(*server.server_address)
        client = HTTPTeacher(url, tok, head_weight(teacher_model).shape[0])
        meter.measure("score (served)", client.score, batch, K)
    finally:
        stop_server(server)
    cross = meter.measure("cross-tokenizer setup", cross_tokenizer_teacher, teacher_model, tok)
    meter.measure("score (cross-tokenizer)", cross.score, batch, K)
    checker = types.SimpleNamespace(model=student, max_gap=float("inf"), name="bench", gap_option="--max-gap")
    meter.measure("policy check (served engine)", ServerEngine.check_policy, checker, batch)
    student.train()
    if T >= 4096:
        checkpoint_layers(student)
    for name, options in OBJECTIVES.items():
        meter.measure(name, loss_and_backward, student, teacher, batch, scores, options, K)
        student.zero_grad(set_to_none=True)
    torch.set_grad_enabled(True)
    return meter.rows


def cell(spec: dict) -> dict:
    torch_threads = os.environ.get("OMP_NUM_THREADS")
    with tempfile.TemporaryDirectory() as tmp:
        rows = (step_cell if spec["kind"] == "step" else stages_cell)({**spec, "tmp": tmp})
    return {**spec, "threads": torch_threads, "stages": rows, "process_peak": max(r["peak"] for r in rows)}


def run_cell(spec: dict) -> dict:
    return cell_in_process(__file__, spec, ROOT, 2000)


def summary(cells: list[dict]) -> list[str]:
    """The issue's goal: at each length, the step's and the final evaluation's peak at V = 151,936 over V = 2,048."""
    out = []
    steps = {(c["vocab"], c["length"]): c for c in cells if c["kind"] == "step" and "error" not in c}
    for T in sorted({t for _, t in steps}):
        small, large = steps.get((VOCABS[0], T)), steps.get((VOCABS[1], T))
        if not (small and large):
            continue
        for stages, what in ((("rollout", "score", "update", "log"), "the step"), (("eval",), "the final evaluation")):
            peak = lambda c, names=stages: max(r["peak"] for r in c["stages"] if r["stage"] in names)
            gap = (peak(large) - peak(small)) / 2**30
            out.append(
                f"{T} response tokens x {ROWS}: {what}'s peak {peak(large) / 2**30:.2f} GiB at V = {VOCABS[1]:,}, "
                f"{peak(small) / 2**30:.2f} GiB at V = {VOCABS[0]:,}: +{gap:.2f} GiB"
            )
    return out


def table(result: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"
    rows = [
        "| cell | V | response tokens | stage | peak (GiB) | rise (GiB) | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        if "error" in c:
            rows.append(f"| {c['kind']} | {c['vocab']:,} | {c['length']:,} | error | | | |")
            continue
        for r in c["stages"]:
            rows.append(
                f"| {c['kind']} | {c['vocab']:,} | {c['length']:,} | {r['stage']} | {gib(r['peak'])} | "
                f"{gib(r['rise'])} | {r['seconds']:.1f} |"
            )
    m = result["machine"]
    head = (
        f"# Real lengths and vocabularies (benchmarks/real_shape.py)\n\nAt {commits(result)}, {m.get('cpu', 'cpu')} "
        f"({m['cpu_cores']} cores, torch {m['torch']}){', quick shapes' if result['quick'] else ''}. Peak: the "
        "process's resident set (VmHWM) during the stage; rise: that peak over the stage's start."
        + (f" {result['note']}" if result.get("note") else "")
        + "\n\n"
    )
    return head + "\n".join(rows) + "\n\n" + "\n".join(f"- {s}" for s in result["summary"]) + "\n"


def commits(result: dict) -> str:
    """The run's commit, or (merged runs) each commit with the cells it measured."""
    kinds: dict[str, list[str]] = {}
    for c in result["cells"]:
        cell = f"{c['kind']} {c['length']:,}"
        if cell not in kinds.setdefault(c.get("commit", result["commit"]), []):
            kinds[c.get("commit", result["commit"])].append(cell)
    if len(kinds) <= 1:
        return result["commit"]
    return "; ".join(f"{commit} ({', '.join(cells)})" for commit, cells in kinds.items())


def merged(paths: list[Path], note: str) -> dict:
    """Earlier runs' cells in one result, each cell with its run's commit (runs made side by side, or one
    length at a time so that a partial result is kept)."""
    runs = [json.loads(p.read_text()) for p in paths]
    cells = [{**c, "commit": c.get("commit", r["commit"])} for r in runs for c in r["cells"]]
    commit = ", ".join(dict.fromkeys(c["commit"] for c in cells))
    result = {"commit": commit, "machine": runs[0]["machine"], "quick": all(r["quick"] for r in runs), "cells": cells}
    return {**result, "note": note, "summary": summary(cells)}


def write(result: dict, out: Path, show: bool = True) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(table(result))
    if show:
        print(table(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64-token responses (a dry run, about a minute)")
    ap.add_argument("--lengths", default="", help="response lengths, comma-separated (default 1024,4096,8192)")
    ap.add_argument("--vocabs", default="", help="vocabulary sizes, comma-separated (default 2048,151936)")
    ap.add_argument("--kinds", default="step,stages", help="which cells: step, stages or both")
    ap.add_argument("--log-rollouts", type=int, default=ROWS, help="rollouts the step logs (rollout logging)")
    ap.add_argument(
        "--sampling",
        default="1.0,1.0",
        help="TEMPERATURE,TOP_P of the rollouts and the sampled evaluation. At top-p 1 opd's sampler sorts the "
        "whole vocabulary at every decode step, about 20 ms a row at V = 151,936 on a CPU core (not a GPU's "
        "cost): 0.05,0.95 puts the nucleus within the 16 most probable tokens of a random model, so long "
        "responses take minutes, not hours; memory is the same",
    )
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "opd-real-shape")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_shape.json")
    ap.add_argument("--note", default="", help="a sentence for the table's head (the machine's load, say)")
    ap.add_argument("--merge", default="", help="earlier runs' JSON files, comma-separated: one JSON and table")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cell:
        print(json.dumps(cell(json.loads(a.cell))))
        return
    if a.merge:
        write(merged([Path(x) for x in a.merge.split(",")], a.note), a.out)
        return
    from opd.lab.real_shape import narrow_pair

    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else list(QUICK_LENGTHS if a.quick else LENGTHS)
    vocabs = [int(x) for x in a.vocabs.split(",")] if a.vocabs else list(VOCABS)
    cells: list[dict] = []
    result = {"commit": source_commit(), "machine": machine_info(), "quick": a.quick, "note": a.note}
    for V in vocabs:
        context = max(lengths) + 1024  # the prompts' room too
        student, teacher = narrow_pair(a.models / f"v{V}-context{context}", V, max_len=context)
        for T in lengths:
            for kind in a.kinds.split(","):
                spec = dict(kind=kind, vocab=V, length=T, student=str(student), teacher=str(teacher))
                temperature, top_p = (float(x) for x in a.sampling.split(","))
                got = run_cell({**spec, "log_rollouts": a.log_rollouts, "temperature": temperature, "top_p": top_p})
                cells.append(got)
                print(
                    f"{kind} V={V} T={T}: " + (got.get("error", "")[-300:] or f"{got['process_peak'] / 2**30:.2f} GiB"),
                    flush=True,
                )
                # after every cell: a run stopped part way (hours at 8k tokens on a busy CPU) keeps what it measured
                write({**result, "cells": cells, "summary": summary(cells)}, a.out, show=False)
    print(table({**result, "cells": cells, "summary": summary(cells)}))


if __name__ == "__main__":
    main()

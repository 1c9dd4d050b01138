#!/usr/bin/env python
"""`opd plan` against measurement: one `opd train` step's peak memory on the CPU, stage by stage, next to
the plan's CPU-equivalent figure for the same options.

Three shapes on narrow Qwen3 models (random weights, tied heads, the demo tokenizer padded to the
vocabulary: :mod:`opd.lab.real_shape`), varying vocabulary, length, batch, dtype and checkpointing. Each
cell runs in a fresh process: one step (rollout with opd's loop at top-p 1, so the sampler sorts the whole
vocabulary as the plan counts; in-process teacher; LSM from hidden states), no evaluation. The second of
two steps is measured: the first has no gradients or AdamW state before its update.

Measured: a stage's peak resident set (VmHWM, reset as the stage starts) less the process's resident set
before the run began, after a warm-up run of one step of the same shape (so the modules a run imports and the
math libraries' own buffers are in the baseline, and the warm-up's tensors are gone: a baseline after a
4-token warm-up left 66-97 MiB more in the second step's rollout and scoring than the plan holds there). So that the resident set is the
memory the tensors hold, and not what glibc's allocator kept of freed ones (an RSS reset at the second step's
rollout read 600 MiB where its live tensors were about 300), each cell runs with ``MALLOC_MMAP_THRESHOLD_``
at 128 KiB (a larger block is its own mapping, returned to the system when freed) and ``malloc_trim(0)``
as each stage starts. Planned: the plan's bytes held in that stage (the run's parts and the stage's; for the
update stage, the larger of its two ends: where the backward starts and AdamW's step), on ``Layout(device="cpu")``.

The tolerance, from what the plan leaves out: one operation's temporaries (at most one layer's activations
at the micro-batch's tokens: a matmul's output exists before the op that reads it frees its input), the
allocator's slack (glibc keeps freed pages of small allocations: 10% of the plan), and what a run holds
besides tensors that the warm-up did not (the run's own Python objects, the records of its steps: 96 MiB). A measured peak passes when it lies within ``plan - 10%`` and ``plan + tolerance``.

Run (repository root):  python benchmarks/bench_plan.py   (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from opd.lab.experiments.core import cell_in_process, machine_info, source_commit  # noqa: E402

MiB = 2**20
STAGES = ("rollout", "score", "update")
FIXED_SLACK = 96 * MiB
SHARE_SLACK = 0.10
# name: (layers, width, vocab, rows, new tokens, dtype, checkpointing)
SHAPES = {
    "A: V 32k, 8 x 256 tokens, f32": (4, 256, 32_768, 8, 256, "float32", False),
    "B: V 32k, 4 x 1024 tokens, f32, ckpt": (4, 256, 32_768, 4, 1024, "float32", True),
    "C: V 152k, 4 x 512 tokens, bf16": (2, 128, 151_936, 4, 512, "bfloat16", False),
}
PROMPT_TOKENS = 48


def options(spec: dict) -> dict:
    layers, width, vocab, rows, T, dtype, ckpt = spec["shape"]
    return dict(
        student=spec["student"],
        teacher=spec["teacher"],
        device="cpu",
        steps=2,  # the second step is measured: gradients and AdamW state exist from the first update on
        batch_size=rows,
        max_new_tokens=T,
        max_prompt_tokens=PROMPT_TOKENS,
        dtype=dtype,
        gradient_checkpointing=ckpt,
        top_p=1.0,
        eval=False,
        ckpt_every=0,
        log_rollouts=0,
        report_to=["none"],
    )


def cell(spec: dict) -> dict:
    """One step measured (a fresh process), and its plan."""
    from real_shape import Meter, status

    from opd.config import TrainConfig
    from opd.lab.real_shape import stages
    from opd.planning.advice import plan_run, shapes
    from opd.planning.memory import Layout, layer_activation_bytes, micro_batch
    from opd.training import loop, producer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.from_flat(out=str(Path(tmp) / "run"), **options(spec))
        plan = plan_run(cfg, Layout(device="cpu"))
        # a warm-up: one step of the same shape imports every module and grows the math libraries' own buffers
        # (MKL's packing buffers, kept for the process) to what the measured run needs
        warm = {**options(spec), "steps": 1}
        loop.train(TrainConfig.from_flat(out=str(Path(tmp) / "warm"), **warm), show_progress=False)
        gc.collect()
        trim = ctypes.CDLL("libc.so.6").malloc_trim
        trim(0)
        base = status("VmRSS")
        meter = Meter()
        names = [f"{s}_stage" for s in STAGES]
        enter = lambda name: (trim(0), meter.enter(name))
        with stages((producer, loop), names, enter, meter.leave):
            loop.train(cfg, show_progress=False)
    measured = {r["stage"]: r["peak"] - base for r in meter.rows}
    dtype = spec["shape"][5]
    r_mb, seq = micro_batch(cfg)
    one_layer = r_mb * seq * layer_activation_bytes(shapes(cfg)[0], seq, dtype)
    out = []
    for s in STAGES:
        planned = plan.stage_peak(s)  # the update stage: the larger of its backward's and its optimizer's
        slack = one_layer + SHARE_SLACK * planned + FIXED_SLACK
        got = measured[s]
        out.append(
            {
                "stage": s,
                "measured": got,
                "planned": planned,
                "tolerance": int(slack),
                "within": planned * (1 - SHARE_SLACK) <= got <= planned + slack,
            }
        )
    parts = [{"name": p.name, "phases": list(p.phases), "bytes": p.bytes} for p in plan.parts]
    return {**spec, "baseline": base, "stages": out, "parts": parts}


def table(result: dict) -> str:
    mib = lambda b: f"{b / MiB:.0f}"
    rows = [
        "| shape | stage | measured (MiB) | planned (MiB) | measured / planned | tolerance (MiB) | within |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        if "error" in c:
            rows.append(f"| {c['name']} | error | | | | | |")
            continue
        for r in c["stages"]:
            ratio = r["measured"] / r["planned"]
            rows.append(
                f"| {c['name']} | {r['stage']} | {mib(r['measured'])} | {mib(r['planned'])} | {ratio:.2f} | "
                f"+{mib(r['tolerance'])} / -{mib(SHARE_SLACK * r['planned'])} | {'yes' if r['within'] else 'NO'} |"
            )
    m = result["machine"]
    head = (
        f"# `opd plan` against measured peaks (benchmarks/bench_plan.py)\n\nAt {result['commit']}, "
        f"{m['cpu_cores']} cores (shared), torch {m['torch']}. Measured: the stage's peak resident set less the "
        "process's before the run; planned: the plan's bytes held in the stage (CPU-equivalent).\n\n"
    )
    return head + "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()) / "opd-bench-plan")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "plan.json")
    ap.add_argument("--only", default="", help="shapes whose name starts with this (A, B, C)")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cell:
        print(json.dumps(cell(json.loads(a.cell))))
        return
    from opd.lab.real_shape import narrow_qwen3, padded_tokenizer

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # the cells' environment (see the docstring)
    cells = []
    for name, shape in SHAPES.items():
        if a.only and not name.startswith(a.only):
            continue
        layers, width, vocab = shape[:3]
        root = a.models / f"{layers}x{width}-v{vocab}"
        if not (root / "teacher" / "config.json").exists():
            tok = padded_tokenizer(root / "tokenizer", vocab)
            narrow_qwen3(tok, root / "student", layers=layers, width=width, seed=1, max_len=4096)
            narrow_qwen3(tok, root / "teacher", layers=layers, width=2 * width, seed=2, max_len=4096)
        spec = dict(name=name, shape=shape, student=str(root / "student"), teacher=str(root / "teacher"))
        got = cell_in_process(__file__, spec, ROOT, 3000)
        cells.append(got)
        print(
            name,
            got.get("error", "")[-800:]
            or [(r["stage"], r["measured"] // MiB, r["planned"] // MiB) for r in got["stages"]],
            flush=True,
        )
    result = {"commit": source_commit(), "machine": machine_info(), "cells": cells}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Memory of an OPD update for long responses: activation checkpointing and token-budget micro-batches.

Each cell runs in a fresh subprocess at a 0.36B body (Qwen2.5-0.5B's: 24 layers, 896 wide, 14/2 heads,
on the demo's 2,048-token vocabulary; random weights), one LSM update (K = 32) against synthetic teacher
scores, through opd's own ``objective_loss`` and micro-batch split (src/opd/training/microbatch.py):

  act    one sequence, a 64-token prompt and L response tokens, L in 512, 1k, 2k, 4k; without and with
         --gradient-checkpointing: the activation memory, the peak above the pre-forward baseline (the
         parameters, their gradients (allocated before the baseline) and the AdamW state (never made) are
         not in it), and the forward+backward seconds
  step   a batch of 16 responses of mixed lengths (32 to 512 tokens after a 64-token prompt), with
         --gradient-checkpointing (in one piece, without it, the batch would not fit this 24 GiB machine): the
         update's peak above the baseline in one piece and with --micro-batch-tokens 1024 and 2048 (each
         micro-batch's rows x longest sequence within the budget); and a batch of 32 (each length twice) with
         the same budgets, whose peak should not grow with the batch; and the seconds

The peak is the process's VmHWM after resetting it (/proc/self/clear_refs) on the CPU, and
torch.cuda.max_memory_allocated on a GPU. Writes JSON (--out) and a Markdown table beside it, with the
commit and the machine.

Run (repository root):  python benchmarks/bench_memory.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from opd.lab.experiments.core import cell_in_process, machine_info, source_commit  # noqa: E402

BODY = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
)
QUICK_BODY = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256
)
PROMPT, VOCAB, K = 64, 2048, 32
STEP_LENGTHS = list(range(32, 513, 32))  # 16 responses; the batch of 32 holds each twice


def peak_reset(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def memory_now(device: str, peak: bool) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()
    field = "VmHWM" if peak else "VmRSS"
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024


def batch_of(lengths: list[int], device: str):
    """A rollout batch of random tokens (prompts of PROMPT tokens, responses of ``lengths``) and synthetic
    teacher top-K scores, on ``device``."""
    import torch

    from opd.rollout.sampling import RolloutBatch
    from opd.teachers.scoring import TeacherScores

    g = torch.Generator().manual_seed(0)
    N, T = len(lengths), max(lengths)
    resp = torch.randint(3, VOCAB, (N, T), generator=g)
    resp_mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.cat([torch.randint(3, VOCAB, (N, PROMPT), generator=g), resp], 1)
    attn = torch.cat([torch.ones(N, PROMPT, dtype=torch.long), resp_mask.long()], 1)
    d = lambda t: t.to(device)
    batch = RolloutBatch(
        d(ids),
        d(attn),
        PROMPT,
        d(resp),
        d(resp_mask),
        d(torch.zeros(N, T)),
        d(torch.ones(N, dtype=torch.bool)),
        action_mask_NT=d(resp_mask),
    )
    top_logprobs = torch.log_softmax(torch.randn(N, T, K, generator=g), -1)
    scores = TeacherScores(d(torch.randint(0, VOCAB, (N, T, K), generator=g)), d(top_logprobs), d(torch.zeros(N, T)))
    return batch, scores


def cell(spec: dict) -> dict:
    """One measurement, in this (fresh) process."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opd.config import TrainConfig
    from opd.models.loading import checkpoint_layers
    from opd.training.loss import LossTotals, objective_loss, reduce_loss
    from opd.training.microbatch import split_rows

    device = spec["device"]
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=1,
        pad_token_id=0,
        **(QUICK_BODY if spec["quick"] else BODY),
    )
    model = Qwen2ForCausalLM(cfg).to(device)
    model.train()
    if spec["checkpointing"]:
        checkpoint_layers(model)
    for p in model.parameters():  # the gradients exist before the baseline: they are not activations
        p.grad = torch.zeros_like(p)
    train = TrainConfig.from_flat(objective="lsm", k=K, batch_size=len(spec["lengths"]))
    warm, warm_scores = batch_of([16], device)  # the first backward in a process pays one-time costs
    loss_NT, _ = objective_loss(train, model, None, warm, warm_scores, warm.response_mask_NT)
    loss_NT.sum().backward()
    batch, scores = batch_of(spec["lengths"], device)
    mask = batch.response_mask_NT
    totals = LossTotals(int(mask.sum()), mask.shape[0], mask.shape[0], mask.shape[1])
    micro = split_rows([batch.attention_mask_NL.sum(-1).cpu()], 1, spec["budget"])
    baseline = memory_now(device, peak=False)
    peak_reset(device)
    t0 = time.perf_counter()
    for m in micro:
        rows = m.rows.to(device)
        loss_NT, _ = objective_loss(train, model, None, batch.select(rows), scores.select(rows), mask[rows])
        reduce_loss("token_mean", loss_NT, mask[rows], totals).backward()
    seconds = time.perf_counter() - t0
    return {
        **spec,
        "micro_batches": len(micro),
        "baseline_bytes": baseline,
        "above_baseline_bytes": memory_now(device, peak=True) - baseline,
        "seconds": seconds,
    }


def run_cell(spec: dict) -> dict:
    return cell_in_process(__file__, spec, ROOT, 1500)


def machine(device: str) -> dict:
    import torch

    device_name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    return {"device": device_name, **machine_info()}


def table(result: dict) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"
    rows = [
        "| cell | response tokens | checkpointing | budget | micro-batches | above baseline (MiB) | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in result["cells"]:
        if "error" in c:
            rows.append(f"| {c['kind']} | {c['label']} | {c['checkpointing']} | {c['budget']} | | error | |")
            continue
        rows.append(
            f"| {c['kind']} | {c['label']} | {c['checkpointing']} | {c['budget'] or '-'} | "
            f"{c['micro_batches']} | {mib(c['above_baseline_bytes'])} | {c['seconds']:.1f} |"
        )
    head = (
        f"# Memory of an OPD update (benchmarks/bench_memory.py)\n\nAt {result['commit']}, "
        f"{result['machine']['device']} ({result['machine']['cpu_cores']} cores, torch {result['machine']['torch']})"
        f", {'quick shapes' if result['quick'] else 'the 0.36B body'}.\n\n"
    )
    return head + "\n".join(rows) + "\n\n" + "\n".join(f"- {s}" for s in result["summary"]) + "\n"


def summary(cells: list[dict]) -> list[str]:
    act = {(c["label"], c["checkpointing"]): c for c in cells if c["kind"] == "act" and "error" not in c}
    out = []
    for length in sorted({k[0] for k in act}):
        if (length, False) in act and (length, True) in act:
            a, b = act[(length, False)], act[(length, True)]
            out.append(
                f"{length} response tokens: checkpointing cuts activation memory "
                f"{a['above_baseline_bytes'] / max(b['above_baseline_bytes'], 1):.1f}x, at "
                f"{b['seconds'] / a['seconds']:.2f}x the time"
            )
    step = [c for c in cells if c["kind"] == "step" and "error" not in c]
    plain = next((c for c in step if not c["budget"]), None)
    for c in step:
        if c["budget"] and plain:
            out.append(
                f"batch {len(c['lengths'])}, --micro-batch-tokens {c['budget']}: peak "
                f"{c['above_baseline_bytes'] / 2**20:,.0f} MiB vs {plain['above_baseline_bytes'] / 2**20:,.0f} "
                f"MiB for batch 16 in one piece; {c['seconds'] / plain['seconds']:.2f}x its time"
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="a 4 x 128 body and short lengths (a dry run)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "memory.json")
    ap.add_argument("--cell", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.cell:
        print(json.dumps(cell(json.loads(a.cell))))
        return
    scale = 8 if a.quick else 1
    specs = [
        dict(kind="act", label=n // scale, lengths=[n // scale], checkpointing=ck, budget=0)
        for n in (512, 1024, 2048, 4096)
        for ck in (False, True)
    ]
    lengths = [n // scale for n in STEP_LENGTHS]
    for n, budgets in ((1, (0, 1024, 2048)), (2, (1024, 2048))):
        specs += [
            dict(
                kind="step",
                label=f"{16 * n} of {min(lengths)}-{max(lengths)}",
                lengths=lengths * n,
                checkpointing=True,
                budget=b // scale,
            )
            for b in budgets
        ]
    cells = []
    for spec in specs:
        got = run_cell({**spec, "device": a.device, "quick": a.quick})
        cells.append(got)
        print(
            f"{spec['kind']} {spec['label']} ckpt={spec['checkpointing']} budget={spec['budget']}: "
            f"{got.get('above_baseline_bytes', 0) / 2**20:,.0f} MiB, {got.get('seconds', 0):.1f} s",
            flush=True,
        )
    result = {
        "commit": source_commit(),
        "machine": machine(a.device),
        "quick": a.quick,
        "cells": cells,
        "summary": summary(cells),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    a.out.with_suffix(".md").write_text(table(result))
    print(table(result))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""opd's HF sampling loop against vLLM's rollouts, side by side in one run, on this machine's CPU.

For two models -- the packaged demo student (0.5M parameters) and a model made here with
Qwen2.5-0.5B's blocks (24 layers, width 896, 14 heads, 2 KV heads, MLP 4864) on the demo's 2,048-token
vocabulary (0.36B parameters, random weights: no download) -- it times, at batch 16 and 64 with 64
new tokens, top-p 0.9, T = 1:

* ``hf``: opd's :class:`~opd.rollout.sampling.HFRollout` in float32 (the trainer's dtype);
* ``vllm-float32`` and ``vllm-bfloat16``: :class:`~opd.rollout.vllm_engine.VLLMRollout` against a vLLM
  server (``opd vllm-setup``'s environment) started on the model in that dtype (``-2cores``: with
  ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``; by default vLLM's CPU build keeps one core for its front end and
  computes on the other), the weights synced
  before every batch as in training; the sync is timed on its own too (write + reload + cache reset),
  and the policy check's gap (the engine's log-probs of the sampled tokens against the float32
  student's) is recorded for each dtype.

Tokens/s counts generated tokens (EOS included) over the batch's wall time, sync included for vLLM.
Random weights rarely sample EOS, so the 0.36B rows generate the full 64 tokens. Then the OPD step:
``opd train`` on the demo models (LSM, batch 64, 48 new tokens) with each engine, the median
``time/step`` and ``time/generate`` over steps 2-6. Every process here shares 2 cores (the engine's
server, the trainer): on a GPU host the engine has its own device, which this does not measure.

Run (from the repository root, after ``opd vllm-setup``; about 25 minutes):
  python benchmarks/bench_vllm.py
  python benchmarks/bench_vllm.py --quick          # the demo student only, batch 4 (a dry run)
Writes benchmarks/results/vllm_rollouts.json (``--json``) and prints a table.
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
from pathlib import Path

import torch

from opd.config import TrainConfig
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.sampling import HFRollout
from opd.rollout.vllm_engine import VLLMRollout
from opd.rollout.vllm_server import start_vllm_server
from opd.tasks import ArithmeticTask
from opd.training import loop as train_mod

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "opd" / "assets" / "demo"


def make_half_b(out: Path) -> Path:
    """Qwen2.5-0.5B's blocks on the demo tokenizer, random weights, saved with the tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(DEMO / "student", "student")
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def prompts(tok, n: int) -> list[list[int]]:
    return [tok(e.prompt)["input_ids"] for e in ArithmeticTask(n_train=n, n_test=8).examples("train")[:n]]


def timed_rollouts(engine, ids: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Median seconds of ``repeats`` batches, the tokens each generated, and the last one's policy check."""
    seconds, tokens, gap = [], [], None
    for r in range(repeats):
        engine.weights_changed()  # as after an optimizer step: the weights synced before every batch, timed with it
        t0 = time.perf_counter()
        batch = engine.generate(ids, list(range(r * 1000, r * 1000 + len(ids))), max_new_tokens=new_tokens, top_p=0.9)
        seconds.append(time.perf_counter() - t0)
        tokens.append(int(batch.response_mask_NT.sum()))
        gap = batch.report.policy_gap
    s, t = statistics.median(seconds), statistics.median(tokens)
    return {"seconds": s, "tokens": t, "tokens_per_s": t / s, "rollouts_per_s": len(ids) / s, "logprob_gap": gap}


# vLLM's CPU build keeps one core for its front end unless told otherwise (VLLM_CPU_NUM_OF_RESERVED_CPU):
# on 2 cores its model then computes on one, where opd's loop uses two.
VLLM_CONFIGS = (
    ("vllm-float32", "float32", "1"),
    ("vllm-float32-2cores", "float32", "0"),
    ("vllm-bfloat16", "bfloat16", "1"),
    ("vllm-bfloat16-2cores", "bfloat16", "0"),
)


def bench_model(
    name: str, model_dir: Path, batches: list[int], new_tokens: int, repeats: int, logs: Path
) -> list[dict]:
    tok, student = load_tokenizer(model_dir, "student"), load_model(model_dir, "student")
    params = sum(p.numel() for p in student.parameters())
    rows, ids = [], prompts(tok, max(batches))
    hf = HFRollout(student, tok.eos_token_id, tok.pad_token_id)
    hf.generate(ids[:2], [0, 1], max_new_tokens=4)  # the first generate in a process is slow
    for b in batches:
        rows.append(
            {
                "model": name,
                "params": params,
                "engine": "hf",
                "batch": b,
                **timed_rollouts(hf, ids[:b], new_tokens, repeats),
            }
        )
        print(rows[-1], flush=True)
    for label, dtype, reserved in VLLM_CONFIGS:
        t0 = time.perf_counter()
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
        try:
            server = start_vllm_server(
                model_dir, logs / f"{name}-{label}.log", dtype=dtype, max_model_len=512, dev_mode=True
            )
        finally:
            del os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]
        started = time.perf_counter() - t0
        try:
            engine = VLLMRollout(student, tok, logs / f"weights-{name}-{label}", url=server.url, max_gap=float("inf"))
            engine.generate(ids[:2], [0, 1], max_new_tokens=4)
            syncs = []
            for _ in range(3):
                t0 = time.perf_counter()
                engine.sync()
                syncs.append(time.perf_counter() - t0)
            for b in batches:
                got = timed_rollouts(engine, ids[:b], new_tokens, repeats)
                rows.append(
                    {
                        "model": name,
                        "params": params,
                        "engine": label,
                        "batch": b,
                        **got,
                        "sync_s": statistics.median(syncs),
                        "server_start_s": started,
                    }
                )
                print(rows[-1], flush=True)
        finally:
            server.stop()
    return rows


def bench_steps(out: Path, steps: int, batch: int) -> list[dict]:
    rows = []
    for engine in ("hf", "vllm"):
        run = out / f"step-{engine}"
        cfg = TrainConfig.from_flat(
            student=str(DEMO / "student"),
            teacher=str(DEMO / "teacher"),
            rollout_engine=engine,
            out=str(run),
            steps=steps,
            batch_size=batch,
            max_new_tokens=48,
            eval_every=0,
            eval_size=8,
            eval_samples=0,
            ckpt_every=0,
        )
        train_mod.train(cfg, show_progress=False)
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        timed = [r for r in records if "time/step" in r][1:]  # the first step warms up
        rows.append(
            {
                "engine": engine,
                "batch": batch,
                "steps_timed": len(timed),
                **{
                    k: statistics.median(r[f"time/{k}"] for r in timed) for k in ("step", "generate", "score", "update")
                },
            }
        )
        print(rows[-1], flush=True)
    return rows


def table(rollouts: list[dict], steps: list[dict]) -> str:
    lines = [
        "| model | engine | batch | tokens/s | rollouts/s | of which sync s | policy gap (nats/token) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rollouts:
        gap = f"{r['logprob_gap']:.2g}" if r.get("logprob_gap") is not None else "-"
        sync = f"{r['sync_s']:.3f}" if "sync_s" in r else "-"
        lines.append(
            f"| {r['model']} | {r['engine']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['rollouts_per_s']:.2f} | {sync} | {gap} |"
        )
    lines += [
        "",
        "| OPD step (demo, LSM) | batch | step s | generate s | score s | update s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in steps:
        lines.append(
            f"| {r['engine']} | {r['batch']} | {r['step']:.2f} | {r['generate']:.2f} | {r['score']:.2f} | {r['update']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the demo student only, batch 4, 2 OPD steps (a dry run)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "vllm_rollouts.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        batches, repeats = ([4], 1) if args.quick else ([16, 64], 2)
        rollouts = bench_model("demo student", DEMO / "student", batches, 64, repeats, tmp)
        if not args.quick:
            rollouts += bench_model("0.36B (Qwen2.5-0.5B blocks)", make_half_b(tmp / "halfb"), batches, 64, 1, tmp)
        steps = bench_steps(tmp, 3 if args.quick else 7, 8 if args.quick else 64)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "commit": commit,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, 2 cores shared by trainer and engine",
        "quick": args.quick,
        "rollouts": rollouts,
        "opd_steps": steps,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rollouts, steps))
    print(f"wrote {args.json} (commit {commit})")


if __name__ == "__main__":
    sys.exit(main())

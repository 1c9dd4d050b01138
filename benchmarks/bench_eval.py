#!/usr/bin/env python
"""Evaluation throughput through each rollout engine: opd's own loop (dynamic KV cache), its static cache
(``--static-cache on``) and vLLM (``--rollout-engine vllm``: the CPU build ``opd vllm-setup`` installs, or
vllm on a GPU), the same evaluation (:func:`opd.evaluation.core.evaluate`) on the same prompts.

Model: the demo student (src/opd/assets/demo/student, 2 layers x 128, float32). Prompts: the arithmetic
task's first ``--prompts`` test prompts; ``--max-new-tokens`` each; a greedy response plus ``--samples``
samples at temperature 1, top-p 0.9 (the in-training evaluation's shape). Rows: wall seconds of the whole
evaluation (median of ``--repeats`` after one untimed warm-up), response tokens per second, and the
figures, which say whether the engines evaluated the same thing (greedy accuracy equal; the samples come
from each engine's own seeded sampler). vLLM's server start is reported apart (once per run).

Run (repository root):
  python benchmarks/bench_eval.py --out benchmarks/results/eval_throughput.json
Writes the JSON (commit, machine, settings, rows) and a Markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from opd.config import TrainConfig  # noqa: E402
from opd.evaluation.core import EvalPlan, EvalSampling, evaluate  # noqa: E402
from opd.evaluation.model_eval import PromptItems  # noqa: E402
from opd.lab.experiments.core import machine_info, source_commit  # noqa: E402
from opd.models.loading import load_model, load_tokenizer  # noqa: E402
from opd.rollout.engine import EngineContext  # noqa: E402
from opd.rollout.prompt_set import PromptSet, eval_prompts, load_task  # noqa: E402
from opd.rollout.sampling import HFRollout  # noqa: E402

DEMO = ROOT / "src" / "opd" / "assets" / "demo"


def timed(engine, items, plan, repeats: int) -> tuple[list[float], dict, int]:
    """Seconds of each timed evaluation (after a warm-up), the last figures, and the response tokens of one."""
    done = evaluate(engine, items, plan)  # warm-up: first calls allocate, vLLM warms its caches
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        done = evaluate(engine, items, plan)
        seconds.append(time.perf_counter() - t0)
    return seconds, done.figures, sum(r["tokens"] for r in done.records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true", help="only opd's loop (no vLLM environment)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    tok = load_tokenizer(DEMO / "student", "student")
    model = load_model(DEMO / "student", "student")
    task = load_task("arithmetic", 2, 0)
    items = PromptItems(PromptSet.build(eval_prompts(task, args.prompts), tok, 256), task, tok, args.max_new_tokens)
    plan = EvalPlan(samples=args.samples, sampling=EvalSampling("greedy", 1.0, 0.9), record_chars=200)
    engines = {
        "opd loop (dynamic cache)": lambda: HFRollout(model, tok.eos_token_id, tok.pad_token_id),
        "opd loop, static cache": lambda: HFRollout(model, tok.eos_token_id, tok.pad_token_id, static_cache="on"),
    }
    start_s = None
    if not args.no_vllm:
        from opd.rollout.vllm_engine import start_vllm

        cfg = TrainConfig.from_flat(student=str(DEMO / "student"), teacher=str(DEMO / "teacher"), rollout_engine="vllm")
        folder = Path(tempfile.mkdtemp(prefix="bench-eval-vllm-"))
        t0 = time.perf_counter()
        served = start_vllm(EngineContext(model, tok, cfg, cfg.model.student, folder=folder))
        start_s = time.perf_counter() - t0
        engines["vLLM (CPU build)"] = lambda: served
    rows = []
    try:
        for name, make in engines.items():
            seconds, figures, tokens = timed(make(), items, plan, args.repeats)
            wall = statistics.median(seconds)
            rows.append(
                {
                    "engine": name,
                    "wall_s": round(wall, 3),
                    "seconds": [round(s, 3) for s in seconds],
                    "response_tokens": tokens,
                    "tokens_per_s": round(tokens / wall, 1),
                    **{k: figures[k] for k in ("accuracy", "avg_at_k", "pass_at_k", "response_tokens_mean")},
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if not args.no_vllm:
            served.close()
    settings = {
        "model": "demo student (2 x 128, float32)",
        "prompts": args.prompts,
        "samples": args.samples,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "vllm_server_start_s": None if start_s is None else round(start_s, 1),
    }
    result = {"commit": source_commit(), "machine": machine_info(), "settings": settings, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"Evaluation throughput, {settings['model']}: {args.prompts} prompts x (greedy + {args.samples} samples), "
        f"{args.max_new_tokens} new tokens; median of {args.repeats}. Commit {result['commit']}.",
        "",
        "| engine | wall s | response tokens/s | greedy accuracy | avg@k | pass@k |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['wall_s']:.2f} | {r['tokens_per_s']:.0f} | {r['accuracy']:.3f} | "
            f"{r['avg_at_k']:.3f} | {r['pass_at_k']:.3f} |"
        )
    if start_s is not None:
        lines += ["", f"vLLM server start (once per run, not in the rows): {start_s:.0f} s."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Decode speed of opd's sampling loop on a GPU: the dynamic KV cache (the loop before issue 65), the static
cache with its decode step replayed as a CUDA graph (``--static-cache``), and Hugging Face ``generate`` with
its own static cache (compiled by transformers on CUDA), side by side in one run of at most ~5 minutes.

Model: Qwen2.5-0.5B's body (24 layers x 896, 14 query / 2 key-value heads, MLP 4864), random weights, on the
demo tokenizer's 2,048-token vocabulary (src/opd/assets/demo), its final-norm gain x13 so that the top-p 0.9
nucleus is a few tokens, as a trained model's is. Prompts: random ids, 56-64 tokens, left-padded; 128 new
tokens, EOS never (every row writes them all); temperature 1, top-p 0.9. Batches 16 and 64.

Precisions: ``float32`` (TF32 matmuls, as opd trains on CUDA), ``bf16-mixed`` (opd's ``--dtype bfloat16``:
float32 weights, the decoder under bfloat16 autocast, :func:`opd.models.precision.compute_in`) and, for
reference, ``bf16-pure`` (bfloat16 weights: what the HF ``generate`` figures of issue 65 ran).

Rows: ``opd dynamic`` (``--static-cache off``), ``opd static`` (``on``; the first call captures the graph:
its seconds are the ``capture s`` column, reused by every later call), ``opd static, no graph`` (the static
cache run eagerly: what the graph itself buys), ``HF static`` (``generate(cache_implementation="static")``,
in a subprocess; its first call compiles). Tokens/s are medians over the timed calls after a first, untimed
one. Checks: ``logp gap``, the largest difference between a row's recorded log-probs and a plain forward over
its rollouts (a graph that read stale buffers or weights would be off by nats, not rounding); ``same tokens``,
the share of rows identical to the dynamic cache's (1.0 on a CPU; on a GPU other kernels round otherwise);
``in-place update`` (float32 and bf16-mixed): the weights changed in place after the graph was captured, the
static rollouts again against a forward of the changed model, with no second capture.

Run (repository root):
  python benchmarks/bench_decode.py --out benchmarks/results/decode.json    # a GPU (about 4-5 minutes)
  python benchmarks/bench_decode.py --small --device cpu --out /tmp/d.json  # the CPU dry run (tiny shapes)
Writes the JSON (commit, machine, settings, rows) and a Markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from opd.lab.experiments.core import machine_info, source_commit  # noqa: E402
from opd.models.loading import load_tokenizer  # noqa: E402
from opd.models.precision import compute_in, configure_device_math  # noqa: E402
from opd.rollout.sampling import HFRollout, RolloutBatch, left_pad  # noqa: E402

DEMO = ROOT / "src" / "opd" / "assets" / "demo"
REAL = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
)
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
LOGIT_GAIN = 13.0  # random-init logits have std ~0.6 (a near-flat nucleus); x13 gives std ~8, a few tokens' nucleus
PRECISIONS = ("float32", "bf16-mixed", "bf16-pure")


def settings(small: bool) -> dict:
    if small:
        return dict(shape=SMALL, batches=(4, 8), new=8, prompt=(8, 16), repeats=1)
    return dict(shape=REAL, batches=(16, 64), new=128, prompt=(56, 64), repeats=2)


def build(shape: dict, dev: torch.device, precision: str):
    """The random model in ``precision`` (seed 0: the same weights in every precision)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = load_tokenizer(DEMO / "student", "student")
    base = json.loads((DEMO / "student" / "config.json").read_text())
    cfg = Qwen2Config(
        vocab_size=base["vocab_size"], max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    with dev:
        model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_GAIN)
    if precision == "bf16-mixed":
        compute_in(model, "bfloat16")
    elif precision == "bf16-pure":
        model.to(torch.bfloat16)
    return model, tok


def prompts(s: dict, batch: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    lo, hi = s["prompt"]
    return [
        torch.randint(3, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(lo, hi + 1, (batch,), generator=g)
    ]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@torch.no_grad()
def logp_gap(model, batch: RolloutBatch) -> float:
    """The largest |recorded log-prob - a plain forward's| over the rollouts' tokens (in chunks of 16 rows)."""
    worst = 0.0
    for rows in torch.arange(batch.num_rollouts).split(16):
        mask = batch.attention_mask_NL[rows]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch.input_ids_NL[rows], attention_mask=mask, position_ids=pos).logits
        P, T = batch.prompt_len, batch.response_ids_NT.shape[1]
        lp = torch.log_softmax(logits[:, P - 1 : P - 1 + T].float(), -1)
        lp = lp.gather(-1, batch.response_ids_NT[rows].unsqueeze(-1)).squeeze(-1)
        gap = (lp - batch.logprobs_NT[rows]).abs()[batch.response_mask_NT[rows]]
        worst = max(worst, float(gap.max()))
    return worst


def opd_row(model, tok, s: dict, batch: int, mode: str, graphs: bool | None = None) -> tuple[dict, RolloutBatch]:
    dev = next(model.parameters()).device
    engine = HFRollout(model, eos_id=-1, pad_id=tok.pad_token_id, static_cache=mode)
    engine.static.graphs = graphs
    ps, seeds = prompts(s, batch, model.config.vocab_size), list(range(batch))
    run = lambda: engine.generate(ps, seeds, max_new_tokens=s["new"], temperature=1.0, top_p=0.9)
    sync(dev)
    t0 = time.perf_counter()
    out = run()
    sync(dev)
    first, times = time.perf_counter() - t0, []
    for _ in range(s["repeats"]):
        t0 = time.perf_counter()
        out = run()
        sync(dev)
        times.append(time.perf_counter() - t0)
    med, tokens = statistics.median(times), int(out.response_mask_NT.sum())
    row = dict(tokens=tokens, tokens_per_s=round(tokens / med, 1), ms_per_step=round(1e3 * med / s["new"], 2),
               first_call_s=round(first, 2), logp_gap=logp_gap(model, out))  # fmt: skip
    if mode == "on":
        row["capture_s"] = round(sum(engine.static.captures), 2) if engine.static.captures else None
        row["captures"] = len(engine.static.captures)
        row["graph"] = bool(engine.static.free and engine.static.free[0].step.graph is not None)
        row["graph_error"] = engine.static.free[0].graph_error if engine.static.free else None
    if dev.type == "cuda":
        row["max_memory_GB"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
    row["_engine"] = engine
    return row, out


def inplace_check(model, s: dict, batch: int, engine: HFRollout) -> dict:
    """The weights change in place after the capture (as an optimizer step writes them): the replayed graph
    must give the changed model's log-probs, without capturing again."""
    before = len(engine.static.captures)
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.mul_(1.5)
        model.model.norm.weight.mul_(0.5)
    ps = prompts(s, batch, model.config.vocab_size)
    out = engine.generate(ps, list(range(batch)), max_new_tokens=s["new"], temperature=1.0, top_p=0.9)
    return dict(logp_gap=logp_gap(model, out), new_captures=len(engine.static.captures) - before)


def same_rows(a: RolloutBatch, b: RolloutBatch) -> float:
    return float((a.response_ids_NT == b.response_ids_NT).all(-1).float().mean())


def hf_worker(args: dict) -> None:
    """HF generate with its static cache, in this subprocess (its compile stays out of the parent); each row
    is written to ``args['out']`` as it ends, so a run cut by the time limit keeps what it measured."""
    s, dev, rows = settings(args["small"]), torch.device(args["device"]), []
    for precision in ("float32", "bf16-pure"):
        model, tok = build(s["shape"], dev, precision)
        model.generation_config.eos_token_id = None
        for batch in sorted(s["batches"], reverse=True):
            ids, attn = (x.to(dev) for x in left_pad(prompts(s, batch, model.config.vocab_size), tok.pad_token_id))
            kw = dict(do_sample=True, top_p=0.9, top_k=0, temperature=1.0, max_new_tokens=s["new"],
                      pad_token_id=tok.pad_token_id, cache_implementation="static")  # fmt: skip
            times = []
            for _ in range(1 + s["repeats"]):  # the first call compiles (on CUDA)
                sync(dev)
                t0 = time.perf_counter()
                out = model.generate(input_ids=ids, attention_mask=attn, **kw)
                sync(dev)
                times.append(time.perf_counter() - t0)
            tokens = int((out.shape[1] - ids.shape[1]) * batch)
            med = statistics.median(times[1:])
            rows.append(dict(precision=precision, batch=batch, engine="HF static", tokens=tokens,
                             tokens_per_s=round(tokens / med, 1), ms_per_step=round(1e3 * med / s["new"], 2),
                             first_call_s=round(times[0], 2)))  # fmt: skip
            Path(args["out"]).write_text(json.dumps(rows))
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()


class Run:
    """The rows so far, written after each; items that would start past the time budget are skipped, said so."""

    def __init__(self, out: Path, budget: float, meta: dict):
        self.out, self.deadline, self.meta, self.rows = out, time.time() + budget, meta, []

    def left(self) -> float:
        return self.deadline - time.time()

    def add(self, row: dict) -> None:
        row = {k: v for k, v in row.items() if not k.startswith("_")}  # "_engine": for the checks, not the record
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        self.write()

    def skip(self, what: dict, need: float) -> bool:
        if self.left() >= need:
            return False
        self.add({**what, "status": "skipped", "why": f"{self.left():.0f} s left of the budget, needs ~{need:.0f}"})
        return True

    def write(self) -> None:
        self.out.write_text(json.dumps({**self.meta, "rows": self.rows}, indent=1) + "\n")
        self.out.with_suffix(".md").write_text(markdown(self.meta, self.rows))


def markdown(meta: dict, rows: list[dict]) -> str:
    m = meta["machine"]
    lines = [
        "# Decode speed: opd's loop, dynamic vs static KV cache, and HF generate (benchmarks/bench_decode.py)",
        "",
        f"opd {meta['commit']}; {m.get('gpu') or 'CPU ' + str(m.get('cpu_capability'))}, torch {m.get('torch')}; "
        f"{meta['settings']}",
        "",
        "| precision | batch | engine | tokens/s | ms/step | vs dynamic | first call s | capture s | logp gap | "
        "same tokens |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dyn = {(r["precision"], r["batch"]): r["tokens_per_s"] for r in rows if r.get("engine") == "opd dynamic"
           and "tokens_per_s" in r}  # fmt: skip
    for r in rows:
        if "batch" not in r:
            continue
        if r.get("status") == "skipped":
            lines.append(f"| {r['precision']} | {r['batch']} | {r['engine']} | skipped: {r['why']} |||||||")
            continue
        base = dyn.get((r["precision"], r["batch"]))
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        cells = [r["precision"], r["batch"], r["engine"], r["tokens_per_s"], r["ms_per_step"], ratio,
                 r.get("first_call_s"), r.get("capture_s"), _g(r.get("logp_gap")), r.get("same_tokens")]  # fmt: skip
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    for r in rows:
        if r.get("graph_error"):
            lines += ["", f"{r['precision']} batch {r['batch']} {r['engine']}: no CUDA graph: {r['graph_error']}"]
    for r in rows:
        if "check" in r:
            lines += ["", f"{r['check']}: " + ", ".join(f"{k} {_g(v)}" for k, v in r.items() if k != "check")]
    return "\n".join(lines) + "\n"


def _g(v) -> str | None:
    return f"{v:.3g}" if isinstance(v, float) else None if v is None else str(v)


def opd_rows(run: Run, s: dict, dev: torch.device) -> None:
    """Every opd row, float32 and bf16-mixed first (what opd trains with), then the bf16-pure reference."""
    for precision in PRECISIONS:
        model, tok = build(s["shape"], dev, precision)
        for batch in s["batches"]:
            at = dict(precision=precision, batch=batch)
            dynamic = None
            if precision != "bf16-pure" and not run.skip({**at, "engine": "opd dynamic"}, 20):
                row, dynamic = opd_row(model, tok, s, batch, "off")
                run.add({**at, "engine": "opd dynamic", **row})
            if run.skip({**at, "engine": "opd static"}, 10):
                continue
            row, static = opd_row(model, tok, s, batch, "on")
            row["same_tokens"] = same_rows(static, dynamic) if dynamic is not None else None
            run.add({**at, "engine": "opd static", **row})
            # float32, and the mixed precision whose graph holds autocast's casts of the float32 weights
            first = precision != "bf16-pure" and batch == s["batches"][0]
            if first and not run.skip({"check": "in-place update", "precision": precision}, 10):
                got = inplace_check(model, s, batch, row["_engine"])
                run.add({"check": "in-place update", "precision": precision, **got})
                model, tok = build(s["shape"], dev, precision)  # the changed weights stay out of the other rows
            if precision != "bf16-pure" and batch == max(s["batches"]):
                if not run.skip({**at, "engine": "opd static, no graph"}, 20):
                    row, _ = opd_row(model, tok, s, batch, "on", graphs=False)
                    run.add({**at, "engine": "opd static, no graph", **row})
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def hf_rows(run: Run, s: dict, a: argparse.Namespace) -> None:
    left = run.left() - 5
    if left < 30:
        run.add({"precision": "-", "batch": "-", "engine": "HF static", "status": "skipped",
                 "why": f"{run.left():.0f} s left of the budget, needs ~30"})  # fmt: skip
        return
    part = a.out.with_name(a.out.stem + "_hf_part.json")
    part.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--_hf-worker", json.dumps(dict(small=a.small, device=a.device, out=str(part)))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        failed = done.returncode != 0 and done.stderr[-1500:]
    except subprocess.TimeoutExpired:
        failed = f"stopped at the time budget ({left:.0f} s)"
    got = json.loads(part.read_text()) if part.exists() else []
    part.unlink(missing_ok=True)
    for row in got:
        run.add(row)
    if failed:
        run.add({"check": "HF static", "status": "failed or cut", "rows_done": len(got), "error": failed})


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes and batches: the CPU dry run")
    ap.add_argument("--budget", type=float, default=270.0, help="seconds for every row (a row that would start "
                    "after is skipped; the HF rows get what is left)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode.json")
    if sys.argv[1:2] == ["--_hf-worker"]:
        return hf_worker(json.loads(sys.argv[2]))
    a = ap.parse_args()
    dev, s = torch.device(a.device), settings(a.small)
    configure_device_math(dev, "float32", None, "bench_decode")  # as opd train: TF32 on, cuDNN attention off
    a.out.parent.mkdir(parents=True, exist_ok=True)
    what = {k: v for k, v in s.items() if k != "shape"}
    meta = dict(commit=source_commit(), machine=machine_info(), settings={**what, **s["shape"], "top_p": 0.9,
                "tf32": dev.type == "cuda", "vocab": "demo tokenizer's"})  # fmt: skip
    run = Run(a.out, a.budget, meta)
    opd_rows(run, s, dev)
    hf_rows(run, s, a)
    print(markdown(meta, run.rows))


if __name__ == "__main__":
    main()

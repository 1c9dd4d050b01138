#!/usr/bin/env python
"""Forward+backward cost of opd's distillation losses at a Qwen2.5-like LM head, next to TRL's.

What it measures, per variant and sequence length T (one sequence, every position unmasked),
for a head of V=151936 tokens, width d=1536 and a support of K=32 tokens:

  (a) lsm_hidden  LSM from hidden states: ``local_support_kl_from_hidden`` (grads to hidden and W)
  (a2) lsm_tail_hidden  LSM with a tail bucket from hidden states:
                  ``local_support_kl_tail_from_hidden(chunk_size=...)``; the student's full
                  log-normalizer, a chunk of (chunk, V) logits at a time (recomputed in the backward)
  (b) lsm_logits  LSM from full logits: ``hidden @ W.T`` then ``local_support_kl`` (same grads)
  (c) sampled     sampled-token OPD: ``token_logprobs_from_hidden`` + ``sampled_token_advantages``
                  + ``sampled_token_pg_loss``
  (d) full_kl     full-vocabulary reverse KL: ``hidden @ W.T`` then ``full_vocab_kl(chunk_size=...)``
  (d2) full_kl_hidden  the same loss from both models' hidden states and heads:
                  ``full_vocab_kl_from_hidden(chunk_size=...)``, no (T, V) tensor of either model
  (e) trl         TRL's ``_chunked_divergence_loss`` (beta=1, reverse KL), when TRL is installed
  (f) opd_signal  opd's whole training signal: ``topk_from_hidden`` on the teacher (no grad) then (a)

Teacher quantities: (a), (a2), (b) get a precomputed teacher top-K (synthetic: K distinct ids per
position, sorted log-probs); (c) a precomputed teacher log-prob of the sampled token; (d) the
teacher's (1, T, V) logits precomputed (an input, so in the baseline, not in the peak); (d2) the
teacher's final hidden states and head, its logits computed (and recomputed in the backward)
inside the timing and the peak (more work than (d) does, and more memory counted). (e) and
(f) start from the same student and teacher final hidden states and both heads, so they compare
whole training signals: TRL projects the teacher's head itself, (f) takes its top-K chunked.

How:
  * time: each (variant, T) runs in a fresh subprocess; ``--warmup`` untimed steps (unless a step takes over ``--long-step`` s) then
    ``--repeats`` timed ones; we report the median wall time and median CPU-seconds. Gradients
    are set to None before each step (``zero_grad(set_to_none=True)``, torch's default).
  * memory: peak beyond the inputs, the parameters and their gradients = peak RSS (VmHWM) minus
    the RSS measured after allocating the inputs plus a touched, parameter-sized gradient buffer
    for hidden and W. The buffer is then freed (the real gradients take its place) and VmHWM is
    reset through /proc/self/clear_refs, so setup never counts. torch's CPU allocations are not
    visible to tracemalloc; RSS sees them (ru_maxrss would also carry the parent's pre-exec peak).
  * FLOPs are the analytic matmul FLOPs (2mnk); bytes are the dominant tensor traffic as written
    in ``FORMULAS`` (each gather of K weight rows per position counts T*K*d*4 once). Both are
    compared to the fp32 GEMM GFLOP/s and copy GB/s measured in the same run (best of a
    measurement before and after the variants).

Run (from the repository root):
  python benchmarks/bench_losses.py --quick        # small sizes, < 1 minute (CI smoke)
  python benchmarks/bench_losses.py                # full sizes: ~50 minutes on 2 cores
  python benchmarks/bench_losses.py --repeats 5 --threads 2 --out /tmp/losses.json
Writes the JSON to ``--out`` (default benchmarks/results/losses.json, or losses_quick.json with
``--quick``) and the printed markdown tables next to it (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from opd import losses as L
from opd.lab.experiments.core import machine_info, source_commit

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "lsm_hidden": "(a) LSM from hidden",
    "lsm_tail_hidden": "(a2) LSM + tail bucket from hidden",
    "lsm_logits": "(b) LSM from full logits",
    "sampled": "(c) sampled-token PG",
    "full_kl": "(d) full-vocab reverse KL",
    "full_kl_hidden": "(d2) full-vocab reverse KL from hidden",
    "trl": "(e) TRL chunked divergence b=1",
    "opd_signal": "(f) opd signal: teacher top-K + (a)",
}
FORMULAS = {
    "lsm_hidden": "flops 6TKd; bytes 4TKd*4 (row dots fwd, weighted rows bwd, dW contributions w+r) + Vd*4 (dense dW)",
    "lsm_tail_hidden": "flops 8TVd (fwd, recompute, 2 bwd GEMMs); bytes 5Vd*4c + 16TV*4, c = ceil(T/chunk) "
    "(W read x3 and dW read+write per chunk; about 16 passes over each (chunk, V) block in fwd+bwd)",
    "lsm_logits": "flops 6TVd; bytes 4Vd*4 (W read x3, dW write) + 4TV*4 (logits, dlogits w, 2 reads)",
    "sampled": "flops 8TVd (fwd, recompute, 2 bwd GEMMs); bytes (4*ceil(T/256)+1)Vd*4 + 7TV*4",
    "full_kl": "flops 6TVd; bytes 4Vd*4 + 8TV*4 (logits, 2x2 chunk reads, dlogits, 2 GEMM reads)",
    "full_kl_hidden": "flops 8TVd + 4TVd_t (student fwd, recompute, 2 bwd GEMMs; teacher fwd, recompute); bytes "
    "(5Vd + 2Vd_t)*4c + 50TV*4, c = ceil(T/chunk) (W read x3 and dW read+write per chunk; "
    "about 50 passes over each (chunk, V) block in fwd+bwd)",
    "trl": "flops 8TVd + 4TVd_t; bytes (4c+1)Vd*4 + 2cVd_t*4 + 11TV*4, c = ceil(T/4096)",
    "opd_signal": "flops 2TVd_t + 6TKd; bytes ceil(T/256)Vd_t*4 + 3TV*4 + the (a) bytes",
}
TRL_FN = "trl.trainer.distillation_trainer._chunked_divergence_loss"


# --------------------------------------------------------------------------- memory probes


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def reset_peak_rss() -> bool:
    """Reset VmHWM (peak RSS) to the current RSS (Linux >= 4.0); False if not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


# --------------------------------------------------------------------------- machine limits


def _median_time(fn, reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def calibrate(d: int, quick: bool) -> dict:
    """fp32 GEMM GFLOP/s at a head-like shape, copy GB/s (read+write) and first-touch GB/s."""
    m, n = (256, 4096) if quick else (1024, 8192)
    a, b = torch.randn(m, d), torch.randn(d, n)
    out = torch.empty(m, n)
    gemm = 2 * m * n * d / _median_time(lambda: torch.mm(a, b, out=out), 5) / 1e9
    numel = (16 if quick else 64) * 2**20
    src, dst = torch.randn(numel), torch.empty(numel)
    copy = 2 * numel * 4 / _median_time(lambda: dst.copy_(src), 5) / 1e9
    touch = numel * 4 / _median_time(lambda: torch.zeros(numel), 3) / 1e9
    return {"gemm_GFLOPs": gemm, "copy_GBps": copy, "first_touch_GBps": touch}


# --------------------------------------------------------------------------- inputs and steps


def make_inputs(variant: str, T: int, V: int, d: int, dt: int, K: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = {
        "W": torch.randn(V, d, generator=g).mul_(2.0 / math.sqrt(d)).requires_grad_(),
        "h": torch.randn(1, T, d, generator=g).requires_grad_(),
        "mask": torch.ones(1, T, dtype=torch.bool),
    }
    if variant in ("lsm_hidden", "lsm_tail_hidden", "lsm_logits"):
        # K distinct ids per position, spread over the vocabulary (random rows to gather).
        base = torch.randint(0, V, (1, T, 1), generator=g)
        x["ids"] = (base + torch.arange(K) * (V // K)) % V
        lp = torch.log_softmax(2.0 * torch.randn(1, T, K, generator=g), -1) - 0.3
        x["lp"] = lp.sort(-1, descending=True).values
    elif variant == "sampled":
        x["y"] = torch.randint(0, V, (1, T), generator=g)
        x["t_logp"] = -3.0 * torch.rand(1, T, generator=g)
    elif variant == "full_kl":
        x["t_logits"] = torch.randn(1, T, V, generator=g).mul_(2.0)
    elif variant in ("trl", "opd_signal", "full_kl_hidden"):
        x["Wt"] = torch.randn(V, dt, generator=g).mul_(2.0 / math.sqrt(dt))
        x["ht"] = torch.randn(1, T, dt, generator=g)
    return x


def build_step(variant: str, x: dict, K: int, kl_chunk: int, kl_hidden_chunk: int, tail_chunk: int):
    """A closure running one forward+backward of ``variant`` on ``x``."""
    h, W, mask = x["h"], x["W"], x["mask"]
    if variant == "lsm_hidden":
        loss = lambda: L.local_support_kl_from_hidden(h, W, x["ids"], x["lp"], mask)
    elif variant == "lsm_tail_hidden":
        loss = lambda: L.local_support_kl_tail_from_hidden(h, W, x["ids"], x["lp"], mask, chunk_size=tail_chunk)
    elif variant == "lsm_logits":
        loss = lambda: L.local_support_kl(h @ W.T, x["ids"], x["lp"], mask)
    elif variant == "sampled":

        def loss():
            logp = L.token_logprobs_from_hidden(h, W, x["y"])
            adv = L.sampled_token_advantages(logp, x["t_logp"], mask, gamma=0.0)
            return L.sampled_token_pg_loss(logp, adv, mask)
    elif variant == "full_kl":
        loss = lambda: L.full_vocab_kl(h @ W.T, x["t_logits"], mask, "reverse", chunk_size=kl_chunk)
    elif variant == "full_kl_hidden":
        loss = lambda: L.full_vocab_kl_from_hidden(h, W, x["ht"], x["Wt"], mask, "reverse", chunk_size=kl_hidden_chunk)
    elif variant == "opd_signal":

        def loss():
            ids, lp = L.topk_from_hidden(x["ht"], x["Wt"], K)
            return L.local_support_kl_from_hidden(h, W, ids, lp, mask)
    elif variant == "trl":
        from trl.trainer.distillation_trainer import _chunked_divergence_loss

        def step():
            _chunked_divergence_loss(h, x["ht"], W, x["Wt"], mask.long(), beta=1.0)[0].backward()

        return step
    else:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    return lambda: L.token_mean(loss(), mask).backward()


def worker(a: argparse.Namespace) -> dict:
    """Run one (variant, T) in this process and return its timings and memory."""
    torch.set_num_threads(a.threads)
    x = make_inputs(a.worker, a.T, a.V, a.d, a.teacher_d, a.K)
    step = build_step(a.worker, x, a.K, a.kl_chunk, a.kl_hidden_chunk, a.tail_chunk)
    params = [x["W"], x["h"]]
    buf = [torch.ones_like(p) for p in params]  # a touched, parameter-sized gradient buffer
    base = rss_bytes()
    del buf
    reset = reset_peak_rss()  # VmHWM now starts below the baseline: the gradients refill it
    times, cpus = [], []
    warmup = a.warmup
    while len(times) < a.repeats:
        for p in params:
            p.grad = None
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        t1, c1 = time.perf_counter(), time.process_time()
        # A step longer than --long-step seconds dwarfs one-time start-up costs: it is timed
        # rather than thrown away as a warm-up (this keeps the full run's wall time bounded).
        if warmup > 0 and t1 - t0 < a.long_step:
            warmup -= 1
            continue
        times.append(t1 - t0)
        cpus.append(c1 - c0)
    return {
        "times_s": times,
        "median_s": statistics.median(times),
        "cpu_s": cpus,
        "cpu_median_s": statistics.median(cpus),
        "baseline_rss_MB": base / 1e6,
        "peak_extra_MB": (_status_bytes("VmHWM") - base) / 1e6,
        "peak_reset": reset,
    }


# --------------------------------------------------------------------------- analytic model


def analytic(
    variant: str, T: int, V: int, d: int, dt: int, K: int, chunk: int = 128, tail_chunk: int = 128
) -> tuple[float, float]:
    """(matmul FLOPs, dominant bytes moved) of one forward+backward, per ``FORMULAS``."""
    b = 4
    lsm = (6 * T * K * d, 4 * T * K * d * b + V * d * b)
    if variant == "lsm_hidden":
        return lsm
    if variant == "lsm_tail_hidden":
        return 8 * T * V * d, 5 * V * d * b * math.ceil(T / tail_chunk) + 16 * T * V * b
    if variant == "lsm_logits":
        return 6 * T * V * d, 4 * V * d * b + 4 * T * V * b
    if variant == "sampled":
        return 8 * T * V * d, (4 * math.ceil(T / 256) + 1) * V * d * b + 7 * T * V * b
    if variant == "full_kl":
        return 6 * T * V * d, 4 * V * d * b + 8 * T * V * b
    if variant == "full_kl_hidden":
        c = math.ceil(T / chunk)
        return 8 * T * V * d + 4 * T * V * dt, (5 * V * d + 2 * V * dt) * b * c + 50 * T * V * b
    if variant == "trl":
        c = math.ceil(T / 4096)
        return 8 * T * V * d + 4 * T * V * dt, (4 * c + 1) * V * d * b + 2 * c * V * dt * b + 11 * T * V * b
    return 2 * T * V * dt + lsm[0], math.ceil(T / 256) * V * dt * b + 3 * T * V * b + lsm[1]


def memory_estimate(variant: str, T: int, V: int, d: int, dt: int, chunk: int = 128, tail_chunk: int = 128) -> float:
    """Rough bytes a (variant, T) subprocess needs, to shrink T before the kernel kills it."""
    head, tv = V * d * 4, T * V * 4
    extra = {
        "lsm_hidden": 0.5e9,
        "lsm_tail_hidden": 2 * min(T, tail_chunk) * V * 4 + 0.5e9,
        "lsm_logits": 3 * tv,
        "sampled": 2 * head + 1e9,
        "full_kl": 5 * tv,
        "full_kl_hidden": V * dt * 4 + 4 * min(T, chunk) * V * 4,
        "trl": V * dt * 4 + 8 * min(T, 4096) * 32768 * 4,
        "opd_signal": V * dt * 4 + 0.5e9,
    }[variant]
    return 2 * head + extra + 0.5e9


def fit_T(variant: str, T: int, a: argparse.Namespace) -> tuple[int, str]:
    """T itself, or T halved until the estimate fits in 85% of the available memory."""
    avail, t = 0.85 * available_bytes(), T
    while t > 128 and memory_estimate(variant, t, a.V, a.d, a.teacher_d, a.kl_hidden_chunk, a.tail_chunk) > avail:
        t //= 2
    need = memory_estimate(variant, T, a.V, a.d, a.teacher_d, a.kl_hidden_chunk, a.tail_chunk) / 1e9
    return t, "" if t == T else f"shrunk from T={T} to T={t}: ~{need:.1f} GB needed, {avail / 1e9:.1f} GB usable"


# --------------------------------------------------------------------------- driver


def run_one(variant: str, T: int, a: argparse.Namespace) -> dict:
    """Run (variant, T) in a fresh subprocess; return its row (timings or an error)."""
    T_run, note = fit_T(variant, T, a)
    row = {
        "variant": variant,
        "label": VARIANTS[variant],
        "T_requested": T,
        "T": T_run,
        "note": note,
        "load1_before": os.getloadavg()[0],
    }  # other processes on the cores make timings noisy
    cmd = [sys.executable, __file__, "--worker", variant, "--T", str(T_run)] + a.passthrough
    print(f"  {VARIANTS[variant]:<38} T={T_run:<5}", end=" ", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        row["error"] = f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"
        print("FAILED", file=sys.stderr)
        return row
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    flops, nbytes = analytic(variant, T_run, a.V, a.d, a.teacher_d, a.K, a.kl_hidden_chunk, a.tail_chunk)
    row.update(flops=flops, bytes=nbytes, formula=FORMULAS[variant])
    if not row["peak_reset"]:
        row["note"] = (row["note"] + "; " if row["note"] else "") + "VmHWM not reset: peak includes setup"
    print(f"{row['median_s']:.3f} s  {row['peak_extra_MB']:.0f} MB", file=sys.stderr)
    return row


def add_fractions(rows: list[dict], machine: dict) -> None:
    for r in rows:
        if "median_s" in r:
            r["GFLOPs"] = r["flops"] / r["median_s"] / 1e9
            r["GBps"] = r["bytes"] / r["median_s"] / 1e9
            r["gemm_fraction"] = r["GFLOPs"] / machine["gemm_GFLOPs"]
            r["bw_fraction"] = r["GBps"] / machine["copy_GBps"]
            ridge = machine["gemm_GFLOPs"] / machine["copy_GBps"]
            r["bound"] = "compute" if r["flops"] / r["bytes"] > ridge else "bandwidth"


def ratios(rows: list[dict]) -> list[dict]:
    """Per T: full-logits vs LSM-from-hidden, full KL from logits vs from hidden, the tail bucket vs
    LSM and full KL from hidden, and TRL vs opd's whole signal (time, memory)."""
    by = {(r["variant"], r["T_requested"]): r for r in rows if "median_s" in r}
    out = []
    for T in sorted({r["T_requested"] for r in rows}):
        entry = {"T": T}
        for name, slow, fast in (
            ("logits_vs_lsm", "lsm_logits", "lsm_hidden"),
            ("full_kl_vs_hidden", "full_kl", "full_kl_hidden"),
            ("tail_vs_lsm", "lsm_tail_hidden", "lsm_hidden"),
            ("full_kl_hidden_vs_tail", "full_kl_hidden", "lsm_tail_hidden"),
            ("trl_vs_opd", "trl", "opd_signal"),
        ):
            s, f = by.get((slow, T)), by.get((fast, T))
            if s and f and s["T"] == f["T"] == T:
                entry[f"{name}_time"] = s["median_s"] / f["median_s"]
                entry[f"{name}_mem"] = s["peak_extra_MB"] / max(f["peak_extra_MB"], 1.0)
        out.append(entry)
    return out


def targets(ratio_rows: list[dict], a: argparse.Namespace) -> list[dict]:
    at_size = a.d == 1536 and a.V == 151936
    entry = next((r for r in ratio_rows if r["T"] == 4096), None) if at_size else None
    where = "T=4096, d=1536" if entry else "not measured at T=4096, d=1536, V=151936 (no verdict)"
    specs = [
        ("LSM from hidden faster than full logits", "logits_vs_lsm_time", 30.0, ">="),
        ("LSM from hidden less memory than full logits", "logits_vs_lsm_mem", 30.0, ">="),
        ("opd whole signal faster than TRL", "trl_vs_opd_time", 2.5, ">="),
        ("opd whole signal less memory than TRL", "trl_vs_opd_mem", 1.0, ">"),
    ]
    out = []
    for name, key, thr, op in specs:
        val = entry.get(key) if entry else None
        ok = None if val is None else (val >= thr if op == ">=" else val > thr)
        out.append({"target": name, "ratio": val, "threshold": f"{op} {thr:g}x", "pass": ok, "where": where})
    return out


def _f(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def render(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = [
        f"# opd loss benchmark ({'quick' if s['quick'] else 'full'})",
        "",
        f"- head V={s['V']} d={s['d']} teacher d={s['teacher_d']} K={s['K']}, fp32, B=1, threads={s['threads']}, "
        f"warmup={s['warmup']} (skipped when a step takes over {s.get('long_step', '-')} s), repeats={s['repeats']} (medians); torch {s['torch']}, "
        f"TRL {s['trl'] or 'not installed'}; load1 = 1-minute load average before the run ({s['threads']} = only us)",
        f"- machine (best of start/end): GEMM {m['gemm_GFLOPs']:.0f} GFLOP/s, copy {m['copy_GBps']:.1f} GB/s, "
        f"first touch {m['first_touch_GBps']:.1f} GB/s",
        f"- memory: {report['method']['memory']}",
        f"- teacher: {report['method']['teacher']}",
        "",
        "| variant | T | median s | CPU s | peak extra MB | GFLOP | GB | GFLOP/s | %GEMM | GB/s | %copy BW | bound "
        "| load1 | note |",
        "|---|" + "---:|" * 10 + "---|---:|---|",
    ]
    for r in report["results"]:
        if "median_s" not in r:
            lines.append(f"| {r['label']} | {r['T']} |" + " - |" * 11 + f" {r.get('error') or r['note']} |")
            continue
        lines.append(
            f"| {r['label']} | {r['T']} | {r['median_s']:.3f} | {r['cpu_median_s']:.2f} | {r['peak_extra_MB']:.0f} "
            f"| {r['flops'] / 1e9:.1f} | {r['bytes'] / 1e9:.2f} | {r['GFLOPs']:.1f} | {100 * r['gemm_fraction']:.1f} "
            f"| {r['GBps']:.1f} | {100 * r['bw_fraction']:.1f} | {r['bound']} | {r['load1_before']:.1f} | {r['note']} |"
        )
    lines += [
        "",
        "| T | full logits / LSM time | full logits / LSM memory | full KL (d) / (d2) time "
        "| full KL (d) / (d2) memory | tail (a2) / LSM (a) time | tail (a2) / LSM (a) memory "
        "| full KL (d2) / tail (a2) time | full KL (d2) / tail (a2) memory "
        "| TRL / opd signal time | TRL / opd signal memory |",
        "|---:|" + "---:|" * 10,
    ]
    for e in report["ratios"]:
        lines.append(
            f"| {e['T']} | {_f(e.get('logits_vs_lsm_time'))} | {_f(e.get('logits_vs_lsm_mem'))} "
            f"| {_f(e.get('full_kl_vs_hidden_time'))} | {_f(e.get('full_kl_vs_hidden_mem'))} "
            f"| {_f(e.get('tail_vs_lsm_time'))} | {_f(e.get('tail_vs_lsm_mem'))} "
            f"| {_f(e.get('full_kl_hidden_vs_tail_time'))} | {_f(e.get('full_kl_hidden_vs_tail_mem'))} "
            f"| {_f(e.get('trl_vs_opd_time'))} | {_f(e.get('trl_vs_opd_mem'))} |"
        )
    lines += ["", "| target | measured | threshold | result | where |", "|---|---:|---|---|---|"]
    for t in report["targets"]:
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        measured = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        lines.append(f"| {t['target']} | {measured} | {t['threshold']} | {verdict} | {t['where']} |")
    return "\n".join(lines + [""])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small head and T (V=8192, d=256, T=256): < 1 minute")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per (variant, T) (default 3, quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument(
        "--long-step", type=float, default=10.0, help="a warm-up step slower than this (s) is timed instead of repeated"
    )
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every run")
    p.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths (default 512 2048 4096)")
    p.add_argument("--V", type=int, default=None, help="vocabulary size (default 151936)")
    p.add_argument("--d", type=int, default=None, help="student width (default 1536)")
    p.add_argument("--teacher-d", type=int, default=None, help="teacher width for (e), (f) (default: --d)")
    p.add_argument("--K", type=int, default=32, help="support size")
    p.add_argument("--kl-chunk", type=int, default=512, help="chunk_size (positions) of full_vocab_kl in (d)")
    p.add_argument(
        "--kl-hidden-chunk", type=int, default=128, help="chunk_size (positions) of full_vocab_kl_from_hidden in (d2)"
    )
    p.add_argument(
        "--tail-chunk",
        type=int,
        default=128,
        help="chunk_size (positions) of local_support_kl_tail_from_hidden in (a2)",
    )
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/losses[_quick].json)")
    p.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.V = a.V or (8192 if a.quick else 151936)
    a.d = a.d or (256 if a.quick else 1536)
    a.teacher_d = a.teacher_d or a.d
    a.T = a.T[0] if a.worker and a.T else (a.T or ([256] if a.quick else [512, 2048, 4096]))
    a.repeats = a.repeats or (2 if a.quick else 3)
    a.out = a.out or HERE / "results" / ("losses_quick.json" if a.quick else "losses.json")
    a.passthrough = [
        f"--{k}={getattr(a, k.replace('-', '_'))}"
        for k in (
            "V",
            "d",
            "teacher-d",
            "K",
            "kl-chunk",
            "kl-hidden-chunk",
            "tail-chunk",
            "repeats",
            "warmup",
            "long-step",
            "threads",
        )
    ]
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return
    torch.set_num_threads(a.threads)
    trl = importlib.metadata.version("trl") if importlib.util.find_spec("trl") else None
    variants = [v for v in a.variants if v != "trl" or trl]
    if "trl" in a.variants and not trl:
        print("TRL is not installed (pip install trl): skipping variant (e) and the TRL comparison.", file=sys.stderr)
    start = calibrate(a.d, a.quick)
    rows = []
    for T in a.T:
        print(f"T={T}", file=sys.stderr)
        rows += [run_one(v, T, a) for v in variants]
    end = calibrate(a.d, a.quick)
    machine = {k: max(start[k], end[k]) for k in start} | {"start": start, "end": end}
    add_fractions(rows, machine)
    ratio_rows = ratios(rows)
    report = {
        "settings": {
            k: getattr(a, k)
            for k in (
                "quick",
                "V",
                "d",
                "teacher_d",
                "K",
                "T",
                "kl_chunk",
                "kl_hidden_chunk",
                "tail_chunk",
                "repeats",
                "warmup",
                "long_step",
                "threads",
            )
        }
        | {
            "torch": torch.__version__,
            "trl": trl,
            "trl_function": TRL_FN if trl else None,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "method": {
            "time": "fresh subprocess per (variant, T); warmup steps, then median wall and CPU time of the timed "
            "forward+backward steps; grads set to None before each step",
            "memory": "peak RSS (VmHWM, reset via /proc/self/clear_refs after setup) minus the RSS after "
            "allocating inputs, parameters and a touched parameter-sized gradient buffer (then freed): "
            "peak beyond inputs, parameters and their gradients",
            "flops": "analytic matmul FLOPs (2mnk); elementwise work not counted",
            "bytes": "analytic dominant tensor traffic, fp32; see each row's formula",
            "teacher": "(a),(a2),(b) precomputed top-K; (c) precomputed teacher log-prob of the sampled token; "
            "(d) precomputed (1,T,V) teacher logits (an input, outside the peak); (d2) teacher hidden "
            "states and head, its logits computed and recomputed chunk by chunk inside the timing and "
            "the peak; (e) TRL projects the teacher head itself; (f) topk_from_hidden on the teacher, "
            "chunked, no grad, inside the timing",
        },
        "commit": source_commit(),
        "machine": {**machine_info(), **machine},
        "results": rows,
        "ratios": ratio_rows,
        "targets": targets(ratio_rows, a),
    }
    text = render(report)
    print(text)
    if not trl:
        print("TRL not installed: (e) and the TRL ratios were skipped (pip install trl).")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2))
    a.out.with_suffix(".md").write_text(text)
    print(f"wrote {a.out} and {a.out.with_suffix('.md')}", file=sys.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Throughput of opd's OPD step (LSM) with 1 and 2 processes, in-process and served teacher, next to TRL.

Every row does the same work: the demo's student and teacher (``opd/assets/demo``), the demo's
arithmetic prompts in the same order (opd's seeded order; TRL gets exactly that list, unshuffled),
the same batch (global: a 2-process row gives each rank half), the same generation length
(``--max-new-tokens``, stopping at EOS), temperature 1, top-p 0.9, lr, and the same number of
steps. opd's full-vocabulary diagnostics (``--diag-positions``, on by default in ``opd train``) are
work TRL does not do, so the rows turn them off except one that shows what they cost. Rows:

  opd-lsm  1 proc, in-process teacher     ``opd train --objective lsm --k K --diag-positions 0``
  opd-lsm  the same with opd's default diagnostics (``--diag-positions 256``)
  opd-lsm  2 procs (torchrun, DDP)         each rank half the batch; one thread per rank
  opd-lsm  1 proc, served teacher          ``opd serve-teacher`` in its own process, ``--teacher-url``
                                           (opd's binary answers, what opd's client and server agree on)
  opd-lsm  the same with vLLM's JSON answers (what a foreign client or server gets), for comparison
  opd-lsm  2 procs, served teacher         both ranks send to the one server (it batches them)
  trl      1 proc                          TRL's ``DistillationTrainer`` (beta=1: reverse KL over the
                                           full vocabulary), ``use_cpu=True``
  opd-lsm  1 proc, teacher in bfloat16     ``--teacher-dtype bfloat16`` (the student trains in float32)
  trl      1 proc, teacher in bfloat16     the same teacher, loaded in bfloat16, given to TRL

Every row's "vs TRL" ratio is against the TRL row whose teacher has the same dtype; a served row's
"vs in-process" ratio is against the in-process row with as many trainer processes (the same
cores: the server is one more process on them). A teacher is
never trained, so it can run in bfloat16 (as a vLLM-served one usually does): on a CPU with
bf16 matrix instructions (AVX512-BF16, AMX) that halves its forward pass for both trainers.

Every row computes on the CPU (``--device cpu`` for opd, ``use_cpu=True`` for TRL), also on a machine
with a GPU.

How it is timed: each row runs in fresh processes; the first ``--warmup`` steps are not timed
(the first ``generate`` in a process is slow). A step's time is the wall time between the ends of
consecutive steps, so it holds everything the trainer does per step (rollout, teacher, update,
logging); opd's own ``time/*`` split (generate, score, update) is reported too. Rollout tokens
per second = response tokens generated in the timed steps / their wall time. Ratios are taken
between rows of this one run. Every process (trainer rank or teacher server) gets ``--threads``
torch threads (default 1): two OpenMP threads per process collapse when the cores are
oversubscribed, so a 2-process row uses two cores where a 1-process row uses one.

The demo's vocabulary has 2,048 tokens, so its output layer is a small part of each model and
LSM's saving (K logits per student position instead of V) has little to act on. ``--vocab V``
pads both models' output layer to V rows (tiny random rows: extra tokens with logits near 0)
to measure the same step at a Qwen-sized head; both trainers get the same padded models.

A row that cannot run (no TRL, or torchrun failing) is reported as unavailable with the reason.

Run (from the repository root):
  python benchmarks/bench_scaleout.py --quick     # ~1-2 minutes: batch 16, 1+3 steps
  python benchmarks/bench_scaleout.py             # ~16 minutes: batch 64, 2+6 steps, 2 rounds
  python benchmarks/bench_scaleout.py --quick --vocab 151936 --rows opd1,trl   # a Qwen-sized head
Writes benchmarks/results/scaleout.json and .md (scaleout_quick.*, scaleout_v<V>_quick.*, ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = 0


def plan(args) -> dict:
    from opd.lab.demos import demo

    return {
        "student": str(demo.ASSETS / "student"),
        "teacher": str(demo.ASSETS / "teacher"),
        "task_level": demo.TASK_LEVEL,
        "top_p": demo.TOP_P,
        "batch": args.batch_size,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "steps": args.warmup + args.steps,
        "warmup": args.warmup,
        "lr": 5e-4,
        "threads": args.threads,
    }


# ----------------------------------------------------------------------------- workers (subprocesses)


def opd_worker(spec: dict, out: Path) -> None:
    """One opd training run; rank 0 writes per-step end times, response tokens and opd's timings."""
    import torch

    from opd.config import TrainConfig
    from opd.training import loop as train_mod

    torch.set_num_threads(spec["threads"])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = TrainConfig.from_flat(
        student=spec["student"],
        teacher="" if spec.get("teacher_url") else spec["teacher"],
        teacher_url=spec.get("teacher_url", ""),
        teacher_dtype="" if spec.get("teacher_url") else spec["teacher_dtype"],
        task_level=spec["task_level"],
        seed=SEED,
        out=str(out.parent / "run"),
        objective="lsm",
        k=spec["k"],
        steps=spec["steps"],
        batch_size=spec["batch"] // world,
        device="cpu",
        max_new_tokens=spec["max_new_tokens"],
        top_p=spec["top_p"],
        temperature=1.0,
        lr=spec["lr"],
        warmup_steps=0,
        eval_every=0,
        eval_size=1,
        eval_samples=0,
        ckpt_every=0,
        log_rollouts=0,
        diag_positions=spec["diag_positions"],
    )
    stamps, records, answers = [], [], []
    real_log = train_mod.log_stage
    if spec.get("teacher_url"):
        from opd.teachers import client as teacher_http
        from opd.teachers import factory as teacher_factory

        real_client = teacher_http.HTTPTeacher

        def client(*a, **kw):  # make_teacher builds the client through this name: the row's answer format
            made = real_client(*a, **kw, binary=spec["wire"] == "binary")
            answers.append("binary" if made.binary else "json")
            return made

        teacher_factory.HTTPTeacher = client

    def timed_log(*a, **kw):
        record = real_log(*a, **kw)
        stamps.append(time.perf_counter())
        records.append(record)
        return record

    train_mod.log_stage = timed_log
    train_mod.train(cfg, show_progress=False)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(
            json.dumps(
                {
                    "stamps": stamps,
                    "world": world,
                    "wire": answers[0] if answers else None,
                    "tokens": [r["rollout/response_len"] * spec["batch"] for r in records],
                    "split": [{k: r[k] for k in ("time/generate", "time/score", "time/update")} for r in records],
                    "loss": [r["train/loss"] for r in records],
                }
            )
        )


def trl_worker(spec: dict, out: Path) -> None:
    """TRL's DistillationTrainer on the same prompts (opd's order), batch, length and steps."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer

    from opd.models.loading import load_tokenizer
    from opd.rollout.prompt_set import PromptSet, load_task

    torch.set_num_threads(spec["threads"])
    tok = load_tokenizer(spec["student"])
    prompts = PromptSet.build(load_task("arithmetic", spec["task_level"], SEED).examples("train"), tok, 256)
    order = [i for s in range(spec["steps"]) for i in prompts.batch_indices(s, spec["batch"], SEED)]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": prompts.examples[i].prompt}]} for i in order])
    stamps, lengths = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    args = DistillationConfig(
        output_dir=str(out.parent / "trl"),
        per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1,
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_completion_length=spec["max_new_tokens"],
        temperature=1.0,
        top_p=spec["top_p"],
        top_k=0,
        beta=1.0,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,
        seed=SEED,
        disable_tqdm=True,
        # DistillationConfig defaults to both; opd runs float32 without recomputation, so the same work means off
        activation_checkpointing=False,
        bf16=False,
    )
    trainer = DistillationTrainer(
        model=AutoModelForCausalLM.from_pretrained(spec["student"], local_files_only=True),
        teacher_model=AutoModelForCausalLM.from_pretrained(
            spec["teacher"], local_files_only=True, dtype=getattr(torch, spec["teacher_dtype"])
        ),
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(spec["student"]),
        callbacks=[Clock()],
    )
    trainer.train()
    out.write_text(json.dumps({"stamps": stamps, "world": 1, "tokens": [m * spec["batch"] for m in lengths]}))


# ----------------------------------------------------------------------------- the driver


def start_server(teacher: str, threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "opd", "serve-teacher", teacher, "--port", "0", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"the teacher server did not start: {line.strip()} {proc.stderr.read()[-500:]}")
    return proc, match.group(0)


def run_row(name: str, kind: str, spec: dict, procs: int, timeout: float) -> dict:
    """Run one row in fresh processes; summarise its timed steps, or say why it is unavailable."""
    with tempfile.TemporaryDirectory(prefix="opd-scaleout-") as tmp:
        out = Path(tmp) / "result.json"
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec))
        worker = [str(Path(__file__).resolve()), "--worker", kind, "--spec", str(spec_file), "--result", str(out)]
        threads = spec["threads"]
        if procs == 1:
            cmd = [sys.executable, *worker]
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(procs),
                *worker,
            ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
        print(f"  running {name} ...", flush=True)
        t0 = time.perf_counter()
        # its own process group: a row that hangs is killed with torchrun's ranks, not just torchrun
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have ended at the last moment
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"row": name, "available": False, "reason": f"did not finish within {timeout:.0f} s"}
        if proc.returncode != 0 or not out.is_file():
            tail = (stderr or stdout).strip().splitlines()[-3:]
            return {"row": name, "available": False, "reason": f"exit {proc.returncode}: {' | '.join(tail)[-400:]}"}
        res = json.loads(out.read_text())
        return summarise(name, spec, res, time.perf_counter() - t0)


def summarise(name: str, spec: dict, res: dict, wall: float) -> dict:
    w = spec["warmup"]
    stamps, tokens = res["stamps"], res["tokens"]
    if len(stamps) < w + 2 or len(tokens) != len(stamps):
        return {
            "row": name,
            "available": False,
            "reason": f"recorded {len(stamps)} step ends and {len(tokens)} token counts for {spec['steps']} steps",
        }
    if spec.get("teacher_url") and res.get("wire") != spec["wire"]:
        return {
            "row": name,
            "available": False,
            "reason": f"the client got {res.get('wire')} answers, not {spec['wire']}",
        }
    step_s = [b - a for a, b in zip(stamps[w - 1 :], stamps[w:])]
    timed_tokens = sum(tokens[w:])
    out = {
        "row": name,
        "available": True,
        "processes": res["world"],
        "timed_steps": len(step_s),
        "s_per_step_median": statistics.median(step_s),
        "s_per_step_mean": sum(step_s) / len(step_s),
        "rollout_tokens_per_s": timed_tokens / sum(step_s),
        "response_tokens_per_step": timed_tokens / len(step_s),
        "process_wall_s": round(wall, 1),
    }
    if "split" in res:
        for key in ("time/generate", "time/score", "time/update"):
            out[key.replace("time/", "median_") + "_s"] = statistics.median(s[key] for s in res["split"][w:])
    return out


ROWS = {  # key: name, worker, processes, teacher, opd's diag_positions, teacher dtype
    "opd1": ("opd LSM, 1 proc, in-process teacher", "opd", 1, "local", 0, "float32"),
    "opd1diag": ("opd LSM, 1 proc, in-process teacher, default diagnostics", "opd", 1, "local", 256, "float32"),
    "opd2": ("opd LSM, 2 procs, in-process teacher", "opd", 2, "local", 0, "float32"),
    "served1": ("opd LSM, 1 proc, served teacher", "opd", 1, "served", 0, "float32"),
    "served1json": ("opd LSM, 1 proc, served teacher, vLLM JSON answers", "opd", 1, "served-json", 0, "float32"),
    "served2": ("opd LSM, 2 procs, served teacher", "opd", 2, "served", 0, "float32"),
    "trl": ("TRL DistillationTrainer (beta=1), 1 proc", "trl", 1, "local", 0, "float32"),
    "opd1bf16": ("opd LSM, 1 proc, in-process teacher in bf16", "opd", 1, "local", 0, "bfloat16"),
    "trlbf16": ("TRL DistillationTrainer (beta=1), 1 proc, teacher in bf16", "trl", 1, "local", 0, "bfloat16"),
}


def padded_models(base: dict, vocab: int, root: Path) -> dict:
    """Copies of the demo models whose output layer has ``vocab`` rows (a Qwen-sized head).

    The extra rows are tiny random vectors: real tokens to every softmax (logits near 0) that the
    tokenizer decodes to "" -- the same extra work for opd and TRL, on an otherwise unchanged
    model. Not zeros: 150k exactly tied logits would send tie-breaking code down a path no
    trained model takes."""
    import torch

    from opd.models.loading import load_model, load_tokenizer

    out = {}
    for role in ("student", "teacher"):
        model, tok = load_model(base[role], role), load_tokenizer(base[role], role)
        old = model.get_input_embeddings().weight.shape[0]
        model.resize_token_embeddings(vocab, mean_resizing=False)
        g = torch.Generator().manual_seed(SEED)
        with torch.no_grad():
            for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
                weight[old:] = 1e-3 * torch.randn(weight[old:].shape, generator=g)
        model.save_pretrained(root / role)
        tok.save_pretrained(root / role)
        out[role] = str(root / role)
    return out


def run_one(key: str, base: dict, args) -> dict:
    name, kind, procs, teacher, diag, teacher_dtype = ROWS[key]
    spec = {**base, "diag_positions": diag, "teacher_dtype": teacher_dtype}
    if kind == "trl" and not _has("trl"):
        return {"row": name, "available": False, "reason": "TRL is not installed (pip install -e '.[bench]')"}
    server = None
    load1 = os.getloadavg()[0]
    try:
        if teacher.startswith("served"):
            server, spec["teacher_url"] = start_server(base["teacher"], args.threads)
            spec["wire"] = "json" if teacher == "served-json" else "binary"
        row = run_row(name, kind, spec, procs, args.row_timeout)
    except RuntimeError as exc:
        row = {"row": name, "available": False, "reason": str(exc)}
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    return {**row, "load1_before": round(load1, 2)}


def run_all(args, model_root: Path) -> dict:
    """Every row once per round, the order rotated each round (other load on the machine drifts);
    a row's figures are the medians over its rounds."""
    base = plan(args)
    if args.vocab:
        base.update(padded_models(base, args.vocab, model_root), vocab=args.vocab)
    keys = args.rows.split(",")
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    for r in range(args.rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            runs[key].append(run_one(key, base, args))
            print(f"    round {r + 1}: {runs[key][-1]}", flush=True)
    rows = [combine(runs[k]) for k in keys]
    add_ratios(rows, [runs[k] for k in keys], keys)
    from opd.lab.experiments.core import machine_info, source_commit  # not in the timed processes

    return {
        "plan": {**base, "rounds": args.rounds},
        "rows": rows,
        "rounds": runs,
        "commit": source_commit(),
        "machine": {**machine_info(), **machine()},
    }


def combine(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if r["available"]]
    if not ok:
        return rounds[-1]
    out = dict(ok[0])
    for key, value in ok[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in ok)
    out["rounds_ok"] = len(ok)
    return out


def add_ratios(rows: list[dict], rounds: list[list[dict]], keys: list[str]) -> None:
    """Ratios taken within each round (rows run minutes apart, not rounds apart), then their median.
    A row is compared with the TRL row whose teacher runs in the same dtype; a served row also with
    the in-process row of the same processes, diagnostics and dtype."""
    trl = {ROWS[k][5]: i for i, k in enumerate(keys) if ROWS[k][1] == "trl"}
    ref = keys.index("opd1") if "opd1" in keys else None
    local = {
        (ROWS[k][2], ROWS[k][4], ROWS[k][5]): i
        for i, k in enumerate(keys)
        if ROWS[k][1] == "opd" and ROWS[k][3] == "local"
    }

    def ratio(i: int, j: int | None) -> float | None:
        pairs = (
            [(a, b) for a, b in zip(rounds[i], rounds[j]) if a["available"] and b["available"]] if j is not None else []
        )
        return (
            statistics.median(a["rollout_tokens_per_s"] / b["rollout_tokens_per_s"] for a, b in pairs)
            if pairs
            else None
        )

    for i, r in enumerate(rows):
        _, _, procs, teacher, diag, dtype = ROWS[keys[i]]
        in_process = local.get((procs, diag, dtype)) if teacher != "local" else None
        for key, j in (
            ("throughput_vs_trl", trl.get(dtype)),
            ("throughput_vs_opd_1proc", ref),
            ("throughput_vs_in_process", in_process),
        ):
            value = ratio(i, j) if r["available"] else None
            if value is not None:
                r[key] = value


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def machine() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if _has("trl"):
        import trl

        info["trl"] = trl.__version__
    return info


def table(result: dict) -> str:
    p = result["plan"]
    head = f"output layer padded to {p['vocab']} rows, " if p.get("vocab") else ""
    lines = [
        f"Batch {p['batch']} prompts, up to {p['max_new_tokens']} new tokens, K={p['k']}, {head}"
        f"{p['steps'] - p['warmup']} timed steps after {p['warmup']} warm-up, {p['threads']} torch thread(s) per process; "
        f"medians over {p['rounds']} interleaved round(s); load1 = 1-minute load average before the row "
        f"({os.cpu_count()} cores, shared with other work).",
        "",
        "| row | processes | s/step (median) | rollout tok/s | vs TRL (tok/s) | vs opd 1 proc | "
        "served vs in-process | generate / score / update s | load1 |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["rows"]:
        if not r["available"]:
            lines.append(f"| {r['row']} | | unavailable: {r['reason']} | | | | | | |")
            continue
        split = " / ".join(f"{r[k]:.3f}" for k in ("median_generate_s", "median_score_s", "median_update_s") if k in r)
        fmt = lambda k, r=r: f"{r[k]:.2f}x" if k in r else "-"
        procs = r["processes"] + (1 if "served" in r["row"] else 0)  # the teacher server is a process too
        lines.append(
            f"| {r['row']} | {procs} | {r['s_per_step_median']:.3f} | {r['rollout_tokens_per_s']:.0f} | "
            f"{fmt('throughput_vs_trl')} | {fmt('throughput_vs_opd_1proc')} | "
            f"{fmt('throughput_vs_in_process')} | {split or '-'} | {r['load1_before']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 16, 1 warm-up + 3 timed steps (~1-2 minutes)")
    ap.add_argument("--batch-size", type=int, default=None, help="global prompts per step (default 64; quick 16)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 6; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps, >= 1 (default 2; quick 1)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="generation length (the demo's)")
    ap.add_argument("--k", type=int, default=32, help="LSM support size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (trainer ranks and server alike)")
    ap.add_argument(
        "--vocab",
        type=int,
        default=0,
        help="pad both models' output layer to this many rows (e.g. 151936, Qwen2.5's); 0: as trained",
    )
    ap.add_argument("--rows", default=",".join(ROWS), help=f"rows to run, comma-separated from {','.join(ROWS)}")
    ap.add_argument("--rounds", type=int, default=None, help="runs of every row, interleaved (default 2; quick 1)")
    ap.add_argument("--row-timeout", type=float, default=900, help="seconds before a row is given up")
    ap.add_argument(
        "--out", type=Path, default=None, help="JSON path (default benchmarks/results/scaleout[_quick].json)"
    )
    ap.add_argument("--worker", choices=("opd", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        (opd_worker if args.worker == "opd" else trl_worker)(json.loads(args.spec.read_text()), args.result)
        return
    args.batch_size = args.batch_size or (16 if args.quick else 64)
    args.steps = args.steps or (3 if args.quick else 6)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.batch_size % 2:
        ap.error("--batch-size must be even (the 2-process rows split it in half)")
    if any(key not in ROWS for key in args.rows.split(",")):
        ap.error(f"--rows {args.rows!r}: choose from {','.join(ROWS)}")
    name = "scaleout" + (f"_v{args.vocab}" if args.vocab else "") + ("_quick" if args.quick else "")
    out = args.out or ROOT / "benchmarks" / "results" / f"{name}.json"
    with tempfile.TemporaryDirectory(prefix="opd-scaleout-models-") as model_root:
        result = run_all(args, Path(model_root))
    text = table(result)
    print("\n" + text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# opd scale-out benchmark\n\n{text}\n\nMachine: {json.dumps(result['machine'])}\n"
    )
    print(f"\nwrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()

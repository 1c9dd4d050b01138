#!/usr/bin/env python
"""How the student's weights reach a vLLM engine (``--vllm-sync``): each way side by side, on this machine's CPU.

For the packaged demo student (0.7M parameters) and a model with Qwen2.5-0.5B's blocks (24 x 896, 0.36B
parameters, random weights, the demo's tokenizer: ``bench_vllm.make_half_b``), against vLLM's CPU build
(float32, as opd starts it):

* **sync**: the median of 5 syncs (after one to warm up) of each way against one running server:
  ``before`` -- the sync as it was before ``--vllm-sync`` (at 1e05e1a): every weight copied, written with
  ``safetensors.torch.save_file`` into a new file renamed over the old one, reloaded in place; ``file`` and
  ``shm`` -- :class:`opd.rollout.vllm_sync.FolderSync` in a folder on disk and in ``/dev/shm``; for a LoRA
  student (rank 16 on every linear layer of the blocks, a trained-looking adapter), ``before`` (the adapter
  merged, then as above) and ``adapter`` (:class:`~opd.rollout.vllm_sync.AdapterSync`, on a server started
  with ``--enable-lora``). Each sync is split into the export (``merged_weights``), the write and the rest
  (the server's reload and its prefix-cache reset);
* **rollout**: a batch of 16 prompts, 64 new tokens, top-p 0.9, from the synced engine (without sync; the
  median of 3 at the demo, 2 at 0.36B), and the policy check's gap of it (a LoRA student's from the adapter
  or from the merged weights);
* **OPD step**: ``opd train`` with ``--rollout-engine vllm`` on the shape (the teacher: the same model; the
  demo: its own teacher): full fine-tuning with ``--vllm-sync file`` and LoRA with ``--vllm-sync adapter``;
  the median ``time/step``, ``time/generate`` and ``time/weight_sync`` over the steps after the first.

A way's share of the step is its sync over (the step without its own run's sync + the way's sync), and the
same for the rollout (``time/generate`` holds the sync): the other stages do not depend on the way.
Every process here (server, trainer) shares 2 cores with whatever else runs: quote ratios measured
side by side, not seconds.

Run (repository root, after ``opd vllm-setup``; about 30 minutes):
  python benchmarks/bench_weight_sync.py            # both shapes
  python benchmarks/bench_weight_sync.py --quick    # the demo student only, 2 syncs, 3 steps (a dry run)
  python benchmarks/bench_weight_sync.py --lora-rollouts  # a LoRA student's rollouts, adapter against merged
Writes benchmarks/results/weight_sync.json (``--json``; ``weight_sync_quick.json`` with ``--quick``) and a
Markdown table beside it.
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
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import safetensors.torch as st
import torch
from bench_vllm import make_half_b, prompts, timed_rollouts

from opd.config import TrainConfig
from opd.lab.experiments.core import source_commit
from opd.models import export
from opd.models.loading import load_model, load_tokenizer
from opd.models.lora import apply_lora
from opd.rollout import vllm_sync
from opd.rollout.vllm_engine import SEEDED_ON_CPU, VLLMRollout
from opd.rollout.vllm_server import start_vllm_server, vllm_python
from opd.service import Client
from opd.training import loop as train_mod

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "src" / "opd" / "assets" / "demo"
LORA_R = 16
# (module, function, the part of a sync it is): where each way looks them up
PARTS = (
    (export, "merged_weights", "export"),
    (vllm_sync, "merged_weights", "export"),
    (vllm_sync, "adapter_weights", "export"),
    (vllm_sync, "write_weights", "write"),
    (st, "save_file", "write"),
)


class Before:
    """The sync before ``--vllm-sync`` (src/opd/rollout/vllm_engine.py at 1e05e1a), kept here to compare."""

    name = "before"

    def __init__(self, folder: Path):
        self.folder = folder

    def push(self, model, client: Client, dtype) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "model.safetensors"
        tmp = path.with_name(path.name + ".tmp")
        st.save_file(export.merged_weights(model, dtype), tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(self.folder.resolve())}}
        client.request("POST", "/collective_rpc", rpc, retry_5xx=False)
        client.request("POST", "/reset_prefix_cache")

    def close(self) -> None:
        return None


def timed_syncs(way, model, client: Client, repeats: int) -> dict:
    """The median sync of ``way`` and its parts (export, write, and the rest: the server's reload and its
    prefix-cache reset), after one sync to warm up."""
    spent = {"export": 0.0, "write": 0.0}

    def timing(fn, part):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[part] += time.perf_counter() - t0

        return timed

    rows = []
    with ExitStack() as stack:
        for module, name, part in PARTS:
            stack.enter_context(mock.patch.object(module, name, timing(getattr(module, name), part)))
        way.push(model, client, None)
        for _ in range(repeats):
            spent.update(export=0.0, write=0.0)
            t0 = time.perf_counter()
            way.push(model, client, None)
            rows.append({"sync_s": time.perf_counter() - t0, "export_s": spent["export"], "write_s": spent["write"]})
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["reload_s"] = med["sync_s"] - med["export_s"] - med["write_s"]
    return med


def written_bytes(way, model) -> int:
    """What one sync of ``way`` writes: the adapter, or the whole weights (float32)."""
    if way.name == "adapter":
        return sum(t.numel() * t.element_size() for t in export.adapter_weights(model).values())
    return vllm_sync.weights_bytes(model, None)


def with_lora(model_dir: Path):
    """The student with a LoRA adapter of rank LORA_R on every linear layer of its blocks, B drawn (a zero B,
    as at initialisation, would make every way's policy check trivially pass)."""
    model = apply_lora(load_model(model_dir, "student"), LORA_R, 2.0 * LORA_R, ["all-linear"], 0.0, model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def bench_server(model_dir: Path, log: Path, way):
    """A float32 vLLM server on ``model_dir`` in dev mode, with the options ``way`` needs (LoRA for an adapter)."""
    args, env = vllm_sync.server_options(way, LORA_R, [])
    return start_vllm_server(
        model_dir,
        log,
        dtype="float32",
        max_model_len=512,
        dev_mode=True,
        extra_args=[*SEEDED_ON_CPU, *args],
        extra_env=env,
        timeout=1800,
    )


def sync_rows(shape: str, model_dir: Path, tmp: Path, repeats: int, rollouts: int) -> list[dict]:
    """Every way's sync against a running server, and a rollout from it: full weights on a plain server,
    a LoRA student's on one started with --enable-lora."""
    tok = load_tokenizer(model_dir, "student")
    ids = prompts(tok, 16)
    rows = []
    for lora in (False, True):
        model = with_lora(model_dir) if lora else load_model(model_dir, "student")
        # the adapter first: the server's base weights must be the student's own, which `before` replaces
        ways = (
            [vllm_sync.AdapterSync(tmp / "adapter"), Before(tmp / "before-lora")]
            if lora
            else [
                Before(tmp / "before"),
                vllm_sync.FolderSync("file", tmp / "file"),
                vllm_sync.FolderSync("shm", Path(tempfile.mkdtemp(prefix="opd-bench-", dir="/dev/shm")), owned=True),
            ]
        )
        t0 = time.perf_counter()
        server = bench_server(model_dir, tmp / f"{shape}-{lora}.log", ways[0])
        started = time.perf_counter() - t0
        try:
            client = Client(server.url, "--vllm-url", timeout=600)
            for way in ways:
                row = {"shape": shape, "lora": lora, "way": way.name, "server_start_s": started}
                row.update(timed_syncs(way, model, client, repeats), written_gb=written_bytes(way, model) / 1e9)
                engine = VLLMRollout(model, tok, tmp / "unused", url=server.url, max_gap=float("inf"), sync=way)
                engine.generate(ids[:2], [0, 1], max_new_tokens=4)  # synced by this way (once), and warm
                got = timed_rollouts(engine, ids, 64, rollouts)
                row["policy_gap"] = got.pop("logprob_gap")
                row.update({f"rollout_{k}": v for k, v in got.items()})
                rows.append(row)
                print(json.dumps(row), flush=True)
                way.close()
        finally:
            server.stop()
    return rows


def lora_rollout_rows(shape: str, model_dir: Path, tmp: Path, repeats: int) -> list[dict]:
    """A LoRA student's rollouts on one server started with --enable-lora, in turn: from the adapter (on the
    student's own base weights, reloaded from its folder first) and from the merged weights (by the base
    model's name), ``repeats`` times each, interleaved so both see the same load."""
    tok, model = load_tokenizer(model_dir, "student"), with_lora(model_dir)
    ids = prompts(tok, 16)
    adapter, merged = vllm_sync.AdapterSync(tmp / "lora-adapter"), vllm_sync.FolderSync("file", tmp / "lora-merged")
    server = bench_server(model_dir, tmp / f"{shape}-lora-rollouts.log", adapter)
    rows = []
    try:
        client = Client(server.url, "--vllm-url", timeout=600)
        for repeat in range(repeats):
            for way in (adapter, merged):
                if way is adapter:  # the base weights back: the adapter goes on the student's own
                    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(model_dir.resolve())}}
                    client.request("POST", "/collective_rpc", rpc, retry_5xx=False)
                engine = VLLMRollout(model, tok, tmp / "unused", url=server.url, max_gap=float("inf"), sync=way)
                engine.generate(ids[:2], [0, 1], max_new_tokens=4)  # synced (once), and warm
                got = timed_rollouts(engine, ids, 64, 1)
                gap = got.pop("logprob_gap")
                row = {"shape": shape, "way": way.name, "repeat": repeat, **got}
                rows.append({**row, "policy_gap": gap, "load": os.getloadavg()[0]})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


def step_rows(
    shape: str, model_dir: Path, teacher: Path, tmp: Path, steps: int, batch: int, new_tokens: int
) -> list[dict]:
    """``opd train`` with vLLM rollouts: full fine-tuning (--vllm-sync file) and LoRA (--vllm-sync adapter)."""
    rows = []
    for lora, way in ((False, "file"), (True, "adapter")):
        out = tmp / f"step-{shape}-{way}"
        cfg = TrainConfig.from_flat(
            student=str(model_dir),
            teacher=str(teacher),
            out=str(out),
            rollout_engine="vllm",
            vllm_sync=way,
            lora_r=LORA_R if lora else 0,
            lora_alpha=2.0 * LORA_R,
            steps=steps,
            batch_size=batch,
            max_new_tokens=new_tokens,
            k=8,
            eval=False,
            ckpt_every=0,
            log_rollouts=0,
            diag_positions=16,
            vllm_start_timeout=1800,
            vllm_max_gap=float("inf") if lora else 0.0,
        )
        train_mod.train(cfg, show_progress=False)
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        timed = [r for r in records if "time/step" in r][1:]  # the first step warms up
        row = {
            "shape": shape,
            "lora": lora,
            "way": way,
            "batch": batch,
            "new_tokens": new_tokens,
            "steps_timed": len(timed),
        }
        row.update({k: statistics.median(r[f"time/{k}"] for r in timed) for k in ("step", "generate", "weight_sync")})
        row["policy_gap"] = max(r["rollout/engine_logprob_gap"] for r in timed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def shares(syncs: list[dict], steps: list[dict]) -> None:
    """Each way's share of the OPD step and of the rollout, and how many times less it takes than ``before``."""
    for row in syncs:
        run = next(s for s in steps if s["shape"] == row["shape"] and s["lora"] == row["lora"])
        other_step = run["step"] - run["weight_sync"]
        other_rollout = run["generate"] - run["weight_sync"]
        row["share_of_step"] = row["sync_s"] / (other_step + row["sync_s"])
        row["share_of_rollout"] = row["sync_s"] / (other_rollout + row["sync_s"])
        before = next(
            b for b in syncs if b["shape"] == row["shape"] and b["lora"] == row["lora"] and b["way"] == "before"
        )
        row["times_less_than_before"] = before["sync_s"] / row["sync_s"]
        row["s_per_gb_written"] = row["sync_s"] / row["written_gb"]


def table(result: dict) -> str:
    lines = [
        f"# Weight sync to vLLM (benchmarks/bench_weight_sync.py)\n\nAt {result['commit']}, {result['machine']}.\n",
        "| shape | student | way | GB written | sync s | export s | write s | reload s | s per GB written | "
        "x less than before | share of OPD step | share of rollout | rollout s (16 x 64 tokens) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["syncs"]:
        lines.append(
            f"| {r['shape']} | {'LoRA r16' if r['lora'] else 'full'} | {r['way']} | {r['written_gb']:.4f} | "
            f"{r['sync_s']:.3f} | {r['export_s']:.3f} | {r['write_s']:.3f} | {r['reload_s']:.3f} | "
            f"{r['s_per_gb_written']:.2f} | {r['times_less_than_before']:.1f} | {100 * r['share_of_step']:.1f}% | "
            f"{100 * r['share_of_rollout']:.1f}% | {r['rollout_seconds']:.2f} |"
        )
    lines += [
        "",
        "| OPD step | student | --vllm-sync | batch | step s | generate s | of which sync s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in result["steps"]:
        lines.append(
            f"| {r['shape']} | {'LoRA r16' if r['lora'] else 'full'} | {r['way']} | {r['batch']} | {r['step']:.2f} | "
            f"{r['generate']:.2f} | {r['weight_sync']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def vllm_version() -> str:
    """The version of the vLLM the servers run (opd vllm-setup's environment), read from it."""
    got = subprocess.run(
        [str(vllm_python()), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    return got.stdout.strip().splitlines()[-1] if got.returncode == 0 and got.stdout.strip() else "unknown"


def machine(load: tuple[float, float, float]) -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or platform.machine(),
    )
    return (
        f"{cpu}, {os.cpu_count()} cores shared by the trainer, the vLLM server and other users (load average "
        f"{load[0]:.1f} at the start), torch {torch.__version__} ({torch.get_num_threads()} threads), vLLM "
        f"{vllm_version()} float32"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the demo student only, 2 syncs, 3 steps (a dry run)")
    ap.add_argument(
        "--lora-rollouts",
        action="store_true",
        help="only a LoRA student's rollouts from its adapter and from its merged weights, in turn, at 0.36B "
        "(writes weight_sync_lora_rollouts.json beside --json)",
    )
    ap.add_argument(
        "--json",
        help="where to write (default benchmarks/results/weight_sync.json; with --quick weight_sync_quick.json, "
        "so that a dry run leaves the committed results alone)",
    )
    args = ap.parse_args()
    args.json = args.json or str(ROOT / "benchmarks" / "results" / f"weight_sync{'_quick' if args.quick else ''}.json")
    torch.set_num_threads(2)
    load, measured_at = os.getloadavg(), source_commit()  # the commit whose modules this process imports, now
    if args.lora_rollouts:
        with tempfile.TemporaryDirectory() as tmp:
            rows = lora_rollout_rows("0.36B", make_half_b(Path(tmp) / "halfb"), Path(tmp), 3)
        out = Path(args.json).with_name("weight_sync_lora_rollouts.json")
        ratio = statistics.median(r["seconds"] for r in rows if r["way"] == "adapter") / statistics.median(
            r["seconds"] for r in rows if r["way"] == "file"
        )
        result = {"commit": measured_at, "machine": machine(load), "adapter_over_merged": ratio, "rows": rows}
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"adapter / merged rollout seconds (medians): {ratio:.2f}; wrote {out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        repeats = 2 if args.quick else 5
        syncs = sync_rows("demo", DEMO / "student", tmp, repeats, 1 if args.quick else 3)
        steps = step_rows("demo", DEMO / "student", DEMO / "teacher", tmp, 3 if args.quick else 6, 64, 48)
        if not args.quick:
            half_b = make_half_b(tmp / "halfb")
            syncs += sync_rows("0.36B", half_b, tmp, repeats, 2)
            steps += step_rows("0.36B", half_b, half_b, tmp, 4, 8, 32)
    shares(syncs, steps)
    result = {
        "commit": measured_at,
        "machine": machine(load),
        "quick": args.quick,
        "syncs": syncs,
        "steps": steps,
    }
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.json).with_suffix(".md").write_text(table(result))
    print(table(result))
    print(f"wrote {args.json} (commit {result['commit']})")


if __name__ == "__main__":
    sys.exit(main())

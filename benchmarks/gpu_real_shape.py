#!/usr/bin/env python
"""Real-shape GPU check of bfloat16 mixed precision, in at most ~5 minutes on one GPU.

The bodies of a Qwen2.5-0.5B-shaped student (24 x 896, 14/2 heads: 0.36B parameters) and a
Qwen2.5-1.5B-shaped teacher (28 x 1536: 1.31B), random weights on the demo's 2,048-token tokenizer; the
teacher's final norm is scaled up so its head is sharp and a falling KL means the student learns it.
Items, in order (each writes its record as it ends; one past the time budget is skipped, said so):

  env          torch / CUDA / cuDNN / GPU versions, the opd commit, the machine
  sdpa         torch alone: scaled_dot_product_attention in bfloat16 with a left-padded boolean mask (fully
               masked query rows), forward and backward, per backend (cuDNN, memory-efficient, math): NaN
               counts of the gradients (pytorch/pytorch#196678)
  nan_cause    opd train's LSM at the real student, bfloat16 mixed precision, 2 steps, with cuDNN attention
               allowed (torch's default) and off (opd's): finite or the step it stopped at
  replay_*     lsm, sampled, full_kl: 20 steps of bfloat16 mixed precision and float32 (TF32 off) on the
               same replayed batches (opd.lab.replay), the per-step losses and gradient norms, and whether
               they are within the derived tolerance (Replayed.within_bf16_bound)
  step_split   opd train at batch 64 and 128 new tokens in bfloat16 (opd's defaults: TF32 on, cuDNN off),
               4 steps: generate / score / update seconds and the rollout's tokens/s
  demo_speed   the demo's LSM, 16 steps: float32, bfloat16, bfloat16 with cuDNN attention allowed: the
               median step (is the slow bfloat16 step of the first probe cuDNN's per-shape plans?)

Run (repository root):
  python benchmarks/gpu_real_shape.py --out benchmarks/results/gpu_real_shape.json     # on a GPU
  python benchmarks/gpu_real_shape.py --device cpu --small --out /tmp/real_shape.json  # dry run (3 replayed steps)
Writes the JSON and a Markdown table next to it (same name, .md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from opd.config import TrainConfig  # noqa: E402
from opd.errors import UserError  # noqa: E402
from opd.lab.experiments.core import machine_info, source_commit  # noqa: E402
from opd.lab.replay import replay  # noqa: E402
from opd.training import loop  # noqa: E402
from opd.training.setup import setup  # noqa: E402

DEMO = ROOT / "src" / "opd" / "assets" / "demo"
REAL = {
    "student": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
    ),
    "teacher": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960
    ),
}
SMALL = {
    "student": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128
    ),
    "teacher": dict(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256
    ),
}
SHARP = 4.0  # the teacher's final-norm scale: logits 4x a random model's, a peaked distribution to learn


class Check:
    """The JSON being written: every item's record, rewritten after each item."""

    def __init__(self, out: Path, budget: float):
        self.out, self.deadline, self.results = out, time.time() + budget, {}

    def item(self, name: str, fn, *args, need: float = 0.0) -> None:
        left = self.deadline - time.time()
        if left < need:
            self.results[name] = {"status": "skipped", "why": f"{left:.0f} s left of the budget, needs ~{need:.0f}"}
        else:
            t0 = time.time()
            try:
                self.results[name] = {"status": "ok", **fn(*args)}
            except Exception as exc:  # noqa: BLE001 -- record and go on: one item's failure is a result
                self.results[name] = {"status": "failed", "error": "".join(traceback.format_exception(exc))[-2000:]}
            self.results[name]["seconds"] = round(time.time() - t0, 1)
        print(f"{name}: {self.results[name]['status']} ({self.results[name].get('seconds', 0)} s)", flush=True)
        self.write()

    def write(self) -> None:
        self.out.write_text(json.dumps(self.results, indent=1) + "\n")
        self.out.with_suffix(".md").write_text(markdown(self.results))


def markdown(results: dict) -> str:
    env = results.get("env", {})
    lines = [
        "# Real-shape GPU check (benchmarks/gpu_real_shape.py)",
        "",
        f"{env.get('gpu') or 'CPU'}, torch {env.get('torch')}, cuDNN {env.get('cudnn')}, opd {env.get('commit')}",
        "",
        "| item | status | what it found |",
        "|---|---|---|",
    ]
    for name, r in results.items():
        if name != "env":
            lines.append(f"| {name} | {r['status']} | {r.get('summary', r.get('why', ''))} |")
    return "\n".join(lines) + "\n"


def make_models(root: Path, shapes: dict) -> tuple[Path, Path]:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(DEMO / "student")
    base = json.loads((DEMO / "student" / "config.json").read_text())
    dirs = []
    for role, shape in shapes.items():
        cfg = Qwen2Config(
            vocab_size=base["vocab_size"],
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=base.get("bos_token_id"),
            eos_token_id=base.get("eos_token_id"),
            pad_token_id=base.get("pad_token_id"),
            **shape,
        )
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg)
        if role == "teacher":
            with torch.no_grad():
                model.model.norm.weight.mul_(SHARP)
        model.save_pretrained(root / role)
        tok.save_pretrained(root / role)
        dirs.append(root / role)
    return dirs[0], dirs[1]


def env_item() -> dict:
    info = machine_info()
    return {
        **info,
        "commit": source_commit(),
        "cudnn": torch.backends.cudnn.version(),
        "cuda": torch.version.cuda,
        "summary": f"{info.get('gpu') or 'CPU'}",
    }


def sdpa_item(device: str) -> dict:
    """Fully masked query rows (left padding) through SDPA in bfloat16, per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    B, H, D = 4, 14, 64
    for L in (192, 200):
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(device, torch.bfloat16) for _ in range(3))
        pad = torch.tensor([0, 5, 40, 100])  # each row's left padding
        keys = torch.arange(L)[None, :] >= pad[:, None]  # (B, L): real tokens
        mask = (torch.ones(L, L, dtype=torch.bool).tril()[None] & keys[:, None, :])[:, None].to(device)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            key = f"L{L}_{backend.name.lower()}"
            try:
                with sdpa_kernel([backend]):
                    o = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
                    o.float().square().sum().backward()
            except RuntimeError as exc:  # a backend that does not serve this device or input
                out[key] = f"unavailable: {str(exc).splitlines()[0][:120]}"
                continue
            out[key] = {name: int((~torch.isfinite(t.grad)).sum()) for name, t in zip("qkv", leaves, strict=True)}
    bad = [k for k, v in out.items() if isinstance(v, dict) and any(v.values())]
    return {"grad_nonfinite": out, "summary": f"non-finite gradients: {', '.join(bad) or 'none'}"}


def run_steps(cfg: TrainConfig, cudnn: bool) -> dict:
    """opd's loop on ``cfg`` (setup switches cuDNN attention off; ``cudnn`` turns it back on first)."""
    run = setup(cfg)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        loop.train_steps(run, show_progress=False)
    except UserError as exc:
        return {"finite": False, "error": str(exc).split(";")[0]}
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
    recs = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train/loss" in r]
    return {
        "finite": all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in steps),
        "steps": [
            {
                k: r[k]
                for k in r
                if k.startswith(("time/", "train/loss", "train/grad_norm"))
                or k in ("rollout/response_len", "rollout/eos_rate")
            }
            for r in steps
        ],
    }


def base_cfg(student: Path, teacher: Path, out: Path, device: str, **kw) -> TrainConfig:
    settings = dict(
        student=str(student),
        teacher=str(teacher),
        out=str(out),
        device=device,
        k=32,
        eval_every=0,
        eval_size=1,
        eval_samples=0,
        ckpt_every=0,
        log_rollouts=0,
        warmup_steps=1,
    )
    return TrainConfig.from_flat(**{**settings, **kw})


def nan_item(models, work: Path, device: str, size: dict) -> dict:
    out = {}
    for cudnn in (True, False):
        cfg = base_cfg(*models, work / f"nan_cudnn_{cudnn}", device, dtype="bfloat16", steps=2, **size)
        out[f"cudnn_{'allowed' if cudnn else 'off'}"] = run_steps(cfg, cudnn)
    said = {k: ("finite" if v["finite"] else v["error"]) for k, v in out.items()}
    return {**out, "summary": "; ".join(f"{k}: {v}" for k, v in said.items())}


def replay_item(models, work: Path, device: str, objective: str, size: dict, steps: int) -> dict:
    kw = dict(objective=objective, steps=steps, lr=1e-5, tf32=False, teacher_dtype="bfloat16", **size)
    got = replay(
        base_cfg(*models, work / f"r32_{objective}", device, **kw),
        base_cfg(*models, work / f"r16_{objective}", device, dtype="bfloat16", **kw),
        steps=steps,
    )
    finite = all(math.isfinite(x) for pair in got.losses + got.grad_norms for x in pair)
    # the sampled-token loss's value reads the batch alone: nothing to bound (equal by construction)
    within = None if objective == "sampled" else got.within_bf16_bound()
    moved, gap = got.weight_gap()
    worst = max(abs(b - a) / max(abs(a), 1e-12) for a, b in got.losses)
    return {
        "losses": got.losses,
        "grad_norms": got.grad_norms,
        "finite": finite,
        "within_tolerance": within,
        "weights_moved": moved,
        "weights_gap": gap,
        "summary": f"finite {finite}, losses within tolerance {within}; worst loss gap {worst:.2%}, weights' "
        f"gap {gap / max(moved, 1e-30):.2%} of their displacement",
    }


def split_item(models, work: Path, device: str, size: dict) -> dict:
    cfg = base_cfg(*models, work / "split", device, dtype="bfloat16", steps=4, **size)
    got = run_steps(cfg, cudnn=False)
    later = got["steps"][1:] or got["steps"]  # the first step includes warm-up
    med = {
        k: statistics.median(s[k] for s in later) for k in ("time/generate", "time/score", "time/update", "time/step")
    }
    tokens = statistics.median(s["rollout/response_len"] for s in later) * cfg.batch_size
    got.update(median=med, rollout_tokens_per_s=tokens / med["time/generate"])
    got["summary"] = (
        f"finite {got['finite']}; step {med['time/step']:.2f} s (generate {med['time/generate']:.2f}, "
        f"score {med['time/score']:.2f}, update {med['time/update']:.2f}); "
        f"rollout {got['rollout_tokens_per_s']:.0f} tokens/s"
    )
    return got


def demo_item(work: Path, device: str, steps: int) -> dict:
    out = {}
    for name, dtype, cudnn in (
        ("float32", "float32", False),
        ("bfloat16", "bfloat16", False),
        ("bfloat16_cudnn", "bfloat16", True),
    ):
        cfg = base_cfg(
            DEMO / "student",
            DEMO / "teacher",
            work / f"demo_{name}",
            device,
            dtype=dtype,
            steps=steps,
            batch_size=16,
            objective="lsm",
        )
        got = run_steps(cfg, cudnn)
        times = [s["time/step"] for s in got["steps"]]
        out[name] = {"finite": got["finite"], "step_s": times, "median_s": statistics.median(times) if times else None}
    out["summary"] = ", ".join(f"{k} {v['median_s']:.3f} s" for k, v in out.items() if v["median_s"] is not None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes and batches: the CPU dry run")
    ap.add_argument("--budget", type=float, default=290.0, help="seconds for all items")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_real_shape.json")
    a = ap.parse_args()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    check = Check(a.out, a.budget)
    work = Path(tempfile.mkdtemp(prefix="opd_real_shape_"))
    models = make_models(work / "models", SMALL if a.small else REAL)
    big = dict(batch_size=4, max_new_tokens=16) if a.small else dict(batch_size=64, max_new_tokens=128)
    replayed = dict(batch_size=4, max_new_tokens=12) if a.small else dict(batch_size=8, max_new_tokens=48)
    check.item("env", env_item)
    check.item("sdpa", sdpa_item, a.device)
    check.item("nan_cause", nan_item, models, work, a.device, big, need=20)
    steps = 3 if a.small else 20
    check.item("replay_lsm", replay_item, models, work, a.device, "lsm", replayed, steps, need=40)
    check.item("step_split", split_item, models, work, a.device, big, need=25)
    for objective in ("sampled", "full_kl"):
        check.item(f"replay_{objective}", replay_item, models, work, a.device, objective, replayed, steps, need=40)
    check.item("demo_speed", demo_item, work, a.device, 2 if a.small else 16, need=20)


if __name__ == "__main__":
    main()

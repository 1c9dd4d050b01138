"""bfloat16 mixed precision at a real model's shape (what benchmarks/gpu_real_shape.py checked): the bodies of
a Qwen2.5-0.5B-shaped student (24 x 896, 14/2 heads: 0.36B parameters) and a Qwen2.5-1.5B-shaped teacher
(28 x 1536: 1.31B), random weights on the demo's 2,048-token tokenizer; the teacher's final norm scaled up so
its head is sharp and a falling KL means the student learns it.

* sdpa: torch alone, scaled_dot_product_attention in bfloat16 with a left-padded boolean mask (fully masked
  query rows), forward and backward, per backend: NaN counts of the gradients recorded (cuDNN's are the
  pytorch/pytorch#196678 NaNs opd avoids); the math backend's must be finite.
* nan_cause: opd's LSM at the real student in bfloat16, 2 steps, with cuDNN attention allowed (torch's
  default: recorded) and off (opd's: must be finite).
* replay: 20 steps of bfloat16 mixed precision and float32 (TF32 off) on the same replayed batches
  (opd.lab.replay): finite, and the losses within the derived tolerance (Replayed.within_bf16_bound).
* step_split, demo_speed: opd train's generate / score / update seconds at batch 64 and 128 new tokens, and
  the demo's median step in float32, bfloat16 and bfloat16 with cuDNN attention allowed: recorded, finite.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from opd.config import TrainConfig
from opd.errors import UserError
from opd.lab.replay import replay
from opd.training import loop
from opd.training.producer import make_producer
from opd.training.setup import setup

from .conftest import DEMO, DRY_RUN, NOT_IN_DRY_RUN

pytestmark = pytest.mark.gpu
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
BIG = dict(batch_size=4, max_new_tokens=16) if DRY_RUN else dict(batch_size=64, max_new_tokens=128)
REPLAYED = dict(batch_size=4, max_new_tokens=12) if DRY_RUN else dict(batch_size=8, max_new_tokens=48)
REPLAY_STEPS = 3 if DRY_RUN else 20


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    root = tmp_path_factory.mktemp("real_shape")
    tok = AutoTokenizer.from_pretrained(DEMO / "student")
    base = json.loads((DEMO / "student" / "config.json").read_text())
    for role, shape in (SMALL if DRY_RUN else REAL).items():
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
    return root / "student", root / "teacher"


def config(student, teacher, out: Path, device, **kw) -> TrainConfig:
    settings = dict(k=32, eval_every=0, eval_size=1, eval_samples=0, ckpt_every=0, log_rollouts=0, warmup_steps=1)
    return TrainConfig.from_flat(
        student=str(student), teacher=str(teacher), out=str(out), device=str(device), **settings, **kw
    )


def run_steps(cfg: TrainConfig, cudnn: bool) -> dict:
    """opd's loop on ``cfg`` (setup switches cuDNN attention off; ``cudnn`` turns it back on first)."""
    run = setup(cfg)
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    producer = make_producer(run)
    try:
        loop.train_steps(run, producer, show_progress=False)
    except UserError as exc:  # opd stops a run whose loss or gradient norm is not finite, saying so
        return {"finite": False, "error": str(exc).split(";")[0], "steps": []}
    finally:
        producer.close()
        torch.backends.cuda.enable_cudnn_sdp(False)
    recs = [json.loads(x) for x in (Path(cfg.run.out) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train/loss" in r]
    finite = all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in steps)
    return {"finite": finite and len(steps) == cfg.optimizer.steps, "steps": steps}


def test_sdpa_fully_masked_rows_bfloat16(device, record_property):
    from torch.nn.attention import SDPBackend, sdpa_kernel

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
                record_property(key, f"unavailable: {str(exc).splitlines()[0][:120]}")
                continue
            nonfinite = {name: int((~torch.isfinite(t.grad)).sum()) for name, t in zip("qkv", leaves, strict=True)}
            record_property(key, nonfinite)
            if backend == SDPBackend.MATH:
                assert not any(nonfinite.values()), f"{key}: {nonfinite}"


def test_bfloat16_real_student_finite_with_cudnn_attention_off(models, device, tmp_path, record_property):
    out = {}
    for cudnn in (True, False):
        cfg = config(*models, tmp_path / f"cudnn_{cudnn}", device, dtype="bfloat16", steps=2, **BIG)
        out[f"cudnn_{'allowed' if cudnn else 'off'}"] = run_steps(cfg, cudnn)
    for name, got in out.items():
        record_property(name, "finite" if got["finite"] else got.get("error", "not finite"))
    assert out["cudnn_off"]["finite"], out["cudnn_off"]


@pytest.mark.parametrize("objective", ["lsm", *(pytest.param(o, marks=NOT_IN_DRY_RUN) for o in ("sampled", "full_kl"))])
def test_replayed_bfloat16_within_bound(objective, models, device, tmp_path, record_property):
    kw = dict(objective=objective, steps=REPLAY_STEPS, lr=1e-5, tf32=False, teacher_dtype="bfloat16", **REPLAYED)
    got = replay(
        config(*models, tmp_path / "r32", device, **kw),
        config(*models, tmp_path / "r16", device, dtype="bfloat16", **kw),
        steps=REPLAY_STEPS,
    )
    moved, gap = got.weight_gap()
    record_property("losses", got.losses)
    record_property("grad_norms", got.grad_norms)
    record_property("worst_loss_gap", max(abs(b - a) / max(abs(a), 1e-12) for a, b in got.losses))
    record_property("weights_gap_of_displacement", gap / max(moved, 1e-30))
    assert all(math.isfinite(x) for pair in got.losses + got.grad_norms for x in pair), got.losses
    if objective != "sampled":  # the sampled-token loss's value reads the batch alone: equal by construction
        assert got.within_bf16_bound(), got.losses


def test_step_split_bfloat16(models, device, tmp_path, record_property):
    cfg = config(*models, tmp_path / "split", device, dtype="bfloat16", steps=4, **BIG)
    got = run_steps(cfg, cudnn=False)
    assert got["finite"], got
    later = got["steps"][1:]  # the first step includes warm-up
    for key in ("time/generate", "time/score", "time/update", "time/step"):
        record_property(key.split("/")[1] + "_s", statistics.median(s[key] for s in later))
    tokens = statistics.median(s["rollout/response_len"] for s in later) * cfg.optimizer.batch_size
    record_property("rollout_tokens_per_s", tokens / statistics.median(s["time/generate"] for s in later))


@pytest.mark.parametrize(
    "name,dtype,cudnn",
    [
        pytest.param("float32", "float32", False, marks=NOT_IN_DRY_RUN),
        pytest.param("bfloat16", "bfloat16", False, marks=NOT_IN_DRY_RUN),
        ("bfloat16_cudnn", "bfloat16", True),
    ],
)
def test_demo_speed(name, dtype, cudnn, device, tmp_path, record_property):
    """The demo's LSM: is a slow bfloat16 step cuDNN's per-shape plans? (the median step, side by side)"""
    steps = 2 if DRY_RUN else 16
    cfg = config(DEMO / "student", DEMO / "teacher", tmp_path / name, device, dtype=dtype, steps=steps,
                 batch_size=16, objective="lsm")  # fmt: skip
    got = run_steps(cfg, cudnn)
    times = [s["time/step"] for s in got["steps"]]
    record_property("step_s", times)
    record_property("median_s", statistics.median(times) if times else None)
    assert got["finite"], got

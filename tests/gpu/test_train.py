"""``opd train`` on the device with the packaged demo models: each objective and option the CLI offers (as
tests/training/test_loop_end_to_end.py runs them on the CPU), a resume against an uninterrupted run, and
torchrun launches with one rank (plain, and DDP and FSDP over nccl through tests/gpu/one_rank.py), each
compared with the uninterrupted run. Each run records its step times (median after step 0, which carries
CUDA's warm-up) and final loss. On a GPU, equal means within tests/helpers.py's tolerances, not bit for bit:
reductions such as ``index_add_`` use atomics there, so the order of float additions varies run to run.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest
from helpers import assert_close_weights, assert_same_trajectory, final_weights, read_metrics, run_launch, step_records

from .conftest import DEMO, DRY_RUN, NOT_IN_DRY_RUN

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent

# the objectives and options `opd train --help` offers, as tests/training/test_loop_end_to_end.py runs them
JOBS = {
    "lsm": ["--objective", "lsm"],
    "sampled": ["--objective", "sampled"],
    "full_kl": ["--objective", "full_kl"],
    "lsm_tail": ["--objective", "lsm", "--tail"],
    "lsm_bfloat16": ["--objective", "lsm", "--dtype", "bfloat16"],
    "lora_lsm": ["--objective", "lsm", "--lora-r", "8", "--lora-alpha", "16"],
    # rollouts one step ahead: the worker process generates on the same GPU from the weights each request carries
    "lsm_max_staleness_1": ["--objective", "lsm", "--max-staleness", "1"],
    "sampled_max_staleness_1": ["--objective", "sampled", "--max-staleness", "1"],
    "lsm_forward_kl_share": ["--objective", "lsm", "--forward-kl-share", "0.3"],
    "lsm_no_renormalize": ["--objective", "lsm", "--no-renormalize"],
    "lsm_student_topk": ["--objective", "lsm", "--support", "student_topk"],
    "lsm_union": ["--objective", "lsm", "--support", "union"],
    "lsm_intersection": ["--objective", "lsm", "--support", "intersection"],
    "lsm_symmetric_difference": ["--objective", "lsm", "--support", "symmetric_difference"],
    "lsm_teacher_topk_plus_sampled": ["--objective", "lsm", "--support", "teacher_topk_plus_sampled"],
    "sampled_gamma_ppo": ["--objective", "sampled", "--gamma", "0.9", "--updates-per-batch", "2", "--grad-accum", "2"],
    "full_kl_forward": ["--objective", "full_kl", "--kl-direction", "forward"],
    "full_kl_bfloat16": ["--objective", "full_kl", "--dtype", "bfloat16"],
    "lsm_teacher_bfloat16": ["--objective", "lsm", "--teacher-dtype", "bfloat16"],
    "lora_sampled": [
        "--objective",
        "sampled",
        "--lora-r",
        "8",
        "--lora-alpha",
        "16",
        "--lora-targets",
        "q_proj,v_proj",
    ],
}
LR = 3e-3  # tests/helpers.py's SMALL: assert_close_weights allows 0.1 of one step at this lr
RESUME_STEPS = 2 if DRY_RUN else 4  # the uninterrupted run; the resumed one stops at half and goes on


def settings(steps: int, ckpt_every: int = 0) -> dict:
    return dict(
        steps=steps,
        batch_size=4 if DRY_RUN else 8,
        max_new_tokens=16 if DRY_RUN else 32,
        eval_size=4 if DRY_RUN else 8,
        eval_samples=0,
        k=8,
        warmup_steps=1,
        log_rollouts=2,
        diag_positions=16,
        eval_every=0,
        ckpt_every=ckpt_every,
        seed=0,
        lr=LR,
    )


def opd_argv(out: Path, device, steps: int, ckpt_every: int = 0, extra=()) -> list[str]:
    argv = ["train", "--student", str(DEMO / "student"), "--teacher", str(DEMO / "teacher")]
    argv += ["--out", str(out), "--device", str(device)]
    for k, v in settings(steps, ckpt_every).items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return argv + list(extra)


def opd(argv: list[str]) -> None:
    """``opd ARGV`` in this process; a non-zero exit fails the test."""
    from opd.cli import app

    try:
        code = app(argv, prog_name="opd", standalone_mode=False)  # click returns an Exit's code here
    except SystemExit as e:
        code = e.code
    assert code in (0, None), f"opd exited {code}"


def check_run(run_dir: Path, steps: int, record) -> list[dict]:
    """Every step logged with a finite loss and gradient norm, the final model saved; the step times recorded."""
    recs = step_records(run_dir)
    assert [r["step"] for r in recs] == list(range(steps)), f"{len(recs)} steps logged, want {steps}"
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in recs), recs
    assert any((run_dir / "final").iterdir()), "no final model"
    later = recs[1:] or recs  # step 0 carries the warm-up (CUDA init, kernel selection, allocator)
    record("final_loss", recs[-1]["train/loss"])
    record("step0_s", recs[0].get("time/step"))
    for key in ("step", "generate", "score", "update"):
        record(f"{key}_s", statistics.median(r[f"time/{key}"] for r in later if f"time/{key}" in r))
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    if evals:
        record("eval_accuracy", evals[-1]["eval/accuracy"])
    return recs


def assert_same_run(got: Path, want: Path) -> None:
    assert_same_trajectory(step_records(got), step_records(want))
    assert_close_weights(final_weights(got), final_weights(want))


@pytest.mark.parametrize("key", [k if k == "lora_lsm" else pytest.param(k, marks=NOT_IN_DRY_RUN) for k in JOBS])
def test_train(key, device, tmp_path, record_property):
    steps = 2 if DRY_RUN else 3
    opd(opd_argv(tmp_path / key, device, steps, extra=JOBS[key]))
    check_run(tmp_path / key, steps, record_property)


@pytest.fixture(scope="module")
def uninterrupted(device, tmp_path_factory) -> Path:
    """An LSM run of RESUME_STEPS steps, checkpointed at half: what the resume and the launches must equal."""
    out = tmp_path_factory.mktemp("train") / "uninterrupted"
    opd(opd_argv(out, device, RESUME_STEPS, RESUME_STEPS // 2))
    return out


def test_resume_equals_uninterrupted(uninterrupted, device, tmp_path, record_property):
    out, n = tmp_path / "resumed", RESUME_STEPS
    opd(opd_argv(out, device, n // 2, n // 2))
    opd(opd_argv(out, device, n, n // 2, ["--resume"]))
    check_run(out, n, record_property)
    assert_same_run(out, uninterrupted)


@pytest.mark.parametrize(
    "mode", [pytest.param("plain", marks=NOT_IN_DRY_RUN), "ddp", pytest.param("fsdp", marks=NOT_IN_DRY_RUN)]
)
def test_torchrun_one_rank(mode, uninterrupted, device, tmp_path, record_property):
    """A one-rank torchrun launch equals the single-process run; FSDP stops at half and resumes."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    entry = ["-m", "opd"] if mode == "plain" else [str(HERE / "one_rank.py"), mode]
    out, n = tmp_path / mode, RESUME_STEPS
    runs = [opd_argv(out, device, n, n // 2)]
    if mode == "fsdp":
        runs = [opd_argv(out, device, n // 2, n // 2), opd_argv(out, device, n, n // 2, ["--resume"])]
    for argv in runs:
        err = run_launch(torchrun + entry + argv)
        record_property("worker_says", [ln for ln in err.splitlines() if ln.startswith("one_rank:")])
    check_run(out, n, record_property)
    assert_same_run(out, uninterrupted)

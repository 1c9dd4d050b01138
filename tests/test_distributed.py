"""Multi-process training: real torchrun / accelerate launches of ``opd train`` with 2 CPU ranks (gloo).

The claim under test: 2 ranks of per-rank batch 2 follow the trajectory of 1 process of batch 4 on
the same prompts and seeds (each prompt's rollout is seeded by its global slot), for DDP and FSDP,
and a 2-rank run that loses a rank mid-run (SIGKILL) resumes in a new launch exactly where it left off.
Tolerance: the loss and gradient norm agree to relative 1e-4 (observed: about 1e-6, the float32
rounding of different padding and reduction order). The other logged values agree to relative
1e-4 or absolute 1e-5, whichever is looser: some are means of log-prob differences that nearly
cancel (a depth bucket's reward of 0.0017 differed by 2e-6), where rounding of log-probs of
order 1 shows up at 1e-6 absolute. Timings and the full-vocabulary diagnostics are not compared
(those use a sample of positions that depends on how the batch is laid out).

LSM is compared over 8 steps (its differences stayed near 1e-6 throughout), the sampled-token
objective over 3: measured at lr 3e-3, its rounding differences grow about tenfold a step (1e-6
at step 0, 4e-5 at step 3) until, at step 4, one sampled token comes out differently and the two
runs part ways -- float32 chaos in the policy gradient under Adam, not a difference in the method.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from opd import train as train_mod
from opd.config import TrainConfig
from opd.distributed import merge_metrics
from opd.stepstats import FULL_VOCAB_KEYS

SMALL = dict(steps=8, max_new_tokens=8, eval_size=4, eval_samples=0, k=8, warmup_steps=1, log_rollouts=2,
             diag_positions=16, eval_every=0, ckpt_every=1, lr=3e-3)
REL = 1e-4
SAMPLED_STEPS = {"lsm": {}, "sampled": {"steps": 3}}  # see the module docstring


def cli_args(models, out, **kw) -> list[str]:
    student, teacher = models
    args = ["train", "--student", str(student), "--teacher", str(teacher), "--out", str(out)]
    for key, value in {**SMALL, **kw}.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(launcher: str, args: list[str]) -> list[str]:
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:  # accelerate: --multi_gpu is what starts 2 ranks on a machine without a GPU (--cpu starts one)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port())]
    return cmd + ["-m", "opd"] + args


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "_TYPER_STANDARD_TRACEBACK": "1"}


def launch(launcher: str, args: list[str], timeout: int = 300) -> None:
    proc = subprocess.run(launch_command(launcher, args), capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]


def train_records(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


def assert_same_trajectory(got: list[dict], want: list[dict], rel: float = REL, abs_other: float = 1e-5) -> None:
    assert want, "no training steps were logged"
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in w:
            if key.startswith("time/") or key in FULL_VOCAB_KEYS:
                continue
            tol = 1e-9 if key in ("train/loss", "train/grad_norm") else abs_other
            assert g[key] == pytest.approx(w[key], rel=rel, abs=tol), (w["step"], key)


def final_weights(run_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_close_weights(a: dict, b: dict) -> None:
    """Equal up to Adam's amplification of rounding noise: where a gradient is zero in one run and a
    rounding residue (~1e-10) in the other, Adam's g / (|g| + eps) turns it into a few percent of
    one step (observed: 2.5% of lr after 3 steps). Saving the wrong weights (the initial ones, or a
    shard) would be off by whole steps (each up to lr), so 10% of one step still tells them apart."""
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert worst < 0.1 * SMALL["lr"], worst


@pytest.fixture(scope="module")
def single(tiny_models, tmp_path_factory):
    """One process, batch 4: the reference trajectories (lsm and sampled)."""
    root = tmp_path_factory.mktemp("single")
    for objective in ("lsm", "sampled"):
        cfg = TrainConfig(student=str(tiny_models[0]), teacher=str(tiny_models[1]), out=str(root / objective),
                          batch_size=4, objective=objective, **{**SMALL, **SAMPLED_STEPS[objective]})
        train_mod.train(cfg, show_progress=False)
    return root


@pytest.fixture(scope="module")
def ddp_lsm(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "lsm"
    # Micro-batches of one rollout: gradients accumulate locally (no_sync) and are reduced once.
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, grad_accum=2, objective="lsm"))
    return out


def test_ddp_two_ranks_match_one_process_lsm(single, ddp_lsm):
    want = train_records(single / "lsm")
    got = train_records(ddp_lsm)
    assert len(got) == SMALL["steps"] and all(r["train/loss_tokens"] > 0 for r in got)
    assert_same_trajectory(got, want)
    # The merged rollout metrics are those of the whole batch, not of rank 0's half.
    assert [r["rollout/response_len"] for r in got] == pytest.approx([r["rollout/response_len"] for r in want])
    assert_close_weights(final_weights(ddp_lsm), final_weights(single / "lsm"))


def test_accelerate_two_ranks_match_one_process_sampled(single, tiny_models, tmp_path):
    launch("accelerate", cli_args(tiny_models, tmp_path / "run", batch_size=2, objective="sampled",
                                  **SAMPLED_STEPS["sampled"]))
    assert_same_trajectory(train_records(tmp_path / "run"), train_records(single / "sampled"))


def kill_a_rank_after_first_checkpoint(args: list[str], out) -> None:
    """Start a 2-rank run and SIGKILL rank 1's process once the first checkpoint exists; torchrun
    then tears the group down, as after a crash or a lost machine."""
    import psutil

    proc = subprocess.Popen(launch_command("torchrun", args), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "latest").exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert workers, "the run ended before a rank could be killed"
        os.kill(workers[0].pid, signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:  # a failed assertion must not leave the launcher and its ranks running
        for p in psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []:
            p.kill()
        proc.kill()
        proc.wait()
    assert not (out / "final").exists()


def test_ddp_killed_run_resumes_like_uninterrupted(tiny_models, ddp_lsm, tmp_path):
    out = tmp_path / "run"
    kill_a_rank_after_first_checkpoint(cli_args(tiny_models, out, batch_size=2, grad_accum=2), out)
    done = [r["step"] for r in train_records(out)]
    assert done and len(done) < SMALL["steps"], done
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, grad_accum=2, resume=True))
    assert_same_trajectory(train_records(out), train_records(ddp_lsm), rel=1e-6, abs_other=1e-9)
    a, b = final_weights(out), final_weights(ddp_lsm)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in b)


def test_fsdp_matches_one_process_and_resumes(single, tiny_models, tmp_path):
    out = tmp_path / "run"
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, steps=2, fsdp=True))
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, fsdp=True, resume=True))
    assert_same_trajectory(train_records(out), train_records(single / "lsm"))
    assert_close_weights(final_weights(out), final_weights(single / "lsm"))
    from opd.errors import UserError

    with pytest.raises(UserError, match="written with --fsdp; resume with --fsdp"):
        train_mod.setup(TrainConfig(student=str(tiny_models[0]), teacher=str(tiny_models[1]), out=str(out),
                                    batch_size=4, resume=True, **SMALL))


def test_fsdp_needs_several_processes(tiny_models, tmp_path):
    from opd.errors import UserError

    cfg = TrainConfig(student=str(tiny_models[0]), teacher=str(tiny_models[1]), out=str(tmp_path / "run"),
                      fsdp=True, **SMALL)
    with pytest.raises(UserError, match="--fsdp needs several processes"):
        train_mod.setup(cfg)


def test_merge_metrics_rules():
    """Weighted means equal the mean over the concatenated batch; sums, maxima and global values."""
    a = {"rollout/len": 2.0, "diag/r": 1.0, "depth/x": [1.0, 0.0], "train/loss_tokens": 3, "time/step": 1.0,
         "train/loss": 0.5}
    b = {"rollout/len": 5.0, "diag/r": 4.0, "depth/x": [3.0, 2.0], "train/loss_tokens": 4, "time/step": 2.5,
         "train/loss": 0.7}  # global already: rank 0's value is kept
    wa = {"rollout/": 1, "diag/": 3, "depth/x": [2, 0], "train/loss_tokens": "sum", "time/": "max"}
    wb = {"rollout/": 3, "diag/": 1, "depth/x": [2, 4], "train/loss_tokens": "sum", "time/": "max"}
    got = merge_metrics([a, b], [wa, wb])
    assert got["rollout/len"] == pytest.approx((2 * 1 + 5 * 3) / 4)
    assert got["diag/r"] == pytest.approx((1 * 3 + 4 * 1) / 4)
    assert got["depth/x"] == pytest.approx([2.0, 2.0])  # an empty bucket on one rank does not dilute the other
    assert got["train/loss_tokens"] == 7 and got["time/step"] == 2.5 and got["train/loss"] == 0.5
    assert list(got) == list(a)

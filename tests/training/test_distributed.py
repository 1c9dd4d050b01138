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
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    ENV,
    SMALL,
    assert_close_weights,
    assert_same_trajectory,
    cli_args,
    final_weights,
    kill_a_rank_after_first_checkpoint,
    launch,
    launch_command,
    read_metrics,
    step_records,
)

from opd.config import TrainConfig
from opd.training import loop as train_mod
from opd.training.distributed import OUTLIVED, merge_metrics

SAMPLED_STEPS = {"lsm": {}, "sampled": {"steps": 3}}  # see the module docstring


# The tests of the reference runs (single, ddp_lsm) run on one xdist worker, so each is made once.
ON_REFERENCE_RUNS = pytest.mark.xdist_group("distributed-reference")


@pytest.fixture(scope="module")
def single(tiny_models, tmp_path_factory):
    """One process, batch 4: the reference trajectories (lsm and sampled)."""
    root = tmp_path_factory.mktemp("single")
    for objective in ("lsm", "sampled"):
        cfg = TrainConfig.from_flat(
            student=str(tiny_models[0]),
            teacher=str(tiny_models[1]),
            out=str(root / objective),
            batch_size=4,
            objective=objective,
            **{**SMALL, **SAMPLED_STEPS[objective]},
        )
        train_mod.train(cfg, show_progress=False)
    return root


@pytest.fixture(scope="module")
def ddp_lsm(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "lsm"
    # Micro-batches of one rollout: gradients accumulate locally (no_sync) and are reduced once.
    err = launch("torchrun", cli_args(tiny_models, out, batch_size=2, grad_accum=2, objective="lsm"))
    assert OUTLIVED not in err  # the wrapper (DDP's reducer) is freed before the process group
    return out


@ON_REFERENCE_RUNS
def test_ddp_two_ranks_match_one_process_lsm(single, ddp_lsm):
    want = step_records(single / "lsm")
    got = step_records(ddp_lsm)
    assert len(got) == SMALL["steps"] and all(r["train/loss_tokens"] > 0 for r in got)
    assert_same_trajectory(got, want)
    # The merged rollout metrics are those of the whole batch, not of rank 0's half.
    assert [r["rollout/response_len"] for r in got] == pytest.approx([r["rollout/response_len"] for r in want])
    assert_close_weights(final_weights(ddp_lsm), final_weights(single / "lsm"))
    # the last step's evaluation, each rank a share of the held-out prompts: all of them counted
    evals = [[r for r in read_metrics(run) if "eval/n" in r] for run in (ddp_lsm, single / "lsm")]
    assert evals[0] == evals[1] and evals[0][0]["eval/n"] == SMALL["eval_size"], evals


@ON_REFERENCE_RUNS
def test_accelerate_two_ranks_match_one_process_sampled(single, tiny_models, tmp_path):
    launch(
        "accelerate",
        cli_args(tiny_models, tmp_path / "run", batch_size=2, objective="sampled", **SAMPLED_STEPS["sampled"]),
    )
    assert_same_trajectory(step_records(tmp_path / "run"), step_records(single / "sampled"))


@ON_REFERENCE_RUNS
def test_ddp_killed_run_resumes_like_uninterrupted(tiny_models, ddp_lsm, tmp_path):
    out = tmp_path / "run"
    kill_a_rank_after_first_checkpoint(cli_args(tiny_models, out, batch_size=2, grad_accum=2), out)
    done = [r["step"] for r in step_records(out)]
    assert done and len(done) < SMALL["steps"], done
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, grad_accum=2, resume=True))
    assert_same_trajectory(step_records(out), step_records(ddp_lsm), rel=1e-6, abs_other=1e-9)
    a, b = final_weights(out), final_weights(ddp_lsm)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-7) for k in b)


@ON_REFERENCE_RUNS
def test_fsdp_matches_one_process_and_resumes(single, tiny_models, tmp_path):
    out = tmp_path / "run"
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, steps=2, fsdp=True))
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, fsdp=True, resume=True))
    assert_same_trajectory(step_records(out), step_records(single / "lsm"))
    assert_close_weights(final_weights(out), final_weights(single / "lsm"))
    # resuming it in one process, without --fsdp: tests/training/test_resume_ranks.py


def test_fsdp_trains_in_mixed_precision(tiny_models, tmp_path):
    """--fsdp --dtype bfloat16: FSDP's policy gathers the blocks in bfloat16 and reduces in float32 onto
    float32 shards; checkpoints hold the float32 masters, final/ is bfloat16."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    launch("torchrun", cli_args(tiny_models, out, batch_size=2, steps=2, fsdp=True, dtype="bfloat16"))
    steps = step_records(out)
    assert [r["step"] for r in steps] == [0, 1]
    assert all(torch.isfinite(torch.tensor([r["train/loss"], r["train/grad_norm"]])).all() for r in steps)
    masters = load_file(str(out / "checkpoints" / "step_0000001" / "model" / "model.safetensors"))
    assert {t.dtype for t in masters.values()} == {torch.float32}
    assert {t.dtype for t in load_file(str(out / "final" / "model.safetensors")).values()} == {torch.bfloat16}


def test_fsdp_needs_several_processes(tiny_models, tmp_path):
    from opd.errors import UserError

    cfg = TrainConfig.from_flat(
        student=str(tiny_models[0]), teacher=str(tiny_models[1]), out=str(tmp_path / "run"), fsdp=True, **SMALL
    )
    with pytest.raises(UserError, match="--fsdp needs several processes"):
        train_mod.setup(cfg)


def test_evaluation_shared_by_two_ranks_equals_one_process(tmp_path):
    """Held-out prompts (greedy accuracy, avg@2, pass@2) and games (success, turns, avg@2) evaluated by
    2 gloo ranks, each its share, give every rank the figures of one process evaluating them all."""
    script = str(Path(__file__).with_name("shared_eval.py"))
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    for out, cmd in ((alone, [sys.executable]), (shared, launch_command("torchrun", [])[:-2])):
        out.mkdir()
        subprocess.run([*cmd, script, str(out)], env=ENV, check=True, capture_output=True, timeout=300)
    want = json.loads((alone / "figures0.json").read_text())
    assert 0 < want["prompts"]["accuracy"] < 1 and 0 < want["games"]["success_rate"] < 1, want  # not all alike
    assert want["prompts"]["avg_at_k"] != want["prompts"]["accuracy"] and "mean_turns_to_success" in want["games"]
    for rank in (0, 1):
        assert json.loads((shared / f"figures{rank}.json").read_text()) == want, rank


# Rank 0 waits at a barrier that rank 1 never reaches (it sleeps, then leaves).
LATE_RANK = """
import sys, time
from opd.training.distributed import init_distributed
dist = init_distributed(timeout=float(sys.argv[1]))
if dist.rank == 1:
    time.sleep(8)
    sys.exit(0)
t0 = time.monotonic()
try:
    dist.barrier()
    print("passed")
except RuntimeError as exc:
    print(f"failed after {time.monotonic() - t0:.1f} s: {exc}")
"""


def test_dist_timeout_bounds_a_wait_for_a_missing_rank():
    """--dist-timeout is the process group's: a rank waiting for one that never comes fails after it."""
    from helpers import free_port

    from opd.config import ConfigError, TrainConfig

    assert TrainConfig.from_flat().run.dist_timeout == 1800.0
    with pytest.raises(ConfigError, match="dist_timeout=0.0 must be > 0"):
        TrainConfig.from_flat(dist_timeout=0.0)
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", LATE_RANK, "2"], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=120)[0] for p in ranks]
    seconds = float(out[0].split("failed after ")[1].split(" s")[0])
    assert "Timed out" in out[0] and 1.5 < seconds < 6, out[0]


def test_merge_metrics_rules():
    """Weighted means equal the mean over the concatenated batch; sums, maxima and global values."""
    a = {
        "rollout/len": 2.0,
        "diag/r": 1.0,
        "depth/x": [1.0, 0.0],
        "train/loss_tokens": 3,
        "time/step": 1.0,
        "train/loss": 0.5,
    }
    b = {
        "rollout/len": 5.0,
        "diag/r": 4.0,
        "depth/x": [3.0, 2.0],
        "train/loss_tokens": 4,
        "time/step": 2.5,
        "train/loss": 0.7,
    }  # global already: rank 0's value is kept
    wa = {"rollout/": 1, "diag/": 3, "depth/x": [2, 0], "train/loss_tokens": "sum", "time/": "max"}
    wb = {"rollout/": 3, "diag/": 1, "depth/x": [2, 4], "train/loss_tokens": "sum", "time/": "max"}
    got = merge_metrics([a, b], [wa, wb])
    assert got["rollout/len"] == pytest.approx((2 * 1 + 5 * 3) / 4)
    assert got["diag/r"] == pytest.approx((1 * 3 + 4 * 1) / 4)
    assert got["depth/x"] == pytest.approx([2.0, 2.0])  # an empty bucket on one rank does not dilute the other
    assert got["train/loss_tokens"] == 7 and got["time/step"] == 2.5 and got["train/loss"] == 0.5
    assert list(got) == list(a)

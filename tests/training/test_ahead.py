"""Rollouts generated ahead of the trainer (``--max-staleness S``, opd.training.ahead).

The claims: step t's rollouts are those of the policy of step t - S (checked against opd's own
sampling loop run here on that step's weights); a run is a function of its seeds at any S (resume
equals uninterrupted, 2 ranks equal one process, and 2 ranks resumed equal 2 uninterrupted: each rank takes
back its own rollouts in flight); a worker killed while running ahead is replaced
and its step's rollouts made again, nothing lost and the restart counted; bad settings are refused.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from helpers import (
    assert_same_trajectory,
    cfg_for,
    cli_args,
    kill_a_rank_after_first_checkpoint,
    launch,
    read_metrics,
    rollout_texts,
    step_records,
    train_killed_at,
)

from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.engine import RolloutBatch
from opd.rollout.sampling import HFRollout
from opd.training import loop as train_mod
from opd.training import producer
from opd.training.ahead import AheadRollouts, rank_share, saved_in_flight
from opd.training.distributed import Dist
from opd.training.resuming import check_same_run


def same_steps(got: list[dict], want: list[dict], skip=("time/", "rollout/worker_restarts")) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for key in w:
            if not key.startswith(skip):
                assert g[key] == pytest.approx(w[key], rel=1e-6, abs=1e-9), (w["step"], key)


def test_step_t_rolls_out_the_policy_of_step_t_minus_s(tiny_models, tmp_path, monkeypatch):
    """Every rollout an S = 1 run trained on, against opd's sampling loop run here on the weights the
    student had as step t - 1 began (the initial student for steps 0 and 1)."""
    S, steps = 1, 4
    cfg = cfg_for(tiny_models, tmp_path, steps=steps, max_staleness=S, eval_samples=0, lr=2e-2)
    starts, used = {}, {}
    real_ahead, real_take = producer.Ahead._rollouts, AheadRollouts.take

    def ahead(self, step):
        starts[step] = {k: v.detach().clone() for k, v in self.run.student.state_dict().items()}
        return real_ahead(self, step)

    def take(self, step):
        parts, policy, seconds = real_take(self, step)
        used[step] = parts[0][0]
        return parts, policy, seconds

    monkeypatch.setattr(producer.Ahead, "_rollouts", ahead)
    monkeypatch.setattr(AheadRollouts, "take", take)
    train_mod.train(cfg, show_progress=False)
    assert [r["rollout/staleness"] for r in step_records(tmp_path / "run")] == [0.0, 1.0, 1.0, 1.0]

    tok = load_tokenizer(cfg.model.student, "student")
    run = train_mod.setup(cfg.replace(out=str(tmp_path / "probe"), max_staleness=0))
    model = load_model(cfg.model.student, "student", "float32", "cpu")

    def rollout(weights, step):
        model.load_state_dict(weights)
        rows, seeds = producer.rollout_request(run, step, producer.step_tasks(run, step)[0])
        ids = [run.tasks[0].source.prompts.prompt_ids[i] for i in rows]
        b = HFRollout(model, tok.eos_token_id, tok.pad_token_id).generate(
            ids,
            seeds,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
        )
        return (b.response_ids_NT * b.response_mask_NT).tolist()

    changed = 0
    for step in range(steps):
        got = (used[step].response_ids_NT * used[step].response_mask_NT).tolist()
        assert got == rollout(starts[max(0, step - S)], step), step
        changed += step >= S and got != rollout(starts[step], step)
    assert changed, "no update changed a rollout: the check cannot tell the policies apart"


@pytest.mark.slow
@pytest.mark.parametrize("objective,S", [("lsm", 1), ("sampled", 2)])
def test_a_stale_run_killed_and_resumed_equals_the_uninterrupted_run(tiny_models, tmp_path, monkeypatch, objective, S):
    """The checkpoint holds the rollouts in flight, so the resumed run takes the ones the uninterrupted
    run took (with S = 2, one of them already taken by the step the kill cut short)."""
    kw = dict(steps=5, ckpt_every=2, eval_samples=0, objective=objective, max_staleness=S)
    train_mod.train(cfg_for(tiny_models, tmp_path / "a", **kw), show_progress=False)
    killed = cfg_for(tiny_models, tmp_path / "b", **kw)
    train_killed_at(killed, 3, monkeypatch)
    train_mod.train(killed.replace(resume=True), show_progress=False)
    want = step_records(tmp_path / "a" / "run")
    assert [r["rollout/staleness"] for r in want] == [float(min(t, S)) for t in range(5)]
    same_steps(step_records(tmp_path / "b" / "run"), want)


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_rollouts_made_again(tiny_models, tmp_path, monkeypatch):
    kw = dict(steps=4, eval_samples=0, max_staleness=1)
    train_mod.train(cfg_for(tiny_models, tmp_path / "a", **kw), show_progress=False)
    real_take = AheadRollouts.take

    def kill_then_take(self, step):
        if step == 2:  # step 3's rollouts were asked for a moment ago (step 2's may be made): the worker dies
            for pid in self.worker_pids():
                os.kill(pid, signal.SIGKILL)
        return real_take(self, step)

    monkeypatch.setattr(AheadRollouts, "take", kill_then_take)
    train_mod.train(cfg_for(tiny_models, tmp_path / "b", **kw), show_progress=False)
    got = step_records(tmp_path / "b" / "run")
    restarts = [r["rollout/worker_restarts"] for r in got]
    # found dead at step 2 where it was still making step 2's rollouts, else at step 3; one restart either way
    assert restarts[:2] == [0.0, 0.0] and restarts[2] in (0.0, 1.0) and restarts[3] == 1.0
    same_steps(got, step_records(tmp_path / "a" / "run"))
    assert (
        read_metrics(tmp_path / "b" / "run")[-1]["eval/accuracy"]
        == read_metrics(tmp_path / "a" / "run")[-1]["eval/accuracy"]
    )


def test_two_ranks_running_ahead_match_one_process(tiny_models, tmp_path):
    """Each rank's worker makes its shard of the batch; together they are one process's batch."""
    kw = dict(steps=4, max_staleness=1, ckpt_every=0)
    launch("torchrun", cli_args(tiny_models, tmp_path / "ddp", batch_size=2, **kw))
    student, teacher = tiny_models
    from helpers import SMALL

    one = TrainConfig.from_flat(
        student=str(student), teacher=str(teacher), out=str(tmp_path / "one"), **{**SMALL, **kw}
    )
    train_mod.train(one.replace(batch_size=4), show_progress=False)
    assert_same_trajectory(step_records(tmp_path / "ddp"), step_records(tmp_path / "one"))


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"max_staleness": -1}, "max_staleness=-1 must lie in"),
        ({"max_staleness": 5}, "max_staleness=5 must lie in"),
        ({"max_staleness": 1, "fsdp": True}, "does not run with --fsdp"),
        ({"stale_weight_cap": 0.5}, "stale_weight_cap=0.5 must be >= 1"),
    ],
)
def test_bad_staleness_settings_are_refused(tiny_models, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for(tiny_models, tmp_path, **kw)


def test_resuming_with_another_staleness_is_refused(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, steps=2, ckpt_every=1, eval_samples=0, max_staleness=1)
    train_mod.train(cfg.replace(steps=1), show_progress=False)
    with pytest.raises(UserError, match="written with --max-staleness 1.*resume with --max-staleness 1"):
        train_mod.train(cfg.replace(resume=True, max_staleness=0), show_progress=False)


@pytest.mark.slow  # three 2-rank torchrun launches: 205 s on the shared 2-core machine
def test_two_ranks_running_ahead_killed_and_resumed_equal_the_uninterrupted_run(tiny_models, tmp_path):
    """Each rank's rollouts in flight are its own share of the batch: the checkpoint holds every rank's,
    and each rank takes its own back on --resume (not rank 0's)."""
    kw = dict(batch_size=2, steps=4, max_staleness=1, ckpt_every=1)
    launch("torchrun", cli_args(tiny_models, tmp_path / "a", **kw))
    out = tmp_path / "b"
    kill_a_rank_after_first_checkpoint(cli_args(tiny_models, out, **kw), out)
    done = [r["step"] for r in step_records(out)]
    assert done and len(done) < kw["steps"], done
    launch("torchrun", cli_args(tiny_models, out, resume=True, **kw))
    same_steps(step_records(out), step_records(tmp_path / "a"))
    assert rollout_texts(out) == rollout_texts(tmp_path / "a")


def in_flight_of(rank: int) -> dict:
    """A rank's rollouts in flight as AheadRollouts.in_flight gives them: step 3's, made by the policy of
    step 2, its tokens and rows the rank's own."""
    ids_NT = torch.full((2, 3), rank)
    batch = RolloutBatch(
        ids_NT, torch.ones_like(ids_NT), 1, ids_NT, torch.ones_like(ids_NT), -ids_NT.float(), ids_NT[:, 0]
    )
    return {3: (2, ([(batch, [2 * rank, 2 * rank + 1], [{"rank": rank}])], {"time/worker_generate": 0.5}))}


def test_a_checkpoint_gives_each_rank_back_its_own_rollouts_in_flight(tmp_path, monkeypatch):
    """The mapping a checkpoint's "ahead" goes through: each rank's gathered to rank 0 in rank order (the
    collective stood in for by rank 1's share; the real one runs in the slow 2-rank test), written,
    read back on the CPU, and each rank's taken by its index; one process's saved as before, a dict."""

    def tokens(share: dict) -> list:
        batch = share[3][1][0][0][0]
        return [batch.response_ids_NT.tolist(), batch.logprobs_NT.tolist(), share[3][1][0][0][1]]

    def written_and_read(state):
        torch.save({"ahead": state}, tmp_path / "state.pt")
        return torch.load(tmp_path / "state.pt", weights_only=False, map_location="cpu")["ahead"]

    monkeypatch.setattr(Dist, "gather_to_main", lambda d, obj: [obj, in_flight_of(1)] if d.is_main else None)
    assert saved_in_flight(Dist(rank=1, world=2), in_flight_of(1)) is None  # rank 1 writes nothing
    saved = written_and_read(saved_in_flight(Dist(rank=0, world=2), in_flight_of(0)))
    for rank in (0, 1):
        got = rank_share(saved, rank)
        assert tokens(got) == tokens(in_flight_of(rank)) and got[3][1][0][0][2] == [{"rank": rank}], rank
        assert got[3][0] == 2 and got[3][1][1] == {"time/worker_generate": 0.5}
    monkeypatch.undo()
    alone = written_and_read(saved_in_flight(Dist(), in_flight_of(0)))
    assert isinstance(alone, dict) and tokens(rank_share(alone, 0)) == tokens(in_flight_of(0))


def test_a_multi_rank_checkpoint_holding_rank_0s_rollouts_alone_is_refused(tiny_models, tmp_path):
    """An opd before each rank's were kept saved rank 0's share as the whole: resuming would train every
    rank on it. Nothing in flight (the last step's checkpoint) loses nothing, and one process's is whole."""
    cfg = cfg_for(tiny_models, tmp_path, max_staleness=1)
    old = {"rng": [{}, {}], "max_staleness": 1, "ahead": in_flight_of(0)}
    with pytest.raises(UserError, match=r"holds only rank 0's rollouts in flight.*--student .*ckpt/model with"):
        check_same_run(old, cfg, tmp_path / "ckpt", 2)
    check_same_run({**old, "ahead": {}}, cfg, tmp_path / "ckpt", 2)
    check_same_run({**old, "ahead": [in_flight_of(0), in_flight_of(1)]}, cfg, tmp_path / "ckpt", 2)
    check_same_run({**old, "rng": {}}, cfg, tmp_path / "ckpt", 1)


def _start_watcher_and_wait(pids) -> None:
    """A stand-in trainer: starts a process that runs the worker's trainer watch, says its pid, waits."""
    import multiprocessing
    import time

    from opd.training.ahead import _exit_with_trainer

    watcher = multiprocessing.get_context("spawn").Process(target=_exit_with_trainer)
    watcher.start()
    pids.put(watcher.pid)
    time.sleep(600)


def test_the_rollout_worker_leaves_when_its_trainer_is_killed_outright():
    """kill -9 of a trainer never shuts its executor down: the worker must not wait for work forever."""
    import multiprocessing
    import time

    ctx = multiprocessing.get_context("spawn")
    pids = ctx.Queue()
    trainer = ctx.Process(target=_start_watcher_and_wait, args=(pids,))
    trainer.start()
    watcher = pids.get(timeout=60)
    time.sleep(0.5)
    assert _running(watcher), "the watch ended while its trainer lived"
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.join()
    deadline = time.monotonic() + 30
    while _running(watcher) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(watcher), "the worker outlived its killed trainer"


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by init, not by us)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False

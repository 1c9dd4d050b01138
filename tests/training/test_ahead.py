"""Rollouts generated ahead of the trainer (``--max-staleness S``, opd.training.ahead).

The claims: step t's rollouts are those of the policy of step t - S (checked against opd's own
sampling loop run here on that step's weights); a run is a function of its seeds at any S (resume
equals uninterrupted, 2 ranks equal one process); a worker killed while running ahead is replaced
and its step's rollouts made again, nothing lost and the restart counted; bad settings are refused.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest
from helpers import (
    assert_same_trajectory,
    cfg_for,
    cli_args,
    launch,
    read_metrics,
    step_records,
    train_killed_at,
)

from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.models.loading import load_model, load_tokenizer
from opd.rollout.sampling import HFRollout
from opd.training import loop as train_mod
from opd.training.ahead import AheadRollouts


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
    real_ahead, real_take = train_mod.rollouts_ahead, AheadRollouts.take

    def ahead(run, step):
        starts[step] = {k: v.detach().clone() for k, v in run.student.state_dict().items()}
        return real_ahead(run, step)

    def take(self, step):
        parts, policy, seconds = real_take(self, step)
        used[step] = parts[0][0]
        return parts, policy, seconds

    monkeypatch.setattr(train_mod, "rollouts_ahead", ahead)
    monkeypatch.setattr(AheadRollouts, "take", take)
    train_mod.train(cfg, show_progress=False)
    assert [r["rollout/staleness"] for r in step_records(tmp_path / "run")] == [0.0, 1.0, 1.0, 1.0]

    tok = load_tokenizer(cfg.student, "student")
    run = train_mod.setup(dataclasses.replace(cfg, out=str(tmp_path / "probe"), max_staleness=0))
    model = load_model(cfg.student, "student", "float32", "cpu")

    def rollout(weights, step):
        model.load_state_dict(weights)
        rows, seeds = train_mod.rollout_request(run, step, train_mod.step_tasks(run, step)[0])
        ids = [run.tasks[0].source.prompts.prompt_ids[i] for i in rows]
        b = HFRollout(model, tok.eos_token_id, tok.pad_token_id).generate(
            ids, seeds, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p
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
    train_mod.train(dataclasses.replace(killed, resume=True), show_progress=False)
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

    one = TrainConfig(student=str(student), teacher=str(teacher), out=str(tmp_path / "one"), **{**SMALL, **kw})
    train_mod.train(dataclasses.replace(one, batch_size=4), show_progress=False)
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
    train_mod.train(dataclasses.replace(cfg, steps=1), show_progress=False)
    with pytest.raises(UserError, match="written with --max-staleness 1.*resume with --max-staleness 1"):
        train_mod.train(dataclasses.replace(cfg, resume=True, max_staleness=0), show_progress=False)

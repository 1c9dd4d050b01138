"""Resuming on another number of processes (:mod:`opd.training.resuming`).

The claim under test: a run begun in one process, resumed by 2 DDP ranks (gloo), then in one process,
then by 2 FSDP ranks, then in one process again, follows the uninterrupted one-process run: each step
keeps its global batch, so its prompts and sampling seeds, and the optimizer state crosses the layouts. Compared as in
tests/training/test_distributed.py (the same tolerances, for the same reasons: float32 rounding of
another reduction order), plus the logged rollouts' text, which must be identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL,
    assert_close_weights,
    assert_same_trajectory,
    cfg_for,
    cli_args,
    final_weights,
    launch,
    rollout_texts,
    step_records,
)

from opd.config import TrainConfig, read_run_config, resolve_tasks
from opd.errors import UserError
from opd.training import loop as train_mod
from opd.training.resuming import check_optimizer_state, check_same_run, named_optimizer_state, rebatch

# step 0 in one process, 1 on two DDP ranks, 2 in one process, 3 on two FSDP ranks, 4 in one process
LAUNCHES = [{}, {"fsdp": False}, {}, {"fsdp": True}, {}]


def one_process(models, out, **kw) -> TrainConfig:
    student, teacher = models
    return TrainConfig.from_flat(
        student=str(student), teacher=str(teacher), out=str(out), batch_size=4, **{**SMALL, **kw}
    )


def per_process_batch(out) -> int:
    return read_run_config(out / "config.json", TrainConfig)["batch_size"]


@pytest.mark.slow  # two 2-rank torchrun launches: 163 s on the shared 2-core machine (load 13)
def test_one_process_then_two_ranks_and_back_equals_uninterrupted(tiny_models, tmp_path):
    steps = len(LAUNCHES)
    uninterrupted = tmp_path / "uninterrupted"
    train_mod.train(one_process(tiny_models, uninterrupted, steps=steps), show_progress=False)
    out = tmp_path / "run"
    for step, ranks in enumerate(LAUNCHES):
        resume = step > 0
        if not ranks:
            train_mod.train(one_process(tiny_models, out, steps=step + 1, resume=resume), show_progress=False)
            assert per_process_batch(out) == 4
            continue
        # the same command (--batch-size 4) on 2 ranks: 2 prompts each, the global batch of 4 kept
        err = launch("torchrun", cli_args(tiny_models, out, batch_size=4, steps=step + 1, resume=True, **ranks))
        assert "this launch has 2: each step keeps its global batch, so --batch-size is now 2 per process" in err
        assert per_process_batch(out) == 2
    assert_same_trajectory(step_records(out), step_records(uninterrupted))
    assert rollout_texts(out) == rollout_texts(uninterrupted)  # the same prompts and seeds, so rollouts
    assert_close_weights(final_weights(out), final_weights(uninterrupted))


def test_a_steps_prompts_and_seeds_are_those_of_its_global_batch_on_any_number_of_ranks():
    """What each rank rolls out, put together in rank order, is one process's batch of the same global size."""
    from types import SimpleNamespace

    from opd.rollout.prompt_set import batch_indices
    from opd.training.distributed import Dist
    from opd.training.producer import Assignment, rollout_request

    source = SimpleNamespace(batch_indices=lambda step, size, seed: batch_indices(10, step, size, seed))

    def drawn(world: int, step: int) -> tuple[list, list]:
        cfg = TrainConfig.from_flat(batch_size=4 // world, samples_per_prompt=2, seed=3)
        at = Assignment(SimpleNamespace(source=source, cfg=cfg), visit=step, slot0=0)
        shares = [rollout_request(SimpleNamespace(dist=Dist(r, world)), step, at) for r in range(world)]
        return [i for rows, _ in shares for i in rows], [s for _, seeds in shares for s in seeds]

    for step in range(4):  # past the first epoch of 10 prompts
        rows, seeds = drawn(1, step)
        assert len(rows) == 8 and len(set(seeds)) == 8
        assert drawn(2, step) == drawn(4, step) == (rows, seeds)


def saved(world: int, batch: int, **config) -> dict:
    """The parts of a checkpoint's state that :func:`rebatch` reads."""
    return {"rng": [{}] * world if world > 1 else {}, "batch": {"": world * batch}, "config": config}


def test_rebatch_keeps_the_global_batch_or_names_the_counts_that_divide_it(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, batch_size=2)
    specs = resolve_tasks(cfg)
    assert rebatch(cfg, specs, saved(2, 2), 2, tmp_path) == (cfg, specs)  # as many processes: unchanged
    for world, want in ((1, 4), (4, 1)):
        got, got_specs = rebatch(cfg, specs, saved(2, 2), world, tmp_path)
        assert got.optimizer.batch_size == want and got_specs[0].cfg is got
        assert got.replace(batch_size=2) == cfg  # nothing else changes
    with pytest.raises(
        UserError, match=r"global batch of 4 prompts a step, which 3 processes cannot share.*\(1, 2, 4\)"
    ):
        rebatch(cfg, specs, saved(2, 2), 3, tmp_path)
    accum = cfg_for(tiny_models, tmp_path, batch_size=4, grad_accum=4)
    with pytest.raises(UserError, match="--batch-size becomes 2 per process.*grad_accum=4 must divide"):
        rebatch(accum, resolve_tasks(accum), saved(1, 4), 2, tmp_path)


def test_rebatch_keeps_the_recorded_global_batch_on_as_many_processes(tiny_models, tmp_path, capsys):
    """--batch-size 4 on 1 process, resumed on 2 (2 each), then again on 2 with the first command: still 2 each."""
    first = cfg_for(tiny_models, tmp_path, batch_size=4)
    second, _ = rebatch(first, resolve_tasks(first), saved(1, 4, batch_size=4), 2, tmp_path)
    assert second.optimizer.batch_size == 2
    third, specs = rebatch(first, resolve_tasks(first), saved(2, 2, batch_size=2), 2, tmp_path)
    assert third.optimizer.batch_size == 2 and specs[0].cfg is third
    assert "global batch of 4 prompts a step, this launch has 2" in capsys.readouterr().err


def test_rebatch_of_a_checkpoint_before_the_record_takes_its_own_batch_size(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, batch_size=4)
    old = {"rng": [{}] * 2, "config": {"batch_size": 2}}  # 2 processes of 2, no "batch"
    for world, want in ((2, 2), (1, 4), (4, 1)):
        assert rebatch(cfg, resolve_tasks(cfg), old, world, tmp_path)[0].optimizer.batch_size == want
    tasks = [{"name": "a", "share": 3}, {"name": "b", "batch_size": 2}]
    mix = TrainConfig.from_flat(teacher="t", batch_size=16, task_mode="mix", tasks=tasks)  # the launch's: 12 and 2
    then = {"rng": {}, "config": {"batch_size": 8, "task_mode": "mix", "tasks": tasks}}  # one process: 6 and 2
    got, got_specs = rebatch(mix, resolve_tasks(mix), then, 2, Path("ckpt"))
    assert got.optimizer.batch_size == 4 and [s.cfg.optimizer.batch_size for s in got_specs] == [3, 1]


def test_rebatch_keeps_each_tasks_global_batch():
    tasks = [{"name": "a", "share": 3}, {"name": "b", "batch_size": 2}]
    cfg = TrainConfig.from_flat(teacher="t", batch_size=8, task_mode="mix", tasks=tasks)
    specs = resolve_tasks(cfg)
    assert [s.cfg.optimizer.batch_size for s in specs] == [6, 2]  # round(0.75 * 8), and b's own
    state = {"rng": {}, "batch": {"a": 6, "b": 2}, "config": {"batch_size": 8}}  # written by one process
    got, got_specs = rebatch(cfg, specs, state, 2, Path("ckpt"))
    assert got.optimizer.batch_size == 4 and [s.cfg.optimizer.batch_size for s in got_specs] == [3, 1]
    with pytest.raises(UserError, match=r"task 'a': .*global batch of 6 prompts a step, which 4 processes"):
        rebatch(cfg, specs, state, 4, Path("ckpt"))


def test_a_positional_optimizer_state_is_renamed_and_checked():
    """A one-process or DDP checkpoint of an opd before named optimizer state resumes under any layout."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    trained = {n: p.shape for n, p in model.named_parameters()}
    named = named_optimizer_state(opt.state_dict(), list(trained))
    want = get_optimizer_state_dict(model, opt)
    assert named["param_groups"] == want["param_groups"]
    assert all(torch.equal(named["state"][k]["exp_avg"], want["state"][k]["exp_avg"]) for k in trained)
    assert named_optimizer_state(want, list(trained)) is want  # already named: as it is
    check_optimizer_state(named, trained, "ckpt")
    with pytest.raises(UserError, match=r"another model's: its 1.weight is \(2, 4\), this student's \(3, 4\)"):
        check_optimizer_state(named, {**trained, "1.weight": torch.Size([3, 4])}, "ckpt")
    with pytest.raises(UserError, match="another model's.*it lacks '2.weight'"):
        check_optimizer_state(named, {**trained, "2.weight": torch.Size([1])}, "ckpt")
    with pytest.raises(UserError, match="optimizer state has 4 parameters, this student trains 3"):
        named_optimizer_state(opt.state_dict(), list(trained)[:3])


@pytest.fixture(scope="module")
def one_step(tiny_models, tmp_path_factory):
    cfg = cfg_for(tiny_models, tmp_path_factory.mktemp("step"), steps=1, ckpt_every=1, eval=False)
    train_mod.train(cfg, show_progress=False)
    return cfg


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"lora_r": 4}, "written with --lora-r 0, this run has --lora-r 4; resume with --lora-r 0"),
        ({"objective": "sampled"}, "written with --objective lsm, this run has --objective sampled"),
        ({"student": "the teacher's folder"}, "written with --student .*student, this run has --student .*teacher"),
    ],
    ids=["lora", "objective", "student"],
)
def test_a_resume_that_changes_the_run_names_what_differs(tiny_models, one_step, change, said):
    if "student" in change:  # another model: the teacher's
        change = {"student": str(tiny_models[1])}
    with pytest.raises(UserError, match=said):
        train_mod.setup(one_step.replace(resume=True, steps=2, **change))


def test_another_number_of_processes_is_refused_with_rollouts_in_flight(tiny_models, tmp_path):
    cfg = cfg_for(tiny_models, tmp_path, max_staleness=1)
    written = {"rng": [{}, {}], "config": {}, "max_staleness": 1}  # by 2 processes
    check_same_run(written, cfg, Path("ckpt"), 2)
    with pytest.raises(UserError, match=r"written by 2 process\(es\) with --max-staleness 1.*resume with 2 process"):
        check_same_run(written, cfg, Path("ckpt"), 1)

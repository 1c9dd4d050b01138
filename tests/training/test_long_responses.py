"""Long responses: activation checkpointing per layer and token-budget micro-batches change what is in
memory, never the step: its loss, gradient and per-row by-products equal the plain step's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_close_weights, assert_same_trajectory, cfg_for, cli_args, final_weights, launch, step_records

from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.models.loading import checkpoint_layers
from opd.training import loop, producer
from opd.training.microbatch import in_row_order, pack_by_tokens, pad_to, split_rows
from opd.training.setup import setup


def test_pack_by_tokens_keeps_each_group_within_the_budget():
    lengths = [30, 5, 12, 12, 40, 7, 7, 100, 3]
    groups = pack_by_tokens(lengths, budget=40)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
    for g in groups:
        assert g == sorted(g)
        assert len(g) * max(lengths[i] for i in g) <= 40 or len(g) == 1  # the 100-token row goes alone
    assert [7] in groups  # longer than the budget: alone
    assert pack_by_tokens(lengths, budget=10**6) == [list(range(len(lengths)))]
    assert pack_by_tokens([4, 4, 4], budget=1) == [[0], [1], [2]]


def test_split_rows_evenly_or_by_budget_and_back_in_order():
    lengths = [torch.tensor([9, 2, 9, 2])]
    even = split_rows(lengths, grad_accum=2, budget=0)
    assert [m.rows.tolist() for m in even] == [[0, 1], [2, 3]]
    packed = split_rows(lengths, grad_accum=1, budget=18)
    assert [m.rows.tolist() for m in packed] == [[0, 2], [1, 3]]
    values = [torch.tensor([10.0, 30.0]), torch.tensor([20.0, 40.0])]  # rows 0, 2 then 1, 3
    assert in_row_order(values, [m.rows for m in packed]).tolist() == [10.0, 20.0, 30.0, 40.0]
    padded = pad_to(packed, 4)
    assert [m.counted for m in padded] == [True, True, False, False]


def _one_step(models, tmp_path, objective: str, reduction: str, other: dict):
    """One step of a plain run and of a run with ``other`` settings on the plain run's rollouts and scores, in
    float64: both StepUpdates, both students' gradients (as the optimizer step sees them), and the batch."""
    kw = dict(objective=objective, reduction=reduction, batch_size=6, max_new_tokens=12, eval_samples=0)
    runs = [setup(cfg_for(models, tmp_path / name, **kw, **extra)) for name, extra in (("a", {}), ("b", other))]
    (at,) = producer.step_tasks(runs[0], 0)
    batch, rows, records = producer.rollout_stage(runs[0], 0, at)
    part = producer.scored_part(runs[0], 0, at.task, batch, rows, records)
    updates, grads = [], []
    for run in runs:
        run.student.double()  # in place (the optimizer's parameters): float rounding of other paddings is gone
        run.tasks[0].teacher.model.double()  # full_kl reads the teacher's hidden states of each micro-batch
        seen: dict = {}
        run.optimizer.register_step_pre_hook(
            lambda *_, seen=seen, run=run: seen.update(
                {n: p.grad.clone() for n, p in run.student.named_parameters() if p.grad is not None}
            )
        )
        updates.append(loop.update_stage(run, 0, [dataclasses.replace(part, task=run.tasks[0])])[0])
        grads.append(seen)
    return updates, grads, batch


def _assert_same_step(updates, grads, rel=1e-12):
    a, b = updates
    assert b.loss == pytest.approx(a.loss, rel=rel, abs=1e-9)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=rel)
    torch.testing.assert_close(b.loss_NT, a.loss_NT, rtol=rel, atol=1e-14)  # the rows back in their order
    torch.testing.assert_close(b.log_hidden_LTD, a.log_hidden_LTD, rtol=rel, atol=1e-14)
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=rel, atol=1e-15, msg=name)


@pytest.mark.parametrize("objective", ["lsm", "sampled", "full_kl"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "constant_sum"])
def test_token_budget_step_equals_the_unsplit_step(tiny_models, tmp_path, objective, reduction):
    updates, grads, batch = _one_step(tiny_models, tmp_path, objective, reduction, {"micro_batch_tokens": 40})
    lengths = batch.attention_mask_NL.sum(-1).tolist()
    assert len(pack_by_tokens(lengths, 40)) > 1  # it did split, and out of row order somewhere
    _assert_same_step(updates, grads)


@pytest.mark.parametrize("objective", ["lsm", "full_kl"])
def test_padding_micro_batches_add_nothing(tiny_models, tmp_path, monkeypatch, objective):
    """As on a rank with fewer micro-batches than the busiest: two padding ones run, and count for nothing;
    each is one row of two tokens (the prompt's last, the first response token), never a real micro-batch
    again (full_kl: the teacher's forward sees the narrowed batch too)."""
    real, inputs = loop.micro_batches_of, loop.micro_inputs
    monkeypatch.setattr(
        loop, "micro_batches_of", lambda run, parts: pad_to(real(run, parts), len(real(run, parts)) + 2)
    )
    padding_shapes = []

    def seen(p, m):
        out = inputs(p, m)
        if not m.counted:
            padding_shapes.append((tuple(out[0].input_ids_NL.shape), tuple(out[1].topk_ids_NTK.shape[:2])))
        return out

    monkeypatch.setattr(loop, "micro_inputs", seen)
    updates, grads, _ = _one_step(tiny_models, tmp_path, objective, "token_mean", {"micro_batch_tokens": 40})
    _assert_same_step(updates, grads)
    assert padding_shapes == [((1, 2), (1, 1))] * 4  # two in each run (the patch pads both)


@pytest.mark.parametrize("objective", ["lsm", "sampled", "full_kl"])
def test_gradient_checkpointing_step_equals_the_plain_step(tiny_models, tmp_path, objective):
    updates, grads, _ = _one_step(tiny_models, tmp_path, objective, "token_mean", {"gradient_checkpointing": True})
    _assert_same_step(updates, grads, rel=0)


def test_gradient_checkpointing_recomputes_with_lora_and_in_bfloat16(tiny_models, tmp_path):
    run = setup(cfg_for(tiny_models, tmp_path, lora_r=4, dtype="bfloat16", gradient_checkpointing=True))
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [
        m for m in run.student.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]
    assert layers, "no decoder layer checkpoints"
    calls = []
    layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(torch.is_grad_enabled()))  # inside the layer
    (at,) = producer.step_tasks(run, 0)
    batch, rows, records = producer.rollout_stage(run, 0, at)
    calls.clear()  # the rollout's forwards (no gradient, eval mode) do not count
    part = producer.scored_part(run, 0, at.task, batch, rows, records)
    upd = loop.update_stage(run, 0, [part])[0]
    assert torch.isfinite(torch.tensor(upd.grad_norm)) and upd.grad_norm > 0
    assert len(calls) >= 2 and calls.count(True) >= 2  # the forward, and its recomputation in the backward


def test_gradient_checkpointing_refused_for_a_model_without_it(tiny_models):
    from opd.models.loading import load_model

    model = load_model(tiny_models[0])
    type(model).supports_gradient_checkpointing = False
    try:
        with pytest.raises(UserError, match="Qwen2ForCausalLM does not support gradient checkpointing"):
            checkpoint_layers(model)
    finally:
        del type(model).supports_gradient_checkpointing


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(micro_batch_tokens=-1), "micro_batch_tokens=-1 must be >= 1"),
        (dict(micro_batch_tokens=64, grad_accum=2), "both split the step; keep one"),
    ],
)
def test_token_budget_bad_input(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_flat(batch_size=4, **kw)


def test_fsdp_with_token_budget_and_checkpointing_follows_one_process(tiny_models, tmp_path):
    """2 gloo ranks under FSDP, micro-batches packed by a 100-token budget, every layer checkpointed: the single
    process's trajectory (batch 4, plain). At these seeds the ranks' rows (lengths 30 and 31 on rank 0, 37 and
    66 on rank 1 at step 0) give them 1 and 2 micro-batches at step 0, 2 and 1 at step 1: the padding keeps
    FSDP's collectives in step."""
    from helpers import SMALL

    single = tmp_path / "single"
    cfg = TrainConfig.from_flat(
        student=str(tiny_models[0]), teacher=str(tiny_models[1]), out=str(single), **{**SMALL, "steps": 3}
    )
    loop.train(cfg.replace(batch_size=4), show_progress=False)
    out = tmp_path / "fsdp"
    args = dict(batch_size=2, fsdp=True, micro_batch_tokens=100, gradient_checkpointing=True, steps=3)
    launch("torchrun", cli_args(tiny_models, out, **args))
    assert_same_trajectory(step_records(out), step_records(single))
    assert_close_weights(final_weights(out), final_weights(single))


def test_a_sequence_over_the_token_budget_goes_alone_said_once(tiny_models, tmp_path, capsys):
    """--micro-batch-tokens smaller than a row: that row alone in its micro-batch, and one note in the run."""
    cfg = cfg_for(tiny_models, tmp_path, micro_batch_tokens=8, steps=2, eval_samples=0)
    run = setup(cfg)
    for step in range(2):
        (at,) = producer.step_tasks(run, step)
        batch, rows, records = producer.rollout_stage(run, step, at)
        part = producer.scored_part(run, step, at.task, batch, rows, records)
        micro = loop.micro_batches_of(run, [part])
        assert sorted(len(m.rows) for m in micro) == [1] * batch.num_rollouts  # every row is over 8 tokens
    err = capsys.readouterr().err
    assert err.count("is longer than --micro-batch-tokens 8") == 1

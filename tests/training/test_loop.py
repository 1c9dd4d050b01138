"""The training loop's guarantees: the constant_sum constant, dropout off by default, non-finite
gradients caught, batch reuse with the analytic losses, and evaluation graded like training."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import cfg_for, first_rollout, step_records, train_killed_at

from opd.errors import UserError
from opd.evaluation.core import Evaluation
from opd.evaluation.model_eval import evaluate_model
from opd.models.loading import disable_dropout, load_model, load_tokenizer
from opd.tasks import ArithmeticTask
from opd.training import loop as train_mod
from opd.training import producer
from opd.training import sources as sources_mod
from opd.training.distributed import Dist
from opd.training.loss import loss_mask, reduce_loss

# ----------------------------------------------------------------------------- constant_sum


def test_constant_sum_weighs_a_token_the_same_whatever_the_batch_length(tiny_models, tmp_path):
    """The constant is rollouts x max_new_tokens, so a token's weight does not follow the batch's
    longest response (it used to divide by that length, changing from step to step)."""
    cfg = cfg_for(tiny_models, tmp_path, reduction="constant_sum", max_new_tokens=16)
    run = SimpleNamespace(cfg=cfg, dist=Dist())
    weights = []
    for longest in (3, 11):  # two steps whose longest responses differ
        mask_NT = torch.zeros(4, longest, dtype=torch.bool)
        mask_NT[:, :2] = True
        mask_NT[0, :longest] = True
        loss_NT = torch.zeros(4, longest)
        loss_NT[1, 0] = 1.0  # the same token, with the same loss, in both batches
        totals = train_mod.global_totals(run, [mask_NT], [cfg.rollout.max_new_tokens])
        weights.append(float(reduce_loss("constant_sum", loss_NT, mask_NT, totals)))
    assert weights[0] == weights[1] == pytest.approx(1.0 / (4 * 16))


# ----------------------------------------------------------------------------- dropout


def _student_with_dropout(student_dir, out, p: float):
    shutil.copytree(student_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["attention_dropout"] = p
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_disable_dropout_reaches_modules_and_attention_attributes():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=50,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.3,
            embd_pdrop=0.3,
            attn_pdrop=0.3,
        )
    )
    model.train()
    x = torch.randint(0, 50, (2, 8))
    assert not torch.equal(model(x).logits, model(x).logits)  # the dropout is live before
    assert disable_dropout(model) > 0
    assert model.training
    assert torch.equal(model(x).logits, model(x).logits)
    assert disable_dropout(model) == 0  # nothing left to turn off


def test_student_dropout_is_off_by_default_and_kept_on_request(tiny_models, tmp_path):
    student, teacher = tiny_models
    noisy = _student_with_dropout(student, tmp_path / "noisy", 0.5)
    ids = torch.randint(3, 100, (2, 12))

    def two_forwards(run):
        assert run.student.training
        return run.student(ids).logits, run.student(ids).logits

    off = train_mod.setup(cfg_for((noisy, teacher), tmp_path / "off"))
    assert torch.equal(*two_forwards(off))
    kept = train_mod.setup(cfg_for((noisy, teacher), tmp_path / "kept", keep_dropout=True))
    assert not torch.equal(*two_forwards(kept))


def test_a_dropout_student_trains_like_the_same_student_without_dropout(tiny_models, tmp_path):
    """With dropout turned off, the configured dropout changes nothing: same losses, same diagnostics."""
    student, teacher = tiny_models
    noisy = _student_with_dropout(student, tmp_path / "noisy", 0.5)
    for name, model in (("plain", student), ("noisy", noisy)):
        train_mod.train(cfg_for((model, teacher), tmp_path / name, eval_samples=0), show_progress=False)
    plain, with_dropout = (step_records(tmp_path / n / "run") for n in ("plain", "noisy"))
    for a, b in zip(plain, with_dropout, strict=True):
        for key in ("train/loss", "train/grad_norm", "diag/overlap", "diag/student_entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key


# ----------------------------------------------------------------------------- non-finite values


class _InfiniteGradient(torch.autograd.Function):
    """The identity in value; an infinite (or NaN) gradient on the way back."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def test_non_finite_gradient_stops_before_the_update_and_keeps_last_checkpoint(tiny_models, tmp_path, monkeypatch):
    cfg = cfg_for(tiny_models, tmp_path, steps=4, ckpt_every=1, eval_samples=0)
    real = train_mod.objective_loss
    calls = []

    def bad_gradient_at_step_2(*a, **kw):
        calls.append(1)
        loss_NT, h = real(*a, **kw)
        return (_InfiniteGradient.apply(loss_NT) if len(calls) == 3 else loss_NT), h

    monkeypatch.setattr(train_mod, "objective_loss", bad_gradient_at_step_2)
    seen = {}
    real_step = train_mod.check_finite

    def spy(run, step, **values):
        seen[step] = values
        real_step(run, step, **values)

    monkeypatch.setattr(train_mod, "check_finite", spy)
    with pytest.raises(UserError, match="gradient norm became (nan|inf) at step 2"):
        train_mod.train(cfg, show_progress=False)
    assert math.isfinite(seen[2]["loss"])  # only the gradient went wrong: the loss check alone would miss it
    latest = (tmp_path / "run" / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_0000001"
    assert [r["step"] for r in step_records(tmp_path / "run")] == [0, 1]


# ----------------------------------------------------------------------------- batch reuse


@pytest.mark.parametrize("objective", ["lsm", "full_kl"])
def test_updates_per_batch_with_an_analytic_loss(tiny_models, tmp_path, objective):
    """Two updates per batch: the logged loss is the first (on-policy) one, so step 0 matches a run
    with one update; the second update is real (later steps differ, the schedule moves twice)."""
    once = cfg_for(tiny_models, tmp_path / "once", objective=objective, eval_samples=0, steps=2)
    twice = once.replace(out=str(tmp_path / "twice" / "run"), updates_per_batch=2)
    train_mod.train(once, show_progress=False)
    run = train_mod.setup(twice.replace(steps=1))
    batch, _, _ = first_rollout(run)
    mask = loss_mask(batch, run.special_ids, run.cfg.objective.mask_special)
    diag = producer.diag_index(mask, run.cfg.run.diag_positions, 0, run.cfg.run.seed)
    scores, ids = producer.score_stage(run, batch, diag, run.tasks[0])
    before = {n: p.detach().clone() for n, p in run.student.named_parameters()}
    part = producer.StepPart(run.tasks[0], batch, list(range(batch.num_rollouts)), None, mask, diag, scores, ids, {})
    train_mod.update_stage(run, 0, [part])
    assert run.scheduler.last_epoch == 2
    shutil.rmtree(twice.run.out)
    train_mod.train(twice, show_progress=False)
    a, b = step_records(tmp_path / "once" / "run"), step_records(tmp_path / "twice" / "run")
    assert b[0]["train/loss"] == pytest.approx(a[0]["train/loss"], rel=1e-6)
    assert b[1]["train/loss"] != pytest.approx(a[1]["train/loss"], rel=1e-6)
    assert any(not torch.equal(before[n], p) for n, p in run.student.named_parameters())


# ----------------------------------------------------------------------------- evaluation


def test_periodic_eval_follows_the_configured_temperature(tiny_models, tmp_path, monkeypatch):
    seen = []

    def fake_eval(engine, items, plan):
        seen.append(plan.sampling.temperature)
        return Evaluation({"accuracy": 0.0, "n": 1}, [])

    monkeypatch.setattr(sources_mod, "evaluate", fake_eval)
    train_mod.train(cfg_for(tiny_models, tmp_path, temperature=0.7, steps=1), show_progress=False)
    assert seen == [0.7]


class _GenerousTask(ArithmeticTask):
    """Every completion is correct: an evaluation that grades with anything else than the task's
    own reward reports less than 100%."""

    def reward(self, completion, example):
        return 1.0


def test_evaluation_grades_with_the_tasks_reward(tiny_models):
    from opd.rollout.prompt_set import PromptSet

    student, _ = tiny_models
    tok = load_tokenizer(student)
    task = _GenerousTask(n_train=10, n_test=6)
    prompts = PromptSet.build(task.examples("test"), tok, 256, "test prompts")
    model = load_model(student, device=torch.device("cpu"))
    res = evaluate_model(model, tok, prompts, task, max_new_tokens=4, samples=2)
    assert res["accuracy"] == 1.0 and res["avg_at_k"] == 1.0
    plain = evaluate_model(model, tok, prompts, ArithmeticTask(n_train=10, n_test=6), max_new_tokens=4)
    assert plain["accuracy"] == 0.0  # a random 1-layer model writes no boxed answer in 4 tokens


# ----------------------------------------------------------------------------- full_kl


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_full_kl_from_hidden_states_equals_the_dense_loss_on_rollouts(tiny_models, tmp_path, direction):
    """The trainer's full_kl never builds (N, T, V) logits; it must still be the dense KL, value and gradient."""
    from opd import losses as L
    from opd.models.loading import head_weight
    from opd.rollout.forward import response_hidden
    from opd.training.loss import objective_loss

    run = train_mod.setup(cfg_for(tiny_models, tmp_path, objective="full_kl", kl_direction=direction))
    batch, _, _ = first_rollout(run)
    mask = loss_mask(batch, run.special_ids, run.cfg.objective.mask_special)
    scores = run.tasks[0].teacher.score(batch, run.cfg.objective.k)
    params = [p for p in run.student.parameters() if p.requires_grad]

    loss_NT, _ = objective_loss(run.cfg, run.student, run.tasks[0].teacher, batch, scores, mask)
    grads = torch.autograd.grad(loss_NT.sum(), params)
    with torch.no_grad():
        t_logits = response_hidden(run.tasks[0].teacher.model, batch) @ head_weight(run.tasks[0].teacher.model).T
    s_logits = response_hidden(run.student, batch) @ head_weight(run.student).T
    dense_NT = L.full_vocab_kl(s_logits, t_logits, mask, direction)
    dense_grads = torch.autograd.grad(dense_NT.sum(), params)
    assert mask.any() and float(dense_NT.detach().sum()) > 0
    torch.testing.assert_close(loss_NT, dense_NT, rtol=1e-5, atol=1e-6)
    for g, d in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(g, d, rtol=1e-4, atol=1e-6)


def test_resume_before_any_checkpoint_starts_the_logs_over(tiny_models, tmp_path, monkeypatch):
    cfg = cfg_for(tiny_models, tmp_path, steps=3, ckpt_every=0, eval_samples=0)
    train_killed_at(cfg, 2, monkeypatch)
    assert [r["step"] for r in step_records(tmp_path / "run")] == [0, 1]
    train_mod.train(cfg.replace(resume=True), show_progress=False)
    assert [r["step"] for r in step_records(tmp_path / "run")] == [0, 1, 2]

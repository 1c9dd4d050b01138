"""The objective registry (opd.objectives): an objective added as one entry trains end to end, and
the checks that read the registry (config, served and cross-tokenizer teachers, the score stage)
follow its entry rather than its name."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import cfg_for, first_rollout, step_records

import opd.losses as L
from opd import objectives as O
from opd.config import ConfigError, TrainConfig
from opd.errors import UserError
from opd.teachers.factory import make_teacher
from opd.training import loop as train_mod
from opd.training.loss import loss_mask, needs_student_topk


def _teacher_argmax_ce(x: O.ObjectiveInputs, cfg, update) -> torch.Tensor:
    """Cross-entropy on the teacher's top token: -log p(argmax q) at each counted position."""
    logp_NT = L.token_logprobs_from_hidden(x.hidden_NTD, x.head_VD, x.teacher_topk_ids_NTK[..., 0])
    return (-logp_NT).masked_fill(~x.mask_NT, 0.0)  # as docs/architecture.md writes it


@pytest.fixture
def registered():
    """Entries registered by a test, removed after it (the registry is process-wide)."""
    added = []

    def add(entry: O.Objective) -> O.Objective:
        added.append(O.register(entry).name)
        return entry

    yield add
    for name in added:
        del O.REGISTRY[name]


def test_an_objective_added_as_one_entry_trains(tiny_models, tmp_path, registered):
    registered(O.Objective("argmax_ce", "CE on the teacher's top token", _teacher_argmax_ce, lambda c: {O.TOPK}))
    cfg = cfg_for(tiny_models, tmp_path, objective="argmax_ce", steps=3, lr=1e-2)
    assert cfg.objective.mask_special is False  # the entry's default
    train_mod.train(cfg, show_progress=False)
    losses = [r["train/loss"] for r in step_records(tmp_path / "run")]
    assert len(losses) == 3 and all(math.isfinite(v) and v > 0 for v in losses)


def test_the_entry_loss_is_what_the_trainer_minimises(tiny_models, tmp_path, registered):
    """objective_loss hands the entry the batch's tensors: its value equals the same loss computed
    here from the batch and scores directly (the teacher's top token's -log p)."""
    registered(O.Objective("argmax_ce", "CE on the teacher's top token", _teacher_argmax_ce, lambda c: {O.TOPK}))
    from opd.models.loading import head_weight
    from opd.rollout.forward import response_hidden
    from opd.training.loss import objective_loss

    run = train_mod.setup(cfg_for(tiny_models, tmp_path, objective="argmax_ce"))
    batch, _, _ = first_rollout(run)
    mask = loss_mask(batch, run.special_ids, run.cfg.objective.mask_special)
    scores = run.tasks[0].teacher.score(batch, run.cfg.objective.k)
    loss_NT, _ = objective_loss(run.cfg, run.student, run.tasks[0].teacher, batch, scores, mask)
    logits = (response_hidden(run.student, batch) @ head_weight(run.student).T).double()
    want = -logits.log_softmax(-1).gather(-1, scores.topk_ids_NTK[..., :1]).squeeze(-1)
    assert mask.any()
    torch.testing.assert_close(loss_NT.double()[mask], want[mask], rtol=1e-5, atol=1e-6)
    assert float(loss_NT.detach()[~mask].abs().sum()) == 0.0


def test_a_name_registered_twice_is_refused():
    with pytest.raises(ValueError, match="'lsm' is registered twice"):
        O.register(O.Objective("lsm", "again", _teacher_argmax_ce, lambda c: {O.TOPK}))


def test_needs_decide_which_teachers_can_train_an_objective(tiny_models, registered):
    """A new entry that reads the teacher's whole distribution is refused with a served teacher,
    from its needs alone, with the options a served teacher can train."""
    registered(O.Objective("dense_ce", "needs the full distribution", _teacher_argmax_ce, lambda c: {O.FULL}))
    cfg = TrainConfig.from_flat(student=str(tiny_models[0]), teacher_url="http://127.0.0.1:9", objective="dense_ce")
    with pytest.raises(UserError) as err:
        make_teacher(cfg, None, None)
    assert str(err.value) == (
        "objective=dense_ce needs the teacher's distribution over the student's vocabulary, which a "
        "vLLM-format server does not return; with --teacher-url use --objective sampled, or --objective lsm "
        "with --support teacher_topk or teacher_topk_plus_sampled, or use --teacher DIR"
    )


@pytest.mark.parametrize(
    "support, student_topk, served",
    [
        ("teacher_topk", False, True),
        ("teacher_topk_plus_sampled", False, True),
        ("student_topk", True, False),
        ("union", True, False),
        ("intersection", True, False),
        ("symmetric_difference", True, False),
    ],
)
def test_lsm_supports_and_their_needs(support, student_topk, served):
    cfg = TrainConfig.from_flat(support=support)
    assert needs_student_topk(cfg) is student_topk
    assert (O.refusal(cfg.objective, O.SERVED_GIVES, "x") is None) is served


def test_variant_flags_and_mask_default_come_from_the_entry(registered):
    with pytest.raises(ConfigError, match="tail is a variant of --objective lsm, not of full_kl"):
        TrainConfig.from_flat(objective="full_kl", tail=True)
    registered(O.Objective("tailed", "has a tail", _teacher_argmax_ce, lambda c: {O.TOPK}, True, ("tail",)))
    cfg = TrainConfig.from_flat(objective="tailed", tail=True)
    assert cfg.objective.mask_special is True
    assert TrainConfig.from_flat(objective="sampled").objective.mask_special is False


def test_an_unknown_objective_names_the_registered_ones(registered):
    registered(O.Objective("argmax_ce", "CE", _teacher_argmax_ce, lambda c: {O.TOPK}))
    with pytest.raises(ConfigError, match="objective='kl': choose one of lsm, sampled, full_kl, argmax_ce"):
        TrainConfig.from_flat(objective="kl")
    with pytest.raises(KeyError, match="choose one of lsm, sampled, full_kl, argmax_ce"):
        O.lookup("kl")


def test_an_objective_checks_its_own_options_and_the_config_refuses_with_its_words(registered):
    def at_most_4(o: O.ObjectiveOptions) -> str | None:
        return None if o.k <= 4 else f"k={o.k}: argmax_ce reads at most 4; lower --k"

    registered(
        O.Objective(
            "argmax_ce", "CE on the teacher's top token", _teacher_argmax_ce, lambda c: {O.TOPK}, check=at_most_4
        )
    )
    assert O.ObjectiveOptions(objective="argmax_ce", k=4).problem() is None
    with pytest.raises(ConfigError, match="k=8: argmax_ce reads at most 4; lower --k"):
        TrainConfig.from_flat(objective="argmax_ce", k=8)
    # lsm's own: the tail replaces renormalization
    assert str(O.ObjectiveOptions(tail=True, renormalize=False).problem()).startswith("tail compares")

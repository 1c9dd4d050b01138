"""The guard: no stage of a step holds a (rows x length x vocabulary) tensor.

One step, its evaluation and its checkpoint, at a shape where such a tensor is unmistakable: 4 rollouts of
128 tokens over a 32,768-token vocabulary (a narrow Qwen3 pair, :mod:`opd.lab.real_shape`). B x T x V is
then 16.8M elements, 8 times the head itself (V x 64) and twice a 256-position chunk of logits (the
teacher's scoring, the losses), the largest a chunked stage allocates. A dispatch mode records the largest tensor each stage allocates.
The same for what one step runs under other options, on a batch of B x 512 tokens: cross-tokenizer scoring
and each objective's loss and backward (:data:`opd.lab.real_shape.OBJECTIVES`, the --no-renormalize ablation
among them). Those that need the full vocabulary hold up to four (256, V) buffers (full_kl's backward), so
B x 512 x V is twice the most a chunked objective allocates.
"""

from __future__ import annotations

import pytest
import torch
from helpers import step_records

from opd.config import TrainConfig
from opd.lab.real_shape import (
    OBJECTIVES,
    LargestTensor,
    cross_tokenizer_teacher,
    loss_and_backward,
    narrow_pair,
    prompts,
    rollout_engine,
    stages,
)
from opd.models.loading import load_model, load_tokenizer
from opd.teachers.scoring import HFTeacher
from opd.training import loop, producer

B, T, V = 4, 128, 32_768
T_OBJECTIVES = 512  # B x T_OBJECTIVES positions: twice full_kl's four 256-position chunks
STAGES = ["rollout_stage", "score_stage", "update_stage", "log_stage", "eval_stage", "checkpoint_stage"]


@pytest.fixture(scope="module")
def wide_vocab_pair(tmp_path_factory):
    return narrow_pair(tmp_path_factory.mktemp("v32768"), V, max_len=1024)


def test_the_padded_tokenizer_reloads_with_the_demos_ids_and_every_id_once(wide_vocab_pair):
    """Saved next to a Qwen3 model and loaded back: V distinct ids, the demo's encoding, the padding decodes."""
    from importlib import resources

    from opd.models.loading import load_tokenizer

    tok = load_tokenizer(wide_vocab_pair[0])
    demo = load_tokenizer(str(resources.files("opd") / "assets" / "demo" / "tokenizer"))
    assert len(tok) == V and len(set(tok.get_vocab().values())) == V
    text = "<think>Compute 12 + 7.</think> 19"
    assert tok(text)["input_ids"] == demo(text)["input_ids"]
    assert tok.decode([V - 1]) == f"xpad{V - 1}"


def test_the_recorder_sees_a_full_logits_tensor():
    """The guard can fail: a (B, T, V) tensor made under the mode is recorded, and a view of it is not."""
    with LargestTensor() as seen:
        seen.stage = "made"
        x = torch.zeros(B, T, V)
        seen.stage = "viewed"
        x.transpose(1, 2)
    assert seen.largest["made"][0] == B * T * V
    assert "viewed" not in seen.largest


def test_no_stage_allocates_rows_by_length_by_vocabulary(wide_vocab_pair, tmp_path):
    student, teacher = wide_vocab_pair
    cfg = TrainConfig.from_flat(
        student=str(student),
        teacher=str(teacher),
        out=str(tmp_path / "run"),
        device="cpu",
        steps=1,
        batch_size=B,
        max_new_tokens=T,
        k=8,
        log_rollouts=B,  # rollout logging too (issue 69 made it chunked)
        diag_positions=16,
        eval_size=2,
        eval_samples=1,  # greedy and sampled
        eval_every=0,
        ckpt_every=0,
    )
    entered: set[str] = set()

    def enter(name: str) -> None:
        entered.add(name)
        seen.stage = name

    with (
        LargestTensor() as seen,
        stages((producer, loop), STAGES, enter, lambda name: setattr(seen, "stage", "between")),
    ):
        loop.train(cfg, show_progress=False)
    (step,) = step_records(tmp_path / "run")
    assert step["rollout/response_len"] > 0.9 * T  # random weights rarely sample EOS (about 1/V): a real length
    assert entered == set(STAGES)
    over = {name: got for name, got in seen.largest.items() if got[0] >= B * T * V}
    assert not over, f"stages allocating B x T x V = {B * T * V:,} elements or more: {over}"


@pytest.fixture(scope="module")
def one_batch(wide_vocab_pair):
    """A rollout batch of B x T_OBJECTIVES from the narrow student, the models and the in-process teacher's top-8."""
    student_dir, teacher_dir = wide_vocab_pair
    tok, student, teacher_model = load_tokenizer(student_dir), load_model(student_dir), load_model(teacher_dir)
    torch.manual_seed(0)
    batch = rollout_engine(student, tok).generate(
        prompts(tok, B), list(range(B)), max_new_tokens=T_OBJECTIVES, temperature=0.05, top_p=0.95
    )
    assert batch.action_mask_NT.sum() > 0.9 * B * T_OBJECTIVES  # random weights rarely sample EOS: a real length
    teacher = HFTeacher(teacher_model)
    return tok, student, teacher_model, teacher, batch, teacher.score(batch, 8)


def test_cross_tokenizer_scoring_allocates_no_rows_by_length_by_vocabulary(one_batch):
    tok, _, teacher_model, _, batch, _ = one_batch
    teacher = cross_tokenizer_teacher(teacher_model, tok)
    with LargestTensor() as seen:
        seen.stage = "score"
        scores = teacher.score(batch, 8)
    assert scores.topk_ids_NTK.shape == (B, T_OBJECTIVES, 8)
    assert seen.largest["score"][0] < B * T_OBJECTIVES * V, seen.largest


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_no_objective_allocates_rows_by_length_by_vocabulary(one_batch, name):
    """Each objective's loss and backward, the --no-renormalize ablation among them (it once formed the logits)."""
    _, student, _, teacher, batch, scores = one_batch
    student.train()
    with LargestTensor() as seen:
        seen.stage = name
        loss_and_backward(student, teacher, batch, scores, OBJECTIVES[name], 8)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())  # it trained
    student.zero_grad(set_to_none=True)
    assert seen.largest[name][0] < B * T_OBJECTIVES * V, f"{name}: {seen.largest[name]}"

"""The update stage's loss: from a rollout batch and the teacher's scores to one differentiable loss.

The glue between the models and the objectives of :mod:`opd.objectives` (the registry, pure
tensors): the student's response hidden states, the teacher's hidden states when an objective
reads them, the loss mask and the reduction over the global batch.

The loss mask is the action mask (the tokens the model sampled; environment and template tokens
of multi-turn episodes are context, never trained) minus, when ``mask_special`` is on, the
positions whose sampled token is special (EOS, ``<think>``, ``</think>``, template markers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from opd import losses as L
from opd.config import TrainConfig
from opd.models.head import model_head
from opd.objectives import FULL, QUERY, ObjectiveInputs, lookup
from opd.rollout.engine import RolloutBatch
from opd.rollout.forward import response_hidden
from opd.teachers.scoring import TeacherScores


def loss_mask(batch: RolloutBatch, special_ids: list[int], mask_special: bool | None) -> torch.Tensor:
    mask = cast(torch.Tensor, batch.action_mask_NT).clone()  # set by RolloutBatch.__post_init__
    if mask_special and special_ids:
        mask &= ~L.special_token_mask(batch.response_ids_NT, special_ids)
    return mask


def scored_loss_mask(mask_NT: torch.Tensor, scores: TeacherScores) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss mask without the positions the teacher did not score (``scores.position_mask_NT``:
    a cross-tokenizer teacher's unaligned positions), and their share of the loss positions as the
    metric ``cross/dropped`` (none when the teacher scored every position)."""
    if scores.position_mask_NT is None:
        return mask_NT, {}
    kept_NT = mask_NT & scores.position_mask_NT
    return kept_NT, {"cross/dropped": float((mask_NT & ~kept_NT).sum()) / max(int(mask_NT.sum()), 1)}


@torch.no_grad()
def student_topk_ids(student, batch: RolloutBatch, k: int) -> torch.Tensor:
    """The student's own top-K at each response position (for student-side supports)."""
    h = response_hidden(student, batch)
    return L.topk_from_hidden(h, model_head(student), k)[0]


@torch.no_grad()
def policy_logprobs(student, batch: RolloutBatch) -> torch.Tensor:
    """The student's log-probs of the sampled tokens (N, T), as the trainer computes them: for rollouts
    an older policy sampled (--max-staleness), the policy a policy-gradient update starts from."""
    return L.token_logprobs_from_hidden(response_hidden(student, batch), model_head(student), batch.response_ids_NT)


def reads_policy_logprobs(cfg: TrainConfig) -> bool:
    """Whether a step computes :func:`policy_logprobs` first: a policy-gradient objective's rollouts
    come from an older policy (--max-staleness > 0)."""
    return cfg.rollout.max_staleness > 0 and lookup(cfg.objective.objective).policy_gradient


def needs_student_topk(cfg: TrainConfig) -> bool:
    """Whether the objective reads the student's own top-K (student-side supports), which the
    score stage computes and the teacher scores."""
    return QUERY in lookup(cfg.objective.objective).needs(cfg.objective)


@dataclass
class LossTotals:
    """Whole-batch counts, so micro-batch losses add up to the full-batch reduction exactly.

    In data-parallel training the counts are those of the global batch (summed over ranks) and
    ``ranks`` is the number of ranks. ``horizon`` is the configured ``max_new_tokens``, never a
    length measured on the batch: ``constant_sum`` then weighs every token the same at every step.
    ``budget`` is what ``constant_sum`` divides by: rollouts x horizon, or in a multi-task mixed
    batch the sum over its tasks of rollouts x that task's horizon (0: rollouts x horizon).
    """

    tokens: int
    sequences: int
    rollouts: int
    horizon: int
    ranks: int = 1
    budget: int = 0


def reduce_loss(kind: str, loss_NT: torch.Tensor, mask_NT: torch.Tensor, totals: LossTotals) -> torch.Tensor:
    """This micro-batch's share of the global batch loss, times ``totals.ranks``.

    DDP and FSDP average gradients over R ranks. With global counts, the global loss is
    sum_r l_r where l_r is rank r's share, so its gradient is sum_r g_r = R * mean_r g_r: each rank
    scales its share by R, and the averaged gradient equals the single-process gradient of the
    whole batch. The global loss value is then sum_r (value_r / R).
    """
    if kind == "token_mean":
        loss = L.constant_sum(loss_NT, mask_NT, max(totals.tokens, 1))
    elif kind == "sequence_mean":
        seqs = int((mask_NT.sum(-1) > 0).sum())
        loss = L.sequence_mean(loss_NT, mask_NT) * seqs / max(totals.sequences, 1)
    else:
        loss = L.constant_sum(loss_NT, mask_NT, totals.budget or totals.rollouts * totals.horizon)
    return loss * totals.ranks if totals.ranks != 1 else loss


def objective_loss(
    cfg: TrainConfig,
    student,
    teacher,
    batch: RolloutBatch,
    scores: TeacherScores,
    mask_NT: torch.Tensor,
    student_ids_NTK: torch.Tensor | None = None,
    old_logprobs_NT: torch.Tensor | None = None,
    policy_logprobs_NT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss (N, T) of ``cfg.objective.objective`` (gradients to the student only) and the
    student's response hidden states (N, T, D) it was computed from (for diagnostics)."""
    objective = lookup(cfg.objective.objective)
    h = response_hidden(student, batch)
    t_h = t_W = None
    if FULL in objective.needs(cfg.objective):
        t_h, t_W = teacher.hidden_and_head(batch)
    x = ObjectiveInputs(
        hidden_NTD=h,
        head_VD=model_head(student),
        response_ids_NT=batch.response_ids_NT,
        behaviour_logprobs_NT=batch.logprobs_NT,
        action_mask_NT=cast(torch.Tensor, batch.action_mask_NT),
        mask_NT=mask_NT,
        teacher_topk_ids_NTK=scores.topk_ids_NTK,
        teacher_topk_logprobs_NTK=scores.topk_logprobs_NTK,
        teacher_sampled_logprobs_NT=scores.sampled_logprobs_NT,
        teacher_query_logprobs_NTQ=scores.query_logprobs_NTQ,
        student_topk_ids_NTQ=student_ids_NTK,
        old_logprobs_NT=old_logprobs_NT,
        policy_logprobs_NT=policy_logprobs_NT,
        teacher_hidden_NTE=t_h,
        teacher_head_VE=t_W,
    )
    return objective.loss(x, cfg.objective, cfg.optimizer), h

"""From a rollout batch and the teacher's scores to one differentiable loss, per objective.

This is the glue between the models and the pure losses of :mod:`opd.losses`:

* ``lsm``: support (teacher top-K by default, or any kind of :func:`opd.losses.build_support`),
  then :func:`~opd.losses.local_support_kl_from_hidden` -- the student's (N, T, V) logits are never
  built. ``renormalize=False`` (the ablation) needs full-vocabulary student probabilities and so
  builds them. ``tail`` adds a bucket for the mass outside the support
  (:func:`~opd.losses.local_support_kl_tail_from_hidden`, the student's head a chunk at a time).
* ``sampled``: sampled-token OPD, r_t = log q(y_t) - log p(y_t) with the discounted reward-to-go
  and a policy-gradient surrogate (importance-ratio clipping when a batch is reused).
* ``full_kl``: dense reverse or forward KL over the whole vocabulary, from both models' hidden
  states a chunk of positions at a time (:func:`~opd.losses.full_vocab_kl_from_hidden`).

The loss mask is the action mask (the tokens the model sampled; environment and template tokens
of multi-turn episodes are context, never trained) minus, when ``mask_special`` is on, the
positions whose sampled token is special (EOS, ``<think>``, ``</think>``, template markers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opd import losses as L
from opd.config import TrainConfig
from opd.models.loading import head_weight
from opd.rollout.sampling import RolloutBatch
from opd.teachers.base import TeacherScores, response_hidden

NEEDS_STUDENT_TOPK = ("student_topk", "union", "intersection", "symmetric_difference")


def loss_mask(batch: RolloutBatch, special_ids: list[int], mask_special: bool) -> torch.Tensor:
    mask = batch.action_mask_NT.clone()
    if mask_special and special_ids:
        mask &= ~L.special_token_mask(batch.response_ids_NT, special_ids)
    return mask


def scored_loss_mask(mask_NT: torch.Tensor, scores: TeacherScores) -> torch.Tensor:
    """The loss mask without the positions the teacher did not score (``scores.position_mask_NT``:
    a cross-tokenizer teacher's unaligned positions). Their share of the loss positions is recorded
    in ``scores.metrics`` as ``cross/dropped``, so it is logged with the step."""
    if scores.position_mask_NT is None:
        return mask_NT
    kept_NT = mask_NT & scores.position_mask_NT
    scores.metrics["cross/dropped"] = float((mask_NT & ~kept_NT).sum()) / max(int(mask_NT.sum()), 1)
    return kept_NT


@torch.no_grad()
def student_topk_ids(student, batch: RolloutBatch, k: int) -> torch.Tensor:
    """The student's own top-K at each response position (for student-side supports)."""
    h = response_hidden(student, batch)
    return L.topk_from_hidden(h, head_weight(student), k)[0]


def support_with_teacher_logprobs(
    cfg: TrainConfig, batch: RolloutBatch, scores: TeacherScores, student_ids_NTK: torch.Tensor | None
):
    """Support ids, validity mask and the teacher's log-probs on every slot."""
    ids, smask = L.build_support(cfg.support, scores.topk_ids_NTK, student_ids_NTK, batch.response_ids_NT)
    t = scores.topk_logprobs_NTK
    if cfg.support == "student_topk":
        t_lp = scores.query_logprobs_NTQ
    elif cfg.support in ("union", "symmetric_difference"):
        t_lp = torch.cat([t, scores.query_logprobs_NTQ], dim=-1)
    elif cfg.support == "teacher_topk_plus_sampled":
        t_lp = torch.cat([t, scores.sampled_logprobs_NT.unsqueeze(-1)], dim=-1)
    else:  # teacher_topk, intersection: the support slots are the teacher's own top-K
        t_lp = t
    return ids, smask, t_lp


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss (N, T) of ``cfg.objective`` (gradients to the student only) and the
    student's response hidden states (N, T, D) it was computed from (for diagnostics)."""
    h = response_hidden(student, batch)
    W = head_weight(student)
    if cfg.objective == "lsm":
        ids, smask, t_lp = support_with_teacher_logprobs(cfg, batch, scores, student_ids_NTK)
        if cfg.tail:
            return L.local_support_kl_tail_from_hidden(h, W, ids, t_lp, mask_NT, support_mask=smask), h
        if cfg.renormalize:
            return L.local_support_kl_from_hidden(h, W, ids, t_lp, mask_NT, support_mask=smask), h
        return L.local_support_kl(h @ W.T, ids, t_lp, mask_NT, renormalize=False, support_mask=smask), h
    if cfg.objective == "sampled":
        logp = L.token_logprobs_from_hidden(h, W, batch.response_ids_NT)
        adv = L.sampled_token_advantages(
            batch.logprobs_NT, scores.sampled_logprobs_NT, mask_NT, cfg.gamma, action_mask_BT=batch.action_mask_NT
        )
        clip = cfg.clip_eps if old_logprobs_NT is not None else None
        return L.sampled_token_pg_loss(logp, adv, mask_NT, old_logprobs_NT, clip), h
    t_h_NTE, t_W_VE = teacher.hidden_and_head(batch)
    return L.full_vocab_kl_from_hidden(h, W, t_h_NTE, t_W_VE, mask_NT, cfg.kl_direction, chunk_size=256), h

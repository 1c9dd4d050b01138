"""Top-K of a distribution (from logits or from hidden states) and the LSM support sets.

:func:`topk_from_hidden` serves the teacher (its top-K is LSM's default support) and the student
(its top-K for the ``student_topk`` / ``union`` / ... supports of :func:`build_support`) alike;
``teacher_topk_from_hidden`` is the same function under its old name. :func:`teacher_topk` is
the from-logits form. None of them builds an autograd graph: supports and teacher log-probs are
constants of the loss.
"""

from __future__ import annotations

from typing import overload

import torch

from opd.losses._common import check_k, chunk_buffers, compute_dtype, position_chunks
from opd.losses.head import HeadLike, as_head, cast_bias, chunk_logits, head_dtype

SUPPORT_KINDS = (
    "teacher_topk",
    "student_topk",
    "union",
    "intersection",
    "symmetric_difference",
    "teacher_topk_plus_sampled",
)


@torch.no_grad()
def teacher_topk(
    teacher_logits_BTV: torch.Tensor, k: int, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's K most probable tokens and their full-vocabulary log-probabilities.

    Shapes:
        teacher_logits_BTV: (B, T, V)
        returns ids_BTK (B, T, K) int64 and logprobs_BTK (B, T, K), sorted descending.

    With ``chunk_size`` the positions are processed in chunks, so the extra memory is
    O(chunk_size * V) instead of O(B * T * V).
    """
    B, T, V = teacher_logits_BTV.shape
    check_k(k, V)
    dtype = compute_dtype(teacher_logits_BTV)
    flat_NV = teacher_logits_BTV.reshape(B * T, V)
    ids_NK = torch.empty(B * T, k, dtype=torch.long, device=flat_NV.device)
    lp_NK = torch.empty(B * T, k, dtype=dtype, device=flat_NV.device)
    for sl in position_chunks(B * T, chunk_size):
        chunk = flat_NV[sl].to(dtype)
        top_vals, top_ids = chunk.topk(k, dim=-1)
        lp_NK[sl] = top_vals - torch.logsumexp(chunk, dim=-1, keepdim=True)
        ids_NK[sl] = top_ids
    return ids_NK.view(B, T, k), lp_NK.view(B, T, k)


@torch.no_grad()
def topk_from_hidden(
    hidden_BTD: torch.Tensor, lm_head_weight_VD: HeadLike, k: int, chunk_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K ids and log-probs of ``softmax(head(hidden))``, a chunk of logits at a time.

    ``lm_head_weight_VD``: the model's :class:`~opd.losses.Head` (bias, scale, soft-cap) or a plain
    (V, D) weight (logits = hidden @ W.T).

    :func:`teacher_topk` of ``hidden @ W.T`` for any model, teacher or student, without holding
    more than one chunk's (chunk_size, V) logits. ``teacher_topk_from_hidden`` is an alias kept
    for existing callers.

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D)
        returns ids_BTK (B, T, K) int64 and logprobs_BTK (B, T, K), sorted descending.
    """
    ids, logprobs, _ = topk_and_gather_from_hidden(hidden_BTD, lm_head_weight_VD, k, None, chunk_size)
    return ids, logprobs


# The old name, from when only the teacher's top-K came from hidden states; same function.
teacher_topk_from_hidden = topk_from_hidden


@overload
def topk_and_gather_from_hidden(
    hidden_BTD: torch.Tensor,
    lm_head_weight_VD: HeadLike,
    k: int,
    query_ids_BTQ: torch.Tensor,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def topk_and_gather_from_hidden(
    hidden_BTD: torch.Tensor,
    lm_head_weight_VD: HeadLike,
    k: int,
    query_ids_BTQ: None = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, None]: ...


@torch.no_grad()
def topk_and_gather_from_hidden(
    hidden_BTD: torch.Tensor,
    lm_head_weight_VD: HeadLike,
    k: int,
    query_ids_BTQ: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One pass over the head: top-K ids and log-probs, plus the log-probs of ``query_ids``.

    A teacher needs both (its top-K for the support, and its log-prob of the student's sampled
    or top-K tokens); computing them from the same chunk of logits halves the head's cost. The
    logits are the head's own (:class:`~opd.losses.Head`: bias, scale and soft-cap applied).

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D) or a Head; query_ids_BTQ: (B, T, Q)
        returns ids_BTK, logprobs_BTK (sorted descending) and query_logprobs_BTQ (or None).
    """
    head = as_head(lm_head_weight_VD)
    B, T, D = hidden_BTD.shape
    check_k(k, head.vocab)
    dtype = head_dtype(head, hidden_BTD)
    W_VD, b_V = head.weight_VD, cast_bias(head, dtype)  # the weight: cast a block at a time (chunk_logits)
    flat_ND = hidden_BTD.reshape(B * T, D)
    buf = chunk_buffers(1, B * T, chunk_size, head.vocab, dtype, flat_ND.device)[0]
    ids_NK = torch.empty(B * T, k, dtype=torch.long, device=flat_ND.device)
    lp_NK = torch.empty(B * T, k, dtype=dtype, device=flat_ND.device)
    query_NQ = None if query_ids_BTQ is None else query_ids_BTQ.reshape(B * T, -1)
    q_lp_NQ = None if query_NQ is None else torch.empty(query_NQ.shape, dtype=dtype, device=flat_ND.device)
    for sl in position_chunks(B * T, chunk_size):
        logits_cV = chunk_logits(flat_ND[sl].to(dtype), W_VD, b_V, head, buf[: sl.stop - sl.start])
        log_z = torch.logsumexp(logits_cV, dim=-1, keepdim=True)
        top_vals, top_ids = logits_cV.topk(k, dim=-1)
        lp_NK[sl] = top_vals - log_z
        ids_NK[sl] = top_ids
        if query_NQ is not None and q_lp_NQ is not None:  # both or neither
            q_lp_NQ[sl] = logits_cV.gather(-1, query_NQ[sl]) - log_z
    q_out = None if query_ids_BTQ is None or q_lp_NQ is None else q_lp_NQ.view(*query_ids_BTQ.shape)
    return ids_NK.view(B, T, k), lp_NK.view(B, T, k), q_out


def _member(ids_BTM: torch.Tensor, pool_BTK: torch.Tensor) -> torch.Tensor:
    """True where ids_BTM[..., m] occurs anywhere in pool_BTK[...] (same position)."""
    return (ids_BTM.unsqueeze(-1) == pool_BTK.unsqueeze(-2)).any(-1)


def build_support(
    kind: str,
    teacher_ids_BTK: torch.Tensor,
    student_ids_BTK: torch.Tensor | None = None,
    sampled_ids_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The support set S at each position, as ids plus a validity mask.

    ``kind`` is one of :data:`SUPPORT_KINDS`: ``teacher_topk`` (LSM's default), ``student_topk``
    (Top-k OPD of arXiv:2604.13016), ``union``, ``intersection`` (the overlap tokens),
    ``symmetric_difference`` (the non-overlap tokens) and ``teacher_topk_plus_sampled`` (the
    augmented support). Invalid slots still hold a real vocabulary id, so they are safe to gather;
    valid slots never repeat an id.

    Shapes:
        teacher_ids_BTK: (B, T, K); student_ids_BTK: (B, T, K); sampled_ids_BT: (B, T)
        returns ids_BTM (B, T, M) int64 and support_mask_BTM (B, T, M) bool, with M = K
        (teacher_topk, student_topk, intersection), 2K (union, symmetric_difference) or K + 1.
    """
    if kind not in SUPPORT_KINDS:
        raise ValueError(f"unknown support kind {kind!r}; choose one of {', '.join(SUPPORT_KINDS)}")

    t_ids = teacher_ids_BTK
    if kind == "teacher_topk":
        return t_ids, torch.ones_like(t_ids, dtype=torch.bool)
    if kind == "teacher_topk_plus_sampled":
        if sampled_ids_BT is None:
            raise ValueError("support kind 'teacher_topk_plus_sampled' needs the sampled ids (sampled_ids_BT)")
        sampled_BT1 = sampled_ids_BT.unsqueeze(-1).to(t_ids.dtype)
        ids = torch.cat([t_ids, sampled_BT1], dim=-1)
        mask = torch.cat([torch.ones_like(t_ids, dtype=torch.bool), ~_member(sampled_BT1, t_ids)], -1)
        return ids, mask
    # The other kinds (student_topk, union, intersection, symmetric_difference) read the student's top-K.
    if student_ids_BTK is None:
        raise ValueError(f"support kind {kind!r} needs the student's top-K ids (student_ids_BTK)")
    if kind == "student_topk":
        return student_ids_BTK, torch.ones_like(student_ids_BTK, dtype=torch.bool)
    if kind == "intersection":
        return t_ids, _member(t_ids, student_ids_BTK)
    if kind == "union":
        ids = torch.cat([t_ids, student_ids_BTK], dim=-1)
        mask = torch.cat([torch.ones_like(t_ids, dtype=torch.bool), ~_member(student_ids_BTK, t_ids)], -1)
        return ids, mask
    # symmetric_difference
    ids = torch.cat([t_ids, student_ids_BTK], dim=-1)
    mask = torch.cat([~_member(t_ids, student_ids_BTK), ~_member(student_ids_BTK, t_ids)], -1)
    return ids, mask

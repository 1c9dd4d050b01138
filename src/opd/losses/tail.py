"""LSM with a tail bucket: KL over a truncated support S plus one category for the mass outside S.

Renormalizing over the teacher's top-K (LSM) makes every token outside S free: the student's mass
there carries no loss and can drift. The tail bucket (TRL's ``loss_add_tail``, SDPO's
``distillation_add_tail``, OpenClaw-RL) compares K + 1 categories per position instead: the valid
slots of S, with each model's full-vocabulary probability (not renormalized), and one bucket with
each model's mass outside S, p_tail = 1 - sum_S p and q_tail = 1 - sum_S q. The loss is
KL(p || q) (``direction="reverse"``) or KL(q || p) (``"forward"``) over those categories.

The student's full-vocabulary log-probs need its log-normalizer over the whole vocabulary, so
unlike renormalized LSM this costs a pass over the head: :func:`local_support_kl_tail_from_hidden`
computes it a chunk of positions at a time (forward, and again in the backward), never forming
(B, T, V) logits. The teacher's K log-probs must already be normalized over its full vocabulary
(as :func:`~opd.losses.topk_from_hidden` and vLLM's ``prompt_logprobs`` give them).

Stability: log(1 - e^x) is Maechler's log(-expm1(x)) for x > -ln 2, else log1p(-e^x). The
support's log-mass x = logsumexp_S is clamped to at most ``LOG_MASS_CAP`` = -1e-7 (TRL's value),
so a support that holds all the mass (K = V, or rounding that sums it past 1) leaves a tail of
about 1e-7, whose log (about -16) and gradient are finite; where the clamp acts, nothing flows
back through the tail. The price is that the K + 1 masses can sum to 1 + 1e-7, so the loss can
dip to about -1e-7 instead of 0.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from opd.losses._common import (
    NEG_INF,
    as_bool,
    chunk_buffers,
    compute_dtype,
    head_for_grad_h,
    position_chunks,
)
from opd.losses.full_vocab import _check_direction
from opd.losses.head import Head, HeadLike, as_head, chunk_logits, head_dtype, raw_grad_

LOG_MASS_CAP = -1e-7
_LN2 = math.log(2.0)


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= LOG_MASS_CAP or -inf, accurate in both regimes (Maechler 2012).

    Each branch sees only the inputs it is accurate on (the other gets a harmless -1), so
    neither can feed an inf or NaN into the gradient of ``torch.where``.
    """
    near_zero = x > -_LN2
    a = torch.log(-torch.expm1(torch.where(near_zero, x, torch.full_like(x, -1.0))))
    b = torch.log1p(-torch.exp(torch.where(near_zero, torch.full_like(x, -1.0), x)))
    return torch.where(near_zero, a, b)


def _log_mass(logp_NK: torch.Tensor) -> torch.Tensor:
    """logsumexp over slots, -inf for a row with no mass, with no NaN in its gradient.

    torch.logsumexp back-propagates exp(-inf - -inf) = NaN on an all -inf row, so such rows are
    kept out of the log.
    """
    top = logp_NK.detach().amax(-1)
    has = torch.isfinite(top)
    top = torch.where(has, top, torch.zeros_like(top))
    total = (logp_NK - top.unsqueeze(-1)).exp().sum(-1)
    safe = torch.where(has, total, torch.ones_like(total))
    return torch.where(has, top + safe.log(), torch.full_like(total, NEG_INF))


def _tail_kl_terms(
    z_NK: torch.Tensor,
    lse_N: torch.Tensor,
    t_logprobs_NK: torch.Tensor,
    valid_NK: torch.Tensor,
    active_N: torch.Tensor,
    reverse: bool,
) -> torch.Tensor:
    """The K + 1 category KL per row from the student's support logits and log-normalizer.

    A slot is in S when valid and of finite teacher log-prob; any other slot's student mass is
    tail mass. Rows that do not count (inactive, S empty, or a student with no finite logit) are
    neutralised before any log/exp, so they are exactly 0 with zero gradient. A slot term counts
    where the student's log-prob is finite: 0 log 0 = 0 in the reverse KL, and in the forward KL
    a teacher slot the student gives no mass (an infinite term) is left out, as in full_vocab.
    """
    in_s = valid_NK & torch.isfinite(t_logprobs_NK)
    row_ok = active_N & in_s.any(-1) & torch.isfinite(lse_N)
    in_s = in_s & row_ok.unsqueeze(-1)
    lse = torch.where(row_ok, lse_N, torch.zeros_like(lse_N))
    # Full-vocabulary log-probs on S (not renormalized); -inf on the other slots.
    logp = torch.where(in_s, z_NK, torch.full_like(z_NK, NEG_INF)) - lse.unsqueeze(-1)
    logq = torch.where(in_s, t_logprobs_NK, torch.full_like(t_logprobs_NK, NEG_INF))
    logp_tail = _log1m_exp(_log_mass(logp).clamp(max=LOG_MASS_CAP))
    logq_tail = _log1m_exp(_log_mass(logq).clamp(max=LOG_MASS_CAP))
    counted = in_s & torch.isfinite(logp)
    lp = torch.where(counted, logp, torch.zeros_like(logp))
    lq = torch.where(counted, logq, torch.zeros_like(logq))
    if reverse:
        w_NK = torch.where(counted, lp.exp(), torch.zeros_like(lp))
        kl = (w_NK * (lp - lq)).sum(-1) + logp_tail.exp() * (logp_tail - logq_tail)
    else:
        w_NK = torch.where(counted, lq.exp(), torch.zeros_like(lq))
        kl = (w_NK * (lq - lp)).sum(-1) + logq_tail.exp() * (logq_tail - logp_tail)
    return torch.where(row_ok, kl, torch.zeros_like(kl))


def local_support_kl_tail(
    student_logits_BTV: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    support_mask: torch.Tensor | None = None,
    direction: str = "reverse",
) -> torch.Tensor:
    """KL over the support's slots plus a tail bucket (the module docstring), from logits.

    ``reverse``: KL(p || q), ``forward``: KL(q || p), p the student, q the teacher, over the K + 1
    categories (each valid slot's full-vocabulary probability, and the mass outside S). A slot
    is in S when ``support_mask`` is true and the teacher's log-prob is finite; a slot of teacher
    log-prob -inf is outside the teacher's support, so the student's mass on it counts in the
    student's tail. Valid slots must hold distinct ids (as :func:`~opd.losses.build_support`
    gives). ``teacher_logprobs_BTK`` must be normalized over the teacher's full vocabulary: its
    tail is 1 minus their sum. A student logit of -inf on a slot of S contributes 0 to the
    reverse KL (0 log 0 = 0) and is left out of the forward KL (an infinite term, the rule of
    :func:`~opd.losses.full_vocab_kl`, so that sum can then fall below 0). Positions where
    ``mask_BT`` is false, where S is empty or where the student has no finite logit are exactly 0
    with zero gradient. Gradients reach only ``student_logits_BTV``.

    Shapes:
        student_logits_BTV: (B, T, V)
        support_ids_BTK, teacher_logprobs_BTK, support_mask: (B, T, K)
        mask_BT: (B, T)
        returns kl_BT: (B, T)
    """
    _check_direction(direction)
    dtype = compute_dtype(student_logits_BTV, teacher_logprobs_BTK)
    valid = torch.ones_like(support_ids_BTK, dtype=torch.bool) if support_mask is None else as_bool(support_mask)
    logits = student_logits_BTV.to(dtype)
    # A row of -inf logits is no distribution: kept out of logsumexp (whose gradient would be NaN).
    has_mass = torch.isfinite(logits).any(-1)
    lse = torch.logsumexp(torch.where(has_mass.unsqueeze(-1), logits, torch.zeros_like(logits)), dim=-1)
    lse = torch.where(has_mass, lse, torch.full_like(lse, NEG_INF))
    z = logits.gather(-1, support_ids_BTK)
    t_lp = teacher_logprobs_BTK.detach().to(dtype)
    return _tail_kl_terms(z, lse, t_lp, valid, as_bool(mask_BT), direction == "reverse")


class SupportLogitsAndNormalizer(torch.autograd.Function):
    """The support logits z[a, k] = head(h[rows[a]])[ids[a, k]] and the log-normalizer
    lse[a] = logsumexp_v head(h[rows[a]])[v], one chunk of (chunk, V) logits at a time.

    The backward recomputes each chunk's logits: dz_v = g_lse softmax_v plus g_z at the support
    ids, taken back through the head's cap and scale (:func:`~opd.losses.head.raw_grad_`), then
    grad_h = du @ W, grad_W += du.T @ h (addmm_ into one (V, D) buffer) and grad_b += sum du.
    Rows whose upstream gradients are all zero are skipped. Two (chunk, V) buffers are reused.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden_ND: torch.Tensor,
        weight_VD: torch.Tensor,
        bias_V: torch.Tensor | None,
        head: Head,
        rows_A: torch.Tensor,
        ids_AK: torch.Tensor,
        dtype: torch.dtype,
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w, b = weight_VD.to(dtype), None if bias_V is None else bias_V.to(dtype)
        A, K = ids_AK.shape
        z_AK = torch.empty(A, K, dtype=dtype, device=hidden_ND.device)
        lse_A = torch.empty(A, dtype=dtype, device=hidden_ND.device)
        buf = chunk_buffers(1, A, chunk_size, w.shape[0], dtype, hidden_ND.device)[0]
        for sl in position_chunks(A, chunk_size):
            logits = chunk_logits(hidden_ND[rows_A[sl]].to(dtype), w, b, head, buf[: sl.stop - sl.start])
            z_AK[sl] = logits.gather(-1, ids_AK[sl])
            top = logits.amax(-1, keepdim=True)
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # an all -inf row: lse -inf
            lse_A[sl] = logits.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, rows_A, ids_AK, lse_A)
        ctx.chunk_size, ctx.head = chunk_size, head
        return z_AK, lse_A

    @staticmethod
    @once_differentiable  # the backward writes into a reused buffer; no graph of it is needed
    def backward(
        ctx: Any, grad_z_AK: torch.Tensor | None, grad_lse_A: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        hidden_ND, weight_VD, bias_V, rows_A, ids_AK, lse_A = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = lse_A.dtype
        w, b = weight_VD.to(dtype), None if bias_V is None else bias_V.to(dtype)
        grad_h = torch.zeros(hidden_ND.shape, dtype=dtype, device=hidden_ND.device) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=dtype, device=w.device) if need_w else None
        grad_b = torch.zeros(w.shape[0], dtype=dtype, device=w.device) if need_b else None
        g_z = torch.zeros_like(ids_AK, dtype=dtype) if grad_z_AK is None else grad_z_AK.to(dtype)
        g_lse = torch.zeros_like(lse_A) if grad_lse_A is None else grad_lse_A.to(dtype)
        keep = ((g_lse != 0) | (g_z != 0).any(-1)).nonzero().squeeze(-1)
        w_h = head_for_grad_h(w) if need_h else w
        bufs = chunk_buffers(2, keep.numel(), ctx.chunk_size, w.shape[0], dtype, hidden_ND.device)
        for sl in position_chunks(keep.numel(), ctx.chunk_size):
            a = keep[sl]
            r = rows_A[a]
            h_cD = hidden_ND[r].to(dtype)
            z = chunk_logits(h_cD, w, b, ctx.head, bufs[0, : a.numel()])
            dz = torch.sub(z, lse_A[a].unsqueeze(-1), out=bufs[1, : a.numel()]).exp_()
            dz.mul_(g_lse[a].unsqueeze(-1)).scatter_add_(-1, ids_AK[a], g_z[a])
            raw_grad_(dz, z, ctx.head)
            if grad_h is not None:  # need_h
                grad_h[r] = dz @ w_h
            if grad_w is not None:  # need_w
                grad_w.addmm_(dz.T, h_cD)
            if grad_b is not None:  # need_b
                grad_b.add_(dz.sum(0))
        grad_h = None if grad_h is None else grad_h.to(hidden_ND.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight_VD.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias_V.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def local_support_kl_tail_from_hidden(
    hidden_BTD: torch.Tensor,
    lm_head_weight_VD: HeadLike,
    support_ids_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    support_mask: torch.Tensor | None = None,
    direction: str = "reverse",
    chunk_size: int | None = 128,
) -> torch.Tensor:
    """:func:`local_support_kl_tail` of the head's logits without forming the (B, T, V) logits.

    ``lm_head_weight_VD`` is the model's :class:`~opd.losses.Head` (bias, scale, soft-cap) or a plain
    (V, D) weight (logits = hidden @ W.T).

    The tail needs the student's full-vocabulary log-normalizer, so each unmasked position's
    logits are computed, ``chunk_size`` positions at a time (None: all at once), in the forward
    and again in the backward: about the cost of sampled-token OPD's log-probs (four (chunk, V)
    GEMMs per chunk), more than renormalized LSM from hidden (K logits per position) and less
    than full-vocabulary KL (which also runs the teacher's head). The extra memory is one
    (chunk_size, V) buffer in the compute dtype (two in the backward) plus the head's gradient.
    Values and gradients (of hidden, weight and bias) equal
    ``local_support_kl_tail(head.logits(hidden), ...)``; where the head holds -inf entries the
    hidden states get a finite gradient (see :func:`~opd.losses.full_vocab_kl_from_hidden`). An
    all-masked batch still returns a tensor connected to hidden and weight, with zero gradients.

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D) or a Head
        support_ids_BTK, teacher_logprobs_BTK, support_mask: (B, T, K)
        mask_BT: (B, T)
        returns kl_BT: (B, T)
    """
    _check_direction(direction)
    head = as_head(lm_head_weight_VD)
    B, T, D = hidden_BTD.shape
    K = support_ids_BTK.shape[-1]
    dtype = head_dtype(head, hidden_BTD, teacher_logprobs_BTK)
    valid = torch.ones_like(support_ids_BTK, dtype=torch.bool) if support_mask is None else as_bool(support_mask)
    # Only unmasked positions are computed: padding and prompt cost nothing.
    active = as_bool(mask_BT).reshape(-1).nonzero().squeeze(-1)
    ids_AK = support_ids_BTK.reshape(B * T, K)[active]
    # torch's Function.apply is unannotated, hence the ignore
    z_AK, lse_A = SupportLogitsAndNormalizer.apply(  # type: ignore[no-untyped-call]
        hidden_BTD.reshape(B * T, D), head.weight_VD, head.bias_V, head, active, ids_AK, dtype, chunk_size
    )
    t_lp_AK = teacher_logprobs_BTK.detach().reshape(B * T, K)[active].to(dtype)
    everyone = torch.ones(active.numel(), dtype=torch.bool, device=hidden_BTD.device)
    kl_A = _tail_kl_terms(z_AK, lse_A, t_lp_AK, valid.reshape(B * T, K)[active], everyone, direction == "reverse")
    kl_flat = torch.zeros(B * T, dtype=dtype, device=hidden_BTD.device)
    return kl_flat.index_put((active,), kl_A).view(B, T)

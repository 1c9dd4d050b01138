"""Local support matching (LSM, arXiv:2603.25562): reverse KL on a local support, renormalized.

At each position take a support S (by default the teacher's top-K tokens, see
:func:`opd.losses.build_support`), renormalize the student and the teacher over S and take
KL(student_hat || teacher_hat). ``renormalize=False`` is the paper's ablation (truncated,
unnormalized masses) that collapses in training.

:func:`local_support_kl_from_hidden` departs from the paper's implementation in how, not what:
renormalization cancels the student's full-vocabulary normalizer, so only the K logits
``h_t . W[v]`` (v in S) are computed, with a hand-written backward, and no (B, T, V) tensor
exists. The supports may have invalid slots (``support_mask``), which the paper's fixed top-K
does not need.
"""

from __future__ import annotations

from typing import Any

import torch

from opd.losses._common import NEG_INF, as_bool, compute_dtype, position_chunks
from opd.losses._row_kernels import support_logits, weighted_rows
from opd.losses.head import Head, HeadLike, as_head, head_dtype, raw_grad_, transform_
from opd.losses.tail import SupportLogitsAndNormalizer


def _support_kl_terms(
    s_logits_NK: torch.Tensor, t_logprobs_NK: torch.Tensor, valid_NK: torch.Tensor, active_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Renormalized KL over valid slots, with the slot probabilities and log-probs behind it.

    Returns (kl_N, p_NK, q_NK, logp_NK, logq_NK); slots that do not count hold p = q = logp = logq = 0.

    Rows that do not count (inactive, no valid slot, or a student with no finite logit on the
    support) are neutralised *before* any log/exp, so neither the value nor the gradient can
    pick up a NaN from ``0 * inf``.
    """
    valid = valid_NK & torch.isfinite(t_logprobs_NK)
    s = s_logits_NK.masked_fill(~valid, NEG_INF)
    row_ok = active_N & (valid & torch.isfinite(s)).any(-1)
    s = torch.where(row_ok.unsqueeze(-1), s, torch.zeros_like(s))
    t = torch.where(row_ok.unsqueeze(-1) & valid, t_logprobs_NK, torch.full_like(t_logprobs_NK, NEG_INF))
    t = torch.where(row_ok.unsqueeze(-1), t, torch.zeros_like(t))
    logp = torch.log_softmax(s, dim=-1)
    logq = torch.log_softmax(t, dim=-1)
    counted = row_ok.unsqueeze(-1) & torch.isfinite(logp) & torch.isfinite(logq)
    logp_safe = torch.where(counted, logp, torch.zeros_like(logp))
    logq_safe = torch.where(counted, logq, torch.zeros_like(logq))
    p = torch.where(counted, logp_safe.exp(), torch.zeros_like(logp))
    q = torch.where(counted, logq_safe.exp(), torch.zeros_like(logq))
    return (p * (logp_safe - logq_safe)).sum(-1), p, q, logp_safe, logq_safe


def _mixed_kl(
    kl_N: torch.Tensor,
    p_NK: torch.Tensor,
    q_NK: torch.Tensor,
    logp_NK: torch.Tensor,
    logq_NK: torch.Tensor,
    share: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 - share) KL(p||q) + share KL(q||p) over the counted slots, and its gradient wrt the support
    logits: reverse KL's is p_j (log p_j - log q_j - KL), forward KL's p_j (sum q) - q_j, the
    softmax Jacobian of d/dp_j = -q_j / p_j. Reverse KL's pull on a slot scales with the student's
    own p_j; forward KL's does not, so a token the student has all but dropped is still pulled up."""
    d_rev = p_NK * (logp_NK - logq_NK - kl_N.unsqueeze(-1))
    if not share:
        return kl_N, d_rev
    fkl_N = (q_NK * (logq_NK - logp_NK)).sum(-1)
    d_fwd = p_NK * q_NK.sum(-1, keepdim=True) - q_NK
    return (1 - share) * kl_N + share * fkl_N, (1 - share) * d_rev + share * d_fwd


def local_support_kl(
    student_logits_BTV: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    renormalize: bool = True,
    support_mask: torch.Tensor | None = None,
    forward_share: float = 0.0,
) -> torch.Tensor:
    """Truncated reverse KL of the student to the teacher over a local support S.

    ``renormalize=True`` (LSM): p_hat = softmax(student logits on S), q_hat = softmax(teacher
    log-probs on S), KL(p_hat || q_hat). ``renormalize=False`` (the ablation): full-vocabulary
    student probabilities truncated to S, sum over S of p (log p - log q). ``forward_share`` b
    (renormalized only): (1 - b) KL(p_hat || q_hat) + b KL(q_hat || p_hat).

    A slot counts when ``support_mask`` is true and the teacher's log-prob is finite (a token of
    teacher probability 0 is outside the teacher's support). A student logit of -inf contributes
    0 (0 log 0 = 0). Positions where ``mask_BT`` is false, or with nothing left to compare, are
    exactly 0 with zero gradient. Gradients reach only ``student_logits_BTV``.

    Shapes:
        student_logits_BTV: (B, T, V)
        support_ids_BTK, teacher_logprobs_BTK, support_mask: (B, T, K)
        mask_BT: (B, T)
        returns kl_BT: (B, T)
    """
    dtype = compute_dtype(student_logits_BTV, teacher_logprobs_BTK)
    mask = as_bool(mask_BT)
    valid = torch.ones_like(support_ids_BTK, dtype=torch.bool) if support_mask is None else as_bool(support_mask)
    t_lp = teacher_logprobs_BTK.detach().to(dtype)
    if renormalize:
        # Only the K support logits are read: gathered before the cast, so bfloat16 logits are never
        # copied whole to float32 (2.5 GB at T=4096 and a 151,936-token vocabulary, and its gradient).
        s_K = student_logits_BTV.gather(-1, support_ids_BTK).to(dtype)
        kl, p, q, logp, logq = _support_kl_terms(s_K, t_lp, valid, mask)
        if not forward_share:
            return kl
        return (1 - forward_share) * kl + forward_share * (q * (logq - logp)).sum(-1)
    if forward_share:
        raise ValueError("forward_share mixes the renormalized divergences: it needs renormalize=True")
    # Without renormalization the student masses come from the full-vocabulary softmax.
    logp_full = torch.log_softmax(student_logits_BTV.to(dtype), dim=-1).gather(-1, support_ids_BTK)
    return _truncated_kl(logp_full, t_lp, valid & mask.unsqueeze(-1))


def _truncated_kl(logp_NK: torch.Tensor, t_logprobs_NK: torch.Tensor, valid_NK: torch.Tensor) -> torch.Tensor:
    """The ablation's sum over valid slots of p (log p - log q), p and q full-vocabulary probabilities (not
    renormalized). A slot with a non-finite log-prob on either side counts 0, and gets no gradient.

    Shapes:
        logp_NK, t_logprobs_NK, valid_NK: (N, K) -> (N,)
    """
    counted = valid_NK & torch.isfinite(t_logprobs_NK) & torch.isfinite(logp_NK)
    logp = torch.where(counted, logp_NK, torch.zeros_like(logp_NK))
    logq = torch.where(counted, t_logprobs_NK, torch.zeros_like(t_logprobs_NK))
    p = torch.where(counted, logp.exp(), torch.zeros_like(logp))
    return (p * (logp - logq)).sum(-1)


class _SupportKLFromHidden(torch.autograd.Function):
    """LSM from hidden states over the active positions ``rows_A``, with an analytic backward.

    The forward stores only dKL/du for the K raw support logits u = h . W[v] + b[v] of each active
    position (the head's scale and cap are folded in, :func:`~opd.losses.head.raw_grad_`). The K
    logits and grad_h come from embedding-bag kernels that read each weight row once, index the
    hidden states in place (no copy of the active rows) and write grad_h at full size directly;
    the weight gradient is accumulated a chunk at a time into one reused buffer, so peak extra
    memory is O(chunk * K * D) rather than O(B * T * K * D).
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
        t_lp_AK: torch.Tensor,
        valid_AK: torch.Tensor,
        chunk_size: int | None,
        forward_share: float,
    ) -> torch.Tensor:
        dtype = compute_dtype(hidden_ND, weight_VD, t_lp_AK, *([] if bias_V is None else [bias_V]))
        everyone = torch.ones(ids_AK.shape[0], dtype=torch.bool, device=hidden_ND.device)
        z_AK = support_logits(hidden_ND, weight_VD, rows_A, ids_AK, dtype, chunk_size)
        if bias_V is not None:
            z_AK += bias_V.to(dtype)[ids_AK]
        transform_(z_AK, head)
        terms = _support_kl_terms(z_AK, t_lp_AK.to(dtype), valid_AK, everyone)
        # slots that do not count have p_j = q_j = 0, so no gradient
        kl_A, dz_AK = _mixed_kl(*terms, share=forward_share)
        raw_grad_(dz_AK, z_AK, head)
        ctx.save_for_backward(hidden_ND, weight_VD, bias_V, rows_A, ids_AK, dz_AK)
        ctx.chunk_size = chunk_size
        return kl_A

    @staticmethod
    def backward(
        ctx: Any, grad_kl_A: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None, None, None]:
        hidden_ND, weight_VD, bias_V, rows_A, ids_AK, dz_AK = ctx.saved_tensors
        dtype = dz_AK.dtype
        g_AK = grad_kl_A.to(dtype).unsqueeze(-1) * dz_AK
        grad_h: torch.Tensor | None = None
        grad_w: torch.Tensor | None = None
        grad_b: torch.Tensor | None = None
        if ctx.needs_input_grad[0]:
            grad_h = weighted_rows(weight_VD, rows_A, ids_AK, g_AK, hidden_ND.shape[0], ctx.chunk_size)
            grad_h = grad_h.to(hidden_ND.dtype)
        if ctx.needs_input_grad[1]:
            A, K = ids_AK.shape
            D = hidden_ND.shape[1]
            grad_w = torch.zeros(weight_VD.shape, dtype=dtype, device=weight_VD.device)
            buf = torch.empty(min(A, ctx.chunk_size or A), K, D, dtype=dtype, device=weight_VD.device)
            for sl in position_chunks(A, ctx.chunk_size):
                n = sl.stop - sl.start
                h_cD = hidden_ND[rows_A[sl]].to(dtype)
                contrib = torch.mul(g_AK[sl].unsqueeze(-1), h_cD.unsqueeze(1), out=buf[:n])
                grad_w.index_add_(0, ids_AK[sl].reshape(-1), contrib.view(n * K, D))
            grad_w = grad_w.to(weight_VD.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = torch.zeros(bias_V.shape, dtype=dtype, device=bias_V.device)
            grad_b = grad_b.index_add_(0, ids_AK.reshape(-1), g_AK.reshape(-1)).to(bias_V.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def local_support_kl_from_hidden(
    hidden_BTD: torch.Tensor,
    lm_head_weight_VD: HeadLike,
    support_ids_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    support_mask: torch.Tensor | None = None,
    chunk_size: int = 128,
    forward_share: float = 0.0,
    renormalize: bool = True,
) -> torch.Tensor:
    """:func:`local_support_kl` (with its ``renormalize`` and ``forward_share``) from the student's final
    hidden states; the (B, T, V) logits are never formed.

    Renormalizing over S cancels the student's full-vocabulary normalizer, so only the K logits
    of S are computed, chunk by chunk over the unmasked positions. ``renormalize=False`` (the
    ablation) needs that normalizer: each unmasked position's logits are computed ``chunk_size``
    positions at a time, in the forward and again in the backward, as
    :func:`~opd.losses.local_support_kl_tail_from_hidden` does. ``lm_head_weight_VD`` is the
    model's :class:`~opd.losses.Head` (the logits are then its own: bias, scale and soft-cap
    applied) or a plain (V, D) weight. Values and gradients (of hidden, weight and bias) equal
    ``local_support_kl(head.logits(hidden), ..., renormalize=renormalize)``.

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D) or a Head
        support_ids_BTK, teacher_logprobs_BTK, support_mask: (B, T, K)
        mask_BT: (B, T)
        returns kl_BT: (B, T)
    """
    head = as_head(lm_head_weight_VD)
    B, T, D = hidden_BTD.shape
    K = support_ids_BTK.shape[-1]
    dtype = head_dtype(head, hidden_BTD, teacher_logprobs_BTK)
    valid = torch.ones_like(support_ids_BTK, dtype=torch.bool) if support_mask is None else as_bool(support_mask)
    # Only unmasked positions are computed: padding and prompt cost nothing.
    active = as_bool(mask_BT).reshape(-1).nonzero().squeeze(-1)
    kl_flat = torch.zeros(B * T, dtype=dtype, device=hidden_BTD.device)
    if not renormalize:
        if forward_share:
            raise ValueError("forward_share mixes the renormalized divergences: it needs renormalize=True")
        ids_AK = support_ids_BTK.reshape(B * T, K)[active]
        # torch's Function.apply is unannotated, hence the ignore
        z_AK, lse_A = SupportLogitsAndNormalizer.apply(  # type: ignore[no-untyped-call]
            hidden_BTD.reshape(B * T, D), head.weight_VD, head.bias_V, head, active, ids_AK, dtype, chunk_size
        )
        t_lp_AK = teacher_logprobs_BTK.detach().reshape(B * T, K)[active].to(dtype)
        kl_A = _truncated_kl(z_AK - lse_A.unsqueeze(-1), t_lp_AK, valid.reshape(B * T, K)[active])
        return kl_flat.index_put((active,), kl_A).view(B, T)
    if active.numel() == 0:
        # Keep the graph connected so callers can always call backward() on the reduced loss.
        return kl_flat.view(B, T) + 0.0 * hidden_BTD.sum(-1).to(dtype)
    # torch's Function.apply is unannotated, hence the ignore
    kl_active = _SupportKLFromHidden.apply(  # type: ignore[no-untyped-call]
        hidden_BTD.reshape(B * T, D),
        head.weight_VD,
        head.bias_V,
        head,
        active,
        support_ids_BTK.reshape(B * T, K)[active],
        teacher_logprobs_BTK.detach().reshape(B * T, K)[active],
        valid.reshape(B * T, K)[active],
        chunk_size,
        float(forward_share),
    )
    return kl_flat.index_put((active,), kl_active).view(B, T)

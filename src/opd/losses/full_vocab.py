"""Dense full-vocabulary divergences: KL in either direction and the generalized JSD.

These are the baselines the OPD papers compare against (full-vocabulary distillation, GKD's
generalized JSD with TRL's beta convention). :func:`full_vocab_kl` and :func:`generalized_jsd`
take both models' (B, T, V) logits. :func:`full_vocab_kl_from_hidden` departs from the usual
implementation, not the objective: it takes both models' final hidden states and heads and never
forms a (B, T, V) tensor of either model, computing one chunk of positions' logits at a time
with a hand-written backward that recomputes them.

Zero-probability tokens follow one rule everywhere here: a term of KL(a || b) counts where
a > 0 and log a - log b is finite. So 0 log 0 = 0, and a token that a puts mass on but b does
not (an infinite term, e.g. a teacher logit of -inf under a student that gives the token mass in
the reverse KL) is left out of the sum rather than making the loss infinite; the gradient is the
gradient of that truncated sum.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from opd.losses._common import (
    NEG_INF,
    as_bool,
    chunk_buffers,
    compute_dtype,
    head_for_grad_h,
    position_chunks,
)
from opd.losses.head import Head, HeadLike, as_head, cast_head, chunk_logits, head_dtype, raw_grad_

# A head's weight and bias in the compute dtype, and the head (its scale and cap): chunk_logits' arguments.
_Parts = tuple[torch.Tensor, torch.Tensor | None, Head]

DIRECTIONS = ("reverse", "forward")


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction={direction!r}; use 'reverse' (KL(student||teacher)) or 'forward'")


def _kl_rows(logp_NV: torch.Tensor, logq_NV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row; 0 log 0 = 0, and terms that are not finite are left out."""
    p = logp_NV.exp()
    diff = torch.where(p > 0, logp_NV - logq_NV, torch.zeros_like(logp_NV))
    diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
    return (p * diff).sum(-1)


def _log_mixture(logq: torch.Tensor, logp: torch.Tensor, beta: float) -> torch.Tensor:
    """log(beta q + (1 - beta) p), -inf where both are 0, with no NaN in its gradient.

    A plain logsumexp back-propagates 0/0 where both inputs are -inf (padded vocabularies), so
    the zero-mass entries are kept out of every log and exp that has a gradient.
    """
    a, b = logq + math.log(beta), logp + math.log(1.0 - beta)
    top = torch.maximum(a, b)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = (a - top).exp() + (b - top).exp()
    positive = total > 0
    safe = torch.where(positive, total, torch.ones_like(total))
    return torch.where(positive, top + safe.log(), torch.full_like(total, NEG_INF))


def _divergence_chunk(
    s_NV: torch.Tensor, t_NV: torch.Tensor, m_N: torch.Tensor, mode: str, beta: float
) -> torch.Tensor:
    logp = torch.log_softmax(s_NV, dim=-1)
    logq = torch.log_softmax(t_NV, dim=-1)
    if mode == "reverse":
        out = _kl_rows(logp, logq)
    elif mode == "forward":
        out = _kl_rows(logq, logp)
    else:
        # Generalized JSD against the mixture m = beta * q + (1 - beta) * p.
        logm = _log_mixture(logq, logp, beta)
        out = beta * _kl_rows(logq, logm) + (1.0 - beta) * _kl_rows(logp, logm)
    return torch.where(m_N, out, torch.zeros_like(out))


def _chunked_divergence(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BTV: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    beta: float,
    chunk_size: int | None,
) -> torch.Tensor:
    B, T, V = student_logits_BTV.shape
    if teacher_logits_BTV.shape != student_logits_BTV.shape:
        raise ValueError(
            f"student logits {tuple(student_logits_BTV.shape)} and teacher logits "
            f"{tuple(teacher_logits_BTV.shape)} differ; both models must share one vocabulary"
        )
    dtype = compute_dtype(student_logits_BTV, teacher_logits_BTV)
    s_NV = student_logits_BTV.reshape(B * T, V)
    t_NV = teacher_logits_BTV.detach().reshape(B * T, V)
    m_N = as_bool(mask_BT).reshape(-1)
    grad_on = torch.is_grad_enabled() and s_NV.requires_grad and chunk_size
    step = chunk_size if chunk_size and chunk_size > 0 else max(B * T, 1)
    pieces: list[torch.Tensor] = []
    # split() rather than slicing: the backward of each slice would allocate a full-size zero
    # gradient, where split's backward concatenates the chunk gradients once.
    for s_cV, t_cV, m_c in zip(s_NV.split(step), t_NV.split(step), m_N.split(step)):
        args = (s_cV.to(dtype), t_cV.to(dtype), m_c, mode, beta)
        # Checkpointing keeps only the chunk's inputs in the graph: one chunk of V-sized
        # intermediates is alive at a time, in the forward and in the backward.
        pieces.append(
            checkpoint(_divergence_chunk, *args, use_reentrant=False) if grad_on else _divergence_chunk(*args)
        )
    return torch.cat(pieces).view(B, T)


def full_vocab_kl(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BTV: torch.Tensor,
    mask_BT: torch.Tensor,
    direction: str = "reverse",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Full-vocabulary KL per position: ``reverse`` KL(p || q) or ``forward`` KL(q || p).

    p is the student, q the teacher (gradients reach only the student). With ``chunk_size``
    positions are processed (and recomputed in the backward) a chunk at a time. Both (B, T, V)
    inputs must exist: :func:`full_vocab_kl_from_hidden` avoids them.

    Shapes:
        student_logits_BTV, teacher_logits_BTV: (B, T, V); mask_BT: (B, T) -> kl_BT: (B, T)
    """
    _check_direction(direction)
    return _chunked_divergence(student_logits_BTV, teacher_logits_BTV, mask_BT, direction, 0.0, chunk_size)


def generalized_jsd(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BTV: torch.Tensor,
    mask_BT: torch.Tensor,
    beta: float = 0.5,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence per position (GKD / TRL convention).

    beta = 0 gives KL(teacher || student), beta = 1 gives KL(student || teacher); otherwise with
    m = beta q + (1 - beta) p: beta KL(q || m) + (1 - beta) KL(p || m).

    Shapes:
        student_logits_BTV, teacher_logits_BTV: (B, T, V); mask_BT: (B, T) -> jsd_BT: (B, T)
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must lie in [0, 1]")
    if beta == 0.0:
        return full_vocab_kl(student_logits_BTV, teacher_logits_BTV, mask_BT, "forward", chunk_size)
    if beta == 1.0:
        return full_vocab_kl(student_logits_BTV, teacher_logits_BTV, mask_BT, "reverse", chunk_size)
    return _chunked_divergence(student_logits_BTV, teacher_logits_BTV, mask_BT, "jsd", beta, chunk_size)


# --------------------------------------------------------------------------- from hidden states


def _chunk_logprobs(
    hs_cD: torch.Tensor, s_head: _Parts, ht_cE: torch.Tensor, t_head: _Parts, bufs_3MV: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both models' log-softmax of one chunk, in reused buffers: (the student's logits, logp_cV, logq_cV).

    The teacher's logits go through the scratch buffer first, so it holds the student's at the end
    (a soft-capped student head's backward needs them)."""
    n = hs_cD.shape[0]
    z, logp, logq = (b[:n] for b in bufs_3MV[:3])
    torch.log_softmax(chunk_logits(ht_cE, *t_head, out=z), dim=-1, out=logq)
    torch.log_softmax(chunk_logits(hs_cD, *s_head, out=z), dim=-1, out=logp)
    return z, logp, logq


def _kl_chunk(logp_cV: torch.Tensor, logq_cV: torch.Tensor, reverse: bool) -> torch.Tensor:
    """:func:`_kl_rows` of (logp, logq) or (logq, logp) per row, overwriting both buffers."""
    a, b = (logp_cV, logq_cV) if reverse else (logq_cV, logp_cV)
    d = torch.sub(a, b, out=b)
    r = a.exp_()
    counted = (r > 0) & torch.isfinite(d)
    return d.masked_fill_(~counted, 0.0).mul_(r).sum(-1)


def _kl_grad_chunk(
    scratch_cV: torch.Tensor, logp_cV: torch.Tensor, logq_cV: torch.Tensor, g_c: torch.Tensor, reverse: bool
) -> torch.Tensor:
    """g * dKL/dz (z: the student's logits) of one chunk, in one of the buffers (all overwritten).

    The gradient of the truncated sum of the module docstring, with C the counted tokens:
      reverse KL(p||q) = sum_C p (log p - log q):  p_j ([j in C](log p_j - log q_j + 1) - S),
                                                  S = sum_C p (log p - log q + 1) = KL + p(C);
      forward KL(q||p) = sum_C q (log q - log p):  p_j q(C) - [j in C] q_j.
    With nothing left out (C = every token of mass) these are p (log p - log q - KL) and p - q.
    """
    if reverse:
        d = torch.sub(logp_cV, logq_cV, out=logq_cV)
        p = logp_cV.exp_()
        counted = (p > 0) & torch.isfinite(d)
        d.masked_fill_(~counted, 0.0).add_(counted)
        s = torch.mul(p, d, out=scratch_cV).sum(-1, keepdim=True)
        return d.sub_(s).mul_(p).mul_(g_c.unsqueeze(-1))
    q = logq_cV.exp_()
    # Where q > 0, log q is finite, so log q - log p is finite exactly where log p is.
    counted = (q > 0) & torch.isfinite(logp_cV)
    q.masked_fill_(~counted, 0.0)
    return logp_cV.exp_().mul_(q.sum(-1, keepdim=True)).sub_(q).mul_(g_c.unsqueeze(-1))


class _FullKLFromHidden(torch.autograd.Function):
    """Full-vocabulary KL over the active rows ``rows_A``, from both models' hidden states and heads.

    Nothing V-sized is saved: the forward and the backward each compute one chunk's student and
    teacher logits at a time (the backward recomputes them, two extra GEMMs per chunk, which is
    the price of never holding (rows, V) logits). The student's logit gradient is taken back
    through its head's cap and scale (:func:`~opd.losses.head.raw_grad_`); the weight gradient
    accumulates into one (V, D) buffer with addmm_ (the bias's into a (V,) one), and rows whose
    upstream gradient is zero are skipped.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hs_ND: torch.Tensor,
        ws_VD: torch.Tensor,
        bs_V: torch.Tensor | None,
        ht_NE: torch.Tensor,
        heads: tuple[Head, Head],
        rows_A: torch.Tensor,
        reverse: bool,
        chunk_size: int | None,
    ) -> torch.Tensor:
        s_head, t_head = heads
        dtype = head_dtype(s_head, hs_ND, ht_NE, *_head_tensors(t_head))
        s_parts, t_parts = (*cast_head(s_head, dtype), s_head), (*cast_head(t_head, dtype), t_head)
        A = rows_A.numel()
        kl_A = torch.empty(A, dtype=dtype, device=hs_ND.device)
        if A:  # no buffers for no rows
            bufs = chunk_buffers(3, A, chunk_size, s_head.vocab, dtype, hs_ND.device)
            for sl in position_chunks(A, chunk_size):
                r = rows_A[sl]
                _, logp, logq = _chunk_logprobs(hs_ND[r].to(dtype), s_parts, ht_NE[r].to(dtype), t_parts, bufs)
                kl_A[sl] = _kl_chunk(logp, logq, reverse)
        ctx.save_for_backward(hs_ND, ws_VD, bs_V, ht_NE, rows_A)
        ctx.heads, ctx.reverse, ctx.chunk_size = heads, reverse, chunk_size
        return kl_A

    @staticmethod
    @once_differentiable  # the backward writes into reused buffers; no graph of it is needed
    def backward(
        ctx: Any, grad_A: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        hs_ND, ws_VD, bs_V, ht_NE, rows_A = ctx.saved_tensors
        s_head, t_head = ctx.heads
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        dtype = head_dtype(s_head, hs_ND, ht_NE, *_head_tensors(t_head))
        s_parts, t_parts = (*cast_head(s_head, dtype), s_head), (*cast_head(t_head, dtype), t_head)
        ws = s_parts[0]
        grad_h = torch.zeros(hs_ND.shape, dtype=dtype, device=hs_ND.device) if need_h else None
        grad_w = torch.zeros(ws.shape, dtype=dtype, device=ws.device) if need_w else None
        grad_b = torch.zeros(ws.shape[0], dtype=dtype, device=ws.device) if need_b else None
        grad_A = grad_A.to(dtype)
        keep = grad_A.nonzero().squeeze(-1)
        ws_h = head_for_grad_h(ws) if need_h else ws
        capped = s_head.softcap is not None
        if keep.numel():  # no buffers for no rows
            bufs = chunk_buffers(4 if capped else 3, keep.numel(), ctx.chunk_size, ws.shape[0], dtype, hs_ND.device)
            for sl in position_chunks(keep.numel(), ctx.chunk_size):
                a = keep[sl]
                r = rows_A[a]
                hs_cD = hs_ND[r].to(dtype)
                scratch, logp, logq = _chunk_logprobs(hs_cD, s_parts, ht_NE[r].to(dtype), t_parts, bufs)
                # the grad below overwrites every buffer: keep the capped logits the cap's derivative reads
                z = bufs[3, : a.numel()].copy_(scratch) if capped else None
                dz_cV = raw_grad_(_kl_grad_chunk(scratch, logp, logq, grad_A[a], ctx.reverse), z, s_head)
                if grad_h is not None:  # need_h
                    grad_h[r] = dz_cV @ ws_h
                if grad_w is not None:  # need_w
                    grad_w.addmm_(dz_cV.T, hs_cD)
                if grad_b is not None:  # need_b
                    grad_b.add_(dz_cV.sum(0))
        grad_h = None if grad_h is None else grad_h.to(hs_ND.dtype)
        grad_w = None if grad_w is None else grad_w.to(ws_VD.dtype)
        grad_b = None if grad_b is None else grad_b.to(bs_V.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _head_tensors(head: Head) -> list[torch.Tensor]:
    return [head.weight_VD] if head.bias_V is None else [head.weight_VD, head.bias_V]


def full_vocab_kl_from_hidden(
    student_hidden_BTD: torch.Tensor,
    student_head_VD: HeadLike,
    teacher_hidden_BTE: torch.Tensor,
    teacher_head_VE: HeadLike,
    mask_BT: torch.Tensor,
    direction: str = "reverse",
    chunk_size: int | None = 128,
) -> torch.Tensor:
    """:func:`full_vocab_kl` of both models' logits from their hidden states, without either (B, T, V) tensor.

    Each head is the model's :class:`~opd.losses.Head` (bias, scale, soft-cap) or a plain (V, D)
    weight (logits = hidden @ W.T).

    ``reverse`` is KL(p || q), ``forward`` KL(q || p), with p the student and q the teacher.
    Only unmasked positions are computed, ``chunk_size`` at a time (None: all at once); the
    extra memory is three (chunk_size, V) buffers in the compute dtype plus the student head's
    gradient. Values and gradients (of the student's hidden states, head weight and bias) equal
    ``full_vocab_kl(head_s.logits(h_s), head_t.logits(h_t), mask_BT, direction)``, including its rule for
    zero-probability tokens (see the module docstring). The teacher's inputs are constants.

    A -inf logit here comes from a -inf entry in a head (a banned or padded token, against a
    hidden coordinate that is positive). Where the student's head has one, the student's hidden
    states get a finite gradient (the banned token's logit does not move), where autograd
    through ``h_s @ W_s.T`` gives NaN (0 * inf); all else matches.

    The two models may differ in width (D vs E) but must share the vocabulary.
    Masked positions are exactly 0 with zero gradient; an all-masked batch still returns a
    tensor connected to the student's inputs. Low-precision inputs are computed in float32, so
    a bfloat16 head is copied to float32 in the forward and again in the backward.

    Shapes:
        student_hidden_BTD: (B, T, D); student_head_VD: (V, D) or a Head
        teacher_hidden_BTE: (B, T, E); teacher_head_VE: (V, E) or a Head
        mask_BT: (B, T)
        returns kl_BT: (B, T)
    """
    _check_direction(direction)
    s_head, t_head = as_head(student_head_VD), as_head(teacher_head_VE).detach()
    B, T, D = student_hidden_BTD.shape
    E = teacher_hidden_BTE.shape[-1]
    V = s_head.vocab
    ws, wt = s_head.weight_VD, t_head.weight_VD
    if tuple(ws.shape) != (V, D) or tuple(wt.shape) != (V, E):
        raise ValueError(
            f"heads {tuple(ws.shape)} (student) and {tuple(wt.shape)} (teacher) "
            f"do not fit hidden widths {D} and {E}, or differ in vocabulary; both models must share one vocabulary"
        )
    if teacher_hidden_BTE.shape[:2] != (B, T) or tuple(mask_BT.shape) != (B, T):
        raise ValueError(
            f"student hidden {tuple(student_hidden_BTD.shape)}, teacher hidden {tuple(teacher_hidden_BTE.shape)} "
            f"and mask {tuple(mask_BT.shape)} must share (B, T)"
        )
    dtype = head_dtype(s_head, student_hidden_BTD, teacher_hidden_BTE, *_head_tensors(t_head))
    active = as_bool(mask_BT).reshape(-1).nonzero().squeeze(-1)
    # With no active row the Function still runs (on nothing), so the result stays connected
    # to the student's inputs and backward() hands them zero gradients.
    # torch's Function.apply is unannotated, hence the ignore
    kl_active = _FullKLFromHidden.apply(  # type: ignore[no-untyped-call]
        student_hidden_BTD.reshape(B * T, D),
        ws,
        s_head.bias_V,
        teacher_hidden_BTE.detach().reshape(B * T, E),
        (s_head, t_head),
        active,
        direction == "reverse",
        chunk_size,
    )
    kl_flat = torch.zeros(B * T, dtype=dtype, device=student_hidden_BTD.device)
    return kl_flat.index_put((active,), kl_active).view(B, T)

"""Per-position distillation losses for on-policy distillation (OPD), pure torch.

Tensors in, tensors out: no model, tokenizer or trainer object is touched here, so an engineer
with their own trainer can import only this module. Names carry their shapes (``logits_BTV``:
batch B, positions T, vocabulary V; ``ids_BTK``: K support slots; ``hidden_BTD``: width D).

The objectives follow the papers in ``shared/papers``:

* :func:`local_support_kl` -- teacher top-K local support matching (LSM, arXiv:2603.25562):
  at each position take a support S (by default the teacher's top-K tokens), renormalize the
  student and the teacher over S and take KL(student_hat || teacher_hat). ``renormalize=False``
  is the paper's ablation (truncated, unnormalized masses) that collapses in training.
* :func:`local_support_kl_from_hidden` -- the same loss from the student's final hidden states and
  output embedding. Renormalization cancels the student's full-vocabulary normalizer, so only the
  K logits ``h_t . W[v]`` for v in S are needed: no (B, T, V) tensor is ever formed.
* :func:`sampled_token_advantages` / :func:`sampled_token_pg_loss` -- the standard sampled-token
  OPD signal r_t = log q(y_t) - log p(y_t) with the discounted reward-to-go of the paper (gamma=0
  token level, gamma=1 sequence level) and a policy-gradient surrogate.
* :func:`full_vocab_kl` and :func:`generalized_jsd` -- dense full-vocabulary baselines.

Every loss returns a per-position ``_BT`` tensor that is exactly 0 where ``mask_BT`` is false;
reduce it with :func:`token_mean`, :func:`sequence_mean` or :func:`constant_sum`.

Dtypes: float64 inputs are computed and returned in float64; float32, float16 and bfloat16
inputs are computed and returned in float32 (low-precision accumulation of a KL is not worth its
error). Gradients come back in each input's own dtype.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "SUPPORT_KINDS",
    "build_support",
    "constant_sum",
    "full_vocab_kl",
    "gather_logprobs",
    "generalized_jsd",
    "local_support_kl",
    "local_support_kl_from_hidden",
    "sampled_token_advantages",
    "sampled_token_pg_loss",
    "sequence_mean",
    "special_token_mask",
    "teacher_topk",
    "teacher_topk_from_hidden",
    "token_logprobs_from_hidden",
    "topk_and_gather_from_hidden",
    "token_mean",
]

SUPPORT_KINDS = (
    "teacher_topk",
    "student_topk",
    "union",
    "intersection",
    "symmetric_difference",
    "teacher_topk_plus_sampled",
)

_NEG_INF = float("-inf")


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _check_k(k: int, vocab: int) -> None:
    if not 1 <= k <= vocab:
        raise ValueError(
            f"k={k} is outside [1, vocabulary size {vocab}]; choose a support size no larger "
            "than the vocabulary (e.g. --k 32)."
        )


def _position_chunks(n: int, chunk_size: int | None):
    step = n if not chunk_size or chunk_size <= 0 else chunk_size
    for start in range(0, n, max(step, 1)):
        yield slice(start, min(start + step, n))


# --------------------------------------------------------------------------- teacher top-K


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
    _check_k(k, V)
    dtype = _compute_dtype(teacher_logits_BTV)
    flat_NV = teacher_logits_BTV.reshape(B * T, V)
    ids_NK = torch.empty(B * T, k, dtype=torch.long, device=flat_NV.device)
    lp_NK = torch.empty(B * T, k, dtype=dtype, device=flat_NV.device)
    for sl in _position_chunks(B * T, chunk_size):
        chunk = flat_NV[sl].to(dtype)
        top_vals, top_ids = chunk.topk(k, dim=-1)
        lp_NK[sl] = top_vals - torch.logsumexp(chunk, dim=-1, keepdim=True)
        ids_NK[sl] = top_ids
    return ids_NK.view(B, T, k), lp_NK.view(B, T, k)


@torch.no_grad()
def teacher_topk_from_hidden(
    hidden_BTD: torch.Tensor, lm_head_weight_VD: torch.Tensor, k: int, chunk_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`teacher_topk` of ``hidden @ W.T`` without holding more than a chunk of logits.

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D)
        returns ids_BTK (B, T, K) int64 and logprobs_BTK (B, T, K), sorted descending.
    """
    ids, logprobs, _ = topk_and_gather_from_hidden(hidden_BTD, lm_head_weight_VD, k, None, chunk_size)
    return ids, logprobs


@torch.no_grad()
def topk_and_gather_from_hidden(
    hidden_BTD: torch.Tensor,
    lm_head_weight_VD: torch.Tensor,
    k: int,
    query_ids_BTQ: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One pass over the head: top-K ids and log-probs, plus the log-probs of ``query_ids``.

    A teacher needs both (its top-K for the support, and its log-prob of the student's sampled
    or top-K tokens); computing them from the same chunk of logits halves the head's cost.

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D); query_ids_BTQ: (B, T, Q)
        returns ids_BTK, logprobs_BTK (sorted descending) and query_logprobs_BTQ (or None).
    """
    B, T, D = hidden_BTD.shape
    V = lm_head_weight_VD.shape[0]
    _check_k(k, V)
    dtype = _compute_dtype(hidden_BTD, lm_head_weight_VD)
    W_VD = lm_head_weight_VD.to(dtype)
    flat_ND = hidden_BTD.reshape(B * T, D)
    ids_NK = torch.empty(B * T, k, dtype=torch.long, device=flat_ND.device)
    lp_NK = torch.empty(B * T, k, dtype=dtype, device=flat_ND.device)
    query_NQ = None if query_ids_BTQ is None else query_ids_BTQ.reshape(B * T, -1)
    q_lp_NQ = None if query_NQ is None else torch.empty(query_NQ.shape, dtype=dtype, device=flat_ND.device)
    for sl in _position_chunks(B * T, chunk_size):
        logits_cV = flat_ND[sl].to(dtype) @ W_VD.T
        log_z = torch.logsumexp(logits_cV, dim=-1, keepdim=True)
        top_vals, top_ids = logits_cV.topk(k, dim=-1)
        lp_NK[sl] = top_vals - log_z
        ids_NK[sl] = top_ids
        if q_lp_NQ is not None:
            q_lp_NQ[sl] = logits_cV.gather(-1, query_NQ[sl]) - log_z
    q_out = None if q_lp_NQ is None else q_lp_NQ.view(*query_ids_BTQ.shape)
    return ids_NK.view(B, T, k), lp_NK.view(B, T, k), q_out


# --------------------------------------------------------------------------- supports


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
    needs_student = kind in ("student_topk", "union", "intersection", "symmetric_difference")
    if kind not in SUPPORT_KINDS:
        raise ValueError(f"unknown support kind {kind!r}; choose one of {', '.join(SUPPORT_KINDS)}")
    if needs_student and student_ids_BTK is None:
        raise ValueError(f"support kind {kind!r} needs the student's top-K ids (student_ids_BTK)")
    if kind == "teacher_topk_plus_sampled" and sampled_ids_BT is None:
        raise ValueError("support kind 'teacher_topk_plus_sampled' needs the sampled ids (sampled_ids_BT)")

    t_ids = teacher_ids_BTK
    if kind == "teacher_topk":
        return t_ids, torch.ones_like(t_ids, dtype=torch.bool)
    if kind == "student_topk":
        return student_ids_BTK, torch.ones_like(student_ids_BTK, dtype=torch.bool)
    if kind == "intersection":
        return t_ids, _member(t_ids, student_ids_BTK)
    if kind == "union":
        ids = torch.cat([t_ids, student_ids_BTK], dim=-1)
        mask = torch.cat([torch.ones_like(t_ids, dtype=torch.bool), ~_member(student_ids_BTK, t_ids)], -1)
        return ids, mask
    if kind == "symmetric_difference":
        ids = torch.cat([t_ids, student_ids_BTK], dim=-1)
        mask = torch.cat([~_member(t_ids, student_ids_BTK), ~_member(student_ids_BTK, t_ids)], -1)
        return ids, mask
    sampled_BT1 = sampled_ids_BT.unsqueeze(-1).to(t_ids.dtype)
    ids = torch.cat([t_ids, sampled_BT1], dim=-1)
    mask = torch.cat([torch.ones_like(t_ids, dtype=torch.bool), ~_member(sampled_BT1, t_ids)], -1)
    return ids, mask


# --------------------------------------------------------------------------- LSM


def _support_kl_terms(
    s_logits_NK: torch.Tensor, t_logprobs_NK: torch.Tensor, valid_NK: torch.Tensor, active_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Renormalized KL over valid slots, with the slot probabilities and log-probs behind it.

    Returns (kl_N, p_NK, logp_NK, logq_NK); slots that do not count hold p = logp = logq = 0.

    Rows that do not count (inactive, no valid slot, or a student with no finite logit on the
    support) are neutralised *before* any log/exp, so neither the value nor the gradient can
    pick up a NaN from ``0 * inf``.
    """
    valid = valid_NK & torch.isfinite(t_logprobs_NK)
    s = s_logits_NK.masked_fill(~valid, _NEG_INF)
    row_ok = active_N & (valid & torch.isfinite(s)).any(-1)
    s = torch.where(row_ok.unsqueeze(-1), s, torch.zeros_like(s))
    t = torch.where(row_ok.unsqueeze(-1) & valid, t_logprobs_NK, torch.full_like(t_logprobs_NK, _NEG_INF))
    t = torch.where(row_ok.unsqueeze(-1), t, torch.zeros_like(t))
    logp = torch.log_softmax(s, dim=-1)
    logq = torch.log_softmax(t, dim=-1)
    counted = row_ok.unsqueeze(-1) & torch.isfinite(logp) & torch.isfinite(logq)
    logp_safe = torch.where(counted, logp, torch.zeros_like(logp))
    logq_safe = torch.where(counted, logq, torch.zeros_like(logq))
    p = torch.where(counted, logp_safe.exp(), torch.zeros_like(logp))
    return (p * (logp_safe - logq_safe)).sum(-1), p, logp_safe, logq_safe


def local_support_kl(
    student_logits_BTV: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    renormalize: bool = True,
    support_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated reverse KL of the student to the teacher over a local support S.

    ``renormalize=True`` (LSM): p_hat = softmax(student logits on S), q_hat = softmax(teacher
    log-probs on S), KL(p_hat || q_hat). ``renormalize=False`` (the ablation): full-vocabulary
    student probabilities truncated to S, sum over S of p (log p - log q).

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
    dtype = _compute_dtype(student_logits_BTV, teacher_logprobs_BTK)
    mask = _as_bool(mask_BT)
    valid = torch.ones_like(support_ids_BTK, dtype=torch.bool) if support_mask is None else _as_bool(support_mask)
    t_lp = teacher_logprobs_BTK.detach().to(dtype)
    logits = student_logits_BTV.to(dtype)
    if renormalize:
        s_K = logits.gather(-1, support_ids_BTK)
        return _support_kl_terms(s_K, t_lp, valid, mask)[0]
    # Without renormalization the student masses come from the full-vocabulary softmax.
    logp_full = torch.log_softmax(logits, dim=-1).gather(-1, support_ids_BTK)
    counted = valid & mask.unsqueeze(-1) & torch.isfinite(t_lp) & torch.isfinite(logp_full)
    logp = torch.where(counted, logp_full, torch.zeros_like(logp_full))
    logq = torch.where(counted, t_lp, torch.zeros_like(t_lp))
    p = torch.where(counted, logp.exp(), torch.zeros_like(logp))
    return (p * (logp - logq)).sum(-1)


class _SupportKLFromHidden(torch.autograd.Function):
    """LSM from hidden states over the active positions ``rows_A``, with an analytic backward.

    The forward stores only dKL/dz for the K support logits of each active position. The K
    logits and grad_h come from embedding-bag kernels that read each weight row once, index the
    hidden states in place (no copy of the active rows) and write grad_h at full size directly;
    the weight gradient is accumulated a chunk at a time into one reused buffer, so peak extra
    memory is O(chunk * K * D) rather than O(B * T * K * D).
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, rows_A, ids_AK, t_lp_AK, valid_AK, chunk_size):
        dtype = _compute_dtype(hidden_ND, weight_VD, t_lp_AK)
        everyone = torch.ones(ids_AK.shape[0], dtype=torch.bool, device=hidden_ND.device)
        z_AK = _support_logits(hidden_ND, weight_VD, rows_A, ids_AK, dtype, chunk_size)
        kl_A, p_AK, logp_AK, logq_AK = _support_kl_terms(z_AK, t_lp_AK.to(dtype), valid_AK, everyone)
        # d KL(p||q) / dz_j = p_j (log p_j - log q_j - KL); slots that do not count have p_j = 0.
        dz_AK = p_AK * (logp_AK - logq_AK - kl_A.unsqueeze(-1))
        ctx.save_for_backward(hidden_ND, weight_VD, rows_A, ids_AK, dz_AK)
        ctx.chunk_size = chunk_size
        return kl_A

    @staticmethod
    def backward(ctx, grad_kl_A):
        hidden_ND, weight_VD, rows_A, ids_AK, dz_AK = ctx.saved_tensors
        dtype = dz_AK.dtype
        g_AK = grad_kl_A.to(dtype).unsqueeze(-1) * dz_AK
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_h = _weighted_rows(weight_VD, rows_A, ids_AK, g_AK, hidden_ND.shape[0], ctx.chunk_size)
            grad_h = grad_h.to(hidden_ND.dtype)
        if ctx.needs_input_grad[1]:
            A, K = ids_AK.shape
            D = hidden_ND.shape[1]
            grad_w = torch.zeros(weight_VD.shape, dtype=dtype, device=weight_VD.device)
            buf = torch.empty(min(A, ctx.chunk_size or A), K, D, dtype=dtype, device=weight_VD.device)
            for sl in _position_chunks(A, ctx.chunk_size):
                n = sl.stop - sl.start
                h_cD = hidden_ND[rows_A[sl]].to(dtype)
                contrib = torch.mul(g_AK[sl].unsqueeze(-1), h_cD.unsqueeze(1), out=buf[:n])
                grad_w.index_add_(0, ids_AK[sl].reshape(-1), contrib.view(n * K, D))
            grad_w = grad_w.to(weight_VD.dtype)
        return grad_h, grad_w, None, None, None, None, None


# A public-API equivalent of this fused "row . vector" kernel would need a (chunk, K, D) copy.
_ROW_DOTS = getattr(torch.ops.aten, "_embedding_bag_per_sample_weights_backward", None)


def _fused(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, dtype: torch.dtype) -> bool:
    return (_ROW_DOTS is not None and hidden_ND.dtype == weight_VD.dtype == dtype
            and hidden_ND.device.type == "cpu")


def _support_logits(hidden_ND, weight_VD, rows_A, ids_AK, dtype, chunk_size) -> torch.Tensor:
    """z[a, k] = hidden[rows[a]] . W[ids[a, k]] in ``dtype``."""
    A, K = ids_AK.shape
    if _fused(hidden_ND, weight_VD, dtype):
        # embedding_bag's per-sample-weight gradient is one dot product per (bag, row); its
        # bag of each sample may be any row of hidden, so the active rows are never copied.
        flat = ids_AK.reshape(-1)
        offsets = torch.arange(0, A * K, K, device=flat.device)
        return _ROW_DOTS(hidden_ND.contiguous(), weight_VD.contiguous(), flat, offsets,
                         rows_A.repeat_interleave(K), 0, -1).view(A, K)
    z_AK = torch.empty(A, K, dtype=dtype, device=hidden_ND.device)
    # One reused buffer: fresh memory costs page faults that dominate this bandwidth-bound loop.
    buf = torch.empty(min(A, chunk_size or A) * K, weight_VD.shape[1], dtype=weight_VD.dtype, device=weight_VD.device)
    for sl in _position_chunks(A, chunk_size):
        n = sl.stop - sl.start
        w_cKD = torch.index_select(weight_VD, 0, ids_AK[sl].reshape(-1), out=buf[: n * K]).view(n, K, -1)
        z_AK[sl] = torch.bmm(w_cKD.to(dtype), hidden_ND[rows_A[sl]].to(dtype).unsqueeze(-1)).squeeze(-1)
    return z_AK


def _weighted_rows(weight_VD, rows_A, ids_AK, g_AK, n_rows: int, chunk_size) -> torch.Tensor:
    """out[rows[a]] = sum_k g[a, k] * W[ids[a, k]], zero on the other rows, in g's dtype."""
    A, K = ids_AK.shape
    if weight_VD.dtype == g_AK.dtype:
        # A weighted bag of embedding rows per output row; rows that are not active get an empty
        # bag (a zero row), so the full-size gradient is written once with no scatter.
        counts = torch.zeros(n_rows, dtype=torch.long, device=ids_AK.device).index_fill_(0, rows_A, K)
        offsets = counts.cumsum(0) - counts
        return F.embedding_bag(ids_AK.reshape(-1), weight_VD, offsets, per_sample_weights=g_AK.reshape(-1), mode="sum")
    out = torch.zeros(n_rows, weight_VD.shape[1], dtype=g_AK.dtype, device=g_AK.device)
    for sl in _position_chunks(A, chunk_size):
        out[rows_A[sl]] = torch.bmm(g_AK[sl].unsqueeze(1), weight_VD[ids_AK[sl]].to(g_AK.dtype)).squeeze(1)
    return out


def local_support_kl_from_hidden(
    hidden_BTD: torch.Tensor,
    lm_head_weight_VD: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    support_mask: torch.Tensor | None = None,
    chunk_size: int = 128,
) -> torch.Tensor:
    """:func:`local_support_kl` (renormalized) from the student's final hidden states.

    Renormalizing over S cancels the student's full-vocabulary normalizer, so only the K logits
    ``hidden_t . W[v]`` (v in S) are computed, chunk by chunk over the unmasked positions; the
    (B, T, V) logits are never formed. Values and gradients (of hidden and weight) equal
    ``local_support_kl(hidden @ W.T, ...)``. Models that scale or soft-cap their logits need
    that applied before calling this (it assumes logits = hidden @ W.T).

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D)
        support_ids_BTK, teacher_logprobs_BTK, support_mask: (B, T, K)
        mask_BT: (B, T)
        returns kl_BT: (B, T)
    """
    B, T, D = hidden_BTD.shape
    K = support_ids_BTK.shape[-1]
    dtype = _compute_dtype(hidden_BTD, lm_head_weight_VD, teacher_logprobs_BTK)
    valid = torch.ones_like(support_ids_BTK, dtype=torch.bool) if support_mask is None else _as_bool(support_mask)
    # Only unmasked positions are computed: padding and prompt cost nothing.
    active = _as_bool(mask_BT).reshape(-1).nonzero().squeeze(-1)
    kl_flat = torch.zeros(B * T, dtype=dtype, device=hidden_BTD.device)
    if active.numel() == 0:
        # Keep the graph connected so callers can always call backward() on the reduced loss.
        return kl_flat.view(B, T) + 0.0 * hidden_BTD.sum(-1).to(dtype)
    kl_active = _SupportKLFromHidden.apply(
        hidden_BTD.reshape(B * T, D),
        lm_head_weight_VD,
        active,
        support_ids_BTK.reshape(B * T, K)[active],
        teacher_logprobs_BTK.detach().reshape(B * T, K)[active],
        valid.reshape(B * T, K)[active],
        chunk_size,
    )
    return kl_flat.index_put((active,), kl_active).view(B, T)


# --------------------------------------------------------------------------- sampled token


def gather_logprobs(logits_BTV: torch.Tensor, ids_BT: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``ids_BT`` under ``softmax(logits_BTV)``.

    Shapes:
        logits_BTV: (B, T, V); ids_BT: (B, T) -> logp_BT: (B, T)
    """
    logits = logits_BTV.to(_compute_dtype(logits_BTV))
    picked = logits.gather(-1, ids_BT.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


class _TokenLogprobsFromHidden(torch.autograd.Function):
    """log_softmax(h W^T)[id] a chunk of rows at a time, with a hand-written backward.

    The backward recomputes one chunk's (chunk, V) logits and accumulates the weight gradient
    into a single (V, D) buffer with addmm_: checkpointing each chunk instead would make autograd
    allocate (and later sum) a full V x D gradient per chunk.
    """

    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, ids_N, chunk_size):
        lse_N = hidden_ND.new_empty(hidden_ND.shape[0])
        picked_N = torch.empty_like(lse_N)
        for sl in _position_chunks(hidden_ND.shape[0], chunk_size):
            logits_cV = hidden_ND[sl] @ weight_VD.T
            lse_N[sl] = torch.logsumexp(logits_cV, dim=-1)
            picked_N[sl] = logits_cV.gather(-1, ids_N[sl].unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(hidden_ND, weight_VD, ids_N, lse_N)
        ctx.chunk_size = chunk_size
        return picked_N - lse_N

    @staticmethod
    def backward(ctx, grad_N):
        hidden_ND, weight_VD, ids_N, lse_N = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden_ND) if need_h else None
        grad_w = torch.zeros_like(weight_VD) if need_w else None
        # Rows with a zero upstream gradient (masked positions) contribute nothing: skip them.
        rows = grad_N.nonzero().squeeze(-1)
        for sl in _position_chunks(rows.numel(), ctx.chunk_size):
            r = rows[sl]
            h_cD, g_c = hidden_ND[r], grad_N[r]
            # d logp[id] / d logits = onehot(id) - softmax(logits), scaled by the upstream grad.
            d_cV = torch.exp((h_cD @ weight_VD.T).sub_(lse_N[r].unsqueeze(-1))).mul_(-g_c.unsqueeze(-1))
            d_cV.scatter_add_(-1, ids_N[r].unsqueeze(-1), g_c.unsqueeze(-1))
            if need_h:
                grad_h[r] = d_cV @ weight_VD
            if need_w:
                grad_w.addmm_(d_cV.T, h_cD)
        return grad_h, grad_w, None, None


def token_logprobs_from_hidden(
    hidden_BTD: torch.Tensor, lm_head_weight_VD: torch.Tensor, ids_BT: torch.Tensor, chunk_size: int = 256
) -> torch.Tensor:
    """Differentiable log-probs of ``ids_BT`` from hidden states, a chunk of logits at a time.

    Only one chunk's (chunk, V) logits exist at a time, in the forward and in the backward
    (which recomputes them and skips positions whose upstream gradient is zero).

    Shapes:
        hidden_BTD: (B, T, D); lm_head_weight_VD: (V, D); ids_BT: (B, T) -> logp_BT: (B, T)
    """
    B, T, D = hidden_BTD.shape
    dtype = _compute_dtype(hidden_BTD, lm_head_weight_VD)
    flat_ND = hidden_BTD.reshape(B * T, D).to(dtype)
    w_VD = lm_head_weight_VD.to(dtype)
    return _TokenLogprobsFromHidden.apply(flat_ND, w_VD, ids_BT.reshape(-1), chunk_size).view(B, T)


def sampled_token_advantages(
    student_logprobs_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float = 0.0,
) -> torch.Tensor:
    """Discounted reward-to-go of the sampled-token OPD reward (detached).

    r_t = log q(y_t) - log p(y_t); A_t = sum over unmasked u >= t of gamma^(u - t) r_u, with the
    distance u - t counted in positions (masked positions break nothing, they just add no
    reward). gamma = 0 is token-level OPD, gamma = 1 the sequence-level reward-to-go.

    Shapes:
        student_logprobs_BT, teacher_logprobs_BT, mask_BT: (B, T) -> adv_BT: (B, T)
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must lie in [0, 1] (0: token-level OPD, 1: sequence level)")
    mask = _as_bool(mask_BT)
    dtype = _compute_dtype(student_logprobs_BT, teacher_logprobs_BT)
    r = (teacher_logprobs_BT.detach().to(dtype) - student_logprobs_BT.detach().to(dtype))
    r = torch.where(mask, r, torch.zeros_like(r))
    if gamma == 0.0:
        return r
    # Backward scan: A_t = r_t + gamma * A_{t+1}; T is the response length, so a loop is cheap.
    adv = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        adv[:, t] = running
    return torch.where(mask, adv, torch.zeros_like(adv))


def sampled_token_pg_loss(
    student_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor | None = None,
    clip_eps: float | None = None,
) -> torch.Tensor:
    """Policy-gradient surrogate whose gradient is -A_t * grad log p(y_t).

    On policy (``old_logprobs_BT=None``) the ratio is exp(logp - logp.detach()) = 1 in value, so
    the loss equals -A_t and its gradient the REINFORCE gradient. For rollouts from an older
    policy the importance ratio exp(logp - old) is used, optionally PPO-clipped to
    [1 - clip_eps, 1 + clip_eps].

    Shapes:
        student_logprobs_BT, advantages_BT, mask_BT, old_logprobs_BT: (B, T) -> loss_BT: (B, T)
    """
    dtype = _compute_dtype(student_logprobs_BT, advantages_BT)
    logp = student_logprobs_BT.to(dtype)
    old = logp.detach() if old_logprobs_BT is None else old_logprobs_BT.detach().to(dtype)
    adv = advantages_BT.detach().to(dtype)
    mask = _as_bool(mask_BT)
    log_ratio = torch.where(mask, logp - old, torch.zeros_like(logp))
    ratio = log_ratio.exp()
    loss = -ratio * adv
    if clip_eps is not None:
        if clip_eps <= 0:
            raise ValueError(f"clip_eps={clip_eps} must be positive (e.g. 0.2), or None for no clipping")
        clipped = -ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
        loss = torch.maximum(loss, clipped)
    return torch.where(mask, loss, torch.zeros_like(loss))


# --------------------------------------------------------------------------- full vocabulary


def _kl_rows(logp_NV: torch.Tensor, logq_NV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row; 0 log 0 = 0 and -inf logits stay finite."""
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
    return torch.where(positive, top + safe.log(), torch.full_like(total, _NEG_INF))


def _divergence_chunk(s_NV, t_NV, m_N, mode: str, beta: float) -> torch.Tensor:
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


def _chunked_divergence(student_logits_BTV, teacher_logits_BTV, mask_BT, mode, beta, chunk_size):
    B, T, V = student_logits_BTV.shape
    if teacher_logits_BTV.shape != student_logits_BTV.shape:
        raise ValueError(
            f"student logits {tuple(student_logits_BTV.shape)} and teacher logits "
            f"{tuple(teacher_logits_BTV.shape)} differ; both models must share one vocabulary"
        )
    dtype = _compute_dtype(student_logits_BTV, teacher_logits_BTV)
    s_NV = student_logits_BTV.reshape(B * T, V)
    t_NV = teacher_logits_BTV.detach().reshape(B * T, V)
    m_N = _as_bool(mask_BT).reshape(-1)
    grad_on = torch.is_grad_enabled() and s_NV.requires_grad and chunk_size
    step = chunk_size if chunk_size and chunk_size > 0 else max(B * T, 1)
    pieces = []
    # split() rather than slicing: the backward of each slice would allocate a full-size zero
    # gradient, where split's backward concatenates the chunk gradients once.
    for s_cV, t_cV, m_c in zip(s_NV.split(step), t_NV.split(step), m_N.split(step)):
        args = (s_cV.to(dtype), t_cV.to(dtype), m_c, mode, beta)
        # Checkpointing keeps only the chunk's inputs in the graph: one chunk of V-sized
        # intermediates is alive at a time, in the forward and in the backward.
        pieces.append(checkpoint(_divergence_chunk, *args, use_reentrant=False) if grad_on else _divergence_chunk(*args))
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
    positions are processed (and recomputed in the backward) a chunk at a time.

    Shapes:
        student_logits_BTV, teacher_logits_BTV: (B, T, V); mask_BT: (B, T) -> kl_BT: (B, T)
    """
    if direction not in ("reverse", "forward"):
        raise ValueError(f"direction={direction!r}; use 'reverse' (KL(student||teacher)) or 'forward'")
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


# --------------------------------------------------------------------------- reductions, masks


def token_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over all unmasked tokens of the batch (0, with zero gradient, if there are none).

    Shapes: loss_BT, mask_BT: (B, T) -> scalar
    """
    mask = _as_bool(mask_BT)
    total = torch.where(mask, loss_BT, torch.zeros_like(loss_BT)).sum()
    return total / mask.sum().clamp(min=1)


def sequence_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over sequences (with at least one unmasked token) of each sequence's token mean.

    Shapes: loss_BT, mask_BT: (B, T) -> scalar
    """
    mask = _as_bool(mask_BT)
    per_seq_tokens = mask.sum(-1)
    per_seq = torch.where(mask, loss_BT, torch.zeros_like(loss_BT)).sum(-1) / per_seq_tokens.clamp(min=1)
    has_tokens = per_seq_tokens > 0
    return torch.where(has_tokens, per_seq, torch.zeros_like(per_seq)).sum() / has_tokens.sum().clamp(min=1)


def constant_sum(loss_BT: torch.Tensor, mask_BT: torch.Tensor, constant: float) -> torch.Tensor:
    """Sum over unmasked tokens divided by a fixed constant (e.g. batch size x max length).

    Unlike :func:`token_mean` the weight of a token does not depend on how many other tokens
    the batch holds, which keeps gradient accumulation and data-parallel shards exact.

    Shapes: loss_BT, mask_BT: (B, T) -> scalar
    """
    if constant <= 0:
        raise ValueError(f"constant={constant} must be positive")
    mask = _as_bool(mask_BT)
    return torch.where(mask, loss_BT, torch.zeros_like(loss_BT)).sum() / constant


def special_token_mask(token_ids_BT: torch.Tensor, special_ids: Sequence[int]) -> torch.Tensor:
    """True where the token is one of ``special_ids`` (EOS, <think>, </think>, template markers).

    Use it as ``loss_mask = response_mask & ~special_token_mask(ids, special_ids)``.

    Shapes: token_ids_BT: (B, T) -> bool (B, T)
    """
    ids = torch.as_tensor(list(special_ids), dtype=token_ids_BT.dtype, device=token_ids_BT.device)
    if ids.numel() == 0:
        return torch.zeros_like(token_ids_BT, dtype=torch.bool)
    return torch.isin(token_ids_BT, ids)

"""Diagnostics for on-policy distillation (OPD): overlap, advantage, entropy gap, support, loops.

Pure torch, no transformers, all under ``torch.no_grad``. Each diagnostic has a per-position
``*_BT`` function (0 where ``mask_BT`` is false) and a scalar, its :func:`masked_mean` (0.0 when
every position is masked). p is the student and q the teacher at student-visited states.

The "Mechanism" metrics of *Rethinking On-Policy Distillation of LLMs* (successful OPD: overlap
rises, entropy gap narrows, overlap-token advantage rises towards 0):

* eq. 6 :func:`topk_overlap_ratio`       |TopK(p_t, k) ∩ TopK(q_t, k)| / k
* eq. 7 :func:`overlap_token_advantage`  mean over v in that intersection of
  A_t(v) = p̄(v) (log q̄(v) - log p̄(v)), with p̄, q̄ renormalized over the student's top-k as in
  eq. 5 (Top-k OPD). The paper leaves positions with an empty intersection undefined: the
  per-position value is 0 there and the scalar averages only positions where it is non-empty.
* eq. 8 :func:`entropy_gap`              |H(q_t) - H(p_t)|

For teacher top-K local support matching (LSM, arXiv:2603.25562) and sampled-token OPD's failure
modes: :func:`support_mass` (mass inside a support before renormalization), :func:`tail_mass` (mass
outside a top-K, from its log-probs alone: what the tail bucket of ``opd.losses`` weighs),
:func:`out_of_support_share` (sampled tokens LSM gives no gradient), :func:`negative_reward_share`
(failure mode 1), :func:`repetition_rate` (failure mode 2: loops the teacher still rewards),
:func:`format_token_share` (segments holding a format token: another task's ``<think>`` leaking into
a game's actions) and :func:`by_position_bucket` (any per-position value by depth: reward quality
degrades with depth).

Conventions: computed in float32, or float64 if an input is float64; masks are bool or 0/1.
Top-k sets break ties towards the lower token id, and a token whose logit is -inf (probability 0)
is never counted as a member of a top-k set, so with fewer than k finite logits the set has fewer
than k members. Rows whose logits are all -inf get entropy 0, mass 0, overlap 0. Logits must not
contain NaN or +inf. Positions are independent: slice big (B, T, V) batches over B or T.

Usage::

    from opd import metrics
    metrics.topk_overlap_ratio(student_logits_BTV, teacher_logits_BTV, 16, response_mask_BT)
    neg_BT = metrics.negative_reward_BT(student_logprobs_BT, teacher_logprobs_BT)
    means_N, counts_N = metrics.by_position_bucket(neg_BT, response_mask_BT, num_buckets=8)
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F

# the losses' dtype policy and mask handling, so a diagnostic and the loss it explains agree
from opd.losses._common import as_bool, compute_dtype

__all__ = [
    "by_position_bucket",
    "entropy",
    "entropy_BT",
    "entropy_gap",
    "entropy_gap_BT",
    "format_token_share",
    "has_repetition_loop_B",
    "masked_mean",
    "negative_reward_BT",
    "negative_reward_share",
    "out_of_support_BT",
    "out_of_support_share",
    "overlap_mass",
    "overlap_mass_BT",
    "overlap_token_advantage",
    "overlap_token_advantage_BT",
    "repetition_rate",
    "support_mass",
    "support_mass_BT",
    "tail_mass",
    "tail_mass_BT",
    "topk_ids",
    "topk_overlap_BT",
    "topk_overlap_ratio",
]


def _bool(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    return as_bool(mask)


def _masked(values_BT: torch.Tensor, mask_BT: torch.Tensor | None) -> torch.Tensor:
    if mask_BT is None:
        return values_BT
    return torch.where(_bool(mask_BT, values_BT.shape), values_BT, 0.0)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"student and teacher shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")


def _log_softmax(x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """log-softmax over the last dim (only ``valid`` entries); all -inf, not NaN, on empty rows."""
    if valid is not None:
        x = x.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    return x - torch.where(torch.isfinite(lse), lse, 0.0)


def _isin(query: torch.Tensor, set_ids: torch.Tensor, set_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Whether each query id (..., Q) is a valid id of ``set_ids`` (..., M), same leading dims."""
    s = set_ids.long()
    if set_valid is not None:
        s = torch.where(set_valid, s, -1)
    s = s.sort(dim=-1).values.contiguous()
    q = query.long().contiguous()
    pos = torch.searchsorted(s, q).clamp_(max=s.shape[-1] - 1)
    return (s.gather(-1, pos) == q) & (q >= 0)


@torch.no_grad()
def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """Mean of ``values_BT`` where ``mask_BT`` is true (a NaN elsewhere is ignored); 0.0 if none.

    Shapes:
        values_BT: (B, T); mask_BT: (B, T) bool or 0/1. Returns a Python float.
    """
    mask = _bool(mask_BT, values_BT.shape)
    n = int(mask.sum())
    if n == 0:
        return 0.0
    return float(torch.where(mask, values_BT.to(compute_dtype(values_BT)), 0.0).sum() / n)


@torch.no_grad()
def topk_ids(logits_BTV: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest logits, by logit descending; ties go to the lower id (deterministic).

    Shapes:
        logits_BTV: (..., V) -> ids (..., k) int64. Raises ValueError unless 1 <= k <= V.
    """
    V = logits_BTV.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"k={k} is outside [1, vocabulary size {V}]")
    flat_NV = logits_BTV.reshape(-1, V).to(compute_dtype(logits_BTV))
    vals_NK, ids_NK = flat_NV.topk(k, dim=-1)
    # torch.topk picks arbitrarily among values tied at the cut (common in bfloat16): in those
    # rows take every value >= the k-th as candidates and keep the lowest ids among the ties.
    n_ge_N = (flat_NV >= vals_NK[:, -1:]).sum(-1)
    rows = (n_ge_N > k).nonzero().squeeze(1)
    if rows.numel():
        cand_RC = flat_NV[rows].topk(int(n_ge_N[rows].max()), dim=-1).indices.sort(dim=-1).values
        order_RC = flat_NV[rows].gather(-1, cand_RC).sort(dim=-1, descending=True, stable=True)
        ids_NK[rows] = cand_RC.gather(-1, order_RC.indices[:, :k])
    ids_NK = ids_NK.sort(dim=-1).values
    order_NK = flat_NV.gather(-1, ids_NK).sort(dim=-1, descending=True, stable=True).indices
    return ids_NK.gather(-1, order_NK).reshape(*logits_BTV.shape[:-1], k)


def _topk_set(logits_BTV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids_BTK = topk_ids(logits_BTV, k)
    return ids_BTK, torch.isfinite(logits_BTV.gather(-1, ids_BTK))


def _student_topk_and_overlap(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student top-k ids S_p, its finite slots, and which slots are also in the teacher's top-k."""
    _same_shape(student_logits_BTV, teacher_logits_BTV)
    sp_BTK, vp_BTK = _topk_set(student_logits_BTV, k)
    sq_BTK, vq_BTK = _topk_set(teacher_logits_BTV, k)
    return sp_BTK, vp_BTK, vp_BTK & _isin(sp_BTK, sq_BTK, vq_BTK)


@torch.no_grad()
def topk_overlap_BT(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int, mask_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 6 per position: |TopK(p_t, k) ∩ TopK(q_t, k)| / k (1 when the top-k sets agree).

    Shapes:
        student_logits_BTV, teacher_logits_BTV: (B, T, V); mask_BT: optional (B, T).
        Returns (B, T), 0 where masked.
    """
    _, _, inter_BTK = _student_topk_and_overlap(student_logits_BTV, teacher_logits_BTV, k)
    hits_BT = inter_BTK.sum(-1).to(compute_dtype(student_logits_BTV, teacher_logits_BTV))
    return _masked(hits_BT / k, mask_BT)


@torch.no_grad()
def topk_overlap_ratio(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int, mask_BT: torch.Tensor
) -> float:
    """Eq. 6: masked mean of :func:`topk_overlap_BT` (M_overlap).
    Shapes: student_logits_BTV, teacher_logits_BTV (B, T, V); mask_BT (B, T). Returns a float."""
    return masked_mean(topk_overlap_BT(student_logits_BTV, teacher_logits_BTV, k, mask_BT), mask_BT)


def _overlap_advantage(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    sp_BTK, vp_BTK, inter_BTK = _student_topk_and_overlap(student_logits_BTV, teacher_logits_BTV, k)
    dtype = compute_dtype(student_logits_BTV, teacher_logits_BTV)
    logp_BTK = _log_softmax(student_logits_BTV.gather(-1, sp_BTK).to(dtype), vp_BTK)
    logq_BTK = _log_softmax(teacher_logits_BTV.gather(-1, sp_BTK).to(dtype), vp_BTK)
    # In the intersection both logits are finite, so both log-probs are finite.
    adv_BTK = torch.where(inter_BTK, logp_BTK.exp() * (logq_BTK - logp_BTK), 0.0)
    n_BT = inter_BTK.sum(-1)
    return adv_BTK.sum(-1) / n_BT.clamp(min=1), n_BT > 0


@torch.no_grad()
def overlap_token_advantage_BT(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int, mask_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 7 per position: mean over v in I_t = S_p ∩ S_q of p̄(v) (log q̄(v) - log p̄(v)).

    S_p, S_q are the student's and teacher's top-k; p̄ and q̄ are the student and teacher
    renormalized over S_p (eq. 5); summed over S_p it would be -KL(p̄ || q̄). 0 where I_t is empty.

    Shapes:
        student_logits_BTV, teacher_logits_BTV: (B, T, V); mask_BT: optional (B, T).
        Returns (B, T), 0 where masked or where the intersection is empty.
    """
    adv_BT, _ = _overlap_advantage(student_logits_BTV, teacher_logits_BTV, k)
    return _masked(adv_BT, mask_BT)


@torch.no_grad()
def overlap_token_advantage(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int, mask_BT: torch.Tensor
) -> float:
    """Eq. 7: mean of :func:`overlap_token_advantage_BT` over unmasked positions whose top-k
    intersection is non-empty (0.0 if there are none), so low overlap cannot fake a value near 0.

    Shapes: student_logits_BTV, teacher_logits_BTV (B, T, V); mask_BT (B, T). Returns a float.
    """
    adv_BT, nonempty_BT = _overlap_advantage(student_logits_BTV, teacher_logits_BTV, k)
    return masked_mean(adv_BT, _bool(mask_BT, adv_BT.shape) & nonempty_BT)


@torch.no_grad()
def overlap_mass_BT(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int, mask_BT: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-vocabulary mass of the overlap tokens I_t = TopK(p_t, k) ∩ TopK(q_t, k), under each model.

    2604.13016 reports that in successful OPD these tokens carry 97-99% of both models' mass.

    Shapes:
        student_logits_BTV, teacher_logits_BTV: (B, T, V); mask_BT optional (B, T).
        Returns (student_BT, teacher_BT), each (B, T) in [0, 1], 0 where masked or I_t is empty.
    """
    sp_BTK, _, inter_BTK = _student_topk_and_overlap(student_logits_BTV, teacher_logits_BTV, k)
    return (
        support_mass_BT(student_logits_BTV, sp_BTK, inter_BTK, mask_BT),
        support_mass_BT(teacher_logits_BTV, sp_BTK, inter_BTK, mask_BT),
    )


@torch.no_grad()
def overlap_mass(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, k: int, mask_BT: torch.Tensor
) -> tuple[float, float]:
    """Masked means of :func:`overlap_mass_BT`: (student's, teacher's) mass on the overlap tokens.
    Shapes: student_logits_BTV, teacher_logits_BTV (B, T, V); mask_BT (B, T). Returns two floats."""
    student_BT, teacher_BT = overlap_mass_BT(student_logits_BTV, teacher_logits_BTV, k, mask_BT)
    return masked_mean(student_BT, mask_BT), masked_mean(teacher_BT, mask_BT)


@torch.no_grad()
def entropy_BT(logits_BTV: torch.Tensor, mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy H(softmax(logits)) in nats per position (0 log 0 = 0; all -inf row -> 0).

    Shapes: logits_BTV (B, T, V); mask_BT optional (B, T). Returns (B, T), 0 where masked.
    """
    logp_BTV = torch.log_softmax(logits_BTV.to(compute_dtype(logits_BTV)), dim=-1)
    # 0 * -inf and an all -inf row give NaN terms; nansum counts them as 0 (0 log 0 = 0).
    return _masked(-(logp_BTV.exp() * logp_BTV).nansum(-1), mask_BT)


@torch.no_grad()
def entropy(logits_BTV: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """Masked mean of :func:`entropy_BT` (watch for student entropy collapse).
    Shapes: logits_BTV (B, T, V); mask_BT (B, T). Returns a float."""
    return masked_mean(entropy_BT(logits_BTV, mask_BT), mask_BT)


@torch.no_grad()
def entropy_gap_BT(
    student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, mask_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """Eq. 8 per position: |H(q_t) - H(p_t)|.

    Shapes: student_logits_BTV (B, T, V), teacher_logits_BTV (B, T, V') (V' may differ from V);
    mask_BT optional (B, T). Returns (B, T), 0 where masked.
    """
    _same_shape(student_logits_BTV[..., 0], teacher_logits_BTV[..., 0])
    dtype = compute_dtype(student_logits_BTV, teacher_logits_BTV)
    gap = entropy_BT(teacher_logits_BTV).to(dtype) - entropy_BT(student_logits_BTV).to(dtype)
    return _masked(gap.abs(), mask_BT)


@torch.no_grad()
def entropy_gap(student_logits_BTV: torch.Tensor, teacher_logits_BTV: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """Eq. 8: masked mean of :func:`entropy_gap_BT`.
    Shapes: student_logits_BTV (B, T, V), teacher_logits_BTV (B, T, V'), mask_BT (B, T) -> float."""
    return masked_mean(entropy_gap_BT(student_logits_BTV, teacher_logits_BTV, mask_BT), mask_BT)


@torch.no_grad()
def support_mass_BT(
    logits_BTV: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    support_mask_BTK: torch.Tensor | None = None,
    mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full-vocabulary probability mass inside the support, before renormalization.

    Only valid slots count (``support_mask_BTK``, default all) and a repeated id counts once. For
    student or teacher: low student mass in the teacher's top-K means LSM matches a thin slice.

    Shapes:
        logits_BTV (B, T, V); support_ids_BTK (B, T, K) int; support_mask_BTK optional (B, T, K);
        mask_BT optional (B, T). Returns (B, T) in [0, 1], 0 where masked.
    """
    valid_BTK = (
        torch.ones_like(support_ids_BTK, dtype=torch.bool)
        if support_mask_BTK is None
        else _bool(support_mask_BTK, support_ids_BTK.shape)
    )
    ids_BTK = torch.where(valid_BTK, support_ids_BTK.long(), -1).sort(dim=-1).values
    valid_BTK = ids_BTK >= 0
    valid_BTK[..., 1:] &= ids_BTK[..., 1:] != ids_BTK[..., :-1]  # drop repeated ids
    dtype = compute_dtype(logits_BTV)
    lse_BT1 = torch.logsumexp(logits_BTV.to(dtype), dim=-1, keepdim=True)
    lse_BT1 = torch.where(torch.isfinite(lse_BT1), lse_BT1, 0.0)
    p_BTK = (logits_BTV.gather(-1, ids_BTK.clamp(min=0)).to(dtype) - lse_BT1).exp()
    return _masked(torch.where(valid_BTK, p_BTK, 0.0).sum(-1), mask_BT)


@torch.no_grad()
def support_mass(
    logits_BTV: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    support_mask_BTK: torch.Tensor | None = None,
) -> float:
    """Masked mean of :func:`support_mass_BT`.
    Shapes: as :func:`support_mass_BT`, with mask_BT (B, T) required. Returns a float."""
    mass_BT = support_mass_BT(logits_BTV, support_ids_BTK, support_mask_BTK, mask_BT)
    return masked_mean(mass_BT, mask_BT)


@torch.no_grad()
def tail_mass_BT(topk_logprobs_BTK: torch.Tensor, mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Probability mass outside a top-K set, 1 - sum_k exp(logp_k), from the set's own full-vocabulary
    (not renormalized) log-probs: all a served teacher returns, so it needs no logits. -inf slots
    (padding, tokens of probability 0) add nothing; rounding that pushes the sum past 1 gives 0.

    Shapes: topk_logprobs_BTK (B, T, K); mask_BT optional (B, T). Returns (B, T) in [0, 1], 0 where masked.
    """
    dtype = compute_dtype(topk_logprobs_BTK)
    inside_BT = topk_logprobs_BTK.to(dtype).exp().sum(-1)
    return _masked((1.0 - inside_BT).clamp(0.0, 1.0), mask_BT)


@torch.no_grad()
def tail_mass(topk_logprobs_BTK: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """Masked mean of :func:`tail_mass_BT`.
    Shapes: topk_logprobs_BTK (B, T, K); mask_BT (B, T) required. Returns a float."""
    return masked_mean(tail_mass_BT(topk_logprobs_BTK, mask_BT), mask_BT)


@torch.no_grad()
def out_of_support_BT(
    sampled_ids_BT: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    support_mask_BTK: torch.Tensor | None = None,
    mask_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """1.0 where the sampled token is not on a valid slot of the support (LSM ignores it), else 0.

    Shapes:
        sampled_ids_BT (B, T) int; support_ids_BTK (B, T, K) int; support_mask_BTK optional
        (B, T, K); mask_BT optional (B, T). Returns (B, T) float32, 0 where masked.
    """
    valid_BTK = None if support_mask_BTK is None else _bool(support_mask_BTK, support_ids_BTK.shape)
    inside_BT = _isin(sampled_ids_BT.unsqueeze(-1), support_ids_BTK, valid_BTK).squeeze(-1)
    return _masked((~inside_BT).float(), mask_BT)


@torch.no_grad()
def out_of_support_share(
    sampled_ids_BT: torch.Tensor,
    support_ids_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    support_mask_BTK: torch.Tensor | None = None,
) -> float:
    """Share of unmasked sampled tokens outside the support (:func:`out_of_support_BT`).
    Shapes: as :func:`out_of_support_BT`, with mask_BT (B, T) required. Returns a float."""
    out_BT = out_of_support_BT(sampled_ids_BT, support_ids_BTK, support_mask_BTK, mask_BT)
    return masked_mean(out_BT, mask_BT)


@torch.no_grad()
def negative_reward_BT(
    student_logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """1.0 where the sampled-token reward r_t = log q(y_t) - log p(y_t) is negative, else 0.0.

    A -inf teacher log-prob against a finite student one counts as negative; both -inf does not.

    Shapes: student_logprobs_BT, teacher_logprobs_BT (B, T); mask_BT optional (B, T).
    Returns (B, T), 0 where masked.
    """
    _same_shape(student_logprobs_BT, teacher_logprobs_BT)
    dtype = compute_dtype(student_logprobs_BT, teacher_logprobs_BT)
    neg_BT = teacher_logprobs_BT.to(dtype) < student_logprobs_BT.to(dtype)
    return _masked(neg_BT.to(dtype), mask_BT)


@torch.no_grad()
def negative_reward_share(
    student_logprobs_BT: torch.Tensor, teacher_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> float:
    """Share of unmasked sampled tokens with a negative reward (:func:`negative_reward_BT`).
    Shapes: student_logprobs_BT, teacher_logprobs_BT, mask_BT all (B, T). Returns a float."""
    neg_BT = negative_reward_BT(student_logprobs_BT, teacher_logprobs_BT, mask_BT)
    return masked_mean(neg_BT, mask_BT)


@torch.no_grad()
def by_position_bucket(
    values_BT: torch.Tensor, mask_BT: torch.Tensor, num_buckets: int = 8, horizon: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean of a per-position value in equal-width depth buckets.

    Position t (depth in the response) goes to bucket floor(t * num_buckets / H), H = horizon or T:
    [0, H) split evenly, t >= H ignored. An empty bucket has mean 0 and count 0.

    Shapes:
        values_BT (B, T); mask_BT (B, T) bool or 0/1.
        Returns means_N (num_buckets,) float and counts_N (num_buckets,) int64 (unmasked positions).
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets} must be >= 1")
    B, T = values_BT.shape
    H = T if horizon is None else horizon
    if H < 1:
        raise ValueError(f"horizon={horizon} must be >= 1")
    mask_BT = _bool(mask_BT, values_BT.shape)
    t_T = torch.arange(T, device=values_BT.device)
    keep_BT = mask_BT & (t_T < H)
    bucket_K = ((t_T * num_buckets) // H).expand(B, T)[keep_BT]
    dtype = compute_dtype(values_BT)
    sums_N = torch.zeros(num_buckets, dtype=dtype, device=values_BT.device)
    sums_N.index_add_(0, bucket_K, values_BT.to(dtype)[keep_BT])
    counts_N = torch.bincount(bucket_K, minlength=num_buckets)
    return sums_N / counts_N.clamp(min=1), counts_N


@torch.no_grad()
def has_repetition_loop_B(
    token_ids_BT: torch.Tensor, mask_BT: torch.Tensor, ngram: int = 4, min_repeats: int = 3
) -> torch.Tensor:
    """Whether each sequence's unmasked tokens (in order, masked ones skipped) contain an
    ``ngram``-gram repeated back to back >= ``min_repeats`` times ("a b a b a b": n=2, m=3).

    A loop of period d is found when d divides ``ngram`` (ngram=4: periods 1, 2, 4; not 3).

    Shapes: token_ids_BT (B, T) int; mask_BT (B, T) bool or 0/1. Returns (B,) bool.
    """
    if ngram < 1 or min_repeats < 2:
        raise ValueError(f"need ngram >= 1 and min_repeats >= 2, got {ngram}, {min_repeats}")
    mask_BT = _bool(mask_BT, token_ids_BT.shape)
    B, T = token_ids_BT.shape
    if T < ngram * min_repeats:
        return torch.zeros(B, dtype=torch.bool, device=token_ids_BT.device)
    # Pack unmasked tokens to the left, keeping their order.
    order_BT = torch.sort((~mask_BT).to(torch.uint8), dim=1, stable=True).indices
    packed_BT = token_ids_BT.gather(1, order_BT)
    n_B1 = mask_BT.sum(1, keepdim=True)
    # same[j]: token j equals token j + n. A loop is a run of n * (m - 1) consecutive such j.
    j_J = torch.arange(T - ngram, device=token_ids_BT.device)
    same_BJ = (packed_BT[:, ngram:] == packed_BT[:, :-ngram]) & (j_J + ngram < n_B1)
    run = ngram * (min_repeats - 1)
    misses_BJ = F.pad((~same_BJ).long().cumsum(1), (1, 0))
    return ((misses_BJ[:, run:] - misses_BJ[:, :-run]) == 0).any(1)


@torch.no_grad()
def repetition_rate(token_ids_BT: torch.Tensor, mask_BT: torch.Tensor, ngram: int = 4, min_repeats: int = 3) -> float:
    """Share of sequences with at least one unmasked token that contain a loop
    (:func:`has_repetition_loop_B`); 0.0 if no sequence has an unmasked token.

    Shapes: token_ids_BT (B, T) int; mask_BT (B, T) bool or 0/1. Returns a float.
    """
    loop_B = has_repetition_loop_B(token_ids_BT, mask_BT, ngram, min_repeats)
    nonempty_B = _bool(mask_BT, token_ids_BT.shape).any(1)
    n = int(nonempty_B.sum())
    return 0.0 if n == 0 else float((loop_B & nonempty_B).sum()) / n


@torch.no_grad()
def format_token_share(
    token_ids_BT: torch.Tensor, mask_BT: torch.Tensor, format_ids: Collection[int]
) -> tuple[int, int]:
    """How many of the model's segments hold at least one of ``format_ids``, and how many segments.

    A segment is a maximal run of unmasked positions in a row: a prompt task's response, or each
    action of a multi-turn episode (the environment's tokens between them are masked). With
    ``format_ids`` the format tokens other than end-of-turn (``<think>``, ``</think>``), the share
    in a game task is how often another task's format leaks into its actions.

    Shapes: token_ids_BT (B, T) int; mask_BT (B, T) bool or 0/1. Returns (with format token, segments).
    """
    mask_BT = _bool(mask_BT, token_ids_BT.shape)
    start_BT = mask_BT.clone()
    start_BT[:, 1:] &= ~mask_BT[:, :-1]
    segments = int(start_BT.sum())
    if segments == 0 or len(format_ids) == 0:
        return 0, segments
    segment_BT = start_BT.flatten().long().cumsum(0).view_as(token_ids_BT) - 1  # a position's segment
    ids = torch.as_tensor(list(format_ids), dtype=token_ids_BT.dtype, device=token_ids_BT.device)
    hit_BT = torch.isin(token_ids_BT, ids) & mask_BT
    return int(torch.unique(segment_BT[hit_BT]).numel()), segments

"""Cross-tokenizer OPD losses: a teacher whose vocabulary differs from the student's. Pure torch.

The alignment of the two tokenizations and the vocabulary map come from :mod:`opd.crosstok`
as index tensors (``teacher_pos_BT``, ``student_group_BT``, ``teacher_group_BU``,
``teacher_to_student_V``); U is the number of teacher positions, which differs from T.

* :func:`cross_tokenizer_local_support_kl` -- LSM across vocabularies. At a student position
  paired with a teacher position (the two are predicted from the same text prefix), the support
  is the teacher's top-K tokens that map to a student token; both sides are renormalized over it
  and KL(student_hat || teacher_hat) is taken by :func:`opd.losses.local_support_kl` itself
  (:func:`cross_tokenizer_support` builds its inputs, so ``local_support_kl_from_hidden`` works
  the same way). Teacher tokens with the same bytes (a token and its byte-fallback twin) map to
  one student token and their masses are added. Unpaired positions (inside a many-to-many group,
  special tokens without a partner, text past a byte mismatch) and positions whose teacher top-K
  maps to nothing are exactly 0, and counted. With identical tokenizers this is ordinary LSM.
* :func:`span_reward` -- sampled-token OPD per aligned group: the teacher's log-prob of the
  group's teacher tokens minus the student's of its student tokens, on the group's last student
  token.
* :func:`one_to_one_share`, :func:`mapped_topk_mass` -- diagnostics.

Departure from GOLD/ULD: no merged group distributions and no sorted-probability (ULD) term; the
comparison is LSM's, on the mapped part of the teacher's top-K, where the text prefixes agree.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from opd.losses._common import NEG_INF, as_bool, compute_dtype
from opd.losses.lsm import local_support_kl

__all__ = [
    "CrossSupportCounts",
    "cross_tokenizer_local_support_kl",
    "cross_tokenizer_support",
    "mapped_topk_mass",
    "one_to_one_share",
    "span_reward",
]


class CrossSupportCounts(NamedTuple):
    """Position counts of one call (0-dim int64 tensors, no device sync).

    ``positions``: where ``mask_BT`` is true. ``compared``: those with a loss term.
    ``unpaired``: masked-in positions with no teacher position. ``no_mapped_support``: paired
    positions whose teacher top-K has no token that maps (with teacher probability above 0).
    positions = compared + unpaired + no_mapped_support.
    """

    positions: torch.Tensor
    compared: torch.Tensor
    unpaired: torch.Tensor
    no_mapped_support: torch.Tensor


def _at_teacher_positions(x_BUK: torch.Tensor, teacher_pos_BT: torch.Tensor) -> torch.Tensor:
    """x at each student position's paired teacher position (row 0's value where unpaired)."""
    K = x_BUK.shape[-1]
    index = teacher_pos_BT.clamp(min=0).unsqueeze(-1).expand(-1, -1, K)
    return x_BUK.gather(1, index)


def _map_ids(
    teacher_ids_BTK: torch.Tensor,
    teacher_to_student_V: torch.Tensor,
    text_start_BT: torch.Tensor | None,
    teacher_to_student_start_V: torch.Tensor | None,
) -> torch.Tensor:
    """Student ids of teacher ids; at text-start positions through the start-of-text map."""
    V_t = teacher_to_student_V.shape[0]
    if teacher_ids_BTK.numel() and int(teacher_ids_BTK.max()) >= V_t:
        raise ValueError(
            f"teacher id {int(teacher_ids_BTK.max())} is outside the vocabulary map ({V_t} ids): build the map "
            "with teacher_rows set to the teacher head's size"
        )
    ids = teacher_to_student_V.to(teacher_ids_BTK.device)[teacher_ids_BTK]
    if (text_start_BT is None) != (teacher_to_student_start_V is None):
        raise ValueError("pass text_start_BT and teacher_to_student_start_V together (or neither)")
    if text_start_BT is None or teacher_to_student_start_V is None:  # neither, as just checked
        return ids
    start = teacher_to_student_start_V.to(teacher_ids_BTK.device)[teacher_ids_BTK]
    return torch.where(as_bool(text_start_BT).unsqueeze(-1), start, ids)


def _merge_twins(
    ids_NK: torch.Tensor, lp_NK: torch.Tensor, valid_NK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where valid slots repeat a student id, keep the first slot with the log-sum-exp of their masses.

    Only rows holding a repeat are touched, so rows without one keep their values bit for bit.
    """
    K = ids_NK.shape[-1]
    # Invalid slots get distinct negative keys so they never match anything.
    key = torch.where(valid_NK, ids_NK, -1 - torch.arange(K, device=ids_NK.device))
    sorted_key = key.sort(-1).values
    rows = (sorted_key[:, 1:] == sorted_key[:, :-1]).any(-1).nonzero().squeeze(-1)
    if rows.numel() == 0:
        return lp_NK, valid_NK
    k_r, lp_r = key[rows], lp_NK[rows]
    same = k_r.unsqueeze(-1) == k_r.unsqueeze(-2)  # (R, K, K)
    earlier = torch.ones(K, K, dtype=torch.bool, device=ids_NK.device).tril(-1)
    first = valid_NK[rows] & ~(same & earlier).any(-1)
    merged = torch.where(same, lp_r.unsqueeze(-2), torch.full_like(lp_r.unsqueeze(-2), NEG_INF)).logsumexp(-1)
    lp_out, valid_out = lp_NK.clone(), valid_NK.clone()
    lp_out[rows] = torch.where(first, merged, lp_r)
    valid_out[rows] = first
    return lp_out, valid_out


def cross_tokenizer_support(
    teacher_topk_ids_BUK: torch.Tensor,
    teacher_topk_logprobs_BUK: torch.Tensor,
    teacher_pos_BT: torch.Tensor,
    teacher_to_student_V: torch.Tensor,
    mask_BT: torch.Tensor,
    text_start_BT: torch.Tensor | None = None,
    teacher_to_student_start_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, CrossSupportCounts]:
    """The LSM inputs at student positions from the teacher's top-K at its own positions.

    Returns (support_ids_BTK in the student vocabulary, teacher_logprobs_BTK, support_mask_BTK,
    loss_mask_BT, counts), ready for :func:`opd.losses.local_support_kl` or
    :func:`opd.losses.local_support_kl_from_hidden`. Invalid slots hold student id 0 (safe to
    gather). The teacher log-probs stay normalized over the teacher's full vocabulary; LSM
    renormalizes them over the mapped support. Where ``text_start_BT`` is true the teacher ids
    go through ``teacher_to_student_start_V`` (``AlignmentTensors.text_start_BT`` and
    ``VocabMap.teacher_to_student_start_V``: a SentencePiece ``▁hello`` opening a text is
    b"hello").

    Shapes:
        teacher_topk_ids_BUK, teacher_topk_logprobs_BUK: (B, U, K)
        teacher_pos_BT: (B, T) int64, -1 where unpaired; mask_BT, text_start_BT: (B, T)
        teacher_to_student_V, teacher_to_student_start_V: (V_t,) int64, -1 where unmapped
        returns support_ids_BTK, teacher_logprobs_BTK, support_mask_BTK: (B, T, K); loss_mask_BT: (B, T)
    """
    B, T = teacher_pos_BT.shape
    K = teacher_topk_ids_BUK.shape[-1]
    mask = as_bool(mask_BT)
    paired = mask & (teacher_pos_BT >= 0)
    t_ids = _at_teacher_positions(teacher_topk_ids_BUK, teacher_pos_BT)
    t_lp = _at_teacher_positions(teacher_topk_logprobs_BUK.detach(), teacher_pos_BT)
    s_ids = _map_ids(t_ids, teacher_to_student_V, text_start_BT, teacher_to_student_start_V)
    # A slot of teacher probability 0 is outside the teacher's support (as in LSM).
    valid = (s_ids >= 0) & paired.unsqueeze(-1) & torch.isfinite(t_lp)
    lp, valid = _merge_twins(s_ids.reshape(B * T, K), t_lp.reshape(B * T, K), valid.reshape(B * T, K))
    lp, valid = lp.view(B, T, K), valid.view(B, T, K)
    support_ids = torch.where(valid, s_ids, torch.zeros_like(s_ids))
    loss_mask = paired & valid.any(-1)
    counts = CrossSupportCounts(mask.sum(), loss_mask.sum(), (mask & ~paired).sum(), (paired & ~loss_mask).sum())
    return support_ids, lp, valid, loss_mask, counts


def cross_tokenizer_local_support_kl(
    student_logits_BTV: torch.Tensor,
    teacher_topk_ids_BUK: torch.Tensor,
    teacher_topk_logprobs_BUK: torch.Tensor,
    teacher_pos_BT: torch.Tensor,
    teacher_to_student_V: torch.Tensor,
    mask_BT: torch.Tensor,
    text_start_BT: torch.Tensor | None = None,
    teacher_to_student_start_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CrossSupportCounts]:
    """Cross-tokenizer LSM: renormalized KL(student || teacher) over the mapped teacher top-K.

    Exactly 0 (with zero gradient) where ``mask_BT`` is false, where the position is unpaired
    and where no top-K token maps; see :class:`CrossSupportCounts`. Gradients reach only
    ``student_logits_BTV``. ``text_start_BT`` / ``teacher_to_student_start_V``: see
    :func:`cross_tokenizer_support`.

    Shapes:
        student_logits_BTV: (B, T, V_s)
        teacher_topk_ids_BUK, teacher_topk_logprobs_BUK: (B, U, K), ids in the teacher vocabulary
        teacher_pos_BT: (B, T) int64; mask_BT, text_start_BT: (B, T)
        teacher_to_student_V, teacher_to_student_start_V: (V_t,) int64
        returns kl_BT: (B, T) and the counts
    """
    ids, lp, valid, loss_mask, counts = cross_tokenizer_support(
        teacher_topk_ids_BUK,
        teacher_topk_logprobs_BUK,
        teacher_pos_BT,
        teacher_to_student_V,
        mask_BT,
        text_start_BT,
        teacher_to_student_start_V,
    )
    return local_support_kl(student_logits_BTV, ids, lp, loss_mask, support_mask=valid), counts


def _group_sums(values: torch.Tensor, group: torch.Tensor, G: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-row sums of ``values`` by group id; id -1 goes to a discarded column G."""
    col = torch.where(group >= 0, group, torch.full_like(group, G))
    vals = torch.where(group >= 0, values.detach().to(dtype), torch.zeros((), dtype=dtype, device=values.device))
    out = torch.zeros(group.shape[0], G + 1, dtype=dtype, device=values.device)
    return out.scatter_add_(1, col, vals)[:, :G]


def span_reward(
    student_logprobs_BT: torch.Tensor,
    teacher_logprobs_BU: torch.Tensor,
    student_group_BT: torch.Tensor,
    teacher_group_BU: torch.Tensor,
    mask_BT: torch.Tensor,
) -> torch.Tensor:
    """Sampled-token OPD reward per aligned group, on the group's last student token (detached).

    r_g = sum over the group's teacher tokens of log q(token) - sum over its student tokens of
    log p(token): the log-ratio of the two models' probabilities of the same bytes given the same
    text prefix. It sits on the last student token because only there is the span complete; the
    group's other tokens get 0, so with ``gamma=0`` they receive no credit and with ``gamma=1``
    (reward-to-go) every token of the group sees r_g. For a one-to-one group this is the ordinary
    r_t = log q(y_t) - log p(y_t), and a teacher log-prob of -inf gives -inf as there. A group's
    reward is dropped where ``mask_BT`` is false at its last student token; positions in no
    group get 0.

    To train: ``A = sampled_token_advantages(torch.zeros_like(r), r, mask, gamma)`` (r as the
    "teacher log-prob" against a zero student log-prob), then ``sampled_token_pg_loss``.

    Shapes:
        student_logprobs_BT, student_group_BT, mask_BT: (B, T)
        teacher_logprobs_BU, teacher_group_BU: (B, U); groups numbered per row, -1: none
        returns reward_BT: (B, T)
    """
    dtype = compute_dtype(student_logprobs_BT, teacher_logprobs_BU)
    B, T = student_group_BT.shape
    reward = torch.zeros(B, T, dtype=dtype, device=student_logprobs_BT.device)
    G = max((int(g.max()) + 1 for g in (student_group_BT, teacher_group_BU) if g.numel()), default=0)
    if G == 0:
        return reward
    r_BG = _group_sums(teacher_logprobs_BU, teacher_group_BU, G, dtype) - _group_sums(
        student_logprobs_BT, student_group_BT, G, dtype
    )
    cols = torch.arange(T, device=student_group_BT.device).expand(B, T)
    grp = student_group_BT.clamp(min=0)
    last_BG = torch.full((B, G), -1, dtype=torch.long, device=cols.device)
    last_BG.scatter_reduce_(1, grp, torch.where(student_group_BT >= 0, cols, -1), reduce="amax")
    is_last = (student_group_BT >= 0) & (last_BG.gather(1, grp) == cols) & as_bool(mask_BT)
    return torch.where(is_last, r_BG.gather(1, grp), reward)


def one_to_one_share(one_to_one_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Share of the masked-in (response) positions that are one-to-one groups (0 if none).

    Shapes: one_to_one_BT, mask_BT: (B, T) -> scalar
    """
    mask = as_bool(mask_BT)
    return (as_bool(one_to_one_BT) & mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def mapped_topk_mass(
    teacher_topk_ids_BUK: torch.Tensor,
    teacher_topk_logprobs_BUK: torch.Tensor,
    teacher_pos_BT: torch.Tensor,
    teacher_to_student_V: torch.Tensor,
    mask_BT: torch.Tensor,
    text_start_BT: torch.Tensor | None = None,
    teacher_to_student_start_V: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over paired positions of the share of the teacher's top-K mass that maps to student tokens.

    Per position: sum of q over mapped top-K slots / sum of q over all top-K slots; positions
    with no top-K mass are left out. 1.0 means the support lost nothing to the vocabulary map.
    ``text_start_BT`` / ``teacher_to_student_start_V``: as in :func:`cross_tokenizer_support`.

    Shapes:
        teacher_topk_ids_BUK, teacher_topk_logprobs_BUK: (B, U, K); teacher_pos_BT, mask_BT: (B, T)
        returns a scalar (0 if no position counts)
    """
    dtype = compute_dtype(teacher_topk_logprobs_BUK)
    q = _at_teacher_positions(teacher_topk_logprobs_BUK, teacher_pos_BT).to(dtype).exp()
    t_ids = _at_teacher_positions(teacher_topk_ids_BUK, teacher_pos_BT)
    mapped = _map_ids(t_ids, teacher_to_student_V, text_start_BT, teacher_to_student_start_V) >= 0
    total = q.sum(-1)
    counted = as_bool(mask_BT) & (teacher_pos_BT >= 0) & (total > 0)
    share = torch.where(counted, (q * mapped).sum(-1) / total.clamp(min=torch.finfo(dtype).tiny), 0.0)
    return share.sum() / counted.sum().clamp(min=1)

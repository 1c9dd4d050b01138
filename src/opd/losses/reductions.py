"""Reductions of per-position losses to a scalar, and the special-token mask.

Every loss in :mod:`opd.losses` returns a (B, T) tensor that is 0 where the mask is false; these
functions decide how tokens are weighted against each other. ``constant_sum`` is the one that
keeps gradient accumulation and data-parallel shards exact (a token's weight does not depend on
how many other tokens share its batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opd.losses._common import as_bool


def token_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over all unmasked tokens of the batch (0, with zero gradient, if there are none).

    Shapes: loss_BT, mask_BT: (B, T) -> scalar
    """
    mask = as_bool(mask_BT)
    total = torch.where(mask, loss_BT, torch.zeros_like(loss_BT)).sum()
    return total / mask.sum().clamp(min=1)


def sequence_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over sequences (with at least one unmasked token) of each sequence's token mean.

    Shapes: loss_BT, mask_BT: (B, T) -> scalar
    """
    mask = as_bool(mask_BT)
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
    mask = as_bool(mask_BT)
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

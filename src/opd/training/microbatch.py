"""A step's micro-batches: the rollouts split evenly (``--grad-accum``) or packed by token budget
(``--micro-batch-tokens``), every rank running as many as the busiest one.

The loss of a micro-batch is its share of the whole step's (normalised by the global batch's counts,
:func:`opd.training.loss.reduce_loss`), so how the rows are grouped changes neither the step's loss nor
its gradient; only how much is in memory at once. Packing by tokens groups rows out of order (longest
first), so the update puts each row's by-products (per-token loss, hidden states) back in row order.

Under DDP and FSDP every rank must run the same number of forwards and backwards: FSDP gathers each
block's weights in every forward, a collective all ranks join. A rank with fewer micro-batches runs
padding ones: one row cut to its last prompt token and first response token (``width`` 1), its loss times
zero, which adds nothing to the gradient. It runs every layer (the same collectives, forward and backward)
at the cost of a two-token forward, where re-running a real micro-batch (the longest, under a token budget)
cost a full forward and backward. Within a micro-batch the forwards still differ in number (the student's
forward runs its rows in chunks of 8): under FSDP those are kept in step by the student's
:class:`~opd.models.sharding.Lockstep` (tests/training/test_fsdp_uneven.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``rows`` (ascending) of part ``part``; ``counted`` False for a padding micro-batch, whose
    ``width`` is the response positions it keeps (0: all; see :meth:`opd.rollout.engine.RolloutBatch.narrow`)."""

    part: int
    rows: torch.Tensor
    counted: bool = True
    width: int = 0


def pack_by_tokens(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices packed into groups whose size (rows x the group's longest length: the padded forward)
    stays within ``budget``, longest rows first, so rows of like length share a group; a row longer than
    ``budget`` goes alone. Each group's indices ascending."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)  # the group's first row is its longest
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def split_rows(lengths_per_part: list[torch.Tensor], grad_accum: int, budget: int) -> list[MicroBatch]:
    """This rank's micro-batches: each part's rows in ``grad_accum`` even pieces, or packed by ``budget``
    tokens when it is set. ``lengths_per_part``: each part's sequence lengths (N,). Row indices live on the
    CPU (they index tensors on any device; the default device may be another)."""
    out = []
    for i, lengths in enumerate(lengths_per_part):
        N = lengths.shape[0]
        if budget:
            groups = [torch.tensor(g, device="cpu") for g in pack_by_tokens([int(n) for n in lengths], budget)]
        else:
            groups = list(torch.arange(N, device="cpu").split(N // grad_accum))
        out += [MicroBatch(i, g) for g in groups]
    return out


def over_budget(lengths_per_part: list[torch.Tensor], budget: int) -> str | None:
    """What a run says (once) when a sequence is longer than the token ``budget``; None when none is."""
    longest = max(int(n.max()) for n in lengths_per_part)
    if not budget or longest <= budget:
        return None
    return (
        f"a sequence of {longest} tokens is longer than --micro-batch-tokens {budget}: each such sequence "
        "goes alone in its micro-batch (said once)"
    )


def pad_to(micro: list[MicroBatch], count: int) -> list[MicroBatch]:
    """``micro`` and padding micro-batches up to ``count`` (the most any rank runs): one row, one
    response position each."""
    return micro + [MicroBatch(micro[0].part, micro[0].rows[:1], counted=False, width=1)] * (count - len(micro))


def in_row_order(pieces: list[torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor:
    """The micro-batches' per-row tensors of one part, concatenated, in the part's row order."""
    order = torch.cat(rows)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return torch.cat(pieces)[inverse.to(pieces[0].device)]

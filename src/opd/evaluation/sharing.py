"""An evaluation shared by several processes: each evaluates its own items and the outcomes meet.

Under torchrun every rank evaluates a share of the held-out prompts (or games) instead of rank 0
evaluating them all while the others wait: item ``i`` goes to rank ``i % world``. Every item's
outcome depends on the item alone (its seeds are the item's index and sample number, and opd's own
sampler draws a prompt's tokens from its own seeded stream whatever batch it lands in), so the
outcomes gathered back in item order are one process's, and so are the figures made from them.

Plain Python: the caller brings the collective (``gather``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Share:
    """This process's part of an evaluation: rank ``rank`` of ``world``. ``gather(obj)`` returns every
    rank's ``obj`` in rank order, on every rank (a collective: every rank calls it at the same point)."""

    rank: int = 0
    world: int = 1
    gather: Callable[[Any], list] | None = None

    def __post_init__(self) -> None:
        if self.world > 1 and self.gather is None:
            raise ValueError("a Share of several ranks needs their gather")

    def items(self, n: int) -> list[int]:
        """The items of ``n`` this rank evaluates."""
        return list(range(self.rank, n, self.world))

    def merged(self, n: int, mine: list) -> list:
        """Every item's outcome, in item order, from each rank's outcomes of its own items (``mine``, in
        the order :meth:`items` gave them)."""
        parts = self.gather(mine) if self.gather is not None and self.world > 1 else [mine]
        out: list = [None] * n
        for rank, part in enumerate(parts):
            for i, outcome in zip(range(rank, n, self.world), part, strict=True):
                out[i] = outcome
        return out


ALONE = Share()  # one process evaluates everything
